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
#include <stdlib.h>
/* First fit of items (in the given order) into rows of `cap`: row_out[i] = row of item i; returns the row count. */
int64_t v17_first_fit(const int64_t *need, int64_t n, int64_t cap, int64_t *row_out) {
    int64_t size = 1, rows = 0;
    while (size < (n > 0 ? n : 1)) size <<= 1;
    int64_t *tree = (int64_t *)malloc(sizeof(int64_t) * 2 * size);
    if (!tree) return -1;
    for (int64_t i = 0; i < 2 * size; i++) tree[i] = cap;
    for (int64_t i = 0; i < n; i++) {
        int64_t node = 1, w = need[i];
        while (node < size) node = tree[2 * node] >= w ? 2 * node : 2 * node + 1;
        int64_t row = node - size;
        if (row == rows) rows++;
        row_out[i] = row;
        tree[node] -= w;
        for (node >>= 1; node; node >>= 1) {
            int64_t a = tree[2 * node], b = tree[2 * node + 1];
            tree[node] = a > b ? a : b;
        }
    }
    free(tree);
    return rows;
}
"""


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
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    return fn


def _first_fit_python(need: np.ndarray, cap: int) -> tuple[np.ndarray, int]:
    size = 1
    while size < max(len(need), 1):
        size *= 2
    tree = [cap] * (2 * size)
    rows_out = np.empty(len(need), dtype=np.int64)
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
    """Row of each item under first fit in the given order (int64 array), and the row count."""
    need = np.ascontiguousarray(need, dtype=np.int64)
    fn = _compiled()
    if fn is None:
        return _first_fit_python(need, cap)
    out = np.empty(need.size, dtype=np.int64)
    rows = fn(need.ctypes.data, need.size, int(cap), out.ctypes.data)
    if rows < 0:
        raise MemoryError("first fit could not allocate its segment tree")
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
        return tuple(Segment(int(d), int(s), int(s + n)) for d, s, n in
                     zip(p.doc[lo:hi], p.start[lo:hi], p.length[lo:hi], strict=True))  # fmt: skip


class ArrayPlan:
    """An ``ffd`` packing plan in arrays: chunks grouped by row (CSR), in each row in the order first fit placed them.

    Attributes:
        doc, start, length: int64 per chunk, sorted by row.
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


def pack_ffd(lengths: Any, seq_len: int) -> ArrayPlan:
    """``pack(lengths, seq_len, mode="ffd")`` in arrays: the same rows, without a Python object per chunk."""
    doc, start, length, split = chunk_arrays(lengths, seq_len)
    order = np.lexsort((start, doc, -length))  # length decreasing, ties by (document, offset): pack()'s order
    doc, start, length = doc[order], start[order], length[order]
    row, num_rows = first_fit(length, seq_len)
    by_row = np.argsort(row, kind="stable")  # within a row, the order first fit placed them in
    counts = np.bincount(row, minlength=num_rows)
    row_ptr = np.zeros(num_rows + 1, dtype=np.int64)
    np.cumsum(counts, out=row_ptr[1:])
    return ArrayPlan(doc[by_row], start[by_row], length[by_row], row_ptr, seq_len, split)


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
