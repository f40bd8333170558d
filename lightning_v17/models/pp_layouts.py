"""Pipeline layouts of the model families the pipeline engine can split (``engine.pipeline.PipelineLayout``).

The engine knows no model family; this module does. :func:`model_pipeline_layout` finds the decoder in a module
(the module itself, or a submodule such as a LightningModule's ``self.model``) and describes it with FQNs relative to
that module:

* a ``pipeline_layout()`` method on the module or a submodule (a model hands the engine its own plan);
* the reference :class:`lightning_v17.models.llama.Llama` (``tok_embeddings`` -> ``layers`` -> ``norm`` ->
  ``output``; labels already shifted; document boundaries from ``position_ids``);
* Hugging Face ``*ForCausalLM`` decoders, duck-typed by ``config.base_model_pp_plan`` and ``base_model_prefix``
  (``model.embed_tokens`` -> ``model.layers`` -> ``model.norm`` -> ``lm_head``; labels shifted inside the loss);
* litgpt ``GPT`` (``transformer.wte`` -> ``transformer.h`` -> ``transformer.ln_f`` -> ``lm_head``).

Each stage function reproduces what the family's own ``forward`` computes around its blocks -- rotary embeddings,
attention masks, embedding scaling, logit soft-capping -- on every stage that needs it, so a pipelined model computes
exactly what the unsplit model computes. ``transformers`` and ``litgpt`` are optional (test extras): nothing here
imports them at module import time.
"""

from __future__ import annotations

import functools
from enum import StrEnum
from typing import Any

import torch
from torch import nn

from lightning_v17.config import V17ConfigError
from lightning_v17.engine.pipeline import PipelineLayout, StageModule
from lightning_v17.models.llama import Llama

__all__ = ["HF_PIPELINE_MODEL_TYPES", "model_pipeline_layout"]


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


# ------------------------------------------------------------------------------------------------- Hugging Face


class _HFMask(StrEnum):
    """How a Hugging Face decoder picks each layer's attention mask (read from its ``*Model.forward``)."""

    CAUSAL = "causal"  # create_causal_mask for every layer (Llama, OLMo-2)
    CONFIG_WINDOW = "config_window"  # sliding-window mask iff config.sliding_window is set (Mistral, Phi-3)
    LAYER_TYPE = "layer_type"  # per layer by decoder_layer.attention_type (Qwen2, Qwen3, SmolLM3)


#: ``config.model_type`` of the Hugging Face decoders whose ``*Model.forward`` (read in transformers 5.3) is exactly:
#: embed, causal / sliding mask, rotary ``position_embeddings`` from ``model.rotary_emb``, the layers, ``norm``, then
#: ``lm_head`` and ``ForCausalLMLoss``; tests/unit/test_pp_layouts.py checks each one's stages against its own
#: logits. Others (Gemma scales the embeddings, Granite multiplies them and the logits, Gemma-2 soft-caps the
#: logits, ...) would silently compute something else, so they are refused.
HF_PIPELINE_MODEL_TYPES: dict[str, _HFMask] = {
    "llama": _HFMask.CAUSAL,
    "olmo2": _HFMask.CAUSAL,
    "mistral": _HFMask.CONFIG_WINDOW,
    "phi3": _HFMask.CONFIG_WINDOW,
    "qwen2": _HFMask.LAYER_TYPE,
    "qwen3": _HFMask.LAYER_TYPE,
    "smollm3": _HFMask.LAYER_TYPE,
}


def _hf_stage_forward(
    base: nn.Module,
    rule: _HFMask,
    stage: StageModule,
    x: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """One stage of a Hugging Face decoder, as ``LlamaModel.forward`` / ``Qwen2Model.forward`` / ... compute it
    without a KV cache (training): masks from ``masking_utils`` with the same arguments, rotary embeddings from the
    base model's ``rotary_emb`` (recomputed on every stage: they are not sent between stages)."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    h = stage.embed(x) if stage.embed is not None else x
    cache_position = torch.arange(h.shape[1], device=h.device)
    if position_ids is None:
        position_ids = cache_position.unsqueeze(0)
    mask_kwargs = {
        "config": base.config,
        "inputs_embeds": h,
        "attention_mask": attention_mask,
        "cache_position": cache_position,
        "past_key_values": None,
        "position_ids": position_ids,
    }
    masks: dict[str, Any] = {}

    def mask_for(layer: nn.Module) -> Any:
        if rule == _HFMask.LAYER_TYPE:
            kind = getattr(layer, "attention_type", "full_attention")
        elif rule == _HFMask.CONFIG_WINDOW and getattr(base.config, "sliding_window", None) is not None:
            kind = "sliding_attention"
        else:
            kind = "full_attention"
        if kind not in masks:
            make = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
            if kind not in make:
                raise V17ConfigError(f"pipeline stages do not build {kind!r} attention masks; use pp=1")
            masks[kind] = make[kind](**mask_kwargs)
        return masks[kind]

    position_embeddings = base.rotary_emb(h, position_ids=position_ids)
    for layer in stage.blocks.values():
        out = layer(
            h,
            attention_mask=mask_for(layer),
            position_embeddings=position_embeddings,
            position_ids=position_ids,
            past_key_values=None,
            use_cache=False,
            cache_position=cache_position,
        )
        # transformers 5 decoder layers return the hidden states; 4.x returned a tuple (hidden_states, ...).
        h = out[0] if isinstance(out, tuple) else out
    if stage.norm is not None:
        h = stage.norm(h)
    if stage.head is not None:
        h = stage.head(h)
    return h


def _is_hf_causal_lm(module: nn.Module) -> bool:
    config = getattr(module, "config", None)
    prefix = getattr(module, "base_model_prefix", None)
    plan = getattr(config, "base_model_pp_plan", None)
    base = getattr(module, prefix, None) if isinstance(prefix, str) and prefix else None
    return bool(plan) and isinstance(base, nn.Module) and isinstance(getattr(module, "lm_head", None), nn.Module)


def _hf_layout(model: nn.Module) -> PipelineLayout:
    config = model.config
    prefix = model.base_model_prefix
    base = getattr(model, prefix)
    kind = getattr(config, "model_type", None)
    if kind not in HF_PIPELINE_MODEL_TYPES:
        raise V17ConfigError(
            f"{type(model).__name__} (model_type={kind!r}) has a forward the pipeline stages do not reproduce; "
            f"supported: {sorted(HF_PIPELINE_MODEL_TYPES)}. Give the module a pipeline_layout() returning a "
            "lightning_v17.engine.pipeline.PipelineLayout, or train it with pp=1"
        )
    plan = config.base_model_pp_plan
    missing = [n for n in ("embed_tokens", "layers", "norm") if n not in plan or not hasattr(base, n)]
    if missing or not hasattr(base, "rotary_emb"):
        raise V17ConfigError(
            f"{type(model).__name__}.{prefix} lacks {missing or ['rotary_emb']}, which its base_model_pp_plan "
            "promises; give the module a pipeline_layout() or use pp=1"
        )
    return PipelineLayout(
        embed=f"{prefix}.embed_tokens",
        blocks=f"{prefix}.layers",
        norm=f"{prefix}.norm",
        head="lm_head",
        stage_forward=functools.partial(_hf_stage_forward, base, HF_PIPELINE_MODEL_TYPES[kind]),
        shift_labels=True,
        stage_kwargs=("position_ids", "attention_mask"),
    )


# ------------------------------------------------------------------------------------------------------- litgpt


def _litgpt_stage_forward(gpt: nn.Module, stage: StageModule, x: torch.Tensor, **_: Any) -> torch.Tensor:
    """One stage of litgpt's ``GPT.forward(idx)`` (litgpt/model.py, training path without ``input_pos``): cos/sin
    are the first T rows of the model's rope cache on every stage, the mask is None (causal), the embeddings are
    scaled by sqrt(n_embd) when ``config.scale_embeddings``, and the logits soft-capped when
    ``config.final_logit_softcapping`` is set. Like ``GPT.forward``, it takes no position ids (batch keys such as
    ``position_ids`` are ignored: packed documents attend across boundaries exactly as in litgpt's own training)."""
    cfg = gpt.config
    t = x.shape[1]
    if gpt.max_seq_length < t:
        raise ValueError(f"Cannot forward sequence of length {t}, max seq length is only {gpt.max_seq_length}.")
    cos, sin = gpt.cos[:t].unsqueeze(0), gpt.sin[:t].unsqueeze(0)
    h = x
    if stage.embed is not None:
        h = stage.embed(x)
        if cfg.scale_embeddings:
            h = h * torch.tensor(cfg.n_embd**0.5, dtype=h.dtype)
    for key, block in stage.blocks.items():
        if cfg.rope_indices is not None:
            idx = cfg.rope_indices[int(key)]
            h = block(h, cos[..., idx], sin[..., idx], None, None, None)
        else:
            h = block(h, cos, sin, None, None, None)
    if stage.norm is not None:
        h = stage.norm(h)
    if stage.head is not None:
        h = stage.head(h)
        if cfg.final_logit_softcapping is not None:
            h = torch.tanh(h / cfg.final_logit_softcapping) * cfg.final_logit_softcapping  # litgpt do_softcapping
    return h


def _is_litgpt_gpt(module: nn.Module) -> bool:
    transformer = getattr(module, "transformer", None)
    return (
        isinstance(transformer, nn.ModuleDict)
        and all(k in transformer for k in ("wte", "h", "ln_f"))
        and isinstance(getattr(module, "lm_head", None), nn.Module)
        and hasattr(module, "rope_cache")
        and hasattr(getattr(module, "config", None), "n_embd")
    )


def _litgpt_layout(model: nn.Module) -> PipelineLayout:
    return PipelineLayout(
        embed="transformer.wte",
        blocks="transformer.h",
        norm="transformer.ln_f",
        head="lm_head",
        stage_forward=functools.partial(_litgpt_stage_forward, model),
        shift_labels=False,
    )


# ------------------------------------------------------------------------------------------------------- lookup


def _family_layout(module: nn.Module) -> PipelineLayout | None:
    hook = getattr(module, "pipeline_layout", None)
    if callable(hook):
        layout = hook()
        if not isinstance(layout, PipelineLayout):
            raise V17ConfigError(
                f"{type(module).__name__}.pipeline_layout() must return a lightning_v17.engine.pipeline."
                f"PipelineLayout; got {type(layout).__name__}"
            )
        return layout
    if isinstance(module, Llama):
        return _llama_layout(module)
    if _is_hf_causal_lm(module):
        return _hf_layout(module)
    if _is_litgpt_gpt(module):
        return _litgpt_layout(module)
    return None


def model_pipeline_layout(module: nn.Module) -> PipelineLayout | None:
    """The pipeline layout of the decoder in ``module``, with FQNs relative to ``module``.

    ``module`` and then its submodules (outermost first) are tried in turn; the first that defines
    ``pipeline_layout()`` or belongs to a known family (reference Llama, Hugging Face ``*ForCausalLM``, litgpt
    ``GPT``) gives the layout.

    Args:
        module: the model, or a module holding it (e.g. a LightningModule with ``self.model``).

    Returns:
        The layout for ``engine.pipeline.split_model(module, layout=...)``, or None when no decoder is recognized.

    Raises:
        V17ConfigError: a Hugging Face decoder whose forward the stages do not reproduce, or a ``pipeline_layout()``
            that returns something else than a ``PipelineLayout``.
    """
    for name, sub in module.named_modules():
        layout = _family_layout(sub)
        if layout is not None:
            return layout.with_prefix(name)
    return None
