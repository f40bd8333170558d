"""The planner's plot in a fresh interpreter: importing the planner does not import matplotlib."""

from __future__ import annotations

import sys

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_planner_import_does_not_import_matplotlib():
    import subprocess

    code = ("import sys, lightning_v17.planner.cli, lightning_v17.planner.plot; "
            "sys.exit(1 if 'matplotlib' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60, check=False).returncode == 0
