"""ZeRO stages 0-3 as keyword-only, Lightning-free functions (Rajbhandari 2020, "ZeRO", §5; design §3).

* Stage 0 (DDP semantics): parameters, gradients and optimizer state replicated; gradients are all-reduced over the
  data-parallel ranks in buckets as backward produces them.
* Stage 1: as stage 0, but the optimizer is rebuilt over the local dim-0 shard of every parameter (``torch.chunk``
  semantics over the ``dp_shard`` axis, i.e. DTensor ``Shard(0)``, FSDP2's layout). Full gradients are all-reduced,
  each rank steps its shard, then the shards are all-gathered back into the full parameters. The gradients are views
  of the reduced bucket (DDP's ``gradient_as_bucket_view``); the packing copies are in :mod:`.zero_comm`.
* Stage 2: gradients are reduce-scattered into per-rank shard gradients as backward produces them (post-accumulate-
  grad hooks, bucketed); the full gradient of a bucket is freed as soon as its reduce-scatter is issued.
  What stays resident between steps on each rank: the full parameters (replicated), the shard gradients (1/dp_shard
  of all gradients, plus at most one padding row per parameter), and the optimizer state over the shards. During
  backward, the full gradients of the buckets still in flight (at most the whole model when communication is slower
  than backward). During gradient accumulation (``require_grad_sync=False``) the full gradients accumulate locally and
  stay resident until the last micro-step, which communicates once.
* Frozen parameters (``requires_grad=False`` at setup: a LoRA model's base, a frozen backbone) are outside the
  partition: no gradient is reduced for them, no rows are sharded, and an optimizer that lists them (peft's examples
  pass ``self.parameters()``) has them dropped from its param groups, since nothing could step them. The optimizer
  state is that of the trainable parameters only, sharded (DeepSpeed's ZeRO-1/2 optimizer also keeps only the
  trainable parameters of each group).
* Several optimizers (a GAN's generator and discriminator, manual optimization): each optimizer's step is followed by
  the refresh of *its* parameters only (:meth:`ZeroEngine.gather_params` with that optimizer); the other network's
  parameters are not written, so a graph built through them before this step still back-propagates. What the
  refresh writes in place are parameters this very step has just updated (their rows here, or whole on their owner),
  as DDP's step updates each of them in place on every rank: a graph that still holds one fails exactly where it
  would under DDP. Each optimizer's ``zero_grad`` clears its own parameters' gradients only, and
  ``toggle_optimizer`` reaches the parameters through what the optimizers hold
  (:class:`~lightning_v17.engine.zero.layout.ShardParameter`).
* Stage 3: FSDP2 ``fully_shard`` per unit (the repeated blocks) plus the residual top-level modules
  (:mod:`lightning_v17.engine.zero.fsdp`). State dicts for DCP, every stage: :mod:`lightning_v17.engine.zero.state_dict`.

Because stages 1, 2 and 3 all use the same dim-0 ``torch.chunk`` partition and the same fully-qualified names (FQNs),
their optimizer state dicts are interchangeable: stages 1/2 report their shards as ``DTensor``s with ``Shard(0)``
placements, exactly what FSDP2 reports, so torch.distributed.checkpoint (DCP) can save and reshard all of them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_v17.config import V17ConfigError
from lightning_v17.engine.collectives import reduce_scatter
from lightning_v17.engine.ep.apply import is_expert_param
from lightning_v17.engine.state import optimizer_state
from lightning_v17.engine.zero.adoption import LateParams
from lightning_v17.engine.zero.comm import gather_bucket, pack_grad, pack_rows
from lightning_v17.engine.zero.fsdp import apply_fsdp
from lightning_v17.engine.zero.layout import (
    PARTITIONS,
    _Bucket,
    _local,
    _Param,
    _rows,
    chunk_rows,
    is_elementwise_optimizer,
)
from lightning_v17.engine.zero.optim_state import ShardedOptimizerState

__all__ = ["ZeroEngine", "apply_zero", "broadcast_module", "chunk_rows", "is_elementwise_optimizer"]


class ZeroEngine(LateParams, ShardedOptimizerState):
    """Gradient reduction and optimizer sharding for ZeRO stages 0, 1 and 2 over replicated full parameters.

    Two ways to partition the optimizer over the dp_shard ranks (``partition``):

    * ``"rows"``: every parameter is split along dim 0 and each rank steps its rows (the FSDP2/DTensor ``Shard(0)``
      layout; memory balanced to one row). Exact for elementwise optimizers only.
    * ``"params"``: whole parameters are assigned to ranks (largest first, to the least-loaded rank, as torch's
      ``ZeroRedundancyOptimizer`` does) and each rank steps the parameters it owns, then broadcasts them. Exact for
      every optimizer whose update is computed per parameter (Adafactor's row/column factors, Muon's matrix
      iterations, bitsandbytes' block-quantized states, ...), at the cost of a coarser memory balance. Optimizers
      that couple all parameters (``torch.optim.LBFGS``) cannot be partitioned and are refused. Stage 2 then
      all-reduces gradients and each rank keeps only its own parameters' gradients (the gradient memory after the
      step is partitioned; during backward a full bucket is alive).
    * ``"auto"`` (default): "rows" when every optimizer is an elementwise ``torch.optim`` class
      (:func:`is_elementwise_optimizer`), else "params".

    Args:
        module: the model; its trainable parameters are reduced (shared parameters once, under their first FQN);
            the frozen ones (``requires_grad=False`` now) are left out (see the module docstring).
        stage: 0, 1 or 2.
        shard_group: process group of the ``dp_shard`` axis (optimizer state and, at stage 2, gradients are
            partitioned over it).
        replicate_group: process group of the ``dp_replicate`` axis (HSDP outer axis) or None when its size is 1.
        shard_mesh: the DeviceMesh used to describe shards as DTensors in state dicts: 1-D ``dp_shard``, or 2-D
            (``dp_replicate``, ``dp_shard``) for HSDP.
        bucket_mb: bucket size in MiB (DeepSpeed's ``reduce_bucket_size``).
        reduce_dtype: dtype of the gradient reduction (None: the gradient's own dtype).
        partition: "auto", "rows" or "params" (see above).
        overlap: start each bucket's reduction (async, on gloo's threads or NCCL's stream) from the gradient hooks
            as soon as all of its gradients are ready, in bucket order, so it runs while backward computes the
            earlier layers; the end of backward waits for what is still in flight. False: every bucket is
            reduced at the end of backward (the A/B baseline; bitwise the same gradients).
        experts: False: the engine of every trainable parameter but the experts sharded over ``ep``; True: the
            engine of those experts alone, whose ``shard_group`` is ``efsdp`` (the ranks that hold the same experts)
            and whose rows are the rank's local experts (:func:`apply_zero` builds it beside the dense one).
        grad_divisor: what the summed gradients are divided by (None: the ranks of ``shard_group`` x
            ``replicate_group``). The experts' engine divides by the whole data-parallel degree, since each expert
            gradient already sums the tokens of every ep rank (``engine/ep/apply.py``).
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        stage: int,
        shard_group: Any,
        replicate_group: Any = None,
        shard_mesh: Any = None,
        bucket_mb: float = 25.0,
        reduce_dtype: torch.dtype | None = None,
        partition: str = "auto",
        overlap: bool = True,
        experts: bool = False,
        grad_divisor: int | None = None,
    ) -> None:
        if partition not in PARTITIONS:
            raise V17ConfigError(f"optimizer_partition={partition!r}; choose one of {list(PARTITIONS)}")
        if stage not in (0, 1, 2):
            raise V17ConfigError(f"ZeroEngine handles zero_stage 0, 1 and 2, got {stage}; stage 3 uses apply_fsdp")
        self.stage = stage
        self.partition = partition
        #: "params" once :meth:`choose_partition` picked whole-parameter ownership
        self.owner_mode = False
        self._partition_chosen = False
        self.shard_group = shard_group
        self.replicate_group = replicate_group
        self.shard_mesh = shard_mesh
        self.reduce_dtype = reduce_dtype
        self.world = dist.get_world_size(shard_group)
        self.rank = dist.get_rank(shard_group)
        self.replicas = dist.get_world_size(replicate_group) if replicate_group is not None else 1
        self.dp = grad_divisor or self.world * self.replicas
        #: True: the engine of the expert weights sharded over ep (their rows over efsdp), beside the dense one
        self.experts = experts
        #: the expert weights' engine (:func:`apply_zero` builds it at ep > 1 with efsdp > 1), which the optimizer
        #: state of the dense one covers too (one optimizer holds both kinds); None without one
        self.expert_engine: ZeroEngine | None = None
        #: False during accumulation micro-steps: gradients accumulate locally, nothing is communicated.
        self.require_grad_sync = True
        self.overlap = overlap
        self._callback_queued = False
        self._next_launch = 0
        #: the experts' engine reduced since the last gradient hook or parameter gather (see finish_grad_sync)
        self._reduced = False

        seen: set[int] = set()
        self.module = module
        self.params: list[_Param] = []
        #: id -> FQN of the expert weights sharded over ep (outside the partition, stepped as they are)
        self.expert_fqns: dict[int, str] = {}
        #: id -> (FQN, parameter) of this engine's parameters that were frozen at setup (see :meth:`adopt`)
        self.frozen: dict[int, tuple[str, nn.Parameter]] = {}
        for fqn, p in module.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            if is_expert_param(p) != experts:
                if not experts and p.requires_grad:
                    self.expert_fqns[id(p)] = fqn
                continue
            if not p.requires_grad:
                self.frozen[id(p)] = (fqn, p)
                continue
            self.params.append(self._entry_of(fqn, p))
        self.by_param = {id(e.param): e for e in self.params}
        #: id -> FQN of the frozen parameters an optimizer listed at stage 1/2 (dropped from its groups: nothing
        #: could step them); one that becomes trainable without ``add_param_group`` is refused (:meth:`adopt_unfrozen`)
        self.dropped: dict[int, str] = {}
        #: per parameter of ``params``: whether some data-parallel rank produced its gradient this step
        self._used: list[bool] = []
        self.by_shard: dict[int, _Param] = {}
        #: id(optimizer) -> (the parameters it holds, their gather buckets): what its step refreshes
        self._stepped_by: dict[int, tuple[list[_Param], list[_Bucket]]] = {}

        # Buckets in reverse registration order: backward produces the last layers' gradients first (as DDP does).
        bucket_bytes = bucket_mb * 2**20
        self.buckets: list[_Bucket] = []
        cur: list[_Param] = []
        cur_bytes = 0
        for e in reversed(self.params):
            cur.append(e)
            cur_bytes += e.param.numel() * e.param.element_size()
            if cur_bytes >= bucket_bytes:
                self.buckets.append(_Bucket(cur, sum(x.seg_numel for x in cur)))
                cur, cur_bytes = [], 0
        if cur:
            self.buckets.append(_Bucket(cur, sum(x.seg_numel for x in cur)))
        self.bucket_of = {id(e.param): i for i, b in enumerate(self.buckets) for e in b.params}
        self._hooks = [e.param.register_post_accumulate_grad_hook(self._on_grad) for e in self.params]

    def _entry_of(self, fqn: str, p: nn.Parameter) -> _Param:
        r = _rows(p.detach())
        start, stop = chunk_rows(r.shape[0], self.world, self.rank)
        padded = -(-r.shape[0] // self.world) if r.shape[0] else 0
        return _Param(fqn, p, r.shape[0], r.shape[1], start, stop, padded)

    # ------------------------------------------------------------------ optimizer sharding (stages 1/2)
    def choose_partition(self, optimizers: Iterable[torch.optim.Optimizer]) -> str:
        """Fix "rows" or "params" for every optimizer of the module (call once, before :meth:`shard_optimizer`)."""
        optimizers = list(optimizers)
        if self.stage > 0:
            for o in optimizers:
                if isinstance(o, torch.optim.LBFGS):
                    raise V17ConfigError(
                        f"torch.optim.LBFGS couples all parameters in one line search, so zero_stage={self.stage} "
                        "cannot partition it; use zero_stage=0, or zero_stage=3 (FSDP2 keeps every rank's "
                        "optimizer over the whole sharded model)"
                    )
        mode = self.partition
        if mode == "auto":
            mode = "rows" if all(is_elementwise_optimizer(o) for o in optimizers) else "params"
        self.owner_mode = self.stage > 0 and mode == "params"
        self._partition_chosen = True
        if self.owner_mode:
            loads = [0] * self.world
            order = sorted(range(len(self.params)), key=lambda i: (-_local(self.params[i].param).numel(), i))
            for i in order:  # largest first, to the least-loaded rank (lowest rank on ties): the same on every rank
                r = min(range(self.world), key=lambda k: (loads[k], k))
                self.params[i].owner = r
                loads[r] += _local(self.params[i].param).numel()
        return mode

    def shard_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Rebuild ``optimizer`` in place over the local dim-0 shards (stage >= 1); returns the same object.

        The optimizer object, its class, its param groups and hyperparameters are kept (LR schedulers still point
        at it); only each group's ``params`` list is swapped for leaf views of this rank's rows of every parameter
        (:class:`~lightning_v17.engine.zero.layout.ShardParameter`; frozen parameters dropped), so
        ``optimizer.step()`` writes the full parameter's local rows in place and :meth:`gather_params` completes
        them. Works for any ``torch.optim.Optimizer`` whose update is elementwise per parameter (Adam/AdamW/SGD/
        Lion/...); optimizers that need the whole matrix (Shampoo, Adafactor's factored rows/columns) are not
        partitioned exactly and must use stage 0 or 3.
        """
        mark = "zero_experts" if self.experts else "zero"
        if self.stage == 0 or getattr(optimizer_state(optimizer), mark) is self:
            return optimizer
        if not self._partition_chosen:
            self.choose_partition([optimizer])
        if optimizer.state:
            raise RuntimeError("shard_optimizer must run before the first optimizer step (the optimizer has state)")
        for group in optimizer.param_groups:
            kept = []
            for p in group["params"]:
                if id(p) in self.by_param or self.experts or id(p) in self.expert_fqns:
                    kept.append(p)  # the experts' engine keeps the dense engine's (already checked and sharded)
                elif id(p) in self.frozen:
                    self.dropped[id(p)] = self.frozen[id(p)][0]  # nothing could step it (module docstring)
                elif not p.requires_grad:
                    continue  # frozen and not the module's own: dropped as well
                else:
                    raise V17ConfigError(
                        "the optimizer holds a trainable parameter that is not a parameter of the LightningModule; "
                        "build optimizers from self.parameters() (or a subset of them) in configure_optimizers"
                    )
            group["params"] = self.optimizer_params(kept)
        setattr(optimizer_state(optimizer), mark, self)
        self._note_stepped(optimizer)
        # The optimizer now only sees the shards, so its zero_grad would leave the full parameters' gradients (stage
        # 1 keeps them; stage 2 during accumulation) to leak into the next step. Clear them too, for this optimizer's
        # parameters only: another optimizer's gradients are not its to clear (a GAN accumulates them separately).
        inner_zero_grad = optimizer.zero_grad

        def zero_grad(set_to_none: bool = True) -> None:
            inner_zero_grad(set_to_none=set_to_none)
            for e in self._stepped_by[id(optimizer)][0]:
                if e.param.grad is not None:
                    if set_to_none:
                        e.param.grad = None
                    else:
                        e.param.grad.zero_()

        optimizer.zero_grad = zero_grad  # type: ignore[method-assign]
        return optimizer

    # ------------------------------------------------------------------ gradient reduction
    def _on_grad(self, p: torch.Tensor) -> None:
        self._reduced = False
        if not self.require_grad_sync:
            return
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_grad_sync)
        if not self.overlap:
            return
        i = self.bucket_of[id(p)]
        self.buckets[i].ready.add(id(p))
        # Launch in bucket order only, so every rank issues the same collectives in the same order.
        while self._next_launch < len(self.buckets):
            b = self.buckets[self._next_launch]
            if len(b.ready) < len(b.params):
                break
            self._launch(b)
            self._next_launch += 1

    def _grad(self, e: _Param) -> torch.Tensor:
        g = e.param.grad
        e.used = g is not None
        if g is None:  # unused on this rank: contributes zeros (every rank must join every collective)
            return torch.zeros_like(_local(e.param))
        if any(pl.is_partial() for pl in getattr(g, "placements", ())):
            # a Replicate parameter used on sequence-sharded activations (SP's norms) gets a Partial gradient over tp:
            # reduced to the parameter's layout first, as FSDP2 does (FSDPParam._get_grad_inner_tensor)
            g = e.param.grad = g.redistribute(placements=e.param.placements)
        return _local(g)

    def _unused_everywhere(self) -> set[int]:
        """The parameters no data-parallel rank produced a gradient for in this step (ids): one all-reduce of a
        flag per parameter, as DDP's ``find_unused_parameters`` does for its ``local_used_map``. Their gradients stay
        None, as they do under DDP and in one process, so the optimizer skips them (an AdamW weight decay on a head
        that training never calls would move it otherwise)."""
        flags = torch.tensor([e.used for e in self.params], dtype=torch.int32)
        if dist.get_world_size(self._full_group()) > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._full_group())
        return {id(e.param) for e, f in zip(self.params, flags.tolist()) if not f}

    def _launch(self, b: _Bucket) -> None:
        # The mean over dp ranks is folded into the copy that packs each gradient into the bucket (one pass instead of
        # a copy then a division of the whole bucket; the same arithmetic, so the same bits): see zero_comm.
        dtype = self.reduce_dtype or self._grad(b.params[0]).dtype
        device = _local(b.params[0].param).device
        if self.stage in (0, 1) or self.owner_mode:
            b.buf = torch.empty(sum(_local(e.param).numel() for e in b.params), dtype=dtype, device=device)
            off = 0
            for e in b.params:
                g = self._grad(e)
                pack_grad(b.buf[off : off + g.numel()].view_as(g), g, self.dp)
                off += g.numel()
            b.work = dist.all_reduce(b.buf, group=self._full_group(), async_op=True)
            return
        # stage 2: lay every parameter's rows out as [world, padded_rows*row_numel] so rank r's segment holds its rows
        # (written in place, no padded copy: only the padding rows are zeroed).
        buf = torch.empty(self.world, b.seg_numel, dtype=dtype, device=device)
        off = 0
        for e in b.params:
            if e.rows:
                dst = buf[:, off : off + e.seg_numel].unflatten(1, (e.padded_rows, e.row_numel))
                pack_rows(dst, self._grad(e), e, self.world, self.dp)
            off += e.seg_numel
            e.param.grad = None  # the full gradient is freed now; only the reduced shard is kept
        b.buf = buf.view(-1)
        b.out = torch.empty(b.seg_numel, dtype=dtype, device=buf.device)
        # gloo: all_to_all + local sum (engine/collectives.py); other backends: reduce_scatter_tensor
        b.work = reduce_scatter(b.out, b.buf, group=self.shard_group, async_op=True)

    def _full_group(self) -> Any:
        return self._dp_group if hasattr(self, "_dp_group") else self.shard_group

    def set_dp_group(self, group: Any) -> None:
        """The flattened (dp_replicate x dp_shard) group for stage 0/1 all-reduces (HSDP)."""
        self._dp_group = group

    def finish_grad_sync(self) -> None:
        """Run at the end of backward (autograd callback): launch what is left, wait, and install the gradients.

        The experts' engine reduces once between two optimizer steps: a second call (an explicit one after a
        backward whose callback already reduced) does nothing until a gradient hook fires or :meth:`gather_params`
        runs, since its divisor (the whole data-parallel degree) is larger than its group and a second reduction
        would shrink the gradients again. Not keyed on the hooks alone: a pipeline's zero-bubble schedules
        accumulate the weight gradients by hand, with no hook. The dense engine's second reduction is a mean of
        equal values and is left as it was."""
        self._callback_queued = False
        if self.experts and self._reduced:
            return
        self._reduced = True
        self.adopt_unfrozen()
        while self._next_launch < len(self.buckets):
            self._launch(self.buckets[self._next_launch])
            self._next_launch += 1
        self._next_launch = 0
        unused = self._unused_everywhere()
        # Views of the bucket keep all of it alive: not when stage 2 ("params") drops the gradients it does not own, nor
        # for tensor-parallel (DTensor) gradients, which must stay DTensors.
        keep_grads = (self.owner_mode and self.stage == 2) or any(_is_dtensor(e.param) for e in self.params)
        for b in self.buckets:
            b.work.wait()
            if self.stage in (0, 1) or self.owner_mode:
                off = 0
                for e in b.params:
                    n = _local(e.param).numel()
                    flat = b.buf[off : off + n].view_as(_local(e.param))
                    off += n
                    if id(e.param) in unused:
                        if e.shard is not None and e.shard is not e.param:
                            e.shard.grad = None
                        e.param.grad = None
                        continue
                    if e.param.grad is not None and (keep_grads or flat.dtype != e.param.dtype):
                        _local(e.param.grad).copy_(flat)
                    else:  # the reduced bucket becomes the gradient (a view: no copy, DDP's gradient_as_bucket_view)
                        g = flat.to(e.param.dtype)
                        e.param.grad = g.clone() if keep_grads and g is flat else g
                    if self.owner_mode:
                        if self.stage == 2 and e.owner != self.rank:
                            e.param.grad = None  # stage 2: keep only the gradients this rank's optimizer steps
                    elif self.stage == 1 and e.shard is not None:
                        local = _rows(e.param.grad)[e.start : e.stop]
                        e.shard.grad = local.view(e.shard.shape)  # a view: no extra memory
            else:
                if self.replicate_group is not None:
                    dist.all_reduce(b.out, group=self.replicate_group)
                off = 0
                for e in b.params:
                    local = b.out[off : off + (e.stop - e.start) * e.row_numel]
                    off += e.seg_numel
                    if e.shard is None or id(e.param) in unused:
                        continue  # no optimizer holds it here, or no rank has its gradient (it stays as it was)
                    local = local.view(e.shard.shape).to(e.shard.dtype)
                    if e.shard.grad is None:
                        e.shard.grad = local if e.padded_rows == e.stop - e.start else local.clone()
                    else:
                        e.shard.grad.add_(local)
            b.buf = b.out = b.work = None
            b.ready.clear()

    # ------------------------------------------------------------------ after the step
    @torch.no_grad()
    def gather_params(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """All-gather every rank's updated rows into the full parameters (stages 1/2), bucket by bucket: those of
        ``optimizer`` (the one that just stepped), or of every parameter when None or not sharded here."""
        self._reduced = False  # the next backward's gradients are new (finish_grad_sync)
        if self.stage == 0:
            return
        entries, buckets = self._stepped_by.get(id(optimizer), (self.params, self.buckets))
        if self.owner_mode:
            self._broadcast_owned(entries)
            return
        # Bucket k+1 is packed while bucket k is on the wire; at most two are in flight (two receive buffers).
        pending: list[Any] = []
        for b in buckets:
            pending.append(gather_bucket(b, world=self.world, rank=self.rank, group=self.shard_group))
            if len(pending) > 1:
                pending.pop(0).wait()
        for p in pending:
            p.wait()

    @torch.no_grad()
    def _broadcast_owned(self, entries: list[_Param]) -> None:
        """partition="params": each rank broadcasts the parameters of ``entries`` it stepped (one flat broadcast per
        owner)."""
        if self.world == 1:
            return
        for r in range(self.world):
            owned = [_local(e.param.detach()) for e in entries if e.owner == r]
            if not owned:
                continue
            flat = torch.cat([t.reshape(-1) for t in owned]) if r == self.rank else torch.empty(
                sum(t.numel() for t in owned), dtype=owned[0].dtype, device=owned[0].device
            )
            dist.broadcast(flat, src=dist.get_global_rank(self.shard_group, r), group=self.shard_group)
            if r != self.rank:
                off = 0
                for t in owned:
                    t.copy_(flat[off : off + t.numel()].view_as(t))
                    off += t.numel()

    def is_tp_sharded(self, p: torch.Tensor) -> bool:
        """Whether optimizer parameter ``p`` (a shard, or a full parameter at stage 0) is a piece of a DTensor
        parameter that is *sharded* (not replicated) on some mesh axis, i.e. tensor parallel; for clipping."""
        e = self.by_shard.get(id(p)) or self.by_param.get(id(p))
        if e is None or self.experts:  # an expert's rows: over ep, not tp (the experts are whole on every tp rank)
            return False
        placements = getattr(e.param, "placements", ())
        return any(pl.is_shard() or pl.is_partial() for pl in placements)

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


def apply_zero(
    module: nn.Module,
    *,
    stage: int,
    mesh: Any,
    bucket_mb: float = 25.0,
    reshard_after_forward: bool | None = None,
    wrap_classes: Sequence[str] = (),
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    offload_params: bool = False,
    optimizer_partition: str = "auto",
    overlap_comm: bool = True,
    prefetch_units: int = 1,
    child_units: bool = False,
    pipeline_stages: Sequence[nn.Module] = (),
    offload_experts: bool = False,
) -> ZeroEngine | None:
    """Apply ZeRO ``stage`` to ``module`` over the data-parallel axes of ``mesh`` (a DeviceMesh with axes
    "dp_replicate", "dp_shard" and the flattened "dp"). Returns the :class:`ZeroEngine` for stages 0-2, None for 3.

    ``param_dtype`` (stages 0-2) is ignored: mixed precision there is autocast (Lightning's precision plugin) over
    fp32 parameters, which are then the master weights themselves. ``overlap_comm`` (every stage) and
    ``prefetch_units``, ``child_units`` and ``pipeline_stages`` (stage 3): see :class:`ZeroEngine` and
    :func:`~lightning_v17.engine.zero.fsdp.apply_fsdp`. ``offload_experts`` (stage 3, with parameter offload): the
    experts become FSDP2 units even where no other rank holds them (:func:`~lightning_v17.mesh.expert_shard_mesh`).
    """
    from lightning_v17.mesh import expert_shard_mesh, submesh, zero_mesh

    replicate = mesh["dp_replicate"].size() > 1
    shard_mesh = zero_mesh(mesh)  # dp_shard, or dp_shard x cp (torchtitan's dp_shard_cp); 2-D under HSDP
    cp = mesh["cp"].size() > 1
    if stage == 3:
        apply_fsdp(
            module,
            mesh=shard_mesh,
            reshard_after_forward=reshard_after_forward,
            wrap_classes=wrap_classes,
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
            offload_params=offload_params,
            overlap_comm=overlap_comm,
            prefetch_units=prefetch_units,
            child_units=child_units,
            pipeline_stages=pipeline_stages,
            expert_mesh=expert_shard_mesh(mesh, offloaded=offload_experts),
            expert_divide_factor=mesh["dp_replicate"].size() * mesh["dp_shard"].size() * mesh["cp"].size(),
        )
        return None
    engine = ZeroEngine(
        module,
        stage=stage,
        shard_group=shard_mesh.get_group(shard_mesh.ndim - 1),
        replicate_group=mesh["dp_replicate"].get_group() if replicate else None,
        shard_mesh=shard_mesh,
        bucket_mb=bucket_mb,
        reduce_dtype=reduce_dtype,
        partition=optimizer_partition,
        overlap=overlap_comm,
    )
    engine.set_dp_group(submesh(mesh, "dp_cp" if cp else "dp").get_group())
    experts = expert_shard_mesh(mesh) if stage > 0 else None
    if experts is not None:  # the experts' rows over efsdp, the ranks that hold the same ones (see ZeroEngine)
        engine.expert_engine = ZeroEngine(
            module, stage=stage, shard_group=experts.get_group(experts.ndim - 1),
            replicate_group=mesh["dp_replicate"].get_group() if replicate else None, shard_mesh=experts,
            bucket_mb=bucket_mb, reduce_dtype=reduce_dtype, partition=optimizer_partition, overlap=overlap_comm,
            experts=True, grad_divisor=mesh["dp_replicate"].size() * mesh["dp_shard"].size() * mesh["cp"].size(),
        )  # fmt: skip
        engine.expert_engine.set_dp_group(submesh(mesh, "edp").get_group())
    return engine


def _is_dtensor(t: torch.Tensor) -> bool:
    return hasattr(t, "_local_tensor")


@torch.no_grad()
def broadcast_module(module: nn.Module, *, group: Any) -> None:
    """Make every replica start from the first rank's parameters and buffers (DDP's ``_sync_module_states``).

    ``_broadcast_coalesced`` takes the source as a rank *within* ``group`` (DDP passes 0 for its subgroups): the
    group's first rank is 0 there, whatever its global rank (e.g. global rank 2 for the dp group of pp stage 1).
    """
    tensors = [t for t in (*module.parameters(), *module.buffers()) if not t.is_meta]
    if tensors and dist.get_world_size(group) > 1:
        dist._broadcast_coalesced(group, [t.data for t in tensors], 250 * 2**20, 0)
