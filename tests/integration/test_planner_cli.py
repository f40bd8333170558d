"""The installed v17 console script prints the plan, and the planner imports without torch (fresh interpreters)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_console_script_prints_the_report_and_planner_is_torch_free():
    # One subprocess for both checks: the installed `v17` script, and a fresh interpreter importing the planner.
    result = subprocess.run([str(ROOT / ".venv" / "bin" / "v17"), "plan", "--model", "tiny"], capture_output=True,
                            text=True, timeout=60, cwd=ROOT, check=False)
    assert result.returncode == 0, result.stderr
    for needle in ("param  (fp32)", "█", "activations", "comm", "bubble", "FLOPs", "recommendation", "ZeRO-3"):
        assert needle in result.stdout
    code = ("import sys, lightning_v17.planner, lightning_v17.planner.cli, lightning_v17.planner.report, "
            "lightning_v17.planner.emit; "
            "sys.exit(1 if any(m == 'torch' or m.startswith('torch.') for m in sys.modules) else 0)")
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=60, check=False).returncode == 0
