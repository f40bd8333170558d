"""Varlen attention: equal to attending each document separately (outputs and gradients, fp32 1e-5), no leakage
between documents, and boundaries from position_ids equal to explicit cu_seqlens."""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_v17.models import Llama, ModelConfig
from lightning_v17.models.attention import (
    AttentionBackend,
    cu_seqlens_from_position_ids,
    flash_attn_available,
    flex_attention_available,
    resolve_backend,
    varlen_attention,
)

TOL = {"atol": 1e-5, "rtol": 1e-5}  # fp32


def _reference_attention(q, k, v):
    """Naive causal attention of one document: q [L, Hq, D], k/v [L, Hkv, D] (explicit softmax, repeated kv heads)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    n = q.shape[0]
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def _random_cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


@settings(max_examples=15, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 12), min_size=1, max_size=6),
    hkv=st.sampled_from([1, 2, 4]),
    seed=st.integers(0, 100),
)
def test_varlen_equals_per_document_reference_outputs_and_grads(lengths, hkv, seed):
    g = torch.Generator().manual_seed(seed)
    total, hq, d = sum(lengths), 4, 8
    q = torch.randn(total, hq, d, generator=g, requires_grad=True)
    k = torch.randn(total, hkv, d, generator=g, requires_grad=True)
    v = torch.randn(total, hkv, d, generator=g, requires_grad=True)
    cu = _random_cu(lengths)
    out = varlen_attention(q, k, v, cu, max(lengths))
    w = torch.randn(out.shape, generator=g)
    (out * w).sum().backward()
    got = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    ref = torch.cat([_reference_attention(q[s:e], k[s:e], v[s:e]) for s, e in itertools.pairwise(cu)])
    (ref * w).sum().backward()
    torch.testing.assert_close(out, ref, **TOL)
    for a, t in zip(got, (q, k, v), strict=True):
        torch.testing.assert_close(a, t.grad, **TOL)


def _tiny(**kw):
    torch.manual_seed(0)
    return Llama(ModelConfig.from_preset("tiny", layers=2, **kw))


def _packed(lengths_per_row, seed=0):
    g = torch.Generator().manual_seed(seed)
    width = max(sum(r) for r in lengths_per_row)
    rows_tok, rows_pos, bounds = [], [], [0]
    for row in lengths_per_row:
        lens = list(row) + ([width - sum(row)] if sum(row) < width else [])
        rows_tok.append(torch.randint(0, 256, (width,), generator=g))
        rows_pos.append(torch.cat([torch.arange(n) for n in lens]))
        for n in lens:
            bounds.append(bounds[-1] + n)
    return torch.stack(rows_tok), torch.stack(rows_pos), torch.tensor(bounds, dtype=torch.int32)


def test_model_on_packed_rows_equals_each_document_alone():
    model = _tiny()
    tokens, pos, cu = _packed([[5, 9, 3], [11, 6]])
    logits = model(tokens, pos, cu, 11)
    w = torch.randn(logits.shape, generator=torch.Generator().manual_seed(1))
    (logits * w).sum().backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    flat_tok, flat_w = tokens.reshape(-1), w.reshape(-1, w.shape[-1])
    flat_logits = logits.reshape(-1, logits.shape[-1])
    total = 0
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        alone = model(flat_tok[s:e].unsqueeze(0))[0]  # a batch of one document, plain causal attention
        torch.testing.assert_close(flat_logits[s:e], alone, **TOL)
        total = total + (alone * flat_w[s:e]).sum()
    total.backward()
    for n, p in model.named_parameters():
        # Weight gradients sum over many tokens in a different order: compare relative to the gradient's norm (fp32).
        rel = float((packed_grads[n] - p.grad).norm() / p.grad.norm().clamp_min(1e-12))
        assert rel < 1e-5, (n, rel)


def test_changing_one_document_never_changes_another():
    model = _tiny()
    tokens, pos, cu = _packed([[7, 10, 4], [12, 9]], seed=3)
    base = model(tokens, pos, cu)
    flat = tokens.reshape(-1)
    bounds = cu.tolist()
    for doc in range(len(bounds) - 1):
        s, e = bounds[doc], bounds[doc + 1]
        changed = flat.clone()
        changed[s:e] = (changed[s:e] + 17) % 256
        out = model(changed.view_as(tokens), pos, cu).reshape(-1, base.shape[-1])
        ref = base.reshape(-1, base.shape[-1])
        assert not torch.allclose(out[s:e], ref[s:e])  # the edited document itself does change
        keep = torch.ones(flat.numel(), dtype=torch.bool)
        keep[s:e] = False
        torch.testing.assert_close(out[keep], ref[keep], atol=1e-6, rtol=0)


def test_position_ids_boundaries_equal_explicit_cu_seqlens():
    model = _tiny()
    tokens, pos, cu = _packed([[4, 8, 4], [3, 3, 3, 7]], seed=5)
    derived, max_len = cu_seqlens_from_position_ids(pos)
    assert torch.equal(derived, cu) and max_len == 8
    torch.testing.assert_close(model(tokens, pos), model(tokens, pos, cu, 8), atol=0, rtol=0)
    # One document per row: position_ids, explicit cu_seqlens and plain causal all agree.
    plain = torch.arange(16).expand(2, 16)
    cu_rows = torch.tensor([0, 16, 32], dtype=torch.int32)
    torch.testing.assert_close(model(tokens, plain, cu_rows), model(tokens), **TOL)
    torch.testing.assert_close(model(tokens, plain), model(tokens), **TOL)


def test_rows_never_attend_to_each_other_even_without_a_zero_position():
    pos = torch.tensor([[3, 4, 5, 0, 1], [7, 8, 0, 1, 2]])  # continuation rows that do not start at 0
    cu, _ = cu_seqlens_from_position_ids(pos)
    assert cu.tolist() == [0, 3, 5, 7, 10]


def test_backend_selection_on_cpu():
    q = torch.zeros(4, 2, 8)
    assert resolve_backend(q, "auto") is AttentionBackend.SDPA
    with pytest.raises(ValueError, match="needs CUDA"):
        resolve_backend(q, "flash")
    with pytest.raises(ValueError, match=r"varlen_attention\(backend='magic'\) is not supported; choose one of"):
        resolve_backend(q, "magic")


@pytest.mark.skipif(not flex_attention_available(), reason="FlexAttention backend needs CUDA")
def test_flex_backend_matches_sdpa_on_cuda():
    g = torch.Generator(device="cuda").manual_seed(0)
    cu = _random_cu([17, 130, 5, 256]).cuda()
    q = torch.randn(int(cu[-1]), 4, 64, device="cuda", generator=g, requires_grad=True)
    k = torch.randn(int(cu[-1]), 2, 64, device="cuda", generator=g, requires_grad=True)
    v = torch.randn(int(cu[-1]), 2, 64, device="cuda", generator=g, requires_grad=True)
    ref = varlen_attention(q, k, v, cu, backend="sdpa")
    torch.testing.assert_close(varlen_attention(q, k, v, cu, backend="flex"), ref, atol=2e-3, rtol=2e-3)


@pytest.mark.skipif(not flash_attn_available(), reason="flash-attn backend needs CUDA and the flash-attn package")
def test_flash_backend_matches_sdpa_on_cuda():
    g = torch.Generator(device="cuda").manual_seed(0)
    cu = _random_cu([17, 130, 5, 256]).cuda()
    q, k, v = (torch.randn(int(cu[-1]), h, 64, device="cuda", generator=g, dtype=torch.bfloat16) for h in (4, 2, 2))
    ref = varlen_attention(q.float(), k.float(), v.float(), cu, backend="sdpa")
    out = varlen_attention(q, k, v, cu, 256, backend="flash")
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_auto_never_picks_flex_with_dropout_and_forced_flex_with_dropout_names_the_fix(monkeypatch):
    """On a CUDA tensor with FlexAttention available and no flash-attn, 'auto' picks flex without dropout and
    per-document SDPA with it (flex_attention has no dropout; it used to raise mid-forward)."""
    from lightning_v17.models import attention

    monkeypatch.setattr(attention, "flex_attention_available", lambda: True)
    monkeypatch.setattr(attention, "flash_attn_available", lambda: False)
    q = SimpleNamespace(is_cuda=True, dtype=torch.float32)  # only is_cuda/dtype are read
    assert resolve_backend(q, "auto") is AttentionBackend.FLEX
    assert resolve_backend(q, "auto", dropout_p=0.1) is AttentionBackend.SDPA
    with pytest.raises(ValueError, match=r"'flex' has no attention dropout \(dropout_p=0.1\); set the model's dropout=0"):
        resolve_backend(q, "flex", dropout_p=0.1)


def test_varlen_reads_cu_seqlens_to_the_host_once_per_forward_not_per_layer(monkeypatch):
    """Every layer gets the same cu_seqlens tensor; the boundaries are read to the host once (a device sync on CUDA)."""
    model = _tiny()  # several layers
    n_layers = len(model.layers)
    assert n_layers >= 2
    tokens, pos, cu = _packed([[4, 8, 4], [3, 3, 3, 7]], seed=1)
    calls = []
    real_tolist = torch.Tensor.tolist

    def counting_tolist(self):
        calls.append(tuple(self.shape))
        return real_tolist(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counting_tolist)
    out = model(tokens, pos, cu, None)
    assert calls.count(tuple(cu.shape)) == 1, (calls, n_layers)
    monkeypatch.setattr(torch.Tensor, "tolist", real_tolist)
    torch.testing.assert_close(out, model(tokens, pos, cu.clone(), 8), atol=0, rtol=0)

