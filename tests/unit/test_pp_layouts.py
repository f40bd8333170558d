"""Pipeline layouts of the model families (``models.pp_layouts``): FQNs, in-place split, refusals, and exactness.

Pure: no process group. The split of rank r is taken on its own deep copy; chaining the stages of all ranks in one
process must give exactly the unsplit model's logits (the same ops in the same order: 0 difference), for eleven
Hugging Face families on the installed transformers (packed position ids, a padding attention mask; embedding and
logit scaling, soft-capping, sliding windows, other part names), litgpt (embedding scaling and soft-capping on) and
the reference Llama. The stages run each model's own public forward, so the families need no code of their own in
``models/pp_layouts.py``; a test checks that it holds no copy of Hugging Face forward code. Tiny random models;
nothing downloaded.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_v17.config import PipelinePolicy, V17ConfigError
from lightning_v17.engine.pipeline.runtime import PipelineLayout, PipelineLoss, split_model
from lightning_v17.models import Llama, ModelConfig
from lightning_v17.models.pp_layouts import model_pipeline_layout
from tests._models import hf_causal_lm, litgpt_gpt

VOCAB = 128
#: Hugging Face model_types whose stages are checked against their own logits, with what each one adds: the layouts
#: accept any model whose base_model_pp_plan names its parts; these cover the ways a forward differs around its blocks
HF_FAMILIES = {
    "llama": {},
    "olmo2": {},
    "mistral": {},
    "phi3": {},
    # layers 2 and 3 attend through a 4-token window, picked by config.layer_types[i]: a block must stay at its index
    "qwen2": {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 2},
    "qwen3": {},
    "smollm3": {},
    "gemma": {"head_dim": 16},  # embeddings scaled by sqrt(hidden) after the lookup
    # logit soft-capping; sliding (4 tokens) and full layers alternate
    "gemma2": {"head_dim": 16, "attn_implementation": "eager", "sliding_window": 4},
    "granite": {"embedding_multiplier": 3.0, "logits_scaling": 2.0},  # both multiplied outside the parts
    "gpt_neox": {},  # other part names (embed_in, final_layer_norm) and a parameter-free emb_dropout in the plan
}


def _hf(kind: str = "llama", **kw):
    # pad 0: Phi-3's default pad id (32000) lies outside a 128-token vocabulary
    return hf_causal_lm(
        kind, pad_token_id=0, bos_token_id=1, eos_token_id=2, **{**HF_FAMILIES.get(kind, {}), **kw}
    ).eval()


def _litgpt(**kw):
    return litgpt_gpt(init_weights=True, **kw).eval()


def _llama(**kw) -> Llama:
    cfg = {"vocab_size": VOCAB, "hidden": 64, "layers": 4, "heads": 4, "kv_heads": 2, "ffn": 128, "max_seq_len": 64}
    cfg.update(kw)
    torch.manual_seed(0)
    return Llama(ModelConfig(**cfg))


def _split(model, rank: int, *, pp: int = 2, **policy):
    return split_model(model, layout=model_pipeline_layout(model), pp_rank=rank, pp=pp, policy=PipelinePolicy(**policy))


def _chained(model, x, *, pp: int = 2, **kwargs) -> torch.Tensor:
    """Run the stages of every rank (each split from its own copy) in stage order, in this process."""
    stages = {}
    for rank in range(pp):
        mods, ids = _split(copy.deepcopy(model), rank, pp=pp, schedule="interleaved_1f1b", virtual_stages=2)
        stages.update(zip(ids, mods))
    h = x
    for s in sorted(stages):
        h = stages[s](h, **kwargs)
    return h


def _ids_and_packed_positions(rows: int = 2, seq: int = 16):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (rows, seq), generator=g)
    pos = torch.cat([torch.arange(7), torch.arange(seq - 7)]).expand(rows, seq).contiguous()
    return ids, pos


# ------------------------------------------------------------------------------------------------------- layouts


def test_layout_fqns_per_family():
    hf = model_pipeline_layout(_hf())
    assert (hf.embed, hf.blocks, hf.norm, hf.head) == ("model.embed_tokens", "model.layers", "model.norm", "lm_head")
    assert hf.shift_labels and "attention_mask" in hf.stage_kwargs
    lit = model_pipeline_layout(_litgpt())
    assert (lit.embed, lit.blocks, lit.norm, lit.head) == (
        "transformer.wte",
        "transformer.h",
        "transformer.ln_f",
        "lm_head",
    )
    assert not lit.shift_labels
    ref = model_pipeline_layout(_llama())
    assert (ref.embed, ref.blocks, ref.norm, ref.head) == ("tok_embeddings", "layers", "norm", "output")
    assert not ref.shift_labels
    assert model_pipeline_layout(nn.Linear(2, 2)) is None


def test_layout_found_below_a_holder_module():
    holder = nn.Module()  # e.g. a LightningModule with self.model
    holder.model = _hf()
    layout = model_pipeline_layout(holder)
    assert (layout.embed, layout.blocks, layout.head) == (
        "model.model.embed_tokens",
        "model.model.layers",
        "model.lm_head",
    )
    full = {k: v.clone() for k, v in holder.state_dict().items()}
    stages, ids = split_model(holder, layout=layout, pp_rank=1, pp=2, policy=PipelinePolicy())
    assert ids == (1,) and list(stages[0].blocks) == ["2", "3"]
    sd = holder.state_dict()
    assert "model.model.layers.2.self_attn.q_proj.weight" in sd and "model.lm_head.weight" in sd
    assert not any(k.startswith(("model.model.layers.0.", "model.model.embed_tokens")) for k in sd)
    assert all(torch.equal(v, full[k]) for k, v in sd.items())


def test_pipeline_layout_hook_wins_and_is_checked():
    class Custom(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = _llama()

        def pipeline_layout(self) -> PipelineLayout:
            base = model_pipeline_layout(self.inner)
            return base.with_prefix("inner")

    holder = nn.Module()
    holder.net = Custom()
    assert model_pipeline_layout(holder).blocks == "net.inner.layers"

    class Wrong(nn.Module):
        def pipeline_layout(self):
            return {"blocks": "layers"}

    with pytest.raises(V17ConfigError, match="must return a lightning_v17.engine.pipeline.runtime.PipelineLayout"):
        model_pipeline_layout(Wrong())


def test_hf_plans_the_split_cannot_follow_are_refused_with_the_fix():
    model = _hf()
    plan = dict(model.config.base_model_pp_plan)
    # two parameterized parts before the blocks: only one can be the first stage's embedding
    model.config.base_model_pp_plan = {
        "embed_tokens": plan["embed_tokens"],
        "norm": plan["norm"],
        "layers": plan["layers"],
    }
    with pytest.raises(
        V17ConfigError, match=r"several parts with parameters before \(\['embed_tokens', 'norm'\]\).*pp=1"
    ):
        model_pipeline_layout(model)
    model.config.base_model_pp_plan = {**plan, "vision_tower": plan["norm"]}
    with pytest.raises(V17ConfigError, match=r"lacks \['vision_tower'\], which its base_model_pp_plan names"):
        model_pipeline_layout(model)
    model.config.base_model_pp_plan = plan
    assert model_pipeline_layout(model).norm == "model.norm"


def test_hf_model_without_a_pipeline_plan_is_not_guessed():
    gpt2 = hf_causal_lm("gpt2", layers=2, n_embd=64, n_head=4, n_positions=64, vocab_size=VOCAB)
    assert not gpt2.config.base_model_pp_plan
    assert model_pipeline_layout(gpt2) is None  # parallelize() then names the fix (pipeline_layout() or pp=1)


def _code_words(module) -> set[str]:
    """Every name, attribute, import and string literal of a module's code (docstrings and comments left out)."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(module))
    docs = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    words: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            words.add(node.id)
        elif isinstance(node, ast.Attribute):
            words.add(node.attr)
        elif isinstance(node, ast.ImportFrom | ast.Import):
            words.update(a.name for a in node.names)
            words.add(getattr(node, "module", None) or "")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            words.add(node.value)
    return words


def test_stage_adapters_hold_no_copy_of_a_family_forward():
    """The stages call the model's forward: the adapter's code names no Hugging Face helper, no family, and none
    of what a family's forward computes around its blocks (masks, rotary embeddings, cache positions)."""
    from lightning_v17.models import pp_layouts

    words = {w.lower() for w in _code_words(pp_layouts)}
    code = " ".join(sorted(words))
    for part in (
        "transformers",
        "masking",
        "causal_mask",
        "rotary",
        "cache_position",
        "model_type",
        "sliding",
        "softcap",
    ):
        assert part not in code, part
    assert not words & {"cos", "sin"}  # rotary tables
    for family in ("llamafor", "qwen", "mistral", "gemma", "granite", "olmo", "phi3", "smollm"):
        assert family not in code, family


# -------------------------------------------------------------------------------------------------------- splits


def test_hf_split_keeps_fqns_and_drops_foreign_blocks():
    full = _hf()
    ref = {k: v.clone() for k, v in full.state_dict().items()}
    m = copy.deepcopy(full)
    stages, ids = _split(m, 1)
    assert ids == (1,)
    # the ModuleList became a ModuleDict keyed by the original indices (deleting would renumber the FQNs)
    assert isinstance(m.model.layers, nn.ModuleDict) and list(m.model.layers) == ["2", "3"]
    assert m.model.embed_tokens is None and m.model.norm is not None and m.lm_head is not None
    assert stages[0].embed is None and stages[0].head is m.lm_head
    assert stages[0].blocks["2"] is m.model.layers["2"]  # shared, not copied
    sd = m.state_dict()
    assert "model.layers.3.mlp.down_proj.weight" in sd and not any(k.startswith("model.layers.0.") for k in sd)
    assert all(torch.equal(v, ref[k]) for k, v in sd.items())
    first = copy.deepcopy(full)
    _split(first, 0)
    assert list(first.model.layers) == ["0", "1"] and first.lm_head is None and first.model.norm is None


def test_litgpt_split_keeps_fqns():
    m = _litgpt()
    names = {k for k, _ in m.named_parameters()}
    stages, _ = _split(m, 1, schedule="interleaved_1f1b", virtual_stages=2)
    assert isinstance(m.transformer.h, nn.ModuleDict) and list(m.transformer.h) == ["1", "3"]
    assert m.transformer.wte is None and m.lm_head is not None
    assert [list(s.blocks) for s in stages] == [["1"], ["3"]]
    local = {k for k, _ in m.named_parameters()}
    assert local <= names and "transformer.h.3.attn.qkv.weight" in local


def test_tied_embeddings_refused_with_the_fix():
    with pytest.raises(V17ConfigError, match=r"lm_head.weight is model.embed_tokens.weight.*tie_word_embeddings=False"):
        _split(_hf(tie_word_embeddings=True), 0)
    with pytest.raises(V17ConfigError, match=r"stages \[0, 1\].*tie_embeddings=False"):
        _split(_llama(tie_embeddings=True), 0)


def test_split_points_by_fqn_or_suffix_and_bad_ones_named():
    stages, _ = _split(_hf(), 0, split_points=("model.layers.1",))
    assert list(stages[0].blocks) == ["0"]
    stages, _ = _split(_hf(), 1, split_points=("layers.3",))  # a unique suffix of "model.layers.3"
    assert list(stages[0].blocks) == ["3"]
    with pytest.raises(V17ConfigError, match=r"'model.layers.9' is not a block.*model.layers.0 \.\. model.layers.3"):
        _split(_hf(), 0, split_points=("model.layers.9",))


# ------------------------------------------------------------------------------------------------------ exactness


@pytest.mark.parametrize("kind", sorted(HF_FAMILIES))
def test_hf_stages_chain_to_the_models_own_logits(kind):
    model = _hf(kind)
    ids, pos = _ids_and_packed_positions()
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding: the real tokens must not see these
    with torch.no_grad():
        assert torch.equal(_chained(model, ids), model(input_ids=ids).logits)
        packed = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        assert torch.equal(_chained(model, ids, position_ids=pos), packed)
        padded = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        assert torch.equal(_chained(model, ids, attention_mask=mask), padded)


def test_litgpt_stages_chain_to_the_models_own_logits():
    ids, _ = _ids_and_packed_positions()
    for kw in ({}, {"scale_embeddings": True, "final_logit_softcapping": 5.0}):
        model = _litgpt(**kw)
        with torch.no_grad():
            assert torch.equal(_chained(model, ids), model(ids)), kw


def test_reference_llama_stages_keep_document_boundaries():
    model = _llama()
    ids, pos = _ids_and_packed_positions()
    with torch.no_grad():
        assert torch.equal(_chained(model, ids, position_ids=pos), model(ids, position_ids=pos))
        assert not torch.allclose(_chained(model, ids), model(ids, position_ids=pos))  # boundaries matter here


def test_shifted_token_mean_equals_hf_loss():
    model = _hf()
    ids, pos = _ids_and_packed_positions(rows=4)
    labels = ids.clone()
    labels[0, :5] = -100  # uneven valid tokens per micro-batch
    with torch.no_grad():
        out = model(input_ids=ids, labels=labels, position_ids=pos, use_cache=False)
    loss = PipelineLoss()
    loss.prepare({"input_ids": ids, "labels": labels}, {"labels": labels}, rows=4, padded_rows=4, shift=True)
    total = sum(loss(out.logits[r : r + 1], torch.tensor([r])) for r in range(4))
    assert torch.allclose(total, out.loss, rtol=1e-6, atol=0)
    unshifted = PipelineLoss()
    unshifted.prepare({}, {"labels": labels}, rows=4, padded_rows=4, shift=False)
    assert not torch.allclose(unshifted(out.logits, torch.arange(4)), out.loss)
    assert float(F.cross_entropy(out.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())) == pytest.approx(
        float(out.loss), rel=1e-6
    )
