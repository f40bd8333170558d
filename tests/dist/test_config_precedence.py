"""Precedence of a DeepSpeed config against the constructor: given > config > default, decided by whether an
argument was given, never by comparing it with its default.

``V17Strategy(zero_stage=3, config={... "stage": 2 ...})`` must train at stage 3 (the given argument equals the
default, which an equality test would mistake for "not given"), and ``V17Strategy(config={... "stage": 2 ...})``
at stage 2. What each run trained at is read from the model after one step on 2 gloo ranks, not from the policy:
stage 3 leaves FSDP2 DTensor shards as parameters, stage 2 plain full tensors with the optimizer state sharded.
"""

from __future__ import annotations

from tests._dist import spawn

CONFIG = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 4}


def _module():
    import lightning as L
    import torch
    from torch import nn

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))

        def training_step(self, batch, batch_idx):
            return self.model(batch).square().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Tiny()


def _worker(rank: int, world: int) -> dict:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    from lightning_v17 import V17Strategy

    out = {}
    for name, kw in {"given3": {"zero_stage": 3, "config": CONFIG}, "config2": {"config": CONFIG},
                     "default": {}}.items():  # fmt: skip
        L.seed_everything(0, verbose=False)
        module = _module()
        trainer = L.Trainer(
            accelerator="cpu", devices=world, strategy=V17Strategy(**kw), max_steps=1, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        trainer.fit(module, DataLoader(torch.randn(16, 8), batch_size=4))
        p = next(module.parameters())
        out[name] = {
            "stage": trainer.strategy.zero.stage,
            "dtensor_params": hasattr(p, "to_local"),
            "full_shape": tuple(p.shape),
            "local_numel": p.to_local().numel() if hasattr(p, "to_local") else p.numel(),
        }
    return out


def test_given_argument_beats_config_and_config_beats_default() -> None:
    r0 = spawn(_worker, world_size=2, timeout=240)[0]
    # given zero_stage=3 wins over the config's 2: parameters are FSDP2 shards (half of the 8x8 weight per rank)
    assert r0["given3"] == {"stage": 3, "dtensor_params": True, "full_shape": (8, 8), "local_numel": 32}, r0
    # the config alone: stage 2 keeps whole plain parameters
    assert r0["config2"] == {"stage": 2, "dtensor_params": False, "full_shape": (8, 8), "local_numel": 64}, r0
    # neither: the default stage 3
    assert r0["default"]["stage"] == 3 and r0["default"]["dtensor_params"], r0
