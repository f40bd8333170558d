"""The planner's simulated bubble against a measured run: ``bench/pipeline.py`` re-analyses the trace of a recorded
run (``tests/fixtures/pipeline-trace.json``: every timed step's per-rank action timeline and P2P times,
2 gloo ranks, 5 schedules, m = 4 and 8) and the planner, fed with the op times measured in it (mean and jitter per
stage and op), must land within max(15%, 0.01) of every measured bubble."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT / "tests" / "fixtures" / "pipeline-trace.json"


def test_simulated_bubble_within_tolerance_of_the_measured_run() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "pipeline.py"), "--skip-raw", "--from-trace", str(TRACE)],
        capture_output=True, text=True, check=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    report = json.loads(out.stdout)
    rows = report["bubble_table"]
    assert {(r["schedule"], r["m"]) for r in rows} == {
        (s, m) for s in ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv") for m in (4, 8)
    }
    for r in rows:
        # the measured bubble is recomputed from the raw timelines here, not read from a stored number
        assert r["measured"] > 0.02, r
        assert abs(r["simulated"] - r["measured"]) <= max(0.15 * r["measured"], 0.01), r
    # the jitter is what closes the gap: the means alone miss at least one configuration
    assert not all(r["ok_step_means"] for r in rows)
