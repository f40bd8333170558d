"""Megatron's indexed token files (``.bin`` + ``.idx``), byte for byte: a streaming writer and a memory-mapped reader.

The format is Megatron-LM's ``MMapIndexedDataset`` (``megatron/core/datasets/indexed_dataset.py``), which is what
pretraining corpora are shipped in. ``<prefix>.bin`` holds every token of every sequence back to back in one dtype;
``<prefix>.idx`` is, all little-endian:

===================  ========================================================================================
bytes                field
===================  ========================================================================================
9                    the magic ``MMIDIDX\\x00\\x00``
8 (uint64)           the version, 1
1 (uint8)            the token dtype code (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32,
                     8 uint16)
8 (uint64)           ``S``, the sequence count
8 (uint64)           ``D``, the document-index count (documents + 1)
4 S (int32)          the token count of each sequence
8 S (int64)          the byte offset of each sequence in the ``.bin``
8 D (int64)          the document boundaries: sequence indices, starting at 0, one past each document's last
S (int8), optional   a per-sequence mode (Megatron's multimodal variant; read past, never written here)
===================  ========================================================================================

Tokens are ``uint16`` when the vocabulary has fewer than 65,500 ids, else ``int32`` (Megatron's ``optimal_dtype``).
The writer writes one sequence per document. Reading a sequence is a slice of the memory map: nothing is copied and
nothing is read that is not used; the lengths and offsets are views of the ``.idx`` map.
"""

from __future__ import annotations

import os
import struct
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Self

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
_HEADER_BYTES = len(MAGIC) + 8 + 1 + 8 + 8  # 34
#: Megatron's ``DType`` codes.
DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
_CODE_OF = {dt: code for code, dt in DTYPE_CODES.items()}


class TokenFileError(ValueError):
    """A ``.bin``/``.idx`` pair that is missing, truncated, or of another version or dtype than expected."""


def token_dtype(vocab_size: int) -> np.dtype:
    """``uint16`` when ``vocab_size < 65500``, else ``int32`` (Megatron's ``DType.optimal_dtype``)."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size={vocab_size} must be >= 1")
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


def idx_path(prefix: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(prefix)}.idx")


def bin_path(prefix: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(prefix)}.bin")


def _prefix_of(path: str | os.PathLike) -> str:
    """Accept ``foo``, ``foo.bin`` or ``foo.idx`` for the prefix ``foo``."""
    s = os.fspath(path)
    return s[:-4] if s.endswith((".bin", ".idx")) else s


class IndexedWriter:
    """Streams documents into ``<prefix>.bin`` and writes ``<prefix>.idx`` at :meth:`finalize`, atomically.

    Both files are written under temporary names in the target directory and renamed only at the end (``.bin``
    first, then ``.idx``, which readers open first): a process killed before that leaves no ``.bin``/``.idx`` that
    looks complete, only ``*.tmp`` files. Use it as a context manager; an exception removes the temporary files.

    Args:
        prefix: output path without the ``.bin``/``.idx`` suffix.
        dtype: token dtype (see :func:`token_dtype`); any of Megatron's dtype codes.
    """

    def __init__(self, prefix: str | os.PathLike, dtype: Any = np.uint16) -> None:
        self.prefix = _prefix_of(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODE_OF:
            raise TokenFileError(f"dtype={self.dtype} has no Megatron dtype code; use one of "
                                 f"{sorted(str(d) for d in _CODE_OF)}")  # fmt: skip
        self._info = np.iinfo(self.dtype) if self.dtype.kind in "iu" else None
        directory = Path(self.prefix).parent
        directory.mkdir(parents=True, exist_ok=True)
        stem = Path(self.prefix).name
        fd, self._bin_tmp = tempfile.mkstemp(dir=directory, prefix=f".{stem}.bin.", suffix=".tmp")
        self._bin = os.fdopen(fd, "wb", buffering=1 << 20)
        self._lengths: list[int] = []
        self.tokens = 0
        self._done = False

    def add_document(self, tokens: Any) -> None:
        """Append one document (a 1-D sequence of token ids) as one sequence."""
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise ValueError(f"a document is a 1-D sequence of token ids, got shape {arr.shape}")
        if arr.size and self._info is not None and (arr.min() < self._info.min or arr.max() > self._info.max):
            raise TokenFileError(f"token ids in [{arr.min()}, {arr.max()}] do not fit dtype={self.dtype}; write with "
                                 f"dtype=token_dtype(vocab_size)")  # fmt: skip
        self._bin.write(np.ascontiguousarray(arr, dtype=self.dtype).tobytes())
        self._lengths.append(int(arr.size))
        self.tokens += int(arr.size)

    def add_documents(self, docs: Iterable[Any]) -> None:
        for doc in docs:
            self.add_document(doc)

    @property
    def num_documents(self) -> int:
        return len(self._lengths)

    def finalize(self) -> Path:
        """Write the ``.idx`` and move both files into place; returns the ``.idx`` path."""
        self._bin.close()
        lengths = np.asarray(self._lengths, dtype=np.int64)
        if lengths.size and lengths.max() > np.iinfo(np.int32).max:
            raise TokenFileError("a document has more than 2**31-1 tokens, which the int32 lengths cannot hold")
        pointers = np.zeros(lengths.size, dtype=np.int64)
        np.cumsum(lengths[:-1] * self.dtype.itemsize, out=pointers[1:])
        doc_index = np.arange(lengths.size + 1, dtype=np.int64)  # one sequence per document
        fd, idx_tmp = tempfile.mkstemp(dir=Path(self.prefix).parent, prefix=f".{Path(self.prefix).name}.idx.",
                                       suffix=".tmp")  # fmt: skip
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(MAGIC)
                f.write(struct.pack("<Q", VERSION))
                f.write(struct.pack("<B", _CODE_OF[self.dtype]))
                f.write(struct.pack("<Q", lengths.size))
                f.write(struct.pack("<Q", doc_index.size))
                f.write(lengths.astype(np.int32).tobytes())
                f.write(pointers.tobytes())
                f.write(doc_index.tobytes())
            os.replace(self._bin_tmp, bin_path(self.prefix))
            os.replace(idx_tmp, idx_path(self.prefix))
        except BaseException:
            _unlink(idx_tmp)
            raise
        self._done = True
        return idx_path(self.prefix)

    def abort(self) -> None:
        """Close and delete the temporary files (nothing is moved into place)."""
        if not self._bin.closed:
            self._bin.close()
        _unlink(self._bin_tmp)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None and not self._done:
            self.finalize()
        elif exc_type is not None:
            self.abort()


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def write_indexed(prefix: str | os.PathLike, documents: Iterable[Any], *, dtype: Any = np.uint16) -> Path:
    """Write ``documents`` (1-D token-id sequences) to ``<prefix>.bin/.idx``; returns the ``.idx`` path."""
    with IndexedWriter(prefix, dtype) as writer:
        writer.add_documents(documents)
    return idx_path(writer.prefix)


class IndexedReader:
    """A memory-mapped ``.bin/.idx`` pair: sequence ``i`` is a zero-copy slice of the ``.bin`` map.

    The header is checked on open, and the file sizes against the counts, so a truncated or foreign file is
    refused before any token is read.

    Args:
        prefix: path without suffix (``foo`` for ``foo.bin`` + ``foo.idx``; a ``.bin``/``.idx`` path also works).
        expect_dtype: refuse files whose token dtype differs (None: accept any Megatron dtype).
    """

    def __init__(self, prefix: str | os.PathLike, *, expect_dtype: Any = None) -> None:
        self.prefix = _prefix_of(prefix)
        ipath, bpath = idx_path(self.prefix), bin_path(self.prefix)
        if not ipath.is_file():
            hint = " (the .bin is there: its preprocessing was interrupted or the .idx was not copied)" \
                if bpath.is_file() else ""  # fmt: skip
            raise TokenFileError(f"no index file {ipath}{hint}; write the pair with `v17 preprocess` or IndexedWriter")
        if not bpath.is_file():
            raise TokenFileError(f"no token file {bpath} next to {ipath}; copy both files of the pair")
        idx_size = ipath.stat().st_size
        with open(ipath, "rb") as f:
            head = f.read(_HEADER_BYTES)
        if len(head) < _HEADER_BYTES or head[: len(MAGIC)] != MAGIC:
            raise TokenFileError(f"{ipath} is not a Megatron index file (no {MAGIC!r} header)")
        (version,) = struct.unpack_from("<Q", head, len(MAGIC))
        if version != VERSION:
            raise TokenFileError(f"{ipath} is version {version} of the index format; only version {VERSION} is read")
        (code,) = struct.unpack_from("<B", head, len(MAGIC) + 8)
        if code not in DTYPE_CODES:
            raise TokenFileError(f"{ipath} has the unknown dtype code {code}; known: {sorted(DTYPE_CODES)}")
        self.dtype = DTYPE_CODES[code]
        if expect_dtype is not None and np.dtype(expect_dtype) != self.dtype:
            raise TokenFileError(f"{ipath} holds {self.dtype} tokens but {np.dtype(expect_dtype)} was expected; "
                                 f"re-run `v17 preprocess` with the tokenizer of this run")  # fmt: skip
        self.num_sequences, self.num_doc_index = struct.unpack_from("<QQ", head, len(MAGIC) + 9)
        s, d = self.num_sequences, self.num_doc_index
        need = _HEADER_BYTES + 12 * s + 8 * d
        if idx_size not in (need, need + s):  # + s: Megatron's multimodal per-sequence modes
            raise TokenFileError(f"{ipath} is {idx_size} bytes but its header announces {s} sequences and {d} document"
                                 f" indices ({need} bytes): truncated or corrupt; re-run `v17 preprocess`")
        self._idx_map = np.memmap(ipath, dtype=np.uint8, mode="r")
        buf = self._idx_map
        self.sequence_lengths = np.frombuffer(buf, np.int32, s, _HEADER_BYTES)
        self.sequence_pointers = np.frombuffer(buf, np.int64, s, _HEADER_BYTES + 4 * s)
        self.document_indices = np.frombuffer(buf, np.int64, d, _HEADER_BYTES + 12 * s)
        expected = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype.itemsize if s else 0
        actual = bpath.stat().st_size
        if actual != expected:
            what = "truncated" if actual < expected else "longer than its index says"
            raise TokenFileError(f"{bpath} is {actual} bytes but {ipath} indexes {expected}: the .bin is {what}; "
                                 f"re-run `v17 preprocess` (or copy the pair again)")  # fmt: skip
        # An empty .bin cannot be memory-mapped; nothing is ever read from it then.
        self._bin_map = np.memmap(bpath, dtype=self.dtype, mode="r") if actual else np.empty(0, self.dtype)

    def __len__(self) -> int:
        return self.num_sequences

    @property
    def num_documents(self) -> int:
        return max(self.num_doc_index - 1, 0)

    @property
    def num_tokens(self) -> int:
        return self._bin_map.size

    def token_offsets(self) -> np.ndarray:
        """The token offset of each sequence in the ``.bin`` (int64; a view-derived array, no file read)."""
        return self.sequence_pointers // self.dtype.itemsize

    def get(self, index: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``index``: a read-only view of the memory map."""
        if not -self.num_sequences <= index < self.num_sequences:
            raise IndexError(f"sequence {index} out of range for {self.num_sequences} sequences")
        index %= self.num_sequences
        n = int(self.sequence_lengths[index])
        start = int(self.sequence_pointers[index]) // self.dtype.itemsize
        end = start + n if length is None else start + min(offset + length, n)
        return self._bin_map[start + min(offset, n) : end]

    def span(self, start: int, end: int) -> np.ndarray:
        """Tokens ``[start, end)`` of the whole ``.bin`` stream (a view)."""
        return self._bin_map[start:end]

    def __getitem__(self, index: int) -> np.ndarray:
        return self.get(index)

    def __getstate__(self) -> dict[str, Any]:  # pickled (DataLoader workers, spawn): re-open, never copy the maps
        return {"prefix": self.prefix, "dtype": self.dtype.str}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["prefix"], expect_dtype=state["dtype"])


class TokenFileDataset:
    """Map-style dataset over a ``.bin/.idx`` pair: item ``i`` is sequence ``i``'s tokens (a memory-map view).

    ``lengths()`` comes straight from the ``.idx``: no document is read to learn it, so
    :class:`~lightning_v17.data.PackedDataModule` plans over millions of documents without tokenizing any.

    Args:
        prefix: path without suffix (``foo`` for ``foo.bin`` + ``foo.idx``).
        expect_dtype: refuse files whose token dtype differs (None: any).
    """

    def __init__(self, prefix: str | os.PathLike, *, expect_dtype: Any = None) -> None:
        self.prefix = _prefix_of(prefix)
        self.expect_dtype = expect_dtype
        self.reader = IndexedReader(self.prefix, expect_dtype=expect_dtype)

    def __len__(self) -> int:
        return len(self.reader)

    def __getitem__(self, index: int) -> np.ndarray:
        return self.reader.get(index)

    def lengths(self) -> np.ndarray:
        return self.reader.sequence_lengths

    def __getstate__(self) -> dict[str, Any]:  # DataLoader workers re-open the maps instead of pickling them
        return {"prefix": self.prefix, "expect_dtype": self.expect_dtype}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["prefix"], expect_dtype=state["expect_dtype"])
