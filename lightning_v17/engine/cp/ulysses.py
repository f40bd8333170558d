"""Ulysses context parallelism (Jacobs 2023, DeepSpeed-Ulysses; ALST, Bekman 2025): attention heads sharded over
the ``cp`` ranks for the attention, the sequence sharded everywhere else.

Before attention, an all-to-all turns each rank's sequence shard of all heads, q/k/v ``[B, S/cp, H, D]``, into the
full sequence of ``H/cp`` heads, ``[B, S, H/cp, D]``; after it, the inverse all-to-all brings the output back to
``[B, S/cp, Hq, D]``. Any attention kernel runs in between on whole sequences, so a packed row's per-document kernel
(varlen flash-attn on GPU, per-document SDPA on CPU) sees every document whole, wherever the shards cut it.

The all-to-all lays the gathered sequence out in *shard order* (rank 0's tokens, then rank 1's). Under head-tail or
packed balancing that is not the token order, so :func:`ulysses_attention` permutes it back before the kernel and
forward again after it (:meth:`SequenceLayout.to_true_order`); the kernel sees the row exactly as one process would.

Heads: ``cp`` must divide the query heads (else use ``cp_mode="allgather"``, which works for any cp). When it does
not divide the KV heads of grouped-query attention but is a multiple of them (cp % kv_heads == 0), every KV head is
replicated ``cp / kv_heads`` times before the all-to-all, as ALST does, so each rank receives the one KV head of its
query heads; the replicas' gradients are summed by autograd (``repeat_interleave``'s backward).

Communication per layer and rank (forward): the all-to-all of q, k, v and of the output moves
``(2 Hq + 2 Hkv') D (S/cp) (cp-1)/cp`` elements per row, ``Hkv' = max(Hkv, cp)``; backward the same again.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_v17.config import V17ConfigError
from lightning_v17.engine.cp.sharding import SequenceLayout, cu_seqlens_from_segment_ids

__all__ = ["AttentionFn", "check_ulysses_heads", "document_causal_sdpa", "head_to_seq", "seq_to_head",
           "ulysses_attention"]  # fmt: skip

#: ``fn(q, k, v) -> out``: q [B, S, h, D], k/v [B, S, h_kv, D] of whole rows in token order -> [B, S, h, D].
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of equal blocks along dim 0 (block ``r`` goes to rank ``r``; block ``r`` of the
    result came from rank ``r``). The exchange is its own adjoint, so backward runs it on the gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()  # the collective reads and writes storage order: both buffers must be contiguous
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def seq_to_head(x: torch.Tensor, *, group: Any) -> torch.Tensor:
    """[B, S/cp, H, D] (this rank's tokens, all heads) -> [B, S, H/cp, D] (every rank's tokens in shard order,
    this rank's contiguous block of ``H/cp`` heads). Differentiable."""
    cp = dist.get_world_size(group)
    b, s, h, d = x.shape
    if h % cp:
        raise ValueError(f"{h} heads cannot be split over cp={cp} ranks")
    blocks = x.reshape(b, s, cp, h // cp, d).permute(2, 0, 1, 3, 4)  # [cp (destination), B, s, h/cp, D]
    got = _AllToAll.apply(blocks, group)  # [cp (source), B, s, h/cp, D]
    return got.permute(1, 0, 2, 3, 4).reshape(b, cp * s, h // cp, d)


def head_to_seq(x: torch.Tensor, *, group: Any) -> torch.Tensor:
    """The inverse of :func:`seq_to_head`: [B, S, H/cp, D] in shard order -> [B, S/cp, H, D]. Differentiable."""
    cp = dist.get_world_size(group)
    b, full, h, d = x.shape
    s = full // cp
    blocks = x.reshape(b, cp, s, h, d).permute(1, 0, 2, 3, 4)  # [cp (destination), B, s, h, D]
    got = _AllToAll.apply(blocks, group)  # [cp (source: its head block), B, s, h, D]
    return got.permute(1, 2, 0, 3, 4).reshape(b, s, cp * h, d)


def check_ulysses_heads(cp: int, heads: int, kv_heads: int) -> int:
    """How many times each KV head is replicated under Ulysses (1: none); raise a user error when impossible."""
    if heads % cp:
        raise V17ConfigError(
            f"CPPolicy(mode='ulysses') shards the attention heads over cp: cp={cp} must divide the {heads} query "
            "heads of this rank (num_attention_heads / tp under tensor parallelism); use CPPolicy(mode='allgather') "
            f"(any cp degree) or cp in {[c for c in range(1, heads + 1) if heads % c == 0]}"
        )
    if kv_heads % cp == 0:
        return 1
    if cp % kv_heads == 0:
        return cp // kv_heads
    raise V17ConfigError(
        f"CPPolicy(mode='ulysses') with cp={cp} and {kv_heads} KV heads (of this rank: num_key_value_heads / tp "
        "under tensor parallelism): cp must divide the KV heads or be a multiple of them (then they are replicated); "
        "use CPPolicy(mode='allgather') or another cp"
    )


def document_causal_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, segment_ids: torch.Tensor | None, scale: float | None = None
) -> torch.Tensor:
    """Exact causal attention within each document of whole rows: one ``scaled_dot_product_attention(is_causal)``
    per document (the CPU path of the model's varlen attention), or one per row batch when ``segment_ids`` is None.

    Args:
        q: [B, S, h, D]; k, v: [B, S, h_kv, D] (``h % h_kv == 0``).
        segment_ids: [B, S] documents in token order, or None (one document per row).
        scale: softmax scale; default 1/sqrt(D).
    """
    gqa = q.shape[2] != k.shape[2]
    if segment_ids is None:
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale, enable_gqa=gqa
        )
        return out.transpose(1, 2)
    b, s = segment_ids.shape
    flat = [t.reshape(b * s, *t.shape[2:]) for t in (q, k, v)]
    outs = []
    for start, end in itertools.pairwise(cu_seqlens_from_segment_ids(segment_ids).tolist()):
        # [1, h, L, D]: CPU SDPA's fused kernel needs 4-D inputs (3-D ones fall back to the slower math kernel)
        qs, ks, vs = (t[start:end].transpose(0, 1).unsqueeze(0) for t in flat)
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=gqa)
        outs.append(out.squeeze(0).transpose(0, 1))
    return torch.cat(outs).view(b, s, *q.shape[2:])


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: Any,
    layout: SequenceLayout,
    segment_ids: torch.Tensor | None = None,
    attention_fn: AttentionFn | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of this rank's queries over the whole rows, heads sharded for the kernel.

    Args:
        q: [B, S/cp, Hq, D] this rank's tokens in local order (``layout.token_index(rank)``).
        k, v: [B, S/cp, Hkv, D].
        group: the cp process group (its size is ``layout.cp``).
        layout: the sequence layout the batch was sharded with.
        segment_ids: [B, S] documents of the full rows in token order (None: one causal document per row).
        attention_fn: the kernel on whole rows in token order (default :func:`document_causal_sdpa`); under packed
            rows it must mask by the same documents, e.g. varlen attention with
            ``cu_seqlens_from_segment_ids(segment_ids)``.
        scale: softmax scale of the default kernel.

    Returns:
        [B, S/cp, Hq, D], this rank's tokens in local order.
    """
    cp = dist.get_world_size(group)
    if cp != layout.cp:
        raise ValueError(f"the cp group has {cp} ranks but the layout was made for cp={layout.cp}")
    repeat = check_ulysses_heads(cp, q.shape[2], k.shape[2])
    if repeat > 1:  # ALST: each rank receives the one KV head its query heads use
        k, v = k.repeat_interleave(repeat, dim=2), v.repeat_interleave(repeat, dim=2)
    qf, kf, vf = (layout.to_true_order(seq_to_head(t, group=group)) for t in (q, k, v))
    if attention_fn is None:
        out = document_causal_sdpa(qf, kf, vf, segment_ids=segment_ids, scale=scale)
    else:
        out = attention_fn(qf, kf, vf)
    return head_to_seq(layout.to_shard_order(out), group=group)
