"""V17Strategy's arguments -> one frozen :class:`~lightning_v17.config.TrainingPolicy`, parsed once.

Precedence is given > config > default, decided by whether an argument was given (not None), never by comparing it
with its default: ``V17Strategy(zero_stage=3, config={... "stage": 2 ...})`` trains at stage 3, and the config's
stage 2 applies when ``zero_stage`` is left out. The Lightning CLI passes every argument, defaults included, which is
why "given" cannot be read from the call. A policy object (``zero=ZeroPolicy(...)``) is given as a whole: it wins over
the config's section, fields left at their defaults included. A policy may also be the dict of its fields (the YAML
spelling, what ``yaml.safe_load`` of a ``configs/`` file gives).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields, replace
from enum import Enum
from pathlib import Path
from typing import Any, TypeVar

from lightning_v17.config import (
    CPPolicy,
    EPPolicy,
    FP8Policy,
    OffloadPolicy,
    ParallelDims,
    PipelinePolicy,
    Recompute,
    Tier,
    TPPolicy,
    TrainingPolicy,
    V17ConfigError,
    ZeroPolicy,
)
from lightning_v17.config.deepspeed import from_deepspeed_config

P = TypeVar("P")
Fields = Mapping[str, Any]  # a policy as the dict of its fields (the YAML spelling)


def axis_size(value: Any, cls: type, option: str) -> int:
    """The size an axis argument gives: the int itself, or its policy's ``size`` (a dict in YAML)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    policy = axis_policy(value, cls, option)
    assert policy is not None
    return policy.size  # type: ignore[attr-defined]


def axis_policy(value: Any, cls: type[P], option: str) -> P | None:
    """The policy an axis argument gives; None for a plain size (not given: the config's, else the defaults)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return None
    if not isinstance(value, (cls, Mapping)):
        raise V17ConfigError(f"{option}={value!r} must be a positive integer (its size) or {cls.__name__}(size=...)")
    return as_policy(value, cls, option)


def as_policy(value: Any, cls: type[P], option: str) -> P | None:
    """``value`` as a ``cls``: the object itself, or built from the dict of its fields; None stays None (not given).

    Raises:
        V17ConfigError: a key that is not a field of ``cls``, or a value of another type.
    """
    if value is None or isinstance(value, cls):
        return value
    if isinstance(value, Mapping):
        names = [f.name for f in fields(cls)]  # type: ignore[arg-type]
        unknown = sorted(set(value) - set(names))
        if unknown:
            raise V17ConfigError(f"{option}: {unknown} not fields of {cls.__name__}; its fields are {names}")
        return cls(**value)
    raise V17ConfigError(f"{option}={value!r} must be {cls.__name__}(...) or the dict of its fields")


def build_policy(
    *,
    zero_stage: int | None,
    activation_checkpointing: str | None,
    tp: int | TPPolicy | Fields,
    pp: int | PipelinePolicy | Fields,
    cp: int | CPPolicy | Fields,
    ep: int | EPPolicy | Fields,
    zero: ZeroPolicy | Fields | None,
    offload: OffloadPolicy | Fields | None,
    fp8: FP8Policy | str | Fields | None,
    config: str | Path | Fields | None,
) -> TrainingPolicy:
    """Parse ``V17Strategy``'s policy arguments (each as the user gave it, None: not given) into a TrainingPolicy.

    Raises:
        V17ConfigError: ``zero_stage`` together with ``zero=``, an unknown value, or an nvme tier whose
            ``nvme_path`` is missing or unwritable.
    """
    base = from_deepspeed_config(config) if config is not None else TrainingPolicy()
    objs = {  # the policies given (None: not given)
        "zero": as_policy(zero, ZeroPolicy, "zero"),
        "offload": as_policy(offload, OffloadPolicy, "offload"),
        "pp": axis_policy(pp, PipelinePolicy, "pp"),
        "tp": axis_policy(tp, TPPolicy, "tp"),
        "cp": axis_policy(cp, CPPolicy, "cp"),
        "ep": axis_policy(ep, EPPolicy, "ep"),
    }
    zero_policy = objs["zero"]
    if zero_policy is not None and zero_stage is not None:
        raise V17ConfigError(
            f"zero_stage={zero_stage!r} and zero=ZeroPolicy(stage={zero_policy.stage}, ...) both set the ZeRO stage; "
            "give the stage once: inside zero=ZeroPolicy(stage=...), or zero_stage= alone"
        )
    if zero_policy is None:
        zero_policy = base.zero if zero_stage is None else replace(base.zero, stage=zero_stage)
    offload_policy = objs["offload"] or base.offload
    if Tier.NVME in (offload_policy.optimizer, offload_policy.params, offload_policy.activations):
        from lightning_v17.engine.offload.nvme import check_nvme_path

        check_nvme_path(offload_policy.nvme_path)  # exists and is writable: now, before any process starts
    if offload_policy.activations == Tier.CPU:
        from lightning_v17.engine.offload.activations import check_activation_tier

        check_activation_tier(offload_policy.activations)  # CUDA only: refused here, now
    policy = replace(
        base,
        zero=zero_policy,
        offload=offload_policy,
        pipeline=replace(objs["pp"] or base.pipeline, size=axis_size(pp, PipelinePolicy, "pp")),
        tensor_parallel=replace(objs["tp"] or base.tensor_parallel, size=axis_size(tp, TPPolicy, "tp")),
        context=replace(objs["cp"] or base.context, size=axis_size(cp, CPPolicy, "cp")),
        expert=replace(objs["ep"] or base.expert, size=axis_size(ep, EPPolicy, "ep")),
        recompute=base.recompute if activation_checkpointing is None else Recompute.parse(activation_checkpointing),
        fp8=build_fp8_policy(fp8),
    )
    _warn_inapplicable(policy, objs, pp=policy.pipeline.size)
    return policy


def build_fp8_policy(fp8: Any) -> FP8Policy | None:
    """``fp8=`` -> one FP8Policy (a recipe string is ``FP8Policy(recipe=...)``; None/False: off). A DeepSpeed config
    has no FP8 section.

    ``backend='te'`` is checked against this machine now (no CUDA: it can never run here) and against the real
    device again when the model is parallelized (``engine.fp8.apply_fp8``).

    Raises:
        V17ConfigError: an unknown recipe/backend, ``backend='te'`` without a CUDA GPU.
    """
    if fp8 is None or fp8 is False:
        return None
    policy = FP8Policy(recipe=fp8) if isinstance(fp8, str) else as_policy(fp8, FP8Policy, "fp8")
    import torch

    from lightning_v17.engine.fp8.convert import resolve_fp8_backend

    if not torch.cuda.is_available():
        resolve_fp8_backend(policy, "cpu")  # raises for 'te' here; 'auto' resolves to torchao on CPU
    return policy


def parallel_dims(policy: TrainingPolicy, *, dp_replicate: int, dp_shard: int | str) -> ParallelDims:
    """The axis sizes, once: pp, cp, tp and ep read from ``policy`` (after the config's), validated now (a typo fails
    at construction, not after launch).

    Raises:
        V17ConfigError: a size that is not a positive integer, a bad ``dp_shard``, or an ``ep`` that a
            given ``dp_shard`` is not a multiple of.
    """
    return ParallelDims(pp=policy.pipeline.size, dp_replicate=dp_replicate, dp_shard=dp_shard,
                        cp=policy.context.size, tp=policy.tensor_parallel.size, ep=policy.expert.size)  # fmt: skip


def check_hang_timeout(hang_timeout: float | None) -> float | None:
    """``hang_timeout`` as given, once checked: a positive number of seconds, or None (no watchdog)."""
    if hang_timeout is not None and not hang_timeout > 0:
        raise V17ConfigError(f"hang_timeout={hang_timeout!r} must be a positive number of seconds, or None (off)")
    return hang_timeout


def _changed(policy: Any, cls: type) -> dict[str, Any]:
    """The fields of a given policy that differ from the policy's own defaults ({} when none was given)."""
    if policy is None:
        return {}
    default = cls()
    return {f.name: getattr(policy, f.name) for f in fields(cls) if getattr(policy, f.name) != getattr(default, f.name)}


def _show(name: str, value: Any) -> str:
    return f"{name}={(value.value if isinstance(value, Enum) else value)!r}"


def _warn_inapplicable(policy: TrainingPolicy, objs: Mapping[str, Any], *, pp: int) -> None:
    """One warning per option that was set but cannot apply to this configuration (never silently ignored): the
    fields of each given policy (``objs``) that differ from that policy's own defaults."""
    zero, offload = _changed(objs["zero"], ZeroPolicy), _changed(objs["offload"], OffloadPolicy)
    pipeline, context = _changed(objs["pp"], PipelinePolicy), _changed(objs["cp"], CPPolicy)
    expert = _changed(objs["ep"], EPPolicy)
    notes = []
    if policy.zero.shards_params:
        notes += [f"zero.{_show(n, zero[n])} applies to zero_stage 0-2 (FSDP2 reduces per unit at stage 3)"
                  for n in ("bucket_mb", "optimizer_partition") if n in zero]  # fmt: skip
    else:
        notes += [f"zero.{n} applies to zero_stage=3 only (stages 0-2 keep whole parameters)"
                  for n in ("reshard_after_forward", "prefetch_units") if n in zero]  # fmt: skip
    if pp == 1:
        notes += [f"pp.{_show(n, pipeline[n])} applies only with pp > 1"
                  for n in ("schedule", "microbatches", "virtual_stages") if n in pipeline]  # fmt: skip
    if policy.context.size == 1:
        notes += [f"cp.{_show(n, context[n])} applies only with cp > 1"
                  for n in ("mode", "balance", "chunks_per_rank") if n in context]  # fmt: skip
    if policy.expert.size == 1 and "dispatcher" in expert:
        notes.append(f"ep.{_show('dispatcher', expert['dispatcher'])} applies only with ep > 1")
    if policy.offload.activations == Tier.NONE:
        notes += [f"offload.{_show(n, offload[n])} applies only with offload.activations='nvme' or 'cpu'"
                  for n in ("activation_min_kb", "resident_blocks") if n in offload]  # fmt: skip
    if "wrap_classes" in zero and not policy.zero.shards_params and policy.recompute == Recompute.NONE:
        notes.append("zero.wrap_classes names the ZeRO-3 units and the recompute blocks; neither is in use here")
    if "nvme_path" in offload and Tier.NVME not in (policy.offload.optimizer, policy.offload.params,
                                                     policy.offload.activations):
        notes.append(f"offload.{_show('nvme_path', offload['nvme_path'])} applies only to an 'nvme' offload tier "
                     "(none is set)")  # fmt: skip
    for note in notes:
        _warn(note)


def warn_checkpoint_io(io: Any) -> None:
    """A ``CheckpointIO`` plugin given to the Trainer is not used: V17Strategy writes sharded checkpoints itself."""
    if io is not None:
        _warn("checkpoint_io: V17Strategy writes sharded DCP checkpoint directories itself (checkpoint/sharded.py)")


def _warn(note: str) -> None:
    from lightning.pytorch.utilities.rank_zero import rank_zero_warn

    rank_zero_warn(f"V17Strategy: {note}; it is ignored here")


def apply_config_to_trainer(policy: TrainingPolicy, trainer: Any) -> None:
    """A DeepSpeed config's ``gradient_clipping`` / ``gradient_accumulation_steps`` apply when the Trainer's
    ``gradient_clip_val`` is None / ``accumulate_grad_batches`` is 1 (its bf16/fp16 block: ``_precision.py``)."""
    if policy.gradient_clipping is not None and trainer.gradient_clip_val is None:
        trainer.gradient_clip_val = policy.gradient_clipping
    if policy.gradient_accumulation_steps and trainer.accumulate_grad_batches == 1:
        trainer.accumulate_grad_batches = policy.gradient_accumulation_steps


def check_first_batch(strategy: Any, batch: Any) -> bool:
    """:func:`check_batch_keys` against the first training batch when the config has batch keys; True once done."""
    from lightning_v17.strategies._pipeline import rows

    policy = strategy.policy
    if policy.micro_batch_size or policy.train_batch_size:
        trainer = strategy.lightning_module.trainer
        check_batch_keys(policy, rows=rows(batch), accumulate=trainer.accumulate_grad_batches, dp=strategy.mesh.spec.dp)
    return True


def check_batch_keys(policy: TrainingPolicy, *, rows: int, accumulate: int, dp: int) -> None:
    """The DeepSpeed batch keys against the first real training batch (in Lightning the DataLoader decides it).

    Raises:
        V17ConfigError: naming the key, the value Lightning actually uses, and the fix.
    """
    micro, total = policy.micro_batch_size, policy.train_batch_size
    if micro is not None and micro != rows:
        raise V17ConfigError(
            f"config train_micro_batch_size_per_gpu={micro} but the DataLoader gives {rows} rows per rank; in "
            "Lightning the DataLoader's batch_size decides: set it to the config's value, or drop the key"
        )
    if total is not None and total != rows * accumulate * dp:
        raise V17ConfigError(
            f"config train_batch_size={total} but this run steps on {rows} rows x accumulate_grad_batches="
            f"{accumulate} x {dp} data-parallel ranks = {rows * accumulate * dp}; the DataLoader's batch_size and "
            "the Trainer's accumulate_grad_batches decide: make them match, or drop the key"
        )
