"""Pipeline schedules as per-rank action lists, and an event simulation of one training step.

Torch-free. The planner's bubble (``planner.pipeline.bubble_fraction``), the engine's replay of recorded actions
(``engine.pipeline_timing.replay_actions``) and ``bench/pipeline.py``'s measured-vs-simulated table all run the
same :func:`simulate`, so a schedule's bubble comes from the order of its actions, not from a closed form.

Actions are ``(op, stage, microbatch)`` with op ``"F"`` (forward), ``"B"`` (backward for the input gradient; the
full backward when the schedule does not split it) or ``"W"`` (backward for the weight gradient; Qi 2023 splits
the backward into B and W).

Generators, one per schedule of ``planner.schedules.SCHEDULES``:

* ``gpipe``: all forwards, then all backwards (Huang 2019 §2.3; torch's ``ScheduleGPipe``).
* ``1f1b``: ``min(p - r, m)`` warm-up forwards on rank r, then one backward and one forward (Narayanan 2021
  §2.2.1; torch's ``Schedule1F1B``).
* ``interleaved_1f1b``: loop placement, v chunks per rank, depth-first in rounds of ``m // max(1, m // p)``
  micro-batches (Narayanan 2021 §2.2.2), in the order of torch 2.13's ``ScheduleInterleaved1F1B``.
* ``zero_bubble``: torch 2.13's ``ScheduleInterleavedZeroBubble`` (Qi 2023's ZB-1P on looped chunks): the
  interleaved order with split backwards, rank r running its first ``r`` backwards' W late.
* ``zbv``: torch 2.13's ``ScheduleZBVZeroBubble`` (Qi 2023 §6, V placement: rank r holds stages r and 2p-1-r).
* ``zb_h1``: Qi 2023 §3.1's handcrafted ZB-H1, one stage per rank: 1F1B's warm-up, and the W of rank r's first
  ``r`` backwards postponed to fill the tail. Bubble ``(p-1)(T_F + T_B - T_W)`` per rank, ``(p-1)/(3m)`` of the
  compute when T_F = T_B = T_W (Qi 2023 §3.1). It is what ``ScheduleInterleavedZeroBubble`` computes with one
  stage per rank (a unit test compares the two orders).
* ``zb_h2``: Qi 2023 §3.2's ZB-H2, one stage per rank: ``2(p - r) - 1`` warm-up forwards (so the first stage
  holds up to ``2p - 1`` micro-batches), then B, W, F in the steady state; rank r postpones its first ``r`` W
  to the tail. Qi's zero bubble also needs the optimizer step without a global synchronisation (Qi 2023,
  "bypassing optimizer synchronizations"); under a step-synchronous optimizer, as here, no order beats ZB-H1's
  (p-1)/(3m) at equal op times (the last stage starts (p-1)·T_F late), and that is what :func:`simulate` gives.

Op times (:class:`OpTimes`): per micro-batch and stage. The defaults are the FLOP split of a transformer layer:
a full backward costs 2 forwards (Narayanan 2021 Eq. 3: two matmuls per forward matmul) and splits 1:1 into the
input and the weight gradient (Qi 2023: T_B = T_W), so T_F = T_B = T_W = 1.
"""

from __future__ import annotations

import math
import random
import statistics
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from lightning_v17.config import Schedule

__all__ = [
    "Action",
    "OpTimes",
    "Timeline",
    "dependency",
    "sample_bubbles",
    "schedule_actions",
    "simulate",
    "simulate_schedule",
    "splits_backward",
]

F, B, W = "F", "B", "W"


class Action(NamedTuple):
    """One compute action of a pipeline rank: op "F", "B" or "W" on global stage ``stage`` for ``microbatch``."""

    op: str
    stage: int
    microbatch: int


@dataclass(frozen=True)
class OpTimes:
    """Durations of one micro-batch's ops on one stage (any time unit; seconds in ``bench/pipeline.py``).

    Args:
        forward: T_F, the forward (the last stage's loss included).
        backward_input: T_B, the backward for the input gradient.
        backward_weight: T_W, the backward for the weight gradient. Schedules without the split run one full
            backward of ``backward_input + backward_weight``.
        forward_cv, backward_input_cv, backward_weight_cv: the coefficient of variation (standard deviation /
            mean) of each op's duration from one micro-batch to the next. 0 (the default): every action takes
            exactly its mean. Above 0, :func:`sample_bubbles` draws each action's duration independently, and the
            planner's bubble is the median over the draws: a pipeline waits on the slowest of its dependencies,
            so jitter adds idle time that the means alone do not show (on a shared 2-core CPU the measured CVs
            were 0.05-0.2, and 1F1B at m=8 idled 0.159 against 0.131 from the means; see ``bench/pipeline.py``).
            The full backward of an unsplit schedule has the combined deviation of its two halves, taken as
            independent.
    """

    forward: float = 1.0
    backward_input: float = 1.0
    backward_weight: float = 1.0
    forward_cv: float = 0.0
    backward_input_cv: float = 0.0
    backward_weight_cv: float = 0.0

    def __post_init__(self) -> None:
        for name in ("forward", "backward_input", "backward_weight", "forward_cv", "backward_input_cv",
                     "backward_weight_cv"):  # fmt: skip
            if getattr(self, name) < 0:
                raise ValueError(f"OpTimes.{name}={getattr(self, name)} must be >= 0")

    @property
    def full_backward(self) -> float:
        return self.backward_input + self.backward_weight

    @property
    def full_backward_cv(self) -> float:
        """The coefficient of variation of ``full_backward``: the two halves' deviations added as independent."""
        total = self.full_backward
        sd = math.hypot(self.backward_input_cv * self.backward_input, self.backward_weight_cv * self.backward_weight)
        return sd / total if total > 0 else 0.0

    @property
    def varies(self) -> bool:
        return bool(self.forward_cv or self.backward_input_cv or self.backward_weight_cv)


@dataclass(frozen=True)
class Timeline:
    """The simulated step: per rank, ``(action, start, end)`` in execution order, all ranks starting at 0.

    The bubble follows ``engine.pipeline_timing.BubbleTimer``: a rank is busy inside its actions and idle for
    the rest of the step (the last end over all ranks; the step is barrier-bracketed, as ``bench/pipeline.py``
    measures it). ``bubble_over_busy`` = idle / busy is Narayanan 2021 §2.2's bubble fraction (the planner's);
    ``idle_fraction`` = idle / step is ``BubbleTimer.bubble_fraction``. The step values are the median over ranks,
    as ``bench/pipeline.py`` aggregates its measured ones.
    """

    events: dict[int, list[tuple[Action, float, float]]]
    #: fixed idle time per step outside the actions (the runtime's set-up before the first action and its tail
    #: after the last: waiting on sends, the closing barrier), added to the step
    step_overhead: float = 0.0

    @property
    def step(self) -> float:
        return max((ev[-1][2] for ev in self.events.values() if ev), default=0.0) + self.step_overhead

    @property
    def busy(self) -> dict[int, float]:
        return {r: sum(e - s for _, s, e in ev) for r, ev in self.events.items()}

    @property
    def bubble_over_busy_per_rank(self) -> dict[int, float]:
        step = self.step
        return {r: (step - b) / b if b > 0 else 0.0 for r, b in self.busy.items()}

    @property
    def idle_fraction_per_rank(self) -> dict[int, float]:
        step = self.step
        return {r: (step - b) / step if step > 0 else 0.0 for r, b in self.busy.items()}

    @property
    def bubble_over_busy(self) -> float:
        return statistics.median(self.bubble_over_busy_per_rank.values()) if self.events else 0.0

    @property
    def idle_fraction(self) -> float:
        return statistics.median(self.idle_fraction_per_rank.values()) if self.events else 0.0


def dependency(op: str, stage: int, microbatch: int, num_stages: int) -> tuple[str, int, int] | None:
    """The action whose output this one consumes: F(s) <- F(s-1); B(s) <- B(s+1), the last stage's B <- its own F
    (the loss); W(s) <- B(s) (Qi 2023: W needs the output gradient that B received)."""
    if op == F:
        return (F, stage - 1, microbatch) if stage > 0 else None
    if op == B:
        return (B, stage + 1, microbatch) if stage < num_stages - 1 else (F, stage, microbatch)
    if op == W:
        return (B, stage, microbatch)
    raise ValueError(f"unknown pipeline op {op!r}; expected 'F', 'B' or 'W'")


def simulate(
    actions_by_rank: Mapping[int, Sequence[tuple[str, int, int, float]]],
    *,
    num_stages: int,
    p2p_s: float = 0.0,
    dispatch_s: float = 0.0,
    step_overhead_s: float = 0.0,
) -> Timeline:
    """Run per-rank action lists with given durations: each action starts when its rank has finished the action
    before it (plus ``dispatch_s``) and its input is ready (:func:`dependency`), plus ``p2p_s`` when the input
    comes from another rank.

    A rank's stages are those of its F actions; stages on the same rank (ZB-V's turn, Qi 2023 §6) hand over
    without P2P, as torch's runtime does ("V-schedule special case").

    Args:
        actions_by_rank: per rank, ``(op, stage, microbatch, duration)`` in execution order.
        num_stages: total number of pipeline stages (p·v).
        p2p_s: one activation or gradient transfer between two ranks (latency, not occupying either rank).
        dispatch_s: the runtime's own time between two actions of a rank (bookkeeping; idle, not busy).
        step_overhead_s: fixed idle time per step outside the actions (:attr:`Timeline.step_overhead`).

    Returns:
        The :class:`Timeline`.

    Raises:
        ValueError: if the actions cannot all run (a dependency never executes: not one complete step, or an
            order that deadlocks).
    """
    owner = {stage: rank for rank, acts in actions_by_rank.items() for op, stage, _, _ in acts if op == F}
    seqs = {r: list(acts) for r, acts in actions_by_rank.items()}
    end: dict[tuple[str, int, int], float] = {}
    events: dict[int, list[tuple[Action, float, float]]] = {r: [] for r in seqs}
    free = dict.fromkeys(seqs, 0.0)
    pos = dict.fromkeys(seqs, 0)
    waiting: dict[tuple[str, int, int], list[int]] = defaultdict(list)  # dependency -> ranks blocked on it
    runnable = list(seqs)
    while runnable:
        rank = runnable.pop()
        seq = seqs[rank]
        while pos[rank] < len(seq):
            op, stage, mb, dur = seq[pos[rank]]
            dep = dependency(op, stage, mb, num_stages)
            if dep is not None and dep not in end:
                waiting[dep].append(rank)
                break
            ready = 0.0
            if dep is not None:
                ready = end[dep] + (p2p_s if owner.get(dep[1], rank) != rank else 0.0)
            start = max(free[rank] + (dispatch_s if pos[rank] else 0.0), ready)
            free[rank] = end[(op, stage, mb)] = start + dur
            events[rank].append((Action(op, stage, mb), start, start + dur))
            pos[rank] += 1
            runnable += waiting.pop((op, stage, mb), [])
    stuck = {r: tuple(seqs[r][pos[r]][:3]) for r in seqs if pos[r] < len(seqs[r])}
    if stuck:
        raise ValueError(f"pipeline simulation: actions wait on dependencies that never run: {stuck}")
    return Timeline(events, step_overhead=step_overhead_s)


# --- schedule generators -------------------------------------------------------------------------------------


def _gpipe(p: int, m: int, v: int) -> dict[int, list[Action]]:
    return {r: [Action(F, r, i) for i in range(m)] + [Action(B, r, i) for i in range(m)] for r in range(p)}


def _one_f_one_b(p: int, m: int, v: int) -> dict[int, list[Action]]:
    out = {}
    for r in range(p):
        warm = min(p - r, m)  # torch's Schedule1F1B: warm-up forwards, the last of them the "1F" of the first pair
        acts = [Action(F, r, i) for i in range(warm)]
        nf = warm
        for nb in range(m):
            acts.append(Action(B, r, nb))
            if nf < m:
                acts.append(Action(F, r, nf))
                nf += 1
        out[r] = acts
    return out


def _looped(p: int, m: int, v: int, *, zero_bubble: bool) -> dict[int, list[Action]]:
    """torch 2.13's ``_get_1f1b_rank_ops`` for ``ScheduleInterleaved1F1B`` (``zero_bubble=False``) and
    ``ScheduleInterleavedZeroBubble`` (True), without its idle slots (None), which its runtime skips."""
    return {r: _looped_rank(r, p, m, v, zero_bubble=zero_bubble) for r in range(p)}


def _looped_rank(r: int, p: int, m: int, v: int, *, zero_bubble: bool) -> list[Action]:
    rounds = max(1, m // p)
    per_round = m // rounds  # micro-batches per round: depth-first within a round (Narayanan 2021 §2.2.2)
    # warm-up forwards: (v - 1) rounds, plus 2 (1F1B) or 1 (zero bubble) per hop from the last rank
    warmup = min((v - 1) * per_round + (1 if zero_bubble else 2) * (p - 1 - r), m * v)
    fwd_bwd = v * m - warmup  # steps with one F and one B; then ``warmup`` steps of B only

    def fwd_stage(step: int) -> int:
        return ((step // per_round) % v) * p + r

    def bwd_stage(step: int) -> int:
        return (v - 1 - ((step - warmup) // per_round) % v) * p + r

    nxt: dict[tuple[str, int], int] = defaultdict(int)

    def take(op: str, stage: int) -> Action:
        i = nxt[(op, stage)]
        nxt[(op, stage)] = i + 1
        return Action(op, stage, i)

    acts: list[Action] = []
    backward_steps: list[int] = []
    weights_done = 0
    for step in range(warmup + fwd_bwd + warmup):
        if step < warmup + fwd_bwd:
            acts.append(take(F, fwd_stage(step)))
        if step >= warmup:
            acts.append(take(B, bwd_stage(step)))
            backward_steps.append(step)
            # ZB-1P: rank r's W lag r backwards behind its B (torch's num_1f1b_microbatches = rank)
            if zero_bubble and step - warmup >= r:
                acts.append(take(W, bwd_stage(backward_steps[weights_done])))
                weights_done += 1
    while zero_bubble and weights_done < len(backward_steps):
        acts.append(take(W, bwd_stage(backward_steps[weights_done])))
        weights_done += 1
    return acts


def _interleaved_1f1b(p: int, m: int, v: int) -> dict[int, list[Action]]:
    return _looped(p, m, v, zero_bubble=False)


def _interleaved_zero_bubble(p: int, m: int, v: int) -> dict[int, list[Action]]:
    return _looped(p, m, v, zero_bubble=True)


def _zb_h1(p: int, m: int, v: int) -> dict[int, list[Action]]:
    # Qi 2023 §3.1 on one stage per rank is the looped zero-bubble order with v = 1 (torch computes the same)
    return _looped(p, m, 1, zero_bubble=True)


def _zb_h2(p: int, m: int, v: int) -> dict[int, list[Action]]:
    out = {}
    for r in range(p):
        warm = min(2 * (p - r) - 1, m)  # Qi 2023 §3.2: p - 1 more warm-up forwards on the first stage than 1F1B
        acts = [Action(F, r, i) for i in range(warm)]
        nf, late = warm, 0
        for nb in range(m):
            acts.append(Action(B, r, nb))
            if nb >= r:  # the W of the first r backwards run in the tail (as in ZB-H1)
                acts.append(Action(W, r, late))
                late += 1
            if nf < m:
                acts.append(Action(F, r, nf))
                nf += 1
        acts += [Action(W, r, i) for i in range(late, m)]
        out[r] = acts
    return out


def _zbv(p: int, m: int, v: int) -> dict[int, list[Action]]:
    """torch 2.13's ``ScheduleZBVZeroBubble._calculate_single_rank_operations`` (Qi 2023 §6), idle slots dropped."""
    s = 2 * p
    n = max(2 * p - 1, m)  # torch plans at least 2p - 1 micro-batches and drops the extra ones afterwards
    out = {}
    for r in range(p):
        c0, c1 = r, s - 1 - r
        f0 = f1 = b0 = b1 = 0
        acts: list[Action] = []
        for _ in range(2 * (p - r) - 1):
            acts.append(Action(F, c0, f0))
            f0 += 1
        for _ in range(r):
            acts += [Action(F, c1, f1), Action(F, c0, f0)]
            f1 += 1
            f0 += 1
        for _ in range(p - r):
            acts += [Action(F, c1, f1), Action(B, c1, b1), Action(W, c1, b1)]
            f1 += 1
            b1 += 1
        while f1 < f0 or f0 < n:
            if f0 < n:
                acts.append(Action(F, c0, f0))
                f0 += 1
            acts += [Action(B, c0, b0), Action(W, c0, b0), Action(F, c1, f1), Action(B, c1, b1), Action(W, c1, b1)]
            b0 += 1
            f1 += 1
            b1 += 1
        w0, w1 = b0, b1
        for _ in range(r):
            acts += [Action(B, c0, b0), Action(B, c1, b1)]
            b0 += 1
            b1 += 1
        for _ in range(p - r):
            acts += [Action(B, c0, b0), Action(W, c0, w0)]
            b0 += 1
            w0 += 1
        acts += [Action(W, c1, i) for i in range(w1, b1)]
        acts += [Action(W, c0, i) for i in range(w0, b0)]
        out[r] = [a for a in acts if a.microbatch < m]
    return out


_GENERATORS: dict[Schedule, Callable[[int, int, int], dict[int, list[Action]]]] = {
    Schedule.GPIPE: _gpipe,
    Schedule.ONE_F_ONE_B: _one_f_one_b,
    Schedule.INTERLEAVED_1F1B: _interleaved_1f1b,
    Schedule.ZERO_BUBBLE: _interleaved_zero_bubble,
    Schedule.ZB_H1: _zb_h1,
    Schedule.ZB_H2: _zb_h2,
    Schedule.ZBV: _zbv,
}


def splits_backward(schedule: Schedule | str) -> bool:
    """Whether the schedule runs the backward as separate B (input gradient) and W (weight gradient) actions."""
    from lightning_v17.config.schedules import schedule_info

    return schedule_info(schedule).split_backward


def schedule_actions(
    schedule: Schedule | str, *, pp: int, microbatches: int, virtual_stages: int = 1
) -> dict[int, list[Action]]:
    """Per pp rank, the compute actions of one step of ``schedule`` in execution order (module docstring).

    Args:
        schedule: the schedule (a :class:`Schedule` or its name).
        pp: pipeline ranks p.
        microbatches: micro-batches per step m.
        virtual_stages: model chunks per rank v (the schedule's ``planner.schedules`` row says which v it takes).

    Raises:
        ValueError: p, m or v below 1.
        V17ConfigError: a ``virtual_stages`` the schedule does not take, or for the looped schedules an m that
            torch's rounds of ``m // max(1, m // p)`` micro-batches do not divide.
    """
    from lightning_v17.config.schedules import Placement, schedule_info

    schedule = Schedule.parse(schedule, "schedule")
    if pp < 1 or microbatches < 1 or virtual_stages < 1:
        raise ValueError(f"pp={pp}, microbatches={microbatches}, virtual_stages={virtual_stages} must be >= 1")
    info = schedule_info(schedule)
    info.check_virtual_stages(virtual_stages)
    if info.placement == Placement.LOOP:
        info.check_microbatches(pp=pp, microbatches=microbatches)  # torch's rounds must divide m
    return _GENERATORS[schedule](pp, microbatches, virtual_stages)


def simulate_schedule(
    schedule: Schedule | str,
    *,
    pp: int,
    microbatches: int,
    virtual_stages: int = 1,
    op_times: OpTimes | Sequence[OpTimes] = OpTimes(),
    p2p_s: float = 0.0,
    dispatch_s: float = 0.0,
    step_overhead_s: float = 0.0,
) -> Timeline:
    """Simulate one step of ``schedule`` (:func:`schedule_actions`) with the given op times (:func:`simulate`).

    Args:
        schedule, pp, microbatches, virtual_stages: as in :func:`schedule_actions`.
        op_times: one :class:`OpTimes` for every stage, or one per global stage (``pp * virtual_stages`` of them,
            e.g. measured means). Schedules without the B/W split run ``full_backward`` as their B.
        p2p_s, dispatch_s, step_overhead_s: as in :func:`simulate` (all default to 0: the ideal runtime).
    """
    plan, num_stages = _actions_with_times(schedule, pp, microbatches, virtual_stages, op_times)
    timed = {r: [(a.op, a.stage, a.microbatch, mu) for a, mu, _ in acts] for r, acts in plan.items()}
    return simulate(timed, num_stages=num_stages, p2p_s=p2p_s, dispatch_s=dispatch_s, step_overhead_s=step_overhead_s)


def _actions_with_times(
    schedule: Schedule | str, pp: int, microbatches: int, virtual_stages: int, op_times: OpTimes | Sequence[OpTimes]
) -> tuple[dict[int, list[tuple[Action, float, float]]], int]:
    """Per rank, ``(action, mean duration, CV)`` of the schedule's actions, and the number of global stages.
    Schedules without the B/W split run ``full_backward`` (with its combined CV) as their B."""
    actions = schedule_actions(schedule, pp=pp, microbatches=microbatches, virtual_stages=virtual_stages)
    num_stages = pp * virtual_stages
    times = [op_times] * num_stages if isinstance(op_times, OpTimes) else list(op_times)
    if len(times) != num_stages:
        raise ValueError(f"op_times has {len(times)} entries; expected one per stage ({num_stages})")
    split = splits_backward(schedule)

    def mean_cv(a: Action) -> tuple[float, float]:
        t = times[a.stage]
        if a.op == F:
            return t.forward, t.forward_cv
        if a.op == W:
            return t.backward_weight, t.backward_weight_cv
        return (t.backward_input, t.backward_input_cv) if split else (t.full_backward, t.full_backward_cv)

    return {r: [(a, *mean_cv(a)) for a in acts] for r, acts in actions.items()}, num_stages


def sample_bubbles(
    schedule: Schedule | str,
    *,
    pp: int,
    microbatches: int,
    virtual_stages: int = 1,
    op_times: OpTimes | Sequence[OpTimes] = OpTimes(),
    p2p_s: float = 0.0,
    dispatch_s: float = 0.0,
    step_overhead_s: float = 0.0,
    samples: int = 256,
    seed: int = 0,
) -> list[float]:
    """``samples`` simulated steps of ``schedule`` whose action durations vary: each action independently takes
    its stage's mean × max(0, 1 + N(0, cv)) (a Gaussian clipped at zero, with the op's CV from :class:`OpTimes`).

    Returns every rank's idle / busy of every sampled step (``samples × pp`` values), the population that the
    measured bubble's median is taken over in ``bench/pipeline.py`` (ranks × timed steps). Seeded: the same
    arguments give the same values. With every CV 0 each value is the deterministic :func:`simulate_schedule`'s.

    Args:
        schedule, pp, microbatches, virtual_stages, op_times, p2p_s, dispatch_s, step_overhead_s: as in
            :func:`simulate_schedule`.
        samples: simulated steps (>= 1).
        seed: the seed of the draws.
    """
    if samples < 1:
        raise ValueError(f"samples={samples} must be >= 1")
    plan, num_stages = _actions_with_times(schedule, pp, microbatches, virtual_stages, op_times)
    rng = random.Random(seed)
    out: list[float] = []
    for _ in range(samples):
        timed = {
            r: [(a.op, a.stage, a.microbatch, mu * max(0.0, 1.0 + rng.gauss(0.0, cv)) if cv else mu)
                for a, mu, cv in acts]
            for r, acts in plan.items()
        }  # fmt: skip
        timeline = simulate(
            timed, num_stages=num_stages, p2p_s=p2p_s, dispatch_s=dispatch_s, step_overhead_s=step_overhead_s
        )
        out += list(timeline.bubble_over_busy_per_rank.values())
    return out
