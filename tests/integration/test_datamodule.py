"""PackedDataModule under a real Trainer: exact mid-epoch resume through a Lightning checkpoint, and a seq_len longer
than the model's context refused at setup."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_v17.data.datamodule import PackedDataModule
from lightning_v17.models import LlamaLM
from tests.unit.test_datamodule import _docs


class _Recorder(LlamaLM):
    def __init__(self) -> None:
        super().__init__(
            model_overrides={"layers": 1, "hidden": 32, "heads": 2, "kv_heads": 1, "ffn": 64},
            warmup_steps=0,
            max_steps=8,
        )
        self.seen: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch["input_ids"].clone())
        return super().training_step(batch, batch_idx)


def _fit(tmp_path, max_steps, ckpt_path=None):
    torch.manual_seed(0)
    model = _Recorder()
    dm = PackedDataModule(_docs(), seq_len=32, batch_size=2, seed=3)
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=4, save_top_k=-1)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[ckpt],
    )
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
    return model.seen, trainer


def test_resume_mid_epoch_through_a_lightning_checkpoint(tmp_path):
    full, _ = _fit(tmp_path / "a", 8)
    head, _ = _fit(tmp_path / "b", 4)
    tail, trainer = _fit(tmp_path / "b", 8, ckpt_path="last")
    assert trainer.global_step == 8
    assert len(full) == 8 and len(head) == 4 and len(tail) == 4
    # No repeated and no skipped rows: the resumed run trains on exactly the uninterrupted run's steps 5..8.
    for a, b in zip(full, head + tail, strict=True):
        assert torch.equal(a, b)
    state = torch.load(tmp_path / "b" / "last.ckpt", weights_only=False)["PackedDataModule"]
    assert state["consumed"] == 8 * 2 and state["epoch"] == 0


def test_seq_len_longer_than_the_model_context_is_refused_at_setup(tmp_path):
    """seq_len > the model's max_seq_len is refused before any step, naming both options and the fix."""
    model = LlamaLM(model="tiny", model_overrides={"max_seq_len": 32})
    dm = PackedDataModule(_docs(20), seq_len=48, batch_size=2)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"seq_len=48 .* config\.max_seq_len=32; set data seq_len <= 32"):
        trainer.fit(model, datamodule=dm)
    assert trainer.global_step == 0
    # at the limit it trains
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(model, datamodule=PackedDataModule(_docs(20), seq_len=32, batch_size=2))
    assert trainer.global_step == 1
