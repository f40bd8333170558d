"""The DynamicLossScaling callback under a real single-process Trainer: bf16 warns and does nothing, 16-true is
refused, 16-mixed installs the sharded scaler."""

from __future__ import annotations

import pytest
import torch


def _fit_single(precision=None, plugins=None):
    import lightning as L
    from lightning_v17.callbacks import DynamicLossScaling

    class M(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.l = torch.nn.Linear(4, 4)

        def training_step(self, batch, batch_idx):
            return self.l(batch).float().pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=4)

    dls = DynamicLossScaling(init_scale=8.0)
    kw = {"precision": precision} if precision else {"plugins": plugins}
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=2,
        callbacks=[dls],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kw,
    )
    trainer.fit(M())
    return dls, trainer


def test_bf16_warns_and_does_nothing():
    with pytest.warns(UserWarning, match="does nothing with precision='bf16-mixed'"):
        dls, trainer = _fit_single(precision="bf16-mixed")
    assert not dls.active and dls.tracker.total_steps == 0 and trainer.global_step == 2


def test_fp16_true_is_refused_and_16_mixed_installs_the_scaler():
    from lightning.pytorch.plugins.precision import MixedPrecision

    from lightning_v17.config import V17ConfigError

    with pytest.raises(V17ConfigError, match="16-mixed"):
        _fit_single(precision="16-true")
    dls, trainer = _fit_single(plugins=[MixedPrecision("16-mixed", "cpu")])
    assert dls.active and trainer.precision_plugin.scaler is dls.scaler
    assert dls.tracker.total_steps == 2 and trainer.global_step == 2
