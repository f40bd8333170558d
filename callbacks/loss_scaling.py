"""``DynamicLossScaling``: a Lightning adapter over :mod:`lightning_v17.trackers.loss_scale`."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_v17.config import LossScalePolicy, Precision, V17ConfigError
from lightning_v17.engine.precision import ShardedLossScaler
from lightning_v17.trackers import LossScaleError, LossScaleTracker

__all__ = ["DynamicLossScaling", "LossScaleError"]


def _noop_step(*args: Any, **kwargs: Any) -> None:
    return None


class DynamicLossScaling(Callback):
    """Dynamic fp16 loss scaling that checks every shard on every rank and never counts a skipped step.

    How it plugs in: use it with ``precision="16-mixed"`` (fp16 autocast over fp32 master weights, the only fp16
    mode with master weights; design §12.4). At ``on_fit_start`` (after the strategy's own setup) it replaces the
    precision plugin's ``torch.amp.GradScaler`` with a :class:`ShardedLossScaler`; under ``V17Strategy``, which
    already runs one built from its policy, it configures that scaler (this callback's options win) instead of
    adding another. Lightning's own AMP path
    (``MixedPrecision.pre_backward`` / ``optimizer_step``) calls it in the right order: scale the loss before
    backward, **unscale after the closure and before** ``on_before_optimizer_step`` **and gradient clipping** (so
    the clip norm is not S times too large), then step (skipped on overflow) and update. The inf/NaN check reads
    the grads of the optimizer's ``param_groups`` (plain tensors, DTensor shards via ``to_local()``, ZeRO-1/2 shard
    tensors) and uses ONE all-reduce over the world per step.

    A skipped step advances neither ``global_step`` nor a step-interval LR scheduler. Lightning increments the
    optimizer-step progress (which *is* ``global_step``) and steps the schedulers unconditionally after
    ``optimizer_step``; so when the scaler skips, this callback makes each step-interval scheduler's ``step`` a
    no-op for that batch and, in ``on_train_batch_end`` (which runs before ``ModelCheckpoint``'s), takes the step
    back off the progress counters. ``max_steps`` therefore counts applied steps. (In manual optimization the user
    steps schedulers; only ``global_step`` is corrected.)

    On CPU, Lightning turns ``precision="16-mixed"`` into bf16 with a warning; to train fp16 on CPU pass
    ``plugins=[MixedPrecision("16-mixed", "cpu")]`` (the tests do).

    With ``bf16-*`` (or fp32) precision there is nothing to scale: it warns once and does nothing. ``16-true`` has no
    fp32 master weights and is refused with a pointer to ``16-mixed``.

    The scale and counters live in this callback's ``state_dict`` and are saved in and restored from checkpoints.
    Logged: ``loss_scale/scale``, ``loss_scale/skipped_steps``, ``loss_scale/overflow_rate``.

    Args:
        init_scale: starting scale S.
        growth_factor: S <- S * growth_factor after ``growth_interval`` consecutive overflow-free steps.
        backoff_factor: S <- S * backoff_factor on an overflow.
        growth_interval: overflow-free steps before the scale grows (DeepSpeed's ``loss_scale_window``).
        hysteresis: overflows tolerated before backing off (DeepSpeed's ``hysteresis``).
        min_scale: backing off below this raises :class:`LossScaleError` naming the likely cause.
        max_consecutive_skips: this many skipped steps in a row raises :class:`LossScaleError` (the loop never spins
            forever on a model that produces NaN).
        log: log the scale, skip count and overflow rate every step.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        hysteresis: int = 1,
        min_scale: float = 1.0,
        max_consecutive_skips: int = 50,
        log: bool = True,
    ) -> None:
        # Validation with user-facing messages lives in the shared policy (one definition of each option).
        self.policy = LossScalePolicy(
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            hysteresis=hysteresis,
            min_scale=min_scale,
            max_consecutive_skips=max_consecutive_skips,
        )
        self.tracker = LossScaleTracker(self.policy)
        self.log_metrics = log
        self.active = False
        self.scaler: ShardedLossScaler | None = None
        self._trainer: pl.Trainer | None = None
        self._skipped_this_batch = False
        self._muted_schedulers: list[Any] = []

    # -- setup --------------------------------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        plugin = trainer.precision_plugin
        precision = str(getattr(plugin, "precision", ""))
        known = Precision.lookup(precision)  # None for Lightning's 64-true and 16-true, which have no member here
        if (known is not None and not known.needs_scaler) or precision in ("64-true", "64"):
            rank_zero_warn(
                f"DynamicLossScaling does nothing with precision={precision!r}: only fp16 needs loss scaling "
                "(bf16 has fp32's exponent range, design §12.1)."
            )
            self.active = False
            return
        if precision == "16-true":
            raise V17ConfigError(
                "DynamicLossScaling needs fp32 master weights: use precision='16-mixed' instead of '16-true'"
            )
        if known is None or not hasattr(plugin, "scaler"):
            raise V17ConfigError(
                f"DynamicLossScaling supports precision='16-mixed' with a plugin that owns a GradScaler; got "
                f"precision={precision!r} with {type(plugin).__name__}"
            )
        self.scaler = ShardedLossScaler(self.tracker, on_skip=self._on_skip)
        self._trainer = trainer
        self.active = True

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # After strategy.setup(): V17Strategy has installed its one ShardedLossScaler by now; configure that one (our
        # policy and skip accounting) instead of adding a second scaler. Other strategies keep Lightning's
        # GradScaler, which ours replaces.
        if not (self.active and self.scaler is not None):
            return
        current = getattr(trainer.precision_plugin, "scaler", None)
        if isinstance(current, ShardedLossScaler):
            strategy_policy = current.tracker.policy
            if strategy_policy != self.policy and strategy_policy != LossScalePolicy():
                rank_zero_warn(
                    f"DynamicLossScaling's options ({self.policy}) replace the strategy's loss-scale policy "
                    f"({strategy_policy}, e.g. from the DeepSpeed config's fp16 block); drop one of them to silence this"
                )
            current.configure(self.tracker, on_skip=self._on_skip)
            self.scaler = current
        else:
            trainer.precision_plugin.scaler = self.scaler  # MixedPrecision now calls scale/unscale_/step/update on ours

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._unmute_schedulers()

    # -- per step -----------------------------------------------------------------------------------------------
    def _on_skip(self) -> None:
        """Called by the scaler inside ``optimizer_step`` when it skips: hold back the LR schedulers for this batch."""
        self._skipped_this_batch = True
        trainer = self._trainer
        if trainer is None or not trainer.lightning_module.automatic_optimization:
            return
        for config in trainer.lr_scheduler_configs:
            if config.interval == "step" and not config.reduce_on_plateau:
                # Instance attribute shadows the class method for this batch only (removed in on_train_batch_end).
                config.scheduler.step = _noop_step
                self._muted_schedulers.append(config.scheduler)

    def _unmute_schedulers(self) -> None:
        for scheduler in self._muted_schedulers:
            scheduler.__dict__.pop("step", None)
        self._muted_schedulers.clear()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int):
        self._skipped_this_batch = False

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self.active:
            return
        if self._skipped_this_batch:
            self._unmute_schedulers()
            self._uncount_optimizer_step(trainer, pl_module)
            self._skipped_this_batch = False
        if self.log_metrics:
            t = self.tracker
            pl_module.log_dict(
                {
                    "loss_scale/scale": float(t.scale),
                    "loss_scale/skipped_steps": float(t.skipped_steps),
                    "loss_scale/overflow_rate": float(t.overflow_rate),
                },
                on_step=True,
                on_epoch=False,
                rank_zero_only=True,
            )

    @staticmethod
    def _uncount_optimizer_step(trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # global_step is the optimizer-step progress counter (training_epoch_loop.global_step); Lightning increments
        # ready/completed around LightningModule.optimizer_step whether or not the scaler skipped.
        epoch_loop = trainer.fit_loop.epoch_loop
        if pl_module.automatic_optimization:
            progress = epoch_loop.automatic_optimization.optim_progress.optimizer.step
        else:
            progress = epoch_loop.manual_optimization.optim_step_progress
        for tracker in (progress.total, progress.current):
            tracker.ready = max(0, tracker.ready - 1)
            tracker.completed = max(0, tracker.completed - 1)

    # -- checkpoint ---------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return self.tracker.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.tracker.load_state_dict(state_dict)
