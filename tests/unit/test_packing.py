"""Packing properties (hypothesis): coverage, row capacity, position reset, labels within documents, DP sharding,
per-epoch shuffling and exact mid-epoch resume."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_v17.data.packing import (
    IGNORE_INDEX,
    PackedRowSampler,
    PackingMode,
    collate_rows,
    materialize_row,
    pack,
    padding_fraction,
)
from lightning_v17.models.attention import cu_seqlens_from_position_ids

FAST = settings(max_examples=40, deadline=None)
lengths_st = st.lists(st.integers(min_value=0, max_value=70), min_size=0, max_size=40)
seq_len_st = st.integers(min_value=2, max_value=32)
mode_st = st.sampled_from(list(PackingMode))


def _docs(lengths: list[int], seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 250, (n,), generator=g) for n in lengths]


@FAST
@given(lengths=lengths_st, seq_len=seq_len_st, mode=mode_st, group=st.integers(1, 5))
def test_plan_covers_every_token_once_and_rows_fit(lengths, seq_len, mode, group):
    plan = pack(lengths, seq_len, mode=mode, group_size=group)
    covered: dict[int, list[tuple[int, int]]] = {}
    for row in plan.rows:
        assert 0 < sum(s.length for s in row) <= seq_len
        if not mode.packs:
            assert len(row) == 1
        for s in row:
            assert 0 < s.length <= seq_len
            covered.setdefault(s.doc, []).append((s.start, s.end))
    for doc, n in enumerate(lengths):
        spans = sorted(covered.get(doc, []))
        # The spans tile [0, n) exactly: nothing lost, nothing duplicated.
        assert [a for a, _ in spans] == list(range(0, n, seq_len))
        assert [b for _, b in spans] == [min(a + seq_len, n) for a in range(0, n, seq_len)]
    assert plan.num_split_docs == sum(1 for n in lengths if n > seq_len)
    assert plan.real_tokens == sum(lengths)


@FAST
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=60),
    seq_len=st.integers(8, 40),
    mode=st.sampled_from([PackingMode.FFD, PackingMode.BEST_FIT]),
)
def test_fit_heuristics_leave_at_most_one_row_half_empty(lengths, seq_len, mode):
    # Any first-fit/best-fit packing: two rows both <= half full would have been merged (Johnson 1974).
    plan = pack(lengths, seq_len, mode=mode)
    loads = [sum(s.length for s in row) for row in plan.rows]
    assert sum(1 for load in loads if 2 * load <= seq_len) <= 1


def test_ffd_is_deterministic_and_tighter_than_no_packing():
    rng = random.Random(3)
    lengths = [rng.randint(1, 300) for _ in range(500)]
    a, b = pack(lengths, 256), pack(lengths, 256)
    assert a.rows == b.rows
    assert a.padding_fraction() < 0.02
    assert pack(lengths, 256, mode="none").padding_fraction(8) > 0.3
    assert pack(lengths, 256, mode="bucket", group_size=8).padding_fraction() < 0.05


@FAST
@given(
    lengths=lengths_st.filter(lambda x: sum(x) > 0),
    seq_len=seq_len_st,
    mode=mode_st,
    batch=st.integers(1, 4),
    seed=st.integers(0, 5),
)
def test_rows_positions_labels_and_cu_seqlens(lengths, seq_len, mode, batch, seed):
    docs = _docs(lengths, seed)
    plan = pack(lengths, seq_len, mode=mode, group_size=batch)
    rows = [
        materialize_row(r, docs.__getitem__, pad_to=seq_len if mode.packs else None, pad_id=258)
        for r in plan.rows[:batch]
    ]
    b = collate_rows(rows, pad_id=258)
    ids, pos, lab, doc = b["input_ids"], b["position_ids"], b["labels"], b["doc_ids"]
    bsz, width = ids.shape
    cu = b["cu_seqlens"]
    assert cu.dtype == torch.int32 and cu[0] == 0 and cu[-1] == bsz * width
    assert torch.all(cu[1:] > cu[:-1])
    assert b["max_seqlen"] == int((cu[1:] - cu[:-1]).max())
    # Every segment lies in one row, positions count 0..len-1 inside it, and segments are what position_ids imply.
    derived, derived_max = cu_seqlens_from_position_ids(pos)
    assert torch.equal(derived, cu) and derived_max == b["max_seqlen"]
    flat_ids, flat_pos, flat_lab, flat_doc = ids.reshape(-1), pos.reshape(-1), lab.reshape(-1), doc.reshape(-1)
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        assert s // width == (e - 1) // width
        assert torch.equal(flat_pos[s:e], torch.arange(e - s))
        assert len(set(flat_doc[s:e].tolist())) == 1
        # Labels: the next token of the same segment, -100 at its last token (and everywhere on padding).
        assert flat_lab[e - 1] == IGNORE_INDEX
        if flat_doc[s] >= 0:
            assert torch.equal(flat_lab[s : e - 1], flat_ids[s + 1 : e])
        else:
            assert torch.all(flat_lab[s:e] == IGNORE_INDEX) and torch.all(flat_ids[s:e] == 258)
    # Real tokens are exactly the planned document slices.
    for r, row in enumerate(plan.rows[:batch]):
        got = ids[r][doc[r] >= 0]
        want = torch.cat([docs[sg.doc][sg.start : sg.end] for sg in row])
        assert torch.equal(got, want)
    pad = float((doc < 0).sum()) / doc.numel()
    assert padding_fraction(b) == pytest.approx(pad)


def test_loss_mask_is_aligned_with_labels():
    docs = [torch.arange(10, 16), torch.arange(20, 24)]  # prompt = first 3 tokens of doc 0, all of doc 1 is answer
    masks = [torch.tensor([0, 0, 0, 1, 1, 1]), torch.tensor([1, 1, 1, 1])]
    plan = pack([6, 4], 12)
    row = materialize_row(plan.rows[0], docs.__getitem__, pad_to=12, pad_id=0, loss_mask_of=masks.__getitem__)
    # Row: doc0 (6) then doc1 (4) then 2 pad. loss_mask[i] is the mask of target token i+1 of the same document.
    assert row["labels"].tolist() == [11, 12, 13, 14, 15, -100, 21, 22, 23, -100, -100, -100]
    assert row["loss_mask"].tolist() == [0, 0, 1, 1, 1, 0, 1, 1, 1, 0, 0, 0]
    assert row["position_ids"].tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 0, 1]
    batch = collate_rows([row, row])
    assert batch["cu_seqlens"].tolist() == [0, 6, 10, 12, 18, 22, 24]


def test_errors_name_the_option():
    with pytest.raises(ValueError, match="packing='zip'"):
        pack([3], 8, mode="zip")
    with pytest.raises(ValueError, match="seq_len=1"):
        pack([3], 1)


# ---- sampler ------------------------------------------------------------------------------------------------------
@FAST
@given(
    rows=st.integers(0, 60),
    world=st.integers(1, 4),
    group=st.integers(1, 4),
    seed=st.integers(0, 3),
    epoch=st.integers(0, 3),
    drop_last=st.booleans(),
)
def test_dp_shards_are_disjoint_and_complete(rows, world, group, seed, epoch, drop_last):
    shards = []
    for rank in range(world):
        s = PackedRowSampler(rows, num_replicas=world, rank=rank, seed=seed, drop_last=drop_last, group_size=group)
        s.set_epoch(epoch)
        shards.append(list(s))
        assert len(s) == len(shards[-1])
    seen = [i for sh in shards for i in sh]
    assert len(seen) == len(set(seen))  # no row on two ranks, none twice
    groups = -(-rows // group)
    if not drop_last or groups % world == 0:
        assert sorted(seen) == list(range(rows))  # none missing
    else:
        # drop_last cuts fewer than `world` groups so every rank has the same number of groups.
        assert len({-(-len(sh) // group) for sh in shards}) == 1
        assert rows - len(seen) < world * group


def test_shuffle_depends_on_seed_and_epoch():
    def order(seed, epoch):
        s = PackedRowSampler(200, seed=seed)
        s.set_epoch(epoch)
        return list(s)

    assert order(0, 0) == order(0, 0)
    assert order(0, 0) != order(0, 1)  # a fixed seed must not mean a fixed order across epochs
    assert order(0, 0) != order(1, 0)
    assert sorted(order(0, 1)) == list(range(200))


@FAST
@given(
    rows=st.integers(1, 50),
    world=st.integers(1, 3),
    group=st.integers(1, 3),
    stop=st.integers(0, 60),
    new_world=st.integers(1, 3),
)
def test_resume_mid_epoch_yields_exactly_the_rest(rows, world, group, stop, new_world):
    # Reference: the epoch's global order, ranks interleaved group by group.
    def sampler(w, r):
        s = PackedRowSampler(rows, num_replicas=w, rank=r, seed=7, drop_last=False, group_size=group)
        s.set_epoch(2)
        return s

    full = [list(sampler(world, r)) for r in range(world)]
    per_rank_groups = min(stop, min(-(-len(f) // group) for f in full))
    consumed_rows = set()
    states = []
    for r in range(world):
        s = sampler(world, r)
        it = iter(s)
        taken = []
        for _ in range(per_rank_groups):
            g = [next(it) for _ in range(len(s._rows_of(s._my_groups()[len(taken)])))]
            taken.append(g)
        consumed_rows.update(i for g in taken for i in g)
        states.append(s.state_dict(consumed_groups=per_rank_groups))
    assert all(st_ == states[0] for st_ in states)  # every rank reports the same global position
    # Resume on possibly another number of ranks: the rest, each row exactly once.
    rest = []
    for r in range(new_world):
        s = PackedRowSampler(rows, num_replicas=new_world, rank=r, seed=0, drop_last=False, group_size=group)
        s.load_state_dict(states[0])
        s.set_epoch(2)
        rest.extend(s)
    assert len(rest) == len(set(rest))
    assert consumed_rows.isdisjoint(rest)
    assert consumed_rows | set(rest) == set(range(rows))


def test_resume_same_world_continues_each_rank_stream():
    for rank in range(2):
        ref = PackedRowSampler(37, num_replicas=2, rank=rank, seed=5)
        ref.set_epoch(1)
        full = list(ref)
        s = PackedRowSampler(37, num_replicas=2, rank=rank, seed=5)
        s.set_epoch(1)
        it = iter(s)
        head = [next(it) for _ in range(6)]
        state = s.state_dict()  # counts what it handed out
        resumed = PackedRowSampler(37, num_replicas=2, rank=rank, seed=0)
        resumed.load_state_dict(state)
        resumed.set_epoch(1)
        assert head + list(resumed) == full
        resumed.set_epoch(2)  # the next epoch starts from the beginning again
        assert len(list(resumed)) == len(full)


def test_load_state_rejects_other_plan():
    s = PackedRowSampler(10)
    with pytest.raises(ValueError, match="same data, seq_len and packing"):
        PackedRowSampler(11).load_state_dict(s.state_dict())
