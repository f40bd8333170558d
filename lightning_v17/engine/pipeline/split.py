"""Cutting a model into pipeline stages (part of :mod:`lightning_v17.engine.pipeline.runtime`, which re-exports it).

A :class:`PipelineLayout` describes any decoder (embedding -> blocks -> norm -> head, plus a callable that runs one
stage); :func:`split_model` prunes the model in place to this rank's stages, keeping every parameter's FQN, and
returns one :class:`StageModule` per local stage. The engine knows no model family: ``lightning_v17.models.
pp_layouts`` describes them.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_v17.config import PipelinePolicy, V17ConfigError
from lightning_v17.config.schedules import schedule_info

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
            f"PipelinePolicy(split_points={tuple(points)}) gives {len(points) + 1} stages but pp * virtual_stages = "
            f"{num_stages}; give exactly {num_stages - 1} block FQNs such as "
            f"{layout.blocks + '.' + keys[len(keys) // 2]!r}"
        )
    fqns = [f"{layout.blocks}.{k}" for k in keys]
    idx = []
    for p in points:
        # The FQN relative to the split module, or a unique dotted suffix of one (e.g. "layers.2" for the block
        # "model.layers.2" when the LightningModule holds the model as `self.model`).
        hits = [i for i, f in enumerate(fqns) if f == p] or [i for i, f in enumerate(fqns) if f.endswith("." + p)]
        if len(hits) != 1:
            raise V17ConfigError(
                f"PipelinePolicy(split_points=...) entry {p!r} is not a block of the model; valid: {fqns[0]} .. "
                f"{fqns[-1]}"
            )
        idx.append(hits[0])
    bounds = [0, *idx, len(keys)]
    if any(b >= e for b, e in itertools.pairwise(bounds)):
        raise V17ConfigError(
            f"PipelinePolicy(split_points={tuple(points)}) must be strictly increasing and leave at least one block "
            "per stage"
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
