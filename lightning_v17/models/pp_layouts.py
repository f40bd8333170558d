"""Pipeline layouts of the model families the pipeline engine can split (``engine.pipeline.PipelineLayout``).

The engine knows no model family; this module does. :func:`model_pipeline_layout` finds the decoder in a module
(the module itself, or a submodule such as a LightningModule's ``self.model``) and describes it with FQNs relative to
that module:

* a ``pipeline_layout()`` method on the module or a submodule (a model hands the engine its own plan);
* the reference :class:`lightning_v17.models.llama.Llama` (``tok_embeddings`` -> ``layers`` -> ``norm`` ->
  ``output``; labels already shifted; document boundaries from ``position_ids``), run through ``Llama.forward``;
* Hugging Face models with a ``config.base_model_pp_plan`` (duck-typed): the parts its pipeline plans name
  (``model.embed_tokens`` -> ``model.layers`` -> ``model.norm`` -> ``lm_head`` for ``LlamaForCausalLM``; labels
  shifted inside the loss);
* litgpt ``GPT`` (``transformer.wte`` -> ``transformer.h`` -> ``transformer.ln_f`` -> ``lm_head``).

Third-party stages run the model's own public ``forward`` with the parts of other stages replaced by pass-throughs
(:class:`_PublicForward`, the torchtitan / transformers way), never a copy of it: masks, rotary embeddings and
embedding or logit scaling are whatever the installed release computes, so a new release does not break the stages
and a family needs no code of its own here. What stays refused, with the fix: tied embedding/head weights across
stages and parameters outside the plan's parts (``engine.pipeline.split_model``), and a plan with several
parameterized parts before or after the blocks. ``transformers`` and ``litgpt`` are optional (test extras):
nothing here imports them.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_v17.config import V17ConfigError
from lightning_v17.engine.pipeline.runtime import PipelineLayout, StageModule
from lightning_v17.models.llama import Llama

__all__ = ["model_pipeline_layout"]


# ------------------------------------------------------------------------------------------- reference Llama (ours)


class _LlamaStageView:
    """What ``Llama.forward`` reads from ``self``, taken from a stage: running the model's own forward on it keeps
    the pipeline identical to the unsplit model (document boundaries derived from ``position_ids``, plain causal
    attention when every row holds one document)."""

    def __init__(self, stage: StageModule, config: Any) -> None:
        self.config = config
        self.tok_embeddings = stage.embed
        self.layers = stage.blocks
        self.norm = stage.norm
        self.output = stage.head


def _llama_stage_forward(
    root: nn.Module, stage: StageModule, x: torch.Tensor, position_ids: torch.Tensor | None = None
) -> torch.Tensor:
    return Llama.forward(_LlamaStageView(stage, root.config), x, position_ids=position_ids)  # type: ignore[arg-type]


def _llama_layout(model: nn.Module) -> PipelineLayout:
    return PipelineLayout(
        embed="tok_embeddings",
        blocks="layers",
        norm="norm",
        head="output",
        stage_forward=functools.partial(_llama_stage_forward, model),
        shift_labels=False,
    )


# ----------------------------------------------------------------------------- third-party models: public forward


class _Passthrough(nn.Module):
    """Stands in for a part another stage owns, as transformers' own ``PipelineIdentityLayer`` does: returns its
    first input. What it returns is never used (see :class:`_PublicForward`)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return args[0] if args else next(iter(kwargs.values()))


def _shallow(module: nn.Module) -> nn.Module:
    """A copy of ``module`` sharing its parameters, buffers, hooks and config, with a child table of its own."""
    view = copy.copy(module)
    object.__setattr__(view, "_modules", dict(module._modules))
    return view


def _view_with(root: nn.Module, parts: dict[str, nn.Module]) -> nn.Module:
    """``root`` as seen by one stage: each FQN in ``parts`` names the module given there.

    ``root`` and the modules on the way to each part are shallow copies (:func:`_shallow`), so the model itself is
    not touched and everything else in the view (rotary embeddings, dropout, config, buffers) is the model's own.
    """
    views = {"": _shallow(root)}
    for fqn, part in parts.items():
        path = fqn.split(".")
        for i in range(1, len(path)):
            key = ".".join(path[:i])
            if key not in views:
                parent = views[".".join(path[: i - 1])]
                views[key] = parent._modules[path[i - 1]] = _shallow(parent._modules[path[i - 1]])
        views[".".join(path[:-1])]._modules[path[-1]] = part
    return views[""]


def _feed(h: torch.Tensor, _module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Forward pre-hook of a stage's first block: its input is what the previous stage sent."""
    if args:
        return (h, *args[1:]), kwargs
    if "hidden_states" in kwargs:
        return args, {**kwargs, "hidden_states": h}
    raise V17ConfigError(
        f"{type(_module).__name__} was called without positional hidden states or a hidden_states keyword, so a "
        "pipeline stage cannot hand it the previous stage's output; give the module a pipeline_layout() or use pp=1"
    )


#: ``call(view, x, first, kwargs) -> logits``: one public forward of the model family on a stage's view; ``x`` is
#: the token ids on the first stage and the received hidden states after.
_Call = Callable[[nn.Module, torch.Tensor, bool, dict[str, Any]], torch.Tensor]


@dataclass(eq=False)
class _PublicForward:
    """One pipeline stage of a third-party decoder, run through the model's own public ``forward``.

    This is how torchtitan and transformers' own pipeline support (``transformers.distributed.pipeline_parallel``)
    run a stage: the stage calls the whole model, in which the blocks of other stages are pass-throughs at their own
    indices (a forward that looks up ``config.layer_types[i]`` still sees block i at i) and the embedding, norm and
    head stand in with pass-throughs where another stage owns them. Everything the forward computes around the
    blocks -- masks (packed documents from ``position_ids``, padding), rotary embeddings, embedding scaling, logit
    scaling or soft-capping -- is the model's own code of the installed release, so nothing here follows a private
    helper across releases. Two hooks make the result independent of what the pass-throughs return:

    * a stage after the first feeds the received hidden states to its first block (a forward pre-hook), so a forward
      that transforms its input embeddings (Granite's ``embedding_multiplier``) applies that transform on the first
      stage only, as the unsplit model does (handing them in as ``inputs_embeds`` alone would apply it again);
    * a stage before the last returns its last block's output (a forward hook), not what the norm and head
      pass-throughs and any logit transform make of it.

    Args:
        model: the family's model (FQNs below are relative to it).
        embed, blocks, norm, head: FQNs of the parts (``split_model`` sets them on each stage).
        num_blocks: how many blocks the unsplit model has.
        call: runs the family's public forward (:data:`_Call`).
    """

    model: nn.Module
    embed: str | None
    blocks: str
    norm: str | None
    head: str | None
    num_blocks: int
    call: _Call

    def __call__(self, stage: StageModule, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        fill = _Passthrough()
        own = dict(stage.blocks.items())  # original index -> block, in order
        parts: dict[str, nn.Module] = {
            self.blocks: nn.ModuleList([own.get(str(i), fill) for i in range(self.num_blocks)])
        }
        for fqn, mine in ((self.embed, stage.embed), (self.norm, stage.norm), (self.head, stage.head)):
            if fqn is not None:
                parts[fqn] = fill if mine is None else mine
        view = _view_with(self.model, parts)
        blocks = list(own.values())
        sent: list[Any] = []
        hooks = []
        if not stage.is_first:
            hooks.append(blocks[0].register_forward_pre_hook(functools.partial(_feed, x), with_kwargs=True))
        if not stage.is_last:
            hooks.append(blocks[-1].register_forward_hook(lambda _m, _a, out: sent.append(out)))
        try:
            logits = self.call(view, x, stage.is_first, kwargs)
        finally:
            for h in hooks:
                h.remove()
        if stage.is_last:
            return logits
        if len(sent) != 1:
            raise V17ConfigError(
                f"{type(self.model).__name__}.forward called block {list(own)[-1]} {len(sent)} times instead of "
                "once, so the pipeline stage cannot take its output; give the module a pipeline_layout() or use pp=1"
            )
        # transformers 5 decoder layers return the hidden states; older ones (and some families) a tuple
        return sent[0][0] if isinstance(sent[0], tuple) else sent[0]


def _count_params(module: nn.Module | None) -> int:
    return 0 if module is None else sum(p.numel() for p in module.parameters())


# ------------------------------------------------------------------------------------------------- Hugging Face


def _hf_call(view: nn.Module, x: torch.Tensor, first: bool, kwargs: dict[str, Any]) -> torch.Tensor:
    """``*ForCausalLM.forward`` without a KV cache; later stages hand their hidden states in as ``inputs_embeds``
    (what transformers' own pipeline support does), which the forward reads for shapes, dtype and masks only: the
    first block's pre-hook feeds them to the blocks."""
    inputs = {"input_ids": x} if first else {"inputs_embeds": x}
    return view(**inputs, **kwargs, use_cache=False).logits


def _has_hf_pp_plan(module: nn.Module) -> bool:
    config = getattr(module, "config", None)
    prefix = getattr(module, "base_model_prefix", None)
    plan = getattr(config, "base_model_pp_plan", None)
    base = getattr(module, prefix, None) if isinstance(prefix, str) and prefix else None
    return bool(plan) and isinstance(base, nn.Module) and base is not module


def _hf_layout(model: nn.Module) -> PipelineLayout:
    """The parts named by the model's own pipeline plans: ``config.base_model_pp_plan`` (ordered: what runs before
    the blocks, the blocks, what runs after them; e.g. ``embed_tokens`` -> ``layers`` -> ``norm``) under
    ``base_model_prefix``, and the head from the class ``_pp_plan`` (``{"lm_head": ...}``). Parameter-free
    entries (``embed_dropout``) stay in the model's forward on every stage."""
    name = type(model).__name__
    prefix = model.base_model_prefix
    base = getattr(model, prefix)
    plan = list(model.config.base_model_pp_plan)
    absent = [n for n in plan if not isinstance(getattr(base, n, None), nn.Module)]
    blocks = [n for n in plan if isinstance(getattr(base, n, None), nn.ModuleList)]
    heads = [n for n in getattr(type(model), "_pp_plan", None) or {} if isinstance(getattr(model, n, None), nn.Module)]
    if absent or len(blocks) != 1 or len(heads) != 1:
        why = (
            f"lacks {absent}, which its base_model_pp_plan names" if absent
            else f"has {len(blocks)} block lists in its base_model_pp_plan {plan}" if len(blocks) != 1
            else f"names {len(heads)} output heads in its _pp_plan (a *ForCausalLM names one, lm_head)"
        )  # fmt: skip
        raise V17ConfigError(
            f"{name}.{prefix} {why}, so it cannot be cut into pipeline stages; give the module a pipeline_layout() "
            "returning a lightning_v17.engine.pipeline.runtime.PipelineLayout, or use pp=1"
        )
    i = plan.index(blocks[0])
    before = [n for n in plan[:i] if _count_params(getattr(base, n))]
    after = [n for n in plan[i + 1 :] if _count_params(getattr(base, n))]
    if len(before) > 1 or len(after) > 1:
        raise V17ConfigError(
            f"{name}.{prefix} has several parts with parameters before ({before}) or after ({after}) its blocks; "
            "the pipeline split places one embedding on the first stage and one norm on the last. Give the module "
            "a pipeline_layout() or use pp=1"
        )
    embed = f"{prefix}.{before[0]}" if before else None
    norm = f"{prefix}.{after[0]}" if after else None
    blocks_fqn = f"{prefix}.{blocks[0]}"
    return PipelineLayout(
        embed=embed,
        blocks=blocks_fqn,
        norm=norm,
        head=heads[0],
        stage_forward=_PublicForward(
            model, embed, blocks_fqn, norm, heads[0], num_blocks=len(getattr(base, blocks[0])), call=_hf_call
        ),
        shift_labels=True,
        stage_kwargs=("position_ids", "attention_mask"),
    )


# ------------------------------------------------------------------------------------------------------- litgpt


def _litgpt_call(view: nn.Module, x: torch.Tensor, first: bool, kwargs: dict[str, Any]) -> torch.Tensor:
    """``GPT.forward(idx)`` (training path, no ``input_pos``; like it, no position ids). Later stages pass dummy ids
    of the same shape, which the embedding's pass-through hands on and the first block's pre-hook replaces."""
    return view(x if first else x.new_zeros(x.shape[:2], dtype=torch.long))


def _is_litgpt_gpt(module: nn.Module) -> bool:
    transformer = getattr(module, "transformer", None)
    return (
        isinstance(transformer, nn.ModuleDict)
        and all(k in transformer for k in ("wte", "h", "ln_f"))
        and isinstance(transformer["h"], nn.ModuleList)
        and isinstance(getattr(module, "lm_head", None), nn.Module)
        and hasattr(module, "rope_cache")
        and hasattr(getattr(module, "config", None), "n_embd")
    )


def _litgpt_layout(model: nn.Module) -> PipelineLayout:
    embed, blocks, norm, head = "transformer.wte", "transformer.h", "transformer.ln_f", "lm_head"
    return PipelineLayout(
        embed=embed,
        blocks=blocks,
        norm=norm,
        head=head,
        stage_forward=_PublicForward(
            model, embed, blocks, norm, head, num_blocks=len(model.transformer.h), call=_litgpt_call
        ),
        shift_labels=False,
        stage_kwargs=(),  # GPT.forward takes no position ids
    )


# ------------------------------------------------------------------------------------------------------- lookup


def _family_layout(module: nn.Module) -> PipelineLayout | None:
    hook = getattr(module, "pipeline_layout", None)
    if callable(hook):
        layout = hook()
        if not isinstance(layout, PipelineLayout):
            raise V17ConfigError(
                f"{type(module).__name__}.pipeline_layout() must return a lightning_v17.engine.pipeline.runtime."
                f"PipelineLayout; got {type(layout).__name__}"
            )
        return layout
    if isinstance(module, Llama):
        return _llama_layout(module)
    if _has_hf_pp_plan(module):
        return _hf_layout(module)
    if _is_litgpt_gpt(module):
        return _litgpt_layout(module)
    return None


def model_pipeline_layout(module: nn.Module) -> PipelineLayout | None:
    """The pipeline layout of the decoder in ``module``, with FQNs relative to ``module``.

    ``module`` and then its submodules (outermost first) are tried in turn; the first that defines
    ``pipeline_layout()`` or belongs to a known family (reference Llama, a Hugging Face model with a
    ``base_model_pp_plan``, litgpt ``GPT``) gives the layout.

    Args:
        module: the model, or a module holding it (e.g. a LightningModule with ``self.model``).

    Returns:
        The layout for ``engine.pipeline.split_model(module, layout=...)``, or None when no decoder is recognized.

    Raises:
        V17ConfigError: a Hugging Face model whose pipeline plans do not name one block list, one head and at most
            one parameterized part on each side of the blocks, or a ``pipeline_layout()`` that returns something
            else than a ``PipelineLayout``.
    """
    for name, sub in module.named_modules():
        layout = _family_layout(sub)
        if layout is not None:
            return layout.with_prefix(name)
    return None
