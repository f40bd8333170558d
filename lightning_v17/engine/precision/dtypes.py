"""The dtypes a mixed precision asks of the engine: what FSDP2 computes in and what the reductions run in."""

from __future__ import annotations

import torch

from lightning_v17.config import Precision

__all__ = ["mixed_precision_dtypes"]


def mixed_precision_dtypes(precision: str | None) -> tuple[torch.dtype | None, torch.dtype | None]:
    """(param_dtype, reduce_dtype) for FSDP2's MixedPrecisionPolicy (stage 3) and the stage 0-2 reductions.

    "bf16-mixed"/"16-mixed" (a precision with an fp32 master, :attr:`~lightning_v17.config.Precision.has_master`):
    compute in its :attr:`~lightning_v17.config.Precision.compute_dtype`, reduce gradients in fp32, the sharded fp32
    parameter is the master. Stages 0-2 keep fp32 parameters and rely on Lightning's autocast (the precision
    plugin), so their gradients are fp32 already. "32-true", "bf16-true" (the plugin converts the module) and
    Lightning precisions without a member here ("64-true", "16-true", ...): nothing to add.
    """
    p = Precision.lookup(precision or "32-true")
    if p is None or not p.has_master:
        return None, None
    return getattr(torch, p.compute_dtype), torch.float32
