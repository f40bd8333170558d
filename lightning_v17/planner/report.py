"""Render a :class:`~lightning_v17.planner.plan.Plan`: the human report (design §1.5 ASCII bars) and the JSON object.

Torch-free. Bytes are per rank; GB = 1e9 bytes (ZeRO's unit). JSON bytes are integers. A MoE plan adds its ``ep``,
the experts' share of the model state and a ``moe`` section; a dense plan renders as it always has.
"""

from __future__ import annotations

import os
from typing import Any

from lightning_v17.config import OptimizerKind, Precision, Tier
from lightning_v17.config.schedules import schedule_info
from lightning_v17.planner import capacity as cap
from lightning_v17.planner import memory as mem
from lightning_v17.planner.capacity import TierCheck, capacity_checks
from lightning_v17.planner.model_search import MaxModel
from lightning_v17.planner.plan import Plan
from lightning_v17.planner.resilience import recovery_goodput

BAR_WIDTH = 32


def recovery_line(plan: Plan) -> str:
    """Expected goodput per recovery path (:func:`~lightning_v17.planner.resilience.recovery_goodput`), one line."""
    words = []
    for name, path in recovery_goodput(plan)["paths"].items():
        label = name.replace("_", " ")
        if "needs" in path:
            words.append(f"{label} needs {path['needs'].split(' with ')[0]}")
        else:
            words.append(f"{label} {path['goodput']:.2%} ({fmt_seconds(path['recovery_s'])} a failure)")
    return "goodput " + "; ".join(words)


def fmt_bytes(n: float) -> str:
    """1234567 -> '1.23 MB' (decimal units, as ZeRO and the vendors count)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}" if n / scale < 100 else f"{n / scale:.0f} {unit}"
    return f"{n:.0f} B"


def fmt_count(n: float) -> str:
    """6738415616 -> '6.74B'."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"


def fmt_rate(flops_per_s: float) -> str:
    """989.4e12 -> '989.4 TFLOP/s'; 105e9 -> '105 GFLOP/s'."""
    if flops_per_s >= 1e12:
        return f"{flops_per_s / 1e12:.4g} TFLOP/s"
    return f"{flops_per_s / 1e9:.4g} GFLOP/s"


def fmt_flops(n: float) -> str:
    """1.01e18 -> '1.01e18' (no '+')."""
    return f"{n:.3g}".replace("e+", "e")


def fmt_seconds(s: float) -> str:
    """Seconds as h / min / s / ms, whichever reads best."""
    if s >= 3600:
        return f"{s / 3600:.4g} h"
    if s >= 60:
        return f"{s / 60:.1f} min"
    if s >= 1:
        return f"{s:.2f} s"
    return f"{s * 1e3:.1f} ms"


def bar(value: float, largest: float, width: int = BAR_WIDTH) -> str:
    """A bar of full blocks scaled to ``largest``; a nonzero value shows at least a thin sliver."""
    if largest <= 0 or value <= 0:
        return ""
    n = round(width * value / largest)
    return "█" * n if n else "▏"


#: Short names of the dtypes :class:`~lightning_v17.config.Precision` answers with, for the bars' labels.
_SHORT_DTYPE = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


def _dtype(precision: Precision) -> str:
    return _SHORT_DTYPE[precision.compute_dtype]


def _state_dtype(name: str, plan: Plan) -> str:
    lay = plan.layout
    if name == "master":
        return "fp32"
    if lay.optimizer == OptimizerKind.ADAM8BIT:
        return "int8"
    if lay.optimizer == OptimizerKind.ADAFACTOR:
        return "fact"
    return "bf16" if lay.precision.state_bytes == 2 else "fp32"


def bucket_rows(plan: Plan) -> list[tuple[str, int, str]]:
    """(label, bytes, tier) for each bar, in the design outline's order (§1.5)."""
    m, lay = plan.memory, plan.layout
    dt = _dtype(lay.precision)
    grad_tier = Tier.CPU if lay.offload_optimizer != Tier.NONE else Tier.NONE
    rows = [(f"param  ({dt})", m.param, lay.params_tier.value), (f"grad   ({dt})", m.grad, grad_tier.value)]
    for name, nbytes in m.optimizer_parts:
        rows.append((f"{name:<6} ({_state_dtype(name, plan)})", nbytes, lay.offload_optimizer.value))
    rows.append(("activations", m.activation, "none"))
    rows.append(("temp buffers", m.temp, "none"))
    return rows


def _checks(plan: Plan) -> tuple[TierCheck, ...]:
    return plan.capacity or capacity_checks(plan.memory.tiers, plan.cluster, gpus=plan.layout.gpus)


def render_text(plan: Plan, max_model: MaxModel | None = None, *, max_model_asked: bool = False) -> str:
    """The human report: header, bars, comm/bubble/FLOPs lines, recommendation and warnings."""
    lay, acc, m = plan.layout, plan.cluster.accelerator, plan.memory
    shape = plan.model.shape
    out: list[str] = []
    if shape is not None:
        dims = (f"L={shape.layers} h={shape.hidden} a={shape.heads} kv={shape.kv_heads} ffn={shape.ffn} "
                f"V={shape.vocab}")
        active = f", {fmt_count(shape.active_params)} active" if shape.num_experts else ""
        out.append(f"v17 plan: {plan.model.name} ({shape.arch.value}, {fmt_count(plan.model.num_params)} params"
                   f"{active}; {dims})")
    else:
        out.append(f"v17 plan: {fmt_count(plan.model.num_params)} params (no shape: model state only)")
    gpn = plan.cluster.gpus_per_node or acc.gpus_per_node
    peak = acc.peak_flops_for(lay.precision)
    share = cap.core_share(plan.cluster, lay.gpus)
    shared = f" at {share:.2g} of a core per rank (the ranks share this machine's cores)" if share < 1 else ""
    out.append(f"cluster : {lay.gpus} x {acc.name} ({plan.nodes} node{'s' * (plan.nodes > 1)} x {gpn}), "
               f"{fmt_bytes(acc.memory_bytes)} and {fmt_rate(peak)} ({_dtype(lay.precision)}) per device{shared}")
    ep = f" ep={lay.ep}" if plan.moe is not None else ""
    cp_mode = f" ({lay.cp_mode.value})" if lay.cp_mode is not None else ""
    hsdp = f" (replicate {lay.dims.dp_replicate} x shard {lay.dims.dp_shard})" if lay.dims.dp_replicate > 1 else ""
    out.append(f"layout  : tp={lay.tp} pp={lay.pp} dp={lay.dp}{hsdp} cp={lay.cp}{cp_mode}{ep} sp={'on' if lay.sp else 'off'} "
               f"zero={lay.zero.stage} recompute={lay.recompute.value} | {lay.optimizer.value} {lay.precision.value}"
               f" | offload optimizer={lay.offload_optimizer.value} params={lay.offload_params.value}")
    out.append(f"batch   : micro-batch {lay.micro_batch} x seq {lay.seq}, m={lay.microbatches} micro-batches, "
               f"global batch {lay.global_batch} ({fmt_count(lay.global_batch * lay.seq)} tokens/step)")
    out.append("")
    rows = bucket_rows(plan)
    largest = max(b for _, b, _ in rows)
    out.append("per-rank memory (GB = 1e9 bytes), bars scaled to the largest bucket")
    for label, nbytes, tier in rows:
        where = "" if tier == "none" else f"  [{tier}]"
        shown = "n/a" if shape is None and label == "activations" else fmt_bytes(nbytes)
        out.append(f"{label:<14} {bar(nbytes, largest):<{BAR_WIDTH}}  {shown:>9}{where}")
    slice_params = plan.model.num_params / (lay.tp * lay.pp)
    before = (m.param + m.grad + m.optimizer) and (
        mem.param_bytes_per_param(lay.precision) + mem.grad_bytes_per_param(lay.precision)
        + mem.optimizer_bytes_per_param(lay.optimizer, lay.precision))
    out.append(f"{'':<14} └── model state {fmt_bytes(m.model_state)}: {before:.4g} B/param, "
               f"{m.model_state / slice_params:.3g} after ZeRO-{lay.zero.stage} over dp={lay.dp * lay.cp} "
               f"(Ψ/(tp·pp) = {fmt_count(slice_params)})")
    if plan.moe is not None:
        moe = plan.moe
        kept = (f"sharded by ZeRO over the efsdp={moe.efsdp} ranks that hold the same ones" if moe.ep > 1 else
                "sharded by ZeRO like the dense part") if moe.experts_sharded_over_efsdp else (
            f"whole on each of the efsdp={moe.efsdp} ranks that hold the same ones (V17Strategy keeps them outside ZeRO)")
        out.append(f"{'':<14} └── of it experts {fmt_bytes(m.experts.total)}: {moe.experts_per_rank} of "
                   f"{moe.num_experts} routed experts per MoE block on each rank (ep={moe.ep}), {kept}; dense part "
                   f"{fmt_bytes(m.model_state - m.experts.total)}")
    t = m.tiers
    verdict = "fits" if _checks(plan)[0].fits else "DOES NOT FIT"  # the device; the node's tiers: next line
    usable = plan.cluster.usable_memory_bytes
    out.append(f"{'total':<14} {fmt_bytes(m.total)}: gpu {fmt_bytes(t.gpu)} of {fmt_bytes(usable)} usable "
               f"({fmt_bytes(acc.memory_bytes)} less a {plan.cluster.memory_reserve:.0%} reserve) ({verdict}), "
               f"cpu {fmt_bytes(t.cpu)}, nvme {fmt_bytes(t.nvme)}")
    node = [c for c in _checks(plan) if c.tier != "device"]
    out.append(f"{'per node':<14} {node[0].ranks} rank{'s' * (node[0].ranks > 1)}: " + ", ".join(
        f"{c.tier} {fmt_bytes(c.need_bytes)} of {fmt_bytes(c.capacity_bytes)} ({c.source}) "
        f"({'fits' if c.fits else 'DOES NOT FIT'})" for c in node))
    out.append("")
    out.append(f"comm    : {fmt_bytes(plan.comm_bytes_per_step)} per step per rank, "
               f"~{fmt_seconds(plan.comm_time_s)} if not overlapped")
    for c in plan.collectives:
        out.append(f"          {c.name:<44} {fmt_bytes(c.bytes_per_step):>9}")
    if plan.cp is not None:
        both = ", ".join(f"{m} {fmt_bytes(b)}" for m, b in plan.cp.bytes_per_layer.items())
        out.append(f"cp      : {plan.cp.mode.value}, per layer and micro-batch (fwd+bwd): {both}; {plan.cp.why}")
    if lay.pp > 1:
        runs = "" if schedule_info(lay.schedule).runnable else " (planner-only: the engine cannot run it)"
        out.append(f"pipeline: {lay.schedule.value} p={lay.pp} m={lay.microbatches} v={lay.virtual_stages}: "
                   f"bubble {plan.bubble:.1%} of ideal compute time (simulated, {plan.bubble_inputs}){runs}")
    else:
        out.append("pipeline: none (pp=1), bubble 0%")
    rec_txt = "no recompute" if lay.recompute.value == "none" else f"{lay.recompute.value} recompute"
    out.append(f"FLOPs   : {fmt_flops(plan.model_flops_per_step)} model FLOPs/step, "
               f"{fmt_flops(plan.flops_per_step)} executed with {rec_txt} (per step, all ranks)")
    if plan.moe is not None:
        moe = plan.moe
        out.append(f"MoE     : {fmt_count(moe.total_params)} params, {fmt_count(moe.active_params)} active per token "
                   f"(top-{moe.experts_per_token} of {moe.num_experts} experts + {moe.shared_experts} shared, "
                   f"{moe.moe_blocks} MoE blocks); FLOPs count the active ones")
        out.append(f"dispatch: {moe.dispatcher}, {fmt_bytes(moe.alltoall_bytes_per_step)} all-to-all vs "
                   f"{fmt_bytes(moe.allgather_bytes_per_step)} all-gather per step per rank: {moe.why}")
    out.append(f"step    : ~{fmt_seconds(plan.step_time_s)} at MFU {plan.mfu_assumed:.0%} before bubble/recompute "
               f"-> effective MFU {plan.mfu:.1%}, {fmt_count(lay.global_batch * lay.seq / plan.step_time_s)} tokens/s")
    if plan.offload_traffic.pcie_bytes or plan.offload_traffic.nvme_bytes:
        out.append(f"offload : {fmt_bytes(plan.offload_traffic.pcie_bytes)} over PCIe + "
                   f"{fmt_bytes(plan.offload_traffic.nvme_bytes)} NVMe per step per rank = "
                   f"{fmt_seconds(plan.offload_time_s)} (not overlapped, included in the step)")
    if plan.activation_offload is not None:
        a = plan.activation_offload
        hides = "hide behind compute" if a.hides else f"do not hide: +{fmt_seconds(a.exposed_s_per_step)} per step"
        out.append(f"act off : {a.blocks_offloaded} of {shape.layers} blocks' activations to {a.tier.value} "
                   f"({fmt_bytes(a.offloaded_bytes)} off the device, {fmt_bytes(a.device_bytes)} stay); one block "
                   f"{fmt_bytes(a.bytes_per_block)} = {fmt_seconds(a.transfer_s_per_block)} each way vs "
                   f"{fmt_seconds(a.forward_s_per_block)} forward / {fmt_seconds(a.backward_s_per_block)} backward: "
                   f"transfers {hides}")
    out.append(f"ckpt    : write ~{fmt_seconds(plan.checkpoint_write_s)}, job MTBF {fmt_seconds(plan.cluster_mtbf_s)} "
               f"-> checkpoint every {fmt_seconds(plan.daly_s)} (Daly 2006; Young 1974: "
               f"{fmt_seconds(plan.young_s)})")
    out.append(f"recovery: {recovery_line(plan)}")
    if max_model_asked:
        if max_model is None:
            out.append("max model: nothing fits with this layout")
        elif not max_model.bounded:
            out.append("max model: no limit below 10^15 parameters with this layout (all model state is offloaded "
                       "and the host memory and NVMe hold it)")
        else:
            depth = f" ({max_model.layers} layers)" if max_model.layers is not None else ""
            limit = f"; one more is refused by the {max_model.limited_by}" if max_model.limited_by else ""
            out.append(f"max model: {fmt_count(max_model.params)} params{depth} fit in "
                       f"{fmt_bytes(plan.cluster.usable_memory_bytes)} "
                       f"per rank with this layout ({fmt_bytes(max_model.gpu_bytes)} used{limit}), and in the "
                       "node's host memory and NVMe")
    out.append("")
    rec = plan.recommendation
    rec_ep = f" ep={rec.ep}" if plan.moe is not None else ""
    rec_cp = f" cp={rec.cp}" if rec.cp > 1 else ""
    out.append(f"recommendation: tp={rec.tp} pp={rec.pp} dp={rec.dp}{rec_cp}{rec_ep} zero={rec.zero.stage} "
               f"sp={'on' if rec.sp else 'off'} recompute={plan.recommended_recompute.value} "
               f"schedule={rec.schedule.value}")
    out.append(f"  why: {rec.reason}")
    for note in plan.notes:
        out.append(f"  note: {note}")
    if plan.warnings:
        out.append("warnings:")
        out.extend(f"  ! {w}" for w in plan.warnings)
    else:
        out.append("warnings: none")
    return "\n".join(out)


def to_dict(plan: Plan, max_model: MaxModel | None = None, *, max_model_asked: bool = False) -> dict[str, Any]:
    """The JSON object (``v17 plan --json``; docs/planner.md lists its main keys); all bytes are integers per rank."""
    lay, m, acc, rec = plan.layout, plan.memory, plan.cluster.accelerator, plan.recommendation
    shape = plan.model.shape
    model: dict[str, Any] = {"name": plan.model.name, "params": int(plan.model.num_params)}
    if shape is not None:
        model.update(arch=shape.arch.value, layers=shape.layers, hidden=shape.hidden, heads=shape.heads,
                     kv_heads=shape.kv_heads, ffn=shape.ffn, vocab=shape.vocab, seq=shape.seq,
                     tie_embeddings=shape.tie_embeddings)
    out: dict[str, Any] = {
        "model": model,
        "cluster": {
            "gpu": acc.name, "gpus": lay.gpus, "gpus_per_node": plan.cluster.gpus_per_node or acc.gpus_per_node,
            "nodes": plan.nodes, "memory_bytes": int(acc.memory_bytes),
            "memory_reserve": plan.cluster.memory_reserve, "usable_memory_bytes": plan.cluster.usable_memory_bytes,
            "peak_flops": acc.peak_flops_for(lay.precision), "core_share": cap.core_share(plan.cluster, lay.gpus),
        },
        "layout": {
            "tp": lay.tp, "pp": lay.pp, "dp": lay.dp, "dp_replicate": lay.dims.dp_replicate, "cp": lay.cp, "sp": lay.sp,
            "zero_stage": lay.zero.stage,
            "recompute": lay.recompute.value, "schedule": lay.schedule.value, "virtual_stages": lay.virtual_stages,
            "micro_batch": lay.micro_batch, "microbatches": lay.microbatches, "global_batch": lay.global_batch,
            "seq": lay.seq, "optimizer": lay.optimizer.value, "precision": lay.precision.value,
            "offload_optimizer": lay.offload_optimizer.value, "offload_params": lay.offload_params.value,
        },
        "per_rank": {
            "param_bytes": m.param, "grad_bytes": m.grad, "optimizer_bytes": m.optimizer,
            "optimizer_parts_bytes": {name: b for name, b in m.optimizer_parts},
            "model_state_bytes": m.model_state, "activation_bytes": m.activation,
            "activation_bytes_per_layer": m.activation_per_layer, "temp_bytes": m.temp, "total_bytes": m.total,
        },
        "tiers": {"gpu_bytes": m.tiers.gpu, "cpu_bytes": m.tiers.cpu, "nvme_bytes": m.tiers.nvme},
        "fits": plan.fits,
        "capacity": {"ranks_per_node": _checks(plan)[-1].ranks,
                     "does_not_fit": [c.tier for c in _checks(plan) if not c.fits],
                     "nvme_path": os.path.abspath(plan.cluster.nvme_path),
                     **{c.tier: c.to_dict() for c in _checks(plan)}},
        "comm": {
            "bytes_per_step": plan.comm_bytes_per_step,
            "time_s_if_not_overlapped": plan.comm_time_s,
            "collectives": [{"name": c.name, "axis": c.axis, "bytes_per_step": c.bytes_per_step}
                            for c in plan.collectives],
        },
        "pipeline": {"schedule": lay.schedule.value, "stages": lay.pp, "microbatches": lay.microbatches,
                     "virtual_stages": lay.virtual_stages, "bubble_fraction": plan.bubble,
                     "bubble_method": "simulated", "bubble_inputs": plan.bubble_inputs, "runnable": schedule_info(lay.schedule).runnable},
        "flops": {"per_step": plan.flops_per_step, "model_per_step": plan.model_flops_per_step,
                  "step_time_s": plan.step_time_s, "mfu_assumed": plan.mfu_assumed, "mfu_effective": plan.mfu,
                  "tokens_per_s": lay.global_batch * lay.seq / plan.step_time_s},
        "offload": {"pcie_bytes_per_step": plan.offload_traffic.pcie_bytes,
                    "nvme_bytes_per_step": plan.offload_traffic.nvme_bytes, "transfer_s": plan.offload_time_s},
        "checkpoint": {"write_s": plan.checkpoint_write_s, "mtbf_s": plan.cluster_mtbf_s,
                       "young_interval_s": plan.young_s, "daly_interval_s": plan.daly_s},
        "recovery": recovery_goodput(plan),
        "recommendation": {
            "tp": rec.tp, "pp": rec.pp, "dp": rec.dp, "cp": rec.cp, "zero_stage": rec.zero.stage, "sp": rec.sp,
            "recompute": plan.recommended_recompute.value, "schedule": rec.schedule.value, "reason": rec.reason,
            "notes": list(plan.notes), "warnings": list(plan.warnings),
        },
    }  # fmt: skip
    if plan.cp is not None:
        out["layout"]["cp_mode"] = lay.cp_mode.value
        out["cp"] = plan.cp.to_dict()
    if plan.activation_offload is not None:
        a = plan.activation_offload
        out["layout"].update(offload_activations=lay.offload_activations.value, resident_blocks=lay.resident_blocks)
        out["activation_offload"] = {
            "tier": a.tier.value, "blocks_offloaded": a.blocks_offloaded, "bytes_per_block": a.bytes_per_block,
            "offloaded_bytes": a.offloaded_bytes, "device_bytes": a.device_bytes,
            "bandwidth_bytes_per_s": a.bandwidth_bytes_per_s, "transfer_s_per_block": a.transfer_s_per_block,
            "forward_s_per_block": a.forward_s_per_block, "backward_s_per_block": a.backward_s_per_block,
            "exposed_s_per_step": a.exposed_s_per_step, "hides": a.hides,
        }  # fmt: skip
    if plan.moe is not None:
        e = m.experts
        out["layout"]["ep"] = lay.ep
        out["layout"]["efsdp"] = lay.efsdp
        out["per_rank"].update(expert_param_bytes=e.param, expert_grad_bytes=e.grad, expert_optimizer_bytes=e.optimizer,
                               expert_model_state_bytes=e.total, dense_model_state_bytes=m.model_state - e.total)
        out["recommendation"]["ep"] = rec.ep
        out["moe"] = plan.moe.to_dict()
    if max_model_asked:
        out["max_model"] = (None if max_model is None else
                            {"params": max_model.params, "layers": max_model.layers, "gpu_bytes": max_model.gpu_bytes,
                             "bounded": max_model.bounded, "limited_by": max_model.limited_by})
    return out


__all__ = ["bar", "bucket_rows", "fmt_bytes", "render_text", "to_dict"]
