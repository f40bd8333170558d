"""FP8 (tensorwise) with tensor parallelism at tp=2 (issue 12), 2 gloo ranks, against one process.

``parallelize`` converts the blocks' Linears first, then applies the model's own TP plan with torchao's float8
styles for them (``Float8ColwiseParallel`` for wq/wk/wv/w1/w3, ``Float8RowwiseParallel`` for wo/w2). Each cast
takes its amax over the whole tensor the single process would cast: the replicated input, the weight (its two
shards' amaxes all-reduced with MAX), and the gradient of the output (``NoopFwToFloat8BwDynamic`` on the DTensor).
So both tp ranks quantize exactly as one process running the whole batch does; what remains is the row-parallel
partial sums' fp32 order: 5 AdamW steps agree within ``RTOL`` relative (losses and every final parameter, gathered by
FQN). Both tp ranks read the same batches, so the reference is the whole batch (no micro-batch split).

Parity alone cannot tell torchao's float8 styles from plain ones here (without sequence parallelism a plain style
hands the Linear an fp32 DTensor that ``Float8Linear`` casts with the same global amax), so the test also checks
what the styles change: each converted Linear receives its input already cast to float8 (a DTensor of
``Float8TrainingTensor``), so a TP redistribution of it would move float8. Also checked: every converted Linear's
weight is a tp-sharded DTensor, the float8 GEMMs per step (3 per converted Linear, run on the local shards), and at
zero_stage=3 on top (dp_shard=1, float8 all-gather on) the same parity.
"""

from __future__ import annotations

import pytest

from tests._dist import spawn

#: the compositions this file checks against one process (docs/gen_layouts.py builds docs/layouts.md from them)
COMPOSES = (("fp8", "tp"),)

pytest.importorskip("torchao")

# Against one process. A last-bit difference of a row-parallel partial sum can move a value across a float8 rounding
# boundary of the next cast (e4m3: 3 mantissa bits), and Adam carries it on: 4.3e-4 (losses) and 5.1e-4 (parameters)
# relative on an Intel Xeon with torch's AVX512/AMX kernels, under 1e-5 on an AVX2 machine. What the float8 TP path
# must get right exactly is checked exactly (the casts' inputs and scales, the ranks' histories).
RTOL = 2e-3
STEPS = 5
LAYERS = 2
CONVERTED = 7 * LAYERS  # wq, wk, wv, wo, w1, w2, w3 per block


def _model():
    from tests.dist.test_tp import tiny_model

    return tiny_model(0, layers=LAYERS)  # hidden 64, 4 heads, 2 kv heads (dim 16), ffn 128, vocab 320


def _reference():
    from lightning_v17.config import FP8Policy
    from lightning_v17.engine.fp8.convert import apply_fp8
    from lightning_v17.engine.zero.fsdp import find_wrap_units
    from tests.dist.test_tp import packed_batch, reference_run

    model = _model()
    apply_fp8(model, policy=FP8Policy("tensorwise"), units=find_wrap_units(model), device="cpu")
    return reference_run(model, [[packed_batch(10 + s)] for s in range(STEPS)])


def _tp_sharded(weight) -> bool:
    names = weight.device_mesh.mesh_dim_names
    return any(p.is_shard() for n, p in zip(names, weight.placements, strict=True) if n == "tp")


def _worker(rank: int, world: int) -> dict:
    import torch
    from torch.distributed.tensor import DTensor
    from torchao.float8.float8_linear import Float8Linear

    from lightning_v17.config import FP8Policy, MeshSpec, TrainingPolicy, ZeroPolicy
    from lightning_v17.engine.parallelize import parallelize
    from lightning_v17.mesh import MeshRuntime, build_device_mesh
    from lightning_v17.models.tp_plans import resolve_tp_plan
    from tests.dist.test_fp8 import _count_scaled_mm
    from tests.dist.test_tp import full, make_optimizer, packed_batch, token_mean_loss

    torch.set_num_threads(1)
    spec = MeshSpec(tp=2)
    mesh = MeshRuntime(spec, build_device_mesh(spec, device_type="cpu"))
    calls = _count_scaled_mm()
    out = {}
    for stage in (1, 3):
        model = _model()
        policy = TrainingPolicy(zero=ZeroPolicy(stage=stage), fp8=FP8Policy("tensorwise"))
        done = parallelize(model, mesh=mesh, policy=policy, device="cpu", tp_plan=resolve_tp_plan(model))
        opt = make_optimizer(model.parameters())
        done.zero.prepare_optimizers([opt])
        # torchao's float8 styles cast a converted Linear's input to float8 as a DTensor before the Linear runs
        # (so a TP redistribution of it moves float8); a plain ColwiseParallel/RowwiseParallel hands it over in fp32
        arrived: dict[str, str] = {}

        def seen(name, arrived=arrived):
            def hook(_mod, args):
                x = args[0]
                arrived[name] = type(getattr(x, "_local_tensor", x)).__name__

            return hook

        for n, m in model.named_modules():
            if isinstance(m, Float8Linear):
                m.register_forward_pre_hook(seen(n))  # after the style's own pre-hook
        losses, per_step = [], []
        for s in range(STEPS):
            b = packed_batch(10 + s)
            before = len(calls)
            loss = token_mean_loss(model(b["input_ids"], position_ids=b["position_ids"]), b["labels"])
            loss.backward()
            opt.step()
            done.zero.after_optimizer_step()
            done.fp8.after_optimizer_step()
            opt.zero_grad()
            per_step.append(len(calls) - before)
            losses.append(float(full(loss.detach())))
        f8 = {n: m for n, m in model.named_modules() if isinstance(m, Float8Linear)}
        out[stage] = {
            "losses": losses,
            "per_step": per_step,
            "layers": done.fp8_layers,
            "float8_modules": sorted(f8),
            "inputs": arrived,
            "tp_sharded": all(isinstance(m.weight, DTensor) and _tp_sharded(m.weight) for m in f8.values()),
            "params": {n: full(p.detach()).clone() for n, p in model.named_parameters()},
        }
    return out


@pytest.mark.timeout(240)
def test_fp8_tensorwise_at_tp2_matches_one_process():
    from tests.dist.test_tp import rel_err

    res = spawn(_worker, world_size=2, timeout=220)
    ref_losses, ref_params = _reference()
    for rank, r in enumerate(res):
        for stage, got in r.items():
            where = f"tp=2 zero_stage={stage} rank {rank}"
            assert len(got["layers"]) == CONVERTED and got["float8_modules"] == sorted(got["layers"]), where
            assert got["tp_sharded"], f"{where}: a converted Linear's weight is not tp-sharded"
            assert set(got["inputs"]) == set(got["layers"]), where
            assert set(got["inputs"].values()) == {"Float8TrainingTensor"}, f"{where}: inputs {got['inputs']}"
            assert got["per_step"] == [3 * CONVERTED] * STEPS, f"{where}: float8 GEMMs per step {got['per_step']}"
            assert got["losses"] == pytest.approx(ref_losses, rel=RTOL), where
            for n, ref in ref_params.items():
                err = rel_err(got["params"][n], ref)
                assert err < RTOL, f"{where}: {n} differs by {err:.2e} relative"
