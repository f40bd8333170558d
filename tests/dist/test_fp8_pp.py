"""FP8 (tensorwise) under pipeline parallelism, pp=2 (issue 12): each stage converts its own blocks.

``parallelize`` splits the model first and converts afterwards, so each pp rank converts only the Linears of the
blocks it holds: 7 per block of the tiny Llama, one block per stage here, none on the other stage. 5 AdamW steps of
the 1F1B schedule (4 micro-batches of one packed row) match one process within 1e-5 relative. Dynamic float8 scales
depend on the tokens quantized, and the pipeline quantizes each micro-batch on its own, so the reference runs the
same 4 rows as 4 micro-batches (each row has the same number of target tokens, so the mean of the micro-batch
means is the batch's token mean). Also counted: 3 float8 GEMMs per converted Linear per micro-batch on each stage
(the first step runs a few more while torch.distributed.pipelining sets the stages up).
"""

from __future__ import annotations

import pytest

from tests._dist import spawn

#: the compositions this file checks against one process (docs/gen_layouts.py builds docs/layouts.md from them)
COMPOSES = (("fp8", "pp"),)

pytest.importorskip("torchao")

RTOL = 1e-5
STEPS = 5
MICRO = 4
LAYERS = 2


def _model():
    from tests.dist.test_tp import tiny_model

    return tiny_model(0, layers=LAYERS)


def _reference():
    from lightning_v17.config import FP8Policy
    from lightning_v17.engine.fp8.convert import apply_fp8
    from lightning_v17.engine.zero.fsdp import find_wrap_units
    from tests.dist.test_tp import make_optimizer, packed_batch, token_mean_loss

    model = _model()
    apply_fp8(model, policy=FP8Policy("tensorwise"), units=find_wrap_units(model), device="cpu")
    opt = make_optimizer(model.parameters())
    losses = []
    for s in range(STEPS):
        b = packed_batch(20 + s)
        total = 0.0
        for i in range(MICRO):
            row = {k: v[i : i + 1] for k, v in b.items()}
            loss = token_mean_loss(model(row["input_ids"], position_ids=row["position_ids"]), row["labels"]) / MICRO
            loss.backward()
            total += float(loss)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _worker(rank: int, world: int) -> dict:
    import torch
    from torchao.float8.float8_linear import Float8Linear

    from lightning_v17.config import FP8Policy, MeshSpec, PipelinePolicy, TrainingPolicy, ZeroPolicy
    from lightning_v17.engine.parallelize import parallelize
    from lightning_v17.engine.pipeline.runtime import pipeline_step
    from lightning_v17.mesh import MeshRuntime, build_device_mesh
    from lightning_v17.models.pp_layouts import model_pipeline_layout
    from tests.dist.test_fp8 import _count_scaled_mm
    from tests.dist.test_tp import make_optimizer, packed_batch

    torch.set_num_threads(1)
    spec = MeshSpec(pp=2)
    mesh = MeshRuntime(spec, build_device_mesh(spec, device_type="cpu"))
    calls = _count_scaled_mm()
    model = _model()
    policy = TrainingPolicy(
        zero=ZeroPolicy(stage=1), pipeline=PipelinePolicy(schedule="1f1b", microbatches=MICRO),
        fp8=FP8Policy("tensorwise"),
    )  # fmt: skip
    done = parallelize(model, mesh=mesh, policy=policy, device="cpu", pp_layout=model_pipeline_layout(model))
    opt = make_optimizer(model.parameters())
    done.zero.prepare_optimizers([opt])
    losses, per_step = [], []
    for s in range(STEPS):
        before = len(calls)
        loss = pipeline_step(done.pipeline, packed_batch(20 + s), grad_sync=done.zero)
        opt.step()
        done.zero.after_optimizer_step()
        done.fp8.after_optimizer_step()
        opt.zero_grad()
        per_step.append(len(calls) - before)
        losses.append(float(loss))
    return {
        "losses": losses,
        "per_step": per_step,
        "layers": done.fp8_layers,
        "blocks": sorted(model.layers.keys()),
        "float8_modules": sorted(n for n, m in model.named_modules() if isinstance(m, Float8Linear)),
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


@pytest.mark.timeout(240)
def test_each_pipeline_stage_converts_its_own_blocks_and_matches_one_process():
    res = spawn(_worker, world_size=2, timeout=220)
    ref_losses, ref_params = _reference()
    blocks = [r["blocks"] for r in res]
    assert blocks == [["0"], ["1"]], blocks
    names = ("attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1", "feed_forward.w2",
             "feed_forward.w3")  # fmt: skip
    seen = set()
    for rank, r in enumerate(res):
        assert r["layers"] == tuple(f"layers.{rank}.{n}" for n in names), (rank, r["layers"])
        assert r["float8_modules"] == sorted(r["layers"]), rank
        assert r["losses"] == pytest.approx(ref_losses, rel=RTOL), rank
        # 3 float8 GEMMs per converted Linear per micro-batch; the first step runs more (torch.distributed.pipelining
        # sets the stages up then: measured 7 more on stage 0, 21 more on stage 1), the parity above covers it
        gemms = 3 * len(r["layers"]) * MICRO
        assert r["per_step"][1:] == [gemms] * (STEPS - 1), (rank, r["per_step"])
        assert r["per_step"][0] >= gemms, (rank, r["per_step"])
        for n, p in r["params"].items():
            ref = ref_params[n]
            err = float((p - ref).norm() / ref.norm().clamp_min(1e-12))
            assert err < RTOL, f"rank {rank}: {n} differs by {err:.2e} relative"
            seen.add(n)
    assert seen == set(ref_params)
