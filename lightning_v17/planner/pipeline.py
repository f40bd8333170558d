"""Pipeline bubble fraction per schedule.

Torch-free. The bubble fraction is the idle time of a pipeline step relative to its ideal (bubble-free) compute
time, as Narayanan 2021 §2.2 defines it: step time = ideal time × (1 + bubble fraction).
"""

from __future__ import annotations

from lightning_v17.config import Schedule


def bubble_fraction(schedule: Schedule, *, pp: int, microbatches: int, virtual_stages: int = 1) -> float:
    """Idle fraction of a pipeline step (bubble time / ideal compute time).

    Sources:
      - GPipe and 1F1B: (p - 1)/m (Narayanan 2021 §2.2.1; 1F1B has GPipe's bubble but holds only p micro-batches).
      - Interleaved 1F1B with v chunks per rank: (p - 1)/(v·m) (Narayanan 2021 §2.2.2).
      - ZB-H1: (p - 1)/(3m) when T_F = T_B = T_W (Qi 2023, Zero Bubble Pipeline Parallelism §3.1). The interleaved
        zero-bubble schedule (torch's ``ScheduleInterleavedZeroBubble``) with v chunks is counted as ZB-H1 divided
        by v, as interleaving divides 1F1B's bubble (an extrapolation, not a published figure).
      - ZB-H2 and ZBV: about 0 (Qi 2023 §3.2; ZBV reaches zero bubble with the V-shaped placement, §6).

    Args:
        schedule: the pipeline schedule.
        pp: pipeline stages p (1 means no pipeline: no bubble).
        microbatches: micro-batches per step m.
        virtual_stages: model chunks per rank v (interleaved schedules).
    """
    schedule = Schedule.parse(schedule, "schedule")
    if pp < 1 or microbatches < 1 or virtual_stages < 1:
        raise ValueError(f"pp={pp}, microbatches={microbatches}, virtual_stages={virtual_stages} must be >= 1")
    if pp == 1:
        return 0.0
    p, m, v = pp, microbatches, virtual_stages
    if schedule in (Schedule.GPIPE, Schedule.ONE_F_ONE_B):
        return (p - 1) / m
    if schedule == Schedule.INTERLEAVED_1F1B:
        return (p - 1) / (v * m)
    if schedule == Schedule.ZERO_BUBBLE:
        return (p - 1) / (3 * m * v)
    return 0.0  # ZB_H2, ZBV


__all__ = ["bubble_fraction"]
