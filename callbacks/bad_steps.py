"""``BadStepGuard``: a Lightning adapter over :mod:`lightning_v17.trackers.bad_steps`."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from enum import StrEnum
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from lightning_v17.config import V17ConfigError
from lightning_v17.trackers.bad_steps import BadStepError, BadStepTracker, BadStepVerdict

__all__ = ["SKIP_FILE", "BadStepAction", "BadStepError", "BadStepGuard", "BadStepRollback", "read_skip_file"]

log = logging.getLogger(__name__)

#: Name of the JSON file, next to the checkpoints, that lists the batches a rollback must skip on the next attempt.
SKIP_FILE = "bad_steps.json"


class BadStepAction(StrEnum):
    """What ``patience`` consecutive bad steps lead to."""

    SKIP = "skip"
    ROLLBACK = "rollback"


class BadStepRollback(RuntimeError):
    """Raised on every rank at once by ``BadStepGuard(action="rollback")``: restart from the last checkpoint.

    The process exits non-zero; an elastic launcher (``torchrun --max-restarts N``) restarts it, the script calls
    ``trainer.fit(..., ckpt_path="last")``, and the guard then skips the batches listed in ``skip_file``.

    Attributes:
        offending: ``(epoch, batch_idx)`` of the batches that will be skipped.
        skip_file: the JSON file that records them.
    """

    def __init__(self, message: str, offending: list[tuple[int, int]], skip_file: Path) -> None:
        super().__init__(message)
        self.offending = offending
        self.skip_file = skip_file


def _noop_step(*args: Any, **kwargs: Any) -> None:
    return None


def read_skip_file(path: str | Path) -> dict[str, Any]:
    """The rollback record (``{"skip_batches": [[epoch, batch_idx], ...], "events": [...]}``); empty if absent."""
    path = Path(path)
    if not path.exists():
        return {"skip_batches": [], "events": []}
    return json.loads(path.read_text())


def _json_float(x: float | None) -> float | str | None:
    return x if x is None or math.isfinite(x) else str(x)


class BadStepGuard(Callback):
    """Skips, or rolls back over, steps whose loss is NaN/inf or spikes above a multiple of its running median.

    Every step the guard takes the step's loss (from ``on_before_backward``, summed over gradient-accumulation
    micro-batches, divided by the fp16 loss scale when there is one), and in ``on_before_optimizer_step`` (after
    backward, before the optimizer touches anything) ONE all-reduce (MAX, a single float64; NaN counts as +inf) gives
    every rank the same number, so every rank's :class:`BadStepTracker` takes the same decision. Then:

    * a withheld step (triggered, or non-finite whatever the patience) is not applied: every gradient the optimizers
      hold is set to ``None``, which torch optimizers treat as "no update" (no parameter, moment, step-count or weight
      decay change); as in ``DynamicLossScaling``, step-interval LR schedulers are held for this batch and the step is
      taken back off ``global_step``, so ``max_steps`` counts applied steps;
    * ``action="skip"``: the run continues with the next batch;
    * ``action="rollback"``: rank 0 appends the offending ``(epoch, batch_idx)`` to ``<dirpath>/bad_steps.json``,
      all ranks barrier (the file exists before any rank exits) and raise :class:`BadStepRollback`. Under an
      elastic launcher the job restarts; ``fit(ckpt_path="last")`` loads the newest complete checkpoint and the guard
      skips the recorded batches (their optimizer step is withheld as above) when the loop reaches them again.

    Launch requirement for ``rollback``: run under ``torchrun --max-restarts N`` (or SLURM's requeue) and call
    ``trainer.fit(model, datamodule, ckpt_path="last")``; keep a checkpoint callback (``AsyncCheckpoint`` or
    ``ModelCheckpoint``) whose ``dirpath`` is shared by all ranks. Batches are named ``(epoch, batch_idx)``, which
    stays the same across a resume when the data resumes mid-epoch at the same position (``PackedDataModule``) or
    when checkpoints fall on epoch boundaries. With ``patience > 1`` the spikes before the trigger were applied; the
    rollback goes to the newest complete checkpoint, which may postdate the start of the streak (keep several with
    ``keep_last`` and point ``ckpt_path`` at an older one if so).

    Each event is logged by rank 0 (logger ``lightning_v17.callbacks.bad_steps``, WARNING) and as metrics
    ``bad_steps/withheld`` and ``bad_steps/events`` (cumulative), ``bad_steps/median_loss``. ``events`` holds one
    dict per triggered or withheld step. Under ``pp > 1`` the strategy runs backward inside the schedule and
    Lightning's ``on_before_backward`` is not called; V17Strategy hands the guard the step's loss (the last stage's,
    the same on every pp rank) through :meth:`on_pipeline_loss` right after the schedule, before the optimizer step.

    Args:
        spike_factor: a loss above ``spike_factor`` x the running median of the good losses is a spike.
        window: good losses the median is taken over.
        patience: consecutive bad steps that trigger ``action``.
        action: ``"skip"`` or ``"rollback"``.
        min_history: good losses seen before spikes are detected (NaN/inf are detected from the first step).
        max_consecutive_bad: this many bad steps in a row raises :class:`BadStepError` (None: never).
        dirpath: where ``bad_steps.json`` lives; None: the ``dirpath`` of the trainer's first checkpoint callback.
    """

    def __init__(
        self,
        spike_factor: float = 3.0,
        window: int = 100,
        patience: int = 1,
        action: str = "skip",
        min_history: int = 10,
        max_consecutive_bad: int | None = 50,
        dirpath: str | None = None,
    ) -> None:
        try:
            self.action = BadStepAction(action)
        except ValueError as err:
            raise V17ConfigError(f"BadStepGuard(action={action!r}) must be 'skip' or 'rollback'") from err
        try:
            self.tracker = BadStepTracker(
                spike_factor=spike_factor,
                window=window,
                patience=patience,
                min_history=min(min_history, window),
                max_consecutive_bad=max_consecutive_bad,
            )
        except ValueError as err:
            raise V17ConfigError(f"BadStepGuard: {err}") from err
        self.dirpath = Path(dirpath) if dirpath is not None else None
        self.skip_batches: set[tuple[int, int]] = set()
        self.events: list[dict[str, Any]] = []
        self.withheld_this_batch = False  # read by GoodputMonitor (a withheld step is not useful time)
        self.withheld_steps = 0
        self._trainer: pl.Trainer | None = None
        self._batch: tuple[int, int] = (0, 0)
        self._loss: float | None = None
        self._decided: BadStepVerdict | None | bool = False
        self._forced = False
        self._muted: list[Any] = []
        self._warned_no_loss = False

    # -- setup --------------------------------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._trainer = trainer

    def _resolve_dir(self, trainer: pl.Trainer) -> Path | None:
        if self.dirpath is not None:
            return self.dirpath
        for cb in trainer.checkpoint_callbacks:
            d = getattr(cb, "dirpath", None)
            if d:
                return Path(d)
        return None

    @property
    def skip_file(self) -> Path | None:
        d = self._resolve_dir(self._trainer) if self._trainer is not None else self.dirpath
        return d / SKIP_FILE if d is not None else None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # After the checkpoint restore (ModelCheckpoint has resolved its dirpath by now).
        self._trainer = trainer
        path = self.skip_file
        if self.action is BadStepAction.ROLLBACK and path is None:
            raise V17ConfigError(
                "BadStepGuard(action='rollback') needs a checkpoint to roll back to: add AsyncCheckpoint(dirpath=...) "
                "or ModelCheckpoint(dirpath=...) to the callbacks, or pass BadStepGuard(dirpath=...)"
            )
        # Only a resumed attempt (from a checkpoint, or a torchrun restart, which may precede the first checkpoint)
        # takes the record: a fresh run in a reused directory must not skip an older run's batches.
        resumed = trainer.ckpt_path is not None or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0
        if path is not None and self.action is BadStepAction.ROLLBACK and resumed:
            record = read_skip_file(path)
            self.skip_batches |= {(int(e), int(b)) for e, b in record.get("skip_batches", [])}
            if self.skip_batches and trainer.is_global_zero:
                log.warning(
                    "BadStepGuard: resumed at global_step %d after a rollback; batches (epoch, batch_idx) %s will be "
                    "skipped (recorded in %s)",
                    trainer.global_step,
                    sorted(self.skip_batches),
                    path,
                )

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._unmute()

    # -- per step -----------------------------------------------------------------------------------------------
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int):
        self._batch = (int(trainer.current_epoch), int(batch_idx))
        self._loss = None
        self._decided = False
        self._forced = self._batch in self.skip_batches
        self.withheld_this_batch = False

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        value = float(loss.detach().float().sum())
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None and getattr(scaler, "is_enabled", lambda: False)():
            value /= float(scaler.get_scale())  # MixedPrecision hands this hook the fp16-scaled loss
        self._loss = value if self._loss is None else self._loss + value

    def on_pipeline_loss(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        """V17Strategy's hook for ``pp > 1`` (``strategies/_pipeline.py``): the loss of a step whose forward and
        backward the pipeline schedule ran (unscaled), in place of ``on_before_backward``."""
        value = float(loss.detach().float().sum())
        self._loss = value if self._loss is None else self._loss + value

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if self._decided is False:  # once per batch; further optimizers reuse the decision
            self._decided = self._decide(trainer)
        verdict = self._decided
        if self._forced or (isinstance(verdict, BadStepVerdict) and verdict.withhold):
            self._withhold(trainer, optimizer)

    def _global_loss(self, trainer: pl.Trainer) -> float | None:
        local = -math.inf if self._loss is None else self._loss
        if not math.isfinite(local) and local != -math.inf:
            local = math.inf  # NaN -> +inf so that MAX is well defined on every backend
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            t = torch.tensor([local], dtype=torch.float64, device=trainer.strategy.root_device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the ONE collective per step
            local = float(t.item())
        return None if local == -math.inf else local

    def _decide(self, trainer: pl.Trainer) -> BadStepVerdict | None:
        loss = self._global_loss(trainer)
        if self._forced:
            self._event(trainer, "skipped (recorded by a rollback)", loss, None, [self._batch])
            return None
        if loss is None:
            if not self._warned_no_loss and trainer.is_global_zero:
                log.warning("BadStepGuard saw no loss this step (pp > 1, or training_step returned None): inactive")
            self._warned_no_loss = True
            return None
        verdict = self.tracker.observe(loss, batch_id=list(self._batch))
        if not verdict.withhold:
            return verdict
        offending = [tuple(b) for b in verdict.offending] or [self._batch]
        if verdict.triggered and self.action is BadStepAction.ROLLBACK:
            self._rollback(trainer, verdict, offending)
        what = (
            "skipped" if verdict.triggered else f"skipped (non-finite, {verdict.consecutive}/{self.tracker.patience})"
        )
        self._event(trainer, what, loss, verdict, offending)
        return verdict

    def _event(
        self,
        trainer: pl.Trainer,
        what: str,
        loss: float | None,
        verdict: BadStepVerdict | None,
        offending: list[tuple[int, int]],
    ) -> dict[str, Any]:
        event = {
            "action": what,
            "epoch": self._batch[0],
            "batch_idx": self._batch[1],
            "global_step": int(trainer.global_step),
            "loss": _json_float(loss),
            "median": None if verdict is None else verdict.median,
            "reason": "recorded" if verdict is None else verdict.reason,
            "offending": [list(b) for b in offending],
            "time": time.time(),
        }
        self.events.append(event)
        if trainer.is_global_zero:
            log.warning(
                "BadStepGuard: step %d (epoch %d, batch %d) %s: loss %s, running median %s, reason %s",
                event["global_step"],
                event["epoch"],
                event["batch_idx"],
                what,
                loss,
                event["median"],
                event["reason"],
            )
        return event

    def _rollback(self, trainer: pl.Trainer, verdict: BadStepVerdict, offending: list[tuple[int, int]]) -> None:
        path = self.skip_file
        assert path is not None  # checked in on_train_start
        event = self._event(trainer, "rollback", verdict.loss, verdict, offending)
        # All ranks are alive and agree: finish (publish) an in-flight async save first, so "the last complete
        # checkpoint" the restart loads is the newest one taken before this step (AsyncCheckpoint.on_train_end waits
        # for its in-flight write and publishes it, a collective every rank reaches here).
        from lightning_v17.callbacks.async_checkpoint import AsyncCheckpoint

        for cb in trainer.checkpoint_callbacks:
            if isinstance(cb, AsyncCheckpoint):
                cb.on_train_end(trainer, trainer.lightning_module)
        if trainer.is_global_zero:
            record = read_skip_file(path)
            skip = {tuple(b) for b in record.get("skip_batches", [])} | set(offending)
            record["skip_batches"] = sorted([list(b) for b in skip])
            record.setdefault("events", []).append(event)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(record, indent=1))
            os.replace(tmp, path)  # atomic: a restart never reads half a file
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()  # the record is on disk before any rank exits (torchrun then kills the others)
        raise BadStepRollback(
            f"BadStepGuard: {verdict.consecutive} bad step(s) (last loss {verdict.loss}, running median "
            f"{verdict.median}, reason {verdict.reason}) at global_step {trainer.global_step}; rolling back to the "
            f"last complete checkpoint. Batches (epoch, batch_idx) {offending} are recorded in {path} and will be "
            "skipped when the job restarts with fit(ckpt_path='last') under an elastic launcher "
            "(torchrun --max-restarts N)",
            offending,
            path,
        )

    def _withhold(self, trainer: pl.Trainer, optimizer: Any) -> None:
        """Make this optimizer step a no-op: torch optimizers skip every parameter whose ``grad`` is None."""
        opt = getattr(optimizer, "_optimizer", optimizer)
        for group in opt.param_groups:
            for p in group["params"]:
                p.grad = None
        if self.withheld_this_batch:
            return
        self.withheld_this_batch = True
        self.withheld_steps += 1
        if trainer.lightning_module.automatic_optimization:
            for config in trainer.lr_scheduler_configs:
                if config.interval == "step" and not config.reduce_on_plateau:
                    config.scheduler.step = _noop_step  # instance attribute, popped in on_train_batch_end
                    self._muted.append(config.scheduler)

    def _unmute(self) -> None:
        for scheduler in self._muted:
            scheduler.__dict__.pop("step", None)
        self._muted.clear()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.withheld_this_batch:
            self._unmute()
            if not self._loss_scaler_skipped(trainer):
                self._uncount_optimizer_step(trainer, pl_module)
        verdict = self._decided
        median = verdict.median if isinstance(verdict, BadStepVerdict) else None
        metrics = {
            "bad_steps/withheld": float(self.withheld_steps),
            "bad_steps/events": float(self.tracker.events),
        }
        if median is not None:
            metrics["bad_steps/median_loss"] = float(median)
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, rank_zero_only=True)

    @staticmethod
    def _loss_scaler_skipped(trainer: pl.Trainer) -> bool:
        # DynamicLossScaling takes its own skipped step back off global_step: do not take it off twice.
        from lightning_v17.callbacks.loss_scaling import DynamicLossScaling

        return any(isinstance(cb, DynamicLossScaling) and cb._skipped_this_batch for cb in trainer.callbacks)

    @staticmethod
    def _uncount_optimizer_step(trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from lightning_v17.callbacks.loss_scaling import DynamicLossScaling

        DynamicLossScaling._uncount_optimizer_step(trainer, pl_module)  # the one place that knows Lightning's counters

    # -- checkpoint ---------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"tracker": self.tracker.state_dict(), "skip_batches": sorted([list(b) for b in self.skip_batches])}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.tracker.load_state_dict(state_dict.get("tracker", {}))
        self.skip_batches |= {(int(e), int(b)) for e, b in state_dict.get("skip_batches", [])}
