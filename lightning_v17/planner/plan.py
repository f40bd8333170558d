"""Planner inputs (dataclasses), layout resolution, and the assembled :class:`Plan`.

Torch-free. The CLI maps flags onto :class:`ModelSpec`, :class:`ClusterSpec` and :class:`TrainSpec`;
:func:`make_plan` resolves what was left unset from the design outline's decision tree (recipes.py) and evaluates every
formula (memory.py, comm.py, pipeline.py, throughput.py, offload.py, resilience.py) for the resolved layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from lightning_v17.config import (
    FP8Recipe,
    OptimizerKind,
    PipelinePolicy,
    Precision,
    Recompute,
    Schedule,
    Tier,
    V17ConfigError,
    ZeroPolicy,
    check_tp_divides,
)
from lightning_v17.config.schedules import schedule_info
from lightning_v17.planner import comm as comm_
from lightning_v17.planner import memory as mem
from lightning_v17.planner import offload as off
from lightning_v17.planner import recipes
from lightning_v17.planner import resilience as res
from lightning_v17.planner import throughput as thr
from lightning_v17.planner.hardware import GB, Accelerator, get_accelerator
from lightning_v17.planner.model import ModelShape
from lightning_v17.planner.pipeline import OpTimes, bubble_fraction


def _positive(name: str, value: Any, *, allow_none: bool = True, kind: type = int) -> None:
    if value is None and allow_none:
        return
    ok = isinstance(value, kind) and not isinstance(value, bool) and value > 0
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
    if not ok:
        raise V17ConfigError(f"{name}={value!r} must be a positive {'integer' if kind is int else 'number'}")


@dataclass(frozen=True)
class ModelSpec:
    """What is trained: a full shape, or only a parameter count (model-state questions).

    Args:
        shape: the model shape (preset or explicit). None when only ``params`` is known.
        params: parameter count, used when ``shape`` is None.
        name: preset name or "custom", for the report.
    """

    shape: ModelShape | None = None
    params: int | None = None
    name: str = "custom"

    def __post_init__(self) -> None:
        if self.shape is None and self.params is None:
            raise V17ConfigError("give a model: --model PRESET, the shape flags (--layers ... --vocab), or --params N")
        _positive("params", self.params)

    @property
    def num_params(self) -> int:
        return self.shape.num_params if self.shape is not None else int(self.params)  # type: ignore[arg-type]


@dataclass(frozen=True)
class ClusterSpec:
    """Where it is trained.

    Args:
        gpu: accelerator name in ``hardware.ACCELERATORS``.
        gpus: world size (None: derived from dp, or one node).
        gpus_per_node: devices per node (None: the accelerator's usual server).
        pcie_gbps: host <-> device bandwidth per rank, GB/s (offload transfers).
        nvme_gbps: NVMe bandwidth per rank, GB/s.
        storage_gbps: checkpoint write bandwidth per node, GB/s.
        node_mtbf_hours: mean time between failures of one node, hours. The default, 6000 h, is what Meta's
            Llama 3 run saw (Dubey 2024 §3.3.4: 419 unexpected interruptions in 54 days on 16,384 GPUs, i.e. one per
            ~50,700 GPU-hours, ~6,300 h per 8-GPU node).
        memory_reserve: fraction of each device's memory the plan leaves free, in [0, 0.9]: what the buckets do not
            count (the CUDA context, NCCL's communication buffers, the caching allocator's fragmentation and
            whatever else a process holds). A plan "fits" when its device bytes stay within the rest
            (:attr:`usable_memory_bytes`). Default 0.1: 8 GB of an 80 GB H100, about what a CUDA context
            (~0.5-1 GB), NCCL buffers (~1-2 GB) and a few percent of fragmentation take. 0 plans to the last byte.
    """

    gpu: str = "h100-80gb"
    gpus: int | None = None
    gpus_per_node: int | None = None
    pcie_gbps: float = 25.0
    nvme_gbps: float = 3.0
    storage_gbps: float = 5.0
    node_mtbf_hours: float = 6000.0
    memory_reserve: float = 0.1

    def __post_init__(self) -> None:
        if not (isinstance(self.memory_reserve, (int, float)) and 0 <= self.memory_reserve <= 0.9):
            raise V17ConfigError(f"memory_reserve={self.memory_reserve!r} must be a fraction in [0, 0.9]")
        get_accelerator(self.gpu)
        _positive("gpus", self.gpus)
        _positive("gpus_per_node", self.gpus_per_node)
        for name in ("pcie_gbps", "nvme_gbps", "storage_gbps", "node_mtbf_hours"):
            _positive(name, getattr(self, name), allow_none=False, kind=float)

    @property
    def accelerator(self) -> Accelerator:
        return get_accelerator(self.gpu)

    @property
    def usable_memory_bytes(self) -> int:
        """Device bytes a plan may use: the accelerator's memory less ``memory_reserve``."""
        return int(self.accelerator.memory_bytes * (1.0 - self.memory_reserve))


@dataclass(frozen=True)
class TrainSpec:
    """How it is trained. ``None`` means "let the planner choose" (decision tree, or the cheapest fit).

    Args:
        tp, pp, dp, cp: mesh sizes.
        sp: sequence parallelism (None: on whenever tp > 1).
        zero: the ZeRO policy (``v17 plan --zero-stage N`` is ``ZeroPolicy(stage=N)``).
        optimizer: optimizer kind.
        precision: training precision.
        micro_batch: samples per micro-batch (b).
        seq: training sequence length (None: the shape's ``seq``; 2048 with ``params`` only).
        global_batch: samples per optimizer step, all replicas (G = dp·b·m).
        microbatches: micro-batches per step per replica (m).
        recompute: none/selective/full (None: the cheapest that fits).
        schedule: pipeline schedule.
        virtual_stages: model chunks per rank for interleaved/zero-bubble schedules.
        offload_optimizer, offload_params: tiers.
        fp8: the strategy's ``fp8`` recipe ("tensorwise", "rowwise", "delayed"; None: off, or "tensorwise" when
            ``precision`` is "fp8"). It changes the saved activations (``delayed`` keeps float8 casts,
            :func:`~lightning_v17.planner.memory.fp8_activation_delta_bytes_per_layer`) and, at ZeRO-3 with
            ``tensorwise``, the all-gathered unit (its Linear weights travel in float8, 1 B each).
        mfu: assumed MFU without bubble and recomputation, for the step-time estimate.
        checkpoint_write_s: seconds to write a checkpoint (None: model state / storage bandwidth).
        op_times: T_F, T_B, T_W of one micro-batch on one stage, with their coefficients of variation, for the
            pipeline bubble simulation (``planner.pipeline.bubble_fraction``); None: the FLOP split
            T_F = T_B = T_W and no jitter. Any unit; only the ratios and ``p2p_time`` relative to them matter.
        p2p_time: one activation/gradient transfer between pipeline ranks, in the unit of ``op_times``.
    """

    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    cp: int | None = None
    sp: bool | None = None
    zero: ZeroPolicy | None = None
    optimizer: OptimizerKind = OptimizerKind.ADAMW
    precision: Precision = Precision.BF16_MIXED
    micro_batch: int = 1
    seq: int | None = None
    global_batch: int | None = None
    microbatches: int | None = None
    recompute: Recompute | None = None
    schedule: Schedule | None = None
    virtual_stages: int | None = None
    offload_optimizer: Tier = Tier.NONE
    offload_params: Tier = Tier.NONE
    fp8: FP8Recipe | None = None
    mfu: float = 0.5
    checkpoint_write_s: float | None = None
    op_times: OpTimes | None = None
    p2p_time: float = 0.0

    def __post_init__(self) -> None:
        if self.p2p_time < 0:
            raise ValueError(f"p2p_time={self.p2p_time} must be >= 0")
        object.__setattr__(self, "optimizer", OptimizerKind.parse(self.optimizer))
        object.__setattr__(self, "precision", Precision.parse(self.precision))
        if self.fp8 is not None:
            try:
                object.__setattr__(self, "fp8", FP8Recipe(self.fp8))
            except ValueError:
                raise V17ConfigError(
                    f"fp8={self.fp8!r}; choose one of {[r.value for r in FP8Recipe]} (or leave it unset)"
                ) from None
        elif self.precision == Precision.FP8:
            object.__setattr__(self, "fp8", FP8Recipe.TENSORWISE)  # what an fp8 run of V17Strategy uses
        if self.recompute is not None:
            object.__setattr__(self, "recompute", Recompute.parse(self.recompute, "recompute"))
        if self.schedule is not None:
            object.__setattr__(self, "schedule", Schedule.parse(self.schedule, "schedule"))
        object.__setattr__(self, "offload_optimizer", Tier.parse(self.offload_optimizer, "offload_optimizer"))
        object.__setattr__(self, "offload_params", Tier.parse(self.offload_params, "offload_params"))
        for name in ("tp", "pp", "dp", "cp", "seq", "global_batch", "microbatches", "virtual_stages"):
            _positive(name, getattr(self, name))
        _positive("micro_batch", self.micro_batch, allow_none=False)
        if not 0 < self.mfu <= 1:
            raise V17ConfigError(f"mfu={self.mfu!r} must be in (0, 1]")
        _positive("checkpoint_write_s", self.checkpoint_write_s, kind=float)


@dataclass(frozen=True)
class Layout:
    """A fully resolved layout: every size concrete, the ZeRO stage a :class:`~lightning_v17.config.ZeroPolicy`."""

    tp: int
    pp: int
    dp: int
    cp: int
    sp: bool
    zero: ZeroPolicy
    recompute: Recompute
    schedule: Schedule
    virtual_stages: int
    micro_batch: int
    microbatches: int
    global_batch: int
    seq: int
    optimizer: OptimizerKind
    precision: Precision
    offload_optimizer: Tier
    offload_params: Tier
    fp8: FP8Recipe | None = None

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def params_tier(self) -> Tier:
        """Where the parameters live: ``offload_params`` when ZeRO shards them (ZeRO-Infinity offloads parameter
        shards), else the device (the rules table warns about ``offload_params`` below ZeRO-3)."""
        return self.offload_params if self.zero.shards_params else Tier.NONE


@dataclass(frozen=True)
class Memory:
    """Per-rank bytes by bucket, and by tier."""

    param: int
    grad: int
    optimizer: int
    optimizer_parts: tuple[tuple[str, int], ...]
    activation: int
    activation_per_layer: int
    temp: int
    tiers: off.TierBytes

    @property
    def model_state(self) -> int:
        return self.param + self.grad + self.optimizer

    @property
    def total(self) -> int:
        return self.model_state + self.activation + self.temp


@dataclass(frozen=True)
class Plan:
    """Everything the planner computed. :mod:`lightning_v17.planner.report` renders it."""

    model: ModelSpec
    cluster: ClusterSpec
    layout: Layout
    recommendation: recipes.Recommendation
    recommended_recompute: Recompute
    memory: Memory
    collectives: tuple[comm_.Collective, ...]
    comm_time_s: float
    bubble: float
    flops_per_step: float
    model_flops_per_step: float
    mfu_assumed: float
    step_time_s: float
    offload_traffic: off.OffloadTraffic
    offload_time_s: float
    checkpoint_write_s: float
    cluster_mtbf_s: float
    young_s: float
    daly_s: float
    warnings: tuple[str, ...]
    notes: tuple[str, ...] = field(default_factory=tuple)
    #: the op times the bubble was simulated with, in words ("T_F = T_B = T_W" by default)
    bubble_inputs: str = "T_F = T_B = T_W"

    @property
    def fits(self) -> bool:
        return self.memory.tiers.gpu <= self.cluster.usable_memory_bytes

    @property
    def comm_bytes_per_step(self) -> int:
        return sum(c.bytes_per_step for c in self.collectives)

    @property
    def nodes(self) -> int:
        return math.ceil(self.layout.gpus / _gpus_per_node(self.cluster))

    @property
    def mfu(self) -> float:
        acc = self.cluster.accelerator
        peak = acc.peak_flops_for(self.layout.precision)
        return thr.mfu_from_step_time(
            self.model_flops_per_step, step_time_s=self.step_time_s, gpus=self.layout.gpus, peak_flops=peak
        )


def _gpus_per_node(cluster: ClusterSpec) -> int:
    return cluster.gpus_per_node or cluster.accelerator.gpus_per_node


def memory_for(model: ModelSpec, layout: Layout) -> Memory:
    """Per-rank bytes of every bucket for ``layout`` (ZeRO §3.1, Korthikanti Table 2 / Eq. 5, temp buffers).

    With pp > 1 the rank described is the first pipeline stage, the activation peak (Korthikanti Eq. 5); model
    state is split evenly over stages (Ψ/(tp·pp)), and the fp32 logits are counted only when pp = 1 (with a
    pipeline they live on the last stage, which holds one micro-batch in flight instead of p).
    """
    shape = model.shape
    lay = layout
    pb = mem.param_bytes_per_param(lay.precision)
    gb = mem.grad_bytes_per_param(lay.precision)
    parts = mem.optimizer_state_components(lay.optimizer, lay.precision)
    k = sum(b for _, b in parts)
    # ZeRO shards over every data-parallel rank of a model replica, cp included (torchtitan's dp_shard_cp).
    shard = lay.dp * lay.cp
    state = mem.model_state_bytes_per_rank(
        model.num_params, zero=lay.zero, dp=shard, tp=lay.tp, pp=lay.pp,
        param_bytes=pb, grad_bytes=gb, optimizer_bytes=k,
    )  # fmt: skip
    opt_parts = tuple((name, math.ceil(state.optimizer * b / k) if k else 0) for name, b in parts)
    element = lay.precision.activation_bytes
    per_layer = act = temp = 0
    if shape is not None:
        per_layer = mem.activation_bytes_per_layer_of(
            shape, seq=lay.seq, micro_batch=lay.micro_batch, tp=lay.tp, sp=lay.sp, recompute=lay.recompute,
            cp=lay.cp, element_bytes=element, fp8=lay.fp8,
        )  # fmt: skip
        act = mem.activation_bytes_first_stage(
            per_layer, layers=shape.layers, pp=lay.pp, microbatches=lay.microbatches, schedule=lay.schedule,
            virtual_stages=lay.virtual_stages,
        )  # fmt: skip
        if lay.zero.shards_params and shard > 1:
            temp += mem.zero3_gather_bytes(shape.largest_unit_params, tp=lay.tp, param_bytes=pb, grad_bytes=gb,
                                           float8_params=mem.fp8_gathered_params(shape, lay.fp8))  # fmt: skip
        if lay.pp == 1:
            temp += mem.logits_bytes(seq=lay.seq // lay.cp, micro_batch=lay.micro_batch, vocab=shape.vocab, tp=lay.tp)
    if shard > 1:
        temp += mem.grad_bucket_bytes(zero=lay.zero)
    tiers = off.tier_bytes(
        param_bytes=state.param, grad_bytes=state.grad, optimizer_bytes=state.optimizer, activation_bytes=act,
        temp_bytes=temp, offload_optimizer=lay.offload_optimizer, offload_params=lay.params_tier,
    )  # fmt: skip
    return Memory(state.param, state.grad, state.optimizer, opt_parts, act, per_layer, temp, tiers)


def _resolve_world(cluster: ClusterSpec, train: TrainSpec, tp: int, pp: int, cp: int) -> tuple[int, int]:
    """(gpus, dp) from the flags: --gpus, --dp, or one node by default. Raises on a mismatch."""
    group = tp * pp * cp
    if cluster.gpus is not None:
        if cluster.gpus % group != 0:
            ok = ", ".join(str(group * k) for k in range(1, 5))
            raise V17ConfigError(
                f"gpus={cluster.gpus} is not divisible by tp*pp*cp = {tp}*{pp}*{cp} = {group}; use gpus in "
                f"{{{ok}, ...}} or change tp/pp"
            )
        dp = cluster.gpus // group
        if train.dp is not None and train.dp != dp:
            raise V17ConfigError(
                f"dp={train.dp} does not match gpus={cluster.gpus} / (tp*pp*cp={group}) = {dp}; give one of --dp/--gpus"
            )
        return cluster.gpus, dp
    dp = train.dp if train.dp is not None else max(1, _gpus_per_node(cluster) // group)
    return dp * group, dp


def _resolve_batch(train: TrainSpec, *, dp: int, pp: int) -> tuple[int, int]:
    """(microbatches m, global_batch G) with G = dp·b·m (Narayanan 2021 §2: batch B = b·m per pipeline, times d
    data-parallel replicas). Unset, m = 4·p (design §10.7). Raises when the flags disagree."""
    b = train.micro_batch
    if train.microbatches is not None:
        m = train.microbatches
        if train.global_batch is not None and train.global_batch != dp * b * m:
            raise V17ConfigError(
                f"global_batch={train.global_batch} != dp*micro_batch*microbatches = {dp}*{b}*{m} = {dp * b * m}; "
                f"give only one of --global-batch/--microbatches"
            )
        return m, dp * b * m
    if train.global_batch is not None:
        if train.global_batch % (dp * b) != 0:
            raise V17ConfigError(
                f"global_batch={train.global_batch} is not divisible by dp*micro_batch = {dp}*{b} = {dp * b}; "
                f"use a multiple of {dp * b}"
            )
        return train.global_batch // (dp * b), train.global_batch
    m = recipes.default_microbatches(pp)
    return m, dp * b * m


def _layout(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, rec: recipes.Recommendation,
            recompute: Recompute) -> Layout:
    tp = train.tp or rec.tp
    pp = train.pp or rec.pp
    cp = train.cp or 1
    _, dp = _resolve_world(cluster, train, tp, pp, cp)
    m, g = _resolve_batch(train, dp=dp, pp=pp)
    schedule = train.schedule or rec.schedule
    v = train.virtual_stages or (2 if schedule_info(schedule).multi_chunk else 1)
    if pp > 1:
        # The strategy's own policy validates schedule/microbatches/virtual_stages, so plan and run agree.
        PipelinePolicy(schedule=schedule, microbatches=m, virtual_stages=v)
    seq = train.seq or (model.shape.seq if model.shape is not None else 2048)
    zero = rec.zero if train.zero is None else train.zero
    sp = (tp > 1) if train.sp is None else train.sp
    return Layout(tp=tp, pp=pp, dp=dp, cp=cp, sp=sp, zero=zero, recompute=recompute, schedule=schedule,
                  virtual_stages=v, micro_batch=train.micro_batch, microbatches=m, global_batch=g, seq=seq,
                  optimizer=train.optimizer, precision=train.precision, offload_optimizer=train.offload_optimizer,
                  offload_params=train.offload_params, fp8=train.fp8)


def _validate(model: ModelSpec, train: TrainSpec, layout: Layout) -> None:
    shape = model.shape
    if shape is not None:
        if train.tp is not None:
            check_tp_divides(layout.tp, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                             ffn=shape.ffn)
        if layout.pp > shape.layers:
            raise V17ConfigError(f"pp={layout.pp} exceeds layers={shape.layers}; use pp <= {shape.layers}")
    if layout.seq % layout.cp != 0:
        raise V17ConfigError(f"cp={layout.cp} must divide seq={layout.seq}")


def _cheapest_recompute(model: ModelSpec, layout: Layout, memory_bytes: int) -> Recompute:
    """The least recomputation whose plan fits (none, then selective, then full); full if none fits."""
    for mode in (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL):
        if memory_for(model, replace(layout, recompute=mode)).tiers.gpu <= memory_bytes:
            return mode
    return Recompute.FULL


def make_plan(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec) -> Plan:
    """Resolve the layout (flags first, then the decision tree) and evaluate every formula for it.

    Raises:
        V17ConfigError: on inconsistent or impossible inputs, with the option and the fix in the message.
    """
    acc = cluster.accelerator
    gpn = _gpus_per_node(cluster)
    shape = model.shape
    num_params = model.num_params
    dims = (shape.heads, shape.kv_heads, shape.ffn) if shape is not None else ()
    world = cluster.gpus
    if world is None and train.dp is None and not (train.tp or train.pp or train.cp):
        world = gpn  # nothing says how many: plan one node
        cluster = replace(cluster, gpus=world)
    if world is None and train.dp is None:
        train = replace(train, dp=1)  # tp/pp/cp given without a world size: one data-parallel replica

    def state_fits(tp: int, pp: int) -> bool:
        dp = (world // (tp * pp)) if world else (train.dp or 1)
        st = mem.model_state_bytes_per_rank(num_params, zero=ZeroPolicy(stage=1), dp=dp, tp=tp, pp=pp)
        return st.total <= cluster.usable_memory_bytes / 2

    rec = recipes.recommend(
        num_params, gpus=world, gpus_per_node=gpn, nvlink=acc.nvlink, layers=shape.layers if shape else None,
        tp_dims=dims, seq=train.seq or (shape.seq if shape else None), model_state_fits=state_fits,
    )  # fmt: skip
    if world is None:
        rec = replace(rec, dp=train.dp)

    # The tree's own layout (its sizes; only the batch flags from the user) and the cheapest recompute that fits it.
    rec_train = replace(train, tp=None, pp=None, cp=None, sp=None, zero=None, schedule=None,
                        virtual_stages=None, dp=None)
    rec_cluster = cluster if world else replace(cluster, gpus=rec.tp * rec.pp * (train.dp or 1))
    try:
        rec_layout = _layout(model, rec_cluster, rec_train, rec, Recompute.NONE)
        rec_recompute = _cheapest_recompute(model, rec_layout, cluster.usable_memory_bytes)
    except V17ConfigError:  # e.g. a --global-batch that only the user's dp divides
        rec_recompute = Recompute.SELECTIVE

    layout = _layout(model, cluster, train, rec, train.recompute or Recompute.NONE)
    _validate(model, train, layout)
    if train.recompute is None:
        layout = replace(layout, recompute=_cheapest_recompute(model, layout, cluster.usable_memory_bytes))
    memory = memory_for(model, layout)
    lay = layout

    pb = mem.param_bytes_per_param(lay.precision)
    gb = mem.grad_bytes_per_param(lay.precision)
    k = mem.optimizer_bytes_per_param(lay.optimizer, lay.precision)
    element = lay.precision.activation_bytes
    psi_mp = num_params / (lay.tp * lay.pp)
    shard = lay.dp * lay.cp
    # Each rank runs m micro-batches per step; with ZeRO-2/3 each one triggers its own reduce-scatter/gathers.
    collectives = list(comm_.dp_comm_bytes(psi_mp, zero=lay.zero, dp=shard, grad_bytes=gb,
                                           param_bytes=pb, grad_accum_steps=lay.microbatches))
    layers_per_stage = math.ceil(shape.layers / lay.pp) if shape else 0
    per_rank_layers = layers_per_stage * lay.microbatches
    seq_local = lay.seq // lay.cp
    if shape is not None and lay.tp > 1:
        per = comm_.tp_comm_bytes_per_layer(seq=seq_local, micro_batch=lay.micro_batch, hidden=shape.hidden,
                                            tp=lay.tp, element_bytes=element, recompute=lay.recompute)
        kind = "reduce-scatter+all-gather" if lay.sp else "all-reduce"
        collectives.append(comm_.Collective(f"tp {kind} (activations)", "tp", per * per_rank_layers))
    if shape is not None and lay.cp > 1:
        per = comm_.cp_comm_bytes_per_layer(seq=lay.seq, micro_batch=lay.micro_batch, kv_dim=shape.kv_dim,
                                            cp=lay.cp, element_bytes=element, recompute=lay.recompute)
        collectives.append(comm_.Collective("cp all-gather/reduce-scatter (K,V)", "cp", per * per_rank_layers))
    if shape is not None and lay.pp > 1:
        per = comm_.pp_comm_bytes_per_microbatch(seq=seq_local, micro_batch=lay.micro_batch, hidden=shape.hidden,
                                                 tp=lay.tp, element_bytes=element, virtual_stages=lay.virtual_stages)
        collectives.append(comm_.Collective("pp send/recv (activations, grads)", "pp", per * lay.microbatches))
    comm_time = 0.0
    nodes = math.ceil(lay.gpus / gpn)
    for c in collectives:
        intra = nodes == 1 or (c.axis in ("tp", "cp") and lay.tp * lay.cp <= gpn)
        comm_time += c.bytes_per_step / (acc.intra_node_bytes_per_s if intra else acc.inter_node_bytes_per_s)

    bubble = bubble_fraction(lay.schedule, pp=lay.pp, microbatches=lay.microbatches,
                             virtual_stages=lay.virtual_stages, op_times=train.op_times, p2p_s=train.p2p_time)
    tokens = lay.global_batch * lay.seq
    if shape is not None:
        hw = thr.flops_per_token(shape, seq=lay.seq, recompute=lay.recompute) * tokens
        model_flops = thr.flops_per_token(shape, seq=lay.seq) * tokens
    else:
        hw = thr.flops_per_token_from_params(num_params, recompute=lay.recompute) * tokens
        model_flops = thr.flops_per_token_from_params(num_params) * tokens
    peak = acc.peak_flops_for(lay.precision)
    compute_s = thr.compute_time_s(hw, model_flops_per_step=model_flops, gpus=lay.gpus, peak_flops=peak,
                                   mfu=train.mfu, bubble_fraction=bubble)

    opt_partition = psi_mp / (shard if lay.zero.shards_optimizer else 1)
    traffic = off.offload_traffic_bytes(
        optimizer_partition_params=opt_partition, param_partition_params=psi_mp / shard, zero=lay.zero,
        grad_accum_steps=lay.microbatches, param_bytes=pb, grad_bytes=gb, optimizer_bytes=k,
        offload_optimizer=lay.offload_optimizer, offload_params=lay.offload_params,
    )  # fmt: skip
    offload_s = off.offload_transfer_s(traffic, pcie_bytes_per_s=cluster.pcie_gbps * GB,
                                       nvme_bytes_per_s=cluster.nvme_gbps * GB)
    step_s = compute_s + offload_s

    # A checkpoint holds the parameters and the optimizer state (master included) of every rank; each node writes
    # its own ranks' shards in parallel.
    ckpt_rank_bytes = memory.param + memory.optimizer
    write_s = train.checkpoint_write_s or res.checkpoint_write_s(
        ckpt_rank_bytes * min(gpn, lay.gpus), write_bytes_per_s=cluster.storage_gbps * GB
    )
    mtbf_s = res.cluster_mtbf_s(cluster.node_mtbf_hours * 3600.0, nodes)

    warnings = recipes.anti_pattern_warnings(
        tp=lay.tp, pp=lay.pp, dp=lay.dp, cp=lay.cp, sp=lay.sp, zero=lay.zero, gpus_per_node=gpn,
        microbatches=lay.microbatches, offload_params=lay.offload_params, offload_optimizer=lay.offload_optimizer,
        fp8=lay.fp8,
    )  # fmt: skip
    notes = list(rec.notes)
    engine_note = schedule_info(lay.schedule).engine_note() if lay.pp > 1 else None
    if engine_note:
        notes.append(engine_note)
    if shape is None:
        notes.append("activations, temporary buffers, TP/PP traffic and attention FLOPs need a shape; "
                     "give --model or the shape flags")
    elif shape.arch == "gpt" and lay.seq > shape.seq:
        warnings.append(f"seq={lay.seq} exceeds the learned position table ({shape.seq}) of this gpt shape")
    fit = recipes.fit_warning(memory.tiers.gpu, cluster.usable_memory_bytes, name=acc.name,
                              total_bytes=acc.memory_bytes)
    if fit:
        warnings.append(fit)
    return Plan(
        model=model, cluster=cluster, layout=layout, recommendation=rec, recommended_recompute=rec_recompute,
        memory=memory, collectives=tuple(collectives), comm_time_s=comm_time, bubble=bubble, flops_per_step=hw,
        model_flops_per_step=model_flops, mfu_assumed=train.mfu, step_time_s=step_s, offload_traffic=traffic,
        offload_time_s=offload_s,
        checkpoint_write_s=write_s, cluster_mtbf_s=mtbf_s, young_s=res.young_interval_s(write_s, mtbf_s),
        daly_s=res.daly_interval_s(write_s, mtbf_s), warnings=tuple(warnings), notes=tuple(notes),
        bubble_inputs=_bubble_inputs(train),
    )  # fmt: skip


def _bubble_inputs(train: TrainSpec) -> str:
    """The op times of the bubble simulation, in words, for the report."""
    t = train.op_times
    words = "T_F = T_B = T_W" if t is None else f"T_F:T_B:T_W = {t.forward:g}:{t.backward_input:g}:{t.backward_weight:g}"
    if t is not None and t.varies:
        words += f", CV {t.forward_cv:g}/{t.backward_input_cv:g}/{t.backward_weight_cv:g}"
    if train.p2p_time:
        words += f", P2P {train.p2p_time:g}"
    return words


__all__ = ["ClusterSpec", "Layout", "Memory", "ModelSpec", "Plan", "TrainSpec", "make_plan", "memory_for"]
