"""Hugging Face ``datasets`` input: an Arrow ``input_ids`` column read in place (lengths from the offsets, documents
as views of the values buffer, no row ever converted to Python), the same rows and batches as the same documents
written to a token file, blended with token files and resumed, and bad inputs refused with the fix."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

datasets = pytest.importorskip("datasets")
pa = pytest.importorskip("pyarrow")

from lightning_v17.data.blend import BlendedTokens
from lightning_v17.data.datamodule import PackedDataModule
from lightning_v17.data.hf_arrow import ArrowTokens
from lightning_v17.data.indexed import write_indexed
from lightning_v17.data.packing import collate_rows

FIELDS = ("input_ids", "position_ids", "labels", "doc_ids", "cu_seqlens")


def _docs(n, seed, *, empty_every=7):
    rng = np.random.default_rng(seed)
    lengths = np.maximum(rng.lognormal(2.5, 1.0, n).astype(int), 1)
    lengths[::empty_every] = 0  # empty documents, also at the ends of the shards
    return [rng.integers(0, 50_000, int(k)).astype(np.int32) for k in lengths]


def _saved(tmp_path, docs, name="hf", shards=3):
    """A save_to_disk directory of the documents in several shards (a ChunkedArray of several memory-mapped chunks)."""
    lengths = np.array([len(d) for d in docs])
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    values = np.concatenate(docs) if docs else np.zeros(0, np.int32)
    column = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))
    table = pa.table({"input_ids": column, "text": pa.array([f"doc {i}" for i in range(len(docs))])})
    datasets.Dataset(table).save_to_disk(str(tmp_path / name), num_shards=shards)
    return str(tmp_path / name)


def _forbid_rows(monkeypatch):
    """Every way ``datasets`` turns rows into Python objects raises from here on."""

    def refuse(*args, **kwargs):
        raise AssertionError("a row was materialized")

    for name in ("__getitem__", "__getitems__", "__iter__", "_getitem", "iter", "to_list", "to_dict", "to_pandas"):
        monkeypatch.setattr(datasets.Dataset, name, refuse, raising=False)
    monkeypatch.setattr(datasets.formatting.formatting, "query_table", refuse)
    monkeypatch.setattr(datasets.formatting, "format_table", refuse)


def _by_sample(ds):
    """The dataset's collated rows in corpus-sample order (the shuffle is keyed by the corpus's path)."""
    _, sample = ds.locate(np.arange(len(ds)))
    return collate_rows(ds.__getitems__(np.argsort(sample, kind="stable").tolist()))


def test_an_arrow_column_gives_the_token_files_rows_without_materializing_a_row(tmp_path, monkeypatch):
    docs = _docs(300, seed=1)
    path = _saved(tmp_path, docs)
    write_indexed(tmp_path / "tok", docs)
    _forbid_rows(monkeypatch)

    arrow = ArrowTokens(path)
    assert arrow.lengths().tolist() == [len(d) for d in docs]  # from the offsets, across the shards' chunks
    assert arrow.num_tokens == sum(len(d) for d in docs)
    assert len(datasets.load_from_disk(path).data.column("input_ids").chunks) == 3
    view = arrow[5]
    np.testing.assert_array_equal(view, docs[5])
    assert not view.flags.owndata  # a view of the memory-mapped values buffer

    hf, tok = BlendedTokens([path], seq_len=32, seed=3), BlendedTokens([str(tmp_path / "tok")], seq_len=32, seed=3)
    assert len(hf) == len(tok)
    a, b = _by_sample(hf), _by_sample(tok)
    for key in FIELDS:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=key)
    for i in (0, 7, len(hf) - 1):  # the one-row path too (segments across shard boundaries included)
        _, s = hf.locate_one(i)
        ref = tok[int(np.flatnonzero(tok.locate(np.arange(len(tok)))[1] == s)[0])]
        for key in FIELDS[:4]:
            torch.testing.assert_close(hf[i][key], ref[key], rtol=0, atol=0, msg=f"{key} of {i}")

    # a contiguous select slices the table: chunks whose offsets do not start at 0
    part = datasets.load_from_disk(path).select(range(50, 250))
    assert part._indices is None and ArrowTokens(part).lengths().tolist() == [len(d) for d in docs[50:250]]
    write_indexed(tmp_path / "part", docs[50:250])
    a = _by_sample(BlendedTokens([part], seq_len=32))
    b = _by_sample(BlendedTokens([str(tmp_path / "part")], seq_len=32))
    torch.testing.assert_close(a["input_ids"], b["input_ids"], rtol=0, atol=0)

    # the data module: a Dataset object planned with ffd gives the token file's batches, in the same order
    mods = [PackedDataModule(dataset=datasets.load_from_disk(path), packing="ffd", seq_len=64, batch_size=4,
                             prefetch_batches=0),
            PackedDataModule(paths=[str(tmp_path / "tok")], packing="ffd", seq_len=64, batch_size=4,
                             prefetch_batches=0)]  # fmt: skip
    for m in mods:
        m.setup("fit")
    for x, y in zip(mods[0].train_dataloader(), mods[1].train_dataloader(), strict=True):
        for key in FIELDS:
            torch.testing.assert_close(x[key], y[key], rtol=0, atol=0, msg=key)
    # and the directory in data.paths (concat, the YAML form) through its loader
    loader = PackedDataModule(paths=[path], seq_len=32, batch_size=4, prefetch_batches=0).train_dataloader()
    assert next(iter(loader))["input_ids"].shape == (4, 32)


def test_arrow_corpora_blend_with_token_files_and_resume(tmp_path):
    docs_a, docs_b = _docs(120, seed=2), _docs(80, seed=3)
    write_indexed(tmp_path / "a", docs_a)
    path_b = _saved(tmp_path, docs_b, name="b", shards=2)
    blend = BlendedTokens([str(tmp_path / "a"), path_b], weights=[0.5, 0.5], seq_len=16, seed=1)
    assert blend.manifest()["corpora"][1] == {"path": path_b, "sequences": 80, "tokens": sum(map(len, docs_b))}
    positions = list(range(3, 60, 3))
    batch = collate_rows(blend.__getitems__(positions))
    ref = collate_rows([blend[i] for i in positions])
    for key in FIELDS:
        torch.testing.assert_close(batch[key], ref[key], rtol=0, atol=0, msg=key)
    assert {blend.locate_one(i)[0] for i in positions} == {0, 1}
    # resume from the index state: the same rows from the saved position on
    again = BlendedTokens([str(tmp_path / "a"), path_b], weights=[0.5, 0.5], seq_len=16, seed=1)
    again.load_index_state(blend.index_state(), position=40)
    for i in (40, 41, 77):
        torch.testing.assert_close(again[i]["input_ids"], blend[i]["input_ids"], rtol=0, atol=0)
    # an in-memory Dataset is named by its contents: the same documents, the same index on a restart
    def mem(docs):
        return ArrowTokens(datasets.Dataset.from_dict({"input_ids": [d.tolist() for d in docs]}))

    assert mem(docs_b).path == mem(docs_b).path != mem(docs_a).path
    assert mem(docs_b).path.startswith("arrow:input_ids:")
    # DataLoader workers: the pickled source re-opens the directory and gives the same documents
    clone = pickle.loads(pickle.dumps(blend))
    torch.testing.assert_close(collate_rows(clone.__getitems__(positions))["labels"], batch["labels"], rtol=0, atol=0)


def test_bad_arrow_inputs_are_named_with_the_fix(tmp_path):
    texts = datasets.Dataset.from_dict({"text": ["a b", "c"]})
    with pytest.raises(ValueError, match=r"no 'input_ids' column \(columns: \['text'\]\); tokenize into an integer"):
        ArrowTokens(texts)
    floats = datasets.Dataset.from_dict({"input_ids": [[0.5, 1.5], [2.0]]})
    with pytest.raises(ValueError, match=r"column 'input_ids' holds list<item: double>, not lists of integer token"):
        ArrowTokens(floats)
    strings = datasets.Dataset.from_dict({"input_ids": ["1 2 3", "4"]})
    with pytest.raises(ValueError, match=r"holds string, not lists of integer token ids; tokenize"):
        PackedDataModule(dataset=strings, packing="ffd")
    shuffled = datasets.Dataset.from_dict({"input_ids": [[1, 2], [3]]}).select([1, 0])
    with pytest.raises(ValueError, match=r"indices mapping .* dataset.flatten_indices\(\)"):
        ArrowTokens(shuffled)
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"input_ids": [[1]]})})
    with pytest.raises(TypeError, match=r"DatasetDict \(splits \['train'\]\); give one split, e.g. ds\['train'\]"):
        ArrowTokens(dd)
    dd.save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ValueError, match=r"is a DatasetDict \(splits \['train'\]\); give one split's directory"):
        PackedDataModule(paths=[str(tmp_path / "dd")]).setup("fit")
