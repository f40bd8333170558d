"""Layout resolution and the assembled :class:`Plan`.

Torch-free. The CLI maps flags onto :class:`ModelSpec`, :class:`ClusterSpec` and :class:`TrainSpec` (specs.py,
re-exported here); :func:`make_plan` resolves what was left unset from the design outline's decision tree
(recipes.py) and evaluates every formula (memory.py, comm.py, pipeline.py, throughput.py, offload.py,
resilience.py, and moe.py for mixture-of-experts shapes) for the resolved layout.
"""

from __future__ import annotations

import math
from dataclasses import astuple, dataclass, field, replace

from lightning_v17.config import (
    CPMode,
    FP8Recipe,
    MeshSpec,
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
from lightning_v17.planner import capacity as cap
from lightning_v17.planner import comm as comm_
from lightning_v17.planner import memory as mem
from lightning_v17.planner import moe as moe_
from lightning_v17.planner import offload as off
from lightning_v17.planner import recipes
from lightning_v17.planner import resilience as res
from lightning_v17.planner import throughput as thr
from lightning_v17.planner.hardware import GB
from lightning_v17.planner.pipeline import bubble_fraction
from lightning_v17.planner.specs import ClusterSpec, ModelSpec, TrainSpec


@dataclass(frozen=True)
class Layout:
    """A fully resolved layout: every size concrete (``dims``, the same :class:`~lightning_v17.config.MeshSpec` the
    strategy resolves, with the data-parallel ranks as ``dp_shard``), the ZeRO stage a
    :class:`~lightning_v17.config.ZeroPolicy`."""

    dims: MeshSpec
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
    #: the cp attention scheme, resolved (``ulysses`` or ``allgather``); None at cp = 1
    cp_mode: CPMode | None = None
    #: where the blocks' saved activations go between forward and backward, and the blocks that stay
    offload_activations: Tier = Tier.NONE
    resident_blocks: int = 1

    @property
    def tp(self) -> int:
        return self.dims.tp

    @property
    def pp(self) -> int:
        return self.dims.pp

    @property
    def dp(self) -> int:
        return self.dims.dp

    @property
    def cp(self) -> int:
        return self.dims.cp

    @property
    def ep(self) -> int:
        """Expert-parallel size, folded out of the data-parallel ranks (not a factor of ``gpus``)."""
        return self.dims.ep

    @property
    def gpus(self) -> int:
        return self.dims.world_size

    @property
    def efsdp(self) -> int:
        """The experts' ZeRO group: the data-parallel ranks that hold the same experts (``dp / ep``)."""
        return self.dims.efsdp

    @property
    def params_tier(self) -> Tier:
        """Where the parameters live: ``offload_params`` when ZeRO shards them (ZeRO-Infinity offloads parameter
        shards), else the device (the rules table warns about ``offload_params`` below ZeRO-3)."""
        return self.offload_params if self.zero.shards_params else Tier.NONE


#: the experts' share of a dense model's model state
_NO_EXPERTS = mem.ModelStateBytes(0, 0, 0, 0)


@dataclass(frozen=True)
class Memory:
    """Per-rank bytes by bucket, and by tier. ``param``, ``grad`` and ``optimizer`` hold everything; ``experts`` is
    the routed experts' share of them (zero for a dense model), the rest is the dense part."""

    param: int
    grad: int
    optimizer: int
    optimizer_parts: tuple[tuple[str, int], ...]
    activation: int
    activation_per_layer: int
    temp: int
    tiers: off.TierBytes
    experts: mem.ModelStateBytes = _NO_EXPERTS
    #: saved activation bytes activation offload keeps off the device (on ``Layout.offload_activations``)
    activation_offloaded: int = 0

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
    #: the MoE section (expert parallelism, dispatch traffic); None for a dense model
    moe: moe_.MoEReport | None = None
    #: the context-parallel section (the scheme, why, both schemes' bytes); None at cp = 1 or without a shape
    cp: CPReport | None = None
    #: activation offload: what leaves the device and whether its transfers hide; None without it
    activation_offload: off.ActivationOffload | None = None
    #: device (per rank), host and NVMe (per node: all its ranks) against their capacities
    capacity: tuple[cap.TierCheck, ...] = ()

    @property
    def fits(self) -> bool:
        checks = self.capacity or cap.capacity_checks(self.memory.tiers, self.cluster, gpus=self.layout.gpus)
        return all(c.fits for c in checks)

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
    pipeline they live on the last stage, which holds one micro-batch in flight instead of p). A MoE shape's routed
    experts are counted apart (:func:`~lightning_v17.planner.moe.expert_state_bytes_per_rank`: / ep, and what ZeRO
    shards of them), their extra activations averaged over the blocks (``moe_activation_delta_bytes_per_layer``).
    """
    shape = model.shape
    lay = layout
    pb = mem.param_bytes_per_param(lay.precision)
    gb = mem.grad_bytes_per_param(lay.precision)
    parts = mem.optimizer_state_components(lay.optimizer, lay.precision)
    k = sum(b for _, b in parts)
    # ZeRO shards over every data-parallel rank of a model replica, cp included (torchtitan's dp_shard_cp).
    shard = lay.dims.dp_shard * lay.cp
    expert_params = shape.expert_params if shape is not None else 0
    dense = mem.model_state_bytes_per_rank(
        model.num_params - expert_params, zero=lay.zero, dp=shard, tp=lay.tp, pp=lay.pp,
        param_bytes=pb, grad_bytes=gb, optimizer_bytes=k,
    )  # fmt: skip
    experts = moe_.expert_state_bytes_per_rank(expert_params, zero=lay.zero, ep=lay.ep, dp_shard=shard, tp=lay.tp,
                                               pp=lay.pp, param_bytes=pb, grad_bytes=gb, optimizer_bytes=k)
    state = mem.ModelStateBytes(*(a + b for a, b in zip(astuple(dense), astuple(experts), strict=True)))
    opt_parts = tuple((name, math.ceil(state.optimizer * b / k) if k else 0) for name, b in parts)
    element = lay.precision.activation_bytes
    per_layer = act = temp = 0
    if shape is not None:
        per_layer = mem.activation_bytes_per_layer_of(
            shape, seq=lay.seq, micro_batch=lay.micro_batch, tp=lay.tp, sp=lay.sp, recompute=lay.recompute,
            cp=lay.cp, element_bytes=element, fp8=lay.fp8, cp_mode=lay.cp_mode,
        )  # fmt: skip
        if shape.moe_blocks:  # the mean over the blocks: exact in sum at pp = 1
            delta = moe_.moe_activation_delta_bytes_per_layer(shape, seq=lay.seq, micro_batch=lay.micro_batch, tp=lay.tp,
                                                              recompute=lay.recompute, cp=lay.cp, element_bytes=element)
            per_layer += math.ceil(delta * shape.moe_blocks / shape.layers)
        act = mem.activation_bytes_first_stage(
            per_layer, layers=shape.layers, pp=lay.pp, microbatches=lay.microbatches, schedule=lay.schedule,
            virtual_stages=lay.virtual_stages,
        )  # fmt: skip
        if lay.zero.shards_params and shard > 1:
            temp += mem.zero3_gather_bytes(moe_.gathered_unit_params(shape, ep=lay.ep), tp=lay.tp, param_bytes=pb,
                                           grad_bytes=gb,
                                           float8_params=mem.fp8_gathered_params(shape, lay.fp8))  # fmt: skip
        if lay.pp == 1:
            temp += mem.logits_bytes(seq=lay.seq // lay.cp, micro_batch=lay.micro_batch, vocab=shape.vocab, tp=lay.tp)
        if lay.cp_mode == CPMode.ALLGATHER:
            # one block's gathered K/V and mask, in forward and again in backward: transient, not saved
            temp += mem.cp_allgather_transient_bytes_per_layer(seq=lay.seq, micro_batch=lay.micro_batch,
                                                               kv_dim=shape.kv_dim, cp=lay.cp, tp=lay.tp,
                                                               element_bytes=element)
    if shard > 1:
        temp += mem.grad_bucket_bytes(zero=lay.zero)
    device_act, offloaded = act, 0
    if lay.offload_activations != Tier.NONE and shape is not None:  # pp = 1 (_validate): act = L blocks' bytes
        offloaded, blocks_device = off.activation_offload_bytes(per_layer, layers=shape.layers,
                                                                resident_blocks=lay.resident_blocks)
        device_act = act - per_layer * shape.layers + blocks_device
    tiers = off.tier_bytes(
        param_bytes=state.param, grad_bytes=state.grad, optimizer_bytes=state.optimizer, activation_bytes=device_act,
        temp_bytes=temp, offload_optimizer=lay.offload_optimizer, offload_params=lay.params_tier,
        offload_activations=lay.offload_activations, offloaded_activation_bytes=offloaded,
    )  # fmt: skip
    return Memory(state.param, state.grad, state.optimizer, opt_parts, act, per_layer, temp, tiers, experts,
                  activation_offloaded=offloaded)


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
    if train.cp is None and train.dp is None and rec.cp > 1 and (cluster.gpus or 0) % (tp * pp * rec.cp) == 0:
        cp = rec.cp  # the tree's "+CP" (_recommend_cp) where the world holds it
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
    ep = train.ep
    if ep is None:  # the tree's expert parallelism, on the layouts its recipe is for: data parallelism alone (the
        # recipe is measured on dp alone and with optimizer offload; ep with tp, pp, cp or parameter offload is
        # planned when asked for with --ep)
        plain = tp == pp == cp == 1 and train.offload_params == Tier.NONE
        ep = moe_.recommend_ep(model.shape.num_experts, dp_shard=dp) if rec.ep > 1 and plain else 1
    cp_mode = None
    if cp > 1 and model.shape is not None:
        # the engine decides on the heads of one tp rank (cp runs on what tp left)
        cp_mode = comm_.choose_cp_mode(train.cp_mode, cp=cp, heads=model.shape.heads // tp,
                                       kv_heads=max(1, model.shape.kv_heads // tp))[0]
    r = comm_.check_replicas(train.dp_replicate or 1, dp=dp, zero=zero)
    moe_.check_ep(ep, dp_shard=dp // r, num_experts=model.shape.num_experts if model.shape is not None else 0)
    return Layout(dims=MeshSpec(tp=tp, pp=pp, dp_replicate=r, dp_shard=dp // r, cp=cp, ep=ep), sp=sp, zero=zero, recompute=recompute,
                  schedule=schedule, virtual_stages=v, micro_batch=train.micro_batch, microbatches=m, global_batch=g,
                  seq=seq,                  optimizer=train.optimizer, precision=train.precision, offload_optimizer=train.offload_optimizer,
                  offload_params=train.offload_params, fp8=train.fp8, cp_mode=cp_mode,
                  offload_activations=train.offload_activations, resident_blocks=train.resident_blocks)


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
    if layout.offload_activations != Tier.NONE:
        off.check_activation_offload_plan(layout.offload_activations, pp=layout.pp, has_shape=shape is not None)


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
        dp = max(1, world // (tp * pp)) if world else (train.dp or 1)  # the tree shrinks tp·pp > world later
        st = mem.model_state_bytes_per_rank(num_params, zero=ZeroPolicy(stage=1), dp=dp, tp=tp, pp=pp)
        return st.total <= cluster.usable_memory_bytes / 2

    rec = recipes.recommend(
        num_params, gpus=world, gpus_per_node=gpn, nvlink=acc.nvlink, layers=shape.layers if shape else None,
        tp_dims=dims, seq=train.seq or (shape.seq if shape else None), model_state_fits=state_fits,
        num_experts=shape.num_experts if shape else 0, expert_params=shape.expert_params if shape else 0,
    )  # fmt: skip
    if world is None:
        rec = replace(rec, dp=train.dp)
    rec = _recommend_cp(model, cluster, train, rec)

    # The tree's own layout (its sizes; only the batch flags from the user) and the cheapest recompute that fits it.
    rec_train = replace(train, tp=None, pp=None, cp=None, sp=None, zero=None, schedule=None,
                        virtual_stages=None, dp=None, ep=None)
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
    shard = lay.dims.dp_shard * lay.cp
    # At ep > 1 the routed experts leave the dense ZeRO collectives: they get their own over efsdp (the stage's at
    # ZeRO 1-3, an all-reduce at ZeRO-0), and every MoE block dispatches its tokens over ep (moe.py).
    own_experts = shape.expert_params / (lay.tp * lay.pp * lay.ep) if shape is not None and lay.ep > 1 else 0.0
    # Each rank runs m micro-batches per step; with ZeRO-2/3 each one triggers its own reduce-scatter/gathers.
    collectives = list(comm_.dp_comm_bytes(psi_mp - own_experts * lay.ep, zero=lay.zero, dp=shard, grad_bytes=gb,
                                           param_bytes=pb, grad_accum_steps=lay.microbatches))
    collectives += comm_.replicate_comm_bytes(psi_mp, zero=lay.zero, shard=shard, replicate=lay.dims.dp_replicate,
                                              grad_bytes=gb, grad_accum_steps=lay.microbatches)
    moe = None
    if shape is not None and shape.num_experts:
        moe = replace(moe_.moe_report(shape, ep=lay.ep, dp=lay.dp, tokens_per_rank=lay.micro_batch * lay.seq // lay.cp,
                                      activation_bytes=element, zero=lay.zero, tp=lay.tp, pp=lay.pp,
                                      microbatches=lay.microbatches, param_bytes=pb, grad_bytes=gb, optimizer_bytes=k),
                      expert_state_bytes_per_rank=memory.experts.total)  # fmt: skip
    if moe is not None and lay.ep > 1:
        collectives += moe_.expert_collectives(own_experts, zero=lay.zero, efsdp=lay.efsdp, grad_bytes=gb,
                                               param_bytes=pb, microbatches=lay.microbatches)  # fmt: skip
        dispatched = moe.alltoall_bytes_per_step if moe.dispatcher == "alltoall" else moe.allgather_bytes_per_step
        collectives.append(comm_.Collective(f"ep {moe.dispatcher} (tokens, dispatch+combine)", "ep", dispatched))
    layers_per_stage = math.ceil(shape.layers / lay.pp) if shape else 0
    per_rank_layers = layers_per_stage * lay.microbatches
    seq_local = lay.seq // lay.cp
    if shape is not None and lay.tp > 1:
        per = comm_.tp_comm_bytes_per_layer(seq=seq_local, micro_batch=lay.micro_batch, hidden=shape.hidden,
                                            tp=lay.tp, element_bytes=element, recompute=lay.recompute)
        kind = "reduce-scatter+all-gather" if lay.sp else "all-reduce"
        collectives.append(comm_.Collective(f"tp {kind} (activations)", "tp", per * per_rank_layers))
    cp_report = None
    if shape is not None and lay.cp > 1:
        cp_report = comm_.cp_report(shape, lay, train.cp_mode, element)
        per = cp_report.bytes_per_layer[lay.cp_mode.value]
        name = ("cp all-to-all (q,k,v,out)" if lay.cp_mode == CPMode.ULYSSES
                else "cp all-gather/reduce-scatter (K,V)")
        collectives.append(comm_.Collective(name, "cp", per * per_rank_layers))
    if shape is not None and lay.pp > 1:
        per = comm_.pp_comm_bytes_per_microbatch(seq=seq_local, micro_batch=lay.micro_batch, hidden=shape.hidden,
                                                 tp=lay.tp, element_bytes=element, virtual_stages=lay.virtual_stages)
        collectives.append(comm_.Collective("pp send/recv (activations, grads)", "pp", per * lay.microbatches))
    comm_time = dispatch_s = 0.0
    nodes = math.ceil(lay.gpus / gpn)
    for c in collectives:
        # tp and cp groups are consecutive ranks, and an ep group spans ep of them (ep innermost in dp_shard)
        group = lay.tp * lay.cp * {"ep": lay.ep, "dp": lay.dims.dp_shard}.get(c.axis, 1)  # dp: one shard group
        intra = nodes == 1 or (c.axis in ("tp", "cp", "ep", "dp") and group <= gpn)
        seconds = c.bytes_per_step / (acc.intra_node_bytes_per_s if intra else acc.inter_node_bytes_per_s)
        comm_time += seconds
        dispatch_s += seconds if c.axis == "ep" else 0.0

    bubble = bubble_fraction(lay.schedule, pp=lay.pp, microbatches=lay.microbatches,
                             virtual_stages=lay.virtual_stages, op_times=train.op_times, p2p_s=train.p2p_time)
    tokens = lay.global_batch * lay.seq
    if shape is not None:
        hw = thr.flops_per_token(shape, seq=lay.seq, recompute=lay.recompute) * tokens
        model_flops = thr.flops_per_token(shape, seq=lay.seq) * tokens
    else:
        hw = thr.flops_per_token_from_params(num_params, recompute=lay.recompute) * tokens
        model_flops = thr.flops_per_token_from_params(num_params) * tokens
    peak = acc.peak_flops_for(lay.precision) * cap.core_share(cluster, lay.gpus)  # cpu: ranks share the cores
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
    act_offload = None
    if lay.offload_activations != Tier.NONE:
        # one block's share of the step's compute, split by FLOPs: the forward is a third of the model FLOPs
        # (Narayanan 2021 Eq. 3), the rest (backward and any recompute) is backward
        block_s = compute_s / (lay.microbatches * shape.layers)
        fwd_s = block_s * (model_flops / 3) / hw
        act_offload = off.activation_offload(
            tier=lay.offload_activations, bytes_per_block=memory.activation_per_layer, layers=shape.layers,
            resident_blocks=lay.resident_blocks, microbatches=lay.microbatches, forward_s_per_block=fwd_s,
            backward_s_per_block=block_s - fwd_s, pcie_bytes_per_s=cluster.pcie_gbps * GB,
            nvme_bytes_per_s=cluster.nvme_gbps * GB,
        )  # fmt: skip
    step_s = compute_s + offload_s + (act_offload.exposed_s_per_step if act_offload is not None else 0.0)

    # A checkpoint holds the parameters and the optimizer state (master included) of every rank; each node writes
    # its own ranks' shards in parallel.
    ckpt_rank_bytes = memory.param + memory.optimizer
    write_s = train.checkpoint_write_s or res.checkpoint_write_s(
        ckpt_rank_bytes * min(gpn, lay.gpus), write_bytes_per_s=cluster.storage_gbps * GB
    )
    mtbf_s = res.cluster_mtbf_s(cluster.node_mtbf_hours * 3600.0, nodes)

    warnings = recipes.anti_pattern_warnings(
        lay.dims, sp=lay.sp, zero=lay.zero, gpus_per_node=gpn, microbatches=lay.microbatches,
        offload_params=lay.offload_params, offload_optimizer=lay.offload_optimizer, fp8=lay.fp8,
    )  # fmt: skip
    if act_offload is not None and not act_offload.hides:
        warnings.append(act_offload.warning())
    if moe is not None:
        traffic_line = moe_.traffic_warning(dispatch_s, compute_s=compute_s, shape=shape, ep=lay.ep, gpus_per_node=gpn)
        warnings += [traffic_line] if traffic_line else []
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
    checks = cap.capacity_checks(memory.tiers, cluster, gpus=lay.gpus)
    warnings += [fit] if fit else []
    warnings += [c.warning() for c in checks if c.tier != "device" and not c.fits]
    return Plan(
        model=model, cluster=cluster, layout=layout, recommendation=rec, recommended_recompute=rec_recompute,
        memory=memory, collectives=tuple(collectives), comm_time_s=comm_time, bubble=bubble, flops_per_step=hw,
        model_flops_per_step=model_flops, mfu_assumed=train.mfu, step_time_s=step_s, offload_traffic=traffic,
        offload_time_s=offload_s,
        checkpoint_write_s=write_s, cluster_mtbf_s=mtbf_s, young_s=res.young_interval_s(write_s, mtbf_s),
        daly_s=res.daly_interval_s(write_s, mtbf_s), warnings=tuple(warnings), notes=tuple(notes),
        bubble_inputs=_bubble_inputs(train), moe=moe, cp=cp_report, activation_offload=act_offload, capacity=checks,
    )  # fmt: skip


def _recommend_cp(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec,
                  rec: recipes.Recommendation) -> recipes.Recommendation:
    """The tree's "+CP for long sequences" (design §17.4): at seq >= ``recipes.LONG_SEQUENCE``, for a dense layout
    without tp, pp or ep (what V17Strategy composes cp with), when it does not fit at cp = 1 even with full recompute, the smallest power-of-two cp (dividing the world over
    tp·pp and the sequence by 2cp, for head-tail chunks) whose layout fits with some recompute; cp = 1 otherwise."""
    shape, world = model.shape, cluster.gpus
    seq = train.seq or (shape.seq if shape is not None else None)
    if shape is None or world is None or seq is None or seq < recipes.LONG_SEQUENCE or train.cp is not None:
        return rec
    if rec.tp > 1 or rec.pp > 1 or rec.ep > 1 or (train.ep or 1) > 1 or shape.num_experts:
        return rec  # V17Strategy composes cp with data parallelism (ZeRO) only: the note stays a note
    base = replace(train, tp=None, pp=None, cp=None, sp=None, zero=None, schedule=None, virtual_stages=None, dp=None,
                   ep=None, recompute=None)
    cp, group = 1, rec.tp * rec.pp
    while world % (group * cp) == 0 and seq % (2 * cp) == 0:
        try:
            lay = _layout(model, cluster, replace(base, cp=cp), replace(rec, cp=cp), Recompute.FULL)
        except V17ConfigError:
            break
        if memory_for(model, lay).tiers.gpu <= cluster.usable_memory_bytes:
            if cp == 1:
                return rec
            note = (f"seq={seq}: the activations at cp=1 do not fit; cp={cp} ({lay.cp_mode.value}) splits them "
                    f"over {cp} ranks of each row")
            notes = tuple(n for n in rec.notes if "add context parallelism" not in n) + (note,)
            return replace(rec, cp=cp, dp=world // (group * cp), notes=notes)
        cp *= 2
    return rec


def _bubble_inputs(train: TrainSpec) -> str:
    """The op times of the bubble simulation, in words, for the report."""
    t = train.op_times
    words = "T_F = T_B = T_W" if t is None else f"T_F:T_B:T_W = {t.forward:g}:{t.backward_input:g}:{t.backward_weight:g}"
    if t is not None and t.varies:
        words += f", CV {t.forward_cv:g}/{t.backward_input_cv:g}/{t.backward_weight_cv:g}"
    if train.p2p_time:
        words += f", P2P {train.p2p_time:g}"
    return words


CPReport = comm_.CPReport

__all__ = ["CPReport", "ClusterSpec", "Layout", "Memory", "ModelSpec", "Plan", "TrainSpec", "make_plan", "memory_for"]
