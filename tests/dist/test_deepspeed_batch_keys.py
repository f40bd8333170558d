"""DeepSpeed's batch keys inside a Trainer: a config whose ``train_micro_batch_size_per_gpu`` / ``train_batch_size``
disagree with the DataLoader and the Trainer is refused at the first batch with the fix; a consistent one trains."""

from __future__ import annotations

import pytest

from tests._dist import spawn

pytest.importorskip("transformers")


def _worker(rank: int, world: int) -> dict:
    from lightning_v17 import V17Strategy
    from lightning_v17.config import V17ConfigError
    from tests._models import fit

    out = {}
    for name, cfg in {
        "ok": {"train_micro_batch_size_per_gpu": 4, "train_batch_size": 8},
        "micro": {"train_micro_batch_size_per_gpu": 2},
        "total": {"train_batch_size": 16},
    }.items():
        try:
            out[name] = fit("hf_llama", V17Strategy(zero_stage=1, config=cfg), devices=world, batch_size=4, steps=2,
                            layers=1)  # fmt: skip
        except V17ConfigError as err:
            out[name] = str(err)
    return out


@pytest.mark.timeout(300)
def test_deepspeed_batch_keys_checked_against_the_dataloader():
    for r in spawn(_worker, world_size=2, init_process_group=False):
        assert isinstance(r["ok"], list) and len(r["ok"]) == 2, r["ok"]
        assert "train_micro_batch_size_per_gpu=2 but the DataLoader gives 4 rows per rank" in r["micro"]
        assert "train_batch_size=16 but this run steps on 4 rows x accumulate_grad_batches=1 x 2" in r["total"]
