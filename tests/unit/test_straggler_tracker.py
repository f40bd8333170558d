"""Pure straggler statistics with synthetic timings (torch-free, no process group)."""

from __future__ import annotations

import random

import pytest

from lightning_v17.trackers.straggler import StragglerTracker, mad, median, quantile


def test_robust_stats_by_hand():
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([1.0, 2.0, 3.0, 10.0]) == 2.5
    assert quantile([1.0, 2.0, 3.0, 4.0, 5.0], 0.9) == pytest.approx(4.6)  # numpy type 7: 1 + 0.9 * 4 = 4.6th
    assert mad([1.0, 2.0, 3.0, 4.0, 100.0]) == 1.0  # |x - 3| = 2,1,0,1,97 -> median 1


def _windows(world, steps, every, rng, base=0.05, sigma=0.08, slow=None, factor=1.0):
    """Synthetic per-step timings: lognormal noise around ``base`` seconds; rank ``slow`` is ``factor`` x slower."""
    for start in range(0, steps, every):
        n = min(every, steps - start)
        local = [
            [base * (factor if r == slow else 1.0) * rng.lognormvariate(0.0, sigma) for _ in range(n)]
            for r in range(world)
        ]
        wait = [[0.1 * v for v in row] for row in local]
        step = [[v + 0.02 for v in row] for row in local]
        yield step, local, wait


@pytest.mark.parametrize("world", [2, 8])
def test_balanced_200_steps_flags_nobody(world):
    rng = random.Random(1234)
    tracker = StragglerTracker(threshold=1.2, patience=3)
    reports = [tracker.update(s, lo, w, step=i) for i, (s, lo, w) in enumerate(_windows(world, 200, 20, rng))]
    assert len(reports) == 10
    assert all(not r.flagged for r in reports)
    assert max(x.ratio for r in reports for x in r.ranks) < 1.2


def test_slow_rank_flagged_exactly_after_patience_windows():
    rng = random.Random(7)
    tracker = StragglerTracker(threshold=1.2, patience=3)
    flagged_at = [
        tracker.update(s, lo, w, hosts=[f"node{r // 4}" for r in range(8)]).flagged
        for s, lo, w in _windows(8, 100, 20, rng, slow=5, factor=1.5)
    ]
    assert flagged_at == [(), (), (5,), (5,), (5,)]
    report = tracker.update(*next(_windows(8, 20, 20, rng, slow=5, factor=1.5)), hosts=[f"n{r}" for r in range(8)])
    assert report.flagged_hosts == ("n5",)
    table = report.table()
    assert "FLAGGED" in table and "step p50" in table and "data wait" in table


def test_intermittent_slowness_resets_patience():
    tracker = StragglerTracker(threshold=1.2, patience=3)
    fast, slow = [0.05] * 5, [0.09] * 5
    pattern = [True, True, False, True, True]
    flagged = []
    for is_slow in pattern:
        local = [fast, slow if is_slow else fast]
        flagged.append(tracker.update(local, local, [[0.0] * 5] * 2).flagged)
    assert flagged == [(), (), (), (), ()]


def test_absolute_noise_floor():
    # 1 ms vs 1.5 ms is 1.5x but only 0.5 ms: below min_excess_s=5 ms it is timer noise, not a straggler
    tracker = StragglerTracker(threshold=1.2, patience=1, min_excess_s=0.005)
    local = [[0.001] * 4, [0.0015] * 4]
    assert tracker.update(local, local, [[0.0] * 4] * 2).flagged == ()
    tracker = StragglerTracker(threshold=1.2, patience=1, min_excess_s=0.0)
    assert tracker.update(local, local, [[0.0] * 4] * 2).flagged == (1,)


def test_options_validated():
    with pytest.raises(ValueError, match="threshold"):
        StragglerTracker(threshold=1.0)
    with pytest.raises(ValueError, match="patience"):
        StragglerTracker(patience=0)


def test_low_quantile_score_ignores_intermittent_interference():
    # rank 1 is 2x slower on 8 of 20 steps (a noisy neighbour), never consistently: its 25th percentile is normal
    fast = [0.05] * 20
    noisy = [0.10 if i % 5 in (0, 2) else 0.05 for i in range(20)]
    zeros = [[0.0] * 20] * 2
    tracker = StragglerTracker(threshold=1.2, patience=1)  # score_quantile=0.25
    assert tracker.update([fast, noisy], [fast, noisy], zeros).flagged == ()
    tracker = StragglerTracker(threshold=1.2, patience=1, score_quantile=0.75)
    assert tracker.update([fast, noisy], [fast, noisy], zeros).flagged == (1,)
