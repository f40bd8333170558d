"""Delayed scaling (``fp8="delayed"``) on 2 gloo ranks (issue 12): amax synced over dp, histories in checkpoints.

1. **Engine, 10 steps at ZeRO-3 and ZeRO-1, dp=2** (tiny HF Llama, 14 converted Linears): after every step the
   amax histories and scales of every layer are bitwise equal on both ranks (the pending amaxes are all-reduced with
   MAX over the dp axis after the optimizer step); losses and final parameters match one process that runs each
   rank's rows as a micro-batch (its pending amax is the max over both micro-batches, which is what the MAX
   all-reduce computes) within 1e-5 relative, and so do its histories; 3 float8 GEMMs per layer per step.
2. **Through V17Strategy in a Trainer** (ZeRO-3, dp=2, the reference LlamaLM on packed data): 8 steps with a
   sharded checkpoint at step 4; fresh processes resume from it and steps 5-8 are bit-identical (==) in loss, and
   the final histories and scales equal the uninterrupted run's; the same checkpoint loads on 1 rank (ZeRO-0), where
   the histories and scales are those saved at step 4 (the buffers are replicated, so resharding moves them whole).
"""

from __future__ import annotations

import pytest

from tests._dist import spawn

#: the compositions this file checks against one process (docs/gen_layouts.py builds docs/layouts.md from them)
COMPOSES = (("fp8", "zero1"), ("fp8", "zero3"))

pytest.importorskip("transformers")

RTOL = 1e-5
STEPS = 10
ROWS = 8
LAYERS = 2
CONVERTED = 7 * LAYERS
HISTORY = 4  # shorter than STEPS, so the histories roll


def _batches():
    import torch

    from tests._models import token_dataset

    rows = token_dataset("hf_llama", rows=ROWS * STEPS)
    return [torch.stack([r["input_ids"] for r in rows[ROWS * s : ROWS * s + ROWS]]) for s in range(STEPS)]


def _fp8_state(model) -> dict:
    from lightning_v17.engine.fp8.delayed import DelayedFloat8Linear

    return {
        f"{n}.{b}": getattr(m, b).detach().clone()
        for n, m in model.named_modules()
        if isinstance(m, DelayedFloat8Linear)
        for b in ("amax_history", "scale")
    }


def _reference():
    import torch

    from lightning_v17.config import FP8Policy
    from lightning_v17.engine.fp8.convert import apply_fp8
    from lightning_v17.engine.fp8.delayed import update_scales
    from lightning_v17.engine.zero.fsdp import find_wrap_units
    from tests._models import hf_llama

    model = hf_llama(layers=LAYERS)
    apply_fp8(model, policy=FP8Policy("delayed", amax_history_len=HISTORY), units=find_wrap_units(model), device="cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for ids in _batches():
        total = 0.0
        for part in (ids[: ROWS // 2], ids[ROWS // 2 :]):
            # each micro-batch back-propagates its own mean loss, as each rank does (a loss / 2 here would halve
            # the grad_output amaxes, which the delayed history records); the dp mean comes after, as FSDP2's AVG
            loss = model(input_ids=part, labels=part).loss
            loss.backward()
            total += loss.item() / 2
        for p in model.parameters():
            p.grad /= 2
        opt.step()
        opt.zero_grad()
        update_scales(model)
        losses.append(total)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, _fp8_state(model)


def _engine_worker(rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist

    from lightning_v17.config import FP8Policy, MeshSpec, TrainingPolicy, ZeroPolicy
    from lightning_v17.engine.parallelize import parallelize
    from lightning_v17.mesh import MeshRuntime, build_device_mesh
    from tests._models import hf_llama
    from tests.dist.test_fp8 import _count_scaled_mm

    spec = MeshSpec(dp_shard=2)
    mesh = MeshRuntime(spec, build_device_mesh(spec, device_type="cpu"))
    calls = _count_scaled_mm()
    out = {}
    for stage in (3, 1):
        model = hf_llama(layers=LAYERS)
        policy = TrainingPolicy(zero=ZeroPolicy(stage=stage), fp8=FP8Policy("delayed", amax_history_len=HISTORY))
        done = parallelize(model, mesh=mesh, policy=policy, device="cpu")
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        done.zero.prepare_optimizers([opt])
        losses, per_step, states = [], [], []
        for ids in _batches():
            mine = ids[rank * ROWS // 2 : (rank + 1) * ROWS // 2]
            before = len(calls)
            loss = model(input_ids=mine, labels=mine).loss
            loss.backward()
            opt.step()
            done.zero.after_optimizer_step()
            done.fp8.after_optimizer_step()  # what V17Strategy.optimizer_step calls: the amax MAX all-reduce
            opt.zero_grad()
            per_step.append(len(calls) - before)
            states.append(_fp8_state(model))
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(float(total) / world)
        params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                  for n, p in model.named_parameters()}  # fmt: skip
        out[stage] = {"losses": losses, "params": params, "states": states, "per_step": per_step,
                      "groups": len(done.fp8.amax_groups)}  # fmt: skip
    return out


@pytest.mark.timeout(240)
def test_delayed_histories_are_bitwise_equal_on_all_ranks_and_match_one_process():
    import torch

    res = spawn(_engine_worker, world_size=2, timeout=220)
    ref_losses, ref_params, ref_state = _reference()
    for stage in (3, 1):
        a, b = res[0][stage], res[1][stage]
        where = f"zero_stage={stage}"
        assert a["groups"] == 1, where  # the dp axis (tp=1)
        for step, (sa, sb) in enumerate(zip(a["states"], b["states"], strict=True)):
            assert len(sa) == 2 * CONVERTED
            for k in sa:
                assert torch.equal(sa[k], sb[k]), f"{where} step {step + 1}: {k} differs between the ranks"
        last = a["states"][-1]
        assert all(int((v > 0).sum(dim=1).min()) == HISTORY for k, v in last.items() if k.endswith("amax_history"))
        for k, v in ref_state.items():
            assert torch.allclose(last[k], v, rtol=RTOL, atol=0), f"{where}: {k} vs one process"
        for rank, r in enumerate(res):
            got = r[stage]
            assert got["per_step"] == [3 * CONVERTED] * STEPS, (where, got["per_step"])
            assert got["losses"] == pytest.approx(ref_losses, rel=RTOL), (where, rank)
            for n, ref in ref_params.items():
                err = float((got["params"][n] - ref).norm() / ref.norm().clamp_min(1e-12))
                assert err < RTOL, f"{where} rank {rank}: {n} differs by {err:.2e} relative"


# ------------------------------------------------------------------------------------------ Trainer: resume, dp2->dp1
HALF = 4


def _trainer(stage: int, max_steps: int, devices: int = 2, callbacks: tuple = ()):
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning_v17.strategies import V17Strategy

    from lightning_v17.config import FP8Policy

    class Losses(L.Callback):
        def __init__(self) -> None:
            self.values: list[float] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.values.append(float(outputs["loss"]))

    rec = Losses()
    strategy = V17Strategy(zero_stage=stage, fp8=FP8Policy("delayed", amax_history_len=HISTORY))
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=max_steps, logger=False,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks), enable_progress_bar=False,
        enable_model_summary=False, callbacks=[rec, *callbacks], num_sanity_val_steps=0, limit_val_batches=0,
    )  # fmt: skip
    return trainer, rec


def _module():
    from lightning_v17.models import LlamaLM

    return LlamaLM(model="tiny", model_overrides={"layers": 2}, warmup_steps=0, lr=1e-2, max_steps=2 * HALF)


def _phase_train(rank: int, world: int, ckpt_dir: str) -> dict:
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint

    from tests.dist.test_strategy_resume import _data

    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    saved: dict = {}

    class Snapshot(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if trainer.global_step == HALF:
                saved.update(_fp8_state(pl_module))

    ckpt = ModelCheckpoint(dirpath=ckpt_dir, filename="step{step}", auto_insert_metric_name=False,
                           every_n_train_steps=HALF, save_top_k=-1)  # fmt: skip
    module = _module()
    trainer, rec = _trainer(3, 2 * HALF, callbacks=(Snapshot(), ckpt))
    trainer.fit(module, datamodule=_data())
    return {"losses": rec.values, "saved": saved, "final": _fp8_state(module),
            "layers": len(trainer.strategy.parallel.fp8_layers)}  # fmt: skip


def _phase_resume(rank: int, world: int, ckpt: str) -> dict:
    import lightning as L
    import torch

    from tests.dist.test_strategy_resume import _data

    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    module = _module()
    trainer, rec = _trainer(3, 2 * HALF)
    trainer.fit(module, datamodule=_data(), ckpt_path=ckpt)
    return {"losses": rec.values, "final": _fp8_state(module)}


def _phase_one_rank(rank: int, world: int, ckpt: str) -> dict:
    import lightning as L
    import torch

    from tests.dist.test_strategy_resume import _data

    torch.set_num_threads(1)
    L.seed_everything(3, verbose=False)
    module = _module()
    trainer, _ = _trainer(0, HALF, devices=1)  # max_steps == the saved step: only the load runs
    trainer.fit(module, datamodule=_data(), ckpt_path=ckpt)
    return {"loaded": _fp8_state(module), "global_step": trainer.global_step}


@pytest.mark.timeout(300)
def test_delayed_resume_is_bit_exact_and_a_zero3_dp2_checkpoint_loads_at_dp1(tmp_path):
    import torch

    first = spawn(_phase_train, world_size=2, args=(str(tmp_path),), timeout=200, init_process_group=False)
    ckpt = str(tmp_path / f"step{HALF}.ckpt")
    second = spawn(_phase_resume, world_size=2, args=(ckpt,), timeout=200, init_process_group=False)
    third = spawn(_phase_one_rank, world_size=1, args=(ckpt,), timeout=200, init_process_group=False)
    assert first[0]["layers"] == CONVERTED
    saved = first[0]["saved"]
    assert saved and all(bool((v != 0).any()) for k, v in saved.items() if k.endswith("amax_history"))
    for rank in range(2):
        assert second[rank]["losses"] == first[rank]["losses"][HALF:], rank  # bit-identical after the restart
        for k, v in first[rank]["final"].items():
            assert torch.equal(second[rank]["final"][k], v), (rank, k)
        for k, v in first[rank]["saved"].items():
            assert torch.equal(v, saved[k]), (rank, k)  # and the ranks agreed at the save
    assert third[0]["global_step"] == HALF
    assert set(third[0]["loaded"]) == set(saved)
    for k, v in saved.items():
        assert torch.equal(third[0]["loaded"][k], v), k
    # the run moved on after the save (the checks above are not satisfied by a state that never changes)
    assert any(not torch.equal(first[0]["final"][k], v) for k, v in saved.items())
