"""The ONE place that composes the parallelism axes for any ``nn.Module`` (torchtitan's ``parallelize_llama``, for any
model): validate once, then PP split -> (FP8) -> TP -> activation checkpointing -> ZeRO (-> offload) -> identical
initial weights on every replica.

Why this order (torchtitan's, and Megatron's before it):

1. **PP split first**: it prunes the model in place to this rank's stages, so everything after it only touches (and
   allocates) the local stages.
2. **FP8** (``engine/fp8/convert.py``): the blocks' Linears become torchao ``Float8Linear`` after the split (each pipeline
   stage converts its own blocks) and before TP and ZeRO (torchtitan's order: model converters, then parallelize),
   so TP gives the converted Linears torchao's float8 styles (``Float8ColwiseParallel``/``Float8RowwiseParallel``)
   and FSDP2 shards the converted modules (with float8 all-gather at ZeRO-3 for ``tensorwise``).
3. **TP** before ZeRO: TP turns parameters into DTensors on the ``tp`` axis; ``fully_shard`` then adds the dp axis
   on top and sees one uniform 2-D layout (FSDP2 + TP, torchtitan's ``apply_fsdp`` after ``apply_tp``).
4. **Activation checkpointing** wraps the blocks' ``forward`` after TP (so recomputation replays the TP
   collectives' local ops) and before ``fully_shard`` (whose hooks sit around ``__call__`` and unshard before the
   recomputation); it patches the blocks' ``forward`` and keeps their (converted) children.
5. **ZeRO** last; with stage 3 the meta-device model is materialized shard by shard afterwards.
6. **Replicas agree**: every parameter is broadcast over the axes it is replicated on (``dp_replicate`` for HSDP,
   the whole ``dp`` group at stages 0-2, ``tp`` for tp-replicated parameters), so ranks that drew different random
   initial weights never train different replicas.
7. **Parameter offload** (``offload_params="nvme"``, ``engine/offload/params.py``) once the shards are final: each
   FSDP2 group's shards go to the nvme tier and come back only around their all-gathers and the optimizer step.

The function knows no model family: plans (a TP plan, a pipeline layout, a loss) are handed to it, resolved by the
caller from the user's options, the LightningModule's hooks or the model's own plan (``lightning_v17.models``).
It does not import Lightning and is tested without it (``tests/dist/test_parallelize.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_v17.config import FP8Recipe, ParallelDims, Recompute, Tier, TrainingPolicy, V17ConfigError
from lightning_v17.config.rules import check as check_rules
from lightning_v17.engine._dtensor import local as _local
from lightning_v17.engine.ep.apply import ExpertParallel, apply_expert_parallel, check_pipeline_moe, is_expert_param
from lightning_v17.engine.fp8.convert import FP8Runtime, apply_fp8, float8_tp_plan
from lightning_v17.engine.recompute import apply_activation_checkpointing
from lightning_v17.engine.state import state_of
from lightning_v17.engine.zero import fsdp as fsdp_engine
from lightning_v17.engine.zero import stages_0_2 as zero_engine
from lightning_v17.engine.zero.backend import ZeroBackend
from lightning_v17.engine.zero.meta_init import materialize_meta_module
from lightning_v17.mesh import MeshRuntime, expert_shard_mesh

__all__ = ["Parallelized", "apply_zero_stage", "check_composition", "parallelize", "parallelized", "sync_replicas"]

log = logging.getLogger(__name__)


@dataclass
class Parallelized:
    """What :func:`parallelize` did to a module, and the objects that run it.

    Attributes:
        module: the same module, transformed in place.
        zero: the applied ZeRO stage (ask it what is sharded, how to sync, how to save the optimizer).
        pipeline: the pipeline runtime when pp > 1 (``engine.pipeline.PipelineRuntime``), else None.
        units: the repeated blocks (recompute units and ZeRO-3 FSDP units); empty if the model has none.
        recompute: the activation checkpointing mode applied to ``units``.
        fp8_layers: FQNs of the Linears converted to float8 (empty without ``policy.fp8``).
        fp8: the FP8 runtime (``engine.fp8.FP8Runtime``: float8 all-gather scales after each optimizer step), or
            None without ``policy.fp8``.
        ep: the expert parallelism applied with ep > 1 (``engine.ep.ExpertParallel``), else None.
        activations: the activation offload of ``units`` (``engine.offload.activations.ActivationOffload``) with
            ``OffloadPolicy(activations="nvme"|"cpu")``, else None; closed (its files removed) by the strategy's
            teardown.
    """

    module: nn.Module
    zero: ZeroBackend
    pipeline: Any
    units: list[nn.Module]
    recompute: Recompute
    fp8_layers: tuple[str, ...] = ()
    fp8: FP8Runtime | None = None
    ep: ExpertParallel | None = None
    activations: Any = None


def parallelized(module: nn.Module) -> Parallelized | None:
    """What :func:`parallelize` did to ``module`` (None: it has not run on it)."""
    return state_of(module).parallel


def check_composition(policy: TrainingPolicy, dims: ParallelDims) -> None:
    """The combinations of options that cannot work, refused before any process touches the model: every rule of
    :mod:`lightning_v17.config.rules` on ``dims`` (the axis sizes: the strategy's ``ParallelDims``, or the mesh's
    ``MeshSpec``), then the pipeline schedule's own limits.

    Raises:
        V17ConfigError: naming the option and the fix.
    """
    check_rules(policy, dims)
    pp = dims.pp
    if pp > 1:
        from lightning_v17.config.schedules import schedule_info

        info = schedule_info(policy.pipeline.schedule)
        info.check_runnable()
        info.check_microbatches(pp=pp, microbatches=policy.pipeline.microbatches)


def _units(module: nn.Module, policy: TrainingPolicy) -> list[nn.Module]:
    units = fsdp_engine.find_wrap_units(module, policy.zero.wrap_classes)
    if units:
        return units
    fix = (
        f"{type(module).__name__} has no repeated blocks (no nn.ModuleList/ModuleDict of blocks was found); name "
        "the block classes with wrap_classes=[...] (e.g. wrap_classes=['DecoderLayer'])"
    )
    if policy.recompute != Recompute.NONE:
        raise V17ConfigError(f"activation_checkpointing={policy.recompute.value!r} checkpoints each block, but {fix}")
    if policy.zero.shards_params:
        log.warning("zero_stage=3: the whole model is one FSDP unit (all-gathered at once), because %s", fix)
    return units


def apply_zero_stage(
    module: nn.Module,
    *,
    mesh: MeshRuntime,
    policy: TrainingPolicy,
    device: torch.device,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    steps_inside_forward: bool = False,
    pipeline_stages: Any = (),
) -> ZeroBackend:
    """Apply ``policy.zero`` (and parameter offload) over the data-parallel axes; materialize what is still on meta.

    Args:
        module: the (already split / tensor-parallel / checkpointed) model.
        mesh: the live mesh.
        policy: the training policy (``zero``, ``offload``).
        device: where parameters live.
        param_dtype: stage 3 compute dtype (FSDP2 ``MixedPrecisionPolicy``); None keeps the parameters' dtype.
        reduce_dtype: gradient reduction dtype.
        steps_inside_forward: stage 3: the module's step hook steps optimizers inside itself (Lightning's manual
            optimization), so each parameterized child becomes a unit of its own (``apply_fsdp``'s
            ``child_units``).
        pipeline_stages: with pp > 1, this rank's stage modules: at stage 3 each is an FSDP2 root of its own
            (``apply_fsdp``'s ``pipeline_stages``).
    """
    z = policy.zero
    engine = zero_engine.apply_zero(
        module,
        stage=z.stage,
        mesh=mesh.device_mesh,
        bucket_mb=z.bucket_mb,
        optimizer_partition=z.optimizer_partition,
        reshard_after_forward=z.reshard_after_forward,
        wrap_classes=z.wrap_classes,
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
        offload_params=policy.offload.params == Tier.CPU,
        overlap_comm=z.overlap_comm,
        prefetch_units=z.prefetch_units,
        child_units=steps_inside_forward,
        offload_experts=policy.offload.params != Tier.NONE,  # the tier moves FSDP2 units: the experts in units too
        pipeline_stages=pipeline_stages,
    )
    # Only what is still on the meta device (meta_init, empty_init): weights loaded in configure_model are kept.
    # Into the nvme tier unit by unit (_attach_param_offload) where nothing between needs the values.
    if not _streams_into_tier(policy, mesh):
        materialize_meta_module(module, device=device)
    return ZeroBackend(
        module,
        stage=z.stage,
        engine=engine,
        shard_group=mesh.group(mesh.zero_axis),
        shard_size=mesh.spec.dp_shard * mesh.spec.cp,
        partition=z.optimizer_partition,
    )


def _streams_into_tier(policy: TrainingPolicy, mesh: MeshRuntime) -> bool:
    """Whether a meta-device model is materialized straight into the nvme tier, unit by unit: parameters on nvme at
    stage 3, and no replica axis whose broadcast (:func:`sync_replicas`, between ZeRO and the tier) needs every
    shard in memory at once (dp_replicate, tp, an expert-data axis)."""
    return (
        policy.offload.params == Tier.NVME and policy.zero.shards_params and policy.fp8 is None
        and mesh["dp_replicate"].size() == 1 and mesh["tp"].size() == 1 and mesh.spec.ep == 1
    )  # fmt: skip


def _attach_param_offload(
    module: nn.Module, backend: ZeroBackend, policy: TrainingPolicy, device: torch.device | None = None
) -> None:
    """``OffloadPolicy(params="nvme")``: the FSDP2 groups' shards to the nvme tier (root group first, then the units in
    module order, i.e. forward order); the optimizer's step then streams them (``ZeroBackend.prepare_optimizers``).
    A model still on the meta device is materialized into the tier here, each unit written once it is initialized."""
    if policy.offload.params != Tier.NVME or not backend.shards_params:
        return
    if backend.param_offload is not None and not backend.param_offload.closed:
        return
    from torch.distributed.fsdp import FSDPModule

    from lightning_v17.engine.offload.params import ParamOffload

    backend.param_offload = ParamOffload(
        [m for m in module.modules() if isinstance(m, FSDPModule)], nvme_path=policy.offload.nvme_path,
        rank=dist.get_rank() if dist.is_initialized() else 0, prefetch_units=policy.zero.prefetch_units,
        buffer_count=policy.offload.buffer_count, host_memory=policy.offload.host_memory,
        materialize=lambda after_group: materialize_meta_module(
            module, device=device or torch.device("cpu"), after_group=after_group
        ),
    )  # fmt: skip


def _activation_offload(
    units: list[nn.Module],
    policy: TrainingPolicy,
    device: torch.device | str,
    current: Any = None,
    pipeline: Any = None,
) -> Any:
    """``OffloadPolicy(activations=)``: the blocks' saved tensors to the nvme or cpu tier, attached after recompute
    and ZeRO (``engine/offload/activations.py``), for blocks computing on ``device`` (with ``offload_params`` their
    shards are on the host); ``current`` is kept while it is open (a later fit re-attaches). Under pp the pipeline
    runtime runs each stage forward under the offload's ``micro_batch(i)`` (a pass per micro-batch)."""
    off = policy.offload
    if off.activations == Tier.NONE or (current is not None and not current.closed):
        return current
    passes_in_flight = 1 if pipeline is None else pipeline.policy.microbatches
    from lightning_v17.engine.offload.activations import ActivationOffload

    offload = ActivationOffload(
        units, tier=off.activations, nvme_path=off.nvme_path, min_bytes=int(off.activation_min_kb * 1024),
        resident_blocks=off.resident_blocks, rank=dist.get_rank() if dist.is_initialized() else 0,
        option="OffloadPolicy(activations=...)", device=device, passes_in_flight=passes_in_flight,
    )  # fmt: skip
    if pipeline is not None:
        pipeline.activations = offload
    return offload


def _tp_sharded(t: torch.Tensor) -> bool:
    """Whether a (DTensor) parameter is split on some mesh axis other than the data-parallel ones: its local pieces
    differ across tp ranks by construction and must not be broadcast over tp."""
    mesh = getattr(t, "device_mesh", None)
    if mesh is None:
        return False
    names = mesh.mesh_dim_names or ()
    return any(pl.is_shard() for name, pl in zip(names, t.placements) if name == "tp")


@torch.no_grad()
def sync_replicas(module: nn.Module, *, mesh: MeshRuntime, backend: ZeroBackend) -> None:
    """Broadcast every parameter and buffer over the mesh axes it is replicated on, from the first rank of each.

    * ``dp_replicate`` (HSDP) at stage 3, the whole ``dp`` group at stages 0-2 (DDP's ``_sync_module_states``);
    * ``tp`` for what TP leaves replicated (norms, unsharded embeddings, plain tensors outside the plan);
    * ``edp`` (and ``tp``) for the experts sharded over ``ep`` (each ep rank holds other experts).

    Ranks that drew different random initial weights (a different seed per rank, or RNG streams that diverged
    before ``fit``) then hold one model; without it HSDP replicas would train apart for the whole run.
    ``dp_shard`` pieces of a stage-3 parameter are disjoint and ``pp`` stages hold different parameters, so neither
    axis is broadcast over.
    """
    tensors = [t for t in (*module.parameters(), *module.buffers()) if not t.is_meta]
    experts = [t for t in tensors if is_expert_param(t)]  # different on each ep rank: one copy per edp rank
    tensors = [t for t in tensors if not is_expert_param(t)]
    dp_axis = "dp_replicate" if backend.shards_params else mesh.replica_axis
    axes = [(dp_axis, tensors), ("tp", [t for t in tensors if not _tp_sharded(t)])]
    if experts and mesh["edp"].size() > 1:  # dp_replicate x efsdp (x cp)
        axes.append(("edp", experts))
    if experts:  # ep x tp: every tp rank holds (and runs) the same experts
        axes.append(("tp", experts))
    for axis, group_tensors in axes:
        if mesh[axis].size() > 1 and group_tensors:
            # _broadcast_coalesced takes the source as a rank *within* the group (its first rank is 0 there).
            dist._broadcast_coalesced(mesh.group(axis), [_local(t).data for t in group_tensors], 250 * 2**20, 0)


def parallelize(
    module: nn.Module,
    *,
    mesh: MeshRuntime,
    policy: TrainingPolicy,
    device: torch.device | str,
    tp_plan: Mapping[str, Any] | Callable[[nn.Module, Any], None] | None = None,
    pp_layout: Any = None,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    steps_inside_forward: bool = False,
) -> Parallelized:
    """Apply every parallelism axis of ``policy`` to ``module`` in place, in torchtitan's order; see the module doc.

    Calling it again on the same module (Lightning runs ``validate``/``test`` after ``fit``) re-attaches only what
    the previous run's teardown removed (the stage 0-2 gradient hooks); the structure is never transformed twice.

    Args:
        module: any ``nn.Module`` (a LightningModule too); parameters may be on the meta device at stage 3.
        mesh: the live 5-axis mesh (``MeshRuntime``).
        policy: the parsed options (ZeRO, offload, pipeline, recompute, sequence parallel, FP8).
        device: the device of this rank.
        tp_plan: with tp > 1, the resolved TP plan (``{fqn or wildcard: style}`` or a callable that applies itself;
            see ``lightning_v17.models.tp_plans.resolve_tp_plan``).
        pp_layout: with pp > 1, how to cut the model (``engine.pipeline.PipelineLayout``; see
            ``lightning_v17.models.pp_layouts.model_pipeline_layout``).
        loss_fn: with pp > 1, an optional ``loss_fn(logits, micro_batch) -> mean loss`` (the LightningModule's
            ``pipeline_loss``); None: token-mean cross-entropy against ``labels``.
        param_dtype: stage 3 compute dtype for mixed precision.
        reduce_dtype: gradient reduction dtype.
        steps_inside_forward: the module's step hook steps optimizers inside itself (Lightning's manual
            optimization); see :func:`apply_zero_stage`.

    Returns:
        A :class:`Parallelized` holding the ZeRO backend, the pipeline runtime (pp > 1) and the units.

    Raises:
        V17ConfigError: an unsupported combination, a missing plan or layout, recompute without blocks.
    """
    device = torch.device(device)
    done: Parallelized | None = state_of(module).parallel
    if done is not None:
        if not done.zero.active:
            done.zero = apply_zero_stage(
                module, mesh=mesh, policy=policy, device=device, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                steps_inside_forward=steps_inside_forward,
            )  # fmt: skip
            if done.ep is not None:
                done.ep.grad_sync.attach()
                done.zero.expert_sync = done.ep.grad_sync
        _attach_param_offload(module, done.zero, policy)  # again after a teardown brought the shards back
        done.activations = _activation_offload(done.units, policy, device, done.activations, done.pipeline)
        return done
    spec = mesh.spec
    check_composition(policy, spec)
    if spec.pp > 1 and pp_layout is None:
        raise V17ConfigError(
            f"pp={spec.pp} needs to know where to cut {type(module).__name__}: models shaped embedding -> blocks -> "
            "norm -> head (the reference Llama, Hugging Face *ForCausalLM, litgpt GPT) are split automatically; for "
            "another model give the LightningModule a pipeline layout, or use pp=1"
        )
    if spec.tp > 1 and tp_plan is None:
        raise V17ConfigError(
            f"tp={spec.tp} needs a tensor-parallel plan for {type(module).__name__}: pass "
            "V17Strategy(tp=TPPolicy(plan={fqn: style})) (parallelize(tp_plan=...) without Lightning), define "
            "configure_tensor_parallel(mesh) or a tp_plan dict on the LightningModule, or use a model that ships one "
            "(the reference Llama, Hugging Face models' base_model_tp_plan)"
        )

    pipeline = None
    check_pipeline_moe(module, pp=spec.pp)  # MoE balance terms the pipeline would drop or miscount
    if spec.pp > 1:  # 1. cut the model into this rank's stages (in place; FQNs kept)
        from lightning_v17.engine.pipeline.runtime import build_schedule, split_model

        stage_modules, stage_ids = split_model(
            module, layout=pp_layout, pp_rank=mesh.rank("pp"), pp=spec.pp, policy=policy.pipeline
        )
    units = _units(module, policy)
    fp8_layers: tuple[str, ...] = ()
    fp8 = None
    if policy.fp8 is not None:  # 2. the blocks' Linears to float8 (engine/fp8/convert.py), before TP reshapes them
        gather8 = policy.fp8.float8_all_gather(zero=policy.zero)
        fp8_layers = apply_fp8(
            module, policy=policy.fp8, units=units, device=device, float8_all_gather=gather8, tp=spec.tp
        )
        fp8 = FP8Runtime(
            module, fp8_layers, float8_all_gather=gather8, delayed=policy.fp8.recipe == FP8Recipe.DELAYED,
            amax_groups=tuple(mesh.group(a) for a in ("dp", "tp") if mesh[a].size() > 1),
        )  # fmt: skip
        if spec.tp > 1:  # torchao's float8 tensor-parallel styles for the converted Linears
            tp_plan = float8_tp_plan(module, tp_plan, layers=fp8_layers)
    if spec.tp > 1:  # 3. DTensor plans over the tp axis
        from lightning_v17.engine.tp.apply import apply_tensor_parallel

        apply_tensor_parallel(module, tp_mesh=mesh["tp"], plan=tp_plan)
    ep = None
    if spec.ep > 1:  # 3b. the MoE layers' experts over ep, all-to-all dispatch (engine/ep/)
        ep = apply_expert_parallel(
            module, ep_mesh=mesh["ep"], edp_group=mesh.group("edp") if mesh["edp"].size() > 1 else None,
            dp=spec.dp * spec.cp,  # the experts' gradients average over dp x cp, as the dense ones do
            dispatcher=policy.expert.dispatcher.value, cp=spec.cp,
            # ZeRO over efsdp (stages 1-3) reduces the experts' gradients itself
            reduce_grads=not (policy.zero.shards_optimizer and expert_shard_mesh(
                mesh.device_mesh, offloaded=policy.offload.params != Tier.NONE) is not None),
        )
    apply_activation_checkpointing(module, mode=policy.recompute, units=units)  # 4. recompute the blocks
    backend = apply_zero_stage(  # 5. ZeRO over the dp axes (+ parameter offload); materialize a meta model
        module, mesh=mesh, policy=policy, device=device, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
        steps_inside_forward=steps_inside_forward, pipeline_stages=stage_modules if spec.pp > 1 else (),
    )  # fmt: skip
    backend.expert_sync = ep.grad_sync if ep is not None else None
    if fp8 is not None:
        fp8.init_state()  # delayed scaling: fresh histories (a materialized meta model's buffers are garbage)
    sync_replicas(module, mesh=mesh, backend=backend)  # 6. one model on every replica
    if fp8 is not None:
        fp8.refresh_weight_scales()  # float8 all-gather: whole-weight scales from the first step on (see FP8Runtime)
    _attach_param_offload(module, backend, policy, device)  # 7. parameter shards to nvme, once they are final
    if spec.pp > 1:
        pipeline = build_schedule(
            stage_modules,
            stage_ids=stage_ids,
            pp_mesh=mesh["pp"],
            policy=policy.pipeline,
            device=device,
            loss_fn=loss_fn,
            shift_labels=getattr(pp_layout, "shift_labels", False),
        )
    out = Parallelized(
        module=module, zero=backend, pipeline=pipeline, units=units, recompute=policy.recompute, fp8_layers=fp8_layers,
        fp8=fp8, ep=ep, activations=_activation_offload(units, policy, device, pipeline=pipeline),  # 8. saved tensors
    )
    state_of(module).parallel = out
    return out
