"""The ``.bin/.idx`` token files against megatron-core 0.16.1 itself: its ``IndexedDatasetBuilder`` writes the same
bytes as ours, its ``IndexedDataset`` reads ours back (uint16 and int32, empty documents included), and bad files
are refused with errors that name the problem.

megatron-core is installed by ``make venv`` into ``.venv/megatron-target`` (not into the environment: it would pull
its own pins); the comparisons skip with the reason when it is not importable.
"""

from __future__ import annotations

import struct
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_v17.data.indexed import (
    IndexedReader,
    IndexedWriter,
    TokenFileDataset,
    TokenFileError,
    token_dtype,
    write_indexed,
)

ROOT = Path(__file__).resolve().parents[2]
MEGATRON_TARGET = ROOT / ".venv" / "megatron-target"


@pytest.fixture(scope="module")
def megatron():
    if MEGATRON_TARGET.is_dir() and str(MEGATRON_TARGET) not in sys.path:
        sys.path.append(str(MEGATRON_TARGET))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core.datasets import indexed_dataset
    except Exception as err:  # noqa: BLE001 - any import failure means the reference is unavailable
        pytest.skip(f"megatron-core 0.16.1 is not importable ({err!r}); `make venv` installs it into {MEGATRON_TARGET}")
    return indexed_dataset


def _documents(vocab: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    lengths = [0, 5, 0, 1, 300, 0, 17, 2048, 3, 0]  # empty documents first, in the middle and last
    return [rng.integers(0, vocab, n) for n in lengths]


@pytest.mark.parametrize("vocab", [320, 65499, 65500, 200_000])
def test_bytes_identical_to_megatron_builder_and_read_back_by_megatron(tmp_path, megatron, vocab):
    dtype = token_dtype(vocab)
    assert dtype == megatron.DType.optimal_dtype(vocab)  # uint16 below 65,500, int32 from there
    docs = _documents(vocab, seed=vocab)
    builder = megatron.IndexedDatasetBuilder(str(tmp_path / "ref.bin"), dtype=dtype.type)
    for doc in docs:
        builder.add_item(torch.from_numpy(doc))
        builder.end_document()
    builder.finalize(str(tmp_path / "ref.idx"))
    write_indexed(tmp_path / "ours", docs, dtype=dtype)
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"ours{suffix}").read_bytes() == (tmp_path / f"ref{suffix}").read_bytes(), suffix

    theirs = megatron.IndexedDataset(str(tmp_path / "ours"), mmap=True)
    ours = IndexedReader(tmp_path / "ref")
    assert len(theirs) == len(ours) == len(docs)
    np.testing.assert_array_equal(theirs.document_indices, np.arange(len(docs) + 1))
    np.testing.assert_array_equal(ours.document_indices, theirs.document_indices)
    np.testing.assert_array_equal(ours.sequence_lengths, [len(d) for d in docs])
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(theirs[i], doc)
        np.testing.assert_array_equal(ours[i], doc)
        assert ours[i].dtype == dtype
        if len(doc) > 4:
            np.testing.assert_array_equal(ours.get(i, offset=2, length=3), theirs.get(i, offset=2, length=3))


def test_a_document_is_a_view_of_the_memory_map_not_a_copy(tmp_path):
    docs = _documents(320, seed=1)
    write_indexed(tmp_path / "d", docs)
    ds = TokenFileDataset(tmp_path / "d")
    item = ds[7]
    assert isinstance(item.base, np.memmap) or isinstance(getattr(item.base, "base", None), np.memmap)
    assert not item.flags.owndata and not item.flags.writeable
    np.testing.assert_array_equal(ds.lengths(), [len(d) for d in docs])
    # the offsets are the cumulative lengths, hand-computed
    np.testing.assert_array_equal(ds.reader.token_offsets(), np.concatenate([[0], np.cumsum([len(d) for d in docs])[:-1]]))


def test_pickling_reopens_the_files_instead_of_copying_them(tmp_path):
    import pickle

    write_indexed(tmp_path / "d", _documents(320, seed=2))
    reader = IndexedReader(tmp_path / "d")
    blob = pickle.dumps(TokenFileDataset(tmp_path / "d"))
    assert len(pickle.dumps(reader)) < 500 and len(blob) < 500  # the .bin alone is 4.7 KB
    np.testing.assert_array_equal(pickle.loads(blob)[7], reader[7])


def test_writer_refuses_ids_outside_the_dtype(tmp_path):
    with pytest.raises(TokenFileError, match="do not fit dtype=uint16"):
        write_indexed(tmp_path / "x", [np.array([1, 70000])], dtype=np.uint16)
    assert not list(tmp_path.iterdir()), "an aborted write leaves nothing behind"


def test_an_unfinished_write_leaves_no_pair(tmp_path):
    w = IndexedWriter(tmp_path / "p")
    w.add_document([1, 2, 3])
    assert not (tmp_path / "p.bin").exists() and not (tmp_path / "p.idx").exists()
    w.finalize()
    assert IndexedReader(tmp_path / "p")[0].tolist() == [1, 2, 3]


def test_bad_files_are_named(tmp_path):
    write_indexed(tmp_path / "a", [np.arange(10), np.arange(5)])
    (tmp_path / "b.bin").write_bytes((tmp_path / "a.bin").read_bytes())
    with pytest.raises(TokenFileError, match=r"no index file .*b\.idx.*interrupted"):
        IndexedReader(tmp_path / "b")
    with pytest.raises(TokenFileError, match="holds uint16 tokens but int32 was expected"):
        IndexedReader(tmp_path / "a", expect_dtype=np.int32)

    (tmp_path / "t.idx").write_bytes((tmp_path / "a.idx").read_bytes())
    (tmp_path / "t.bin").write_bytes((tmp_path / "a.bin").read_bytes()[:-2])
    with pytest.raises(TokenFileError, match=r"t\.bin is 28 bytes but .* indexes 30: the \.bin is truncated"):
        IndexedReader(tmp_path / "t")

    raw = bytearray((tmp_path / "a.idx").read_bytes())
    (tmp_path / "v.bin").write_bytes((tmp_path / "a.bin").read_bytes())
    (tmp_path / "v.idx").write_bytes(bytes(raw[:9]) + struct.pack("<Q", 2) + bytes(raw[17:]))
    with pytest.raises(TokenFileError, match="version 2 of the index format"):
        IndexedReader(tmp_path / "v")
    (tmp_path / "v.idx").write_bytes(bytes(raw[:17]) + b"\x09" + bytes(raw[18:]))
    with pytest.raises(TokenFileError, match="unknown dtype code 9"):
        IndexedReader(tmp_path / "v")
    (tmp_path / "v.idx").write_bytes(bytes(raw[:-4]))
    with pytest.raises(TokenFileError, match="truncated or corrupt"):
        IndexedReader(tmp_path / "v")
    (tmp_path / "v.idx").write_bytes(b"NOTANIDX" + bytes(raw[8:]))
    with pytest.raises(TokenFileError, match="not a Megatron index file"):
        IndexedReader(tmp_path / "v")
