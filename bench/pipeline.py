"""Pipeline parallelism side by side: every schedule at pp=2, m in {4, 8}, measured bubble vs the planner, tokens/s,
and V17's pp=2 1F1B path against raw ``torch.distributed.pipelining`` (same schedule, model, data), one invocation.

Model: the reference Llama (``lightning_v17.models``), 8 blocks, hidden 256, 8 heads, ffn 768, vocab 64, seq 128,
fp32, one intra-op thread per rank, 2 gloo ranks on CPU, rank r pinned to the r-th allowed core (``--no-pin`` to
turn off). Each step feeds m micro-batches of 8 rows (one document
per row). Every configuration builds its stages from the same seed; ``--warmup`` steps are excluded.

Measurement: every configuration (five schedules and raw torch 1F1B, at each m) runs in its own fresh pair of
processes, as a user runs one job, over ``--rounds`` rounds in a rotated order (so load from other processes does
not always hit the same configuration); the medians are over all rounds and timed steps. One process running all
configurations one after another does not measure GPipe: its m live micro-batches then need memory that the other
configurations' allocations had left fragmented, and the first touch of fresh pages (~11 us per 4 KiB page in this
VM, ~26k page faults and ~0.3 s of system time per forward) made its last forwards up to 4x slower. The ratio to
raw ``torch.distributed.pipelining`` is measured in one more process pair per m that runs our 1F1B and the raw 1F1B
interleaved step by step (A B A B ...; both have the same memory pattern), so both see the same machine state: two
separate process pairs minutes apart differed by up to 5% from run to run. Each iteration is zero_grad, a barrier,
the schedule step, a barrier (``schedule_s``: the wall clock of the slowest rank, i.e. the pipeline's real step),
the optimizer step, a barrier (``iter_s``, used for tokens/s). Busy time is what the engine's ``BubbleTimer``
records on each rank (stage forward, backward, weight-backward and loss compute). Reported per configuration
(median over ranks x timed steps, robust to a step disturbed by other processes on the machine):

* ``bubble_measured`` = idle / busy = step / busy - 1 (Narayanan 2021 §2.2's definition, the one the planner's
  ``bubble_fraction`` predicts: (p-1)/m for GPipe and 1F1B);
* ``idle_fraction`` = idle / step;
* ``bubble_planner`` from ``lightning_v17.planner.pipeline.bubble_fraction``;
* ``tokens_per_s`` = tokens per iteration / median iteration time (optimizer step included);
* ``bubble_replayed``: every timed step's recorded actions (``BubbleTimer.trace``) replayed with zero communication
  time (``engine.pipeline.replay_actions``): the idle / busy that the measured action durations alone imply. With
  equal durations it is exactly (p-1)/m; the gap to it is stage imbalance and micro-batch-to-micro-batch variation
  of the compute (``action_cv``), and ``bubble_measured - bubble_replayed`` is communication + scheduling overhead.

Targets checked and printed under ``"checks"``: GPipe/1F1B measured bubble within ±25% of (p-1)/m; zero_bubble's
below 1F1B's at equal m; V17 1F1B tokens/s / raw torch.distributed.pipelining 1F1B tokens/s >= 0.95.

Usage::

    .venv/bin/python bench/pipeline.py                  # prints one JSON object
    .venv/bin/python bench/pipeline.py --steps 6 --warmup 2 --rounds 1   # one round: ~5 min
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # after the path insert, so the script runs from anywhere (spawned ranks re-import it too)

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 2), ("zbv", 2)]
# vocab 64 keeps the head + loss of the last stage small (~2% of a block): (p-1)/m assumes equal stage times, and
# with vocab 512 the last stage was ~6% slower, which GPipe/1F1B amplify by m into extra idle time on stage 0.
MODEL = {"vocab_size": 64, "hidden": 256, "layers": 8, "heads": 8, "kv_heads": 8, "ffn": 768, "max_seq_len": 128}
SEQ = 128
# 8 rows per micro-batch: each send/recv and schedule action has a fixed cost on CPU gloo that (p-1)/m leaves out;
# with 2 rows it was ~10% of a micro-batch's compute and inflated every measured bubble.
ROWS_PER_MICROBATCH = 8


def _batch(m: int, step: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    rows = m * ROWS_PER_MICROBATCH
    tokens = torch.randint(0, MODEL["vocab_size"], (rows, SEQ), generator=g)
    labels = torch.cat([tokens[:, 1:], torch.full((rows, 1), -100)], dim=1)
    return {"input_ids": tokens, "labels": labels, "position_ids": torch.arange(SEQ).expand(rows, SEQ).contiguous()}


class _Runner:
    """One pipeline configuration on this rank: ``zero_grad`` + ``schedule`` + ``optimizer.step`` per iteration."""

    def __init__(self, schedule_step, opt, busy_of, trace: list | None = None) -> None:
        self.schedule_step, self.opt, self.busy_of, self.trace = schedule_step, opt, busy_of, trace
        self.sched_s: list[float] = []  # barrier-bracketed schedule step: forward + backward of all micro-batches
        self.iter_s: list[float] = []  # the whole iteration, optimizer step included (for tokens/s)
        self.busy: list[float] = []
        self.actions: list[list[tuple]] = []  # per timed step: (kind, stage, chunk, duration_s) in execution order

    def iteration(self, i: int, *, record: bool) -> None:
        import torch.distributed as dist

        dist.barrier()
        t0 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        dist.barrier()
        if self.trace is not None:
            self.trace.clear()
        b0 = self.busy_of()
        t1 = time.perf_counter()
        self.schedule_step(i)
        dist.barrier()
        t2 = time.perf_counter()
        b1 = self.busy_of()
        if record and self.trace is not None:
            self.actions.append([(k, s, c, e - b) for k, s, c, b, e in self.trace])
        self.opt.step()
        dist.barrier()
        t3 = time.perf_counter()
        if record:
            self.sched_s.append(t2 - t1)
            self.busy.append(b1 - b0)
            self.iter_s.append(t3 - t0)

    def result(self) -> dict[str, list]:
        return {"sched_s": self.sched_s, "iter_s": self.iter_s, "busy": self.busy, "actions": self.actions}


def _v17(rank: int, schedule: str, v: int, m: int, base) -> _Runner:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_v17.config import PipelinePolicy
    from lightning_v17.engine.pipeline import build_schedule, pipeline_step, split_model
    from lightning_v17.models.pp_layouts import model_pipeline_layout

    pp_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))["pp"]
    policy = PipelinePolicy(schedule=schedule, microbatches=m, virtual_stages=v)
    model = copy.deepcopy(base)
    views, ids = split_model(model, layout=model_pipeline_layout(model), pp_rank=rank, pp=2, policy=policy)
    rt = build_schedule(views, stage_ids=ids, pp_mesh=pp_mesh, policy=policy, device="cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    trace = rt.enable_trace()
    return _Runner(
        lambda i: pipeline_step(rt, _batch(m, i)), opt, lambda: rt.timer.busy_s + rt.loss_fn.busy_s, trace=trace
    )


def _raw_1f1b(rank: int, m: int, base) -> _Runner:
    """Plain torch.distributed.pipelining, written as its tutorial / torchtitan do: deep-copy the model, delete what
    the stage does not own, PipelineStage + Schedule1F1B with a mean cross-entropy loss (scale_grads=True)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    stage_mod = copy.deepcopy(base)
    keep = range(4) if rank == 0 else range(4, 8)
    for k in list(stage_mod.layers.keys()):
        if int(k) not in keep:
            del stage_mod.layers[k]
    if rank == 0:
        stage_mod.norm = None
        stage_mod.output = None
    else:
        stage_mod.tok_embeddings = None

    def loss_fn(logits, labels):
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)

    stage = PipelineStage(stage_mod, rank, 2, torch.device("cpu"), group=dist.group.WORLD)
    sched = Schedule1F1B(stage, n_microbatches=m, loss_fn=loss_fn)
    opt = torch.optim.AdamW(stage_mod.parameters(), lr=1e-4)

    def step(i: int) -> None:
        b = _batch(m, i)
        args = (b["input_ids"],) if rank == 0 else ()
        sched.step(*args, target=b["labels"], losses=[], return_outputs=False, position_ids=b["position_ids"])

    return _Runner(step, opt, lambda: 0.0)


def _worker(rank: int, port: int, key: str, args: argparse.Namespace, queue) -> None:
    """One configuration (``"<schedule>/m<m>"``) on this rank, in a fresh process: warm-up, then timed steps."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if args.pin and hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) >= 2:
        # one core per rank, as one accelerator per rank: the OS cannot co-schedule both stages on one core
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[rank]})
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        from lightning_v17.models import Llama, ModelConfig

        torch.manual_seed(0)
        base = Llama(ModelConfig(**MODEL))
        name, m = key.split("/m")
        if name == "pair_1f1b":
            # ours and raw torch 1F1B in one process pair, timed iterations interleaved step by step (A B A B):
            # the same machine state for both, for the ratio (the two have the same memory pattern)
            runners = {"v17": _v17(rank, "1f1b", 1, int(m), base), "raw": _raw_1f1b(rank, int(m), base)}
        else:
            runners = {"one": _v17(rank, name, dict(SCHEDULES)[name], int(m), base)}
        for r in runners.values():
            for i in range(args.warmup):
                r.iteration(i, record=False)
        for i in range(args.steps):
            for r in runners.values():
                r.iteration(args.warmup + i, record=True)
        out = {k: r.result() for k, r in runners.items()}
        queue.put((rank, out.get("one", out)))
    finally:
        dist.destroy_process_group()


def _launch(key: str, args: argparse.Namespace, timeout_s: float = 600.0) -> dict[int, dict[str, list]]:
    """Run one configuration in a fresh pair of spawned ranks; returns ``{rank: result}``."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = C.free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, key, args, queue)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        out = dict(queue.get() for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=timeout_s)
            if p.is_alive():
                p.kill()
    return out


def _replay(per_rank: dict, key: str, *, num_stages: int) -> dict[str, Any]:
    """Replay each timed step's recorded actions with zero communication time (``engine.pipeline.replay_actions``).

    ``bubble_replayed``: idle / busy that the measured action durations alone give (stage imbalance and run-to-run
    variation of the compute included, communication and scheduling overhead excluded); ``bubble_measured`` minus
    it is what the P2P transfers, the schedule's bookkeeping and the step's own set-up cost. ``action_cv``: the
    coefficient of variation of the forward ("F", loss included) and backward ("B") durations of one rank within a
    step (median over ranks and steps): how unequal the "equal" micro-batches are on this machine.
    """
    from lightning_v17.engine.pipeline import replay_actions

    bubbles: list[float] = []
    cvs: dict[str, list[float]] = {"F": [], "B": []}
    steps = min(len(per_rank[r][key]["actions"]) for r in (0, 1))
    for j in range(steps):
        acts = {r: per_rank[r][key]["actions"][j] for r in (0, 1)}
        out = replay_actions(acts, num_stages)
        bubbles += list(out["bubble_over_busy"].values())
        for r in (0, 1):
            for kind in ("F", "B"):
                durs = [a[3] for a in acts[r] if a[0] == kind]
                if len(durs) > 1:
                    cvs[kind].append(statistics.pstdev(durs) / statistics.mean(durs))
    if not bubbles:
        return {}
    return {
        "bubble_replayed": statistics.median(bubbles),
        "action_cv": {k: round(statistics.median(v), 4) for k, v in cvs.items() if v},
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="timed steps per configuration and round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (stage init, allocator)")
    parser.add_argument(
        "--rounds", type=int, default=2, help="repetitions of the whole measurement (order rotated each round)"
    )
    parser.add_argument(
        "--no-pin", dest="pin", action="store_false", help="do not pin rank r to the r-th allowed CPU core"
    )
    parser.add_argument("--json-out", default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from lightning_v17.planner.pipeline import bubble_fraction

    keys = [f"{name}/m{m}" for m in (4, 8) for name in [*(s for s, _ in SCHEDULES), "pair_1f1b"]]
    per_rank: dict[int, dict[str, dict[str, list]]] = {0: {}, 1: {}}
    t0 = time.time()

    def add(key: str, r: int, res: dict) -> None:
        acc = per_rank[r].setdefault(key, {"sched_s": [], "iter_s": [], "busy": [], "actions": []})
        for k, vals in res.items():
            acc[k] += vals

    for rnd in range(args.rounds):
        order = keys[rnd % len(keys) :] + keys[: rnd % len(keys)]  # rotate: no configuration has a fixed slot
        for key in order:
            res = _launch(key, args)
            m = key.split("/m")[1]
            for r in (0, 1):
                if key.startswith("pair_"):
                    add(f"paired_v17_1f1b/m{m}", r, res[r]["v17"])
                    add(f"raw_1f1b/m{m}", r, res[r]["raw"])
                else:
                    add(key, r, res[r])
            first = res[0]["v17"] if key.startswith("pair_") else res[0]
            it = statistics.median(first["iter_s"])
            print(f"[round {rnd + 1}/{args.rounds}] {key}: {it:.3f} s/iter", file=sys.stderr, flush=True)
    results: dict[str, Any] = {}
    out_keys = [k.replace("pair_1f1b", "raw_1f1b") for k in keys]
    out_keys += [f"paired_v17_1f1b/m{m}" for m in (4, 8)]
    for key in out_keys:
        name, m = key.split("/m")
        m = int(m)
        iter_s = statistics.median(per_rank[0][key]["iter_s"])  # barrier-bracketed: equal on both ranks
        entry: dict[str, Any] = {
            "m": m,
            "iter_s": iter_s,
            "schedule_s": statistics.median(per_rank[0][key]["sched_s"]),
            "tokens_per_s": m * ROWS_PER_MICROBATCH * SEQ / iter_s,
        }
        if name in dict(SCHEDULES):
            v = dict(SCHEDULES)[name]
            pairs = [(t, b) for r in (0, 1) for t, b in zip(per_rank[r][key]["sched_s"], per_rank[r][key]["busy"])]
            entry.update(
                virtual_stages=v,
                bubble_measured=statistics.median(t / b - 1 for t, b in pairs),
                idle_fraction=statistics.median(1 - b / t for t, b in pairs),
                bubble_planner=bubble_fraction(name, pp=2, microbatches=m, virtual_stages=v),
                busy_s_per_rank=[statistics.median(per_rank[r][key]["busy"]) for r in (0, 1)],
                **_replay(per_rank, key, num_stages=2 * v),
            )
        results[key] = entry
    checks: dict[str, Any] = {}
    for m in (4, 8):
        ideal = (2 - 1) / m
        for s in ("gpipe", "1f1b"):
            got = results[f"{s}/m{m}"]["bubble_measured"]
            checks[f"{s}/m{m}: bubble within 25% of (p-1)/m={ideal:.3f}"] = {
                "measured": round(got, 4),
                "rel_err": round(abs(got - ideal) / ideal, 3),
                "ok": abs(got - ideal) <= 0.25 * ideal,
                "replayed_zero_comm": round(results[f"{s}/m{m}"].get("bubble_replayed", float("nan")), 4),
            }
        zb, ob = results[f"zero_bubble/m{m}"]["bubble_measured"], results[f"1f1b/m{m}"]["bubble_measured"]
        checks[f"m{m}: zero_bubble bubble < 1f1b bubble"] = {
            "zero_bubble": round(zb, 4),
            "1f1b": round(ob, 4),
            "ok": zb < ob,
        }
        # paired: both in the same process pair, iterations interleaved (see _worker)
        ratio = results[f"paired_v17_1f1b/m{m}"]["tokens_per_s"] / results[f"raw_1f1b/m{m}"]["tokens_per_s"]
        checks[f"m{m}: v17 1f1b / raw torch.distributed.pipelining 1f1b tokens/s >= 0.95"] = {
            "ratio": round(ratio, 3),
            "ok": ratio >= 0.95,
            "separate_runs_ratio": round(
                results[f"1f1b/m{m}"]["tokens_per_s"] / results[f"raw_1f1b/m{m}"]["tokens_per_s"], 3
            ),
        }
    report = {
        "bench": "pipeline",
        "pp": 2,
        "model": {**MODEL, "seq": SEQ, "rows_per_microbatch": ROWS_PER_MICROBATCH, "dtype": "fp32"},
        "steps": args.steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "pinned": args.pin,
        "results": results,
        "checks": checks,
        "wall_s": round(time.time() - t0, 1),
    }
    C.emit_json(report, args.json_out)
    return report


if __name__ == "__main__":
    main()
