"""Each parameter's gradient norm as one process (or DDP) would compute it, whatever holds the gradient at a stage.

Stages 0-1 keep every parameter's whole reduced gradient in ``.grad``; stage 2 keeps only this rank's rows of it (the
full gradient is freed as soon as its reduce-scatter is issued), on the optimizer's shard; stage 3 and tensor
parallelism keep DTensor gradients whose local pieces are this rank's part. What logging code such as Lightning's
``grad_norm`` needs is the norm of the *whole* gradient, identical on every rank: the local pieces' ``|g|^p`` sums
(or maxima, for the inf-norm) summed over the ranks that hold disjoint pieces. Every rank must call this at the same
point (it runs collectives), as every rank calls ``on_before_optimizer_step``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from lightning_v17.engine.zero.backend import ZeroBackend

__all__ = ["grad_norms"]


def _pow_sum(t: torch.Tensor, norm_type: float) -> torch.Tensor:
    """``sum |t|^p`` in float64 (``max |t|`` for the inf-norm): what adds up over disjoint pieces."""
    t = (t.to_local() if hasattr(t, "to_local") else t).detach().double()
    if math.isinf(norm_type):
        return t.abs().max() if t.numel() else torch.zeros((), dtype=torch.float64, device=t.device)
    return t.abs().pow(norm_type).sum()


def _finish(total: torch.Tensor, norm_type: float) -> torch.Tensor:
    return total if math.isinf(norm_type) else total.pow(1.0 / norm_type)


def _reduce(t: torch.Tensor, norm_type: float, group: Any) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM, group=group)


def _sharded_dims(param: Any) -> list[Any]:
    """The process groups over which a DTensor parameter's local pieces are disjoint (its Shard mesh dims)."""
    if not hasattr(param, "placements"):
        return []
    mesh = param.device_mesh
    return [mesh.get_group(i) for i, pl in enumerate(param.placements) if pl.is_shard()]


def grad_norms(module: nn.Module, zero: ZeroBackend, norm_type: float) -> dict[str, torch.Tensor]:
    """FQN -> the ``norm_type``-norm of that parameter's whole gradient (a float32 scalar, the same on every rank),
    for the parameters that have a gradient this step, in ``named_parameters`` order.

    Stage 2's gradients are on the optimizer's shards (:class:`~lightning_v17.engine.zero.layout.ShardParameter`):
    their rows are summed over the engine's ``shard_group`` (the replicas of HSDP hold equal copies), then over the
    tensor-parallel dims that shard the parameter. A DTensor gradient (stage 3, TP) is reduced over its own mesh.
    One all-reduce per engine for stage 2, one per DTensor gradient otherwise.
    """
    norm_type = float(norm_type)
    by_param: dict[int, tuple[Any, Any]] = {}
    if zero.shards_grads:
        for eng in zero._engines():
            for e in eng.params:
                by_param[id(e.param)] = (eng, e)
    out: dict[str, torch.Tensor] = {}
    pending: dict[int, list[tuple[str, Any, Any]]] = {}  # id(engine) -> [(fqn, entry, local grad or None)]
    engines: dict[int, Any] = {}
    for fqn, p in module.named_parameters():
        hit = by_param.get(id(p))
        if hit is not None:  # stage 2: the rows on this rank's shard, or the whole gradient on its owner
            eng, e = hit
            if eng.owner_mode:
                g = e.param.grad if e.owner == eng.rank else None
            else:
                g = e.shard.grad if e.shard is not None else None
            pending.setdefault(id(eng), []).append((fqn, e, g))
            engines[id(eng)] = eng
            out[fqn] = torch.empty(())  # placeholder keeps named_parameters order
            continue
        g = p.grad
        if g is None:
            continue
        if hasattr(g, "to_local"):  # a DTensor: the norm of the whole tensor, reduced over its mesh by DTensor
            out[fqn] = torch.linalg.vector_norm(g, norm_type).full_tensor().float()
        else:
            out[fqn] = torch.linalg.vector_norm(g.detach(), norm_type).float()
    for key, rows in pending.items():
        eng = engines[key]
        # flags: whether any rank holds this parameter's gradient (an unused parameter has none anywhere)
        sums = torch.stack([_pow_sum(g, norm_type) if g is not None else torch.zeros((), dtype=torch.float64)
                            for _, _, g in rows])  # fmt: skip
        held = torch.tensor([g is not None for _, _, g in rows], dtype=torch.float64)
        both = torch.cat([sums, held])
        _reduce(both, norm_type, eng.shard_group)  # the flags are summed (or maxed) too: > 0 where some rank holds it
        sums, held = both[: len(rows)], both[len(rows) :]
        for i, (fqn, e, _) in enumerate(rows):
            if held[i] == 0:
                del out[fqn]
                continue
            total = sums[i : i + 1].clone()
            for group in _sharded_dims(e.param):  # tensor-parallel pieces of the parameter
                _reduce(total, norm_type, group)
            out[fqn] = _finish(total[0], norm_type).float()
    return out
