"""``pack_ffd`` (numpy chunking and sort, first fit in C) gives the rows of today's ``pack(mode="ffd")``, row for row,
through the compiled helper and through its Python fallback."""

from __future__ import annotations

import numpy as np
import pytest

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
