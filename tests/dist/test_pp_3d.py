"""Composed meshes on 4 gloo ranks against a single-process reference: pp=2 x dp=2 (ZeRO-1), tp=2 x dp=2 (FSDP2 /
ZeRO-3, torchtitan order: TP first, then fully_shard over dp_shard) and pp=2 x tp=2 (sequence parallel, vocab-parallel embedding, loss-parallel cross entropy).

Tiny Llama, fp32, 5 AdamW steps. The data-parallel ranks see different batches; the reference averages their
token-mean losses (what averaging gradients over dp computes). Tolerance: 1e-5 relative on losses and final params.
One spawn runs all three meshes (each rank builds the three 5-D meshes with lightning_v17.mesh.build_device_mesh).
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests._dist import spawn
from tests.dist.test_tp import (
    RTOL,
    STEPS,
    compare_params,
    full,
    make_optimizer,
    packed_batch,
    reference_run,
    rel_loss,
    tiny_model,
    token_mean_loss,
)

#: the compositions this file checks against one process (docs/gen_layouts.py builds docs/layouts.md from them)
COMPOSES = (("pp", "zero1"), ("sp", "zero3"), ("pp", "sp"))


def _batches(dp: int, seed: int) -> list[list[dict]]:
    return [[packed_batch(seed + 10 * s + d) for d in range(dp)] for s in range(STEPS)]


def _pp_dp_zero1(base) -> dict:
    from lightning_v17.config import MeshSpec, PipelinePolicy
    from lightning_v17.engine.pipeline.runtime import build_schedule, pipeline_step, split_model
    from lightning_v17.engine.zero.stages_0_2 import apply_zero
    from lightning_v17.mesh import build_device_mesh
    from lightning_v17.models.pp_layouts import model_pipeline_layout

    mesh = build_device_mesh(MeshSpec(pp=2, dp_shard=2), device_type="cpu")
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    steps = _batches(2, 300)
    ref_losses, ref_params = reference_run(base, steps)
    policy = PipelinePolicy(schedule="1f1b", microbatches=4)
    model = copy.deepcopy(base)
    stage_modules, stage_ids = split_model(
        model, layout=model_pipeline_layout(model), pp_rank=pp_rank, pp=2, policy=policy
    )
    engine = apply_zero(model, stage=1, mesh=mesh)  # ZeRO-1 over this stage's dp group
    runtime = build_schedule(stage_modules, stage_ids=stage_ids, pp_mesh=mesh["pp"], policy=policy, device="cpu")
    opt = engine.shard_optimizer(make_optimizer(model.parameters()))
    losses = []
    for s in range(STEPS):
        opt.zero_grad()
        local = pipeline_step(runtime, steps[s][dp_rank], grad_sync=engine)
        opt.step()
        engine.gather_params()
        # the logged loss is per dp rank; the reference is their mean
        mean = local.clone()
        torch.distributed.all_reduce(mean, group=mesh["dp"].get_group())
        losses.append(float(mean) / 2)
    opt_numel = sum(p.numel() for g in opt.param_groups for p in g["params"])
    return {
        "loss_rel": rel_loss(losses, ref_losses),
        "param_rel": compare_params(dict(model.named_parameters()), ref_params),
        "opt_shard_fraction": opt_numel / sum(p.numel() for p in model.parameters()),
    }


def _tp_dp_fsdp(base) -> dict:
    from lightning_v17.config import MeshSpec
    from lightning_v17.engine.tp.apply import apply_tensor_parallel
    from lightning_v17.engine.zero.stages_0_2 import apply_zero
    from lightning_v17.mesh import build_device_mesh
    from lightning_v17.models.tp_plans import resolve_tp_plan

    mesh = build_device_mesh(MeshSpec(dp_shard=2, tp=2), device_type="cpu")
    dp_rank = mesh["dp"].get_local_rank()
    steps = _batches(2, 400)
    ref_losses, ref_params = reference_run(base, steps)
    model = copy.deepcopy(base)
    apply_tensor_parallel(model, tp_mesh=mesh["tp"], plan=resolve_tp_plan(model, sequence_parallel=True))
    # FSDP2 over dp_shard on top of the TP DTensors: 2-D (dp_shard, tp). apply_zero expects the LightningModule as
    # root (it shards the root's children), so hold the Llama the way LlamaLM does, as `.model`.
    holder = torch.nn.Module()
    holder.model = model
    apply_zero(holder, stage=3, mesh=mesh)
    opt = make_optimizer(model.parameters())
    losses = []
    for s in range(STEPS):
        b = steps[s][dp_rank]
        opt.zero_grad()
        loss = token_mean_loss(model(b["input_ids"], position_ids=b["position_ids"]), b["labels"])
        loss.backward()
        opt.step()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean, group=mesh["dp"].get_group())
        losses.append(float(mean) / 2)
    params = {k: full(v.detach()) for k, v in model.named_parameters()}
    two_d = all(len(p.placements) == 2 for p in model.parameters())
    return {"loss_rel": rel_loss(losses, ref_losses), "param_rel": compare_params(params, ref_params), "2d": two_d}


def _pp_tp(base) -> dict:
    from lightning_v17.config import MeshSpec, PipelinePolicy
    from lightning_v17.engine.pipeline.runtime import build_schedule, pipeline_step, split_model
    from lightning_v17.engine.tp.apply import apply_tensor_parallel
    from lightning_v17.mesh import build_device_mesh
    from lightning_v17.models.pp_layouts import model_pipeline_layout
    from lightning_v17.models.tp_plans import resolve_tp_plan

    mesh = build_device_mesh(MeshSpec(pp=2, tp=2), device_type="cpu")
    steps = _batches(1, 500)
    ref_losses, ref_params = reference_run(base, steps)
    policy = PipelinePolicy(schedule="interleaved_1f1b", microbatches=4, virtual_stages=2)
    model = copy.deepcopy(base)
    stage_modules, stage_ids = split_model(
        model, layout=model_pipeline_layout(model), pp_rank=mesh["pp"].get_local_rank(), pp=2, policy=policy
    )
    # TP on the pruned model: the stage views share its submodules, so they are parallelized too
    plan = resolve_tp_plan(model, sequence_parallel=True, vocab_parallel=True, loss_parallel=True)
    apply_tensor_parallel(model, tp_mesh=mesh["tp"], plan=plan)
    runtime = build_schedule(
        stage_modules, stage_ids=stage_ids, pp_mesh=mesh["pp"], policy=policy, device="cpu", loss_parallel=True
    )
    opt = make_optimizer(model.parameters())
    losses = []
    for s in range(STEPS):
        opt.zero_grad()
        losses.append(float(pipeline_step(runtime, steps[s][0])))
        opt.step()
    params = {k: full(v.detach()) for k, v in model.named_parameters()}
    return {"loss_rel": rel_loss(losses, ref_losses), "param_rel": compare_params(params, ref_params)}


def _worker(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    base = tiny_model(0)
    return {"pp_dp_zero1": _pp_dp_zero1(base), "tp_dp_fsdp2": _tp_dp_fsdp(base), "pp_tp_sp": _pp_tp(base)}


@pytest.mark.timeout(240)
def test_composed_meshes_match_single_process():
    results = spawn(_worker, world_size=4, timeout=230)
    print(results[0])
    for rank, r in enumerate(results):
        for name in ("pp_dp_zero1", "tp_dp_fsdp2", "pp_tp_sp"):
            assert r[name]["loss_rel"] < RTOL, (rank, name, r[name])
            assert r[name]["param_rel"] < RTOL, (rank, name, r[name])
        assert r["tp_dp_fsdp2"]["2d"], r
        # ZeRO-1: each dp rank's optimizer holds about half of its stage's parameters (dim-0 chunks)
        assert 0.45 < r["pp_dp_zero1"]["opt_shard_fraction"] < 0.56, r
