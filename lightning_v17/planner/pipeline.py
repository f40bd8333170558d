"""Pipeline bubble fraction per schedule, by simulating the schedule's action list.

Torch-free. The bubble fraction is the idle time of a pipeline step relative to its ideal (bubble-free) compute
time, as Narayanan 2021 §2.2 defines it: step time = ideal time × (1 + bubble fraction). It comes from
:mod:`lightning_v17.planner.simulate`, which runs the order of F/B/W actions the engine's torch schedule runs, with
per-op times, not from a closed form. The closed forms are the cross-checks in the tests, at equal stage times:

- GPipe and 1F1B: (p - 1)/m (Narayanan 2021 §2.2.1).
- Interleaved 1F1B with v chunks per rank: (p - 1)/(v·m) (Narayanan 2021 §2.2.2).
- ZB-H1 at T_F = T_B = T_W: (p - 1)/(3m) (Qi 2023 §3.1).

No closed form is published for torch's interleaved zero-bubble order or for ZB-V under a synchronous optimizer
step; the simulation gives them (e.g. (p - 1)/(6m) for both at p = 4, m = 8 with T_F = T_B = T_W).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from functools import lru_cache

from lightning_v17.config import Schedule
from lightning_v17.planner.simulate import OpTimes, sample_bubbles, simulate_schedule

__all__ = ["STEADY_MICROBATCHES_PER_STAGE", "OpTimes", "bubble_fraction"]


def bubble_fraction(
    schedule: Schedule | str,
    *,
    pp: int,
    microbatches: int,
    virtual_stages: int = 1,
    op_times: OpTimes | Sequence[OpTimes] | None = None,
    p2p_s: float = 0.0,
    dispatch_s: float = 0.0,
    step_overhead_s: float = 0.0,
) -> float:
    """Idle fraction of a pipeline step (bubble time / ideal compute time), simulated.

    The median over pp ranks of idle / busy in one simulated step (:class:`simulate.Timeline`), the way
    ``bench/pipeline.py`` aggregates its measured bubbles. When ``op_times`` give a coefficient of variation
    (``OpTimes.forward_cv`` etc.), the median over the ranks of 256 seeded sampled steps
    (:func:`simulate.sample_bubbles`) instead: the expected bubble of a pipeline whose op durations jitter.

    Args:
        schedule: the pipeline schedule.
        pp: pipeline ranks p (1 means no pipeline: no bubble).
        microbatches: micro-batches per step m.
        virtual_stages: model chunks per rank v (interleaved schedules).
        op_times: T_F, T_B, T_W of one micro-batch per stage (one :class:`OpTimes` for all, or one per global
            stage); None: the FLOP split T_F = T_B = T_W (a full backward is 2 forwards, split 1:1; Qi 2023).
        p2p_s: one activation/gradient transfer between ranks, in the unit of ``op_times``.
        dispatch_s: the runtime's bookkeeping between two actions of a rank (idle), same unit.
        step_overhead_s: fixed idle time per step outside the actions (set-up and tail), same unit.
    """
    schedule = Schedule.parse(schedule, "schedule")
    if pp < 1 or microbatches < 1 or virtual_stages < 1:
        raise ValueError(f"pp={pp}, microbatches={microbatches}, virtual_stages={virtual_stages} must be >= 1")
    if pp == 1:
        return 0.0
    times = OpTimes() if op_times is None else op_times if isinstance(op_times, OpTimes) else tuple(op_times)
    args = (times, float(p2p_s), float(dispatch_s), float(step_overhead_s))
    m0 = STEADY_MICROBATCHES_PER_STAGE * pp
    if microbatches <= 2 * m0 or not isinstance(times, OpTimes):
        return _simulated(schedule, pp, microbatches, virtual_stages, *args)
    # Past the warm-up and cool-down every further micro-batch adds the same busy and the same idle time to each
    # rank (the steady state), so idle / busy-per-micro-batch, bubble x m, is linear in m: two simulations at m0
    # and 2 m0 give it for any m at their cost (m = 8192 micro-batches on 64 stages would take minutes).
    idle0 = _simulated(schedule, pp, m0, virtual_stages, *args) * m0
    idle1 = _simulated(schedule, pp, 2 * m0, virtual_stages, *args) * 2 * m0
    return (idle0 + (idle1 - idle0) * (microbatches - m0) / m0) / microbatches


#: micro-batches per stage past which :func:`bubble_fraction` extrapolates the steady state instead of simulating
STEADY_MICROBATCHES_PER_STAGE = 2


@lru_cache(maxsize=256)
def _simulated(
    schedule: Schedule, pp: int, m: int, v: int, times: OpTimes | tuple[OpTimes, ...], p2p: float, dispatch: float,
    overhead: float,
) -> float:  # fmt: skip
    # cached: the planner's max-model search asks for the same layout many times
    if any(t.varies for t in ((times,) if isinstance(times, OpTimes) else times)):
        return statistics.median(sample_bubbles(
            schedule, pp=pp, microbatches=m, virtual_stages=v, op_times=times, p2p_s=p2p, dispatch_s=dispatch,
            step_overhead_s=overhead,
        ))  # fmt: skip
    return simulate_schedule(
        schedule, pp=pp, microbatches=m, virtual_stages=v, op_times=times, p2p_s=p2p, dispatch_s=dispatch,
        step_overhead_s=overhead,
    ).bubble_over_busy  # fmt: skip
