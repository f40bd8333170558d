"""V17FabricStrategy: ZeRO-1/2/3 and tensor parallelism under Lightning Fabric, a thin adapter over ``lightning_v17.engine``.

The front door is V17Strategy's: the same argument names, parsed by the same functions (``_options.build_policy``,
``_options.parallel_dims``, ``engine.parallelize.check_composition``); the model goes through the same one engine call
(:func:`lightning_v17.engine.parallelize.parallelize`) on the same mesh (:func:`lightning_v17.mesh.build_device_mesh`).
What Fabric does not run yet is refused with a :class:`~lightning_v17.config.V17ConfigError` that names it, at
construction or at the call, never silently ignored (``docs/fabric.md``).
"""

from __future__ import annotations

import atexit
from contextlib import AbstractContextManager, ExitStack, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.fabric.strategies.parallel import ParallelStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.fabric.utilities.distributed import ReduceOp, _distributed_is_initialized
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import _Stateful
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from lightning_v17.strategies._checkpoint import load, save
from lightning_v17.strategies._collectives import WorldCollectives, init_world
from lightning_v17.strategies._engine_state import EngineState
from lightning_v17.strategies._options import _changed, build_policy, check_hang_timeout, parallel_dims
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_v17.config import (
    CPPolicy,
    EPPolicy,
    FP8Policy,
    OffloadPolicy,
    ParallelDims,
    PipelinePolicy,
    Recompute,
    TPPolicy,
    TrainingPolicy,
    V17ConfigError,
    ZeroPolicy,
)
from lightning_v17.engine.parallelize import Parallelized, check_composition, parallelize, parallelized
from lightning_v17.engine.precision.clip import clip_grad_norm_
from lightning_v17.engine.zero import meta_init
from lightning_v17.engine.zero import state_dict as state_engine
from lightning_v17.mesh import MeshRuntime, UnsetMesh, build_device_mesh

__all__ = ["V17FabricStrategy"]


def _not_yet(feature: str, fix: str = "") -> V17ConfigError:
    return V17ConfigError(f"{feature} is not available under Fabric yet (V17FabricStrategy){'; ' + fix if fix else ''}")


def refuse_unsupported(policy: TrainingPolicy, dims: ParallelDims, *, hang_timeout: float | None,
                       loss_normalization: str) -> None:  # fmt: skip
    """Every option this strategy does not run yet, refused at construction with the feature's name.

    Raises:
        V17ConfigError: naming the first such option.
    """
    checks = [
        (not policy.zero.shards_optimizer, "ZeRO-0 (zero_stage=0)", "use Fabric's strategy='ddp'"),
        (policy.zero.meta_init, "zero.meta_init=True", ""),
        (dims.pp > 1, f"pipeline parallelism (pp={dims.pp})", ""),
        (dims.cp > 1, f"context parallelism (cp={dims.cp})", ""),
        (dims.ep > 1, f"expert parallelism (ep={dims.ep})", ""),
        (dims.dp_replicate != 1, f"HSDP (dp_replicate={dims.dp_replicate})", ""),
        (policy.offload != OffloadPolicy(), f"offload ({_changed(policy.offload, OffloadPolicy)})", ""),
        (policy.fp8 is not None, "fp8", ""),
        (policy.recompute != Recompute.NONE, f"activation_checkpointing={policy.recompute.value!r}", ""),
        (policy.tensor_parallel.sequence_parallel, "TPPolicy(sequence_parallel=True)", ""),
        (policy.tensor_parallel.vocab_parallel, "TPPolicy(vocab_parallel=True)", ""),
        (policy.tensor_parallel.loss_parallel, "TPPolicy(loss_parallel=True)", ""),
        (policy.precision is not None, "the config's bf16/fp16 block", "give Fabric(precision=...) instead"),
        (policy.loss_scale is not None, "the config's loss scaling", ""),
        (policy.gradient_clipping is not None, "the config's gradient_clipping", "call fabric.clip_gradients"),
        (policy.gradient_accumulation_steps is not None, "the config's gradient_accumulation_steps",
         "accumulate with fabric.no_backward_sync"),
        (policy.micro_batch_size is not None or policy.train_batch_size is not None, "the config's batch keys", ""),
        (hang_timeout is not None, "hang_timeout (the step watchdog)", ""),
        (loss_normalization != "rank_mean", f"loss_normalization={loss_normalization!r}",
         "under Fabric the loss is the one your code computes (each rank's mean, as with 'ddp'): leave it 'rank_mean'"),
    ]  # fmt: skip
    for bad, feature, fix in checks:
        if bad:
            raise _not_yet(feature, fix)


class _V17BackwardSyncControl(_BackwardSyncControl):
    """``fabric.no_backward_sync``: the applied ZeRO stage accumulates without communicating (stages 1-2: the
    engine's reduction is deferred to the next synchronised backward; stage 3: FSDP2's
    ``set_requires_gradient_sync(False)``), through :meth:`ZeroBackend.no_sync`."""

    def __init__(self, strategy: V17FabricStrategy) -> None:
        self._strategy = strategy

    @override
    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        if not enabled:
            return nullcontext()
        return self._strategy.zero.no_sync()


class V17FabricStrategy(EngineState, WorldCollectives, ParallelStrategy):
    """ZeRO-1/2/3 and tensor parallelism (tp) on V17's device mesh, for ``lightning.fabric.Fabric``.

    ``Fabric(accelerator="cpu", devices=2, strategy=V17FabricStrategy(zero_stage=3))``, then ``fabric.setup(model,
    optimizer)`` (or ``setup_module`` and then ``setup_optimizers``), ``fabric.backward``, ``fabric.clip_gradients(...,
    max_norm=...)`` (the global norm over the ZeRO shards and the tp pieces) and ``fabric.no_backward_sync``.

    Args: as :class:`~lightning_v17.strategies.V17Strategy`'s, of which these run under Fabric: ``zero_stage`` 1-3
    (or ``zero=ZeroPolicy(...)``), ``dp_shard``, ``tp`` (a size or ``TPPolicy(size=..., plan=...)``; without a plan,
    the model's own), ``config`` (its ZeRO section), ``process_group_backend`` and ``timeout``. Pipeline, context and
    expert parallelism, HSDP, offload, fp8, activation checkpointing, sequence/vocab/loss parallel tp, the config's
    precision, clipping, accumulation and batch keys, ``hang_timeout`` and ``loss_normalization="tokens"`` are refused
    with a :class:`~lightning_v17.config.V17ConfigError` (the loss is the one the user's loop computes: each rank's
    mean, as under Fabric's ``"ddp"``).

    Its own argument: ``async_save``: ``fabric.save`` returns once the state is staged in host memory; the shards
    are written in the background and the checkpoint is published (``meta.json`` last, then renamed into place, as a
    synchronous save) by the first optimizer step or ``fabric.barrier`` that finds every rank's write done, and at the
    latest by the next ``fabric.save`` or ``fabric.load`` or when the process exits. One save is in flight at a time;
    a failed write discards the partial directory and leaves the previous checkpoint as it was.
    """

    _setup_call = "fabric.setup(model)"

    def __init__(
        self,
        zero_stage: int | None = None,
        activation_checkpointing: str | None = None,
        dp_replicate: int = 1,
        dp_shard: int | str = "auto",
        tp: int | TPPolicy = 1,
        pp: int | PipelinePolicy = 1,
        cp: int | CPPolicy = 1,
        ep: int | EPPolicy = 1,
        zero: ZeroPolicy | None = None,
        offload: OffloadPolicy | None = None,
        fp8: FP8Policy | str | None = None,
        config: str | Path | dict | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        hang_timeout: float | None = None,
        loss_normalization: str = "rank_mean",
        async_save: bool = False,
    ) -> None:
        super().__init__()  # accelerator, devices, cluster environment, precision: set by Fabric's connector
        self.policy = build_policy(zero_stage=zero_stage, activation_checkpointing=activation_checkpointing, tp=tp,
                                   pp=pp, cp=cp, ep=ep, zero=zero, offload=offload, fp8=fp8, config=config)  # fmt: skip
        self.dims = parallel_dims(self.policy, dp_replicate=dp_replicate, dp_shard=dp_shard)
        check_composition(self.policy, self.dims)
        refuse_unsupported(self.policy, self.dims, hang_timeout=check_hang_timeout(hang_timeout),
                           loss_normalization=loss_normalization)  # fmt: skip
        self._process_group_backend, self._timeout = process_group_backend, timeout
        self._mesh: MeshRuntime | UnsetMesh = UnsetMesh()
        self._parallel: Parallelized | None = None
        self._num_nodes = 1
        self._async_save, self._saver = bool(async_save), None
        self._backward_sync_control = _V17BackwardSyncControl(self)

    @classmethod
    def register_strategies(cls, registry: Any) -> None:
        """Fabric's aliases: ``Fabric(strategy="v17_zero3")`` (and ``"v17"``, ZeRO-3; ``"v17_zero1"``/``"v17_zero2"``)."""
        registry.register("v17", cls, description="V17 ZeRO-3 (FSDP2) on a device mesh, under Fabric", zero_stage=3)
        for stage in (1, 2, 3):
            registry.register(f"v17_zero{stage}", cls, description=f"V17 ZeRO stage {stage} under Fabric",
                              zero_stage=stage)  # fmt: skip

    # ------------------------------------------------------------------ properties

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    # ------------------------------------------------------------------ launch and environment
    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        if self.precision.precision != "32-true":
            raise _not_yet(f"precision={self.precision.precision!r}", "use Fabric(precision='32-true')")
        reset_seed()
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank
        self._process_group_backend = init_world(
            self.cluster_environment, self._process_group_backend, device=self.root_device, rank=self.global_rank,
            world_size=self.world_size, timeout=self._timeout,
        )  # fmt: skip
        spec = self.dims.mesh(self.world_size)
        self._mesh = MeshRuntime(spec, build_device_mesh(spec, device_type=self.root_device.type))

    # ------------------------------------------------------------------ model and optimizers
    @override
    def setup_module(self, module: Module) -> Module:
        """One engine call, :func:`~lightning_v17.engine.parallelize.parallelize`, as V17Strategy's ``_setup_model``."""
        if self._parallel is not None or parallelized(module) is not None:
            raise _not_yet("a second model (or the same one set up twice) on one V17FabricStrategy")
        spec, tp_plan = self.mesh.spec, None
        if spec.tp > 1:
            from lightning_v17.models.tp_plans import resolve_tp_plan

            tp_plan = resolve_tp_plan(module, explicit=self.policy.tensor_parallel.plan)
        self._parallel = parallelize(module, mesh=self.mesh, policy=self.policy, device=self.root_device,
                                     tp_plan=tp_plan)  # fmt: skip
        return module

    @override
    def setup_module_and_optimizers(
        self, module: Module, optimizers: list[Optimizer], scheduler: Any = None
    ) -> tuple[Module, list[Optimizer], Any]:
        """``fabric.setup(model, optimizer)``: the optimizers were built on the model's parameters before TP and
        FSDP2 replaced them (with DTensors); their parameter groups are pointed at the new ones by name, then
        partitioned as ``setup_optimizer`` does."""
        names = {id(p): n for n, p in module.named_parameters()}
        for opt in optimizers:
            if opt.state:
                raise _not_yet("an optimizer that has stepped before fabric.setup", "set it up before its first step")
            if any(id(p) not in names for g in opt.param_groups for p in g["params"]):
                raise V17ConfigError("fabric.setup(model, optimizer): the optimizer holds parameters not in the model")
        module = self.setup_module(module)
        new = dict(module.named_parameters())
        for opt in optimizers:
            for group in opt.param_groups:
                group["params"] = [new[names[id(p)]] for p in group["params"]]
        return module, [self.setup_optimizer(opt) for opt in optimizers], scheduler

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Partition the optimizer over the ZeRO shards (stages 1-2) or plan its step (stage 3), as V17Strategy's
        ``setup`` does (:meth:`ZeroBackend.prepare_optimizers`)."""
        self.zero.prepare_optimizers([optimizer], offload=self.policy.offload)
        return optimizer

    @override
    def module_to_device(self, module: Module) -> None:
        if not meta_init.has_meta(module):  # a meta model is materialized, shard by shard, by fabric.setup
            module.to(self.root_device)

    @override
    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        """``fabric.init_module(empty_init=True)`` builds on the meta device; ``fabric.setup`` then allocates only
        this rank's shards and initializes them (``reset_parameters``/``init_weights``, as V17Strategy's
        ``empty_init``): at ZeRO-3 no rank ever holds the whole model."""
        stack = ExitStack()
        if empty_init:
            stack.enter_context(torch.device("meta"))
        stack.enter_context(self.precision.module_init_context())
        return stack

    # ------------------------------------------------------------------ step
    @override
    def backward(self, tensor: Tensor, module: Module | None, *args: Any, **kwargs: Any) -> None:
        with self.zero.backward_context():
            super().backward(tensor, module, *args, **kwargs)

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        out = super().optimizer_step(optimizer, **kwargs)
        self.zero.after_optimizer_step(optimizer)  # stages 1-2: this optimizer's parameters made whole again
        self._publish(wait=False)
        return out

    @override
    def clip_gradients_norm(
        self, module: Module, optimizer: Optimizer, max_norm: float, norm_type: float = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:  # fmt: skip
        """The global L2 norm over every rank's shards and tp pieces (V17Strategy's ``ShardedClipping``; torch's
        ``clip_grad_norm_`` would see only this rank's shards), then scaled in place; returns the norm before it."""
        if float(norm_type) != 2.0:
            raise _not_yet(f"clip_gradients(norm_type={norm_type})", "only the L2 norm (norm_type=2) is")
        self.precision.unscale_gradients(optimizer)
        params = list(self.precision.main_params(optimizer))
        mesh, zero = self.mesh, self.zero
        tp = mesh.spec.tp > 1
        norm = clip_grad_norm_(
            params, float(max_norm), group=zero.shard_group, sharded=zero.grad_norm_over_shards,
            tp_sharded=[zero.is_tp_sharded(p) for p in params] if tp else None,
            tp_group=mesh.group("tp") if tp else None,
        )  # fmt: skip
        if error_if_nonfinite and not torch.isfinite(norm):
            raise RuntimeError(f"the total norm of the gradients is {float(norm)}, non-finite (error_if_nonfinite)")
        return norm

    @override
    def clip_gradients_value(self, module: Module, optimizer: Optimizer, clip_val: float) -> None:
        raise _not_yet(
            "fabric.clip_gradients(clip_val=...)", "clip by the gradients' norm: pass max_norm instead of clip_val"
        )

    # ------------------------------------------------------------------ collectives over the world
    @override
    def all_reduce(self, tensor: Tensor, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Tensor:
        return self.reduce(tensor, group, reduce_op)  # WorldCollectives': over the world

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if _distributed_is_initialized():
            self._publish(wait=False)  # every rank is here: an asynchronous save may be published
        super().barrier()

    # ------------------------------------------------------------------ checkpoints
    @override
    def save_checkpoint(
        self, path: Any, state: dict[str, Any], storage_options: Any | None = None,
        filter: dict[str, Any] | None = None,
    ) -> None:  # fmt: skip
        """``fabric.save(path, state)``: a sharded checkpoint directory, every rank writing its own shards, in the
        Trainer's format (``strategies/_checkpoint.py``): the model in ``state`` is its model component, the
        optimizers (in ``state``'s order) its optimizer component, the other entries (``state_dict()`` of those that
        have one) the trainer state. It loads at any world size or layout, under Fabric or the Trainer."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint(storage_options=...) is not supported")
        if filter is not None:
            raise _not_yet("fabric.save(filter=...)", "a sharded checkpoint is saved whole; save the full state")
        model_key, module, optimizers = self._objects(state, "fabric.save")
        rest = {k: v for k, v in state.items() if k != model_key and k not in optimizers}
        clash = sorted(set(rest) & {"state_dict", "optimizer_states"})
        if clash:
            raise V17ConfigError(f"fabric.save(state=...): the keys {clash} name the checkpoint's own components; "
                                 "rename them")  # fmt: skip
        checkpoint = {k: v.state_dict() if isinstance(v, _Stateful) else v for k, v in rest.items()}
        checkpoint["state_dict"] = state_engine.get_model_state(module)
        checkpoint["optimizer_states"] = [self.zero.optimizer_state_dict(o) for o in optimizers.values()]
        self._publish(wait=True)  # one save in flight at a time
        if self._async_save and self._saver is None:
            from lightning_v17.checkpoint.async_save import AsyncShardedSaver

            self._saver = AsyncShardedSaver()
            atexit.register(self._publish, wait=True)  # a last save before the script ends is published, not lost
        keys = {"model": model_key, "optimizers": list(optimizers)}
        save(self, checkpoint, path, fabric_keys=keys, saver=self._saver)

    def _publish(self, *, wait: bool) -> None:
        """Publish the asynchronous save in flight: when every rank's write is done (``wait=False``: one all-reduce,
        so only at a call every rank makes), or after waiting for this rank's write (``wait=True``)."""
        if self._saver is not None and self._saver.in_flight:
            self._saver.wait() if wait else self._saver.poll()

    @override
    def teardown(self) -> None:
        self._publish(wait=True)
        if self._saver is not None:
            self._saver.close()
            self._saver = None
        super().teardown()

    @override
    def load_checkpoint(
        self, path: Any, state: Module | Optimizer | dict[str, Any] | None = None, strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """``fabric.load(path, state)``: the model and optimizers in ``state`` are loaded in place from a sharded
        checkpoint (``fabric.save``'s or the Trainer's, any world size, ZeRO stage or tp layout), the other requested
        entries replaced (or ``load_state_dict``-ed); returns what ``state`` did not ask for (a Trainer checkpoint's
        ``global_step``, ``loops``, ...)."""
        if not isinstance(state, dict):
            raise _not_yet("fabric.load without a state dict, or fabric.load_raw",
                           "pass the objects set up by fabric.setup: fabric.load(path, {'model': model, "
                           "'optimizer': optimizer, ...})")  # fmt: skip
        model_key, module, optimizers = self._objects(state, "fabric.load")
        self._publish(wait=True)  # a save still in flight is published before anything is read
        remainder, _info = load(self, path, weights_only=weights_only, model=module,
                                optimizers=list(optimizers.values()), option="fabric.load(path)")  # fmt: skip
        requested = [k for k in state if k != model_key and k not in optimizers]
        missing = [k for k in requested if k not in remainder]
        if strict and missing:
            raise KeyError(f"fabric.load: the requested state key {missing[0]!r} is not in the checkpoint at "
                           f"{str(path)!r}; to skip the keys it lacks, pass strict=False")  # fmt: skip
        for key in [k for k in requested if k in remainder]:
            if isinstance(state[key], _Stateful):
                state[key].load_state_dict(remainder.pop(key))
            else:
                state[key] = remainder.pop(key)
        return remainder

    def _objects(self, state: dict[str, Any], call: str) -> tuple[str, Module, dict[str, Optimizer]]:
        """The one model this strategy set up and the optimizers in ``state``, by key."""
        modules = {k: v for k, v in state.items() if isinstance(v, Module)}
        if len(modules) != 1 or self._parallel is None or parallelized(next(iter(modules.values()))) is None:
            raise V17ConfigError(
                f"{call}(path, state): state must hold exactly one model, the one fabric.setup set up with this "
                f"strategy (found {len(modules)} modules: {sorted(modules)}), e.g. {{'model': model, "
                "'optimizer': optimizer, 'step': step}"
            )
        ((model_key, module),) = modules.items()
        return model_key, module, {k: v for k, v in state.items() if isinstance(v, Optimizer)}
