"""The composition function alone, without Lightning: ``engine.parallelize.parallelize`` on 2 gloo ranks.

* An unchanged Hugging Face ``LlamaForCausalLM`` through ZeRO-3 + full recompute, 3 SGD steps: losses and updated
  parameters equal a single-process run on the whole batch within 1e-5 relative (fp32); and the worker never
  imported Lightning.
* Refusals and warnings: recompute on a model without repeated blocks (names ``wrap_classes``), ZeRO-3 on one
  (warns that the whole model is one unit), pp>1 without a layout, tp>1 without a plan, ZeRO-2 with pp>1.
* Replicas: ranks that drew different weights hold one model after ``parallelize`` at ZeRO-1.
"""

from __future__ import annotations

import pytest

from lightning_v17.engine.state import state_of
from tests._dist import spawn

#: the compositions this file checks against one process (docs/gen_layouts.py builds docs/layouts.md from them)
COMPOSES = (("zero3", "recompute"),)

pytest.importorskip("transformers")

RTOL = 1e-5
STEPS = 3


def _batches():
    import torch

    from tests._models import token_dataset

    rows = token_dataset("hf_llama", rows=8 * STEPS)
    return [torch.stack([r["input_ids"] for r in rows[8 * s : 8 * s + 8]]) for s in range(STEPS)]


def _reference():
    import torch

    from tests._models import hf_llama

    torch.manual_seed(0)
    model = hf_llama(layers=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for ids in _batches():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _hf_zero3_worker(rank: int, world: int) -> dict:
    import sys

    import torch
    import torch.distributed as dist

    from lightning_v17.config import MeshSpec, TrainingPolicy, ZeroPolicy
    from lightning_v17.engine.parallelize import parallelize
    from lightning_v17.mesh import MeshRuntime, build_device_mesh
    from tests._models import hf_llama

    spec = MeshSpec(dp_shard=2)
    mesh = MeshRuntime(spec, build_device_mesh(spec, device_type="cpu"))
    torch.manual_seed(0)
    model = hf_llama(layers=2)
    policy = TrainingPolicy(zero=ZeroPolicy(stage=3), recompute="full")
    out = parallelize(model, mesh=mesh, policy=policy, device="cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for ids in _batches():
        mine = ids[4 * rank : 4 * rank + 4]
        loss = model(input_ids=mine, labels=mine).loss
        loss.backward()  # FSDP2 reduce-scatters the mean gradient over dp_shard
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / world)
    params = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    return {
        "losses": losses,
        "params": params,
        "units": len(out.units),
        "recompute": [state_of(u).recompute for u in out.units],
        # V17 keeps what it set on a module in one object (engine/state.py), as FSDP2 keeps its FSDPState
        "loose": sorted({k for m in model.modules() for k in vars(m) if k.startswith("_v17") and k != "_v17_state"}),
        "parallel_is_out": state_of(model).parallel is out,
        "lightning_imported": any(m == "lightning" or m.startswith(("lightning.", "pytorch_lightning")) for m in sys.modules),
    }


@pytest.mark.timeout(240)
def test_parallelize_hf_llama_zero3_recompute_matches_single_process():
    ref_losses, ref_params = _reference()
    res = spawn(_hf_zero3_worker, world_size=2, fresh_interpreter=True)
    for r in res:
        assert not r["lightning_imported"], "the composition function must work without Lightning"
        assert r["units"] == 2 and r["recompute"] == ["full", "full"], r
        assert r["loose"] == [] and r["parallel_is_out"], r
        assert r["losses"] == pytest.approx(ref_losses, rel=RTOL)
        for n, ref in ref_params.items():
            err = float((r["params"][n] - ref).norm() / ref.norm().clamp_min(1e-12))
            assert err < RTOL, f"{n}: {err:.2e}"


def _refusal_worker(rank: int, world: int) -> dict:
    import logging

    import torch
    from torch import nn

    from lightning_v17.config import MeshSpec, TrainingPolicy, V17ConfigError, ZeroPolicy
    from lightning_v17.engine.parallelize import parallelize
    from lightning_v17.mesh import MeshRuntime, build_device_mesh

    def flat_model() -> nn.Module:  # no ModuleList/ModuleDict of blocks anywhere
        torch.manual_seed(rank)  # different draws per rank: parallelize must make the replicas agree
        return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))

    spec = MeshSpec(dp_shard=2)
    mesh = MeshRuntime(spec, build_device_mesh(spec, device_type="cpu"))
    out: dict = {}

    def error(policy: TrainingPolicy, **kw) -> str:
        try:
            parallelize(flat_model(), mesh=mesh, policy=policy, device="cpu", **kw)
        except V17ConfigError as err:
            return str(err)
        return "no error"

    out["recompute"] = error(TrainingPolicy(zero=ZeroPolicy(stage=1), recompute="full"))
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda rec: records.append(rec.getMessage())  # type: ignore[method-assign]
    logging.getLogger("lightning_v17.engine.parallelize").addHandler(handler)
    parallelize(flat_model(), mesh=mesh, policy=TrainingPolicy(zero=ZeroPolicy(stage=3)), device="cpu")
    out["zero3_warning"] = records
    # replicas at ZeRO-1: every rank drew its own weights; after parallelize all hold rank 0's
    model = flat_model()
    parallelize(model, mesh=mesh, policy=TrainingPolicy(zero=ZeroPolicy(stage=1)), device="cpu")
    out["weight"] = model[0].weight.detach().clone()
    return out


@pytest.mark.timeout(240)
def test_parallelize_refuses_recompute_without_blocks_warns_zero3_and_syncs_replicas():
    res = spawn(_refusal_worker, world_size=2)
    for r in res:
        assert "activation_checkpointing='full'" in r["recompute"] and "wrap_classes" in r["recompute"], r
        assert any("one FSDP unit" in m and "wrap_classes" in m for m in r["zero3_warning"]), r["zero3_warning"]
    assert res[0]["weight"].equal(res[1]["weight"]), "replicas must hold the same weights after parallelize"


def test_composition_refusals_before_any_process_group():
    from lightning_v17.config import (
        OffloadPolicy,
        ParallelDims,
        PipelinePolicy,
        TrainingPolicy,
        V17ConfigError,
        ZeroPolicy,
    )
    from lightning_v17.engine.parallelize import check_composition

    one_f_one_b = TrainingPolicy(pipeline=PipelinePolicy(schedule="1f1b", microbatches=1))
    with pytest.raises(V17ConfigError, match=r"microbatches >= pp stages: microbatches=1 < pp=2"):
        check_composition(one_f_one_b, ParallelDims(pp=2))
    offload = TrainingPolicy(zero=ZeroPolicy(stage=1), offload=OffloadPolicy(params="cpu"))
    with pytest.raises(V17ConfigError, match=r"OffloadPolicy\(params='cpu'\).*needs zero_stage=3"):
        check_composition(offload, ParallelDims())
