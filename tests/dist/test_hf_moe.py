"""Hugging Face MoE models, unchanged but for the adapter (Mixtral, Qwen3-MoE, DeepSeek-V3 of the installed
transformers, tiny random configs, fp32), at ep=2 on 2 gloo ranks through ``engine.parallelize``, ZeRO-1 and ZeRO-3
over the dense part: 6 SGD steps of transformers' own loss, per-step losses within 1e-4 (measured far below) and the
parameters within 1e-5 of one process on the concatenated batch. One spawn for all cases."""

from __future__ import annotations

import pytest

from tests._dist import spawn
from tests._models import HF_MOE_FAMILIES

pytest.importorskip("transformers")

STEPS, LR = 6, 0.5
CASES = [(family, stage) for family in HF_MOE_FAMILIES for stage in (1, 3)]


def _batches():
    import torch

    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, 64, (4, 12), generator=g) for _ in range(STEPS)]


def _reference(family: str) -> tuple[list[float], dict]:
    import torch

    from tests._models import hf_moe

    model = hf_moe(family)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for ids in _batches():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _worker(rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist

    from lightning_v17.config import MeshSpec, TrainingPolicy, ZeroPolicy
    from lightning_v17.engine.parallelize import parallelize
    from lightning_v17.mesh import MeshRuntime, build_device_mesh
    from lightning_v17.models.hf_moe import adapt_hf_moe
    from tests._models import hf_moe

    spec = MeshSpec(dp_shard=2, ep=2)
    mesh = MeshRuntime(spec, build_device_mesh(spec, device_type="cpu"))
    out = {}
    for family, stage in CASES:
        model = hf_moe(family)
        adapted = adapt_hf_moe(model)
        done = parallelize(model, mesh=mesh, policy=TrainingPolicy(zero=ZeroPolicy(stage=stage)), device="cpu")
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        done.zero.prepare_optimizers([opt])
        losses = []
        for ids in _batches():
            mine = ids[2 * rank : 2 * rank + 2]
            loss = model(input_ids=mine, labels=mine).loss
            loss.backward()
            done.zero.finish_grad_sync()
            opt.step()
            done.zero.after_optimizer_step(opt)
            opt.zero_grad()
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(float(total) / world)
        out[(family, stage)] = {
            "losses": losses, "adapted": adapted, "sharded": len(done.ep.params) if done.ep else 0,
            "params": {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                       for n, p in model.named_parameters()},
        }  # fmt: skip
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return spawn(_worker, world_size=2, args=(), timeout=500)


@pytest.mark.parametrize(("family", "stage"), CASES)
def test_hf_moe_at_ep2_matches_one_process(runs, family, stage) -> None:
    import torch

    ref_losses, ref_params = _reference(family)
    for rank, res in enumerate(runs):
        got = res[(family, stage)]
        assert got["adapted"] and got["sharded"] == 2 * len(got["adapted"])  # gate_up_proj, down_proj per block
        assert got["losses"] == pytest.approx(ref_losses, rel=1e-4, abs=1e-4), (rank, got["losses"], ref_losses)
        for name, p in got["params"].items():
            torch.testing.assert_close(p, ref_params[name], rtol=1e-5, atol=1e-5, msg=f"{family} {stage} {name}")
