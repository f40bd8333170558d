"""DeepSpeed JSON compatibility: :func:`from_deepspeed_config` reads a DeepSpeed config (dict or path) into the
frozen policies of :mod:`lightning_v17.config`, naming every key it cannot honour. Torch-free.
"""

from __future__ import annotations

from typing import Any

from lightning_v17.config.enums import Precision
from lightning_v17.config.errors import V17ConfigError
from lightning_v17.config.mesh_spec import _check_positive_int
from lightning_v17.config.policies import LossScalePolicy, OffloadPolicy, TrainingPolicy, ZeroPolicy

__all__ = ["DEEPSPEED_NO_EFFECT_KEYS", "DEEPSPEED_SUPPORTED_KEYS", "from_deepspeed_config"]


#: DeepSpeed keys that from_deepspeed_config maps (dotted paths). Anything else is listed in one warning.
DEEPSPEED_SUPPORTED_KEYS: frozenset[str] = frozenset({
    "zero_optimization.stage",
    "zero_optimization.reduce_bucket_size",
    "zero_optimization.offload_optimizer.device",
    "zero_optimization.offload_optimizer.nvme_path",
    "zero_optimization.offload_optimizer.ratio",
    "zero_optimization.offload_optimizer.buffer_count",
    "zero_optimization.offload_param.device",
    "zero_optimization.offload_param.nvme_path",
    "bf16.enabled",
    "fp16.enabled",
    "fp16.initial_scale_power",
    "fp16.loss_scale_window",
    "fp16.hysteresis",
    "fp16.min_loss_scale",
    "fp16.loss_scale",
    "gradient_clipping",
    "gradient_accumulation_steps",
    "train_micro_batch_size_per_gpu",
    "train_batch_size",
})  # fmt: skip

#: DeepSpeed keys that are read but have no effect here, with the reason; named in one warning when set.
DEEPSPEED_NO_EFFECT_KEYS: dict[str, str] = {
    "zero_optimization.overlap_comm": "overlap is ZeroPolicy(overlap_comm=...), on by default (FSDP2's streams on "
    "GPUs, async work on gloo's threads on CPU; bitwise the same results either way)",
    "zero_optimization.contiguous_gradients": "gradient buckets are contiguous by construction",
    "activation_checkpointing.partition_activations": "DeepSpeed's partitioning of checkpointed activations across "
    "model-parallel ranks is not implemented; recompute is V17Strategy(activation_checkpointing=...)",
    "steps_per_print": "DeepSpeed's own progress printing; Lightning's logger and progress bar report here",
    "wall_clock_breakdown": "DeepSpeed's own timers; use lightning_v17.callbacks.ThroughputMonitor",
    "zero_allow_untested_optimizer": "DeepSpeed's own optimizer allow-list; any torch optimizer runs here",
    "zero_optimization.offload_optimizer.pin_memory": "V17 pins nothing for the optimizer tier: it steps CPU "
    "parameters (accelerator parameters are refused with an optimizer offload in this version)",
    "zero_optimization.offload_param.pin_memory": "V17 pins offloaded parameters exactly when CUDA is available "
    "(FSDP2 CPUOffloadPolicy); pinning needs an accelerator",
    "zero_optimization.offload_param.buffer_count": "the nvme parameter tier reads ahead prefetch_units units "
    "(forward and backward) and offload_optimizer.buffer_count - 1 chunks in the step; set ZeroPolicy(prefetch_units=...)",
    "zero_optimization.offload_param.ratio": "parameters are offloaded whole (no partial parameter offload)",
}


def _flatten_keys(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flatten_keys(v, key + "."))
        else:
            out[key] = v
    return out


def from_deepspeed_config(config: dict[str, Any] | str | Any) -> TrainingPolicy:
    """Map a DeepSpeed JSON config (a dict, or a path to a .json file) onto a :class:`TrainingPolicy`.

    Mapped keys: ``zero_optimization.stage`` -> ``zero.stage``; ``zero_optimization.reduce_bucket_size`` (elements,
    fp32 assumed) -> ``zero.bucket_mb``; ``zero_optimization.offload_{optimizer,param}.{device,nvme_path}`` ->
    ``offload``; ``offload_optimizer.ratio`` / ``.buffer_count`` -> ``offload.optimizer_ratio`` / ``.buffer_count``
    (``pin_memory`` is read without effect); ``bf16.enabled`` -> precision "bf16-mixed"; ``fp16.enabled`` -> "16-mixed" with
    ``fp16.{initial_scale_power, loss_scale_window, hysteresis, min_loss_scale}`` -> :class:`LossScalePolicy`
    (init_scale = 2**initial_scale_power, growth_interval = loss_scale_window); ``gradient_clipping`` ->
    ``gradient_clipping``; ``gradient_accumulation_steps``; ``train_micro_batch_size_per_gpu`` -> ``micro_batch_size`` and
    ``train_batch_size`` (both checked against the real batch by V17Strategy). Keys read without effect
    (:data:`DEEPSPEED_NO_EFFECT_KEYS`, e.g. ``overlap_comm``) are named with the reason in one warning.
    "auto" values (Hugging Face's convention) mean "not set here". Every other key is named in ONE ``UserWarning``,
    never silently dropped.

    Raises:
        V17ConfigError: for an unreadable file, a non-dict config, bf16 and fp16 both enabled, a static fp16
            ``loss_scale`` (not supported) or invalid values.
    """
    import json
    import os
    import warnings

    if isinstance(config, (str, os.PathLike)):
        try:
            with open(config) as f:
                config = json.load(f)
        except (OSError, json.JSONDecodeError) as err:
            raise V17ConfigError(f"config={str(config)!r}: cannot read the DeepSpeed JSON config ({err})") from err
    if not isinstance(config, dict):
        raise V17ConfigError(f"config must be a DeepSpeed config dict or a path to a .json file, got {type(config)}")

    flat = {k: v for k, v in _flatten_keys(config).items() if v != "auto"}
    known = DEEPSPEED_SUPPORTED_KEYS | DEEPSPEED_NO_EFFECT_KEYS.keys()
    unknown = sorted(k for k in flat if k not in known)
    no_effect = [f"{k} ({why})" for k, why in DEEPSPEED_NO_EFFECT_KEYS.items() if flat.get(k)]
    if no_effect:
        warnings.warn(f"DeepSpeed config keys without effect here: {'; '.join(no_effect)}", UserWarning, stacklevel=2)
    if unknown:
        warnings.warn(
            f"DeepSpeed config keys not supported by lightning-v17 (ignored): {', '.join(unknown)}",
            UserWarning,
            stacklevel=2,
        )

    zero_kw: dict[str, Any] = {}
    if "zero_optimization.stage" in flat:
        zero_kw["stage"] = flat["zero_optimization.stage"]
    if "zero_optimization.reduce_bucket_size" in flat:
        zero_kw["bucket_mb"] = float(flat["zero_optimization.reduce_bucket_size"]) * 4 / 2**20
    paths = {flat.get(f"zero_optimization.{k}.nvme_path") for k in ("offload_optimizer", "offload_param")} - {None}
    if len(paths) > 1:
        raise V17ConfigError(
            f"zero_optimization.offload_optimizer.nvme_path and offload_param.nvme_path differ ({sorted(paths)}); V17 "
            "keeps both nvme tiers under one nvme_path (each rank in its own folder): give the same directory"
        )
    offload = OffloadPolicy(
        optimizer=flat.get("zero_optimization.offload_optimizer.device", "none"),
        params=flat.get("zero_optimization.offload_param.device", "none"),
        nvme_path=flat.get("zero_optimization.offload_optimizer.nvme_path")
        or flat.get("zero_optimization.offload_param.nvme_path"),
        optimizer_ratio=flat.get("zero_optimization.offload_optimizer.ratio", 1.0),
        buffer_count=flat.get("zero_optimization.offload_optimizer.buffer_count", OffloadPolicy.buffer_count),
    )

    bf16 = bool(flat.get("bf16.enabled", False))
    fp16 = bool(flat.get("fp16.enabled", False))
    if bf16 and fp16:
        raise V17ConfigError("config enables both bf16.enabled and fp16.enabled; enable at most one")
    precision = Precision.BF16_MIXED if bf16 else Precision.FP16_MIXED if fp16 else None
    loss_scale = None
    if fp16:
        if flat.get("fp16.loss_scale", 0) not in (0, 0.0):
            raise V17ConfigError(
                f"fp16.loss_scale={flat['fp16.loss_scale']} (a static scale) is not supported; set fp16.loss_scale=0 "
                "for dynamic loss scaling"
            )
        loss_scale = LossScalePolicy(
            init_scale=2.0 ** float(flat.get("fp16.initial_scale_power", 16)),
            growth_interval=int(flat.get("fp16.loss_scale_window", 1000)),
            hysteresis=int(flat.get("fp16.hysteresis", 2)),
            min_scale=float(flat.get("fp16.min_loss_scale", 1.0)),
        )

    clip = flat.get("gradient_clipping")
    if clip is not None and (not isinstance(clip, (int, float)) or clip < 0):
        raise V17ConfigError(f"gradient_clipping={clip!r} must be a number >= 0 (0 disables clipping)")
    accum = flat.get("gradient_accumulation_steps")
    if accum is not None:
        _check_positive_int("gradient_accumulation_steps", accum)
    micro = flat.get("train_micro_batch_size_per_gpu")
    if micro is not None:
        _check_positive_int("train_micro_batch_size_per_gpu", micro)
    global_batch = flat.get("train_batch_size")
    if global_batch is not None:
        _check_positive_int("train_batch_size", global_batch)
    return TrainingPolicy(
        zero=ZeroPolicy(**zero_kw),
        offload=offload,
        train_batch_size=global_batch,
        loss_scale=loss_scale,
        gradient_clipping=float(clip) if clip else None,
        gradient_accumulation_steps=accum,
        micro_batch_size=micro,
        precision=precision,
    )
