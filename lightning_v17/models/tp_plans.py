"""Where a tensor-parallel plan comes from, and the model-family knowledge behind it.

``lightning_v17.engine.tp.apply`` shards whatever plan it is handed and knows no model. This module is the one place
that finds the plan, from the first source that has one (:func:`resolve_tp_plan`); every caller of the engine
(``V17Strategy``, ``parallelize(tp_plan=...)`` users, tests and benchmarks) resolves through it:

1. the strategy's ``TPPolicy(plan=...)`` (``explicit``), a dict ``{fqn: style}``;
2. the LightningModule: a ``configure_tensor_parallel(mesh)`` method (it applies its own plan) or a ``tp_plan`` dict;
3. the model's own plan, for every submodule of a family this module knows:

   * torchtitan-shaped Llama (``tok_embeddings``/``layers``/``norm``/``output``, e.g. the reference
     :class:`~lightning_v17.models.llama.Llama`): its ``tensor_parallel_plan()`` roles, else Megatron's roles
     (:data:`~lightning_v17.models.llama.BLOCK_TP_PLAN`), through ``llama_tp_plan`` (sequence/vocab/loss parallel);
   * Hugging Face ``PreTrainedModel`` (duck-typed; transformers is a test extra, never imported here): its
     ``config.base_model_tp_plan`` under ``base_model_prefix``, the instance plan ``post_init`` assembled (with the
     vocab-parallel input embedding recent releases add) and the class ``_tp_plan`` of the head (``{"lm_head":
     "colwise_gather_output"}``), each style meaning what it means in that release; attention there reads its local
     head count from tensor shapes (``view(..., -1, head_dim)``), so plain column/row sharding is exact;
   * litgpt ``GPT`` (duck-typed): see :class:`LitGPTAttentionParallel` for its fused ``qkv``.

The model's own plan comes back as a :class:`ModelTPPlan`, a callable that first checks that tp divides every sharded
dimension ("tp=3 must divide num_attention_heads=8; try tp in {1, 2, 4, 8}") and only then shards.

Limits (each refused with a V17ConfigError, never run wrongly): for Hugging Face and litgpt models,
``sequence_parallel`` (their blocks take the residual stream as a keyword or through a fused forward, which the
sequence-sharded layout needs to intercept); tied input/output embeddings keep the embedding and the head replicated
(and refuse ``vocab_parallel``/``loss_parallel``); litgpt's latent attention, MoE MLPs and q/k norms; Hugging Face styles this
engine does not implement (``packed_colwise``, ``replicated_with_grad_allreduce``, MoE styles). Parameters a string
plan does not name (norms, an unsharded embedding) stay plain tensors, as in Hugging Face's own TP.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from lightning_v17.config import V17ConfigError, check_tp_divides
from lightning_v17.engine.tp.apply import (
    SegmentedColwiseParallel,
    TPPlan,
    apply_tensor_parallel,
    check_tensor_parallel,
    expand_plan,
    find_llama_modules,
    llama_tp_plan,
)
from lightning_v17.models.llama import BLOCK_TP_PLAN, TOP_TP_PLAN

__all__ = [
    "LitGPTAttentionParallel",
    "ModelTPPlan",
    "hf_tp_plan",
    "litgpt_tp_plan",
    "llama_default_roles",
    "model_tp_plan",
    "resolve_tp_plan",
]

Styles = dict[str, "str | ParallelStyle"]


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix and key else prefix or key


def _check_divides(tp: int, where: str, dims: Mapping[str, int]) -> None:
    try:
        check_tp_divides(tp, **dims)
    except V17ConfigError as err:
        raise V17ConfigError(f"{err} ({where})") from None


@dataclass(frozen=True)
class ModelTPPlan:
    """A model's own tensor-parallel plan: a callable ``plan(module, tp_mesh)`` for ``apply_tensor_parallel``.

    Calling it checks the mesh size against every sharded dimension, then expands and applies :attr:`styles`;
    nothing is sharded when a check fails.

    Args:
        styles: ``{fqn: style}`` relative to the module it was resolved for (wildcards and style names allowed).
        sources: one line per model found, e.g. ``"hf LlamaForCausalLM at ''"``, for logs and errors.
        checks: callables ``check(tp)`` raising :class:`V17ConfigError` when tp does not fit the model.
    """

    styles: Mapping[str, str | ParallelStyle]
    sources: tuple[str, ...] = ()
    checks: tuple[Callable[[int], None], ...] = field(default=(), repr=False)

    def validate(self, tp: int) -> None:
        """Check that ``tp`` fits every model in the plan (heads, kv heads, MLP width, vocab when sharded).

        Args:
            tp: the tensor-parallel size.

        Raises:
            V17ConfigError: naming the dimension and the valid tp values, e.g. "tp=3 must divide
                num_attention_heads=8; try tp in {1, 2, 4, 8}".
        """
        for check in self.checks:
            check(tp)

    def __call__(self, module: nn.Module, tp_mesh: DeviceMesh) -> None:
        """Validate against ``tp_mesh.size()``, then shard ``module`` in place.

        Args:
            module: the module the plan was resolved for.
            tp_mesh: the 1-D tp mesh axis.

        Raises:
            V17ConfigError: see :meth:`validate` and ``expand_plan``.
        """
        self.validate(tp_mesh.size())
        apply_tensor_parallel(module, tp_mesh=tp_mesh, plan=dict(self.styles))


# ------------------------------------------------------------------------------------------------ torchtitan Llama
def llama_default_roles(model: nn.Module) -> dict[str, str]:
    """Megatron's projection roles (Shoeybi 2019 §3) for a torchtitan-shaped model without ``tensor_parallel_plan()``.

    Args:
        model: ``tok_embeddings``/``layers`` (ModuleDict of blocks with ``attention.wq``... ``feed_forward.w2``)/
            ``norm``/``output``; parts a pipeline stage removed are left out.

    Returns:
        ``{fqn: "colwise" | "rowwise"}`` relative to ``model``.
    """
    roles = {name: role for name, role in TOP_TP_PLAN.items() if getattr(model, name, None) is not None}
    for key in model.layers:
        roles.update({f"layers.{key}.{n}": r for n, r in BLOCK_TP_PLAN.items()})
    return roles


def _llama_plan(prefix: str, llama: nn.Module, seq: bool, vocab: bool, loss: bool) -> tuple[Styles, Callable]:
    if getattr(getattr(llama, "config", None), "tie_embeddings", False):
        raise V17ConfigError(
            f"tensor parallelism of {type(llama).__name__} at {prefix!r} with tie_embeddings=True would untie the "
            f"embedding and the head (they are sharded differently); set tie_embeddings=False"
        )
    roles = None if callable(getattr(llama, "tensor_parallel_plan", None)) else llama_default_roles(llama)
    styles = llama_tp_plan(llama, roles=roles, sequence_parallel=seq, vocab_parallel=vocab, loss_parallel=loss)

    def check(tp: int) -> None:
        try:
            check_tensor_parallel(llama, tp=tp, vocab_parallel=vocab, loss_parallel=loss)
        except V17ConfigError as err:
            raise V17ConfigError(f"{err} ({type(llama).__name__} at {prefix!r})") from None

    return {_join(prefix, k): v for k, v in styles.items()}, check


# ---------------------------------------------------------------------------------------------------- Hugging Face
def _is_hf_model(module: nn.Module) -> bool:
    """Duck-typed ``transformers.PreTrainedModel``: a config with ``base_model_tp_plan`` and a ``base_model_prefix``."""
    cfg = getattr(module, "config", None)
    return (
        cfg is not None
        and hasattr(cfg, "base_model_tp_plan")
        and isinstance(getattr(type(module), "base_model_prefix", None), str)
        and callable(getattr(module, "get_input_embeddings", None))
    )


def _fqn_of(root: nn.Module, target: nn.Module | None) -> str | None:
    if target is None:
        return None
    return next((name for name, mod in root.named_modules() if mod is target), None)


def hf_tp_plan(
    model: nn.Module, *, vocab_parallel: bool = False, loss_parallel: bool = False
) -> tuple[Styles, dict[str, int]]:
    """The plan a Hugging Face model supplies itself, keyed relative to ``model``, with the styles its release gives.

    ``config.base_model_tp_plan`` (e.g. ``{"layers.*.self_attn.q_proj": "colwise", ...}``) is placed under the base
    model's prefix (``model.`` in ``LlamaForCausalLM``); the instance ``_tp_plan`` adds what ``post_init`` gathered
    (nested submodels; in recent releases, 5.24 among them, also ``{"model.embed_tokens": "embedding_rowwise"}``, the
    vocab-parallel input embedding added to every plan), and the class ``_tp_plan`` the head (``{"lm_head":
    "colwise_gather_output"}``). The style names mean what they mean in ``transformers/distributed/tensor_parallel.py``
    (``lightning_v17.engine.tp.apply.PARALLEL_STYLES``): ``colwise`` q/k/v leave each rank its heads and the
    attention reads the local head count from the shape (``view(*input_shape, -1, head_dim)``).

    Args:
        model: a ``transformers.PreTrainedModel`` (duck-typed).
        vocab_parallel: shard the input embedding along the vocab (``"rowwise_rep"``: masked lookup, all-reduce),
            whether or not the model's plan already does.
        loss_parallel: keep the head's logits a vocab-sharded DTensor (``Shard(-1)``); the loss must run inside
            ``loss_parallel_context``.

    Returns:
        ``(styles, dims)``: the plan and the dimensions tp must divide (``num_attention_heads``,
        ``num_key_value_heads``, ``intermediate_size``, and ``vocab_size`` when the vocab is sharded on request).

    Raises:
        V17ConfigError: tied embeddings with vocab/loss parallel; loss parallel without a sharded head.
    """
    cfg = model.config
    prefix = type(model).base_model_prefix
    base = getattr(model, prefix, None) if prefix else None
    base_prefix = prefix if isinstance(base, nn.Module) and base is not model else ""
    styles: Styles = {_join(base_prefix, k): v for k, v in (getattr(cfg, "base_model_tp_plan", None) or {}).items()}
    styles.update(getattr(model, "_tp_plan", None) or {})  # post_init: base plan + nested submodels, prefixed
    styles.update(getattr(type(model), "_tp_plan", None) or {})  # the class's own: the head
    emb = model.get_input_embeddings()
    head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    emb_fqn, head_fqn = _fqn_of(model, emb), _fqn_of(model, head)
    tied = emb is not None and head is not None and getattr(head, "weight", None) is getattr(emb, "weight", 0)
    if tied:
        if vocab_parallel or loss_parallel:
            raise V17ConfigError(
                f"{type(model).__name__} ties its input and output embeddings (tie_word_embeddings=True): "
                f"vocab_parallel/loss_parallel would shard the shared table for one use only; turn them off or untie"
            )
        # One table, two uses sharded differently (the head's output features vs the embedding's rows looked up by
        # token): sharding either would untie them, so both stay replicated.
        styles = {k: v for k, v in styles.items() if k not in (head_fqn, emb_fqn)}
    if vocab_parallel:
        if emb_fqn is None:
            raise V17ConfigError(f"vocab_parallel: {type(model).__name__} has no input embedding to shard")
        # A padding_idx is fine: DTensor computes the table's gradient whole (Replicate), from the global token ids,
        # so the padding row's gradient is zeroed where it lives (engine.tp_styles._RowwiseReplicatedInput).
        styles[emb_fqn] = "rowwise_rep"
    if loss_parallel:
        if head_fqn is None or head_fqn not in styles:
            raise V17ConfigError(f"loss_parallel needs a sharded LM head; {type(model).__name__} has none in its plan")
        styles[head_fqn] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    text = cfg.get_text_config() if callable(getattr(cfg, "get_text_config", None)) else cfg
    heads = getattr(text, "num_attention_heads", None)
    dims = {
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(text, "num_key_value_heads", None) or heads,
        "intermediate_size": getattr(text, "intermediate_size", None),
    }
    if vocab_parallel or loss_parallel:
        dims["vocab_size"] = getattr(text, "vocab_size", None)
    return styles, {k: v for k, v in dims.items() if isinstance(v, int)}


# ---------------------------------------------------------------------------------------------------------- litgpt
def _is_litgpt(module: nn.Module) -> bool:
    """Duck-typed ``litgpt.GPT``: ``transformer`` ModuleDict with ``h`` blocks, ``lm_head``, a litgpt-style config."""
    blocks = getattr(module, "transformer", None)
    cfg = getattr(module, "config", None)
    return (
        isinstance(blocks, nn.ModuleDict)
        and "h" in blocks
        and "lm_head" in module._modules
        and all(hasattr(cfg, a) for a in ("n_head", "n_query_groups", "head_size", "n_embd"))
    )


class LitGPTAttentionParallel(ParallelStyle):
    """Tensor parallelism for litgpt's ``CausalSelfAttention`` (fused ``qkv`` + ``proj``).

    litgpt's ``qkv`` rows are ``[all q heads; all k heads; all v heads]`` and its forward splits them with
    ``self.config.n_head`` / ``n_query_groups``. A plain column shard would hand rank 0 most of q and rank 1 the rest
    plus k and v, which is no head partition. This style

    * gives the attention module its own copy of the config with ``n_head / tp`` and ``n_query_groups / tp``
      (``head_size`` is a stored field and stays), so the forward splits, repeats kv groups and reshapes with the
      local head counts;
    * shards ``qkv`` with :class:`SegmentedColwiseParallel` over the segments ``(n_head, n_query_groups,
      n_query_groups) * head_size``: rank r computes q heads ``[r*n_head/tp, (r+1)*n_head/tp)`` and their kv groups
      ``[r*n_query_groups/tp, ...)`` (q head i uses group ``i // (n_head/n_query_groups)``, a ratio tp keeps). The
      parameter stays ``transformer.h.<i>.attn.qkv.weight``, a ``Shard(0)`` DTensor in the true layout; the price
      is an all-gather of that weight per forward and a reduce-scatter of its gradient per backward;
    * shards ``proj`` row-wise (its input is this rank's heads), ending in the usual all-reduce.

    Raises (when applied):
        V17ConfigError: tp does not divide n_head / n_query_groups; latent attention (MLA) or q/k norms, whose
            parameters span all heads.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        tp = device_mesh.size()
        cfg = module.config
        if not all(isinstance(getattr(module, n, None), nn.Linear) for n in ("qkv", "proj")):
            raise V17ConfigError(
                f"litgpt tensor parallelism supports CausalSelfAttention (qkv, proj); {type(module).__name__} "
                f"(latent attention?) needs an explicit tp_plan"
            )
        if getattr(cfg, "norm_qk", False):
            raise V17ConfigError("litgpt tensor parallelism does not support norm_qk=True (q/k norms span all heads)")
        _check_divides(tp, type(module).__name__, {"n_head": cfg.n_head, "n_query_groups": cfg.n_query_groups})
        hs = cfg.head_size
        segments = (cfg.n_head * hs, cfg.n_query_groups * hs, cfg.n_query_groups * hs)
        local = copy.copy(cfg)  # per instance: the model's config (and GPT.forward's) keeps the global counts
        local.n_head, local.n_query_groups = cfg.n_head // tp, cfg.n_query_groups // tp
        parallelize_module(module.qkv, device_mesh, SegmentedColwiseParallel(segments))
        parallelize_module(module.proj, device_mesh, RowwiseParallel())
        module.config = local
        return module


_LITGPT_MLPS = {  # child names of litgpt's MLPs -> roles
    ("fc_1", "fc_2", "proj"): {"fc_1": "colwise", "fc_2": "colwise", "proj": "rowwise"},  # LLaMAMLP, GemmaMLP
    ("fc", "proj"): {"fc": "colwise", "proj": "rowwise"},  # GptNeoxMLP
}


def litgpt_tp_plan(
    model: nn.Module, *, vocab_parallel: bool = False, loss_parallel: bool = False
) -> tuple[Styles, dict[str, int]]:
    """The plan for a litgpt ``GPT``, keyed relative to ``model``.

    ``transformer.h.*.attn`` -> :class:`LitGPTAttentionParallel`; MLP ``fc_1``/``fc_2`` (or ``fc``) column-, ``proj``
    row-parallel; ``lm_head`` column-parallel with the logits gathered (or kept vocab-sharded for loss parallel);
    ``transformer.wte`` vocab-parallel when asked; norms and the embedding otherwise stay replicated plain tensors.
    Blocks and parts a pipeline split removed are skipped by the engine.

    Args:
        model: a ``litgpt.GPT`` (duck-typed).
        vocab_parallel: shard ``transformer.wte`` along the vocab.
        loss_parallel: keep the logits a vocab-sharded DTensor (``Shard(-1)``).

    Returns:
        ``(styles, dims)``: the plan and the dimensions tp must divide (``n_head``, ``n_query_groups``,
        ``intermediate_size``, and ``padded_vocab_size`` when the vocab is sharded).

    Raises:
        V17ConfigError: an MLP or attention this plan does not know (MoE, latent attention), q/k norms.
    """
    cfg = model.config
    blocks = model.transformer["h"]
    mlp_roles: dict[str, str] | None = None
    for key, block in blocks.named_children():
        attn, mlp = getattr(block, "attn", None), getattr(block, "mlp", None)
        if not (
            isinstance(getattr(attn, "qkv", None), nn.Linear) and isinstance(getattr(attn, "proj", None), nn.Linear)
        ):
            raise V17ConfigError(
                f"transformer.h.{key}.attn is {type(attn).__name__}: the litgpt plan supports CausalSelfAttention "
                f"(fused qkv + proj) only; give an explicit tp_plan"
            )
        if getattr(cfg, "norm_qk", False):
            raise V17ConfigError("the litgpt plan does not support norm_qk=True (q/k norms span all heads)")
        names = tuple(n for n, _ in mlp.named_children()) if mlp is not None else ()
        roles = _LITGPT_MLPS.get(names)
        if roles is None or (mlp_roles is not None and roles != mlp_roles):
            raise V17ConfigError(
                f"transformer.h.{key}.mlp is {type(mlp).__name__} with children {names}: the litgpt plan knows "
                f"LLaMAMLP/GemmaMLP (fc_1, fc_2, proj) and GptNeoxMLP (fc, proj), the same in every block; "
                f"give an explicit tp_plan"
            )
        mlp_roles = roles
    styles: Styles = {"transformer.h.*.attn": LitGPTAttentionParallel()}
    styles.update({f"transformer.h.*.mlp.{n}": r for n, r in (mlp_roles or {}).items()})
    styles["lm_head"] = (
        ColwiseParallel(output_layouts=Shard(-1), use_local_output=False) if loss_parallel else "colwise_rep"
    )
    if vocab_parallel:
        styles["transformer.wte"] = "rowwise_rep"
    dims = {"n_head": cfg.n_head, "n_query_groups": cfg.n_query_groups, "intermediate_size": cfg.intermediate_size}
    if vocab_parallel or loss_parallel:
        dims["padded_vocab_size"] = cfg.padded_vocab_size
    return styles, {k: v for k, v in dims.items() if isinstance(v, int)}


# ------------------------------------------------------------------------------------------------------ resolution
def _outermost(module: nn.Module) -> Iterable[tuple[str, str, nn.Module]]:
    """(family, prefix, submodule) for every known model inside ``module`` (itself included), outermost only."""
    llamas = {id(m) for _, m in find_llama_modules(module)}
    found: list[str] = []
    for name, sub in module.named_modules():
        if any(name == p or name.startswith(p + ".") or p == "" for p in found):
            continue
        family = "llama" if id(sub) in llamas else "hf" if _is_hf_model(sub) else "litgpt" if _is_litgpt(sub) else None
        if family is not None:
            found.append(name)
            yield family, name, sub


def model_tp_plan(
    module: nn.Module, *, sequence_parallel: bool = False, vocab_parallel: bool = False, loss_parallel: bool = False
) -> ModelTPPlan | None:
    """The plan the models inside ``module`` supply themselves (source 3 of :func:`resolve_tp_plan`), or None.

    Args:
        module: a LightningModule, a model, or a pipeline stage.
        sequence_parallel: torchtitan-shaped Llama only: shard norms along the sequence dim.
        vocab_parallel: shard input embeddings along the vocab.
        loss_parallel: keep the logits vocab-sharded.

    Returns:
        A :class:`ModelTPPlan` keyed relative to ``module``, or None when no known model is inside.

    Raises:
        V17ConfigError: an option a found model cannot honour (see the module docstring), or a model shape the
            plan does not know.
    """
    styles: Styles = {}
    sources: list[str] = []
    checks: list[Callable[[int], None]] = []
    for family, prefix, sub in _outermost(module):
        where = f"{type(sub).__name__} at {prefix!r}"
        if family == "llama":
            sub_styles, check = _llama_plan(prefix, sub, sequence_parallel, vocab_parallel, loss_parallel)
            styles.update(sub_styles)
            checks.append(check)
        else:
            if sequence_parallel:
                raise V17ConfigError(
                    f"sequence_parallel=True is supported for torchtitan-shaped models only, not for {family} "
                    f"{where}; turn it off or give an explicit tp_plan"
                )
            build = hf_tp_plan if family == "hf" else litgpt_tp_plan
            sub_styles, dims = build(sub, vocab_parallel=vocab_parallel, loss_parallel=loss_parallel)
            styles.update({_join(prefix, k): v for k, v in sub_styles.items()})
            checks.append(lambda tp, where=where, dims=dims: _check_divides(tp, where, dims))
        sources.append(f"{family} {where}")
    if not sources:
        return None
    return ModelTPPlan(styles=styles, sources=tuple(sources), checks=tuple(checks))


def _hook_plan(hook: Callable[[DeviceMesh], Any]) -> Callable[[nn.Module, DeviceMesh], None]:
    def plan(module: nn.Module, tp_mesh: DeviceMesh) -> None:
        hook(tp_mesh)

    plan.source = "configure_tensor_parallel"  # type: ignore[attr-defined]
    return plan


def resolve_tp_plan(
    module: nn.Module,
    *,
    explicit: Mapping[str, str | ParallelStyle] | None = None,
    sequence_parallel: bool = False,
    vocab_parallel: bool = False,
    loss_parallel: bool = False,
) -> TPPlan:
    """The tensor-parallel plan for ``module``, from the first source that has one; pass it to
    ``apply_tensor_parallel(module, tp_mesh=..., plan=...)``.

    1. ``explicit`` (the strategy's ``TPPolicy.plan``): returned as a dict, its keys checked against ``module``.
    2. ``module.configure_tensor_parallel(mesh)`` (returned wrapped as ``plan(module, mesh)``), else a non-empty
       ``module.tp_plan`` dict (a Hugging Face model's own ``tp_plan`` property is not a user hook: it is the
       model's plan, which source 3 reads with the checks and options that apply to it).
    3. :func:`model_tp_plan`: every torchtitan-shaped Llama, Hugging Face ``PreTrainedModel`` and litgpt ``GPT``
       inside ``module``, as one :class:`ModelTPPlan` that validates tp before sharding.

    Args:
        module: the LightningModule (or any module) whose parameters will be sharded; keys are relative to it.
        explicit: ``{fqn: style}``, wildcards and style names allowed.
        sequence_parallel: for the model's own plan (torchtitan-shaped models only; refused for others).
        vocab_parallel: for the model's own plan: shard the input embedding along the vocab.
        loss_parallel: for the model's own plan: keep logits vocab-sharded (compute the loss inside
            ``loss_parallel_context``).

    The three options shape source 3 only: a user's plan (1, 2) already says how each module is sharded.

    Returns:
        A dict ``{fqn: style}`` or a callable ``plan(module, tp_mesh)``.

    Raises:
        V17ConfigError: ``explicit``/``tp_plan``/the model's plan names a missing module or an unknown style (found
            here, before anything is sharded); no source has a plan (the message names the three ways to give one);
            an option the found model cannot honour.
    """
    user_source = (
        "TPPolicy(plan=...)" if explicit is not None
        else "configure_tensor_parallel" if callable(getattr(module, "configure_tensor_parallel", None))
        else "the module's tp_plan" if not _is_hf_model(module) and getattr(module, "tp_plan", None)
        else None
    )  # fmt: skip
    if user_source and (sequence_parallel or vocab_parallel or loss_parallel):
        raise V17ConfigError(
            f"sequence_parallel/vocab_parallel/loss_parallel shape the model's own plan, but {user_source} decides "
            "the layout here; express them in that plan (e.g. 'sequence_parallel' styles) and leave the options off"
        )
    if explicit is not None:
        if not isinstance(explicit, Mapping) or not explicit:
            raise V17ConfigError(f"TPPolicy(plan=...) must be a non-empty dict {{fqn: style}}; got {explicit!r}")
        expand_plan(module, explicit)
        return dict(explicit)
    hook = getattr(module, "configure_tensor_parallel", None)
    if callable(hook):
        return _hook_plan(hook)
    user_plan = None if _is_hf_model(module) else getattr(module, "tp_plan", None)
    if isinstance(user_plan, Mapping) and user_plan:
        expand_plan(module, user_plan)
        return dict(user_plan)
    plan = model_tp_plan(
        module, sequence_parallel=sequence_parallel, vocab_parallel=vocab_parallel, loss_parallel=loss_parallel
    )
    if plan is not None:
        expand_plan(module, plan.styles)  # unknown style names (a Hugging Face style not implemented here), bad keys
    if plan is None:
        raise V17ConfigError(
            f"tensor parallelism needs a plan and none was found for {type(module).__name__}: (1) pass "
            f"V17Strategy(tp=TPPolicy(size=..., plan={{fqn: style}})) (parallelize(tp_plan=...) without Lightning; "
            f"e.g. {{'layers.*.attn.q_proj': 'colwise', ...}}), (2) give the "
            f"LightningModule a configure_tensor_parallel(self, mesh) method or a `tp_plan` dict, or (3) use a model "
            f"that supplies its own (Hugging Face base_model_tp_plan, litgpt GPT, torchtitan-style Llama)"
        )
    return plan
