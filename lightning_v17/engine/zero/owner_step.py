"""ZeRO-3 steps of whole parameters on owner ranks, for the user's own optimizers that cannot step FSDP2's shards.

Why: at ZeRO-3 the optimizer holds FSDP2's dim-0 shards (DTensor ``Shard(0)`` over ``dp_shard``). An elementwise
update (SGD, Adam/AdamW, Lion) of a shard is the shard of the update, so those step the shards
(:mod:`lightning_v17.optim.local_step`). Others do not:

* ``torch.optim.Adafactor`` factors a matrix's second moment into row and column means and scales its step by the
  parameter's RMS and the update's RMS (Shazeer & Stern 2018, Alg. 4, §5-§6). On DTensors torch 2.13 fails
  ("aten.pow_.Scalar: in-place operations that require placement changes are not supported"); on a local shard
  the column means and both RMS values would cover this rank's rows only.
* bitsandbytes' optimizers are C kernels over plain tensors ("mixed torch.Tensor and DTensor"). Their 8-bit state is
  quantized per block of 256 values of the tensor stepped (Dettmers 2022, §2.1), so a shard that does not start on
  a block boundary of the whole tensor quantizes differently, and a shard under ``min_8bit_size`` keeps fp32 state
  where the whole tensor gets 8-bit state.

How (the whole-parameter partition of ``ZeroRedundancyOptimizer`` and DeepSpeed ZeRO-1/2, as the ZeRO-1/2 engine's
``optimizer_partition="params"``): every sharded parameter has one owner among the ``dp_shard`` ranks, assigned
largest first to the least-loaded rank (elements; ties to the lower rank), the same on every rank. A step

1. runs the closure (forward and backward; the gradients are FSDP2's reduce-scattered shards);
2. sends every rank's rows of each parameter and of its gradient to the parameter's owner: one
   ``all_to_all_single`` per (mesh axis, dtype) for all parameters (FSDP2's ``torch.chunk`` rows, padded to
   ``ceil(dim0 / dp_shard)``), with one more element per parameter flagging whether this rank has its gradient;
3. runs the optimizer's own ``step`` (its class, hyperparameters, hooks, LR schedulers) on the owner, over plain full
   tensors. Param groups keep their length and order (bitsandbytes looks its per-parameter overrides up by
   position): a parameter owned by another rank is a 0-element placeholder without gradient, which optimizers skip;
4. sends every rank its rows of the updated parameters, written into its FSDP2 shard (one ``all_to_all_single`` per
   (mesh axis, dtype)).

So each parameter's update is the one-process update of the whole parameter from FSDP2's reduced gradient, and its
state lives on its owner only: full plain tensors keyed by the DTensor parameter, as ``optimizer_partition="params"``
keeps them at ZeRO-1/2. DTensor parameters replicated over every mesh axis step whole on every rank; plain tensors as
they are. Memory per rank: the owned parameters' state (balanced to within the largest parameter), and during the
step the owned parameters' full values and gradients twice (the receive buffer, then the assembled tensors).

Checkpoints: :meth:`OwnerStep.state_dict` is the optimizer's own ``state_dict()`` keyed by FQN (each owner's whole
states; DCP writes each once and reads it into whichever rank owns it in the loading run, at any world size), and
:meth:`OwnerStep.load_state_dict` hands it to the optimizer's own ``load_state_dict``.

Which optimizers step this way is decided once per optimizer by :func:`plan_step`. Refused at setup, with the fix:
parameters split over a second mesh axis (tensor parallel at ZeRO-3), offloaded optimizer state or parameters (the
offloaded step runs each rank's own chunks), and ``torch.optim.LBFGS`` per parameter (its line search couples every
parameter: torch steps it on the DTensors, exactly, where every shard has the same rows; uneven shards are refused).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from lightning_v17.config import V17ConfigError
from lightning_v17.engine.state import optimizer_state
from lightning_v17.engine.zero.layout import chunk_rows
from lightning_v17.optim.factory import bitsandbytes_optimizer_base
from lightning_v17.optim.local_step import is_torch_elementwise, local_grad, replace_step

__all__ = ["OwnerStep", "StepPlan", "attach_owner_steps", "owner_step_of", "plan_step"]

log = logging.getLogger(__name__)


class StepPlan(Enum):
    """How an optimizer steps FSDP2's DTensor shards at ZeRO-3 (:func:`plan_step`)."""

    #: it steps the DTensors itself: our library's classes, torch's DTensor dispatch (and the faster local step of
    #: :func:`~lightning_v17.optim.local_step.enable_local_step` for torch's elementwise classes)
    AS_IS = "as_is"
    #: elementwise, but cannot take DTensors: its own step over the local tensors (``step_on_local_shards``)
    LOCAL_SHARDS = "local_shards"
    #: whole parameters on owner ranks (this module)
    OWNER = "owner"


def _bitsandbytes_elementwise(opt: Any) -> bool:
    """Whether a bitsandbytes optimizer's update is elementwise for every parameter: 32-bit state (8-bit state is
    block-quantized) and no per-tensor norm (``max_unorm``: LAMB/LARS trust ratios; ``percentile_clipping`` of
    older releases), with the per-parameter overrides of its ``GlobalOptimManager`` applied."""
    for gi, group in enumerate(opt.param_groups):
        for pi in range(len(group["params"])):
            cfg = opt.get_config(gi, pi, group)
            if cfg.get("optim_bits", 32) != 32 or cfg.get("max_unorm", 0.0) > 0.0:
                return False
            if cfg.get("percentile_clipping", 100) < 100:
                return False
    return True


def _check_lbfgs(opt: torch.optim.LBFGS) -> None:
    """LBFGS flattens every gradient into one vector (``grad.view(-1)``), which DTensor refuses for a shard of uneven
    rows ("Cannot flatten unevenly sharded tensor"): refuse that before the first step."""
    for g in opt.param_groups:
        for p in g["params"]:
            if not isinstance(p, DTensor):
                continue
            for axis, pl in enumerate(p.placements):
                n = p.device_mesh.size(axis)
                if pl.is_shard() and p.shape[pl.dim] % n:
                    raise V17ConfigError(
                        f"torch.optim.LBFGS at zero_stage=3 flattens every gradient into one vector, which FSDP2's "
                        f"shards allow only when each parameter's dim {pl.dim} divides evenly over the "
                        f"{p.device_mesh.mesh_dim_names[axis]} axis; a parameter of shape {tuple(p.shape)} does not "
                        f"split over {n} ranks. Use zero_stage=0 with LBFGS (its line search couples all parameters, "
                        "so stages 1-2 cannot partition it), or sizes divisible by the axis size"
                    )


def plan_step(optimizer: Any, *, partition: str = "auto") -> StepPlan:
    """How ``optimizer`` steps DTensor shards at ZeRO-3, decided once before its first step.

    Args:
        optimizer: the user's optimizer (the torch optimizer: the strategy unwraps Lightning's ``LightningOptimizer``).
        partition: ``optimizer_partition``. "auto": :attr:`StepPlan.OWNER` for what needs whole parameters or cannot
            step DTensors (``torch.optim.Adafactor``, bitsandbytes' 8-bit optimizers, any class that is not known or
            declared elementwise: the ZeRO-1/2 engine's "auto" gives these whole parameters too),
            :attr:`StepPlan.LOCAL_SHARDS` for elementwise classes that cannot take DTensors (bitsandbytes' 32-bit
            ones, a class declaring ``v17_elementwise = True``), :attr:`StepPlan.AS_IS` for the rest (our library,
            torch's elementwise classes, LBFGS). "rows": never whole parameters; what cannot step DTensors steps
            this rank's rows, as a ZeRO-1/2 "rows" partition hands them to it (exact for elementwise optimizers
            only). "params": whole parameters for every optimizer.

    Raises:
        V17ConfigError: ``torch.optim.LBFGS`` with ``partition="params"``, or over unevenly sharded parameters.
    """
    opt = optimizer
    if isinstance(opt, torch.optim.LBFGS):
        if partition == "params":
            raise V17ConfigError(
                "optimizer_partition='params' cannot step torch.optim.LBFGS per parameter: its line search couples "
                "all parameters; use optimizer_partition='auto' (at zero_stage=3 torch steps LBFGS on the DTensors)"
            )
        _check_lbfgs(opt)
        return StepPlan.AS_IS  # torch's DTensor dispatch completes its dot products over the shards
    if partition == "params":
        return StepPlan.OWNER
    if getattr(opt, "v17_kind", None) is not None:
        return StepPlan.AS_IS  # lightning_v17.optim: every class steps DTensor shards (Adafactor completes its sums)
    declared = getattr(opt, "v17_elementwise", None)
    torch_elementwise = declared is None and is_torch_elementwise(opt)  # torch's classes step DTensors
    if partition == "rows":
        return StepPlan.AS_IS if torch_elementwise else StepPlan.LOCAL_SHARDS
    base = bitsandbytes_optimizer_base()
    if base is not None and isinstance(opt, base):
        return StepPlan.LOCAL_SHARDS if _bitsandbytes_elementwise(opt) else StepPlan.OWNER
    if declared is not None:
        return StepPlan.LOCAL_SHARDS if declared else StepPlan.OWNER
    return StepPlan.AS_IS if torch_elementwise else StepPlan.OWNER


@dataclass
class _Entry:
    """One sharded parameter: its rows over the process group of its ``Shard(0)`` mesh axis, and its owner."""

    index: int  # position in the flattened param groups
    param: DTensor
    group: Any  # process group of the mesh axis that shards dim 0
    world: int
    rank: int  # this rank's index in ``group``
    rows: int  # dim 0
    row_numel: int
    padded: int  # ceil(rows / world): every rank's chunk in the exchange buffers
    owner: int = -1

    @property
    def seg(self) -> int:
        return self.padded * self.row_numel

    def span(self, r: int) -> tuple[int, int]:
        """Rows ``[start, stop)`` of dim 0 held by group rank ``r`` (FSDP2's ``torch.chunk`` rows)."""
        return chunk_rows(self.rows, self.world, r)


def _rows(t: torch.Tensor, row_numel: int) -> torch.Tensor:
    return t.reshape(-1, row_numel)


class OwnerStep:
    """Steps ``optimizer``'s sharded parameters whole, each on its owner rank (see the module docstring).

    Args:
        optimizer: the user's optimizer over FSDP2's DTensor parameters; its ``step`` is replaced on the instance.
        names: ``id(parameter) -> FQN`` of every parameter it holds (the checkpoint keys).
        loads: elements owned per rank so far, per process group, shared between the optimizers of one model so that
            their owners balance together; updated in place.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, names: Mapping[int, str],
                 loads: dict[Any, list[int]] | None = None) -> None:  # fmt: skip
        self.optimizer = optimizer
        self.names = dict(names)
        self.loads = loads if loads is not None else {}
        #: steps taken (every rank takes the same ones: each is collective)
        self.steps = 0
        #: a checkpoint was loaded (its state replaces the zero-lr initialization of :meth:`init_state`)
        self.loaded = False
        self._layout()
        replace_step(optimizer, self._step)
        optimizer_state(optimizer).owner_step = self

    # ------------------------------------------------------------------ layout
    def _signature(self) -> tuple[int, ...]:
        return tuple(id(p) for g in self.optimizer.param_groups for p in g["params"])

    def _layout(self) -> None:
        """Classify every parameter, check it can be stepped whole, and assign the owners: the trainable parameters
        balanced (with the other optimizers'), then the frozen ones apart, so that freezing or unfreezing later moves
        no owner (and no state) and a frozen base does not skew the balance of what trains (LoRA)."""
        cls = type(self.optimizer).__name__
        self.entries: dict[int, _Entry] = {}  # id(param) -> entry (sharded)
        self.whole: set[int] = set()  # ids of DTensor parameters replicated over every mesh axis
        index = -1
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                index += 1
                if id(p) not in self.names:
                    raise V17ConfigError(
                        f"{cls} holds a tensor that is not a parameter of the module; build optimizers from "
                        "self.parameters() in configure_optimizers"
                    )
                if not isinstance(p, DTensor):
                    continue  # plain tensors step as they are
                mesh, placements = p.device_mesh, p.placements
                split = [(a, pl) for a, pl in enumerate(placements) if not pl.is_replicate() and mesh.size(a) > 1]
                if not split:
                    self.whole.add(id(p))
                    continue
                axis, pl = split[0]
                if len(split) > 1 or type(pl) is not Shard or pl.dim != 0:
                    raise V17ConfigError(
                        f"{cls} needs whole parameters to step (it is not elementwise, or cannot step DTensors), so "
                        f"zero_stage=3 steps each parameter whole on one rank; but {self.names[id(p)]!r} is split as "
                        f"{tuple(placements)} over mesh axes {mesh.mesh_dim_names}, and only a split along dim 0 "
                        "over one mesh axis can be gathered whole (tensor parallel splits it further). Use tp=1 with "
                        "this optimizer, an elementwise optimizer, or lightning_v17.optim.Adafactor (it completes its "
                        "reductions over the tp axis)"
                    )
                rows = p.shape[0]
                world, rank = mesh.size(axis), mesh.get_local_rank(axis)
                e = _Entry(index, p, mesh.get_group(axis), world, rank, rows, p.numel() // max(rows, 1),
                           -(-rows // world))  # fmt: skip
                start, stop = e.span(rank)
                if tuple(p._local_tensor.shape) != (stop - start, *p.shape[1:]):
                    raise RuntimeError(
                        f"{self.names[id(p)]!r}: local shard {tuple(p._local_tensor.shape)} is not rows "
                        f"[{start}, {stop}) of {tuple(p.shape)} (FSDP2's torch.chunk layout)"
                    )
                self.entries[id(p)] = e
        # largest first, to the least-loaded rank of the parameter's group (lowest on ties): the same on every rank
        frozen: dict[Any, list[int]] = {}
        for e in sorted(self.entries.values(), key=lambda e: (-e.param.numel(), e.index)):
            loads = (self.loads if e.param.requires_grad else frozen).setdefault(e.group, [0] * e.world)
            e.owner = min(range(e.world), key=lambda r: (loads[r], r))
            loads[e.owner] += e.param.numel()
        self._sig = self._signature()

    def _exchanges(self) -> dict[tuple[Any, torch.dtype], list[_Entry]]:
        """The trainable sharded parameters by (process group, dtype), in param-group order: one exchange each.
        ``requires_grad`` is the same on every rank, so every rank issues the same exchanges."""
        out: dict[tuple[Any, torch.dtype], list[_Entry]] = {}
        for e in sorted(self.entries.values(), key=lambda e: e.index):
            if e.param.requires_grad:
                out.setdefault((e.group, e.param.dtype), []).append(e)
        return out

    def owned(self) -> list[str]:
        """FQNs of the sharded parameters this rank steps (and keeps the state of)."""
        return [self.names[id(e.param)] for e in self.entries.values() if e.owner == e.rank]

    # ------------------------------------------------------------------ the step
    def _step(self, previous: Callable[[], Any], closure: Callable[[], Any] | None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            if self._signature() != self._sig:
                self.loads = {}  # param groups changed (add_param_group): the same new owners on every rank
                self._layout()
            exchanges = self._exchanges()
            full = self._to_owners(exchanges)
            updated = self._run(previous, full)
            self._from_owners(exchanges, updated)
        self.steps += 1
        return loss

    def _to_owners(self, exchanges: dict[tuple[Any, torch.dtype], list[_Entry]]
                   ) -> dict[int, tuple[torch.Tensor, torch.Tensor | None]]:  # fmt: skip
        """Every rank's rows of each parameter and gradient to its owner: ``{id(param): (full, grad)}`` there."""
        out: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        for (group, dtype), es in exchanges.items():
            world, me = es[0].world, es[0].rank
            sizes = [sum(2 * e.seg + 1 for e in es if e.owner == r) for r in range(world)]
            device = es[0].param._local_tensor.device
            send = torch.empty(sum(sizes), dtype=dtype, device=device)
            off = 0
            for r in range(world):
                for e in (e for e in es if e.owner == r):
                    local = e.param._local_tensor
                    n = local.numel()
                    send[off : off + n].copy_(local.reshape(-1))
                    g = local_grad(e.param)
                    grad_area = send[off + e.seg : off + e.seg + n]
                    if g is None:
                        grad_area.zero_()  # zeros, flagged absent: an owner uses them only if another rank has one
                    else:
                        grad_area.copy_(g.reshape(-1))
                    send[off + 2 * e.seg] = 0.0 if g is None else 1.0
                    off += 2 * e.seg + 1
            recv = torch.empty(world * sizes[me], dtype=dtype, device=device)
            dist.all_to_all_single(recv, send, [sizes[me]] * world, sizes, group=group)
            recv = recv.view(world, sizes[me])
            off = 0
            for e in (e for e in es if e.owner == me):
                block = recv[:, off : off + 2 * e.seg + 1]
                full = torch.empty(e.param.shape, dtype=dtype, device=device)
                grad = torch.empty_like(full)
                fr, gr = _rows(full, e.row_numel), _rows(grad, e.row_numel)
                for s in range(world):
                    start, stop = e.span(s)
                    n = (stop - start) * e.row_numel
                    fr[start:stop].copy_(block[s, :n].view(stop - start, e.row_numel))
                    gr[start:stop].copy_(block[s, e.seg : e.seg + n].view(stop - start, e.row_numel))
                has_grad = bool(block[:, 2 * e.seg].any())
                out[id(e.param)] = (full, grad if has_grad else None)
                off += 2 * e.seg + 1
        return out

    def _run(self, previous: Callable[[], Any], full: dict[int, tuple[torch.Tensor, torch.Tensor | None]]
             ) -> dict[int, torch.Tensor]:  # fmt: skip
        """The optimizer's own step over the owned parameters as whole plain tensors (placeholders for the others);
        the states go back to the DTensor keys. Returns ``{id(param): its updated full tensor}`` of the owned ones."""
        opt, state = self.optimizer, self.optimizer.state
        originals = [g["params"] for g in opt.param_groups]
        swapped: list[tuple[torch.Tensor, torch.Tensor]] = []  # (DTensor parameter, plain tensor in its slot)
        try:
            for group in opt.param_groups:
                new = []
                for p in group["params"]:
                    e = self.entries.get(id(p)) if p.requires_grad else None
                    if e is not None and e.owner != e.rank:
                        new.append(p._local_tensor.new_empty(0))  # no gradient: every optimizer skips it
                        continue
                    if e is not None:
                        alias = full[id(p)][0]
                        alias.grad = full[id(p)][1]
                    elif id(p) in self.whole:
                        alias = p._local_tensor.detach()  # the whole parameter: updated in place
                        alias.grad = local_grad(p)
                    else:
                        new.append(p)
                        continue
                    alias.requires_grad_(p.requires_grad)
                    st = state.pop(p, None)
                    if st:
                        state[alias] = st
                    swapped.append((p, alias))
                    new.append(alias)
                group["params"] = new
            previous()
        finally:
            for group, params in zip(opt.param_groups, originals):
                group["params"] = params
            for p, alias in swapped:
                alias.grad = None
                st = state.pop(alias, None)
                if st:
                    state[p] = st
        # read the tensors in the slots after the step: an optimizer may rebind ``.data`` (bitsandbytes makes it
        # contiguous) rather than write in place
        return {id(p): alias for p, alias in swapped if id(p) in full}

    def _from_owners(self, exchanges: dict[tuple[Any, torch.dtype], list[_Entry]],
                     updated: dict[int, torch.Tensor]) -> None:  # fmt: skip
        """Each owner sends every rank its rows of the updated parameters, copied into the FSDP2 shards."""
        for (group, dtype), es in exchanges.items():
            world, me = es[0].world, es[0].rank
            sizes = [sum(e.seg for e in es if e.owner == r) for r in range(world)]
            device = es[0].param._local_tensor.device
            send = torch.empty(world, sizes[me], dtype=dtype, device=device)
            off = 0
            for e in (e for e in es if e.owner == me):
                rows = _rows(updated[id(e.param)], e.row_numel)
                for s in range(world):
                    start, stop = e.span(s)
                    dst = send[s, off : off + (stop - start) * e.row_numel]
                    dst.view(stop - start, e.row_numel).copy_(rows[start:stop])
                off += e.seg
            recv = torch.empty(sum(sizes), dtype=dtype, device=device)
            dist.all_to_all_single(recv, send.view(-1), sizes, [sizes[me]] * world, group=group)
            base = 0
            for r in range(world):
                off = base
                for e in (e for e in es if e.owner == r):
                    local = e.param._local_tensor
                    local.copy_(recv[off : off + local.numel()].view(local.shape))
                    off += e.seg
                base += sizes[r]

    # ------------------------------------------------------------------ checkpoints
    def init_state(self) -> None:
        """Before any step or load, create the state tensors that a checkpoint load fills in place: torch's
        ``_init_optim_state`` (a step with zero gradients at lr 0), decided the same way on every rank (this rank may
        own nothing, so an empty ``optimizer.state`` does not tell)."""
        opt = self.optimizer
        if self.steps or self.loaded:
            return
        params = [p for g in opt.param_groups for p in g["params"]]
        if any(p.grad is not None for p in params):
            return  # torch's rule: gradients exist, so a step is coming (and a stateless optimizer needs nothing)
        for p in params:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
        lrs = [g["lr"] for g in opt.param_groups if "lr" in g]
        for g in opt.param_groups:
            if "lr" in g:
                g["lr"] = torch.tensor(0.0) if torch.is_tensor(g["lr"]) else 0.0
        try:
            opt.step()
        finally:
            for g in opt.param_groups:
                if "lr" in g:
                    g["lr"] = lrs.pop(0)
            opt.zero_grad(set_to_none=True)

    def _fqns(self) -> list[str]:
        return [self.names[id(p)] for g in self.optimizer.param_groups for p in g["params"]]

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's own ``state_dict()`` keyed by FQN: this rank's owned parameters' whole states (plain
        tensors), plus those of plain and replicated parameters; every parameter's FQN in the param groups."""
        self.init_state()
        sd = self.optimizer.state_dict()
        fqns = self._fqns()
        return {
            "state": {fqns[i]: st for i, st in sd["state"].items()},
            "param_groups": [{**g, "params": [fqns[i] for i in g["params"]]} for g in sd["param_groups"]],
        }

    def load_state_dict(self, osd: Mapping[str, Any]) -> None:
        """Load what :meth:`state_dict` produced (after ``dcp.load`` filled it in place) through the optimizer's own
        ``load_state_dict``. The hyperparameters come from ``osd`` by group index, which parameters each group holds
        from the optimizer itself (a checkpoint of another pipeline split lists other FQNs)."""
        index = {fqn: i for i, fqn in enumerate(self._fqns())}
        own: list[list[int]] = []
        i = 0
        for g in self.optimizer.param_groups:
            own.append(list(range(i, i + len(g["params"]))))
            i += len(g["params"])
        saved = osd["param_groups"]
        if len(saved) != len(own):
            raise V17ConfigError(
                f"the checkpoint's optimizer has {len(saved)} param groups but configure_optimizers builds "
                f"{len(own)}; build the same param groups as the run that saved it"
            )
        state = {index[fqn]: dict(st) for fqn, st in osd["state"].items() if fqn in index}
        groups = [{**g, "params": ids} for g, ids in zip(saved, own)]
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})
        self.loaded = True


def owner_step_of(optimizer: Any) -> OwnerStep | None:
    """The :class:`OwnerStep` attached to ``optimizer``, else None."""
    st = optimizer_state(optimizer, create=False)
    return None if st is None else st.owner_step


def attach_owner_steps(optimizers: Iterable[torch.optim.Optimizer], *, names: Mapping[int, str]) -> list[OwnerStep]:
    """Attach an :class:`OwnerStep` to each of ``optimizers`` (already attached ones are kept), their owners balanced
    together; say so once per optimizer (global rank 0, log level INFO)."""
    loads: dict[Any, list[int]] = {}
    out = []
    for opt in optimizers:
        existing = owner_step_of(opt)
        if existing is not None:
            out.append(existing)
            continue
        step = OwnerStep(opt, names=names, loads=loads)
        out.append(step)
        if not dist.is_initialized() or dist.get_rank() == 0:
            log.info(
                "zero_stage=3: %s steps whole parameters on owner ranks (it needs whole parameters or cannot step "
                "DTensor shards): %d sharded parameters, elements owned per rank %s",
                type(opt).__name__, len(step.entries), [v for v in loads.values()] if loads else "[]",
            )  # fmt: skip
    return out
