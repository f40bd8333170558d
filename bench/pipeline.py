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

* ``bubble_simulated``: the planner's simulation (``planner.pipeline.bubble_fraction``, i.e. ``planner.simulate``
  running the same action order torch runs) fed with this configuration's measured op times, the mean F (loss
  included), B and W duration per stage (``op_times_ms``), and the measured P2P time (``p2p_ms``: half the median
  round trip of one micro-batch's activation between the two ranks, timed in the same processes after the steps);
  ``bubble_simulated_no_p2p`` without it. ``handoff_ms`` (end of an action to the start of its consumer on the
  other rank, when that rank was waiting) and ``dispatch_ms`` (gap between two actions of a rank that did not wait)
  are read off the traces (``perf_counter`` is one clock for all processes of the machine), to explain a gap.

Targets checked and printed under ``"checks"``: GPipe/1F1B measured bubble within ±25% of (p-1)/m; zero_bubble's
below 1F1B's at equal m; V17 1F1B tokens/s / raw torch.distributed.pipelining 1F1B tokens/s >= 0.95; for all five
schedules at m = 4 and 8, the simulated bubble within max(15% relative, 0.01 absolute) of the measured one (also
printed as a table on stderr and under ``"bubble_table"``). ``--plot OUT.png`` draws the Gantt timeline of one
measured step (the median one) per configuration from the engine's trace; it needs matplotlib
(``pip install matplotlib``, or the project's ``plot`` extra).

Usage::

    .venv/bin/python bench/pipeline.py                  # prints one JSON object
    .venv/bin/python bench/pipeline.py --steps 6 --warmup 2 --rounds 1   # one round: ~5 min
    .venv/bin/python bench/pipeline.py --plot pipeline.png   # and the Gantt timelines
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
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
        # per timed step: (step start = leaving the barrier, step end = leaving the closing barrier,
        # [(kind, stage, chunk, t0, t1), ...]) in perf_counter seconds, which is CLOCK_MONOTONIC, one clock for all
        # processes of the machine: the ranks' times compare
        self.timelines: list[tuple[float, float, list[tuple]]] = []
        self.p2p_s: list[float] = []

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
            self.timelines.append((t1, t2, list(self.trace)))
        self.opt.step()
        dist.barrier()
        t3 = time.perf_counter()
        if record:
            self.sched_s.append(t2 - t1)
            self.busy.append(b1 - b0)
            self.iter_s.append(t3 - t0)

    def result(self) -> dict[str, list]:
        return {"sched_s": self.sched_s, "iter_s": self.iter_s, "busy": self.busy, "actions": self.actions,
                "timelines": self.timelines, "p2p_s": self.p2p_s}  # fmt: skip


def _p2p_one_way_s(rank: int, *, rounds: int = 30) -> float:
    """One activation transfer between the two ranks: half the median round trip of a micro-batch's activation
    ([rows, seq, hidden] fp32, the tensor a stage sends forward; its gradient has the same shape) over gloo."""
    import torch
    import torch.distributed as dist

    x = torch.zeros(ROWS_PER_MICROBATCH, SEQ, MODEL["hidden"])
    peer = 1 - rank
    times = []
    dist.barrier()
    for _ in range(rounds + 3):
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(x, peer)
            dist.recv(x, peer)
        else:
            dist.recv(x, peer)
            dist.send(x, peer)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[3:]) / 2


def _v17(rank: int, schedule: str, v: int, m: int, base) -> _Runner:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_v17.config import PipelinePolicy
    from lightning_v17.engine.pipeline.runtime import build_schedule, pipeline_step, split_model
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
        if "one" in runners:
            runners["one"].p2p_s.append(_p2p_one_way_s(rank))
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
    from lightning_v17.engine.pipeline.runtime import replay_actions

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


def _steps(per_rank: dict, key: str) -> int:
    return min(len(per_rank[r][key]["timelines"]) for r in (0, 1))


def _merged_step(per_rank: dict, key: str, j: int) -> dict[int, list[list]]:
    """Step ``j``'s actions per rank as ``[kind, stage, chunk, t0, t1, busy_s]``, each "loss" folded into the
    forward before it (the last stage's forward ends with its loss, as ``replay_actions`` counts it): its end
    becomes the loss's end and its busy time grows by the loss's duration."""
    out: dict[int, list[list]] = {}
    for r in (0, 1):
        seq: list[list] = []
        for kind, stage, chunk, t0, t1 in per_rank[r][key]["timelines"][j][2]:
            if kind == "loss" and seq and seq[-1][0] == "F":
                seq[-1][4] = t1
                seq[-1][5] += t1 - t0
            else:
                seq.append([kind, stage, chunk, t0, t1, t1 - t0])
        out[r] = seq
    return out


def _measured_op_times(
    per_rank: dict, key: str, *, num_stages: int, steps: list[int] | None = None, with_cv: bool = False
) -> list:
    """Per global stage, the mean measured duration of its forwards (loss included), its B (the full backward for
    schedules without the split) and its W actions over the timed ``steps`` (default: all), as
    :class:`planner.simulate.OpTimes`. With ``with_cv`` also each op's coefficient of variation: the standard
    deviation of every action's duration relative to the mean of the same op and stage *in its own step*, pooled
    over the steps (so a slower or faster step as a whole does not count as micro-batch-to-micro-batch jitter)."""
    from lightning_v17.planner.simulate import OpTimes

    durs: dict[tuple[str, int], list[float]] = {}
    rel: dict[tuple[str, int], list[float]] = {}
    for j in range(_steps(per_rank, key)) if steps is None else steps:
        in_step: dict[tuple[str, int], list[float]] = {}
        for seq in _merged_step(per_rank, key, j).values():
            for kind, stage, _, _, _, busy in seq:
                durs.setdefault((kind, stage), []).append(busy)
                in_step.setdefault((kind, stage), []).append(busy)
        for op, vals in in_step.items():
            mu = statistics.fmean(vals)
            if mu > 0:
                rel.setdefault(op, []).extend(v / mu - 1.0 for v in vals)

    def mean(kind: str, stage: int) -> float:
        vals = durs.get((kind, stage), [])
        return statistics.fmean(vals) if vals else 0.0

    def cv(kind: str, stage: int) -> float:
        vals = rel.get((kind, stage), [])
        return statistics.pstdev(vals) if with_cv and len(vals) > 1 else 0.0

    return [
        OpTimes(mean("F", s), mean("B", s), mean("W", s), cv("F", s), cv("B", s), cv("W", s))
        for s in range(num_stages)
    ]


def _observed_gaps(per_rank: dict, key: str, *, num_stages: int) -> dict[str, float]:
    """What the runtime adds to the compute, read off the timelines (one clock for both processes), as medians:

    * ``handoff_s``: from the end of an action on one rank to the start of the action that consumes its output on
      the other rank, when that rank was idle waiting for it (P2P transfer + the receive's bookkeeping);
    * ``dispatch_s``: between two actions of a rank when the second did not wait for the other rank (the
      runtime's per-action bookkeeping: posting sends and receives, the loss call, Python);
    * ``setup_s``: from leaving the step's barrier to the first action of the first stage (splitting the batch
      into micro-batches, stage set-up);
    * ``tail_s``: from the end of the step's last action (either rank) to leaving the closing barrier (waiting on
      the last sends, the schedule's own wrap-up, the barrier).
    """
    from lightning_v17.planner.simulate import dependency

    handoff: list[float] = []
    dispatch: list[float] = []
    setup: list[float] = []
    tail: list[float] = []
    for j in range(_steps(per_rank, key)):
        step = _merged_step(per_rank, key, j)
        owner = {a[1]: r for r, seq in step.items() for a in seq if a[0] == "F"}
        end = {(a[0], a[1], a[2]): a[4] for seq in step.values() for a in seq}
        last_end = max(seq[-1][4] for seq in step.values() if seq)
        for r, seq in step.items():
            t_start, t_end, _ = per_rank[r][key]["timelines"][j]
            if owner.get(0) == r and seq:
                setup.append(seq[0][3] - t_start)
            tail.append(t_end - last_end)
            for prev, act in itertools.pairwise(seq):
                dep = dependency(act[0], act[1], act[2], num_stages)
                prev_end = prev[4]
                if dep is not None and owner.get(dep[1], r) != r and dep in end and end[dep] > prev_end:
                    handoff.append(act[3] - end[dep])
                else:
                    dispatch.append(act[3] - prev_end)

    def med(vals: list[float]) -> float:
        return statistics.median(vals) if vals else 0.0

    return {"handoff_s": med(handoff), "dispatch_s": med(dispatch), "setup_s": med(setup), "tail_s": med(tail)}


def _contention(per_rank: dict, key: str) -> float | None:
    """Median over (op, stage) of the ratio: duration of that op while the other rank computes (>80% overlap) /
    duration while the other rank is idle (<20% overlap). 1 means op times are properties of the op, as the
    simulation assumes; on a CPU shared with other jobs it was 1.2-1.7 (processes the scheduler moves onto the core
    of an idle rank slow the busy one down less), which is what per-stage mean times cannot express. Stage 0's
    empty input-gradient backward (< 5 ms) is left out."""
    alone: dict[tuple[str, int], list[float]] = {}
    both: dict[tuple[str, int], list[float]] = {}
    for j in range(_steps(per_rank, key)):
        step = _merged_step(per_rank, key, j)
        for r in (0, 1):
            for kind, stage, _, t0, t1, busy in step[r]:
                if t1 <= t0 or busy < 0.005:
                    continue
                overlap = sum(max(0.0, min(t1, e) - max(t0, b)) for _, _, _, b, e, _ in step[1 - r]) / (t1 - t0)
                if overlap < 0.2 or overlap > 0.8:
                    (alone if overlap < 0.2 else both).setdefault((kind, stage), []).append(busy)
    ratios = [statistics.median(both[k]) / statistics.median(alone[k]) for k in alone if k in both]
    return round(statistics.median(ratios), 3) if ratios else None


def _simulated(per_rank: dict, key: str, name: str, m: int, v: int) -> dict[str, Any]:
    """The planner's simulation (``planner.simulate``, which ``planner.pipeline.bubble_fraction`` runs) of ``name``
    fed with this configuration's measurements, next to the measured bubble:

    * ``bubble_simulated``: the planner's ``bubble_fraction`` with the measured op times of the run: per stage
      and op the mean duration *and its coefficient of variation* (micro-batch-to-micro-batch jitter within a
      step, :func:`_measured_op_times`), the measured P2P time (ping-pong), the measured per-action dispatch gap
      and the step's set-up + tail (:func:`_observed_gaps`); the planner samples the jittered durations
      (``planner.simulate.sample_bubbles``) and takes the median of idle / busy over ranks x sampled steps: the
      same aggregation as ``bubble_measured``;
    * ``bubble_simulated_step_means``: each timed step simulated with that step's mean op times per stage (no
      jitter), same P2P and overheads, median over ranks x steps (what ``bubble_simulated`` was before the
      planner took the jitter: 8 of 10 within tolerance on a quiet machine, 4-7 of 10 on a loaded one);
    * ``bubble_simulated_actions``: the same, each action with its own measured duration instead of the step's
      per-stage mean (the recorded order, which is the schedule's);
    * ``bubble_simulated_run_means``: one simulation with the op times averaged over all timed steps (the
      planner's use: one set of op times), same P2P and overheads;
    * ``bubble_simulated_ops_p2p``: run means and P2P only (an ideal runtime); ``bubble_simulated_no_p2p``: run
      means only.
    """
    from lightning_v17.planner.pipeline import bubble_fraction
    from lightning_v17.planner.simulate import schedule_actions, simulate, simulate_schedule

    num_stages = 2 * v
    times = _measured_op_times(per_rank, key, num_stages=num_stages)
    p2p = statistics.median(per_rank[0][key]["p2p_s"] + per_rank[1][key]["p2p_s"])
    gaps = _observed_gaps(per_rank, key, num_stages=num_stages)
    overhead = gaps["setup_s"] + gaps["tail_s"]
    per_step: list[float] = []
    per_action: list[float] = []
    for j in range(_steps(per_rank, key)):
        step_times = _measured_op_times(per_rank, key, num_stages=num_stages, steps=[j])
        timeline = simulate_schedule(
            name, pp=2, microbatches=m, virtual_stages=v, op_times=step_times, p2p_s=p2p,
            dispatch_s=gaps["dispatch_s"], step_overhead_s=overhead,
        )  # fmt: skip
        per_step += list(timeline.bubble_over_busy_per_rank.values())
        # the same simulation, each action with its own measured duration (the order is the schedule's, which the
        # trace shows the runtime ran): what the micro-batch-to-micro-batch variation within a step adds
        recorded = {r: [(a[0], a[1], a[2], a[5]) for a in seq] for r, seq in _merged_step(per_rank, key, j).items()}
        timeline = simulate(
            recorded, num_stages=num_stages, p2p_s=p2p, dispatch_s=gaps["dispatch_s"], step_overhead_s=overhead
        )
        per_action += list(timeline.bubble_over_busy_per_rank.values())

    def sim(p2p_s: float = 0.0, dispatch_s: float = 0.0, step_overhead_s: float = 0.0, op_times=times) -> float:
        return bubble_fraction(
            name, pp=2, microbatches=m, virtual_stages=v, op_times=op_times, p2p_s=p2p_s, dispatch_s=dispatch_s,
            step_overhead_s=step_overhead_s,
        )  # fmt: skip

    jittered = _measured_op_times(per_rank, key, num_stages=num_stages, with_cv=True)

    # the simulated order is the engine's: every timed step ran exactly the planner's action list
    planned = schedule_actions(name, pp=2, microbatches=m, virtual_stages=v)
    same_order = all(
        [tuple(a) for a in planned[r]] == [(k, st, c) for k, st, c, *_ in tl[2] if k != "loss"]
        for r in (0, 1)
        for tl in per_rank[r][key]["timelines"]
    )
    return {
        "order_matches_planner": same_order,
        "concurrent_over_alone": _contention(per_rank, key),
        "bubble_simulated": sim(p2p, gaps["dispatch_s"], overhead, op_times=jittered),
        "bubble_simulated_step_means": statistics.median(per_step),
        "bubble_simulated_actions": statistics.median(per_action),
        "bubble_simulated_run_means": sim(p2p, gaps["dispatch_s"], overhead),
        "bubble_simulated_ops_p2p": sim(p2p),
        "bubble_simulated_no_p2p": sim(),
        "op_times_ms": [
            {
                "stage": s,
                "F": round(t.forward * 1e3, 3),
                "B": round(t.backward_input * 1e3, 3),
                "W": round(t.backward_weight * 1e3, 3),
                "cv_F": round(t.forward_cv, 3),
                "cv_B": round(t.backward_input_cv, 3),
                "cv_W": round(t.backward_weight_cv, 3),
            }
            for s, t in enumerate(jittered)
        ],
        "p2p_ms": round(p2p * 1e3, 4),
        **{k.replace("_s", "_ms"): round(val * 1e3, 4) for k, val in gaps.items()},
    }


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit(
            "bench/pipeline.py --plot needs matplotlib: pip install matplotlib (or the project's extra: "
            "pip install 'lightning-v17[plot]')"
        ) from None


def _plot_gantt(per_rank: dict, results: dict, path: str) -> None:
    """The Gantt timeline of one measured step per configuration (the step with the median schedule time), from
    the engine's trace (``BubbleTimer.trace``): one row per rank, F / B / W / loss bars, x in ms since the step's
    barrier."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    keys = [k for k in results if "bubble_measured" in results[k]]
    colors = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868", "loss": "#C44E52"}
    fig, axes = plt.subplots(len(keys), 1, figsize=(13, 1.25 * len(keys) + 0.8), squeeze=False)
    for ax, key in zip(axes[:, 0], keys):
        sched = per_rank[0][key]["sched_s"][-_steps(per_rank, key) :]
        j = sorted(range(len(sched)), key=sched.__getitem__)[len(sched) // 2]
        t_start = min(per_rank[r][key]["timelines"][j][0] for r in (0, 1))
        for r in (0, 1):
            for kind, stage, chunk, t0, t1 in per_rank[r][key]["timelines"][j][2]:
                x, w = (t0 - t_start) * 1e3, (t1 - t0) * 1e3
                ax.broken_barh([(x, w)], (r - 0.4, 0.8), facecolors=colors[kind], edgecolor="white", linewidth=0.3)
                if kind != "loss" and w > 2.0:
                    label = f"{kind}{chunk}" if results[key]["virtual_stages"] == 1 else f"{kind}{stage}.{chunk}"
                    ax.text(x + w / 2, r, label, ha="center", va="center", fontsize=5, color="white")
        res = results[key]
        ax.set_yticks([0, 1], ["rank 0", "rank 1"])
        ax.set_ylim(1.6, -0.6)
        ax.set_title(
            f"{key}: bubble measured {res['bubble_measured']:.3f}, simulated "
            f"{res.get('bubble_simulated', float('nan')):.3f} (idle / busy)",
            fontsize=8,
            loc="left",
        )
        ax.tick_params(labelsize=7)
    axes[-1, 0].set_xlabel("ms since the step's barrier", fontsize=8)
    fig.legend(handles=[Patch(color=c, label=k) for k, c in colors.items()], loc="upper right", ncol=4, fontsize=7)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=150)
    plt.close(fig)


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
    parser.add_argument(
        "--skip-raw", action="store_true",
        help="skip the paired run against raw torch.distributed.pipelining 1F1B (and its ratio check)",
    )  # fmt: skip
    parser.add_argument("--json-out", default=None, help="also write the JSON here")
    parser.add_argument(
        "--trace-out", default=None, metavar="FILE.json",
        help="also write every timed step's per-rank timeline and measured P2P times (to re-analyse or re-plot)",
    )  # fmt: skip
    parser.add_argument(
        "--from-trace", default=None, metavar="FILE.json",
        help="measure nothing: analyse (and --plot) a file written by --trace-out",
    )  # fmt: skip
    parser.add_argument(
        "--plot", default=None, metavar="OUT.png",
        help="also draw the Gantt timeline of one measured step per schedule and m (needs matplotlib)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.plot:
        _require_matplotlib()  # before minutes of measurement, not after
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from lightning_v17.planner.pipeline import bubble_fraction

    pair = [] if args.skip_raw else ["pair_1f1b"]
    keys = [f"{name}/m{m}" for m in (4, 8) for name in [*(s for s, _ in SCHEDULES), *pair]]
    per_rank: dict[int, dict[str, dict[str, list]]] = {0: {}, 1: {}}
    t0 = time.time()

    def add(key: str, r: int, res: dict) -> None:
        acc = per_rank[r].setdefault(
            key, {"sched_s": [], "iter_s": [], "busy": [], "actions": [], "timelines": [], "p2p_s": []}
        )
        for k, vals in res.items():
            acc[k] += vals

    if args.from_trace:
        with open(args.from_trace) as f:
            per_rank = {int(r): d for r, d in json.load(f).items()}
        for d in per_rank.values():
            for acc in d.values():
                acc["actions"] = [[(k, s, c, e - b) for k, s, c, b, e in tl[2]] for tl in acc["timelines"]]
        keys = [k for k in keys if k in per_rank[0]]
        args.skip_raw = True
    for rnd in range(0 if args.from_trace else args.rounds):
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
    out_keys += [] if args.skip_raw else [f"paired_v17_1f1b/m{m}" for m in (4, 8)]
    for key in out_keys:
        name, m = key.split("/m")
        m = int(m)
        # barrier-bracketed: equal on both ranks (not in traces from --trace-out before it kept them)
        iter_s = statistics.median(per_rank[0][key]["iter_s"]) if per_rank[0][key].get("iter_s") else None
        entry: dict[str, Any] = {
            "m": m,
            "iter_s": iter_s,
            "schedule_s": statistics.median(per_rank[0][key]["sched_s"]),
            "tokens_per_s": m * ROWS_PER_MICROBATCH * SEQ / iter_s if iter_s else None,
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
                **_simulated(per_rank, key, name, m, v),
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
        if args.skip_raw:
            continue
        # paired: both in the same process pair, iterations interleaved (see _worker)
        ratio = results[f"paired_v17_1f1b/m{m}"]["tokens_per_s"] / results[f"raw_1f1b/m{m}"]["tokens_per_s"]
        checks[f"m{m}: v17 1f1b / raw torch.distributed.pipelining 1f1b tokens/s >= 0.95"] = {
            "ratio": round(ratio, 3),
            "ok": ratio >= 0.95,
            "separate_runs_ratio": round(
                results[f"1f1b/m{m}"]["tokens_per_s"] / results[f"raw_1f1b/m{m}"]["tokens_per_s"], 3
            ),
        }
    table = []
    for m in (4, 8):
        for name, _ in SCHEDULES:
            res = results[f"{name}/m{m}"]
            meas, sim = res["bubble_measured"], res["bubble_simulated"]
            tol = max(0.15 * abs(meas), 0.01)
            row = {"schedule": name, "m": m, "measured": round(meas, 4), "simulated": round(sim, 4),
                   "simulated_step_means": round(res["bubble_simulated_step_means"], 4),
                   "simulated_actions": round(res["bubble_simulated_actions"], 4),
                   "simulated_run_means": round(res["bubble_simulated_run_means"], 4),
                   "simulated_ops_p2p": round(res["bubble_simulated_ops_p2p"], 4),
                   "simulated_no_p2p": round(res["bubble_simulated_no_p2p"], 4),
                   "replayed": round(res.get("bubble_replayed", float("nan")), 4),
                   "planner_equal_times": round(res["bubble_planner"], 4), "abs_err": round(abs(sim - meas), 4),
                   "tolerance": round(tol, 4), "ok": abs(sim - meas) <= tol,
                   "ok_step_means": abs(res["bubble_simulated_step_means"] - meas) <= tol,
                   "ok_per_action": abs(res["bubble_simulated_actions"] - meas) <= tol}  # fmt: skip
            table.append(row)
            checks[f"{name}/m{m}: simulated bubble within max(15%, 0.01) of measured"] = row
    head = ("schedule          m  measured  simulated  step means  per-action  run means  ops+p2p  ops only  "
            "replayed  T equal")  # fmt: skip
    print(head + "  ok    ok/means ok/act", file=sys.stderr)
    for row in table:
        print(
            f"{row['schedule']:<17} {row['m']}  {row['measured']:8.4f}  {row['simulated']:9.4f}  "
            f"{row['simulated_step_means']:10.4f}  "
            f"{row['simulated_actions']:10.4f}  {row['simulated_run_means']:9.4f}  {row['simulated_ops_p2p']:7.4f}  "
            f"{row['simulated_no_p2p']:8.4f}  {row['replayed']:8.4f}  "
            f"{row['planner_equal_times']:7.4f}  {row['ok']!s:5} {row['ok_step_means']!s:8} {row['ok_per_action']}",
            file=sys.stderr,
        )
    if args.plot:
        _plot_gantt(per_rank, results, args.plot)
    if args.trace_out:
        with open(args.trace_out, "w") as f:
            keep = ("sched_s", "iter_s", "busy", "timelines", "p2p_s")
            json.dump({r: {k: {x: d[x] for x in keep} for k, d in per_rank[r].items()} for r in (0, 1)}, f)
    report = {
        "bench": "pipeline",
        "pp": 2,
        "model": {**MODEL, "seq": SEQ, "rows_per_microbatch": ROWS_PER_MICROBATCH, "dtype": "fp32"},
        "steps": args.steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "pinned": args.pin,
        "results": results,
        "bubble_table": table,
        "checks": checks,
        "wall_s": round(time.time() - t0, 1),
    }
    C.emit_json(report, args.json_out)
    return report


if __name__ == "__main__":
    main()
