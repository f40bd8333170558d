"""replay_actions: the zero-communication replay of recorded pipeline actions, against timelines worked by hand."""

from __future__ import annotations

import pytest

from lightning_v17.engine.pipeline.runtime import BubbleTimer, replay_actions


def _gpipe(rank: int, m: int, f: float, b: float) -> list[tuple[str, int, int, float]]:
    # torch's ScheduleGPipe: all forwards, then the backwards in micro-batch order
    return [("F", rank, i, f) for i in range(m)] + [("B", rank, i, b) for i in range(m)]


def _one_f_one_b(rank: int, p: int, m: int, f: float, b: float) -> list[tuple[str, int, int, float]]:
    warm = min(p - rank, m)  # forwards before the first backward (torch's Schedule1F1B warm-up + 1)
    acts = [("F", rank, i, f) for i in range(warm)]
    nf, nb = warm, 0
    while nb < m:
        acts.append(("B", rank, nb, b))
        nb += 1
        if nf < m:
            acts.append(("F", rank, nf, f))
            nf += 1
    return acts


@pytest.mark.parametrize("m", [2, 4, 8])
def test_equal_durations_give_the_planner_bubble(m: int) -> None:
    # p=2, F=1, B=2: the step is (m + p - 1)(F + B) and idle / busy = (p - 1) / m on both ranks
    for build in (lambda r: _gpipe(r, m, 1.0, 2.0), lambda r: _one_f_one_b(r, 2, m, 1.0, 2.0)):
        out = replay_actions({r: build(r) for r in (0, 1)}, num_stages=2)
        assert out["step_s"] == pytest.approx((m + 1) * 3.0)
        for r in (0, 1):
            assert out["bubble_over_busy"][r] == pytest.approx(1 / m)


def test_gpipe_with_a_slower_forward_on_the_last_stage() -> None:
    # worked by hand: rank 0 F=1 B=2, rank 1 F=1.5 B=2, m=2
    # r0 F0[0,1] F1[1,2]; r1 F0[1,2.5] F1[2.5,4] B0[4,6] B1[6,8]; r0 B0[6,8] B1[8,10]
    acts = {0: _gpipe(0, 2, 1.0, 2.0), 1: _gpipe(1, 2, 1.5, 2.0)}
    out = replay_actions(acts, num_stages=2)
    assert out["step_s"] == pytest.approx(10.0)
    assert out["busy_s"] == pytest.approx({0: 6.0, 1: 7.0})
    assert out["bubble_over_busy"] == pytest.approx({0: 4 / 6, 1: 3 / 7})


def test_loss_counts_as_part_of_the_last_stage_forward() -> None:
    with_loss = {0: _gpipe(0, 2, 1.0, 2.0), 1: []}
    for i in range(2):
        with_loss[1] += [("F", 1, i, 1.0), ("loss", -1, -1, 0.5)]
    with_loss[1] += [("B", 1, i, 2.0) for i in range(2)]
    merged = replay_actions(with_loss, num_stages=2)
    assert merged["step_s"] == pytest.approx(
        replay_actions({0: _gpipe(0, 2, 1.0, 2.0), 1: _gpipe(1, 2, 1.5, 2.0)}, num_stages=2)["step_s"]
    )


def test_incomplete_step_is_an_error() -> None:
    with pytest.raises(ValueError, match="never run"):
        replay_actions({0: [("F", 0, 0, 1.0), ("B", 0, 0, 1.0)], 1: [("F", 1, 0, 1.0)]}, num_stages=2)


class _Stage:
    """An object with the three PipelineStage compute methods: BubbleTimer must time and trace real calls."""

    stage_index = 3

    def forward_one_chunk(self, fwd_chunk_id, args, kwargs=None):
        return sum(range(10_000))

    def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
        return None

    def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):
        return None


def test_bubble_timer_trace_records_kind_stage_chunk() -> None:
    timer, stage = BubbleTimer(), _Stage()
    timer.wrap_stage(stage)
    stage.forward_one_chunk(0, ())
    timer.trace = []
    stage.forward_one_chunk(2, ())
    stage.backward_one_chunk(bwd_chunk_id=1)
    stage.backward_weight_one_chunk(1)
    assert [t[:3] for t in timer.trace] == [("F", 3, 2), ("B", 3, 1), ("W", 3, 1)]
    assert all(t1 >= t0 for *_, t0, t1 in timer.trace)
    # busy_s also holds the untraced first call
    assert timer.busy_s >= sum(t1 - t0 for *_, t0, t1 in timer.trace) > 0
