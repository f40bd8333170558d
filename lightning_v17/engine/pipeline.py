"""Pipeline parallelism over ``torch.distributed.pipelining``: stage split, schedules, one training/eval step, bubble.

Three steps, in the strategy's setup order (torchtitan's: PP split -> TP -> activation checkpointing -> ZeRO):

1. :func:`split_model` cuts a Llama-shaped model (``tok_embeddings`` -> ``layers`` ModuleDict -> ``norm`` -> ``output``)
   into ``pp * virtual_stages`` contiguous stages, balanced by parameter count or at user split points, and keeps only
   this rank's stages: the model is pruned *in place* (foreign blocks deleted, ``tok_embeddings``/``norm``/``output``
   set to None) and each local stage is a shallow view of it that shares the remaining submodules. Parameter FQNs are
   therefore unchanged (``layers.3.attention.wq.weight``): the LightningModule's ``parameters()``/``state_dict()`` see
   exactly the local stage parameters, the optimizer is built over them as usual, and a DCP checkpoint reshards by FQN.
2. (the caller applies TP / recompute / ZeRO-1 to the pruned model; the stage views see the same modules.)
3. :func:`build_schedule` wraps the stages in ``PipelineStage`` objects and the chosen schedule.

:func:`pipeline_step` runs forward + backward over all micro-batches and returns the token-mean loss of the whole
local batch, identical on every pp rank (Lightning logs what ``training_step`` returns on every rank).
:func:`pipeline_eval` is the forward-only path. :class:`BubbleTimer` measures each rank's busy vs idle time.

Loss normalization: the last stage's loss for one micro-batch is ``sum(CE * w) / W`` where ``W`` is the total weight
(tokens with label != -100, times ``loss_mask``) of the *whole* batch, and the schedule does not rescale gradients
(``scale_grads=False``). The sum over micro-batches is then exactly the non-pipelined token-mean loss, so parity with
a single-process run holds even when micro-batches hold different numbers of valid tokens.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_v17.config import PipelinePolicy, Schedule, V17ConfigError

__all__ = [
    "BubbleTimer",
    "PipelineRuntime",
    "TokenMeanLoss",
    "balanced_split_points",
    "build_schedule",
    "check_pipeline_composition",
    "pipeline_eval",
    "pipeline_step",
    "replay_actions",
    "split_model",
    "stage_ids_for_rank",
]

#: Schedules that run one stage per rank.
_SINGLE = (Schedule.GPIPE, Schedule.ONE_F_ONE_B)


def check_pipeline_composition(*, pp: int, zero_stage: int) -> None:
    """Refuse PP combined with ZeRO-2/3.

    Seed §17.5: "PP + ZeRO-3: AG가 stage 간 얽힘 → ZeRO-1만" -- with parameters (ZeRO-3) or gradients (ZeRO-2)
    sharded, every micro-batch of every stage issues its own all-gather / reduce-scatter, interleaved with the
    pipeline's P2P traffic; the collectives of different stages entangle and the communication volume grows with the
    number of micro-batches. Only ZeRO-1 (optimizer state, one reduction per step) composes cleanly.

    Raises:
        V17ConfigError: when ``pp > 1`` and ``zero_stage >= 2``.
    """
    if pp > 1 and zero_stage >= 2:
        raise V17ConfigError(
            f"pp={pp} with zero_stage={zero_stage} is not supported: with pipeline parallelism the per-micro-batch "
            f"all-gathers/reduce-scatters of ZeRO-2/3 entangle across stages (seed §17.5: 'PP + ZeRO-3: AG가 stage 간 "
            f"얽힘 → ZeRO-1만'); set zero_stage=1 (or 0) with pp>1, or pp=1 to use ZeRO-{zero_stage}"
        )


# ----------------------------------------------------------------------------------------------------------- split


def _blocks(model: nn.Module) -> nn.ModuleDict:
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleDict) or not all(
        hasattr(model, a) for a in ("tok_embeddings", "norm", "output")
    ):
        raise V17ConfigError(
            f"automatic pipeline split needs a model shaped tok_embeddings -> layers (nn.ModuleDict) -> norm -> output "
            f"(torchtitan names); {type(model).__name__} is not. Give pp_split_points or a model with these names"
        )
    return layers


def _numel(module: nn.Module | None) -> int:
    return 0 if module is None else sum(p.numel() for p in module.parameters())


def balanced_split_points(model: nn.Module, num_stages: int) -> list[str]:
    """Split points (``"layers.K"``, the first block of each stage after the first) balancing parameter count.

    Contiguous partition of the blocks into ``num_stages`` non-empty groups minimizing the largest stage, where the
    first stage also carries ``tok_embeddings`` and the last ``norm`` + ``output`` (linear partition by dynamic
    programming, O(S * L^2)).

    Args:
        model: the whole (unsplit) model.
        num_stages: pp * virtual_stages.
    """
    keys = list(_blocks(model).keys())
    n = len(keys)
    if num_stages > n:
        raise V17ConfigError(
            f"pp * virtual_stages = {num_stages} stages but the model has only {n} blocks; every stage needs at least "
            f"one block: lower pp or virtual_stages"
        )
    w = [_numel(model.layers[k]) for k in keys]
    head = _numel(model.tok_embeddings)
    tail = _numel(model.norm) + _numel(model.output)
    prefix = [0]
    for x in w:
        prefix.append(prefix[-1] + x)

    def cost(i: int, j: int, s: int) -> int:  # blocks i..j-1 form stage s
        return prefix[j] - prefix[i] + (head if s == 0 else 0) + (tail if s == num_stages - 1 else 0)

    inf = float("inf")
    # best[s][j]: min over partitions of blocks[0:j] into s+1 stages of the max stage cost
    best = [[inf] * (n + 1) for _ in range(num_stages)]
    cut = [[0] * (n + 1) for _ in range(num_stages)]
    for j in range(1, n + 1):
        best[0][j] = cost(0, j, 0)
    for s in range(1, num_stages):
        for j in range(s + 1, n + 1):
            for i in range(s, j):
                c = max(best[s - 1][i], cost(i, j, s))
                if c < best[s][j]:
                    best[s][j], cut[s][j] = c, i
    points, j = [], n
    for s in range(num_stages - 1, 0, -1):
        j = cut[s][j]
        points.append(j)
    return [f"layers.{keys[i]}" for i in reversed(points)]


def _stage_block_keys(
    model: nn.Module, num_stages: int, split_points: list[str] | tuple[str, ...] | None
) -> list[list[str]]:
    keys = list(_blocks(model).keys())
    points = list(split_points) if split_points else balanced_split_points(model, num_stages)
    if len(points) != num_stages - 1:
        raise V17ConfigError(
            f"pp_split_points={tuple(points)} gives {len(points) + 1} stages but pp * virtual_stages = {num_stages}; "
            f"give exactly {num_stages - 1} block names such as 'layers.2'"
        )
    idx = []
    for p in points:
        k = p.removeprefix("layers.")
        if k not in keys:
            raise V17ConfigError(
                f"pp_split_points entry {p!r} is not a block; valid: layers.0 .. layers.{len(keys) - 1}"
            )
        idx.append(keys.index(k))
    bounds = [0, *idx, len(keys)]
    if any(b >= e for b, e in itertools.pairwise(bounds)):
        raise V17ConfigError(
            f"pp_split_points={tuple(points)} must be strictly increasing and leave at least one block per stage"
        )
    return [keys[b:e] for b, e in itertools.pairwise(bounds)]


def stage_ids_for_rank(pp_rank: int, *, pp: int, virtual_stages: int, schedule: Schedule) -> tuple[int, ...]:
    """Global stage indices owned by a pp rank.

    Looped placement (interleaved 1F1B, interleaved zero bubble; Narayanan 2021 §2.2): rank, rank + pp, ...
    V placement (ZB-V, Qi 2023 §6): rank and 2*pp - 1 - rank, so the first and last stage share rank 0.
    """
    if schedule == Schedule.ZBV:
        return (pp_rank, 2 * pp - 1 - pp_rank)
    return tuple(pp_rank + k * pp for k in range(virtual_stages))


def _stage_view(model: nn.Module, block_keys: list[str], *, first: bool, last: bool) -> nn.Module:
    """A shallow copy of ``model`` holding the given blocks; submodules and parameters are shared, not copied."""
    view = copy.copy(model)
    # copy.copy shares the registries (dicts) with the original: give the view its own so that edits stay local.
    view._modules = dict(model._modules)
    view._parameters = dict(model._parameters)
    view._buffers = dict(model._buffers)
    view.layers = nn.ModuleDict({k: model.layers[k] for k in block_keys})
    if not first:
        view.tok_embeddings = None
    if not last:
        view.norm = None
        view.output = None
    return view


def split_model(
    model: nn.Module,
    *,
    pp_rank: int,
    pp: int,
    policy: PipelinePolicy,
) -> tuple[list[nn.Module], tuple[int, ...]]:
    """Prune ``model`` in place to this rank's stages and return one shared-parameter view per local stage.

    Args:
        model: a Llama-shaped model (``tok_embeddings``, ``layers`` ModuleDict, ``norm``, ``output``); deleted parts
            are set to None / removed from ``layers`` so FQNs of what remains do not change.
        pp_rank: this rank's coordinate on the pp axis.
        pp: pp axis size.
        policy: schedule, virtual stages and optional split points.

    Returns:
        ``(stage_modules, stage_ids)``: the views in increasing stage order and their global stage indices.

    Raises:
        V17ConfigError: unsupported shapes (tied embeddings across stages, too few blocks, bad split points).
    """
    schedule = policy.schedule
    v = policy.virtual_stages
    if schedule in _SINGLE and v != 1:
        raise V17ConfigError(
            f"pp_schedule={schedule.value!r} runs one stage per rank; set virtual_stages=1, or use "
            f"'interleaved_1f1b'/'zero_bubble'/'zbv' for virtual_stages={v}"
        )
    if schedule == Schedule.ZB_H2:
        raise V17ConfigError(
            "pp_schedule='zb_h2' is not available in torch.distributed.pipelining; use 'zero_bubble' (ZB-H1 "
            "interleaved) or 'zbv'"
        )
    if getattr(getattr(model, "config", None), "tie_embeddings", False) and pp > 1:
        raise V17ConfigError(
            "pp>1 with tie_embeddings=True would put the shared embedding/head weight on two stages; "
            "set tie_embeddings=False for pipeline parallelism"
        )
    num_stages = pp * v
    groups = _stage_block_keys(model, num_stages, policy.split_points)
    ids = tuple(sorted(stage_ids_for_rank(pp_rank, pp=pp, virtual_stages=v, schedule=schedule)))
    views = [_stage_view(model, groups[s], first=s == 0, last=s == num_stages - 1) for s in ids]
    keep = {k for s in ids for k in groups[s]}
    for k in list(model.layers.keys()):
        if k not in keep:
            del model.layers[k]
    if 0 not in ids:
        model.tok_embeddings = None
    if num_stages - 1 not in ids:
        model.norm = None
        model.output = None
    return views, ids


# -------------------------------------------------------------------------------------------------- loss and timing


class TokenMeanLoss:
    """Last-stage loss: ``sum(CE(logits, labels) * w) / W`` per micro-batch, ``W`` set per step from the whole batch.

    The target is either the labels (LongTensor [b, S], -100 ignored) or ``stack([labels, loss_mask], -1)`` as float
    (labels are exact in fp32 below 2**24), so that the pipeline's micro-batch split carries the mask along.
    Logits may be a vocab-sharded DTensor (loss parallel); :func:`pipeline_step` then runs inside ``loss_parallel``.
    """

    def __init__(self) -> None:
        self.normalizer: torch.Tensor | float = 1.0
        #: fp16 loss scale (GradScaler): the backward runs on loss * scale; pipeline_step divides it out again
        self.scale: torch.Tensor | float = 1.0
        self.busy_s = 0.0  # time spent here, counted as the last stage's compute by BubbleTimer
        #: when a list (``BubbleTimer.trace`` of the same runtime), each call appends ("loss", -1, -1, t0, t1)
        self.trace: list[tuple[str, int, int, float, float]] | None = None

    def __call__(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        if target.dim() == logits.dim():  # [b, S, 2]: labels and weights
            labels, weight = target[..., 0].long(), target[..., 1]
        else:
            labels, weight = target, None
        flat = logits.flatten(0, 1).float()
        if weight is None:
            loss = F.cross_entropy(flat, labels.flatten(), ignore_index=-100, reduction="sum")
        else:
            ce = F.cross_entropy(flat, labels.flatten(), ignore_index=-100, reduction="none")
            loss = (ce * weight.flatten().to(ce.dtype)).sum()
        out = loss / self.normalizer
        if not (isinstance(self.scale, float) and self.scale == 1.0):
            out = out * self.scale
        t1 = time.perf_counter()
        self.busy_s += t1 - t0
        if self.trace is not None:
            self.trace.append(("loss", -1, -1, t0, t1))
        return out


_ACTION_KIND = {"forward_one_chunk": "F", "backward_one_chunk": "B", "backward_weight_one_chunk": "W"}


@dataclass
class BubbleTimer:
    """Busy vs idle time of one pp rank per step: ``bubble = 1 - busy / step`` (Huang 2019 GPipe §2.3 defines the
    bubble as the idle fraction of a device over one step).

    Busy time is the wall time inside the stage compute calls the schedule makes (``forward_one_chunk``,
    ``backward_one_chunk``, ``backward_weight_one_chunk``) plus the last stage's loss; everything else inside
    ``schedule.step`` (waiting on P2P receives, schedule bookkeeping) is idle.

    Setting ``trace`` to a list (``enable_trace``) also records every action as ``(kind, stage_index, chunk_id, t0,
    t1)`` with kind "F", "B" (input or full backward), "W" (weight backward) or "loss" (perf_counter seconds): the
    per-action timeline ``bench/pipeline.py`` replays to separate stage-time variation from communication.
    """

    busy_s: float = 0.0
    history: list[dict[str, float]] = field(default_factory=list)
    trace: list[tuple[str, int, int, float, float]] | None = None

    def wrap_stage(self, stage: Any) -> None:
        for name, kind in _ACTION_KIND.items():
            fn = getattr(stage, name)

            def timed(*args: Any, _orig: Any = fn, _kind: str = kind, **kwargs: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return _orig(*args, **kwargs)
                finally:
                    t1 = time.perf_counter()
                    self.busy_s += t1 - t0
                    if self.trace is not None:
                        chunk = args[0] if args else kwargs.get("fwd_chunk_id", kwargs.get("bwd_chunk_id", -1))
                        self.trace.append((_kind, int(stage.stage_index), int(chunk), t0, t1))

            setattr(stage, name, timed)

    def record(self, step_s: float, busy_s: float) -> dict[str, float]:
        """Store one step. ``bubble_fraction`` = idle / step (the device's idle share of the step);
        ``bubble_over_busy`` = idle / busy, Narayanan 2021 §2.2's definition, which the planner's
        ``planner.pipeline.bubble_fraction`` predicts ((p-1)/m for GPipe/1F1B)."""
        idle = max(0.0, step_s - busy_s)
        rec = {
            "step_s": step_s,
            "busy_s": busy_s,
            "bubble_fraction": idle / step_s if step_s > 0 else 0.0,
            "bubble_over_busy": idle / busy_s if busy_s > 0 else 0.0,
        }
        self.history.append(rec)
        return rec

    @property
    def last(self) -> dict[str, float] | None:
        return self.history[-1] if self.history else None


def replay_actions(actions_by_rank: dict[int, list[tuple[str, int, int, float]]], num_stages: int) -> dict[str, Any]:
    """Replay recorded pipeline actions with zero communication time: the step the same action durations give.

    Each rank runs its own actions in the recorded order; an action starts when its rank is free and its input is
    ready: ``F(s, i)`` after ``F(s-1, i)``; ``B(s, i)`` after ``B(s+1, i)`` (the last stage: after its ``F``);
    ``W(s, i)`` after ``B(s, i)``. A "loss" action belongs to the forward just before it on the same rank.
    Comparing the measured step with this replay separates stage-time variation and imbalance (in both) from
    communication and scheduling overhead (measured only); with equal durations everywhere the replay's idle / busy
    is exactly the planner's (p-1)/m for GPipe and 1F1B.

    Args:
        actions_by_rank: per pp rank, ``(kind, stage_index, chunk_id, duration_s)`` in execution order (kind "F",
            "B", "W" or "loss"), e.g. from :attr:`BubbleTimer.trace` of one step.
        num_stages: total number of pipeline stages.

    Returns:
        ``{"step_s", "busy_s": {rank: s}, "bubble_over_busy": {rank: idle / busy}}``.

    Raises:
        ValueError: if the actions cannot all run (a dependency never executes: not one complete step).
    """
    seqs: dict[int, list[list[Any]]] = {}
    for rank, acts in actions_by_rank.items():
        seq: list[list[Any]] = []
        for kind, stage, chunk, dur in acts:
            if kind == "loss":
                for prev in reversed(seq):
                    if prev[0] == "F":
                        prev[3] += dur
                        break
                else:
                    raise ValueError(f"rank {rank}: a loss action with no forward before it")
                continue
            seq.append([kind, stage, chunk, dur])
        seqs[rank] = seq
    end: dict[tuple[str, int, int], float] = {}
    free = dict.fromkeys(seqs, 0.0)
    pos = dict.fromkeys(seqs, 0)
    remaining = sum(len(v) for v in seqs.values())
    while remaining:
        progressed = False
        for rank, seq in seqs.items():
            while pos[rank] < len(seq):
                kind, stage, chunk, dur = seq[pos[rank]]
                if kind == "F":
                    dep = ("F", stage - 1, chunk) if stage > 0 else None
                elif kind == "B":
                    dep = ("B", stage + 1, chunk) if stage < num_stages - 1 else ("F", stage, chunk)
                else:
                    dep = ("B", stage, chunk)
                if dep is not None and dep not in end:
                    break
                start = max(free[rank], end[dep] if dep is not None else 0.0)
                free[rank] = end[(kind, stage, chunk)] = start + dur
                pos[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: seqs[r][pos[r]][:3] for r in seqs if pos[r] < len(seqs[r])}
            raise ValueError(f"replay_actions: actions wait on dependencies that never run: {stuck}")
    step = max(free.values()) if free else 0.0
    busy = {r: sum(a[3] for a in seq) for r, seq in seqs.items()}
    return {
        "step_s": step,
        "busy_s": busy,
        "bubble_over_busy": {r: (step - b) / b if b > 0 else 0.0 for r, b in busy.items()},
    }


# ------------------------------------------------------------------------------------------------------- schedules


@dataclass
class PipelineRuntime:
    """Everything :func:`pipeline_step` needs: the schedule, the local stages and the pp group."""

    schedule: Any
    stages: list[Any]
    stage_modules: list[nn.Module]
    stage_ids: tuple[int, ...]
    num_stages: int
    policy: PipelinePolicy
    pp_group: dist.ProcessGroup
    loss_fn: TokenMeanLoss
    timer: BubbleTimer
    loss_parallel: bool = False

    @property
    def has_first_stage(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last_stage(self) -> bool:
        return self.num_stages - 1 in self.stage_ids

    def enable_trace(self) -> list[tuple[str, int, int, float, float]]:
        """Start recording every stage action and loss call (see :class:`BubbleTimer`); returns the shared list."""
        self.timer.trace = self.loss_fn.trace = []
        return self.timer.trace

    @property
    def bubble_fraction(self) -> float | None:
        """Measured idle / step of this rank in the last step (None before the first step)."""
        rec = self.timer.last
        return None if rec is None else rec["bubble_fraction"]

    @property
    def bubble_over_busy(self) -> float | None:
        """Measured idle / busy of this rank in the last step: comparable to :attr:`planned_bubble`."""
        rec = self.timer.last
        return None if rec is None else rec["bubble_over_busy"]

    @property
    def planned_bubble(self) -> float:
        """The planner's prediction (idle / ideal compute; Narayanan 2021 §2.2), e.g. (p-1)/m for 1F1B."""
        from lightning_v17.planner.pipeline import bubble_fraction

        pp = self.num_stages // self.policy.virtual_stages
        return bubble_fraction(
            self.policy.schedule,
            pp=pp,
            microbatches=self.policy.microbatches,
            virtual_stages=self.policy.virtual_stages,
        )


def _schedule_class(schedule: Schedule) -> type:
    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
        ScheduleZBVZeroBubble,
    )

    table = {
        Schedule.GPIPE: ScheduleGPipe,
        Schedule.ONE_F_ONE_B: Schedule1F1B,
        Schedule.INTERLEAVED_1F1B: ScheduleInterleaved1F1B,
        Schedule.ZERO_BUBBLE: ScheduleInterleavedZeroBubble,
        Schedule.ZBV: ScheduleZBVZeroBubble,
    }
    if schedule not in table:
        raise V17ConfigError(f"pp_schedule={schedule.value!r} has no torch.distributed.pipelining schedule")
    return table[schedule]


def build_schedule(
    stage_modules: list[nn.Module],
    *,
    stage_ids: tuple[int, ...],
    pp_mesh: DeviceMesh,
    policy: PipelinePolicy,
    device: torch.device | str,
    loss_parallel: bool = False,
) -> PipelineRuntime:
    """Wrap the local stages in ``PipelineStage`` objects and build the schedule from ``policy``.

    Schedules: "gpipe" -> ScheduleGPipe, "1f1b" -> Schedule1F1B, "interleaved_1f1b" -> ScheduleInterleaved1F1B,
    "zero_bubble" -> ScheduleInterleavedZeroBubble, "zbv" -> ScheduleZBVZeroBubble.

    Args:
        stage_modules: the views from :func:`split_model` (after TP/recompute/ZeRO-1 were applied to the model).
        stage_ids: their global stage indices, as returned by :func:`split_model`.
        pp_mesh: the 1-D "pp" mesh axis.
        policy: the pipeline policy (schedule, micro-batches m, virtual stages v).
        device: the device the stages run on.
        loss_parallel: the last stage emits vocab-sharded DTensor logits (TP loss parallel).
    """
    from torch.distributed.pipelining import PipelineStage

    pp = pp_mesh.size()
    num_stages = pp * policy.virtual_stages
    group = pp_mesh.get_group()
    device = torch.device(device)
    stages = [PipelineStage(m, s, num_stages, device, group=group) for m, s in zip(stage_modules, stage_ids)]
    loss_fn = TokenMeanLoss()
    cls = _schedule_class(policy.schedule)
    m = policy.microbatches
    if policy.schedule in _SINGLE:
        schedule = cls(stages[0], n_microbatches=m, loss_fn=loss_fn, scale_grads=False)
    else:
        schedule = cls(stages, n_microbatches=m, loss_fn=loss_fn, scale_grads=False)
    timer = BubbleTimer()
    for st in stages:
        timer.wrap_stage(st)
    return PipelineRuntime(
        schedule=schedule,
        stages=stages,
        stage_modules=list(stage_modules),
        stage_ids=tuple(stage_ids),
        num_stages=num_stages,
        policy=policy,
        pp_group=group,
        loss_fn=loss_fn,
        timer=timer,
        loss_parallel=loss_parallel,
    )


@contextlib.contextmanager
def _forward_only_actions(schedule: Any) -> Iterator[None]:
    """Run a multi-stage schedule's eval with its backward actions removed.

    ``schedule.eval`` only flags the stages as forward-only but still walks the backward actions; for the V placement
    (ZB-V: stages 1 and 2 on the same rank) the local gradient hand-off then fails ("can't steal_bwd_input if this
    stage doesn't have backward"). Filtering every rank's action list the same way keeps the forward P2P pairs matched.
    """
    order = getattr(schedule, "pipeline_order_with_comms", None)
    if not order:
        yield
        return
    from torch.distributed.pipelining.schedules import _ComputationType as C

    keep = {C.FORWARD, C.SEND_F, C.RECV_F, C.UNSHARD, C.RESHARD}
    schedule.pipeline_order_with_comms = {
        r: [a for a in acts if a is not None and a.computation_type in keep] for r, acts in order.items()
    }
    try:
        yield
    finally:
        schedule.pipeline_order_with_comms = order


def _inputs(runtime: PipelineRuntime, batch: dict[str, Any]) -> tuple[tuple, dict, torch.Tensor, torch.Tensor]:
    tokens = batch["input_ids"]
    labels = batch["labels"]
    m = runtime.policy.microbatches
    if tokens.shape[0] % m != 0:
        raise V17ConfigError(
            f"the batch of {tokens.shape[0]} sequences does not split into microbatches={m}; make the per-rank "
            f"batch size a multiple of {m}"
        )
    mask = batch.get("loss_mask")
    weight = (labels != -100).to(torch.float32)
    if mask is not None:
        weight = weight * mask.to(torch.float32)
        target = torch.stack([labels.to(torch.float32), mask.to(torch.float32)], dim=-1)
    else:
        target = labels
    total = weight.sum()
    # position_ids is a kwarg of every stage: the schedule splits kwargs into micro-batches along dim 0 and hands
    # each stage its slice (stage.forward_one_chunk(i, args, kwargs)); the model derives document boundaries from it.
    kwargs: dict[str, Any] = {}
    if batch.get("position_ids") is not None:
        kwargs["position_ids"] = batch["position_ids"]
    args = (tokens,) if runtime.has_first_stage else ()
    return args, kwargs, target, total


def _run(runtime: PipelineRuntime, batch: dict[str, Any], *, train: bool, loss_scale: Any = None) -> torch.Tensor:
    from lightning_v17.engine.tensor_parallel import loss_parallel_context

    args, kwargs, target, total = _inputs(runtime, batch)
    runtime.loss_fn.normalizer = total.clamp_min(1.0)
    runtime.loss_fn.scale = 1.0 if loss_scale is None or not train else loss_scale
    losses: list[torch.Tensor] = []
    timer = runtime.timer
    busy0, loss0 = timer.busy_s, runtime.loss_fn.busy_s
    t0 = time.perf_counter()
    with loss_parallel_context(runtime.loss_parallel):
        if train:
            runtime.schedule.step(*args, target=target, losses=losses, return_outputs=False, **kwargs)
        else:
            with torch.no_grad(), _forward_only_actions(runtime.schedule):
                runtime.schedule.eval(*args, target=target, losses=losses, **kwargs)
    step_s = time.perf_counter() - t0
    timer.record(step_s, timer.busy_s - busy0 + runtime.loss_fn.busy_s - loss0)
    device = runtime.stages[0].device
    if runtime.has_last_stage:
        loss = torch.stack([x.detach().float() for x in losses]).sum()
        if hasattr(loss, "full_tensor"):
            loss = loss.full_tensor()
        loss = loss / runtime.loss_fn.scale
    else:
        loss = torch.zeros((), dtype=torch.float32, device=device)
    loss = loss.to(device)
    if dist.get_world_size(runtime.pp_group) > 1:
        # Only the rank holding the last stage has the loss; summing over the pp axis broadcasts it.
        dist.all_reduce(loss, op=dist.ReduceOp.SUM, group=runtime.pp_group)
    return loss


def pipeline_step(
    runtime: PipelineRuntime, batch: dict[str, Any], *, grad_sync: Any = None, loss_scale: Any = None
) -> torch.Tensor:
    """One training step through the schedule: forward and backward of every micro-batch, gradients accumulated.

    Args:
        runtime: from :func:`build_schedule`.
        batch: packed batch dict with ``input_ids`` [B, S], ``labels`` [B, S] (-100 ignored), optional
            ``position_ids`` [B, S] (sent to every stage) and ``loss_mask`` [B, S]. ``cu_seqlens`` spans the whole
            batch and is not used: stages derive document boundaries from ``position_ids``. B must be a multiple of
            the number of micro-batches.
        grad_sync: the data-parallel gradient reducer of the stage parameters (``engine.zero.ZeroEngine`` for
            ZeRO-0/1 over the dp axes), or None. Each micro-batch's backward is a separate autograd call, so its
            per-backward hooks are switched off during the schedule (``require_grad_sync = False``) and one
            reduction of the accumulated gradients runs after the last micro-batch (``finish_grad_sync()``), unless
            the caller had already switched sync off (gradient accumulation over several Lightning batches).
        loss_scale: fp16 dynamic loss scale (``GradScaler.get_scale()``) or None. The schedule back-propagates
            ``loss * loss_scale`` (what ``scaler.scale(loss).backward()`` does without PP); the returned loss is
            unscaled.

    Returns:
        The detached token-mean loss of the local batch (sum over micro-batches of the last stage's normalized
        losses), the same value on every pp rank. The gradients are already in ``.grad``: do not call backward.
    """
    if grad_sync is None:
        return _run(runtime, batch, train=True, loss_scale=loss_scale)
    sync = bool(grad_sync.require_grad_sync)
    grad_sync.require_grad_sync = False
    try:
        loss = _run(runtime, batch, train=True, loss_scale=loss_scale)
    finally:
        grad_sync.require_grad_sync = sync
    if sync:
        grad_sync.finish_grad_sync()
    return loss


def pipeline_eval(runtime: PipelineRuntime, batch: dict[str, Any]) -> torch.Tensor:
    """Forward-only pass over all micro-batches (the schedule's ``eval``); returns the loss like :func:`pipeline_step`."""
    return _run(runtime, batch, train=False)
