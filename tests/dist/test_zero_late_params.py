"""Parameters whose gradient is None, and parameters that become trainable after setup, at ZeRO stages 0-3.

Two gloo ranks run ``parallelize`` + the ZeRO backend directly (no Lightning), against a plain one-process loop over
the same global batch (the reference shares no lightning_v17 code):

* a probe head that training never calls keeps a None gradient, so AdamW's weight decay skips it as it does in one
  process: it must stay bitwise at its initial value, at every stage;
* a head that only rank 0's rows use gets the mean with zeros from rank 1 (DDP's semantics, and one process's), at
  stages 0-2 (FSDP2 reduce-scatters only the gradients a rank has, so at stage 3 every rank must use the same
  parameters: there both ranks use it);
* a backbone frozen at setup is unfrozen at step 3 and added with ``optimizer.add_param_group`` (what Lightning's
  ``BaseFinetuning`` does, right after a validation forward), then trained like the rest; its added group's state is
  saved and resumed at other stages;
* an optimizer that listed the frozen backbone at setup: unfrozen without ``add_param_group``, stage 0 steps it as one
  process does, stages 1-2 refuse at that step naming it (their partition left it out when it was frozen);
* the whole gradients' norms (:func:`lightning_v17.engine.zero.grad_norms.grad_norms`) equal one process's;
* gradients kept across steps (a step that does not zero them, so the next backward accumulates onto them), clipped
  by norm and by value in between: at ZeRO-1 the whole gradient behind the optimizer's shards is clipped on every
  rank, as under DDP (clipping only a rank's own rows left the others' rows unclipped, and the next reduction
  averaged the two), with either partition.

Plain SGD (no momentum, no clipping: a gradient off by a constant factor moves the weights) and AdamW with weight
decay. Tolerance: 1e-6 on parameters and losses (fp32, 6 steps; measured <= 1.2e-7), 1e-5 relative on norms.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from tests._dist import spawn

STEPS, UNFREEZE, LR = 6, 3, 0.05


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.Linear(8, 16), nn.Linear(16, 16)])  # the backbone (FSDP units at stage 3)
        self.head = nn.Linear(16, 8)
        self.aux = nn.Linear(16, 8)  # used by rank 0's rows only
        self.probe = nn.Linear(16, 3)  # never used in training

    def forward(self, x: torch.Tensor, use_aux: bool) -> torch.Tensor:
        h = x
        for layer in self.layers:
            h = torch.tanh(layer(h))
        out = self.head(h)
        return out + self.aux(h) if use_aux else out


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + rank))


def _loss(model: nn.Module, x: torch.Tensor, rank: int, stage: int) -> torch.Tensor:
    return (model(x, use_aux=rank == 0 or stage == 3) - x).pow(2).mean()


def _evaluate(model: nn.Module, rank: int, stage: int) -> None:
    """A validation forward right before the unfreeze, as Lightning runs one at the end of the epoch before
    ``BaseFinetuning`` unfreezes: at stage 3 the last unit and the root stay gathered after a forward without backward,
    and the gathered parameters must still take the new ``requires_grad`` (else the last unit got no gradient)."""
    with torch.no_grad():
        _loss(model, _batch(99, rank), rank, stage)


def _optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=LR)
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1)


def _freeze(model: Net, frozen: bool) -> None:
    for p in model.layers.parameters():
        p.requires_grad_(not frozen)


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def reference(opt_name: str, *, add_group: bool, stage: int = 0) -> dict:
    """One process on the global batch: the mean of the two ranks' losses."""
    model = Net()
    _freeze(model, True)
    params = [p for p in model.parameters() if p.requires_grad] if add_group else list(model.parameters())
    opt = _optimizer(opt_name, params)
    losses, norms = [], []
    for step in range(STEPS):
        if step == UNFREEZE:
            _evaluate(model, 0, stage)
            _freeze(model, False)
            if add_group:
                opt.add_param_group({"params": list(model.layers.parameters()), "lr": LR / 2})
        opt.zero_grad()
        loss = 0.5 * (_loss(model, _batch(step, 0), 0, stage) + _loss(model, _batch(step, 1), 1, stage))
        loss.backward()
        norms.append({n: float(p.grad.norm()) for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
        losses.append(float(loss))
    return {"losses": losses, "norms": norms, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _run(rank: int, stage: int, opt_name: str, *, add_group: bool, save: str | None = None) -> dict:
    import torch.distributed as dist

    from lightning_v17.config import MeshSpec, TrainingPolicy, V17ConfigError, ZeroPolicy
    from lightning_v17.engine.parallelize import parallelize
    from lightning_v17.engine.zero.grad_norms import grad_norms
    from lightning_v17.mesh import MeshRuntime, build_device_mesh

    spec = MeshSpec(dp_shard=2)
    mesh = MeshRuntime(spec, build_device_mesh(spec, device_type="cpu"))
    model = Net()
    _freeze(model, True)
    out = parallelize(model, mesh=mesh, policy=TrainingPolicy(zero=ZeroPolicy(stage=stage)), device="cpu")
    params = [p for p in model.parameters() if p.requires_grad] if add_group else list(model.parameters())
    opt = _optimizer(opt_name, params)
    out.zero.prepare_optimizers([opt])
    losses, norms = [], []
    try:
        for step in range(STEPS):
            if step == UNFREEZE:
                _evaluate(model, rank, stage)
                _freeze(model, False)
                if add_group:
                    opt.add_param_group({"params": list(model.layers.parameters()), "lr": LR / 2})
            opt.zero_grad()
            loss = _loss(model, _batch(step, rank), rank, stage)
            loss.backward()
            norms.append({n: float(v) for n, v in grad_norms(model, out.zero, 2.0).items()})
            opt.step()
            out.zero.after_optimizer_step(opt)
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(float(mean) / 2)
    except V17ConfigError as err:
        return {"refused": str(err), "step": step}
    result = {"losses": losses, "norms": norms, "params": {n: _full(p) for n, p in model.named_parameters()}}
    if save is not None:
        from lightning_v17.checkpoint.sharded import save_sharded
        from lightning_v17.engine.zero.state_dict import get_state_dicts

        save_sharded(save, app_state=get_state_dicts(model, [opt], backend=out.zero), trainer_state={}, meta={})
    out.zero.remove()
    return result


def _resume(rank: int, stage: int, path: str) -> dict:
    """Load the stage-1 AdamW save (two param groups, the second added after setup) at ``stage`` and step once more;
    the state of the added group must come back resharded (compared with the same continuation of one process)."""
    import torch.distributed as dist

    from lightning_v17.checkpoint.sharded import load_sharded
    from lightning_v17.config import MeshSpec, TrainingPolicy, ZeroPolicy
    from lightning_v17.engine.parallelize import parallelize
    from lightning_v17.engine.zero.state_dict import drop_unsaved_optimizer_entries, get_state_dicts, set_state_dicts
    from lightning_v17.mesh import MeshRuntime, build_device_mesh

    spec = MeshSpec(dp_shard=2)
    mesh = MeshRuntime(spec, build_device_mesh(spec, device_type="cpu"))
    model = Net()
    out = parallelize(model, mesh=mesh, policy=TrainingPolicy(zero=ZeroPolicy(stage=stage)), device="cpu")
    layers = {id(p) for p in model.layers.parameters()}
    opt = _optimizer("adamw", [p for p in model.parameters() if id(p) not in layers])
    opt.add_param_group({"params": list(model.layers.parameters()), "lr": LR / 2})
    out.zero.prepare_optimizers([opt])
    app_state = get_state_dicts(model, [opt], backend=out.zero)
    drop_unsaved_optimizer_entries(app_state, f"{path}/optim")  # what V17Strategy's load does (the probe has none)
    load_sharded(path, app_state=app_state)
    set_state_dicts(model, [opt], app_state, backend=out.zero)
    opt.zero_grad()
    loss = _loss(model, _batch(STEPS, rank), rank, stage)
    loss.backward()
    opt.step()
    out.zero.after_optimizer_step(opt)
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    result = {"loss": float(mean) / 2, "params": {n: _full(p) for n, p in model.named_parameters()}}
    out.zero.remove()
    return result


def _kept(model: nn.Module, step: int, params: list, clip: Any) -> bool:
    """Clip the way the step says (norm on even steps, value on odd ones); whether to zero the gradients after it
    (not after steps 1 and 3: the next backward accumulates onto them)."""
    if step % 2 == 0:
        clip.norm(params, 0.05)
    else:
        clip.value(params, 0.02)
    return step not in (1, 3)


def reference_kept() -> dict:
    class Clip:
        norm = staticmethod(lambda ps, v: torch.nn.utils.clip_grad_norm_(ps, v))
        value = staticmethod(lambda ps, v: torch.nn.utils.clip_grad_value_(ps, v))

    model = Net()
    opt = _optimizer("sgd", model.parameters())
    for step in range(STEPS):
        loss = 0.5 * (_loss(model, _batch(step, 0), 0, 0) + _loss(model, _batch(step, 1), 1, 0))
        loss.backward()
        zero = _kept(model, step, [p for p in model.parameters() if p.grad is not None], Clip)
        opt.step()
        if zero:
            opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _run_kept(rank: int, stage: int, partition: str) -> dict:
    from lightning_v17.config import MeshSpec, TrainingPolicy, ZeroPolicy
    from lightning_v17.engine.parallelize import parallelize
    from lightning_v17.engine.precision.clip import clip_grad_norm_, clip_grad_value_
    from lightning_v17.mesh import MeshRuntime, build_device_mesh

    spec = MeshSpec(dp_shard=2)
    mesh = MeshRuntime(spec, build_device_mesh(spec, device_type="cpu"))
    model = Net()
    policy = TrainingPolicy(zero=ZeroPolicy(stage=stage, optimizer_partition=partition))
    out = parallelize(model, mesh=mesh, policy=policy, device="cpu")
    opt = _optimizer("sgd", model.parameters())
    out.zero.prepare_optimizers([opt])

    class Clip:  # what V17Strategy's precision plugin runs for gradient_clip_val / clip_gradients
        norm = staticmethod(lambda ps, v: clip_grad_norm_(ps, v, group=out.zero.shard_group,
                                                          sharded=out.zero.grad_norm_over_shards))  # fmt: skip
        value = staticmethod(clip_grad_value_)

    for step in range(STEPS):
        _loss(model, _batch(step, rank), rank, 0).backward()
        zero = _kept(model, step, [p for g in opt.param_groups for p in g["params"]], Clip)
        opt.step()
        out.zero.after_optimizer_step(opt)
        if zero:
            opt.zero_grad()
    result = {n: _full(p) for n, p in model.named_parameters()}
    out.zero.remove()
    return result


def _worker(rank: int, world: int, tmp: str) -> dict:
    torch.set_num_threads(1)
    res: dict = {}
    for stage in (0, 1, 2, 3):
        for opt_name in ("sgd", "adamw"):
            save = f"{tmp}/stage1" if (stage, opt_name) == (1, "adamw") else None
            res[("add", stage, opt_name)] = _run(rank, stage, opt_name, add_group=True, save=save)
    for stage in (0, 1, 2):
        res[("listed", stage)] = _run(rank, stage, "sgd", add_group=False)
    for stage in (2, 3):
        res[("resume", stage)] = _resume(rank, stage, f"{tmp}/stage1")
    for stage, partition in ((0, "rows"), (1, "rows"), (1, "params"), (2, "rows")):
        res[("kept", stage, partition)] = _run_kept(rank, stage, partition)
    return res


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("late"))
    return spawn(_worker, world_size=2, args=(tmp,), timeout=240)


def _close(got: dict, ref: dict, tol: float = 1e-6) -> None:
    assert got.keys() == ref.keys()
    for name, want in ref.items():
        diff = float((got[name] - want).abs().max())
        assert diff <= tol, (name, diff)


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_added_group_and_unused_heads_match_one_process(results, stage, opt_name):
    ref = reference(opt_name, add_group=True, stage=stage)
    init = Net()
    for rank in (0, 1):
        got = results[rank][("add", stage, opt_name)]
        assert got["losses"] == pytest.approx(ref["losses"], rel=1e-6, abs=1e-7)
        _close(got["params"], ref["params"])
        # the probe never had a gradient: bitwise its initial value (AdamW's decay would have moved it)
        assert torch.equal(got["params"]["probe.weight"], init.probe.weight.detach())
        assert torch.equal(got["params"]["probe.bias"], init.probe.bias.detach())
        # the backbone trained after the unfreeze (not a run that ignored the added group)
        assert float((got["params"]["layers.0.weight"] - init.layers[0].weight).abs().max()) > 1e-3
        for mine, theirs in zip(got["norms"], ref["norms"]):
            assert mine.keys() == theirs.keys()  # the same parameters have a gradient (none for the probe)
            for name in theirs:
                assert mine[name] == pytest.approx(theirs[name], rel=1e-5), (name, mine[name], theirs[name])


def test_listed_frozen_backbone_stage0_steps_it_stages12_refuse_naming_it(results):
    ref = reference("sgd", add_group=False)
    for rank in (0, 1):
        got = results[rank][("listed", 0)]
        _close(got["params"], ref["params"])
        for stage in (1, 2):
            got = results[rank][("listed", stage)]
            assert got.get("step") == UNFREEZE, got
            assert "layers.0.weight" in got["refused"] and "add_param_group" in got["refused"], got["refused"]


@pytest.mark.parametrize("stage", [2, 3])
def test_added_group_state_resumes_resharded(results, stage):
    """The reference continues the one-process AdamW run by one step: the added group's moments must be the saved ones
    (a fresh state would make a different step)."""
    model = Net()
    _freeze(model, True)
    opt = _optimizer("adamw", [p for p in model.parameters() if p.requires_grad])
    for step in range(STEPS + 1):
        if step == UNFREEZE:
            _freeze(model, False)
            opt.add_param_group({"params": list(model.layers.parameters()), "lr": LR / 2})
        opt.zero_grad()
        st = 1 if step < STEPS else stage  # the saving run was at stage 1; the resumed step at ``stage``
        loss = 0.5 * (_loss(model, _batch(step, 0), 0, st) + _loss(model, _batch(step, 1), 1, st))
        loss.backward()
        opt.step()
    for rank in (0, 1):
        got = results[rank][("resume", stage)]
        assert got["loss"] == pytest.approx(float(loss), rel=1e-6)
        _close(got["params"], {n: p.detach() for n, p in model.named_parameters()})


@pytest.mark.parametrize("stage,partition", [(0, "rows"), (1, "rows"), (1, "params"), (2, "rows")])
def test_gradients_kept_across_steps_are_clipped_whole(results, stage, partition):
    ref = reference_kept()
    for rank in (0, 1):
        _close(results[rank][("kept", stage, partition)], ref)
