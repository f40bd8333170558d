"""V17Strategy's world group: its creation (:func:`init_world`) and Lightning's ``barrier`` / ``broadcast`` /
``reduce`` over it, on gloo and NCCL."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.strategies.strategy import TBroadcast
from torch import Tensor

from lightning_v17.resilience.elastic import elastic_attempt, init_elastic_process_group


def init_world(
    cluster_environment: Any, backend: str | None, *, device: torch.device, rank: int, world_size: int,
    timeout: timedelta | None,
) -> str:  # fmt: skip
    """Create the world process group and return its backend (None: picked from ``device``, as Lightning does).

    Under torchrun every restart attempt shares the agent's store, so each attempt's keys are kept apart
    (``resilience/elastic.py``); otherwise Lightning's own connection over the cluster environment.
    """
    backend = backend or _get_default_process_group_backend_for_device(device)
    kwargs: dict[str, Any] = {"timeout": timeout}
    if device.type != "cpu":
        kwargs["device_id"] = device
    if elastic_attempt() is not None and not torch.distributed.is_initialized():
        init_elastic_process_group(backend, rank=rank, world_size=world_size, **kwargs)
    else:
        _init_dist_connection(cluster_environment, backend, **kwargs)
    return backend


class WorldCollectives:
    """Mixed into V17Strategy ahead of ``ParallelStrategy``: collectives over the whole world, for Lightning."""

    root_device: torch.device
    _process_group_backend: str | None

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    @property
    def is_distributed(self) -> bool:
        """Lightning asks this of custom strategies to decide on a DistributedSampler (it knows only its own)."""
        return True

    def barrier(self, name: str | None = None) -> None:
        if not _distributed_is_initialized():
            return
        if torch.distributed.get_backend() == "nccl":
            torch.distributed.barrier(device_ids=[self.root_device.index])
        else:
            torch.distributed.barrier()

    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src, group=_group.WORLD)
        return box[0]

    def reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

