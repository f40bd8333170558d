"""The per-round store prefix of elastic restarts (``lightning_v17.resilience.elastic.agree_on_generation``) on a real
TCPStore that keeps the keys of earlier rounds, as torchrun's agent store does.

Each round's ranks are threads with their own store clients. A round must give one token to all its ranks, and a
token no earlier round gave, whatever the order in which the ranks arrive: a rank that starts late makes rank 0 first
read the previous round's ``hello`` of that rank (stale), which must not fool it.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from lightning_v17.resilience.elastic import agree_on_generation


def _round(port: int, world: int, delays: dict[int, float]) -> list[str]:
    tokens: list[str | None] = [None] * world
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            time.sleep(delays.get(r, 0.0))
            store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=20))
            tokens[r] = agree_on_generation(store, rank=r, world_size=world, timeout=timedelta(seconds=20))
        except BaseException as err:  # noqa: BLE001 - re-raised in the test
            errors.append(err)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return tokens  # type: ignore[return-value]


@pytest.mark.timeout(60)
def test_each_round_agrees_on_a_fresh_token_despite_stale_keys():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=20))
    seen: list[str] = []
    rounds = [
        (3, {}),
        (3, {2: 0.3}),  # rank 2 late: rank 0 first answers round 1's hello of rank 2
        (2, {0: 0.3}),  # rank 0 late: rank 1 must not take round 2's token/1 for its own
        (3, {1: 0.2, 2: 0.4}),  # grown back; both late
    ]
    for world, delays in rounds:
        tokens = _round(server.port, world, delays)
        assert len(set(tokens)) == 1, (world, delays, tokens)
        assert tokens[0] not in seen, (world, delays, tokens, seen)
        seen.append(tokens[0])


@pytest.mark.timeout(60)
def test_a_missing_rank_is_named_after_the_timeout():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=20))
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[2\] of this elastic round \(world size 3\) did not join"):
        client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=20))
        threads = [threading.Thread(target=agree_on_generation, args=(client,),
                                    kwargs={"rank": 1, "world_size": 3, "timeout": timedelta(seconds=1)})]  # fmt: skip
        threads[0].start()
        try:
            agree_on_generation(server, rank=0, world_size=3, timeout=timedelta(seconds=1))
        finally:
            threads[0].join(10)
    assert time.monotonic() - t0 < 5
