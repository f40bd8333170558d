"""``v17 plan --plot PATH``: the plan as a PNG, per-rank memory by bucket and tier, and traffic per collective.

Torch-free, and matplotlib-free until called: matplotlib is the optional ``plot`` extra
(``pip install 'lightning-v17[plot]'``), imported inside :func:`write_plot` with the Agg backend (no display needed).
The ASCII report stays the default output; the picture shows the same numbers as ``--json``:

* left: a stacked bar per tier (gpu, cpu, nvme) of the per-rank buckets (params, grads, optimizer, activations,
  buffers), GB = 1e9 bytes, with the device's memory as a dashed line. Each bucket's tier is what
  :func:`lightning_v17.planner.offload.tier_bytes` (ZeRO-Offload §4.1, ZeRO-Infinity §5) gives, the same split the
  plan's ``tiers`` report.
* right: bytes each rank sends per optimizer step, one bar per collective of the plan's ``comm`` section, with the
  plan's total communication time if nothing overlapped.
"""

from __future__ import annotations

from pathlib import Path

from lightning_v17.planner import offload as off
from lightning_v17.planner.plan import Plan

#: Bucket name -> colour (Okabe-Ito, readable for colour-blind readers).
BUCKET_COLOURS: dict[str, str] = {
    "params": "#0072B2",
    "grads": "#56B4E9",
    "optimizer": "#009E73",
    "activations": "#E69F00",
    "buffers": "#CC79A7",
}
TIERS = ("gpu", "cpu", "nvme")
MISSING_MATPLOTLIB = "--plot needs matplotlib: pip install 'lightning-v17[plot]'"
GB = 1e9


class PlotDependencyError(ImportError):
    """matplotlib is not installed; the message says how to get it."""


def bucket_tier_bytes(plan: Plan) -> dict[str, dict[str, int]]:
    """Per-rank bytes of each bucket on each tier: {"params": {"gpu": ..., "cpu": ..., "nvme": ...}, ...}.

    Every bucket but the parameters is placed by :func:`~lightning_v17.planner.offload.tier_bytes` with the layout's
    offload policy; the parameters take what is left of the plan's own tier totals (they move only where the plan
    allowed it, e.g. ZeRO-3), so the columns add up to ``plan.memory.tiers`` exactly.
    """
    m, lay = plan.memory, plan.layout
    buckets = {"grads": {"grad_bytes": m.grad}, "optimizer": {"optimizer_bytes": m.optimizer},
               "activations": {"activation_bytes": m.activation}, "buffers": {"temp_bytes": m.temp}}
    zero = {"param_bytes": 0, "grad_bytes": 0, "optimizer_bytes": 0, "activation_bytes": 0, "temp_bytes": 0}
    out: dict[str, dict[str, int]] = {}
    for name, given in buckets.items():
        t = off.tier_bytes(**{**zero, **given}, offload_optimizer=lay.offload_optimizer)
        out[name] = {"gpu": t.gpu, "cpu": t.cpu, "nvme": t.nvme}
    totals = {"gpu": m.tiers.gpu, "cpu": m.tiers.cpu, "nvme": m.tiers.nvme}
    out = {"params": {tier: totals[tier] - sum(b[tier] for b in out.values()) for tier in TIERS}, **out}
    return out


def _matplotlib():
    try:
        import matplotlib
    except ImportError as exc:
        raise PlotDependencyError(MISSING_MATPLOTLIB) from exc
    matplotlib.use("Agg", force=True)  # files only; works without a display
    import matplotlib.pyplot as plt

    return plt


def write_plot(plan: Plan, path: str | Path, *, dpi: int = 110) -> Path:
    """Render ``plan`` to a PNG at ``path`` (parent folders created) and return the path.

    Raises:
        PlotDependencyError: matplotlib is missing (an ImportError naming the extra to install).
    """
    plt = _matplotlib()
    from lightning_v17.planner.report import fmt_bytes, fmt_seconds

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lay, acc = plan.layout, plan.cluster.accelerator
    placed = bucket_tier_bytes(plan)
    fig, (ax_mem, ax_comm) = plt.subplots(1, 2, figsize=(13, 5.2), gridspec_kw={"width_ratios": [1, 1.35]})

    bottoms = [0.0] * len(TIERS)
    for name, per_tier in placed.items():
        heights = [per_tier[t] / GB for t in TIERS]
        ax_mem.bar(TIERS, heights, bottom=bottoms, color=BUCKET_COLOURS[name], label=name, edgecolor="white")
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    for x, total in enumerate(bottoms):
        ax_mem.annotate(fmt_bytes(total * GB), (x, total), ha="center", va="bottom", fontsize=9,
                        xytext=(0, 2), textcoords="offset points")
    ax_mem.axhline(acc.memory_bytes / GB, color="#D55E00", linestyle="--", linewidth=1.2)
    ax_mem.annotate(f"{acc.name}: {fmt_bytes(acc.memory_bytes)} per device", (-0.45, acc.memory_bytes / GB),
                    ha="left", va="bottom", fontsize=8, color="#D55E00")
    usable = plan.cluster.usable_memory_bytes
    if usable != acc.memory_bytes:
        ax_mem.axhline(usable / GB, color="#D55E00", linestyle=":", linewidth=1.0)
        ax_mem.annotate(f"usable: {fmt_bytes(usable)} ({plan.cluster.memory_reserve:.0%} reserved)",
                        (-0.45, usable / GB), ha="left", va="top", fontsize=8, color="#D55E00")
    ax_mem.set_ylim(0, max(max(bottoms), acc.memory_bytes / GB) * 1.4)  # headroom for the legend
    ax_mem.set_ylabel("GB per rank (1e9 bytes)")
    fits = "fits" if plan.fits else "does NOT fit"
    ax_mem.set_title(f"memory per rank by tier ({fits})", fontsize=11)
    ax_mem.legend(loc="upper center", ncol=3, fontsize=8, frameon=False)

    collectives = list(plan.collectives)
    if collectives:
        names = [f"{c.name} [{c.axis}]" for c in collectives]
        values = [c.bytes_per_step / GB for c in collectives]
        colours = {"dp": "#0072B2", "tp": "#E69F00", "pp": "#009E73", "cp": "#CC79A7"}
        ax_comm.barh(names, values, color=[colours.get(c.axis, "#999999") for c in collectives])
        for y, c in enumerate(collectives):
            ax_comm.annotate(fmt_bytes(c.bytes_per_step), (c.bytes_per_step / GB, y), va="center", fontsize=8,
                             xytext=(3, 0), textcoords="offset points")
        ax_comm.invert_yaxis()
        positive = [v for v in values if v > 0]
        if positive and max(positive) / min(positive) > 50:  # TP traffic can dwarf DP's by 100x: log axis
            ax_comm.set_xscale("log")
            ax_comm.set_xlim(min(positive) / 2, max(positive) * 8)
        else:
            ax_comm.set_xlim(0, max(values) * 1.25 if positive else 1)
        ax_comm.tick_params(axis="y", labelsize=8)
    else:
        ax_comm.text(0.5, 0.5, "no collectives (one rank)", ha="center", va="center", transform=ax_comm.transAxes)
        ax_comm.set_yticks([])
    ax_comm.set_xlabel("GB sent per rank per optimizer step" + (" (log scale)" if ax_comm.get_xscale() == "log"
                                                                 else ""))
    ax_comm.set_title(f"communication: {fmt_bytes(plan.comm_bytes_per_step)} per step, "
                      f"~{fmt_seconds(plan.comm_time_s)} if not overlapped", fontsize=11)

    model = plan.model.name if plan.model.shape is None else f"{plan.model.name} ({plan.model.shape.arch.value})"
    fig.suptitle(f"v17 plan: {model} on {lay.gpus} x {acc.name} | tp={lay.tp} pp={lay.pp} dp={lay.dp} cp={lay.cp} "
                 f"zero={lay.zero.stage} recompute={lay.recompute.value} {lay.precision.value}", fontsize=12)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi, format="png")
    plt.close(fig)
    return path


__all__ = ["BUCKET_COLOURS", "MISSING_MATPLOTLIB", "PlotDependencyError", "bucket_tier_bytes", "write_plot"]
