"""Pipeline parallelism over ``torch.distributed.pipelining``: stage split, schedules, one training/eval step, bubble.

Three steps, in the strategy's setup order (torchtitan's: PP split -> TP -> activation checkpointing -> ZeRO):

1. :func:`split_model` cuts any decoder described by a :class:`PipelineLayout` (the FQNs of its embedding, its
   sequence of blocks, its final norm and head, and a callable that runs one stage) into ``pp * virtual_stages``
   contiguous stages, balanced by parameter count or at user split points, and keeps only this rank's stages. The
   model is pruned *in place*: a block ``nn.ModuleList`` becomes an ``nn.ModuleDict`` keyed by the original indices
   holding only the local blocks (deleting from a ModuleList would renumber them), parts of other stages are set to
   None. Parameter FQNs are therefore unchanged (``model.layers.3.self_attn.q_proj.weight``): the LightningModule's
   ``parameters()``/``state_dict()`` see exactly the local stage parameters, the optimizer is built over them as
   usual, and a DCP checkpoint reshards by FQN. Each local stage is a :class:`StageModule` that shares the remaining
   submodules. The engine knows no model family: ``lightning_v17.models.pp_layouts`` describes them.
2. (the caller applies TP / recompute / ZeRO-1 to the pruned model; the stage modules see the same modules.)
3. :func:`build_schedule` wraps the stages in ``PipelineStage`` objects and the schedule named by the one schedule
   table (``lightning_v17.config.schedules``).

:func:`pipeline_step` runs forward + backward over all micro-batches and returns the loss of the whole local batch,
identical on every pp rank (Lightning logs what ``training_step`` returns on every rank). :func:`pipeline_eval` is
the forward-only path. :class:`BubbleTimer` measures each rank's busy vs idle time.

The last stage's loss and how it is normalized (a token mean over the whole batch, exact across micro-batches) live
in :mod:`lightning_v17.engine.pipeline.loss`.

A failing stage: a rank whose stage raises inside a step writes its error to the process group's store before
re-raising; every other rank runs a watchdog thread while it is inside a step and, on seeing that key, prints the
error and ends its process, instead of waiting in a gloo send/receive until the process-group timeout
(``ProcessGroupGloo.abort()`` does not unblock a pending operation; see :class:`PeerFailureWatch`).
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_v17.config import PipelinePolicy, V17ConfigError
from lightning_v17.config.schedules import schedule_info
from lightning_v17.engine.pipeline.loss import PipelineLoss, _as_dict, _pad_rows
from lightning_v17.engine.pipeline.split import (
    PipelineLayout,
    StageModule,
    balanced_split_points,
    split_model,
)
from lightning_v17.engine.pipeline.timing import BubbleTimer, replay_actions
from lightning_v17.resilience.peer_failure import PeerFailureWatch

__all__ = [
    "BubbleTimer",
    "PeerFailureWatch",
    "PipelineLayout",
    "PipelineLoss",
    "PipelineRuntime",
    "StageModule",
    "balanced_split_points",
    "build_schedule",
    "pipeline_eval",
    "pipeline_step",
    "replay_actions",
    "split_model",
]


# ------------------------------------------------------------------------------------------------------- schedules

#: Runtimes built in this process, in order: every rank builds its runtimes in the same order, so the n-th one
#: has the same failure key on every rank of the job.
_RUNTIMES = itertools.count()


@dataclass
class PipelineRuntime:
    """Everything :func:`pipeline_step` needs: the schedule, the local stages, the pp group and the step state."""

    schedule: Any
    stages: list[Any]
    stage_modules: list[nn.Module]
    stage_ids: tuple[int, ...]
    num_stages: int
    policy: PipelinePolicy
    pp_group: dist.ProcessGroup
    loss_fn: PipelineLoss
    timer: BubbleTimer
    watch: PeerFailureWatch
    loss_parallel: bool = False
    shift_labels: bool = False
    stage_kwargs: tuple[str, ...] = ("position_ids",)
    #: per mode (True: training), the [rows, seq] the stages' P2P buffers were sized for when the schedule last
    #: (re)inferred its shapes; see :func:`_padded_rows`
    shapes: dict[bool, tuple[int, int]] = field(default_factory=dict)
    last_train: bool | None = None
    #: under cp, the step's context cut to each micro-batch's rows (``CPContext.split_rows``): every stage action on
    #: micro-batch i (forward, backward, the activation recompute inside it) runs with ``cp_contexts[i]`` current
    cp_contexts: list[Any] | None = None
    #: ``OffloadPolicy(activations=...)``'s offload of the local blocks (``engine/offload/activations.py``): each
    #: stage forward of micro-batch i runs under its ``micro_batch(i)``, so that its saved tensors form that
    #: micro-batch's pass
    activations: Any = None

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


def build_schedule(
    stage_modules: list[nn.Module],
    *,
    stage_ids: tuple[int, ...],
    pp_mesh: DeviceMesh,
    policy: PipelinePolicy,
    device: torch.device | str,
    loss_parallel: bool = False,
    loss_fn: Callable[[torch.Tensor, Any], torch.Tensor] | None = None,
    shift_labels: bool | None = None,
) -> PipelineRuntime:
    """Wrap the local stages in ``PipelineStage`` objects and build the schedule ``policy`` names.

    The schedule class is the ``torch_class`` of the schedule's row in ``lightning_v17.config.schedules``, looked
    up in ``torch.distributed.pipelining``; single-stage runtimes get the one local stage, multi-stage runtimes
    (``PipelineScheduleMulti``, including ZB-H1's one stage per rank) the list.

    Args:
        stage_modules: the stages from :func:`split_model` (after TP/recompute/ZeRO-1 were applied to the model).
        stage_ids: their global stage indices, as returned by :func:`split_model`.
        pp_mesh: the 1-D "pp" mesh axis.
        policy: the pipeline policy (schedule, micro-batches m, virtual stages v).
        device: the device the stages run on.
        loss_parallel: run the whole step inside torch's ``loss_parallel()``. Not needed for vocab-sharded logits
            (TP loss parallel): the loss enters it itself when it sees them, for the rest of the step.
        loss_fn: ``loss_fn(logits, batch) -> Tensor``, the mean loss of one micro-batch given its logits and its
            rows of the batch (e.g. the LightningModule's ``pipeline_loss``); None: token-mean cross-entropy
            against ``batch["labels"]`` (see :class:`PipelineLoss`).
        shift_labels: shift labels by one for the default loss (Hugging Face convention); None takes the layout's
            ``shift_labels`` from the stage modules.

    Returns:
        The runtime for :func:`pipeline_step` / :func:`pipeline_eval`.

    Raises:
        V17ConfigError: a schedule with no torch implementation, or stages that do not match its placement.
    """
    from torch.distributed import pipelining

    info = schedule_info(policy.schedule)
    info.check_runnable()
    cls = getattr(pipelining, info.torch_class, None)
    if cls is None:
        raise V17ConfigError(
            f"PipelinePolicy(schedule={info.schedule.value!r}) needs torch.distributed.pipelining."
            f"{info.torch_class}, which this torch {torch.__version__} does not have; choose another schedule or "
            "upgrade torch"
        )
    pp = pp_mesh.size()
    num_stages = pp * policy.virtual_stages
    if len(stage_modules) != len(stage_ids) or not stage_modules:
        raise V17ConfigError(f"{len(stage_modules)} stage modules for stage ids {tuple(stage_ids)}")
    layout = getattr(stage_modules[0], "layout", None)
    group = pp_mesh.get_group()
    device = torch.device(device)
    stages = [pipelining.PipelineStage(m, s, num_stages, device, group=group) for m, s in zip(stage_modules, stage_ids)]
    loss = PipelineLoss(loss_fn)
    m = policy.microbatches
    local = stages if info.multi_stage_runtime else stages[0]  # ZB-H1: one stage, in the multi-stage runtime
    schedule = cls(local, n_microbatches=m, loss_fn=loss, scale_grads=False)
    timer = BubbleTimer()
    runtime = PipelineRuntime(
        schedule=schedule,
        stages=stages,
        stage_modules=list(stage_modules),
        stage_ids=tuple(stage_ids),
        num_stages=num_stages,
        policy=policy,
        pp_group=group,
        loss_fn=loss,
        timer=timer,
        # One key for the whole job, not per pp group: with dp replicas, a rank of another replica waits on the
        # failing replica in the gradient reduction, inside the same guarded step.
        watch=PeerFailureWatch(f"lightning_v17/pipeline_failure/{next(_RUNTIMES)}"),
        loss_parallel=loss_parallel,
        shift_labels=bool(layout.shift_labels if shift_labels is None and layout is not None else shift_labels),
        stage_kwargs=tuple(layout.stage_kwargs) if layout is not None else ("position_ids",),
    )
    for st in stages:
        _with_microbatch_context(st, runtime)
        _mark_shape_inference(st)
        timer.wrap_stage(st)
    return runtime


def _mark_shape_inference(stage: Any) -> None:
    """Run ``stage``'s shape inference (torch ``pipelining/stage.py``: an extra forward of micro-batch 0, and a
    backward for the gradients' shapes, on the first step and after each train/eval switch) under
    ``engine.ep.balance.shape_inference()``: MoE layers count no routed load in it and keep no aux loss from it."""
    from lightning_v17.engine.ep.balance import shape_inference

    for name in ("_prepare_forward_infra", "_prepare_backward_infra"):
        fn = getattr(stage, name, None)
        if fn is None:
            continue

        def run(*args: Any, _orig: Any = fn, **kwargs: Any) -> Any:
            with shape_inference():
                return _orig(*args, **kwargs)

        setattr(stage, name, run)


def _with_microbatch_context(stage: Any, runtime: PipelineRuntime) -> None:
    """Run each of ``stage``'s actions on micro-batch i under ``runtime.cp_contexts[i]`` (when set): the attention of
    a micro-batch must see that micro-batch's documents, in its forward and in a recompute during its backward; and
    its forwards under ``runtime.activations.micro_batch(i)`` (when set)."""
    from lightning_v17.engine.cp import use_cp_context

    for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
        fn = getattr(stage, name)

        def run(*args: Any, _orig: Any = fn, _forward: bool = name == "forward_one_chunk", **kwargs: Any) -> Any:
            contexts, offload = runtime.cp_contexts, runtime.activations if _forward else None
            if contexts is None and offload is None:
                return _orig(*args, **kwargs)
            chunk = int(args[0] if args else kwargs.get("fwd_chunk_id", kwargs.get("bwd_chunk_id")))
            with contextlib.ExitStack() as stack:
                if contexts is not None:
                    stack.enter_context(use_cp_context(contexts[chunk]))
                if offload is not None and not offload.closed:
                    stack.enter_context(offload.micro_batch(chunk))
                return _orig(*args, **kwargs)

        setattr(stage, name, run)


def _padded_rows(runtime: PipelineRuntime, rows: int, seq: int, *, train: bool) -> int:
    """The row count to run this batch with: ``rows`` padded to the stages' established size.

    ``PipelineStage`` infers every stage's input/output shapes from the first micro-batch the first time a schedule
    runs (and again after each switch between ``step`` and ``eval``), then sizes its P2P receive buffers once: a
    later batch of another shape fails deep in a receive (torch 2.13 ``stage.py``, ``_prepare_forward_infra``). So
    each mode remembers the largest row count it was sized for, and smaller batches (a ragged last batch, or one
    that is not a multiple of the micro-batches) are padded up to it with rows whose labels are -100 / whose loss
    weight is 0, which add exactly nothing to the loss or the gradients.

    Raises:
        V17ConfigError: a batch larger than, or with another sequence length than, what the stages were sized for.
    """
    m = runtime.policy.microbatches
    need = -(-rows // m) * m
    mode = "training" if train else "evaluation"
    if runtime.last_train is not train:  # the schedule re-infers its shapes on this call: size it generously
        padded = max(need, runtime.shapes.get(train, (0, seq))[0])
        runtime.shapes[train] = (padded, seq)
        return padded
    padded, seq0 = runtime.shapes[train]
    if seq != seq0:
        raise V17ConfigError(
            f"this {mode} batch has sequence length {seq} but the pipeline stages were sized for {seq0} at the first "
            "step (torch.distributed.pipelining fixes its P2P buffer shapes then); pad or pack every batch to one "
            "sequence length (e.g. lightning_v17.data's fixed seq_len)"
        )
    if need > padded:
        raise V17ConfigError(
            f"this {mode} batch has {rows} rows but the pipeline stages were sized for {padded} at the first step "
            "(torch.distributed.pipelining fixes its P2P buffer shapes then); keep the per-rank batch size constant "
            "(smaller batches, such as a ragged last one, are padded) or make the first batch the largest"
        )
    return padded


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


@dataclass
class _StepInputs:
    args: tuple
    kwargs: dict[str, Any]
    target: torch.Tensor
    train: bool
    cp: list[Any] | None = None


def _prepare(runtime: PipelineRuntime, batch: Any, *, train: bool, loss_scale: Any = None) -> _StepInputs:
    """Check and pad the batch and hand it to the loss; runs before the failure watch is armed, so a batch error
    (the same on every rank) is raised as itself on every rank instead of ending the peers."""
    parts = _as_dict(batch)
    rows, seq = parts["input_ids"].shape
    padded = _padded_rows(runtime, rows, seq, train=train)
    runtime.last_train = train
    runtime.loss_fn.prepare(batch, parts, rows=rows, padded_rows=padded, shift=runtime.shift_labels)
    runtime.loss_fn.scale = 1.0 if loss_scale is None or not train else loss_scale
    from lightning_v17.engine.cp import current_cp_context

    ctx = current_cp_context()  # cp: the batch is already sharded on dim 1; each micro-batch gets its rows' documents
    runtime.loss_fn.token_shares = ctx is not None
    cp = None if ctx is None else ctx.split_rows(runtime.policy.microbatches, rows=padded)
    args = (_pad_rows(parts["input_ids"], padded),) if runtime.has_first_stage else ()
    # Per-row model inputs (position_ids: the models derive document boundaries from it) go to every stage as
    # kwargs: the schedule splits them into micro-batches along dim 0 and hands each stage its slice.
    kwargs = {k: _pad_rows(parts[k], padded) for k in runtime.stage_kwargs if parts.get(k) is not None}
    # The target is the row index: the schedule splits it like the inputs, and the loss reads its rows of the batch.
    return _StepInputs(args=args, kwargs=kwargs, target=torch.arange(padded), train=train, cp=cp)


def _run(runtime: PipelineRuntime, inputs: _StepInputs) -> torch.Tensor:
    from lightning_v17.engine.cp import use_cp_context
    from lightning_v17.engine.ep.balance import pipeline_balance_step

    loss_fn = runtime.loss_fn
    losses: list[torch.Tensor] = []
    timer = runtime.timer
    busy0, loss0 = timer.busy_s, loss_fn.busy_s
    t0 = time.perf_counter()
    runtime.cp_contexts = inputs.cp
    # the schedule's first call infers the stages' shapes by running micro-batch 0 outside the stage actions
    first = use_cp_context(inputs.cp[0]) if inputs.cp else contextlib.nullcontext()
    # MoE layers attach their balance losses to their outputs at the micro-batch loss's scale (engine/ep/balance.py)
    moe = (pipeline_balance_step(loss_fn.scale / runtime.policy.microbatches,
                                 padding_rows=inputs.target.numel() - loss_fn._rows)
           if inputs.train else contextlib.nullcontext())  # fmt: skip
    if runtime.loss_parallel:  # else the loss opens it at the first vocab-sharded logits (engine/pipeline/loss.py)
        loss_fn.open_loss_parallel()
    try:
        with first, moe:
            if inputs.train:
                runtime.schedule.step(
                    *inputs.args, target=inputs.target, losses=losses, return_outputs=False, **inputs.kwargs
                )
            else:
                with torch.no_grad(), _forward_only_actions(runtime.schedule):
                    runtime.schedule.eval(*inputs.args, target=inputs.target, losses=losses, **inputs.kwargs)
    finally:
        loss_fn.end_step()  # loss parallel covered every loss of the step and every backward through them
    step_s = time.perf_counter() - t0
    timer.record(step_s, timer.busy_s - busy0 + loss_fn.busy_s - loss0)
    device = runtime.stages[0].device
    if runtime.has_last_stage:
        loss = torch.stack([x.detach().float() for x in losses]).sum()
        if hasattr(loss, "full_tensor"):
            loss = loss.full_tensor()
        loss = loss / loss_fn.scale
    else:
        loss = torch.zeros((), dtype=torch.float32, device=device)
    loss = loss.to(device)
    if dist.get_world_size(runtime.pp_group) > 1:
        # Only the rank holding the last stage has the loss; summing over the pp axis broadcasts it.
        dist.all_reduce(loss, op=dist.ReduceOp.SUM, group=runtime.pp_group)
    return loss


def pipeline_step(
    runtime: PipelineRuntime, batch: Any, *, grad_sync: Any = None, loss_scale: Any = None
) -> torch.Tensor:
    """One training step through the schedule: forward and backward of every micro-batch, gradients accumulated.

    Args:
        runtime: from :func:`build_schedule`.
        batch: a dict with ``input_ids`` [B, S], ``labels`` [B, S] (-100 ignored), optional ``position_ids``
            [B, S] (sent to every stage, with the layout's other ``stage_kwargs``) and ``loss_mask`` [B, S]; or an
            ``(input_ids, labels)`` pair. ``cu_seqlens`` spans the whole batch and is not used: stages derive
            document boundaries from ``position_ids``. B need not be a multiple of the micro-batches: smaller
            batches are padded with rows that add nothing (see :func:`_padded_rows`).
        grad_sync: the data-parallel gradient reducer of the stage parameters (``engine.zero.ZeroEngine`` for
            ZeRO-0/1 over the dp axes), or None. Each micro-batch's backward is a separate autograd call, so its
            per-backward hooks are switched off during the schedule (``require_grad_sync = False``) and one
            reduction of the accumulated gradients runs after the last micro-batch (``finish_grad_sync()``), unless
            the caller had already switched sync off (gradient accumulation over several Lightning batches).
        loss_scale: fp16 dynamic loss scale (``GradScaler.get_scale()``) or None. The schedule back-propagates
            ``loss * loss_scale`` (what ``scaler.scale(loss).backward()`` does without PP); the returned loss is
            unscaled.

    Returns:
        The detached loss of the local batch (token mean, or the row-weighted mean of ``loss_fn``), the same value
        on every pp rank. The gradients are already in ``.grad``: do not call backward.

    Raises:
        V17ConfigError: a malformed batch, or one larger than the stages were sized for.
    """
    inputs = _prepare(runtime, batch, train=True, loss_scale=loss_scale)
    with runtime.watch.guard():
        if grad_sync is None:
            return _run(runtime, inputs)
        sync = bool(grad_sync.require_grad_sync)
        grad_sync.require_grad_sync = False
        try:
            loss = _run(runtime, inputs)
        finally:
            grad_sync.require_grad_sync = sync
        if sync:
            grad_sync.finish_grad_sync()
        return loss


def pipeline_eval(runtime: PipelineRuntime, batch: Any) -> torch.Tensor:
    """Forward-only pass over all micro-batches (the schedule's ``eval``).

    Args:
        runtime: from :func:`build_schedule`.
        batch: as for :func:`pipeline_step`.

    Returns:
        The loss like :func:`pipeline_step`, the same value on every pp rank.

    Raises:
        V17ConfigError: a malformed batch, or one larger than the stages were sized for.
    """
    inputs = _prepare(runtime, batch, train=False)
    with runtime.watch.guard():
        return _run(runtime, inputs)
