"""Gradient clipping by the *global* norm of sharded gradients (design §3: "shard만 clip → norm 계산 틀림").

Under ZeRO each rank holds only part of every gradient, so ``torch.nn.utils.clip_grad_norm_`` over the local
tensors computes a per-rank norm and every rank would scale by a different factor. Here each rank sums the squares of
its *local, disjoint* elements (a DTensor contributes its local shard), one all-reduce over the group that partitions
them adds the parts, and every rank scales by the same ``max_norm / (norm + 1e-6)`` factor that
``torch.nn.utils.clip_grad_norm_`` uses, so the result equals the single-process one.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from lightning_v17.engine.zero.layout import whole_grads

__all__ = ["clip_grad_norm_", "global_grad_norm"]




def global_grad_norm(
    grads: Iterable[torch.Tensor],
    *,
    group: Any = None,
    sharded: bool = True,
    stage_group: Any = None,
    tp_sharded: Iterable[bool] | None = None,
    tp_group: Any = None,
) -> torch.Tensor:
    """L2 norm of all gradients across ranks (float32 scalar on the gradients' device).

    Plain tensors (ZeRO-1/2 shards, or replicated ZeRO-0 gradients) are summed locally and all-reduced over
    ``group``. DTensors (ZeRO-3 / FSDP2, tensor parallel) go through torch's placement-aware norm
    (``torch.nn.utils.get_total_norm``), which reduces over exactly the mesh axes they are sharded on and counts
    replicated axes once; ``.full_tensor()`` makes the result a plain scalar.

    Args:
        grads: this rank's gradient tensors (local shards, or DTensors).
        group: the process group over which the plain tensors' elements are partitioned (the ``dp_shard`` axis).
        sharded: False when the plain gradients are replicated (stage 0): no communication, the local norm is global.
        stage_group: the pipeline (pp) group when pp > 1: each pp rank holds different parameters, so the squared
            norms of all stages are summed over it at the end.
        tp_sharded: per gradient, whether it is a plain local piece of a tensor-parallel-*sharded* parameter
            (ZeRO-1/2 over TP DTensor locals): those are also summed over ``tp_group``; tp-replicated ones are not
            (they are identical on every tp rank and must be counted once).
        tp_group: the tensor-parallel group (with ``tp_sharded``).
    """
    from torch.distributed.tensor import DTensor

    grads = list(grads)
    flags = [False] * len(grads) if tp_sharded is None else list(tp_sharded)
    pairs = [(g, f) for g, f in zip(grads, flags) if g is not None]
    dtensors = [g for g, _ in pairs if isinstance(g, DTensor)]
    plain = [(g, f) for g, f in pairs if not isinstance(g, DTensor)]
    device = pairs[0][0].device if pairs else torch.device("cpu")
    # [tp-replicated, tp-sharded] sums of squares, in fp64: millions of squared fp32 values lose digits otherwise.
    parts = torch.zeros(2, dtype=torch.float64, device=device)
    for g, f in plain:
        if g.numel():
            parts[int(f)] += g.detach().to(torch.float64).pow(2).sum()
    if plain and sharded and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(parts, group=group)
    if tp_group is not None and any(f for _, f in plain) and dist.get_world_size(tp_group) > 1:
        dist.all_reduce(parts[1:], group=tp_group)
    total = parts.sum()
    by_mesh: dict[int, list[torch.Tensor]] = {}  # FSDP2's (dp) and the experts' (ep) meshes: one norm per mesh
    for g in dtensors:
        by_mesh.setdefault(id(g.device_mesh), []).append(g.detach())
    for same_mesh in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(same_mesh, norm_type=2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        total += norm.to(torch.float64).pow(2)
    if stage_group is not None and dist.get_world_size(stage_group) > 1:
        dist.all_reduce(total, group=stage_group)
    return total.sqrt().to(torch.float32)


@torch.no_grad()
def clip_grad_norm_(
    params: Iterable[torch.Tensor],
    max_norm: float,
    *,
    group: Any = None,
    sharded: bool = True,
    stage_group: Any = None,
    tp_sharded: Iterable[bool] | None = None,
    tp_group: Any = None,
) -> torch.Tensor:
    """Scale the gradients of ``params`` in place so that their global L2 norm is at most ``max_norm``.

    Returns the global norm before clipping (like ``torch.nn.utils.clip_grad_norm_``).
    """
    params = list(params)
    flags = [False] * len(params) if tp_sharded is None else list(tp_sharded)
    keep = [(p, f) for p, f in zip(params, flags) if p.grad is not None]
    params = [p for p, _ in keep]
    total = global_grad_norm(
        [p.grad for p in params],
        group=group,
        sharded=sharded,
        stage_group=stage_group,
        tp_sharded=[f for _, f in keep],
        tp_group=tp_group,
    )
    coef = (float(max_norm) / (total.double() + 1e-6)).clamp(max=1.0)
    for g in whole_grads(params):  # ZeRO-1: the whole gradient behind each shard (scaling a DTensor's local piece
        g.mul_(coef.to(device=g.device, dtype=g.dtype))  # scales the DTensor)
    return total


def clip_grad_value_(params: Iterable[torch.Tensor], clip_value: float) -> None:
    """Clamp the gradients of ``params`` to ``[-clip_value, clip_value]`` in place (``clip_grad_value_``), on the
    whole gradients behind ZeRO-1's shards (:func:`~lightning_v17.engine.zero.layout.whole_grads`)."""
    for g in whole_grads(params):
        g.clamp_(min=-clip_value, max=clip_value)
