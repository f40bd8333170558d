"""Tensor-parallel plans: style names, wildcard expansion, errors, and where a plan comes from. Pure: no process group.

Plans are expanded and validated before anything is sharded, so every error here is raised with a stand-in mesh
that only knows its size.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from lightning_v17.config import V17ConfigError
from lightning_v17.engine.tp.apply import (
    PARALLEL_STYLES,
    apply_tensor_parallel,
    expand_plan,
    llama_tp_plan,
    parallel_style,
)
from lightning_v17.models import Llama, ModelConfig
from lightning_v17.models.tp_plans import ModelTPPlan, llama_default_roles, resolve_tp_plan
from tests._models import hf_causal_lm, litgpt_gpt

ENGINE = Path(__file__).resolve().parents[2] / "lightning_v17" / "engine" / "tp" / "apply.py"


class _FakeMesh:
    """Stands in for a 1-D tp DeviceMesh of size ``n``: plans are checked before any collective."""

    def __init__(self, n: int = 2) -> None:
        self.n = n

    def size(self) -> int:
        return self.n


class _Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(8, 8)
        self.o = nn.Linear(8, 8)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = _Attn()
        self.norm = nn.LayerNorm(8)


class _Net(nn.Module):
    def __init__(self, layers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.layers = nn.ModuleList(_Block() for _ in range(layers))
        self.head = nn.Linear(8, 16)


def _hf_llama(**kw):
    return hf_causal_lm("llama", layers=2, **kw)


def _litgpt(**kw):
    # block size 32 and litgpt's default partial rotary (0.25); weights from whatever the RNG holds
    return litgpt_gpt(2, seed=None, block_size=32, rotary_percentage=0.25, **kw)


# ---------------------------------------------------------------------------------------------------- engine side
def test_engine_imports_nothing_from_models():
    tree = ast.parse(ENGINE.read_text())
    mods = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    mods |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not {m for m in mods if m.startswith("lightning_v17.models")}, mods


def test_engine_shards_the_plan_it_is_handed_and_looks_for_none():
    """No plan is a refusal that names the resolver, even on a module that carries a hook and a ``tp_plan`` dict:
    finding those is ``resolve_tp_plan``'s job alone."""
    net = _Net()
    net.tp_plan = {"head": "colwise"}
    net.configure_tensor_parallel = lambda mesh: pytest.fail("the engine called the module's hook itself")
    with pytest.raises(V17ConfigError, match=r"tp=2 needs a tensor-parallel plan for _Net: pass plan=.*resolve_tp_plan"):
        apply_tensor_parallel(net, tp_mesh=_FakeMesh(), plan=None)


def test_style_names_map_to_dtensor_styles():
    assert type(parallel_style("colwise")) is ColwiseParallel
    assert type(parallel_style("rowwise")) is RowwiseParallel
    for name in ("colwise_rep", "colwise_gather_output"):
        style = parallel_style(name)
        assert type(style) is ColwiseParallel and style.output_layouts == (Replicate(),)
    for name in ("rowwise_rep", "rowwise_split_input", "embedding_rowwise"):
        rep_in = parallel_style(name)  # on an nn.Embedding it also keeps the weight's gradient Shard(0)
        assert isinstance(rep_in, RowwiseParallel) and rep_in.input_layouts == (Replicate(),)
    assert type(parallel_style("sequence_parallel")) is SequenceParallel
    assert type(parallel_style("replicate")).__name__ == "_ReplicateParallel"
    assert parallel_style("colwise") is not parallel_style("colwise")  # a fresh object per module
    obj = RowwiseParallel(output_layouts=Replicate())
    assert parallel_style(obj) is obj  # a ParallelStyle is taken as is
    assert {"colwise", "rowwise", "colwise_rep", "rowwise_rep", "sequence_parallel", "replicate"} <= set(
        PARALLEL_STYLES
    )


def test_unknown_style_names_the_key_and_lists_supported():
    with pytest.raises(V17ConfigError) as e:
        expand_plan(_Net(), {"layers.*.attn.q": "packed_colwise"})
    msg = str(e.value)
    assert "'packed_colwise'" in msg and "'layers.*.attn.q'" in msg
    assert all(name in msg for name in ("colwise", "rowwise_rep", "sequence_parallel", "replicate"))
    with pytest.raises(V17ConfigError, match="unknown tensor-parallel style"):
        apply_tensor_parallel(_Net(), tp_mesh=_FakeMesh(), plan={"head": 3})  # checked before anything is sharded


def test_wildcard_matches_exactly_one_component():
    net = _Net(layers=3)
    plan = expand_plan(net, {"layers.*.attn.q": "colwise", "layers.*.attn.o": RowwiseParallel(), "head": "colwise_rep"})
    assert list(plan) == [
        "layers.0.attn.q",
        "layers.1.attn.q",
        "layers.2.attn.q",
        "layers.0.attn.o",
        "layers.1.attn.o",
        "layers.2.attn.o",
        "head",
    ]
    assert all(type(plan[f"layers.{i}.attn.q"]) is ColwiseParallel for i in range(3))
    assert list(expand_plan(net, {"layers.*": "replicate"})) == ["layers.0", "layers.1", "layers.2"]
    assert list(expand_plan(net, {"*.1.*": "replicate"})) == ["layers.1.attn", "layers.1.norm"]
    assert list(expand_plan(net, {"layers.1.attn.q": "colwise"})) == ["layers.1.attn.q"]
    with pytest.raises(V17ConfigError, match="'layers.\\*.q'"):  # '*' is one component, not a path
        expand_plan(net, {"layers.*.q": "colwise"})


def test_unmatched_key_is_named_with_near_names():
    with pytest.raises(V17ConfigError) as e:
        expand_plan(_Net(), {"layers.*.atn.q": "colwise"})
    assert "'layers.*.atn.q'" in str(e.value) and "did you mean 'layers.*.attn.q'" in str(e.value)
    with pytest.raises(V17ConfigError, match="'head.weight'"):  # keys are modules, not parameters
        expand_plan(_Net(), {"head.weight": "colwise"})
    with pytest.raises(V17ConfigError, match="'layers.7.attn.q'"):  # out of range in a ModuleList
        expand_plan(_Net(), {"layers.7.attn.q": "colwise"})


def test_parts_on_other_pipeline_stages_are_skipped():
    net = _Net(layers=4)
    # what a pipeline split leaves on a middle stage: no embedding or head, blocks 2 and 3 under their indices
    net.layers = nn.ModuleDict({"2": net.layers[2], "3": net.layers[3]})
    net.embed = None
    net.head = None
    plan = {"embed": "rowwise_rep", "layers.*.attn.q": "colwise", "layers.0.attn.o": "rowwise", "head": "colwise_rep"}
    assert list(expand_plan(net, plan)) == ["layers.2.attn.q", "layers.3.attn.q"]
    with pytest.raises(V17ConfigError, match="'layers.\\*.attn.k'"):  # a typo is still an error on a stage
        expand_plan(net, {"layers.*.attn.k": "colwise"})


def test_two_keys_giving_one_module_different_styles_are_refused():
    with pytest.raises(V17ConfigError, match="'layers.1.attn.q'"):
        expand_plan(_Net(), {"layers.*.attn.q": "colwise", "layers.1.attn.q": "rowwise"})
    assert list(expand_plan(_Net(2), {"layers.*.attn.q": "colwise", "layers.1.attn.q": "colwise"})) == [
        "layers.0.attn.q",
        "layers.1.attn.q",
    ]


def test_plan_that_would_untie_weights_is_refused_before_sharding():
    net = _Net()
    net.head.weight = net.embed.weight  # tied [16, 8]
    with pytest.raises(V17ConfigError, match="untie the shared parameter"):
        apply_tensor_parallel(net, tp_mesh=_FakeMesh(), plan={"head": "colwise_rep"})
    with pytest.raises(V17ConfigError, match="untie"):
        apply_tensor_parallel(net, tp_mesh=_FakeMesh(), plan={"embed": "rowwise_rep", "head": "colwise"})
    assert net.head.weight is net.embed.weight and not hasattr(net.head.weight, "placements")
    # one module object under two names is not a tie: sharding it moves its parameters for both names
    from lightning_v17.engine.tp.apply import _check_shared_parameters

    shared = _Net()
    shared.alias = shared.head
    _check_shared_parameters(shared, ["head"])


def test_callable_plan_applies_itself_and_size_one_is_a_no_op():
    seen = []
    net = _Net()
    apply_tensor_parallel(net, tp_mesh=_FakeMesh(), plan=lambda m, mesh: seen.append((m, mesh.size())))
    assert seen == [(net, 2)]
    apply_tensor_parallel(net, tp_mesh=_FakeMesh(1), plan={"nothing": "colwise"})  # tp=1: nothing to do


# ------------------------------------------------------------------------------------------------ model families
def test_hf_divisibility_errors_list_valid_tp():
    plan = resolve_tp_plan(_hf_llama(num_attention_heads=8, num_key_value_heads=4, intermediate_size=192))
    assert isinstance(plan, ModelTPPlan)
    plan.validate(4)
    with pytest.raises(V17ConfigError) as e:
        plan.validate(3)
    assert "tp=3 must divide num_attention_heads=8, num_key_value_heads=4" in str(e.value)
    assert "try tp in {1, 2, 4}" in str(e.value)
    with pytest.raises(V17ConfigError, match="tp=3 must divide"):
        apply_tensor_parallel(_hf_llama(), tp_mesh=_FakeMesh(3), plan=resolve_tp_plan(_hf_llama()))
    vocab = resolve_tp_plan(_hf_llama(vocab_size=130), vocab_parallel=True)
    with pytest.raises(V17ConfigError, match="vocab_size=130"):
        vocab.validate(4)


def test_litgpt_divisibility_errors_list_valid_tp():
    plan = resolve_tp_plan(_litgpt(n_head=8, n_query_groups=2, intermediate_size=96))
    plan.validate(2)
    with pytest.raises(V17ConfigError) as e:
        plan.validate(4)
    assert "tp=4 must divide n_query_groups=2; try tp in {1, 2}" in str(e.value)
    with pytest.raises(V17ConfigError, match="tp=3 must divide n_head=8, n_query_groups=2"):
        plan.validate(3)


def test_hf_plan_is_base_model_plan_under_prefix_plus_head():
    model = _hf_llama()
    plan = resolve_tp_plan(model)
    assert plan.styles["model.layers.*.self_attn.q_proj"] == "colwise"
    assert plan.styles["model.layers.*.mlp.down_proj"] == "rowwise"
    assert plan.styles["lm_head"] == "colwise_gather_output"  # from the class _tp_plan
    # the vocab-parallel input embedding the release adds to the instance plan (post_init), in HF's style name
    assert plan.styles["model.embed_tokens"] == "embedding_rowwise"
    assert {k: v for k, v in plan.styles.items() if k in model.tp_plan} == model.tp_plan  # HF's plan, unchanged
    assert len(expand_plan(model, plan.styles)) == 2 * 7 + 2
    assert plan.sources == ("hf LlamaForCausalLM at ''",)


def test_hf_tied_embeddings_keep_the_head_replicated():
    model = _hf_llama(tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    plan = resolve_tp_plan(model)
    assert "model.layers.*.self_attn.q_proj" in plan.styles
    assert "lm_head" not in plan.styles and "model.embed_tokens" not in plan.styles  # sharding either unties them
    with pytest.raises(V17ConfigError, match="tie_word_embeddings"):
        resolve_tp_plan(model, vocab_parallel=True)


def test_options_a_family_cannot_honour_are_refused():
    with pytest.raises(V17ConfigError, match="sequence_parallel=True is supported for torchtitan-shaped"):
        resolve_tp_plan(_hf_llama(), sequence_parallel=True)
    with pytest.raises(V17ConfigError, match="sequence_parallel"):
        resolve_tp_plan(_litgpt(), sequence_parallel=True)
    moe = _litgpt(mlp_class_name="LLaMAMoE", n_expert=2, n_expert_per_token=1, moe_intermediate_size=32)
    with pytest.raises(V17ConfigError, match="LLaMAMoE"):
        resolve_tp_plan(moe)


def test_hf_style_not_implemented_here_is_refused_when_resolved():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3Config(
        hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        vocab_size=128, head_dim=16,
    )  # fmt: skip
    with pytest.raises(V17ConfigError) as e:  # Qwen3's q/k norms need a gradient all-reduce this engine lacks
        resolve_tp_plan(transformers.Qwen3ForCausalLM(cfg))
    assert "'replicated_with_grad_allreduce'" in str(e.value) and "self_attn.q_norm" in str(e.value)


def test_litgpt_plan_shards_fused_attention_as_a_unit():
    plan = resolve_tp_plan(_litgpt())
    assert type(plan.styles["transformer.h.*.attn"]).__name__ == "LitGPTAttentionParallel"
    assert "transformer.h.*.attn.qkv" not in plan.styles  # never a plain column shard of [q; k; v]
    assert plan.styles["transformer.h.*.mlp.fc_1"] == "colwise" and plan.styles["lm_head"] == "colwise_rep"
    loss = resolve_tp_plan(_litgpt(), vocab_parallel=True, loss_parallel=True)
    assert loss.styles["transformer.wte"] == "rowwise_rep"
    assert loss.styles["lm_head"].output_layouts == (torch.distributed.tensor.Shard(-1),)


def test_llama_without_its_own_roles_gets_megatron_defaults():
    cfg = ModelConfig(vocab_size=64, hidden=32, layers=2, heads=4, kv_heads=2, ffn=64, max_seq_len=16)
    torch.manual_seed(0)
    model = Llama(cfg)
    with_hook = resolve_tp_plan(model)
    assert llama_default_roles(model) == model.tensor_parallel_plan()

    class Bare(Llama):
        tensor_parallel_plan = None  # a torchtitan-shaped model that does not name its roles

    torch.manual_seed(0)
    bare = resolve_tp_plan(Bare(cfg))
    assert {k: type(v) for k, v in bare.styles.items()} == {k: type(v) for k, v in with_hook.styles.items()}
    with pytest.raises(V17ConfigError, match="tensor_parallel_plan"):  # the engine alone has no default table
        llama_tp_plan(Bare(cfg))


# ------------------------------------------------------------------------------------------------------ resolution
class _Module(nn.Module):
    """A LightningModule stand-in holding a Hugging Face model under ``net``."""

    def __init__(self, net: nn.Module, *, hook: bool = False, tp_plan: dict | None = None) -> None:
        super().__init__()
        self.net = net
        self.hooked = []
        if tp_plan is not None:
            self.tp_plan = tp_plan
        if hook:
            self.configure_tensor_parallel = lambda mesh: self.hooked.append(mesh)


def test_resolution_order_explicit_then_hook_then_model():
    hf = _hf_llama()
    user = {"net.lm_head": "colwise_rep"}
    attr = {"net.model.layers.*.mlp.up_proj": "colwise"}
    full = _Module(hf, hook=True, tp_plan=attr)
    assert resolve_tp_plan(full, explicit=user) == user  # 1. the strategy's tp_plan= beats everything
    hooked = resolve_tp_plan(full)  # 2a. the configure_tensor_parallel hook
    mesh = _FakeMesh()
    hooked(full, mesh)
    assert full.hooked == [mesh]
    assert resolve_tp_plan(_Module(hf, tp_plan=attr)) == attr  # 2b. a tp_plan dict
    own = resolve_tp_plan(_Module(hf))  # 3. the model's own, keyed relative to the module
    assert isinstance(own, ModelTPPlan) and own.sources == ("hf LlamaForCausalLM at 'net'",)
    assert own.styles["net.lm_head"] == "colwise_gather_output"
    assert own.styles["net.model.layers.*.self_attn.k_proj"] == "colwise"
    with pytest.raises(V17ConfigError, match="'net.lm_hed'"):  # an explicit plan is checked when resolved
        resolve_tp_plan(_Module(hf), explicit={"net.lm_hed": "colwise"})


def test_no_plan_anywhere_names_the_three_ways():
    with pytest.raises(V17ConfigError) as e:
        resolve_tp_plan(_Net())
    msg = str(e.value)
    assert "tp_plan=" in msg and "configure_tensor_parallel" in msg and "base_model_tp_plan" in msg


def test_model_plan_options_with_a_user_plan_are_refused_not_ignored():
    """sequence_parallel=True shapes the model's own plan only; with the user's plan it cannot apply: refused."""
    model = Llama(ModelConfig.from_preset("tiny", layers=2))
    with pytest.raises(V17ConfigError, match=r"TPPolicy\(plan=\.\.\.\) decides the layout"):
        resolve_tp_plan(model, explicit={"layers.*.attention.wq": "colwise"}, sequence_parallel=True)
    assert resolve_tp_plan(model, explicit={"layers.*.attention.wq": "colwise"}) == {"layers.*.attention.wq": "colwise"}
