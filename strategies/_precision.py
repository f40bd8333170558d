"""V17Strategy's precision glue: the DeepSpeed config's bf16/fp16 block, FSDP2 mixed-precision dtypes, and the
sharding-aware clipping and fp16 inf check patched into Lightning's precision plugin."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision

from lightning_v17.config import LossScalePolicy
from lightning_v17.config import Precision as V17Precision
from lightning_v17.engine.clip import clip_grad_norm_
from lightning_v17.engine.trackers.loss_scale import LossScaleTracker, ShardedLossScaler

if TYPE_CHECKING:
    from lightning_v17.strategies.v17 import V17Strategy


def apply_config_precision(strategy: V17Strategy) -> None:
    """A DeepSpeed config's bf16/fp16 block applies only if the Trainer was left at the default 32-true.

    fp16 gets the strategy's one loss scaler (:func:`build_loss_scaler`) from the start, so nothing swaps it later.
    """
    want = strategy.policy.precision
    if want is None or type(strategy.precision_plugin) is not Precision:
        return
    if want in (V17Precision.BF16_MIXED, V17Precision.FP16_MIXED):
        scaler = build_loss_scaler(strategy) if want == V17Precision.FP16_MIXED else None
        strategy.precision_plugin = MixedPrecision(want.value, device=strategy.root_device.type, scaler=scaler)


def build_loss_scaler(strategy: V17Strategy, like: Any = None) -> ShardedLossScaler:
    """The strategy's one fp16 loss scaler: a :class:`ShardedLossScaler` over the policy's :class:`LossScalePolicy`.

    The policy comes from the DeepSpeed config's fp16 block (``initial_scale_power``, ``loss_scale_window``,
    ``hysteresis``, ``min_loss_scale``) when there is one. Otherwise, when the user's precision plugin brought a
    ``torch.amp.GradScaler`` (``like``), its init scale, growth/backoff factors and interval carry over, with
    ``hysteresis=1`` as GradScaler has. The ``DynamicLossScaling`` callback later *configures* this scaler (its
    policy, skip accounting) instead of installing another one.
    """
    policy = strategy.policy.loss_scale
    if policy is None and like is not None and like.is_enabled():
        policy = LossScalePolicy(
            init_scale=float(like.get_scale()),
            growth_factor=float(like.get_growth_factor()),
            backoff_factor=float(like.get_backoff_factor()),
            growth_interval=int(like.get_growth_interval()),
            min_scale=min(1.0, float(like.get_scale())),
        )
    return ShardedLossScaler(LossScaleTracker(policy or LossScalePolicy()))


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
      gradients ranks could disagree on skipping a step and diverge silently. When Lightning built one (the user's
      ``precision="16-mixed"``) it is replaced, once, by the strategy's :func:`build_loss_scaler`, which checks
      every shard with one all-reduce over the world and honours ``hysteresis`` and ``min_loss_scale``.
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
    if isinstance(plugin, MixedPrecision) and plugin.scaler is None:
        # bf16-mixed: no scaler, so nothing is unscaled before the step, and Lightning's refusal to clip with an
        # optimizer that "unscales internally" (torch's fused AdamW, the optim library's default) does not apply;
        # it made the main job with precision="bf16-mixed" and gradient_clip_val fail at its first step.
        plugin.clip_gradients = functools.partial(Precision.clip_gradients, plugin)  # type: ignore[method-assign]
    scaler = getattr(plugin, "scaler", None)
    if scaler is not None and not isinstance(scaler, ShardedLossScaler):
        plugin.scaler = build_loss_scaler(strategy, like=scaler)


def loss_scale(strategy: V17Strategy) -> Any:
    """The fp16 loss scale as a float32 tensor on the root device (the pipeline schedule scales its losses by it),
    or None without a scaler."""
    scaler = getattr(strategy.precision_plugin, "scaler", None)
    if scaler is None or not scaler.is_enabled():
        return None
    return torch.tensor(float(scaler.get_scale()), dtype=torch.float32, device=strategy.root_device)
