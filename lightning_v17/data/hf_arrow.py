"""Hugging Face ``datasets`` input: an Arrow ``input_ids`` column read in place, as a corpus of a blend or a dataset.

A ``datasets.Dataset`` is an Arrow table, memory-mapped from its ``.arrow`` files when it comes from disk. Its
``input_ids`` column is a ``ChunkedArray`` of ``ListArray`` chunks: per chunk an offsets buffer (row ``i`` is values
``[offsets[i], offsets[i+1])``) and one values buffer of all its tokens. :class:`ArrowTokens` reads exactly that: the
lengths are the differences of the offsets, a document is a zero-copy numpy view of its chunk's values, and the
documents concatenated in row order are the token stream a :class:`~lightning_v17.data.blend.BlendedTokens` corpus
cuts every ``seq_len`` tokens -- the same stream a token file of the same documents holds, so the same rows. No row
is ever converted to Python objects. ``datasets`` itself is needed only to open a ``save_to_disk`` directory.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

_FIX_TOKENIZE = ("tokenize into an integer `input_ids` column first, e.g. "
                 "dataset.map(lambda b: tokenizer(b['text']), batched=True)")


def _saved_dataset(path: Any) -> Path | None:
    """The directory, when ``path`` is a ``save_to_disk`` directory (a ``Dataset`` or a ``DatasetDict``)."""
    if not isinstance(path, str | os.PathLike):
        return None
    p = Path(path)
    return p if p.is_dir() and ((p / "state.json").is_file() or (p / "dataset_dict.json").is_file()) else None


def is_arrow_input(data: Any) -> bool:
    """True for what :class:`ArrowTokens` reads: a ``datasets.Dataset``, a ``save_to_disk`` directory, a
    ``pyarrow.Table`` or ``ChunkedArray``."""
    if _saved_dataset(data) is not None:
        return True
    kind = type(data)
    return (kind.__module__.startswith("datasets") and hasattr(data, "data") and hasattr(data, "column_names")) or \
        kind.__module__.startswith("pyarrow") and kind.__name__ in ("Table", "ChunkedArray")  # fmt: skip


class ArrowTokens:
    """Token-id documents from an Arrow list column, read in place: a corpus for ``data.paths`` and a dataset.

    As a dataset (``PackedDataModule(dataset=...)``, ``packing="ffd"``), item ``i`` is row ``i``'s tokens (a
    read-only numpy view) and :meth:`lengths` comes from the offsets. As a corpus of a blend it implements the
    interface of :class:`~lightning_v17.data.sources.TokenFileSource`, so it blends with token files and resumes the
    same way; its identity is its directory (or, for an in-memory table, a hash of its offsets), its documents and
    its tokens.

    Args:
        data: a ``datasets.Dataset`` (memory-mapped when loaded from disk), a ``save_to_disk`` directory of one,
            a ``pyarrow.Table`` or a ``pyarrow.ChunkedArray`` of integer lists.
        column: the column of token ids.
    """

    def __init__(self, data: Any, *, column: str = "input_ids") -> None:
        self.column = column
        self._data = data
        self.path, table = self._open(data)
        self._index(table)

    # ---- opening ---------------------------------------------------------------------------------------------------
    def _open(self, data: Any) -> tuple[str | None, Any]:
        saved = _saved_dataset(data)
        if saved is not None:
            if (saved / "dataset_dict.json").is_file():
                splits = json.loads((saved / "dataset_dict.json").read_text()).get("splits", [])
                raise ValueError(f"{saved} is a DatasetDict (splits {splits}); give one split's directory, e.g. "
                                 f"{saved / (splits[0] if splits else 'train')}")  # fmt: skip
            try:
                import datasets
            except ImportError as err:
                raise ImportError(f"reading the saved dataset {saved} needs the `datasets` package: pip install "
                                  f"datasets (or lightning-v17[hf])") from err  # fmt: skip
            return os.fspath(data), self._table_of(datasets.load_from_disk(os.fspath(saved)), str(saved))
        if type(data).__module__.startswith("pyarrow"):
            return None, data
        if isinstance(data, dict):  # a DatasetDict
            raise TypeError(f"the dataset is a DatasetDict (splits {list(data)}); give one split, e.g. "
                            f"ds[{next(iter(data), 'train')!r}]")  # fmt: skip
        files = [f["filename"] for f in getattr(data, "cache_files", []) or []]
        path = os.path.dirname(files[0]) if len(files) >= 1 else None
        return path, self._table_of(data, f"the dataset{f' at {path}' if path else ''}")

    def _table_of(self, ds: Any, what: str) -> Any:
        if not hasattr(ds, "data"):  # e.g. a DatasetDict object
            raise ValueError(f"{what} is a {type(ds).__name__}, not one Dataset; give one split, e.g. ds['train']")
        if getattr(ds, "_indices", None) is not None:
            raise ValueError(f"{what} has an indices mapping (from select/shuffle/filter/sort), so its rows are not "
                             f"the Arrow table's; call dataset = dataset.flatten_indices() first")  # fmt: skip
        return ds.data

    def _index(self, table: Any) -> None:
        import pyarrow as pa

        if isinstance(table, pa.ChunkedArray):
            col = table
        else:
            names = list(table.column_names)
            if self.column not in names:
                raise ValueError(f"the dataset has no {self.column!r} column (columns: {names}); {_FIX_TOKENIZE}, or "
                                 f"name the column of token ids with ArrowTokens(..., column=...)")  # fmt: skip
            col = table.column(self.column)
        kind = col.type
        if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)) or not pa.types.is_integer(kind.value_type):
            raise ValueError(f"column {self.column!r} holds {kind}, not lists of integer token ids; {_FIX_TOKENIZE}")
        offsets, values = [], []
        for chunk in col.chunks:
            if len(chunk) == 0:
                continue
            if chunk.values.null_count:
                raise ValueError(f"column {self.column!r} has null token ids; drop or fill them before training")
            offsets.append(chunk.offsets.to_numpy())  # zero-copy views of the (memory-mapped) buffers
            values.append(chunk.values.to_numpy(zero_copy_only=True))
        self._offsets, self._values = offsets, values
        rows = np.array([0, *(o.size - 1 for o in offsets)], dtype=np.int64)
        tokens = np.array([0, *(int(o[-1] - o[0]) for o in offsets)], dtype=np.int64)
        self._doc_base, self._tok_base = np.cumsum(rows), np.cumsum(tokens)  # per chunk (+ the end): few entries
        if self.path is None:  # an in-memory table: named by its contents, so a resume recognizes it
            digest = hashlib.sha256()
            for o in offsets:
                digest.update(np.ascontiguousarray(o - o[0]).tobytes())
            self.path = f"arrow:{self.column}:{digest.hexdigest()[:16]}"

    # ---- sizes -----------------------------------------------------------------------------------------------------
    @property
    def num_documents(self) -> int:
        return int(self._doc_base[-1])

    @property
    def num_tokens(self) -> int:
        return int(self._tok_base[-1])

    @property
    def identity(self) -> dict[str, Any]:
        return {"path": self.path, "sequences": self.num_documents, "tokens": self.num_tokens}

    def lengths(self) -> np.ndarray:
        """Each row's token count, from the offsets (int64; no row is read)."""
        if not self._offsets:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([np.diff(o).astype(np.int64, copy=False) for o in self._offsets])

    # ---- as a dataset ----------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.num_documents

    def __getitem__(self, index: int) -> np.ndarray:
        n = self.num_documents
        if not -n <= index < n:
            raise IndexError(f"row {index} out of range for {n} rows")
        index %= n
        k = int(self._doc_base.searchsorted(index, side="right")) - 1
        o, i = self._offsets[k], index - int(self._doc_base[k])
        return self._values[k][o[i] : o[i + 1]]

    # ---- as a corpus (the interface of sources.TokenFileSource) -------------------------------------------------------
    def _chunks_of(self, at: np.ndarray, base: np.ndarray) -> np.ndarray:
        return base[:-1].searchsorted(at, side="right") - 1

    def count_le(self, q: np.ndarray) -> np.ndarray:
        """How many documents start at or before each token offset ``q`` of the stream."""
        q = np.asarray(q, dtype=np.int64)
        out = np.zeros(q.shape, dtype=np.int64)
        k = self._chunks_of(q, self._tok_base)  # the last chunk starting at or before q (-1: none)
        for c in np.unique(k[k >= 0]).tolist():
            sel = k == c
            o = self._offsets[c]
            local = o[:-1].searchsorted(q[sel] - self._tok_base[c] + o[0], side="right")
            out[sel] = self._doc_base[c] + local
        return out

    def _map_documents(self, docs: np.ndarray, of: Callable[[int, np.ndarray, np.ndarray], Any]) -> np.ndarray:
        """``of(c, offsets, rows)`` for the documents ``docs`` of the stream, one call per chunk ``c`` they fall in:
        ``rows`` are those documents' rows within the chunk, ``offsets`` the chunk's; int64, shaped like ``docs``."""
        docs = np.asarray(docs, dtype=np.int64)
        out = np.empty(docs.shape, dtype=np.int64)
        k = self._chunks_of(docs, self._doc_base)
        for c in np.unique(k).tolist():
            sel = k == c
            out[sel] = of(c, self._offsets[c], docs[sel] - self._doc_base[c])
        return out

    def doc_starts(self, docs: np.ndarray) -> np.ndarray:
        """The token offset of each document of ``docs`` in the stream."""
        return self._map_documents(docs, lambda c, o, i: self._tok_base[c] + o[i] - o[0])

    def doc_lengths(self, docs: np.ndarray) -> np.ndarray:
        return self._map_documents(docs, lambda c, o, i: o[i + 1] - o[i])

    def _pieces(self, start: int, end: int) -> list[np.ndarray]:
        """Views of the chunks' values covering stream tokens ``[start, end)``, in order."""
        pieces = []
        c = int(self._chunks_of(np.array([start]), self._tok_base)[0])
        while start < end:
            o, base = self._offsets[c], int(self._tok_base[c])
            stop = min(end, int(self._tok_base[c + 1]))
            if stop > start:
                pieces.append(self._values[c][o[0] + start - base : o[0] + stop - base])
            start, c = stop, c + 1
        return pieces

    def span(self, start: int, end: int) -> np.ndarray:
        """Tokens ``[start, end)`` of the stream: a view within one chunk, a copy across chunks."""
        pieces = self._pieces(start, end)
        if len(pieces) == 1:
            return pieces[0]
        return np.concatenate(pieces) if pieces else self._values[0][:0]

    def copy_rows(self, flat: np.ndarray, at: Sequence[int], lo: Sequence[int], hi: Sequence[int]) -> None:
        """``flat[at[k] : at[k] + hi[k] - lo[k]] = tokens [lo[k], hi[k])`` for every k, chunk by chunk."""
        for t, a, b in zip(at, lo, hi, strict=True):
            for piece in self._pieces(a, b):
                flat[t : t + piece.size] = piece
                t += piece.size

    # ---- DataLoader workers ----------------------------------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        # A directory is re-opened (memory-mapped again); a Dataset or table pickles as itself (datasets pickles a
        # memory-mapped table as its file paths). The numpy views are rebuilt, never pickled.
        return {"data": self._data, "column": self.column}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["data"], column=state["column"])
