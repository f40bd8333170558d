"""Token dispatch over the ``ep`` axis: every rank's (token, slot) assignment rows travel to the rank that holds
their expert, run there in one grouped GEMM per projection, and come back (GShard, Lepikhin 2020 §3.2;
torchtitan's and Megatron-core's all-to-all dispatcher).

For a MoE layer with ``E`` experts on an ``ep``-rank group (``E / ep`` local experts per rank, expert ``e`` on rank
``e // (E / ep)``), :class:`AllToAllDispatch` runs, in forward:

1. sort this rank's assignment rows by global expert id (stable: token order kept within an expert), count them
   per expert;
2. exchange the counts (one ``all_to_all_single`` of ``E`` integers), so every rank knows how many rows each source
   sends to each of its local experts;
3. ``all_to_all_single`` the rows (uneven splits: the rows for rank r's experts go to rank r);
4. sort the received rows by local expert, stable over the sources (source rank order, each source in its own
   order), run the experts, unsort;
5. the reverse ``all_to_all_single``, then unsort into the caller's row order.

Backward mirrors it: the gradient of step 5 is an all-to-all with the splits swapped, then step 3's likewise
(:class:`_AllToAll`). Nothing is scaled: a rank's expert gradient is the sum over the tokens of every source rank;
the data-parallel mean is taken once, by :class:`~lightning_v17.engine.ep.apply.ExpertGradSync`.

Each expert sees, in the same order, the rows it would see in one process that runs the ranks' batches one after
another, so its outputs and weight gradients equal that process's bit for bit.

:class:`AllGatherDispatch` is the simple alternative (Megatron-core's allgather dispatcher): every rank gathers
every rank's rows, runs its local experts on the rows routed to them, and the outputs go back to their sources by
all-to-all. It moves ``ep - 1`` times a rank's rows where the all-to-all moves ``(ep - 1) / ep`` of them, but it
exchanges no counts before the rows and its all-gather has equal sizes; the planner compares both by bytes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["AllGatherDispatch", "AllToAllDispatch", "all_gather_rows", "all_to_all", "make_dispatcher"]


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` along dim 0 with uneven splits; backward is the same exchange with the splits swapped."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        back = grad.new_empty((sum(ctx.in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), ctx.in_splits, ctx.out_splits, group=ctx.group)
        return back, None, None, None


def all_to_all(x: torch.Tensor, *, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
    """Differentiable ``all_to_all_single`` of the rows of ``x``: ``in_splits[r]`` rows go to rank r, and
    ``out_splits[r]`` rows come from rank r, in rank order."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


class AllToAllDispatch:
    """The MoE layer's dispatcher under expert parallelism: assignment rows to their experts' ranks and back.

    Args:
        group: the ``ep`` process group (the ranks that hold one expert each of the layer's ``num_experts / ep``).
        num_experts: the layer's global expert count ``E`` (a multiple of the group size).

    Called as ``dispatch(x, expert_idx, experts)`` with ``x`` [M, H] (one row per kept assignment), ``expert_idx``
    [M] global expert ids and ``experts`` the layer's grouped experts (local weights: ``E / ep`` experts); returns
    the expert outputs [M, H] in ``x``'s row order.
    """

    def __init__(self, group: Any, num_experts: int) -> None:
        self.group = group
        self.ep = dist.get_world_size(group)
        if num_experts % self.ep:
            raise ValueError(f"num_experts={num_experts} is not a multiple of the ep group size {self.ep}")
        self.num_experts = num_experts
        self.local_experts = num_experts // self.ep
        #: the last forward's row counts: sent per global expert, received per (source, local expert)
        self.last_sent: torch.Tensor | None = None
        self.last_received: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor, expert_idx: torch.Tensor, experts: nn.Module) -> torch.Tensor:
        ep, local = self.ep, self.local_experts
        order = torch.argsort(expert_idx, stable=True)
        counts = torch.bincount(expert_idx, minlength=self.num_experts)
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)  # [source, local expert] rows coming here
        self.last_sent, self.last_received = counts, received
        in_splits = counts.view(ep, local).sum(1).tolist()
        out_splits = received.view(ep, local).sum(1).tolist()
        rows = all_to_all(x[order], out_splits=out_splits, in_splits=in_splits, group=self.group)
        local_id = torch.repeat_interleave(torch.arange(local, device=x.device).repeat(ep), received)
        by_expert = torch.argsort(local_id, stable=True)
        y = experts(rows[by_expert], received.view(ep, local).sum(0))
        y = y[torch.argsort(by_expert)]  # back to (source, local expert) order
        back = all_to_all(y, out_splits=in_splits, in_splits=out_splits, group=self.group)
        return back[torch.argsort(order)]


class _AllGatherRows(torch.autograd.Function):
    """All-gather of equal-size row blocks; backward sums every rank's gradient of this rank's block (a
    reduce-scatter, written as one all-to-all plus a local sum so that gloo runs it too)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        world = dist.get_world_size(group)
        out = x.new_empty((world * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        world = dist.get_world_size(ctx.group)
        parts = torch.empty_like(grad)
        dist.all_to_all_single(parts, grad.contiguous(), group=ctx.group)  # block r of every rank's grad -> rank r
        return parts.view(world, -1, *grad.shape[1:]).sum(0), None


def all_gather_rows(x: torch.Tensor, *, group: Any) -> torch.Tensor:
    """Differentiable all-gather of ``x``'s rows (every rank the same row count), in rank order."""
    return _AllGatherRows.apply(x, group)


class AllGatherDispatch(AllToAllDispatch):
    """Every rank's rows gathered on every rank; each rank runs its local experts on the rows routed to them and
    sends the outputs back to their sources (same arguments and result as :class:`AllToAllDispatch`)."""

    def __call__(self, x: torch.Tensor, expert_idx: torch.Tensor, experts: nn.Module) -> torch.Tensor:
        ep, local = self.ep, self.local_experts
        me = dist.get_rank(self.group)
        rows_per_rank = torch.tensor([x.shape[0]], device=x.device)
        sizes = torch.empty(ep, dtype=rows_per_rank.dtype, device=x.device)
        dist.all_gather_into_tensor(sizes, rows_per_rank, group=self.group)
        pad = int(sizes.max())
        padded = torch.cat([x, x.new_zeros((pad - x.shape[0], *x.shape[1:]))])
        ids = torch.cat([expert_idx, expert_idx.new_full((pad - x.shape[0],), -1)])
        rows = all_gather_rows(padded, group=self.group)
        all_ids = torch.empty(ep * pad, dtype=ids.dtype, device=ids.device)
        dist.all_gather_into_tensor(all_ids, ids, group=self.group)
        mine = (all_ids >= me * local) & (all_ids < (me + 1) * local)
        where = mine.nonzero().squeeze(1)  # in (source rank, row) order
        local_id = all_ids[where] - me * local
        by_expert = torch.argsort(local_id, stable=True)
        counts = torch.bincount(local_id, minlength=local)
        self.last_sent = torch.bincount(expert_idx, minlength=self.num_experts)
        self.last_received = torch.stack(
            [torch.bincount(all_ids[s * pad : (s + 1) * pad][mine[s * pad : (s + 1) * pad]] - me * local,
                            minlength=local) for s in range(ep)]
        ).flatten()  # fmt: skip
        y = experts(rows[where][by_expert], counts)[torch.argsort(by_expert)]
        out_splits = self.last_sent.view(ep, local).sum(1).tolist()  # my rows each rank computed
        in_splits = [int(c) for c in (where // pad).bincount(minlength=ep).tolist()]
        back = all_to_all(y, out_splits=out_splits, in_splits=in_splits, group=self.group)
        # back holds my rows grouped by the rank of their expert, each group in my row order
        owner = expert_idx // local
        order = torch.argsort(owner, stable=True)
        return back[torch.argsort(order)]


def make_dispatcher(kind: str, group: Any, num_experts: int) -> AllToAllDispatch:
    """The dispatcher named ``kind`` ("alltoall" or "allgather") for a layer of ``num_experts`` over ``group``."""
    kinds = {"alltoall": AllToAllDispatch, "allgather": AllGatherDispatch}
    if kind not in kinds:
        raise ValueError(f"dispatcher={kind!r}; choose one of {sorted(kinds)}")
    return kinds[kind](group, num_experts)
