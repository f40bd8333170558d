"""Rows under tensor parallelism's sequence parallelism (beside cp or not) must split evenly over the tp ranks: the
lengths the strategy refuses before the first forward, and the length its error says to pad to."""

from __future__ import annotations

import pytest

from lightning_v17.config import V17ConfigError
from lightning_v17.engine.cp import check_sequence_parallel_split, make_layout, sequence_multiple


@pytest.mark.parametrize(("cp", "tp", "balance", "need"), [
    (1, 2, "head_tail", 2), (2, 2, "head_tail", 4), (2, 4, "head_tail", 8), (4, 2, "head_tail", 8),
    (2, 2, "none", 4), (2, 3, "head_tail", 12), (2, 4, "packed", 16),
])  # fmt: skip
def test_the_multiple_covers_the_cp_layout_and_the_tp_split(cp, tp, balance, need) -> None:
    assert sequence_multiple(cp, balance, chunks_per_rank=8 if balance == "packed" else 1, tp=tp) == need
    make_layout(need * 3, cp, balance, chunks_per_rank=8)  # a multiple is a valid cp layout ...
    check_sequence_parallel_split(need * 3, cp=cp, tp=tp, balance=balance)  # ... that tp splits evenly


def test_an_uneven_tp_split_is_refused_with_the_length_to_pad_to() -> None:
    check_sequence_parallel_split(32, cp=2, tp=2)
    # 40 tokens make a head_tail layout over cp=2 (a multiple of 4), but 20 per cp rank do not split over tp=8
    with pytest.raises(V17ConfigError, match=r"TPPolicy\(sequence_parallel=True\) with tp=8 .* 20 tokens .* "
                                             r"multiple of 16 tokens"):  # fmt: skip
        check_sequence_parallel_split(40, cp=2, tp=8)
    with pytest.raises(V17ConfigError, match=r"multiple of 2 tokens"):  # no cp: S itself over tp
        check_sequence_parallel_split(7, cp=1, tp=2)
