"""Blended token-file corpora behind a lazy sample index: O(corpora) to build, O(1) to resume, O(1) per sample.

Each corpus (a ``.bin/.idx`` pair, :class:`~lightning_v17.data.indexed.IndexedReader`) is read as Megatron's GPT
dataset reads it: its documents concatenated, cut into samples of ``seq_len`` tokens (the last one shorter), with
``cu_seqlens`` at the document boundaries and positions reset at each, so attention never crosses a document. Sample
``s`` of corpus ``c`` is tokens ``[s*seq_len, (s+1)*seq_len)`` of the stream; its documents come from a binary search
over the ``.idx`` byte offsets (a view of the memory map: nothing per document is built).

The order is computed on demand from the global sample position ``i``, never materialized:

1. **Blend.** A balanced binary tree over the corpora; at each node sample ``j`` goes left iff
   ``floor((j+1) p + 1/2) > floor(j p + 1/2)`` with ``p`` the left subtree's share (a Sturmian / Beatty sequence,
   the exact integer form of Bresenham's line). The left child's index of ``j`` is ``floor(j p + 1/2)``, the right
   one's ``j`` minus that, so a corpus's count among the first ``i`` samples is O(log corpora) integer arithmetic and
   within 1 sample per tree level of ``i`` times its weight (Megatron's greedy blend is within 1, but needs a pass over
   all samples). With no weights, ``p`` is the exact ratio of the corpora's sample counts: every epoch of
   ``num_samples`` takes every corpus's samples exactly once.
2. **Shuffle.** A corpus's ``k``-th draw is its sample ``perm_e(k mod n)`` of epoch ``e = k div n``, where
   ``perm_e`` is a 4-round Feistel bijection over the smallest even power of two ``>= n`` keyed by (seed, corpus,
   epoch), cycle-walked into ``[0, n)`` (Black & Rogaway 2002, "Ciphers with arbitrary finite domains").

Why samples are shuffled instead of documents: with document-masked attention (``cu_seqlens``) and positions reset
per document, which documents share a row changes no loss term, only which rows share a batch; shuffling samples
keeps the concatenation's binary search over the file's own offsets, where a document shuffle needs the cumulative
lengths in shuffled order, i.e. per-document arrays per epoch (Megatron's cost, which grows with documents x epochs).

**Resume.** The state is the global sample position plus the index (seq_len, seed, corpora, mixture phases). A
mixture change declared on resume starts a new phase at the saved position: each corpus continues from the count of
draws it had there, so nothing seen is repeated and the realised fractions follow the new weights from then on.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np
import torch

from lightning_v17.data.indexed import IndexedReader
from lightning_v17.data.packing import IGNORE_INDEX, PAD_DOC_ID, PackedRowSampler, RowBatch

_ONE = 1 << 24  # fixed-point denominator of user weights: i * numerator stays exact in int64 up to ~5e11 samples
_U64 = np.uint64


# ---- the shuffle ---------------------------------------------------------------------------------------------------
def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer (Steele, Lea & Flood 2014) on uint64 arrays (wrapping arithmetic)."""
    x = (x ^ (x >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> _U64(27))) * _U64(0x94D049BB133111EB)
    return x ^ (x >> _U64(31))


@lru_cache(maxsize=4096)
def _key(*parts: Any) -> int:
    return int.from_bytes(hashlib.sha256(":".join(map(str, parts)).encode()).digest()[:8], "little")


_MASK64 = (1 << 64) - 1


def _mix_int(x: int) -> int:
    """:func:`_mix` on one Python int (the same bits)."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def feistel_one(x: int, n: int, key: int, *, rounds: int = 4) -> int:
    """:func:`feistel_permute` of one int, in Python ints (no numpy call overhead: the per-row path)."""
    if n <= 1:
        return 0
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    mask = (1 << half) - 1
    keys = [_key(key, r) for r in range(rounds)]
    while True:
        left, right = x >> half, x & mask
        for k in keys:
            left, right = right, left ^ (_mix_int(right ^ k) & mask)
        x = (left << half) | right
        if x < n:
            return x


def feistel_permute(x: np.ndarray, n: int, key: int, *, rounds: int = 4) -> np.ndarray:
    """A seeded bijection of ``[0, n)`` evaluated at ``x`` (int array in ``[0, n)``): ``perm[x]``, O(1) per element."""
    x = np.asarray(x, dtype=np.int64)
    if n <= 1:
        return np.zeros_like(x)
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    mask = _U64((1 << half) - 1)
    sh = _U64(half)
    keys = [_U64(_key(key, r)) for r in range(rounds)]

    def once(v: np.ndarray) -> np.ndarray:
        left, right = v >> sh, v & mask
        for k in keys:
            left, right = right, left ^ (_mix(right ^ k) & mask)
        return (left << sh) | right

    with np.errstate(over="ignore"):
        out = once(x.astype(_U64))
        bad = out >= _U64(n)
        while bad.any():  # cycle walking: the domain is < 4n, so under 4 walks are expected
            out[bad] = once(out[bad])
            bad = out >= _U64(n)
    return out.astype(np.int64)


# ---- the blend -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Node:
    """A split of corpora ``leaves`` into the left ``leaves[:cut]`` and the right rest, left share ``num/den``."""

    leaves: tuple[int, ...]
    cut: int
    num: int
    den: int


def _tree(shares: Sequence[int], den_of_root: int | None = None) -> list[_Node]:
    """Balanced split nodes in pre-order over integer ``shares`` (weights in fixed point, or sample counts)."""
    nodes: list[_Node] = []

    def build(leaves: tuple[int, ...]) -> None:
        if len(leaves) < 2:
            return
        cut = len(leaves) // 2
        left = sum(shares[c] for c in leaves[:cut])
        total = sum(shares[c] for c in leaves)
        nodes.append(_Node(leaves, cut, left, total))
        build(leaves[:cut])
        build(leaves[cut:])

    build(tuple(range(len(shares))))
    return nodes


def _left_count(j: np.ndarray, node: _Node) -> np.ndarray:
    return (j * node.num + node.den // 2) // node.den


def blend_locate(j: np.ndarray, shares: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(corpus, draw index within the corpus) of blend positions ``j`` (int64 array), vectorized."""
    j = np.asarray(j, dtype=np.int64)
    corpus = np.zeros(j.shape, dtype=np.int64)
    local = j.copy()
    if len(shares) == 1:
        return corpus, local
    # Walk every position down from the root; `at` is the node's leaf tuple each position sits in.
    pending = [(tuple(range(len(shares))), np.arange(j.size))]
    nodes = {n.leaves: n for n in _tree(shares)}
    while pending:
        leaves, idx = pending.pop()
        if len(leaves) == 1:
            corpus[idx] = leaves[0]
            continue
        node = nodes[leaves]
        jj = local[idx]
        before = _left_count(jj, node)
        go_left = _left_count(jj + 1, node) > before
        local[idx] = np.where(go_left, before, jj - before)
        pending.append((leaves[: node.cut], idx[go_left]))
        pending.append((leaves[node.cut :], idx[~go_left]))
    return corpus, local


def blend_counts(i: int, shares: Sequence[int]) -> list[int]:
    """How many of the first ``i`` blend positions go to each corpus (O(corpora), exact)."""
    counts = [0] * len(shares)

    def down(leaves: tuple[int, ...], j: int, nodes: dict) -> None:
        if len(leaves) == 1:
            counts[leaves[0]] = j
            return
        node = nodes[leaves]
        left = (j * node.num + node.den // 2) // node.den
        down(leaves[: node.cut], left, nodes)
        down(leaves[node.cut :], j - left, nodes)

    down(tuple(range(len(shares))), int(i), {n.leaves: n for n in _tree(shares)})
    return counts


def fixed_point_weights(weights: Sequence[float]) -> list[int]:
    """Weights -> integer shares out of 2**24 (normalized), with a named error for bad weights."""
    w = [float(x) for x in weights]
    if any(not np.isfinite(x) or x < 0 for x in w):
        raise ValueError(f"data.weights={list(weights)} must be finite and >= 0")
    total = sum(w)
    if total <= 0:
        raise ValueError(f"data.weights={list(weights)} must sum to a positive number")
    return [round(x / total * _ONE) for x in w]


# ---- corpora -------------------------------------------------------------------------------------------------------
@dataclass
class Corpus:
    """One token file of a blend: its reader, its samples at ``seq_len`` and an identity for resume checks."""

    path: str
    reader: IndexedReader
    seq_len: int
    num_tokens: int = field(init=False)
    num_samples: int = field(init=False)

    def __post_init__(self) -> None:
        self.num_tokens = self.reader.num_tokens
        self.num_samples = -(-self.num_tokens // self.seq_len)

    @property
    def identity(self) -> dict[str, Any]:
        return {"path": self.path, "sequences": len(self.reader), "tokens": self.num_tokens}

    @property
    def name(self) -> str:
        return os.path.basename(self.path)


class BlendedTokens:
    """Map-style dataset of packed rows over blended token files, indexed by global sample position.

    Item ``i`` (any ``i >= 0``: positions past ``len`` continue into the next epoch) is a row dict as
    :func:`lightning_v17.data.packing.materialize_row` returns it (``input_ids``, ``position_ids``, ``labels``,
    ``doc_ids``, ``seqlens``), padded to ``seq_len`` only when a corpus's last sample is shorter.

    Args:
        paths: token-file prefixes (``foo`` for ``foo.bin`` + ``foo.idx``).
        weights: one weight per path (normalized); None: each corpus in proportion to its samples, so that every
            epoch of the default ``num_samples`` takes every sample of every corpus exactly once.
        seq_len: tokens per row.
        seed: the shuffle seed.
        num_samples: samples per epoch (``len``); None: the corpora's samples at ``seq_len`` added up.
        pad_id: the token id of padding.
    """

    def __init__(
        self,
        paths: Sequence[str | os.PathLike],
        *,
        weights: Sequence[float] | None = None,
        seq_len: int = 2048,
        seed: int = 0,
        num_samples: int | None = None,
        pad_id: int = 0,
    ) -> None:
        if not paths:
            raise ValueError("data.paths is empty; give at least one token-file prefix")
        if weights is not None and len(weights) != len(paths):
            raise ValueError(f"data.weights has {len(weights)} entries but data.paths has {len(paths)}; give one "
                             f"weight per path (or none: in proportion to their sizes)")  # fmt: skip
        if seq_len < 2:
            raise ValueError(f"seq_len={seq_len} must be >= 2")
        self.paths = [os.fspath(p) for p in paths]
        self.seq_len = seq_len
        self.seed = seed
        self.pad_id = pad_id
        self.corpora = [Corpus(p, IndexedReader(p), seq_len) for p in self.paths]
        empty = [c.path for c in self.corpora if c.num_samples == 0]
        if empty:
            raise ValueError(f"token files {empty} hold no tokens; drop them from data.paths")
        self.weights = None if weights is None else [float(w) for w in weights]
        shares = [c.num_samples for c in self.corpora] if weights is None else fixed_point_weights(weights)
        self.num_samples = int(num_samples) if num_samples is not None else sum(c.num_samples for c in self.corpora)
        if self.num_samples < 1:
            raise ValueError(f"data.num_samples={num_samples} must be >= 1")
        # Mixture phases: from global position `start`, corpus c's draws are `base[c] + blend_locate(i - start)`.
        self.phases: list[dict[str, Any]] = [{"start": 0, "shares": shares, "base": [0] * len(shares)}]

    # ---- the index -------------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.num_samples

    def locate(self, positions: Any) -> tuple[np.ndarray, np.ndarray]:
        """(corpus, sample within the corpus) of global positions (int array), vectorized."""
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        if pos.size and pos.min() < 0:
            raise IndexError("sample positions are >= 0")
        corpus = np.empty_like(pos)
        draw = np.empty_like(pos)
        starts = np.array([p["start"] for p in self.phases], dtype=np.int64)
        phase_of = np.searchsorted(starts, pos, side="right") - 1
        if pos.size and phase_of.min() < 0:
            raise IndexError(f"positions before {starts[0]} precede this run's resume point and are not indexed")
        for k in np.unique(phase_of):
            sel = phase_of == k
            phase = self.phases[k]
            c, local = blend_locate(pos[sel] - phase["start"], phase["shares"])
            corpus[sel] = c
            draw[sel] = local + np.asarray(phase["base"], dtype=np.int64)[c]
        sample = np.empty_like(pos)
        for c in np.unique(corpus):
            sel = corpus == c
            n = self.corpora[c].num_samples
            epoch, r = np.divmod(draw[sel], n)
            out = np.empty_like(r)
            for e in np.unique(epoch):
                at = epoch == e
                out[at] = feistel_permute(r[at], n, _key(self.seed, self.corpora[c].path, int(e)))
            sample[sel] = out
        return corpus, sample

    def locate_one(self, position: int) -> tuple[int, int]:
        """:meth:`locate` of one position in Python ints (the same answer, without numpy's per-call overhead)."""
        position = int(position)
        k = bisect.bisect_right(self._phase_starts, position) - 1
        if position < 0 or k < 0:
            raise IndexError(f"sample position {position} is not indexed (positions start at {self._phase_starts[0]})")
        phase = self.phases[k]
        j, leaves = position - phase["start"], tuple(range(len(self.corpora)))
        nodes = self._nodes(k)
        while len(leaves) > 1:
            node = nodes[leaves]
            before = (j * node.num + node.den // 2) // node.den
            if ((j + 1) * node.num + node.den // 2) // node.den > before:
                j, leaves = before, leaves[: node.cut]
            else:
                j, leaves = j - before, leaves[node.cut :]
        c = leaves[0]
        corpus = self.corpora[c]
        epoch, r = divmod(phase["base"][c] + j, corpus.num_samples)
        return c, feistel_one(r, corpus.num_samples, _key(self.seed, corpus.path, epoch))

    @property
    def _phase_starts(self) -> list[int]:
        return [p["start"] for p in self.phases]

    def _nodes(self, k: int) -> dict[tuple[int, ...], _Node]:
        cache = self.__dict__.setdefault("_node_cache", {})
        key = (k, tuple(self.phases[k]["shares"]))
        if key not in cache:
            cache[key] = {n.leaves: n for n in _tree(self.phases[k]["shares"])}
        return cache[key]

    def segments(self, position: int) -> list[tuple[int, int, int, int]]:
        """(corpus, document, token offset in the document, length) of each document chunk of sample ``position``."""
        c, s = self.locate_one(position)
        return [(c, *seg) for seg in self._doc_chunks(c, s)]

    def _doc_chunks(self, c: int, s: int) -> list[tuple[int, int, int]]:
        corpus = self.corpora[c]
        start = s * self.seq_len
        end = min(start + self.seq_len, corpus.num_tokens)
        reader = corpus.reader
        size = reader.dtype.itemsize
        ptr = reader.sequence_pointers
        first = int(np.searchsorted(ptr, start * size, side="right")) - 1
        last = int(np.searchsorted(ptr, end * size, side="left"))  # documents [first, last) start before `end`
        out = []
        for d in range(first, last):
            d_start = int(ptr[d]) // size
            lo, hi = max(start, d_start), min(end, d_start + int(reader.sequence_lengths[d]))
            if hi > lo:
                out.append((d, lo - d_start, hi - lo))
        return out

    def __getitem__(self, position: int) -> dict[str, Any]:
        c, s = self.locate_one(position)
        chunks = self._doc_chunks(c, s)
        start = s * self.seq_len
        tokens = self.corpora[c].reader.span(start, start + sum(n for _, _, n in chunks)).astype(np.int64)
        seqlens = [n for _, _, n in chunks]
        n_real = tokens.size
        bounds = np.cumsum([0, *seqlens])
        seg_start = np.repeat(bounds[:-1], seqlens)
        labels = np.full(n_real, IGNORE_INDEX, dtype=np.int64)
        labels[:-1] = tokens[1:]
        labels[bounds[1:] - 1] = IGNORE_INDEX  # each document chunk's last token has no target inside it
        doc_ids = np.repeat(np.array([d for d, _, _ in chunks], dtype=np.int64), seqlens)
        position_ids = np.arange(n_real, dtype=np.int64) - seg_start
        k = self.seq_len - n_real
        if k:  # a corpus's last, shorter sample: padding is its own segment, as materialize_row pads
            tokens = np.concatenate([tokens, np.full(k, self.pad_id, np.int64)])
            position_ids = np.concatenate([position_ids, np.arange(k, dtype=np.int64)])
            labels = np.concatenate([labels, np.full(k, IGNORE_INDEX, np.int64)])
            doc_ids = np.concatenate([doc_ids, np.full(k, PAD_DOC_ID, np.int64)])
            seqlens.append(k)
        return {
            "input_ids": torch.from_numpy(tokens),
            "position_ids": torch.from_numpy(position_ids),
            "labels": torch.from_numpy(labels),
            "doc_ids": torch.from_numpy(doc_ids),
            "seqlens": seqlens,
        }

    def __getitems__(self, positions: Sequence[int]) -> RowBatch:
        """The rows of a batch of positions at once (``DataLoader`` calls this for a batch when it exists): one
        vectorized locate, then every field built over the ``[B, seq_len]`` grid; the same rows as ``__getitem__``."""
        # Per position in Python ints: for a batch of a few rows that beats the vectorized locate's ~100 numpy calls.
        located = [self.locate_one(int(i)) for i in positions]
        corpus = np.array([c for c, _ in located], dtype=np.int64)
        sample = np.array([s for _, s in located], dtype=np.int64)
        n_rows, width = len(located), self.seq_len
        tokens = np.full((n_rows, width), self.pad_id, dtype=np.int64)
        marks = np.zeros((n_rows, width), dtype=bool)  # True where a document chunk (or the padding) starts
        doc_grid = np.full((n_rows, width), PAD_DOC_ID, dtype=np.int64)
        used = np.empty(n_rows, dtype=np.int64)
        for c in np.unique(corpus).tolist():
            rows = np.flatnonzero(corpus == c)
            reader = self.corpora[c].reader
            size, ptr = reader.dtype.itemsize, reader.sequence_pointers
            start = sample[rows] * width
            end = np.minimum(start + width, self.corpora[c].num_tokens)
            used[rows] = end - start
            for r, lo, hi in zip(rows.tolist(), start.tolist(), end.tolist(), strict=True):
                tokens[r, : hi - lo] = reader.span(lo, hi)
            first = np.searchsorted(ptr, start * size, side="right") - 1
            last = np.searchsorted(ptr, end * size, side="left")
            inner = last - first - 1  # documents starting strictly inside each row
            offsets = np.arange(int(inner.sum())) - np.repeat(np.cumsum(inner) - inner, inner)
            docs = np.repeat(first + 1, inner) + offsets
            at_row = np.repeat(rows, inner)
            local = ptr[docs] // size - np.repeat(start, inner)
            marks[rows, 0] = True
            doc_grid[rows, 0] = first
            marks[at_row, local] = True
            np.maximum.at(doc_grid, (at_row, local), docs)  # several empty documents at one offset: the last one
        cols = np.arange(width, dtype=np.int64)
        pad = cols[None, :] >= used[:, None]
        short = np.flatnonzero(used < width)
        marks[short, used[short]] = True
        doc_ids = np.maximum.accumulate(doc_grid, axis=1)
        doc_ids[pad] = PAD_DOC_ID
        position_ids = cols[None, :] - np.maximum.accumulate(np.where(marks, cols[None, :], 0), axis=1)
        labels = np.full((n_rows, width), IGNORE_INDEX, dtype=np.int64)
        labels[:, :-1] = np.where(marks[:, 1:], IGNORE_INDEX, tokens[:, 1:])
        labels[pad] = IGNORE_INDEX
        grid = {"input_ids": tokens, "position_ids": position_ids, "labels": labels, "doc_ids": doc_ids}
        return RowBatch(grid, marks)  # collate_rows takes the grids whole; a row is built only when indexed

    # ---- resume ----------------------------------------------------------------------------------------------------
    def manifest(self) -> dict[str, Any]:
        """What the index depends on: seq_len, seed, the corpora (path, sequences, tokens) and the weights."""
        return {"seq_len": self.seq_len, "seed": self.seed, "corpora": [c.identity for c in self.corpora],
                "weights": self.weights}  # fmt: skip

    def key(self) -> str:
        """A hash of the manifest and the mixture phases (the index's identity, for logs and checkpoints)."""
        blob = json.dumps({"manifest": self.manifest(), "phases": self.phases}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def index_state(self) -> dict[str, Any]:
        return {"key": self.key(), "manifest": self.manifest(), "phases": [dict(p) for p in self.phases]}

    def load_index_state(self, state: dict[str, Any], *, position: int, mixture_change: bool = False) -> None:
        """Continue the saved index; with ``mixture_change``, under this dataset's weights from ``position`` on.

        Refused, naming what changed, when seq_len, the seed or a corpus's contents differ, or when the corpora or
        weights differ and ``mixture_change`` is not declared.
        """
        saved, now = state["manifest"], self.manifest()
        for what in ("seq_len", "seed"):
            if saved[what] != now[what]:
                raise ValueError(f"the checkpoint's data index has {what}={saved[what]} but this run has "
                                 f"{what}={now[what]}; resume with {what}={saved[what]}")  # fmt: skip
        old = {c["path"]: c for c in saved["corpora"]}
        for c in now["corpora"]:
            if c["path"] in old and old[c["path"]] != c:
                o = old[c["path"]]
                raise ValueError(f"token file {c['path']} changed since the checkpoint ({o['sequences']} -> "
                                 f"{c['sequences']} documents, {o['tokens']} -> {c['tokens']} tokens); resume with "
                                 f"the files it was trained on")  # fmt: skip
        same_corpora = [c["path"] for c in saved["corpora"]] == [c["path"] for c in now["corpora"]]
        if same_corpora and saved["weights"] == now["weights"]:
            self.phases = [dict(p) for p in state["phases"]]
            return
        if not mixture_change:
            changes = []
            if not same_corpora:
                changes.append(f"data.paths {[c['path'] for c in saved['corpora']]} -> "
                               f"{[c['path'] for c in now['corpora']]}")  # fmt: skip
            if saved["weights"] != now["weights"]:
                changes.append(f"data.weights {saved['weights']} -> {now['weights']}")
            raise ValueError(f"the data mixture changed since the checkpoint: {'; '.join(changes)}; set "
                             f"data.mixture_change=true to continue from the same position under the new mixture "
                             f"(nothing seen is repeated), or resume with the old one")  # fmt: skip
        # Draws each saved corpus had made by `position`, carried over by path; new corpora start at 0.
        draws: dict[str, int] = {}
        phases = state["phases"]
        for k, phase in enumerate(phases):
            end = phases[k + 1]["start"] if k + 1 < len(phases) else position
            counts = blend_counts(max(min(end, position) - phase["start"], 0), phase["shares"])
            for c, (base, n) in enumerate(zip(phase["base"], counts, strict=True)):
                draws[saved["corpora"][c]["path"]] = base + n
            if end >= position:
                break
        current = self.phases[0]["shares"]
        kept = [p for p in phases if p["start"] < position]
        # Earlier phases refer to the saved corpus order; re-express their bases/shares in this run's order.
        remap = [next((i for i, c in enumerate(now["corpora"]) if c["path"] == o["path"]), None)
                 for o in saved["corpora"]]  # fmt: skip
        if remap != list(range(len(now["corpora"]))):
            kept = []  # positions before `position` are never asked for again after this resume
        self.phases = [*kept, {"start": int(position), "shares": current,
                               "base": [draws.get(c["path"], 0) for c in now["corpora"]]}]  # fmt: skip


class PositionSampler(PackedRowSampler):
    """Global sample positions of a :class:`BlendedTokens`, sharded over data-parallel ranks, resumable anywhere.

    The dataset is already in its shuffled order, so this sampler only deals positions out: rank ``r`` of ``N`` takes
    ``start + r, start + r + N, ...`` of the epoch, i.e. with a per-rank batch ``b`` every step trains the global
    positions ``[t*N*b, (t+1)*N*b)``, whatever ``N`` is. The state (inherited) is the epoch and the positions consumed
    by all ranks together, so a resume at another world size continues the same global order. Everything is a
    ``range``: nothing per sample is built. Positions continue across epochs (epoch ``e`` yields
    ``e * len(dataset) + ...``), so a corpus's later draws come from its next shuffles, never repeating this epoch's.

    Args:
        num_samples: positions per epoch (the dataset's ``len``).
        num_replicas: data-parallel world size.
        rank: data-parallel rank.
        drop_last: cut each epoch's remaining positions to a multiple of ``num_replicas`` (lock-step DP training).
    """

    def __init__(self, num_samples: int, *, num_replicas: int = 1, rank: int = 0, drop_last: bool = True) -> None:
        super().__init__(num_samples, num_replicas=num_replicas, rank=rank, shuffle=False, drop_last=drop_last)

    def _my_groups(self) -> range:
        n = self.num_rows - self._start
        if self.drop_last:
            n -= n % self.num_replicas
        return range(self._start, self._start + n)[self.rank :: self.num_replicas]

    def __iter__(self):
        self._yielded = 0
        offset = self.epoch * self.num_rows
        for i in self._my_groups():
            self._yielded += 1
            yield offset + i

    def __len__(self) -> int:
        return len(self._my_groups())
