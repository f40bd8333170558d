"""Expert parallelism for any module with MoE layers: the experts' weights sharded over ``ep`` (DTensor
``Shard(0)``: ``E / ep`` whole experts per rank), the layer's dispatcher swapped for the all-to-all one, and the
experts' gradients reduced once, over the ranks that hold the same experts.

``ep`` is folded out of the data-parallel ranks (torchtitan's sparse mesh, Megatron-core's "parallel folding"):
``dp_shard = efsdp x ep``, ep innermost, so the ``ep`` ranks of one group are consecutive ``dp_shard`` ranks and
each of them trains on its own batch. Everything that is not an expert keeps the dense mesh (ZeRO over
``dp_shard``, replicas over ``dp_replicate``). The expert-data-parallel ranks ``edp = dp_replicate x efsdp`` hold
the same experts: with ``efsdp > 1`` ZeRO partitions them further over ``efsdp`` and reduces their gradients, at
ZeRO-3 as FSDP2 units of their own (``engine/zero/fsdp.py``, ``apply_fsdp(expert_mesh=)``), at ZeRO-1/2 in an
expert ZeRO engine (``engine/zero/stages_0_2.py``, ``ZeroEngine(experts=True)``); otherwise (ZeRO-0, or
``efsdp = 1``) they are outside the ZeRO partition and outside FSDP2 (``ignored_params``), replicated over ``edp``,
and reduced here.

The gradient of a local expert is, after backward, the sum over the tokens that every rank of the ep group sent it
(the all-to-all's backward adds nothing else). :class:`ExpertGradSync` (or FSDP2's reduce-scatter at ZeRO-3 over
``efsdp``, with the same divide factor) then sums it over ``edp`` and divides by the
whole data-parallel degree ``dp = dp_replicate x dp_shard``, once, on the micro-step that synchronises: the mean
over every rank's loss, what one process computes on the concatenated batch, and what the dense part's reduction
gives too (the factor a second division or a missing one would be off by is what pytorch#160285 reports).

Beside tensor parallelism (``ep x tp``) the ep groups are the same per tp index (one group per tp index, ranks that
share the tp index and differ in dp_shard) and the experts are replicated over tp (not tp-sharded: ETP = 1). Without
sequence parallelism each tp rank routes and dispatches the whole, replicated sequence: the tp ranks of one dp rank
compute the same expert outputs and the same expert gradients, so nothing is summed over tp and the reduction stays
over ``edp``. With ``TPPolicy(sequence_parallel=True)`` (Megatron-core's MoE under SP) each tp rank routes only its
``S / tp`` tokens: no expert work is repeated over tp, and the router's, the shared and the routed experts' gradients
are summed over tp as the layer uses them (``engine/ep/tokens.py``), before the reduction over ``edp``. Beside
context parallelism (``ep x cp``) each cp rank dispatches its ``S / cp`` tokens over the ep group of its cp index;
the cp ranks of a row hold the same experts, so ``edp`` includes cp (``lightning_v17/mesh.py``) and the divisor is
``dp x cp``, as for the dense gradients. Inside pipeline stages (``ep x pp``) each stage's ep group dispatches its own
micro-batches, and the experts' gradients accumulate unreduced over the schedule (:meth:`ExpertGradSync.finish_grad_sync`).

A MoE layer is found by what it has, not by its class: a ``dispatcher`` attribute, an ``experts`` child whose
parameters are 3-D with the expert on dim 0, and ``num_experts`` (:func:`find_moe_layers`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_v17.config import V17ConfigError
from lightning_v17.engine._dtensor import local as _local
from lightning_v17.engine.ep.dispatch import make_dispatcher

__all__ = ["ExpertGradSync", "ExpertParallel", "apply_expert_parallel", "check_pipeline_moe", "expert_params",
           "find_moe_layers", "is_expert_param"]  # fmt: skip

log = logging.getLogger(__name__)

#: the attribute that marks an expert weight sharded over ep (ZeRO, FSDP2 and the replica sync leave it out)
EXPERT_MARK = "_v17_expert"


def find_moe_layers(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """(fqn, layer) of every MoE layer in ``module``, in module order."""
    out = []
    for name, m in module.named_modules():
        experts = getattr(m, "experts", None)
        if isinstance(experts, nn.Module) and hasattr(m, "dispatcher") and hasattr(m, "num_experts"):
            out.append((name, m))
    return out


#: the MoE layer attributes that need every forward to be a real one and every loss term in the pipeline's loss
_BALANCE_TERMS = ("aux_loss_coef", "z_loss_coef", "expert_bias_rate")


def check_pipeline_moe(module: nn.Module, *, pp: int) -> None:
    """Refuse MoE layers whose balance terms a pipeline (pp > 1) would lose, before the model is cut.

    The schedule's loss is the last stage's ``loss_fn`` of the logits, and torch's pipelining infers the stages'
    shapes with an extra forward of micro-batch 0 on its first step. A layer that declares ``pipeline_balance``
    (the reference :class:`~lightning_v17.models.moe.MoE`) attaches its balance losses to its output activations
    inside the schedule and counts no load in that extra forward (``engine/ep/balance.py``): every term is honoured.
    Any other layer with ``aux_loss_coef``, ``z_loss_coef`` or ``expert_bias_rate`` is refused.

    Raises:
        V17ConfigError: naming the layer, the option and the fix.
    """
    if pp <= 1:
        return
    for name, layer in find_moe_layers(module):
        if getattr(layer, "pipeline_balance", False):
            continue
        for term in _BALANCE_TERMS:
            if getattr(layer, term, 0):
                lost = (
                    "the pipeline's shape inference runs an extra forward that the layer would count as routed load"
                    if term == "expert_bias_rate"
                    else "the pipeline's loss is the last stage's, so a balance loss that the layer hands its caller "
                    "never reaches the backward"
                )
                raise V17ConfigError(
                    f"pp={pp} with {term}={getattr(layer, term)} in the MoE layer {name} ({type(layer).__name__}): "
                    f"{lost}; attach the aux loss to the layer's output with lightning_v17.engine.ep.balance."
                    "attach_aux_loss, skip counting inside balance.in_shape_inference(), and set the layer's "
                    f"pipeline_balance = True, or set {term}=0 with pp > 1"
                )


def is_expert_param(p: torch.Tensor) -> bool:
    return bool(getattr(p, EXPERT_MARK, False))


def expert_params(module: nn.Module) -> list[nn.Parameter]:
    seen: set[int] = set()
    out = []
    for p in module.parameters():
        if is_expert_param(p) and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


@dataclass
class ExpertGradSync:
    """Reduce the experts' gradients once per optimizer step: SUM over ``edp``, divided by ``dp``.

    Post-accumulate-grad hooks on the expert weights; while :attr:`require_grad_sync` is False (accumulation
    micro-steps, and every micro-batch of a pipeline schedule) the gradients only accumulate, and are reduced either
    by the next synchronising backward's hook (Lightning's last accumulation micro-step) or by
    :meth:`finish_grad_sync` (the pipeline's one reduction after its last micro-batch), never twice.
    """

    params: list[nn.Parameter]
    edp_group: Any
    dp: int
    require_grad_sync: bool = True
    _hooks: list[Any] = field(default_factory=list)
    _pending: set[int] = field(default_factory=set)  # ids of the weights whose gradient accumulated unreduced

    def __post_init__(self) -> None:
        self.edp = dist.get_world_size(self.edp_group) if self.edp_group is not None else 1
        self.attach()

    def attach(self) -> None:
        if not self._hooks:
            self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]

    @torch.no_grad()
    def _on_grad(self, p: torch.Tensor) -> None:
        if p.grad is None:
            return
        if not self.require_grad_sync:
            self._pending.add(id(p))
            return
        self._pending.discard(id(p))
        self._reduce(p)

    def _reduce(self, p: torch.Tensor) -> None:
        g = _local(p.grad)
        if self.edp > 1:
            dist.all_reduce(g, group=self.edp_group)
        g.div_(self.dp)

    @torch.no_grad()
    def finish_grad_sync(self) -> None:
        """Reduce the gradients that accumulated while :attr:`require_grad_sync` was False (in parameter order, the
        same on every edp rank: they hold the same experts and ran the same micro-batches)."""
        pending, self._pending = self._pending, set()
        for p in self.params:
            if id(p) in pending and p.grad is not None:
                self._reduce(p)

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


@dataclass
class ExpertParallel:
    """What :func:`apply_expert_parallel` did: the layers, their sharded weights, the gradient reduction."""

    layers: list[tuple[str, nn.Module]]
    params: list[nn.Parameter]
    grad_sync: ExpertGradSync
    ep_mesh: Any


def _shard_experts(layer: nn.Module, ep_mesh: Any) -> list[nn.Parameter]:
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    ep = ep_mesh.size()
    out = []
    for name, p in list(layer.experts.named_parameters(recurse=True)):
        if isinstance(p, DTensor):
            raise V17ConfigError(
                f"expert weight {name} is already a DTensor ({p.placements} on {p.device_mesh.mesh_dim_names}); "
                "ep > 1 shards the experts itself: leave them out of the tensor-parallel plan"
            )
        if p.dim() < 2 or p.shape[0] != layer.num_experts:
            raise V17ConfigError(
                f"expert weight {name} has shape {tuple(p.shape)}; ep > 1 needs the experts fused on dim 0 "
                f"({layer.num_experts} x ...), as in Hugging Face's fused layout"
            )
        if p.is_meta:
            dt = DTensor.from_local(torch.empty_like(p).chunk(ep)[0], ep_mesh, [Shard(0)], run_check=False,
                                    shape=p.shape, stride=p.stride())  # fmt: skip
        else:
            dt = distribute_tensor(p.detach(), ep_mesh, [Shard(0)])
        new = nn.Parameter(dt, requires_grad=p.requires_grad)
        setattr(new, EXPERT_MARK, True)
        owner_name, _, leaf = name.rpartition(".")
        owner = layer.experts.get_submodule(owner_name) if owner_name else layer.experts
        setattr(owner, leaf, new)
        out.append(new)
    return out


def apply_expert_parallel(
    module: nn.Module,
    *,
    ep_mesh: Any,
    edp_group: Any,
    dp: int,
    layers: Iterable[tuple[str, nn.Module]] | None = None,
    dispatcher: str = "alltoall",
    reduce_grads: bool = True,
    cp: int = 1,
) -> ExpertParallel:
    """Shard every MoE layer's experts over ``ep_mesh`` and give it the all-to-all dispatcher.

    Args:
        module: the model (its MoE layers are found by :func:`find_moe_layers`).
        ep_mesh: the 1-D ``ep`` DeviceMesh.
        edp_group: the ranks that hold the same experts (``dp_replicate x efsdp``), or None when there are none.
        dp: the whole data-parallel degree, the divisor of the experts' gradients.
        layers: the (fqn, layer) pairs to shard; None: every layer :func:`find_moe_layers` finds.
        dispatcher: "alltoall" (:class:`~lightning_v17.engine.ep.dispatch.AllToAllDispatch`) or "allgather"
            (:class:`~lightning_v17.engine.ep.dispatch.AllGatherDispatch`).
        reduce_grads: reduce the experts' gradients here (:class:`ExpertGradSync`); False when ZeRO-3 shards the
            experts over ``efsdp`` and FSDP2 reduces them (``engine.zero.fsdp.apply_fsdp``'s ``expert_mesh``).
        cp: the context-parallel size: each rank routes ``S / cp`` tokens of every row; a layer that does not
            declare ``v17_split_tokens`` (gathering its per-sequence statistics over cp) is warned about once.

    Raises:
        V17ConfigError: no MoE layer, an expert count that ``ep`` does not divide, weights not fused on dim 0.
    """
    ep = ep_mesh.size()
    found = list(layers) if layers is not None else find_moe_layers(module)
    if not found:
        raise V17ConfigError(
            f"ep={ep} shards the experts of MoE layers, and {type(module).__name__} has none (a layer with "
            "`experts`, `num_experts` and `dispatcher`); use ep=1 for a dense model"
        )
    params: list[nn.Parameter] = []
    for name, layer in found:
        if layer.num_experts % ep:
            raise V17ConfigError(
                f"ep={ep} must divide the {layer.num_experts} experts of {name or 'the MoE layer'}; choose ep among "
                f"{[d for d in range(1, layer.num_experts + 1) if layer.num_experts % d == 0]}"
            )
        if cp > 1 and not getattr(type(layer), "v17_split_tokens", False):
            log.warning(
                "cp=%d: the MoE layer %s (%s) routes each cp rank's S/%d tokens and computes any routing statistics "
                "of its own (a balance loss, a capacity) on them alone; the dispatch and the experts' gradients are "
                "exact, statistics over whole sequences or batches are not", cp, name, type(layer).__name__, cp,
            )
        params += _shard_experts(layer, ep_mesh)
        layer.dispatcher = make_dispatcher(dispatcher, ep_mesh.get_group(), layer.num_experts)
    sync = ExpertGradSync(params if reduce_grads else [], edp_group, dp)
    return ExpertParallel(layers=found, params=params, grad_sync=sync, ep_mesh=ep_mesh)
