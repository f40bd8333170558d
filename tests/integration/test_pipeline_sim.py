"""The pipeline simulator through the installed planner CLI (fresh interpreters): the paper's figures from v17 plan
--json, and op times, jitter and p2p taken from the command line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# --- the action order torch runs ---------------------------------------------------------------------------------


def test_paper_figures_from_v17_plan_json() -> None:
    # p = 4, m = 8, T_F = T_B = T_W: GPipe 0.375, 1F1B 0.375, interleaved (v=2) 0.1875, ZB-H1 0.125
    want = {"gpipe": (0.375, 1), "1f1b": (0.375, 1), "interleaved": (0.1875, 2), "zb-h1": (0.125, 1)}
    code = "import json, sys\nfrom lightning_v17.planner.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    for name, (bubble, v) in want.items():
        argv = ["--model", "llama3-8b", "--gpus", "32", "--pp", "4", "--microbatches", "8", "--schedule", name,
                "--json"]  # fmt: skip
        out = subprocess.run([sys.executable, "-c", code, *argv], cwd=ROOT, capture_output=True, text=True,
                             timeout=120, check=True)  # fmt: skip
        pipe = json.loads(out.stdout)["pipeline"]
        assert pipe["bubble_fraction"] == pytest.approx(bubble), (name, pipe)
        assert pipe["virtual_stages"] == v, (name, pipe)
    # zb-h1 is Qi's ZB-H1, one stage per rank, which the engine runs (torch's interleaved zero-bubble runtime with
    # one stage per rank); ZB-H2 has no torch implementation and the recommendation says so
    assert pipe["schedule"] == "zb_h1" and pipe["runnable"] is True
    argv[argv.index("zb-h1")] = "zb-h2"
    out = subprocess.run([sys.executable, "-c", code, *argv], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         check=True)  # fmt: skip
    assert json.loads(out.stdout)["pipeline"]["runnable"] is False
    notes = json.loads(out.stdout)["recommendation"]["notes"]
    assert any("'zb_h2'" in n and "cannot run" in n for n in notes), notes


def test_v17_plan_takes_op_times_jitter_and_p2p() -> None:
    def bubble(*extra: str) -> float:
        out = subprocess.run(
            [sys.executable, "-m", "lightning_v17.cli", "plan", "--model", "tiny", "--gpu", "cpu", "--gpus", "2",
             "--pp", "2", "--microbatches", "8", "--schedule", "1f1b", "--json", *extra],
            capture_output=True, text=True, check=True, cwd=ROOT,
        )  # fmt: skip
        return json.loads(out.stdout)["pipeline"]["bubble_fraction"]

    assert bubble() == pytest.approx(1 / 8)
    assert bubble("--op-times", "1,1,1", "--p2p-time", "0.1") > 1 / 8 + 0.01
    assert bubble("--op-cv", "0.15") > 1 / 8 + 0.02
