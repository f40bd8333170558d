"""Megatron-style tensor parallelism (and sequence parallelism) through DTensor ``parallelize_module``, for any model.

The engine is model-agnostic: a *plan* says which submodule gets which ``ParallelStyle``; the engine expands and
checks it, then shards. Plans come from the caller, always: the one resolver,
``lightning_v17.models.tp_plans.resolve_tp_plan``, finds them on the strategy's options, on the LightningModule, or on
the model (torchtitan-shaped Llama, Hugging Face ``base_model_tp_plan``, litgpt ``GPT``). This module imports nothing
from ``lightning_v17.models`` and looks for no plan itself; :func:`llama_tp_plan` builds the torchtitan-shaped plan
from the projection roles the model hands it.

A plan is either

* a mapping ``{fqn: style}`` relative to the module. ``*`` matches exactly one FQN component
  (``layers.*.self_attn.q_proj``), as in Hugging Face's ``base_model_tp_plan``. A style is a ``ParallelStyle`` or one
  of the names in :data:`PARALLEL_STYLES` (Hugging Face's names where they mean the same thing). A key that matches no
  module is an error (:func:`expand_plan`), except where a pipeline split removed the part (an attribute set to None, a
  block missing from a ``ModuleDict`` of numbered blocks): that part lives on another stage.
* a callable ``plan(module, tp_mesh) -> None`` that applies itself (a LightningModule's
  ``configure_tensor_parallel(mesh)`` hook, or a model's plan that must validate against the mesh size first).

The default plan for torchtitan-shaped Llama blocks (Shoeybi 2019 §3, Fig. 3; Korthikanti 2022 §4.2.2 for sequence
parallel), :func:`llama_tp_plan`:

* attention: ``wq``/``wk``/``wv`` column-parallel (each rank owns ``heads/tp`` query heads and ``kv_heads/tp`` key/value
  heads; the model derives its local head count from tensor shapes), ``wo`` row-parallel.
* feed-forward: ``w1``/``w3`` column-parallel, ``w2`` row-parallel.
* That is one all-reduce in the forward (at the row-parallel output) and one in the backward (at the shared input of
  the column-parallel projections) per sublayer. The shared input is made a single DTensor *before* the three
  projections, so their three partial input-gradients add up as one ``Partial`` and are all-reduced once.
* ``sequence_parallel=True``: the residual stream between sublayers is sharded along the sequence dim (``Shard(1)``);
  norms (and residual dropout) run on the local slice; the all-reduce becomes an all-gather before the column-parallel
  projections and a reduce-scatter after the row-parallel one (same bytes, 1/tp of the activation memory).
* Options: vocab-parallel embedding (``RowwiseParallel`` on ``tok_embeddings``, input replicated) and loss-parallel
  cross entropy (the head's logits stay sharded on the vocab dim, ``Shard(-1)``; the loss must then be computed and
  back-propagated inside :func:`loss_parallel_context`).
  Every parameter of such a model ends up a DTensor on the tp mesh (sharded, or ``Replicate`` for norms/unsharded
  embeddings), so FSDP2 can be applied on the dp axes afterwards (torchtitan's order: TP first, then ``fully_shard``).
  Models planned from strings keep the parameters the plan does not name as plain tensors (Hugging Face's own TP does
  the same); ZeRO, clipping and checkpointing accept both.

A fused projection whose output rows are several segments (litgpt's ``qkv`` = [all q heads; all k heads; all v
heads]) cannot be sharded as one contiguous block; :class:`SegmentedColwiseParallel` computes each rank's slice of
every segment while the parameter stays a ``Shard(0)`` DTensor in its true layout.
"""

from __future__ import annotations

import contextlib
import difflib
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from lightning_v17.config import V17ConfigError, check_tp_divides
from lightning_v17.engine.tp.styles import (
    PARALLEL_STYLES,
    SegmentedColwiseParallel,
    _PrepareFirstInput,
    _ReplicateParallel,
    parallel_style,
)

__all__ = [
    "PARALLEL_STYLES",
    "SegmentedColwiseParallel",
    "TPPlan",
    "apply_tensor_parallel",
    "check_tensor_parallel",
    "expand_plan",
    "find_llama_modules",
    "llama_tp_plan",
    "loss_parallel_context",
    "parallel_style",
]

#: What :func:`apply_tensor_parallel` accepts as a plan: ``{fqn: style}`` (style: a name from
#: :data:`PARALLEL_STYLES` or a ``ParallelStyle``) or a callable ``plan(module, tp_mesh)`` that applies itself.
TPPlan = Mapping[str, "str | ParallelStyle"] | Callable[[nn.Module, DeviceMesh], None]


# ----------------------------------------------------------------------------------------------- plan expansion
_INDEX = re.compile(r"(?:(?<=\.)|^)\d+(?=\.|$)")


def _generic(fqn: str) -> str:
    """``layers.3.attn`` -> ``layers.*.attn``: the form plan keys are written in, for suggestions."""
    return _INDEX.sub("*", fqn)


def _pruned_by_pipeline(parent: nn.Module, name: str) -> bool:
    """Whether child ``name`` of ``parent`` is absent because a pipeline split moved it to another stage.

    A split sets a registered attribute to None (``tok_embeddings``, ``output``) or keeps a ``ModuleDict`` of blocks
    keyed by their original indices holding only the local ones, so a missing numbered key is on another stage.
    """
    if name in parent._modules:
        return parent._modules[name] is None
    return isinstance(parent, nn.ModuleDict) and name.isdigit() and len(parent) > 0 and all(k.isdigit() for k in parent)


def _match(module: nn.Module, key: str) -> tuple[list[str], bool]:
    """FQNs of the submodules ``key`` names (``*`` = one component) and whether some branch was pipeline-pruned."""
    frontier: list[tuple[str, nn.Module]] = [("", module)]
    pruned = False
    for atom in key.split(".") if key else []:
        nxt: list[tuple[str, nn.Module]] = []
        for prefix, mod in frontier:
            if atom == "*":
                children = list(mod.named_children())
                nxt.extend((f"{prefix}.{n}" if prefix else n, c) for n, c in children)
                pruned = pruned or any(c is None for c in mod._modules.values())
            elif mod._modules.get(atom) is not None:
                nxt.append((f"{prefix}.{atom}" if prefix else atom, mod._modules[atom]))
            elif _pruned_by_pipeline(mod, atom):
                pruned = True
        frontier = nxt
    return [fqn for fqn, _ in frontier], pruned


def expand_plan(module: nn.Module, plan: Mapping[str, str | ParallelStyle]) -> dict[str, ParallelStyle]:
    """Resolve a plan's keys against ``module``: ``{fqn: ParallelStyle}`` with every wildcard expanded.

    Nothing is sharded here, so a bad plan fails before the model is touched.

    Args:
        module: the module the keys are relative to (``""`` names the module itself).
        plan: ``{key: style}``; ``*`` in a key matches exactly one FQN component (``layers.*.mlp.up_proj``);
            a style is a name from :data:`PARALLEL_STYLES` or a ``ParallelStyle``.

    Returns:
        ``{fqn: ParallelStyle}`` in plan order, one fresh style object per module for named styles.

    Raises:
        V17ConfigError: a key matches no module (the message names it and suggests near module names), unless the
            path runs through a part a pipeline split removed (set to None, or a numbered block missing from a
            ``ModuleDict``): then the key is skipped, that part lives on another stage; an unknown style name; two
            keys giving one module different styles.
    """
    if not isinstance(plan, Mapping):
        raise V17ConfigError(f"a tensor-parallel plan must be a dict {{fqn: style}}; got {type(plan).__name__}")
    out: dict[str, ParallelStyle] = {}
    given: dict[str, tuple[str, Any]] = {}
    for key, style in plan.items():
        if not isinstance(key, str):
            raise V17ConfigError(f"tensor-parallel plan keys must be module FQN strings; got {key!r}")
        parallel_style(style, key=key)  # unknown names fail even when the key is pruned on this stage
        fqns, pruned = _match(module, key)
        if not fqns and not pruned:
            names = {_generic(n) for n, _ in module.named_modules() if n} | {n for n, _ in module.named_modules() if n}
            near = difflib.get_close_matches(key, sorted(names), n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(repr(n) for n in near)}?" if near else ""
            raise V17ConfigError(
                f"tensor-parallel plan key {key!r} matches no submodule of {type(module).__name__}{hint} "
                f"(keys are module FQNs relative to the module; '*' matches one component)"
            )
        for fqn in fqns:
            if fqn in given and given[fqn][1] is not style and given[fqn][1] != style:
                raise V17ConfigError(
                    f"tensor-parallel plan keys {given[fqn][0]!r} and {key!r} both match {fqn!r} with different "
                    f"styles ({given[fqn][1]!r} vs {style!r}); give each module one style"
                )
            if fqn not in given:
                given[fqn] = (key, style)
                out[fqn] = parallel_style(style, key=key)
    return out


def _check_shared_parameters(module: nn.Module, fqns: Sequence[str]) -> None:
    """Refuse a plan that would untie a shared (tied) parameter.

    Sharding replaces a module's parameters by new DTensor parameters; a parameter that another module also holds
    (an LM head tied to the embedding) would silently become two different tensors.
    """

    def root(name: str) -> str:
        hits = [f for f in fqns if f in ("", name) or name.startswith(f + ".")]
        return max(hits, key=len) if hits else "<not in plan>"  # the deepest planned module: the style that acts

    # A module registered under several names is one object: its parameters move together, whatever the name.
    acted_on: dict[int, set[str]] = {}
    owners: dict[int, list[tuple[str, int]]] = {}
    for name, mod in module.named_modules(remove_duplicate=False):
        acted_on.setdefault(id(mod), set()).add(root(name))
        for p_name, p in mod.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append((f"{name}.{p_name}" if name else p_name, id(mod)))
    for entries in owners.values():
        mods = {m for _, m in entries}
        if len(mods) < 2:
            continue
        names = [n for n, _ in entries]
        if len({frozenset(acted_on[m]) for m in mods}) > 1:
            raise V17ConfigError(
                f"the tensor-parallel plan would untie the shared parameter {' = '.join(names)}: only part of its "
                f"owners is sharded, or they are sharded separately. Leave all of them out of the plan (replicated), "
                f"or untie the weights (e.g. tie_word_embeddings=False)"
            )


def _apply_mapping(module: nn.Module, tp_mesh: DeviceMesh, plan: Mapping[str, str | ParallelStyle]) -> None:
    styles = expand_plan(module, plan)
    _check_shared_parameters(module, list(styles))
    # Deepest first (stable, so identical on every rank: distribute_tensor is a collective): a parent's style that
    # replicates "all remaining parameters" then sees its children's DTensors and leaves them alone.
    for fqn in sorted(styles, key=lambda f: -(f.count(".") + bool(f))):
        parallelize_module(module.get_submodule(fqn) if fqn else module, tp_mesh, styles[fqn])


def _config_dims(model: nn.Module) -> dict[str, int]:
    """Model dimensions TP must divide, read from ``model.config`` (a ModelConfig) or from the weight shapes."""
    cfg = getattr(model, "config", None)
    if cfg is not None and all(hasattr(cfg, k) for k in ("heads", "kv_heads", "ffn", "vocab_size")):
        return {"heads": cfg.heads, "kv_heads": cfg.kv_heads, "ffn": cfg.ffn, "vocab": cfg.vocab_size}
    block = next(iter(model.layers.values()))
    attn, ff = block.attention, block.feed_forward
    head_dim = getattr(attn, "head_dim", None)
    if head_dim is None:
        raise V17ConfigError(
            f"cannot read heads/kv_heads from {type(model).__name__}: give it a `config` with heads, kv_heads, ffn and "
            f"vocab_size, or a `head_dim` attribute on its attention, or provide tp_plan/configure_tensor_parallel"
        )
    emb = getattr(model, "tok_embeddings", None)
    out = getattr(model, "output", None)
    vocab = emb.num_embeddings if emb is not None else (out.out_features if out is not None else 1)
    return {
        "heads": attn.wq.out_features // head_dim,
        "kv_heads": attn.wk.out_features // head_dim,
        "ffn": ff.w1.out_features,
        "vocab": vocab,
    }


def check_tensor_parallel(
    model: nn.Module, *, tp: int, vocab_parallel: bool = False, loss_parallel: bool = False
) -> None:
    """Raise a :class:`V17ConfigError` listing the valid tp values unless ``tp`` divides the sharded dims.

    Args:
        model: a Llama-shaped module (``tok_embeddings``/``layers``/``norm``/``output``).
        tp: tensor-parallel size.
        vocab_parallel: the embedding is split along the vocab, so tp must divide it too.
        loss_parallel: the head's logits are split along the vocab, so tp must divide it too.

    Raises:
        V17ConfigError: tp does not divide a dimension ("tp=3 must divide num_attention_heads=8; try tp in {1, 2, 4,
            8}"), or the dimensions cannot be read from the model.
    """
    dims = _config_dims(model)
    named = {"num_attention_heads": dims["heads"], "num_key_value_heads": dims["kv_heads"], "ffn_hidden": dims["ffn"]}
    if vocab_parallel or loss_parallel:
        named["vocab_size"] = dims["vocab"]
    check_tp_divides(tp, **named)


def find_llama_modules(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """(prefix, module) for every torchtitan-shaped Llama submodule (including ``module`` itself), outermost only.

    Args:
        module: any module; a match has ``tok_embeddings``, ``norm`` and ``output`` attributes (possibly None on a
            pipeline stage) and a ``layers`` ``nn.ModuleDict``.

    Returns:
        ``[(fqn prefix, submodule), ...]`` in ``named_modules`` order.
    """
    found: list[tuple[str, nn.Module]] = []
    for name, sub in module.named_modules():
        if any(name.startswith(p + ".") or p == "" for p, _ in found):
            continue
        if isinstance(getattr(sub, "layers", None), nn.ModuleDict) and all(
            hasattr(sub, a) for a in ("tok_embeddings", "norm", "output")
        ):
            found.append((name, sub))
    return found


def _projection_roles(model: nn.Module, roles: Mapping[str, str] | None) -> dict[str, str]:
    """FQN -> "colwise"/"rowwise": ``roles`` if given, else the model's ``tensor_parallel_plan()`` (the reference Llama
    has one; ``lightning_v17.models.tp_plans`` supplies Megatron's default roles for torchtitan-shaped models that
    do not)."""
    if roles is None:
        hook = getattr(model, "tensor_parallel_plan", None)
        if not callable(hook):
            raise V17ConfigError(
                f"{type(model).__name__} has torchtitan-style names but no tensor_parallel_plan() method: call "
                f"llama_tp_plan(..., roles={{fqn: 'colwise'|'rowwise'}}), or resolve the plan with "
                f"lightning_v17.models.tp_plans.resolve_tp_plan (it knows Megatron's default roles)"
            )
        roles = hook()
    roles = dict(roles)
    bad = {k: v for k, v in roles.items() if v not in ("colwise", "rowwise")}
    if bad:
        raise V17ConfigError(f"tensor_parallel_plan() roles must be 'colwise' or 'rowwise'; got {bad}")
    return roles


def llama_tp_plan(
    model: nn.Module,
    *,
    roles: Mapping[str, str] | None = None,
    sequence_parallel: bool = False,
    vocab_parallel: bool = False,
    loss_parallel: bool = False,
) -> dict[str, ParallelStyle]:
    """The TP plan for a torchtitan-shaped Llama, keyed by FQN relative to ``model``.

    Modules that a pipeline stage deleted (``tok_embeddings``/``norm``/``output`` set to None, blocks removed from
    ``layers``) are simply absent from the plan, so the same function serves a whole model and any PP stage.

    Args:
        model: the Llama (or a PP stage of it): ``tok_embeddings``, ``layers`` ModuleDict, ``norm``, ``output``.
        roles: ``{fqn: "colwise" | "rowwise"}`` for the projections (and ``tok_embeddings``/``output``); default:
            ``model.tensor_parallel_plan()``.
        sequence_parallel: shard norms and residual dropout along the sequence dim (Korthikanti 2022).
        vocab_parallel: split the embedding table along the vocab (``RowwiseParallel``, input replicated).
        loss_parallel: keep logits sharded on the vocab dim (``Shard(-1)``) for a vocab-parallel cross entropy.

    Returns:
        ``{fqn: ParallelStyle}`` for :func:`apply_tensor_parallel`.

    Raises:
        V17ConfigError: no roles (neither ``roles`` nor a ``tensor_parallel_plan()`` method), or a role other than
            "colwise"/"rowwise".
    """
    seq = Shard(1) if sequence_parallel else Replicate()
    roles = _projection_roles(model, roles)
    plan: dict[str, ParallelStyle] = {}
    if getattr(model, "tok_embeddings", None) is not None:
        if vocab_parallel and roles.get("tok_embeddings") == "rowwise":
            # Each rank looks up its vocab slice (zeros elsewhere): the partial sums are all-reduced, or
            # reduce-scattered along the sequence under SP.
            plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
        else:
            plan["tok_embeddings"] = _ReplicateParallel(output_layout=seq)

    def norm_style() -> ParallelStyle:
        return SequenceParallel(use_local_output=False) if sequence_parallel else _ReplicateParallel()

    for key, block in model.layers.items():
        pre = f"layers.{key}"
        plan[f"{pre}.attention_norm"] = norm_style()
        plan[f"{pre}.ffn_norm"] = norm_style()
        # one DTensor input shared by the column-parallel projections: a single all-reduce (or reduce-scatter)
        # of its gradient in backward instead of one per projection
        plan[f"{pre}.attention"] = _PrepareFirstInput(input_layout=seq, desired_layout=Replicate())
        # a MoE MLP that routes slices of the sequences (v17_split_tokens) keeps its SP slice: each tp rank routes and
        # dispatches its own tokens (Megatron-core's MoE under SP; engine/ep/tokens.py)
        split = sequence_parallel and getattr(type(getattr(block, "feed_forward", None)), "v17_split_tokens", False)
        plan[f"{pre}.feed_forward"] = _PrepareFirstInput(input_layout=seq, desired_layout=seq if split else Replicate())
        for fqn, role in roles.items():
            if not fqn.startswith(f"{pre}."):
                continue
            plan[fqn] = ColwiseParallel() if role == "colwise" else RowwiseParallel(output_layouts=seq)
        if sequence_parallel:
            # Residual dropout acts on the sequence-sharded local slice; as a DTensor op each shard draws its own mask.
            for name, child in block.named_children():
                if isinstance(child, nn.Dropout):
                    plan[f"{pre}.{name}"] = SequenceParallel(use_local_output=True)
    if getattr(model, "norm", None) is not None:
        plan["norm"] = norm_style()
    if getattr(model, "output", None) is not None:
        plan["output"] = ColwiseParallel(
            input_layouts=seq,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    if sequence_parallel:
        for name, child in model.named_children():
            if isinstance(child, nn.Dropout):
                plan[name] = SequenceParallel(use_local_output=True)
    return plan


def apply_tensor_parallel(module: nn.Module, *, tp_mesh: DeviceMesh, plan: TPPlan) -> nn.Module:
    """Apply tensor (and sequence) parallelism in place over ``tp_mesh``; returns ``module``.

    Call it after the PP split and before activation checkpointing and ZeRO/FSDP2 (torchtitan's order). With a
    size-1 mesh it does nothing. The engine shards the plan it is handed and looks for none itself:
    ``lightning_v17.models.tp_plans.resolve_tp_plan`` is the one place that finds a module's plan (the strategy's
    ``TPPolicy(plan=...)``, the module's ``configure_tensor_parallel(mesh)`` or ``tp_plan`` dict, the plan a
    torchtitan-shaped, Hugging Face or litgpt model supplies) and shapes it with sequence, vocab and loss parallel.

    Args:
        module: any ``nn.Module`` (a LightningModule, a model, or a PP stage).
        tp_mesh: the 1-D "tp" mesh axis (``mesh["tp"]``).
        plan: ``{fqn: style}`` (wildcards and style names allowed, see :func:`expand_plan`) or a callable
            ``plan(module, tp_mesh)`` that applies itself, e.g. ``resolve_tp_plan(module, sequence_parallel=True)``.

    Returns:
        ``module``, parallelized in place.

    Raises:
        V17ConfigError: no plan (the message names the resolver), a plan key that matches no submodule, an unknown
            style name, a plan that would untie shared weights (all raised before anything is sharded).
    """
    tp = tp_mesh.size()
    if tp == 1:
        return module
    if plan is None:
        raise V17ConfigError(
            f"tp={tp} needs a tensor-parallel plan for {type(module).__name__}: pass "
            f"plan=lightning_v17.models.tp_plans.resolve_tp_plan(module) (it finds the module's "
            f"configure_tensor_parallel(self, mesh) or `tp_plan` dict, and the plans Hugging Face, litgpt and "
            f"torchtitan-style models supply), or a dict {{fqn: style}}"
        )
    if isinstance(plan, Mapping):
        _apply_mapping(module, tp_mesh, plan)
    elif callable(plan):
        plan(module, tp_mesh)
    else:
        raise V17ConfigError(
            f"plan must be a dict {{fqn: style}} or a callable plan(module, tp_mesh); got {type(plan).__name__}"
        )
    return module


@contextlib.contextmanager
def loss_parallel_context(enabled: bool = True) -> Iterator[None]:
    """``torch.distributed.tensor.parallel.loss_parallel()`` when enabled, else nothing.

    With loss parallel the logits are a DTensor sharded on the vocab dim; ``F.cross_entropy`` and its backward must
    both run inside this context (wrap the training step's forward/loss and ``backward``).

    Args:
        enabled: enter torch's ``loss_parallel()``; False makes this a no-op context.
    """
    if not enabled:
        yield
        return
    from torch.distributed.tensor.parallel import loss_parallel

    with loss_parallel():
        yield
