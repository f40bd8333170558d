"""Tensor parallel on third-party models with the plans they supply themselves, against a single-process reference.

2 gloo ranks, engine level (no Lightning): Hugging Face ``LlamaForCausalLM`` and ``Qwen2ForCausalLM`` with the plan
of the installed transformers (column/row sharding from ``base_model_tp_plan``, the vocab-parallel input embedding
its ``post_init`` adds -- for Qwen2 with a padding row on the second rank's half of the table -- and the head's
``_tp_plan``), litgpt ``GPT`` (fused ``qkv`` through
``LitGPTAttentionParallel``), and a user-written plan dict of style names. Tiny configs, random weights, fp32, built
identically on every rank from one seed; nothing is downloaded.

Tolerance: 1e-5 relative on every step's loss and on every final parameter (||a - b|| / ||b||, gathered by FQN with
``DTensor.full_tensor()``), after ``STEPS`` AdamW steps (eps as in test_tp.py, for the same reason). Each case also
checks which parameters are sharded, so a plan that silently leaves a module replicated fails even though it would
still compute the right numbers.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from tests._dist import spawn
from tests._models import hf_causal_lm, litgpt_gpt
from tests.dist.test_tp import RTOL, full, make_optimizer, rel_err, rel_loss

STEPS = 4
VOCAB = 128


def _batches(n: int = STEPS, batch: int = 2, seq: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (batch, seq + 1), generator=g)
        out.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    return out


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def _train(model, forward, batches, *, loss_parallel: bool = False) -> tuple[list[float], str]:
    """``STEPS`` AdamW steps; returns the losses and the logits' layout ("plain" or the DTensor placements)."""
    from lightning_v17.engine.tp.apply import loss_parallel_context

    opt = make_optimizer(model.parameters())
    losses, layout = [], "plain"
    for ids, labels in batches:
        opt.zero_grad()
        with loss_parallel_context(loss_parallel):
            logits = forward(model, ids)
            layout = str(tuple(logits.placements)) if hasattr(logits, "placements") else "plain"
            loss = _loss(logits, labels)
            loss.backward()
        opt.step()
        losses.append(float(full(loss.detach())))
    return losses, layout


def _case(base, forward, tp_mesh, plan_fn, *, loss_parallel: bool = False) -> dict:
    """Reference run on a copy, then TP on another copy with ``plan_fn(model)``; losses, params, layout."""
    from lightning_v17.engine.tp.apply import apply_tensor_parallel

    batches = _batches()
    ref = copy.deepcopy(base)
    ref_losses, _ = _train(ref, forward, batches)
    ref_params = {k: v.detach() for k, v in ref.named_parameters()}
    model = copy.deepcopy(base)
    apply_tensor_parallel(model, tp_mesh=tp_mesh, plan=plan_fn(model))
    losses, layout = _train(model, forward, batches, loss_parallel=loss_parallel)
    params = dict(model.named_parameters())
    return {
        "loss_rel": rel_loss(losses, ref_losses),
        "param_rel": max(rel_err(full(v.detach()), ref_params[k]) for k, v in params.items()),
        "fqns_equal": sorted(params) == sorted(ref_params),
        "sharded": sorted(k for k, v in params.items() if hasattr(v, "placements") and v.placements[0].is_shard()),
        "replicated": sorted(
            k for k, v in params.items() if hasattr(v, "placements") and v.placements[0].is_replicate()
        ),
        "losses": losses,
        "logits": layout,
    }


def _tp_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))["tp"]


# ---------------------------------------------------------------------------------------------------- Hugging Face
def _hf_model(family: str):
    # Qwen2's q/k/v carry biases: random ones (std 0.02), not HF's zeros (see hf_causal_lm); Llama has none. Qwen2's
    # padding row (id 100, which the batches hit) lies on rank 1's half of the vocab-parallel embedding.
    return hf_causal_lm(family, bias_std=0.02, **({"pad_token_id": 100} if family == "qwen2" else {}))


def _hf_forward(model, ids):
    return model(input_ids=ids, use_cache=False).logits


def _hf_worker(rank: int, world: int, family: str) -> dict:
    from lightning_v17.models.tp_plans import resolve_tp_plan

    torch.set_num_threads(1)
    tp_mesh = _tp_mesh()
    base = _hf_model(family)
    out = {"own": _case(base, _hf_forward, tp_mesh, resolve_tp_plan)}
    if family == "llama":
        out["own_vocab_loss"] = _case(
            base,
            _hf_forward,
            tp_mesh,
            lambda m: resolve_tp_plan(m, vocab_parallel=True, loss_parallel=True),
            loss_parallel=True,
        )
        user = {
            "model.embed_tokens": "rowwise_rep",
            "model.layers.*.input_layernorm": "replicate",
            "model.layers.*.self_attn.q_proj": "colwise",
            "model.layers.*.self_attn.k_proj": "colwise",
            "model.layers.*.self_attn.v_proj": "colwise",
            "model.layers.*.self_attn.o_proj": "rowwise",
            "model.layers.*.post_attention_layernorm": "replicate",
            "model.layers.*.mlp.gate_proj": "colwise",
            "model.layers.*.mlp.up_proj": "colwise",
            "model.layers.*.mlp.down_proj": "rowwise",
            "model.norm": "replicate",
            "lm_head": "colwise_rep",
        }
        out["user_strings"] = _case(base, _hf_forward, tp_mesh, lambda m: resolve_tp_plan(m, explicit=user))
    return out


def _hf_expected_sharded(layers: int, *, embed: bool = False) -> list[str]:
    names = [
        f"model.layers.{i}.{n}.weight"
        for i in range(layers)
        for n in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        )
    ]
    return sorted([*names, "lm_head.weight", *(["model.embed_tokens.weight"] if embed else [])])


def _check(results: list[dict], expected: dict[str, list[str]]) -> None:
    print({k: {m: v[m] for m in ("loss_rel", "param_rel")} for k, v in results[0].items()})
    for rank_out in results:
        assert set(rank_out) == set(expected), sorted(rank_out)
        for name, r in rank_out.items():
            assert r["loss_rel"] < RTOL, (name, r["loss_rel"], r["losses"])
            assert r["param_rel"] < RTOL, (name, r["param_rel"])
            assert r["fqns_equal"], name
            assert r["sharded"] == expected[name], (name, sorted(set(expected[name]) ^ set(r["sharded"])))
            # loss parallel: the logits stay a vocab-sharded DTensor; otherwise the head gathers them
            assert r["logits"] == ("(Shard(dim=2),)" if name.endswith("_loss") else "plain"), (name, r["logits"])
    for name in expected:  # every rank computed the same (replicated) loss
        assert results[0][name]["losses"] == results[1][name]["losses"], name


@pytest.mark.timeout(240)
def test_hf_llama_own_plan_and_user_string_plan():
    pytest.importorskip("transformers")
    results = spawn(_hf_worker, world_size=2, args=("llama",), timeout=230)
    _check(
        results,
        {
            "own": _hf_expected_sharded(4, embed=True),  # the release's plan shards the input embedding
            "own_vocab_loss": _hf_expected_sharded(4, embed=True),
            "user_strings": _hf_expected_sharded(4, embed=True),
        },
    )
    # "replicate" made the block norms and the final norm Replicate DTensors; the model's own plan leaves them plain
    norms = [f"model.layers.{i}.{n}.weight" for i in range(4) for n in ("input_layernorm", "post_attention_layernorm")]
    for r in results:
        assert r["user_strings"]["replicated"] == sorted([*norms, "model.norm.weight"])
        assert r["own"]["replicated"] == []


@pytest.mark.timeout(240)
def test_hf_qwen2_own_plan():
    pytest.importorskip("transformers")
    results = spawn(_hf_worker, world_size=2, args=("qwen2",), timeout=230)
    expected = _hf_expected_sharded(4, embed=True)
    # column-parallel biases are sharded with their rows
    expected = sorted([*expected, *(f"model.layers.{i}.self_attn.{p}_proj.bias" for i in range(4) for p in "qkv")])
    _check(results, {"own": expected})


# ---------------------------------------------------------------------------------------------------------- litgpt
def _litgpt_forward(model, ids):
    return model(ids)


def _litgpt_worker(rank: int, world: int) -> dict:
    from lightning_v17.models.tp_plans import resolve_tp_plan

    torch.set_num_threads(1)
    tp_mesh = _tp_mesh()
    gqa = litgpt_gpt(2, block_size=32)
    neox = litgpt_gpt(  # MHA, biases, LayerNorm, GptNeoxMLP, parallel residual: pythia's shape
        2,
        block_size=32,
        n_query_groups=4,
        bias=True,
        mlp_class_name="GptNeoxMLP",
        norm_class_name="LayerNorm",
        parallel_residual=True,
    )
    out = {
        "gqa": _case(gqa, _litgpt_forward, tp_mesh, resolve_tp_plan),
        "gqa_vocab_loss": _case(
            gqa,
            _litgpt_forward,
            tp_mesh,
            lambda m: resolve_tp_plan(m, vocab_parallel=True, loss_parallel=True),
            loss_parallel=True,
        ),
        "neox_bias": _case(neox, _litgpt_forward, tp_mesh, resolve_tp_plan),
    }
    # the fused qkv keeps its FQN and its true [q; k; v] layout: this rank's local rows are the contiguous Shard(0)
    # chunk of the unpermuted weight, and attention runs with local head counts
    from lightning_v17.engine.tp.apply import apply_tensor_parallel

    model = copy.deepcopy(gqa)
    apply_tensor_parallel(model, tp_mesh=tp_mesh, plan=resolve_tp_plan(model))
    attn = model.transformer.h[0].attn
    w = gqa.transformer.h[0].attn.qkv.weight
    out["layout"] = {
        "qkv_local_is_chunk": bool(torch.equal(attn.qkv.weight.to_local(), w.chunk(2, dim=0)[rank])),
        "local_heads": (attn.config.n_head, attn.config.n_query_groups, attn.config.head_size),
        "global_heads": (model.config.n_head, model.config.n_query_groups),
    }
    return out


@pytest.mark.timeout(240)
def test_litgpt_own_plan_fused_qkv():
    pytest.importorskip("litgpt")
    results = spawn(_litgpt_worker, world_size=2, timeout=230)
    layouts = [r.pop("layout") for r in results]
    for lay in layouts:
        assert lay == {"qkv_local_is_chunk": True, "local_heads": (2, 1, 16), "global_heads": (4, 2)}, lay
    llama_mlp = [
        f"transformer.h.{i}.{n}.weight"
        for i in range(2)
        for n in ("attn.qkv", "attn.proj", "mlp.fc_1", "mlp.fc_2", "mlp.proj")
    ]
    neox = [
        f"transformer.h.{i}.{n}" for i in range(2) for n in ("attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight")
    ]
    neox += [f"transformer.h.{i}.mlp.{n}" for i in range(2) for n in ("fc.weight", "fc.bias", "proj.weight")]
    _check(
        results,
        {
            "gqa": sorted([*llama_mlp, "lm_head.weight"]),
            "gqa_vocab_loss": sorted([*llama_mlp, "lm_head.weight", "transformer.wte.weight"]),
            "neox_bias": sorted([*neox, "lm_head.weight"]),
        },
    )
