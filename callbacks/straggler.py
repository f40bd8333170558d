"""``StragglerDetector``: a Lightning adapter over :mod:`lightning_v17.trackers.straggler`."""

from __future__ import annotations

import os
import socket
import time
import warnings
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_v17.config import V17ConfigError
from lightning_v17.trackers.straggler import StragglerReport, StragglerTracker

__all__ = ["TEST_SLEEP_ENV", "StragglerDetected", "StragglerDetector"]

#: TEST-ONLY knob: ``V17_TEST_STRAGGLER_SLEEP="rank:seconds"`` makes that rank ``time.sleep(seconds)`` in the data
#: path of every training batch (at the start of ``on_train_batch_start``, i.e. after the batch's sync point and
#: before the batch starts: a slow input pipeline or host), to create a real straggler on real ranks in tests.
#: Never set it in production.
TEST_SLEEP_ENV = "V17_TEST_STRAGGLER_SLEEP"


class StragglerDetected(RuntimeError):
    """Raised by ``StragglerDetector(action="raise")`` so an elastic launcher can restart without the slow ranks.

    Attributes:
        ranks: the flagged global ranks.
        hosts: their host names.
        report: the full :class:`StragglerReport` of the window that flagged them.
    """

    def __init__(self, report: StragglerReport) -> None:
        self.report = report
        self.ranks = report.flagged
        self.hosts = report.flagged_hosts
        super().__init__(
            f"straggler ranks {list(self.ranks)} on hosts {list(self.hosts)} stayed slower than the median for "
            f"the last windows; restart without them (e.g. torchrun --max-restarts with the node excluded).\n"
            + report.table()
        )


def _parse_test_sleep(value: str | None, rank: int) -> float:
    if not value:
        return 0.0
    try:
        target, seconds = value.split(":")
        return float(seconds) if int(target) == rank else 0.0
    except ValueError as err:
        raise V17ConfigError(f"{TEST_SLEEP_ENV}={value!r} must look like 'rank:seconds', e.g. '1:0.05'") from err


class StragglerDetector(Callback):
    """Flags ranks that stay slower than the others (design §15.3, §15.9 "straggler 방치: throughput 전체 ↓").

    Each rank times every training batch: ``data wait`` (wall time from the start of the batch fetch to the start of
    the batch: fetching and moving the batch; taken from Lightning's profiler hook around the fetch, so the per-batch
    sigterm broadcast before it, a sync point, is excluded), ``step`` (wall time of the batch) and ``local`` = data wait + forward compute
    time (up to ``on_before_backward``). ``local`` is the work a rank does before its first gradient collective under
    DDP / ZeRO-1/2, which is what differs between ranks in synchronous training (the wall step time is equalized by
    the collectives, see the tracker). The forward is timed as compute, not wall time: on CPU the main thread's CPU
    time (``time.thread_time``), so a rank that the OS merely deschedules for a while (co-tenants on a shared host)
    is not mistaken for a slow one; on CUDA with CUDA events on the current stream (host-side wall time would only
    see kernel launches). Every ``every_n_steps`` batches ONE ``all_gather`` brings the window's timings of all ranks
    together; every rank then computes the same statistics (quantiles, median, MAD, see the tracker) and therefore
    takes the same decision, so ``action="raise"`` raises on all ranks at once and never leaves one blocked in a
    collective. Under ZeRO-3 / TP the forward itself all-gathers, so there the forward time is equalized too and only
    the data-path part separates ranks.

    The per-rank table (rank, host, step p50/p90, local score, data-wait share, ratio to the others) is printed by
    rank 0 whenever a rank is over the threshold. Logged every window: ``straggler/max_ratio``,
    ``straggler/flagged``.

    Args:
        every_n_steps: batches per window (one all_gather per window).
        threshold: a rank is over when its window score (the ``score_quantile`` of its ``local`` times) exceeds
            ``threshold`` x the median of the other ranks' scores (leave-one-out; see the tracker).
        patience: consecutive over-windows before a rank is flagged and ``action`` runs.
        action: ``"warn"`` (a warning naming ranks and hosts), ``"raise"`` (raise :class:`StragglerDetected`, for an
            elastic launcher to restart without the node) or a callable taking the :class:`StragglerReport`.
        min_excess_s: never flag a rank less than this many seconds above the reference (timer noise floor).
        score_quantile: quantile of a rank's per-step ``local`` times that scores it (0.25: a rank must be slow on
            at least 3/4 of a window's steps; 0.5 = median).
        warmup_steps: batches ignored at the start (first-iteration allocation and dataloader start-up).
    """

    def __init__(
        self,
        every_n_steps: int = 20,
        threshold: float = 1.2,
        patience: int = 3,
        action: str | Callable[[StragglerReport], Any] = "warn",
        min_excess_s: float = 0.005,
        warmup_steps: int = 5,
        score_quantile: float = 0.25,
    ) -> None:
        if not isinstance(every_n_steps, int) or every_n_steps < 2:
            raise V17ConfigError(f"every_n_steps={every_n_steps!r} must be an integer >= 2 (p50/p90 need samples)")
        if not (callable(action) or action in ("warn", "raise")):
            raise V17ConfigError(f"action={action!r} must be 'warn', 'raise' or a callable taking the report")
        try:
            self.tracker = StragglerTracker(
                threshold=threshold, patience=patience, min_excess_s=min_excess_s, score_quantile=score_quantile
            )
        except ValueError as err:
            raise V17ConfigError(f"StragglerDetector: {err}") from err
        self.every_n_steps = every_n_steps
        self.action = action
        self.warmup_steps = max(0, int(warmup_steps))
        self.reports: list[StragglerReport] = []  # every window's report (small: one per window)
        self.flag_events: list[StragglerReport] = []
        self._rows: list[tuple[float, float, Any]] = []  # (step_s, data_wait_s, forward timing)
        self._hosts: list[str] = []
        self._seen = 0
        self._t_prev_end: float | None = None
        self._t_start = 0.0
        self._data_wait = 0.0
        self._fwd: float | tuple[Any, Any] | None = None
        self._cpu_start = 0.0
        self._ev_start: Any = None
        self._t_fetch: float | None = None
        self._profiler: Any = None
        self._test_sleep_s = 0.0

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._test_sleep_s = _parse_test_sleep(os.environ.get(TEST_SLEEP_ENV), trainer.global_rank)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        host = socket.gethostname()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            hosts: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(hosts, host)  # once per fit, not per window
            self._hosts = [str(h) for h in hosts]
        else:
            self._hosts = [host]
        self._t_prev_end = None
        self._rows.clear()
        self._seen = 0
        self._hook_fetch_start(trainer)

    def _hook_fetch_start(self, trainer: pl.Trainer) -> None:
        """Timestamp the start of each batch fetch through the profiler hook Lightning calls around it.

        Lightning (>= 2.5) broadcasts a sigterm flag at the top of every training batch, a sync point, and then
        fetches the batch inside ``profiler.start/stop("[_TrainingEpochLoop].train_dataloader_next")``. Timing the
        data wait from that ``start`` excludes the broadcast's wait, which belongs to the *other* ranks' lateness.
        """
        profiler = trainer.profiler
        if "start" in vars(profiler):  # already hooked (a second fit with the same trainer)
            return
        original = profiler.start
        detector = self

        def start(action_name: str) -> None:
            if action_name.endswith("train_dataloader_next"):
                detector._t_fetch = time.perf_counter()
            original(action_name)

        profiler.start = start  # instance attribute; removed in teardown
        self._profiler = profiler

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._profiler is not None:
            vars(self._profiler).pop("start", None)
            self._profiler = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int):
        if self._test_sleep_s:
            # TEST-ONLY (see TEST_SLEEP_ENV): a slow batch fetch on this rank, after the fetch starts and before `now`
            time.sleep(self._test_sleep_s)
        now = time.perf_counter()
        begin = self._t_fetch if self._t_fetch is not None else self._t_prev_end
        self._data_wait = now - begin if begin is not None else 0.0
        self._t_fetch = None
        self._t_start = now
        self._fwd = None
        if trainer.strategy.root_device.type == "cuda":
            self._ev_start = torch.cuda.Event(enable_timing=True)
            self._ev_start.record()
        else:
            self._cpu_start = time.thread_time()

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if self._fwd is not None:  # gradient accumulation: only the first micro-batch precedes the first collective
            return
        if trainer.strategy.root_device.type == "cuda":
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._fwd = (self._ev_start, end)  # resolved at the window's end, when the events have completed
        else:
            self._fwd = time.thread_time() - self._cpu_start

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = time.perf_counter()
        step_s = now - self._t_start
        self._t_prev_end = now
        self._seen += 1
        if self._seen > self.warmup_steps:
            self._rows.append((step_s, self._data_wait, self._fwd))
            if len(self._rows) >= self.every_n_steps:
                self._end_window(trainer, pl_module)
                # the gather and the reporting are not part of the next batch's data wait
                self._t_prev_end = time.perf_counter()

    @staticmethod
    def _seconds(fwd: float | tuple[Any, Any] | None, step_s: float) -> float:
        if fwd is None:  # no backward this batch (e.g. training_step returned None): the whole step is local
            return step_s
        if isinstance(fwd, tuple):
            start, end = fwd
            end.synchronize()
            return start.elapsed_time(end) / 1e3  # ms -> s
        return fwd

    def _end_window(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        rows, self._rows = self._rows, []
        table = [(step_s, wait + self._seconds(fwd, step_s), wait) for step_s, wait, fwd in rows]
        step, local_s, wait = self._gather(trainer, table)
        report = self.tracker.update(step, local_s, wait, hosts=self._hosts or None, step=trainer.global_step)
        self.reports.append(report)
        self._after_window(trainer, pl_module, report)

    def _gather(self, trainer: pl.Trainer, rows: list[tuple[float, float, float]]):
        local = torch.tensor(rows, dtype=torch.float64, device=trainer.strategy.root_device)  # [n, 3]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            out = [torch.empty_like(local) for _ in range(dist.get_world_size())]
            dist.all_gather(out, local)  # the ONE collective per window
            allr = torch.stack(out).cpu()
        else:
            allr = local.cpu().unsqueeze(0)
        return allr[..., 0].tolist(), allr[..., 1].tolist(), allr[..., 2].tolist()

    def _after_window(self, trainer: pl.Trainer, pl_module: pl.LightningModule, report: StragglerReport) -> None:
        max_ratio = max(s.ratio for s in report.ranks)
        if trainer.logger is not None:
            trainer.logger.log_metrics(
                {"straggler/max_ratio": max_ratio, "straggler/flagged": float(len(report.flagged))},
                step=trainer.global_step,
            )
        if any(s.over for s in report.ranks):
            rank_zero_info(report.table())
        if not report.flagged:
            return
        self.flag_events.append(report)
        if self.action == "raise":
            raise StragglerDetected(report)
        if self.action == "warn":
            if trainer.global_rank == 0:
                warnings.warn(
                    f"straggler ranks {list(report.flagged)} on {list(report.flagged_hosts)} were over "
                    f"{self.tracker.threshold}x the median for {self.tracker.patience} windows\n{report.table()}",
                    stacklevel=2,
                )
            return
        self.action(report)

    def state_dict(self) -> dict[str, Any]:
        return self.tracker.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.tracker.load_state_dict(state_dict)
