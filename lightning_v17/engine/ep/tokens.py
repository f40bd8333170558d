"""The tokens of every sequence split over several ranks, and what a MoE layer needs across them.

Two layouts hand a MoE layer a slice of each sequence instead of the whole:

* **sequence parallelism** (``TPPolicy(sequence_parallel=True)``, Korthikanti 2022): the tensor-parallel plan leaves
  a MoE layer's input sharded on the sequence (``Shard(1)`` over ``tp``; ``engine/tp/apply.py``), so each tp rank
  routes and dispatches only its own ``S / tp`` tokens (Megatron-core's MoE under SP: the expert work is not repeated
  on every tp rank). The router, shared and routed experts are replicated over tp and nothing else sums their
  gradients over tp, so each use of those weights sums its gradient over the tp ranks in backward
  (:meth:`TokenSplit.weight`; Megatron's ``copy_to_tensor_model_parallel_region`` applied to the weight).
* **context parallelism** (``cp > 1``, ``engine/cp``): each cp rank holds ``S / cp`` tokens of the same rows, in the
  cp layout's chunk order. The dense weights' gradients are averaged over ``dp x cp`` by ZeRO already, and the
  experts' over the expert-data-parallel ranks, which include cp (``lightning_v17/mesh.py``, ``_expert_meshes``).

A MoE layer is token-wise but for its per-sequence statistics, which must equal one process's (GShard's group is
the sequence): the capacity's arrival order (the assignments' expert ids gathered over the group: ``S * k``
integers a sequence, :meth:`TokenSplit.gather_seq`), the balance loss's assignment counts (``E`` integers a
sequence, summed: :meth:`TokenSplit.all_reduce`) and the routed load of the aux-loss-free bias. The activations are
never gathered.

A loss term of the whole sequence (the sequence-wise balance loss, the z-loss) is the sum over the ranks of each
rank's share (its own tokens' part). :meth:`TokenSplit.combine` returns the whole value on every rank, with the
gradient of ``scale`` times the rank's share: under tp the ranks' gradients are summed (``scale`` 1), under cp the
strategy averages them over cp (``scale`` cp; each cp rank's loss is its own token mean, scaled by its targets'
share, ``strategies/_context.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["TokenSplit"]


class _SumGrad(torch.autograd.Function):
    """Identity forward; backward sums the gradient over ``group`` (each rank's share of a replicated weight's)."""

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return w.view_as(w)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


@dataclass(frozen=True)
class TokenSplit:
    """How a batch's sequences are split over a group's ranks (module docstring).

    Args:
        group: the ranks that each hold a slice of every sequence (``tp`` under SP, ``cp`` under cp).
        order: LongTensor [S]: the sequence position at each place of the rank-major concatenation of the ranks'
            slices (``SequenceLayout.order()``); None: contiguous slices in rank order (SP's ``Shard(1)``).
        sum_weight_grads: sum the gradients of the weights the layer uses (:meth:`weight`) over ``group`` (SP);
            False where the data-parallel reduction covers ``group`` already (cp).
        scale: the factor on a rank's share of a whole-sequence loss term (1 where the group's gradients are summed,
            the group size where the strategy averages them).
        outer: the split of the sequences this one slices further (cp x SP: each tp rank holds a contiguous part of
            its cp rank's tokens), or None.

    Attributes:
        size: the ranks one sequence is split over (this group's times ``outer``'s).
    """

    group: Any
    order: torch.Tensor | None = None
    sum_weight_grads: bool = False
    scale: float = 1.0
    outer: TokenSplit | None = None
    size: int = field(init=False)
    rank: int = field(init=False)

    def __post_init__(self) -> None:
        own = dist.get_world_size(self.group)
        object.__setattr__(self, "size", own * (self.outer.size if self.outer is not None else 1))
        object.__setattr__(self, "rank", dist.get_rank(self.group))

    @classmethod
    def sequence_parallel(cls, group: Any, outer: TokenSplit | None = None) -> TokenSplit:
        """Contiguous ``S / tp`` slices over the tp ranks (of ``outer``'s slice); the weights' gradients summed."""
        return cls(group, None, sum_weight_grads=True, scale=1.0, outer=outer)

    @classmethod
    def context_parallel(cls, group: Any, order: torch.Tensor) -> TokenSplit:
        """The cp layout's chunks (``order``); gradients averaged over cp by the data-parallel reduction."""
        return cls(group, order, sum_weight_grads=False, scale=float(dist.get_world_size(group)))

    @property
    def _own(self) -> int:
        return self.size // (self.outer.size if self.outer is not None else 1)

    @property
    def total_scale(self) -> float:
        return self.scale * (self.outer.total_scale if self.outer is not None else 1.0)

    @torch.no_grad()
    def gather_seq(self, t: torch.Tensor) -> torch.Tensor:
        """[B, s, ...] this rank's slice -> [B, s * size, ...] every rank's, in sequence order (no gradient)."""
        parts = [torch.empty_like(t) for _ in range(self._own)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        full = torch.cat(parts, dim=1)
        if self.order is not None:
            out = torch.empty_like(full)
            out[:, self.order.to(full.device)] = full
            full = out
        return full if self.outer is None else self.outer.gather_seq(full)

    def local(self, full: torch.Tensor) -> torch.Tensor:
        """[B, S, ...] in sequence order -> this rank's [B, S / size, ...], in its local order."""
        if self.outer is not None:
            full = self.outer.local(full)
        s = full.shape[1] // self._own
        if self.order is None:
            return full[:, self.rank * s : (self.rank + 1) * s]
        return full[:, self.order[self.rank * s : (self.rank + 1) * s].to(full.device)]

    @torch.no_grad()
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over every rank of the split (a copy; no gradient): per-sequence counts, loads."""
        t = t.detach().clone()
        dist.all_reduce(t, group=self.group)
        return t if self.outer is None else self.outer.all_reduce(t)

    def weight(self, w: torch.Tensor) -> torch.Tensor:
        """``w`` as the layer uses it: with :attr:`sum_weight_grads`, its gradient summed over the group."""
        if self.sum_weight_grads:
            w = _SumGrad.apply(w, self.group)
        return w if self.outer is None else self.outer.weight(w)

    @property
    def sums_weight_grads(self) -> bool:
        """Whether :meth:`weight` changes anything (some level sums the gradients)."""
        return self.sum_weight_grads or (self.outer is not None and self.outer.sums_weight_grads)

    def combine(self, share: torch.Tensor) -> torch.Tensor:
        """A whole-sequence loss term from this rank's ``share``: the whole value (the shares summed over every rank
        of the split), with the gradient of ``scale * share`` (the scales of every level multiplied)."""
        mine = share * self.total_scale
        return mine + (self.all_reduce(share) - mine).detach()
