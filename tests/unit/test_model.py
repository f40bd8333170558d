"""Reference model: the contract other engines depend on (names, stages, TP by shapes), parameter counts equal to
the planner's on the meta device, deterministic init, and the LlamaLM loss/CLI."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_v17.config import V17ConfigError
from lightning_v17.models import BLOCK_TP_PLAN, Llama, LlamaLM, ModelConfig, TransformerBlock
from lightning_v17.planner.model import PRESETS

LLAMA_PRESETS = [n for n, s in PRESETS.items() if str(getattr(s.arch, "value", s.arch)) == "llama"]
TOL = {"atol": 1e-5, "rtol": 1e-5}  # fp32


def small(**kw) -> Llama:
    return Llama(ModelConfig.from_preset("tiny", layers=3, **kw))


@pytest.mark.parametrize("name", LLAMA_PRESETS)
def test_param_count_equals_planner_on_meta_device(name):
    with torch.device("meta"):
        model = Llama(ModelConfig.from_preset(name))
    assert sum(p.numel() for p in model.parameters()) == PRESETS[name].num_params
    assert model.config.to_shape() == PRESETS[name]  # the config round-trips to the preset it came from


def test_known_param_counts():
    # Independent anchors: llama2-7b is 6,738,415,616 (Touvron 2023, HF config); tiny from the brief's formula.
    with torch.device("meta"):
        assert Llama(ModelConfig.from_preset("llama2-7b")).num_params() == 6_738_415_616
    h, v, layers, kv, f = 128, 320, 4, 64, 384
    assert (
        Llama(ModelConfig.from_preset("tiny")).num_params()
        == 2 * v * h + layers * (2 * h * h + 2 * h * kv + 3 * h * f + 2 * h) + h
    )


def test_tied_embeddings_share_one_tensor():
    model = small(tie_embeddings=True)
    assert model.output.weight is model.tok_embeddings.weight
    assert model.num_params() == ModelConfig.from_preset("tiny", layers=3, tie_embeddings=True).num_params()


def test_module_names_follow_the_contract():
    model = small()
    assert isinstance(model.layers, nn.ModuleDict) and list(model.layers) == ["0", "1", "2"]
    names = dict(model.named_modules())
    for sub in (
        "attention_norm",
        "attention.wq",
        "attention.wk",
        "attention.wv",
        "attention.wo",
        "ffn_norm",
        "feed_forward.w1",
        "feed_forward.w2",
        "feed_forward.w3",
    ):
        assert f"layers.1.{sub}" in names
    assert {"tok_embeddings", "norm", "output"} <= set(names)
    plan = model.tensor_parallel_plan()
    assert all(k in names for k in plan)
    assert plan["layers.2.attention.wo"] == "rowwise" and plan["layers.0.feed_forward.w1"] == "colwise"
    assert model.pipeline_split_points() == ["layers.0", "layers.1", "layers.2"]
    assert all(isinstance(u, TransformerBlock) for u in model.recompute_units())


def test_config_errors_name_the_fix():
    with pytest.raises(V17ConfigError, match="kv_heads=3 must divide heads=8"):
        ModelConfig.from_preset("tiny", kv_heads=3)
    with pytest.raises(V17ConfigError, match="unknown model override"):
        ModelConfig.from_preset("tiny", depth=2)
    with pytest.raises(V17ConfigError):
        ModelConfig.from_preset("no-such-model")


def test_pipeline_stages_compose_to_the_full_model():
    torch.manual_seed(0)
    full = small()
    tokens = torch.randint(0, 320, (2, 12))
    pos = torch.cat([torch.arange(5), torch.arange(7)]).expand(2, 12)
    ref = full(tokens, pos)
    first, last = small(), small()  # same weights: init depends only on (seed, parameter name)
    first.norm = first.output = None
    del first.layers["2"]
    last.tok_embeddings = None
    del last.layers["0"], last.layers["1"]
    assert next(n for n, _ in last.named_parameters()).startswith("layers.2.")  # FQNs survive pruning
    hidden = first(tokens, pos)
    assert hidden.shape == (2, 12, 128)
    torch.testing.assert_close(last(hidden, pos), ref, **TOL)


def test_attention_reads_local_heads_from_shapes_like_column_parallel_tp():
    # Split q/k/v heads in two halves (colwise) and wo's input features (rowwise): the sum of the two halves'
    # outputs is the full attention output, as after a TP all-reduce.
    torch.manual_seed(0)
    model = small()
    attn = model.layers["0"].attention
    x = torch.randn(2, 10, 128)
    pos = torch.arange(10).expand(2, 10)
    ref = attn(x, pos)
    hd = attn.head_dim
    parts = []
    for half in range(2):
        shard = Llama(ModelConfig.from_preset("tiny", layers=1)).layers["0"].attention
        q_rows = slice(half * 4 * hd, (half + 1) * 4 * hd)
        kv_rows = slice(half * 2 * hd, (half + 1) * 2 * hd)
        shard.wq = nn.Linear(128, 4 * hd, bias=False)
        shard.wk = nn.Linear(128, 2 * hd, bias=False)
        shard.wv = nn.Linear(128, 2 * hd, bias=False)
        shard.wo = nn.Linear(4 * hd, 128, bias=False)
        with torch.no_grad():
            shard.wq.weight.copy_(attn.wq.weight[q_rows])
            shard.wk.weight.copy_(attn.wk.weight[kv_rows])
            shard.wv.weight.copy_(attn.wv.weight[kv_rows])
            shard.wo.weight.copy_(attn.wo.weight[:, q_rows])
        parts.append(shard(x, pos))
    torch.testing.assert_close(parts[0] + parts[1], ref, **TOL)
    assert set(BLOCK_TP_PLAN.values()) == {"colwise", "rowwise"}


def test_meta_init_then_to_empty_and_init_weights_equals_eager():
    eager = small()
    with torch.device("meta"):
        deferred = small()
    deferred.to_empty(device="cpu")
    deferred.init_weights()
    for (n, a), (_, b) in zip(eager.named_parameters(), deferred.named_parameters(), strict=True):
        assert torch.equal(a, b), n
    other = Llama(ModelConfig.from_preset("tiny", layers=3), init_seed=1)
    assert not torch.equal(other.layers["0"].attention.wq.weight, eager.layers["0"].attention.wq.weight)
    assert torch.equal(eager.norm.weight, torch.ones(128))


# ---- LlamaLM ------------------------------------------------------------------------------------------------------
def test_llamalm_configure_model_is_idempotent_and_loss_honours_labels_and_mask():
    lm = LlamaLM(model_overrides={"layers": 1})
    assert lm.model is None
    lm.configure_model()
    model = lm.model
    lm.configure_model()
    assert lm.model is model
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (2, 8), generator=g)
    labels = torch.randint(0, 256, (2, 8), generator=g)
    labels[0, 3] = labels[1, 7] = -100
    mask = torch.ones(2, 8)
    mask[1, :4] = 0
    batch = {"input_ids": ids, "labels": labels, "loss_mask": mask}
    loss, count = lm.loss(batch)
    logits = model(ids)
    # Reference: an explicit loop over the counted targets.
    terms = [
        F.cross_entropy(logits[b, s][None], labels[b, s][None])
        for b in range(2)
        for s in range(8)
        if labels[b, s] != -100 and mask[b, s] > 0
    ]
    assert int(count) == len(terms) == 10
    torch.testing.assert_close(loss, torch.stack(terms).mean(), **TOL)


def test_cli_help_lists_every_option_with_docstrings():
    from lightning_v17.trainer_cli import run_lightning_cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
        run_lightning_cli(["fit", "--help"])
    assert exit_info.value.code == 0
    text = out.getvalue()
    for option, doc in [
        ("--model.lr", "peak learning rate"),
        ("--model.warmup_steps", "warm-up"),
        ("--model.model_overrides", "ModelConfig fields"),
        ("--data.packing", "first-fit decreasing"),
        ("--data.seq_len", "tokens per row"),
        ("--data.num_workers", "DataLoader worker"),
    ]:
        assert option in text and doc in text, option


def test_main_job_config_parses_and_names_the_zero3_strategy():
    from lightning_v17.trainer_cli import run_lightning_cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
        run_lightning_cli(["fit", "--config", "configs/tiny-cpu.yaml", "--print_config"])
    assert exit_info.value.code == 0
    text = out.getvalue()
    assert "lightning_v17.strategies.V17Strategy" in text and "zero_stage: 3" in text
    assert "model: tiny" in text and "packing: ffd" in text


def test_gpt_presets_are_refused_with_the_reason():
    with pytest.raises(V17ConfigError, match="llama presets only"):
        ModelConfig.from_preset("gpt3-175b")
