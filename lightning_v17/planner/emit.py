"""``v17 plan --emit-config run.yaml``: a :class:`~lightning_v17.planner.plan.Plan` as a Lightning CLI YAML.

Torch-free, like the rest of the planner. The file is what ``v17 fit --config run.yaml`` runs as is: the trainer
(accelerator, devices, num_nodes, precision), ``lightning_v17.strategies.V17Strategy`` with the plan's layout, the
reference model (``LlamaLM``) and ``PackedDataModule`` with the plan's sequence length and batch. A comment at the
top records the exact ``v17 plan`` command, so a recipe in ``configs/`` can be regenerated and re-checked (the test
in tests/unit/test_configs.py re-runs that command and compares).

What the plan recommends but the run cannot express yet (an offload tier V17Strategy refuses, an optimizer
other than LlamaLM's AdamW) is not emitted; it becomes a "NOT EMITTED" comment instead, so the file always loads.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, fields
from enum import Enum
from pathlib import Path
from typing import Any

import yaml

from lightning_v17.config import (
    CPMode,
    OffloadPolicy,
    OptimizerKind,
    PipelinePolicy,
    Precision,
    Tier,
    TPPolicy,
    V17ConfigError,
)
from lightning_v17.planner import capacity as cap
from lightning_v17.planner.plan import Plan
from lightning_v17.planner.report import fmt_bytes, fmt_count

STRATEGY_CLASS = "lightning_v17.strategies.V17Strategy"
#: The comment line that records the producing command; :func:`recorded_command` reads it back.
COMMAND_PREFIX = "# command: v17 plan "
#: Offload tiers V17Strategy accepts today (an nvme tier needs an ``nvme_path`` the plan cannot know);
#: tests/integration/test_emit_config.py checks these sets against the real strategy, so they cannot drift apart.
IMPLEMENTED_OFFLOAD_OPTIMIZER: frozenset[Tier] = frozenset({Tier.NONE, Tier.CPU})  # nvme also needs nvme_path
IMPLEMENTED_OFFLOAD_PARAMS: frozenset[Tier] = frozenset({Tier.NONE, Tier.CPU})
#: LlamaLM (lightning_v17/models/lightning.py) configures AdamW; other optimizers need another LightningModule.
MODEL_OPTIMIZER = OptimizerKind.ADAMW
#: ModelConfig field of each planner shape field (lightning_v17/models/config.py ``from_preset``).
_SHAPE_TO_MODEL_CONFIG = {"vocab": "vocab_size", "hidden": "hidden", "layers": "layers", "heads": "heads",
                          "kv_heads": "kv_heads", "ffn": "ffn"}  # fmt: skip


@dataclass(frozen=True)
class EmittedConfig:
    """The Lightning CLI config of a plan, and the comments that go with it.

    Args:
        config: the YAML document as a dict (``seed_everything``, ``trainer``, ``model``, ``data``).
        summary: comment lines describing the plan (layout, per-rank memory against capacity).
        not_emitted: comment lines for what the plan recommends but the run cannot express yet.
    """

    config: dict[str, Any]
    summary: tuple[str, ...]
    not_emitted: tuple[str, ...]

    def to_yaml(self, command: str) -> str:
        """The file's text: the command and plan comments, then the YAML document.

        Args:
            command: the producing command line without the leading ``v17 plan`` (e.g. ``shlex.join(argv)``).
        """
        head = [
            "# Emitted by `v17 plan --emit-config` (lightning_v17/planner/emit.py); regenerate it with the command",
            "# below instead of editing by hand. Run it with `v17 fit --config THIS_FILE` (add --trainer.max_steps N).",
            f"{COMMAND_PREFIX}{command}".rstrip(),
            *(f"# {line}" for line in self.summary),
            *(f"# NOT EMITTED: {line}" for line in self.not_emitted),
        ]
        body = yaml.safe_dump(self.config, sort_keys=False, default_flow_style=False, width=120)
        return "\n".join(head) + "\n" + body


def recorded_command(text: str) -> list[str] | None:
    """The ``v17 plan`` arguments recorded in an emitted file's comment (without ``v17 plan``), or None."""
    for line in text.splitlines():
        if line.startswith(COMMAND_PREFIX):
            return shlex.split(line[len(COMMAND_PREFIX):])
    return None


def _nodes_and_devices(plan: Plan) -> tuple[int, int]:
    """(num_nodes, devices per node) with num_nodes x devices = world size, as Lightning requires."""
    world = plan.layout.gpus
    per_node = plan.cluster.gpus_per_node or plan.cluster.accelerator.gpus_per_node
    if world <= per_node:
        return 1, world
    if world % per_node:
        raise V17ConfigError(
            f"--emit-config: {world} devices are not a whole number of {per_node}-device nodes, and Lightning needs "
            f"devices x num_nodes = world size; use --gpus a multiple of {per_node} or set --gpus-per-node"
        )
    return world // per_node, per_node


def _model_section(plan: Plan) -> dict[str, Any]:
    """``model:`` for LlamaLM: the preset, plus ``model_overrides`` for shape flags that changed it."""
    from lightning_v17.planner.model import PRESETS

    shape = plan.model.shape
    if shape is None:
        raise V17ConfigError("--emit-config needs a model shape (--model PRESET or the shape flags), not --params")
    arch = str(getattr(shape.arch, "value", shape.arch))
    if arch != "llama":
        raise V17ConfigError(
            f"--emit-config: the reference model implements llama shapes only, not {arch}; "
            "use a llama preset or --arch llama"
        )
    if shape.head_dim or shape.mla is not None:
        what = "multi-head latent attention (mla)" if shape.mla is not None else f"head_dim={shape.head_dim}"
        raise V17ConfigError(f"--emit-config: the reference model has GQA heads of width hidden/heads, not {what} "
                             f"({plan.model.name}); plan it without --emit-config")
    name = plan.model.name if plan.model.name in PRESETS else "tiny"
    base = PRESETS[name]
    overrides = {_SHAPE_TO_MODEL_CONFIG[k]: getattr(shape, k) for k in _SHAPE_TO_MODEL_CONFIG
                 if getattr(shape, k) != getattr(base, k)}  # fmt: skip
    if name != plan.model.name:  # an explicit shape: every field that defines it, on top of the tiny preset
        overrides.update(max_seq_len=shape.seq, rope_theta=float(shape.rope_theta),
                         tie_embeddings=bool(shape.tie_embeddings))
    section: dict[str, Any] = {"model": name}
    if overrides:
        section["model_overrides"] = overrides
    return section


def _fields(policy: Any) -> dict[str, Any]:
    """A policy as the YAML mapping of all its fields: what the Lightning CLI resolves it to, so that a file's values
    survive ``--print_config`` unchanged (tests/unit/test_configs.py). An enum is written as its value where the
    field also takes a string (``Schedule | str``), else as its member name, the only spelling jsonargparse takes
    for a plain enum field (``Tier.CPU`` -> ``CPU``; the policy parses either)."""
    out = {}
    for f in fields(policy):
        value = getattr(policy, f.name)
        if isinstance(value, Enum):
            value = value.value if "str" in str(f.type).split(" | ") else value.name
        out[f.name] = list(value) if isinstance(value, tuple) else value
    return out


def _strategy(plan: Plan, not_emitted: list[str]) -> dict[str, Any]:
    """V17Strategy's ``init_args`` for the plan's layout (only options the strategy accepts): the axis sizes and the
    shortcuts, an axis in use with options as its policy (``pp`` with pp > 1, ``tp`` with tp > 1, the size inside)
    and each offload tier the strategy can run here."""
    lay = plan.layout
    # The planner's ZeRO shards over dp_shard x cp (memory_for), and HSDP's replicas are dp_replicate.
    args: dict[str, Any] = {
        "zero_stage": lay.zero.stage, "activation_checkpointing": lay.recompute.value,
        "dp_replicate": lay.dims.dp_replicate, "dp_shard": lay.dims.dp_shard, "tp": lay.tp, "pp": lay.pp,
    }  # fmt: skip
    if lay.cp > 1:  # CPPolicy's defaults: the scheme chosen from the heads (the plan's, by the same rule), head-tail
        asked = plan.cp.requested if plan.cp is not None else CPMode.AUTO
        args["cp"] = lay.cp if asked == CPMode.AUTO else {"size": lay.cp, "mode": asked.value}
    if lay.ep > 1:
        args["ep"] = lay.ep  # MeshSpec.ep: the experts over ep ranks folded out of dp_shard
    if lay.pp > 1:
        args["pp"] = _fields(PipelinePolicy(size=lay.pp, schedule=lay.schedule, microbatches=lay.microbatches,
                                            virtual_stages=lay.virtual_stages))  # fmt: skip
    if lay.tp > 1:
        args["tp"] = _fields(TPPolicy(size=lay.tp, sequence_parallel=bool(lay.sp)))
    offload: dict[str, Tier] = {}
    if lay.offload_optimizer == Tier.NONE:
        pass
    elif lay.offload_optimizer in IMPLEMENTED_OFFLOAD_OPTIMIZER and plan.cluster.gpu == "cpu":
        offload["optimizer"] = lay.offload_optimizer
    else:  # V17's optimizer offload steps CPU parameters only (engine/offload/optimizer.py); nvme needs the machine's path
        not_emitted.append(f"OffloadPolicy(optimizer={lay.offload_optimizer.value!r}) (the plan counts the optimizer "
                           "state off the device) is not emitted: V17Strategy offloads the optimizer of CPU parameters "
                           "only in this version (nvme also needs nvme_path); the run keeps it on the device")
    if lay.offload_params != Tier.NONE:
        if not lay.zero.shards_params:
            not_emitted.append(f"OffloadPolicy(params={lay.offload_params.value!r}) needs zero_stage=3 (ignored by "
                               f"the plan at zero_stage={lay.zero.stage})")
        elif lay.offload_params in IMPLEMENTED_OFFLOAD_PARAMS:
            offload["params"] = lay.offload_params
        else:
            not_emitted.append(f"OffloadPolicy(params={lay.offload_params.value!r}) is not emitted: it needs "
                               "nvme_path=<a directory on this machine's NVMe drive>, which the plan cannot know; add "
                               "both to the "
                               "strategy's offload: init_args (the run keeps the parameter shards on the device "
                               "otherwise)")
    if lay.offload_activations != Tier.NONE:
        not_emitted.append(f"OffloadPolicy(activations={lay.offload_activations.value!r}) is not emitted: the nvme "
                           "tier needs nvme_path=<a directory on this machine's NVMe drive> and the cpu tier an "
                           "accelerator; add offload: {activations: ..., nvme_path: ...} to the strategy's init_args")
    if offload:
        args["offload"] = _fields(OffloadPolicy(**offload))
    return {"class_path": STRATEGY_CLASS, "init_args": args}


def strategy_section(plan: Plan) -> dict[str, Any]:
    """``trainer.strategy`` of the emitted file alone (``class_path`` and ``init_args``): the layout as V17Strategy
    takes it, for any shape, also one the reference model cannot build (the strategy does not depend on the model)."""
    return _strategy(plan, [])


def _tiers_line(plan: Plan) -> str:
    """Every tier against its capacity (device per rank, host and NVMe per node) and whether the plan fits them all."""
    checks = plan.capacity or cap.capacity_checks(plan.memory.tiers, plan.cluster, gpus=plan.layout.gpus)
    words = [f"{c.tier} {fmt_bytes(c.need_bytes)} of {fmt_bytes(c.capacity_bytes)}"
             + (f" ({c.ranks} ranks)" if c.ranks > 1 else "") for c in checks]  # fmt: skip
    refused = [c.tier for c in checks if not c.fits]
    verdict = "fits every tier" if not refused else f"DOES NOT FIT: {', '.join(refused)}"
    return f"tiers: {'; '.join(words)}: {verdict}"


def emit_config(plan: Plan) -> EmittedConfig:
    """The Lightning CLI config that runs ``plan`` with V17Strategy, LlamaLM and PackedDataModule.

    Batch: with pp > 1 the pipeline splits each data-parallel rank's batch into ``microbatches`` chunks, so
    ``data.batch_size`` = micro_batch * microbatches; without a pipeline the m micro-batches are gradient
    accumulation (``trainer.accumulate_grad_batches``) of ``batch_size`` = micro_batch each. Either way
    G = dp * b * m (Narayanan 2021 §2), the plan's global batch.

    Raises:
        V17ConfigError: the plan cannot be run by these classes (no shape, a gpt shape, cp > 1, a world size that
            is not whole nodes), with the fix in the message.
    """
    lay = plan.layout
    not_emitted: list[str] = []
    model = _model_section(plan)
    strategy = _strategy(plan, not_emitted)
    nodes, devices = _nodes_and_devices(plan)
    precision = lay.precision
    if lay.fp8 is not None:
        strategy["init_args"]["fp8"] = lay.fp8.value  # the recipe, FP8Policy's shortcut (engine/fp8/convert.py)
    if precision == Precision.FP8:
        precision = Precision.BF16_MIXED  # fp8 runs as V17Strategy(fp8=...) with bf16-mixed outside the matmuls
    if lay.optimizer != MODEL_OPTIMIZER:
        not_emitted.append(f"optimizer={lay.optimizer.value} (LlamaLM trains with {MODEL_OPTIMIZER.value}; the "
                           f"plan's optimizer-state bytes assume {lay.optimizer.value})")
    trainer: dict[str, Any] = {
        "accelerator": "cpu" if plan.cluster.gpu == "cpu" else "gpu",
        "devices": devices,
        "num_nodes": nodes,
        "strategy": strategy,
        "precision": precision.value,
    }
    batch_size = lay.micro_batch * (lay.microbatches if lay.pp > 1 else 1)
    if lay.pp == 1 and lay.microbatches > 1:
        trainer["accumulate_grad_batches"] = lay.microbatches
    data = {"seq_len": lay.seq, "batch_size": batch_size}
    config = {"seed_everything": 0, "trainer": trainer, "model": model, "data": data}

    acc = plan.cluster.accelerator
    gpu_bytes = plan.memory.tiers.gpu
    summary = [
        (f"plan: {plan.model.name} ({fmt_count(plan.model.num_params)} params) on {lay.gpus} x {acc.name} "
         f"({nodes} node{'s' if nodes > 1 else ''} x {devices})"),
        (f"  layout: tp={lay.tp} pp={lay.pp} dp={lay.dp}{f' ep={lay.ep}' if lay.ep > 1 else ''} zero={lay.zero.stage} sp={'on' if lay.sp else 'off'} "
         f"recompute={lay.recompute.value} schedule={lay.schedule.value if lay.pp > 1 else '-'} | "
         f"{lay.optimizer.value} {lay.precision.value}{f' fp8={lay.fp8.value}' if lay.fp8 else ''}"),
        (f"  device memory per rank: {fmt_bytes(gpu_bytes)} of {fmt_bytes(plan.cluster.usable_memory_bytes)} usable "
         f"({fmt_bytes(acc.memory_bytes)} less a {plan.cluster.memory_reserve:.0%} reserve); offloaded per rank: "
         f"cpu {fmt_bytes(plan.memory.tiers.cpu)}, nvme {fmt_bytes(plan.memory.tiers.nvme)}"),
        f"  {_tiers_line(plan)}",
        (f"  batch: global {lay.global_batch} = dp {lay.dp} x micro-batch {lay.micro_batch} x m "
         f"{lay.microbatches}, seq {lay.seq} ({fmt_count(lay.global_batch * lay.seq)} tokens/step)"),
        *(f"  planner warning: {w}" for w in plan.warnings),
    ]  # fmt: skip
    return EmittedConfig(config=config, summary=tuple(summary), not_emitted=tuple(not_emitted))


def write_config(path: str | Path, plan: Plan, *, command: str) -> Path:
    """Write ``emit_config(plan)`` to ``path`` (parent folders created) and return the path.

    Args:
        path: the YAML file to write.
        plan: the plan to emit.
        command: the producing ``v17 plan`` arguments as one shell-quoted string (recorded in a comment).
    """
    text = emit_config(plan).to_yaml(command)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return out


__all__ = ["COMMAND_PREFIX", "STRATEGY_CLASS", "EmittedConfig", "emit_config", "recorded_command", "strategy_section",
           "write_config"]
