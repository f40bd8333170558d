"""One object that answers every question about the ZeRO stage (DESIGN.md: "decide once, ask the object").

Stages 0-2 run on :class:`lightning_v17.engine.zero.stages_0_2.ZeroEngine` (our bucketed reducer and optimizer partition over
replicated parameters); stage 3 runs on FSDP2 (:mod:`lightning_v17.engine.zero.fsdp`). The strategy, the state-dict
helpers, gradient clipping, ``MemoryBuckets`` and ``AsyncCheckpoint`` used to re-decide what a stage means
(``zero_stage == 3``, ``stage in (1, 2)``); they ask a :class:`ZeroBackend` instead:

* what is sharded (``shards_params`` / ``shards_grads`` / ``shards_optimizer``), over which axis (always
  ``dp_shard``; the ``dp_replicate`` axis of HSDP only replicates) and how many ways (``shard_size``);
* gradient synchronisation: :meth:`no_sync` (accumulation), and the per-step hooks the pipeline needs
  (``require_grad_sync`` / :meth:`finish_grad_sync`);
* the optimizer: :meth:`prepare_optimizers` (partition before the first step), :meth:`after_optimizer_step`
  (make the replicated parameters whole again), :meth:`optimizer_state_dict` / :meth:`load_optimizer_state_dict`;
"""

from __future__ import annotations

from collections.abc import Generator, Iterable
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from lightning_v17.config import V17ConfigError
from lightning_v17.engine.offload import handles as offload_engine
from lightning_v17.engine.state import optimizer_state
from lightning_v17.engine.zero import fsdp as fsdp_engine
from lightning_v17.engine.zero.stages_0_2 import ZeroEngine

__all__ = ["ZeroBackend"]


class ZeroBackend:
    """The applied ZeRO stage of one module, and every answer that depends on it.

    Args:
        module: the model the stage was applied to.
        stage: 0 (DDP), 1 (optimizer state sharded), 2 (+ gradients), 3 (+ parameters; FSDP2).
        engine: the :class:`ZeroEngine` for stages 0-2; None for stage 3.
        shard_group: process group of the ``dp_shard`` axis (what stages 1-3 partition over).
        shard_size: size of that axis.
        partition: ``optimizer_partition``; at stage 3 it decides which optimizers step whole parameters on owner
            ranks (:func:`~lightning_v17.engine.zero.owner_step.plan_step`); stages 0-2 read it from their engine.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        stage: int,
        engine: ZeroEngine | None,
        shard_group: Any,
        shard_size: int,
        partition: str = "auto",
    ) -> None:
        if (engine is None) != (stage == 3):
            raise ValueError(f"ZeroBackend(stage={stage}) needs a ZeroEngine exactly for stages 0-2")
        self.module = module
        self.stage = stage
        self.engine = engine
        self.shard_group = shard_group
        self.shard_size = shard_size
        self.partition = partition
        #: False after :meth:`remove` (Trainer teardown): the stage must be applied again before the next run
        self.active = True
        #: the optimizers' offload engines (``offload_optimizer`` "cpu"/"nvme"), closed by :meth:`remove`
        self.offloads: list[Any] = []
        #: the parameter shards' nvme tier (``offload_params="nvme"``, engine/offload/params.py), set by parallelize
        self.param_offload: Any = None
        #: backward runs under glibc's 1 MiB mmap threshold (:meth:`backward_context`)
        self.map_backward = False
        #: the experts' gradient reduction under ep > 1 (:class:`~lightning_v17.engine.ep.ExpertGradSync`), set by
        #: parallelize; it accumulates without communicating exactly when the dense part does
        self.expert_sync: Any = None

    # ------------------------------------------------------------------ what is sharded
    @property
    def shards_optimizer(self) -> bool:
        return self.stage >= 1

    @property
    def shards_grads(self) -> bool:
        return self.stage >= 2

    @property
    def shards_params(self) -> bool:
        return self.stage >= 3

    @property
    def grad_norm_over_shards(self) -> bool:
        """Whether a global gradient norm (clipping) must all-reduce its squared sum over :attr:`shard_group`: the
        gradients the optimizer holds are disjoint pieces over it. So from stage 1 on, where the gradients
        themselves may still be whole (``shards_grads`` is False at stage 1) but the optimizer steps only this
        rank's partition, whose gradients are that partition's; not at stage 0, where every rank's optimizer holds
        the whole gradient."""
        return self.shards_optimizer

    def is_tp_sharded(self, p: torch.Tensor) -> bool:
        """Whether optimizer parameter ``p`` is a local piece of a tensor-parallel-sharded parameter (stages 0-2;
        stage 3 parameters are DTensors that carry their own placements)."""
        return self.engine.is_tp_sharded(p) if self.engine is not None else False

    # ------------------------------------------------------------------ gradient synchronisation
    @contextmanager
    def no_sync(self) -> Generator[None, None, None]:
        """Accumulate gradients locally, without communication (DDP's ``no_sync``; FSDP2's
        ``set_requires_gradient_sync(False)``)."""
        with self._experts_sync(False):
            yield from self._no_sync()

    @contextmanager
    def _experts_sync(self, value: bool) -> Generator[None, None, None]:
        sync = self.expert_sync
        if sync is None:
            yield
            return
        prev, sync.require_grad_sync = sync.require_grad_sync, value
        try:
            yield
        finally:
            sync.require_grad_sync = prev

    def _engines(self) -> list[ZeroEngine]:
        """The stage 0-2 engines: the dense one, and the experts' (their rows over efsdp) when there is one."""
        return self.engine._engines() if self.engine is not None else []

    def _no_sync(self) -> Generator[None, None, None]:
        if self.engine is not None:
            prev = [(e, e.require_grad_sync) for e in self._engines()]
            for e, _ in prev:
                e.require_grad_sync = False
            try:
                yield
            finally:
                for e, value in prev:
                    e.require_grad_sync = value
        else:
            fsdp_engine.set_requires_gradient_sync(self.module, False)
            try:
                yield
            finally:
                fsdp_engine.set_requires_gradient_sync(self.module, True)

    @property
    def require_grad_sync(self) -> bool:
        """Whether the next backward communicates (the pipeline switches this off per micro-batch)."""
        return self.engine.require_grad_sync if self.engine is not None else True

    @require_grad_sync.setter
    def require_grad_sync(self, value: bool) -> None:
        if self.engine is None:
            raise RuntimeError("stage 3 synchronises per FSDP unit; use no_sync()")
        for e in self._engines():
            e.require_grad_sync = value
        if self.expert_sync is not None:
            self.expert_sync.require_grad_sync = value

    @property
    def pipeline_reducer(self) -> Any:
        """What a pipeline step switches off for its schedule's micro-batches and finishes once after them
        (``require_grad_sync`` / :meth:`finish_grad_sync`): this backend at stages 0-2; at stage 3 the experts'
        reducer under ep (None without), because torch's ``PipelineStage`` drives its FSDP2 stages itself (no sync
        per micro-batch, one reduce-scatter in ``perform_reduce_grad``; ``fsdp._shard_pipeline_stages``)."""
        return self if self.engine is not None else self.expert_sync

    def finish_grad_sync(self) -> None:
        """Reduce the gradients accumulated while ``require_grad_sync`` was False (stages 0-2; the experts' too)."""
        for e in self._engines():
            e.finish_grad_sync()
        if self.expert_sync is not None:
            self.expert_sync.finish_grad_sync()

    # ------------------------------------------------------------------ optimizer
    def prepare_optimizers(self, optimizers: Iterable[torch.optim.Optimizer], *, offload: Any = None) -> None:
        """Partition the optimizers' state (stages 1-2) before their first step. At stage 3 FSDP2's parameters are
        already the shards, and each optimizer is planned once (:func:`~lightning_v17.engine.zero.owner_step.plan_step`):
        one that needs whole parameters or cannot step DTensors (``torch.optim.Adafactor``, bitsandbytes' 8-bit
        optimizers, a class not known to be elementwise) steps each parameter whole on an owner rank
        (:mod:`lightning_v17.engine.zero.owner_step`); an elementwise one that cannot take DTensors (bitsandbytes' 32-bit
        optimizers) steps the local shards. With an ``offload`` policy whose optimizer tier is "cpu"/"nvme", each
        (partitioned) optimizer then steps through that tier (:mod:`lightning_v17.engine.offload.optimizer`). Otherwise a user's
        own elementwise ``torch.optim`` optimizer (AdamW, Adam, SGD, ...) steps DTensor parameters (stage 3, TP) on
        their local shards (:func:`~lightning_v17.optim.local_step.enable_local_step`): bitwise the same update
        without DTensor dispatch per op.

        Raises:
            V17ConfigError: at stage 3, an optimizer that steps whole parameters with offloaded optimizer state or
                parameters, or over tensor-parallel parameters (:class:`~lightning_v17.engine.zero.owner_step.OwnerStep`).
        """
        optimizers = list(optimizers)
        for e in self._engines():  # the dense engine first: it checks every parameter the optimizers hold
            e.choose_partition(optimizers)
            for opt in optimizers:
                e.shard_optimizer(opt)
        if self.engine is not None:
            for opt in optimizers:
                self._adopt_added_groups(opt)
        params = self.param_offload if self.param_offload is not None and not self.param_offload.closed else None
        owner_steps: list[Any] = []
        if self.engine is None:
            offloaded = offload is not None and (offload.optimizer != "none" or params is not None)
            owner_steps = self._plan_stage3(optimizers, offloaded=offloaded)
        if offload is not None and (offload.optimizer != "none" or params is not None):
            import torch.distributed as dist

            from lightning_v17.config import HostMemory
            from lightning_v17.engine.collectives import map_all_gathers, map_gradient_buffers
            from lightning_v17.engine.offload.handles import attach_offload

            rank = dist.get_rank() if dist.is_initialized() else 0
            host_memory = offload.host_memory or HostMemory.RECYCLE
            nvme_tier = offload.optimizer == "nvme" or params is not None
            if nvme_tier and host_memory == HostMemory.RECYCLE and self.engine is None:
                # the sharded gradients outside the heap that forward/backward recycle (collectives.py), the
                # unsharded parameters too, and backward's own buffers (backward_context)
                map_gradient_buffers(self.module)
                map_all_gathers(self.module)
                self.map_backward = True
            self.offloads = [
                attach_offload(opt, tier=offload.optimizer, nvme_path=offload.nvme_path, ratio=offload.optimizer_ratio,
                               rank=rank, buffer_count=offload.buffer_count, chunk_mb=offload.chunk_mb, params=params,
                               host_memory=host_memory)
                for opt in optimizers
            ]  # fmt: skip
            if nvme_tier:  # the ranks of one host share its drive: room for all of their bytes, before step 0
                from lightning_v17.engine.offload.nvme import check_node_capacity

                tiers = [t for t in (params, *self.offloads) if getattr(t, "files", None) is not None]
                need = (params.nvme_bytes if params is not None else 0) + sum(o.planned_nvme_bytes for o in self.offloads)
                check_node_capacity(offload.nvme_path, need, held_bytes=sum(t.files.allocated_bytes() for t in tiers))
        from lightning_v17.optim.local_step import enable_local_step

        for opt in optimizers:
            if offload_engine.offload_of(opt) is None and opt not in owner_steps:  # those step plain tensors already
                enable_local_step(opt)  # the user's torch.optim AdamW/SGD/...: local shards, bitwise the same

    def _adopt_added_groups(self, optimizer: torch.optim.Optimizer) -> None:
        """Stages 0-2: a param group added after setup (``optimizer.add_param_group``, e.g. by ``BaseFinetuning``
        when it unfreezes a backbone) is reduced and, from stage 1 on, partitioned like the others: its parameters
        join the engines (:meth:`ZeroEngine.adopt`) and the group holds this rank's shards of them. Every rank adds
        the same group at the same point (callbacks run on every rank). Lightning's ``LightningOptimizer`` copies
        the optimizer's attributes when it wraps it, so it calls this too."""
        inner = optimizer.add_param_group

        def add_param_group(param_group: dict[str, Any]) -> None:
            group = dict(param_group)
            params = [group["params"]] if isinstance(group["params"], torch.Tensor) else list(group["params"])
            engines = self._engines()
            for e in engines:
                e.adopt(params)
            for e in engines:
                params = e.optimizer_params(params)
            inner({**group, "params": params})
            for e in engines:
                if e.stage > 0:
                    e._note_stepped(optimizer)

        optimizer.add_param_group = add_param_group  # type: ignore[method-assign]

    def _plan_stage3(self, optimizers: list[Any], *, offloaded: bool) -> list[Any]:
        """Stage 3: plan every optimizer's step (module docstring of :mod:`lightning_v17.engine.zero.owner_step`), attach
        the owner steps (their owners balanced over all of them) and the local-shard steps; returns the optimizers
        that step on owner ranks."""
        from lightning_v17.engine.zero.owner_step import StepPlan, attach_owner_steps, plan_step
        from lightning_v17.optim.local_step import step_on_local_shards

        plans = [plan_step(o, partition=self.partition) for o in optimizers]
        owners = [o for o, plan in zip(optimizers, plans) if plan == StepPlan.OWNER]
        if owners and offloaded:
            names = sorted({type(o).__name__ for o in owners})
            raise V17ConfigError(
                f"zero_stage=3 steps {', '.join(names)} whole on owner ranks (it needs whole parameters or cannot step "
                "DTensor shards), which the offloaded step (OffloadPolicy(optimizer=...) / OffloadPolicy(params=...)) "
                "cannot do yet: it steps each rank's own shards chunk by chunk. Use OffloadPolicy(optimizer='none', "
                "params='none') with it, or one of lightning_v17.optim's optimizers (Adafactor, Adam8bit, Lion8bit "
                "step the shards)"
            )
        for o, plan in zip(optimizers, plans):
            if plan == StepPlan.LOCAL_SHARDS:
                step_on_local_shards(o)  # before an offload wraps it: its chunks then step the local tensors
        if not owners:
            return []
        from torch.distributed.checkpoint.state_dict import _get_fqns

        # the FQNs torch's get_optimizer_state_dict would write (wrapper prefixes such as activation checkpointing's
        # removed), so that a checkpoint names every stage's optimizer state alike
        names = {id(p): next(iter(_get_fqns(self.module, key))) for key, p in self.module.named_parameters()}
        attach_owner_steps(owners, names=names)
        return owners

    def backward_context(self) -> Any:
        """What the strategy runs backward inside: with an nvme tier (optimizer state or parameters) under
        ``host_memory="recycle"`` at stage 3, :func:`~lightning_v17.engine.offload.host_memory.own_mappings` (glibc's mmap
        threshold at 1 MiB: an allocation of that size that no free heap chunk holds gets a mapping of its own,
        unmapped when freed, instead of growing the heap). Backward's large buffers (the unsharded gradients of a unit
        before its reduce-scatter, activation gradients) are all freed before the step; growing the heap, they left it
        fragmented and resident through the step and the next forward (bench/offload.py, side by side: 103M GPT
        70-95 MB less peak RSS per rank; 3.7M GPT 4,000-8,000 more minor faults per step, no slower). Forward and the
        step keep recycling the heap. Else nothing."""
        from contextlib import nullcontext

        from lightning_v17.engine.offload.host_memory import own_mappings

        return own_mappings() if self.map_backward else nullcontext()

    def after_optimizer_step(self, optimizer: Any = None) -> None:
        """Stages 1-2: every rank stepped its part of ``optimizer``'s parameters; all-gather (or broadcast) them into
        the replicated parameters. Only that optimizer's: with several (a GAN), the others' parameters are left
        untouched, and a graph built through them still back-propagates. None: every parameter."""
        if self.engine is not None:
            for e in self._engines():
                e.gather_params(optimizer)
        else:  # stage 3, a step inside a step hook (manual optimization): the root's own parameters gathered anew
            fsdp_engine.after_optimizer_step(self.module, optimizer)

    def optimizer_state_dict(self, optimizer: Any) -> dict[str, Any]:
        """FQN-keyed optimizer state for DCP: DTensor shards (stages 1-3) or whole tensors (stage 0)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
        )

        from lightning_v17.engine.zero.owner_step import owner_step_of

        opt = optimizer
        owner = owner_step_of(opt)
        if owner is not None:  # stage 3, whole parameters on owner ranks: each owner's whole states, by FQN
            return owner.state_dict()
        with offload_engine.materialized(opt):  # offloaded state: read from its tier for the save
            if self.engine is not None and optimizer_state(opt).zero is self.engine:
                self.engine.init_optimizer_state(opt)  # empty state gets tensors, so that DCP has something to load
                return self.engine.optimizer_state_dict(opt)
            return get_optimizer_state_dict(self.module, opt, options=StateDictOptions(full_state_dict=False))

    def load_optimizer_state_dict(self, optimizer: Any, state: dict[str, Any]) -> None:
        """Load what :meth:`optimizer_state_dict` produced (after ``dcp.load`` filled it in place)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        from lightning_v17.engine.zero.owner_step import owner_step_of

        opt = optimizer
        owner = owner_step_of(opt)
        if owner is not None:
            owner.load_state_dict(state)
            return
        with offload_engine.materialized(opt):  # offloaded state: written back to its tier after the load
            if self.engine is not None and optimizer_state(opt).zero is self.engine:
                self.engine.load_optimizer_state_dict(opt, state)
            else:  # not strict: a parameter the saved optimizer never stepped has no state (drop_unsaved_optimizer_entries
                # left it out of the template; DCP itself loads every key the template has strictly)
                options = StateDictOptions(full_state_dict=False, strict=False)
                set_optimizer_state_dict(self.module, opt, state, options=options)

    # ------------------------------------------------------------------ lifetime
    def remove(self) -> None:
        """Detach the stage 0-2 gradient hooks (Trainer teardown). FSDP2's sharding stays: it is the model's
        layout now, and a following validate/test runs on it. Offloaded optimizer state is released (nvme files
        removed)."""
        for off in self.offloads:
            off.close()
        self.offloads = []
        if self.engine is None:
            from lightning_v17.engine.collectives import map_all_gathers, map_gradient_buffers

            map_gradient_buffers(self.module, None)
            if self.map_backward:  # before the parameter tier's close, which removes its own wrappers
                map_all_gathers(self.module, False)
        self.map_backward = False
        if self.param_offload is not None:
            self.param_offload.close()  # every shard back in memory: after fit the model is plain FSDP2 again
        if self.engine is not None:
            for e in self._engines():
                e.remove()
            self.active = False
