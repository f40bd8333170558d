"""``v17 preprocess``: text corpora -> Megatron ``.bin/.idx`` token files (:mod:`lightning_v17.data.indexed`).

Inputs are jsonl files (one JSON object per line, the text under ``--json-key``), plain text files (one document
per file), or directories of them (walked in sorted order; ``.jsonl``/``.json`` files are read as jsonl, every other
file as one text document; hidden files are skipped), or ``stdlib:train`` / ``stdlib:val``: a split of the
embedded corpus (:mod:`lightning_v17.data.corpus`, the main job's data), one document per top-level definition.
Documents are tokenized on ``--workers`` processes in batches,
in input order, with the tokenizer's EOS appended to each; the output's dtype follows the vocabulary (``uint16``
below 65,500 ids, else ``int32``).

The output is written under temporary names and renamed only when complete (:class:`IndexedWriter`), so an
interrupted run -- Ctrl-C or SIGKILL -- never leaves a ``.bin``/``.idx`` pair that looks complete.

Example::

    v17 preprocess data/*.jsonl --output runs/tokens/corpus --tokenizer byte --workers 2
    v17 preprocess docs/ --output runs/tokens/docs --tokenizer /path/to/hf_tokenizer_dir
    v17 preprocess stdlib:train --output runs/tokens/stdlib-train --bos    # the embedded corpus, as make run does
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lightning_v17.data.indexed import IndexedWriter, token_dtype
from lightning_v17.data.tokenizer import ByteTokenizer

JSONL_SUFFIXES = (".jsonl", ".json")
STDLIB_SPLITS = ("stdlib:train", "stdlib:val")  # the embedded corpus's splits, as inputs


@dataclass(frozen=True)
class PreprocessSummary:
    """What a run wrote: documents, tokens, input bytes, wall seconds and the output prefix."""

    documents: int
    tokens: int
    input_bytes: int
    seconds: float
    prefix: str
    dtype: str

    @property
    def mb_per_s(self) -> float:
        return self.input_bytes / 1e6 / max(self.seconds, 1e-9)

    def line(self) -> str:
        return (f"preprocess: {self.documents} documents, {self.tokens} tokens ({self.dtype}), "
                f"{self.input_bytes / 1e6:.1f} MB in {self.seconds:.1f} s ({self.mb_per_s:.1f} MB/s) -> "
                f"{self.prefix}.bin/.idx")  # fmt: skip


# ---- inputs --------------------------------------------------------------------------------------------------------
def input_files(inputs: Sequence[str | os.PathLike]) -> list[Path | str]:
    """Files named by ``inputs`` (files as given; directories walked in sorted order, hidden entries skipped); a
    ``stdlib:<split>`` input stays as it is."""
    files: list[Path | str] = []
    for item in inputs:
        if str(item) in STDLIB_SPLITS:
            files.append(str(item))
            continue
        path = Path(item)
        if path.is_dir():
            for dirpath, dirnames, filenames in os.walk(path):
                dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
                files += [Path(dirpath) / f for f in sorted(filenames) if not f.startswith(".")]
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"preprocess input {path} does not exist; pass jsonl/text files or directories")
    if not files:
        raise ValueError(f"preprocess inputs {list(map(str, inputs))} hold no files")
    return files


def iter_texts(files: Sequence[Path | str], *, json_key: str = "text") -> Iterator[str]:
    """Every document of ``files`` in order: a jsonl line's ``json_key`` field, a whole text file, or the
    documents of an embedded-corpus split."""
    for path in files:
        if isinstance(path, str):  # stdlib:<split>
            from lightning_v17.data.corpus import load_stdlib_documents

            split = path.split(":", 1)[1]
            yield from (d.text for d in load_stdlib_documents() if d.split == split)
        elif path.suffix in JSONL_SUFFIXES:
            with open(path, encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as err:
                        raise ValueError(f"{path}:{n} is not a JSON line ({err.msg})") from err
                    if not isinstance(record, dict) or json_key not in record:
                        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                        raise ValueError(f"{path}:{n} has no key {json_key!r} (it has {keys}); set --json-key")
                    yield str(record[json_key])
        else:
            try:
                yield path.read_text(encoding="utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(f"{path} is not UTF-8 text ({err.reason} at byte {err.start})") from err


# ---- tokenizers ----------------------------------------------------------------------------------------------------
class _Encoder:
    """Text -> token ids (+ EOS) for the byte tokenizer or a Hugging Face tokenizer loaded from a local directory."""

    def __init__(self, spec: str, *, bos: bool) -> None:
        self.spec = spec
        self.bos = bos
        if spec == "byte":
            self._hf = None
            self.eos_id, self.bos_id = ByteTokenizer.EOS, ByteTokenizer.BOS
            self.vocab_size = ByteTokenizer.BYTES + ByteTokenizer.NUM_SPECIAL
            return
        if not Path(spec).is_dir():
            raise ValueError(f"--tokenizer {spec!r} is neither 'byte' nor a local tokenizer directory (a directory "
                             f"with tokenizer.json, as AutoTokenizer.from_pretrained(path) reads it)")  # fmt: skip
        try:
            from transformers import AutoTokenizer
        except ImportError as err:
            raise ValueError(f"--tokenizer {spec}: a Hugging Face tokenizer needs `pip install transformers`") from err
        self._hf = AutoTokenizer.from_pretrained(spec)
        self.eos_id, self.bos_id = self._hf.eos_token_id, self._hf.bos_token_id
        if self.eos_id is None:
            raise ValueError(f"--tokenizer {spec} has no eos_token; set one in its tokenizer_config.json")
        if bos and self.bos_id is None:
            raise ValueError(f"--tokenizer {spec} has no bos_token; drop --bos or set one in tokenizer_config.json")
        self.vocab_size = len(self._hf)

    def encode(self, texts: Sequence[str]) -> list[np.ndarray]:
        head = [self.bos_id] if self.bos else []
        if self._hf is None:
            out = []
            for text in texts:
                body = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
                out.append(np.concatenate([np.array(head, np.int64), body, np.array([self.eos_id], np.int64)]))
            return out
        ids = self._hf(list(texts), add_special_tokens=False)["input_ids"]
        return [np.array(head + list(i) + [self.eos_id], dtype=np.int64) for i in ids]


_WORKER: _Encoder | None = None


def _init_worker(spec: str, bos: bool) -> None:
    global _WORKER
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one process per worker already
    _WORKER = _Encoder(spec, bos=bos)


def _encode_batch(texts: list[str]) -> tuple[list[np.ndarray], int]:
    assert _WORKER is not None
    return _WORKER.encode(texts), sum(len(t.encode("utf-8")) for t in texts)


def _batches(texts: Iterator[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for text in texts:
        batch.append(text)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _ordered(pool: Any, batches: Iterator[list[str]], *, window: int) -> Iterator[tuple[list[np.ndarray], int]]:
    """Results in input order with at most ``window`` batches in flight (``Pool.imap`` would read the whole input
    ahead into its task queue, i.e. the corpus into memory)."""
    pending: deque = deque()
    for batch in batches:
        pending.append(pool.apply_async(_encode_batch, (batch,)))
        if len(pending) >= window:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


# ---- the run -------------------------------------------------------------------------------------------------------
def preprocess(
    inputs: Sequence[str | os.PathLike],
    output: str | os.PathLike,
    *,
    tokenizer: str = "byte",
    json_key: str = "text",
    workers: int = 1,
    batch_size: int = 64,
    bos: bool = False,
    progress: bool = True,
) -> PreprocessSummary:
    """Tokenize ``inputs`` into ``<output>.bin/.idx``; see the module docstring for the input forms.

    Args:
        inputs: jsonl files, text files or directories of them.
        output: the output prefix (``runs/tokens/corpus`` writes ``corpus.bin`` and ``corpus.idx``).
        tokenizer: ``byte`` (the byte-level tokenizer) or a local Hugging Face tokenizer directory.
        json_key: the field of each jsonl record that holds its text.
        workers: tokenizer processes (1: tokenize in this process).
        batch_size: documents per task handed to a worker.
        bos: prepend the tokenizer's BOS to every document too (EOS is always appended).
        progress: print a progress line to stderr while running.
    """
    if workers < 1:
        raise ValueError(f"--workers={workers} must be >= 1")
    if batch_size < 1:
        raise ValueError(f"--batch-size={batch_size} must be >= 1")
    files = input_files(inputs)
    encoder = _Encoder(tokenizer, bos=bos)  # fails here, not in a worker, on a bad tokenizer
    dtype = token_dtype(encoder.vocab_size)
    start = time.perf_counter()
    docs = tokens = nbytes = 0
    last = start
    texts = iter_texts(files, json_key=json_key)
    pool = None
    with IndexedWriter(output, dtype) as writer:
        try:
            if workers == 1:
                _init_worker(tokenizer, bos)
                results: Iterator = map(_encode_batch, _batches(texts, batch_size))
            else:
                pool = mp.get_context("fork" if sys.platform == "linux" else "spawn").Pool(
                    workers, initializer=_init_worker, initargs=(tokenizer, bos)
                )
                results = _ordered(pool, _batches(texts, batch_size), window=4 * workers)
            for arrays, batch_bytes in results:
                for arr in arrays:
                    writer.add_document(arr)
                docs += len(arrays)
                tokens += sum(a.size for a in arrays)
                nbytes += batch_bytes
                now = time.perf_counter()
                if progress and now - last > 0.5:
                    last = now
                    print(f"\rpreprocess: {docs} documents, {tokens} tokens, "
                          f"{nbytes / 1e6 / (now - start):.1f} MB/s", end="", file=sys.stderr, flush=True)  # fmt: skip
        finally:
            if pool is not None:
                pool.terminate()
                pool.join()
    summary = PreprocessSummary(docs, tokens, nbytes, time.perf_counter() - start, os.fspath(writer.prefix),
                                str(dtype))  # fmt: skip
    if progress:
        print("\r" + summary.line().ljust(100), file=sys.stderr, flush=True)
    return summary


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="v17 preprocess", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("inputs", nargs="+", help="jsonl files, text files, directories of them, or stdlib:train|val")
    p.add_argument("--output", "-o", required=True, help="output prefix: writes PREFIX.bin and PREFIX.idx")
    p.add_argument("--tokenizer", default="byte", help="'byte' or a local Hugging Face tokenizer directory")
    p.add_argument("--json-key", default="text", help="the field of each jsonl record holding its text")
    p.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    p.add_argument("--batch-size", type=int, default=64, help="documents per task handed to a worker")
    p.add_argument("--bos", action="store_true", help="prepend BOS to each document too (EOS is always appended)")
    p.add_argument("--quiet", action="store_true", help="no progress line and no summary")
    return p


def preprocess_main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        preprocess(args.inputs, args.output, tokenizer=args.tokenizer, json_key=args.json_key, workers=args.workers,
                   batch_size=args.batch_size, bos=args.bos, progress=not args.quiet)  # fmt: skip
    except (ValueError, FileNotFoundError) as err:
        print(f"v17 preprocess: error: {err}", file=sys.stderr)
        return 2
    return 0
