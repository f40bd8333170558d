"""V17Strategy's world group: its creation (:func:`init_world`) and Lightning's ``barrier`` / ``broadcast`` /
``reduce`` over it, on gloo and NCCL."""

from __future__ import annotations

import atexit
import sys
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

from lightning_v17.mesh import destroy_process_groups
from lightning_v17.resilience.elastic import elastic_attempt, init_elastic_process_group


def init_world(
    cluster_environment: Any, backend: str | None, *, device: torch.device, rank: int, world_size: int,
    timeout: timedelta | None,
) -> str:  # fmt: skip
    """Create the world process group and return its backend (None: picked from ``device``, as Lightning does).

    Under torchrun every restart attempt shares the agent's store, so each attempt's keys are kept apart
    (``resilience/elastic.py``); otherwise Lightning's own connection over the cluster environment. A group created
    here is destroyed when the interpreter exits (:func:`destroy_groups_at_exit`); one the caller created is theirs.
    """
    backend = backend or _get_default_process_group_backend_for_device(device)
    kwargs: dict[str, Any] = {"timeout": timeout}
    if device.type != "cpu":
        kwargs["device_id"] = device
    created = not torch.distributed.is_initialized()
    if elastic_attempt() is not None and created:
        init_elastic_process_group(backend, rank=rank, world_size=world_size, **kwargs)
    else:
        _init_dist_connection(cluster_environment, backend, **kwargs)
    if created:
        destroy_groups_at_exit()
    return backend


_EXIT_HOOK: list[bool] = []  # one hook per process, however many fits initialize the world


def destroy_groups_at_exit() -> None:
    """Destroy the process groups from an ``atexit`` hook (:func:`lightning_v17.mesh.destroy_process_groups`), once per
    process.

    Why: a gloo worker thread drops its reference to a finished collective's tensors only after the caller has
    returned. When that reference is the last one to a tensor whose Python object outlived the caller's, dropping it
    takes the GIL; if the interpreter is already finalizing by then, CPython ends the thread with ``pthread_exit``,
    whose unwinding through the tensor's ``noexcept`` destructor calls ``std::terminate``: "terminate called without an
    active exception", exit code 134, after a run that trained correctly (gdb: ``ProcessGroupGloo::runLoop`` ->
    ``~AsyncAllreduceWork`` -> ``TensorImpl::decref_pyobject`` -> ``take_gil`` -> ``pthread_exit``; the report of
    pytorch/pytorch#190489). The groups stay alive after ``fit`` on purpose (the parameters' DTensors gather over
    them), so they go at exit: ``atexit`` hooks run before finalization, and a destroyed gloo group joins its workers
    while the interpreter still serves them. Lightning does the same for NCCL groups only.

    After an uncaught exception the groups are left to the process's end instead: a gloo group's destructor joins its
    workers, and one still inside a collective whose peer lives on would hold the exit until the group's timeout.
    """
    if not _EXIT_HOOK:
        _EXIT_HOOK.append(True)
        atexit.register(_destroy_groups)


def _destroy_groups() -> None:
    if getattr(sys, "last_value", None) is not None:  # exiting on an uncaught exception (see destroy_groups_at_exit)
        return
    destroy_process_groups()


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
