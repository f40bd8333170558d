"""Packing variable-length documents into fixed rows, with document-aware positions, labels and attention segments.

Padding wastes compute: with a mean/max length ratio of 0.5, half of every padded batch is padding. Packing several
documents into each row of ``seq_len`` tokens removes it, but only if nothing crosses a document boundary:

- attention: the rows carry ``cu_seqlens`` (flash-attn's varlen convention), so the model attends causally *within*
  each document and never across (``lightning_v17.models.attention``);
- positions: ``position_ids`` restart at 0 at each document start, so RoPE sees every document as if it were alone;
- targets: ``labels`` are shifted *within* each document, with -100 at every document's last token and on padding.

The plan (which document chunk goes into which row) is pure Python over lengths only; tensors are built per row on
demand (:func:`materialize_row`) and batched by :func:`collate_rows`. :class:`PackedRowSampler` shuffles rows by
(seed, epoch), shards them disjointly over data-parallel ranks and resumes mid-epoch exactly.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, NamedTuple

import torch
from torch.utils.data import DistributedSampler

from lightning_v17.config import parse_enum

IGNORE_INDEX = -100
PAD_DOC_ID = -1


class PackingMode(StrEnum):
    """How document chunks are assigned to rows.

    - ``ffd``: first-fit decreasing bin packing into rows of ``seq_len`` (the default; at most 11/9 OPT + 6/9 rows,
      Dósa 2007).
    - ``best_fit``: best-fit decreasing: each chunk goes into the fullest row it still fits.
    - ``bucket``: no packing; one chunk per row, rows sorted by length and grouped ``group_size`` at a time, so a
      batch of one group pads only to lengths close to its own.
    - ``none``: no packing; one chunk per row in corpus order (the padded baseline).
    """

    FFD = "ffd"
    BEST_FIT = "best_fit"
    BUCKET = "bucket"
    NONE = "none"

    @classmethod
    def parse(cls, value: Any) -> PackingMode:
        return parse_enum(cls, value, option="packing")  # type: ignore[return-value]

    @property
    def packs(self) -> bool:
        return self in (PackingMode.FFD, PackingMode.BEST_FIT)


class Segment(NamedTuple):
    """Tokens ``[start, end)`` of document ``doc``."""

    doc: int
    start: int
    end: int

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class PackingPlan:
    """Rows of document chunks.

    Attributes:
        rows: each row is a tuple of segments (one segment for the ``bucket``/``none`` modes).
        seq_len: the row capacity in tokens.
        mode: the packing mode.
        group_size: rows ``[g*group_size, (g+1)*group_size)`` form group ``g``; the sampler shuffles whole groups
            (``bucket`` mode: a group is one batch of similar lengths; otherwise 1).
        num_split_docs: documents longer than ``seq_len``, split into continuation chunks (none is dropped).
        num_chunks: chunks after splitting (= documents + extra continuation chunks).
    """

    rows: tuple[tuple[Segment, ...], ...]
    seq_len: int
    mode: PackingMode
    group_size: int
    num_split_docs: int
    num_chunks: int

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    @property
    def num_groups(self) -> int:
        return -(-len(self.rows) // self.group_size)

    @property
    def real_tokens(self) -> int:
        return sum(s.length for row in self.rows for s in row)

    def row_length(self, index: int) -> int:
        return sum(s.length for s in self.rows[index])

    def padding_fraction(self, batch_size: int | None = None) -> float:
        """Fraction of pad tokens in the batches this plan yields (before shuffling).

        Packed modes pad every row to ``seq_len``. Unpacked modes pad each batch of ``batch_size`` consecutive rows
        to its longest row (``bucket``: a batch is one group).
        """
        if self.mode.packs:
            total = len(self.rows) * self.seq_len
        else:
            b = batch_size or self.group_size
            lengths = [self.row_length(i) for i in range(len(self.rows))]
            total = sum(max(lengths[i : i + b]) * len(lengths[i : i + b]) for i in range(0, len(lengths), b))
        return 1.0 - self.real_tokens / total if total else 0.0

    def stats(self, batch_size: int | None = None) -> dict[str, float]:
        return {
            "rows": float(self.num_rows),
            "chunks": float(self.num_chunks),
            "split_documents": float(self.num_split_docs),
            "real_tokens": float(self.real_tokens),
            "padding_fraction": self.padding_fraction(batch_size),
        }


def chunk_documents(lengths: Sequence[int], seq_len: int) -> tuple[list[Segment], int]:
    """Split documents longer than ``seq_len`` into ``seq_len`` continuation chunks (+ a remainder).

    Returns the chunks in document order and the number of documents that were split. Empty documents are skipped
    (they have no tokens to lose).
    """
    if seq_len < 2:
        raise ValueError(f"seq_len={seq_len} is too short; a row needs at least 2 tokens for one next-token target")
    chunks: list[Segment] = []
    split = 0
    for doc, n in enumerate(lengths):
        if n > seq_len:
            split += 1
        for start in range(0, n, seq_len):
            chunks.append(Segment(doc, start, min(start + seq_len, n)))
    return chunks, split


def _first_fit(chunks: list[Segment], seq_len: int) -> list[list[Segment]]:
    """First fit over ``chunks`` in the given order, O(n log n) with a max-segment-tree over row capacities."""
    size = 1
    while size < max(len(chunks), 1):
        size *= 2
    tree = [seq_len] * (2 * size)  # leaves: remaining capacity of row i (fresh rows have seq_len)
    rows: list[list[Segment]] = []
    for chunk in chunks:
        need = chunk.length
        node = 1
        while node < size:  # descend to the leftmost leaf with capacity >= need
            node = 2 * node if tree[2 * node] >= need else 2 * node + 1
        row = node - size
        if row == len(rows):
            rows.append([])
        rows[row].append(chunk)
        tree[node] -= need
        node //= 2
        while node:
            tree[node] = max(tree[2 * node], tree[2 * node + 1])
            node //= 2
    return rows


def _best_fit(chunks: list[Segment], seq_len: int) -> list[list[Segment]]:
    """Best fit: each chunk goes into the open row with the least remaining capacity that still fits it."""
    open_rows: list[tuple[int, int]] = []  # sorted (remaining, row index)
    rows: list[list[Segment]] = []
    for chunk in chunks:
        need = chunk.length
        i = bisect.bisect_left(open_rows, (need, -1))
        if i < len(open_rows):
            remaining, row = open_rows.pop(i)
        else:
            remaining, row = seq_len, len(rows)
            rows.append([])
        rows[row].append(chunk)
        if remaining - need > 0:
            bisect.insort(open_rows, (remaining - need, row))
    return rows


def pack(lengths: Sequence[int], seq_len: int, *, mode: str | PackingMode = "ffd", group_size: int = 1) -> PackingPlan:
    """Plan rows of at most ``seq_len`` tokens from documents of the given token lengths.

    Args:
        lengths: token count of each document (index = document id).
        seq_len: row capacity in tokens.
        mode: a :class:`PackingMode` (``ffd``, ``best_fit``, ``bucket``, ``none``).
        group_size: ``bucket`` mode only: rows per length group (use the batch size).
    """
    mode = PackingMode.parse(mode)
    if group_size < 1:
        raise ValueError(f"group_size={group_size} must be >= 1")
    chunks, split = chunk_documents(lengths, seq_len)
    if mode.packs:
        # Decreasing length, ties by position: deterministic, and the classic FFD/BFD order.
        ordered = sorted(chunks, key=lambda c: (-c.length, c.doc, c.start))
        fit = _first_fit if mode is PackingMode.FFD else _best_fit
        rows = [tuple(r) for r in fit(ordered, seq_len)]
        group_size = 1
    elif mode is PackingMode.BUCKET:
        rows = [(c,) for c in sorted(chunks, key=lambda c: (c.length, c.doc, c.start))]
    else:
        rows = [(c,) for c in chunks]
        group_size = 1
    return PackingPlan(tuple(rows), seq_len, mode, group_size, split, len(chunks))


TokenSource = Callable[[int], Any]


def _as_long(x: Any) -> torch.Tensor:
    return x.long().reshape(-1) if isinstance(x, torch.Tensor) else torch.as_tensor(x, dtype=torch.long).reshape(-1)


def materialize_row(
    segments: Sequence[Segment],
    tokens_of: TokenSource,
    *,
    pad_to: int | None = None,
    pad_id: int = 0,
    loss_mask_of: TokenSource | None = None,
) -> dict[str, Any]:
    """Build one row's tensors from its segments.

    Args:
        segments: the row's document chunks, in order.
        tokens_of: document id -> its token ids (any 1-D int sequence or tensor).
        pad_to: pad the row to this many tokens (``None``: no padding). Padding is its own segment with positions
            ``0..k-1``, ``pad_id`` inputs, labels -100 and doc id -1.
        pad_id: the pad token id.
        loss_mask_of: document id -> per-token 0/1 mask (SFT: 0 on prompt tokens). The row's ``loss_mask[i]`` is
            the mask of the *target* token ``i+1``, so it is aligned with ``labels``.

    Returns:
        dict with 1-D ``input_ids``, ``position_ids``, ``labels``, ``doc_ids`` (LongTensor), ``loss_mask`` (float,
        only with ``loss_mask_of``) and ``seqlens`` (list of segment lengths, padding included).
    """
    ids, pos, labels, docs, masks, seqlens = [], [], [], [], [], []
    for seg in segments:
        toks = _as_long(tokens_of(seg.doc))[seg.start : seg.end]
        n = toks.numel()
        if n != seg.length:
            raise ValueError(f"document {seg.doc} has {toks.numel()} tokens in [{seg.start}, {seg.end}); plan is stale")
        lab = torch.full((n,), IGNORE_INDEX, dtype=torch.long)
        lab[:-1] = toks[1:]  # next token within this chunk only; the last token has no target inside it
        ids.append(toks)
        pos.append(torch.arange(n, dtype=torch.long))
        labels.append(lab)
        docs.append(torch.full((n,), seg.doc, dtype=torch.long))
        if loss_mask_of is not None:
            m = torch.as_tensor(loss_mask_of(seg.doc), dtype=torch.float32).reshape(-1)[seg.start : seg.end]
            row_mask = torch.zeros(n, dtype=torch.float32)
            row_mask[:-1] = m[1:]
            masks.append(row_mask)
        seqlens.append(n)
    used = sum(seqlens)
    if pad_to is not None:
        if used > pad_to:
            raise ValueError(f"row has {used} tokens but pad_to={pad_to}")
        k = pad_to - used
        if k:
            ids.append(torch.full((k,), pad_id, dtype=torch.long))
            pos.append(torch.arange(k, dtype=torch.long))
            labels.append(torch.full((k,), IGNORE_INDEX, dtype=torch.long))
            docs.append(torch.full((k,), PAD_DOC_ID, dtype=torch.long))
            if loss_mask_of is not None:
                masks.append(torch.zeros(k, dtype=torch.float32))
            seqlens.append(k)
    out: dict[str, Any] = {
        "input_ids": torch.cat(ids) if ids else torch.empty(0, dtype=torch.long),
        "position_ids": torch.cat(pos) if pos else torch.empty(0, dtype=torch.long),
        "labels": torch.cat(labels) if labels else torch.empty(0, dtype=torch.long),
        "doc_ids": torch.cat(docs) if docs else torch.empty(0, dtype=torch.long),
        "seqlens": seqlens,
    }
    if loss_mask_of is not None:
        out["loss_mask"] = torch.cat(masks) if masks else torch.empty(0)
    return out


class RowBatch(Sequence):
    """Rows already laid out as one ``[B, S]`` grid per field (a token file's batch, ``data/blend.py``): a row is
    built only when it is indexed, and :func:`collate_rows` takes the grids as they are instead of splitting and
    stacking them again.

    Args:
        grid: ``input_ids``, ``position_ids``, ``labels`` and ``doc_ids`` as ``[B, S]`` int64 arrays.
        starts: ``[B, S]`` bool, True where a segment (a document chunk, or the padding) starts; True at column 0.
        bounds: instead of ``starts``: the segment starts of the flattened ``B*S`` tokens plus ``B*S`` (sorted,
            every row start included), i.e. the batch's ``cu_seqlens``.
        max_seqlen: the longest segment, when the caller has it (else computed from ``bounds``).
    """

    def __init__(self, grid: Mapping[str, Any], starts: Any = None, *, bounds: Any = None,
                 max_seqlen: int | None = None) -> None:  # fmt: skip
        import numpy as np

        self.grid = dict(grid)
        self.rows, self.width = self.grid["input_ids"].shape
        if (starts is None) == (bounds is None):
            raise ValueError("RowBatch takes the segment starts either as a bool grid (starts) or as bounds")
        self.bounds = np.append(np.flatnonzero(np.asarray(starts).ravel()), starts.size) if bounds is None \
            else np.asarray(bounds)  # fmt: skip
        self.max_seqlen = int(np.diff(self.bounds).max()) if max_seqlen is None else int(max_seqlen)

    def __len__(self) -> int:
        return int(self.rows)

    def __getitem__(self, r: Any) -> Any:
        import numpy as np

        if isinstance(r, slice):
            return [self[i] for i in range(*r.indices(len(self)))]
        row = {k: torch.from_numpy(v[r]) for k, v in self.grid.items()}
        lo, hi = np.searchsorted(self.bounds, [r * self.width, (r + 1) * self.width])
        row["seqlens"] = np.diff(self.bounds[lo : hi + 1]).tolist()
        return row

    def collate(self) -> dict[str, Any]:
        """What :func:`collate_rows` makes of these rows, from the grids in one piece."""
        import numpy as np

        batch: dict[str, Any] = {k: torch.from_numpy(v if v.flags.c_contiguous else np.ascontiguousarray(v))
                                 for k, v in self.grid.items()}  # fmt: skip
        batch["cu_seqlens"] = torch.from_numpy(self.bounds.astype(np.int32))
        batch["max_seqlen"] = self.max_seqlen
        return batch


def collate_rows(rows: Sequence[Mapping[str, Any]], *, pad_id: int = 0, pad_to: int | None = None) -> dict[str, Any]:
    """Batch rows from :func:`materialize_row`: pad each to the longest (or ``pad_to``) and stack.

    ``cu_seqlens`` concatenates every row's segment boundaries with offsets ``b * S`` over the flattened ``B*S``
    tokens; ``max_seqlen`` is the longest segment (padding segments included, as attention runs over them too).
    A :class:`RowBatch` of that width is taken in one piece (the same batch).
    """
    if isinstance(rows, RowBatch) and len(rows) and pad_to in (None, rows.width):
        return rows.collate()
    if not rows:
        raise ValueError("cannot collate an empty batch")
    width = max(r["input_ids"].numel() for r in rows) if pad_to is None else pad_to
    fields = {"input_ids": pad_id, "position_ids": None, "labels": IGNORE_INDEX, "doc_ids": PAD_DOC_ID}
    has_mask = "loss_mask" in rows[0]
    if has_mask:
        fields["loss_mask"] = 0.0
    out: dict[str, list[torch.Tensor]] = {k: [] for k in fields}
    bounds = [0]
    max_seqlen = 0
    for b, row in enumerate(rows):
        n = row["input_ids"].numel()
        k = width - n
        if k < 0:
            raise ValueError(f"row of {n} tokens does not fit pad_to={width}")
        for key, fill in fields.items():
            t = row[key]
            if k:
                extra = torch.arange(k, dtype=torch.long) if fill is None else torch.full((k,), fill, dtype=t.dtype)
                t = torch.cat([t, extra])
            out[key].append(t)
        seqlens = list(row["seqlens"]) + ([k] if k else [])
        offset = b * width
        for n_seg in seqlens:
            bounds.append(bounds[-1] + n_seg)
            max_seqlen = max(max_seqlen, n_seg)
        if bounds[-1] != offset + width:
            raise ValueError("row seqlens do not add up to the row length")
    batch: dict[str, Any] = {k: torch.stack(v) for k, v in out.items()}
    batch["cu_seqlens"] = torch.tensor(bounds, dtype=torch.int32)
    batch["max_seqlen"] = int(max_seqlen)
    return batch


def padding_fraction(batch: Mapping[str, Any]) -> float:
    """Pad tokens / all tokens of a collated batch (padding has doc id -1)."""
    doc_ids = batch["doc_ids"]
    return float((doc_ids == PAD_DOC_ID).sum()) / max(doc_ids.numel(), 1)


class PackedRowSampler(DistributedSampler):
    """Row indices of a :class:`PackingPlan`: shuffled by (seed, epoch), sharded over DP ranks, resumable.

    Each epoch the plan's groups (rows for packed modes) are shuffled with ``random.Random(f"{seed}:{epoch}")``,
    so a fixed seed gives a different order every epoch and the same order on every rank and every run. A trailing
    partial group (``bucket`` mode) is kept last so every other batch stays one whole group. Rank ``r`` of ``N``
    takes groups ``r, r+N, ...``; with ``drop_last`` the epoch's order is first cut to a multiple of ``N`` so every
    rank yields the same number of rows (the cut groups differ every epoch).

    It subclasses :class:`DistributedSampler` only so that Lightning keeps it instead of wrapping it.

    Args:
        plan: the packing plan (or its row count with ``group_size``).
        num_replicas: data-parallel world size.
        rank: data-parallel rank.
        shuffle: shuffle groups each epoch.
        seed: shuffle seed.
        drop_last: cut each epoch to a multiple of ``num_replicas`` groups (needed for lock-step DP training).
        group_size: rows per group when ``plan`` is an int.
    """

    def __init__(
        self,
        plan: PackingPlan | int,
        *,
        num_replicas: int = 1,
        rank: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        group_size: int = 1,
    ) -> None:
        is_plan = hasattr(plan, "num_rows")  # a PackingPlan, or lightning_v17.data.ffd's ArrayPlan
        num_rows = plan.num_rows if is_plan else int(plan)
        group_size = plan.group_size if is_plan else group_size
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank={rank} must be in [0, num_replicas={num_replicas})")
        # Not DistributedSampler.__init__: it would query torch.distributed; we take rank/world size explicitly.
        self.num_rows = num_rows
        self.group_size = group_size
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self._start = 0  # groups of this epoch's global order already consumed (resume)
        self._yielded = 0  # groups this rank has handed out in the current iteration

    @property
    def num_groups(self) -> int:
        return -(-self.num_rows // self.group_size)

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self._start = 0
        self.epoch = epoch

    def _group_order(self) -> list[int]:
        groups = list(range(self.num_groups))
        partial = self.num_rows % self.group_size != 0
        full = groups[:-1] if partial else groups
        if self.shuffle:
            random.Random(f"{self.seed}:{self.epoch}").shuffle(full)
        return full + ([groups[-1]] if partial else [])

    def _my_groups(self) -> list[int]:
        # Cut what is left after the resume point, not the whole order: a position saved at another data-parallel
        # size (elastic 2 -> 1 -> 2) need not be a multiple of this one, and every rank must yield as many groups.
        # From a position that is a multiple of num_replicas (every same-size resume) both cuts are the same.
        rest = self._group_order()[self._start :]
        if self.drop_last:
            rest = rest[: len(rest) - len(rest) % self.num_replicas]
        return rest[self.rank :: self.num_replicas]

    def _rows_of(self, group: int) -> range:
        return range(group * self.group_size, min((group + 1) * self.group_size, self.num_rows))

    def __iter__(self) -> Iterator[int]:
        self._yielded = 0
        for group in self._my_groups():
            rows = self._rows_of(group)
            for i in rows:
                if i == rows[-1]:
                    self._yielded += 1  # count the group as handed out before its last row leaves
                yield i

    def __len__(self) -> int:
        return sum(len(self._rows_of(g)) for g in self._my_groups())

    def state_dict(self, consumed_groups: int | None = None) -> dict[str, int]:
        """The position in this epoch's global order, in groups consumed by all ranks together.

        Args:
            consumed_groups: groups *this rank* has consumed since the last (re)start; default: the groups this
                sampler has handed out, which runs ahead of training when a DataLoader prefetches (use the
                data module's state, which counts batches actually trained on).
        """
        mine = self._yielded if consumed_groups is None else consumed_groups
        return {
            "epoch": self.epoch,
            "seed": self.seed,
            "consumed": self._start + mine * self.num_replicas,
            "num_rows": self.num_rows,
            "group_size": self.group_size,
        }

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        if int(state["num_rows"]) != self.num_rows or int(state["group_size"]) != self.group_size:
            raise ValueError(
                f"sampler state is for {state['num_rows']} rows in groups of {state['group_size']}, but this plan has"
                f" {self.num_rows} rows in groups of {self.group_size}; resume with the same data, seq_len and packing"
            )
        self.epoch = int(state["epoch"])
        self.seed = int(state["seed"])
        self._start = int(state["consumed"])
        self._yielded = 0
