"""Kill one of two torchrun agents mid-run: the group re-forms at world size 1, resumes from the newest complete
checkpoint, then grows back to 2 when a new agent joins, and finishes the epoch (issue "fault tolerance" acceptance).

Two agents on localhost stand for two nodes: ``torchrun --nnodes=1:2 --nproc-per-node=1 --rdzv-backend=c10d`` (the
first hosts the rendezvous store, ``is_host=1``). The job is ``tests/integration/_torchrun_elastic_job.py`` (V17 ZeRO-3, the
tiny Llama, async checkpoints every 2 steps, one epoch of 48 samples). The harness SIGKILLs the second agent and
its worker (a node dying) after its worker's step ``kill_at``; once the survivor has trained a
few steps alone and published a checkpoint, a third agent joins. The agents run with
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: torch 2.13's shared store does not let a node join later (``launch_agent``).

Checked, from the per-step per-rank records of every round:

* the lineage (each round continues from the step its checkpoint held; what a round trained after its last
  published checkpoint is re-done by the next one) ran at world sizes 2, then 1, then 2, to the end of the epoch;
* the multiset of sample ids over the lineage is exactly the epoch's 48 ids (no duplicate, no skip);
* every lineage step's rank-0 loss equals an independent single-process replay (no torch.distributed, no
  checkpoint): the same model and AdamW, stepped on the mean of the recorded per-rank batch losses, which is what
  data parallelism computes. Tolerance ``ATOL`` (the acceptance's 1e-6; measured 0.0: the mean of two ranks'
  gradients rounds alike in ZeRO-3's reduce-scatter and in the replay's backward of the mean loss).

``bench/fault.py --scenario agent-kill`` runs the same and prints the kill-to-first-step split.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from datetime import datetime
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ATOL = 1e-6  # the acceptance's bound on |loss - reference| from the checkpoint on
# A dead node leaves the rendezvous after keep_alive_interval x keep_alive_max_attempt seconds without a heartbeat;
# the agents send one every 1-2 intervals, so 2 attempts flapped here (a live agent was dropped under load, and the new
# node formed a round of its own). A lone survivor waits last_call_timeout for others before it forms a round.
RDZV_CONF = "join_timeout=120,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=5"


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def launch_agent(root: Path, port: int, run_id: str, *, name: str, host: bool) -> subprocess.Popen:
    """One torchrun agent with one worker (its own session: the test's signals do not reach it)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=1",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={run_id}",
           f"--rdzv-conf={RDZV_CONF},is_host={int(host)}", "--local-addr=127.0.0.1", "--max-restarts=3",
           "--monitor-interval=0.1", "-m", "tests.integration._torchrun_elastic_job", str(root)]  # fmt: skip
    # Growing needs the agents' store sharing off (torch 2.13): with it, the rank-0 agent publishes its store's address
    # only in the first round it is rank 0 (DynamicRendezvousHandler.next_rendezvous caches _bootstrap_store_info), so
    # a node joining later waits 60 s for MASTER_ADDR in the new round's keys and fails ("wait timeout after 60000ms,
    # keys: /torch.rendezvous.<id>.2/MASTER_ADDR", measured here; pytorch/pytorch#147064 is the same two-agent set-up).
    # Restarts at the same or a smaller size work with sharing on (test_torchrun_restart.py runs plain torchrun).
    env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    env.update(PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""), OMP_NUM_THREADS="1", LOGLEVEL="INFO")
    log = open(root / f"agent-{name}.log", "w")  # noqa: SIM115 - the child holds it; closed at exit
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc): torchrun starts its workers in sessions of their own, so killing
    the agent's process group would leave them running."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) if entry.name.isdigit() else None
        except (OSError, IndexError, ValueError):
            continue
        if ppid is not None:
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL an agent and everything it started (a node dying: no clean-up anywhere)."""
    if proc.poll() is None:
        for pid in [proc.pid, *_descendants(proc.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()


def run_agent_kill(root: Path, *, kill_at: int = 5, timeout: float = 240) -> dict:
    """The scenario; returns the agents' exit codes, the kill and join times, the records and the events."""
    from tests._dist import free_port

    root.mkdir(parents=True, exist_ok=True)
    port, run_id = free_port(), uuid.uuid4().hex[:8]
    agents = {"a": launch_agent(root, port, run_id, name="a", host=True)}
    agents["b"] = launch_agent(root, port, run_id, name="b", host=False)
    deadline = time.time() + timeout
    out: dict = {"root": str(root), "kill_t": None, "join_t": None, "error": None}

    def wait(pred, what: str) -> bool:
        while time.time() < deadline:
            if pred():
                return True
            ended = {n: p.returncode for n, p in agents.items() if p.poll() is not None and (n != "b" or not out["kill_t"])}
            if ended:
                out["error"] = f"agents {ended} (name: exit code) ended while waiting for {what}"
                return False
            time.sleep(0.05)
        out["error"] = f"timed out after {timeout} s waiting for {what}"
        return False

    def steps() -> list[dict]:
        return _jsonl(root / "steps.jsonl")

    ok = wait(lambda: any(r["world"] == 2 and r["rank"] == 1 and r["step"] >= kill_at for r in steps()),
              f"step {kill_at} at world size 2")  # fmt: skip
    if ok:
        _kill(agents["b"])  # the second node dies: its agent and its worker, no clean-up
        out["kill_t"] = time.time()
        ok = wait(lambda: any(e["what"] == "held" for e in _jsonl(root / "events.jsonl")), "the world-1 round")
    if ok:
        agents["c"] = launch_agent(root, port, run_id, name="c", host=False)  # a new node joins
        out["join_t"] = time.time()
        while time.time() < deadline and any(agents[n].poll() is None for n in ("a", "c")):
            time.sleep(0.1)
        ok = all(agents[n].poll() is not None for n in ("a", "c"))
        out["error"] = None if ok else f"timed out after {timeout} s waiting for the end of the run"
    for p in agents.values():
        _kill(p)
    out["rc"] = {n: p.returncode for n, p in agents.items()}
    out["steps"], out["events"] = steps(), _jsonl(root / "events.jsonl")
    out["logs"] = {n: (root / f"agent-{n}.log").read_text()[-4000:] for n in agents}
    return out


def lineage(records: list[dict], events: list[dict]) -> tuple[list[int], dict[int, dict[int, dict]]]:
    """(world size of each round in order, {step: {rank: record}}) of the training that survived: rounds in the order
    they started training; each continues from the step its checkpoint held, superseding what earlier rounds trained
    after that step."""
    first_load: dict[str, tuple[float, int]] = {}
    for e in events:
        if e["what"] == "loaded" and e.get("round") and e["t"] < first_load.get(e["round"], (float("inf"),))[0]:
            first_load[e["round"]] = (e["t"], e["step"])
    starts = sorted((t, rnd, step) for rnd, (t, step) in first_load.items())
    kept: dict[int, dict[int, dict]] = {}
    worlds = []
    for _, rnd, resumed in starts:
        rows = [r for r in records if r["round"] == rnd]
        if not rows:
            continue
        worlds.append(rows[0]["world"])
        kept = {s: v for s, v in kept.items() if s <= resumed}
        for r in rows:
            kept.setdefault(r["step"], {})[r["rank"]] = r
    return worlds, kept


def replay(kept: dict[int, dict[int, dict]]) -> list[dict]:
    """An independent single-process reference: no torch.distributed, no checkpoint. Each lineage step's recorded
    per-rank batches are rebuilt from the sample ids; the model takes one AdamW step on the mean of their losses."""
    import torch

    from lightning_v17.data.packing import collate_rows
    from tests.integration._torchrun_elastic_job import make_data, make_module

    torch.set_num_threads(1)
    dm = make_data()
    dm.setup("fit")
    rows = dm.train_rows
    by_id = {int(rows[i]["doc_ids"][0]): i for i in range(len(rows))}
    module = make_module()
    module.configure_model()
    conf = module.configure_optimizers()
    opt, sched = conf["optimizer"], conf["lr_scheduler"]["scheduler"]
    out = []
    for step in sorted(kept):
        ranks = kept[step]
        losses = []
        for r in sorted(ranks):
            batch = collate_rows([rows[by_id[i]] for i in ranks[r]["ids"]], pad_id=dm.tokenizer.pad_id)
            losses.append(module.loss(batch)[0])
        opt.zero_grad()
        torch.stack(losses).mean().backward()
        opt.step()
        sched.step()
        out.append({"step": step, "world": len(ranks), "got": ranks[0]["loss"], "want": losses[0].item()})
    return out


def _agent_times(log: Path, pattern: str) -> list[float]:
    """Wall-clock times of the agent's log lines containing ``pattern`` (torch's ``I1130 15:59:20.401000`` prefix,
    local time; the agents run with LOGLEVEL=INFO)."""
    year = time.localtime().tm_year
    found = []
    for line in log.read_text(errors="replace").splitlines():
        m = re.match(r"[IWE](\d{4}) (\d\d:\d\d:\d\d\.\d+) ", line)
        if m and pattern in line:
            found.append(datetime.strptime(f"{year}{m[1]} {m[2]}", "%Y%m%d %H:%M:%S.%f").timestamp())
    return found


def timeline(events: list[dict], kill_t: float, join_t: float | None, survivor_log: Path | None = None) -> dict:
    """The kill-to-first-step split of the world-1 round, and the join-to-first-step time of the world-2 round.
    With the survivor agent's log, ``rendezvous_s`` is split into ``worker_exit_s`` (the failed worker's exception
    until its agent saw it exit: Lightning's teardown), ``agent_rendezvous_s`` (until the agent's "Rendezvous
    complete": stopping the group, the dead node's heartbeat expiry, the last call) and ``spawn_s``."""

    def first(what: str, after: float, **match) -> dict:
        return min((e for e in events if e["what"] == what and e["t"] >= after
                    and all(e.get(k) == v for k, v in match.items())), key=lambda e: e["t"])  # fmt: skip

    failed = first("failed", kill_t)
    start = first("start", kill_t, world=1)
    mine = {e["what"]: e["t"] for e in events if e["pid"] == start["pid"]}
    marks = [kill_t, failed["t"], start["t"], *(mine[w] for w in ("imported", "group_formed", "loaded", "first_step"))]
    names = ("detection_s", "rendezvous_s", "python_imports_s", "group_form_s", "load_s", "first_step_s")
    out = {n: round(b - a, 3) for n, a, b in zip(names, marks, marks[1:])}
    out["kill_to_first_step_s"] = round(marks[-1] - kill_t, 3)
    out["excluding_python_imports_s"] = round(out["kill_to_first_step_s"] - out["python_imports_s"], 3)
    if survivor_log is not None and survivor_log.exists():
        exited = [t for t in _agent_times(survivor_log, "failed (exitcode") if t >= failed["t"] - 0.01]
        formed = [t for t in _agent_times(survivor_log, "Rendezvous complete for workers") if exited and t >= exited[0]]
        if exited and formed:
            out["worker_exit_s"] = round(exited[0] - failed["t"], 3)
            out["agent_rendezvous_s"] = round(formed[0] - exited[0], 3)
            out["spawn_s"] = round(start["t"] - formed[0], 3)
    if join_t is not None:
        grown = [e["t"] for e in events if e["what"] == "first_step" and e["t"] > join_t and e.get("world") == 2]
        out["join_to_first_step_s"] = round(min(grown) - join_t, 3) if grown else None
    return out


def check(out: dict) -> dict:
    """The acceptance checks on one scenario's result; returns the figures (raises AssertionError on a failure)."""
    from tests.integration._torchrun_elastic_job import DOCS

    tail = "\n".join(f"--- agent {n}\n{log}" for n, log in out["logs"].items())
    assert out["error"] is None and out["rc"]["a"] == 0 and out["rc"]["c"] == 0, (out["error"], out["rc"], tail)
    failed = [f"{e['t'] - out['kill_t']:+.1f} s: rank {e['rank']}: {e['error']}" for e in out["events"] if e["what"] == "failed"]
    assert len(failed) == 1, f"one failure expected (the survivor's, at the kill), got {failed}"
    worlds, kept = lineage(out["steps"], out["events"])
    assert worlds[-3:] == [2, 1, 2] and 1 in worlds, (worlds, tail)
    for step, ranks in kept.items():
        assert len(ranks) == next(iter(ranks.values()))["world"], (step, ranks)
    ids = Counter(i for ranks in kept.values() for r in ranks.values() for i in r["ids"])
    dup = sorted(i for i, n in ids.items() if n > 1)
    skipped = sorted(set(range(DOCS)) - set(ids))
    assert not dup and not skipped and sorted(ids) == list(range(DOCS)), f"duplicated {dup}, skipped {skipped}"
    rep = replay(kept)
    worst = max(abs(r["got"] - r["want"]) for r in rep)
    assert worst <= ATOL, [r for r in rep if abs(r["got"] - r["want"]) > ATOL]
    by_world = Counter(r["world"] for r in rep)
    return {"worlds": worlds, "lineage_steps": len(rep), "steps_at_world": dict(by_world),
            "max_abs_loss_diff": worst,
            **timeline(out["events"], out["kill_t"], out["join_t"], Path(out["root"]) / "agent-a.log")}  # fmt: skip


@pytest.mark.fault  # ~1-2 min: `make test-fault`
@pytest.mark.timeout(400)
def test_kill_one_of_two_agents_resizes_2_1_2_with_exact_data_and_losses(tmp_path):
    figures = check(run_agent_kill(tmp_path))
    print(json.dumps(figures))
