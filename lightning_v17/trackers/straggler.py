"""Straggler statistics: per-rank step timings, robust cross-rank comparison, patience (design §15.3).

Lightning-free and torch-free. The Lightning adapter (:class:`lightning_v17.callbacks.StragglerDetector`) measures
per-step timings on each rank, all-gathers one window of them every ``every_n_steps`` steps and feeds the gathered
matrix to :meth:`StragglerTracker.update`.

What is compared across ranks. In synchronous data-parallel training every collective makes the fast ranks wait for
the slow one, so the *wall* step time of all ranks converges to the slowest rank's; it cannot tell who is slow. What
differs is the work a rank does before it reaches the step's first collective. The adapter therefore measures, per
step, ``local_s`` = data wait (wall time fetching the batch) + forward compute time (CPU time of the main thread on
CPU, CUDA-event time on GPU; up to ``on_before_backward``), which contains no collective under DDP and ZeRO-1/2
(their collectives run in backward and after the optimizer step), next to the full wall step time and the data-wait
time used for the report. Under ZeRO-3/TP the forward itself all-gathers, so there ``local_s`` only separates ranks
by their data path; per-kernel device timing excluding communication would be needed to see compute stragglers.

Flagging rule (per window): a rank's score is the ``score_quantile`` (default 0.25) of its ``local_s`` over the
window. A low quantile measures what the rank can do: a truly slow rank (bad host, throttled device, slow data path)
is slow on nearly every step and raises it, while one-off spikes and intermittent interference (OS scheduling, a
noisy neighbour for a few steps) only move the upper quantiles. Its reference is the median of the *other* ranks' scores (leave-one-out, so that with 2 ranks a slow rank
is compared with the other one instead of with their mean); the report also gives the median over all ranks and
their MAD (median absolute deviation, scaled by 1.4826 to estimate a standard deviation, Rousseeuw & Croux 1993).
A rank is *over* when ``score > threshold * reference`` and ``score - reference > min_excess_s`` (an absolute floor
so timer noise on millisecond steps is never flagged). A rank over in ``patience`` consecutive windows is flagged.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["MAD_TO_SIGMA", "RankWindowStats", "StragglerReport", "StragglerTracker", "mad", "median", "quantile"]

#: Consistency constant: for normal data, 1.4826 * MAD estimates the standard deviation (Rousseeuw & Croux 1993).
MAD_TO_SIGMA = 1.4826


def quantile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile (numpy's default, "type 7") of a non-empty sequence, ``0 <= q <= 1``."""
    if not values:
        raise ValueError("quantile of an empty sequence")
    xs = sorted(values)
    pos = (len(xs) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def median(values: Sequence[float]) -> float:
    return quantile(values, 0.5)


def mad(values: Sequence[float]) -> float:
    """Median absolute deviation from the median (unscaled)."""
    m = median(values)
    return median([abs(v - m) for v in values])


@dataclass(frozen=True)
class RankWindowStats:
    """One rank's statistics over one window (times in seconds)."""

    rank: int
    host: str
    step_p50_s: float
    step_p90_s: float
    local_score_s: float  # the score_quantile of the rank's local times
    data_wait_share: float  # sum(data wait) / sum(step + data wait) over the window
    ratio: float  # local_score_s / median of the other ranks' scores
    over: bool
    consecutive_over: int


@dataclass(frozen=True)
class StragglerReport:
    """What one window found."""

    window: int
    step: int
    median_local_s: float
    mad_local_s: float
    ranks: tuple[RankWindowStats, ...]
    flagged: tuple[int, ...] = field(default=())

    @property
    def flagged_hosts(self) -> tuple[str, ...]:
        return tuple(self.ranks[r].host for r in self.flagged)

    def table(self) -> str:
        """The per-rank table: rank, host, step p50/p90, local (pre-collective) score, data-wait share, ratio."""
        head = (
            f"straggler window {self.window} (step {self.step}): median local {self.median_local_s * 1e3:.2f} ms, "
            f"MAD {self.mad_local_s * 1e3:.2f} ms, flagged {list(self.flagged) or 'none'}"
        )
        columns = (
            f"{'rank':>4}  {'host':<16} {'step p50 ms':>11} {'step p90 ms':>11} {'local q ms':>12} "
            f"{'data wait':>9} {'ratio':>6}  flag"
        )
        lines = [head, columns]
        for s in self.ranks:
            mark = "FLAGGED" if s.rank in self.flagged else ("over" if s.over else "")
            lines.append(
                f"{s.rank:>4}  {s.host[:16]:<16} {s.step_p50_s * 1e3:>11.2f} {s.step_p90_s * 1e3:>11.2f} "
                f"{s.local_score_s * 1e3:>12.2f} {s.data_wait_share:>8.1%} {s.ratio:>6.2f}  {mark}"
            )
        return "\n".join(lines)


class StragglerTracker:
    """Cross-rank straggler detection over windows of per-step timings.

    Args:
        threshold: a rank is over when its window median exceeds ``threshold`` x the median over ranks.
        patience: consecutive over-windows before a rank is flagged.
        min_excess_s: and only when it exceeds the median by more than this many seconds (timer-noise floor).
        score_quantile: quantile of a rank's per-step times that scores it in a window (0.5 = median).
    """

    def __init__(
        self, *, threshold: float = 1.2, patience: int = 3, min_excess_s: float = 0.005, score_quantile: float = 0.25
    ) -> None:
        if not threshold > 1.0:
            raise ValueError(f"threshold={threshold} must be > 1 (a multiple of the median step time)")
        if not isinstance(patience, int) or patience < 1:
            raise ValueError(f"patience={patience!r} must be a positive integer")
        if min_excess_s < 0:
            raise ValueError(f"min_excess_s={min_excess_s} must be >= 0")
        self.threshold = threshold
        self.patience = patience
        self.min_excess_s = min_excess_s
        if not 0.0 <= score_quantile <= 1.0:
            raise ValueError(f"score_quantile={score_quantile} must be in [0, 1]")
        self.score_quantile = score_quantile
        self.windows = 0
        self.consecutive_over: dict[int, int] = {}

    def update(
        self,
        step_s: Sequence[Sequence[float]],
        local_s: Sequence[Sequence[float]],
        data_wait_s: Sequence[Sequence[float]],
        *,
        hosts: Sequence[str] | None = None,
        step: int = 0,
    ) -> StragglerReport:
        """Digest one window: ``x[rank][i]`` is rank's value at the window's i-th step (seconds)."""
        world = len(local_s)
        if not (len(step_s) == len(data_wait_s) == world) or world == 0:
            raise ValueError("step_s, local_s and data_wait_s need one row per rank")
        hosts = list(hosts) if hosts is not None else ["?"] * world
        self.windows += 1
        scores = [quantile(row, self.score_quantile) for row in local_s]
        med = median(scores)
        spread = mad(scores)
        stats = []
        flagged = []
        for rank in range(world):
            score = scores[rank]
            # Leave-one-out reference: the median of the *other* ranks. With many ranks it equals the median; with
            # two it is the other rank (the plain median of two is their mean, which hides half the gap).
            others = scores[:rank] + scores[rank + 1 :]
            ref = median(others) if others else score
            ratio = score / ref if ref > 0 else 1.0
            over = score > self.threshold * ref and (score - ref) > self.min_excess_s
            self.consecutive_over[rank] = self.consecutive_over.get(rank, 0) + 1 if over else 0
            if self.consecutive_over[rank] >= self.patience:
                flagged.append(rank)
            busy = sum(step_s[rank]) + sum(data_wait_s[rank])
            stats.append(
                RankWindowStats(
                    rank=rank,
                    host=hosts[rank],
                    step_p50_s=quantile(step_s[rank], 0.5),
                    step_p90_s=quantile(step_s[rank], 0.9),
                    local_score_s=score,
                    data_wait_share=sum(data_wait_s[rank]) / busy if busy > 0 else 0.0,
                    ratio=ratio,
                    over=over,
                    consecutive_over=self.consecutive_over[rank],
                )
            )
        return StragglerReport(
            window=self.windows,
            step=step,
            median_local_s=med,
            mad_local_s=spread * MAD_TO_SIGMA,
            ranks=tuple(stats),
            flagged=tuple(flagged),
        )

    def state_dict(self) -> dict:
        return {"windows": self.windows, "consecutive_over": dict(self.consecutive_over)}

    def load_state_dict(self, state: dict) -> None:
        self.windows = int(state.get("windows", 0))
        self.consecutive_over = {int(k): int(v) for k, v in state.get("consecutive_over", {}).items()}
