"""FP8 (issue 12, first slice), single process: the layer rule, the float8 matmul count per step, and the errors.

* Layer rule on the reference Llama and a tiny HF Llama: exactly the blocks' Linears are converted (FQNs listed);
  embeddings, the output head and norms keep their classes; a Linear with a dim not divisible by 16 is kept and all
  such layers are named in ONE warning; ``fp8_skip`` keeps more out; a pattern matching nothing is an error.
* The matmuls really run in float8: ``torch._scaled_mm`` (what torchao's ``addmm_float8_unwrapped`` calls on every
  device, CPU included) is counted per training step. torchao 0.18's ``Float8Linear`` runs three float8 GEMMs per
  Linear per step (``output``, ``grad_input``, ``grad_weight``; the autograd function
  ``matmul_with_hp_or_float8_args`` in ``float8_linear.py``) for both recipes, even when the input needs no gradient
  (checked below); full recompute reruns the forward (4), selective saves the float8 GEMMs' outputs (3).
* Errors name the option and the fix: ``fp8_backend='te'`` on CPU, ``fp8='delayed'``, ``fp8='rowwise'`` with tp > 1.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from lightning_v17.config import FP8Backend, FP8Policy, V17ConfigError, ZeroPolicy
from lightning_v17.engine.fp8.convert import apply_fp8, resolve_fp8_backend, select_fp8_linears
from lightning_v17.engine.zero.fsdp import find_wrap_units

pytest.importorskip("torchao")
from torchao.float8.float8_linear import Float8Linear

_BLOCK = ("attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1", "feed_forward.w2",
          "feed_forward.w3")  # fmt: skip


def _llama(layers: int = 2):
    from lightning_v17.models import ModelConfig
    from lightning_v17.models.llama import Llama

    return Llama(ModelConfig.from_preset("tiny", layers=layers))  # hidden 128, 8 heads (dim 16), kv 64, ffn 384


def _convert(model: nn.Module, recipe: str = "tensorwise", skip=()) -> tuple[str, ...]:
    return apply_fp8(model, policy=FP8Policy(recipe, skip=skip), units=find_wrap_units(model), device="cpu")


def _types(model: nn.Module) -> dict[str, type]:
    return {n: type(m) for n, m in model.named_modules()}


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_reference_llama_converts_exactly_the_block_linears(recipe):
    model = _llama()
    weights = {n: p for n, p in model.named_parameters()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every dim divides 16: no warning at all
        done = _convert(model, recipe)
    assert done == tuple(f"layers.{i}.{n}" for i in range(2) for n in _BLOCK)
    types = _types(model)
    assert all(types[f] is Float8Linear for f in done)
    assert types["output"] is nn.Linear and types["tok_embeddings"] is nn.Embedding
    assert all(types[f"layers.{i}.{n}"].__name__ == "RMSNorm" for i in range(2) for n in ("attention_norm", "ffn_norm"))
    assert types["norm"].__name__ == "RMSNorm"
    # FQNs and the Parameter objects are unchanged (ZeRO, the optimizer and checkpoints see the same parameters)
    assert {n: p for n, p in model.named_parameters()} == weights
    assert _convert(model, recipe) == done and _types(model) == types  # idempotent: never wrapped twice


def test_a_meta_device_model_converts_then_materializes_with_its_own_init():
    """ZeRO-3 builds ``configure_model`` on the meta device: the swap must not allocate, and the deferred init
    (``init_weights`` by FQN) must give the same weights as an eagerly built model."""
    from lightning_v17.engine.zero.meta_init import materialize_meta_module

    eager = _llama()
    with torch.device("meta"):
        model = _llama()
    done = _convert(model)
    assert len(done) == 14 and all(p.is_meta for p in model.parameters())
    materialize_meta_module(model, device=torch.device("cpu"))
    assert type(model.layers["0"].attention.wq) is Float8Linear
    for n, p in eager.named_parameters():
        assert torch.equal(model.get_parameter(n), p), n


def test_hf_llama_dims_not_divisible_by_16_are_kept_and_named_in_one_warning():
    from tests._models import hf_llama

    model = hf_llama(layers=2, intermediate_size=120)  # gate/up: out 120, down: in 120; 120 % 16 == 8
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        done = _convert(model)
    fp8_warnings = [str(w.message) for w in caught if "fp8=" in str(w.message)]
    assert len(fp8_warnings) == 1, fp8_warnings
    kept = [f"model.layers.{i}.mlp.{n}" for i in range(2) for n in ("gate_proj", "up_proj", "down_proj")]
    assert all(k in fp8_warnings[0] for k in kept) and "divisible by 16" in fp8_warnings[0]
    assert "6 Linear layer(s)" in fp8_warnings[0] and "(in_features=128" not in fp8_warnings[0]
    attn = ("q_proj", "k_proj", "v_proj", "o_proj")
    assert done == tuple(f"model.layers.{i}.self_attn.{n}" for i in range(2) for n in attn)
    types = _types(model)
    assert all(types[k] is nn.Linear for k in kept)
    assert types["lm_head"] is nn.Linear and types["model.embed_tokens"] is nn.Embedding


def test_fp8_skip_keeps_matching_layers_and_whole_blocks_and_refuses_a_pattern_matching_nothing():
    model = _llama(layers=3)
    done = _convert(model, skip=("*.feed_forward.w2", "layers.1"))
    expect = tuple(f"layers.{i}.{n}" for i in (0, 2) for n in _BLOCK if n != "feed_forward.w2")
    assert done == expect
    types = _types(model)
    assert types["layers.0.feed_forward.w2"] is nn.Linear and types["layers.1.attention.wq"] is nn.Linear
    other = _llama()
    sel = select_fp8_linears(other, units=find_wrap_units(other), skip=("*.wq",))
    assert sel.kept_by_skip == ("layers.0.attention.wq", "layers.1.attention.wq") and sel.outside_blocks == ("output",)
    with pytest.raises(V17ConfigError, match=r"FP8Policy\(skip=.*\['\*\.w9'\]\): .* match no module"):
        _convert(_llama(), skip=("*.w9",))


def test_a_model_without_blocks_or_without_convertible_linears_is_refused():
    flat = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
    with pytest.raises(V17ConfigError, match=r"fp8='tensorwise' .* no repeated blocks.*wrap_classes"):
        _convert(flat)
    with pytest.raises(V17ConfigError, match=r"would convert no Linear.*loosen FP8Policy\(skip=\.\.\.\)"):
        _convert(_llama(), skip=("layers.*",))


class _ScaledMMCounter:
    """Counts ``torch._scaled_mm`` calls and checks that their operands are float8."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[torch.dtype] = []
        orig = torch._scaled_mm

        def counted(a, b, *args, **kwargs):
            self.calls.append(a.dtype)
            return orig(a, b, *args, **kwargs)

        monkeypatch.setattr(torch, "_scaled_mm", counted)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_the_matmuls_run_in_float8_three_per_linear_per_step(recipe, recompute, monkeypatch):
    from lightning_v17.engine.recompute import apply_activation_checkpointing

    torch.manual_seed(0)
    model = _llama(layers=2)
    apply_activation_checkpointing(model, mode=recompute, units=find_wrap_units(model))
    converted = len(_convert(model, recipe))
    assert converted == 14  # 7 projections x 2 blocks
    counter = _ScaledMMCounter(monkeypatch)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tokens = torch.randint(0, model.config.vocab_size, (2, 32))
    per_step, losses = [], []
    for _ in range(2):
        before = len(counter.calls)
        logits = model(tokens)
        loss = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        per_step.append(len(counter.calls) - before)
        losses.append(loss.item())
    # forward output + grad_input + grad_weight per converted Linear; full recompute runs each forward once more,
    # selective recompute saves the _scaled_mm outputs (engine/recompute.py SAVED_OPS) and reruns no GEMM
    gemms_per_linear = 3 + (recompute == "full")
    assert per_step == [gemms_per_linear * converted] * 2
    float8 = {torch.float8_e4m3fn, torch.float8_e5m2}
    assert set(counter.calls) <= float8
    if recipe == "rowwise":  # torchao's rowwise recipe casts every operand to e4m3
        assert set(counter.calls) == {torch.float8_e4m3fn}
    else:  # tensorwise: e4m3 forward, e5m2 gradients (Micikevicius 2022 §3)
        assert set(counter.calls) == float8
    assert all(torch.isfinite(torch.tensor(losses)))


def test_a_first_linear_whose_input_needs_no_grad_still_runs_three_gemms(monkeypatch):
    """The count rule holds for the first layer too: torchao computes grad_input unconditionally."""
    model = nn.ModuleList([nn.Linear(32, 64, bias=False)])
    done = apply_fp8(model, policy=FP8Policy("tensorwise"), units=list(model), device="cpu")
    counter = _ScaledMMCounter(monkeypatch)
    model[0](torch.randn(8, 32)).sum().backward()
    assert done == ("0",) and len(counter.calls) == 3


def _strategy(**kw):
    """V17Strategy from the flat fp8 options (``fp8_backend=``, ``fp8_skip=``, ...: ``FP8Policy.from_options``)."""
    from tests._strategy import v17

    return v17(**kw)


def test_strategy_options_parse_once_into_a_frozen_policy():
    s = _strategy(fp8="rowwise", fp8_skip=["*.w2"])
    assert s.policy.fp8 == FP8Policy("rowwise", backend="auto", skip=("*.w2",))
    assert _strategy().policy.fp8 is None
    with pytest.raises(AttributeError):
        s.policy.fp8.recipe = "tensorwise"  # type: ignore[misc]
    assert resolve_fp8_backend(s.policy.fp8, "cpu") == FP8Backend.TORCHAO  # "auto" on CPU is torchao
    with pytest.raises(V17ConfigError, match=r"fp8='e4m3' is not supported; choose one of 'tensorwise', 'rowwise'"):
        _strategy(fp8="e4m3")
    with pytest.raises(V17ConfigError, match=r"FP8Policy's skip apply only with a recipe, fp8="):
        _strategy(fp8_skip=["*.w2"])
    with pytest.raises(V17ConfigError, match=r"FP8Policy\(skip='\*\.w2'\) must be a list of FQN patterns"):
        _strategy(fp8="tensorwise", fp8_skip="*.w2")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_fp8_backend_te_without_an_fp8_gpu_names_the_fix():
    with pytest.raises(V17ConfigError) as err:
        _strategy(fp8="tensorwise", fp8_backend="te")
    msg = str(err.value)
    assert "FP8Policy(backend='te')" in msg and "not a CUDA GPU" in msg
    assert "install transformer-engine" in msg and "compute capability >= 8.9" in msg
    assert "FP8Policy(backend='torchao')" in msg
    # the engine checks too
    with pytest.raises(V17ConfigError, match=r"FP8Policy\(backend='te'\) needs Transformer Engine"):
        apply_fp8(_llama(), policy=FP8Policy("tensorwise", backend="te"), units=[], device="cpu")


def test_fp8_options_all_gather_and_history_len_parse_or_are_refused_with_the_fix():
    from lightning_v17.engine.fp8.convert import float8_config

    tw, rw = _strategy(fp8="tensorwise").policy.fp8, _strategy(fp8="rowwise").policy.fp8
    z1, z3 = ZeroPolicy(stage=1), ZeroPolicy(stage=3)
    assert tw.float8_all_gather(zero=z3) and not tw.float8_all_gather(zero=z1)  # auto: tensorwise at ZeRO-3
    assert not rw.float8_all_gather(zero=ZeroPolicy(stage=3))
    off = _strategy(fp8="tensorwise", fp8_all_gather=False).policy.fp8
    assert not off.float8_all_gather(zero=ZeroPolicy(stage=3))
    assert float8_config(tw, all_gather=True).enable_fsdp_float8_all_gather
    assert not float8_config(tw).enable_fsdp_float8_all_gather
    with pytest.raises(V17ConfigError, match=r"FP8Policy\(all_gather=True\) needs the 'tensorwise' recipe \(got 'row"):
        _strategy(fp8="rowwise", fp8_all_gather=True)
    with pytest.raises(V17ConfigError, match=r"FP8Policy\(all_gather=True\) applies to zero_stage=3.*set zero_stage=3"):
        _strategy(fp8="tensorwise", fp8_all_gather=True, zero_stage=1)
    with pytest.raises(V17ConfigError, match=r"FP8Policy's all_gather apply only with a recipe, fp8="):
        _strategy(fp8_all_gather=True)
    d = _strategy(fp8="delayed", fp8_amax_history_len=4).policy.fp8
    assert d.history_len == 4 and _strategy(fp8="delayed").policy.fp8.history_len == 16
    assert not d.float8_all_gather(zero=ZeroPolicy(stage=3))
    with pytest.raises(V17ConfigError, match=r"FP8Policy\(amax_history_len=4\) applies only to the 'delayed' recipe"):
        _strategy(fp8="tensorwise", fp8_amax_history_len=4)
    with pytest.raises(V17ConfigError, match=r"FP8Policy\(amax_history_len=0\) must be a positive integer"):
        _strategy(fp8="delayed", fp8_amax_history_len=0)


def test_fp8_with_tensor_parallel_tensorwise_and_delayed_and_the_dims_rule_scales_with_tp():
    _strategy(fp8="tensorwise", tp=2)  # torchao's float8 TP styles
    _strategy(fp8="delayed", tp=2)  # plain styles, scales from tp-synced histories (tests/dist/test_fp8_delayed_tp.py)
    with pytest.raises(V17ConfigError) as err:
        _strategy(fp8="rowwise", tp=2)
    msg = str(err.value)
    assert "fp8='rowwise' with tp=2 is not supported" in msg and "fp8='delayed' with tp > 1" in msg
    _strategy(fp8="tensorwise", tp=1, pp=2, zero_stage=1)  # pp is fine: each stage converts its own blocks
    model = _llama()  # hidden 128, kv out 64, ffn 384: every dim divides 16 x 2 = 32, not 16 x 8 = 128
    assert len(select_fp8_linears(model, units=find_wrap_units(model), tp=2).convert) == 14
    sel = select_fp8_linears(model, units=find_wrap_units(model), tp=8)
    assert {f.rsplit(".", 1)[-1] for f, _, _ in sel.kept_for_dims} == {"wk", "wv"}  # out 64 % 128
