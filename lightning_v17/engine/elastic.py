"""Elastic (torchrun) restarts: a process group that re-forms cleanly on every restart attempt.

Torch-only, Lightning-free. Under ``torchrun`` the workers of every restart attempt connect to the *same* TCPStore,
the one the elastic agent hosts (``TORCHELASTIC_USE_AGENT_STORE=True``). ``init_process_group`` namespaces its keys
only by ``"default_pg"``, so the workers of attempt n+1 read what attempt n left there: gloo's ``connectFullMesh``
picks up the dead workers' addresses and fails with "Connection refused", or a store barrier counts the previous
attempt's arrivals and hangs (pytorch/pytorch#135712; measured here: 3 of 4 plain ``torchrun --max-restarts 1``
restarts of a V17 job failed). Exporting ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in the launcher avoids it, but
users launch with plain torchrun, so :func:`init_elastic_process_group` puts every attempt's keys under their own
prefix (``v17/attempt-<TORCHELASTIC_RESTART_COUNT>``) instead.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["elastic_attempt", "init_elastic_process_group"]


def elastic_attempt() -> int | None:
    """The torchelastic restart attempt of this worker (0 for the first), or None when not launched by torchrun."""
    value = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    return int(value) if value not in (None, "") else None


def init_elastic_process_group(
    backend: str,
    *,
    rank: int,
    world_size: int,
    timeout: timedelta | None,
    device_id: torch.device | None = None,
) -> str:
    """``init_process_group`` on the launcher's store under a per-attempt prefix; returns the prefix used.

    Args:
        backend: "gloo" or "nccl".
        rank: global rank of this worker.
        world_size: number of workers in this attempt (it may differ from the previous attempt's: elastic).
        timeout: collective and store timeout (None: torch's default, 30 minutes).
        device_id: bind the group to this device (NCCL eager init), as Lightning does.
    """
    attempt = elastic_attempt() or 0
    timeout = timeout or timedelta(minutes=30)  # torch's default collective timeout
    store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world_size, timeout=timeout))
    store.set_timeout(timeout)
    prefix = f"v17/attempt-{attempt}"
    kwargs = {"device_id": device_id} if device_id is not None else {}
    dist.init_process_group(
        backend, store=dist.PrefixStore(prefix, store), rank=rank, world_size=world_size, timeout=timeout, **kwargs
    )
    return prefix
