"""V17Strategy: every parallelism axis for any LightningModule, a thin Lightning adapter over ``lightning_v17.engine``.

Options are parsed once (``_options.py``); plans are resolved from the options, the LightningModule's hooks or the
model's own; one engine call, :func:`lightning_v17.engine.parallelize.parallelize`, transforms the model. The
pipeline, precision and checkpoint glue live in ``_pipeline.py``, ``_precision.py`` and ``_checkpoint.py``.
"""

from __future__ import annotations

import itertools
from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from lightning_v17.strategies import _lightning_compat, _pipeline, _precision
from lightning_v17.strategies._checkpoint import ShardedCheckpoints
from lightning_v17.strategies._collectives import WorldCollectives, init_world
from lightning_v17.strategies._context import ContextSteps, prepare_context_parallel_model
from lightning_v17.strategies._engine_state import EngineState
from lightning_v17.strategies._fault import FaultSteps
from lightning_v17.strategies._options import (
    apply_config_to_trainer,
    build_policy,
    check_first_batch,
    check_hang_timeout,
    parallel_dims,
    warn_checkpoint_io,
)
from lightning_v17.strategies._tokens import TokenSteps, check_loss_normalization
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_v17.config import (
    CPPolicy,
    EPPolicy,
    FP8Policy,
    FTPolicy,
    MeshSpec,
    OffloadPolicy,
    PipelinePolicy,
    TPPolicy,
    ZeroPolicy,
)
from lightning_v17.engine.ep import balanced_layers, step_expert_biases
from lightning_v17.engine.parallelize import Parallelized, check_composition, parallelize, parallelized
from lightning_v17.engine.precision import mixed_precision_dtypes
from lightning_v17.engine.zero import fsdp as fsdp_engine
from lightning_v17.engine.zero import meta_init
from lightning_v17.mesh import MeshRuntime, UnsetMesh, build_device_mesh
from lightning_v17.resilience.watchdog import StepWatchdog

if TYPE_CHECKING:
    import lightning.pytorch as pl

_RUNS = itertools.count()  # one watchdog key space per setup; every rank runs the same sequence of fits


class V17Strategy(
    FaultSteps, TokenSteps, ContextSteps, WorldCollectives, ShardedCheckpoints, EngineState, ParallelStrategy
):
    """ZeRO-0/1/2/3 (and HSDP) x TP(+SP) x PP on a 5-axis device mesh, for any LightningModule, on CPU and GPU.

    The arguments are the mesh's axis sizes (an axis with options takes its policy instead, the size inside:
    ``tp=TPPolicy(size=2, sequence_parallel=True)``), one policy object per concern, a DeepSpeed config and the
    process group's settings. Each option is documented once, on its policy's field (``lightning_v17.config``'s
    ``ZeroPolicy``, ``OffloadPolicy``, ``PipelinePolicy``, ``TPPolicy``, ``FP8Policy``, ``FTPolicy``). In YAML a policy
    is the mapping of its fields (``zero: {stage: 3, bucket_mb: 25}``, ``tp: {size: 8, sequence_parallel: true}``).
    They become one :class:`~lightning_v17.config.TrainingPolicy` (``strategy.policy``); after setup ``strategy.mesh``
    is the live mesh and ``strategy.zero`` the applied ZeRO stage. The Trainer sets Lightning's plumbing.
    Precedence is given > config > default: a given argument (not None) wins over ``config``, even when it equals
    the default; a policy object wins over the config's section as a whole (``strategies/_options.py``).

    Args:
        zero_stage: shortcut for ``zero=ZeroPolicy(stage=...)``, not together with ``zero``; None: the config's, else 3.
        activation_checkpointing: "none", "selective" or "full" (``Recompute``); None: the config's, else "none".
        dp_replicate: replicated data-parallel groups (HSDP's outer axis; HSDP when ``dp_shard`` > 1 too).
        dp_shard: ranks ZeRO partitions over; "auto" = world size / (pp * dp_replicate * cp * tp).
        tp: tensor-parallel size (innermost mesh axis), or :class:`~lightning_v17.config.TPPolicy` with its options.
        pp: pipeline stages (outermost mesh axis), or :class:`~lightning_v17.config.PipelinePolicy`.
        cp: context-parallel size (each row's sequence split over cp ranks), or :class:`~lightning_v17.config.CPPolicy`.
        ep: expert-parallel size, folded out of ``dp_shard``, or :class:`~lightning_v17.config.EPPolicy`.
        zero: :class:`~lightning_v17.config.ZeroPolicy`; None: the config's section, with ``zero_stage`` if given.
        offload: :class:`~lightning_v17.config.OffloadPolicy` (cpu and nvme tiers); None: the config's, else none.
        fp8: :class:`~lightning_v17.config.FP8Policy`, or its recipe ("tensorwise", "rowwise", "delayed"); None: off.
        config: a DeepSpeed JSON config, dict or path (:func:`lightning_v17.config.deepspeed.from_deepspeed_config`).
        process_group_backend: "gloo" or "nccl"; None picks from the device.
        timeout: collective timeout (``init_process_group(timeout=)``; torch's default is 30 minutes).
        hang_timeout: seconds without progress before the watchdog ends a rank (``resilience/watchdog.py``); None: off.
        loss_normalization: "tokens": the losses that know their target count (the reference model's, the pipeline's
            default, Hugging Face causal LMs') divide their token sum once by the optimizer step's global count, over
            dp x cp ranks and accumulated batches: one process's objective on every layout (``docs/loss.md``).
            "rank_mean": each rank's own mean (DDP's objective), what a module returning a scalar of its own gets.
        fault_tolerance: :class:`~lightning_v17.config.FTPolicy`: replica groups on torchft (docs/resilience.md).
    """

    strategy_name = "v17"
    _setup_call = "Trainer setup"

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
        loss_normalization: str = "tokens",
        fault_tolerance: FTPolicy | None = None,
    ) -> None:
        super().__init__()  # accelerator, devices, cluster environment, checkpoint IO, precision: set by the Trainer
        self.policy = build_policy(zero_stage=zero_stage, activation_checkpointing=activation_checkpointing, tp=tp,
                                   pp=pp, cp=cp, ep=ep, zero=zero, offload=offload, fp8=fp8, config=config)  # fmt: skip
        dp_replicate = self.ft_replicate(fault_tolerance, dp_replicate)  # with FTPolicy: 1, torchft owns that axis
        self.dims = parallel_dims(self.policy, dp_replicate=dp_replicate, dp_shard=dp_shard)  # the one axis owner
        check_composition(self.policy, self.dims)
        self._process_group_backend, self._timeout = process_group_backend, timeout
        self._hang_timeout = check_hang_timeout(hang_timeout)
        self._watchdog: StepWatchdog | None = None
        self._mesh: MeshRuntime | UnsetMesh = UnsetMesh()
        self._parallel: Parallelized | None = None  # what parallelize did, after setup
        self._balanced: list[Module] = []  # MoE layers with an aux-loss-free expert bias
        self._batch_checked, self.num_nodes = False, 1
        self._loss_normalization = check_loss_normalization(loss_normalization)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register("v17", cls, description="V17 ZeRO-3 (FSDP2) on a device mesh", zero_stage=3)
        for stage in (1, 2, 3):
            strategy_registry.register(
                f"v17_zero{stage}", cls, description=f"V17 ZeRO stage {stage} on a device mesh", zero_stage=stage,
            )  # fmt: skip
        strategy_registry.register(
            "v17_zero3_offload", cls, zero_stage=3, offload=OffloadPolicy(params="cpu"),
            description="V17 ZeRO-3 with parameters, gradients and the optimizer step on the CPU (FSDP2 CPUOffloadPolicy)",
        )  # fmt: skip

    # ------------------------------------------------------------------ properties
    @property
    def zero_stage(self) -> int:
        return self.policy.zero.stage

    @property
    @override
    def checkpoint_io(self) -> CheckpointIO:
        return super().checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO | None) -> None:
        warn_checkpoint_io(io)  # the Trainer's plugins=[CheckpointIO]: unused, sharded checkpoints are written here
        self._checkpoint_io = io

    # ------------------------------------------------------------------ launch and environment
    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        # As Lightning's launchers do: one share of the cores per local rank unless OMP_NUM_THREADS is set.
        _set_num_threads_if_needed(num_processes=self.num_processes)
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = init_world(
            self.cluster_environment, self._process_group_backend, device=self.root_device, rank=self.global_rank,
            world_size=self.world_size, timeout=self._timeout,
        )  # fmt: skip
        # Under torchrun the default store is already this round's own (v17/gen-<token>, resilience/elastic.py); the
        # agents' restart counts differ after a node was replaced, so they must not be part of a shared key.
        self._watchdog = StepWatchdog(self._hang_timeout, prefix=f"v17/watchdog/{next(_RUNS)}")
        spec = self.resolve_mesh(self.world_size)
        self._mesh = MeshRuntime(spec, build_device_mesh(spec, device_type=self.root_device.type))
        _precision.apply_config_precision(self)
        # Sharding-aware clipping and fp16 inf checks: a subclass of the Trainer's plugin, as FSDPPrecision is.
        self.precision_plugin = _precision.sharded_precision(self, self.precision_plugin)
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._mesh.device_mesh  # as ModelParallelStrategy: visible to the module

    def resolve_mesh(self, world_size: int) -> MeshSpec:
        """The mesh sizes for ``world_size`` ranks (``dp_shard="auto"`` resolved); raises a clear error on mismatch."""
        return self.dims.mesh(world_size)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    # ------------------------------------------------------------------ model setup
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        _lightning_compat.check_callbacks(self, trainer)  # refused now what would fail mid-run; grad_norm's norms
        if self.mesh.spec.pp > 1:
            _pipeline.check_pipeline_trainer(self, trainer)
        apply_config_to_trainer(self.policy, trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        if not meta_init.has_meta(self.model):
            self.model_to_device()
        self.model = self._setup_model(self.model)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            self.zero.prepare_optimizers(self.optimizers, offload=self.policy.offload)
            if self._pipelined():
                # The schedule runs forward *and* backward inside training_step. Lightning's closure would then zero
                # the gradients and back-propagate again; its skip-backward flag drops both (the mechanism
                # StochasticWeightAveraging uses; NeMo's MegatronStrategy does the same).
                trainer.fit_loop._skip_backward = True
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
            _lightning_compat.share_optimizer_overrides(self)  # self.optimizers()' zero_grad/add_param_group

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        self._reset_optimizers_and_schedulers()  # re-setup after validate: old param references are stale
        super().setup_optimizers(trainer)

    @override
    def _setup_model(self, model: Module) -> Module:
        """Resolve the plans, then one engine call (``parallelize``); idempotent across fit/validate/test."""
        spec, policy = self.mesh.spec, self.policy
        tp_plan = layout = loss_fn = None
        if parallelized(model) is None:
            if spec.tp > 1:
                from lightning_v17.models.tp_plans import resolve_tp_plan

                tp = policy.tensor_parallel
                tp_plan = resolve_tp_plan(
                    model, explicit=tp.plan, sequence_parallel=tp.sequence_parallel, vocab_parallel=tp.vocab_parallel,
                    loss_parallel=tp.loss_parallel,
                )  # fmt: skip
            if spec.ep > 1:  # Hugging Face's fused experts become engine MoE layers (their FQNs unchanged)
                from lightning_v17.models.hf_moe import adapt_hf_moe

                adapt_hf_moe(model)
            if spec.pp > 1:
                pipeline, layout, loss_fn = _pipeline.pipeline_options(model, policy.pipeline)
                policy = replace(policy, pipeline=pipeline)
            prepare_context_parallel_model(self, model, spec.cp)
        param_dtype, reduce_dtype = mixed_precision_dtypes(self.precision_plugin.precision)
        self._parallel = parallelize(
            model, mesh=self.mesh, policy=policy, device=self.root_device, tp_plan=tp_plan, pp_layout=layout,
            loss_fn=loss_fn, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
            steps_inside_forward=not getattr(model, "automatic_optimization", True),
        )  # fmt: skip
        self._balanced = [] if hasattr(model, "step_expert_biases") else balanced_layers(model)  # LlamaLM's: its own
        return model

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """``empty_init=True`` builds on the meta device; ZeRO-3 then allocates only the local shards in ``setup``."""
        ctx = torch.device("meta") if empty_init else nullcontext()
        with ctx, self.precision_plugin.tensor_init_context():
            yield

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Around ``configure_model``: real tensors, as in Lightning's own FSDP and ModelParallel strategies, so that
        ``from_pretrained`` and ``load_state_dict`` work there (each rank holds the whole model until ``setup``
        shards it). ``ZeroPolicy(meta_init=True)`` builds it on the meta device instead, so that only the shards
        are ever allocated, and refuses loads there (:func:`lightning_v17.engine.zero.meta_init.deferred_init`)."""
        with meta_init.deferred_init() if self.policy.zero.meta_init else nullcontext():
            yield

    # ------------------------------------------------------------------ step
    def _pipelined(self) -> bool:
        return self._parallel is not None and self._parallel.pipeline is not None

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if not self._batch_checked:  # DeepSpeed's batch keys against the real batch, once
            self._batch_checked = check_first_batch(self, args[0] if args else kwargs["batch"])
        with self._watch("training_step"):
            if self._pipelined():
                return _pipeline.training_step(self, args, kwargs)
            with self._loss_parallel():
                return self._step("training_step", self.precision_plugin.train_step_context, args, kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._watch("validation_step"):
            if self._pipelined():
                return _pipeline.eval_step(self, "val", args, kwargs)
            with self._loss_parallel():
                return self._step("validation_step", self.precision_plugin.val_step_context, args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._watch("test_step"):
            if self._pipelined():
                return _pipeline.eval_step(self, "test", args, kwargs)
            with self._loss_parallel():
                return self._step("test_step", self.precision_plugin.test_step_context, args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipelined():
            _pipeline.refuse_predict(self)
        return self._step("predict_step", self.precision_plugin.predict_step_context, args, kwargs)

    def _step(self, hook: str, step_context: Any, args: tuple, kwargs: dict) -> Any:
        """Lightning's dispatch of a step hook (``Strategy.training_step`` and its siblings). At stage 3 the hook runs
        as the FSDP2 root's forward (:func:`lightning_v17.engine.zero.fsdp.run_as_forward`): Lightning calls it directly,
        never the module's ``forward``, so the root's own hooks (its all-gather, its reduce-scatter after backward)
        would not run; under manual optimization optimizers may step inside it
        (:func:`~lightning_v17.engine.zero.fsdp.optimizer_steps_inside`)."""
        module = self.lightning_module
        root = fsdp_engine.fsdp_root(module) if module is not None else None
        if root is None:
            return getattr(super(), hook)(*args, **kwargs)
        manual = hook == "training_step" and not module.automatic_optimization
        with step_context(), fsdp_engine.optimizer_steps_inside(root) if manual else nullcontext():
            return fsdp_engine.run_as_forward(root, getattr(module, hook), *args, **kwargs)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        if self._pipelined():
            return closure_loss.detach()  # the pipeline schedule already ran backward (NeMo's skip-backward)
        with self._watch("backward"), self._loss_parallel(), self.zero.backward_context():
            return super().backward(self.scale_loss(closure_loss), optimizer, *args, **kwargs)

    @contextmanager
    def _watch(self, phase: str) -> Generator[None, None, None]:
        """Progress for the watchdog at both ends of a hook; an error inside is published for the peers."""
        wd = self._watchdog
        if wd is None or not wd.active:
            yield
            return
        step = self.lightning_module.trainer.global_step if self._lightning_module is not None else 0
        wd.start()
        wd.progress(step, phase)
        with wd.guard():
            yield
        wd.progress(step, f"after {phase}")

    def _loss_parallel(self) -> Any:
        """torch's ``loss_parallel()`` with ``TPPolicy(loss_parallel=True)`` (the loss and its backward run inside)."""
        from lightning_v17.engine.tp.apply import loss_parallel_context

        return loss_parallel_context(self.policy.tensor_parallel.loss_parallel)

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        from lightning.pytorch.core.optimizer import LightningOptimizer

        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer  # unwrapped here, at the boundary: the engine never sees Lightning's
        with self._watch("optimizer_step"):
            out = super().optimizer_step(optimizer, closure, model, **kwargs)
            self.zero.after_optimizer_step(optimizer)  # stages 1/2: make this optimizer's parameters whole again
            if self._parallel is not None and self._parallel.fp8 is not None:
                self._parallel.fp8.after_optimizer_step()  # float8 scales: all-gathered weights', delayed histories
            if self._balanced:  # MoE: the aux-loss-free expert bias, from the step's load over every data rank
                step_expert_biases(self._balanced, group=self.mesh.group("dp"))
        return out

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Gradient accumulation: no communication on non-final micro-steps (DDP's ``no_sync``)."""
        with self.zero.no_sync() if self._parallel is not None else nullcontext():
            yield None

    @override
    def teardown(self) -> None:
        if self._watchdog is not None:
            self._watchdog.stop()  # fit ended (or raised): a peer's later failure must not end this process
        self.clear_context()
        if self._pipelined() and self._lightning_module is not None:
            trainer = getattr(self._lightning_module, "_trainer", None)
            if trainer is not None:
                trainer.fit_loop._skip_backward = False
        if self._parallel is not None:
            self._parallel.zero.remove()  # stage 0-2 hooks off; the next setup re-attaches them
            if self._parallel.activations is not None:
                self._parallel.activations.close()  # its files removed; the next setup attaches a new one
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
