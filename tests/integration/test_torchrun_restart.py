"""Plain ``torchrun --max-restarts 1`` restarts a V17 job: rank 1 hard-exits after step 10, the agent restarts both
workers, they re-form the process group (each attempt's store keys under their own prefix,
``lightning_v17.resilience.elastic``) and resume from the newest complete async checkpoint, bit-exact.

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
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run_job(
    root: Path, *, kill_at: int = 0, max_restarts: int = 0, timeout: float = 240, extra: tuple[str, ...] = ()
) -> subprocess.CompletedProcess:
    """One ``torchrun --standalone --nproc-per-node 2`` launch of ``tests/integration/_torchrun_job.py`` into ``root``; on
    timeout the whole process group (agent and workers) is killed and the result has returncode -9."""
    root.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", str(max_restarts), "-m", "tests.integration._torchrun_job", str(root)]  # fmt: skip
    if kill_at:
        cmd += ["--kill-at", str(kill_at)]
    cmd += list(extra)
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


@pytest.mark.fault  # about 65 s: `make test-fault`
@pytest.mark.timeout(300)
def test_hung_rank_is_named_and_torchrun_restarts_the_job(tmp_path):
    """Rank 1 sleeps before an all-reduce of step 6; with hang_timeout=3 the watchdog ends the ranks within 2x the
    limit, naming rank 1 as the one outside the collective, the all_reduce rank 0 waits in, and the step; torchrun
    restarts the job, which resumes and finishes."""
    limit = 3.0
    proc = run_job(tmp_path, max_restarts=1, extra=("--hang-at", "6", "--hang-timeout", str(limit)))
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:]
    report = out[out.index("[lightning_v17 watchdog] rank 0: hang:"):][:2500]
    assert "waiting in collective all_reduce" in report and "global_step 5 (training_step)" in report, report
    assert "likely culprit(s), not inside a collective: [1]" in report, report
    idle = float(report.split("made no progress for ")[1].split(" s")[0])
    assert limit < idle <= 2 * limit, report
    ev = events(tmp_path)
    assert sorted({e["rank"] for e in ev if e["what"] == "end" and e["attempt"] == 1}) == [0, 1]
    assert max(losses(tmp_path / "losses-1.jsonl")) == 12


@pytest.mark.timeout(200)
@pytest.mark.parametrize("where", ["forward", "pipeline stage"])
def test_a_rank_that_raises_ends_its_peer_within_seconds_with_its_error(tmp_path, where):
    """No launcher that tears the job down: two plain processes (torchrun's environment variables, set by hand).
    Rank 1 raises in the forward of step 6 (ZeRO-3), or, with pp=2, inside the pipeline schedule (its last stage's
    loss) of step 3; rank 0, blocked in the next collective or P2P receive, must exit by itself within 10 s with rank
    1's error. (Without the watchdog, measured: rank 0 ends only when rank 1's process has exited, with
    gloo's "Connection reset by peer", which names neither rank 1 nor its error; while rank 1 stays alive, rank 0
    waits for the process-group timeout.)"""
    from tests._dist import free_port

    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC")}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
               GROUP_RANK="0", PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""))  # fmt: skip
    procs, logs = [], []
    for rank in (0, 1):
        log = open(tmp_path / f"rank{rank}.log", "w")  # noqa: SIM115 - closed below
        logs.append(log)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "tests.integration._torchrun_job", str(tmp_path),
             *(["--raise-at", "6"] if where == "forward" else ["--pp-raise-at", "3"])], cwd=REPO,
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}, stdout=log, stderr=subprocess.STDOUT,
        ))  # fmt: skip
    ended: dict[int, float] = {}
    deadline = time.time() + 150
    while len(ended) < 2 and time.time() < deadline:
        for rank, p in enumerate(procs):
            if rank not in ended and p.poll() is not None:
                ended[rank] = time.time()
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            p.kill()
    for log in logs:
        log.close()
    out0 = (tmp_path / "rank0.log").read_text()
    raised = next(e["t"] for e in events(tmp_path) if e["what"] == "raise")
    assert sorted(ended) == [0, 1], f"rank 0 is still blocked {time.time() - raised:.0f} s after rank 1 raised"
    assert procs[1].returncode != 0 and procs[0].returncode == 1, (procs[0].returncode, procs[1].returncode)
    assert ended[0] - raised < 10, ended[0] - raised
    assert "failed" in out0 and "rank 1: RuntimeError: injected failure on rank 1" in out0, out0[-2000:]
    print(f"rank 0 ended {ended[0] - raised:.2f} s after rank 1 raised")


@pytest.mark.fault  # about 1-2 min: `make test-fault`
@pytest.mark.timeout(300)
def test_straggler_raise_is_a_clean_exit_that_torchrun_restarts(tmp_path):
    """Rank 1 is slowed by 0.3 s a step in the first attempt; StragglerDetector(action="raise") names it, every rank
    raises at the same window (so none is left in a collective), the workers exit non-zero, torchrun restarts them,
    and the second attempt (not slowed) finishes the job."""
    proc = run_job(tmp_path, max_restarts=1, extra=("--straggler", "raise"))
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:]
    assert "StragglerDetected: straggler ranks [1]" in out, out[-3000:]
    assert "(exitcode: 1)" in out, out[-3000:]  # torchrun saw the workers fail, and restarted them
    first, second = losses(tmp_path / "losses-0.jsonl"), losses(tmp_path / "losses-1.jsonl")
    assert first and max(first) < 12, f"the first attempt must end early, at the straggler: {sorted(first)}"
    ev = events(tmp_path)
    assert sorted({e["rank"] for e in ev if e["what"] == "end" and e["attempt"] == 1}) == [0, 1], ev
    assert max(second) == 12, sorted(second)
