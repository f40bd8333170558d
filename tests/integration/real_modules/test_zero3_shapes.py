"""ZeRO-3 on LightningModules shaped as users write them, against Lightning's own ``"ddp"`` in the same process pair.

* ``own``: an encoder and a decoder as two children (``self.encoder``, ``self.decoder``) plus an ``nn.Parameter`` of
  the LightningModule itself, automatic optimization, with a ``validation_step`` run twice during the fit (after
  steps 3 and 6, so training resumes after a validation). The step hook calls ``self(x)``, so the FSDP2 root's
  hooks run nested in the step hook's, then uses the parameter: the nested call must not free the root, also with
  ``reshard_after_forward=True``. Nothing of it is a repeated block, so the LightningModule
  itself is the FSDP2 root and its step hooks run as that root's forward
  (:func:`lightning_v17.engine.zero.fsdp.run_as_forward`); Lightning never calls its ``forward``.
  With ``wrap_classes=["Encoder", "Decoder"]``: each child its own unit, the root holding the LightningModule's own
  parameter, and (on gloo) the CPU prefetch chain between the units.
* ``plain``: the same two children without a parameter of the LightningModule, with and without ``wrap_classes``
  (with it, the root holds nothing but must still exist: units without a common root would each be a root with
  their own communication context, and the prefetch between them failed).
* ``manual``: manual optimization with two optimizers in the order of Lightning's GAN example (``toggle_optimizer``,
  the generator's step, then the discriminator's on the generator's output again), plus an ``nn.Parameter`` of
  the LightningModule that the generator's optimizer steps and both phases use: each child is a unit gathered at
  each call, and that parameter is gathered again after each step inside the hook
  (:func:`lightning_v17.engine.zero.fsdp.optimizer_steps_inside`).
  Also with ``wrap_classes`` naming both networks.

Each V17 run is compared with the ``"ddp"`` run of its module (:func:`~tests.integration.real_modules._common.
assert_matches`: per-step losses within 1e-4 relative, final parameters within 1e-5 absolute), with SGD, so that
a gradient off by a constant factor shows in the parameters. The validation losses are compared the same way (and,
after the fit, a ``trainer.test`` and a ``trainer.predict`` through the strategy's ``test_step``/``predict_step``), and
an inspection after each fit checks that the parameters really are sharded (each rank holds half of every one,
the LightningModule's own parameter included) and which module is the FSDP2 root.
"""

from __future__ import annotations

import traceback
from typing import Any

import pytest

from tests._dist import spawn
from tests.integration.real_modules._common import LOSS_RTOL, PARAM_ATOL, assert_matches, train


def _ok(ranks: list[dict[str, Any]], *names: str) -> None:
    for name in names:
        errors = [r[name]["error"] for r in ranks if "error" in r[name]]
        assert not errors, f"{name} raised:\n{errors[0]}"

ROWS_PER_RANK = 4  # 2 ranks: 8 rows a step
#: all-gathers of FSDP2 groups so far on this rank (counted in the worker through the gloo all-gather V17 installs)
_GATHERS = [0]
STEPS = 6
VAL_AT = 3  # validate after steps 3 and 6


def _auto_module(own: bool = True):
    import lightning as L
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import DataLoader

    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(16, 32)

        def forward(self, x):
            return torch.tanh(self.proj(x))

    class Decoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(32, 16)

        def forward(self, h):
            return self.proj(h)

    class EncoderDecoder(L.LightningModule):
        """Two parameterized children and, with ``own``, a parameter of its own that the step hook uses after
        calling ``self(x)`` (its ``forward``); without, the step hook calls the children itself."""

        def __init__(self) -> None:
            super().__init__()
            self.encoder = Encoder()
            self.decoder = Decoder()
            if own:
                self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 16))
            self.val_losses: list[float] = []
            self.test_losses: list[float] = []
            self.gathers: list[int] = []  # all-gathers inside each training step (forward and backward)

        def forward(self, x):
            return self.decoder(self.encoder(x))

        def _loss(self, batch):
            x, y = batch
            if own:  # the LightningModule's own call inside its step hook, then its own parameter
                return F.mse_loss(self(x) * self.scale, y)
            return F.mse_loss(self.decoder(self.encoder(x)), y)

        def training_step(self, batch, batch_idx):
            return self._loss(batch)

        def validation_step(self, batch, batch_idx):
            loss = self._loss(batch)
            self.val_losses.append(float(loss))
            return loss

        def test_step(self, batch, batch_idx):
            self.test_losses.append(float(self._loss(batch)))

        def predict_step(self, batch, batch_idx):
            return self.decoder(self.encoder(batch[0])).detach().clone()

        def val_dataloader(self):
            return DataLoader(_rows(16, seed=5), batch_size=ROWS_PER_RANK)

        def on_train_batch_start(self, batch, batch_idx) -> None:
            self._gathers_before = _GATHERS[0]

        def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
            self.gathers.append(_GATHERS[0] - self._gathers_before)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.2)

    return EncoderDecoder()


def _manual_module():
    import lightning as L
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Generator(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 16))

        def forward(self, z):
            return self.net(z)

    class Discriminator(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))

        def forward(self, x):
            return self.net(x)

    class TwoOptimizers(L.LightningModule):
        """Lightning's GAN example in miniature, with a shift of its own that the generator's optimizer steps."""

        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.generator = Generator()
            self.discriminator = Discriminator()
            self.shift = nn.Parameter(torch.linspace(-0.2, 0.2, 16))
            self.recorded_losses: list[float] = []

        def _fake(self, z):
            return self.generator(z) + self.shift

        def training_step(self, batch, batch_idx):
            z, real = batch
            opt_g, opt_d = self.optimizers()
            ones, zeros = torch.ones(len(z), 1), torch.zeros(len(z), 1)

            self.toggle_optimizer(opt_g)
            g_loss = F.binary_cross_entropy_with_logits(self.discriminator(self._fake(z)), ones)
            self.manual_backward(g_loss)
            opt_g.step()
            opt_g.zero_grad()
            self.untoggle_optimizer(opt_g)

            self.toggle_optimizer(opt_d)
            fake = self._fake(z).detach()  # the generator and the shift just stepped: their new values
            d_loss = 0.5 * (
                F.binary_cross_entropy_with_logits(self.discriminator(real), ones)
                + F.binary_cross_entropy_with_logits(self.discriminator(fake), zeros)
            )
            self.manual_backward(d_loss)
            opt_d.step()
            opt_d.zero_grad()
            self.untoggle_optimizer(opt_d)
            self.recorded_losses.extend([float(g_loss), float(d_loss)])

        def configure_optimizers(self):
            g = torch.optim.SGD([*self.generator.parameters(), self.shift], lr=0.3)
            d = torch.optim.SGD(self.discriminator.parameters(), lr=0.2)
            return g, d

    return TwoOptimizers()


def _rows(n: int, *, seed: int) -> list[Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, generator=g), torch.randn(16, generator=g)) for _ in range(n)]


def _gan_rows(n: int) -> list[Any]:
    import torch

    g = torch.Generator().manual_seed(3)
    return [(torch.randn(8, generator=g), 0.5 + 0.3 * torch.randn(16, generator=g)) for _ in range(n)]


def _inspect(module: Any, trainer: Any) -> dict[str, Any]:
    """What the fit left: the validation losses, and for V17 how the optimizers hold each parameter (this rank's
    share of its elements, and its dim-0 size; read from the optimizers, which step the sharded parameters: after
    a validation FSDP2 leaves its root gathered, as it does after any forward) and which module is the FSDP2 root."""
    from lightning_v17.engine.zero.fsdp import fsdp_root

    shares = []
    for opt in trainer.optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                local = p.to_local() if hasattr(p, "to_local") else p
                shares.append((local.numel() / p.numel(), p.shape[0]))
    root = fsdp_root(module)
    out = {}
    if hasattr(module, "test_losses"):  # after the fit: test and predict, through the strategy's step hooks too
        from torch.utils.data import DataLoader

        trainer.test(module, DataLoader(_rows(8, seed=9), batch_size=ROWS_PER_RANK), verbose=False)
        out["test"] = list(module.test_losses)
        out["predict"] = trainer.predict(module, DataLoader(_rows(8, seed=9), batch_size=ROWS_PER_RANK))
    return {
        **out,
        "gathers": list(getattr(module, "gathers", [])),
        "val": list(getattr(module, "val_losses", [])),
        "shares": shares,
        "root": None if root is None else ("module" if root is module else type(root).__name__),
    }


def _run(*args: Any, **kwargs: Any) -> dict[str, Any]:
    """One fit, or the traceback it raised (the other runs still go ahead; the tests of this one fail with it)."""
    try:
        return train(*args, **kwargs)
    except Exception:  # noqa: BLE001 - reported by the run's own test
        return {"error": traceback.format_exc()}


def _worker(rank: int, world: int) -> dict[str, dict[str, Any]]:
    from lightning_v17 import V17Strategy, ZeroPolicy
    from lightning_v17.engine.collectives import FSDPAllToAllAllGather

    gather = FSDPAllToAllAllGather.__call__

    def counted(self, *args: Any, **kwargs: Any) -> Any:
        _GATHERS[0] += 1
        return gather(self, *args, **kwargs)

    FSDPAllToAllAllGather.__call__ = counted  # this rank's process only

    auto_kw = {"val_check_interval": VAL_AT, "limit_val_batches": 2}
    out: dict[str, dict[str, Any]] = {"own": {}, "plain": {}, "manual": {}}
    for shape, own in (("own", True), ("plain", False)):
        runs = {
            "ddp": "ddp",
            "zero3": V17Strategy(zero_stage=3),
            "zero3_wrap": V17Strategy(zero=ZeroPolicy(stage=3, wrap_classes=["Encoder", "Decoder"])),
        }
        if own:  # the root freed at the end of the step hook, not by the call of self(x) nested in it
            runs["zero3_reshard"] = V17Strategy(zero=ZeroPolicy(stage=3, reshard_after_forward=True))
        for name, strategy in runs.items():
            out[shape][name] = _run(
                lambda own=own: _auto_module(own), strategy, _rows(48, seed=1), batch_size=ROWS_PER_RANK, steps=STEPS,
                inspect=_inspect, **auto_kw,
            )  # fmt: skip
    for name, strategy in (
        ("ddp", "ddp_find_unused_parameters_true"),  # each backward reaches one network only
        ("zero3", V17Strategy(zero_stage=3)),
        ("zero3_wrap", V17Strategy(zero=ZeroPolicy(stage=3, wrap_classes=["Generator", "Discriminator"]))),
    ):
        out["manual"][name] = _run(  # Lightning counts each optimizer's step: 2 a batch
            _manual_module, strategy, _gan_rows(48), batch_size=ROWS_PER_RANK, steps=2 * STEPS, inspect=_inspect
        )
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict[str, dict[str, Any]]]:
    return spawn(_worker, world_size=2, init_process_group=False, timeout=420)


def _assert_sharded(ranks: list[dict[str, Any]], name: str, count: int) -> None:
    """The optimizers step ``count`` parameters (all of the module's, its own one too), each split over the 2 ranks
    (FSDP2 splits dim 0: a parameter with one row lives on one rank), and the LightningModule is the FSDP2 root."""
    shares = [r[name]["extra"]["shares"] for r in ranks]
    assert len(shares[0]) == len(shares[1]) == count, shares
    for i, (_, rows) in enumerate(shares[0]):
        both = [s[i][0] for s in shares]
        assert sum(both) == 1.0 and (rows < 2 or max(both) < 1.0), (i, both)
    assert all(r[name]["extra"]["root"] == "module" for r in ranks), [r[name]["extra"]["root"] for r in ranks]


def _val_error(ranks: list[dict[str, Any]], name: str) -> float:
    """Max relative error of the rank-mean validation losses of run ``name`` against ddp's."""
    got = [sum(v) / len(v) for v in zip(*(r[name]["extra"]["val"] for r in ranks))]
    want = [sum(v) / len(v) for v in zip(*(r["ddp"]["extra"]["val"] for r in ranks))]
    assert len(got) == len(want) == 4, (got, want)  # 2 validations x 2 batches per rank
    return max(abs(a - b) / abs(b) for a, b in zip(got, want))


AUTO_CASES = [("own", "zero3"), ("own", "zero3_wrap"), ("own", "zero3_reshard"), ("plain", "zero3"),
              ("plain", "zero3_wrap")]  # fmt: skip


@pytest.mark.timeout(480)
@pytest.mark.parametrize(("shape", "name"), AUTO_CASES, ids=[f"{s}-{n}" for s, n in AUTO_CASES])
def test_encoder_decoder_matches_ddp(runs, shape, name):
    """``own``: with the LightningModule's own parameter; ``plain``: the two children only (with ``wrap_classes``
    nothing is left outside the units: the root holds no parameter, yet must exist for the units to share one
    communication context and prefetch chain); ``zero3_reshard``: ``reshard_after_forward=True``."""
    ranks = [r[shape] for r in runs]
    _ok(ranks, "ddp", name)
    errors = assert_matches(ranks, [name])
    assert len(ranks[0][name]["losses"]) == STEPS
    val = _val_error(ranks, name)
    assert val <= LOSS_RTOL, f"validation losses vs ddp: {val}"
    for r in ranks:  # test_step and predict_step after the fit, on this rank's rows
        got, want = r[name]["extra"], r["ddp"]["extra"]
        assert len(got["test"]) == len(want["test"]) == 1 and len(got["predict"]) == len(want["predict"]) == 1
        assert abs(got["test"][0] - want["test"][0]) <= LOSS_RTOL * abs(want["test"][0]), (got["test"], want["test"])
        assert got["predict"][0].shape == (ROWS_PER_RANK, 16)
        assert float((got["predict"][0] - want["predict"][0]).abs().max()) <= PARAM_ATOL
    _assert_sharded(ranks, name, count=5 if shape == "own" else 4)  # (scale,) the Linears' weights and biases
    if shape == "own" and name != "zero3_wrap":
        # One group (the root holds everything): gathered once a step, from the step hook's start through backward
        # (a validation before a step leaves it gathered: 0); with reshard_after_forward=True freed at the end of
        # the hook and gathered again for backward. The call of self(x) nested in the hook changes neither.
        per_step = {"zero3": 1, "zero3_reshard": 2}[name]
        for r in ranks:
            gathers = r[name]["extra"]["gathers"]
            assert len(gathers) == STEPS and max(gathers) == per_step and min(gathers) >= per_step - 1, gathers
    print(shape, name, errors, "val", val)


@pytest.mark.timeout(480)
@pytest.mark.parametrize("name", ["zero3", "zero3_wrap"])
def test_two_optimizers_manual_optimization_matches_ddp(runs, name):
    ranks = [r["manual"] for r in runs]
    _ok(ranks, "ddp", name)
    errors = assert_matches(ranks, [name])
    assert len(ranks[0][name]["losses"]) == STEPS and len(ranks[0][name]["losses"][0]) == 2  # (g, d) per step
    _assert_sharded(ranks, name, count=9)  # the shift, both networks' two Linears
    print(name, errors)
