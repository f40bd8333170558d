"""Hugging Face MoE models as users write them (``self.model(input_ids=..., labels=...).loss``, SGD over
``self.parameters()``, nothing naming experts or plans), Mixtral, Qwen3-MoE and DeepSeek-V3 of the installed
transformers, under ``V17Strategy(ep=2)`` with ZeRO-1 and with ZeRO-3 over the rest, against Lightning's ``"ddp"``
on the same 2 ranks and batches: per-step losses within 1e-4 relative over 6 steps, parameters within 1e-5. One
spawn runs all."""

from __future__ import annotations

from typing import Any

import pytest

from tests._dist import spawn
from tests._models import HF_MOE_FAMILIES
from tests.integration.real_modules._common import assert_matches, train

pytest.importorskip("transformers")

RUNS = {"ep2_zero1": {"zero_stage": 1, "ep": 2}, "ep2_zero3": {"zero_stage": 3, "ep": 2}}


def _module(family: str) -> Any:
    import lightning as L
    import torch

    from tests._models import hf_moe

    class HFLM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = hf_moe(family)

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.5)

    return HFLM()


def _worker(rank: int, world: int) -> dict:
    import torch
    from lightning_v17.strategies import V17Strategy

    data = list(torch.randint(0, 64, (48, 12), generator=torch.Generator().manual_seed(3)))
    out = {}
    for family in HF_MOE_FAMILIES:
        out[family] = {"ddp": train(lambda family=family: _module(family), "ddp", data, batch_size=4)}
        for name, kw in RUNS.items():
            out[family][name] = train(lambda family=family: _module(family), V17Strategy(**kw), data, batch_size=4)
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return spawn(_worker, world_size=2, args=(), timeout=600)


@pytest.mark.parametrize("family", HF_MOE_FAMILIES)
def test_hf_moe_at_ep2_matches_ddp(ranks, family) -> None:
    assert_matches([r[family] for r in ranks], list(RUNS))
