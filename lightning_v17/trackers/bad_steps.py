"""Bad-step detection: non-finite losses and loss spikes against a running median (pure Python, no tensors).

A step is *bad* when its loss is NaN/inf, or when it exceeds ``spike_factor`` x the median of the last ``window``
*good* losses (once ``min_history`` good losses exist; the median, not the mean, so one earlier spike does not raise
the bar). ``patience`` consecutive bad steps *trigger* the action (skip, or roll back to the last checkpoint and skip
the offending batches): the remedy PaLM used for its loss spikes (Chowdhery et al. 2022, §5.1: "restart training from
a checkpoint roughly 100 steps before the spike started, and skip roughly 200-500 data batches"); OPT's logbook
(Zhang et al. 2022, §2.5) did the same by hand. A non-finite step is never applied, whatever the patience: its
gradients are NaN/inf and would poison every weight, so only the *event* waits for ``patience``.

The loss fed to :meth:`BadStepTracker.observe` must be the same number on every rank (the callback all-reduces the
max over ranks first), so every rank's tracker takes the same decision and holds the same state.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

__all__ = ["BadStepError", "BadStepTracker", "BadStepVerdict"]


class BadStepError(RuntimeError):
    """Too many consecutive bad steps: the loss level moved for good (or the model diverged); skipping cannot help."""


@dataclass(frozen=True)
class BadStepVerdict:
    """The decision for one step.

    Attributes:
        loss: the observed loss (max over ranks).
        median: the running median of the good losses before this step (None while fewer than ``min_history``).
        reason: ``"ok"``, ``"nonfinite"`` or ``"spike"``.
        consecutive: bad steps in a row, this one included (0 for a good step).
        triggered: ``consecutive >= patience``: the configured action runs.
        withhold: the optimizer step must not be applied (triggered, or a non-finite loss).
        offending: batch ids of the current streak of bad steps (oldest first), when triggered.
    """

    loss: float
    median: float | None
    reason: str
    consecutive: int
    triggered: bool
    withhold: bool
    offending: tuple[Any, ...] = ()

    @property
    def bad(self) -> bool:
        return self.reason != "ok"


@dataclass
class BadStepTracker:
    """Running-median spike and NaN/inf detector with patience.

    Args:
        spike_factor: a finite loss above ``spike_factor`` x the running median is a spike (> 1).
        window: number of recent good losses the median is taken over.
        patience: consecutive bad steps that trigger the action (>= 1).
        min_history: good losses needed before spikes are detected (non-finite losses are always bad).
        max_consecutive_bad: this many bad steps in a row raises :class:`BadStepError` (None: never).
    """

    spike_factor: float = 3.0
    window: int = 100
    patience: int = 1
    min_history: int = 10
    max_consecutive_bad: int | None = 50
    _history: deque = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not (isinstance(self.spike_factor, int | float) and self.spike_factor > 1.0):
            raise ValueError(f"spike_factor={self.spike_factor!r} must be a number > 1 (e.g. 3.0)")
        if not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"window={self.window!r} must be an integer >= 1 (recent good losses in the median)")
        if not isinstance(self.patience, int) or self.patience < 1:
            raise ValueError(f"patience={self.patience!r} must be an integer >= 1 (1: act on the first bad step)")
        if not isinstance(self.min_history, int) or not 1 <= self.min_history <= self.window:
            raise ValueError(f"min_history={self.min_history!r} must be an integer in [1, window={self.window}]")
        if self.max_consecutive_bad is not None and self.max_consecutive_bad < self.patience:
            raise ValueError(
                f"max_consecutive_bad={self.max_consecutive_bad!r} must be >= patience={self.patience} (or None)"
            )
        self._history = deque(maxlen=self.window)
        self.consecutive = 0
        self.streak: list[Any] = []  # batch ids of the current run of bad steps
        self.steps = 0
        self.bad_steps = 0
        self.withheld_steps = 0
        self.events = 0  # triggers

    @property
    def median(self) -> float | None:
        """Median of the last ``window`` good losses, or None before ``min_history`` of them."""
        if len(self._history) < self.min_history:
            return None
        return float(statistics.median(self._history))

    def classify(self, loss: float) -> str:
        """``"nonfinite"``, ``"spike"`` or ``"ok"`` for ``loss`` against the current median (no state change)."""
        if not math.isfinite(loss):
            return "nonfinite"
        median = self.median
        if median is not None and loss > self.spike_factor * median:
            return "spike"
        return "ok"

    def observe(self, loss: float, batch_id: Any = None) -> BadStepVerdict:
        """Advance by one step whose (max over ranks) loss is ``loss``.

        Raises:
            BadStepError: ``max_consecutive_bad`` bad steps in a row.
        """
        median = self.median
        reason = self.classify(loss)
        self.steps += 1
        if reason == "ok":
            self.consecutive = 0
            self.streak.clear()
            self._history.append(float(loss))
            return BadStepVerdict(loss, median, reason, 0, triggered=False, withhold=False)
        self.bad_steps += 1
        self.consecutive += 1
        self.streak.append(batch_id)
        if self.max_consecutive_bad is not None and self.consecutive >= self.max_consecutive_bad:
            raise BadStepError(
                f"{self.consecutive} consecutive bad steps (last loss {loss!r}, running median {median!r}, "
                f"spike_factor={self.spike_factor}); the loss level moved or the model diverged: lower the learning "
                f"rate, raise spike_factor or roll back further (max_consecutive_bad={self.max_consecutive_bad})"
            )
        triggered = self.consecutive >= self.patience
        withhold = triggered or reason == "nonfinite"
        self.withheld_steps += int(withhold)
        self.events += int(triggered)
        offending = tuple(self.streak) if triggered else ()
        return BadStepVerdict(loss, median, reason, self.consecutive, triggered, withhold, offending)

    def state_dict(self) -> dict[str, Any]:
        return {
            "history": list(self._history),
            "consecutive": self.consecutive,
            "streak": list(self.streak),
            "steps": self.steps,
            "bad_steps": self.bad_steps,
            "withheld_steps": self.withheld_steps,
            "events": self.events,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._history = deque((float(x) for x in state.get("history", [])), maxlen=self.window)
        self.consecutive = int(state.get("consecutive", 0))
        self.streak = list(state.get("streak", []))
        for key in ("steps", "bad_steps", "withheld_steps", "events"):
            setattr(self, key, int(state.get(key, 0)))
