"""``pack_ffd`` (numpy chunking and sort, first fit in C) gives the rows of today's ``pack(mode="ffd")``, row for row,
through the compiled helper and through its Python fallback; the same arrays as the chunk-level numpy plan
(``_chunk_level_plan``: every chunk sorted and grouped) over a million documents; and its memory peak per document."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_v17.data import ffd
from lightning_v17.data.packing import pack


def _lengths(n, seed, seq_len):
    rng = np.random.default_rng(seed)
    lengths = rng.lognormal(np.log(seq_len / 6), 1.0, n).astype(np.int64)
    lengths[rng.random(n) < 0.05] = 0  # empty documents
    return lengths


@pytest.mark.parametrize(("n", "seq_len", "seed"), [(0, 16, 0), (1, 16, 0), (300, 16, 1), (5000, 128, 2),
                                                    (20_000, 512, 3)])  # fmt: skip
def test_the_rows_of_pack(n, seq_len, seed):
    lengths = _lengths(n, seed, seq_len)
    ref = pack(lengths.tolist(), seq_len, mode="ffd")
    ours = ffd.pack_ffd(lengths, seq_len)
    assert ours.num_rows == ref.num_rows and ours.num_chunks == ref.num_chunks
    assert ours.num_split_docs == ref.num_split_docs
    assert list(ours.rows) == list(ref.rows)
    assert ours.padding_fraction() == pytest.approx(ref.padding_fraction(), abs=1e-12)
    assert ours.stats() == pytest.approx(ref.stats())


def test_the_python_fallback_places_as_the_compiled_helper(monkeypatch):
    assert ffd._compiled() is not None, "the C helper did not build here (is a C compiler installed?)"
    need = np.sort(_lengths(3000, 4, 64).clip(1, 64))[::-1]
    compiled = ffd.first_fit(need, 64)
    monkeypatch.setattr(ffd, "_compiled", lambda: None)
    fallback = ffd.first_fit(need, 64)
    np.testing.assert_array_equal(compiled[0], fallback[0])
    assert compiled[1] == fallback[1]


def test_the_cached_plan_is_written_once_and_memory_mapped_after(tmp_path, monkeypatch):
    lengths = _lengths(2000, 5, 64)
    ref = pack(lengths.tolist(), 64, mode="ffd")
    first = ffd.pack_ffd_cached(lengths, 64, tmp_path / "corpus")
    (cached,) = tmp_path.glob("corpus.ffd-*.npy")
    assert not list(tmp_path.glob("*.tmp"))
    monkeypatch.setattr(ffd, "pack_ffd", lambda *a, **k: pytest.fail("recomputed instead of read from the cache"))
    second = ffd.pack_ffd_cached(lengths, 64, tmp_path / "corpus")
    assert isinstance(second.doc, np.memmap) or isinstance(second.doc.base, np.memmap)
    assert list(first.rows) == list(second.rows) == list(ref.rows)
    other = lengths.copy()
    other[0] += 1  # other lengths (or another seq_len) are another key
    assert ffd.plan_key(other, 64) != ffd.plan_key(lengths, 64) != ffd.plan_key(lengths, 32)
    assert cached.name == f"corpus.ffd-{ffd.plan_key(lengths, 64)}.npy"


@settings(max_examples=150, deadline=None)
@given(seq_len=st.integers(2, 64), lengths=st.lists(st.integers(0, 200), max_size=80), multiples=st.booleans())
def test_random_lengths_give_the_rows_of_pack(seq_len, lengths, multiples):
    lengths = np.array(lengths, dtype=np.int64)
    if multiples:  # whole multiples of seq_len: documents of full chunks only, and empty ones
        lengths = lengths // seq_len * seq_len
    ref = pack(lengths.tolist(), seq_len, mode="ffd")
    ours = ffd.pack_ffd(lengths, seq_len)
    assert list(ours.rows) == list(ref.rows)
    assert ours.num_split_docs == ref.num_split_docs


def _chunk_level_plan(lengths, seq_len):
    """The plan computed chunk by chunk: every chunk materialized in int64, ``lexsort`` by (length decreasing,
    document, offset), first fit over all of them, ``argsort`` by row."""
    doc, start, length, split = ffd.chunk_arrays(lengths, seq_len)
    order = np.lexsort((start, doc, -length))
    doc, start, length = doc[order], start[order], length[order]
    row, num_rows = ffd.first_fit(length, seq_len)
    by_row = np.argsort(row, kind="stable")
    row_ptr = np.zeros(num_rows + 1, dtype=np.int64)
    np.cumsum(np.bincount(row, minlength=num_rows), out=row_ptr[1:])
    return doc[by_row], start[by_row], length[by_row], row_ptr, split


def _bench_lengths(n):
    """bench/data.py's documents: log-normal lengths of mean 700 tokens, int32 like a token file's index."""
    rng = np.random.default_rng(100)
    return np.maximum(rng.lognormal(np.log(700.0) - 0.5, 1.0, n), 1).astype(np.int32)


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_a_million_documents_give_the_chunk_level_plan(dtype):
    lengths = _bench_lengths(1_000_000).astype(dtype)
    lengths[::97] = 4096 * 3  # documents of full chunks only
    lengths[::89] = 0
    ours = ffd.pack_ffd(lengths, 4096)
    *arrays, split = _chunk_level_plan(lengths, 4096)
    for name, want in zip(("doc", "start", "length", "row_ptr"), arrays, strict=True):
        np.testing.assert_array_equal(getattr(ours, name), want, err_msg=name)
    assert ours.num_split_docs == split > 0


#: Bytes per document the plan may hold at its peak, itself included. The plan needs 12 bytes per chunk and 8 per
#: row (about 13.5 per document here); the required ceiling is 48, and this test holds it at 32 (the measured peak is
#: about 26), so that one more int64 array per document alive at the peak fails it.
PEAK_BYTES_PER_DOCUMENT = 32


def test_peak_memory_per_document():
    n = 1_000_000
    lengths = _bench_lengths(n)  # the caller's array, allocated before the measurement
    ffd.pack_ffd(lengths[:1000], 4096)  # the C helper built and loaded outside the measurement
    tracemalloc.start()
    try:
        plan = ffd.pack_ffd(lengths, 4096)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert plan.num_chunks > n  # some documents were split: the per-chunk arrays are longer than the documents
    assert peak / n <= PEAK_BYTES_PER_DOCUMENT <= 48, f"{peak / n:.1f} B/document"
