"""Elastic (torchrun) restarts: a process group that re-forms cleanly on every restart and every resize.

Torch-only, Lightning-free. Under ``torchrun`` the workers of every rendezvous round connect to the *same* TCPStore:
the one the rank-0 agent hosts and keeps across rounds (``TORCHELASTIC_USE_AGENT_STORE=True``). ``init_process_group``
namespaces its keys only by ``"default_pg"``, so the workers of round n+1 read what round n left there: gloo's
``connectFullMesh`` picks up the dead workers' addresses and fails with "Connection refused", or a store barrier counts
the previous round's arrivals and hangs (pytorch/pytorch#135712; measured here: 3 of 4 plain ``torchrun
--max-restarts 1`` restarts of a V17 job failed). Exporting ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in the launcher
avoids it, but users launch with plain torchrun.

So every round's keys go under their own prefix, ``v17/gen-<token>``. The token cannot be
``TORCHELASTIC_RESTART_COUNT``: that count is per agent, so after one node failed and a new one joined, the survivor's
workers are at attempt 1 and the newcomer's at attempt 0, and a group on two prefixes never forms (measured: the
resized group hung in ``init_process_group``). torchrun gives the workers nothing else that is shared and new per round
(the rendezvous round number stays inside the agents), so :func:`agree_on_generation` has the workers agree on a fresh
token over the store itself, with a handshake that stale keys of earlier rounds cannot fool: every rank publishes a
fresh nonce, rank 0 answers each rank's nonce with its own fresh token, and counts the ranks that acknowledged that
token. It relies on one property of the elastic agents: a round's workers start only after every worker of the
previous round has been stopped (a round completes when all its agents re-joined, and an agent stops its workers
before it re-joins).
"""

from __future__ import annotations

import os
import time
import uuid
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["agree_on_generation", "elastic_attempt", "init_elastic_process_group"]

_KEY = "v17/generation"


def elastic_attempt() -> int | None:
    """The torchelastic restart attempt of this worker's agent (0 for the first), or None when not launched by
    torchrun. Per agent: after a node was replaced, the agents' counts differ."""
    value = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    return int(value) if value not in (None, "") else None


def agree_on_generation(
    store: dist.Store, *, rank: int, world_size: int, timeout: timedelta, poll_s: float = 0.01
) -> str:
    """A token that every worker of this rendezvous round returns, and no worker of an earlier round ever saw.

    Keys of earlier rounds may still be in ``store``; only this round's ranks may be alive (see the module docstring).
    Rank r > 0 writes ``hello/r`` = a fresh nonce and waits until ``token/r`` starts with that nonce; rank 0 answers
    every ``hello/r`` it reads (possibly a stale one first, then the fresh one) with ``<nonce>:<its token>`` until each
    rank acknowledged the token in ``ack/r``. About 3 store round trips per rank.

    Args:
        store: the store shared by the workers (torchrun's agent store).
        rank: global rank of this worker.
        world_size: workers in this round.
        timeout: how long to wait for the other ranks; then a ``TimeoutError`` names the missing ranks.
        poll_s: seconds between two polls of the store.
    """
    nonce = uuid.uuid4().hex
    if world_size == 1:
        return nonce
    deadline = time.monotonic() + timeout.total_seconds()

    def get(key: str) -> str | None:
        return store.get(key).decode() if store.check([key]) else None

    if rank != 0:
        store.set(f"{_KEY}/hello/{rank}", nonce)
        while True:
            mine, _, token = (get(f"{_KEY}/token/{rank}") or "").partition(":")
            if mine == nonce:
                store.set(f"{_KEY}/ack/{rank}", token)
                return token
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"rank {rank}: rank 0 of this elastic round did not answer within {timeout} (is it alive? the "
                    "process-group timeout, V17Strategy(timeout=), bounds this wait)"
                )
            time.sleep(poll_s)
    relayed: dict[int, str] = {}
    pending = set(range(1, world_size))
    while pending:
        for r in sorted(pending):
            hello = get(f"{_KEY}/hello/{r}")
            if hello is not None and relayed.get(r) != hello:
                store.set(f"{_KEY}/token/{r}", f"{hello}:{nonce}")
                relayed[r] = hello
            if get(f"{_KEY}/ack/{r}") == nonce:
                pending.discard(r)
        if pending:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"rank 0: ranks {sorted(pending)} of this elastic round (world size {world_size}) did not join "
                    f"within {timeout}; the process-group timeout, V17Strategy(timeout=), bounds this wait"
                )
            time.sleep(poll_s)
    return nonce


def init_elastic_process_group(
    backend: str,
    *,
    rank: int,
    world_size: int,
    timeout: timedelta | None,
    device_id: torch.device | None = None,
) -> str:
    """``init_process_group`` on the launcher's store under a prefix of its own for this round; returns the prefix.

    Args:
        backend: "gloo" or "nccl".
        rank: global rank of this worker.
        world_size: number of workers in this round (it may differ from the previous round's: elastic).
        timeout: collective and store timeout (None: torch's default, 30 minutes).
        device_id: bind the group to this device (NCCL eager init), as Lightning does.
    """
    timeout = timeout or timedelta(minutes=30)  # torch's default collective timeout
    store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world_size, timeout=timeout))
    store.set_timeout(timeout)
    prefix = f"v17/gen-{agree_on_generation(store, rank=rank, world_size=world_size, timeout=timeout)}"
    kwargs = {"device_id": device_id} if device_id is not None else {}
    dist.init_process_group(
        backend, store=dist.PrefixStore(prefix, store), rank=rank, world_size=world_size, timeout=timeout, **kwargs
    )
    return prefix
