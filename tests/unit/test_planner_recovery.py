"""``v17 plan``'s recovery line: the expected goodput of the job restart, the in-process restart and the replica drop,
checked against Daly's wall-clock model and the first-order replica-drop waste written out here by hand."""

from __future__ import annotations

import contextlib
import io
import json
import math

import pytest

from lightning_v17.planner.cli import build_parser, main, specs_from_args
from lightning_v17.planner.hardware import get_accelerator
from lightning_v17.planner.plan import make_plan
from lightning_v17.planner.resilience import daly_interval_s, recovery_goodput

FLAGS = ["--model", "llama3-8b", "--gpus", "64", "--tp", "1", "--pp", "1", "--dp", "64", "--zero-stage", "3"]


def _plan(*extra: str):
    return make_plan(*specs_from_args(build_parser().parse_args(FLAGS + list(extra))))


def _daly_goodput(tau: float, delta: float, m: float, r: float) -> float:
    """Daly 2006: T_w = M e^{R/M} (e^{(tau+delta)/M} - 1) T_s / tau; goodput T_s / T_w."""
    return tau / (m * math.exp(r / m) * (math.exp((tau + delta) / m) - 1.0))


def test_three_paths_against_the_hand_written_models() -> None:
    plan = _plan("--dp-replicate", "8", "--inprocess-restart-s", "3", "--restart-s", "40", "--replica-drop-s", "2")
    got = recovery_goodput(plan)
    nodes = 64 // 8
    m = 6000.0 * 3600.0 / nodes  # the default node MTBF, 8 nodes fail 8x as often
    assert got["mtbf_s"] == pytest.approx(m)
    rank_bytes = plan.memory.param + plan.memory.optimizer
    fetch = rank_bytes / get_accelerator("h100-80gb").inter_node_bytes_per_s
    write = plan.checkpoint_write_s
    paths = got["paths"]

    job = paths["job_restart"]
    assert job["recovery_s"] == pytest.approx(40 + write)  # restart, then read what was written
    assert job["goodput"] == pytest.approx(_daly_goodput(daly_interval_s(write, m), write, m, 40 + write), rel=1e-12)

    inproc = paths["in_process_restart"]
    snapshot = rank_bytes / 25e9  # the default --pcie-gbps
    tau = max(plan.step_time_s, daly_interval_s(snapshot, m))
    assert inproc["recovery_s"] == pytest.approx(3 + fetch)
    assert inproc["goodput"] == pytest.approx(_daly_goodput(tau, snapshot, m, 3 + fetch), rel=1e-12)

    drop = paths["replica_drop"]
    waste = 2 + plan.step_time_s + (40 + fetch) / 8  # detection, the failed step re-run, 1/G of the replacement time
    assert drop["goodput"] == pytest.approx(1 - waste / m, rel=1e-12)
    assert drop["goodput"] > inproc["goodput"] > job["goodput"]  # what each path saves per failure


def test_replica_drop_needs_hsdp() -> None:
    paths = recovery_goodput(_plan())["paths"]
    assert set(paths) == {"job_restart", "in_process_restart", "replica_drop"}
    assert "dp_replicate >= 2" in paths["replica_drop"]["needs"] and "FTPolicy" in paths["replica_drop"]["needs"]


def test_the_report_and_json_carry_it() -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(FLAGS + ["--dp-replicate", "8", "--json"]) == 0
    recovery = json.loads(out.getvalue())["recovery"]
    assert set(recovery["paths"]) == {"job_restart", "in_process_restart", "replica_drop"}
    assert recovery["paths"]["replica_drop"]["goodput"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(FLAGS) == 0
    line = next(x for x in out.getvalue().splitlines() if x.startswith("recovery:"))
    assert "job restart" in line and "replica drop needs dp_replicate >= 2" in line
