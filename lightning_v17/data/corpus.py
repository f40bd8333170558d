"""The embedded default data set: the Python standard library's own ``.py`` sources.

Nothing is downloaded: every machine with Python has these files. Each top-level ``def``/``class`` (with its
decorators) is one document, and each module's remaining top-level code is one more, parsed with :mod:`ast`. Test
packages (``test``, ``tests``, ``idle_test``) and ``site-packages`` are skipped. On CPython 3.11 this gives about
6,600 documents, 12 MB, median about 440 bytes and a long tail (a few documents of hundreds of KB) -- the wide spread
of lengths that packing exists for.

The train/validation split is deterministic: a document is in validation when the SHA-1 of
``"<relative path>::<definition name>"`` falls below ``val_fraction``. Parsing takes several seconds, so the built
corpus is cached as one JSON file under ``$LIGHTNING_V17_CACHE`` (default ``~/.cache/lightning_v17``) keyed by the
Python version and the corpus format; ``rebuild=True`` (or deleting the file) rebuilds it.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import statistics
import sys
import sysconfig
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import Dataset

from lightning_v17.data.tokenizer import ByteTokenizer

_FORMAT_VERSION = 1
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"})
MODULE_DOC = "<module>"


@dataclass(frozen=True)
class Document:
    """One document: the source text of a top-level definition (or of a module's remaining top-level code)."""

    path: str  # relative to the stdlib root, "/"-separated
    name: str  # definition name, or MODULE_DOC
    text: str
    split: str  # "train" | "val"


def stdlib_root() -> Path:
    """The directory of the pure-Python standard library (``sysconfig``'s ``stdlib`` path)."""
    return Path(sysconfig.get_paths()["stdlib"])


def split_of(path: str, name: str, val_fraction: float) -> str:
    """Deterministic split by the hash of (relative path, definition name); independent of Python's hash seed."""
    digest = hashlib.sha1(f"{path}::{name}".encode()).digest()
    return "val" if int.from_bytes(digest[:8], "big") / 2**64 < val_fraction else "train"


def _documents_of_source(source: str) -> list[tuple[str, str]]:
    """(name, text) per top-level def/class, plus (MODULE_DOC, rest) for the remaining top-level code."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    used = [False] * len(lines)
    out: list[tuple[str, str]] = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
            end = node.end_lineno or node.lineno
            out.append((node.name, "".join(lines[start:end])))
            for i in range(start, end):
                used[i] = True
    rest = "".join(line for line, u in zip(lines, used, strict=True) if not u)
    if rest.strip():
        out.append((MODULE_DOC, rest))
    return out


def parse_stdlib(root: Path | None = None, *, val_fraction: float = 0.05) -> list[Document]:
    """Walk ``root`` (default: the stdlib) in sorted order and split every parseable ``.py`` file into documents."""
    root = Path(root) if root is not None else stdlib_root()
    docs: list[Document] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for filename in sorted(filenames):
            if not filename.endswith(".py"):
                continue
            path = Path(dirpath) / filename
            rel = path.relative_to(root).as_posix()
            try:
                source = path.read_text(encoding="utf-8")
                parts = _documents_of_source(source)
            except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
                continue  # e.g. lib2to3 test data written in Python 2: not Python 3 source, skip it
            for name, text in parts:
                docs.append(Document(rel, name, text, split_of(rel, name, val_fraction)))
    return docs


def default_cache_dir() -> Path:
    return Path(os.environ.get("LIGHTNING_V17_CACHE", Path.home() / ".cache" / "lightning_v17"))


def _cache_file(cache_dir: Path, val_fraction: float) -> Path:
    version = "py{}.{}.{}".format(*sys.version_info[:3])
    return cache_dir / f"stdlib-corpus-{version}-v{_FORMAT_VERSION}-val{val_fraction:g}.json"


def load_stdlib_documents(
    *, val_fraction: float = 0.05, cache_dir: str | Path | None = None, rebuild: bool = False
) -> list[Document]:
    """The stdlib documents, from the on-disk cache when present (else parsed and cached atomically)."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cache = _cache_file(cache_dir, val_fraction)
    if not rebuild and cache.is_file():
        try:
            rows = json.loads(cache.read_text(encoding="utf-8"))
            return [Document(*row) for row in rows["docs"]]
        except (ValueError, KeyError, TypeError):
            pass  # a corrupt or foreign cache file: rebuild it below
    docs = parse_stdlib(val_fraction=val_fraction)
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        payload = {"root": str(stdlib_root()), "docs": [[d.path, d.name, d.text, d.split] for d in docs]}
        # Write-then-rename so two ranks building at once never leave a half-written file for a third reader.
        fd, tmp = tempfile.mkstemp(dir=cache_dir, suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(payload, f)
        os.replace(tmp, cache)
    except OSError:
        pass  # a read-only home still works, just without the cache
    return docs


class StdlibCorpus(Dataset):
    """Map-style dataset of token-id documents (``LongTensor``: BOS + UTF-8 bytes + EOS) from the stdlib.

    Args:
        split: ``"train"`` or ``"val"``.
        val_fraction: fraction of documents (by hash of path and name) held out for validation.
        cache_dir: where the parsed corpus is cached; default ``$LIGHTNING_V17_CACHE`` or ``~/.cache/lightning_v17``.
        rebuild: re-parse the stdlib even if a cache file exists.
        vocab_size: the tokenizer's padded vocabulary (the tiny preset's 320).
    """

    def __init__(
        self,
        split: str = "train",
        *,
        val_fraction: float = 0.05,
        cache_dir: str | Path | None = None,
        rebuild: bool = False,
        vocab_size: int = 320,
    ) -> None:
        if split not in ("train", "val"):
            raise ValueError(f"split={split!r} is not a corpus split; use 'train' or 'val'")
        self.split = split
        self.tokenizer = ByteTokenizer(vocab_size)
        docs = load_stdlib_documents(val_fraction=val_fraction, cache_dir=cache_dir, rebuild=rebuild)
        self.documents = [d for d in docs if d.split == split]
        self._bytes = [d.text.encode("utf-8") for d in self.documents]

    def __len__(self) -> int:
        return len(self._bytes)

    def __getitem__(self, index: int) -> torch.Tensor:
        data = self._bytes[index]
        out = torch.empty(len(data) + 2, dtype=torch.long)
        out[0] = self.tokenizer.bos_id
        out[-1] = self.tokenizer.eos_id
        if data:
            out[1:-1] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return out

    def lengths(self) -> list[int]:
        """Token count of every document (without tokenizing): bytes + BOS + EOS."""
        return [len(b) + 2 for b in self._bytes]

    def stats(self, seq_len: int = 2048) -> dict[str, float]:
        """Document count and length statistics; see :func:`length_stats`."""
        out = length_stats(self.lengths(), seq_len=seq_len)
        out["bytes"] = float(sum(len(b) for b in self._bytes))
        return out


def length_stats(lengths: Sequence[int], *, seq_len: int) -> dict[str, float]:
    """Count, mean/median/max tokens, and the mean/max ratio at ``seq_len``.

    Documents longer than ``seq_len`` are counted as they are trained on: split into ``seq_len`` chunks. The ratio
    ``mean_over_max`` = mean chunk length / ``seq_len`` is the efficiency of padding every row to ``seq_len``.
    """
    chunks: list[int] = []
    for n in lengths:
        full, rest = divmod(n, seq_len)
        chunks.extend([seq_len] * full + ([rest] if rest else []))
    mean_chunk = sum(chunks) / max(len(chunks), 1)
    return {
        "documents": float(len(lengths)),
        "tokens": float(sum(lengths)),
        "mean_tokens": sum(lengths) / max(len(lengths), 1),
        "median_tokens": float(statistics.median(lengths)) if lengths else 0.0,
        "max_tokens": float(max(lengths, default=0)),
        "seq_len": float(seq_len),
        "chunks": float(len(chunks)),
        "split_documents": float(sum(1 for n in lengths if n > seq_len)),
        "mean_over_max": mean_chunk / seq_len,
    }
