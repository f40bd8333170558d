"""An optimizer's offload tier by the optimizer itself: :func:`attach_offload` puts its state on a tier
(:class:`~lightning_v17.engine.offload.optimizer.OptimizerOffload`), :func:`offload_of` finds the live tier again and
:func:`materialized` brings the state back for a state-dict read or load."""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

from lightning_v17.config import HostMemory, Tier
from lightning_v17.engine.offload.optimizer import OptimizerOffload
from lightning_v17.engine.state import optimizer_state

__all__ = ["attach_offload", "materialized", "offload_of"]


def attach_offload(
    optimizer: Any,
    *,
    tier: Tier | str,
    nvme_path: str | None = None,
    ratio: float = 1.0,
    rank: int = 0,
    chunk_mb: float = 4.0,
    buffer_count: int = 2,
    params: Any = None,
    host_memory: HostMemory | str | None = None,
) -> OptimizerOffload:
    """Put ``optimizer``'s state on ``tier`` (see :class:`OptimizerOffload`); a ``LightningOptimizer`` is unwrapped.

    Raises:
        V17ConfigError: an unusable ``nvme_path`` (missing, unwritable, too little free space), a bad ratio, or
            parameters on an accelerator.
    """
    opt = getattr(optimizer, "_optimizer", optimizer)
    existing = optimizer_state(opt).offload
    if existing is not None and not existing.closed:
        return existing
    return OptimizerOffload(
        opt, tier=Tier.parse(tier, "OffloadPolicy(optimizer=...)"), nvme_path=nvme_path, ratio=ratio, rank=rank,
        chunk_mb=chunk_mb, buffer_count=buffer_count, params=params, host_memory=host_memory,
    )  # fmt: skip


def offload_of(optimizer: Any) -> OptimizerOffload | None:
    """The live :class:`OptimizerOffload` of ``optimizer`` (a ``LightningOptimizer`` is unwrapped), else None."""
    off = optimizer_state(optimizer).offload
    return off if off is not None and not off.closed else None


@contextmanager
def materialized(optimizer: Any) -> Generator[None, None, None]:
    """:meth:`OptimizerOffload.materialized` for ``optimizer``; nothing to do without offload. After teardown it raises
    if the optimizer's state was on nvme files (removed then) rather than handing out an empty state."""
    off = optimizer_state(optimizer).offload
    if off is None:
        yield
        return
    with off.materialized():
        yield
