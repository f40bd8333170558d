"""All-gather-K/V context parallelism (Llama 3, Dubey 2024 §3.3.2; torchtitan's and Megatron-LM's ``all_gather``
``cp_comm_type``): every rank keeps its queries and gathers the keys and values of the whole row.

Forward: one all-gather (``all_gather_single``, formerly ``all_gather_into_tensor``) of this rank's K and V (concatenated on the head dim) over the cp group,
put back into token order (:meth:`SequenceLayout.to_true_order`). Each local query row then attends to the keys its
document mask allows, computed from *global* token indices (the layout's) and the documents of the full rows:
``key <= query and document(key) == document(query)``. A document cut by a shard boundary, or split over both
chunks of a head-tail rank, is masked exactly as in one process. Backward: the gradient of the gathered K/V is
reduce-scattered (summed over the ranks, each rank keeping its own tokens' part: ``reduce_scatter_single``).

Any cp degree works and the heads are never split, so grouped-query attention needs nothing special. The
transient full K/V is ``2 S Hkv D`` elements per layer; communication per layer and rank is
``2 Hkv D S (cp-1)/cp`` elements forward and the same backward.

The kernel is SDPA with a boolean ``[B, 1, S/cp, S]`` mask (exact on CPU, where FlexAttention has no backward and
flash varlen does not run); its memory is the mask and the ``[B, H, S/cp, S]`` scores.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_v17.engine.cp.sharding import SequenceLayout

__all__ = ["allgather_attention", "gather_sequence", "local_document_mask"]

# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor (the old names warn); the same collectives
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _GatherSequence(torch.autograd.Function):
    """All-gather of every rank's ``[B, s, ...]`` along a new leading rank dim; backward reduce-scatters."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        cp = dist.get_world_size(group)
        out = x.new_empty((cp * x.shape[0], *x.shape[1:]))
        _all_gather(out, x.contiguous(), group=group)
        return out.view(cp, *x.shape)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = grad.new_empty(grad.shape[1:])
        _reduce_scatter(out, grad.contiguous().view(-1, *grad.shape[2:]), group=ctx.group)
        return out, None


def gather_sequence(x: torch.Tensor, *, group: Any, layout: SequenceLayout) -> torch.Tensor:
    """[B, S/cp, ...] local tokens -> [B, S, ...] of the whole row in token order; backward sums every rank's
    gradient of this rank's tokens (a reduce-scatter)."""
    got = _GatherSequence.apply(x, group)  # [cp, B, s, ...]
    full = got.transpose(0, 1).reshape(x.shape[0], layout.seq_len, *x.shape[2:])  # shard order
    return layout.to_true_order(full)


def local_document_mask(
    layout: SequenceLayout, rank: int, segment_ids: torch.Tensor | None, *, device: torch.device | None = None
) -> torch.Tensor:
    """Bool [B or 1, 1, S/cp, S]: which keys (token order) each of ``rank``'s local queries may attend to."""
    q_idx = layout.token_index(rank, device)
    k_idx = torch.arange(layout.seq_len, device=device)
    causal = k_idx.unsqueeze(0) <= q_idx.unsqueeze(1)  # [s, S]
    if segment_ids is None:
        return causal.view(1, 1, *causal.shape)
    seg = segment_ids.to(device)
    same = seg[:, q_idx].unsqueeze(2) == seg.unsqueeze(1)  # [B, s, S]
    return (same & causal).unsqueeze(1)


def allgather_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: Any,
    layout: SequenceLayout,
    segment_ids: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of this rank's queries over the all-gathered keys and values.

    Args:
        q: [B, S/cp, Hq, D] this rank's tokens in local order (``layout.token_index(rank)``).
        k, v: [B, S/cp, Hkv, D] (``Hq % Hkv == 0``).
        group: the cp process group.
        layout: the layout the batch was sharded with.
        segment_ids: [B, S] documents of the full rows in token order (None: one causal document per row).
        scale: softmax scale; default 1/sqrt(D).

    Returns:
        [B, S/cp, Hq, D].
    """
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    if cp != layout.cp:
        raise ValueError(f"the cp group has {cp} ranks but the layout was made for cp={layout.cp}")
    hkv = k.shape[2]
    kv = gather_sequence(torch.cat([k, v], dim=2), group=group, layout=layout)  # one collective for both
    kf, vf = kv[:, :, :hkv], kv[:, :, hkv:]
    mask = local_document_mask(layout, rank, segment_ids, device=q.device)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), kf.transpose(1, 2), vf.transpose(1, 2), attn_mask=mask, scale=scale,
        enable_gqa=q.shape[2] != hkv,
    )  # fmt: skip
    return out.transpose(1, 2)
