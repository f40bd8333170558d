"""The dynamic fp16 loss-scale state machine (design §13.2; Micikevicius 2018), pure Python.

:class:`LossScaleTracker`: "up, skip, down"::

      if any(grad is inf/NaN):  skip the step; S <- S * backoff (after ``hysteresis`` overflows); n_ok <- 0
      else:                     apply the step; n_ok += 1; if n_ok == growth_interval: S <- S * growth; n_ok <- 0

``hysteresis`` follows DeepSpeed's ``DynamicLossScaler`` (``delayed_shift``): the scale backs off only after that
many overflows since the last backoff/growth; every overflow still skips its step. A scale that would fall below
``min_scale``, or more than ``max_consecutive_skips`` skipped steps in a row, raises :class:`LossScaleError`
instead of letting the loop spin forever.

The tensor side, :class:`~lightning_v17.engine.precision.ShardedLossScaler`, drives this tracker with the
gradients of every shard and one all-reduce per step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lightning_v17.config import LossScalePolicy

__all__ = ["LossScaleError", "LossScaleTracker"]


class LossScaleError(RuntimeError):
    """The loss scale collapsed or too many consecutive steps overflowed; training cannot make progress."""


@dataclass
class LossScaleTracker:
    """The design §13.2 dynamic loss-scale state machine (pure Python, no tensors).

    Args:
        policy: the options (init_scale, growth_factor, backoff_factor, growth_interval, hysteresis, min_scale,
            max_consecutive_skips), validated once by :class:`lightning_v17.config.LossScalePolicy`.
    """

    policy: LossScalePolicy = field(default_factory=LossScalePolicy)

    def __post_init__(self) -> None:
        self.scale: float = float(self.policy.init_scale)
        self.good_steps = 0  # n_ok of the seed: overflow-free steps since the last growth/backoff
        self.hysteresis_left = self.policy.hysteresis
        self.total_steps = 0  # optimizer steps attempted (applied + skipped)
        self.skipped_steps = 0
        self.consecutive_skips = 0

    @property
    def overflow_rate(self) -> float:
        """Skipped / attempted steps since the start of training (0.0 before the first step)."""
        return self.skipped_steps / self.total_steps if self.total_steps else 0.0

    def update(self, found_inf: bool, *, cause: Callable[[], str] | None = None) -> bool:
        """Advance the state machine by one attempted optimizer step.

        Args:
            found_inf: whether any gradient on any rank was inf/NaN.
            cause: called only when raising, to name the likely cause in the error message.

        Returns:
            True if the step was (to be) applied, False if it was skipped.

        Raises:
            LossScaleError: the scale would fall below ``min_scale`` or ``max_consecutive_skips`` was reached.
        """
        self.total_steps += 1
        if not found_inf:
            self.consecutive_skips = 0
            self.good_steps += 1
            if self.good_steps == self.policy.growth_interval:
                self.scale *= self.policy.growth_factor
                self.good_steps = 0
                self.hysteresis_left = self.policy.hysteresis
            return True
        self.skipped_steps += 1
        self.consecutive_skips += 1
        self.good_steps = 0
        self.hysteresis_left -= 1
        if self.hysteresis_left <= 0:
            new_scale = self.scale * self.policy.backoff_factor
            if new_scale < self.policy.min_scale:
                raise LossScaleError(
                    f"loss scale collapsed: backing off {self.scale:g} -> {new_scale:g} would fall below "
                    f"min_scale={self.policy.min_scale:g} after {self.consecutive_skips} consecutive overflowing steps. "
                    + (cause() if cause else "")
                )
            self.scale = new_scale
            self.hysteresis_left = self.policy.hysteresis
        if self.consecutive_skips >= self.policy.max_consecutive_skips:
            raise LossScaleError(
                f"{self.consecutive_skips} consecutive optimizer steps were skipped for inf/NaN gradients "
                f"(max_consecutive_skips={self.policy.max_consecutive_skips}; scale now {self.scale:g}). "
                + (cause() if cause else "")
            )
        return False

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "good_steps": self.good_steps,
            "hysteresis_left": self.hysteresis_left,
            "total_steps": self.total_steps,
            "skipped_steps": self.skipped_steps,
            "consecutive_skips": self.consecutive_skips,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = {"scale", "good_steps", "total_steps", "skipped_steps"} - set(state)
        if missing:
            raise KeyError(f"loss-scale state is missing {sorted(missing)}; is this a DynamicLossScaling checkpoint?")
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.hysteresis_left = int(state.get("hysteresis_left", self.policy.hysteresis))
        self.total_steps = int(state["total_steps"])
        self.skipped_steps = int(state["skipped_steps"])
        self.consecutive_skips = int(state.get("consecutive_skips", 0))
