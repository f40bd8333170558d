"""Goodput accounting across restarts: useful step time over wall time, with every loss shown separately.

Large runs are interrupted all the time (Llama 3, Dubey et al. 2024, §3.3.4: 419 unexpected interruptions in 54 days
on 16k GPUs, about one every 3 hours, with more than 90% effective training time). What a run loses splits into:

* ``restart_s``: wall time from the previous attempt's last progress to this attempt's first step (detection,
  rendezvous, process start, checkpoint load);
* ``redo_s``: steps that had completed but came after the checkpoint the run resumed from, so they ran again (their
  first execution is the loss; the re-execution is counted as useful);
* ``checkpoint_s``: seconds the loop was blocked by saves;
* ``bad_step_s``: steps whose update was withheld (``BadStepGuard``);
* ``dropped_s``: with replica groups (``FTPolicy``), a step the quorum did not commit because a peer group failed in
  it, and the wait from its end to the survivors' next quorum (they train its samples again);
* ``other_s``: the rest of the wall time (data waits between steps, validation, logging, the first attempt's setup).

``goodput = useful_s / wall_s``. :class:`GoodputTracker` takes explicit clock readings, so a synthetic timeline tests
it exactly, and carries its counters across processes as two small dicts: ``progress()`` (written by the callback
next to the checkpoints after every step) and ``state_dict()`` (saved *inside* each checkpoint: the useful time at
that checkpoint, which tells the next attempt how much completed work it must redo).

:func:`lightning_v17.planner.resilience.expected_goodput` is the model the planner's checkpoint intervals come from
(Young 1974; Daly 2006), to put the measured number next to the prediction; :meth:`GoodputBreakdown.model_inputs`
gives its inputs as measured.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["GoodputBreakdown", "GoodputTracker"]


@dataclass(frozen=True)
class GoodputBreakdown:
    """Where the wall time of a run went, in seconds, over all its attempts so far."""

    wall_s: float
    useful_s: float
    restart_s: float
    redo_s: float
    checkpoint_s: float
    bad_step_s: float
    dropped_s: float
    other_s: float
    goodput: float
    attempts: int
    step: int

    @property
    def failures(self) -> int:
        """Failures the run recovered from: every attempt after the first."""
        return max(0, self.attempts - 1)

    def model_inputs(self, *, saves: int) -> dict[str, float]:
        """The per-interval inputs of :func:`~lightning_v17.planner.resilience.expected_goodput` measured by this
        breakdown, given the run's ``saves`` (its checkpoints that blocked the loop, over all attempts).

        ``interval_s`` (τ): useful seconds per save; ``overhead_s`` (o): the loop's other seconds and withheld steps
        per save; ``checkpoint_s`` (δ): blocking seconds per save; ``restart_s`` (R): restart seconds per failure
        (0 without failures); ``mtbf_s``: wall seconds per failure, the observed MTBF (``inf`` without failures).
        """
        if saves < 1:
            raise ValueError(f"saves={saves} must be >= 1: the interval is useful time per save")
        n = self.failures
        return {
            "interval_s": self.useful_s / saves,
            "overhead_s": (self.other_s + self.bad_step_s + self.dropped_s) / saves,
            "checkpoint_s": self.checkpoint_s / saves,
            "restart_s": self.restart_s / n if n else 0.0,
            "mtbf_s": self.wall_s / n if n else float("inf"),
        }

    def metrics(self, prefix: str = "goodput/") -> dict[str, float]:
        return {prefix + k: float(v) for k, v in asdict(self).items()}

    def table(self) -> str:
        def row(name: str, s: float) -> str:
            share = s / self.wall_s if self.wall_s > 0 else 0.0
            return f"  {name:<13}{s:10.2f} s  {100 * share:6.1f}%"

        lines = [f"goodput {100 * self.goodput:.1f}% over {self.attempts} attempt(s), step {self.step}"]
        for name in ("wall", "useful", "restart", "redo", "checkpoint", "bad_step", "dropped", "other"):
            lines.append(row(name, getattr(self, f"{name}_s")))
        return "\n".join(lines)


class GoodputTracker:
    """Accumulates useful, restart, redo, checkpoint, bad-step and dropped seconds over the attempts of one run.

    Call order per attempt: :meth:`start_attempt` (with the previous attempt's ``progress()`` and the ``state_dict()``
    stored in the checkpoint it resumed from, when there are), then for every step :meth:`step_started` and
    :meth:`step_finished`, and :meth:`add_checkpoint_blocking` when saves block. All times are seconds on one wall
    clock (``time.time()`` in the callback: attempts are different processes).
    """

    def __init__(self) -> None:
        self.run_start_s: float | None = None
        self.useful_s = self.restart_s = self.redo_s = self.checkpoint_s = self.bad_step_s = self.dropped_s = 0.0
        self.attempts = 0
        self.saves = 0  # checkpoint saves that blocked the loop, over all attempts (Young/Daly's interval)
        self.step = 0
        self.last_progress_s: float | None = None
        self._pending: tuple[float | None, float] | None = None  # (previous last progress, work lost) until step 1

    def start_attempt(
        self, now_s: float, *, previous: dict[str, Any] | None = None, checkpoint: dict[str, Any] | None = None
    ) -> None:
        """Begin an attempt at ``now_s``.

        Args:
            previous: the last ``progress()`` of the previous attempt (None: this is the run's first attempt).
            checkpoint: the ``state_dict()`` saved in the checkpoint this attempt resumed from (None: from scratch).
        """
        if previous is None:
            self.__init__()
            self.run_start_s = now_s
            self.attempts = 1
            return
        self.run_start_s = float(previous["run_start_s"])
        for key in ("useful_s", "restart_s", "redo_s", "checkpoint_s", "bad_step_s", "dropped_s"):
            setattr(self, key, float(previous.get(key, 0.0)))
        self.attempts = int(previous.get("attempts", 1)) + 1
        self.saves = int(previous.get("saves", 0))
        self.step = int(checkpoint.get("step", 0)) if checkpoint else 0
        kept = float(checkpoint["useful_s"]) if checkpoint else 0.0
        lost = max(0.0, self.useful_s - kept)  # completed after the checkpoint: it will run again
        last = previous.get("last_progress_s")
        self._pending = (float(last) if last is not None else None, lost)

    def step_started(self, now_s: float) -> None:
        """The start of a step; the first one of an attempt closes the restart gap."""
        if self._pending is None:
            return
        last, lost = self._pending
        self._pending = None
        if last is not None:
            self.restart_s += max(0.0, now_s - last)
        self.redo_s += lost
        self.useful_s -= lost

    def step_finished(
        self, duration_s: float, *, now_s: float, step: int, useful: bool = True, dropped: bool = False
    ) -> None:
        """A finished step of ``duration_s`` seconds (``useful=False``: its update was withheld; ``dropped``: the
        replica quorum did not commit it)."""
        if dropped:
            self.dropped_s += duration_s
        elif useful:
            self.useful_s += duration_s
        else:
            self.bad_step_s += duration_s
        self.step = int(step)
        self.last_progress_s = now_s

    def add_dropped_wait(self, seconds: float) -> None:
        """The wait from a dropped step's end to the survivors' next quorum (the failure's detection)."""
        self.dropped_s += max(0.0, seconds)

    def add_checkpoint_blocking(self, seconds: float) -> None:
        """One save that blocked the loop for ``seconds``."""
        self.checkpoint_s += max(0.0, seconds)
        self.saves += 1

    def breakdown(self, now_s: float) -> GoodputBreakdown:
        wall = max(0.0, now_s - self.run_start_s) if self.run_start_s is not None else 0.0
        known = self.useful_s + self.restart_s + self.redo_s + self.checkpoint_s + self.bad_step_s + self.dropped_s
        return GoodputBreakdown(
            wall_s=wall,
            useful_s=self.useful_s,
            restart_s=self.restart_s,
            redo_s=self.redo_s,
            checkpoint_s=self.checkpoint_s,
            bad_step_s=self.bad_step_s,
            dropped_s=self.dropped_s,
            other_s=max(0.0, wall - known),
            goodput=self.useful_s / wall if wall > 0 else 0.0,
            attempts=self.attempts,
            step=self.step,
        )

    def progress(self) -> dict[str, Any]:
        """Everything the next attempt needs (the callback writes it next to the checkpoints after every step)."""
        return {
            "run_start_s": self.run_start_s,
            "last_progress_s": self.last_progress_s,
            "useful_s": self.useful_s,
            "restart_s": self.restart_s,
            "redo_s": self.redo_s,
            "checkpoint_s": self.checkpoint_s,
            "bad_step_s": self.bad_step_s,
            "dropped_s": self.dropped_s,
            "attempts": self.attempts,
            "saves": self.saves,
            "step": self.step,
        }

    def state_dict(self) -> dict[str, Any]:
        """Saved inside a checkpoint: the useful time that checkpoint preserves."""
        return {"useful_s": self.useful_s, "step": self.step}
