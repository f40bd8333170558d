"""V17Strategy: ZeRO-0/1/2/3 on an N-dimensional device mesh, as a thin Lightning adapter over ``lightning_v17.engine``.

Works with ``accelerator="cpu"`` (gloo) and ``"gpu"`` (NCCL), unlike Lightning's ``FSDPStrategy`` /
``DeepSpeedStrategy`` which refuse CPU. Model setup order (torchtitan's): pipeline split -> tensor parallel ->
activation checkpointing -> ZeRO.
"""

from __future__ import annotations

import importlib
import shutil
from collections.abc import Generator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _set_num_threads_if_needed,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import _PATH, ReduceOp
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_v17.config import (
    MeshSpec,
    OffloadPolicy,
    PipelinePolicy,
    Recompute,
    Tier,
    TrainingPolicy,
    V17ConfigError,
    ZeroPolicy,
    from_deepspeed_config,
)
from lightning_v17.config import (
    Precision as V17Precision,
)
from lightning_v17.engine import fsdp as fsdp_engine
from lightning_v17.engine import state_dict as state_engine
from lightning_v17.engine import zero as zero_engine
from lightning_v17.engine.clip import clip_grad_norm_
from lightning_v17.engine.recompute import apply_activation_checkpointing
from lightning_v17.mesh import MeshRuntime, UnsetMesh, build_device_mesh

if TYPE_CHECKING:
    import lightning.pytorch as pl

# Constructor defaults of the options a DeepSpeed config can also set: an argument left at its default yields to it.
_DEFAULTS = {
    "zero_stage": 3, "activation_checkpointing": "none", "reshard_after_forward": None, "bucket_mb": 25.0,
    "offload_optimizer": "none", "offload_params": "none",
}  # fmt: skip


def _optional_engine(module: str, attr: str, *, option: str) -> Any:
    """Import ``lightning_v17.engine.<module>.<attr>`` or explain which option needs it."""
    try:
        return getattr(importlib.import_module(f"lightning_v17.engine.{module}"), attr)
    except (ImportError, AttributeError) as err:
        raise V17ConfigError(
            f"{option} needs lightning_v17.engine.{module}.{attr}, which is not available in this installation "
            f"({err}); set {option.split('>')[0]}=1"
        ) from err


class V17Strategy(ParallelStrategy):
    """ZeRO data parallelism (stages 0-3, HSDP) on a 5-axis device mesh, for CPU (gloo) and GPU (NCCL).

    Strings are parsed once, here, into :class:`lightning_v17.config.TrainingPolicy`; after ``setup_environment``
    ``strategy.mesh`` is the live :class:`~lightning_v17.mesh.MeshRuntime` and ``strategy.policy`` the policy.

    Args:
        zero_stage: 0 = DDP (all replicated), 1 = optimizer state sharded, 2 = + gradients sharded,
            3 = + parameters sharded (FSDP2 ``fully_shard``).
        tp: tensor-parallel size (innermost mesh axis); needs ``lightning_v17.engine.tensor_parallel``.
        pp: pipeline-parallel stages (outermost mesh axis); needs ``lightning_v17.engine.pipeline``. With pp > 1 the
            schedule runs forward and backward inside ``training_step`` (the LightningModule's ``training_step`` /
            ``validation_step`` are not called; the strategy logs ``train_loss``, ``val_loss``,
            ``pipeline/bubble_fraction`` and ``pipeline/bubble_planned``), batches must be packed dicts, automatic
            optimization is required and only zero_stage 0/1 compose with it (seed §17.5). The hooks
            ``on_before_zero_grad`` and ``on_after_backward`` (once per step, gradients in place) still fire;
            ``on_before_backward`` does not (forward and backward interleave per micro-batch).
        dp_replicate: replicated data-parallel groups (HSDP outer axis). With ``dp_shard`` > 1 this is HSDP.
        dp_shard: ranks over which ZeRO partitions; "auto" = world size / (pp * dp_replicate * cp * tp).
        cp: context-parallel size (reserved; must be 1).
        sequence_parallel: with tp > 1, shard norms/dropout along the sequence dim (Korthikanti 2022 §4.2.2).
        activation_checkpointing: "none", "selective" (save matmul outputs, recompute the rest) or "full"
            (recompute each block).
        pp_schedule: pipeline schedule: "gpipe", "1f1b", "interleaved_1f1b", "zero_bubble" or "zbv".
        microbatches: pipeline micro-batches per optimizer step; the per-rank batch size must be a multiple of it.
        virtual_stages: model chunks per pipeline rank (interleaved / zero-bubble schedules).
        offload_optimizer: where optimizer state lives: "none", "cpu" or "nvme".
        offload_params: where sharded parameters live between uses (stage 3): "none", "cpu" or "nvme".
        nvme_path: directory for the "nvme" tier.
        wrap_classes: class names that become ZeRO-3 units (empty: the children of every ``nn.ModuleList`` and of
            repeated-block ``nn.ModuleDict``s).
        reshard_after_forward: stage 3: free gathered parameters after each unit's forward (None: True).
        bucket_mb: gradient bucket size in MiB for stages 0-2 (DeepSpeed's ``reduce_bucket_size``).
        optimizer_partition: stages 1-2: "rows" splits every parameter's optimizer state along dim 0 (balanced;
            exact for elementwise optimizers such as SGD/Adam/AdamW), "params" gives each rank whole parameters
            (as ``ZeroRedundancyOptimizer``; exact for any per-parameter optimizer such as Adafactor or 8-bit
            Adam), "auto" picks "rows" when every optimizer is an elementwise ``torch.optim`` class, else "params".
        config: a DeepSpeed JSON config (dict or path), see :func:`lightning_v17.config.from_deepspeed_config`.
            Precedence: a constructor argument that differs from its default wins over the config; the config wins
            over defaults. ``bf16``/``fp16`` apply only when the Trainer runs at its default ``precision="32-true"``
            (fp16 builds Lightning's ``MixedPrecision("16-mixed")`` with a GradScaler from ``initial_scale_power``/
            ``loss_scale_window``; ``hysteresis``/``min_loss_scale`` are kept in ``policy.loss_scale`` for the
            ``DynamicLossScaling`` callback). ``gradient_clipping`` / ``gradient_accumulation_steps`` apply when the
            Trainer's ``gradient_clip_val`` is None / ``accumulate_grad_batches`` is 1.
        accelerator: Lightning accelerator (normally set by the Trainer).
        parallel_devices: devices of this node (normally set by the Trainer).
        cluster_environment: Lightning cluster environment (torchrun/SLURM/...; normally set by the Trainer).
        checkpoint_io: unused for sharded checkpoints (kept for Lightning API compatibility).
        precision_plugin: Lightning precision plugin (normally set by the Trainer from ``precision=``).
        process_group_backend: "gloo" or "nccl"; None picks from the device.
        timeout: collective timeout.
    """

    strategy_name = "v17"

    def __init__(
        self,
        zero_stage: int = 3,
        tp: int = 1,
        pp: int = 1,
        dp_replicate: int = 1,
        dp_shard: int | str = "auto",
        cp: int = 1,
        sequence_parallel: bool = False,
        activation_checkpointing: str = "none",
        pp_schedule: str = "1f1b",
        microbatches: int = 4,
        virtual_stages: int = 1,
        offload_optimizer: str = "none",
        offload_params: str = "none",
        nvme_path: str | None = None,
        wrap_classes: Sequence[str] = (),
        reshard_after_forward: bool | None = None,
        bucket_mb: float = 25.0,
        optimizer_partition: str = "auto",
        config: str | Path | dict | None = None,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        base = from_deepspeed_config(config) if config is not None else TrainingPolicy()

        def pick(name: str, value: Any, from_config: Any) -> Any:
            return value if value != _DEFAULTS[name] or config is None else from_config

        self.policy = TrainingPolicy(
            zero=ZeroPolicy(
                stage=pick("zero_stage", zero_stage, base.zero.stage),
                reshard_after_forward=pick("reshard_after_forward", reshard_after_forward,
                                           base.zero.reshard_after_forward),
                wrap_classes=tuple(wrap_classes) or base.zero.wrap_classes,
                bucket_mb=pick("bucket_mb", bucket_mb, base.zero.bucket_mb),
                optimizer_partition=optimizer_partition,
            ),
            offload=OffloadPolicy(
                optimizer=pick("offload_optimizer", offload_optimizer, base.offload.optimizer),
                params=pick("offload_params", offload_params, base.offload.params),
                nvme_path=nvme_path or base.offload.nvme_path,
            ),
            pipeline=PipelinePolicy(schedule=pp_schedule, microbatches=microbatches, virtual_stages=virtual_stages),
            recompute=Recompute.parse(pick("activation_checkpointing", activation_checkpointing, base.recompute)),
            sequence_parallel=bool(sequence_parallel),
            loss_scale=base.loss_scale,
            gradient_clipping=base.gradient_clipping,
            gradient_accumulation_steps=base.gradient_accumulation_steps,
            micro_batch_size=base.micro_batch_size,
            precision=base.precision,
        )  # fmt: skip
        if self.policy.offload.optimizer != Tier.NONE:
            raise V17ConfigError(
                f"offload_optimizer={self.policy.offload.optimizer.value!r} is not implemented by V17Strategy yet; "
                "set offload_optimizer='none'"
            )
        if self.policy.offload.params == Tier.NVME:
            raise V17ConfigError("offload_params='nvme' is not implemented yet; use 'cpu' (stage 3) or 'none'")
        if self.policy.offload.params == Tier.CPU and self.policy.zero.stage != 3:
            raise V17ConfigError("offload_params='cpu' shards parameters to CPU and needs zero_stage=3")
        # Validate the fixed axis sizes now (a typo fails at construction, not after the processes started).
        MeshSpec(pp=pp, dp_replicate=dp_replicate, cp=cp, tp=tp)
        if pp > 1:  # seed §17.5: PP composes with ZeRO-0/1 only (the engine explains why)
            from lightning_v17.engine.pipeline import check_pipeline_composition

            check_pipeline_composition(pp=pp, zero_stage=self.policy.zero.stage)
        if not (dp_shard in ("auto", -1) or (isinstance(dp_shard, int) and dp_shard >= 1)):
            raise V17ConfigError(f"dp_shard={dp_shard!r} must be a positive integer or 'auto'")
        self._axes = {"pp": pp, "dp_replicate": dp_replicate, "dp_shard": dp_shard, "cp": cp, "tp": tp}
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._mesh: MeshRuntime | UnsetMesh = UnsetMesh()
        self._engine: zero_engine.ZeroEngine | None = None
        self._pipeline: Any = None  # set by the pipeline engine when pp > 1 (it runs forward and backward itself)
        self.num_nodes = 1

    # ------------------------------------------------------------------ registry
    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register("v17", cls, description="V17 ZeRO-3 (FSDP2) on a device mesh", zero_stage=3)
        for stage in (1, 2, 3):
            strategy_registry.register(
                f"v17_zero{stage}", cls, description=f"V17 ZeRO stage {stage} on a device mesh", zero_stage=stage
            )

    # ------------------------------------------------------------------ properties
    @property
    def zero_stage(self) -> int:
        return self.policy.zero.stage

    @property
    def mesh(self) -> MeshRuntime:
        """The live mesh. Reading it before ``setup_environment`` raises (see :class:`~lightning_v17.mesh.UnsetMesh`)."""
        if isinstance(self._mesh, UnsetMesh):
            _ = self._mesh.spec  # raises the explanatory error
        return self._mesh  # type: ignore[return-value]

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        """Lightning asks this of custom strategies to decide on a DistributedSampler (it knows only its own)."""
        return True

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        dp = self.mesh["dp"]
        return {"num_replicas": dp.size(), "rank": dp.get_local_rank()}

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # sharded states load into the already sharded model and optimizers

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint restores the optimizers itself

    # ------------------------------------------------------------------ launch and environment
    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        # As Lightning's launchers do: one share of the cores per local rank unless OMP_NUM_THREADS is set, so that
        # externally launched CPU ranks do not oversubscribe the machine.
        _set_num_threads_if_needed(num_processes=self.num_processes)
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._process_group_backend or _get_default_process_group_backend_for_device(
            self.root_device
        )
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        _init_dist_connection(self.cluster_environment, self._process_group_backend, **kwargs)
        spec = self.resolve_mesh(self.world_size)
        self._mesh = MeshRuntime(spec, build_device_mesh(spec, device_type=self.root_device.type))
        self._apply_config_precision()
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._mesh.device_mesh  # as ModelParallelStrategy: visible to the module

    def resolve_mesh(self, world_size: int) -> MeshSpec:
        """The mesh sizes for ``world_size`` ranks (``dp_shard="auto"`` resolved); raises a clear error on mismatch."""
        return MeshSpec.resolve(world_size, **self._axes)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    def _apply_config_precision(self) -> None:
        """A DeepSpeed config's bf16/fp16 block applies only if the Trainer was left at the default 32-true."""
        want = self.policy.precision
        if want is None or type(self.precision_plugin) is not Precision:
            return
        if want in (V17Precision.BF16_MIXED, V17Precision.FP16_MIXED):
            scaler = None
            if want == V17Precision.FP16_MIXED:
                ls = self.policy.loss_scale
                scaler = torch.amp.GradScaler(
                    self.root_device.type,
                    **({} if ls is None else {"init_scale": ls.init_scale, "growth_interval": ls.growth_interval,
                                              "backoff_factor": ls.backoff_factor, "growth_factor": ls.growth_factor}),
                )  # fmt: skip
            self.precision_plugin = MixedPrecision(want.value, device=self.root_device.type, scaler=scaler)

    # ------------------------------------------------------------------ model setup
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        if self.mesh.spec.pp > 1:
            self._check_pipeline_trainer(trainer)
        if self.policy.gradient_clipping is not None and trainer.gradient_clip_val is None:
            trainer.gradient_clip_val = self.policy.gradient_clipping
        if self.policy.gradient_accumulation_steps and trainer.accumulate_grad_batches == 1:
            trainer.accumulate_grad_batches = self.policy.gradient_accumulation_steps
        self.model = self.precision_plugin.convert_module(self.model)
        if not fsdp_engine.has_meta(self.model):
            self.model_to_device()
        self.model = self._setup_model(self.model)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            if self._engine is not None:
                self._engine.choose_partition(self.optimizers)
                for opt in self.optimizers:
                    self._engine.shard_optimizer(opt)
            if self._pipeline is not None:
                # The schedule runs forward *and* backward inside training_step. Lightning's closure would then zero
                # the gradients (between training_step and backward) and back-propagate again; its skip-backward flag
                # drops both (the mechanism StochasticWeightAveraging uses; NeMo's MegatronStrategy does the same).
                # training_step zeroes the gradients itself, before the schedule runs.
                trainer.fit_loop._skip_backward = True
        self.setup_precision_plugin()
        self._patch_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        self._reset_optimizers_and_schedulers()  # re-setup after validate: old param references are stale
        super().setup_optimizers(trainer)

    @override
    def _setup_model(self, model: Module) -> Module:
        """PP split -> TP -> activation checkpointing -> ZeRO (torchtitan's order). Idempotent across fit/validate."""
        if getattr(model, "_v17_setup_done", False):
            return model
        spec = self.mesh.spec
        # The structural transforms run once per model: after fit's teardown only the ZeRO-0/2 hooks are removed, so a
        # following validate/test re-applies ZeRO below but must not split or parallelize the model a second time.
        if not getattr(model, "_v17_parallelized", False):
            self.validate_model(model, spec)
            if spec.pp > 1:  # slot 1: cut the model into this rank's stages; the schedule runs forward+backward
                self._pipeline = self._apply_pipeline(model)
            if spec.tp > 1:  # slot 2: DTensor colwise/rowwise plans over the "tp" axis
                apply_tp = _optional_engine("tensor_parallel", "apply_tensor_parallel", option="tp>1")
                apply_tp(model, tp_mesh=self.mesh["tp"], sequence_parallel=self.policy.sequence_parallel)
            apply_activation_checkpointing(model, mode=self.policy.recompute, units=self._units(model))
            model._v17_parallelized = True
        param_dtype, reduce_dtype = self._mixed_precision_dtypes()
        self._engine = zero_engine.apply_zero(
            model,
            stage=self.zero_stage,
            mesh=self.mesh.device_mesh,
            bucket_mb=self.policy.zero.bucket_mb,
            optimizer_partition=self.policy.zero.optimizer_partition,
            reshard_after_forward=self.policy.zero.reshard_after_forward,
            wrap_classes=self.policy.zero.wrap_classes,
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
            offload_params=self.policy.offload.params == Tier.CPU,
        )
        if self.zero_stage == 3:
            fsdp_engine.materialize_meta_module(model, device=self.root_device)
        else:
            if fsdp_engine.has_meta(model):
                fsdp_engine.materialize_meta_module(model, device=self.root_device)
            zero_engine.broadcast_module(model, group=self.mesh.group("dp"))  # DDP: replicas start identical
        model._v17_setup_done = True
        return model

    def validate_model(self, model: Module, spec: MeshSpec) -> None:
        """Check that ``model`` fits the mesh ``spec`` before anything is split or sharded (same errors on every rank).

        tp must divide the attention heads, key/value heads and FFN width of every Llama-shaped submodule (the error
        lists the valid tp values); pp * virtual_stages must not exceed the number of blocks. Models with their own
        ``configure_tensor_parallel`` / ``tp_plan`` are checked by their plan instead.

        Raises:
            V17ConfigError: naming the option and the valid values.
        """
        if (
            spec.tp > 1
            and not callable(getattr(model, "configure_tensor_parallel", None))
            and not getattr(model, "tp_plan", None)
        ):
            tp_engine = importlib.import_module("lightning_v17.engine.tensor_parallel")
            for _, llama in tp_engine.find_llama_modules(model):
                tp_engine.check_tensor_parallel(llama, tp=spec.tp)
        if spec.pp > 1:
            pipeline = importlib.import_module("lightning_v17.engine.pipeline")
            target = getattr(model, "model", None) or model
            if isinstance(getattr(target, "layers", None), torch.nn.ModuleDict):
                stages = spec.pp * self.policy.pipeline.virtual_stages
                if stages > len(target.layers):
                    raise V17ConfigError(
                        f"pp={spec.pp} x virtual_stages={self.policy.pipeline.virtual_stages} = {stages} pipeline "
                        f"stages but the model has {len(target.layers)} blocks; every stage needs at least one block: "
                        "lower pp or virtual_stages"
                    )
            pipeline.check_pipeline_composition(pp=spec.pp, zero_stage=self.zero_stage)

    def _apply_pipeline(self, model: Module) -> Any:
        """Split the LightningModule's Llama-shaped ``model`` attribute (or the module itself) into this rank's
        pipeline stages and build the schedule (``lightning_v17.engine.pipeline``)."""
        pipeline = importlib.import_module("lightning_v17.engine.pipeline")
        pipeline.check_pipeline_composition(pp=self.mesh.spec.pp, zero_stage=self.zero_stage)
        target = getattr(model, "model", None) or model
        views, ids = pipeline.split_model(
            target, pp_rank=self.mesh.rank("pp"), pp=self.mesh.spec.pp, policy=self.policy.pipeline
        )
        return pipeline.build_schedule(
            views, stage_ids=ids, pp_mesh=self.mesh["pp"], policy=self.policy.pipeline, device=self.root_device
        )

    def _units(self, model: Module) -> list[Module]:
        return fsdp_engine.find_wrap_units(model, self.policy.zero.wrap_classes)

    def _mixed_precision_dtypes(self) -> tuple[torch.dtype | None, torch.dtype | None]:
        """(param_dtype, reduce_dtype) for FSDP2's MixedPrecisionPolicy (stage 3) and the stage 0-2 reductions.

        "bf16-mixed"/"16-mixed": compute in bf16/fp16, reduce gradients in fp32, the sharded fp32 parameter is the
        master. Stages 0-2 keep fp32 parameters and rely on Lightning's autocast (the precision plugin), so their
        gradients are fp32 already. "bf16-true": the plugin converts the module; nothing to add.
        """
        p = getattr(self.precision_plugin, "precision", "32-true")
        if p == "bf16-mixed":
            return torch.bfloat16, torch.float32
        if p == "16-mixed":
            return torch.float16, torch.float32
        return None, None

    def _patch_precision_plugin(self) -> None:
        """Route Lightning's clipping and fp16 inf checks through sharding-aware code.

        * ``Precision.clip_grad_by_norm`` runs ``torch.nn.utils.clip_grad_norm_`` over the optimizer's parameters,
          which under ZeRO are this rank's shards: a per-shard norm (the classic bug). We replace it on this plugin
          instance with :func:`lightning_v17.engine.clip.clip_grad_norm_` (one all-reduce of the squared norm).
        * ``MixedPrecision``'s ``GradScaler`` checks for inf/nan only in this rank's gradients, so with sharded
          gradients ranks could disagree on skipping a step and diverge silently. We swap in FSDP's
          ``ShardedGradScaler`` (same scale settings), which all-reduces ``found_inf`` over the world.
        """
        plugin = self.precision_plugin
        plugin.clip_grad_by_norm = self._clip_grad_by_norm  # type: ignore[method-assign]
        scaler = getattr(plugin, "scaler", None)
        if scaler is not None and _distributed_is_initialized():
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            if not isinstance(scaler, ShardedGradScaler):
                plugin.scaler = ShardedGradScaler(
                    device=self.root_device.type,
                    init_scale=scaler.get_scale() if scaler.is_enabled() else 2.0**16,
                    growth_factor=scaler.get_growth_factor(),
                    backoff_factor=scaler.get_backoff_factor(),
                    growth_interval=scaler.get_growth_interval(),
                    enabled=scaler.is_enabled(),
                )

    def _clip_grad_by_norm(self, optimizer: Optimizer, clip_val: float) -> None:
        params = list(self.precision_plugin.main_params(optimizer))
        tp_sharded = None
        if self.mesh.spec.tp > 1 and self._engine is not None:
            tp_sharded = [self._engine.is_tp_sharded(p) for p in params]
        clip_grad_norm_(
            params,
            clip_val,
            group=self.mesh.group("dp_shard"),
            sharded=self.zero_stage > 0,
            stage_group=self.mesh.group("pp") if self.mesh.spec.pp > 1 else None,
            tp_sharded=tp_sharded,
            tp_group=self.mesh.group("tp") if self.mesh.spec.tp > 1 else None,
        )

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
        """Around ``configure_model``: at zero_stage=3 the model is built on the meta device (deferred init)."""
        with torch.device("meta") if self.zero_stage == 3 else nullcontext():
            yield

    # ------------------------------------------------------------------ step
    def _check_pipeline_trainer(self, trainer: pl.Trainer) -> None:
        """What pp > 1 needs from the Trainer and the LightningModule (the schedule owns forward and backward)."""
        if not self.lightning_module.automatic_optimization:
            raise V17ConfigError(
                f"pp={self.mesh.spec.pp} runs forward and backward inside the pipeline schedule, so manual "
                "optimization (self.automatic_optimization = False) cannot call backward itself; use automatic "
                "optimization with pp>1, or pp=1 for manual optimization"
            )

    def _pipeline_batch(self, args: tuple, kwargs: dict) -> Any:
        batch = args[0] if args else kwargs["batch"]
        if not isinstance(batch, Mapping) or "input_ids" not in batch or "labels" not in batch:
            raise V17ConfigError(
                "pp>1 feeds the batch to the pipeline schedule itself (LightningModule.training_step/validation_step "
                "are not called), so the batch must be a packed dict with 'input_ids' and 'labels' "
                "(lightning_v17.data); got " + type(batch).__name__
            )
        return batch

    def _loss_scale(self) -> Any:
        """The fp16 GradScaler's current scale (initialized on first use), or None without a scaler."""
        scaler = getattr(self.precision_plugin, "scaler", None)
        if scaler is None or not scaler.is_enabled():
            return None
        if scaler._scale is None:  # GradScaler allocates its scale lazily in scale(); the schedule scales instead
            scaler._lazy_init_scale_growth_tracker(self.root_device)
        return scaler._scale.to(device=self.root_device, dtype=torch.float32)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is None:
            return super().training_step(*args, **kwargs)
        from lightning_v17.engine.pipeline import pipeline_step

        module = self.lightning_module
        trainer = module.trainer
        batch = self._pipeline_batch(args, kwargs)
        batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
        # Lightning's own zero_grad is skipped (setup sets fit_loop._skip_backward): zero here, at the first batch of
        # each accumulation window, *before* the schedule accumulates this step's gradients.
        from lightning.pytorch.trainer import call

        if batch_idx % trainer.accumulate_grad_batches == 0:
            for opt in self.optimizers:  # the hook Lightning's skipped zero_grad would have called
                call._call_callback_hooks(trainer, "on_before_zero_grad", opt)
                call._call_lightning_module_hook(trainer, "on_before_zero_grad", opt)
            module.zero_grad(set_to_none=True)
            for opt in self.optimizers:
                opt.zero_grad(set_to_none=True)
        # Lightning back-propagates training_step's loss / accumulate_grad_batches (ClosureResult); the schedule runs
        # the backward here, so it gets that factor (and the fp16 loss scale) as its loss scale. The returned loss is
        # unscaled again, as LightningModule.training_step would return it.
        scale = self._loss_scale()
        if trainer.accumulate_grad_batches > 1:
            scale = (1.0 if scale is None else scale) / trainer.accumulate_grad_batches
        with self.precision_plugin.train_step_context():
            loss = pipeline_step(self._pipeline, batch, grad_sync=self._engine, loss_scale=scale)
        # The schedule interleaves forward and backward per micro-batch, so there is no single moment "before
        # backward" with the loss in hand: on_before_backward is not called. on_after_backward is, once, with this
        # step's gradients accumulated and reduced (what grad-norm logging callbacks read).
        call._call_callback_hooks(trainer, "on_after_backward")
        call._call_lightning_module_hook(trainer, "on_after_backward")
        # LightningModule.training_step is not called under PP (the stages run the model), so log its loss here.
        bsz = batch["input_ids"].shape[0]
        module.log("train_loss", loss, prog_bar=True, batch_size=bsz)
        bubble = self._pipeline.bubble_over_busy
        if bubble is not None:
            module.log("pipeline/bubble_fraction", bubble, batch_size=bsz)
        module.log("pipeline/bubble_planned", self._pipeline.planned_bubble, batch_size=bsz)
        return loss

    def _pipeline_eval_step(self, stage: str, args: tuple, kwargs: dict) -> Tensor:
        from lightning_v17.engine.pipeline import pipeline_eval

        batch = self._pipeline_batch(args, kwargs)
        ctx = {"val": self.precision_plugin.val_step_context, "test": self.precision_plugin.test_step_context}[stage]
        with ctx():
            loss = pipeline_eval(self._pipeline, batch)
        # Same value on every pp (and tp) rank; sync_dist averages the data-parallel replicas.
        self.lightning_module.log(
            f"{stage}_loss", loss, prog_bar=stage == "val", sync_dist=True, batch_size=batch["input_ids"].shape[0]
        )
        return loss

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is None:
            return super().validation_step(*args, **kwargs)
        return self._pipeline_eval_step("val", args, kwargs)  # the schedule's forward-only path

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is None:
            return super().test_step(*args, **kwargs)
        return self._pipeline_eval_step("test", args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is not None:
            raise V17ConfigError(
                f"predict with pp={self.mesh.spec.pp} is not supported (only the last stage would hold the outputs); "
                "predict with pp=1 (a pp checkpoint loads at pp=1)"
            )
        return super().predict_step(*args, **kwargs)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        if self._pipeline is not None:
            return closure_loss.detach()  # the pipeline schedule already ran backward (NeMo's skip-backward)
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._engine is not None:
            self._engine.gather_params()  # stages 1/2: every rank stepped its rows; make the full params whole
        return out

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Gradient accumulation: no communication on non-final micro-steps (DDP's ``no_sync``)."""
        if self._engine is not None:
            self._engine.require_grad_sync = False
            try:
                yield None
            finally:
                self._engine.require_grad_sync = True
        elif self.zero_stage == 3 and self.model is not None:
            fsdp_engine.set_requires_gradient_sync(self.model, False)
            try:
                yield None
            finally:
                fsdp_engine.set_requires_gradient_sync(self.model, True)
        else:
            yield None

    # ------------------------------------------------------------------ collectives
    @override
    def barrier(self, name: str | None = None) -> None:
        if not _distributed_is_initialized():
            return
        if torch.distributed.get_backend() == "nccl":
            torch.distributed.barrier(device_ids=[self.root_device.index])
        else:
            torch.distributed.barrier()

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src, group=_group.WORLD)
        return box[0]

    @override
    def reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # ------------------------------------------------------------------ checkpoints (sharded, DCP)
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """FQN-keyed model state: full plain tensors (stages 0-2) or DTensor shards (stage 3), for DCP."""
        assert self.model is not None
        return state_engine.get_model_state(self.model)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # load_checkpoint already loaded the sharded states in place

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """FQN-keyed optimizer state with DTensor shards (stages 1-3) or full tensors (stage 0)."""
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        assert self.model is not None
        return state_engine.get_optimizer_state(self.model, optimizer, stage=self.zero_stage)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # load_checkpoint already loaded the sharded states in place

    def _meta(self, checkpoint: Mapping[str, Any]) -> dict[str, Any]:
        import lightning

        spec = self.mesh.spec
        return {
            "world_size": self.world_size,
            "mesh": {a: spec.size(a) for a in ("pp", "dp_replicate", "dp_shard", "cp", "tp")},
            "zero_stage": self.zero_stage,
            "step": checkpoint.get("global_step"),
            "epoch": checkpoint.get("epoch"),
            "versions": {"torch": torch.__version__, "lightning": lightning.__version__},
        }

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        """Write a sharded checkpoint directory (every rank writes its shards; see engine/checkpoint.py)."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint(storage_options=...) is not supported")
        from lightning_v17.engine.checkpoint import save_sharded

        path = Path(self.broadcast(filepath))
        app_state: dict[str, Any] = {"model": checkpoint.pop("state_dict")}
        optim_states = checkpoint.pop("optimizer_states", [])
        if optim_states:
            app_state["optim"] = state_engine.merge_optim(optim_states)
        save_sharded(path, app_state=app_state, trainer_state=checkpoint, meta=self._meta(checkpoint))

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a sharded checkpoint into the sharded model/optimizers in place (any saved stage or world size)."""
        from lightning_v17.engine.checkpoint import is_sharded_checkpoint, load_sharded

        path = Path(self.broadcast(checkpoint_path))
        if not is_sharded_checkpoint(path):
            raise V17ConfigError(
                f"ckpt_path={str(path)!r} is not a V17 sharded checkpoint directory; V17Strategy resumes from the "
                "directories it writes (convert a full checkpoint by loading it into the module before fit)"
            )
        assert self.model is not None
        app_state = state_engine.get_state_dicts(self.model, self.optimizers, stage=self.zero_stage)
        own_groups = state_engine.param_group_lists(app_state)
        trainer_state, _meta = load_sharded(path, app_state=app_state)
        # A checkpoint from another pipeline split lists other stages' FQNs in its param groups: keep our own.
        state_engine.restore_param_group_lists(app_state, own_groups)
        state_engine.set_state_dicts(self.model, self.optimizers, app_state, stage=self.zero_stage)
        return trainer_state

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        if self.is_global_zero:
            path = Path(filepath)
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()

    @override
    def teardown(self) -> None:
        if self._pipeline is not None and self._lightning_module is not None:
            trainer = getattr(self._lightning_module, "_trainer", None)
            if trainer is not None:
                trainer.fit_loop._skip_backward = False
        if self._engine is not None:
            self._engine.remove()
            self._engine = None
            if self.model is not None:
                self.model._v17_setup_done = False
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
