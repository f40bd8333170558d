"""GoodputTracker on a synthetic timeline: injected failures every N steps (on average), a known checkpoint cost and
restart time; the measured goodput is within 10% of the Young/Daly prediction for the same MTBF and checkpoint cost
(printed). The real-run counterpart is ``bench/goodput.py`` (``tests/integration/test_goodput_restart.py``)."""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterator

import pytest

from lightning_v17.planner.resilience import daly_interval_s, expected_goodput, young_interval_s
from lightning_v17.trackers.goodput import GoodputBreakdown, GoodputTracker


def _simulate(
    *,
    work_steps: int,
    step_s: float,
    every: int,
    ckpt_s: float,
    restart_s: float,
    ttfs: Iterator[float],
    gap_s: float = 0.0,
):
    """A run of ``work_steps`` steps of ``step_s`` seconds, each followed by ``gap_s`` seconds of the loop's own work
    (not step time), with a checkpoint blocking ``ckpt_s`` after every ``every``-th step. The job fails
    ``next(ttfs)`` seconds after the run starts and after each failure (a failure may hit a step, the loop's work
    after it, a save, which is then never published, or the restart itself); it comes back ``restart_s`` later
    from the newest published checkpoint, exactly as the callback wires it: the previous attempt's ``progress()`` and
    the checkpoint's ``state_dict()``. Returns (breakdown, failures, exact redone seconds, executed steps, saves)."""
    t = 1000.0
    next_fail = t + next(ttfs)
    progress, ckpt, ckpt_step = None, None, 0
    failures, lost_exact, executed, saves = 0, 0.0, 0, 0
    while True:
        tracker = GoodputTracker()
        tracker.start_attempt(t, previous=progress, checkpoint=ckpt)
        if progress is not None or failures:
            while t + restart_s > next_fail:  # failed again while restarting
                failures, t = failures + 1, next_fail
                next_fail = t + next(ttfs)
            t += restart_s
        step, failed = ckpt_step, False
        while step < work_steps:
            tracker.step_started(t)
            if t + step_s > next_fail:
                failed = True
                break
            t += step_s
            step += 1
            executed += 1
            tracker.step_finished(step_s, now_s=t, step=step)
            progress = tracker.progress()
            if gap_s:
                if t + gap_s > next_fail:  # died between steps: this step completed but is lost all the same
                    failed = True
                    break
                t += gap_s
            if step % every == 0:
                if t + ckpt_s > next_fail:  # died while saving: this checkpoint never becomes complete
                    failed = True
                    break
                t += ckpt_s
                saves += 1
                tracker.add_checkpoint_blocking(ckpt_s)
                ckpt, ckpt_step = tracker.state_dict(), step
                progress = tracker.progress()
        if not failed:
            return tracker.breakdown(t), failures, lost_exact, executed, saves
        failures += 1
        lost_exact += (step - ckpt_step) * step_s
        t = next_fail
        next_fail = t + next(ttfs)


def test_breakdown_is_exact_on_a_synthetic_timeline():
    """Failures every 25.5 s of the job's life (25 steps, then death mid-step): every second is accounted for."""
    b, failures, lost, executed, saves = _simulate(
        work_steps=100, step_s=1.0, every=10, ckpt_s=0.5, restart_s=4.0, ttfs=itertools.repeat(25.5)
    )
    assert failures >= 4 and b.attempts == failures + 1 and b.step == 100
    assert b.useful_s == pytest.approx(100.0)
    assert b.redo_s == pytest.approx(lost) and b.redo_s + b.useful_s == pytest.approx(executed * 1.0)
    assert b.checkpoint_s == pytest.approx(0.5 * saves)
    assert b.other_s == pytest.approx(0.0, abs=1e-9), "every second is useful, redo, checkpoint or restart"
    assert b.restart_s >= failures * 4.0 and b.goodput == pytest.approx(100.0 / b.wall_s)


@pytest.mark.parametrize(
    ("mtbf_steps", "step_s", "ckpt_s", "restart_s"),
    [(50, 1.0, 1.0, 5.0), (200, 0.5, 2.0, 20.0), (1000, 1.0, 5.0, 30.0)],
)
def test_measured_goodput_matches_young_daly_prediction_within_10_percent(mtbf_steps, step_s, ckpt_s, restart_s):
    """Failures injected on average every ``mtbf_steps`` steps (exponential times to failure, the model's
    assumption; seeded), the checkpoint interval Young's optimum for that MTBF (what the planner would choose)."""
    mtbf = mtbf_steps * step_s
    every = max(1, round(young_interval_s(ckpt_s, mtbf) / step_s))
    rng = random.Random(17)
    ttfs = iter(lambda: rng.expovariate(1.0 / mtbf), None)
    b, failures, _, _, _ = _simulate(
        work_steps=300 * mtbf_steps, step_s=step_s, every=every, ckpt_s=ckpt_s, restart_s=restart_s, ttfs=ttfs
    )
    predicted = expected_goodput(interval_s=every * step_s, checkpoint_s=ckpt_s, mtbf_s=mtbf, restart_s=restart_s)
    print(
        f"\nMTBF {mtbf:.0f}s ({failures} failures, observed {b.wall_s / failures:.1f}s), checkpoint {ckpt_s}s every "
        f"{every} steps (Young {young_interval_s(ckpt_s, mtbf):.1f}s, Daly {daly_interval_s(ckpt_s, mtbf):.1f}s): "
        f"measured goodput {b.goodput:.4f}, Young/Daly predicted {predicted:.4f}\n{b.table()}"
    )
    assert failures >= 200
    assert abs(b.goodput - predicted) <= 0.10 * predicted


def test_expected_goodput_limits_and_errors():
    assert expected_goodput(interval_s=10.0, checkpoint_s=0.0, mtbf_s=1e12) == pytest.approx(1.0)
    # first order (Young 1974): waste ~ δ/τ + (τ/2 + R)/M
    g = expected_goodput(interval_s=100.0, checkpoint_s=1.0, mtbf_s=1e5, restart_s=10.0)
    assert 1.0 / g - 1.0 == pytest.approx(1.0 / 100 + (50.0 + 10.0) / 1e5, rel=0.01)
    with pytest.raises(ValueError, match="mtbf_s"):
        expected_goodput(interval_s=1.0, checkpoint_s=1.0, mtbf_s=0.0)
    assert math.isfinite(expected_goodput(interval_s=1.0, checkpoint_s=5.0, mtbf_s=2.0, restart_s=1.0))


def test_progress_round_trip_without_checkpoint_redoes_everything():
    a = GoodputTracker()
    a.start_attempt(0.0)
    for i in range(3):
        a.step_started(float(i))
        a.step_finished(1.0, now_s=i + 1.0, step=i + 1)
    b = GoodputTracker()
    b.start_attempt(10.0, previous=a.progress(), checkpoint=None)  # died before the first save: start over
    b.step_started(12.0)
    b.step_finished(1.0, now_s=13.0, step=1, useful=False)  # a withheld (bad) step
    out = b.breakdown(13.0)
    assert (out.useful_s, out.redo_s, out.restart_s, out.bad_step_s, out.attempts) == (0.0, 3.0, 9.0, 1.0, 2)
    assert out.wall_s == 13.0 and out.other_s == pytest.approx(0.0)


def test_save_count_spans_attempts_so_the_interval_does_too():
    """useful_s and checkpoint_s are the run's, over every attempt; Young/Daly's interval is useful time per save,
    so the save count must be the run's too (a per-attempt count stretched the interval by the attempts)."""
    a = GoodputTracker()
    a.start_attempt(0.0)
    for i in range(6):  # a save blocks 0.5 s after every second step
        a.step_started(float(i))
        a.step_finished(1.0, now_s=i + 1.0, step=i + 1)
        if i % 2 == 1:
            a.add_checkpoint_blocking(0.5)
    b = GoodputTracker()
    b.start_attempt(20.0, previous=a.progress(), checkpoint={"useful_s": 6.0, "step": 6})
    b.step_started(25.0)
    b.step_finished(1.0, now_s=26.0, step=7)
    b.step_started(26.0)
    b.step_finished(1.0, now_s=27.0, step=8)
    b.add_checkpoint_blocking(0.5)
    assert (b.saves, b.checkpoint_s, b.useful_s) == (4, 2.0, 8.0)  # 8 useful seconds over 4 saves: 2 s apart


def test_expected_goodput_overhead_term_hand_computed():
    """o, the loop's wall time per interval that is neither step time nor a save, lengthens Daly's segment (so a
    failure loses it too) but is not goodput. Hand-computed: without failures goodput is τ/(τ+o+δ) = 100/115;
    with τ=100, o=10, δ=5, R=50, M=1000 s, 1/g = M·e^{R/M}·(e^{(τ+o+δ)/M} − 1)/τ = 10·e^{0.05}·(e^{0.115} − 1)
    = 10 · 1.0512711 · 0.1218734 = 1.2812190 (its first-order part: 1.15·(1 + 0.05 + 0.0575) = 1.2736)."""
    assert expected_goodput(interval_s=100.0, overhead_s=10.0, checkpoint_s=5.0, mtbf_s=1e12) == pytest.approx(
        100.0 / 115.0, rel=1e-6
    )
    g = expected_goodput(interval_s=100.0, overhead_s=10.0, checkpoint_s=5.0, mtbf_s=1000.0, restart_s=50.0)
    assert 1.0 / g == pytest.approx(1.2812190, rel=1e-6)
    with pytest.raises(ValueError, match="overhead_s"):
        expected_goodput(interval_s=1.0, checkpoint_s=0.0, mtbf_s=10.0, overhead_s=-1.0)


def test_overhead_between_steps_is_predicted_on_a_synthetic_timeline():
    """Exponential failures (mean 100 steps), 0.15 s of loop work after every 1 s step: the timeline's goodput matches
    the prediction with the overhead term within 3%, and the prediction without it misses by more than 10%."""
    mtbf, step_s, gap_s, every, ckpt_s, restart_s = 100.0, 1.0, 0.15, 10, 0.5, 5.0
    rng = random.Random(13)
    ttfs = iter(lambda: rng.expovariate(1.0 / mtbf), None)
    b, failures, _, _, saves = _simulate(
        work_steps=30000, step_s=step_s, every=every, ckpt_s=ckpt_s, restart_s=restart_s, ttfs=ttfs, gap_s=gap_s
    )
    inputs = b.model_inputs(saves=saves)
    assert inputs["interval_s"] == pytest.approx(every * step_s) and inputs["checkpoint_s"] == pytest.approx(ckpt_s)
    common = {"interval_s": every * step_s, "checkpoint_s": ckpt_s, "mtbf_s": mtbf, "restart_s": restart_s}
    with_o = expected_goodput(**common, overhead_s=every * gap_s)
    without_o = expected_goodput(**common)
    print(f"\n{failures} failures: measured {b.goodput:.4f}, predicted {with_o:.4f} (without overhead {without_o:.4f})")
    assert failures >= 200
    assert abs(b.goodput / with_o - 1.0) <= 0.03
    assert abs(b.goodput / without_o - 1.0) > 0.10


def test_a_dropped_step_and_the_wait_for_the_next_quorum_are_dropped_s():
    """Replica groups: the step the quorum did not commit (2 s) and the wait from its end to the survivors' next
    quorum (1.5 s) are ``dropped_s``, not useful, not bad steps, not other."""
    t = GoodputTracker()
    t.start_attempt(0.0)
    t.step_started(0.0)
    t.step_finished(1.0, now_s=1.0, step=1)
    t.step_started(1.0)
    t.step_finished(2.0, now_s=3.0, step=1, useful=False, dropped=True)
    t.add_dropped_wait(1.5)
    t.step_started(4.5)
    t.step_finished(1.0, now_s=5.5, step=2)
    out = t.breakdown(5.5)
    assert (out.useful_s, out.dropped_s, out.bad_step_s, out.other_s) == (2.0, 3.5, 0.0, 0.0)
    assert "dropped" in out.table() and out.metrics()["goodput/dropped_s"] == 3.5
    again = GoodputTracker()
    again.start_attempt(6.0, previous=t.progress(), checkpoint={"useful_s": 2.0, "step": 2})
    assert again.dropped_s == 3.5  # carried across attempts like the other counters


def test_model_inputs_per_save_and_per_failure():
    """Hand-computed: 10 saves and 2 failures (3 attempts) over a 200 s run."""
    b = GoodputBreakdown(wall_s=200.0, useful_s=150.0, restart_s=20.0, redo_s=10.0, checkpoint_s=5.0, bad_step_s=2.0,
                         dropped_s=1.0, other_s=12.0, goodput=0.75, attempts=3, step=100)  # fmt: skip
    assert b.failures == 2
    assert b.model_inputs(saves=10) == pytest.approx(
        {"interval_s": 15.0, "overhead_s": 1.5, "checkpoint_s": 0.5, "restart_s": 10.0, "mtbf_s": 100.0}
    )
    one = GoodputBreakdown(**{**b.__dict__, "attempts": 1}).model_inputs(saves=10)
    assert one["restart_s"] == 0.0 and one["mtbf_s"] == math.inf
    with pytest.raises(ValueError, match="saves"):
        b.model_inputs(saves=0)


def test_monitor_prediction_counts_the_loop_overhead():
    """GoodputMonitor's printed prediction is the planner's formula on its measured inputs, overhead included."""
    from lightning_v17.callbacks import GoodputMonitor

    mon = GoodputMonitor(mtbf_hours=0.5)
    b, failures, _, _, saves = _simulate(
        work_steps=200, step_s=1.0, every=10, ckpt_s=0.5, restart_s=4.0, ttfs=itertools.repeat(60.0), gap_s=0.2
    )
    mon.last, mon.tracker.saves = b, saves
    assert failures >= 3 and b.other_s > 0
    want = expected_goodput(interval_s=b.useful_s / saves, overhead_s=b.other_s / saves, checkpoint_s=0.5,
                            mtbf_s=1800.0, restart_s=b.restart_s / failures)  # fmt: skip
    assert mon.predicted_goodput() == pytest.approx(want, rel=1e-12)
    observed = b.model_inputs(saves=saves)  # the MTBF the timeline saw: wall seconds per failure
    assert mon.predicted_goodput(mtbf_s=observed["mtbf_s"]) == pytest.approx(expected_goodput(**observed), rel=1e-12)
    assert GoodputMonitor().predicted_goodput() is None  # neither mtbf_hours nor mtbf_s
    assert mon.predicted_goodput() < expected_goodput(interval_s=b.useful_s / saves, checkpoint_s=0.5, mtbf_s=1800.0,
                                                      restart_s=b.restart_s / failures)  # fmt: skip
