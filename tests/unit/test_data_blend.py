"""The lazy blended index: a bijection per corpus, rows equal to ``materialize_row`` of the same chunks, every token of
every corpus exactly once per epoch, weights honoured, and resume at any world size (2 -> 3 -> 1) with the global
order of an uninterrupted run and nothing seen twice -- mixtures and declared mixture changes included."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_v17.data.blend import BlendedTokens, PositionSampler, feistel_permute
from lightning_v17.data.indexed import write_indexed
from lightning_v17.data.packing import Segment, materialize_row


def _write(tmp_path, name, lengths, seed=0):
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, 300, n) for n in lengths]
    write_indexed(tmp_path / name, docs)
    return str(tmp_path / name), docs


@pytest.mark.parametrize("n", [1, 2, 3, 5, 16, 17, 1000, 4097, 123_457])
def test_feistel_is_a_bijection_and_depends_on_the_key(n):
    x = np.arange(n)
    p = feistel_permute(x, n, key=7)
    np.testing.assert_array_equal(np.sort(p), x)
    if n >= 1000:
        q = feistel_permute(x, n, key=8)
        assert (p != q).mean() > 0.99 and (p != x).mean() > 0.99


def test_rows_equal_materialize_row_over_the_same_document_chunks(tmp_path):
    path, docs = _write(tmp_path, "a", [0, 5, 40, 0, 3, 100, 1, 0, 17])
    ds = BlendedTokens([path], seq_len=16, seed=3)
    total = sum(len(d) for d in docs)
    assert len(ds) == -(-total // 16)
    for i in range(len(ds)):
        segs = ds.segments(i)
        row = ds[i]
        ref = materialize_row([Segment(d, o, o + n) for _, d, o, n in segs], lambda d: torch.as_tensor(docs[d]),
                              pad_to=16)  # fmt: skip
        for key in ("input_ids", "position_ids", "labels", "doc_ids"):
            torch.testing.assert_close(row[key], ref[key], rtol=0, atol=0, msg=key)
        assert row["seqlens"] == ref["seqlens"]


def test_a_batch_at_once_equals_its_rows_one_by_one(tmp_path):
    a, _ = _write(tmp_path, "ga", [0, 5, 40, 0, 0, 3, 100, 1, 0, 17, 60, 0], seed=1)
    b, _ = _write(tmp_path, "gb", [33, 0, 2, 2, 2, 90], seed=2)
    ds = BlendedTokens([a, b], weights=[0.6, 0.4], seq_len=16, seed=4)
    positions = [0, 7, 3, 3, 25, 11, 2, 40, 19, 1]  # both corpora, their short last samples, a repeat, epoch 2
    batch = ds.__getitems__(positions)
    for i, row in zip(positions, batch, strict=True):
        ref = ds[i]
        for key in ("input_ids", "position_ids", "labels", "doc_ids"):
            torch.testing.assert_close(row[key], ref[key], rtol=0, atol=0, msg=f"{key} of position {i}")
        assert row["seqlens"] == ref["seqlens"]
    c, s = ds.locate(positions)
    assert [ds.locate_one(i) for i in positions] == list(zip(c.tolist(), s.tolist(), strict=True))
    # the batch collated from its grids in one piece equals the rows one by one through collate_rows' own path
    from lightning_v17.data.packing import collate_rows

    whole, ref = collate_rows(batch), collate_rows([ds[i] for i in positions])
    assert whole.keys() == ref.keys()
    for key in ("input_ids", "position_ids", "labels", "doc_ids", "cu_seqlens"):
        torch.testing.assert_close(whole[key], ref[key], rtol=0, atol=0, msg=key)
    assert whole["max_seqlen"] == ref["max_seqlen"]


def _tokens_of(ds, positions):
    """(corpus, document, offset) of every token of the given positions, from the index's own chunk list."""
    out = []
    for i in positions:
        for c, d, o, n in ds.segments(int(i)):
            out += [(c, d, o + k) for k in range(n)]
    return out


def _all_tokens(corpora):
    return [(c, d, k) for c, docs in enumerate(corpora) for d, doc in enumerate(docs) for k in range(len(doc))]


def _run(ds, world, batch, state, steps=None):
    """Global batches (sorted positions per step) from `world` samplers resumed from `state`; the new state."""
    samplers = [PositionSampler(len(ds), num_replicas=world, rank=r, drop_last=False) for r in range(world)]
    for s in samplers:
        if state:
            s.load_state_dict(state)
    its = [iter(s) for s in samplers]
    out, done = [], 0
    while steps is None or done < steps:
        step = []
        for it in its:
            step += [p for _, p in zip(range(batch), it, strict=False)]
        if not step:
            break
        out.append(sorted(step))
        done += 1
    return out, samplers[0].state_dict(consumed_groups=done * batch)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lengths=st.lists(st.lists(st.integers(0, 40), min_size=1, max_size=12), min_size=3, max_size=3),
    steps=st.tuples(st.integers(0, 6), st.integers(0, 6)),
    seed=st.integers(0, 3),
)
def test_resume_2_then_3_then_1_keeps_the_global_order_and_sees_every_token_once(tmp_path, lengths, steps, seed):
    lengths = [ls if sum(ls) else [*ls, 1] for ls in lengths]  # a corpus needs a token
    paths, corpora = zip(*(_write(tmp_path, f"c{seed}{i}", ls, seed=i) for i, ls in enumerate(lengths)), strict=True)
    ds = BlendedTokens(list(paths), seq_len=8, seed=seed)
    reference, _ = _run(ds, world=2, batch=3, state=None)  # uninterrupted, global batch 6
    part1, state = _run(ds, world=2, batch=3, state=None, steps=steps[0])
    part2, state = _run(ds, world=3, batch=2, state=state, steps=steps[1])
    part3, _ = _run(ds, world=1, batch=6, state=state)
    assert part1 + part2 + part3 == reference
    seen = [p for step in reference for p in step]
    assert sorted(seen) == list(range(len(ds)))
    tokens = _tokens_of(ds, seen)
    assert Counter(tokens) == Counter(_all_tokens(corpora)), "a token seen twice or skipped"


def test_weights_are_honoured_within_one_percent_over_100k_samples(tmp_path):
    paths = [_write(tmp_path, f"w{i}", [50] * (i + 1) * 20, seed=i)[0] for i in range(3)]
    weights = [0.6, 0.3, 0.1]
    ds = BlendedTokens(paths, weights=weights, seq_len=16, num_samples=100_000)
    corpus, sample = ds.locate(np.arange(100_000))
    frac = np.bincount(corpus, minlength=3) / 100_000
    np.testing.assert_allclose(frac, weights, atol=0.01)
    for c in range(3):  # each corpus cycles through all its samples before repeating one (epochs of its own)
        n = ds.corpora[c].num_samples
        draws = sample[corpus == c]
        full = len(draws) // n
        for e in range(full):
            assert sorted(draws[e * n : (e + 1) * n]) == list(range(n))


def test_a_declared_mixture_change_repeats_nothing_and_follows_the_new_weights(tmp_path):
    paths = [_write(tmp_path, f"m{i}", [30] * 400, seed=i)[0] for i in range(2)]
    old = BlendedTokens(paths, weights=[0.5, 0.5], seq_len=16)  # 750 samples per corpus
    state, at = old.index_state(), 600
    seen = set(zip(*old.locate(np.arange(at)), strict=True))

    new = BlendedTokens(paths, weights=[0.8, 0.2], seq_len=16)
    with pytest.raises(ValueError, match=r"data.weights \[0.5, 0.5\] -> \[0.8, 0.2\].*mixture_change=true"):
        new.load_index_state(state, position=at)
    new.load_index_state(state, position=at, mixture_change=True)
    corpus, sample = new.locate(np.arange(at, at + 500))
    np.testing.assert_allclose(np.bincount(corpus) / 500, [0.8, 0.2], atol=0.01)
    after = list(zip(corpus.tolist(), sample.tolist(), strict=True))
    assert not seen & set(after), "a sample seen before the change came again"
    # each corpus had drawn 300 of its 750 by position 600; 400 and 100 more stay inside its first epoch
    assert len(set(after)) == len(after)
    # the same resume again (a restart after the change) continues the same order
    again = BlendedTokens(paths, weights=[0.8, 0.2], seq_len=16)
    again.load_index_state(new.index_state(), position=at + 500)
    np.testing.assert_array_equal(again.locate(np.arange(at, at + 500))[1], sample)


def test_a_changed_corpus_or_seq_len_is_refused_naming_it(tmp_path):
    path, _ = _write(tmp_path, "x", [10, 20])
    state = BlendedTokens([path], seq_len=8).index_state()
    with pytest.raises(ValueError, match="seq_len=8 but this run has seq_len=16"):
        BlendedTokens([path], seq_len=16).load_index_state(state, position=2)
    _write(tmp_path, "x", [10, 20, 5])
    with pytest.raises(ValueError, match=r"x changed since the checkpoint \(2 -> 3 documents, 30 -> 35 tokens\)"):
        BlendedTokens([path], seq_len=8).load_index_state(state, position=2, mixture_change=True)


def test_bad_weights_are_named(tmp_path):
    path, _ = _write(tmp_path, "y", [10])
    with pytest.raises(ValueError, match="data.weights has 1 entries but data.paths has 2"):
        BlendedTokens([path, path], weights=[1.0])
    with pytest.raises(ValueError, match="must sum to a positive number"):
        BlendedTokens([path], weights=[0.0])


@pytest.mark.parametrize("coarse", [2, 3, 7, 1 << 17])
def test_the_document_search_equals_searchsorted_over_the_pointers(tmp_path, monkeypatch, coarse):
    from lightning_v17.data import sources

    monkeypatch.setattr(sources, "_COARSE_POINTERS", coarse)  # strides 1 (the whole array) to ~20 pointers per step
    rng = np.random.default_rng(5)
    path, _ = _write(tmp_path, "s", [0, 0, *rng.integers(0, 9, 60).tolist(), 0], seed=5)
    ds = BlendedTokens([path], seq_len=8)
    source = ds.corpora[0].source
    starts = np.array(source.reader.sequence_pointers) // 2  # an aligned copy, in tokens: what numpy would search
    q = np.arange(-1, int(starts[-1]) + 4)
    np.testing.assert_array_equal(source.count_le(q), np.searchsorted(starts, q, side="right"))


def test_sampler_batches_through_a_dataloader_equal_the_rows_one_by_one(tmp_path, monkeypatch):
    """The batch path as the data module drives it (PositionSampler, DataLoader, __getitems__, collate_rows) over
    located blocks smaller than an epoch, a coarse document search, 3 ranks, two epochs and a resume after a
    mixture change that re-indexes from its position: every batch equals collate_rows of __getitem__'s rows."""
    import pickle

    from torch.utils.data import DataLoader

    from lightning_v17.data import blend, sources
    from lightning_v17.data.packing import collate_rows

    monkeypatch.setattr(blend, "_LOCATE_BLOCK", 5)
    monkeypatch.setattr(sources, "_COARSE_POINTERS", 3)
    a, _ = _write(tmp_path, "da", [0, 5, 40, 0, 0, 3, 100, 1, 0, 17, 60, 0], seed=1)
    b, _ = _write(tmp_path, "db", [33, 0, 2, 2, 2, 90, 0], seed=2)

    def check(ds, sampler, label):
        loader = DataLoader(ds, batch_size=4, sampler=sampler, collate_fn=collate_rows)
        idx = iter(DataLoader(range(10**9), batch_size=4, sampler=sampler))  # the same positions, as a list
        n = 0
        for batch, positions in zip(loader, idx, strict=True):
            ref = collate_rows([ds[int(i)] for i in positions])
            assert batch.keys() == ref.keys()
            for key in ("input_ids", "position_ids", "labels", "doc_ids", "cu_seqlens"):
                torch.testing.assert_close(batch[key], ref[key], rtol=0, atol=0, msg=f"{label}: {key} at {positions}")
            assert batch["max_seqlen"] == ref["max_seqlen"]
            n += 1
        assert n >= 2, label

    ds = BlendedTokens([a, b], weights=[0.6, 0.4], seq_len=16, seed=4)
    for rank in range(3):
        sampler = PositionSampler(len(ds), num_replicas=3, rank=rank, drop_last=False)
        for epoch in (0, 1):
            sampler.set_epoch(epoch)
            check(ds, sampler, f"rank {rank} epoch {epoch}")
    # A resume under reordered paths keeps no earlier phase: positions start at the saved one, mid-block.
    moved = BlendedTokens([b, a], weights=[0.5, 0.5], seq_len=16, seed=4)
    moved.load_index_state(ds.index_state(), position=7, mixture_change=True)
    sampler = PositionSampler(len(moved), num_replicas=2, rank=1, drop_last=False)
    sampler.load_state_dict({**sampler.state_dict(), "consumed": 7})
    check(moved, sampler, "after the mixture change")
    with pytest.raises(IndexError, match="precede this run's resume point"):
        moved.__getitems__(range(5, 9))
    # DataLoader workers get the index without the per-process caches, and the same batches
    clone = pickle.loads(pickle.dumps(ds))
    assert not {"_locate_cache", "_arange_cache"} & set(vars(clone))
    assert ds.corpora[0].source.__getstate__() == {"path": a}  # re-opened from its path, never the maps copied
    torch.testing.assert_close(collate_rows(clone.__getitems__(range(3, 30, 3)))["labels"],
                               collate_rows(ds.__getitems__(range(3, 30, 3)))["labels"], rtol=0, atol=0)  # fmt: skip
