"""All-gather-K/V context parallelism (Llama 3, Dubey 2024 §3.3.2; torchtitan's and Megatron-LM's ``all_gather``
``cp_comm_type``): every rank keeps its queries and gathers the keys and values of the whole row.

Forward: one all-gather (``all_gather_single``, formerly ``all_gather_into_tensor``) of this rank's K and V
(concatenated on the head dim) over the cp group, put back into token order (:meth:`SequenceLayout.to_true_order`).
Each local query row then attends to the keys its document mask allows, computed from *global* token indices (the
layout's) and the documents of the full rows: ``key <= query and document(key) == document(query)``. A document cut
by a shard boundary, or split over both chunks of a head-tail rank, is masked exactly as in one process.

Memory (:class:`_AllGatherAttention`): the forward runs without autograd and keeps only the local q, k, v and the
``[B, S]`` document ids; the gathered K/V, the ``[B, 1, S/cp, S]`` mask and SDPA's own saved tensors are transient.
Backward all-gathers K/V again, rebuilds the mask from the document ids, reruns the attention under autograd and
differentiates through it, then reduce-scatters the gradient of the gathered K/V (summed over the ranks, each rank
keeping its own tokens' part: ``reduce_scatter_single``). This is the trade Megatron-Core's ``all_gather``
``cp_comm_type`` (``AttnFuncWithCPAndKVAllGather``) makes: one more all-gather per layer in backward for not keeping
the whole row's K/V (``2 S Hkv D`` elements per layer) and the mask (``S^2 / cp``) until then.

Any cp degree works and the heads are never split, so grouped-query attention needs nothing special. Communication
per layer and rank is ``2 Hkv D S (cp-1)/cp`` elements for each of the three passes: the forward's all-gather, the
backward's all-gather and its reduce-scatter.

The kernel is SDPA with a boolean ``[B, 1, S/cp, S]`` mask (exact on CPU, where FlexAttention has no backward and
flash varlen does not run); its transient memory is the mask and the ``[B, H, S/cp, S]`` scores.
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


def _gather_rows(x: torch.Tensor, group: Any, layout: SequenceLayout) -> torch.Tensor:
    """[B, S/cp, ...] local tokens -> [B, S, ...] of the whole row in token order (no autograd)."""
    cp = layout.cp
    out = x.new_empty((cp * x.shape[0], *x.shape[1:]))
    _all_gather(out, x.contiguous(), group=group)
    full = out.view(cp, *x.shape).transpose(0, 1).reshape(x.shape[0], layout.seq_len, *x.shape[2:])  # shard order
    return layout.to_true_order(full)


def _scatter_rows(grad: torch.Tensor, group: Any, layout: SequenceLayout) -> torch.Tensor:
    """The adjoint of :func:`_gather_rows`: [B, S, ...] in token order -> [B, S/cp, ...], summed over the ranks."""
    b, cp = grad.shape[0], layout.cp
    blocks = layout.to_shard_order(grad).reshape(b, cp, layout.local_len, *grad.shape[2:]).transpose(0, 1)
    out = grad.new_empty((b, layout.local_len, *grad.shape[2:]))
    _reduce_scatter(out, blocks.contiguous().view(cp * b, *out.shape[1:]), group=group)
    return out


class _GatherSequence(torch.autograd.Function):
    """:func:`_gather_rows` with its adjoint (a reduce-scatter) as the backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, layout: SequenceLayout) -> torch.Tensor:
        ctx.group, ctx.layout = group, layout
        return _gather_rows(x, group, layout)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _scatter_rows(grad, ctx.group, ctx.layout), None, None


def gather_sequence(x: torch.Tensor, *, group: Any, layout: SequenceLayout) -> torch.Tensor:
    """[B, S/cp, ...] local tokens -> [B, S, ...] of the whole row in token order; backward sums every rank's
    gradient of this rank's tokens (a reduce-scatter)."""
    return _GatherSequence.apply(x, group, layout)


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
    cp = dist.get_world_size(group)
    if cp != layout.cp:
        raise ValueError(f"the cp group has {cp} ranks but the layout was made for cp={layout.cp}")
    return _AllGatherAttention.apply(q, k, v, segment_ids, group, layout, scale)


def _attend(q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor, scale: float | None) -> torch.Tensor:
    """SDPA of local q [B, s, Hq, D] over the whole row's kv [B, S, 2 Hkv, D] (K, then V on the head dim)."""
    hkv = kv.shape[2] // 2
    k, v = kv[:, :, :hkv], kv[:, :, hkv:]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale,
        enable_gqa=q.shape[2] != hkv,
    )  # fmt: skip
    return out.transpose(1, 2)


class _AllGatherAttention(torch.autograd.Function):
    """The all-gather attention, keeping for backward only the local q, k, v and the document ids (module
    docstring): the forward gathers K/V and attends without autograd; the backward gathers again, rebuilds the mask,
    reruns the attention under autograd, and reduce-scatters the gathered K/V's gradient."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segment_ids: torch.Tensor | None,
                group: Any, layout: SequenceLayout, scale: float | None) -> torch.Tensor:  # fmt: skip
        ctx.group, ctx.layout, ctx.scale = group, layout, scale
        ctx.save_for_backward(q, k, v, segment_ids)
        mask = local_document_mask(layout, dist.get_rank(group), segment_ids, device=q.device)
        return _attend(q, _gather_rows(torch.cat([k, v], dim=2), group, layout), mask, scale)  # one collective

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, segment_ids = ctx.saved_tensors
        group, layout = ctx.group, ctx.layout
        kv = _gather_rows(torch.cat([k, v], dim=2), group, layout)  # the second all-gather (not kept from forward)
        mask = local_document_mask(layout, dist.get_rank(group), segment_ids, device=q.device)
        with torch.enable_grad():
            q_, kv_ = q.detach().requires_grad_(), kv.requires_grad_()
            dq, dkv = torch.autograd.grad(_attend(q_, kv_, mask, ctx.scale), (q_, kv_), grad)
        dkv = _scatter_rows(dkv, group, layout)
        hkv = k.shape[2]
        return dq, dkv[:, :, :hkv], dkv[:, :, hkv:], None, None, None, None
