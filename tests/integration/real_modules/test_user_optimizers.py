"""The user's own optimizers that cannot step ZeRO-3's shards train exactly: against Lightning's ``"ddp"`` on 2 gloo
ranks, in one spawned pair of ranks.

The user writes ``torch.optim.Adafactor(self.parameters())`` (factored row/column statistics: needs whole
parameters), ``bitsandbytes.optim.Lion`` (32-bit: elementwise, but a C kernel that cannot take DTensors) or
``bitsandbytes.optim.Adam8bit`` (block-quantized state: needs whole parameters) in ``configure_optimizers``. At
ZeRO-3 the first and the last step each parameter whole on an owner rank (``engine/zero/owner_step.py``), Lion steps its
local shards; ZeRO-2 gives whole parameters (``optimizer_partition="params"``), as before. Checked:

* per-step losses within 1e-4 relative and final parameters within 1e-5 of ddp (``_common.assert_matches``; all
  three measured bitwise equal here);
* the optimizer state is sharded by owner: each parameter's state on exactly one rank, as whole plain tensors, the
  largest parameter alone on rank 0 (largest first, to the least-loaded rank); Lion's on both ranks (its shards);
* a ZeRO-3 checkpoint of the 8-bit and of the Adafactor state (Lightning's ``ModelCheckpoint`` after step 3) resumed
  by a new Trainer into a module with other initial weights continues bit for bit (losses and parameters ``==``
  the uninterrupted run);
* refused at setup with the fix, not with torch's error: an owner-stepped optimizer with ``offload_optimizer="cpu"``,
  and ``torch.optim.LBFGS`` over unevenly sharded parameters.

The model: ``Linear(48, 90) -> Tanh -> Linear(90, 7)``. Its first weight has 4,320 elements, so bitsandbytes keeps
it 8-bit (``min_8bit_size`` 4096) where one rank's 45-row shard (2,160) would stay fp32, and the shard boundary
(element 2,160) is not on a 256-block boundary; 7 rows split 4/3, so the exchange pads. Parity runs see 3 batches
per epoch; the resume runs one batch (the same every step), so where Lightning restarts a plain DataLoader after a
resume cannot matter.
"""

from __future__ import annotations

import glob
import os

import lightning as L
import torch
from torch import nn

from tests._dist import spawn
from tests.integration.real_modules._common import assert_matches, recorder, train

STEPS, RESUME_AT, BATCH = 6, 3, 4
PARAMS = ("model.0.weight", "model.0.bias", "model.2.weight", "model.2.bias")


def adafactor(params):
    return torch.optim.Adafactor(params, lr=0.05, weight_decay=0.1)


def lion32(params):
    import bitsandbytes as bnb

    return bnb.optim.Lion(params, lr=1e-3, weight_decay=0.01)


def adam8bit(params):
    import bitsandbytes as bnb

    return bnb.optim.Adam8bit(params, lr=1e-2)


OPTIMIZERS = {"adafactor": adafactor, "lion32": lion32, "adam8bit": adam8bit}


class UserMLP(L.LightningModule):
    """What a user writes: a model in ``self.model``, their own optimizer class in ``configure_optimizers``."""

    def __init__(self, opt: str) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Linear(48, 90), nn.Tanh(), nn.Linear(90, 7))
        self.opt = opt

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.model(x), y)

    def configure_optimizers(self):
        return OPTIMIZERS[self.opt](self.parameters())


def _data(steps_per_epoch: int = RESUME_AT) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(48, generator=g), torch.randn(7, generator=g)) for _ in range(2 * BATCH * steps_per_epoch)]


def _state_layout(module, trainer) -> dict:
    """Which parameters' state this rank holds, and whether it is whole and plain (no DTensor)."""
    from torch.distributed.tensor import DTensor

    opt = trainer.optimizers[0]
    names = {id(p): n for n, p in module.named_parameters()}
    held, whole = [], True
    for p, st in opt.state.items():
        held.append(names[id(p)])
        for v in st.values():
            if torch.is_tensor(v) and v.dim() > 0 and v.shape == p.shape:
                whole &= not isinstance(v, DTensor)
    return {"held": sorted(held), "whole": whole}


def _resume(opt: str, tmp: str) -> dict:
    """ZeRO-3: 6 steps with a checkpoint after step 3 (Lightning's ModelCheckpoint), then a new module with other
    initial weights and a new Trainer resume from it to step 6. One unshuffled batch per epoch, the same batch each
    step, so where Lightning restarts the data after a resume cannot matter. Returns both runs' losses and final
    parameters."""
    from lightning_v17.strategies import V17Strategy
    from torch.utils.data import DataLoader, DistributedSampler

    from tests.integration.real_modules._common import full_parameters

    data = _data(1)

    def fit(module: UserMLP, callbacks: list, **kw) -> dict:
        rec = recorder()
        trainer = L.Trainer(
            accelerator="cpu", devices=2, strategy=V17Strategy(zero_stage=3), max_steps=STEPS, logger=False,
            callbacks=[rec, *callbacks], use_distributed_sampler=False, enable_progress_bar=False,
            enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=tmp,
        )  # fmt: skip
        sampler = DistributedSampler(data, num_replicas=2, rank=trainer.global_rank, shuffle=False)
        trainer.fit(module, DataLoader(data, batch_size=BATCH, sampler=sampler), **kw)
        return {"losses": rec.losses, "params": full_parameters(module)}

    L.seed_everything(1, verbose=False)
    save = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp, every_n_train_steps=RESUME_AT, save_top_k=-1)
    straight = fit(UserMLP(opt), [save])
    L.seed_everything(2, verbose=False)  # other initial weights: the checkpoint must overwrite them
    (ckpt,) = glob.glob(os.path.join(tmp, f"*step={RESUME_AT}.ckpt"))
    return {"straight": straight, "resumed": fit(UserMLP(opt), [], ckpt_path=ckpt)}


class UserLBFGS(UserMLP):
    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters(), lr=0.1)


def _refused(make, strategy) -> str:
    """The error ``fit`` raises (at setup), or "no error"."""
    try:
        train(make, strategy, _data(), batch_size=BATCH, steps=1)
    except Exception as e:  # noqa: BLE001 - the message is what the test checks
        return f"{type(e).__name__}: {e}"
    return "no error"


def _worker(rank: int, world: int, tmp: str) -> dict:
    import torch.distributed as dist
    from lightning_v17.strategies import V17Strategy

    from lightning_v17.config import OffloadPolicy

    tmp_list = [tmp]
    dist.broadcast_object_list(tmp_list, src=0)
    data = _data()
    out: dict = {}
    for opt in OPTIMIZERS:

        def make(opt: str = opt) -> UserMLP:
            return UserMLP(opt)

        out[opt] = {
            "ddp": train(make, "ddp", data, batch_size=BATCH, steps=STEPS),
            "z3": train(make, V17Strategy(zero_stage=3), data, batch_size=BATCH, steps=STEPS, inspect=_state_layout),
            "z2": train(make, V17Strategy(zero_stage=2), data, batch_size=BATCH, steps=STEPS),
        }
    for opt in ("adam8bit", "adafactor"):
        out[opt]["z3_resume"] = _resume(opt, os.path.join(tmp_list[0], opt))
    out["refused_offload"] = _refused(
        lambda: UserMLP("adafactor"), V17Strategy(zero_stage=3, offload=OffloadPolicy(optimizer="cpu"))
    )
    # model.2.weight has 7 rows: FSDP2 shards it 4/3, and LBFGS's flat gradient view of such a shard fails in torch
    out["refused_lbfgs"] = _refused(lambda: UserLBFGS("lbfgs"), V17Strategy(zero_stage=3))
    return out


def _ranks(results: list[dict], opt: str) -> list[dict]:
    return [r[opt] for r in results]


def test_user_optimizers(tmp_path) -> None:
    results = spawn(_worker, world_size=2, args=(str(tmp_path),), timeout=300)
    errors = {opt: assert_matches(_ranks(results, opt), ["z3", "z2"]) for opt in OPTIMIZERS}
    print("errors against ddp {opt: {run: (loss rtol, param atol)}}:", errors)

    for opt in ("adafactor", "adam8bit"):  # owner-stepped: each parameter's whole state on exactly one rank
        layouts = [r[opt]["z3"]["extra"] for r in results]
        held = [set(x["held"]) for x in layouts]
        assert held[0].isdisjoint(held[1]) and held[0] | held[1] == set(PARAMS), (opt, held)
        assert held[0] == {"model.0.weight"}, (opt, held)  # 4,320 elements, against 630 + 90 + 7 on rank 1
        assert all(x["whole"] for x in layouts), (opt, layouts)
    lion = [set(r["lion32"]["z3"]["extra"]["held"]) for r in results]
    assert lion[0] == lion[1] == set(PARAMS), lion  # elementwise: every rank keeps its shards' state

    for opt in ("adam8bit", "adafactor"):
        for r in results:
            straight, resumed = r[opt]["z3_resume"]["straight"], r[opt]["z3_resume"]["resumed"]
            assert resumed["losses"] == straight["losses"][RESUME_AT:], (opt, resumed["losses"], straight["losses"])
            for name in PARAMS:
                assert torch.equal(resumed["params"][name], straight["params"][name]), (opt, name)

    for r in results:
        msg = r["refused_offload"]
        assert msg.startswith("V17ConfigError") and "Adafactor" in msg and "OffloadPolicy(optimizer='none'" in msg, msg
        msg = r["refused_lbfgs"]
        assert msg.startswith("V17ConfigError") and "LBFGS" in msg and "zero_stage=0" in msg, msg


def test_plan_step_decides_per_class() -> None:
    """Which optimizers step whole parameters at ZeRO-3 (``plan_step``), for every ``optimizer_partition``."""
    import bitsandbytes as bnb

    from lightning_v17.config import V17ConfigError
    from lightning_v17.engine.zero.owner_step import StepPlan, plan_step
    from lightning_v17.optim import Adafactor, Lion8bit

    class DeclaredElementwise(torch.optim.SGD):  # a user's class that says what it is
        v17_elementwise = True

    class Unknown(torch.optim.Optimizer):  # a third-party optimizer the library knows nothing of
        def __init__(self, params):
            super().__init__(params, {"lr": 1.0})

    params = list(nn.Linear(4, 4).parameters())
    own, local, as_is = StepPlan.OWNER, StepPlan.LOCAL_SHARDS, StepPlan.AS_IS
    cases = {
        "torch Adafactor": (torch.optim.Adafactor(params), own, local),
        "torch AdamW": (torch.optim.AdamW(params), as_is, as_is),
        "torch LBFGS": (torch.optim.LBFGS(params), as_is, as_is),
        "bnb Lion 32-bit": (bnb.optim.Lion(params), local, local),
        "bnb Lion, optim_bits=8": (bnb.optim.Lion(params, optim_bits=8), own, local),
        "bnb Adam 32-bit": (bnb.optim.Adam(params), local, local),
        "bnb Adam8bit": (bnb.optim.Adam8bit(params), own, local),
        "bnb LAMB 32-bit (trust ratio)": (bnb.optim.LAMB(params, optim_bits=32), own, local),
        "library Adafactor": (Adafactor(params), as_is, as_is),
        "library Lion8bit": (Lion8bit(params), as_is, as_is),
        "declared elementwise": (DeclaredElementwise(params, lr=0.1), local, local),
        "unknown class": (Unknown(params), own, local),
    }
    got = {k: (plan_step(o), plan_step(o, partition="rows")) for k, (o, *_) in cases.items()}
    assert got == {k: (auto, rows) for k, (_, auto, rows) in cases.items()}, got
    assert all(plan_step(o, partition="params") == own for k, (o, *_) in cases.items() if k != "torch LBFGS")
    try:
        plan_step(cases["torch LBFGS"][0], partition="params")
    except V17ConfigError as e:
        assert "optimizer_partition='auto'" in str(e), e
    else:
        raise AssertionError("LBFGS with optimizer_partition='params' was not refused")
