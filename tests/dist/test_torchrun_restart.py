"""Plain ``torchrun --max-restarts 1`` restarts a V17 job: rank 1 hard-exits after step 10, the agent restarts both
workers, they re-form the process group (each attempt's store keys under their own prefix,
``lightning_v17.engine.elastic``) and resume from the newest complete async checkpoint, bit-exact.

Without the per-attempt prefix the restarted workers read the dead attempt's keys from the agent's shared store and
often fail in gloo's connectFullMesh ("Connection refused") or hang (pytorch/pytorch#135712). One try here (about a
minute); ``bench/fault.py --tries 10`` runs the 10 consecutive tries of the acceptance and times the restart.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run_job(root: Path, *, kill_at: int = 0, max_restarts: int = 0, timeout: float = 240) -> subprocess.CompletedProcess:
    """One ``torchrun --standalone --nproc-per-node 2`` launch of ``tests/dist/_torchrun_job.py`` into ``root``; on
    timeout the whole process group (agent and workers) is killed and the result has returncode -9."""
    root.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", str(max_restarts), "-m", "tests.dist._torchrun_job", str(root)]  # fmt: skip
    if kill_at:
        cmd += ["--kill-at", str(kill_at)]
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}  # plain torchrun
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(cmd, proc.returncode, out, "")
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the agent and its workers: a hung restart must not outlive the test
        out, _ = proc.communicate()
        return subprocess.CompletedProcess(cmd, -9, out + f"\n[killed after {timeout} s: hung]", "")


def losses(path: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines())} if path.exists() else {}


def events(root: Path) -> list[dict]:
    return [json.loads(line) for line in (root / "events.jsonl").read_text().splitlines()]


@pytest.mark.timeout(300)
def test_plain_torchrun_restart_resumes_bit_exact(tmp_path):
    proc = run_job(tmp_path, kill_at=10, max_restarts=1)
    tail = (proc.stdout + proc.stderr)[-3000:]
    assert proc.returncode == 0, f"the restarted job did not finish:\n{tail}"
    ev = events(tmp_path)
    assert any(e["what"] == "kill" for e in ev), tail
    assert sorted({e["rank"] for e in ev if e["what"] == "end" and e["attempt"] == 1}) == [0, 1], ev
    first, resumed = losses(tmp_path / "losses-0.jsonl"), losses(tmp_path / "losses-1.jsonl")
    assert sorted(first) == list(range(1, 11)), "attempt 0 ran steps 1..10 before rank 1 exited"
    start = min(resumed)
    assert start > 1 and max(resumed) == 12, f"attempt 1 must resume from a checkpoint, not step 0: {sorted(resumed)}"
    overlap = [s for s in resumed if s in first]
    assert overlap, resumed
    for s in overlap:  # the steps both attempts ran: bit-identical (==)
        assert resumed[s] == first[s], (s, resumed[s], first[s])
