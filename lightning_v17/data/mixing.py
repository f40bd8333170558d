"""The arithmetic of a blend (:mod:`lightning_v17.data.blend`), evaluated on demand: seeded bijections over
document ids (a Feistel network over splitmix64 rounds) and the source of each sample of a weighted mixture, from
its position and the weights alone (a binary tree of fixed-point shares)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

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


__all__ = ["blend_counts", "blend_locate", "feistel_one", "feistel_permute", "fixed_point_weights"]
