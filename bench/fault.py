"""Plain ``torchrun --max-restarts 1`` restarts of a V17 ZeRO-3 job, N consecutive tries (issue "fault tolerance",
acceptance: 10 of 10 resume and finish bit-exact), with the kill-to-first-step time split into its parts.

Each try launches ``torchrun --standalone --nproc-per-node 2 --max-restarts 1 -m tests.integration._torchrun_job`` with
rank 1 hard-exiting after step 10; the restarted attempt resumes from the newest complete async checkpoint. Its
losses are compared (==) with one uninterrupted launch of the same job. The events every rank writes give the split:

* ``detect_restart_s``: the kill until the restarted worker process starts (the agent notices the dead worker,
  stops the other one, re-runs its rendezvous and spawns new workers: torchrun's business, not ours);
* ``python_imports_s``: interpreter start and ``import torch, lightning, lightning_v17`` (outside our control);
* ``group_form_s``: Trainer construction and the process group forming on the per-attempt store prefix;
* ``load_s``: model set-up, sharding and the checkpoint restore;
* ``first_step_s``: the first training step after the restore.

Prints one JSON object. ``python bench/fault.py --tries 10`` (about 7 minutes on 2 cores).

``--scenario agent-kill`` (``tests/integration/test_elastic_agents.py``): two torchrun agents (``--nnodes=1:2``, c10d
rendezvous) stand for two nodes; the second is SIGKILLed with its worker after step 5, the survivor re-forms at world
size 1 and resumes from the newest complete checkpoint, then a third agent joins and the group finishes the epoch at
world size 2. Each try checks the sample ids (each of the epoch's exactly once) and the losses against a
single-process replay, and splits the kill-to-first-step time into detection (the kill until the survivor's worker
fails), rendezvous (until its agent has re-formed the group and started a new worker: dead-node expiry and the
last-call wait, set by ``--rdzv-conf``), Python imports, group formation, load (set-up and checkpoint restore) and
the first step.

``--scenario side-by-side --json-out bench/results/fault.json``: the restart above and the replica drop of
``V17Strategy(fault_tolerance=FTPolicy(...))`` (``tests/dist/test_ft_replicas.py``: two replica groups of 2 ranks,
ZeRO-3, on torchft; rank 1 of group 1 SIGKILLs itself mid-step and group 0 goes on) in one invocation, ``--tries``
of each. Each drop try is checked as its test checks it (every sample once, losses and parameters against a
one-process replay); its kill-to-next-step time is the kill until the survivors' next quorum, the start of their next
step. The ratio is the restart's kill-to-first-step median over the drop's.

The same invocation also runs ``--tries`` in-process restarts (``tests/dist/test_inprocess_restart.py``: one replica
of 2 gloo ranks at ZeRO-3, rank 1 SIGKILLed mid-step, the survivor re-forms the group in its own process and a warm
spare takes the lost rank, both restoring the last step boundary's in-memory snapshot), each checked as its test
checks it (bitwise against an uninterrupted run, within 1e-5 of one process); its time is the kill until the
re-formed group's next step starts, and ``restart_over_in_process`` the restart's median over it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.integration.test_elastic_agents import check, run_agent_kill
from tests.integration.test_torchrun_restart import events, losses, run_job

PARTS = ("detect_restart_s", "python_imports_s", "group_form_s", "load_s", "first_step_s")
MEDIANS = (*PARTS, "kill_to_first_step_s", "excluding_python_imports_s")


def split(ev: list[dict]) -> dict[str, float]:
    """The restart timeline of one try from the ranks' events (the latest rank decides each milestone)."""
    kill = min(e["t"] for e in ev if e["what"] == "kill")

    def at(what: str) -> float:
        return max(e["t"] for e in ev if e["what"] == what and e.get("attempt") == 1)

    marks = [kill, at("start"), at("imported"), at("group_formed"), at("loaded"), at("first_step")]
    out = {name: round(b - a, 3) for name, a, b in zip(PARTS, marks, marks[1:])}
    out["kill_to_first_step_s"] = round(marks[-1] - kill, 3)
    out["excluding_python_imports_s"] = round(out["kill_to_first_step_s"] - out["python_imports_s"], 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tries", type=int, default=10)
    parser.add_argument("--kill-at", type=int, default=None, help="step after which a rank (or agent) is killed")
    parser.add_argument("--scenario", choices=("restart", "agent-kill", "side-by-side"), default="restart")
    parser.add_argument("--json-out", default=None, help="also write the summary there (side-by-side)")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="v17_fault_"))
    if args.scenario == "agent-kill":
        return agent_kill(tmp, tries=args.tries, kill_at=args.kill_at or 5)
    if args.scenario == "side-by-side":
        return side_by_side(tmp, tries=args.tries, kill_at=args.kill_at or 10, json_out=args.json_out)
    summary = restart_summary(restart_tries(tmp, tries=args.tries, kill_at=args.kill_at or 10))
    print(json.dumps(summary))


def restart_tries(tmp: Path, *, tries: int, kill_at: int) -> list[dict]:
    """``tries`` torchrun restarts, each compared with one uninterrupted run (one JSON line per try on stderr)."""
    ref = run_job(tmp / "ref")
    if ref.returncode != 0:
        raise SystemExit(f"the uninterrupted reference run failed:\n{ref.stdout[-3000:]}")
    want = losses(tmp / "ref" / "losses-0.jsonl")
    rows = []
    for i in range(tries):
        root = tmp / f"try{i}"
        t0 = time.perf_counter()
        proc = run_job(root, kill_at=kill_at, max_restarts=1, timeout=240)
        got = losses(root / "losses-1.jsonl")
        row = {"try": i, "rc": proc.returncode, "wall_s": round(time.perf_counter() - t0, 1),
               "resumed_steps": sorted(got)}  # fmt: skip
        row["bit_exact"] = bool(got) and max(got) == max(want) and all(got[s] == want[s] for s in got)
        row["ok"] = proc.returncode == 0 and row["bit_exact"] and min(got) > 1
        if row["ok"]:
            row.update(split(events(root)))
        else:
            row["tail"] = proc.stdout[-1500:]
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "tail"}), file=sys.stderr, flush=True)
    return rows


def restart_summary(tries: list[dict]) -> dict:
    good = [t for t in tries if t["ok"]]
    return {
        "benchmark": "torchrun_restart",
        "tries": len(tries),
        "ok": len(good),
        "median": {k: round(statistics.median(t[k] for t in good), 3) for k in MEDIANS} if good else None,
        "failures": [{k: t[k] for k in ("try", "rc", "tail")} for t in tries if not t["ok"]],
    }


def drop_tries(tmp: Path, *, tries: int) -> list[dict]:
    """``tries`` replica drops on torchft (``tests/dist/test_ft_replicas.py``), each checked as the test checks it."""
    from tests.dist.test_ft_replicas import CLIP, _check, _run

    rows = []
    for i in range(tries):
        out = tmp / f"drop{i}"
        out.mkdir(parents=True)
        t0 = time.perf_counter()
        row: dict = {"try": i}
        try:
            run = _run(out, opt="adamw", clip=CLIP, samples=32, kill=[1, 1, 2], rejoin=False, timeout=200)
            row.update(ok=True, **_check(out, run, opt="adamw", clip=CLIP, samples=32, rejoin=False))
        except AssertionError as err:
            row.update(ok=False, failure=str(err)[-1500:])
        row["wall_s"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "failure"}), file=sys.stderr, flush=True)
    return rows


def inprocess_tries(tmp: Path, *, tries: int) -> list[dict]:
    """``tries`` in-process restarts (``tests/dist/test_inprocess_restart.py``), each checked as the test checks it."""
    from tests.dist.test_inprocess_restart import _check

    rows = []
    for i in range(tries):
        t0 = time.perf_counter()
        row: dict = {"try": i}
        try:
            row.update(ok=True, **_check(tmp / f"inproc{i}", "adamw"))
        except AssertionError as err:
            row.update(ok=False, failure=str(err)[-1500:])
        row["wall_s"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "failure"}), file=sys.stderr, flush=True)
    return rows


def side_by_side(tmp: Path, *, tries: int, kill_at: int, json_out: str | None) -> None:
    """The torchrun restart, the torchft replica drop and the in-process restart, ``tries`` each, in one
    invocation."""
    from _common import emit_json  # bench/ is the script's folder: on the path

    restart = restart_summary(restart_tries(tmp, tries=tries, kill_at=kill_at))
    drops = drop_tries(tmp, tries=tries)
    good = [r for r in drops if r["ok"]]
    drop = {
        "benchmark": "replica_drop_torchft",
        "tries": len(drops),
        "ok": len(good),
        "median": {"kill_to_next_step_s": round(statistics.median(r["latency_s"] for r in good), 3)} if good else None,
        "max": {k: max(r[k] for r in good) for k in ("latency_s", "loss_diff", "param_diff")} if good else None,
        "failures": [{"try": r["try"], "failure": r["failure"]} for r in drops if not r["ok"]],
    }
    inproc_rows = inprocess_tries(tmp, tries=tries)
    good = [r for r in inproc_rows if r["ok"]]
    inproc = {
        "benchmark": "in_process_restart",
        "tries": len(inproc_rows),
        "ok": len(good),
        "median": {k: round(statistics.median(r[k] for r in good), 3) for k in ("kill_to_next_step_s", "restore_s")}
        if good
        else None,
        "max": {k: max(r[k] for r in good) for k in ("kill_to_next_step_s", "param_diff_vs_one_process")}
        if good
        else None,
        "bitwise_vs_uninterrupted": bool(good) and all(r["bitwise_vs_uninterrupted"] for r in good),
        "failures": [{"try": r["try"], "failure": r["failure"]} for r in inproc_rows if not r["ok"]],
    }
    inproc_s = (inproc["median"] or {}).get("kill_to_next_step_s")
    restart_s = (restart["median"] or {}).get("kill_to_first_step_s")
    drop_s = (drop["median"] or {}).get("kill_to_next_step_s")
    report = {
        "benchmark": "fault_recovery_side_by_side",
        "what": "seconds from a SIGKILLed rank to the next training step: the whole job restarted by torchrun from "
        "its newest checkpoint, against the other replica group going on (torchft), and against the only replica "
        "re-forming in its own processes from in-memory snapshots with a warm spare (in-process restart)",
        "restart": restart,
        "replica_drop": drop,
        "in_process": inproc,
        "ratios": {
            "restart_over_replica_drop": round(restart_s / drop_s, 2) if restart_s and drop_s else None,
            "restart_over_in_process": round(restart_s / inproc_s, 2) if restart_s and inproc_s else None,
        },
    }
    emit_json(report, json_out)


AGENT_KILL_MEDIANS = ("detection_s", "rendezvous_s", "worker_exit_s", "agent_rendezvous_s", "spawn_s",
                      "python_imports_s", "group_form_s", "load_s", "first_step_s", "kill_to_first_step_s",
                      "excluding_python_imports_s", "join_to_first_step_s")  # fmt: skip


def agent_kill(tmp: Path, *, tries: int, kill_at: int) -> None:
    """``tries`` agent-kill scenarios (2 -> 1 -> 2 nodes); one JSON line per try on stderr, the summary on stdout."""
    rows = []
    for i in range(tries):
        t0 = time.perf_counter()
        out = run_agent_kill(tmp / f"agents{i}", kill_at=kill_at)
        row: dict = {"try": i, "wall_s": round(time.perf_counter() - t0, 1)}
        try:
            row.update(ok=True, **check(out))
        except AssertionError as err:
            row.update(ok=False, failure=str(err)[-1500:])
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "failure"}), file=sys.stderr, flush=True)
    good = [r for r in rows if r["ok"]]
    median = {k: round(statistics.median(r[k] for r in good if r.get(k) is not None), 3)
              for k in AGENT_KILL_MEDIANS if any(r.get(k) is not None for r in good)}  # fmt: skip
    summary = {"benchmark": "agent_kill_2_1_2", "tries": len(rows), "ok": len(good), "median": median,
               "max_abs_loss_diff": max((r["max_abs_loss_diff"] for r in good), default=None),
               "failures": [{"try": r["try"], "failure": r["failure"]} for r in rows if not r["ok"]]}  # fmt: skip
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
