"""The one table of pipeline schedules: what each one needs and whether the engine can run it.

Torch-free, so that the policy (``config.PipelinePolicy``), the planner and the engine (``engine/pipeline/runtime.py``) read
the same facts instead of each keeping its own tuple of "multi-chunk" schedules (three such tables had drifted apart:
"zbv" was multi-chunk in one of them and not in another).

Per schedule:

* ``placement``: how a rank's model chunks sit on the pipeline. ``single``: one stage per rank (GPipe, 1F1B,
  ZB-H1, ZB-H2);
  ``loop``: rank r holds stages r, r + p, r + 2p, ... (Narayanan 2021 §2.2, interleaved); ``v``: rank r holds stages
  r and 2p - 1 - r, so the first and the last stage share rank 0 (Qi 2023 §6, ZB-V).
* chunks per rank ``v``: 1 for ``single``, exactly 2 for ``v``, any ``v >= 2`` (the user's ``virtual_stages``) for
  ``loop``.
* micro-batches whose activations the first stage holds at its peak (the planner's activation memory): GPipe all m;
  1F1B, ZB-H1 and torch's interleaved zero bubble ``min(p, m)`` (Narayanan 2021 §2.2.1; Qi 2023 §3.1 keeps
  1F1B's memory); ZB-H2 ``min(2p - 1, m)`` (Qi 2023 §3.2); ZB-V ``min(p, m)`` chunk pairs (Qi 2023 §6: the same
  peak as 1F1B).
* ``torch_class``: the ``torch.distributed.pipelining`` schedule the engine runs, or None when there is none.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from lightning_v17.config.enums import Schedule
from lightning_v17.config.errors import V17ConfigError

__all__ = ["SCHEDULES", "Placement", "ScheduleInfo", "schedule_info"]


class Placement(StrEnum):
    """How a rank's model chunks are placed on the pipeline."""

    SINGLE = "single"
    LOOP = "loop"
    V = "v"


@dataclass(frozen=True)
class ScheduleInfo:
    """Facts about one pipeline schedule (see the module docstring).

    Args:
        schedule: the schedule.
        placement: chunk placement.
        torch_class: class name in ``torch.distributed.pipelining``; None: the engine cannot run it.
        in_flight: "m" (all micro-batches), "p" (``min(p, m)``) or "2p-1" (``min(2p - 1, m)``).
        source: the paper section the schedule comes from.
        split_backward: the backward runs as two actions, B (input gradient) and W (weight gradient), as in the
            zero-bubble schedules (Qi 2023); False: one full backward.
    """

    schedule: Schedule
    placement: Placement
    torch_class: str | None
    in_flight: str
    source: str
    split_backward: bool = False

    @property
    def multi_chunk(self) -> bool:
        """Whether a rank holds more than one model chunk (``virtual_stages`` > 1)."""
        return self.placement != Placement.SINGLE

    @property
    def multi_stage_runtime(self) -> bool:
        """Whether torch's class is a multi-stage runtime (``PipelineScheduleMulti``: it takes a list of stages and
        runs ``max(1, m // p)`` rounds), even for a one-stage-per-rank placement (ZB-H1)."""
        return self.torch_class in ("ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble")

    @property
    def runnable(self) -> bool:
        """Whether ``lightning_v17.engine.pipeline.runtime`` can run it (a torch.distributed.pipelining schedule exists)."""
        return self.torch_class is not None

    def check_virtual_stages(self, virtual_stages: int) -> None:
        """Raise a :class:`V17ConfigError` naming the fix unless ``virtual_stages`` suits this schedule."""
        name = self.schedule.value
        if self.placement == Placement.SINGLE and virtual_stages != 1:
            raise V17ConfigError(
                f"PipelinePolicy(schedule={name!r}) runs one stage per rank; set virtual_stages=1, or use schedule="
                f"'interleaved_1f1b', 'zero_bubble' or 'zbv' for virtual_stages={virtual_stages}"
            )
        if self.placement == Placement.LOOP and virtual_stages < 2:
            raise V17ConfigError(
                f"PipelinePolicy(schedule={name!r}) needs virtual_stages >= 2 (model chunks per rank); set "
                "virtual_stages=2 or use schedule='1f1b'"
            )
        if self.placement == Placement.V and virtual_stages != 2:
            raise V17ConfigError(f"PipelinePolicy(schedule={name!r}) uses exactly virtual_stages=2 (the V shape)")

    def check_runnable(self) -> None:
        """Raise a :class:`V17ConfigError` naming the runnable alternatives when the engine cannot run it."""
        if not self.runnable:
            ok = ", ".join(repr(s.value) for s, i in SCHEDULES.items() if i.runnable)
            raise V17ConfigError(
                f"PipelinePolicy(schedule={self.schedule.value!r}) has no torch.distributed.pipelining implementation, "
                f"so the engine cannot run it (the planner can still estimate it); choose one of {ok}"
            )

    def engine_note(self) -> str | None:
        """For a schedule the engine cannot run: what the planner's recommendation says instead of running it."""
        if self.runnable:
            return None
        ok = " or ".join(repr(s.value) for s, i in SCHEDULES.items() if i.runnable and i.split_backward)
        return (
            f"schedule {self.schedule.value!r} ({self.source}) is planner-only: torch.distributed.pipelining has no "
            f"implementation, so V17Strategy cannot run it; the engine runs the B/W-split schedules {ok}"
        )

    def check_microbatches(self, *, pp: int, microbatches: int) -> None:
        """Raise a :class:`V17ConfigError` naming valid values unless torch's schedule accepts ``microbatches``.

        torch.distributed.pipelining (2.13): ``Schedule1F1B`` needs m >= p; the interleaved and zero-bubble runtimes
        run ``max(1, m // p)`` rounds and need m to be a multiple of that.
        """
        name, m, p = self.schedule.value, microbatches, pp
        if self.schedule == Schedule.ONE_F_ONE_B and m < p:
            raise V17ConfigError(
                f"PipelinePolicy(schedule={name!r}) needs microbatches >= pp stages: microbatches={m} < pp={p}; set "
                f"microbatches >= {p}"
            )
        rounds = self.torch_class in ("ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble")
        if rounds and m % max(1, m // p) != 0:
            ok = [k for k in range(p, 4 * p + 1) if k % max(1, k // p) == 0]
            raise V17ConfigError(
                f"PipelinePolicy(schedule={name!r}) runs microbatches // pp rounds and needs microbatches to be a "
                f"multiple of them: microbatches={m} with pp={p} is not; try one of {ok[:6]}"
            )

    def stage_ids(self, pp_rank: int, *, pp: int, virtual_stages: int) -> tuple[int, ...]:
        """Global stage indices owned by pipeline rank ``pp_rank``, in increasing order."""
        if self.placement == Placement.V:
            return (pp_rank, 2 * pp - 1 - pp_rank)
        if self.placement == Placement.SINGLE:
            return (pp_rank,)
        return tuple(pp_rank + k * pp for k in range(virtual_stages))

    def microbatches_in_flight(self, *, pp: int, microbatches: int) -> int:
        """Micro-batches whose activations the first stage holds at its peak (see the module docstring)."""
        if self.in_flight == "m":
            return microbatches
        if self.in_flight == "2p-1":
            return min(2 * pp - 1, microbatches)
        return min(pp, microbatches)


SCHEDULES: dict[Schedule, ScheduleInfo] = {
    s.schedule: s
    for s in (
        ScheduleInfo(Schedule.GPIPE, Placement.SINGLE, "ScheduleGPipe", "m", "Huang 2019 (GPipe) §2.3"),
        ScheduleInfo(Schedule.ONE_F_ONE_B, Placement.SINGLE, "Schedule1F1B", "p", "Narayanan 2021 §2.2.1"),
        ScheduleInfo(
            Schedule.INTERLEAVED_1F1B, Placement.LOOP, "ScheduleInterleaved1F1B", "p", "Narayanan 2021 §2.2.2"
        ),
        ScheduleInfo(
            Schedule.ZERO_BUBBLE, Placement.LOOP, "ScheduleInterleavedZeroBubble", "p", "Qi 2023 ZB-1P, looped", True
        ),
        # Qi's handcrafted ZB-H1 runs one stage per rank; torch 2.13 has no class of that name, but its
        # ScheduleInterleavedZeroBubble given one stage per rank (a list of one) computes exactly ZB-H1's order
        # (tests/unit/test_pipeline_sim.py compares the two), so the engine runs ZB-H1 through it. ZB-H2 (2p - 1
        # warm-up forwards) has no torch implementation: planner-only.
        ScheduleInfo(Schedule.ZB_H1, Placement.SINGLE, "ScheduleInterleavedZeroBubble", "p", "Qi 2023 §3.1", True),
        ScheduleInfo(Schedule.ZB_H2, Placement.SINGLE, None, "2p-1", "Qi 2023 §3.2", True),
        ScheduleInfo(Schedule.ZBV, Placement.V, "ScheduleZBVZeroBubble", "p", "Qi 2023 §6", True),
    )
}


def schedule_info(schedule: Schedule | str) -> ScheduleInfo:
    """The table row of ``schedule`` (a :class:`Schedule` or its name)."""
    return SCHEDULES[Schedule.parse(schedule)]
