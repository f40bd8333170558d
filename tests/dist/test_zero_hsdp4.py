"""True HSDP on 4 gloo ranks inside a Lightning Trainer: dp_replicate=2 x dp_shard=2, against one process.

The 2-rank parity tests can only build dp_replicate=2 x dp_shard=1. Here both axes are 2, so ZeRO partitions over
dp_shard *and* replicates over dp_replicate: stage 1/2 reduce over the shard group then all-reduce over the
replicate group (our engine), stage 3 is FSDP2's HSDP. Each rank gets 2 of the reference's 8 samples per step, so
the global batch equals ``test_zero_parity.reference()``'s.

Tolerances: losses 1e-5 relative, final parameters 1e-5 (max abs diff relative to max abs value), as there.
"""

from __future__ import annotations

import pytest
import torch

from tests._dist import spawn
from tests.dist.test_zero_parity import (
    STEPS,
    _assert_params_close,
    _full_params,
    _lit_cls,
    _rel,
    make_data,
    reference,
)

#: the compositions this file checks against one process (docs/gen_layouts.py builds docs/layouts.md from them)
COMPOSES = (("dp_replicate", "zero1"), ("dp_replicate", "zero2"), ("dp_replicate", "zero3"))

WORLD4, PER_RANK4 = 4, 2
CASES = {"s1": {"stage": 1}, "s2": {"stage": 2}, "s3": {"stage": 3}, "s3_clip": {"stage": 3, "clip": 0.05}}


def _fit(case: dict) -> dict:
    import lightning as L
    import torch.distributed as dist
    from lightning_v17.strategies import V17Strategy
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    class Lit(_lit_cls()):
        def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
            super().on_train_batch_end(outputs, batch, batch_idx)
            mesh = self.trainer.strategy.mesh.spec
            self.mesh = (mesh.dp_replicate, mesh.dp_shard)

    x, y = make_data(STEPS * WORLD4 * PER_RANK4)
    ds = TensorDataset(x, y)
    sampler = DistributedSampler(ds, num_replicas=WORLD4, rank=int(__import__("os").environ["RANK"]), shuffle=False)
    from lightning_v17.callbacks import MemoryBuckets

    model = Lit()
    mem = MemoryBuckets(every_n_steps=1)
    trainer = L.Trainer(callbacks=[mem],
        accelerator="cpu", devices=WORLD4, max_steps=STEPS, use_distributed_sampler=False,
        strategy=V17Strategy(zero_stage=case["stage"], dp_replicate=2, dp_shard=2),
        gradient_clip_val=case.get("clip"), logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(model, DataLoader(ds, batch_size=PER_RANK4, sampler=sampler))
    losses = torch.tensor(model.losses)
    dist.all_reduce(losses)
    return {
        "losses": (losses / WORLD4).tolist(), "params": _full_params(model), "mesh": model.mesh,
        "measured": mem.measured.__dict__, "planned": None if mem.planned is None else mem.planned.__dict__,
        "note": mem.plan_note,
    }  # fmt: skip


def _worker(rank: int, world_size: int) -> dict:
    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    return {name: _fit(case) for name, case in CASES.items()}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return spawn(_worker, world_size=WORLD4, timeout=400, init_process_group=False)


@pytest.mark.timeout(500)
@pytest.mark.parametrize("name", ["s1", "s2", "s3", "s3_clip"])
def test_hsdp_2x2_matches_one_process(results: list[dict], name: str) -> None:
    ref = reference(clip=0.05) if name.endswith("clip") else reference()
    for r in results:
        got = r[name]
        assert got["mesh"] == (2, 2)
        assert len(got["losses"]) == STEPS
        for a, b in zip(got["losses"], ref["losses"], strict=True):
            assert _rel(a, b) <= 1e-5, (got["losses"], ref["losses"])
        _assert_params_close(got["params"], ref["params"], 1e-5)


@pytest.mark.timeout(500)
@pytest.mark.parametrize("name", ["s1", "s2", "s3"])
def test_memory_buckets_under_hsdp_match_the_planner(results: list[dict], name: str) -> None:
    """Every stage partitions over dp_shard (2), not over all 4 data-parallel ranks: the planner, fed the layout the
    ZeRO backend reports, must agree with the bytes counted from real tensor storage within 5%."""
    for rank, r in enumerate(results):
        got = r[name]
        assert got["planned"] is not None, got["note"]
        assert "dp=2" in got["note"], got["note"]
        for bucket in ("param", "grad", "optimizer"):
            planned, measured = got["planned"][bucket], got["measured"][bucket]
            assert abs(measured - planned) <= 0.05 * planned, (name, rank, bucket, measured, planned)
