"""V17Strategy's constructor arguments -> one frozen :class:`~lightning_v17.config.TrainingPolicy`, parsed once.

Precedence is given > config > default, decided by whether an option was given, never by comparing it with its
default: the options a DeepSpeed JSON config (``config=``) can also set default to None ("not given"), so
``V17Strategy(zero_stage=3, config={... "stage": 2 ...})`` trains at stage 3, and the config's stage 2 applies when
``zero_stage`` is left out. The Lightning CLI passes every argument, defaults included, which is why "given" cannot
be read from the call. A policy object (``zero=ZeroPolicy(...)``, for Python users; never together with the flat
arguments it covers) is given as a whole: it wins over the config's section.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from lightning_v17.config import (
    FP8Policy,
    OffloadPolicy,
    PipelinePolicy,
    Recompute,
    Tier,
    TrainingPolicy,
    V17ConfigError,
    ZeroPolicy,
)
from lightning_v17.deepspeed_config import from_deepspeed_config

#: The options a DeepSpeed config can also set: their constructor default is None ("not given"), and this is the
#: value they take when neither the argument nor the config gives one.
FROM_CONFIG: dict[str, Any] = {
    "zero_stage": 3, "activation_checkpointing": "none", "bucket_mb": 25.0, "offload_optimizer": "none",
    "offload_params": "none", "offload_optimizer_ratio": 1.0,
}  # fmt: skip
#: Constructor defaults of the other options a policy object also covers (a clash check, not a precedence rule).
DEFAULTS: dict[str, Any] = {
    "reshard_after_forward": None, "wrap_classes": (), "optimizer_partition": "auto", "nvme_path": None,
    "pp_schedule": "1f1b", "microbatches": 4, "virtual_stages": 1, "pp_split_points": None, "overlap_comm": True,
    "prefetch_units": 1,
}  # fmt: skip
#: The flat arguments each policy object covers.
POLICY_OPTIONS: dict[str, tuple[str, ...]] = {
    "zero": ("zero_stage", "reshard_after_forward", "bucket_mb", "wrap_classes", "optimizer_partition",
             "overlap_comm", "prefetch_units"),
    "offload": ("offload_optimizer", "offload_params", "nvme_path", "offload_optimizer_ratio"),
    "pipeline": ("pp_schedule", "microbatches", "virtual_stages", "pp_split_points"),
}


def _is_default(name: str, value: Any) -> bool:
    """Whether a flat argument was left as the constructor has it (not given)."""
    if name in FROM_CONFIG:
        return value is None
    default = DEFAULTS[name]
    if isinstance(default, tuple) or default is None and name == "pp_split_points":
        return not value
    return value == default


def build_policy(given: dict[str, Any]) -> TrainingPolicy:
    """Parse the constructor's arguments (``locals()`` of ``V17Strategy.__init__``) into a TrainingPolicy.

    Raises:
        V17ConfigError: a policy object and a flat argument it covers are both given, an unknown value, or an
            offload tier V17Strategy does not implement yet.
    """
    config = given["config"]
    for kind, names in POLICY_OPTIONS.items():
        clash = [n for n in names if given[kind] is not None and not _is_default(n, given[n])]
        if clash:
            raise V17ConfigError(f"give {clash} either inside {kind}=... or as arguments, not both")
    base = from_deepspeed_config(config) if config is not None else TrainingPolicy()

    def pick(name: str, from_config: Any) -> Any:
        """given > config > default (``base`` is the config's policy, or the defaults without a config)."""
        return from_config if given[name] is None else given[name]

    zero = given["zero"] or ZeroPolicy(
        stage=pick("zero_stage", base.zero.stage),
        reshard_after_forward=given["reshard_after_forward"],
        wrap_classes=tuple(given["wrap_classes"]) or base.zero.wrap_classes,
        bucket_mb=pick("bucket_mb", base.zero.bucket_mb),
        optimizer_partition=given["optimizer_partition"],
        overlap_comm=bool(given["overlap_comm"]),
        prefetch_units=given["prefetch_units"],
    )
    offload = given["offload"] or OffloadPolicy(
        optimizer=pick("offload_optimizer", base.offload.optimizer),
        params=pick("offload_params", base.offload.params),
        nvme_path=given["nvme_path"] or base.offload.nvme_path,
        optimizer_ratio=pick("offload_optimizer_ratio", base.offload.optimizer_ratio),
        buffer_count=base.offload.buffer_count,
        chunk_mb=base.offload.chunk_mb,
    )
    split = given["pp_split_points"]
    pipeline = given["pipeline"] or PipelinePolicy(
        schedule=given["pp_schedule"], microbatches=given["microbatches"], virtual_stages=given["virtual_stages"],
        split_points=tuple(split) if split else None,
    )  # fmt: skip
    if Tier.NVME in (offload.optimizer, offload.params):
        from lightning_v17.engine.nvme import check_nvme_path

        check_nvme_path(offload.nvme_path)  # exists and is writable: now, before any process starts
    recompute = Recompute.parse(pick("activation_checkpointing", base.recompute))
    _warn_inapplicable(given, zero, offload, recompute)
    tp_plan = given["tp_plan"]
    return replace(
        base,
        zero=zero,
        offload=offload,
        pipeline=pipeline,
        recompute=recompute,
        sequence_parallel=bool(given["sequence_parallel"]),
        vocab_parallel=bool(given["vocab_parallel"]),
        loss_parallel=bool(given["loss_parallel"]),
        tp_plan=dict(tp_plan) if tp_plan else None,
        fp8=build_fp8_policy(given),
    )


def build_fp8_policy(given: dict[str, Any]) -> FP8Policy | None:
    """``fp8``/``fp8_backend``/``fp8_skip``/``fp8_all_gather``/``fp8_amax_history_len`` -> one FP8Policy (None: fp8
    off). A DeepSpeed config has no FP8 section.

    ``fp8_backend='te'`` is checked against this machine now (no CUDA: it can never run here) and against the real
    device again when the model is parallelized (``engine.fp8.apply_fp8``).

    Raises:
        V17ConfigError: an unknown recipe/backend, ``fp8_backend``/``fp8_skip``/``fp8_all_gather``/
            ``fp8_amax_history_len`` without fp8, ``fp8_backend='te'`` without a CUDA GPU.
    """
    import torch

    from lightning_v17.engine.fp8 import resolve_fp8_backend

    policy = FP8Policy.from_options(
        given["fp8"], given["fp8_backend"], given["fp8_skip"], given["fp8_all_gather"], given["fp8_amax_history_len"]
    )
    if policy is not None and not torch.cuda.is_available():
        resolve_fp8_backend(policy, "cpu")  # raises for 'te' here; 'auto' resolves to torchao on CPU
    return policy


def _warn_inapplicable(given: dict[str, Any], zero: ZeroPolicy, offload: OffloadPolicy, recompute: Recompute) -> None:
    """One warning per option that was set but cannot apply to this configuration (never silently ignored)."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_warn

    notes = []
    if zero.shards_params:
        notes += [f"{n}={given[n]!r} applies to zero_stage 0-2 (FSDP2 reduces per unit at stage 3)"
                  for n in ("bucket_mb", "optimizer_partition") if not _is_default(n, given[n])]  # fmt: skip
    else:
        notes += [f"{n} applies to zero_stage=3 only (stages 0-2 keep whole parameters)"
                  for n in ("reshard_after_forward", "prefetch_units") if not _is_default(n, given[n])]  # fmt: skip
    if given["pp"] == 1:
        notes += [f"{n}={given[n]!r} applies only with pp > 1"
                  for n in ("pp_schedule", "microbatches", "virtual_stages") if not _is_default(n, given[n])]  # fmt: skip
    if not _is_default("wrap_classes", given["wrap_classes"]) and not zero.shards_params and recompute == Recompute.NONE:
        notes.append("wrap_classes names the ZeRO-3 units and the recompute blocks; neither is in use here")
    if given["nvme_path"] and Tier.NVME not in (offload.optimizer, offload.params):
        notes.append(f"nvme_path={given['nvme_path']!r} applies only to an 'nvme' offload tier (none is set)")
    if given.get("checkpoint_io") is not None:
        notes.append("checkpoint_io: V17Strategy writes sharded DCP checkpoint directories itself (engine/checkpoint.py)")
    for note in notes:
        rank_zero_warn(f"V17Strategy: {note}; it is ignored here")


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
