"""Pipeline bubble measurement (part of :mod:`lightning_v17.engine.pipeline.runtime`, which re-exports it): busy vs idle
time per rank (:class:`BubbleTimer`) and a replay of recorded actions (:func:`replay_actions`) through the planner's
event simulation (``lightning_v17.planner.simulate``), by default with zero communication time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

_ACTION_KIND = {"forward_one_chunk": "F", "backward_one_chunk": "B", "backward_weight_one_chunk": "W"}


@dataclass
class BubbleTimer:
    """Busy vs idle time of one pp rank per step: ``bubble = 1 - busy / step`` (Huang 2019 GPipe §2.3 defines the
    bubble as the idle fraction of a device over one step).

    Busy time is the wall time inside the stage compute calls the schedule makes (``forward_one_chunk``,
    ``backward_one_chunk``, ``backward_weight_one_chunk``) plus the last stage's loss; everything else inside
    ``schedule.step`` (waiting on P2P receives, schedule bookkeeping) is idle.

    Setting ``trace`` to a list (``enable_trace``) also records every action as ``(kind, stage_index, chunk_id, t0,
    t1)`` with kind "F", "B" (input or full backward), "W" (weight backward) or "loss" (perf_counter seconds): the
    per-action timeline ``bench/pipeline.py`` replays to separate stage-time variation from communication.
    """

    busy_s: float = 0.0
    history: list[dict[str, float]] = field(default_factory=list)
    trace: list[tuple[str, int, int, float, float]] | None = None

    def wrap_stage(self, stage: Any) -> None:
        for name, kind in _ACTION_KIND.items():
            fn = getattr(stage, name)

            def timed(*args: Any, _orig: Any = fn, _kind: str = kind, **kwargs: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return _orig(*args, **kwargs)
                finally:
                    t1 = time.perf_counter()
                    self.busy_s += t1 - t0
                    if self.trace is not None:
                        chunk = args[0] if args else kwargs.get("fwd_chunk_id", kwargs.get("bwd_chunk_id", -1))
                        self.trace.append((_kind, int(stage.stage_index), int(chunk), t0, t1))

            setattr(stage, name, timed)

    def record(self, step_s: float, busy_s: float) -> dict[str, float]:
        """Store one step. ``bubble_fraction`` = idle / step (the device's idle share of the step);
        ``bubble_over_busy`` = idle / busy, Narayanan 2021 §2.2's definition, which the planner's
        ``planner.pipeline.bubble_fraction`` predicts ((p-1)/m for GPipe/1F1B)."""
        idle = max(0.0, step_s - busy_s)
        rec = {
            "step_s": step_s,
            "busy_s": busy_s,
            "bubble_fraction": idle / step_s if step_s > 0 else 0.0,
            "bubble_over_busy": idle / busy_s if busy_s > 0 else 0.0,
        }
        self.history.append(rec)
        return rec

    @property
    def last(self) -> dict[str, float] | None:
        return self.history[-1] if self.history else None


def replay_actions(
    actions_by_rank: dict[int, list[tuple[str, int, int, float]]], num_stages: int, *, p2p_s: float = 0.0
) -> dict[str, Any]:
    """Replay recorded pipeline actions with the planner's event simulation (``planner.simulate.simulate``): the
    step the same action durations give, with ``p2p_s`` per transfer between ranks (default: none).

    Each rank runs its own actions in the recorded order; an action starts when its rank is free and its input is
    ready: ``F(s, i)`` after ``F(s-1, i)``; ``B(s, i)`` after ``B(s+1, i)`` (the last stage: after its ``F``);
    ``W(s, i)`` after ``B(s, i)``. A "loss" action belongs to the forward just before it on the same rank.
    Comparing the measured step with this replay separates stage-time variation and imbalance (in both) from
    communication and scheduling overhead (measured only); with equal durations everywhere the replay's idle / busy
    is exactly the planner's (p-1)/m for GPipe and 1F1B.

    Args:
        actions_by_rank: per pp rank, ``(kind, stage_index, chunk_id, duration_s)`` in execution order (kind "F",
            "B", "W" or "loss"), e.g. from :attr:`BubbleTimer.trace` of one step.
        num_stages: total number of pipeline stages.
        p2p_s: seconds per activation/gradient transfer between two ranks.

    Returns:
        ``{"step_s", "busy_s": {rank: s}, "bubble_over_busy": {rank: idle / busy}}``.

    Raises:
        ValueError: if the actions cannot all run (a dependency never executes: not one complete step).
    """
    from lightning_v17.planner.simulate import simulate

    seqs: dict[int, list[list[Any]]] = {}
    for rank, acts in actions_by_rank.items():
        seq: list[list[Any]] = []
        for kind, stage, chunk, dur in acts:
            if kind == "loss":
                for prev in reversed(seq):
                    if prev[0] == "F":
                        prev[3] += dur
                        break
                else:
                    raise ValueError(f"rank {rank}: a loss action with no forward before it")
                continue
            seq.append([kind, stage, chunk, dur])
        seqs[rank] = seq
    timeline = simulate({r: [tuple(a) for a in seq] for r, seq in seqs.items()}, num_stages=num_stages, p2p_s=p2p_s)
    return {
        "step_s": timeline.step,
        "busy_s": timeline.busy,
        "bubble_over_busy": timeline.bubble_over_busy_per_rank,
    }
