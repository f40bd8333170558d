"""``GoodputMonitor``: a Lightning adapter over :mod:`lightning_v17.trackers.goodput`."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from lightning_v17.callbacks.throughput import CHECKPOINT_BLOCKING_ATTR

from lightning_v17.config import V17ConfigError
from lightning_v17.planner.resilience import expected_goodput
from lightning_v17.trackers.goodput import GoodputBreakdown, GoodputTracker

__all__ = ["PROGRESS_FILE", "GoodputMonitor"]

#: Name of the JSON file, next to the checkpoints, holding the run's goodput counters after its last finished step.
PROGRESS_FILE = "goodput.json"


def _restart_count() -> int:
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        return 0


class GoodputMonitor(Callback):
    """Reports goodput, useful step time over wall time, across restarts, with each loss shown separately.

    Useful time is the wall time of each training batch (``on_train_batch_start`` to ``on_train_batch_end``) whose
    update was applied. Over all attempts of a run it reports (metrics ``goodput/<name>``, every step; a table at
    the end of fit):

    * ``restart_s``: from the previous attempt's last finished step to this attempt's first step (failure detection,
      rendezvous, process start, checkpoint load);
    * ``redo_s``: steps the previous attempt finished after the checkpoint this attempt resumed from (they run again;
      the checkpoint stores the useful time it preserves, so the difference is exact);
    * ``checkpoint_s``: the loop blocked by saves (the cumulative ``checkpoint_blocking_s`` that ``AsyncCheckpoint``
      and ``ThroughputMonitor`` share);
    * ``bad_step_s``: batches whose update ``BadStepGuard`` withheld;
    * ``dropped_s``: with ``V17Strategy(fault_tolerance=FTPolicy(...))``, a batch the replica quorum did not commit
      (a peer group failed in it) and the wait until the survivors' next quorum, after which they train its samples
      again;
    * ``other_s``: the rest (data waits, validation, logging, the first attempt's setup).

    Rank 0 writes ``<dirpath>/goodput.json`` after every step (a few hundred bytes, atomically). An attempt continues
    the run's accounting from it when it resumed from a checkpoint this callback saved state into, or when it runs as
    a torchrun restart (``TORCHELASTIC_RESTART_COUNT > 0``); ``resume`` overrides that. With ``mtbf_hours`` the end
    of fit also prints the Young/Daly expected goodput (Young 1974; Daly 2006, see
    :func:`~lightning_v17.planner.resilience.expected_goodput`) for the measured checkpoint interval, blocking
    cost, restart time and the loop's own time between steps (``other_s``), next to the measured one; after
    failures it also prints the prediction for the MTBF the run saw (wall time per failure), which
    ``bench/goodput.py`` checks against a torchrun run with injected failures. Llama 3 (Dubey et al. 2024,
    §3.3.4) reports more than 90% effective training time with an interruption about every 3 hours on 16k GPUs:
    the scale this is for.

    Args:
        dirpath: where ``goodput.json`` lives; None: the ``dirpath`` of the trainer's first checkpoint callback
            (without either, goodput covers this attempt only).
        mtbf_hours: job mean time between failures, for the printed prediction.
        resume: continue the counters of ``goodput.json`` (True), start over (False), or decide as above (None).
        log: log the breakdown as metrics every step.
    """

    def __init__(
        self,
        dirpath: str | None = None,
        mtbf_hours: float | None = None,
        resume: bool | None = None,
        log: bool = True,
    ) -> None:
        if mtbf_hours is not None and not mtbf_hours > 0:
            raise V17ConfigError(f"GoodputMonitor(mtbf_hours={mtbf_hours!r}) must be > 0 hours")
        self.dirpath = Path(dirpath) if dirpath is not None else None
        self.mtbf_hours = mtbf_hours
        self.resume = resume
        self.log_metrics = log
        self.tracker = GoodputTracker()
        self.last: GoodputBreakdown | None = None
        self._ckpt_state: dict[str, Any] | None = None
        self._path: Path | None = None
        self._t0 = 0.0
        self._blocking_prev = 0.0
        self._dropped_end: float | None = None  # when the last uncommitted step ended (replica groups)

    # -- helpers ------------------------------------------------------------------------------------------------
    def _resolve_path(self, trainer: pl.Trainer) -> Path | None:
        d = self.dirpath
        if d is None:
            for cb in trainer.checkpoint_callbacks:
                if getattr(cb, "dirpath", None):
                    d = Path(cb.dirpath)
                    break
        return d / PROGRESS_FILE if d is not None else None

    @staticmethod
    def _blocking(trainer: pl.Trainer) -> float:
        total = float(getattr(trainer.strategy, CHECKPOINT_BLOCKING_ATTR, 0.0) or 0.0)
        for cb in trainer.callbacks:
            total += float(getattr(cb, CHECKPOINT_BLOCKING_ATTR, 0.0) or 0.0)
        return total

    def _take_blocking(self, trainer: pl.Trainer) -> None:
        total = self._blocking(trainer)
        if total > self._blocking_prev:
            self.tracker.add_checkpoint_blocking(total - self._blocking_prev)
        self._blocking_prev = total

    # -- hooks --------------------------------------------------------------------------------------------------
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # After the checkpoint restore: load_state_dict has run if the checkpoint held our state.
        self._path = self._resolve_path(trainer)
        previous = None
        resume = self.resume
        if resume is None:
            resume = self._ckpt_state is not None or _restart_count() > 0
        if resume and self._path is not None and self._path.exists():
            previous = json.loads(self._path.read_text())
        self.tracker = GoodputTracker()
        self.tracker.start_attempt(time.time(), previous=previous, checkpoint=self._ckpt_state)
        self._blocking_prev = self._blocking(trainer)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int):
        self._take_blocking(trainer)  # a save at the previous batch's end (checkpoint callbacks run after us)
        ft = getattr(trainer.strategy, "ft", None)
        if self._dropped_end is not None and ft is not None and ft.history:  # the quorum ran in batch_to_device
            self.tracker.add_dropped_wait(ft.history[-1]["quorum_time"] - self._dropped_end)
        self._dropped_end = None
        self.tracker.step_started(time.time())
        self._t0 = time.perf_counter()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        duration = time.perf_counter() - self._t0
        withheld = any(getattr(cb, "withheld_this_batch", False) for cb in trainer.callbacks)
        ft = getattr(trainer.strategy, "ft", None)
        dropped = ft is not None and not ft.committed
        now = time.time()
        self.tracker.step_finished(duration, now_s=now, step=trainer.global_step, useful=not withheld, dropped=dropped)
        self._dropped_end = now if dropped else None
        self.last = self.tracker.breakdown(now)
        if trainer.is_global_zero and self._path is not None:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self._path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(self.tracker.progress()))
            os.replace(tmp, self._path)  # atomic: a restart never reads half a file
        if self.log_metrics:
            pl_module.log_dict(self.last.metrics(), on_step=True, on_epoch=False, rank_zero_only=True)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._take_blocking(trainer)
        self.last = self.tracker.breakdown(time.time())
        lines = [f"GoodputMonitor: {self.last.table()}"]
        predicted = self.predicted_goodput()
        if predicted is not None:
            lines.append(f"  Young/Daly expected goodput for MTBF {self.mtbf_hours} h: {100 * predicted:.1f}%")
        if self.last.failures:  # the same model at the MTBF this run saw: wall time per failure
            mtbf_s = self.last.wall_s / self.last.failures
            observed = self.predicted_goodput(mtbf_s=mtbf_s)
            if observed is not None:
                lines.append(
                    f"  Young/Daly expected goodput for the observed MTBF {mtbf_s:.0f} s ({self.last.failures} "
                    f"failure(s)): {100 * observed:.1f}%, measured {100 * self.last.goodput:.1f}%"
                )
        rank_zero_info("\n".join(lines))

    def predicted_goodput(self, mtbf_s: float | None = None) -> float | None:
        """Young/Daly expected goodput for this run's measured interval, save and restart costs and loop overhead.

        Args:
            mtbf_s: the job's mean time between failures, seconds; None: ``mtbf_hours`` (None if that is unset too).
        """
        # useful_s and checkpoint_s cover every attempt of the run, so the save count must too (it used to be this
        # attempt's only, which stretched the interval by the number of attempts after a restart)
        saves = self.tracker.saves if self.tracker is not None else 0
        if mtbf_s is None and self.mtbf_hours is not None:
            mtbf_s = self.mtbf_hours * 3600.0
        if mtbf_s is None or saves == 0 or self.last is None:
            return None
        inputs = self.last.model_inputs(saves=saves)
        if inputs["interval_s"] <= 0:
            return None
        # overhead_s: the loop's own time between steps is in every interval's wall time but is not goodput
        return expected_goodput(
            interval_s=inputs["interval_s"],
            overhead_s=inputs["overhead_s"],
            checkpoint_s=inputs["checkpoint_s"],
            mtbf_s=mtbf_s,
            restart_s=inputs["restart_s"],
        )

    # -- checkpoint ---------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return self.tracker.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._ckpt_state = dict(state_dict) if state_dict else None
