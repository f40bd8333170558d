"""``v17 plan``: the planner's command line. Flags map onto the input dataclasses of plan.py.

Torch-free. Strings are parsed once, here, with the enums of ``lightning_v17.config`` (Recompute, Schedule, Tier,
Precision, OptimizerKind). Bad input prints one line on stderr and returns exit code 2.

Examples::

    v17 plan --model llama3-70b --gpus 512
    v17 plan --model llama2-7b --gpus 8 --zero-stage 2 --json
    v17 plan --params 7.5e9 --dp 64 --zero-stage 3            # ZeRO Fig. 1, model state only
    v17 plan --model llama3-8b --gpus 8 --tp 2 --max-model    # deepest model of this width that fits
    v17 plan --model tiny --gpu cpu --gpus 2 --emit-config run.yaml   # then: v17 fit --config run.yaml
    v17 plan --model llama3-70b --gpus 512 --plot plan.png     # needs the plot extra (matplotlib)
    v17 plan --model mixtral-8x7b --gpus 16 --ep 8 --json     # experts over 8 ranks, dispatch traffic
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shlex
import sys
from dataclasses import replace
from typing import Any

from lightning_v17.config import CPMode, OptimizerKind, Precision, Recompute, Schedule, Tier, ZeroPolicy
from lightning_v17.planner.hardware import ACCELERATORS
from lightning_v17.planner.model import PLANNER_ONLY_PRESETS, PRESETS, Arch, ModelShape, get_preset, with_overrides
from lightning_v17.planner.model_search import max_model
from lightning_v17.planner.pipeline import OpTimes
from lightning_v17.planner.plan import ClusterSpec, ModelSpec, Plan, TrainSpec, make_plan
from lightning_v17.planner.report import render_text, to_dict
from lightning_v17.planner.search import SearchResult, has_fixed_sizes, search
from lightning_v17.planner.search import render as render_search
from lightning_v17.planner.search import to_dict as search_dict

#: Defaults that make a preset's plan describe its usual run. ``tiny`` is the CPU reference model that the main
#: job (``make run``) trains on 2 CPU ranks in fp32 with ZeRO-3; ``tiny-moe`` is its mixture-of-experts sibling.
PRESET_DEFAULTS: dict[str, dict[str, Any]] = {"tiny": {"gpu": "cpu", "gpus": 2, "precision": "fp32"},
                                              "tiny-moe": {"gpu": "cpu", "gpus": 2, "precision": "fp32"}}

_SUFFIXES = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
# argparse only takes "-4" or "-.5" as a value; "-7e9" or "-70B" would read as an unknown option.
_NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)(e[+-]?\d+)?[kmbgt]?$", re.IGNORECASE)


def _glue_negative_values(argv: list[str]) -> list[str]:
    """["--params", "-7e9"] -> ["--params=-7e9"], so that a negative size gets the "must be positive" message."""
    out: list[str] = []
    for token in argv:
        if out and out[-1].startswith("--") and "=" not in out[-1] and _NEGATIVE_NUMBER.match(token):
            out[-1] = f"{out[-1]}={token}"
        else:
            out.append(token)
    return out


class _UsageError(Exception):
    """Raised instead of argparse's print-usage-and-exit, so the CLI prints one line and returns 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise _UsageError(message)


def _count(text: str) -> int:
    """'7.5e9', '70B', '175b', '1.5T' -> a positive integer parameter count."""
    raw = text.strip().lower().replace("_", "").replace(",", "")
    scale = _SUFFIXES.get(raw[-1:], 1.0) if raw else 1.0
    try:
        value = float(raw[:-1] if scale != 1.0 else raw) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number (e.g. 7.5e9 or 70B)") from None
    if not value >= 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive number of parameters")
    return round(value)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive integer (sizes cannot be zero or negative)")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive number")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"{text!r} must be a number >= 0")
    return value


def _zero_stage(text: str) -> int:
    if text.strip() not in ("0", "1", "2", "3"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a ZeRO stage; choose 0, 1, 2 or 3")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    """The ``v17 plan`` argument parser; its errors raise instead of exiting (see :func:`main`)."""
    p = _Parser(prog="v17 plan", description="Per-rank memory, communication, bubble, FLOPs and a recommended "
                "layout for training a transformer. Every number cites its formula (lightning_v17/planner/).")
    j = p.add_argument_group("a training job")
    j.add_argument("--config", action="append", metavar="YAML",
                   help="plan the job a `v17 fit` config trains (repeat it as for `v17 fit`; later files win): its "
                        "model, devices, precision, V17Strategy layout, batch_size (the micro-batch), "
                        "accumulate_grad_batches and seq_len; the model, layout and batch flags are then refused")
    g = p.add_argument_group("model (a preset, explicit shape flags, or --params)")
    g.add_argument("--model", help=f"preset: {', '.join([*PRESETS, *PLANNER_ONLY_PRESETS])}")
    g.add_argument("--params", type=_count, help="parameter count for model-state-only questions (7.5e9, 70B)")
    g.add_argument("--arch", help="llama or gpt (default llama)")
    for flag in ("layers", "hidden", "heads", "kv-heads", "ffn", "vocab"):
        g.add_argument(f"--{flag}", type=_positive_int, help=f"model {flag} (overrides the preset's)")
    g.add_argument("--seq", "--seq-len", dest="seq", type=_positive_int,
                   help="training sequence length (default: the shape's)")
    c = p.add_argument_group("cluster")
    c.add_argument("--gpu", help=f"accelerator: {', '.join(ACCELERATORS)} (default h100-80gb)")
    c.add_argument("--gpus", type=_positive_int, help="world size (default: dp * tp * pp * cp, or one node)")
    c.add_argument("--gpus-per-node", type=_positive_int, help="devices per node (default: 8; cpu: 2)")
    c.add_argument("--pcie-gbps", type=_positive_float, default=25.0, help="host<->device GB/s per rank")
    c.add_argument("--nvme-gbps", type=_positive_float, default=3.0, help="NVMe GB/s per rank")
    c.add_argument("--storage-gbps", type=_positive_float, default=5.0, help="checkpoint write GB/s per node")
    c.add_argument("--node-mtbf-hours", type=_positive_float, default=6000.0, help="MTBF of one node, hours")
    c.add_argument("--memory-reserve", type=_non_negative_float, default=0.1,
                   help="fraction of device memory kept free for the CUDA context, NCCL buffers and allocator "
                        "fragmentation (default 0.1); a plan fits within the rest")
    c.add_argument("--host-memory", type=_positive_float, metavar="GB",
                   help="host memory of one node in GB, shared by its ranks' cpu-tier bytes (on cpu also by their "
                        "device bytes) (default: on cpu this machine's memory; else 250 GB per device, 2 TB for 8)")
    c.add_argument("--host-reserve", type=_non_negative_float, default=0.1,
                   help="fraction of each node's host memory kept free for the OS, other processes and each rank's "
                        "Python/torch runtime (default 0.1); a plan's host bytes fit within the rest")
    c.add_argument("--nvme-capacity", type=_positive_float, metavar="GB",
                   help="NVMe space of one node in GB for the nvme tier, shared by its ranks (default: the free "
                        "space at --nvme-path)")
    c.add_argument("--nvme-path", default=".",
                   help="directory the nvme tier writes to; its free space is the default --nvme-capacity "
                        "(default: the current directory)")
    c.add_argument("--restart-s", type=_positive_float, default=9.0, metavar="S",
                   help="failure to first step of a torchrun-restarted job, before its checkpoint read (default 9.0: "
                        "bench/fault.py on a 2-core CPU host; measure yours)")
    c.add_argument("--replica-drop-s", type=_positive_float, default=1.1, metavar="S",
                   help="failure to the surviving replica groups' next step with FTPolicy (default 1.1: bench/fault.py)")
    c.add_argument("--inprocess-restart-s", type=_positive_float, default=0.23, metavar="S",
                   help="failure to next step of an in-process restart with a warm spare, before the snapshot's "
                        "transfer (default 0.23: bench/fault.py)")
    c.add_argument("--cpu-cores", type=_positive_int,
                   help="on --gpu cpu: the cores its ranks share (default: this machine's); a rank computes at one "
                        "core's peak times min(1, cores / ranks)")
    c.add_argument("--checkpoint-write-s", type=_positive_float, help="checkpoint write time (default: estimated)")
    t = p.add_argument_group("layout and training (unset: searched)")
    for flag in ("tp", "pp", "dp", "cp"):
        t.add_argument(f"--{flag}", type=_positive_int, help=f"{flag} size")
    t.add_argument("--dp-replicate", type=_positive_int,
                   help="HSDP: replicated groups of the dp ranks; ZeRO shards over dp / dp-replicate (default 1)")
    t.add_argument("--cp-mode", default="auto",
                   help="attention scheme under cp > 1: ulysses (all-to-all, cp must divide the heads), allgather "
                        "(K/V all-gathered, any cp) or auto (the one that sends fewer elements; default)")
    t.add_argument("--sp", action=argparse.BooleanOptionalAction, default=None,
                   help="sequence parallelism (default: on when tp > 1)")
    t.add_argument("--zero-stage", type=_zero_stage, help="ZeRO stage 0-3")
    t.add_argument("--optimizer", default="adamw", help=f"{', '.join(o.value for o in OptimizerKind)}")
    t.add_argument("--precision", help="fp32, bf16-mixed, fp16-mixed, bf16-true or fp8 (default bf16-mixed)")
    t.add_argument("--fp8", help="V17Strategy's fp8 recipe: tensorwise, rowwise or delayed (default: off; tensorwise "
                   "with --precision fp8)")  # fmt: skip
    t.add_argument("--micro-batch", type=_positive_int, help="samples per micro-batch (b; default 1)")
    t.add_argument("--global-batch", type=_positive_int, help="samples per step over all replicas")
    t.add_argument("--microbatches", type=_positive_int, help="micro-batches per step per replica (m)")
    t.add_argument("--recompute", help="none, selective or full (default: the least that fits)")
    t.add_argument(
        "--schedule",
        help="pipeline schedule: gpipe, 1f1b, interleaved_1f1b, zero_bubble (torch's interleaved zero bubble), zbv; "
        "zb-h1 / zb-h2 are Qi 2023's one-stage-per-rank schedules (the engine runs zb-h1; zb-h2 is planner-only)",
    )
    t.add_argument("--virtual-stages", type=_positive_int, help="model chunks per rank (interleaved schedules)")
    t.add_argument("--op-times", metavar="F,B,W",
                   help="per-micro-batch forward, input-gradient and weight-gradient times of one stage for the "
                        "bubble simulation, any unit (default 1,1,1: the FLOP split)")
    t.add_argument("--op-cv", type=_non_negative_float, default=0.0,
                   help="coefficient of variation of every op's duration (jitter; default 0); >0 gives the median "
                        "bubble over sampled steps")
    t.add_argument("--p2p-time", type=_non_negative_float, default=0.0,
                   help="one pipeline send/recv, in the unit of --op-times (default 0)")
    t.add_argument("--ep", type=_positive_int,
                   help="expert-parallel size of a MoE model, folded out of dp, which it must divide (default: the "
                        "decision tree's when tp = pp = 1, else 1)")
    t.add_argument("--offload-optimizer", default="none", help="none, cpu or nvme")
    t.add_argument("--offload-params", default="none", help="none, cpu or nvme (ZeRO-3)")
    t.add_argument("--offload-activations", default="none",
                   help="none, cpu or nvme: the blocks' saved activations off the device between forward and backward")
    t.add_argument("--resident-blocks", type=int, default=1,
                   help="with --offload-activations, the last blocks that keep their activations (default 1)")
    t.add_argument("--mfu", type=_positive_float, default=0.5,
                   help="assumed MFU without bubble or recomputation, for the step time (default 0.5)")
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    o.add_argument("--top", type=_positive_int, default=3,
                   help="without fixed sizes: how many of the searched layouts to print (default 3)")
    o.add_argument("--rule-of-thumb", action="store_true",
                   help="plan the decision tree's layout (design §17.4) instead of searching")
    o.add_argument("--allow-nvme-offload", action="store_true",
                   help="without fixed sizes: let the search offload to NVMe too (default: cpu only)")
    o.add_argument("--max-model", action="store_true",
                   help="also report the largest model of this architecture that fits with this layout: device "
                        "memory per rank, host memory and NVMe per node")
    o.add_argument("--emit-config", metavar="PATH",
                   help="also write the plan as a Lightning CLI YAML (V17Strategy, trainer, model, data) that "
                        "`v17 fit --config PATH` runs; a comment records this command")
    o.add_argument("--plot", metavar="PATH",
                   help="also draw the plan as a PNG: per-rank memory by bucket and tier, and bytes per collective "
                        "(needs matplotlib: pip install 'lightning-v17[plot]')")
    return p


def _model_spec(args: argparse.Namespace) -> ModelSpec:
    shape_flags = {"layers": args.layers, "hidden": args.hidden, "heads": args.heads, "kv_heads": args.kv_heads,
                   "ffn": args.ffn, "vocab": args.vocab}
    given = {k: v for k, v in shape_flags.items() if v is not None}
    if args.model is not None:
        if args.params is not None:
            raise _UsageError("give either --model or --params, not both")
        shape = get_preset(args.model, planner_only=True)
        if args.arch is not None:
            given["arch"] = Arch.parse(args.arch)
        return ModelSpec(shape=with_overrides(shape, **given), name=args.model.strip().lower())
    if given or args.arch is not None:
        if args.params is not None:
            raise _UsageError("give either the shape flags or --params, not both")
        missing = [f"--{k}" for k in ("layers", "hidden", "heads", "vocab") if k not in given]
        if missing:
            raise _UsageError(f"an explicit shape needs {', '.join(missing)} (or use --model PRESET)")
        arch = Arch.parse(args.arch or "llama")
        h = given["hidden"]
        # Defaults: GPT-3's 4h MLP; llama's SwiGLU width 2/3·4h rounded up to a multiple of 256 (Touvron 2023,
        # llama/model.py ``multiple_of``), which gives 11008 for h = 4096.
        ffn = given.get("ffn") or (4 * h if arch == Arch.GPT else -(-(8 * h // 3) // 256) * 256)
        shape = ModelShape(arch=arch, layers=given["layers"], hidden=h, heads=given["heads"],
                           kv_heads=given.get("kv_heads", given["heads"]), ffn=ffn, vocab=given["vocab"],
                           seq=args.seq or 4096, tie_embeddings=arch == Arch.GPT)
        return ModelSpec(shape=shape, name="custom")
    if args.params is not None:
        return ModelSpec(params=args.params, name="custom")
    names = ", ".join([*PRESETS, *PLANNER_ONLY_PRESETS])
    raise _UsageError(f"give a model: --model {{{names}}}, the shape flags, or --params N")


#: flags that say what ``--config`` already says (the job's model, world, layout and batch)
_JOB_FLAGS = ("model", "params", "arch", "layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq", "gpus",
              "gpus_per_node", "tp", "pp", "dp", "cp", "ep", "dp_replicate", "sp", "zero_stage", "precision", "fp8", "micro_batch",
              "global_batch", "microbatches", "recompute", "schedule", "virtual_stages")  # fmt: skip
_JOB_TIERS = ("offload_optimizer", "offload_params", "offload_activations")


def _job_specs(args: argparse.Namespace) -> tuple[ModelSpec, ClusterSpec, TrainSpec]:
    """``--config``: the job's model, world, layout and batch, with the other flags (links, capacities, mfu)."""
    from lightning_v17.planner.job import job_specs, load_configs

    given = [f"--{n.replace('_', '-')}" for n in _JOB_FLAGS if getattr(args, n) is not None]
    given += [f"--{n.replace('_', '-')}" for n in _JOB_TIERS if getattr(args, n) != "none"]
    given += ["--rule-of-thumb"] if args.rule_of_thumb else []
    if given:
        raise _UsageError(f"--config gives the job's model, layout and batch; drop {', '.join(given)} (or edit the "
                          "YAML, or add another --config that overrides it)")
    _, cluster, train = _specs_from_flags(args, job=True)
    return job_specs(load_configs(args.config), cluster=cluster, train=train)


def specs_from_args(args: argparse.Namespace) -> tuple[ModelSpec, ClusterSpec, TrainSpec]:
    """Map parsed flags onto the planner's input dataclasses (strings parsed once, into enums)."""
    if args.config:
        return _job_specs(args)
    return _specs_from_flags(args)


def _specs_from_flags(args: argparse.Namespace, *, job: bool = False) -> tuple[ModelSpec, ClusterSpec, TrainSpec]:
    """The flags' specs; with ``job`` (``--config``) no model (the job's replaces it) and no preset defaults."""
    model = None if job else _model_spec(args)
    defaults = PRESET_DEFAULTS.get(model.name, {}) if model is not None and args.model is not None else {}
    gpus = args.gpus
    if gpus is None and args.dp is None and not (args.tp or args.pp or args.cp):
        gpus = defaults.get("gpus")
    cluster = ClusterSpec(
        gpu=args.gpu or defaults.get("gpu", "h100-80gb"), gpus=gpus, gpus_per_node=args.gpus_per_node,
        pcie_gbps=args.pcie_gbps, nvme_gbps=args.nvme_gbps, storage_gbps=args.storage_gbps,
        node_mtbf_hours=args.node_mtbf_hours, memory_reserve=args.memory_reserve,
        host_memory_gb=args.host_memory, host_reserve=args.host_reserve, nvme_capacity_gb=args.nvme_capacity, nvme_path=args.nvme_path,
        cpu_cores=args.cpu_cores, restart_s=args.restart_s, replica_drop_s=args.replica_drop_s,
        inprocess_restart_s=args.inprocess_restart_s,
    )  # fmt: skip
    train = TrainSpec(
        tp=args.tp, pp=args.pp, dp=args.dp, cp=args.cp, sp=args.sp,
        zero=None if args.zero_stage is None else ZeroPolicy(stage=args.zero_stage),
        optimizer=OptimizerKind.parse(args.optimizer, "--optimizer"),
        precision=Precision.parse(args.precision or defaults.get("precision", "bf16-mixed"), "--precision"),
        micro_batch=args.micro_batch or 1, seq=args.seq, global_batch=args.global_batch, microbatches=args.microbatches,
        recompute=None if args.recompute is None else Recompute.parse(args.recompute, "--recompute"),
        schedule=None if args.schedule is None else Schedule.parse(args.schedule, "--schedule"),
        virtual_stages=args.virtual_stages,
        offload_optimizer=Tier.parse(args.offload_optimizer, "--offload-optimizer"),
        offload_params=Tier.parse(args.offload_params, "--offload-params"), fp8=args.fp8,
        offload_activations=Tier.parse(args.offload_activations, "--offload-activations"),
        resident_blocks=args.resident_blocks,
        mfu=args.mfu, checkpoint_write_s=args.checkpoint_write_s, op_times=_op_times(args.op_times, args.op_cv),
        p2p_time=args.p2p_time, ep=args.ep, dp_replicate=args.dp_replicate, cp_mode=CPMode.parse(args.cp_mode, "--cp-mode"),
    )  # fmt: skip
    return model, cluster, train  # type: ignore[return-value]  # model is None only for a job


def _op_times(text: str | None, cv: float) -> OpTimes | None:
    """``--op-times F,B,W`` (and ``--op-cv``) as :class:`OpTimes`; None when neither is given."""
    if text is None:
        return None if cv == 0 else OpTimes(forward_cv=cv, backward_input_cv=cv, backward_weight_cv=cv)
    parts = text.split(",")
    try:
        values = [float(x) for x in parts]
    except ValueError:
        values = []
    if len(values) != 3 or any(not math.isfinite(x) or x < 0 for x in values) or sum(values) == 0:
        raise _UsageError(f"--op-times {text!r}: give three non-negative numbers F,B,W (e.g. 1,1,1), not all 0")
    return OpTimes(*values, forward_cv=cv, backward_input_cv=cv, backward_weight_cv=cv)


def planned(args: argparse.Namespace, model: ModelSpec, cluster: ClusterSpec,
            train: TrainSpec) -> tuple[Plan, SearchResult | None]:
    """The plan ``v17 plan`` reports, and the search behind it: the job's layout with ``--config`` (and the search at
    its batch), the layout the flags fix, the decision tree's with
    ``--rule-of-thumb``, else the fastest searched layout that passes the rules and fits (the tree's when none does)."""
    if args.config:  # the job's layout, and beside it the search over layouts at the job's batch and sequence
        plan = make_plan(model, cluster, train)
        batch = replace(train, global_batch=plan.layout.global_batch, microbatches=None)
        return plan, search(model, cluster, batch, allow_nvme=args.allow_nvme_offload)
    if has_fixed_sizes(train) or args.rule_of_thumb:
        return make_plan(model, cluster, train), None
    found = search(model, cluster, train, allow_nvme=args.allow_nvme_offload)
    return found.best or found.rule_of_thumb, found


def main(argv: list[str] | None = None) -> int:
    """Run ``v17 plan``. Returns 0 on success, 2 on bad input (one line on stderr)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(_glue_negative_values(argv))
        model, cluster, train = specs_from_args(args)
        plan, found = planned(args, model, cluster, train)
        biggest = max_model(plan) if args.max_model else None
        if args.emit_config is not None:
            from lightning_v17.planner.emit import write_config

            written = write_config(args.emit_config, plan, command=shlex.join(argv))
        if args.plot is not None:
            from lightning_v17.planner.plot import write_plot  # matplotlib is imported only now, and only if asked

            plotted = write_plot(plan, args.plot)
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    except (_UsageError, ValueError, OSError, ImportError) as exc:  # ImportError: --plot without matplotlib
        message = " ".join(str(exc).split())
        print(f"v17 plan: error: {message}", file=sys.stderr)
        return 2
    if args.json:
        doc = to_dict(plan, biggest, max_model_asked=args.max_model)
        if args.config:
            doc["job"] = list(args.config)
        if found is not None:
            doc["search"] = search_dict(found, args.top)
        text = json.dumps(doc, indent=2)
    else:
        text = render_text(plan, biggest, max_model_asked=args.max_model)
        if args.config:
            text = f"job     : {' + '.join(args.config)} (the layout and batch it trains)\n{text}"
        text += f"\n\n{render_search(found, args.top)}" if found is not None else ""
    try:
        print(text)
    except BrokenPipeError:  # `v17 plan ... | head`: the reader left; not an error
        sys.stdout = None  # type: ignore[assignment]  # keep the interpreter from flushing to the closed pipe
    if args.emit_config is not None:  # on stderr, so that --json output stays one JSON object
        print(f"v17 plan: wrote {written}; run it with: v17 fit --config {shlex.quote(str(written))}", file=sys.stderr)
    if args.plot is not None:
        print(f"v17 plan: wrote {plotted}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
