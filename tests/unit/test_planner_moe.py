"""The planner on mixture-of-experts shapes (lightning_v17/planner/moe.py, ``v17 plan --ep``).

References are independent of the code under test: parameter counts written by hand here, Hugging Face's Mixtral,
Qwen3-MoE and DeepSeek-V3 modules counted on the meta device, the published totals typed from the papers and model
cards, dispatch bytes counted by a plain loop over explicit routings, and the saved activations of the real
reference MoE layer (``bench/activations.py``'s storage count).
"""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch

from lightning_v17.config import V17ConfigError, ZeroPolicy
from lightning_v17.planner.cli import main
from lightning_v17.planner.model import MLA, PLANNER_ONLY_PRESETS, PRESETS, ModelShape, get_preset
from lightning_v17.planner.moe import (
    allgather_bytes_per_layer,
    alltoall_bytes_per_layer,
    expert_state_bytes_per_rank,
    moe_report,
    recommend_ep,
)
from lightning_v17.planner.plan import ClusterSpec, ModelSpec, TrainSpec, make_plan
from lightning_v17.planner.throughput import flops_per_token


def _plan(*argv: str) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([*argv, "--json"]) == 0
    return json.loads(out.getvalue())


def _error(capsys, *argv: str) -> str:
    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, f"expected one line on stderr, got {err!r}"
    return err


# ------------------------------------------------------------------------------------------------ parameter counts


def test_tiny_moe_parameters_by_hand() -> None:
    s = get_preset("tiny-moe")  # 4 blocks, the first dense; h=128, kv=64, ffn=384, 4 experts of width 128, top-2
    h, kv, v = 128, 64, 320
    attn_norms = 2 * h * h + 2 * h * kv + 2 * h
    dense = attn_norms + 3 * h * 384
    moe = attn_norms + h * 4 + 4 * 3 * h * 128  # router h x E, then E SwiGLU experts
    assert s.num_params == s.total_params == 2 * v * h + dense + 3 * moe + h == 1_018_496
    assert s.expert_params == 3 * 4 * 3 * h * 128
    assert s.active_params == s.num_params - 3 * 2 * 3 * h * 128  # 2 of 4 experts not run per token, 3 MoE blocks


def test_which_blocks_are_moe() -> None:
    base = {"arch": "llama", "hidden": 16, "heads": 2, "kv_heads": 2, "ffn": 32, "vocab": 8, "seq": 4,
            "num_experts": 2, "experts_per_token": 1}  # fmt: skip
    for layers, every, first in [(6, 2, 1), (7, 3, 0), (4, 1, 4), (5, 1, 2)]:
        expected = sum(1 for i in range(layers) if i >= first and (i - first) % every == 0)
        assert ModelShape(layers=layers, moe_every=every, dense_layers=first, **base).moe_blocks == expected
    assert ModelShape(layers=3, **{**base, "num_experts": 0, "experts_per_token": 0}).moe_blocks == 0


def test_shape_validation_names_the_field() -> None:
    base = {"arch": "llama", "layers": 2, "hidden": 16, "heads": 2, "kv_heads": 2, "ffn": 32, "vocab": 8, "seq": 4}
    with pytest.raises(V17ConfigError, match=r"experts_per_token=3 must be in \[1, num_experts=2\]"):
        ModelShape(**base, num_experts=2, experts_per_token=3)
    with pytest.raises(V17ConfigError, match="experts_per_token=0 must be in"):
        ModelShape(**base, num_experts=2)
    with pytest.raises(V17ConfigError, match="shared_experts=-1 must be an integer >= 0"):
        ModelShape(**base, shared_experts=-1)
    with pytest.raises(V17ConfigError, match="moe_every=0 must be an integer >= 1"):
        ModelShape(**base, moe_every=0)
    with pytest.raises(V17ConfigError, match="llama shapes only"):
        ModelShape(**{**base, "arch": "gpt"}, num_experts=2, experts_per_token=1)
    with pytest.raises(V17ConfigError, match="head_dim=-1"):
        ModelShape(**base, head_dim=-1)


def _hf_params(model_cls, config) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in model_cls(config).parameters())


def test_counts_equal_hugging_face_modules() -> None:
    tf = pytest.importorskip("transformers")
    mixtral = ModelShape("llama", layers=3, hidden=64, heads=8, kv_heads=2, ffn=48, vocab=96, seq=32, num_experts=4,
                         experts_per_token=2)  # fmt: skip
    hf = tf.MixtralConfig(vocab_size=96, hidden_size=64, intermediate_size=48, num_hidden_layers=3,
                          num_attention_heads=8, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
    assert mixtral.num_params == _hf_params(tf.MixtralForCausalLM, hf)

    qwen = ModelShape("llama", layers=3, hidden=64, heads=4, kv_heads=2, ffn=80, vocab=96, seq=32, num_experts=8,
                      experts_per_token=2, expert_ffn=24, head_dim=32)  # fmt: skip
    hf = tf.Qwen3MoeConfig(vocab_size=96, hidden_size=64, intermediate_size=80, moe_intermediate_size=24,
                           num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                           num_experts=8, num_experts_per_tok=2, tie_word_embeddings=False)
    # Qwen3's per-head q_norm and k_norm (head_dim each per block) are the one thing the planner leaves out
    assert qwen.num_params + 3 * 2 * 32 == _hf_params(tf.Qwen3MoeForCausalLM, hf)

    deepseek = ModelShape("llama", layers=4, hidden=64, heads=4, kv_heads=4, ffn=80, vocab=96, seq=32, num_experts=8,
                          experts_per_token=2, shared_experts=1, expert_ffn=24, dense_layers=1,
                          mla=MLA(q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                                  v_head_dim=12))  # fmt: skip
    hf = tf.DeepseekV3Config(vocab_size=96, hidden_size=64, intermediate_size=80, moe_intermediate_size=24,
                             num_hidden_layers=4, first_k_dense_replace=1, num_attention_heads=4,
                             num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8,
                             qk_rope_head_dim=4, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2,
                             n_shared_experts=1, n_group=1, topk_group=1, tie_word_embeddings=False)
    assert deepseek.num_params == _hf_params(tf.DeepseekV3ForCausalLM, hf)


def test_published_totals_and_active_counts() -> None:
    m = get_preset("mixtral-8x7b")  # Jiang 2024: 46.7B total, 12.9B active
    assert m.num_params == pytest.approx(46.7e9, rel=0.01) and m.active_params == pytest.approx(12.9e9, rel=0.01)
    q = get_preset("qwen3-30b-a3b", planner_only=True)  # Qwen3 report / model card: 30.5B total, 3.3B activated
    assert q.num_params == pytest.approx(30.5e9, rel=0.01)
    d = get_preset("deepseek-v3-671b", planner_only=True)  # DeepSeek-V3 report: 671B total, 37B activated
    assert d.num_params == pytest.approx(671e9, rel=0.01)
    # The activated counts are printed to two digits, cut rather than rounded: 3.35B reads "3.3B", 37.55B "37B".
    assert 3.3e9 <= q.active_params < 3.4e9 and 37e9 <= d.active_params < 38e9


def test_reference_presets_and_planner_only_presets() -> None:
    # what ModelConfig.from_preset builds has GQA heads of width hidden/heads; the rest is planner-only
    assert all(not s.head_dim and s.mla is None for s in PRESETS.values())
    assert set(PLANNER_ONLY_PRESETS) == {"qwen3-30b-a3b", "deepseek-v3-671b"}
    with pytest.raises(V17ConfigError, match="counted by the planner only"):
        get_preset("qwen3-30b-a3b")


# -------------------------------------------------------------------------------------------------- memory per rank


def test_expert_bytes_halve_at_ep2_through_the_plan() -> None:
    model = ModelSpec(shape=get_preset("tiny-moe"), name="tiny-moe")
    cluster = ClusterSpec(gpu="cpu", gpus=2)
    mems = {ep: make_plan(model, cluster, TrainSpec(zero=ZeroPolicy(stage=0), precision="fp32", ep=ep)).memory
            for ep in (1, 2)}  # fmt: skip
    experts = 3 * 4 * 3 * 128 * 128  # 589,824 routed-expert parameters, 16 B each in fp32 AdamW (4 + 4 + 8)
    assert mems[1].experts.total == experts * 16
    assert abs(2 * mems[2].experts.total - mems[1].experts.total) <= 1
    dense = (1_018_496 - experts) * 16
    assert (mems[1].model_state, mems[2].model_state) == (dense + experts * 16, dense + experts * 8)


def test_expert_state_follows_zero_over_the_expert_group() -> None:
    n, kw = 1200, {"param_bytes": 2, "grad_bytes": 2, "optimizer_bytes": 12}
    z0, z1, z2, z3 = (ZeroPolicy(stage=s) for s in range(4))
    # ep=1: ordinary parameters, ZeRO-3 shards everything over dp_shard=4
    assert expert_state_bytes_per_rank(n, zero=z3, ep=1, dp_shard=4, **kw).total == n * 16 // 4
    # ep=2: 600 experts' parameters per rank, and V17Strategy's ZeRO shards them again over efsdp = 2 ranks:
    # ZeRO-3 all 16 B, ZeRO-2 the grads (2 B) and optimizer (12 B), ZeRO-1 the optimizer only; ZeRO-0 keeps them whole
    assert expert_state_bytes_per_rank(n, zero=z3, ep=2, dp_shard=4, **kw).total == 600 * 16 // 2
    assert expert_state_bytes_per_rank(n, zero=z2, ep=2, dp_shard=4, **kw).total == 600 * 2 + 600 * 14 // 2
    assert expert_state_bytes_per_rank(n, zero=z1, ep=2, dp_shard=4, **kw).total == 600 * 4 + 600 * 12 // 2
    assert expert_state_bytes_per_rank(n, zero=z0, ep=2, dp_shard=4, **kw).total == 600 * 16
    # the other rule (experts replicated over efsdp at every stage), asked for explicitly
    assert expert_state_bytes_per_rank(n, zero=z3, ep=2, dp_shard=4, shard_over_efsdp=False, **kw).total == 600 * 16
    assert expert_state_bytes_per_rank(n, zero=z1, ep=2, dp_shard=4, shard_over_efsdp=False, **kw).total == 600 * 16


# ---------------------------------------------------------------------------------------------------- dispatch bytes


def _loop_bytes(tokens: int, k: int, ep: int, experts: int, row_bytes: int) -> tuple[int, int]:
    """Bytes rank 0 sends per layer (forward + backward) with each dispatcher, counted row by row on an explicit,
    evenly spread routing (token t's slot j goes to expert (t*k + j) mod E, on rank expert // (E / ep))."""
    local = experts // ep
    owner = [[((t * k + j) % experts) // local for j in range(k)] for t in range(tokens)]
    off_rank = sum(1 for t in range(tokens) for j in range(k) if owner[t][j] != 0)
    alltoall = 2 * 2 * off_rank * row_bytes  # dispatch + combine, forward and backward
    gathered = (ep - 1) * tokens * k  # rows rank 0 sends to the other ranks in the all-gather (and its reduce-scatter)
    # rows of the other ranks (same routing) that rank 0's experts compute and send back (and receive grads for)
    back = (ep - 1) * sum(1 for t in range(tokens) for j in range(k) if owner[t][j] == 0)
    return alltoall, 2 * (gathered + back) * row_bytes


@pytest.mark.parametrize(("tokens", "k", "ep", "experts"), [(10, 2, 2, 4), (16, 2, 4, 8), (12, 3, 3, 6), (8, 1, 1, 4)])
def test_dispatch_bytes_by_a_loop(tokens: int, k: int, ep: int, experts: int) -> None:
    hidden, element = 8, 2
    alltoall, allgather = _loop_bytes(tokens, k, ep, experts, hidden * element)
    assert alltoall_bytes_per_layer(tokens, top_k=k, hidden=hidden, ep=ep, element_bytes=element) == alltoall
    assert allgather_bytes_per_layer(tokens, top_k=k, hidden=hidden, ep=ep, element_bytes=element) == allgather


def test_dispatch_bytes_per_step_by_hand() -> None:
    s = ModelShape("llama", layers=2, hidden=8, heads=2, kv_heads=2, ffn=16, vocab=10, seq=4, num_experts=4,
                   experts_per_token=2, expert_ffn=4)  # fmt: skip
    two = moe_report(s, ep=2, dp=2, tokens_per_rank=10, activation_bytes=2, microbatches=3)
    rows = 10 * 2 * 8 * 2  # tokens x k x hidden x bytes, per layer and micro-batch
    assert two.alltoall_bytes_per_step == 3 * 2 * (4 * rows // 2)  # 3 micro-batches x 2 MoE blocks
    assert two.allgather_bytes_per_step == 3 * 2 * (2 * rows + 2 * rows // 2) and two.dispatcher == "alltoall"
    one = moe_report(s, ep=1, dp=2, tokens_per_rank=10, activation_bytes=2)
    assert (one.alltoall_bytes_per_step, one.allgather_bytes_per_step) == (0, 0)


# ----------------------------------------------------------------------------------------------------- FLOPs and MFU


def test_flops_count_the_active_parameters() -> None:
    s, seq = get_preset("tiny-moe"), 512
    h, kv, v, L = 128, 64, 320, 4
    attn = 2 * h * h + 2 * h * kv
    matmul = (attn + 3 * h * 384) + 3 * (attn + h * 4 + 2 * 3 * h * 128)  # 1 dense block, 3 MoE blocks run top-2
    assert flops_per_token(s, seq=seq) == 3 * (2 * matmul + L * 4 * seq * h + 2 * v * h)
    everything = ModelShape("llama", layers=4, hidden=128, heads=8, kv_heads=4, ffn=384, vocab=320, seq=512,
                            num_experts=4, experts_per_token=4, expert_ffn=128, dense_layers=1)  # fmt: skip
    assert flops_per_token(everything, seq=seq) - flops_per_token(s, seq=seq) == 3 * 2 * (3 * 2 * 3 * h * 128)
    plan = make_plan(ModelSpec(shape=s), ClusterSpec(gpu="cpu", gpus=2), TrainSpec(precision="fp32"))
    tokens = plan.layout.global_batch * plan.layout.seq
    assert plan.model_flops_per_step == flops_per_token(s, seq=seq) * tokens  # MFU is against active FLOPs


# ---------------------------------------------------------------------------------------------------- activations


@pytest.mark.parametrize("shared", [0, 1])
@pytest.mark.parametrize("recompute", ["none", "selective"])
@pytest.mark.parametrize(("dtype", "element"), [(torch.float32, 4), (torch.bfloat16, 2)])
def test_moe_block_activations_match_the_reference_layer(shared, recompute, dtype, element) -> None:
    from bench.activations import measure_saved_activation_bytes_per_layer
    from lightning_v17.models.config import ModelConfig
    from lightning_v17.planner.memory import activation_bytes_per_layer_of
    from lightning_v17.planner.moe import moe_activation_delta_bytes_per_layer

    config = ModelConfig(vocab_size=64, hidden=128, layers=2, heads=8, kv_heads=4, ffn=384, max_seq_len=64,
                         num_experts=4, experts_per_token=2, expert_ffn=64, shared_experts=shared)  # fmt: skip
    shape = config.to_shape(64)
    measured = measure_saved_activation_bytes_per_layer(config, recompute=recompute, dtype=dtype, seq=64, micro_batch=2)
    planned = activation_bytes_per_layer_of(shape, seq=64, micro_batch=2, recompute=recompute, element_bytes=element)
    planned += moe_activation_delta_bytes_per_layer(shape, seq=64, micro_batch=2, recompute=recompute,
                                                    element_bytes=element)  # fmt: skip
    assert measured == pytest.approx(planned, rel=0.01)


# ------------------------------------------------------------------------------------------------ recipes and the CLI


def test_recommend_ep_by_hand() -> None:
    # the largest divisor of dp_shard that divides the experts (every rank keeps whole experts)
    assert [recommend_ep(e, dp_shard=d) for e, d in [(8, 16), (8, 12), (256, 2048), (128, 96), (6, 4), (0, 8)]] == [
        8, 4, 256, 32, 2, 1]


def test_mixtral_on_16_gpus_json_has_the_moe_keys() -> None:
    out = _plan("--model", "mixtral-8x7b", "--gpus", "16", "--ep", "8")
    experts = 32 * 8 * 3 * 4096 * 14336
    moe, per_rank = out["moe"], out["per_rank"]
    assert (moe["ep"], moe["efsdp"], moe["experts_per_rank"], moe["expert_params"]) == (8, 2, 1, experts)
    assert moe["dispatcher"] == "alltoall" and "all-gather" in moe["why"] and "\n" not in moe["why"]
    assert out["layout"]["zero_stage"] == 3
    # bf16 AdamW, 16 B/param: ZeRO-3 splits the rank's expert over the efsdp=2 ranks that hold it
    assert per_rank["expert_model_state_bytes"] == experts // 8 * 16 // 2
    assert per_rank["model_state_bytes"] == per_rank["expert_model_state_bytes"] + per_rank["dense_model_state_bytes"]
    assert per_rank["expert_param_bytes"] == experts // 8 * 2 // 2 and out["layout"]["ep"] == 8
    tokens = 32768  # micro-batch 1 x seq 32768, one micro-batch
    assert moe["alltoall_bytes_per_step"] == 32 * 4 * tokens * 2 * 4096 * 2 * 7 // 8
    comm = {c["name"]: (c["axis"], c["bytes_per_step"]) for c in out["comm"]["collectives"]}
    assert comm["ep alltoall (tokens, dispatch+combine)"][0] == "ep"
    # stage 3 over efsdp=2 (ring fraction 1/2): bf16 params gathered in forward and backward, bf16 grads scattered
    assert comm["efsdp all-gather (params, fwd+bwd) of the experts"] == ("efsdp", 2 * (experts // 8) * 2 // 2)
    assert comm["efsdp reduce-scatter (grads) of the experts"] == ("efsdp", (experts // 8) * 2 // 2)
    # ZeRO-1 keeps each rank's expert parameters whole, splits their optimizer state over the efsdp=2 ranks:
    # bf16 grads reduce-scattered and bf16 params all-gathered over them, ring fraction 1/2
    z1 = _plan("--model", "mixtral-8x7b", "--gpus", "16", "--ep", "8", "--zero-stage", "1")
    assert z1["per_rank"]["expert_param_bytes"] == experts // 8 * 2
    assert z1["per_rank"]["expert_model_state_bytes"] == experts // 8 * (4 + 12 // 2)
    z1_comm = {c["name"]: (c["axis"], c["bytes_per_step"]) for c in z1["comm"]["collectives"]}
    assert z1_comm["efsdp reduce-scatter (grads) of the experts"] == ("efsdp", (experts // 8) * 2 // 2)
    assert z1_comm["efsdp all-gather (params) of the experts"] == ("efsdp", (experts // 8) * 2 // 2)
    # ZeRO-0 keeps each rank's expert whole on both efsdp ranks and all-reduces its gradient over them
    z0 = _plan("--model", "mixtral-8x7b", "--gpus", "16", "--ep", "8", "--zero-stage", "0")
    assert {c["name"]: c["axis"] for c in z0["comm"]["collectives"]}["edp all-reduce (expert grads)"] == "edp"
    # left unset, the tree picks FSDP + EP8 itself (experts are 97% of the parameters)
    auto = _plan("--model", "mixtral-8x7b", "--gpus", "16", "--rule-of-thumb")
    assert (auto["layout"]["ep"], auto["recommendation"]["ep"], auto["layout"]["tp"]) == (8, 8, 1)


def test_dense_plans_have_no_moe_keys() -> None:
    out = _plan("--model", "llama3-8b", "--gpus", "8")
    assert "moe" not in out and "ep" not in out["layout"] and "expert_param_bytes" not in out["per_rank"]


def test_bad_ep_is_one_line_naming_the_option(capsys) -> None:
    argv = ["--model", "mixtral-8x7b", "--gpus", "16", "--tp", "1", "--pp", "1"]
    assert "--ep 3 must divide the data-parallel size dp_shard=16" in _error(capsys, *argv, "--ep", "3")
    assert "--ep 16 must divide the 8 experts" in _error(capsys, *argv, "--ep", "16")
    assert "this model has none (use --ep 1)" in _error(capsys, "--model", "tiny", "--ep", "2")


def test_dispatch_that_dominates_the_step_warns_once() -> None:
    crossing = _plan("--model", "qwen3-30b-a3b", "--gpus", "64", "--ep", "64")  # ep spans 8 nodes
    inside = _plan("--model", "qwen3-30b-a3b", "--gpus", "64", "--ep", "8")  # one node: NVLink
    def lines(out: dict) -> list[str]:
        return [w for w in out["recommendation"]["warnings"] if w.startswith("MoE dispatch dominates")]
    assert len(lines(crossing)) == 1 and "ep <= 8" in lines(crossing)[0] and lines(inside) == []


def test_ep_with_tp_is_planned_without_a_rule_warning() -> None:
    # ep x tp composes, with tp's sequence parallelism (on by default at tp > 1; tests/dist/test_ep_tp_sp.py) and
    # without it (tests/dist/test_ep_tp.py): the rules warn about neither
    for sp in ((), ("--no-sp",)):
        out = _plan("--model", "mixtral-8x7b", "--gpus", "16", "--tp", "2", "--ep", "2", *sp)
        assert out["layout"]["ep"] == 2 and out["layout"]["sp"] == (not sp), out["layout"]
        assert not any(w.startswith("ep=2") for w in out["recommendation"]["warnings"]), out["recommendation"]


def test_the_tree_keeps_ep_with_optimizer_offload_and_drops_it_with_parameter_offload() -> None:
    """The tree's recipe applies ep on layouts of data parallelism alone (its own scope: ep with parameter offload
    runs, tests/dist/test_ep_offload.py, and is planned when asked for with --ep)."""
    tree = ("--model", "mixtral-8x7b", "--gpus", "16", "--rule-of-thumb")
    assert _plan(*tree, "--offload-optimizer", "cpu")["layout"]["ep"] == 8
    assert _plan(*tree, "--offload-params", "cpu")["layout"]["ep"] == 1
