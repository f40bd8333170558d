"""Goodput of a run with injected failures against the planner's Young/Daly prediction (issue 13's last acceptance).

One real ``torchrun --standalone --nproc-per-node 2 --max-restarts F`` launch of a V17 ZeRO-3 job on gloo: the tiny
reference Llama on :class:`~lightning_v17.data.PackedDataModule`, ``AsyncCheckpoint`` every ``--every`` (K) steps
and ``GoodputMonitor`` attached. Rank 1 hard-exits (``os._exit(1)``, no cleanup) on a fixed schedule, once per
attempt, ``F`` times in the run; torchrun restarts both workers, which resume from the newest complete checkpoint.

The schedule: attempt 0 fails after global step ``N`` (``--fail-every``), and every later attempt after running
``N`` steps itself, so that a failure is injected every ``N`` executed steps. ``N = (m + 1/2)·K``: every failure
lands half an interval past a checkpoint, so each one re-does ``K/2`` steps, the mean loss Young (1974) and Daly
(2006) assume for a failure uniformly placed in an interval (τ/2). The last attempt runs ``N - K/2`` steps and ends
on a save.

Then the planner's :func:`~lightning_v17.planner.resilience.expected_goodput` is fed with inputs measured in the same
run (nothing is fitted):

* ``mtbf_s``: the run's wall time (GoodputMonitor's, first step of attempt 0 to the end) over its failures;
* ``checkpoint_s``: blocking seconds per save (``checkpoint_blocking_s``, summed over all attempts, per save);
* ``restart_s``: seconds per failure from the last finished step to the first step of the next attempt
  (GoodputMonitor's ``restart_s``; the kill-to-first-step times from the workers' own event logs are printed next
  to it as an independent check);
* ``interval_s``: the checkpoint interval actually run, in useful (step) seconds: GoodputMonitor's ``useful_s``
  per save;
* ``overhead_s``: the loop's own wall time between steps per save (data, the callbacks; GoodputMonitor's
  ``other_s``), which the planner's formula counts in every interval's wall time but not as goodput (2-3% of the
  wall time here: ``predicted_without_overhead_term`` shows the prediction without it).

Prints one JSON object: the measured goodput and its breakdown, the predicted goodput, the inputs and
``measured / predicted`` (the target is within 10%). ``python bench/goodput.py``: 516 executed steps and three
restarts, measured 8.8 min at load average 12 and 14 min at 24 on the 2 shared cores (about 5 min expected idle);
``--quick`` (one failure, 168 executed steps: 2.7 min at load 11, 5 min at 20) is what
``tests/integration/test_goodput_restart.py`` runs.

Expect ``ratio`` a few percent below 1: the formula is Daly's for exponential (Poisson) failures, which also strike
during restarts and lose a little less than R + τ/2 each on average, while this schedule's failures are evenly
spaced and each costs exactly R + K/2 steps; the gap is second order in R/M (about 2-4% at R/M ≈ 0.15-0.2).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

#: name -> (failures F, checkpoint every K steps, a failure every N executed steps); N = (m + 1/2)·K.
PRESETS = {"full": (3, 24, 132), "quick": (1, 16, 88)}


def fail_steps(*, failures: int, every: int, fail_every: int) -> list[int]:
    """Global step after which attempt ``a`` fails, for each attempt that fails (``len == failures``).

    Attempt 0 runs steps 1..N; attempt ``a > 0`` resumes from the checkpoint K/2 steps before the previous failure
    and runs N steps again, so consecutive failures are ``N - K/2`` global steps apart.
    """
    if every % 2 or fail_every % every != every // 2:
        raise ValueError(f"--fail-every={fail_every} must be an odd multiple of half of --every={every}: "
                         f"(m + 1/2)·K, e.g. {every * 4 + every // 2}, so every failure re-does K/2 steps")  # fmt: skip
    out = [fail_every] if failures else []
    for _ in range(failures - 1):
        out.append(out[-1] + fail_every - every // 2)
    return out


def total_steps(*, failures: int, every: int, fail_every: int) -> int:
    """The run's ``max_steps``: the last attempt runs ``N - K/2`` steps from its checkpoint, so that the run ends on
    a save and every save closes an interval of exactly K steps (``interval_s`` is useful time per save)."""
    last = fail_steps(failures=failures, every=every, fail_every=fail_every)[-1] if failures else every // 2
    return last - every + fail_every


# ------------------------------------------------------------------------------------------------------ the worker
def _event(root: Path, **fields) -> None:
    row = {"t": time.time(), "rank": int(os.environ.get("RANK", "0")),
           "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), **fields}  # fmt: skip
    with open(root / "events.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")


def worker(args: argparse.Namespace) -> None:
    """One rank of one attempt (run by torchrun)."""
    root = Path(args.root)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    _event(root, what="start")

    import lightning as L
    import torch
    from lightning_v17.callbacks import AsyncCheckpoint, GoodputMonitor

    from lightning_v17 import V17Strategy
    from lightning_v17.data import PackedDataModule
    from lightning_v17.models import LlamaLM

    _event(root, what="imported")
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    plan = fail_steps(failures=args.failures, every=args.every, fail_every=args.fail_every)
    steps = total_steps(failures=args.failures, every=args.every, fail_every=args.fail_every)

    class Inject(L.Callback):
        """Timeline events, and rank 1's hard exit after its attempt's scheduled step."""

        def __init__(self) -> None:
            self.first = False

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if not self.first:
                self.first = True
                _event(root, what="first_step", step=trainer.global_step)
            if trainer.global_rank == 0:  # each step's end on rank 0's clock (before this step's save, if any)
                with open(root / "steps.jsonl", "a") as f:
                    f.write(json.dumps({"attempt": attempt, "step": trainer.global_step, "t": time.time()}) + "\n")
            if attempt < len(plan) and trainer.global_rank == 1 and trainer.global_step == plan[attempt]:
                _event(root, what="kill", step=trainer.global_step)
                os._exit(1)

    g = torch.Generator().manual_seed(1000)  # enough documents for one epoch of `steps` steps on 2 ranks
    tokens = steps * 2 * args.batch * args.seq
    docs, n = [], 0
    while n < tokens:
        length = int(torch.randint(args.seq // 8, 2 * args.seq, (1,), generator=g))
        docs.append(torch.randint(3, 256, (length,), generator=g).tolist())
        n += length
    data = PackedDataModule(docs, seq_len=args.seq, batch_size=args.batch, seed=0)
    module = LlamaLM(model="tiny", model_overrides={"layers": args.layers, "max_seq_len": args.seq},
                     warmup_steps=0, lr=1e-3, max_steps=steps)  # fmt: skip
    monitor = GoodputMonitor(dirpath=str(root / "ckpt"), log=False)
    ckpt = AsyncCheckpoint(root / "ckpt", every_n_steps=args.every, keep_last=2)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=V17Strategy(zero_stage=3), max_steps=steps, max_epochs=1,
        callbacks=[monitor, Inject(), ckpt], logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
    )  # fmt: skip
    trainer.fit(module, datamodule=data, ckpt_path="last")
    if trainer.global_step != steps:
        raise RuntimeError(f"the run ended at step {trainer.global_step}, not {steps} (too few documents?)")
    if trainer.is_global_zero:
        b = monitor.last
        out = {"breakdown": b.__dict__ if b is not None else None, "saves": monitor.tracker.saves,
               "staging_s": [h["staging_s"] for h in ckpt.history], "steps": steps}  # fmt: skip
        (root / "result.json").write_text(json.dumps(out))
    _event(root, what="end", step=trainer.global_step)


# ------------------------------------------------------------------------------------------------------ the launcher
def launch(root: Path, *, failures: int, every: int, fail_every: int, seq: int, batch: int, layers: int,
           timeout: float) -> subprocess.CompletedProcess:  # fmt: skip
    """One ``torchrun --max-restarts failures`` launch of :func:`worker`; on timeout the whole process group (agent
    and workers) is killed and the result has returncode -9."""
    root.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", str(failures), str(Path(__file__).resolve()), "--worker", str(root),
           "--failures", str(failures), "--every", str(every), "--fail-every", str(fail_every),
           "--seq", str(seq), "--batch", str(batch), "--layers", str(layers)]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}  # plain restarts
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(cmd, proc.returncode, out, "")
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return subprocess.CompletedProcess(cmd, -9, out + f"\n[killed after {timeout} s]", "")


def kill_to_first_step_s(root: Path) -> list[float]:
    """Per failure, from the workers' own events: the kill until the next attempt's first finished step (the slower
    rank decides). It includes that first step, so it bounds GoodputMonitor's ``restart_s`` from above."""
    ev = [json.loads(line) for line in (root / "events.jsonl").read_text().splitlines()]
    kills = sorted((e["attempt"], e["t"]) for e in ev if e["what"] == "kill")
    out = []
    for attempt, t in kills:
        firsts = [e["t"] for e in ev if e["what"] == "first_step" and e["attempt"] == attempt + 1]
        if firsts:
            out.append(round(max(firsts) - t, 3))
    return out


def redo_wall_s(root: Path, *, every: int) -> list[float]:
    """Per failure, from rank 0's step log: the wall time from the end of the step the next attempt resumed from
    (a checkpoint, K/2 steps back) to the end of the last step before the kill. The re-done steps' own time plus
    their share of loop overhead and that save's blocking, so it bounds GoodputMonitor's ``redo_s`` from above."""
    rows = [json.loads(line) for line in (root / "steps.jsonl").read_text().splitlines()]
    out = []
    for attempt in sorted({r["attempt"] for r in rows})[:-1]:  # every attempt but the last one failed
        mine = {r["step"]: r["t"] for r in rows if r["attempt"] == attempt}
        last = max(mine)
        out.append(round(mine[last] - mine[last - every // 2], 3))
    return out


def analyse(root: Path, *, failures: int, every: int) -> dict:
    """The measured goodput and the planner's prediction from the run's own measured inputs."""
    from lightning_v17.planner.resilience import expected_goodput
    from lightning_v17.trackers.goodput import GoodputBreakdown

    res = json.loads((root / "result.json").read_text())
    b, saves = res["breakdown"], res["saves"]
    if b["attempts"] != failures + 1:
        raise RuntimeError(f"expected {failures + 1} attempts, GoodputMonitor counted {b['attempts']}")
    inputs = GoodputBreakdown(**b).model_inputs(saves=saves)  # per save / per failure, all measured
    predicted = expected_goodput(**inputs)
    without_overhead = expected_goodput(**{**inputs, "overhead_s": 0.0})
    measured = b["goodput"]
    return {
        "measured_goodput": round(measured, 4),
        "predicted_goodput": round(predicted, 4),
        "ratio": round(measured / predicted, 4),
        "within_10pct": abs(measured / predicted - 1.0) <= 0.10,
        "inputs": {k: round(v, 4) for k, v in inputs.items()},
        "breakdown_s": {k: round(v, 3) for k, v in b.items() if k.endswith("_s")},
        "attempts": b["attempts"],
        "saves": saves,
        "steps": res["steps"],
        "redo_s_per_failure": round(b["redo_s"] / failures, 3),
        "half_interval_useful_s": round(b["useful_s"] / res["steps"] * every / 2, 3),
        "redo_wall_s": redo_wall_s(root, every=every),
        "kill_to_first_step_s": kill_to_first_step_s(root),
        "predicted_without_overhead_term": round(without_overhead, 4),
        "staging_s_median": sorted(res["staging_s"])[len(res["staging_s"]) // 2] if res["staging_s"] else None,
        "checkpoint_every_steps": every,
    }


def run(root: Path, *, preset: str = "full", seq: int = 256, batch: int = 4, layers: int = 4,
        timeout: float = 2400) -> dict:  # fmt: skip
    """Launch one run into ``root`` and analyse it (raises with the log's tail when the launch fails)."""
    failures, every, fail_every = PRESETS[preset]
    t0 = time.perf_counter()
    proc = launch(root, failures=failures, every=every, fail_every=fail_every, seq=seq, batch=batch, layers=layers,
                  timeout=timeout)  # fmt: skip
    if proc.returncode != 0 or not (root / "result.json").exists():
        raise RuntimeError(f"the torchrun launch failed (rc {proc.returncode}):\n{proc.stdout[-4000:]}")
    out = {"benchmark": "goodput_young_daly", "preset": preset, "failures": failures, "fail_every_steps": fail_every,
           **analyse(root, failures=failures, every=every), "launch_wall_s": round(time.perf_counter() - t0, 1),
           "loadavg_1m": round(os.getloadavg()[0], 2)}  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", metavar="ROOT", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="one failure, about 2 minutes")
    parser.add_argument("--failures", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--every", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--fail-every", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--seq", type=int, default=256, help="tokens per row")
    parser.add_argument("--batch", type=int, default=4, help="rows per rank per step")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of the tiny Llama")
    parser.add_argument("--root", default=None, help="run directory (default: a new temporary one)")
    args = parser.parse_args()
    if args.worker:
        args.root = args.worker
        return worker(args)
    root = Path(args.root) if args.root else Path(tempfile.mkdtemp(prefix="v17_goodput_"))
    print(json.dumps(run(root, preset="quick" if args.quick else "full", seq=args.seq, batch=args.batch,
                         layers=args.layers)))  # fmt: skip


if __name__ == "__main__":
    main()
