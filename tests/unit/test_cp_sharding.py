"""Sequence sharding for context parallelism (``lightning_v17.engine.cp.sharding``), pure (no processes).

* every layout is a partition of the tokens with equal shards, and :meth:`SequenceLayout.unshard` is the exact
  inverse of :meth:`SequenceLayout.shard` (bitwise), as are ``to_true_order`` / ``to_shard_order``;
* attention work (earlier tokens of the same document) is checked against a brute-force count;
* balance on seeded random packed batches: the packed-aware assignment keeps max/mean <= 1.05 at cp 2, 4 and 8
  while head-tail and no balancing are well above it (both printed); head-tail is exact on one causal document;
* labels shifted on the full rows keep every target at the shard boundaries, shifting per shard loses them;
* ``shard_batch`` keeps global positions and the documents of the full rows; bad sizes name the fix;
* the scheme choice follows ``cp > (Hq + Hkv) / Hkv``.
"""

from __future__ import annotations

import pytest
import torch

from lightning_v17.config import V17ConfigError
from lightning_v17.engine.cp import (
    CPMode,
    SequenceLayout,
    attention_work,
    balance_ratio,
    check_ulysses_heads,
    choose_cp_mode,
    cp_comm_elements,
    cu_seqlens_from_segment_ids,
    make_layout,
    segment_ids_from_position_ids,
    shard_batch,
    shift_labels,
    token_work,
)


def _packed_positions(b: int, s: int, mean: float, gen: torch.Generator) -> torch.Tensor:
    """Rows of documents with exponentially distributed lengths (mean ``mean``), cut at the row end."""
    rows = []
    for _ in range(b):
        pos: list[int] = []
        while len(pos) < s:
            pos += range(int(torch.empty(1).exponential_(1 / mean, generator=gen)) + 1)
        rows.append(pos[:s])
    return torch.tensor(rows)


LAYOUTS = [("none", 1), ("head_tail", 1), ("packed", 4), ("packed", 8)]


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize(("balance", "per_rank"), LAYOUTS)
def test_shard_and_unshard_are_exact_inverses(cp, balance, per_rank) -> None:
    gen = torch.Generator().manual_seed(cp)
    s = 16 * cp * 8
    pos = _packed_positions(2, s, 40, gen)
    layout = make_layout(s, cp, balance, position_ids=pos, chunks_per_rank=per_rank)
    x = torch.randn(2, s, 3, generator=gen, dtype=torch.float64)
    shards = [layout.shard(x, r) for r in range(cp)]
    assert all(t.shape == (2, s // cp, 3) for t in shards)
    assert torch.equal(layout.unshard(shards), x)
    owned = torch.cat([layout.token_index(r) for r in range(cp)])
    assert torch.equal(owned.sort().values, torch.arange(s))  # a partition of the tokens
    assert torch.equal(layout.to_true_order(layout.to_shard_order(x)), x)
    assert torch.equal(layout.to_shard_order(x), torch.cat(shards, dim=1))  # what an all-gather lays out
    for r in range(cp):  # local order is ascending token order within a rank
        idx = layout.token_index(r)
        assert torch.equal(idx, idx.sort().values)


def test_head_tail_takes_chunk_r_and_its_mirror() -> None:
    layout = make_layout(16, 4, "head_tail")
    assert layout.chunks == ((0, 7), (1, 6), (2, 5), (3, 4))
    assert layout.token_index(1).tolist() == [2, 3, 12, 13]
    assert make_layout(16, 4, "none").chunks == ((0,), (1,), (2,), (3,))


def test_token_work_counts_earlier_tokens_of_the_same_document() -> None:
    gen = torch.Generator().manual_seed(3)
    pos = _packed_positions(3, 50, 7, gen)
    seg = segment_ids_from_position_ids(pos)
    brute = torch.zeros(50, dtype=torch.long)
    for b in range(3):
        for t in range(50):
            brute[t] += int((seg[b, :t] == seg[b, t]).sum())
    assert torch.equal(token_work(seg), brute)
    assert torch.equal(token_work(None, 5), torch.arange(5))
    # documents restart where position_ids are 0, and at every row start
    assert segment_ids_from_position_ids(torch.tensor([[3, 4, 0, 1, 0]])).tolist() == [[0, 0, 1, 1, 2]]
    assert cu_seqlens_from_segment_ids(torch.tensor([[0, 0, 1], [0, 1, 1]])).tolist() == [0, 2, 3, 4, 6]


def test_head_tail_balances_one_causal_document_exactly() -> None:
    for cp in (2, 4, 8):
        assert balance_ratio(make_layout(1024, cp, "head_tail")) == 1.0
        assert balance_ratio(make_layout(1024, cp, "none")) > 1.5


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_packed_assignment_keeps_the_work_within_5_percent(cp, capsys) -> None:
    gen = torch.Generator().manual_seed(10 + cp)
    ratios: dict[str, list[float]] = {"none": [], "head_tail": [], "packed": []}
    for s, mean in ((4096, 700), (4096, 1500), (8192, 3000), (2048, 300)):
        for _ in range(4):
            seg = segment_ids_from_position_ids(_packed_positions(2, s, mean, gen))
            for balance, got in ratios.items():
                layout = make_layout(s, cp, balance, segment_ids=seg)
                got.append(balance_ratio(layout, seg))
                work = attention_work(layout, seg)
                assert int(work.sum()) == int(token_work(seg).sum())  # every token's work counted once
    worst = {k: max(v) for k, v in ratios.items()}
    mean = {k: sum(v) / len(v) for k, v in ratios.items()}
    with capsys.disabled():
        print(f"\ncp={cp} max/mean attention work over 16 packed batches: worst {worst}, mean {mean}")
    assert worst["packed"] <= 1.05
    assert mean["head_tail"] > 1.05 and mean["none"] > 1.05  # the spread the assignment removes


def test_shift_labels_before_sharding_keeps_the_boundary_targets() -> None:
    tokens = torch.arange(100, 116).view(1, 16)
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3]])
    labels = shift_labels(tokens, position_ids=pos)
    assert labels[0, -1] == -100 and labels[0, 4] == -100 and labels[0, 11] == -100  # row end, document ends
    assert labels[0, 3] == 104 and labels[0, 7] == 108  # the target of token 7 (a shard's last) is token 8
    assert int((shift_labels(tokens) != -100).sum()) == 15
    layout = make_layout(16, 2, "head_tail")
    kept = sum(int((layout.shard(labels, r) != -100).sum()) for r in range(2))
    per_shard = sum(int((shift_labels(layout.shard(tokens, r), position_ids=layout.shard(pos, r)) != -100).sum())
                    for r in range(2))  # fmt: skip
    assert kept == 16 - 3 and per_shard < kept  # shifting each shard drops targets across its chunk ends


def test_shard_batch_keeps_global_positions_and_full_documents() -> None:
    gen = torch.Generator().manual_seed(0)
    pos = _packed_positions(2, 64, 9, gen)
    tokens = torch.randint(0, 50, (2, 64), generator=gen)
    batch = {"input_ids": tokens, "position_ids": pos, "labels": shift_labels(tokens, position_ids=pos),
             "cu_seqlens": torch.tensor([0, 128], dtype=torch.int32), "note": "kept"}  # fmt: skip
    parts = [shard_batch(batch, cp=4, rank=r, balance="packed") for r in range(4)]
    layout = parts[0].layout
    assert all(p.layout == layout for p in parts)  # every rank computes the same assignment
    for key in ("input_ids", "position_ids", "labels"):
        assert torch.equal(layout.unshard([p.local[key] for p in parts]), batch[key])
    assert "cu_seqlens" not in parts[0].local and parts[0].local["note"] == "kept"
    assert torch.equal(parts[0].segment_ids, segment_ids_from_position_ids(pos))
    plain = shard_batch({"input_ids": tokens}, cp=2, rank=1, balance="head_tail")
    assert plain.segment_ids is None and plain.local["position_ids"][0].tolist() == [*range(16, 32), *range(32, 48)]


def test_bad_sizes_name_the_fix() -> None:
    with pytest.raises(V17ConfigError, match="multiple of 8.*pad the rows to 104"):
        make_layout(100, 4, "head_tail")
    with pytest.raises(V17ConfigError, match="multiple of 32"):
        make_layout(48, 4, "packed")
    with pytest.raises(V17ConfigError, match="zigzag.*not supported"):
        make_layout(64, 2, "zigzag")
    with pytest.raises(ValueError, match="equally many chunks"):
        SequenceLayout(12, ((0, 1), (2,)))


def test_scheme_choice_follows_the_communication_volume() -> None:
    # Llama-3-8B: Hq=32, Hkv=8: ulysses moves less only for cp > (32 + 8) / 8 = 5
    assert choose_cp_mode("auto", cp=4, heads=32, kv_heads=8) is CPMode.ALLGATHER
    assert choose_cp_mode("auto", cp=8, heads=32, kv_heads=8) is CPMode.ULYSSES
    assert choose_cp_mode("auto", cp=16, heads=32, kv_heads=8) is CPMode.ULYSSES  # KV heads replicated
    assert choose_cp_mode("auto", cp=3, heads=32, kv_heads=8) is CPMode.ALLGATHER  # ulysses impossible
    dims = {"seq_len": 8192, "heads": 32, "kv_heads": 8, "head_dim": 128}
    assert cp_comm_elements("ulysses", cp=8, **dims) == (64 + 16) * 128 * 1024 * 7 / 8
    assert cp_comm_elements("allgather", cp=8, **dims) == 16 * 128 * 8192 * 7 / 8
    assert check_ulysses_heads(4, 8, 2) == 2 and check_ulysses_heads(2, 8, 2) == 1
    with pytest.raises(V17ConfigError, match=r"CPPolicy\(mode='allgather'\)"):
        choose_cp_mode("ulysses", cp=3, heads=32, kv_heads=8)
    with pytest.raises(V17ConfigError, match="multiple of them"):
        check_ulysses_heads(4, 8, 3)
    with pytest.raises(V17ConfigError, match="ring.*not built"):
        CPMode.parse("ring")
