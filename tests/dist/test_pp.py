"""Pipeline parallel (pp=2) against a single-process reference, for every schedule, plus FQN-resharding checkpoints.

2 gloo ranks, tiny Llama (4 blocks) in fp32, m=4 micro-batches of one packed row each, 5 AdamW steps. Tolerance:
1e-5 relative on each step's loss (which every pp rank must return identically) and on every final parameter.
The stage-local state dicts are gathered by FQN and must equal the reference model's state dict; a checkpoint saved
at pp=2 loads at pp=1 (and a pp=1 checkpoint into the pp=2 stages); one saved at tp=2 loads at tp=1.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from tests._dist import spawn
from tests.dist.test_tp import (
    RTOL,
    STEPS,
    compare_params,
    make_optimizer,
    packed_batch,
    reference_run,
    rel_err,
    rel_loss,
    tiny_model,
    token_mean_loss,
)

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 2), ("zbv", 2)]


def _pp_worker(rank: int, world: int, tmp: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_v17.config import PipelinePolicy
    from lightning_v17.engine.pipeline.runtime import build_schedule, pipeline_eval, pipeline_step, split_model
    from lightning_v17.models.pp_layouts import model_pipeline_layout

    torch.set_num_threads(1)
    pp_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))["pp"]
    base = tiny_model(0)
    steps = [[packed_batch(20 + s)] for s in range(STEPS)]
    ref_losses, ref_params = reference_run(base, steps)
    eval_batch = packed_batch(99)
    with torch.no_grad():
        ref_model = copy.deepcopy(base)
        for k, v in ref_model.named_parameters():
            v.copy_(ref_params[k])
        ref_eval = float(
            token_mean_loss(
                ref_model(eval_batch["input_ids"], position_ids=eval_batch["position_ids"]), eval_batch["labels"]
            )
        )
    out: dict = {}
    for schedule, v in SCHEDULES:
        policy = PipelinePolicy(schedule=schedule, microbatches=4, virtual_stages=v)
        model = copy.deepcopy(base)
        stage_modules, stage_ids = split_model(
            model, layout=model_pipeline_layout(model), pp_rank=rank, pp=2, policy=policy
        )
        runtime = build_schedule(stage_modules, stage_ids=stage_ids, pp_mesh=pp_mesh, policy=policy, device="cpu")
        opt = make_optimizer(model.parameters())  # the pruned model holds exactly this rank's stage parameters
        losses, bubbles = [], []
        for s in range(STEPS):
            opt.zero_grad()
            loss = pipeline_step(runtime, steps[s][0])
            assert not loss.requires_grad
            opt.step()
            losses.append(float(loss))
            bubbles.append(runtime.bubble_fraction)
        eval_loss = float(pipeline_eval(runtime, eval_batch))
        local_sd = {k: t.detach().clone() for k, t in model.state_dict().items()}
        gathered: list = [None] * world
        dist.all_gather_object(gathered, local_sd)
        union: dict = {}
        for part in gathered:
            overlap = set(union) & set(part)
            assert not overlap, f"two stages hold the same FQNs: {sorted(overlap)[:3]}"
            union.update(part)
        out[schedule] = {
            "stage_ids": stage_ids,
            "loss_rel": rel_loss(losses, ref_losses),
            "param_rel": compare_params(dict(model.named_parameters()), ref_params),
            "union_keys_equal": sorted(union) == sorted(ref_params),
            "union_rel": compare_params(union, ref_params),
            "eval_rel": abs(eval_loss - ref_eval) / abs(ref_eval),
            "bubbles": bubbles,
            "local_blocks": sorted(model.layers.keys()),
            "has_embed": model.tok_embeddings is not None,
            "has_head": model.output is not None,
        }
        if schedule == "1f1b":
            out["ckpt"] = _checkpoint_roundtrip(rank, tmp, model, base, ref_params, pp_mesh)
            out["planned_bubble"] = runtime.planned_bubble
        if schedule == "gpipe":
            out["loss_scale"] = _loss_scale_check(rank, base, pp_mesh)
            out["loss_mask"] = _loss_mask_check(rank, base, pp_mesh)
    return out


def _loss_mask_check(rank, base, pp_mesh) -> dict:
    """A float loss_mask travels with the labels through the micro-batch split: the pipeline loss and gradients
    equal sum(CE * mask) / sum(mask) over tokens with label != -100, computed in one process."""
    import torch.nn.functional as F

    from lightning_v17.config import PipelinePolicy
    from lightning_v17.engine.pipeline.runtime import build_schedule, pipeline_step, split_model
    from lightning_v17.models.pp_layouts import model_pipeline_layout

    b = packed_batch(6)
    b["loss_mask"] = torch.rand(b["labels"].shape, generator=torch.Generator().manual_seed(3))
    ref = copy.deepcopy(base)
    logits = ref(b["input_ids"], position_ids=b["position_ids"])
    ce = F.cross_entropy(logits.flatten(0, 1), b["labels"].flatten(), ignore_index=-100, reduction="none")
    w = (b["labels"] != -100).float().flatten() * b["loss_mask"].flatten()
    ref_loss = (ce * w).sum() / w.sum()
    ref_loss.backward()
    policy = PipelinePolicy(schedule="1f1b", microbatches=4)
    model = copy.deepcopy(base)
    views, ids = split_model(model, layout=model_pipeline_layout(model), pp_rank=rank, pp=2, policy=policy)
    rt = build_schedule(views, stage_ids=ids, pp_mesh=pp_mesh, policy=policy, device="cpu")
    loss = float(pipeline_step(rt, b))
    ref_grads = dict(ref.named_parameters())
    worst = max(rel_err(p.grad, ref_grads[k].grad) for k, p in model.named_parameters())
    return {"grad_rel": worst, "loss_rel": abs(loss - float(ref_loss)) / float(ref_loss)}


def _loss_scale_check(rank, base, pp_mesh) -> dict:
    """fp16 loss scaling through the schedule: gradients scale by S, the returned loss does not."""
    from lightning_v17.config import PipelinePolicy
    from lightning_v17.engine.pipeline.runtime import build_schedule, pipeline_step, split_model
    from lightning_v17.models.pp_layouts import model_pipeline_layout

    policy = PipelinePolicy(schedule="gpipe", microbatches=4)
    grads, losses = [], []
    for scale in (None, 1024.0):
        model = copy.deepcopy(base)
        views, ids = split_model(model, layout=model_pipeline_layout(model), pp_rank=rank, pp=2, policy=policy)
        rt = build_schedule(views, stage_ids=ids, pp_mesh=pp_mesh, policy=policy, device="cpu")
        losses.append(float(pipeline_step(rt, packed_batch(5), loss_scale=scale)))
        grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
    worst = max(rel_err(grads[1][k] / 1024.0, grads[0][k]) for k in grads[0])
    return {"grad_rel": worst, "loss_rel": abs(losses[1] - losses[0]) / losses[0]}


def _checkpoint_roundtrip(rank, tmp, pp_model, base, ref_params, pp_mesh) -> dict:
    """pp=2 -> pp=1 and pp=1 -> pp=2 through the checkpoint engine (DCP reshards by FQN)."""
    from lightning_v17.config import PipelinePolicy
    from lightning_v17.checkpoint.sharded import load_full_state_dict, load_sharded, save_sharded
    from lightning_v17.engine.pipeline.runtime import split_model
    from lightning_v17.models.pp_layouts import model_pipeline_layout

    path = f"{tmp}/pp2"
    save_sharded(path, app_state={"model": pp_model.state_dict()}, trainer_state={}, meta={"pp": 2})
    full = load_full_state_dict(path)  # one process, no template: the pp=1 view
    pp2_to_pp1 = compare_params(full, ref_params) if sorted(full) == sorted(ref_params) else float("inf")
    # pp=1 checkpoint (the reference weights) loaded into freshly split pp=2 stages
    ref_model = copy.deepcopy(base)
    with torch.no_grad():
        for k, v in ref_model.named_parameters():
            v.copy_(ref_params[k])
    path1 = f"{tmp}/pp1"
    if rank == 0:
        save_sharded(
            path1,
            app_state={"model": ref_model.state_dict()},
            trainer_state={},
            meta={"pp": 1},
            process_group=dist.new_group([0]),
        )
    else:
        dist.new_group([0])  # new_group is collective over the world
    dist.barrier()
    fresh = tiny_model(7)  # different weights, overwritten by the load
    split_model(
        fresh,
        layout=model_pipeline_layout(fresh),
        pp_rank=rank,
        pp=2,
        policy=PipelinePolicy(schedule="1f1b", microbatches=4),
    )
    load_sharded(path1, app_state={"model": fresh.state_dict()}, process_group=dist.new_group([rank]))
    pp1_to_pp2 = compare_params(dict(fresh.named_parameters()), ref_params)
    return {"pp2_to_pp1": pp2_to_pp1, "pp1_to_pp2": pp1_to_pp2}


@pytest.mark.timeout(240)
def test_pipeline_schedules_match_single_process(tmp_path):
    results = spawn(_pp_worker, world_size=2, args=(str(tmp_path),), timeout=230)
    print(
        {s: {k: results[0][s][k] for k in ("loss_rel", "param_rel", "eval_rel")} for s, _ in SCHEDULES},
        results[0]["ckpt"],
    )
    for rank, rank_out in enumerate(results):
        for schedule, _v in SCHEDULES:
            r = rank_out[schedule]
            assert r["loss_rel"] < RTOL, (rank, schedule, r)
            assert r["param_rel"] < RTOL, (rank, schedule, r)
            assert r["union_keys_equal"] and r["union_rel"] < RTOL, (rank, schedule, r)
            assert r["eval_rel"] < RTOL, (rank, schedule, r)
            assert all(b is not None and 0.0 <= b < 1.0 for b in r["bubbles"]), (rank, schedule, r)
        # stage placement: 1 stage per rank, looped for interleaved, V for zbv (stages 0 and 3 on rank 0)
        assert rank_out["1f1b"]["stage_ids"] == (rank,)
        assert rank_out["interleaved_1f1b"]["stage_ids"] == (rank, rank + 2)
        assert rank_out["zbv"]["stage_ids"] == ((0, 3) if rank == 0 else (1, 2))
        assert rank_out["1f1b"]["local_blocks"] == (["0", "1"] if rank == 0 else ["2", "3"])
        assert rank_out["1f1b"]["has_embed"] == (rank == 0) and rank_out["1f1b"]["has_head"] == (rank == 1)
        assert rank_out["zbv"]["has_embed"] == (rank == 0) and rank_out["zbv"]["has_head"] == (rank == 0)
        ck = rank_out["ckpt"]
        assert ck["pp2_to_pp1"] < RTOL and ck["pp1_to_pp2"] == 0.0, ck
        assert rank_out["loss_scale"]["grad_rel"] < RTOL and rank_out["loss_scale"]["loss_rel"] < RTOL, rank_out
        assert rank_out["loss_mask"]["grad_rel"] < RTOL and rank_out["loss_mask"]["loss_rel"] < RTOL, rank_out
        assert rank_out["planned_bubble"] == 0.25  # (p-1)/m with p=2, m=4
