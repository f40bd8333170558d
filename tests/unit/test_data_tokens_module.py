"""``PackedDataModule`` over token files (no Trainer): ``paths`` with ``ffd`` plans the rows of ``pack()`` and batches
them as the same documents given as a list, a blend's state round-trips, and a changed mixture on resume is refused unless declared."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_v17.data import PackedDataModule
from lightning_v17.data.indexed import write_indexed
from lightning_v17.data.packing import pack


def _docs(n=40, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, int(k)) for k in rng.integers(0, 90, n)]


def _batches(dm, count):
    dm.setup("fit")
    it = iter(dm.train_dataloader())
    return [next(it) for _ in range(count)]


def test_one_token_file_with_ffd_plans_as_the_same_documents_in_a_list(tmp_path):
    docs = _docs()
    write_indexed(tmp_path / "a", docs)
    kw = {"seq_len": 64, "batch_size": 4, "packing": "ffd", "seed": 1, "prefetch_batches": 0}
    dm = PackedDataModule(paths=[str(tmp_path / "a")], **kw)
    ours = _batches(dm, 3)
    assert list(dm.train_rows.plan.rows) == list(pack([len(d) for d in docs], 64, mode="ffd").rows)
    ref = _batches(PackedDataModule(dataset=[d.tolist() for d in docs], **kw), 3)  # the documents from a list
    for a, b in zip(ours, ref, strict=True):
        for key in ("input_ids", "position_ids", "labels", "doc_ids", "cu_seqlens"):
            torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=key)


def _blend_module(tmp_path, weights, **kw):
    paths = []
    for c in range(2):
        if not (tmp_path / f"b{c}.idx").exists():
            write_indexed(tmp_path / f"b{c}", _docs(60, seed=c))
        paths.append(str(tmp_path / f"b{c}"))
    return PackedDataModule(paths=paths, weights=weights, seq_len=32, batch_size=2, prefetch_batches=0, **kw)


def test_blend_state_round_trips_and_a_mixture_change_must_be_declared(tmp_path):
    dm = _blend_module(tmp_path, [0.5, 0.5])
    dm.setup("fit")
    dm.train_dataloader()
    dm._batches = 5  # five batches trained (what on_before_batch_transfer counts)
    state = dm.state_dict()
    assert state["consumed"] == 10 and state["index"]["manifest"]["weights"] == [0.5, 0.5]

    same = _blend_module(tmp_path, [0.5, 0.5])
    same.load_state_dict(state)
    same.setup("fit")
    rows = next(iter(same.train_dataloader()))["input_ids"]
    expect = torch.stack([dm.train_rows[i]["input_ids"] for i in (10, 11)])
    torch.testing.assert_close(rows, expect, rtol=0, atol=0)

    changed = _blend_module(tmp_path, [0.9, 0.1])
    changed.load_state_dict(state)
    changed.setup("fit")
    with pytest.raises(ValueError, match=r"data.weights \[0.5, 0.5\] -> \[0.9, 0.1\]"):
        changed.train_dataloader()
    declared = _blend_module(tmp_path, [0.9, 0.1], mixture_change=True)
    declared.load_state_dict(state)
    declared.setup("fit")
    declared.train_dataloader()
    assert [p["start"] for p in declared.train_rows.phases] == [0, 10]


def test_bad_token_file_options_are_named(tmp_path):
    with pytest.raises(ValueError, match="data.weights, data.num_samples and data.val_paths need data.paths"):
        PackedDataModule(weights=[1.0])
    with pytest.raises(ValueError, match="data.paths and data.dataset both given"):
        PackedDataModule(dataset=[[1, 2]], paths=["x"])
    with pytest.raises(ValueError, match="blended data.paths use packing='concat'"):
        PackedDataModule(paths=["x", "y"], packing="ffd")
    with pytest.raises(ValueError, match="packing='concat' cuts token files: give data.paths"):
        PackedDataModule(packing="concat")
