"""A V17 job ends with exit code 0: no "terminate called without an active exception" when the interpreter exits.

The job (``_exit_job.py``: a Hugging Face Llama at tp=2 on its own TP plan, 2 ranks, ending on a gloo collective) runs
as a script in a fresh interpreter, as users run it, with Lightning's launcher starting rank 1: the forkserver of
``tests/_dist.py`` would end its ranks with ``os._exit`` and never reach the interpreter's exit, where the abort
happened (a gloo worker thread taking the GIL while the interpreter finalizes; ``strategies/_collectives.py``).

The abort itself is a race whose odds depend on the machine's load, so the test also asserts its precondition, which
does not: each rank counts gloo's threads once every other ``atexit`` hook has run, and finds none.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests._dist import free_port

pytest.importorskip("transformers")

JOB = Path(__file__).with_name("_exit_job.py")
#: launcher variables of an enclosing job: the script must start as a plain ``python`` run and launch its own rank 1
_LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR",
                "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID")  # fmt: skip


@pytest.mark.timeout(120)
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through Linux's /proc")
def test_tp2_hf_job_exits_cleanly() -> None:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    env["MASTER_PORT"] = str(free_port())
    cmd = [sys.executable, str(JOB)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=110, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "terminate called" not in out, out[-4000:]
    assert "fit done" in proc.stdout, out[-4000:]
    checks = sorted(line for line in proc.stderr.splitlines() if line.startswith("exit-check"))
    assert checks == [f"exit-check rank {r}: 0 gloo threads alive as the interpreter finalizes" for r in (0, 1)], (
        checks,
        out[-4000:],
    )
