"""Lightning's documented GAN (manual optimization, two optimizers) at ZeRO-1, 2 and 3 against Lightning's ``"ddp"``.

Two ``training_step``s, as the Lightning docs write them:

* ``"docs"`` (the manual-optimization page): the generator's samples ``g_x = G(z)`` are drawn first, the
  discriminator steps, then the generator's loss back-propagates through ``D(g_x)``, i.e. through the graph of
  ``G(z)`` built *before* ``d_opt.step()``. An optimizer step that rewrites the generator's parameters in place (the
  other network's) breaks that backward ("modified by an inplace operation");
* ``"toggle"`` (Lightning's basic GAN example): ``self.toggle_optimizer(opt)`` around each network's step, so the
  generator's backward leaves the discriminator without gradients. ZeRO-1/2 hand the optimizers shards of the
  parameters; the toggle must still reach the parameters themselves, or the generator's gradients of the
  discriminator leak into its next step.

The noise ``z`` comes with the batch, so every strategy draws the same samples. Both optimizers are SGD (the
generator's with momentum): an Adam-family optimizer would hide a constant factor in the gradients, SGD's
parameters show it. Compared per step: both losses (mean over ranks, 1e-4 relative); at the end: every parameter of
both networks (1e-5 absolute).
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests._dist import spawn
from tests.integration.real_modules._common import assert_matches, train

LATENT, FEATURES, HIDDEN = 4, 6, 16
ROWS_PER_RANK = 4


def _data() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    real = torch.randn(64, FEATURES, generator=g) * 0.5 + 1.0
    noise = torch.randn(64, LATENT, generator=g)
    return [{"x": x, "z": z} for x, z in zip(real, noise)]


def _gan(style: str):
    import lightning as L
    import torch.nn.functional as F
    from torch import nn

    class GAN(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.generator = nn.Sequential(nn.Linear(LATENT, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, FEATURES))
            self.discriminator = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.LeakyReLU(0.2), nn.Linear(HIDDEN, 1))
            self.recorded_losses: list[torch.Tensor] = []

        def forward(self, z):
            return self.generator(z)

        @staticmethod
        def criterion(logits, target_value: float):
            return F.binary_cross_entropy_with_logits(logits, torch.full_like(logits, target_value))

        def training_step(self, batch, batch_idx):
            x, z = batch["x"], batch["z"]
            g_opt, d_opt = self.optimizers()
            if style == "docs":
                g_x = self.generator(z)
                err_d = self.criterion(self.discriminator(x), 1.0) + self.criterion(self.discriminator(g_x.detach()), 0.0)
                d_opt.zero_grad()
                self.manual_backward(err_d)
                d_opt.step()
                err_g = self.criterion(self.discriminator(g_x), 1.0)  # through G's graph built before d_opt.step()
                g_opt.zero_grad()
                self.manual_backward(err_g)
                g_opt.step()
            else:
                self.toggle_optimizer(g_opt)
                err_g = self.criterion(self.discriminator(self(z)), 1.0)
                self.manual_backward(err_g)
                g_opt.step()
                g_opt.zero_grad()
                self.untoggle_optimizer(g_opt)
                self.toggle_optimizer(d_opt)
                err_d = self.criterion(self.discriminator(x), 1.0) + self.criterion(self.discriminator(self(z).detach()), 0.0)
                err_d = err_d / 2
                self.manual_backward(err_d)
                d_opt.step()
                d_opt.zero_grad()
                self.untoggle_optimizer(d_opt)
            self.recorded_losses += [err_g.detach(), err_d.detach()]

        def configure_optimizers(self):
            g_opt = torch.optim.SGD(self.generator.parameters(), lr=0.1, momentum=0.9)
            d_opt = torch.optim.SGD(self.discriminator.parameters(), lr=0.05)
            return g_opt, d_opt

    return GAN()


STYLES = ("docs", "toggle")
STAGES = (1, 2, 3)


def _worker(rank: int, world: int, styles: tuple[str, ...], stages: tuple[int, ...]) -> dict:
    from lightning_v17 import V17Strategy

    data = _data()
    # Lightning counts a step per optimizer step: 12 steps are 6 batches, each stepping both networks. The discriminator's
    # backward leaves the generator without gradients, which "ddp" refuses unless told to look for unused parameters.
    kw = {"batch_size": ROWS_PER_RANK, "steps": 12}
    out = {}
    for style in styles:
        make = functools.partial(_gan, style)
        out[f"ddp_{style}"] = train(make, "ddp_find_unused_parameters_true", data, **kw)
        for stage in stages:
            out[f"zero{stage}_{style}"] = train(make, V17Strategy(zero_stage=stage), data, **kw)
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return spawn(_worker, world_size=2, args=(STYLES, STAGES), timeout=300)


@pytest.mark.parametrize("style", STYLES)
def test_gan_matches_ddp_both_losses_both_networks(ranks, style: str) -> None:
    assert len(ranks[0][f"ddp_{style}"]["losses"]) == 6 and len(ranks[0][f"ddp_{style}"]["losses"][0]) == 2
    print(style, assert_matches(ranks, [f"zero{s}_{style}" for s in STAGES], ref=f"ddp_{style}"))
