"""The user's own ``torch.optim`` optimizer steps DTensor parameters on their local shards (issue 16), 2 gloo ranks.

A plain ``torch.optim.AdamW`` (or SGD, Adam, ...) over FSDP2 / tensor-parallel DTensor parameters pays DTensor
dispatch on every elementwise op of its step; ``ZeroBackend.prepare_optimizers`` replaces the step of the elementwise
``torch.optim`` classes with one that runs on the local tensors (``lightning_v17.optim.local_step``). Each case runs
in one spawned pair of ranks twice, through a real Trainer: as built, and with ``enable_local_step`` switched off
(the DTensor step torch would run). Checked:

* the optimizer really stepped plain tensors (a step pre-hook records the parameter types it sees); with the
  switch off the same hook sees DTensors, so the check can tell;
* losses and final parameters are *bitwise* equal to the DTensor step (an elementwise update of a shard is the shard
  of the update), and equal a single-process run of the same optimizer and scheduler at 1e-6 relative (1e-5 at tp=2; lr 1e-3:
  see tests/dist/test_optim_library.py for why Adam at larger lr amplifies fp32 data-parallel noise);
* the state the checkpoint reads (``strategy.optimizer_state``) is keyed by the parameters and held as DTensors
  placed like them, so DCP reshards it as before;
* an ``LambdaLR`` made in ``configure_optimizers`` still sees every ``optimizer.step`` (its lr sequence matches the
  reference, and torch's "lr_scheduler.step() before optimizer.step()" warning never fires).
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests._dist import spawn
from tests.dist.test_zero_parity import PER_RANK_BATCH, STEPS, WORLD, _full_params, loss_fn, make_data, make_model

TOL = 1e-6
# tp=2: rowwise fc2 sums partial products across the ranks, so fp32 addition order differs from one process; measured
# 2.7e-6 (a LayerNorm bias), identical with the DTensor step; 1e-5 as tests/dist/test_strategy_tp_pp.py
TOL_TP = 1e-5

#: case -> (optimizer class name, kwargs, V17Strategy kwargs)
CASES: dict[str, tuple[str, dict, dict]] = {
    "adamw_default_z3": ("AdamW", {"lr": 1e-3}, {"zero_stage": 3}),
    "adam_amsgrad_z3": ("Adam", {"lr": 1e-3, "amsgrad": True, "eps": 1e-5, "weight_decay": 0.01}, {"zero_stage": 3}),
    "sgd_nesterov_z3": ("SGD", {"lr": 0.05, "momentum": 0.9, "nesterov": True}, {"zero_stage": 3}),
    "adamw_foreach_z3": ("AdamW", {"lr": 1e-3, "foreach": True, "eps": 1e-5}, {"zero_stage": 3}),
    # tp=2 (dp 1): colwise fc1 / rowwise fc2 DTensors, replicated everything else (Partial grads redistributed)
    "adamw_tp2": ("AdamW", {"lr": 1e-3, "eps": 1e-5},
                  {"zero_stage": 3, "tp": 2, "tp_plan": {"model.layers.*.fc1": "colwise", "model.layers.*.fc2": "rowwise"}}),
}  # fmt: skip


def _decay(step: int) -> float:
    return 1.0 / (1.0 + 0.5 * step)


def _opt(name: str, kw: dict, params):
    return getattr(torch.optim, name)(params, **kw)


@functools.cache
def reference(case: str) -> dict:
    name, kw, _ = CASES[case]
    model = make_model()
    opt = _opt(name, kw, model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _decay)
    x, y = make_data(STEPS * WORLD * PER_RANK_BATCH)
    gb = WORLD * PER_RANK_BATCH
    losses, lrs = [], []
    for step in range(STEPS):
        opt.zero_grad()
        loss = loss_fn(model(x[step * gb : (step + 1) * gb]), y[step * gb : (step + 1) * gb])
        loss.backward()
        losses.append(loss.item())
        opt.step()
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    return {"losses": losses, "lrs": lrs, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _fit(case: str, local: bool, rank: int) -> dict:
    import warnings

    import lightning as L
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from tests._strategy import v17  # the cases' strategy options are flat dicts

    name, kw, skw = CASES[case]
    tp = skw.get("tp", 1)
    seen: set[str] = set()
    lrs: list[float] = []

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = make_model()
            self.losses: list[float] = []

        def training_step(self, batch, batch_idx):
            loss = loss_fn(self.model(batch[0]), batch[1])
            self.losses.append(loss.detach().item())
            return loss

        def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
            lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])

        def configure_optimizers(self):
            opt = _opt(name, kw, self.parameters())
            opt.register_step_pre_hook(lambda o, a, k: seen.update(type(p).__name__ for g in o.param_groups
                                                                   for p in g["params"]))  # fmt: skip
            sched = torch.optim.lr_scheduler.LambdaLR(opt, _decay)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    x, y = make_data(STEPS * WORLD * PER_RANK_BATCH)
    ds = TensorDataset(x, y)
    # tp=2: both ranks see the whole global batch (dp 1); else rank r gets its half, as in test_zero_parity
    if tp > 1:
        loader = DataLoader(ds, batch_size=WORLD * PER_RANK_BATCH, shuffle=False)
    else:
        sampler = DistributedSampler(ds, num_replicas=WORLD, rank=rank, shuffle=False)
        loader = DataLoader(ds, batch_size=PER_RANK_BATCH, sampler=sampler)
    from lightning_v17.optim import local_step as ls
    original = ls.enable_local_step
    if not local:
        ls.enable_local_step = lambda opt: False  # the DTensor step torch would run
    model = Lit()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer = L.Trainer(
                accelerator="cpu", devices=WORLD, strategy=v17(**skw), max_steps=STEPS,
                use_distributed_sampler=False, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False,
            )  # fmt: skip
            trainer.fit(model, loader)
    finally:
        ls.enable_local_step = original
    opt = trainer.optimizers[0]
    state = trainer.strategy.optimizer_state(opt)["state"]
    params = dict(model.named_parameters())
    placed = all(
        isinstance(v, DTensor) and v.placements == params[fqn].placements
        for fqn, st in state.items() for k, v in st.items()
        if torch.is_tensor(v) and v.dim() > 0 and isinstance(params.get(fqn), DTensor)
    )  # fmt: skip
    n_dtensor_states = sum(isinstance(v, DTensor) for st in state.values() for v in st.values())
    losses = torch.tensor(model.losses)
    if tp == 1:
        dist.all_reduce(losses)
        losses /= WORLD
    return {
        "losses": losses.tolist(), "params": _full_params(model), "seen": sorted(seen), "lrs": lrs,
        "placed": placed, "n_dtensor_states": n_dtensor_states,
        "sched_warnings": [str(w.message) for w in caught if "lr_scheduler.step()" in str(w.message)],
    }  # fmt: skip


def _worker(rank: int, world_size: int) -> dict:
    torch.set_num_threads(1)
    return {f"{c}:{int(local)}": _fit(c, local, rank) for c in CASES for local in (True, False)}


@pytest.fixture(scope="module")
def results() -> dict:
    return spawn(_worker, world_size=WORLD, timeout=400, init_process_group=False)[0]


@pytest.mark.timeout(500)
@pytest.mark.parametrize("case", list(CASES))
def test_local_step_bitwise_and_against_one_process(results: dict, case: str) -> None:
    got, dtensor = results[f"{case}:1"], results[f"{case}:0"]
    assert got["seen"] == ["Tensor"], f"the step saw {got['seen']}: it did not run on local shards"
    assert "DTensor" in dtensor["seen"], "control: with the switch off the step must see DTensors"
    assert got["losses"] == dtensor["losses"]
    for n in got["params"]:
        assert (got["params"][n] == dtensor["params"][n]).all(), f"{n}: local step differs from the DTensor step"
    ref = reference(case)
    tol = TOL_TP if "tp" in CASES[case][2] else TOL
    assert len(got["losses"]) == STEPS
    for a, b in zip(got["losses"], ref["losses"]):
        assert abs(a - b) <= tol * abs(b), (got["losses"], ref["losses"])
    for n, w in ref["params"].items():
        err = (torch.as_tensor(got["params"][n]) - w).abs().max().item() / (w.abs().max().item() or 1.0)
        assert err <= tol, f"{n}: {err:.3e} against one process"
        assert (torch.as_tensor(got["params"][n]) != make_model().state_dict()[n]).any(), f"{n} never moved"
    assert got["lrs"] == pytest.approx(ref["lrs"], rel=1e-12)
    assert not got["sched_warnings"], got["sched_warnings"]
    assert got["placed"] and got["n_dtensor_states"] > 0, "optimizer state must stay DTensors placed like the params"
