"""BadStepTracker (pure): NaN/inf and running-median spikes, patience, the offending streak, state round trip."""

from __future__ import annotations

import math

import pytest

from lightning_v17.trackers.bad_steps import BadStepError, BadStepTracker


def _warm(t: BadStepTracker, n: int = 10, loss: float = 1.0) -> None:
    for i in range(n):
        assert not t.observe(loss + 0.01 * (i % 3), batch_id=("warm", i)).bad


def test_nonfinite_is_bad_from_the_first_step_and_always_withheld():
    t = BadStepTracker(patience=1)
    for bad in (math.nan, math.inf, -math.inf):
        v = t.observe(bad, batch_id=7)
        assert v.reason == "nonfinite" and v.triggered and v.withhold and v.offending == (7,)
        assert t.observe(1.0).reason == "ok"  # and a good step resets the streak
    assert t.events == 3 and t.withheld_steps == 3 and t.bad_steps == 3


def test_spike_against_running_median_only_after_min_history():
    t = BadStepTracker(spike_factor=3.0, window=20, min_history=10)
    for i in range(9):
        assert t.observe(1.0 if i else 50.0, batch_id=i).reason == "ok"  # no median yet: a big early loss is ok
    t.observe(1.0)
    assert t.median == pytest.approx(1.0)  # the median ignores the one early 50.0 (the mean would be 5.9)
    assert t.observe(2.9).reason == "ok"
    v = t.observe(3.1, batch_id="b")
    assert v.reason == "spike" and v.median == pytest.approx(1.0) and v.withhold and v.offending == ("b",)
    assert t.median == pytest.approx(1.0), "a spike never enters the history"


def test_patience_applies_first_spikes_triggers_on_the_nth_and_lists_the_streak():
    t = BadStepTracker(spike_factor=2.0, patience=3, min_history=5, window=5)
    _warm(t, 5)
    v1, v2 = t.observe(10.0, batch_id=(1, 0)), t.observe(10.0, batch_id=(1, 1))
    assert v1.bad and v2.bad and not v1.withhold and not v2.withhold  # spikes below patience are applied
    v3 = t.observe(math.nan, batch_id=(1, 2))
    assert v3.triggered and v3.withhold and v3.consecutive == 3 and v3.offending == ((1, 0), (1, 1), (1, 2))
    t2 = BadStepTracker(patience=3)
    v = t2.observe(math.nan)
    assert v.withhold and not v.triggered, "a NaN step is never applied, even below patience"


def test_window_limits_the_median_and_max_consecutive_bad_raises():
    t = BadStepTracker(spike_factor=1.5, window=3, min_history=3, max_consecutive_bad=2)
    for x in (1.0, 1.0, 1.0, 1.4, 1.4, 2.0, 2.0):
        assert t.observe(x).reason == "ok"  # each is within 1.5x of the median at its time: the level climbs
    assert t.median == pytest.approx(2.0)  # the old 1.0s left the window of 3
    t.observe(math.nan)
    with pytest.raises(BadStepError, match="2 consecutive bad steps"):
        t.observe(math.inf)


def test_state_dict_round_trip_gives_the_same_decisions():
    a = BadStepTracker(spike_factor=2.0, patience=2, min_history=3, window=4)
    for x in (1.0, 1.2, 0.9, 1.1, 5.0):
        a.observe(x, batch_id=[0, 1])
    b = BadStepTracker(spike_factor=2.0, patience=2, min_history=3, window=4)
    b.load_state_dict(a.state_dict())
    for x in (5.0, 1.0, 2.5, 1.9):
        assert a.observe(x, batch_id=[0, 2]) == b.observe(x, batch_id=[0, 2])
    assert a.state_dict() == b.state_dict()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"spike_factor": 1.0}, "spike_factor"),
        ({"window": 0}, "window"),
        ({"patience": 0}, "patience"),
        ({"min_history": 200}, "min_history"),
        ({"patience": 5, "max_consecutive_bad": 2}, "max_consecutive_bad"),
    ],
)
def test_invalid_options_name_the_option(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BadStepTracker(**kwargs)


def test_callback_refuses_unknown_action_and_reads_a_missing_skip_file_as_empty(tmp_path):
    from lightning_v17.callbacks import BadStepGuard
    from lightning_v17.callbacks.bad_steps import read_skip_file

    from lightning_v17.config import V17ConfigError

    with pytest.raises(V17ConfigError, match="'skip' or 'rollback'"):
        BadStepGuard(action="restart")
    with pytest.raises(V17ConfigError, match="patience"):
        BadStepGuard(patience=0)
    assert read_skip_file(tmp_path / "nope.json") == {"skip_batches": [], "events": []}
