"""PackedDataModule: dataset forms, DP sharding from the trainer, default corpus, and exact mid-epoch resume through a
real Lightning checkpoint."""

from __future__ import annotations

from types import SimpleNamespace

import lightning as L
import pytest
import torch
from torch.utils.data import IterableDataset

from lightning_v17.data import ByteTokenizer
from lightning_v17.data.datamodule import PackedDataModule
from lightning_v17.models import LlamaLM


def _docs(n=60, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (int(torch.randint(3, 40, (1,), generator=g)),), generator=g) for _ in range(n)]


def _rows(loader):
    return [r for b in loader for r in b["input_ids"]]


def test_token_lists_texts_dicts_and_iterables():
    docs = _docs()
    as_lists = [d.tolist() for d in docs]
    a = PackedDataModule(as_lists, seq_len=32, batch_size=2, shuffle=False)
    b = PackedDataModule(docs, seq_len=32, batch_size=2, shuffle=False)

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(docs)

    c = PackedDataModule(Stream(), seq_len=32, batch_size=2, shuffle=False)
    batches = [next(iter(dm.train_dataloader())) for dm in (a, b, c)]
    for x in batches[1:]:
        assert all(torch.equal(x[k], batches[0][k]) for k in ("input_ids", "labels", "position_ids", "cu_seqlens"))
    batch = batches[0]
    assert batch["input_ids"].shape == (2, 32) and batch["cu_seqlens"].dtype == torch.int32
    assert a.val_dataloader() == []  # custom data without val_dataset: no validation
    text = PackedDataModule(
        ["def f():\n    return 1\n", "x = 2\n"], tokenizer=ByteTokenizer(), seq_len=64, batch_size=1, shuffle=False
    )
    row = next(iter(text.train_dataloader()))
    assert row["input_ids"][0, 0] == ByteTokenizer.BOS and "loss_mask" not in row
    sft = PackedDataModule([{"input_ids": [1, 2, 3, 4], "loss_mask": [0, 0, 1, 1]}], seq_len=8, batch_size=1)
    assert next(iter(sft.train_dataloader()))["loss_mask"][0].tolist() == [0, 1, 1, 0, 0, 0, 0, 0]


@pytest.mark.parametrize("packing", ["ffd", "best_fit", "bucket", "none"])
def test_ranks_from_the_trainer_get_disjoint_complete_rows(packing):
    docs = _docs(80)
    seen = []
    for rank in range(2):
        dm = PackedDataModule(docs, seq_len=32, batch_size=3, packing=packing, drop_last=False)
        dm.trainer = SimpleNamespace(distributed_sampler_kwargs={"num_replicas": 2, "rank": rank}, training=False)
        seen.append({tuple(r[r != ByteTokenizer.PAD].tolist()) for r in _rows(dm.train_dataloader())})
    assert not seen[0] & seen[1]
    plan = dm.train_rows.plan
    assert len(seen[0]) + len(seen[1]) == plan.num_rows


def test_bucket_batches_pad_only_to_similar_lengths():
    dm = PackedDataModule(_docs(200), seq_len=64, batch_size=8, packing="bucket")
    pads = [float((b["doc_ids"] < 0).float().mean()) for b in dm.train_dataloader()]
    unpacked = PackedDataModule(_docs(200), seq_len=64, batch_size=8, packing="none")
    pads_none = [float((b["doc_ids"] < 0).float().mean()) for b in unpacked.train_dataloader()]
    assert sum(pads) / len(pads) < 0.1 < sum(pads_none) / len(pads_none)


def test_default_dataset_is_the_stdlib_corpus():
    dm = PackedDataModule(seq_len=256, batch_size=2)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape == (2, 256)
    assert len(dm.val_rows) > 100 and dm.stats()["padding_fraction"] < 0.01
    assert dm.pin_memory is torch.cuda.is_available()


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
