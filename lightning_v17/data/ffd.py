"""First-fit decreasing over millions of documents: numpy arrays in, numpy arrays out, the same plan as ``pack()``.

Chunking (documents longer than ``seq_len`` cut into ``seq_len`` continuation chunks) and the decreasing sort are
numpy. First fit itself is sequential -- each chunk's row depends on every earlier one -- so numpy alone cannot
express it; it runs in a 30-line C function (a max segment tree over row capacities, O(n log n)), compiled with the
system C compiler on first use and cached under ``$LIGHTNING_V17_CACHE`` (default ``~/.cache/lightning_v17``) keyed by
its source hash, then called through :mod:`ctypes`. Where no compiler is found, the same loop runs in Python (slow
but identical). The order and the tie-breaking are ``pack()``'s (length decreasing, then document, then offset), so
the rows are the same rows: :func:`pack_ffd` returns an :class:`ArrayPlan`, which answers what a
:class:`~lightning_v17.data.packing.PackingPlan` answers without holding a Python object per segment.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from lightning_v17.data.packing import PackingMode, Segment

_C_SOURCE = r"""
#include <stdint.h>
/* First fit of items (in the given order) into rows of `cap`: row_out[i] = row of item i; returns the row count, or
   -1 when the caller's tree (2 * size entries, size a power of two) has too few leaves for the rows needed. */
int64_t v17_first_fit(const int32_t *need, int64_t n, int32_t cap, int32_t *row_out, int32_t *tree, int64_t size) {
    int64_t rows = 0;
    for (int64_t i = 0; i < 2 * size; i++) tree[i] = cap;
    for (int64_t i = 0; i < n; i++) {
        int64_t node = 1;
        int32_t w = need[i];
        while (node < size) node = tree[2 * node] >= w ? 2 * node : 2 * node + 1;
        if (tree[node] < w) return -1;
        int64_t row = node - size;
        if (row == rows) rows++;
        row_out[i] = (int32_t)row;
        tree[node] -= w;
        for (node >>= 1; node; node >>= 1) {
            int32_t a = tree[2 * node], b = tree[2 * node + 1];
            tree[node] = a > b ? a : b;
        }
    }
    return rows;
}
"""

#: Documents per block of the elementwise passes: their int64 temporaries stay a few hundred KB whatever the corpus.
_BLOCK = 1 << 16


def _cache_dir() -> Path:
    return Path(os.environ.get("LIGHTNING_V17_CACHE", Path.home() / ".cache" / "lightning_v17"))


@cache
def _compiled() -> Any:
    """The C first fit through ctypes, or None when it cannot be built here (then the Python loop is used)."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    digest = hashlib.sha256(_C_SOURCE.encode()).hexdigest()[:16]
    lib = _cache_dir() / f"v17_ffd_{digest}.so"
    if not lib.is_file():
        if compiler is None:
            return None
        try:
            lib.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
                src = Path(tmp) / "ffd.c"
                src.write_text(_C_SOURCE)
                out = Path(tmp) / "ffd.so"
                subprocess.run([compiler, "-O2", "-shared", "-fPIC", str(src), "-o", str(out)], check=True,
                               capture_output=True, timeout=120)  # fmt: skip
                os.replace(out, lib)  # atomic: a rank building at the same time never loads half a file
        except (OSError, subprocess.SubprocessError):
            return None
    fn = ctypes.CDLL(str(lib)).v17_first_fit
    fn.restype = ctypes.c_int64
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    return fn


def _tree_leaves(need: np.ndarray, cap: int) -> int:
    """Leaves of the segment tree: a power of two >= the rows first fit can open. All rows but one end more than
    half full (an item that opened or joined a later row did not fit in any earlier one, so each earlier row plus it
    exceeds ``cap``), hence rows <= 2 * total / cap + 1; and never more rows than items."""
    bound = min(need.size, 2 * int(need.sum(dtype=np.int64)) // cap + 2)
    return 1 << max(bound - 1, 0).bit_length()


def _first_fit_python(need: np.ndarray, cap: int) -> tuple[np.ndarray, int]:
    size = _tree_leaves(need, cap)
    tree = [cap] * (2 * size)
    rows_out = np.empty(len(need), dtype=np.int32)
    rows = 0
    for i, w in enumerate(need.tolist()):
        node = 1
        while node < size:
            node = 2 * node if tree[2 * node] >= w else 2 * node + 1
        row = node - size
        rows += row == rows
        rows_out[i] = row
        tree[node] -= w
        node //= 2
        while node:
            tree[node] = max(tree[2 * node], tree[2 * node + 1])
            node //= 2
    return rows_out, rows


def first_fit(need: np.ndarray, cap: int) -> tuple[np.ndarray, int]:
    """Row of each item (sizes in ``[1, cap]``) under first fit in the given order (int32 array), and the row count.

    The segment tree (int32, ``2 * _tree_leaves`` entries) is a numpy array handed to the C function, so that
    allocation trackers see it with the rest of the plan's memory."""
    need = np.ascontiguousarray(need, dtype=np.int32)
    fn = _compiled()
    if fn is None:
        return _first_fit_python(need, cap)
    size = _tree_leaves(need, cap)
    tree = np.empty(2 * size, dtype=np.int32)
    out = np.empty(need.size, dtype=np.int32)
    rows = fn(need.ctypes.data, need.size, int(cap), out.ctypes.data, tree.ctypes.data, size)
    if rows < 0:
        raise ValueError(f"first fit ran out of rows: an item is larger than cap={cap} or not positive")
    return out, int(rows)


def chunk_arrays(lengths: Any, seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """(document, start, length) of every chunk, in document order, and the number of documents split."""
    if seq_len < 2:
        raise ValueError(f"seq_len={seq_len} is too short; a row needs at least 2 tokens for one next-token target")
    lengths = np.asarray(lengths, dtype=np.int64)
    per_doc = -(-lengths // seq_len)
    doc = np.repeat(np.arange(lengths.size, dtype=np.int64), per_doc)
    first = np.cumsum(per_doc) - per_doc
    start = (np.arange(doc.size, dtype=np.int64) - np.repeat(first, per_doc)) * seq_len
    length = np.minimum(lengths[doc] - start, seq_len)
    return doc, start, length, int((lengths > seq_len).sum())


class _Rows(Sequence):
    """``plan.rows[i]``: the segments of row ``i``, built on access from the CSR arrays."""

    def __init__(self, plan: ArrayPlan) -> None:
        self._p = plan

    def __len__(self) -> int:
        return self._p.num_rows

    def __getitem__(self, i: int) -> tuple[Segment, ...]:  # type: ignore[override]
        p = self._p
        lo, hi = int(p.row_ptr[i]), int(p.row_ptr[i + 1])
        return tuple(Segment(int(d), int(s), int(s) + int(n)) for d, s, n in
                     zip(p.doc[lo:hi], p.start[lo:hi], p.length[lo:hi], strict=True))  # fmt: skip


class ArrayPlan:
    """An ``ffd`` packing plan in arrays: chunks grouped by row (CSR), in each row in the order first fit placed them.

    Attributes:
        doc, start, length: int32 per chunk (int64 where the documents or their lengths need it), sorted by row.
        row_ptr: int64 [num_rows + 1]: row ``i`` holds chunks ``row_ptr[i]:row_ptr[i+1]``.
        seq_len: the row capacity in tokens.
        num_split_docs: documents longer than ``seq_len``.
    """

    mode = PackingMode.FFD
    group_size = 1

    def __init__(self, doc, start, length, row_ptr, seq_len: int, num_split_docs: int) -> None:
        self.doc, self.start, self.length, self.row_ptr = doc, start, length, row_ptr
        self.seq_len = seq_len
        self.num_split_docs = num_split_docs
        self.rows = _Rows(self)

    @property
    def num_rows(self) -> int:
        return self.row_ptr.size - 1

    @property
    def num_groups(self) -> int:
        return self.num_rows

    @property
    def num_chunks(self) -> int:
        return self.doc.size

    @property
    def real_tokens(self) -> int:
        return int(self.length.sum())

    def row_length(self, index: int) -> int:
        return int(self.length[self.row_ptr[index] : self.row_ptr[index + 1]].sum())

    def padding_fraction(self, batch_size: int | None = None) -> float:
        total = self.num_rows * self.seq_len
        return 1.0 - self.real_tokens / total if total else 0.0

    def stats(self, batch_size: int | None = None) -> dict[str, float]:
        return {"rows": float(self.num_rows), "chunks": float(self.num_chunks),
                "split_documents": float(self.num_split_docs), "real_tokens": float(self.real_tokens),
                "padding_fraction": self.padding_fraction()}  # fmt: skip


def _int_lengths(lengths: Any) -> np.ndarray:
    """The lengths as an integer array without a copy when they already are one (an int32 index stays int32)."""
    arr = np.asarray(lengths)
    if arr.dtype.kind not in "iu":
        arr = arr.astype(np.int64)
    return arr.reshape(-1)


def _full_chunks(lengths: np.ndarray, seq_len: int, doc_out: np.ndarray, start_out: np.ndarray) -> None:
    """The ``seq_len``-long chunks, in (document, offset) order, into ``doc_out`` / ``start_out``, a block of
    documents at a time."""
    at = 0
    for lo in range(0, lengths.size, _BLOCK):
        full = lengths[lo : lo + _BLOCK].astype(np.int64) // seq_len
        docs = np.flatnonzero(full)
        if not docs.size:
            continue
        per = full[docs]
        n = int(per.sum())
        doc_out[at : at + n] = np.repeat(docs + lo, per)
        first = np.cumsum(per) - per
        start_out[at : at + n] = (np.arange(n) - np.repeat(first, per)) * seq_len
        at += n


def pack_ffd(lengths: Any, seq_len: int) -> ArrayPlan:
    """``pack(lengths, seq_len, mode="ffd")`` in arrays: the same rows, without a Python object per chunk.

    ``pack()`` sorts the chunks by length decreasing, then document, then offset, and places them by first fit. A
    document holds ``L // seq_len`` chunks of ``seq_len`` and at most one shorter one (``L % seq_len``), so:

    * the full chunks come first, in (document, offset) order, and each opens a row of its own (a full row takes
      nothing more): rows ``0 .. F-1``;
    * the short ones, one per document, follow in a stable sort of their documents by decreasing remainder (a radix
      sort of a 16-bit key), and first fit places them into rows ``F ..``.

    So the order is computed per document, not per chunk, and every per-chunk array is int32 where the values fit
    (int64 lengths are read a block at a time): over a million documents of mean 700 tokens at ``seq_len=4096`` the
    peak is about 26 bytes per document (tracemalloc, the segment tree and the plan's own 13.5 -- 12 per chunk, 8 per
    row -- included). ``tests/unit/test_data_ffd.py`` measures it.
    """
    if seq_len < 2:
        raise ValueError(f"seq_len={seq_len} is too short; a row needs at least 2 tokens for one next-token target")
    if seq_len >= 2**31:
        raise ValueError(f"seq_len={seq_len} must be < 2**31")
    lengths = _int_lengths(lengths)
    n = lengths.size
    if n and int(lengths.min()) < 0:
        raise ValueError(f"document lengths must be >= 0; got {int(lengths.min())}")
    # Per document, the sort key ``seq_len - remainder``: 1 .. seq_len - 1 for a short chunk, seq_len (last) for none.
    key = np.empty(n, dtype=np.uint16 if seq_len < 2**16 else np.uint32)
    num_full = num_split = 0
    for lo in range(0, n, _BLOCK):
        block = lengths[lo : lo + _BLOCK].astype(np.int64)
        key[lo : lo + _BLOCK] = seq_len - block % seq_len
        num_full += int((block // seq_len).sum())
        num_split += int((block > seq_len).sum())
    num_short = n - int(np.count_nonzero(key == seq_len))
    idx = np.int32 if n < 2**31 else np.int64
    short_doc = np.argsort(key, kind="stable")[:num_short].astype(idx)  # decreasing remainder, ties by document
    need = np.subtract(seq_len, key[short_doc], dtype=np.int32)
    del key
    row, num_rows = first_fit(need, seq_len)
    counts = np.bincount(row, minlength=num_rows)
    by_row = np.argsort(row, kind="stable")  # within a row, the order first fit placed them in
    del row
    num_chunks = num_full + num_short
    doc_out = np.empty(num_chunks, dtype=idx)
    np.take(short_doc, by_row, out=doc_out[num_full:])
    del short_doc
    length_out = np.empty(num_chunks, dtype=np.int32)
    length_out[:num_full] = seq_len
    np.take(need, by_row, out=length_out[num_full:])
    del need, by_row
    start_out = np.empty(num_chunks, dtype=np.int32 if not n or int(lengths.max()) < 2**31 else np.int64)
    _full_chunks(lengths, seq_len, doc_out, start_out)
    for lo in range(num_full, num_chunks, _BLOCK):  # a short chunk starts where its document's full chunks end
        hi = min(lo + _BLOCK, num_chunks)
        start_out[lo:hi] = lengths[doc_out[lo:hi]] - length_out[lo:hi]
    row_ptr = np.empty(num_full + num_rows + 1, dtype=np.int64)
    row_ptr[: num_full + 1] = np.arange(num_full + 1)
    np.cumsum(counts, out=row_ptr[num_full + 1 :])
    row_ptr[num_full + 1 :] += num_full
    return ArrayPlan(doc_out, start_out, length_out, row_ptr, seq_len, num_split)


_PLAN_FORMAT = 1


def plan_key(lengths: Any, seq_len: int) -> str:
    """A hash of what an ``ffd`` plan depends on: the document lengths, ``seq_len`` and this format."""
    h = hashlib.sha256(np.ascontiguousarray(lengths, dtype=np.int64).tobytes())
    h.update(f"ffd:{seq_len}:{_PLAN_FORMAT}".encode())
    return h.hexdigest()[:16]


def pack_ffd_cached(lengths: Any, seq_len: int, prefix: str | os.PathLike) -> ArrayPlan:
    """:func:`pack_ffd`, cached as ``<prefix>.ffd-<key>.npy`` next to the data: the first caller (any rank) builds
    and writes it atomically; later callers memory-map it instead of recomputing. A read-only directory only
    skips the cache."""
    lengths = np.asarray(lengths, dtype=np.int64)
    path = Path(f"{os.fspath(prefix)}.ffd-{plan_key(lengths, seq_len)}.npy")
    if path.is_file():
        try:
            flat = np.load(path, mmap_mode="r")
            n, rows, split = (int(x) for x in flat[:3])
            if flat.size == 3 + 3 * n + rows + 1:
                parts = [flat[3 + k * n : 3 + (k + 1) * n] for k in range(3)]
                return ArrayPlan(*parts, flat[3 + 3 * n :], seq_len, split)
        except (OSError, ValueError):
            pass  # unreadable or foreign: rebuild it below
    plan = pack_ffd(lengths, seq_len)
    flat = np.concatenate([[plan.num_chunks, plan.num_rows, plan.num_split_docs], plan.doc, plan.start,
                           plan.length, plan.row_ptr]).astype(np.int64)  # fmt: skip
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            np.save(f, flat)
        os.replace(tmp, path)
    except OSError:
        pass
    return plan
