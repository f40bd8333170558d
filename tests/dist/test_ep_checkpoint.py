"""Checkpoints of a MoE model reshard across expert-parallel sizes online, optimizer state and expert bias
included: saved at ep=2 (2 ranks, ZeRO-1, AdamW, the aux-loss-free bias on), loaded at ep=1 (2 ranks: the experts
back inside the ZeRO partition, rows over dp_shard) and at ep=4 (4 ranks, one expert per rank) through the
strategy's own path (``checkpoint.sharded.save_sharded``/``load_sharded`` with ``engine.zero.state_dict``); the next 3
steps equal the uninterrupted ep=2 run's within 1e-5 (losses, every parameter, the expert biases). Likewise on 4
ranks (ep=2 x efsdp=2): a ZeRO-3 save (experts split over efsdp by FSDP2) resumed at ep=1, ep=4, ep=2 on 2 ranks and
ep=2 x efsdp=2 at ZeRO-1/2 (the experts' ZeRO engine), and a ZeRO-2 save (the experts' optimizer state partitioned
over efsdp by that engine) resumed at ep=1 (ZeRO-1) and ep=4 (ZeRO-3). ``v17 consolidate``
writes every expert of the ep=2 checkpoint whole (``[E, ...]``), equal to the weights at the save."""

from __future__ import annotations

import pytest

from tests._dist import spawn

SEQ, BATCH, BEFORE, AFTER = 16, 4, 3, 3
TOL = 1e-5


def _config():
    from lightning_v17.models import ModelConfig

    return ModelConfig(vocab_size=64, hidden=32, layers=2, heads=4, kv_heads=2, ffn=64, max_seq_len=SEQ,
                       num_experts=4, experts_per_token=2, expert_ffn=32, aux_loss_coef=0.01,
                       expert_bias_rate=0.01)  # fmt: skip


def _batches():
    import torch

    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 64, (BATCH, SEQ + 1), generator=g) for _ in range(BEFORE + AFTER)]


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _worker(rank: int, world: int, ep: int, root: str, load: bool, stage: int = 1) -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from lightning_v17.checkpoint.sharded import load_sharded, save_sharded
    from lightning_v17.config import MeshSpec, TrainingPolicy, ZeroPolicy
    from lightning_v17.engine.ep import balanced_layers, step_expert_biases
    from lightning_v17.engine.parallelize import parallelize
    from lightning_v17.engine.zero import state_dict as state_engine
    from lightning_v17.mesh import MeshRuntime, build_device_mesh
    from lightning_v17.models import Llama
    from lightning_v17.models.moe import moe_layers

    spec = MeshSpec(dp_shard=world, ep=ep)
    mesh = MeshRuntime(spec, build_device_mesh(spec, device_type="cpu"))
    model = Llama(_config(), init_seed=1 if load else 0)  # a loaded run starts from other weights on purpose
    done = parallelize(model, mesh=mesh, policy=TrainingPolicy(zero=ZeroPolicy(stage=stage)), device="cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    done.zero.prepare_optimizers([opt])
    balanced = balanced_layers(model)
    per = BATCH // world
    losses = []
    batches = _batches()
    start, at_save = 0, {}
    if load:
        app = state_engine.get_state_dicts(model, [opt], backend=done.zero)
        own = state_engine.param_group_lists(app)
        load_sharded(root, app_state=app)
        state_engine.restore_param_group_lists(app, own)
        state_engine.set_state_dicts(model, [opt], app, backend=done.zero)
        start = BEFORE
    for step in range(start, BEFORE + AFTER):
        mine = batches[step][per * rank : per * (rank + 1)]
        logits = model(mine[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 64), mine[:, 1:].reshape(-1)) + sum(m.aux_loss for m in
                                                                                      moe_layers(model))
        loss.backward()
        done.zero.finish_grad_sync()
        opt.step()
        done.zero.after_optimizer_step(opt)
        step_expert_biases(balanced, group=mesh.group("dp"))
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / world)
        if not load and step == BEFORE - 1:
            app = state_engine.get_state_dicts(model, [opt], backend=done.zero)
            save_sharded(root, app_state=app, trainer_state={"step": step}, meta={"ep": ep})
            at_save = {n: _full(p).detach().clone() for n, p in model.named_parameters()}
    params = {n: _full(p).detach().clone() for n, p in model.named_parameters()}
    biases = [m.expert_bias.clone() for m in moe_layers(model)]
    return {"losses": losses[-AFTER:], "params": params, "biases": biases, "at_save": None if load else at_save}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[str, dict]:
    root = str(tmp_path_factory.mktemp("ep_ckpt") / "step-3")
    runs = spawn(_worker, world_size=2, args=(2, root, False), timeout=300)
    return root, runs[0]


@pytest.mark.parametrize(("world", "ep"), [(2, 1), (4, 4)], ids=["ep1", "ep4"])
def test_an_ep2_checkpoint_resumes_at_another_ep(saved, world, ep) -> None:
    import torch

    root, uninterrupted = saved
    runs = spawn(_worker, world_size=world, args=(ep, root, True), timeout=300)
    for got in runs:
        assert got["losses"] == pytest.approx(uninterrupted["losses"], rel=TOL, abs=TOL)
        for name, p in got["params"].items():
            torch.testing.assert_close(p, uninterrupted["params"][name], rtol=TOL, atol=TOL, msg=name)
        for b, want in zip(got["biases"], uninterrupted["biases"]):
            torch.testing.assert_close(b, want, rtol=0, atol=0)
    assert any(bool(b.abs().sum() > 0) for b in uninterrupted["biases"]), "the expert bias never moved"


@pytest.fixture(scope="module")
def saved_zero3(tmp_path_factory) -> tuple[str, dict]:
    """ZeRO-3 at ep=2 on 4 ranks: each ep rank's experts split again over efsdp=2 (a quarter of them per rank)."""
    root = str(tmp_path_factory.mktemp("ep_ckpt3") / "step-3")
    runs = spawn(_worker, world_size=4, args=(2, root, False, 3), timeout=300)
    return root, runs[0]


@pytest.mark.parametrize(("world", "ep", "stage"), [(2, 1, 3), (4, 4, 3), (2, 2, 1), (4, 2, 1), (4, 2, 2)],
                         ids=["ep1-zero3", "ep4-zero3", "ep2-zero1", "ep2xefsdp2-zero1", "ep2xefsdp2-zero2"])  # fmt: skip
def test_an_efsdp_sharded_checkpoint_resumes_at_another_layout(saved_zero3, world, ep, stage) -> None:
    _check_resume(saved_zero3, world, ep, stage)


@pytest.fixture(scope="module")
def saved_zero2(tmp_path_factory) -> tuple[str, dict]:
    """ZeRO-2 at ep=2 on 4 ranks: the experts' optimizer state partitioned over efsdp=2 by the experts' engine."""
    root = str(tmp_path_factory.mktemp("ep_ckpt2") / "step-3")
    runs = spawn(_worker, world_size=4, args=(2, root, False, 2), timeout=300)
    return root, runs[0]


@pytest.mark.parametrize(("world", "ep", "stage"), [(2, 1, 1), (4, 4, 3)], ids=["ep1-zero1", "ep4-zero3"])
def test_an_efsdp_partitioned_zero2_checkpoint_resumes_at_another_layout(saved_zero2, world, ep, stage) -> None:
    _check_resume(saved_zero2, world, ep, stage)


def _check_resume(saved_run: tuple[str, dict], world: int, ep: int, stage: int) -> None:
    import torch

    root, uninterrupted = saved_run
    runs = spawn(_worker, world_size=world, args=(ep, root, True, stage), timeout=300)
    for got in runs:
        assert got["losses"] == pytest.approx(uninterrupted["losses"], rel=TOL, abs=TOL)
        for name, p in got["params"].items():
            torch.testing.assert_close(p, uninterrupted["params"][name], rtol=TOL, atol=TOL, msg=name)
        for b, want in zip(got["biases"], uninterrupted["biases"]):
            torch.testing.assert_close(b, want, rtol=0, atol=0)


def test_consolidate_writes_full_per_expert_tensors(saved, tmp_path) -> None:
    import torch

    from lightning_v17.checkpoint.sharded import consolidate

    root, uninterrupted = saved
    out = torch.load(consolidate(root, tmp_path / "full.pt"), weights_only=True)
    model = out.get("model", out)
    experts = [n for n in uninterrupted["at_save"] if ".experts." in n]
    assert experts
    for name in experts:
        assert model[name].shape[0] == 4 and torch.equal(model[name], uninterrupted["at_save"][name]), name
