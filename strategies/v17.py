"""V17Strategy: every parallelism axis for any LightningModule, a thin Lightning adapter over ``lightning_v17.engine``.

Options are parsed once (``_options.py``); plans are resolved from the options, the LightningModule's hooks or the
model's own; one engine call, :func:`lightning_v17.engine.parallelize.parallelize`, transforms the model. The
pipeline, precision and checkpoint glue live in ``_pipeline.py``, ``_precision.py`` and ``_checkpoint.py``.
"""

from __future__ import annotations

import itertools
from collections.abc import Generator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import (
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _set_num_threads_if_needed,
)
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from lightning_v17.strategies import _checkpoint, _pipeline, _precision
from lightning_v17.strategies._collectives import WorldCollectives
from lightning_v17.strategies._options import build_policy, check_batch_keys
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_v17.config import MeshSpec, OffloadPolicy, PipelinePolicy, V17ConfigError, ZeroPolicy
from lightning_v17.engine import fsdp as fsdp_engine
from lightning_v17.engine import state_dict as state_engine
from lightning_v17.engine.elastic import elastic_attempt, init_elastic_process_group
from lightning_v17.engine.parallelize import Parallelized, check_composition, parallelize
from lightning_v17.engine.watchdog import StepWatchdog
from lightning_v17.engine.zero_backend import ZeroBackend
from lightning_v17.mesh import MeshRuntime, UnsetMesh, build_device_mesh

if TYPE_CHECKING:
    import lightning.pytorch as pl

_RUNS = itertools.count()  # one watchdog key space per setup; every rank runs the same sequence of fits


class V17Strategy(WorldCollectives, ParallelStrategy):
    """ZeRO-0/1/2/3 (and HSDP) x TP(+SP) x PP on a 5-axis device mesh, for any LightningModule, on CPU and GPU.

    Options become one :class:`~lightning_v17.config.TrainingPolicy` (``strategy.policy``); after setup
    ``strategy.mesh`` is the live mesh and ``strategy.zero`` the applied ZeRO stage. Plans come from the options
    (``tp_plan``, ``pp_split_points``), else the LightningModule's hooks, else the model's own (README "Your own
    model").

    Args:
        zero_stage: 0 = DDP (all replicated), 1 = optimizer state sharded, 2 = + gradients sharded,
            3 = + parameters sharded (FSDP2 ``fully_shard``). None: the ``config``'s stage, else 3.
        tp: tensor-parallel size (innermost mesh axis).
        pp: pipeline-parallel stages (outermost mesh axis). The schedule then runs the model: ``training_step``/
            ``validation_step``/``test_step`` are not called, ``pipeline_loss(logits, batch)`` is (default: token-mean
            cross-entropy against ``labels``); see ``lightning_v17/strategies/_pipeline.py``. zero_stage 0/1 only.
        dp_replicate: replicated data-parallel groups (HSDP outer axis). With ``dp_shard`` > 1 this is HSDP.
        dp_shard: ranks over which ZeRO partitions; "auto" = world size / (pp * dp_replicate * cp * tp).
        cp: context-parallel size (reserved; must be 1).
        sequence_parallel: with tp > 1, shard norms/dropout along the sequence dim (Korthikanti 2022 §4.2.2).
        vocab_parallel: with tp > 1, shard the input embedding along the vocabulary (Megatron's
            VocabParallelEmbedding); tp must divide the vocabulary size. Shapes the model's own plan only.
        loss_parallel: with tp > 1, keep the output head's logits sharded along the vocabulary and compute the
            cross-entropy on the shards (torch's ``loss_parallel()``; Megatron's vocab-parallel cross entropy): the
            [batch, seq, vocab] logits are never gathered. The strategy runs ``training_step``/``validation_step``/
            ``test_step`` and backward inside that context, so the loss must be ``F.cross_entropy`` on the logits
            (the reference ``LlamaLM``'s is). pp=1 only.
        activation_checkpointing: "none", "selective" (save matmul outputs, recompute the rest) or "full"
            (recompute each block); None: the ``config``'s, else "none". Refused for a model without repeated
            blocks unless ``wrap_classes`` names them.
        tp_plan: explicit tensor-parallel plan ``{fqn: style}``; ``*`` matches one FQN component; styles "colwise",
            "rowwise", "colwise_rep", "rowwise_rep", "sequence_parallel", "replicate". A key matching no module is
            an error. None: the LightningModule's or the model's own plan.
        pp_split_points: FQNs of the blocks that start pipeline stages 2..n (e.g. ``["model.layers.2"]``); None:
            the LightningModule's ``pipeline_split_points()``, else balanced by parameter count.
        pp_schedule: pipeline schedule: "gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv" or "zb_h1"
            (Qi 2023's ZB-H1: one stage per rank with the backward split into input and weight gradients).
        microbatches: pipeline micro-batches per optimizer step; the per-rank batch size must be a multiple of it.
        virtual_stages: model chunks per pipeline rank (interleaved / zero-bubble schedules).
        offload_optimizer: where optimizer state lives: "none", "cpu" or "nvme" (ZeRO-Offload / ZeRO-Infinity, stages
            1-3); None: the ``config``'s, else "none". The optimizer steps chunk by chunk through the tier; with
            "nvme" its state is read ahead and written back asynchronously under ``nvme_path``
            (``lightning_v17/engine/offload.py``). Parameters on an accelerator are refused with "cpu"/"nvme" in this version (the host-side step is not implemented yet).
        offload_params: where sharded parameters live between uses (stage 3; None: the ``config``'s, else "none"):
            "none", "cpu" (FSDP2's ``CPUOffloadPolicy``) or "nvme" (ZeRO-Infinity: each unit's shards are read
            from files under ``nvme_path`` ahead of its all-gather, ``prefetch_units`` units ahead, freed after it, streamed chunk by chunk through
            the optimizer step and written back; ``lightning_v17/engine/param_offload.py``). "nvme" refuses parameters
            on an accelerator and fp8 in this version; code that reads parameters outside forward and the
            step must do it inside ``trainer.strategy.zero.param_offload.resident()``.
        nvme_path: directory for the "nvme" tier: must exist, be writable, and have room for the offloaded state
            plus a margin (checked before step 0); each rank writes in its own run folder, removed at teardown.
        offload_optimizer_ratio: fraction (0, 1] of the optimizer state on the ``offload_optimizer`` tier; the rest
            stays one tier up (nvme -> host memory, cpu -> device memory). DeepSpeed's ``offload_optimizer.ratio``;
            None: the ``config``'s, else 1.
        wrap_classes: class names that become ZeRO-3 units and recompute units (empty: the children of every
            ``nn.ModuleList`` and of repeated-block ``nn.ModuleDict``s).
        reshard_after_forward: stage 3: free gathered parameters after each unit's forward (None: True, except the
            last unit and the root group, which backward needs first).
        bucket_mb: gradient bucket size in MiB for stages 0-2 (DeepSpeed's ``reduce_bucket_size``); None: the
            ``config``'s, else 25.
        overlap_comm: overlap communication with compute where the backend does not already do it (gloo on CPU,
            whose async work runs on its own threads): stages 0-2 start each bucket's reduction as soon as its
            gradients are ready; stage 3 all-gathers the next ``prefetch_units`` units while the current one
            computes and leaves the gradient reduce-scatters in flight until backward ends. Results are bitwise
            the same; False runs every collective synchronously (the A/B baseline). On CUDA, FSDP2's own stream
            overlap is used either way.
        prefetch_units: stage 3: how many units ahead to all-gather, in forward and backward (DeepSpeed's
            ``stage3_prefetch_bucket_size``, counted in units; each one more keeps one more unit gathered). 0: none.
        fp8: float8 matmuls in the repeated blocks' ``nn.Linear`` layers (Micikevicius 2022 "FP8 Formats for Deep
            Learning"): "tensorwise" (one dynamic scale per tensor; torchao ``Float8Linear``), "rowwise" (per-row
            dynamic scales, powers of 2; torchao), "delayed" (scales from an amax history of earlier steps, synced
            over the dp and tp axes; lightning-v17's own, since torchao 0.18 removed it, pytorch/ao#1680) or None
            (off). A Linear is converted when it sits inside a block and both its dims divide 16 (16 x tp under
            tensor parallelism); the others are listed in one warning. Embeddings, the output head and norms stay
            in high precision, and so do the master weights and the optimizer. With tp > 1 "tensorwise"
            (torchao's float8 tensor-parallel styles) or "delayed" (plain styles, tp-synced histories). At
            zero_stage=3 see ``fp8_all_gather``. The DeepSpeed config has no FP8 section.
        fp8_backend: "torchao" (any device, CPU included), "te" (NVIDIA Transformer Engine: a GPU of compute
            capability >= 8.9 with transformer-engine installed; its path is not implemented yet, so it raises a
            clear error) or "auto" (torchao in this version; Transformer Engine where it can run once that path
            exists).
        fp8_skip: ``fnmatch`` patterns of module FQNs kept in high precision too (a pattern matching a block keeps
            all its Linears), e.g. ``["*.w2", "model.layers.0"]``; a pattern matching no module is an error.
        fp8_all_gather: zero_stage=3 all-gathers the converted weights in float8 (torchao's
            ``enable_fsdp_float8_all_gather``: a quarter of the fp32 bytes; on gloo the bytes travel as uint8), with
            their scales computed after each optimizer step in one all-reduce. None (default): on for
            ``fp8="tensorwise"`` at zero_stage=3, off otherwise; True with ``fp8="rowwise"`` or below zero_stage=3
            is refused; False gathers them in their own dtype.
        fp8_amax_history_len: ``fp8="delayed"`` only: how many steps of amax (max |x|) history each float8 scale
            is computed from (scale = float8 max / max of the history). None: 16. The histories are all-reduced
            with MAX over the dp and tp axes after each optimizer step and are saved in checkpoints.
        optimizer_partition: stages 1-2: "rows" splits every parameter's optimizer state along dim 0 (exact for
            elementwise optimizers such as SGD/Adam/AdamW), "params" gives each rank whole parameters (exact for any
            per-parameter optimizer such as Adafactor), "auto" picks "rows" when every optimizer is an elementwise
            ``torch.optim`` class, else "params". Stage 3: "params" steps every optimizer's parameters whole on
            owner ranks, "rows" none, "auto" those that need whole parameters or cannot step DTensors.
        zero: the ZeRO options as one :class:`~lightning_v17.config.ZeroPolicy` (Python users); not together with
            the flat ZeRO arguments above.
        pipeline: the pipeline options as one :class:`~lightning_v17.config.PipelinePolicy`.
        offload: the offload options as one :class:`~lightning_v17.config.OffloadPolicy`.
        config: a DeepSpeed JSON config (dict or path), see :func:`lightning_v17.deepspeed_config.from_deepspeed_config`.
            Precedence is given > config > default: an argument that is given (not None) wins over the config even
            when it equals the default, and the config wins over the defaults. ``bf16``/``fp16`` apply only when
            the Trainer runs at its default ``precision="32-true"``; ``gradient_clipping`` /
            ``gradient_accumulation_steps`` when the Trainer's ``gradient_clip_val`` is None /
            ``accumulate_grad_batches`` is 1.
        accelerator: Lightning accelerator (normally set by the Trainer).
        parallel_devices: devices of this node (normally set by the Trainer).
        cluster_environment: Lightning cluster environment (torchrun/SLURM/...; normally set by the Trainer).
        checkpoint_io: unused for sharded checkpoints (kept for Lightning API compatibility).
        precision_plugin: Lightning precision plugin (normally set by the Trainer from ``precision=``).
        process_group_backend: "gloo" or "nccl"; None picks from the device.
        timeout: collective timeout (``init_process_group(timeout=)``; torch's default is 30 minutes).
        hang_timeout: seconds a rank may go without progress (no training/validation step, backward or optimizer step
            starting or ending) before the watchdog ends it with exit code 3, printing which rank waits in which
            collective at which step and which ranks are not inside a collective (the likely culprits), and
            dumping the Flight Recorder trace where torch keeps one (NCCL); an elastic launcher then restarts the
            group. Set it above the longest step, validation or checkpoint save. None: off (then only
            ``timeout`` ends a hung collective). Independently of it, a rank that raises during a step ends its
            peers within about a second with its error (``lightning_v17/engine/watchdog.py``).
    """

    strategy_name = "v17"

    def __init__(
        self,
        zero_stage: int | None = None,
        tp: int = 1,
        pp: int = 1,
        dp_replicate: int = 1,
        dp_shard: int | str = "auto",
        cp: int = 1,
        sequence_parallel: bool = False,
        vocab_parallel: bool = False,
        loss_parallel: bool = False,
        activation_checkpointing: str | None = None,
        tp_plan: dict[str, str] | None = None,
        pp_split_points: Sequence[str] | None = None,
        pp_schedule: str = "1f1b",
        microbatches: int = 4,
        virtual_stages: int = 1,
        offload_optimizer: str | None = None,
        offload_params: str | None = None,
        nvme_path: str | None = None,
        offload_optimizer_ratio: float | None = None,
        wrap_classes: Sequence[str] = (),
        reshard_after_forward: bool | None = None,
        bucket_mb: float | None = None,
        overlap_comm: bool = True,
        prefetch_units: int = 1,
        optimizer_partition: str = "auto",
        fp8: str | None = None,
        fp8_backend: str = "auto",
        fp8_skip: Sequence[str] = (),
        fp8_all_gather: bool | None = None,
        fp8_amax_history_len: int | None = None,
        zero: ZeroPolicy | None = None,
        pipeline: PipelinePolicy | None = None,
        offload: OffloadPolicy | None = None,
        config: str | Path | dict | None = None,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        hang_timeout: float | None = None,
    ) -> None:
        super().__init__(accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin)
        self.policy = build_policy(dict(locals()))
        # Validate the fixed axis sizes and the combinations now (a typo fails at construction, not after launch).
        MeshSpec(pp=pp, dp_replicate=dp_replicate, cp=cp, tp=tp)
        check_composition(self.policy, pp=pp, tp=tp)  # every rule of config_rules, once
        if not (dp_shard in ("auto", -1) or (isinstance(dp_shard, int) and dp_shard >= 1)):
            raise V17ConfigError(f"dp_shard={dp_shard!r} must be a positive integer or 'auto'")
        self._axes = {"pp": pp, "dp_replicate": dp_replicate, "dp_shard": dp_shard, "cp": cp, "tp": tp}
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        if hang_timeout is not None and not hang_timeout > 0:
            raise V17ConfigError(f"hang_timeout={hang_timeout!r} must be a positive number of seconds, or None (off)")
        self._hang_timeout = hang_timeout
        self._watchdog: StepWatchdog | None = None
        self._mesh: MeshRuntime | UnsetMesh = UnsetMesh()
        self._parallel: Parallelized | None = None
        self._batch_checked = False
        self.num_nodes = 1

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register("v17", cls, description="V17 ZeRO-3 (FSDP2) on a device mesh", zero_stage=3)
        for stage in (1, 2, 3):
            strategy_registry.register(
                f"v17_zero{stage}", cls, description=f"V17 ZeRO stage {stage} on a device mesh", zero_stage=stage,
            )  # fmt: skip
        strategy_registry.register(
            "v17_zero3_offload", cls, zero_stage=3, offload_params="cpu",
            description="V17 ZeRO-3 with parameters, gradients and the optimizer step on the CPU (FSDP2 CPUOffloadPolicy)",
        )  # fmt: skip

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
    def parallel(self) -> Parallelized | None:
        """What ``parallelize`` did to the model (None before ``setup``)."""
        return self._parallel

    @property
    def zero(self) -> ZeroBackend:
        """The applied ZeRO stage: ask it what is sharded, how to sync, how to save the optimizer."""
        if self._parallel is None:
            raise RuntimeError("strategy.zero exists after Trainer setup has parallelized the model")
        return self._parallel.zero

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
        # As Lightning's launchers do: one share of the cores per local rank unless OMP_NUM_THREADS is set.
        _set_num_threads_if_needed(num_processes=self.num_processes)
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._process_group_backend or _get_default_process_group_backend_for_device(
            self.root_device
        )
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        if elastic_attempt() is not None and not torch.distributed.is_initialized():
            # torchrun: every restart attempt shares the agent's store; keep each attempt's keys apart
            init_elastic_process_group(
                self._process_group_backend, rank=self.global_rank, world_size=self.world_size, **kwargs
            )
        else:
            _init_dist_connection(self.cluster_environment, self._process_group_backend, **kwargs)
        # Under torchrun the default store is already this round's own (v17/gen-<token>, engine/elastic.py); the
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
        return MeshSpec.resolve(world_size, **self._axes)

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
        if self.mesh.spec.pp > 1:
            _pipeline.check_pipeline_trainer(self, trainer)
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
            self.zero.prepare_optimizers(self.optimizers, offload=self.policy.offload)
            if self._pipelined():
                # The schedule runs forward *and* backward inside training_step. Lightning's closure would then zero
                # the gradients and back-propagate again; its skip-backward flag drops both (the mechanism
                # StochasticWeightAveraging uses; NeMo's MegatronStrategy does the same).
                trainer.fit_loop._skip_backward = True
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        self._reset_optimizers_and_schedulers()  # re-setup after validate: old param references are stale
        super().setup_optimizers(trainer)

    @override
    def _setup_model(self, model: Module) -> Module:
        """Resolve the plans, then one engine call (``parallelize``); idempotent across fit/validate/test."""
        spec, policy = self.mesh.spec, self.policy
        tp_plan = layout = loss_fn = None
        if getattr(model, "_v17_parallel", None) is None:
            if spec.tp > 1:
                from lightning_v17.models.tp_plans import resolve_tp_plan

                tp_plan = resolve_tp_plan(
                    model, explicit=policy.tp_plan, sequence_parallel=policy.sequence_parallel,
                    vocab_parallel=policy.vocab_parallel, loss_parallel=policy.loss_parallel,
                )  # fmt: skip
            if spec.pp > 1:
                pipeline, layout, loss_fn = _pipeline.pipeline_options(model, policy.pipeline)
                policy = replace(policy, pipeline=pipeline)
        param_dtype, reduce_dtype = _precision.mixed_precision_dtypes(self.precision_plugin)
        self._parallel = parallelize(
            model, mesh=self.mesh, policy=policy, device=self.root_device, tp_plan=tp_plan, pp_layout=layout,
            loss_fn=loss_fn, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
            steps_inside_forward=not getattr(model, "automatic_optimization", True),
        )  # fmt: skip
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
        are ever allocated, and refuses loads there (:func:`lightning_v17.engine.fsdp.deferred_init`)."""
        with fsdp_engine.deferred_init() if self.policy.zero.meta_init else nullcontext():
            yield

    # ------------------------------------------------------------------ step
    def _pipelined(self) -> bool:
        return self._parallel is not None and self._parallel.pipeline is not None

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if not self._batch_checked and (self.policy.micro_batch_size or self.policy.train_batch_size):
            trainer = self.lightning_module.trainer  # DeepSpeed's batch keys against the real batch, once
            rows = _pipeline.rows(args[0] if args else kwargs["batch"])
            check_batch_keys(self.policy, rows=rows, accumulate=trainer.accumulate_grad_batches, dp=self.mesh.spec.dp)
            self._batch_checked = True
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
            raise V17ConfigError(
                f"predict with pp={self.mesh.spec.pp} is not supported (only the last stage would hold the outputs); "
                "predict with pp=1 (a pp checkpoint loads at pp=1)"
            )
        return self._step("predict_step", self.precision_plugin.predict_step_context, args, kwargs)

    def _step(self, hook: str, step_context: Any, args: tuple, kwargs: dict) -> Any:
        """Lightning's dispatch of a step hook (``Strategy.training_step`` and its siblings). At stage 3 the hook runs
        as the FSDP2 root's forward (:func:`lightning_v17.engine.fsdp.run_as_forward`): Lightning calls it directly,
        never the module's ``forward``, so the root's own hooks (its all-gather, its reduce-scatter after backward)
        would not run; under manual optimization optimizers may step inside it
        (:func:`~lightning_v17.engine.fsdp.optimizer_steps_inside`)."""
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
            return super().backward(closure_loss, optimizer, *args, **kwargs)

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
        """torch's ``loss_parallel()`` when ``loss_parallel=True`` (the loss and its backward must both run inside)."""
        from lightning_v17.engine.tensor_parallel import loss_parallel_context

        return loss_parallel_context(self.policy.loss_parallel)

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        with self._watch("optimizer_step"):
            out = super().optimizer_step(optimizer, closure, model, **kwargs)
            self.zero.after_optimizer_step(optimizer)  # stages 1/2: make this optimizer's parameters whole again
            if self._parallel is not None and self._parallel.fp8 is not None:
                self._parallel.fp8.after_optimizer_step()  # float8 scales: all-gathered weights', delayed histories
        return out

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Gradient accumulation: no communication on non-final micro-steps (DDP's ``no_sync``)."""
        with self.zero.no_sync() if self._parallel is not None else nullcontext():
            yield None

    # ------------------------------------------------------------------ checkpoints (sharded, DCP)
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """FQN-keyed model state: full plain tensors (stages 0-2) or DTensor shards (stage 3), for DCP."""
        return state_engine.get_model_state(self.model)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # load_checkpoint already loaded the sharded states in place

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """FQN-keyed optimizer state with DTensor shards (stages 1-3) or full tensors (stage 0)."""
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        return self.zero.optimizer_state_dict(optimizer)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # load_checkpoint already loaded the sharded states in place

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        """Write a sharded checkpoint directory (every rank writes its shards; see engine/checkpoint.py)."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint(storage_options=...) is not supported")
        _checkpoint.save(self, checkpoint, filepath)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a sharded checkpoint into the sharded model/optimizers in place (any saved stage or world size)."""
        out = _checkpoint.load(self, checkpoint_path, weights_only=weights_only)
        if self._parallel is not None and self._parallel.fp8 is not None:
            self._parallel.fp8.refresh_weight_scales()  # the loaded weights' float8 scales (none may be stale)
        return out

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        if self.is_global_zero:
            _checkpoint.remove(filepath)

    @override
    def teardown(self) -> None:
        if self._watchdog is not None:
            self._watchdog.stop()  # fit ended (or raised): a peer's later failure must not end this process
        if self._pipelined() and self._lightning_module is not None:
            trainer = getattr(self._lightning_module, "_trainer", None)
            if trainer is not None:
                trainer.fit_loop._skip_backward = False
        if self._parallel is not None:
            self._parallel.zero.remove()  # stage 0-2 hooks off; the next setup re-attaches them
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
