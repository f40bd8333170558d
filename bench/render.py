"""Render ``docs/benchmarks.md`` (and its plot) from the committed results in ``bench/results/*.json``.

Every benchmark prints one JSON object and, with ``--json-out PATH``, writes exactly that text to PATH. A committed
result is such a file, named after its script: ``bench/results/<script>.json`` or ``<script>-<variant>.json`` (e.g.
``activations-tp2.json`` from ``bench/activations.py --tp 2``). Its ``host`` entry (``_common.host_info``) records the
command, the CPU and its kernels, torch and a note. Nothing here measures, and nothing is typed in by hand: the page
is a pure function of those files, so ``tests/unit/test_docs.py`` renders them again and compares.

    python bench/render.py            # rewrite docs/benchmarks.md and docs/benchmarks-ratios.png
    python bench/render.py --check    # exit 1 if docs/benchmarks.md is not what the results render to

To add a result: run the bench with ``--json-out bench/results/<script>[-<variant>].json`` (set ``V17_BENCH_NOTE``
to say what else ran on the host), then run this script and commit all three.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PAGE = ROOT / "docs" / "benchmarks.md"
PLOT = ROOT / "docs" / "benchmarks-ratios.png"
#: scripts in bench/ that are not benchmarks
NOT_BENCHES = {"_common", "render"}

Report = dict[str, Any]
#: (label, value) bars of one plot panel; each value is a ratio against the panel's anchor (1 = equal)
Bars = list[tuple[str, float]]


# ----------------------------------------------------------------------------------------------------- formatting


def _num(x: Any) -> str:
    """A number as the page prints it: integers with thousands separators; floats to 3 decimals below 100 (ratios,
    seconds, shares), 1 below 1000, none above (rates)."""
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return f"{x:,}"
    if isinstance(x, float):
        if math.isnan(x):
            return "-"
        return f"{x:,.{3 if abs(x) < 100 else 1 if abs(x) < 1000 else 0}f}"
    return str(x)


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(c if isinstance(c, str) else _num(c) for c in row) + " |" for row in rows]
    return out


def _host(report: Report) -> list[str]:
    h = report.get("host") or {}
    parts = [p for p in (h.get("cpu_model"), h.get("cpu_capability") and f"cpu capability {h['cpu_capability']}",
                         h.get("cpus") and f"{h['cpus']} CPUs", h.get("torch") and f"torch {h['torch']}") if p]  # fmt: skip
    lines = []
    if h.get("command"):
        lines.append(f"- command: `{h['command']}`")
    if parts:
        lines.append("- host: " + ", ".join(str(p) for p in parts) + (f"; {h['note']}." if h.get("note") else "."))
    return lines


# ------------------------------------------------------------------------------------------------ per benchmark


def _throughput(report: Report) -> tuple[list[str], list[tuple[str, Bars, Bars]]]:
    """``bench/zero.py`` and ``bench/fp8.py``: configurations side by side, ratios of ours to the anchors."""
    rows = []
    for name, r in report.get("results", {}).items():
        rss = r.get("peak_rss_mb") or []
        rows.append([f"`{name}`", r.get("tokens_per_s"), r.get("tokens_per_cpu_s"),
                     " / ".join(f"{x:,.0f}" for x in rss) or "-", r.get("exposed_comm_share")])  # fmt: skip
    lines = _table(["configuration", "tokens/s", "tokens/CPU-s", "peak RSS MB per rank", "exposed comm share"], rows)
    wall, cpu = report.get("ratios", {}), report.get("ratios_per_cpu_s", {})
    if wall or cpu:
        lines += ["", *_table(["ratio (ours / anchor)", "tokens/s", "tokens/CPU-s"],
                              [[f"`{k}`", wall.get(k), cpu.get(k)] for k in dict.fromkeys([*wall, *cpu])])]  # fmt: skip
    lines += ["", ("tokens/CPU-s divides the tokens by both ranks' process CPU time: when other jobs share the cores "
                   "it measures the work of each code path, while tokens/s also measures when each run was scheduled.")]
    return lines, [("tokens/s, ours / anchor", list(wall.items()), list(cpu.items()))]


def _collectives(report: Report) -> tuple[list[str], list[tuple[str, Bars, Bars]]]:
    rows, bars = [], []
    for numel, r in report.get("results_by_input_numel", {}).items():
        ms = r.get("ms", {})
        for op in ("reduce_scatter", "all_gather"):
            ratio = r.get(f"{op}_native/v17")
            rows.append([_num(int(numel)), f"`{op}`", ms.get(f"{op}_native"), ms.get(f"{op}_v17"), ratio])
            if ratio is not None:
                bars.append((f"{op} {int(numel):,}", ratio))
    lines = _table(["elements per rank", "collective", "native ms", "ours ms", "native / ours"], rows)
    return lines, [("time, native / ours (gloo)", bars, [])]


def _checkpoint(report: Report) -> tuple[list[str], list[tuple[str, Bars, Bars]]]:
    ours = report.get("async_blocking_s")
    anchors = {**{f"raw DCP `async_save`, {k.removeprefix('raw_dcp_').replace('_', ' ')}": v
                  for k, v in report.get("raw_dcp_async_save_blocking_s", {}).items()},
               "a plain copy of the same local bytes": report.get("plain_copy_s"),
               "a synchronous sharded save": report.get("sync_save_s")}  # fmt: skip
    rows = [["`AsyncCheckpoint`'s saver (`AsyncShardedSaver.start`)", ours, "-"]]
    rows += [[k, v, ours / v if ours and v else None] for k, v in anchors.items()]
    lines = [(f"{_num(report.get('state_bytes_total'))} bytes of state on {report.get('world_size')} ranks; median "
              f"of {report.get('repeats')} saves, the slowest rank's blocking time."), ""]
    lines += _table(["what blocks the loop", "seconds", "ours / it"], rows)
    if "meets_targets" in report:
        lines += ["", f"Targets: {report.get('targets')}. Met in this run: {_num(report['meets_targets'])}."]
    bars = [(k.replace("`", ""), v / ours) for k, v in anchors.items() if ours and v]
    return lines, [("blocking time, anchor / ours", bars, [])]


def _packing(report: Report) -> tuple[list[str], list[tuple[str, Bars, Bars]]]:
    arms = [a for a in ("packed", "padded", "length_grouped") if a in report]
    rows = [[f"`{a}`", report[a].get("real_tokens"), report[a].get("real_tokens_per_s"),
             report[a].get("padding_fraction"), report[a].get("attention_flops_fwd")] for a in arms]  # fmt: skip
    lines = [(f"The same {_num(report.get('packed', {}).get('real_tokens'))} real tokens per arm, seq_len "
              f"{report.get('seq_len')}, batch {report.get('batch_size')}."), ""]
    lines += _table(["arm", "real tokens", "real tokens/s", "padding fraction", "attention FLOPs (forward)"], rows)
    bars = [(f"packed / {b}", report[f"packed_over_{b}"]) for b in ("padded", "length_grouped")
            if f"packed_over_{b}" in report]  # fmt: skip
    if bars:
        lines += ["", "Real tokens/s: " + ", ".join(f"{k} **{_num(v)}**" for k, v in bars) + "."]
    return lines, [("real tokens/s, packed / anchor", bars, [])]


def _activations(report: Report) -> tuple[list[str], list[tuple[str, Bars, Bars]]]:
    rows, bars = [], []
    for r in report.get("rows", []):
        label = f"{r['recompute']} {r['dtype']}" + (f" tp{r['tp']}" + (" sp" if r.get("sp") else "") if r.get("tp", 1) > 1 else "")
        rows.append([r.get("tp"), "on" if r.get("sp") else "off", r["recompute"], r["dtype"], r.get("measured_bytes"),
                     r.get("planned_bytes"), r.get("measured_over_planned"), r.get("korthikanti_bytes"),
                     r.get("measured_over_korthikanti")])  # fmt: skip
        bars.append((label, r["measured_over_planned"]))
    shape = report.get("shape", {})
    lines = ["Saved-activation bytes per block of the reference Llama ("
             + ", ".join(f"{k}={v}" for k, v in shape.items()) + ").", ""]
    lines += _table(["tp", "SP", "recompute", "dtype", "measured", "planner", "measured / planner",
                     "Korthikanti Table 2", "measured / Table 2"], rows)  # fmt: skip
    return lines, [("bytes per block, measured / planner", bars, [])]


def _pipeline(report: Report) -> tuple[list[str], list[tuple[str, Bars, Bars]]]:
    res = report.get("results", {})
    rows, bars = [], []
    for r in report.get("bubble_table", []):
        key = f"{r['schedule']}/m{r['m']}"
        rows.append([f"`{r['schedule']}`", r["m"], r["measured"], r["simulated"], r["replayed"],
                     r["planner_equal_times"], res.get(key, {}).get("tokens_per_s"), r["ok"]])  # fmt: skip
        if r["measured"]:
            bars.append((key, r["simulated"] / r["measured"]))
    lines = [("pp=2; bubble = idle / busy per rank (Narayanan 2021); `simulated` is the planner fed with this run's "
              "op times, their jitter and the measured P2P time; `T equal` is the planner's default."), ""]
    lines += _table(["schedule", "m", "measured bubble", "simulated", "replayed", "T equal", "tokens/s",
                     "within max(15%, 0.01)"], rows)  # fmt: skip
    return lines, [("bubble, planner's simulation / measured", bars, [])]


def _moe(report: Report) -> tuple[list[str], list[tuple[str, Bars, Bars]]]:
    g, ep, disp = report.get("grouped", {}), report.get("ep", {}), report.get("dispatch", {})
    ms = g.get("ms_fwd_bwd", {})
    lines = [(f"{g.get('experts')} experts, top-{g.get('top_k')}, {_num(g.get('tokens'))} tokens, hidden "
              f"{g.get('hidden')}, expert width {g.get('expert_ffn')}, forward + backward."), ""]
    lines += _table(["experts", "ms", "loop / grouped"],
                    [["Hugging Face's eager per-expert loop (`MixtralExperts`)", ms.get("hf_eager_loop"), "-"],
                     ["grouped GEMM (`GroupedExperts`)", ms.get("grouped"), g.get("loop/grouped")]])  # fmt: skip
    runs = [("ep=1", ep.get("ep1", {})), ("ep=2, all-to-all", ep.get("ep2", {})),
            ("ep=2, all-gather", disp.get("allgather", {}))]  # fmt: skip
    planned = ep.get("planned_expert_bytes_per_rank", {})
    lines += ["", (f"The MoE Llama on {report.get('world_size')} gloo ranks, ZeRO-0, AdamW, the same global batch; "
                   "expert bytes are parameters, gradients and optimizer state counted from tensor storage (at ep=1 "
                   "the experts' gradients are views of reduction buckets shared with dense gradients, which the "
                   "storage count sees whole)."), ""]
    lines += _table(["run", "tokens/s", "peak RSS MB (rank 0)", "expert bytes per rank", "planner"],
                    [[k, r.get("tokens_per_s"), (r.get("peak_rss_mb") or [None])[0],
                      (r.get("expert_bytes_per_rank") or [None])[0], planned.get(p)]
                     for (k, r), p in zip(runs, ("ep1", "ep2", "ep2"))])  # fmt: skip
    hf = report.get("hf", {})
    if hf.get("ran"):
        lines += ["", ("Hugging Face's own expert-parallel training (`DistributedConfig(fsdp_size=2, ep_size=2)`) "
                       "against ours (the same Mixtral adapted, ep=2, ZeRO-3), same weights and batches:"), ""]
        lines += _table(["run", "tokens/s", "peak RSS MB (rank 0)"],
                        [[k, hf[k]["tokens_per_s"], hf[k]["peak_rss_mb"][0]] for k in ("hf", "v17")])
        lines += ["", f"Largest per-step loss difference: {hf.get('max_loss_diff', 0):.1e}."]
    else:
        lines += ["", f"Hugging Face's own expert parallelism did not run: {hf.get('reason')}."]
    bars = [("grouped / HF eager loop (speed)", g.get("loop/grouped")),
            ("ep2 / ep1 tokens/s", ep.get("ep2/ep1_tokens_per_s")),
            ("all-to-all / all-gather tokens/s", disp.get("alltoall/allgather_tokens_per_s")),
            ("ours / HF EP training tokens/s", report.get("hf", {}).get("v17/hf_tokens_per_s"))]
    return lines, [("MoE, ours / anchor", [(k, v) for k, v in bars if isinstance(v, (int, float))], [])]


def _cp(report: Report) -> tuple[list[str], list[tuple[str, Bars, Bars]]]:
    """``bench/cp.py``: cp=2 in both schemes against dp=2 on half the sequence, and the chunk assignments."""
    res, shape = report.get("results", {}), report.get("shape", {})
    lines = [(f"One row of {_num(shape.get('seq'))} tokens per step over {report.get('world_size')} gloo ranks "
              f"(dp2_half: each rank its own row of half as many), the reference Llama "
              + ", ".join(f"{k}={v}" for k, v in shape.items() if k != "seq") + f", {report.get('dtype')}."), ""]
    lines += _table(["arm", "tokens/s", "tokens per CPU-s", "peak saved-activation bytes per rank",
                     "planner (blocks only)"],
                    [[f"`{a}`", r.get("tokens_per_s"), r.get("tokens_per_cpu_s"), max(r.get("peak_saved_activation_bytes_per_rank") or [0]),
                      r.get("planned_block_bytes_per_rank")] for a, r in res.items()])  # fmt: skip
    bal = report.get("balance", {})
    work = bal.get("max_over_mean_attention_work", {})
    lines += ["", (f"Max/mean causal attention work per rank on {bal.get('batches')} batches of "
                   f"{bal.get('rows_per_batch')} packed corpus rows of {_num(bal.get('seq'))} tokens (mean / worst):"),
              ""]  # fmt: skip
    lines += _table(["cp", "none", "head_tail", "packed"],
                    [[k.removeprefix("cp"), *(f"{_num(v[n]['mean'])} / {_num(v[n]['worst'])}"
                                              for n in ("none", "head_tail", "packed"))] for k, v in work.items()])
    ratios = {k: v for k, v in report.get("ratios", {}).items() if isinstance(v, (int, float))}
    lines += ["", "Ratios: " + ", ".join(f"{k} **{_num(v)}**" for k, v in ratios.items()) + "."]
    return lines, [("context parallelism, ratios", list(ratios.items()), [])]


def _deepspeed_ckpt(report: Report) -> tuple[list[str], list[tuple[str, Bars, Bars]]]:
    """``bench/deepspeed_ckpt.py``: V17's online DeepSpeed import against the universal-checkpoint route."""
    res, model = report.get("results", {}), report.get("model", {})
    lines = [(f"Raw DeepSpeed saves on {report.get('world_size')} gloo ranks, the reference Llama "
              + ", ".join(f"{k}={v}" for k, v in model.items())
              + "; seconds (ranks: the slowest rank's; in-process: the median of the repeats)."), ""]  # fmt: skip
    what = {"num_params": "parameters", "state_bytes": "fp32 master + Adam moments, bytes",
            "read_s": "ours: `read_deepspeed_checkpoint`",
            "v17_restore_s": "ours: restore in `trainer.fit(ckpt_path=save_dir)` (2 ranks)",
            "ds_to_universal_s": "`ds_to_universal` in process", "ds_to_universal_cli_s": "`ds_to_universal` CLI",
            "universal_load_s": "DeepSpeed engine loads the universal checkpoint (2 ranks)",
            "universal_route_s": "universal route (in-process conversion + load)"}  # fmt: skip
    rows = [[label, *(r.get(key) for r in res.values())] for key, label in what.items()]
    lines += _table(["", *(f"`{n}`" for n in res)], rows)
    ratios = {k: v for k, v in report.get("ratios", {}).items() if isinstance(v, (int, float))}
    lines += ["", *_table(["ratio (ours / DeepSpeed's)", "value"], [[f"`{k}`", v] for k, v in ratios.items()])]
    if "meets_targets" in report:
        lines += ["", f"Target: {report.get('targets')}. Met in this run: {_num(report['meets_targets'])}."]
    bars = [(k, 1 / v) for k, v in ratios.items() if v]
    return lines, [("time, DeepSpeed's / ours", bars, [])]


def _planner(report: Report) -> tuple[list[str], list[tuple[str, Bars, Bars]]]:
    """``bench/planner.py``: the planner's top candidates for the main job, predicted against measured."""
    assumed, rows = report.get("planner_assumes", {}), report.get("candidates", {})
    lines = [(f"`{report.get('job')}`: the {assumed.get('model')} model ({_num(assumed.get('params'))} parameters), "
              f"{assumed.get('precision')}, seq {assumed.get('seq')}, on {assumed.get('ranks')} gloo ranks of a "
              f"{assumed.get('cores')}-core host. The planner's `--gpu {assumed.get('gpu')}` row assumes "
              f"{_num(assumed.get('peak_flops_per_rank', 0) / 1e9)} GFLOP/s per rank at MFU {assumed.get('mfu')} "
              f"and {_num(assumed.get('intra_node_bytes_per_s', 0) / 1e9)} GB/s between ranks. Median of "
              f"{report.get('rounds')} rounds of {report.get('steps')} timed steps each."), ""]  # fmt: skip
    table = []
    for name, r in rows.items():
        m = r.get("measured", {})
        growth = max(m.get("rss_growth_mb") or [0])
        table.append([f"`{name}`", f"{r.get('global_batch')} = b {r.get('micro_batch')} x m {r.get('microbatches')}",
                      r.get("predicted_step_s"), m.get("step_s"), r.get("measured_over_predicted_step"),
                      r.get("predicted_per_sample_s", 0) * 1e3, (r.get("measured_per_sample_s") or math.nan) * 1e3,
                      r.get("predicted_device_mb_per_rank"), growth])  # fmt: skip
    lines += _table(["layout (predicted order)", "global batch", "predicted s/step", "measured s/step",
                     "measured / predicted", "predicted ms/sample", "measured ms/sample",
                     "predicted MB/rank", "measured RSS growth MB/rank (max)"], table)  # fmt: skip
    order = ", ".join(f"`{n}`" for n in report.get("measured_order", []))
    lines += ["", (f"Predicted ranking equals the measured one: **{_num(report.get('ranking_agrees'))}** "
                   f"(measured order: {order}).")]  # fmt: skip
    lines += ["", *(f"- {note}" for note in report.get("notes", []))]
    return lines, []


def _fault(report: Report) -> tuple[list[str], list[tuple[str, Bars, Bars]]]:
    """``bench/fault.py --scenario side-by-side``: the kill-to-next-step time of each recovery path, and the ratios."""
    paths = (("job restart (torchrun, from the checkpoint)", "restart", "kill_to_first_step_s"),
             ("replica drop (torchft, the other group goes on)", "replica_drop", "kill_to_next_step_s"),
             ("in-process restart (the only replica, from memory)", "in_process", "kill_to_next_step_s"))  # fmt: skip
    rows = [[name, (report[key].get("median") or {}).get(field, "-"), f"{report[key]['ok']}/{report[key]['tries']}"]
            for name, key, field in paths if key in report]  # fmt: skip
    lines, panels = _generic(report)
    return _table(["path", "kill to next step, median (s)", "tries ok"], rows) + ["", *lines], panels


def _generic(report: Report) -> tuple[list[str], list[tuple[str, Bars, Bars]]]:
    ratios = {k: v for k, v in report.get("ratios", {}).items() if isinstance(v, (int, float))}
    lines = _table(["ratio", "value"], [[f"`{k}`", v] for k, v in ratios.items()]) if ratios else []
    return lines, [("ratio", list(ratios.items()), [])] if ratios else []


RENDERERS: dict[str, tuple[str, Callable[[Report], tuple[list[str], list[tuple[str, Bars, Bars]]]]]] = {
    "zero": ("ZeRO: V17 stages against the anchors run in the same invocation", _throughput),
    "collectives": ("gloo collectives: ours (all-to-all forms) against the native ones", _collectives),
    "pipeline": ("Pipeline schedules: measured bubble against the planner", _pipeline),
    "fp8": ("FP8 recipes against bf16 and fp32 (CPU: no float8 units)", _throughput),
    "checkpoint": ("Checkpoint blocking: asynchronous staging against raw DCP and a plain copy", _checkpoint),
    "packing": ("Packed against padded batches, the same documents", _packing),
    "activations": ("Saved activations against the planner", _activations),
    "moe": ("Mixture of experts: grouped experts, expert parallelism and the two dispatchers", _moe),
    "cp": ("Context parallelism: Ulysses and all-gathered K/V against dp on half the sequence", _cp),
    "deepspeed_ckpt": ("DeepSpeed checkpoint import: online load against the universal-checkpoint route",
                       _deepspeed_ckpt),
    "planner": ("The planner's top candidates for the main job: predicted against measured", _planner),
    "fault": ("Recovery from a killed rank: job restart, replica drop and in-process restart", _fault),
}


# ------------------------------------------------------------------------------------------------------ the page


def load_results(results_dir: Path = RESULTS) -> dict[str, Report]:
    """``{file stem: report}`` of every committed result, in the page's order: the benches of :data:`RENDERERS` in
    theirs (others after them, by name), a bench's own file before its variants."""
    order = list(RENDERERS)

    def key(p: Path) -> tuple:
        name = bench_of(p.stem)
        return (order.index(name) if name in order else len(order), name, "-" in p.stem, p.stem)

    return {p.stem: json.loads(p.read_text()) for p in sorted(Path(results_dir).glob("*.json"), key=key)}


def bench_of(stem: str) -> str:
    """The script a result file belongs to: ``activations-tp2`` -> ``activations``."""
    return stem.split("-", 1)[0]


def benches(bench_dir: Path = ROOT / "bench") -> list[str]:
    """The benchmark scripts in ``bench/``."""
    return sorted(p.stem for p in Path(bench_dir).glob("*.py") if p.stem not in NOT_BENCHES)


def render(results: dict[str, Report], *, all_benches: list[str], plot_name: str = PLOT.name) -> tuple[str, list]:
    """The page's Markdown and the plot's panels ``[(title, label, wall bars, per-CPU-second bars)]``."""
    lines = [
        "# Benchmarks",
        "",
        "<!-- Generated by bench/render.py from bench/results/*.json; do not edit by hand. -->",
        "",
        ("Each benchmark runs ours and its anchor in the same invocation, on the same model and data (`bench/`). "
         "The results below are the committed JSON files in `bench/results/`, each with the command that produced it "
         "and the host it ran on. Absolute times on a shared CPU host are noisy; the ratios come from configurations "
         "run side by side. Regenerate this page with `python bench/render.py`."),
        "",
        f"![ratios against the anchors, per benchmark]({plot_name})",
        "",
    ]
    panels = []
    for stem, report in results.items():
        name = bench_of(stem)
        title, fn = RENDERERS.get(name, (f"`bench/{name}.py`", _generic))
        body, bench_panels = fn(report)
        lines += [f"## {title}" + (f" ({stem.split('-', 1)[1]})" if "-" in stem else ""), "",
                  f"`bench/{name}.py`, `bench/results/{stem}.json`.", "", *_host(report), "", *body, ""]  # fmt: skip
        panels += [(f"{stem}", label, wall, cpu) for label, wall, cpu in bench_panels if wall or cpu]
    missing = [b for b in all_benches if not any(bench_of(s) == b for s in results)]
    if missing:
        lines += ["## Benchmarks without a committed result", "",
                  "These run longer than a shared CPU host allows, need hardware it lacks, or have not been committed "
                  "yet: " + ", ".join(f"`bench/{b}.py`" for b in missing) + ". `bash bench/gpu_check.sh` holds the "
                  "GPU checks.", ""]  # fmt: skip
    return "\n".join(lines).rstrip() + "\n", panels


def draw(panels: list, path: Path) -> None:
    """One horizontal bar chart per benchmark panel, a line at 1 (equal to the anchor)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heights = [max(1.6, 0.32 * max(len(w), len(c)) + 1.0) for _, _, w, c in panels] or [1.6]
    fig, axes = plt.subplots(len(heights), 1, figsize=(8, sum(heights)), gridspec_kw={"height_ratios": heights},
                             squeeze=False)  # fmt: skip
    for ax, (stem, label, wall, cpu) in zip(axes[:, 0], panels):
        names = list(dict.fromkeys([n for n, _ in wall] + [n for n, _ in cpu]))
        w, c = dict(wall), dict(cpu)
        ys = range(len(names))
        if cpu:
            ax.barh([y - 0.2 for y in ys], [w.get(n, 0) for n in names], height=0.4, label="wall clock")
            ax.barh([y + 0.2 for y in ys], [c.get(n, 0) for n in names], height=0.4, label="per CPU-second")
            ax.legend(loc="lower right", fontsize=7)
        else:
            ax.barh(list(ys), [w[n] for n in names], height=0.6)
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.set_yticks(list(ys), names, fontsize=7)
        ax.invert_yaxis()
        ax.set_title(f"{stem}: {label}", fontsize=9, loc="left")
        ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare with the committed page instead of writing it")
    args = ap.parse_args(argv)
    text, panels = render(load_results(), all_benches=benches())
    if args.check:
        same = PAGE.exists() and PAGE.read_text() == text
        print("docs/benchmarks.md is up to date" if same else "docs/benchmarks.md differs: run python bench/render.py")
        return 0 if same else 1
    PAGE.write_text(text)
    draw(panels, PLOT)
    print(f"wrote {PAGE.relative_to(ROOT)} and {PLOT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
