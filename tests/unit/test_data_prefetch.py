"""PackedDataModule's prefetch thread (issue 16): packing and collation run ahead of the step, off the training thread.

The documents are served by a dataset that records which thread materializes each one and when; the test consumes
one batch, then waits (as a training step would) and checks that the next batches were built meanwhile, on the
prefetch thread, and that the batches are identical to the ones built on demand (``prefetch_batches=0``). The
resume position is counted from batches trained on (``tests/unit/test_datamodule.py`` checks a mid-epoch resume
through a real checkpoint, with the prefetch thread on by default).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch.utils.data import Dataset

from lightning_v17.data.datamodule import PackedDataModule


class _Docs(Dataset):
    def __init__(self, n: int = 48) -> None:
        g = torch.Generator().manual_seed(0)
        self.docs = [
            torch.randint(0, 256, (int(torch.randint(3, 30, (1,), generator=g)),), generator=g) for _ in range(n)
        ]
        self.log: list[tuple[str, int]] = []

    def __len__(self) -> int:
        return len(self.docs)

    def lengths(self) -> list[int]:
        return [len(d) for d in self.docs]

    def __getitem__(self, i: int) -> torch.Tensor:
        self.log.append((threading.current_thread().name, i))
        return self.docs[i]


def _batches(prefetch: int) -> tuple[list[dict], _Docs, int]:
    """All batches of one epoch, the dataset (with its log) and how many documents had been materialized when the
    consumer, busy after its first batch (as with a training step), asked for the second one."""
    docs = _Docs()
    dm = PackedDataModule(docs, seq_len=32, batch_size=2, shuffle=True, prefetch_batches=prefetch)
    it = iter(dm.train_dataloader())
    out = [next(it)]
    seen, deadline = -1, time.monotonic() + 5.0
    while len(docs.log) != seen and time.monotonic() < deadline:  # until the producer stops (its queue is full)
        seen = len(docs.log)
        time.sleep(0.2)
    made_before_second = len(docs.log)
    out += list(it)
    return out, docs, made_before_second


def test_batches_are_built_ahead_on_the_prefetch_thread_and_unchanged() -> None:
    ahead, docs, made = _batches(prefetch=2)
    on_demand, docs0, made0 = _batches(prefetch=0)
    assert len(ahead) == len(on_demand) > 4
    for a, b in zip(ahead, on_demand):
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k], k
    assert [i for _, i in docs.log] == [i for _, i in docs0.log]  # the same documents, in the same order
    assert {name for name, _ in docs.log} == {"v17-data-prefetch"}, set(docs.log)
    assert {name for name, _ in docs0.log} == {threading.current_thread().name}
    # on demand, only batch 0's documents exist when batch 1 is asked for; with the thread, batches 1-2 (the queue's
    # depth) and the one it is blocked on were built while the consumer was busy
    assert made > made0, (made, made0)


def test_producer_errors_reach_the_consumer_and_bad_depth_is_refused() -> None:
    class Broken(_Docs):
        def __getitem__(self, i: int) -> torch.Tensor:
            raise RuntimeError("corrupt document 7")

    dm = PackedDataModule(Broken(), seq_len=32, batch_size=2, prefetch_batches=2)
    with pytest.raises(RuntimeError, match="corrupt document 7"):
        next(iter(dm.train_dataloader()))
    with pytest.raises(ValueError, match="prefetch_batches=-1 must be >= 0"):
        PackedDataModule(_Docs(), prefetch_batches=-1)
