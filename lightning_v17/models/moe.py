"""The reference decoder's mixture-of-experts MLP: a top-k router and SwiGLU experts fused as 3-D weights, run by
one grouped GEMM per projection (Shazeer 2017; GShard, Lepikhin 2020; Switch, Fedus 2022; DeepSeek-V3, Liu 2024).

:class:`MoE` forward, in this order (the expert-parallel engine's parity with one process relies on it):

1. router logits in fp32 for the ``T = B*S`` tokens (batch-major), scores ``softmax`` or ``sigmoid``;
2. the top-k experts of ``scores + expert_bias`` (the bias only selects, DeepSeek-V3's aux-loss-free balance); the
   weights are the scores at those experts, renormalised to sum 1 when ``router_norm_topk``;
3. with ``capacity_factor``: per *sequence* (GShard's group; a rank's batch and one process's batch then drop the
   same assignments) and expert at most ``ceil(capacity_factor * S * k / E)`` assignments, first come in token then
   slot order (Switch); the rest are dropped (``last_dropped``);
4. one row per kept assignment, in (token, slot) order, through the dispatcher (``LocalDispatch`` in one process,
   the engine's all-to-all under ``ep > 1``), combined back with their weights by ``index_add``; plus the shared
   experts' output (DeepSeek's always-on experts);
5. the routed load per expert, counted into ``expert_load`` in training (not while activation checkpointing
   recomputes the forward) and kept as ``last_load``;
6. ``aux_loss``: the sequence-wise balance loss (DeepSeek-V3 eqs. 17-20) times ``aux_loss_coef``, plus the router
   z-loss (Zoph 2022, ST-MoE) times ``z_loss_coef``; both batch-size invariant.

Inside a pipeline schedule (pp > 1, ``engine/ep/balance.py``) the schedule's loss is the last stage's, so step 6
attaches ``aux_loss`` to the layer's output instead (it rides the backward of the schedule's loss, at the main loss's
scale over the micro-batches; ``aux_loss`` keeps a detached copy), and a forward that only infers the stages' shapes
counts no load and keeps no aux loss (:attr:`MoE.pipeline_balance`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_v17.engine._dtensor import local
from lightning_v17.engine.ep.balance import (
    attach_aux_loss,
    current_pipeline_step,
    in_shape_inference,
    warn_padding_once,
)
from lightning_v17.engine.ep.tokens import TokenSplit

if TYPE_CHECKING:
    from lightning_v17.models.config import ModelConfig

__all__ = ["GroupedExperts", "LocalDispatch", "MoE", "moe_layers", "update_expert_biases"]


def _contiguous_grad(y: torch.Tensor) -> torch.Tensor:
    if y.requires_grad:  # torch._grouped_mm's backward refuses the zero-stride gradient of a .sum()
        y.register_hook(lambda g: g.contiguous())
    return y


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU experts in Hugging Face's fused layout: ``gate_up_proj`` [E, 2I, H] (gate rows, then
    up rows) and ``down_proj`` [E, H, I]; expert e computes ``down_e(silu(gate_e x) * up_e x)``, weights applied as
    ``x @ W.T``.

    Args:
        num_experts: E.
        hidden: H.
        intermediate: I, each expert's SwiGLU width.
        grouped: one ``torch._grouped_mm`` per projection; False: the per-expert loop (Hugging Face's eager path),
            kept as a reference.
    """

    def __init__(self, num_experts: int, hidden: int, intermediate: int, *, grouped: bool = True) -> None:
        super().__init__()
        self.num_experts, self.hidden, self.intermediate, self.grouped = num_experts, hidden, intermediate, grouped
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        if not self.gate_up_proj.is_meta:
            self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.gate_up_proj, std=0.02)
        nn.init.normal_(self.down_proj, std=0.02)

    def forward(self, x: torch.Tensor, counts: torch.Tensor, weight_fn: Callable | None = None) -> torch.Tensor:
        """Rows ``x`` [N, H] grouped by local expert (``counts`` [E_local] int64 rows each, summing to N) -> [N, H].

        The local experts are the weights' local dim 0 (the engine may shard them over ``ep``). The grouped GEMM
        needs 16-byte-aligned strides (H and I multiples of 4 in fp32, of 8 in bf16); other sizes, and an empty
        ``x``, take the per-expert loop, which computes the same. ``weight_fn`` wraps each weight as it is used
        (``TokenSplit.weight``: its gradient summed over the sequence-parallel ranks)."""
        gate_up, down = local(self.gate_up_proj), local(self.down_proj)
        if weight_fn is not None:
            gate_up, down = weight_fn(gate_up), weight_fn(down)
        aligned = all(n * x.element_size() % 16 == 0 for n in (self.hidden, self.intermediate))
        if not (self.grouped and aligned) or x.shape[0] == 0:
            return self._loop(x, counts, gate_up, down)
        offs = counts.cumsum(0).to(torch.int32)
        h = _contiguous_grad(torch._grouped_mm(x, gate_up.transpose(-2, -1), offs=offs))
        gate, up = h.chunk(2, dim=-1)
        return _contiguous_grad(torch._grouped_mm(F.silu(gate) * up, down.transpose(-2, -1), offs=offs))

    @staticmethod
    def _loop(x: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        outs, start = [], 0
        for e, n in enumerate(counts.tolist()):
            gate, up = F.linear(x[start : start + n], gate_up[e]).chunk(2, dim=-1)
            outs.append(F.linear(F.silu(gate) * up, down[e]))
            start += n
        return torch.cat(outs) if outs else x.new_zeros((0, down.shape[1]))


class LocalDispatch:
    """The single-process dispatcher: sort the assignment rows by expert (stable), run the experts, unsort."""

    def __call__(self, x: torch.Tensor, expert_idx: torch.Tensor, experts: nn.Module) -> torch.Tensor:
        """``x`` [M, H] one row per kept assignment, ``expert_idx`` [M] global ids -> outputs [M, H], x's order."""
        order = torch.argsort(expert_idx, stable=True)
        counts = torch.bincount(expert_idx, minlength=experts.num_experts)
        y_sorted = experts(x[order], counts)
        y = torch.empty_like(y_sorted)
        y[order] = y_sorted  # the inverse permutation by a scatter (no second sort)
        return y


class _WeightsThrough:
    """The routed experts as a dispatcher calls them (``experts(rows, counts)``, ``experts.num_experts``), each of
    their weights used through ``weight_fn``."""

    def __init__(self, experts: GroupedExperts, weight_fn: Callable) -> None:
        self.experts, self.weight_fn, self.num_experts = experts, weight_fn, experts.num_experts

    def __call__(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return self.experts(x, counts, weight_fn=self.weight_fn)


class _SharedExperts(nn.Module):
    def __init__(self, hidden: int, width: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, width, bias=False)
        self.w2 = nn.Linear(width, hidden, bias=False)
        self.w3 = nn.Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor, weight_fn: Callable | None = None) -> torch.Tensor:
        if weight_fn is None:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        w1, w2, w3 = (weight_fn(m.weight) for m in (self.w1, self.w2, self.w3))
        return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)


class MoE(nn.Module):
    """The MoE MLP of a block (see the module docstring for the forward).

    Attributes:
        router: ``nn.Linear(H, E, bias=False)``.
        experts: the routed experts (:class:`GroupedExperts`).
        shared_experts: an always-on SwiGLU of width ``shared_experts * expert_ffn``, or None.
        expert_bias: [E] fp32 buffer (persistent: checkpoints carry it), the aux-loss-free selection bias.
        expert_load: [E] fp32 buffer (not persistent), assignments routed per expert since the last bias update.
        dispatcher: None (one process: :class:`LocalDispatch`) or the engine's dispatcher under ``ep > 1``.
        aux_loss, last_load, last_dropped: of the last forward.
        pipeline_balance: True: under a pipeline schedule the layer attaches its aux loss to its output and skips
            the shape-inference forward (``engine.ep.check_pipeline_moe`` refuses balance terms in layers without it).
    """

    pipeline_balance = True

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c = config
        self.num_experts, self.experts_per_token = c.num_experts, c.experts_per_token
        self.router_score, self.router_norm_topk = c.router_score, c.router_norm_topk
        self.capacity_factor, self.aux_loss_coef, self.z_loss_coef = c.capacity_factor, c.aux_loss_coef, c.z_loss_coef
        self.expert_bias_rate = c.expert_bias_rate
        width = c.expert_ffn or c.ffn
        self.router = nn.Linear(c.hidden, c.num_experts, bias=False)
        self.experts = GroupedExperts(c.num_experts, c.hidden, width)
        self.shared_experts = _SharedExperts(c.hidden, c.shared_experts * width) if c.shared_experts else None
        self.register_buffer("expert_bias", torch.zeros(c.num_experts), persistent=True)
        self.register_buffer("expert_load", torch.zeros(c.num_experts), persistent=False)
        self.dispatcher: Callable[..., torch.Tensor] | None = None
        self.aux_loss: torch.Tensor = torch.zeros(())
        self.last_load: torch.Tensor = torch.zeros(c.num_experts)
        self.last_dropped: torch.Tensor = torch.zeros((), dtype=torch.long)

    #: routes a slice of each sequence (sequence or context parallelism) with the whole sequences' statistics
    #: (:meth:`_local_tokens`): a tensor-parallel plan with sequence parallelism leaves its input sequence-sharded
    v17_split_tokens = True

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> MoE:
        """``Module._apply`` (``.to``, ``.cuda``, ``to_empty``, ...) keeping the balance buffers fp32: a bf16-true
        model would otherwise count its load in bf16, exact only to 256 tokens per expert."""
        super()._apply(fn, recurse)
        for name in ("expert_bias", "expert_load"):
            buf = self._buffers[name]
            if buf is not None and buf.dtype != torch.float32:
                self._buffers[name] = buf.float()
        return self

    def _groups(self, idx: torch.Tensor, b: int, s: int) -> torch.Tensor:
        """[B*S*k] the (sequence, expert) group ``sequence * E + expert`` of each assignment, in (token, slot) order."""
        seq = torch.arange(b, device=idx.device).repeat_interleave(s * self.experts_per_token)
        return seq * self.num_experts + idx.reshape(-1)

    def _keep(self, group: torch.Tensor, b: int, s: int) -> torch.Tensor:
        """[T, k] mask of the assignments within their sequence's per-expert capacity, first come in (token, slot)
        order (Switch). An assignment's arrival rank in its group comes from one stable sort: O(T k) memory, not the
        O(T k E) of a one-hot cumsum."""
        k, e = self.experts_per_token, self.num_experts
        capacity = math.ceil(self.capacity_factor * s * k / e)
        order = torch.argsort(group, stable=True)
        sizes = torch.bincount(group, minlength=b * e)
        first = sizes.cumsum(0) - sizes  # where each group starts in the sorted order
        rank = torch.empty_like(group)
        rank[order] = torch.arange(group.numel(), device=group.device) - first[group[order]]
        return (rank < capacity).view(b * s, k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, split = self._local_tokens(x)
        self._split = split  # this forward's token split (None: the whole sequences are here)
        b, s, h = x.shape
        k, e = self.experts_per_token, self.num_experts
        flat = x.reshape(b * s, h)
        router = self.router.weight if split is None else split.weight(self.router.weight)
        logits = F.linear(flat.float(), router.float())  # the router in fp32
        scores = logits.softmax(-1) if self.router_score == "softmax" else logits.sigmoid()
        idx = torch.topk(scores.detach() + self.expert_bias, k, dim=-1).indices  # [T, k]
        weights = scores.gather(1, idx)
        if self.router_norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        group = self._groups(idx, b, s)
        if self.capacity_factor is None:
            keep = torch.ones_like(idx, dtype=torch.bool)
        elif split is None:
            keep = self._keep(group, b, s)
        else:  # the arrival order is the whole sequence's: its expert ids gathered (S * k integers a sequence)
            whole = split.gather_seq(idx.view(b, s, k))
            keep = split.local(self._keep(self._groups(whole, b, whole.shape[1]), b, whole.shape[1]).view(b, -1, k))
            keep = keep.reshape(b * s, k)
        token_of = torch.arange(b * s, device=x.device).repeat_interleave(k)[keep.reshape(-1)]
        expert_of = idx.reshape(-1)[keep.reshape(-1)]
        weight_of = weights.reshape(-1)[keep.reshape(-1)]
        dispatch = self.dispatcher if self.dispatcher is not None else LocalDispatch()
        experts = self.experts if split is None or not split.sums_weight_grads else _WeightsThrough(self.experts,
                                                                                                  split.weight)
        y = dispatch(flat[token_of], expert_of, experts)
        out = torch.zeros_like(flat).index_add(0, token_of, y * weight_of[:, None].to(y.dtype))
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat, None if split is None else split.weight)
        out = out.view(b, s, h)
        if in_shape_inference():  # torch's pipelining inferring the stages' shapes: not a forward of the step
            return out
        load = torch.bincount(expert_of, minlength=e).float()
        load = load if split is None else split.all_reduce(load)  # the whole sequences' load on every rank
        self.last_load, self.last_dropped = load, (~keep).sum()
        if self.training and torch._C._current_graph_task_id() == -1:  # not inside backward (a recompute)
            self.expert_load += load
        aux = self._aux(logits, scores, group, b, s)
        step = current_pipeline_step()
        if step is None:  # the caller adds aux_loss to its loss (LlamaLM.training_step)
            self.aux_loss = aux
            return out
        # inside a pipeline schedule the loss is the last stage's: the aux loss rides this output's backward
        if self.aux_loss_coef or self.z_loss_coef or self.expert_bias_rate:
            warn_padding_once(step)
        self.aux_loss = aux.detach()
        attached = attach_aux_loss(out, aux)
        return out if attached is None else attached

    @staticmethod
    def _local_tokens(x: torch.Tensor) -> tuple[torch.Tensor, TokenSplit | None]:
        """The tokens this rank routes, and how the sequences are split over ranks (``engine/ep/tokens.py``).

        * A ``Replicate()`` DTensor on ``tp`` (tensor parallelism without SP: the column-parallel projections'
          input): the whole sequences, run as the plain tensor they are on every tp rank (the router and the experts
          are not tp-sharded); ``to_local``'s backward hands the gradient back as ``Replicate()``, each tp rank
          computes the same full gradient and nothing is summed over tp.
        * A ``Shard(1)`` DTensor on ``tp`` (sequence parallelism: the plan leaves layers with
          ``v17_split_tokens`` sequence-sharded): this tp rank's ``S / tp`` tokens only; the weights' gradients
          are summed over tp and the per-sequence statistics gathered (:meth:`TokenSplit.sequence_parallel`).
        * Under cp (a current ``CPContext``): this cp rank's ``S / cp`` tokens (:meth:`TokenSplit.context_parallel`);
          with SP beside it, the tp rank's contiguous part of those.
        """
        from torch.distributed.tensor import DTensor, Shard

        from lightning_v17.engine.cp import current_cp_context

        ctx = current_cp_context()
        split = None if ctx is None else TokenSplit.context_parallel(ctx.group, ctx.layout.order(x.device))
        if isinstance(x, DTensor):
            if tuple(x.placements) == (Shard(1),):  # under cp too: a contiguous part of the cp rank's tokens
                split = TokenSplit.sequence_parallel(x.device_mesh.get_group(), outer=split)
            elif not all(p.is_replicate() for p in x.placements):
                raise ValueError(
                    f"the MoE layer got a {x.placements} DTensor on {x.device_mesh.mesh_dim_names}; it takes whole "
                    "sequences (Replicate) or slices of them (Shard(1), sequence parallelism)"
                )
            x = x.to_local()
        return x, split

    def _aux(self, logits: torch.Tensor, scores: torch.Tensor, group: torch.Tensor, b: int, s: int) -> torch.Tensor:
        """``aux_loss_coef * mean_seq sum_e f_e P_e`` (DeepSeek-V3 eqs. 17-20) plus ``z_loss_coef * mean_t lse^2``
        (ST-MoE eq. 5): ``f_e = E / (k S) *`` the sequence's assignments to e before capacity, ``P_e`` the mean of
        its tokens' normalised scores.

        With the sequences split over ranks (``self._split``, ``s = S / ranks`` here) the counts are summed over the
        ranks (``E`` integers a sequence), each rank's share sums its own tokens' scores (and z-terms) over the whole
        ``S``, and :meth:`TokenSplit.combine` makes the whole value with the gradient of the share."""
        k, e = self.experts_per_token, self.num_experts
        split = getattr(self, "_split", None)
        if split is not None:
            return self._aux_split(logits, scores, group, b, s, split)
        aux = logits.new_zeros(())
        if self.aux_loss_coef:
            counts = torch.bincount(group, minlength=b * e).view(b, e).float()  # assignments before capacity
            f = counts * (e / (k * s))
            p = (scores / scores.sum(-1, keepdim=True)).view(b, s, e).mean(1)  # [B, E]
            aux = aux + self.aux_loss_coef * (f * p).sum(-1).mean()
        if self.z_loss_coef:
            aux = aux + self.z_loss_coef * torch.logsumexp(logits, dim=-1).pow(2).mean()
        return aux

    def _aux_split(self, logits: torch.Tensor, scores: torch.Tensor, group: torch.Tensor, b: int, s: int,
                   split: TokenSplit) -> torch.Tensor:  # fmt: skip
        k, e = self.experts_per_token, self.num_experts
        whole = s * split.size  # S
        share = logits.new_zeros(())
        if self.aux_loss_coef:
            counts = split.all_reduce(torch.bincount(group, minlength=b * e).view(b, e).float())  # the sequences'
            f = counts * (e / (k * whole))
            p = (scores / scores.sum(-1, keepdim=True)).view(b, s, e).sum(1) / whole  # this rank's part of P
            share = share + self.aux_loss_coef * (f * p).sum(-1).mean()
        if self.z_loss_coef:
            share = share + self.z_loss_coef * torch.logsumexp(logits, dim=-1).pow(2).sum() / (b * whole)
        if not (self.aux_loss_coef or self.z_loss_coef):
            return share
        return split.combine(share)

    @torch.no_grad()
    def update_expert_bias(self, total_load: torch.Tensor) -> None:
        """DeepSeek-V3's update: ``bias += rate * sign(mean(load) - load)``; then the load count restarts."""
        if self.expert_bias_rate:
            load = total_load.to(self.expert_bias.device, torch.float32)
            self.expert_bias += self.expert_bias_rate * torch.sign(load.mean() - load)
        self.expert_load.zero_()


def moe_layers(module: nn.Module) -> list[MoE]:
    """The :class:`MoE` layers of ``module``, in module order."""
    return [m for m in module.modules() if isinstance(m, MoE)]


def update_expert_biases(module: nn.Module, all_reduce: Callable[[torch.Tensor], Any] | None = None) -> None:
    """One bias update for every MoE layer of ``module``: the loads stacked, ``all_reduce`` (if given) summing them
    in place over the data-parallel ranks, then each layer's :meth:`MoE.update_expert_bias`.

    A plain PyTorch loop calls it after each ``optimizer.step()``; ``LlamaLM`` does so itself under any Lightning
    strategy (``LlamaLM.step_expert_biases``)."""
    layers = moe_layers(module)
    if not layers:
        return
    loads = torch.stack([m.expert_load for m in layers])
    if all_reduce is not None:
        all_reduce(loads)
    for m, load in zip(layers, loads):
        m.update_expert_bias(load)
