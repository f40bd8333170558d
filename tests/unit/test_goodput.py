"""GoodputTracker on a synthetic timeline: injected failures every N steps (on average), a known checkpoint cost and
restart time; the measured goodput is within 10% of the Young/Daly prediction for the same MTBF and checkpoint cost (printed)."""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterator

import pytest

from lightning_v17.engine.trackers.goodput import GoodputTracker
from lightning_v17.planner.resilience import daly_interval_s, expected_goodput, young_interval_s


def _simulate(*, work_steps: int, step_s: float, every: int, ckpt_s: float, restart_s: float, ttfs: Iterator[float]):
    """A run of ``work_steps`` steps of ``step_s`` seconds with a checkpoint blocking ``ckpt_s`` after every
    ``every``-th step. The job fails ``next(ttfs)`` seconds after the run starts and after each failure (a failure
    may hit a step, a save, which is then never published, or the restart itself); it comes back ``restart_s`` later
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
