"""planner.simulate: schedule action lists against torch's own order, the event simulation against timelines worked
by hand, and the simulated bubble against the published closed forms (Narayanan 2021 §2.2, Qi 2023 §3.1)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest

from lightning_v17.config import Schedule, V17ConfigError
from lightning_v17.config.schedules import SCHEDULES, schedule_info
from lightning_v17.planner.pipeline import bubble_fraction
from lightning_v17.planner.simulate import (
    OpTimes,
    sample_bubbles,
    schedule_actions,
    simulate,
    simulate_schedule,
    splits_backward,
)

ROOT = Path(__file__).resolve().parents[2]

# --- the action order torch runs ---------------------------------------------------------------------------------


def _torch_orders(schedule: str, p: int, m: int, v: int) -> dict[str, dict[int, list[tuple[str, int, int]]]]:
    """torch 2.13's own orders for ``schedule``, built without a process group from stand-in stages.

    ``pipeline_order``: the schedule IR every torch schedule exposes; ``runtime``: for the multi-stage schedules,
    the compute actions of ``pipeline_order_with_comms``, the list ``_PipelineScheduleRuntime`` executes.
    """
    from torch.distributed.pipelining import schedules as ts

    kind = {ts.F: "F", ts.B: "B", ts.I: "B", ts.W: "W"}

    def convert(order: dict) -> dict[int, list[tuple[str, int, int]]]:
        return {
            r: [(kind[a.computation_type], a.stage_index, a.microbatch_index) for a in acts
                if a is not None and a.computation_type in kind]
            for r, acts in order.items()
        }  # fmt: skip

    info = schedule_info(schedule)
    if schedule == "zb_h1":  # one stage per rank through the interleaved zero-bubble IR (see planner.simulate)
        cls, v = ts.ScheduleInterleavedZeroBubble, 1
    else:
        cls = getattr(ts, info.torch_class)
    if info.placement.value == "single" and schedule != "zb_h1":
        # GPipe/1F1B run their own loop (_step_microbatches), not the IR: run that loop on a stage that records
        # its compute calls and has no P2P to do. (torch 2.13's Schedule1F1B.pipeline_order is off by one
        # micro-batch on the last rank, e.g. F1 B0 F2 B1 at p = m = 2; the loop runs F0 B0 F1 B1.)
        ran = {}
        for r in range(p):
            calls: list[tuple[str, int, int]] = []
            stage = _RecordingStage(r, p, calls)
            sched = cls(stage, n_microbatches=m, loss_fn=lambda out, target: out)
            sched._initialize_stage = lambda *a, **k: None
            sched._step_microbatches(target_mbs=[0.0] * m)
            ran[r] = calls
        return {"runtime": ran}
    stages = [
        SimpleNamespace(num_stages=p * v, group_size=p, group_rank=0, stage_index=s, submod=None)
        for s in info.stage_ids(0, pp=p, virtual_stages=v)
    ]
    sched = cls(stages, n_microbatches=m)
    return {"pipeline_order": convert(sched.pipeline_order), "runtime": convert(sched.pipeline_order_with_comms)}


class _RecordingStage:
    """Stands in for a ``PipelineStage`` of a single-stage torch schedule: records the compute calls, no P2P."""

    def __init__(self, index: int, num_stages: int, calls: list) -> None:
        self.stage_index, self.num_stages, self.calls = index, num_stages, calls
        self.is_first, self.is_last = index == 0, index == num_stages - 1

    def forward_one_chunk(self, i, *args, **kwargs):
        self.calls.append(("F", self.stage_index, i))
        return 0.0

    def backward_one_chunk(self, i, *args, **kwargs):
        self.calls.append(("B", self.stage_index, i))

    def get_fwd_recv_ops(self, i):
        return []

    get_fwd_send_ops = get_bwd_recv_ops = get_bwd_send_ops = get_fwd_recv_ops

    def perform_reduce_grad(self, *args):
        pass


TORCH_CASES = [
    (s, p, m, v)
    for s, v in [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 3), ("zero_bubble", 2),
                 ("zbv", 2), ("zb_h1", 1)]
    for p, m in [(2, 2), (2, 4), (2, 8), (4, 2), (4, 3), (4, 4), (4, 8), (4, 12), (3, 9)]
    if not (s == "1f1b" and m < p)
]  # fmt: skip


@pytest.mark.parametrize(("schedule", "p", "m", "v"), TORCH_CASES)
def test_action_order_is_the_one_torch_runs(schedule: str, p: int, m: int, v: int) -> None:
    pytest.importorskip("torch.distributed.pipelining")
    ours = {
        r: [tuple(a) for a in acts]
        for r, acts in schedule_actions(schedule, pp=p, microbatches=m, virtual_stages=v).items()
    }
    for name, theirs in _torch_orders(schedule, p, m, v).items():
        assert ours == theirs, (name, schedule, p, m, v)


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize(("p", "m"), [(1, 3), (2, 4), (4, 8), (4, 5), (3, 7)])
def test_every_action_once_on_the_rank_that_owns_its_stage(schedule: Schedule, p: int, m: int) -> None:
    info = schedule_info(schedule)
    v = 1 if not info.multi_chunk else 2
    if info.placement.value == "loop" and m % max(1, m // p):
        with pytest.raises(V17ConfigError, match="multiple"):  # torch's rounds do not divide m
            schedule_actions(schedule, pp=p, microbatches=m, virtual_stages=v)
        return
    acts = schedule_actions(schedule, pp=p, microbatches=m, virtual_stages=v)
    ops = ("F", "B", "W") if splits_backward(schedule) else ("F", "B")
    assert sorted(acts) == list(range(p))
    for r, seq in acts.items():
        stages = info.stage_ids(r, pp=p, virtual_stages=v)
        assert Counter(seq) == Counter((o, s, i) for o in ops for s in stages for i in range(m)), (r, seq)


# --- the event simulation, against timelines worked by hand -----------------------------------------------------


def test_p2p_latency_delays_every_cross_rank_dependency() -> None:
    # GPipe p=2, m=2, F=1, B=2, P2P 0.5: r0 F0[0,1] F1[1,2]; r1 F0[1.5,2.5] F1[2.5,3.5] B0[3.5,5.5] B1[5.5,7.5];
    # r0 B0[6,8] B1[8,10]: step 10, busy 6 each
    acts = {r: [("F", r, 0, 1.0), ("F", r, 1, 1.0), ("B", r, 0, 2.0), ("B", r, 1, 2.0)] for r in (0, 1)}
    t = simulate(acts, num_stages=2, p2p_s=0.5)
    assert t.step == pytest.approx(10.0)
    assert [(a.op, a.microbatch, s, e) for a, s, e in t.events[1]] == [
        ("F", 0, 1.5, 2.5), ("F", 1, 2.5, 3.5), ("B", 0, 3.5, 5.5), ("B", 1, 5.5, 7.5)]  # fmt: skip
    assert t.bubble_over_busy_per_rank == pytest.approx({0: 4 / 6, 1: 4 / 6})
    assert t.idle_fraction_per_rank == pytest.approx({0: 0.4, 1: 0.4})
    assert simulate(acts, num_stages=2).step == pytest.approx(9.0)  # without P2P: (m + p - 1)(F + B)


def test_dispatch_gap_and_step_overhead_by_hand() -> None:
    # as above with a 0.25 dispatch gap between two actions of a rank and 1.0 of set-up + tail per step:
    # r0 F0[0,1] F1[1.25,2.25]; r1 F0[1.5,2.5] F1[2.75,3.75] B0[4,6] B1[6.25,8.25]; r0 B0[6.5,8.5] B1[8.75,10.75]
    acts = {r: [("F", r, 0, 1.0), ("F", r, 1, 1.0), ("B", r, 0, 2.0), ("B", r, 1, 2.0)] for r in (0, 1)}
    t = simulate(acts, num_stages=2, p2p_s=0.5, dispatch_s=0.25, step_overhead_s=1.0)
    assert [(s, e) for _, s, e in t.events[0]] == [(0.0, 1.0), (1.25, 2.25), (6.5, 8.5), (8.75, 10.75)]
    assert [(s, e) for _, s, e in t.events[1]] == [(1.5, 2.5), (2.75, 3.75), (4.0, 6.0), (6.25, 8.25)]
    assert t.step == pytest.approx(11.75) and t.busy == pytest.approx({0: 6.0, 1: 6.0})
    assert bubble_fraction("gpipe", pp=2, microbatches=2, op_times=OpTimes(1.0, 2.0, 0.0), p2p_s=0.5,
                           dispatch_s=0.25, step_overhead_s=1.0) == pytest.approx(5.75 / 6)  # fmt: skip


def test_stages_on_one_rank_hand_over_without_p2p() -> None:
    # ZB-V turns on rank p-1 (stages p-1 and p): no transfer there, one on every other hop
    t = simulate_schedule("zbv", pp=2, microbatches=1, virtual_stages=2, p2p_s=10.0)
    starts = {a: s for ev in t.events.values() for a, s, _ in ev}
    assert starts[("F", 2, 0)] == pytest.approx(starts[("F", 1, 0)] + 1.0)  # same rank: right after
    assert starts[("F", 1, 0)] == pytest.approx(1.0 + 10.0)  # across ranks: + P2P


def test_weight_gradient_waits_for_its_input_gradient() -> None:
    # a W ordered before its own B can never run
    with pytest.raises(ValueError, match="never run"):
        simulate({0: [("F", 0, 0, 1.0), ("W", 0, 0, 1.0), ("B", 0, 0, 1.0)]}, num_stages=1)
    # and on another rank a W starts only when the B it follows has ended
    t = simulate({0: [("F", 0, 0, 1.0), ("B", 0, 0, 3.0), ("W", 0, 0, 1.0)]}, num_stages=1)
    assert t.events[0][2][1:] == (4.0, 5.0)


def test_unequal_stage_times_by_hand() -> None:
    # 1F1B p=2 m=2, stage 1 twice as slow: r0 F0[0,1] F1[1,2]; r1 F0[1,3] B0[3,7] F1[7,9] B1[9,13];
    # r0 B0[7,9] B1[13,15]: step 15
    times = [OpTimes(1.0, 1.0, 1.0), OpTimes(2.0, 2.0, 2.0)]
    t = simulate_schedule("1f1b", pp=2, microbatches=2, op_times=times)
    assert t.step == pytest.approx(15.0)
    assert t.busy == pytest.approx({0: 6.0, 1: 12.0})
    assert t.bubble_over_busy == pytest.approx((9 / 6 + 3 / 12) / 2)  # median of two ranks = their mean


def test_full_backward_schedules_run_b_plus_w_as_one_action() -> None:
    split = simulate_schedule("1f1b", pp=4, microbatches=8, op_times=OpTimes(1.0, 0.5, 1.5))
    merged = simulate_schedule("1f1b", pp=4, microbatches=8, op_times=OpTimes(1.0, 2.0, 0.0))
    assert split.step == merged.step == pytest.approx(11 * 3.0)
    assert not splits_backward("interleaved_1f1b") and splits_backward("zb-h1") and splits_backward("zbv")


def test_op_times_default_is_the_flop_split() -> None:
    t = OpTimes()
    assert (t.forward, t.backward_input, t.backward_weight, t.full_backward) == (1.0, 1.0, 1.0, 2.0)
    with pytest.raises(ValueError, match="forward"):
        OpTimes(forward=-1.0)
    with pytest.raises(ValueError, match="one per stage"):
        simulate_schedule("1f1b", pp=2, microbatches=2, op_times=[OpTimes()])


# --- closed forms as cross-checks -------------------------------------------------------------------------------


@pytest.mark.parametrize(("p", "m"), [(2, 4), (2, 8), (4, 8), (4, 16), (8, 32), (3, 12)])
def test_closed_forms_at_equal_times(p: int, m: int) -> None:
    # Narayanan 2021 §2.2.1: GPipe/1F1B (p-1)/m; §2.2.2: interleaved (p-1)/(v·m) (m a multiple of p);
    # Qi 2023 §3.1: ZB-H1 (p-1)/(3m) when T_F = T_B = T_W
    assert bubble_fraction("gpipe", pp=p, microbatches=m) == pytest.approx((p - 1) / m)
    assert bubble_fraction("1f1b", pp=p, microbatches=m) == pytest.approx((p - 1) / m)
    for v in (2, 4):
        assert bubble_fraction("interleaved", pp=p, microbatches=m, virtual_stages=v) == pytest.approx(
            (p - 1) / (v * m)
        )
    assert bubble_fraction("zb-h1", pp=p, microbatches=m) == pytest.approx((p - 1) / (3 * m))
    # ZB-H1's bubble is (p-1)(T_F + T_B - T_W) per rank (Qi 2023 §3.1), also at unequal op times
    t = OpTimes(forward=1.0, backward_input=1.5, backward_weight=0.75)
    busy = m * (1.0 + 1.5 + 0.75)
    assert bubble_fraction("zb_h1", pp=p, microbatches=m, op_times=t) == pytest.approx((p - 1) * 1.75 / busy)


def test_zb_h1_is_not_the_interleaved_zero_bubble_schedule() -> None:
    assert Schedule.parse("zb-h1") is Schedule.ZB_H1 is not Schedule.ZERO_BUBBLE
    assert not schedule_info("zb_h1").multi_chunk and schedule_info("zb_h1").runnable
    assert schedule_info("zb_h1").multi_stage_runtime and not schedule_info("zb_h2").runnable
    assert schedule_info("zero_bubble").runnable and schedule_info("zbv").runnable
    with pytest.raises(V17ConfigError, match="virtual_stages=1"):
        schedule_actions("zb_h1", pp=4, microbatches=8, virtual_stages=2)


def test_p2p_and_slower_ops_raise_the_bubble() -> None:
    base = bubble_fraction("zbv", pp=2, microbatches=4, virtual_stages=2)
    assert bubble_fraction("zbv", pp=2, microbatches=4, virtual_stages=2, p2p_s=0.2) > base
    assert bubble_fraction("1f1b", pp=1, microbatches=4) == 0.0
    with pytest.raises(ValueError, match="must be >= 1"):
        bubble_fraction("1f1b", pp=2, microbatches=0)


# --- jitter: op durations that vary from micro-batch to micro-batch --------------------------------------------


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv"])
def test_no_jitter_samples_are_the_deterministic_step(schedule: str) -> None:
    v = 1 if schedule in ("gpipe", "1f1b") else 2
    times = OpTimes(1.0, 0.8, 1.2)
    one = simulate_schedule(schedule, pp=2, microbatches=4, virtual_stages=v, op_times=times, p2p_s=0.05)
    sampled = sample_bubbles(schedule, pp=2, microbatches=4, virtual_stages=v, op_times=times, p2p_s=0.05, samples=3)
    assert sampled == list(one.bubble_over_busy_per_rank.values()) * 3


def test_jitter_on_one_op_by_hand() -> None:
    """pp=2, m=1 GPipe is one serial chain F0 -> F1 -> B1 -> B0, so rank 0 idles while rank 1 works: its idle /
    busy is (F1 + B1) / (F0 + B0) = (F1 + 2) / 3 with T_F = 1 and a full backward of 2, and only stage 1's forward
    varies. Its mean over the draws is (E[F1] + 2) / 3, and E[F1] = 1 for a CV of 0.2 (the clip at 0 is 5 standard
    deviations away)."""
    times = [OpTimes(1.0, 1.0, 1.0), OpTimes(1.0, 1.0, 1.0, forward_cv=0.2)]
    vals = sample_bubbles("gpipe", pp=2, microbatches=1, op_times=times, samples=4000, seed=3)
    rank0, rank1 = vals[0::2], vals[1::2]
    f1 = [3 * x - 2 for x in rank0]  # solve rank 0's bubble for the drawn F1
    mean = sum(f1) / len(f1)
    sd = (sum((x - mean) ** 2 for x in f1) / len(f1)) ** 0.5
    assert abs(mean - 1.0) < 0.015 and abs(sd - 0.2) < 0.015, (mean, sd)
    assert all(abs(b - 3 / (f + 2)) < 1e-12 for b, f in zip(rank1, f1))  # rank 1 idles for F0 + B0 = 3


def test_jitter_raises_the_1f1b_bubble_and_is_seeded() -> None:
    """A pipeline waits on the slower of two dependencies, so jitter adds idle time the means do not show (1F1B at
    m=8 on this CPU: 0.159 measured against 0.131 from the mean op times, 0.163 with their CVs)."""
    flat = bubble_fraction("1f1b", pp=2, microbatches=8)
    cv = OpTimes(forward_cv=0.15, backward_input_cv=0.15, backward_weight_cv=0.15)
    jittered = bubble_fraction("1f1b", pp=2, microbatches=8, op_times=cv)
    assert flat == pytest.approx(1 / 8)
    assert jittered > flat + 0.02, (jittered, flat)
    assert sample_bubbles("1f1b", pp=2, microbatches=8, op_times=cv, samples=5, seed=1) == sample_bubbles(
        "1f1b", pp=2, microbatches=8, op_times=cv, samples=5, seed=1
    )
    assert OpTimes(1.0, 1.0, 3.0, backward_input_cv=0.2, backward_weight_cv=0.1).full_backward_cv == pytest.approx(
        (0.2**2 + 0.3**2) ** 0.5 / 4
    )
