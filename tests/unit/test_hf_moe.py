"""Hugging Face MoE models (Mixtral, Qwen3-MoE, DeepSeek-V3 of the installed transformers, tiny random configs) adapted
for expert parallelism (``lightning_v17/models/hf_moe.py``), in one process: the adapted experts give the logits of
transformers' own ``grouped_mm`` experts (rows in the same order) bit for bit and every gradient within 1e-8; the eager per-expert loop within
1e-5; unsupported layouts are refused by name."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_v17.config import V17ConfigError
from lightning_v17.models.hf_moe import adapt_hf_moe
from tests._models import HF_MOE_FAMILIES, hf_moe, stable_sort

pytest.importorskip("transformers")


def _run(model, ids):
    model.zero_grad()
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _set_impl(model, impl: str) -> None:
    for m in model.modules():
        if hasattr(m, "gate_up_proj") and hasattr(m, "config"):
            m.config._experts_implementation = impl


@pytest.mark.parametrize("family", HF_MOE_FAMILIES)
def test_adapted_experts_equal_transformers_own(family) -> None:
    model = hf_moe(family)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    _set_impl(model, "grouped_mm")
    with stable_sort():  # the engine's row order within an expert (tests/_models.py says why it matters)
        hf_logits, hf_grads = _run(model, ids)
    _set_impl(model, "eager")
    eager_logits, _ = _run(model, ids)
    adapted = adapt_hf_moe(model)
    assert adapted and all(name.endswith(".mlp") for name in adapted)
    logits, grads = _run(model, ids)
    assert torch.equal(logits, hf_logits)
    for name, g in grads.items():
        torch.testing.assert_close(g, hf_grads[name], rtol=0, atol=1e-8, msg=name)
    torch.testing.assert_close(logits, eager_logits, rtol=1e-5, atol=1e-5)
    assert adapt_hf_moe(model) == adapted  # idempotent


def test_a_model_without_moe_is_left_alone_and_unfused_experts_are_refused() -> None:
    from tests._models import hf_llama

    assert adapt_hf_moe(hf_llama(layers=1)) == []

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.experts = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])

    with pytest.raises(V17ConfigError, match=r"Block \(0\) keeps its experts as a ModuleList.*upgrade transformers"):
        adapt_hf_moe(nn.Sequential(Block()))
