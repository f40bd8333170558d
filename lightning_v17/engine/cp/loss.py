"""The next-token loss under context parallelism: token sums per shard, divided once by the global token count.

Each cp rank holds ``S/cp`` tokens of the same rows, with labels shifted on the full rows before sharding
(:func:`~lightning_v17.engine.cp.sharding.shift_labels`). The one-process loss is ``sum_t w_t CE_t / sum_t w_t``
over all ``S`` tokens (``w_t``: 1 for a label that is not ``ignore_index``, times ``loss_mask``). Here rank ``r``
returns its *share* ``sum_{t in r} w_t CE_t / W`` with ``W`` all-reduced over the cp group (no gradient flows
through ``W``): the shares sum to the one-process loss, and backward of each share gives exactly the one-process
gradient of that rank's logits. Averaging per-shard means instead would weight the shards by their token counts'
inverse (packed rows have uneven ignored targets), and all-reducing the loss with a gradient would multiply the
gradient by ``cp``.

Weight gradients must therefore be *summed* over the cp ranks (they see different tokens of the same rows). A
gradient reduction that averages over an FSDP group spanning ``dp_shard x cp`` divides by ``cp`` too: train on
``share * cp`` there (torchtitan's convention, where the data-parallel mean is over ``dp_shard`` only).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_v17.engine.cp.sharding import IGNORE_INDEX

__all__ = ["context_parallel_cross_entropy", "global_loss"]


def context_parallel_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    group: Any,
    loss_mask: torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of the token-mean cross-entropy of the full rows.

    Args:
        logits: [B, S/cp, V] this rank's tokens (the loss is computed in fp32, or in fp64 for fp64 logits).
        labels: [B, S/cp] targets shifted before sharding (``ignore_index``: no target).
        group: the cp process group (None: the default group).
        loss_mask: optional [B, S/cp] weights aligned with ``labels``.
        ignore_index: the label with no target.

    Returns:
        (share, count): ``share`` = this rank's token-summed loss / the global weight ``count`` (an fp64 tensor,
        the same on every cp rank). The sum of the shares over the cp ranks is the one-process loss.
    """
    flat = logits.reshape(-1, logits.shape[-1])
    per_token = F.cross_entropy(
        flat.to(torch.promote_types(flat.dtype, torch.float32)),
        labels.reshape(-1),
        ignore_index=ignore_index,
        reduction="none",
    )
    weight = (labels.reshape(-1) != ignore_index).float()
    if loss_mask is not None:
        weight = weight * loss_mask.reshape(-1).float()
    count = weight.detach().double().sum()  # fp64: exact token counts far past fp32's 2**24
    dist.all_reduce(count, group=group)
    return (per_token * weight).sum() / count.clamp_min(1.0).to(per_token.dtype), count


def global_loss(share: torch.Tensor, *, group: Any) -> torch.Tensor:
    """The one-process loss value for logging: the shares summed over the cp group (detached)."""
    total = share.detach().clone()
    dist.all_reduce(total, group=group)
    return total
