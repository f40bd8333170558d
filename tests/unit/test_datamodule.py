"""PackedDataModule: dataset forms, DP sharding from the trainer, default corpus (the resume through a real Lightning
checkpoint is in tests/integration/test_datamodule.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import IterableDataset

from lightning_v17.data import ByteTokenizer
from lightning_v17.data.datamodule import PackedDataModule


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
