"""The nvme tier's file I/O behind one protocol, and the choice of backend for a tier folder.

Two backends implement :class:`TierIO`: :class:`~lightning_v17.engine.offload.nvme.ThreadPoolIO` (``os.pwrite`` /
``os.preadv`` on threads, always available) and :class:`~lightning_v17.engine.offload.aio.AioIO` (DeepSpeed's
``async_io`` op: libaio, O_DIRECT; it needs the Debian package ``libaio-dev``). :func:`open_io` picks one per folder.
It lives here, not beside either backend, so that neither imports the other.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Protocol

import torch

__all__ = ["TierIO", "open_io"]


class TierIO(Protocol):
    """What the optimizer and parameter tiers ask of a backend: asynchronous whole-tensor file I/O."""

    name: str
    bytes_read: int
    bytes_written: int

    def alloc(self, nbytes: int) -> torch.Tensor: ...

    def free(self, t: torch.Tensor) -> None: ...

    def write(self, path: Path, t: torch.Tensor, offset: int | None = None) -> Future: ...

    def read(self, path: Path, nbytes: int) -> Future: ...

    def read_into(self, path: Path, t: torch.Tensor, offset: int = 0, *, after: Sequence[Future] = ()) -> Future: ...

    def close(self) -> None: ...


def open_io(folder: str | os.PathLike) -> tuple[TierIO, str]:
    """The I/O backend for a tier folder and why: DeepSpeed's ``async_io`` op when it builds and an O_DIRECT round
    trip works in ``folder``, else the thread pool, with the reason the op is not used."""
    from lightning_v17.engine.offload.aio import aio_backend_or_reason
    from lightning_v17.engine.offload.nvme import ThreadPoolIO

    aio, reason = aio_backend_or_reason(folder)
    if aio is not None:
        return aio, reason
    return ThreadPoolIO(), reason
