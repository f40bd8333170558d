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
   table (``lightning_v17.planner.schedules``).

:func:`pipeline_step` runs forward + backward over all micro-batches and returns the loss of the whole local batch,
identical on every pp rank (Lightning logs what ``training_step`` returns on every rank). :func:`pipeline_eval` is
the forward-only path. :class:`BubbleTimer` measures each rank's busy vs idle time.

Loss normalization (default token-mean cross-entropy): the last stage's loss for one micro-batch is
``sum(CE * w) / W`` where ``W`` is the total weight (tokens with label != -100, times ``loss_mask``) of the *whole*
batch, and the schedule does not rescale gradients (``scale_grads=False``). The sum over micro-batches is then
exactly the non-pipelined token-mean loss, so parity with a single-process run holds even when micro-batches hold
different numbers of valid tokens. A user loss (``loss_fn``, the LightningModule's ``pipeline_loss``) returns each
micro-batch's mean; the step loss is their mean weighted by rows.

A failing stage: a rank whose stage raises inside a step writes its error to the process group's store before
re-raising; every other rank runs a watchdog thread while it is inside a step and, on seeing that key, prints the
error and ends its process, instead of waiting in a gloo send/receive until the process-group timeout
(``ProcessGroupGloo.abort()`` does not unblock a pending operation; see :class:`PeerFailureWatch`).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_v17.config import PipelinePolicy, V17ConfigError
from lightning_v17.planner.schedules import Placement, schedule_info

__all__ = [
    "BubbleTimer",
    "PeerFailureWatch",
    "PipelineLayout",
    "PipelineLoss",
    "PipelineRuntime",
    "StageModule",
    "balanced_split_points",
    "build_schedule",
    "check_pipeline_composition",
    "pipeline_eval",
    "pipeline_step",
    "replay_actions",
    "split_model",
]


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


# ---------------------------------------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class PipelineLayout:
    """How to cut one decoder into pipeline stages, independent of its family.

    Args:
        embed: FQN of the token embedding (first stage only), relative to the module given to :func:`split_model`,
            or None.
        blocks: FQN of the ``nn.ModuleList`` / ``nn.ModuleDict`` of repeated blocks, split into contiguous runs.
        norm: FQN of the final norm (last stage only), or None if the model has none.
        head: FQN of the output projection (last stage only), or None.
        stage_forward: ``stage_forward(stage, x, **kwargs) -> Tensor`` runs one stage: ``stage`` is the
            :class:`StageModule` (``stage.embed`` / ``stage.norm`` / ``stage.head`` are None unless it owns them,
            ``stage.blocks`` holds its blocks in order, keyed by their original index), ``x`` is the token ids [b, S]
            on the first stage and hidden states [b, S, h] after, and ``kwargs`` are this micro-batch's slices of the
            ``stage_kwargs`` present in the batch. Returns hidden states [b, S, h], or logits [b, S, V] on the last
            stage.
        shift_labels: the model predicts ``labels[:, t + 1]`` at position t (Hugging Face's convention: labels are a
            copy of the input ids, and ``ForCausalLMLoss`` shifts them); False when the labels are already shifted
            (the packed-batch contract of ``lightning_v17.data``, litgpt).
        stage_kwargs: batch keys handed to every stage as keyword arguments, split into micro-batches along dim 0.
    """

    embed: str | None
    blocks: str
    norm: str | None
    head: str | None
    stage_forward: Callable[..., torch.Tensor]
    shift_labels: bool = False
    stage_kwargs: tuple[str, ...] = ("position_ids",)

    def with_prefix(self, prefix: str) -> PipelineLayout:
        """The same layout with every FQN below ``prefix`` (a submodule's layout seen from a parent module)."""
        if not prefix:
            return self

        def at(name: str | None) -> str | None:
            return None if name is None else f"{prefix}.{name}"

        return PipelineLayout(
            embed=at(self.embed),
            blocks=at(self.blocks),
            norm=at(self.norm),
            head=at(self.head),
            stage_forward=self.stage_forward,
            shift_labels=self.shift_labels,
            stage_kwargs=self.stage_kwargs,
        )


class StageModule(nn.Module):
    """One pipeline stage: the parts of the model it owns, run by the layout's ``stage_forward``.

    The parts are the model's own modules (shared, not copied), so TP / recompute / ZeRO applied to the pruned model
    apply here too. ``blocks`` is keyed by the blocks' original indices.
    """

    def __init__(
        self,
        *,
        layout: PipelineLayout,
        stage_index: int,
        num_stages: int,
        embed: nn.Module | None,
        blocks: dict[str, nn.Module],
        norm: nn.Module | None,
        head: nn.Module | None,
    ) -> None:
        super().__init__()
        self.layout = layout
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.embed = embed
        self.blocks = nn.ModuleDict(blocks)
        self.norm = norm
        self.head = head

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def forward(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return self.layout.stage_forward(self, x, **kwargs)


# ----------------------------------------------------------------------------------------------------------- split


def _part(model: nn.Module, fqn: str | None, what: str) -> nn.Module | None:
    if fqn is None:
        return None
    try:
        return model.get_submodule(fqn)
    except AttributeError:
        raise V17ConfigError(
            f"the pipeline layout names {what} {fqn!r}, which {type(model).__name__} does not have (or a previous "
            "split removed it); pass the whole, unsplit model with a layout whose FQNs are relative to it"
        ) from None


def _block_container(model: nn.Module, layout: PipelineLayout) -> nn.ModuleList | nn.ModuleDict:
    blocks = _part(model, layout.blocks, "the blocks")
    if not isinstance(blocks, (nn.ModuleList, nn.ModuleDict)) or len(blocks) == 0:
        raise V17ConfigError(
            f"the pipeline layout's blocks {layout.blocks!r} must be a non-empty nn.ModuleList or nn.ModuleDict of the "
            f"repeated blocks; {type(model).__name__}.{layout.blocks} is a {type(blocks).__name__}"
        )
    return blocks


def _block_keys(blocks: nn.ModuleList | nn.ModuleDict) -> list[str]:
    return [str(i) for i in range(len(blocks))] if isinstance(blocks, nn.ModuleList) else list(blocks.keys())


def _numel(module: nn.Module | None) -> int:
    return 0 if module is None else sum(p.numel() for p in module.parameters())


def balanced_split_points(model: nn.Module, num_stages: int, *, layout: PipelineLayout) -> list[str]:
    """Split points (FQNs of the first block of each stage after the first) balancing parameter count.

    Contiguous partition of the blocks into ``num_stages`` non-empty groups minimizing the largest stage, where the
    first stage also carries the embedding and the last the norm and head (linear partition by dynamic programming,
    O(S * L^2)).

    Args:
        model: the whole (unsplit) model.
        num_stages: pp * virtual_stages.
        layout: where the parts are.

    Returns:
        ``num_stages - 1`` block FQNs such as ``"model.layers.2"``.

    Raises:
        V17ConfigError: fewer blocks than stages.
    """
    blocks = _block_container(model, layout)
    keys = _block_keys(blocks)
    n = len(keys)
    if num_stages > n:
        raise V17ConfigError(
            f"pp * virtual_stages = {num_stages} pipeline stages but the model has only {n} blocks; every stage "
            "needs at least one block: lower pp or virtual_stages"
        )
    w = [_numel(blocks[int(k)] if isinstance(blocks, nn.ModuleList) else blocks[k]) for k in keys]
    head = _numel(_part(model, layout.embed, "the embedding"))
    tail = _numel(_part(model, layout.norm, "the norm")) + _numel(_part(model, layout.head, "the head"))
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
    return [f"{layout.blocks}.{keys[i]}" for i in reversed(points)]


def _stage_block_keys(
    model: nn.Module, num_stages: int, layout: PipelineLayout, split_points: Sequence[str] | None
) -> list[list[str]]:
    keys = _block_keys(_block_container(model, layout))
    points = list(split_points) if split_points else balanced_split_points(model, num_stages, layout=layout)
    if len(points) != num_stages - 1:
        raise V17ConfigError(
            f"pp_split_points={tuple(points)} gives {len(points) + 1} stages but pp * virtual_stages = {num_stages}; "
            f"give exactly {num_stages - 1} block FQNs such as {layout.blocks + '.' + keys[len(keys) // 2]!r}"
        )
    fqns = [f"{layout.blocks}.{k}" for k in keys]
    idx = []
    for p in points:
        # The FQN relative to the split module, or a unique dotted suffix of one (e.g. "layers.2" for the block
        # "model.layers.2" when the LightningModule holds the model as `self.model`).
        hits = [i for i, f in enumerate(fqns) if f == p] or [i for i, f in enumerate(fqns) if f.endswith("." + p)]
        if len(hits) != 1:
            raise V17ConfigError(
                f"pp_split_points entry {p!r} is not a block of the model; valid: {fqns[0]} .. {fqns[-1]}"
            )
        idx.append(hits[0])
    bounds = [0, *idx, len(keys)]
    if any(b >= e for b, e in itertools.pairwise(bounds)):
        raise V17ConfigError(
            f"pp_split_points={tuple(points)} must be strictly increasing and leave at least one block per stage"
        )
    return [keys[b:e] for b, e in itertools.pairwise(bounds)]


def _check_no_shared_parameters(model: nn.Module, owners: dict[str, list[int]]) -> None:
    """Refuse a parameter that two stages would hold (tied embedding/head weights), and parameters no stage holds.

    Args:
        model: the unsplit model.
        owners: FQN of each part (embedding, each block, norm, head) -> the stages that hold it.
    """
    stages_of: dict[int, set[int]] = {}
    names: dict[int, list[str]] = {}
    for fqn, stages in owners.items():
        for name, p in model.get_submodule(fqn).named_parameters(remove_duplicate=False):
            stages_of.setdefault(id(p), set()).update(stages)
            names.setdefault(id(p), []).append(f"{fqn}.{name}")
    for pid, stages in stages_of.items():
        if len(stages) > 1:
            tied = sorted(set(names[pid]))
            raise V17ConfigError(
                f"pipeline stages {sorted(stages)} would share one parameter ({' is '.join(tied)}: tied weights); "
                "each parameter must live on one stage. Untie them (Hugging Face: tie_word_embeddings=False; "
                "lightning_v17 Llama: tie_embeddings=False) or train with pp=1"
            )
    stray = [n for n, p in model.named_parameters() if id(p) not in stages_of]
    if stray:
        raise V17ConfigError(
            f"parameters outside the pipeline layout's embedding, blocks, norm and head would stay on every stage "
            f"untrained: {stray[:4]}; move them into one of those parts or describe the model with a PipelineLayout "
            "that covers them"
        )


def _set_child(model: nn.Module, fqn: str, value: nn.Module | None) -> None:
    parent, _, name = fqn.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, name, value)


def split_model(
    model: nn.Module,
    *,
    layout: PipelineLayout,
    pp_rank: int,
    pp: int,
    policy: PipelinePolicy,
) -> tuple[list[StageModule], tuple[int, ...]]:
    """Prune ``model`` in place to this rank's stages and return one shared-parameter stage module per local stage.

    Args:
        model: the whole model, or a module holding it (e.g. the LightningModule); ``layout``'s FQNs are relative
            to it. After the call it holds only this rank's parts: a block ``ModuleList`` becomes a ``ModuleDict``
            keyed by the original indices, other stages' blocks are gone, embedding/norm/head of stages this rank
            does not hold are None; FQNs of what remains do not change.
        layout: where the parts are and how a stage runs (``lightning_v17.models.model_pipeline_layout``).
        pp_rank: this rank's coordinate on the pp axis.
        pp: pp axis size.
        policy: schedule, virtual stages and optional split points (block FQNs relative to ``model``, or a unique
            dotted suffix of one).

    Returns:
        ``(stage_modules, stage_ids)``: the local stages in increasing stage order and their global stage indices.

    Raises:
        V17ConfigError: an unrunnable schedule, too few blocks, bad split points, tied weights across stages or
            parameters outside the layout's parts.
    """
    info = schedule_info(policy.schedule)
    info.check_runnable()
    info.check_virtual_stages(policy.virtual_stages)
    num_stages = pp * policy.virtual_stages
    blocks = _block_container(model, layout)
    groups = _stage_block_keys(model, num_stages, layout, policy.split_points)
    owners: dict[str, list[int]] = {f"{layout.blocks}.{k}": [s] for s, keys in enumerate(groups) for k in keys}
    for fqn, stage in ((layout.embed, 0), (layout.norm, num_stages - 1), (layout.head, num_stages - 1)):
        if fqn is not None and _part(model, fqn, "a part") is not None:
            owners[fqn] = [stage]
    _check_no_shared_parameters(model, owners)

    ids = info.stage_ids(pp_rank, pp=pp, virtual_stages=policy.virtual_stages)
    embed = _part(model, layout.embed, "the embedding")
    norm = _part(model, layout.norm, "the norm")
    head = _part(model, layout.head, "the head")

    def block(k: str) -> nn.Module:
        return blocks[int(k)] if isinstance(blocks, nn.ModuleList) else blocks[k]

    stages = [
        StageModule(
            layout=layout,
            stage_index=s,
            num_stages=num_stages,
            embed=embed if s == 0 else None,
            blocks={k: block(k) for k in groups[s]},
            norm=norm if s == num_stages - 1 else None,
            head=head if s == num_stages - 1 else None,
        )
        for s in ids
    ]
    keep = [k for s in ids for k in groups[s]]
    if isinstance(blocks, nn.ModuleList):
        # Deleting from a ModuleList renumbers the rest ("layers.3" would become "layers.1"), breaking FQN-keyed
        # optimizer state and DCP resharding; a ModuleDict keyed by the original indices keeps them (torchtitan).
        order = {k: i for i, k in enumerate(_block_keys(blocks))}
        _set_child(model, layout.blocks, nn.ModuleDict({k: block(k) for k in sorted(keep, key=order.__getitem__)}))
    else:
        for k in list(blocks.keys()):
            if k not in keep:
                del blocks[k]
    if 0 not in ids and layout.embed is not None:
        _set_child(model, layout.embed, None)
    if num_stages - 1 not in ids:
        for fqn in (layout.norm, layout.head):
            if fqn is not None:
                _set_child(model, fqn, None)
    return stages, ids


# ---------------------------------------------------------------------------------------------------------- batches


def _as_dict(batch: Any) -> dict[str, Any]:
    """The batch as a dict: a mapping with ``input_ids`` and ``labels``, or an ``(inputs, labels)`` pair."""
    if isinstance(batch, Mapping):
        if "input_ids" not in batch or "labels" not in batch:
            raise V17ConfigError(
                "a pipeline batch dict needs 'input_ids' [B, S] and 'labels' [B, S] (optional: 'position_ids', "
                f"'loss_mask'); got keys {sorted(batch)}"
            )
        out = dict(batch)
    elif isinstance(batch, (tuple, list)) and len(batch) == 2:
        out = {"input_ids": batch[0], "labels": batch[1]}
    else:
        raise V17ConfigError(
            "a pipeline batch must be a dict with 'input_ids' and 'labels' or an (inputs, labels) pair; got "
            + type(batch).__name__
        )
    ids, labels = out["input_ids"], out["labels"]
    if not (isinstance(ids, torch.Tensor) and isinstance(labels, torch.Tensor)) or ids.dim() != 2:
        raise V17ConfigError("pipeline batches need token ids as a [B, S] tensor and labels of the same shape")
    if labels.shape != ids.shape:
        raise V17ConfigError(f"labels {tuple(labels.shape)} must have the shape of input_ids {tuple(ids.shape)}")
    return out


def _slice_rows(batch: Any, start: int, stop: int, rows: int) -> Any:
    """Rows ``start:stop`` of every tensor with ``rows`` rows in ``batch`` (a dict, tuple or list, kept as such).

    ``cu_seqlens`` (document offsets over the whole flattened batch) means nothing for a slice and is left out.
    """

    def cut(v: Any) -> Any:
        return v[start:stop] if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == rows else v

    if isinstance(batch, Mapping):
        return {k: cut(v) for k, v in batch.items() if k != "cu_seqlens"}
    return type(batch)(cut(v) for v in batch)


def _pad_rows(t: torch.Tensor, rows: int, fill: float | None = None) -> torch.Tensor:
    """``t`` with rows appended up to ``rows``: copies of row 0 (valid ids / positions / masks for any model), or
    ``fill`` when given (-100 labels, 0 loss weights), so that padding rows add exactly nothing to the loss."""
    pad = rows - t.shape[0]
    if pad <= 0:
        return t
    extra = t[:1].expand(pad, *t.shape[1:]) if fill is None else t.new_full((pad, *t.shape[1:]), fill)
    return torch.cat([t, extra])


# ------------------------------------------------------------------------------------------------- loss and timing


class PipelineLoss:
    """The last stage's loss, called by the schedule once per micro-batch as ``loss(logits, rows)``.

    The schedule splits its ``target`` along dim 0 like the inputs; the target is ``arange(B)``, so ``rows`` are the
    micro-batch's row indices into the step's batch, which this object holds (:meth:`prepare`).

    * Default: token-mean cross-entropy, ``sum(CE(logits, labels) * w) / W`` with ``W`` the weight of the whole
      batch (labels != -100, times ``loss_mask``), labels shifted by one first when the layout says so.
    * ``loss_fn(logits, batch)``: called with the micro-batch's logits and its rows of the batch (only real rows,
      never ragged-batch padding; labels as given, unshifted); returns that micro-batch's mean loss, scaled here by
      its share of the real rows so that the step loss is the row-weighted mean.

    Logits may be a vocab-sharded DTensor (loss parallel); :func:`pipeline_step` then runs inside ``loss_parallel``.
    """

    def __init__(self, loss_fn: Callable[[torch.Tensor, Any], torch.Tensor] | None = None) -> None:
        self.loss_fn = loss_fn
        #: fp16 loss scale (GradScaler): the backward runs on loss * scale; pipeline_step divides it out again
        self.scale: torch.Tensor | float = 1.0
        self.busy_s = 0.0  # time spent here, counted as the last stage's compute by BubbleTimer
        #: when a list (``BubbleTimer.trace`` of the same runtime), each call appends ("loss", -1, -1, t0, t1)
        self.trace: list[tuple[str, int, int, float, float]] | None = None
        self._batch: Any = None
        self._labels: torch.Tensor | None = None
        self._weight: torch.Tensor | None = None
        self._normalizer: torch.Tensor | float = 1.0
        self._rows = 0

    def prepare(self, batch: Any, parts: dict[str, Any], *, rows: int, padded_rows: int, shift: bool) -> None:
        """Hold one step's batch: ``batch`` as given (for ``loss_fn``), ``parts`` its dict form (``labels``,
        optional ``loss_mask``) for the token mean; ``rows`` real rows, padded to ``padded_rows``."""
        self._batch, self._rows = batch, rows
        labels = parts["labels"]
        mask = parts.get("loss_mask")
        if shift:
            # Hugging Face ForCausalLMLoss: pad labels with -100 and take labels[..., 1:] (loss/loss_utils.py).
            labels = F.pad(labels[:, 1:], (0, 1), value=-100)
            mask = None if mask is None else F.pad(mask[:, 1:], (0, 1), value=0)
        weight = (labels != -100).to(torch.float32)
        if mask is not None:
            weight = weight * mask.to(torch.float32)
        self._normalizer = weight.sum().clamp_min(1.0)
        self._labels = _pad_rows(labels, padded_rows, -100)
        self._weight = None if mask is None else _pad_rows(weight, padded_rows, 0.0)

    def __call__(self, logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        start, n = int(rows[0]), rows.numel()  # the schedule's chunks of arange(B) are contiguous
        if self.loss_fn is None:
            labels = self._labels[start : start + n]
            flat = logits.flatten(0, 1).float()
            if self._weight is None:
                loss = F.cross_entropy(flat, labels.flatten(), ignore_index=-100, reduction="sum")
            else:
                ce = F.cross_entropy(flat, labels.flatten(), ignore_index=-100, reduction="none")
                loss = (ce * self._weight[start : start + n].flatten().to(ce.dtype)).sum()
            out = loss / self._normalizer
        else:
            real = max(0, min(n, self._rows - start))
            if real == 0:  # only ragged-batch padding: no loss, but a graph for the schedule's backward
                out = logits.sum() * 0.0
            else:
                part = logits if real == n else logits[:real]
                mean = self.loss_fn(part, _slice_rows(self._batch, start, start + real, self._rows))
                out = mean * (real / self._rows)
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


# -------------------------------------------------------------------------------------------------- a failing stage


def _describe(err: BaseException, limit: int = 8000) -> str:
    """The root cause first (torch's ``PipelineStage`` wraps a stage's error in "failed to run forward"), then the
    traceback, cut in the middle when longer than ``limit`` characters."""
    root = err
    for _ in range(32):  # a bounded walk down the chain of causes
        if (nxt := root.__cause__ or root.__context__) is None:
            break
        root = nxt
    text = "".join(traceback.format_exception(err))
    if len(text) > limit:
        text = text[: limit // 2] + "\n[...]\n" + text[-limit // 2 :]
    return f"{type(root).__name__}: {root}\n{text}"


class PeerFailureWatch:
    """Ends this process within about ``poll_s`` when another rank fails inside the same pipeline step.

    Why: a stage that raises leaves its peers blocked in a P2P send/receive of the schedule. On gloo that wait only
    ends at the process-group timeout (30 minutes by default), and ``ProcessGroupGloo.abort()`` does not unblock it
    (measured here, torch 2.13: the peer of a rank that raised and stayed alive waited the full timeout with a
    message that names no error). So, as torch's NCCL watchdog does with ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` (it
    tears the process down rather than leave a rank hung in a collective), the failing rank publishes its traceback
    in the default process group's store (first writer wins: ``compare_set``) and re-raises; every rank inside a
    step polls that key from a daemon thread and, when a peer's failure appears, prints that traceback to stderr and
    ends its own process with exit code 1 (a launcher such as torchrun then tears the job down). The thread polls
    only while a step runs (``guard``), so a rank that already left its step, or a failure before any step, ends
    nothing.

    Args:
        key: store key shared by all ranks of one pipeline runtime (:func:`build_schedule` makes it).
        poll_s: seconds between two polls of the store (one small request each). None: 0.25 s, longer on big jobs
            so that all ranks together send at most about 2000 requests per second to the store's host.
    """

    def __init__(self, key: str, *, poll_s: float | None = None) -> None:
        self.key = key
        world = dist.get_world_size() if dist.is_initialized() else 1
        self.poll_s = max(0.25, world / 2000) if poll_s is None else poll_s
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self._store: Any = None
        if world > 1:
            with contextlib.suppress(Exception):  # no default store (exotic init): no watchdog, as before
                self._store = dist.distributed_c10d._get_default_store()
        self._armed = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def active(self) -> bool:
        """Whether a store is available to watch (a multi-rank process group)."""
        return self._store is not None

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Watch peers while the body runs; publish this rank's own exception before re-raising it."""
        if self._store is None:
            yield
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="v17-pipeline-watchdog", daemon=True)
            self._thread.start()
        self._armed.set()
        try:
            yield
        except Exception as err:
            self._armed.clear()  # before publishing: this rank's own key must never end this rank
            self._publish(_describe(err))
            raise
        finally:
            self._armed.clear()

    def _publish(self, text: str) -> None:
        with contextlib.suppress(Exception):  # the original error matters more than the report
            self._store.compare_set(self.key, "", f"rank {self.rank}: {text}")

    def _loop(self) -> None:
        while True:
            self._armed.wait()
            try:
                failed = self._store.check([self.key])
                text = self._store.get(self.key).decode(errors="replace") if failed else ""
            except Exception:  # noqa: BLE001 - the store's host rank ended: gloo reports that in the main thread
                return
            if failed and not text.startswith(f"rank {self.rank}:") and self._armed.is_set():
                sys.stderr.write(
                    f"\n[lightning_v17 pipeline] rank {self.rank}: ending this process because a pipeline peer "
                    "failed during the same step; a pending gloo P2P send/receive cannot be cancelled, so this "
                    "rank would otherwise wait for the process-group timeout. The first failure was on "
                    f"{text}\n"
                )
                sys.stderr.flush()
                os._exit(1)
            time.sleep(self.poll_s)


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

    The schedule class is the ``torch_class`` of the schedule's row in ``lightning_v17.planner.schedules``, looked
    up in ``torch.distributed.pipelining``; single-stage placements get the one local stage, the others the list.

    Args:
        stage_modules: the stages from :func:`split_model` (after TP/recompute/ZeRO-1 were applied to the model).
        stage_ids: their global stage indices, as returned by :func:`split_model`.
        pp_mesh: the 1-D "pp" mesh axis.
        policy: the pipeline policy (schedule, micro-batches m, virtual stages v).
        device: the device the stages run on.
        loss_parallel: the last stage emits vocab-sharded DTensor logits (TP loss parallel).
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
            f"pp_schedule={info.schedule.value!r} needs torch.distributed.pipelining.{info.torch_class}, which this "
            f"torch {torch.__version__} does not have; choose another pp_schedule or upgrade torch"
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
    local = stages[0] if info.placement == Placement.SINGLE else stages
    schedule = cls(local, n_microbatches=m, loss_fn=loss, scale_grads=False)
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
        loss_fn=loss,
        timer=timer,
        # One key for the whole job, not per pp group: with dp replicas, a rank of another replica waits on the
        # failing replica in the gradient reduction, inside the same guarded step.
        watch=PeerFailureWatch(f"lightning_v17/pipeline_failure/{next(_RUNTIMES)}"),
        loss_parallel=loss_parallel,
        shift_labels=bool(layout.shift_labels if shift_labels is None and layout is not None else shift_labels),
        stage_kwargs=tuple(layout.stage_kwargs) if layout is not None else ("position_ids",),
    )


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


def _prepare(runtime: PipelineRuntime, batch: Any, *, train: bool, loss_scale: Any = None) -> _StepInputs:
    """Check and pad the batch and hand it to the loss; runs before the failure watch is armed, so a batch error
    (the same on every rank) is raised as itself on every rank instead of ending the peers."""
    parts = _as_dict(batch)
    rows, seq = parts["input_ids"].shape
    padded = _padded_rows(runtime, rows, seq, train=train)
    runtime.last_train = train
    runtime.loss_fn.prepare(batch, parts, rows=rows, padded_rows=padded, shift=runtime.shift_labels)
    runtime.loss_fn.scale = 1.0 if loss_scale is None or not train else loss_scale
    args = (_pad_rows(parts["input_ids"], padded),) if runtime.has_first_stage else ()
    # Per-row model inputs (position_ids: the models derive document boundaries from it) go to every stage as
    # kwargs: the schedule splits them into micro-batches along dim 0 and hands each stage its slice.
    kwargs = {k: _pad_rows(parts[k], padded) for k in runtime.stage_kwargs if parts.get(k) is not None}
    # The target is the row index: the schedule splits it like the inputs, and the loss reads its rows of the batch.
    return _StepInputs(args=args, kwargs=kwargs, target=torch.arange(padded), train=train)


def _run(runtime: PipelineRuntime, inputs: _StepInputs) -> torch.Tensor:
    from lightning_v17.engine.tensor_parallel import loss_parallel_context

    loss_fn = runtime.loss_fn
    losses: list[torch.Tensor] = []
    timer = runtime.timer
    busy0, loss0 = timer.busy_s, loss_fn.busy_s
    t0 = time.perf_counter()
    with loss_parallel_context(runtime.loss_parallel):
        if inputs.train:
            runtime.schedule.step(
                *inputs.args, target=inputs.target, losses=losses, return_outputs=False, **inputs.kwargs
            )
        else:
            with torch.no_grad(), _forward_only_actions(runtime.schedule):
                runtime.schedule.eval(*inputs.args, target=inputs.target, losses=losses, **inputs.kwargs)
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
