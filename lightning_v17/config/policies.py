"""The frozen policies, one per concern: :class:`ZeroPolicy`, :class:`OffloadPolicy`, :class:`PipelinePolicy`,
:class:`LossScalePolicy` and the :class:`TrainingPolicy` that holds them; each option is documented once, on its field."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from lightning_v17.config.enums import CPBalance, CPMode, Dispatcher, HostMemory, Precision, Recompute, Schedule, Tier
from lightning_v17.config.errors import V17ConfigError, parse_enum
from lightning_v17.config.fp8 import FP8Policy
from lightning_v17.config.mesh_spec import _check_positive_int


@dataclass(frozen=True)
class ZeroPolicy:
    """What ZeRO partitions (Rajbhandari 2020 §5; design §3).

    Args:
        stage: 0 = DDP (nothing sharded), 1 = optimizer state, 2 = + gradients, 3 = + parameters (FSDP2).
        reshard_after_forward: stage 3 only. ``True`` frees gathered parameters after each unit's forward (ZeRO-3);
            ``False`` keeps them until backward (more memory, one all-gather less). ``None``: True, except the last
            unit and the root group, which backward needs first; with pp > 1, False (each stage's units stay gathered
            across the step's micro-batches: one all-gather per unit per step, torchtitan's choice under pp).
        wrap_classes: class names that become ZeRO-3 units and recompute blocks. Empty means auto-detect: the
            children of every ``nn.ModuleList`` / repeated-block ``nn.ModuleDict``.
        bucket_mb: gradient bucket size for stage 0-2 reductions, in MiB (DeepSpeed's reduce_bucket_size).
        optimizer_partition: stages 1-2: how the optimizer is split over the dp_shard ranks. "rows": every
            parameter along dim 0 (balanced; exact for elementwise optimizers: SGD/Adam/AdamW/...). "params": whole
            parameters per rank, as ``ZeroRedundancyOptimizer`` (exact for any per-parameter optimizer: Adafactor,
            Muon, 8-bit). "auto": "rows" if every optimizer is an elementwise ``torch.optim`` class, else "params".
            Stage 3: "params" steps every optimizer's parameters whole on owner ranks, "rows" none, "auto" the
            optimizers that need whole parameters or cannot step DTensors (``engine/zero/owner_step.py``).
        overlap_comm: overlap communication with compute where the backend does not already do it (gloo on CPU,
            whose async work runs on its own threads): stages 0-2 start each bucket's reduction as soon as its
            gradients are ready; stage 3 all-gathers the next ``prefetch_units`` units while the current one
            computes and leaves the gradient reduce-scatters in flight until backward ends. Bitwise the same
            results; False runs every collective synchronously (the A/B baseline). On CUDA, FSDP2's own stream
            overlap is used either way.
        prefetch_units: stage 3 with ``overlap_comm``: how many ZeRO-3 units ahead to all-gather, in forward and in
            backward (DeepSpeed's ``stage3_prefetch_bucket_size``, counted in units); 0 turns prefetching off.
        meta_init: stage 3: build ``configure_model`` on the meta device, so that each rank only ever allocates its
            shards (deferred init; needed when the full model does not fit in one rank's memory). Every module
            built there must initialize itself: ``reset_parameters()`` or an ``init_weights()`` on an enclosing
            module (torchtitan's convention). Weights cannot be loaded there: ``load_state_dict`` into the meta
            model is refused (``assign=True`` keeps the loaded tensors), and ``from_pretrained`` refuses the meta
            device itself. False (default): Lightning's semantics, as its FSDP and ModelParallel strategies:
            ``configure_model`` builds real tensors, so ``from_pretrained`` and ``load_state_dict`` work there;
            the model may still build parts on meta itself (``self.trainer.init_module(empty_init=True)``), and only
            what is still on meta at setup is initialized.
    """

    stage: int = 3
    reshard_after_forward: bool | None = None
    wrap_classes: tuple[str, ...] = ()
    bucket_mb: float = 25.0
    optimizer_partition: str = "auto"
    overlap_comm: bool = True
    prefetch_units: int = 1
    meta_init: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.stage, int) or isinstance(self.stage, bool) or self.stage not in (0, 1, 2, 3):
            raise V17ConfigError(
                f"ZeroPolicy(stage={self.stage!r}) (V17Strategy(zero_stage={self.stage!r})) is not a ZeRO stage; "
                "choose 0 (DDP), 1 (optimizer state), 2 (+ gradients) or 3 (+ parameters)"
            )
        if self.bucket_mb <= 0:
            raise V17ConfigError(f"ZeroPolicy(bucket_mb={self.bucket_mb}) must be > 0")
        if not isinstance(self.prefetch_units, int) or isinstance(self.prefetch_units, bool) or self.prefetch_units < 0:
            raise V17ConfigError(
                f"ZeroPolicy(prefetch_units={self.prefetch_units!r}) must be an integer >= 0 (ZeRO-3 units "
                "all-gathered ahead; 0: no prefetch)"
            )
        if self.optimizer_partition not in ("auto", "rows", "params"):
            raise V17ConfigError(
                f"ZeroPolicy(optimizer_partition={self.optimizer_partition!r}); choose 'auto', 'rows' (dim-0 slices, "
                "elementwise optimizers) or 'params' (whole parameters per rank, any per-parameter optimizer)"
            )
        if not isinstance(self.meta_init, bool):
            raise V17ConfigError(f"ZeroPolicy(meta_init={self.meta_init!r}) must be True or False")
        if self.meta_init and self.stage != 3:
            raise V17ConfigError(
                "ZeroPolicy(meta_init=True) builds configure_model on the meta device so that ZeRO-3 allocates only "
                f"each rank's shards; ZeroPolicy(stage={self.stage}) keeps whole parameters on every rank: use "
                "stage=3, or drop meta_init"
            )
        object.__setattr__(self, "wrap_classes", tuple(self.wrap_classes))

    # What the stage partitions over the dp_shard ranks (Rajbhandari 2020 §5.1-§5.3: P_os, P_os+g, P_os+g+p). Every
    # caller asks these instead of comparing the stage; the applied stage (engine/zero/backend.py) answers the same.
    @property
    def shards_optimizer(self) -> bool:
        """Stages 1-3: each rank keeps (and steps) only its partition of the optimizer state (P_os)."""
        return self.stage >= 1

    @property
    def shards_grads(self) -> bool:
        """Stages 2-3: gradients are reduce-scattered, so each rank keeps only its partition of them (P_g); they
        cannot accumulate locally, so every micro-batch reduces its own."""
        return self.stage >= 2

    @property
    def shards_params(self) -> bool:
        """Stage 3: parameters are sharded, so a model may be built on the meta device (deferred init)."""
        return self.stage >= 3


@dataclass(frozen=True)
class OffloadPolicy:
    """Offload tiers (design §4; ZeRO-Offload, ZeRO-Infinity).

    Args:
        optimizer: where optimizer state and the fp32 master live: "none", "cpu" or "nvme".
        params: where sharded parameters live between uses: "none", "cpu" or "nvme".
        nvme_path: directory for the NVMe tier; required when either tier is "nvme".
        optimizer_ratio: fraction (0, 1] of the optimizer state, in bytes at chunk granularity, on the
            ``optimizer`` tier; the rest stays one tier up (nvme -> host memory; cpu -> device memory). DeepSpeed's
            ``offload_optimizer.ratio``; a cpu/nvme split answers DeepSpeed#5508.
        buffer_count: chunk buffers of the nvme optimizer tier (>= 2; DeepSpeed's ``offload_optimizer.buffer_count``):
            one chunk stepping, and ``buffer_count - 1`` chunks of optimizer state read ahead of use or being
            written back (a read refills the buffer of the oldest write-back once it is written). Bound: the tier
            holds at most ``buffer_count x`` the largest chunk's state bytes per rank, i.e. ``buffer_count x
            max(chunk_mb MiB, the largest parameter shard) x`` the optimizer's state bytes per fp32 parameter byte
            (AdamW: 2; each state tensor 64-byte aligned, each chunk a whole 4 KiB page); by default 2 x 4 MiB x 2 =
            16 MiB (a parameter shard larger than ``chunk_mb`` is a chunk of its own and sizes the buffers: an 8 MiB
            shard makes them 2 x 16 MiB). The first step also holds the chunk the optimizer has just created, until
            it is packed into a buffer; a checkpoint save or load holds the whole state for its duration. Speed
            against memory: at 2 a read waits on the I/O thread for the write-back whose buffer it refills, so
            reads and writes take turns; 3 or more let them overlap and read further ahead, one more chunk buffer
            each (a 100M-parameter MLP at ZeRO-3, 2 ranks, fp32 AdamW: the step's I/O wait fell from 0.22-0.45 s to
            0.06-0.29 s a step at 3, for 16 MiB more per rank). With ``params="nvme"`` the step also reads the
            parameters of ``buffer_count - 1`` chunks ahead.
        chunk_mb: MiB of a rank's fp32 parameter elements whose optimizer state steps (and moves) together, the unit
            of the offloaded step: consecutive parameters up to ``chunk_mb`` (a larger parameter alone). Like
            DeepSpeed's ``zero_optimization.sub_group_size``, which counts elements; not mapped from a DeepSpeed
            config, where it also sizes the step without offload. Smaller chunks lower the bound above (down to the
            largest parameter shard) at more reads and writes per step.
        host_memory: how an nvme tier sets glibc's malloc (None: "recycle"; only with an nvme tier). A threshold
            the user fixed in the environment (``MALLOC_MMAP_THRESHOLD_=N`` or ``GLIBC_TUNABLES=glibc.malloc.
            mmap_threshold=N``, e.g. 65536 so that freed tensors leave the process) is kept in both modes, never
            raised; one set with ``mallopt`` inside the process cannot be read back, and is replaced. "recycle"
            gives allocations their own mappings (unmapped, so out of the RSS, when freed) only where the tier's
            own happen (the first step, checkpoint loads), to the sharded gradients, (ZeRO-3) inside backward and,
            with ``params="nvme"``, inside FSDP2's all-gathers (the unsharded parameters), whose large buffers then
            never grow the heap, and lets glibc's heap recycle the rest (forward's activations, the step) as
            without offload (103M-param GPT on CPU: peak RSS drop 0.89-1.15x the planned optimizer state; its
            heap's fragmentation keeps the rest). "return" fixes the mmap threshold at 1 MiB for the whole process:
            every host allocation of 1 MiB or more is its own mapping, so the offloaded bytes leave whatever the
            fragmentation (a drop of 1.4x: the fragmentation of the run without offload goes too), but host
            allocations of that size that recur every step (the activations of CPU-only training; few when they
            live on an accelerator) are faulted in anew each step (3.7M GPT on CPU: 0.81-0.92x DeepSpeed's
            tokens/s against recycle's 1.03-1.15x). ``bench/offload.py`` measures both (``nvme`` /
            ``nvme_return``, ``nvme_params`` / ``nvme_params_return``).
        activations: where the repeated blocks' saved activations go between forward and backward: "none",
            "nvme" (files under ``nvme_path``, written block by block in forward, read one block ahead in backward
            into a pool of host buffers) or "cpu" (CUDA only: pinned host buffers, copied on a side stream ordered
            by events; refused where torch sees no CUDA device, since a host-to-host move saves nothing; never
            copied while a CUDA graph is being captured). With selective recompute, what recompute keeps; with full
            recompute, the blocks' inputs (``lightning_v17/engine/offload/activations.py``).
        activation_min_kb: saved tensors smaller than this many KiB stay in memory.
        resident_blocks: the last blocks whose saved tensors are never offloaded (backward needs them first).
    """

    optimizer: Tier | str = "none"  # plain defaults: the Lightning CLI prints and parses them as written
    params: Tier | str = "none"
    nvme_path: str | None = None
    optimizer_ratio: float = 1.0
    buffer_count: int = 2
    chunk_mb: float = 4.0
    host_memory: HostMemory | str | None = None
    activations: Tier | str = "none"
    activation_min_kb: float = 1024.0
    resident_blocks: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "optimizer", Tier.parse(self.optimizer, "OffloadPolicy(optimizer=...)"))
        object.__setattr__(self, "params", Tier.parse(self.params, "OffloadPolicy(params=...)"))
        object.__setattr__(self, "activations", Tier.parse(self.activations, "OffloadPolicy(activations=...)"))
        if isinstance(self.resident_blocks, bool) or not isinstance(self.resident_blocks, int) or self.resident_blocks < 0:
            raise V17ConfigError(f"OffloadPolicy(resident_blocks={self.resident_blocks!r}) must be an integer >= 0")
        if isinstance(self.activation_min_kb, bool) or not isinstance(self.activation_min_kb, (int, float)) or not (
            self.activation_min_kb >= 0
        ):
            raise V17ConfigError(f"OffloadPolicy(activation_min_kb={self.activation_min_kb!r}) must be a number >= 0")
        if Tier.NVME in (self.optimizer, self.params, self.activations) and not self.nvme_path:
            raise V17ConfigError(
                "an 'nvme' offload tier needs OffloadPolicy(nvme_path=<directory on a local NVMe drive>)"
            )
        ratio = self.optimizer_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 < ratio <= 1.0:
            raise V17ConfigError(f"OffloadPolicy(optimizer_ratio={ratio!r}) must be a number in (0, 1]")
        if ratio < 1.0 and self.optimizer == Tier.NONE:
            raise V17ConfigError(
                f"OffloadPolicy(optimizer_ratio={ratio!r}) splits an offloaded optimizer state; set "
                "OffloadPolicy(optimizer='cpu' or 'nvme'), or drop the ratio"
            )
        object.__setattr__(self, "optimizer_ratio", float(ratio))
        if isinstance(self.buffer_count, bool) or not isinstance(self.buffer_count, int) or self.buffer_count < 2:
            raise V17ConfigError(
                f"OffloadPolicy(buffer_count={self.buffer_count!r}) must be an integer >= 2 (one chunk stepping, one "
                "read ahead)"
            )
        if isinstance(self.chunk_mb, bool) or not isinstance(self.chunk_mb, (int, float)) or not self.chunk_mb > 0:
            raise V17ConfigError(f"OffloadPolicy(chunk_mb={self.chunk_mb!r}) must be a positive number of MiB")
        if self.host_memory is not None:
            host_memory = parse_enum(HostMemory, self.host_memory, option="OffloadPolicy(host_memory=...)")
            object.__setattr__(self, "host_memory", host_memory)
            if Tier.NVME not in (self.optimizer, self.params):
                raise V17ConfigError(
                    f"OffloadPolicy(host_memory={self.host_memory.value!r}) sets glibc's malloc for an nvme tier, and "
                    "there is none; drop host_memory or set OffloadPolicy(optimizer='nvme')"
                )


@dataclass(frozen=True)
class PipelinePolicy:
    """Pipeline parallelism, used when pp > 1 (Huang 2019 GPipe; Narayanan 2021 §2 1F1B and interleaving; Qi 2023
    zero bubble). The schedule then runs the model: ``training_step``/``validation_step``/``test_step`` are not
    called, ``pipeline_loss(logits, batch)`` is (default: token-mean cross-entropy against ``labels``); see
    ``lightning_v17/strategies/_pipeline.py``. ZeRO stage 0/1 only. ``V17Strategy(pp=2)`` is
    ``V17Strategy(pp=PipelinePolicy(size=2))``.

    Args:
        size: pipeline stages (pp, the outermost mesh axis).
        schedule: "gpipe", "1f1b", "interleaved_1f1b", "zero_bubble" (torch's interleaved zero bubble, ZB-1P on
            looped chunks), "zbv" (Qi 2023 §6, V-shaped chunks) or "zb_h1" (Qi 2023 §3.1: one stage per rank with
            the backward split into input and weight gradients); "zb_h2" is planned but not runnable.
        microbatches: micro-batches per optimizer step (m); the per-rank batch size must be a multiple of it. The
            bubble is (p-1)/m for gpipe/1f1b.
        virtual_stages: model chunks per rank (v) for the interleaved and zero-bubble schedules.
        split_points: FQNs of the blocks that start stages 2..n, e.g. ``("model.layers.2",)``. None: the
            LightningModule's ``pipeline_split_points()``, else blocks balanced by parameter count.
    """

    size: int = 1
    schedule: Schedule | str = "1f1b"  # a plain default: the Lightning CLI prints it as written
    microbatches: int = 4
    virtual_stages: int = 1
    split_points: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        _check_positive_int("pp", self.size)
        object.__setattr__(self, "schedule", Schedule.parse(self.schedule))
        _check_positive_int("microbatches", self.microbatches)
        _check_positive_int("virtual_stages", self.virtual_stages)
        from lightning_v17.config.schedules import schedule_info  # the one schedule table (imports this module)

        schedule_info(self.schedule).check_virtual_stages(self.virtual_stages)
        if self.split_points is not None:
            object.__setattr__(self, "split_points", tuple(self.split_points))


@dataclass(frozen=True)
class TPPolicy:
    """Tensor parallelism, used when tp > 1 (Shoeybi 2019 Megatron-LM; Korthikanti 2022 for sequence parallelism).

    The plan comes from ``plan``, else the LightningModule's ``configure_tensor_parallel(mesh)`` or ``tp_plan`` dict,
    else the model's own (Hugging Face ``base_model_tp_plan``, litgpt, torchtitan-style Llama;
    ``lightning_v17.models.tp_plans.resolve_tp_plan``). The three flags shape the model's own plan only.
    ``V17Strategy(tp=2)`` is ``V17Strategy(tp=TPPolicy(size=2))``.

    Args:
        size: tensor-parallel ranks (tp, the innermost mesh axis).
        plan: explicit plan ``{fqn: style}``; ``*`` matches one FQN component; styles "colwise", "rowwise",
            "colwise_rep", "rowwise_rep", "sequence_parallel", "replicate" (or a torch ``ParallelStyle``). A key
            matching no module is an error. None: the LightningModule's or the model's own plan.
        sequence_parallel: shard norms/dropout along the sequence dim between the sublayers (Korthikanti 2022
            §4.2.2).
        vocab_parallel: shard the input embedding along the vocabulary (Megatron's ``VocabParallelEmbedding``); tp
            must divide the vocabulary size.
        loss_parallel: keep the output head's logits sharded along the vocabulary and compute the cross-entropy on
            the shards (torch's ``loss_parallel()``; Megatron's vocab-parallel cross entropy): the [batch, seq, vocab]
            logits are never gathered. The strategy runs ``training_step``/``validation_step``/``test_step`` and
            backward inside that context, so the loss must be ``F.cross_entropy`` on the logits (the reference
            ``LlamaLM``'s is). pp=1 only.
    """

    size: int = 1
    plan: dict[str, str] | None = None
    sequence_parallel: bool = False
    vocab_parallel: bool = False
    loss_parallel: bool = False

    def __post_init__(self) -> None:
        _check_positive_int("tp", self.size)
        for name in ("sequence_parallel", "vocab_parallel", "loss_parallel"):
            if not isinstance(getattr(self, name), bool):
                raise V17ConfigError(f"TPPolicy({name}={getattr(self, name)!r}) must be True or False")
        if self.plan is not None:
            if not isinstance(self.plan, Mapping) or not all(isinstance(k, str) and k for k in self.plan):
                raise V17ConfigError(
                    f"TPPolicy(plan={self.plan!r}) must be a dict {{fqn: style}}, e.g. "
                    "{'layers.*.attn.q_proj': 'colwise'}"
                )
            object.__setattr__(self, "plan", dict(self.plan))


@dataclass(frozen=True)
class EPPolicy:
    """Expert parallelism, used when ep > 1: every MoE layer's experts are sharded over ep ranks folded out of
    dp_shard (``MeshSpec.ep``; ``lightning_v17/engine/ep/``). ``V17Strategy(ep=2)`` is ``V17Strategy(ep=EPPolicy(size=2))``.

    Args:
        size: expert-parallel ranks; must divide dp_shard and every MoE layer's expert count.
        dispatcher: "alltoall" (each assignment row sent to its expert's rank and back, GShard's and Megatron-core's
            default; uneven splits) or "allgather" (every rank's rows all-gathered, each rank runs its own experts'
            rows, the outputs summed back by a reduce-scatter; Megatron-core's allgather dispatcher: more bytes,
            no uneven splits).
    """

    size: int = 1
    dispatcher: Dispatcher | str = "alltoall"

    def __post_init__(self) -> None:
        _check_positive_int("ep", self.size)
        object.__setattr__(self, "dispatcher", Dispatcher.parse(self.dispatcher))


@dataclass(frozen=True)
class CPPolicy:
    """Context parallelism, used when cp > 1: every row's sequence dim is split over the cp ranks, which run
    attention over the whole rows together (DeepSpeed Ulysses; the Llama-3 all-gathered K/V). Labels are the
    batch's, already shifted (the data pipeline shifts before the split, so no target is lost at a shard boundary);
    position ids stay global; the loss is divided once by the global token count. ``lightning_v17/engine/cp/``.
    ``V17Strategy(cp=2)`` is ``V17Strategy(cp=CPPolicy(size=2))``.

    Args:
        size: context-parallel ranks (cp, between dp_shard and tp in the mesh); ZeRO shards over dp_shard x cp.
        mode: "ulysses" (an all-to-all from sequence- to head-sharded q/k/v and back; cp must divide the query
            heads and divide or be a multiple of the KV heads), "allgather" (K/V all-gathered, their gradients
            reduce-scattered; any cp) or "auto" (ulysses where the heads allow it and it sends fewer elements).
            "ring" is not built.
        balance: "head_tail" (rank r holds chunks r and 2cp-1-r of every row: equal causal work), "packed"
            (chunks assigned by the attention work of the packed documents in them, max/mean <= 1.05) or "none"
            (contiguous). The sequence length must be a multiple of cp, 2cp or ``chunks_per_rank`` x cp.
        chunks_per_rank: chunks per rank of the "packed" assignment (more: finer balance, shorter chunks).
    """

    size: int = 1
    mode: CPMode | str = "auto"
    balance: CPBalance | str = "head_tail"
    chunks_per_rank: int = 8

    def __post_init__(self) -> None:
        _check_positive_int("cp", self.size)
        object.__setattr__(self, "mode", CPMode.parse(self.mode))
        object.__setattr__(self, "balance", CPBalance.parse(self.balance))
        _check_positive_int("chunks_per_rank", self.chunks_per_rank)


@dataclass(frozen=True)
class LossScalePolicy:
    """fp16 dynamic loss scaling (design §13; DeepSpeed's fp16 block).

    Args:
        init_scale: starting scale S.
        growth_factor: S <- S * growth after ``growth_interval`` overflow-free steps.
        backoff_factor: S <- S * backoff on an overflow.
        growth_interval: overflow-free steps before growing (DeepSpeed's loss_scale_window).
        hysteresis: overflows tolerated before backing off (DeepSpeed's hysteresis).
        min_scale: smallest scale; falling below it is an error (the model diverged).
        max_consecutive_skips: this many overflowing steps in a row is an error (the loop must not spin forever).
    """

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    hysteresis: int = 1
    min_scale: float = 1.0
    max_consecutive_skips: int = 50

    def __post_init__(self) -> None:
        if not (self.init_scale > 0 and math.isfinite(self.init_scale)):
            raise V17ConfigError(f"init_scale={self.init_scale} must be a finite positive number")
        if self.growth_factor <= 1.0:
            raise V17ConfigError(f"growth_factor={self.growth_factor} must be > 1")
        if not 0.0 < self.backoff_factor < 1.0:
            raise V17ConfigError(f"backoff_factor={self.backoff_factor} must be in (0, 1)")
        _check_positive_int("growth_interval", self.growth_interval)
        _check_positive_int("hysteresis", self.hysteresis)
        _check_positive_int("max_consecutive_skips", self.max_consecutive_skips)
        if not 0.0 < self.min_scale <= self.init_scale:
            raise V17ConfigError(f"min_scale={self.min_scale} must be in (0, init_scale={self.init_scale}]")


@dataclass(frozen=True)
class TrainingPolicy:
    """Everything V17Strategy was configured with, after parsing. Built once at the boundary.

    Args:
        zero: ZeRO partitioning policy.
        offload: offload tiers.
        pipeline: pipeline schedule policy (used when the mesh has pp > 1).
        recompute: activation checkpointing mode.
        tensor_parallel: tensor-parallel options (:class:`TPPolicy`; used when tp > 1).
        loss_scale: fp16 loss-scaling policy (None: Lightning's defaults, or bf16/fp32 with no scaler).
        gradient_clipping: max global grad norm from a DeepSpeed config (None: use the Trainer's setting).
        gradient_accumulation_steps: from a DeepSpeed config (None: use the Trainer's setting).
        micro_batch_size: ``train_micro_batch_size_per_gpu`` from a DeepSpeed config: the strategy checks that the
            DataLoader's per-rank batch equals it (in Lightning the DataLoader decides the batch).
        train_batch_size: ``train_batch_size`` from a DeepSpeed config: checked against micro-batch x gradient
            accumulation x data-parallel ranks at the first training batch.
        precision: precision from a DeepSpeed config (None: use the Trainer's ``precision=``).
        fp8: float8 matmuls in the blocks' Linears (:class:`FP8Policy`); None: off.
        context: context-parallel options (:class:`CPPolicy`; used when cp > 1).
        expert: expert-parallel options (:class:`EPPolicy`; used when ep > 1).
    """

    zero: ZeroPolicy = field(default_factory=ZeroPolicy)
    offload: OffloadPolicy = field(default_factory=OffloadPolicy)
    pipeline: PipelinePolicy = field(default_factory=PipelinePolicy)
    recompute: Recompute = Recompute.NONE
    tensor_parallel: TPPolicy = field(default_factory=TPPolicy)
    loss_scale: LossScalePolicy | None = None
    gradient_clipping: float | None = None
    gradient_accumulation_steps: int | None = None
    micro_batch_size: int | None = None
    train_batch_size: int | None = None
    precision: Precision | None = None
    fp8: FP8Policy | None = None
    context: CPPolicy = field(default_factory=CPPolicy)
    expert: EPPolicy = field(default_factory=EPPolicy)

    def __post_init__(self) -> None:
        object.__setattr__(self, "recompute", Recompute.parse(self.recompute))
