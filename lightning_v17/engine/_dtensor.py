"""DTensor helpers shared by the engine, the optimizers and the trackers: this rank's piece of a tensor.

Two functions because there are two meanings. :func:`local` is ``DTensor.to_local()``: autograd sees it, so inside a
graph it is the differentiable local view (and, outside one, a view of the same storage). :func:`local_tensor` is
the DTensor's own local storage, with no autograd node: what an optimizer step, a reduction or a byte count reads and
writes in place. A plain tensor is its own local piece in both.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

__all__ = ["local", "local_tensor"]


def local(t: torch.Tensor) -> torch.Tensor:
    """``t.to_local()`` for a DTensor (a ZeRO-3 shard, a tensor-parallel piece), else ``t``."""
    return t.to_local() if isinstance(t, DTensor) else t


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local storage without an autograd node (``_local_tensor``), else ``t``."""
    return t._local_tensor if isinstance(t, DTensor) else t
