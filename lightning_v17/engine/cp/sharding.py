"""The sequence dim of a batch split over the ``cp`` ranks, with causal load balancing, and its exact inverse.

A row of ``S`` tokens is cut into ``n`` equal chunks; every cp rank owns ``n / cp`` of them, concatenated in
ascending chunk order (its *local order*). :class:`SequenceLayout` records which, and answers every later question
(the global token index of each local token, the shard-order permutation that an all-to-all or all-gather over the
ranks produces, and its inverse). Three assignments (``lightning_v17.config.CPBalance``):

- ``none``: rank ``r`` gets chunk ``r`` of ``cp`` contiguous chunks. Under causal attention the last rank does
  ``2cp - 1`` times the work of the first.
- ``head_tail``: ``2cp`` chunks, rank ``r`` gets chunks ``r`` and ``2cp - 1 - r`` (the "zigzag" of Megatron-LM's
  context parallelism and of Llama 3, Dubey 2024 §3.3.2). On one causal document every rank does exactly the same
  work; on packed rows (attention restarting per document) the spread stays (max/mean 1.2-1.5 on average over the
  random packed batches of ``tests/unit/test_cp_sharding.py``, up to 2.3 on one batch).
- ``packed``: ``chunks_per_rank * cp`` chunks assigned by the attention work measured on the batch itself: longest
  processing time first under the constraint of equally many chunks per rank (every rank keeps ``S / cp`` tokens,
  so the collectives stay even), then pairwise swaps that lower the busiest rank's work. The better of that and the
  zigzag of the same chunks is kept. Every cp rank computes the same assignment from the same full batch, so no
  communication decides it.

The attention work of a token is the number of earlier tokens of its own document (the keys it attends to, itself
left out), and a chunk's work is the sum over its tokens and over the rows of the batch (all rows share one layout).

Labels are shifted *before* sharding (:func:`shift_labels`), so the target of a shard's last token (the first token
of the next shard) is not lost; positions stay global (:func:`shard_batch` keeps the original ``position_ids``); and
the document of every token is fixed on the full row (:func:`segment_ids_from_position_ids`), because a shard that
starts inside a document cannot tell where it began.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_v17.config import CPBalance, V17ConfigError

__all__ = [
    "CPBalance",
    "CPBatch",
    "SequenceLayout",
    "attention_work",
    "balance_ratio",
    "check_sequence_parallel_split",
    "cu_seqlens_from_segment_ids",
    "make_layout",
    "segment_ids_from_position_ids",
    "sequence_multiple",
    "shard_batch",
    "shift_labels",
    "token_work",
]

IGNORE_INDEX = -100


@dataclass(frozen=True)
class SequenceLayout:
    """Which chunks of a row of ``seq_len`` tokens each cp rank owns.

    Args:
        seq_len: ``S``, the full sequence length (dim 1 of the batch).
        chunks: ``chunks[r]`` = the chunk ids of rank ``r``, ascending (its local order); every rank the same count,
            every chunk id in ``range(n)`` exactly once, ``n = sum(len(c) for c in chunks)``, ``S % n == 0``.
    """

    seq_len: int
    chunks: tuple[tuple[int, ...], ...]
    _order: torch.Tensor = field(init=False, repr=False, compare=False)
    _inverse: torch.Tensor = field(init=False, repr=False, compare=False)
    _copies: dict = field(init=False, repr=False, compare=False)  # (name, device) -> index tensor on that device

    def __post_init__(self) -> None:
        n = sum(len(c) for c in self.chunks)
        if len({len(c) for c in self.chunks}) != 1:
            raise ValueError(f"every cp rank must own equally many chunks, got {[len(c) for c in self.chunks]}")
        if sorted(i for c in self.chunks for i in c) != list(range(n)):
            raise ValueError(f"chunks {self.chunks} are not a partition of range({n})")
        if self.seq_len % n:
            raise V17ConfigError(
                f"sequence length {self.seq_len} is not divisible by the {n} chunks of this cp layout "
                f"(cp={len(self.chunks)}); pad the rows to a multiple of {n} tokens or choose another cp balance"
            )
        c = self.seq_len // n
        order = torch.cat([torch.arange(i * c, (i + 1) * c) for rank in self.chunks for i in rank])
        object.__setattr__(self, "_order", order)
        object.__setattr__(self, "_inverse", torch.argsort(order))
        object.__setattr__(self, "_copies", {})

    def _on(self, name: str, device: torch.device | str | None) -> torch.Tensor:
        """The index tensor ``name`` on ``device``, copied there once (every layer of a step reuses it)."""
        base = getattr(self, name)
        if device is None or torch.device(device) == base.device:
            return base
        key = (name, str(torch.device(device)))
        if key not in self._copies:
            self._copies[key] = base.to(device)
        return self._copies[key]

    @property
    def cp(self) -> int:
        return len(self.chunks)

    @property
    def num_chunks(self) -> int:
        return sum(len(c) for c in self.chunks)

    @property
    def chunk_len(self) -> int:
        return self.seq_len // self.num_chunks

    @property
    def local_len(self) -> int:
        """Tokens per rank, ``S / cp``."""
        return self.seq_len // self.cp

    def token_index(self, rank: int, device: torch.device | str | None = None) -> torch.Tensor:
        """LongTensor [S/cp]: the global token index (0..S-1 in the row) of each of ``rank``'s local tokens."""
        s = self.local_len
        return self._on("_order", device)[rank * s : (rank + 1) * s]

    def order(self, device: torch.device | str | None = None) -> torch.Tensor:
        """LongTensor [S]: the global token index at each place of the *shard order* (rank 0's local tokens, then
        rank 1's, ...), the order in which an all-gather or all-to-all over the cp ranks lays the tokens out."""
        return self._on("_order", device)

    def inverse(self, device: torch.device | str | None = None) -> torch.Tensor:
        """LongTensor [S]: ``full_true = full_shard_order.index_select(dim, inverse())``."""
        return self._on("_inverse", device)

    def shard(self, x: torch.Tensor, rank: int, *, dim: int = 1) -> torch.Tensor:
        """``rank``'s local part of ``x`` (the full sequence on ``dim``), in local order."""
        if x.shape[dim] != self.seq_len:
            raise ValueError(
                f"dim {dim} of a tensor of shape {tuple(x.shape)} is not the sequence length {self.seq_len}"
            )
        return x.index_select(dim, self.token_index(rank, x.device))

    def unshard(self, shards: Sequence[torch.Tensor], *, dim: int = 1) -> torch.Tensor:
        """The exact inverse of :meth:`shard`: every rank's local part (in rank order) back to the full tensor."""
        if len(shards) != self.cp:
            raise ValueError(f"{len(shards)} shards for a layout of cp={self.cp}")
        return self.to_true_order(torch.cat(list(shards), dim=dim), dim=dim)

    def to_true_order(self, x: torch.Tensor, *, dim: int = 1) -> torch.Tensor:
        """A full sequence in shard order (e.g. after an all-gather) put back into token order."""
        return x.index_select(dim, self.inverse(x.device))

    def to_shard_order(self, x: torch.Tensor, *, dim: int = 1) -> torch.Tensor:
        """A full sequence in token order laid out in shard order (the inverse of :meth:`to_true_order`)."""
        return x.index_select(dim, self.order(x.device))


# ---------------------------------------------------------------------------------------------- documents and work


def segment_ids_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """LongTensor [B, S]: the document of every token, numbered from 0 in each row.

    A document starts where ``position_ids == 0`` and at every row start: the same rule as the model's
    ``cu_seqlens`` (``lightning_v17.models.attention.cu_seqlens_from_position_ids``). Call it on the *full* rows.
    """
    starts = position_ids == 0
    starts[:, 0] = True
    return starts.long().cumsum(1) - 1


def cu_seqlens_from_segment_ids(segment_ids: torch.Tensor) -> torch.Tensor:
    """int32 [n+1] document offsets over the flattened ``B*S`` tokens (flash-attn's ``cu_seqlens``) of full rows."""
    b, s = segment_ids.shape
    starts = torch.ones_like(segment_ids, dtype=torch.bool)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    idx = torch.nonzero(starts.reshape(-1)).reshape(-1)
    return torch.cat([idx, idx.new_tensor([b * s])]).to(torch.int32)


def token_work(segment_ids: torch.Tensor | None, seq_len: int | None = None) -> torch.Tensor:
    """LongTensor [S]: per token, the number of earlier tokens of its document, summed over the rows.

    Args:
        segment_ids: [B, S] documents (:func:`segment_ids_from_position_ids`); None: one causal document per row.
        seq_len: ``S`` when ``segment_ids`` is None.
    """
    if segment_ids is None:
        return torch.arange(seq_len, dtype=torch.long)
    b, s = segment_ids.shape
    idx = torch.arange(s, device=segment_ids.device).expand(b, s)
    new = torch.ones_like(segment_ids, dtype=torch.bool)
    new[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    start = torch.where(new, idx, torch.zeros_like(idx)).cummax(1).values  # index of each token's document start
    return (idx - start).sum(0)


def attention_work(layout: SequenceLayout, segment_ids: torch.Tensor | None = None) -> torch.Tensor:
    """LongTensor [cp]: the causal attention work (see :func:`token_work`) of each rank under ``layout``."""
    work = token_work(segment_ids, layout.seq_len)
    return torch.stack([work[layout.token_index(r, work.device)].sum() for r in range(layout.cp)])


def balance_ratio(layout: SequenceLayout, segment_ids: torch.Tensor | None = None) -> float:
    """max / mean of :func:`attention_work` over the ranks (1.0 is perfect balance)."""
    work = attention_work(layout, segment_ids).double()
    return float(work.max() / work.mean().clamp_min(1e-30))


# ------------------------------------------------------------------------------------------------------ layouts


def _zigzag(cp: int, per_rank: int) -> list[list[int]]:
    """Chunks of ``2cp`` in pairs: rank r gets r and 2cp-1-r of every group of ``2cp`` consecutive chunks."""
    if per_rank % 2:
        return [[j * cp + r for j in range(per_rank)] for r in range(cp)]
    out: list[list[int]] = [[] for _ in range(cp)]
    for g in range(per_rank // 2):
        for r in range(cp):
            out[r] += [2 * cp * g + r, 2 * cp * g + 2 * cp - 1 - r]
    return out


def _balanced_chunks(work: list[int], cp: int, per_rank: int) -> list[list[int]]:
    """Equal-cardinality partition of chunk works into ``cp`` bins minimizing the largest bin (LPT, then swaps)."""
    bins: list[list[int]] = [[] for _ in range(cp)]
    load = [0] * cp
    for i in sorted(range(len(work)), key=lambda i: (-work[i], i)):
        r = min((r for r in range(cp) if len(bins[r]) < per_rank), key=lambda r: (load[r], r))
        bins[r].append(i)
        load[r] += work[i]
    for _ in range(8 * len(work)):  # improve the busiest rank by the best single swap; stop when none helps
        hi = max(range(cp), key=lambda r: load[r])
        best = (0, None)
        for lo in range(cp):
            if lo == hi:
                continue
            for a in bins[hi]:
                for b in bins[lo]:
                    d = work[a] - work[b]
                    if 0 < d and load[lo] + d < load[hi]:
                        gain = min(d, load[hi] - load[lo] - d)
                        if gain > best[0]:
                            best = (gain, (lo, a, b))
        if best[1] is None:
            break
        lo, a, b = best[1]
        bins[hi][bins[hi].index(a)] = b
        bins[lo][bins[lo].index(b)] = a
        load[hi] -= work[a] - work[b]
        load[lo] += work[a] - work[b]
    return bins


def sequence_multiple(cp: int, balance: str | CPBalance = CPBalance.HEAD_TAIL, *, chunks_per_rank: int = 8,
                      tp: int = 1) -> int:  # fmt: skip
    """The row lengths ``S`` must be a multiple of: the chunks of the cp layout (``cp``, ``2 cp`` or
    ``chunks_per_rank * cp``), and with tensor parallelism's sequence parallelism (``tp`` > 1) ``cp * tp`` too, since
    each cp rank's ``S / cp`` tokens are split evenly over the tp ranks between the sublayers (DTensor's sequence
    shards are equal ones)."""
    balance = CPBalance.parse(balance)
    chunks = {CPBalance.NONE: cp, CPBalance.HEAD_TAIL: 2 * cp, CPBalance.PACKED: chunks_per_rank * cp}[balance]
    return math.lcm(chunks, cp * tp) if cp > 1 else tp


def check_sequence_parallel_split(
    seq_len: int, *, cp: int, tp: int, balance: str | CPBalance = CPBalance.HEAD_TAIL, chunks_per_rank: int = 8
) -> None:
    """Refuse rows whose ``S / cp`` tokens per cp rank the ``tp`` sequence-parallel ranks cannot share evenly.

    Raises:
        V17ConfigError: naming ``TPPolicy(sequence_parallel=True)``, the lengths and the length to pad to.
    """
    if (seq_len // cp) % tp == 0:
        return
    need = sequence_multiple(cp, balance, chunks_per_rank=chunks_per_rank, tp=tp)
    what = f"each cp rank's {seq_len // cp} tokens (sequence length {seq_len}, cp={cp})" if cp > 1 else (
        f"the {seq_len} tokens of each row")  # fmt: skip
    raise V17ConfigError(
        f"TPPolicy(sequence_parallel=True) with tp={tp} splits {what} over the tp ranks, which needs them divisible "
        f"by {tp}; pad the rows to a multiple of {need} tokens, or set sequence_parallel=False"
    )


def make_layout(
    seq_len: int,
    cp: int,
    balance: str | CPBalance = CPBalance.HEAD_TAIL,
    *,
    position_ids: torch.Tensor | None = None,
    segment_ids: torch.Tensor | None = None,
    chunks_per_rank: int = 8,
) -> SequenceLayout:
    """The layout of rows of ``seq_len`` tokens over ``cp`` ranks.

    Args:
        seq_len: ``S``; it must be a multiple of ``cp`` (``none``), ``2cp`` (``head_tail``) or
            ``chunks_per_rank * cp`` (``packed``).
        cp: the cp group size.
        balance: see :class:`CPBalance`.
        position_ids: [B, S] full rows (``packed`` only; the documents start where they are 0).
        segment_ids: [B, S] documents of the full rows instead of ``position_ids``; neither: one causal document
            per row.
        chunks_per_rank: chunks per rank of the ``packed`` assignment (more: finer balance, smaller chunks).

    Returns:
        the :class:`SequenceLayout` every cp rank computes alike from the same batch.
    """
    balance = CPBalance.parse(balance)
    if cp < 1:
        raise ValueError(f"cp={cp} must be a positive integer")
    need = {CPBalance.NONE: cp, CPBalance.HEAD_TAIL: 2 * cp, CPBalance.PACKED: chunks_per_rank * cp}[balance]
    if seq_len % need:
        raise V17ConfigError(
            f"cp={cp} with balance={balance.value!r} needs the sequence length to be a multiple of {need}, "
            f"got {seq_len}; pad the rows to {-(-seq_len // need) * need} tokens or change cp / cp_balance"
        )
    if balance is CPBalance.NONE:
        return SequenceLayout(seq_len, tuple((r,) for r in range(cp)))
    if balance is CPBalance.HEAD_TAIL:
        return SequenceLayout(seq_len, tuple(tuple(sorted(c)) for c in _zigzag(cp, 2)))
    if segment_ids is None and position_ids is not None:
        segment_ids = segment_ids_from_position_ids(position_ids)
    per_token = token_work(segment_ids, seq_len)
    n = chunks_per_rank * cp
    work = per_token.view(n, seq_len // n).sum(1).tolist()
    candidates = [_balanced_chunks(work, cp, chunks_per_rank), _zigzag(cp, chunks_per_rank)]
    best = min(candidates, key=lambda bins: max(sum(work[i] for i in b) for b in bins))
    return SequenceLayout(seq_len, tuple(tuple(sorted(b)) for b in best))


# ------------------------------------------------------------------------------------------------------- batches


def shift_labels(
    tokens: torch.Tensor, *, position_ids: torch.Tensor | None = None, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """Next-token targets of full rows, computed before sharding: ``out[:, i] = tokens[:, i + 1]``, and
    ``ignore_index`` at the end of every row (and, given ``position_ids``, at the last token of every document).

    Hugging Face's ``ForCausalLMLoss`` shifts the same way (pad with -100, take ``[..., 1:]``); sharding first and
    shifting each shard would drop the target of every shard's last token.
    """
    out = torch.full_like(tokens, ignore_index)
    out[:, :-1] = tokens[:, 1:]
    if position_ids is not None:
        out[:, :-1][position_ids[:, 1:] == 0] = ignore_index
    return out


@dataclass(frozen=True)
class CPBatch:
    """One rank's share of a batch.

    Attributes:
        local: every ``[B, S, ...]`` tensor of the batch cut to this rank's ``[B, S/cp, ...]`` tokens, in local
            order (``position_ids`` keep their global values); other entries unchanged.
        layout: the layout used.
        segment_ids: [B, S] documents of the full rows in token order (what the attention masks with), or None for
            one causal document per row.
        rank: this rank's index in the cp group.
    """

    local: dict[str, Any]
    layout: SequenceLayout
    segment_ids: torch.Tensor | None
    rank: int


def shard_batch(
    batch: Mapping[str, Any],
    *,
    cp: int,
    rank: int,
    balance: str | CPBalance = CPBalance.HEAD_TAIL,
    chunks_per_rank: int = 8,
    packed: bool | None = None,
    seq_keys: Sequence[str] | None = None,
) -> CPBatch:
    """Cut a batch's sequence dim (dim 1) to cp rank ``rank``'s tokens.

    Args:
        batch: ``input_ids`` [B, S] and optionally ``labels`` (already shifted, e.g. by :func:`shift_labels`),
            ``position_ids`` (global, restarting per document), ``loss_mask`` and any other [B, S, ...] tensor.
            ``cu_seqlens``/``max_seqlen`` of the full rows are dropped from ``local`` (they describe the full rows;
            :attr:`CPBatch.segment_ids` replaces them).
        cp: the cp group size; rank: this rank's index in it.
        balance: see :class:`CPBalance`.
        chunks_per_rank: for ``balance="packed"``.
        packed: mask by document (from ``position_ids``); default: whenever ``position_ids`` restart inside a row.
        seq_keys: the keys to cut (default: every tensor whose dim 1 is ``S``).

    Returns:
        :class:`CPBatch`. Without ``position_ids`` in the batch, ``local["position_ids"]`` holds the global
        ``arange(S)`` positions of the local tokens.
    """
    tokens = batch["input_ids"]
    b, s = tokens.shape[:2]
    pos = batch.get("position_ids")
    if pos is None:
        pos = torch.arange(s, device=tokens.device).expand(b, s)
    segments = segment_ids_from_position_ids(pos)
    if packed is None:
        packed = bool((segments[:, -1] > 0).any())
    segments = segments if packed else None
    layout = make_layout(s, cp, balance, segment_ids=segments, chunks_per_rank=chunks_per_rank)
    keys = seq_keys
    if keys is None:
        keys = [k for k, v in batch.items() if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[1] == s]
    local = {k: v for k, v in batch.items() if k not in ("cu_seqlens", "max_seqlen")}
    local["position_ids"] = pos
    for key in {*keys, "position_ids"}:
        local[key] = layout.shard(local[key], rank, dim=1)
    return CPBatch(local=local, layout=layout, segment_ids=segments, rank=rank)
