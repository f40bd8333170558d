"""V17Strategy's precision glue: the DeepSpeed config's bf16/fp16 block, FSDP2 mixed-precision dtypes, and the
sharding-aware clipping and fp16 inf check patched into Lightning's precision plugin."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.utilities.distributed import _distributed_is_initialized
from lightning.pytorch.plugins.precision import MixedPrecision, Precision

from lightning_v17.config import Precision as V17Precision
from lightning_v17.engine.clip import clip_grad_norm_

if TYPE_CHECKING:
    from lightning_v17.strategies.v17 import V17Strategy


def apply_config_precision(strategy: V17Strategy) -> None:
    """A DeepSpeed config's bf16/fp16 block applies only if the Trainer was left at the default 32-true."""
    want = strategy.policy.precision
    if want is None or type(strategy.precision_plugin) is not Precision:
        return
    if want in (V17Precision.BF16_MIXED, V17Precision.FP16_MIXED):
        scaler = None
        if want == V17Precision.FP16_MIXED:
            ls = strategy.policy.loss_scale
            scaler = torch.amp.GradScaler(
                strategy.root_device.type,
                **({} if ls is None else {"init_scale": ls.init_scale, "growth_interval": ls.growth_interval,
                                          "backoff_factor": ls.backoff_factor, "growth_factor": ls.growth_factor}),
            )  # fmt: skip
        strategy.precision_plugin = MixedPrecision(want.value, device=strategy.root_device.type, scaler=scaler)


def mixed_precision_dtypes(plugin: Any) -> tuple[torch.dtype | None, torch.dtype | None]:
    """(param_dtype, reduce_dtype) for FSDP2's MixedPrecisionPolicy (stage 3) and the stage 0-2 reductions.

    "bf16-mixed"/"16-mixed": compute in bf16/fp16, reduce gradients in fp32, the sharded fp32 parameter is the
    master. Stages 0-2 keep fp32 parameters and rely on Lightning's autocast (the precision plugin), so their
    gradients are fp32 already. "bf16-true": the plugin converts the module; nothing to add.
    """
    p = getattr(plugin, "precision", "32-true")
    if p == "bf16-mixed":
        return torch.bfloat16, torch.float32
    if p == "16-mixed":
        return torch.float16, torch.float32
    return None, None


def patch_precision_plugin(strategy: V17Strategy) -> None:
    """Route Lightning's clipping and fp16 inf checks through sharding-aware code.

    * ``Precision.clip_grad_by_norm`` runs ``torch.nn.utils.clip_grad_norm_`` over the optimizer's parameters,
      which under ZeRO are this rank's shards: a per-shard norm (the classic bug). We replace it on this plugin
      instance with :func:`lightning_v17.engine.clip.clip_grad_norm_` (one all-reduce of the squared norm).
    * ``MixedPrecision``'s ``GradScaler`` checks for inf/nan only in this rank's gradients, so with sharded
      gradients ranks could disagree on skipping a step and diverge silently. We swap in FSDP's
      ``ShardedGradScaler`` (same scale settings), which all-reduces ``found_inf`` over the world.
    """
    plugin = strategy.precision_plugin

    def clip_grad_by_norm(optimizer: Any, clip_val: float) -> None:
        params = list(plugin.main_params(optimizer))
        mesh, zero = strategy.mesh, strategy.zero
        clip_grad_norm_(
            params,
            clip_val,
            group=zero.shard_group,
            sharded=zero.grads_are_sharded(),
            stage_group=mesh.group("pp") if mesh.spec.pp > 1 else None,
            tp_sharded=[zero.is_tp_sharded(p) for p in params] if mesh.spec.tp > 1 else None,
            tp_group=mesh.group("tp") if mesh.spec.tp > 1 else None,
        )

    plugin.clip_grad_by_norm = clip_grad_by_norm  # type: ignore[method-assign]
    scaler = getattr(plugin, "scaler", None)
    if scaler is not None and _distributed_is_initialized():
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        if not isinstance(scaler, ShardedGradScaler):
            plugin.scaler = ShardedGradScaler(
                device=strategy.root_device.type,
                init_scale=scaler.get_scale() if scaler.is_enabled() else 2.0**16,
                growth_factor=scaler.get_growth_factor(),
                backoff_factor=scaler.get_backoff_factor(),
                growth_interval=scaler.get_growth_interval(),
                enabled=scaler.is_enabled(),
            )


def loss_scale(strategy: V17Strategy) -> Any:
    """The fp16 GradScaler's current scale (initialized on first use), or None without a scaler."""
    scaler = getattr(strategy.precision_plugin, "scaler", None)
    if scaler is None or not scaler.is_enabled():
        return None
    if scaler._scale is None:  # GradScaler allocates its scale lazily in scale(); the schedule scales instead
        scaler._lazy_init_scale_growth_tracker(strategy.root_device)
    return scaler._scale.to(device=strategy.root_device, dtype=torch.float32)
