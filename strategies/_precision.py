"""V17Strategy's precision glue: the DeepSpeed config's bf16/fp16 block, FSDP2 mixed-precision dtypes, and the
precision-plugin subclass with sharding-aware clipping and fp16 inf check (as Lightning's ``FSDPPrecision``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType

from lightning_v17.config import LossScalePolicy
from lightning_v17.config import Precision as V17Precision
from lightning_v17.engine.precision import ShardedLossScaler
from lightning_v17.engine.precision.clip import clip_grad_norm_, clip_grad_value_
from lightning_v17.trackers import LossScaleTracker

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
        scaler = build_loss_scaler(strategy) if want.needs_scaler else None
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


class ShardedClipping:
    """Lightning's gradient clipping over sharded gradients, for any precision plugin this mixin is combined with.

    ``Precision.clip_grad_by_norm`` runs ``torch.nn.utils.clip_grad_norm_`` over the optimizer's parameters, which
    under ZeRO are this rank's shards: a per-shard norm (the classic bug). Here it is
    :func:`lightning_v17.engine.precision.clip.clip_grad_norm_`, one all-reduce of the squared norm over the shard group (and
    the pp stages, and the tp-sharded pieces). Lightning's own ``FSDPPrecision`` is the same kind of subclass.
    """

    _v17_strategy: V17Strategy

    def clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:
        params = list(self.main_params(optimizer))  # type: ignore[attr-defined]
        strategy = self._v17_strategy
        mesh, zero = strategy.mesh, strategy.zero
        clip_grad_norm_(
            params,
            clip_val,
            group=zero.shard_group,
            sharded=zero.grad_norm_over_shards,
            stage_group=mesh.group("pp") if mesh.spec.pp > 1 else None,
            tp_sharded=[zero.is_tp_sharded(p) for p in params] if mesh.spec.tp > 1 else None,
            tp_group=mesh.group("tp") if mesh.spec.tp > 1 else None,
        )


    def clip_grad_by_value(self, optimizer: Any, clip_val: float) -> None:
        clip_grad_value_(self.main_params(optimizer), clip_val)  # type: ignore[attr-defined]


class V17MixedPrecision(ShardedClipping, MixedPrecision):
    """``MixedPrecision`` ("bf16-mixed"/"16-mixed") with sharded clipping and, for fp16, the strategy's one
    :class:`ShardedLossScaler` (its inf check covers every rank's shards with one all-reduce, so ranks never disagree
    on skipping a step; torch's ``GradScaler`` checks only this rank's gradients)."""

    def clip_gradients(self, optimizer: Any, clip_val: float = 0.0, gradient_clip_algorithm: Any = None) -> None:
        if self.scaler is None:
            # bf16-mixed: no scaler, so nothing is unscaled before the step, and MixedPrecision's refusal to clip with
            # an optimizer that "unscales internally" (torch's fused AdamW, the optim library's default) does not
            # apply; it made the main job with precision="bf16-mixed" and gradient_clip_val fail at its first step.
            return Precision.clip_gradients(self, optimizer, clip_val, gradient_clip_algorithm or _NORM)
        return super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm or _NORM)


_NORM = GradClipAlgorithmType.NORM
_SUBCLASSES: dict[type, type] = {MixedPrecision: V17MixedPrecision}


def sharded_precision(strategy: V17Strategy, plugin: Precision) -> Precision:
    """The strategy's precision plugin: ``plugin`` as a subclass with :class:`ShardedClipping` (and, for
    "16-mixed", the sharded loss scaler), keeping everything else the plugin does.

    ``MixedPrecision`` becomes :class:`V17MixedPrecision`; any other plugin class (``Precision``, ``HalfPrecision``,
    ``DoublePrecision``, bitsandbytes, the user's own) gets a subclass of its own class with the mixin, made once per
    class, and keeps its state. Idempotent (Lightning runs setup again for validate/test after fit).
    """
    if isinstance(plugin, ShardedClipping):
        return plugin
    cls = type(plugin)
    sub = _SUBCLASSES.get(cls)
    if sub is None:
        sub = _SUBCLASSES[cls] = type(f"V17{cls.__name__}", (ShardedClipping, cls), {"__doc__": ShardedClipping.__doc__})
    # The subclass adds methods only (no __init__ of its own), so the instance keeps its state under its new class.
    plugin.__class__ = sub
    plugin._v17_strategy = strategy  # type: ignore[attr-defined]
    scaler = getattr(plugin, "scaler", None)
    if scaler is not None and not isinstance(scaler, ShardedLossScaler):
        plugin.scaler = build_loss_scaler(strategy, like=scaler)  # type: ignore[attr-defined]
    return plugin


def loss_scale(strategy: V17Strategy) -> Any:
    """The fp16 loss scale as a float32 tensor on the root device (the pipeline schedule scales its losses by it),
    or None without a scaler."""
    scaler = getattr(strategy.precision_plugin, "scaler", None)
    if scaler is None or not scaler.is_enabled():
        return None
    return torch.tensor(float(scaler.get_scale()), dtype=torch.float32, device=strategy.root_device)
