"""The planner against measurement: its top-3 layouts for the main job's model and batch, run on 4 CPU gloo ranks.

What is planned: the job ``make run`` trains (configs/tiny-cpu.yaml: the tiny reference Llama, fp32, 8 packed rows
of 512 tokens per data-parallel rank, AdamW) with ``trainer.devices: 4``, read by ``v17 plan --config`` and searched
at that batch (``lightning_v17.planner.search``, ``--gpu cpu``). The three fastest candidates per sample are each
run for ``--warmup`` + ``--steps`` optimizer steps under Lightning's Trainer with the ``V17Strategy`` that
``v17 plan --emit-config`` writes for them (``planner.emit.strategy_section``), ``LlamaLM(model="tiny")`` with the
job's optimizer settings and ``PackedDataModule`` on the embedded stdlib corpus (the job's data, ffd packing, seed 0).

Measurement: every candidate runs in its own 4 fresh processes (``bench/_common.py``'s launcher, one intra-op thread
per rank), over ``--rounds`` rounds in a rotated order so load from other processes does not always hit the same
candidate; the medians over rounds are reported. Step time: the barrier-bracketed wall clock of the timed steps over
their count (the slowest rank decides; warm-up excluded). Memory: each rank's peak RSS, and its growth over the RSS
at the start of training (model and optimizer built, the Python/torch runtime and the corpus already resident), which
is what the planner's per-rank buckets count on a CPU (activations, gradients, optimizer state, temporaries).

Reported per candidate: the predicted step time (every collective exposed, as the search ranks) and its terms, the
measured step time, both per sample (step / global batch: the candidates train different global batches), the
predicted per-rank bytes and the measured peak RSS and growth, and the CPU seconds of all ranks per step (a rank
blocked in a collective does not spend them: they separate the compute term from the wait). ``ranking_agrees`` says
whether the predicted order per sample equals the measured one; ``notes`` compare each candidate's predicted and
measured time per sample against the first's and name the term that is off. ``loss_last`` is rank 0's last
micro-batch loss as Lightning hands it to callbacks (divided by ``accumulate_grad_batches``): a sanity value.

Usage::

    .venv/bin/python bench/planner.py --steps 2 --warmup 1 --json-out bench/results/planner.json   # ~10 min, 2 cores
    .venv/bin/python bench/planner.py --steps 3 --warmup 1 --rounds 1          # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # after the path insert, so `python bench/planner.py` works from anywhere

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "configs" / "tiny-cpu.yaml"
WORLD = 4


def plan_candidates(top: int) -> tuple[list, dict]:
    """The search's ``top`` candidates for the main job on ``WORLD`` CPU ranks, and the job's inputs in words."""
    from lightning_v17.planner.job import job_specs, load_configs, merge
    from lightning_v17.planner.search import search

    doc = merge(load_configs([JOB]), {"trainer": {"devices": WORLD}})
    model, cluster, train = job_specs(doc)
    found = search(model, cluster, train)
    acc = cluster.accelerator
    assumed = {
        "gpu": cluster.gpu, "peak_flops_per_rank": acc.peak_flops, "mfu": train.mfu,
        "intra_node_bytes_per_s": acc.intra_node_bytes_per_s, "ranks": WORLD, "cores": os.cpu_count(),
        "micro_batch": train.micro_batch, "microbatches": train.microbatches, "seq": train.seq,
        "precision": train.precision.value, "model": model.name, "params": model.num_params,
    }  # fmt: skip
    return list(found.candidates[:top]), assumed


def _run_args(plan) -> dict:
    """What ``v17 plan --emit-config`` writes for ``plan`` that the run needs: V17Strategy's ``init_args``, the rows
    per micro-batch (``data.batch_size``) and the micro-batches per step (``trainer.accumulate_grad_batches``)."""
    from lightning_v17.planner.emit import emit_config

    config = emit_config(plan).config
    return {"strategy": config["trainer"]["strategy"]["init_args"], "batch_size": config["data"]["batch_size"],
            "accumulate_grad_batches": config["trainer"].get("accumulate_grad_batches", 1)}  # fmt: skip


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def _worker(args: argparse.Namespace) -> None:
    _, world = C.worker_setup()
    import lightning as L
    import torch
    from lightning_v17.strategies import V17Strategy

    from lightning_v17.data import PackedDataModule
    from lightning_v17.models import LlamaLM
    from lightning_v17.planner.job import load_configs

    job = load_configs([JOB])
    run = json.loads(args.run)
    accumulate = run["accumulate_grad_batches"]
    timer = C.StepTimer(args.warmup, args.steps)
    start: dict[str, float] = {}
    losses: list[float] = []

    class Timing(L.Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            start["rss_mb"] = _rss_mb()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if (batch_idx + 1) % accumulate == 0:  # an optimizer step ended with this micro-batch
                losses.append(float(outputs["loss"]))
                timer.after_step(trainer.global_step - 1)

    L.seed_everything(0, verbose=False)
    module = LlamaLM(**job["model"])
    data = PackedDataModule(**{**job["data"], "batch_size": run["batch_size"], "seed": 0})
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=V17Strategy(**run["strategy"]), precision="32-true",
        accumulate_grad_batches=accumulate,
        max_steps=args.warmup + args.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        gradient_clip_val=job["trainer"].get("gradient_clip_val"), callbacks=[Timing()],
    )  # fmt: skip
    trainer.fit(module, datamodule=data)
    C.write_result(args._out, timer, _Shape(), world, loss_last=losses[-1], rss_start_mb=start.get("rss_mb"),
                   threads=torch.get_num_threads())  # fmt: skip


class _Shape:
    """What ``_common.write_result`` reads of a shape: rows and tokens per rank (its tokens/s is not used here)."""

    batch, seq = 8, 512


def _measured(runs: list[dict]) -> dict:
    import statistics

    ok = [r for r in runs if r["ok"]]
    if not ok:
        return {"error": runs[-1]["error"] if runs else "not run"}
    steps = [r["ranks"][0]["seconds"] / r["ranks"][0]["timed_steps"] for r in ok]
    world = len(ok[0]["ranks"])
    peak = [statistics.median(r["ranks"][k]["peak_rss_mb"] for r in ok) for k in range(world)]
    growth = [statistics.median(r["ranks"][k]["peak_rss_mb"] - r["ranks"][k]["rss_start_mb"] for r in ok)
              for k in range(world)]  # fmt: skip
    cpu = [sum(k["cpu_s"] for k in r["ranks"]) / r["ranks"][0]["timed_steps"] for r in ok]  # all ranks, per step
    out = {"step_s": round(statistics.median(steps), 4), "rounds_step_s": [round(s, 4) for s in steps],
           "cpu_s_per_step_all_ranks": round(statistics.median(cpu), 4),
           "peak_rss_mb": [round(x, 1) for x in peak], "rss_growth_mb": [round(x, 1) for x in growth],
           "loss_last": round(ok[-1]["ranks"][0]["loss_last"], 4)}  # fmt: skip
    bad = [r["error"] for r in runs if not r["ok"]]
    if bad:
        out["failed_rounds"] = bad
    return out


def _order(values: dict[str, float]) -> list[str]:
    return sorted(values, key=lambda k: values[k])


def _notes(rows: dict[str, dict]) -> list[str]:
    """Each later candidate against the first: the predicted and measured time per sample, and the term that is off.

    The measured CPU seconds of all ranks per sample separate the two candidates' terms: a rank blocked in a
    collective waits without computing, so where CPU seconds per sample grow as much as the time does, the work
    itself grew and the compute term (one MFU for every layout) is off; where they do not, the wait is
    communication the planner undercounts."""
    notes = []
    names = list(rows)
    first = rows[names[0]]

    def per_sample(row: dict, value: float) -> float:
        return value / row["global_batch"]

    for name in names[1:]:
        row = rows[name]
        predicted = row["predicted_per_sample_s"] / first["predicted_per_sample_s"]
        measured = row["measured_per_sample_s"] / first["measured_per_sample_s"]
        compute = (per_sample(row, row["predicted_terms_s"]["compute_s"])
                   / per_sample(first, first["predicted_terms_s"]["compute_s"]))  # fmt: skip
        cpu = (per_sample(row, row["measured"]["cpu_s_per_step_all_ranks"])
               / per_sample(first, first["measured"]["cpu_s_per_step_all_ranks"]))  # fmt: skip
        if abs(measured - predicted) <= 0.1 * predicted:
            verdict = "agrees within 10%"
        elif cpu >= 1.25 * compute:
            verdict = (f"the compute term is off: the ranks' CPU seconds per sample are {cpu:.2f}x the first's where "
                       f"the planner's compute is {compute:.2f}x (one MFU for every layout; a tp-sharded matmul of "
                       "width h/tp and its DTensor dispatch cost more per FLOP)")
        else:
            verdict = (f"the comm term is off: CPU seconds per sample are {cpu:.2f}x the first's, close to the "
                       f"planner's compute ({compute:.2f}x), so the extra time is waiting in collectives")
        notes.append(f"{name}: predicted {predicted:.2f}x the first's time per sample, measured {measured:.2f}x; "
                     + verdict)
    return notes


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--top", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--json-out")
    ap.add_argument("--_worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--run", help=argparse.SUPPRESS)
    ap.add_argument("--_out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._worker:
        _worker(args)
        return {}

    from lightning_v17.planner.search import describe

    candidates, assumed = plan_candidates(args.top)
    names = [describe(c.plan) for c in candidates]
    runs: dict[str, list[dict]] = {n: [] for n in names}
    t_start = time.monotonic()
    common = ["--_worker", "--steps", str(args.steps), "--warmup", str(args.warmup)]
    for rnd in range(args.rounds):
        order = list(range(len(candidates)))
        order = order[rnd % len(order):] + order[: rnd % len(order)]  # rotate: no fixed position
        for i in order:
            t = time.monotonic()
            run = json.dumps(_run_args(candidates[i].plan))
            res = C.launch(os.path.abspath(__file__), [*common, "--run", run], world_size=WORLD,
                           timeout_s=args.timeout)  # fmt: skip
            if res["ok"]:
                for rank in res["ranks"]:
                    rank["timed_steps"] = args.steps
            runs[names[i]].append(res)
            took = f"{res['ranks'][0]['seconds'] / args.steps:.3f} s/step" if res["ok"] else "FAILED " + res["error"][:300]
            print(f"[round {rnd + 1}/{args.rounds}] {names[i]}: {took} ({time.monotonic() - t:.0f}s)", file=sys.stderr,
                  flush=True)  # fmt: skip

    rows: dict[str, dict] = {}
    for name, cand in zip(names, candidates):
        plan, terms = cand.plan, cand.terms
        measured = _measured(runs[name])
        g = plan.layout.global_batch
        row = {
            "run": _run_args(plan), "global_batch": g, "micro_batch": plan.layout.micro_batch,
            "microbatches": plan.layout.microbatches,
            "predicted_step_s": round(cand.step_s, 4), "predicted_per_sample_s": cand.per_sample_s,
            "predicted_terms_s": {k: round(v, 5) for k, v in vars(terms).items()},
            "predicted_device_mb_per_rank": round(plan.memory.tiers.gpu / 2**20, 1),
            "predicted_without_params_mb_per_rank": round((plan.memory.total - plan.memory.param) / 2**20, 1),
            "measured": measured,
        }  # fmt: skip
        if "step_s" in measured:
            row["measured_per_sample_s"] = measured["step_s"] / g
            row["measured_over_predicted_step"] = round(measured["step_s"] / cand.step_s, 2)
        rows[name] = row
    done = {n: r for n, r in rows.items() if "measured_per_sample_s" in r}
    predicted = _order({n: r["predicted_per_sample_s"] for n, r in done.items()})
    measured_order = _order({n: r["measured_per_sample_s"] for n, r in done.items()})
    out = {
        "job": "configs/tiny-cpu.yaml with trainer.devices: 4 (v17 plan --config)",
        "planner_assumes": assumed,
        "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds,
        "candidates": rows,
        "predicted_order": predicted, "measured_order": measured_order,
        "ranking_agrees": predicted == measured_order and len(done) == len(rows),
        "notes": _notes(done) if done else [],
        "wall_s": round(time.monotonic() - t_start, 1),
    }  # fmt: skip
    C.emit_json(out, args.json_out)
    return out


if __name__ == "__main__":
    C.run_main(main)
