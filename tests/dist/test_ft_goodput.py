"""The planner's goodput of the three recovery paths (``lightning_v17.planner.resilience.goodput_by_path``); pure.

The replica-drop formula is checked against a simulation of its own model (Poisson failures of one group at a time:
every group stalls for the detection and the re-run step, then the failed group's share is missing until its
replacement trains), the other two against the Daly model they are built from.
"""

from __future__ import annotations

import random

import pytest

from lightning_v17.planner.resilience import (
    daly_interval_s,
    expected_goodput,
    goodput_by_path,
    replica_drop_goodput,
)


def _simulate_drop(*, mtbf_s: float, groups: int, detect_s: float, step_s: float, replace_s: float) -> float:
    """Useful group-seconds over available group-seconds, failures a Poisson process of rate 1/M (seed 0)."""
    rng = random.Random(0)
    horizon = 2e8
    t, lost = 0.0, 0.0
    while True:
        t += rng.expovariate(1.0 / mtbf_s)
        if t >= horizon:
            break
        lost += (detect_s + step_s) + replace_s / groups  # every group stalls; then one share is missing
    return 1.0 - lost / horizon


@pytest.mark.parametrize("groups", [2, 8])
def test_replica_drop_goodput_is_its_model(groups: int) -> None:
    kw = {"mtbf_s": 3 * 3600.0, "detect_s": 1.1, "step_s": 5.0, "replace_s": 600.0}
    want = _simulate_drop(groups=groups, **kw)
    got = replica_drop_goodput(replica_groups=groups, **kw)
    assert abs(got - want) < 2e-4, (got, want)


def test_the_three_paths() -> None:
    # a Llama-3-405B-like job: a failure every 3 hours, minutes to restart, seconds to drop a group
    kw = {"node_mtbf_s": 3 * 3600.0 * 2000, "nodes": 2000, "checkpoint_s": 60.0, "restart_s": 600.0,
          "inprocess_restart_s": 30.0, "snapshot_s": 0.5, "step_s": 5.0, "replica_groups": 8, "drop_s": 2.0,
          "replace_s": 600.0}  # fmt: skip
    got = goodput_by_path(**kw)
    mtbf = 3 * 3600.0
    want_restart = expected_goodput(interval_s=daly_interval_s(60.0, mtbf), checkpoint_s=60.0, mtbf_s=mtbf,
                                    restart_s=600.0)  # fmt: skip
    assert got["job_restart"] == pytest.approx(want_restart, rel=1e-12)
    assert got["job_restart"] < got["in_process_restart"] < got["replica_drop"] < 1.0
    # more groups: a lost group is a smaller share of the batch
    assert goodput_by_path(**{**kw, "replica_groups": 64})["replica_drop"] > got["replica_drop"]
    with pytest.raises(ValueError, match="replica_groups"):
        replica_drop_goodput(mtbf_s=1.0, replica_groups=1, detect_s=1.0, step_s=1.0, replace_s=1.0)
