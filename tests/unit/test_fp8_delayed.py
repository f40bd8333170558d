"""Delayed scaling (``fp8="delayed"``, ``engine/fp8/delayed.py``), one process: the three float8 GEMMs per step, the
history and the scales, and that the output is the fp32 Linear's within float8 precision.

The distributed checks (amax synced over dp, bitwise-equal histories, parity, resume, dp2 -> dp1) are in
``tests/dist/test_fp8_delayed.py``.
"""

from __future__ import annotations

import copy
from collections import Counter

import torch
from torch import nn

from lightning_v17.config import FP8Policy
from lightning_v17.engine.fp8.convert import apply_fp8
from lightning_v17.engine.fp8.delayed import DelayedFloat8Linear, update_scales
from lightning_v17.engine.zero.fsdp import find_wrap_units

E4M3_MAX, E5M2_MAX = torch.finfo(torch.float8_e4m3fn).max, torch.finfo(torch.float8_e5m2).max


def _llama(layers: int = 2):
    from lightning_v17.models import ModelConfig
    from lightning_v17.models.llama import Llama

    torch.manual_seed(0)
    return Llama(ModelConfig.from_preset("tiny", layers=layers))


def _counter(monkeypatch):
    calls: list[tuple[torch.dtype, torch.dtype]] = []
    orig = torch._scaled_mm

    def counted(a, b, *args, **kwargs):
        calls.append((a.dtype, b.dtype))
        return orig(a, b, *args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", counted)
    return calls


def test_delayed_converts_the_block_linears_and_runs_three_float8_gemms_per_step(monkeypatch):
    model = _llama()
    weights = dict(model.named_parameters())
    done = apply_fp8(model, policy=FP8Policy("delayed", amax_history_len=4), units=find_wrap_units(model), device="cpu")
    assert len(done) == 14 and all(type(model.get_submodule(f)) is DelayedFloat8Linear for f in done)
    assert type(model.output) is nn.Linear and dict(model.named_parameters()) == weights  # same Parameter objects
    sd = model.state_dict()
    assert sd["layers.0.attention.wq.amax_history"].shape == (3, 4) and "layers.0.attention.wq.scale" in sd
    assert "layers.0.attention.wq.amax_pending" not in sd  # folded into the history each step, never saved
    calls = _counter(monkeypatch)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tokens = torch.randint(0, model.config.vocab_size, (2, 32))
    wq = model.get_submodule("layers.0.attention.wq")
    for step in range(5):
        before = len(calls)
        logits = model(tokens)
        loss = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        pending = wq.amax_pending.clone()
        assert (pending > 0).all(), pending  # input, weight and grad_output amaxes of this step
        opt.step()
        opt.zero_grad()
        update_scales(model)
        assert len(calls) - before == 3 * 14
        assert torch.equal(wq.amax_history[:, 0], pending) and not wq.amax_pending.any()
        assert int((wq.amax_history > 0).sum(dim=1)[0]) == min(step + 1, 4)  # the history rolls, length 4
        top = wq.amax_history.max(dim=1).values
        want = torch.tensor([E4M3_MAX, E4M3_MAX, E5M2_MAX]) / top
        assert torch.equal(wq.scale, want)
    # output = x @ W.T in e4m3 x e4m3; grad_input and grad_weight take grad_output in e5m2 (the hybrid format)
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    assert Counter(calls) == {(e4, e4): 14 * 5, (e5, e4): 2 * 14 * 5}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().norm() / b.detach().norm())


def test_delayed_output_and_gradients_are_the_fp32_linear_within_float8_precision():
    torch.manual_seed(0)
    ref = nn.Linear(64, 32)
    layer = DelayedFloat8Linear.from_linear(copy.deepcopy(ref), history_len=16)
    x = torch.randn(8, 64)
    for step in range(3):  # step 0 runs with scale 1.0 (no history yet), then with the delayed scales
        xr, xd = x.clone().requires_grad_(), x.clone().requires_grad_()
        out_r, out_d = ref(xr), layer(xd)
        g = torch.randn_like(out_r)
        out_r.backward(g)
        out_d.backward(g)
        update_scales(layer)
        assert _rel(out_d, out_r) < 0.08, step  # e4m3 keeps 3 mantissa bits: ~2-4% relative per product
        assert _rel(xd.grad, xr.grad) < 0.15 and _rel(layer.weight.grad, ref.weight.grad) < 0.15, step  # e5m2: 2 bits
        assert torch.equal(layer.bias.grad, ref.bias.grad)
        ref.zero_grad()
        layer.zero_grad()
    assert torch.equal(layer.scale[0], E4M3_MAX / x.abs().max())


def test_two_forwards_before_their_backwards_and_a_saturating_cast():
    """A pipeline schedule runs several micro-batches' forwards before their backwards: the pending amax (updated in
    place by each) must not break the saved tensors; an amax above the delayed scale's range saturates, never inf."""
    layer = DelayedFloat8Linear.from_linear(nn.Linear(32, 16, bias=False), history_len=2)
    a, b = torch.randn(4, 32, requires_grad=True), (100 * torch.randn(4, 32)).requires_grad_()
    layer.scale.fill_(E4M3_MAX / 1.0)  # as if the history's amax were 1.0: b's values saturate at +-448
    out_a, out_b = layer(a), layer(b)
    out_b.sum().backward()
    out_a.sum().backward()
    assert torch.isfinite(out_b).all() and torch.isfinite(b.grad).all() and torch.isfinite(layer.weight.grad).all()
    assert float(layer.amax_pending[0]) == float(b.detach().abs().max())  # the max over both micro-batches


def test_delayed_keeps_the_plain_tp_styles_and_refuses_others():
    """At tp > 1 a delayed Linear runs its GEMMs on the local shards under the plain colwise/rowwise styles
    (``tests/dist/test_fp8_delayed_tp.py``): ``float8_tp_plan`` keeps those (no torchao float8 style, which would cast
    with dynamic scales) and refuses another style for a converted Linear, naming it and the fix."""
    import pytest
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from lightning_v17.config import V17ConfigError
    from lightning_v17.engine.fp8.convert import float8_tp_plan

    model = _llama(layers=1)
    layers = apply_fp8(model, policy=FP8Policy("delayed"), units=find_wrap_units(model), device="cpu")
    styles = {"layers.*.attention.wq": "colwise", "layers.*.attention.wo": "rowwise"}
    plan = float8_tp_plan(model, styles, layers=layers)
    assert [type(s) for s in plan.values()] == [ColwiseParallel, RowwiseParallel]
    with pytest.raises(V17ConfigError, match=r"fp8='delayed' with tensor parallelism: 'layers.0.attention.wq' .* "
                                             r"style is _ReplicateParallel.*"
                                             r"FP8Policy\(skip=\['layers.0.attention.wq'\]\)"):
        float8_tp_plan(model, {"layers.0.attention.wq": "replicate"}, layers=layers)
