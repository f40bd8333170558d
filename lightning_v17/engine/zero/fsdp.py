"""ZeRO-3 with FSDP2: wrap units, ``fully_shard``, the root around step hooks, ``no_sync``.

Stage 3 shards parameters, gradients and optimizer state with FSDP2 ``fully_shard`` per unit (the repeated blocks,
found automatically or named by class) plus one root for everything outside them (:func:`apply_fsdp`); a
LightningModule's step hooks run as that root's forward (:func:`run_as_forward`), since Lightning never calls its
``forward``. On gloo the groups use the all-to-all collectives of :mod:`lightning_v17.engine.collectives`. A model
built on the meta device is materialized by :mod:`lightning_v17.engine.zero.meta_init`. Stages 0-2 are
:mod:`lightning_v17.engine.zero.stages_0_2`.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from lightning_v17.config import V17ConfigError
from lightning_v17.engine._dtensor import local as _local
from lightning_v17.engine.collectives import install_fsdp_comms, is_cpu_gloo
from lightning_v17.engine.ep.apply import find_moe_layers, is_expert_param
from lightning_v17.engine.state import state_of

# re-exported: strategies/v17.py and engine/parallelize.py reach them as ``fsdp_engine.<name>``

__all__ = [
    "after_optimizer_step",
    "apply_fsdp",
    "find_wrap_units",
    "fsdp_root",
    "optimizer_steps_inside",
    "run_as_forward",
    "set_cpu_prefetch",
    "set_requires_gradient_sync",
]


def find_wrap_units(module: nn.Module, wrap_classes: Sequence[str] = ()) -> list[nn.Module]:
    """The modules that become ZeRO-3 units, outermost first.

    With ``wrap_classes`` (class names), every module of one of those classes (not nested in another match).
    Otherwise the children of every ``nn.ModuleList``, and of every ``nn.ModuleDict`` whose children share one class
    (the repeated transformer blocks), as torchtitan and Lightning's docs shard them.
    """
    names = set(wrap_classes)
    units: list[nn.Module] = []
    taken: set[int] = set()

    def visit(m: nn.Module) -> None:
        for child in m.children():
            if names:
                if type(child).__name__ in names:
                    units.append(child)
                    continue
            elif isinstance(child, (nn.ModuleList, nn.ModuleDict)):
                blocks = list(child.children())
                repeated = isinstance(child, nn.ModuleList) or len({type(b) for b in blocks}) == 1
                if repeated and blocks and any(True for _ in child.parameters()):
                    for b in blocks:
                        if id(b) not in taken and any(True for _ in b.parameters()):
                            taken.add(id(b))
                            units.append(b)
                    continue
            visit(child)

    visit(module)
    if names and not units:
        raise V17ConfigError(
            f"wrap_classes={sorted(names)} matched no submodule; use class names of the model's blocks, e.g. "
            f"{sorted({type(m).__name__ for m in module.modules()})[:8]}"
        )
    return units


def apply_fsdp(
    module: nn.Module,
    *,
    mesh: Any,
    reshard_after_forward: bool | None = None,
    wrap_classes: Sequence[str] = (),
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    offload_params: bool = False,
    overlap_comm: bool = True,
    prefetch_units: int = 1,
    child_units: bool = False,
    expert_mesh: Any = None,
    expert_divide_factor: float | None = None,
    pipeline_stages: Sequence[nn.Module] = (),
) -> list[nn.Module]:
    """ZeRO-3 with FSDP2: ``fully_shard`` each unit, then one root for everything outside the units.

    The root is the FSDP2 root module: the first to run forward, it holds the parameters outside the units, and its
    lazy init gives every unit under it one shared communication context (FSDP2's ``_lazy_init``). When everything
    outside the units sits in one child (a LightningModule holding ``self.model``), that child is the root and the
    LightningModule's class is left alone. Otherwise (several such children, parameters owned by ``module`` itself,
    units outside that one child, or ``child_units``) ``module`` itself is the root, as in FSDP2's usual
    ``fully_shard(model)``. :func:`fsdp_root` returns it.

    A LightningModule's step hooks (``training_step``, ...) are not its forward: Lightning calls them directly, so the
    root's forward hooks (which gather the root's parameters) would never run. The strategy runs each step hook *as*
    the root's forward (:func:`run_as_forward`), and with ``child_units`` lets optimizers step inside it
    (:func:`optimizer_steps_inside`). Why the root's gather around the step hook rather than making every child a
    unit: a step hook may use parameters without calling the module that holds them (a head tied to the embedding
    through ``embed.weight``, ``self.model.lm_head`` called past the model's forward, a parameter of the
    LightningModule itself), and a unit's parameters exist only inside its own call: only a group gathered for the
    whole hook covers those uses, and FSDP2's root hooks then keep backward consistent (the pre-backward hook on the
    returned loss, the root's reduce-scatter in its post-backward callback, the units' prefetch in both directions).

    ``child_units`` is for step hooks that step optimizers inside themselves (Lightning's manual optimization: a GAN
    steps the discriminator, then runs it again for the generator's loss). A group gathered once for the whole hook
    would then hold copies that are stale after a step and that ignore ``toggle_optimizer``'s ``requires_grad``
    changes; a unit is gathered from its current shards at every call, with the current ``requires_grad``. So every
    parameterized child outside the units (looking through ``nn.ModuleList``/``nn.ModuleDict`` containers, which
    are never called) becomes a unit of its own (children sharing a parameter one grouped unit, FSDP2's
    ``fully_shard([a, b])``), and the root keeps only ``module``'s own parameters, gathered again after each
    optimizer step (:func:`after_optimizer_step`). Those children must then be called to use their parameters.

    Args:
        module: the model (parameters may be on the meta device: FSDP2 shards meta tensors too).
        mesh: 1-D ``dp_shard`` mesh, or the 2-D (``dp_replicate``, ``dp_shard``) mesh for HSDP.
        reshard_after_forward: free each unit's gathered parameters after its forward. None (default): True for
            every unit except the last one and the root, which backward needs first, so they stay gathered from
            forward to backward as in FSDP2's root and torchtitan. An explicit True frees the root too, at the end
            of its forward (the whole step hook under the strategy, not a call of the model inside it).
        wrap_classes: unit class names (empty: auto-detect repeated blocks).
        param_dtype: compute dtype (FSDP2 ``MixedPrecisionPolicy.param_dtype``); the sharded fp32 parameter is the
            master copy.
        reduce_dtype: gradient reduce-scatter dtype (fp32 for mixed precision).
        offload_params: keep sharded parameters (and gradients) on CPU (FSDP2 ``CPUOffloadPolicy``).
        overlap_comm: on CPU over gloo, overlap the collectives with compute: all-gather the next
            ``prefetch_units`` units asynchronously while the current one computes (forward and backward, see
            :func:`set_cpu_prefetch`) and leave gradient reduce-scatters in flight until the end of backward
            (:class:`~lightning_v17.engine.collectives.DeferredReduceScatters`). Results are bitwise unchanged.
            Elsewhere (CUDA/NCCL) FSDP2 overlaps on its own streams and this changes nothing.
        prefetch_units: how many units ahead to all-gather (DeepSpeed's ``stage3_prefetch_bucket_size``, counted in
            units as FSDP2's ``set_modules_to_forward_prefetch``); each one more keeps one more unit gathered.
            0: no prefetch (the reduce-scatters still overlap with ``overlap_comm``).
        child_units: every parameterized child outside the units is a unit of its own and the root holds only
            ``module``'s own parameters (see above): for step hooks that step optimizers inside themselves.
        expert_mesh: with experts sharded over ``ep`` (``engine/ep``), the mesh that shards them further
            (``efsdp``, or ``(dp_replicate, efsdp)``: :func:`lightning_v17.mesh.expert_shard_mesh`): every MoE layer's
            ``experts`` becomes a unit of its own over it (:func:`_shard_experts`). None: the experts stay outside
            FSDP2 (``ignored_params``), reduced by ``engine/ep``.
        expert_divide_factor: what the experts' summed gradients are divided by (the whole data-parallel degree).
        pipeline_stages: with pp > 1, this rank's pipeline stages (``engine/pipeline``'s ``StageModule``s, which
            share the pruned model's modules): each is the root of its own units instead of one root for ``module``
            (:func:`_shard_pipeline_stages`); ``reshard_after_forward=None`` then keeps every unit gathered.

    Returns:
        The modules that were sharded (units first, then the child units, then the root).
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    # under pp the default keeps the units gathered across the step's micro-batches (_shard_pipeline_stages)
    rsf = not pipeline_stages if reshard_after_forward is None else bool(reshard_after_forward)
    kw = {
        "mesh": mesh,
        "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
        # Pinned host memory needs an accelerator ("Cannot access accelerator device when none is available" on a
        # CPU-only machine), and pinning buys nothing there: host and device are the same memory.
        "offload_policy": CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload_params else OffloadPolicy(),
    }
    expert_units = [] if expert_mesh is None else _shard_experts(module, expert_mesh, expert_divide_factor, rsf, kw)
    experts = {p for p in module.parameters() if is_expert_param(p)}
    if experts:  # sharded over ep already, reduced by engine/ep: outside every FSDP2 group
        kw["ignored_params"] = experts
    units = find_wrap_units(module, wrap_classes)
    if pipeline_stages:
        sharded = _shard_pipeline_stages(module, pipeline_stages, units, rsf=rsf, kw=kw, overlap_comm=overlap_comm,
                                         prefetch_units=prefetch_units)  # fmt: skip
        if expert_units:
            install_fsdp_comms(expert_units, expert_mesh.get_group(expert_mesh.ndim - 1))
        return expert_units + sharded
    # Parameter identities before sharding (fully_shard replaces each module's parameters with DTensor ones).
    in_units = {id(p) for u in units for p in u.parameters()}
    unit_ids = {id(u) for u in units}

    def outside_units(m: nn.Module) -> bool:
        return any(id(p) not in in_units for p in m.parameters())

    residual = [c for c in module.children() if id(c) not in unit_ids and outside_units(c)]
    own = any(True for _ in module.parameters(recurse=False))
    groups = _child_unit_groups(module, unit_ids, in_units) if child_units else []
    for i, u in enumerate(units):
        # torchtitan's optimization: by default the last unit is not resharded after forward, because backward
        # starts with it and would all-gather it again at once (one all-gather of one block saved per step).
        last_default = reshard_after_forward is None and i == len(units) - 1
        fully_shard(u, reshard_after_forward=False if last_default else rsf, **kw)
    child_mods: list[nn.Module] = []
    for g in groups:
        fully_shard(g if len(g) > 1 else g[0], reshard_after_forward=rsf, **kw)
        child_mods.extend(g)
    # The root (embeddings, final norm, head) runs first in forward and its parameters are needed first in backward.
    # Freeing it after forward only to all-gather it again at once costs one extra all-gather per step (for a 128k
    # vocab: the embedding and head, ~2 GB in bf16). FSDP2 keeps its root unsharded for this reason; with the default
    # (reshard_after_forward=None) we do the same. An explicit True is honoured at the end of the root's forward.
    root_rsf = False if reshard_after_forward is None else rsf
    single = residual[0] if len(residual) == 1 and not own and not child_units else None
    inside = {id(m) for m in single.modules()} if single is not None else set()
    if single is not None and all(id(u) in inside for u in units):
        # A LightningModule wrapping one model: that model is the root, and the LightningModule's class is left alone.
        root: nn.Module | None = single
    elif units or groups or residual or own:
        # One FSDP root must own everything outside the units: FSDP2 refuses a multi-module group as the root
        # ("FSDP requires a single root module"), and units outside one common root would each be a root of their
        # own, with their own communication context (prefetching across them fails: an uninitialized context has no
        # ``device_handle``). So ``module`` itself is the root (FSDP2's usual ``fully_shard(model)``).
        root = module
    else:
        root = None
    if root is not None:
        fully_shard(root, reshard_after_forward=False, **kw)
        # Gathered for the whole of its forward (the step hook): a call of the model inside it must not free it; an
        # explicit reshard_after_forward=True is applied at the end of that forward (run_as_forward).
        state_of(root).root_reshard = root_rsf
    state_of(module).fsdp_root = root
    sharded = units + child_mods + ([root] if root is not None else [])
    # On gloo, reduce-scatter and all-gather as one all_to_all each (engine/collectives.py: ~2x and ~1.5x faster);
    # NCCL keeps FSDP2's native collectives.
    shard_group = mesh.get_group(mesh.ndim - 1) if mesh.ndim > 1 else mesh.get_group()
    # On CPU, FSDP2's streams are no-ops: every all-gather and reduce-scatter runs synchronously on the main thread.
    # gloo runs async work on its own threads, so issuing them async is what overlaps them with compute here.
    cpu_overlap = overlap_comm and mesh.device_type == "cpu" and is_cpu_gloo(shard_group)
    # HSDP all-reduces each reduce-scatter output at once inside FSDP2, so only a 1-D shard mesh defers them.
    install_fsdp_comms(sharded, shard_group, defer_reduce_scatter=cpu_overlap and mesh.ndim == 1)
    if expert_units:
        install_fsdp_comms(expert_units, expert_mesh.get_group(expert_mesh.ndim - 1))
        sharded = expert_units + sharded
    if cpu_overlap and prefetch_units > 0:
        # The chain runs over the units only: the child units of manual optimization run in whatever order the step
        # hook calls them (and some not at all in a given backward), so they are gathered when called.
        set_cpu_prefetch(units, root, depth=prefetch_units)
    if root is not None:
        state_of(root).sharded = tuple(sharded)
        root.register_forward_hook(lambda m, args, out: reshard_after_no_grad(m))
    return sharded


def _shard_pipeline_stages(
    module: nn.Module, stages: Sequence[nn.Module], units: list[nn.Module], *, rsf: bool, kw: dict[str, Any],
    overlap_comm: bool, prefetch_units: int,
) -> list[nn.Module]:
    """ZeRO-3 under pp (torchtitan's ``apply_fsdp`` per model part): every local pipeline stage is an FSDP2 root over
    its own units and holds the rest of its parameters (the embedding on the first stage, the norm and head on the
    last); ``module`` gets no root (:func:`fsdp_root` is None), since the schedule, not a step hook, calls the stages.

    torch's ``PipelineStage`` drives an FSDP2 stage itself (``torch/distributed/pipelining/stage.py``): every
    micro-batch's backward runs with ``set_requires_gradient_sync(False)`` and ``set_reshard_after_backward(False)``,
    and after the last one ``perform_reduce_grad`` reduce-scatters the accumulated gradients once and reshards. With
    ``rsf`` False (the default under pp: torchtitan's ``reshard_after_forward = not pp_enabled``) the units stay
    gathered from the first micro-batch's forward to that reduce-scatter: one all-gather and one reduce-scatter per
    unit per step, as at pp = 1, instead of one pair per micro-batch (1F1B interleaves the micro-batches' forwards
    and backwards, so a unit freed after a forward is gathered again m times). True frees each unit after every
    forward (less memory, m all-gathers per unit per step).
    """
    from torch.distributed.fsdp import fully_shard

    sharded: list[nn.Module] = []
    for stage in stages:
        inside = {id(m) for m in stage.modules()}
        mine = [u for u in units if id(u) in inside]
        for u in mine:
            fully_shard(u, reshard_after_forward=rsf, **kw)
        fully_shard(stage, reshard_after_forward=rsf, **kw)
        group = [*mine, stage]
        shard_group = kw["mesh"].get_group(kw["mesh"].ndim - 1) if kw["mesh"].ndim > 1 else kw["mesh"].get_group()
        cpu_overlap = overlap_comm and kw["mesh"].device_type == "cpu" and is_cpu_gloo(shard_group)
        # the reduce-scatters run in perform_reduce_grad, outside backward: nothing to defer them to
        install_fsdp_comms(group, shard_group)
        if cpu_overlap and prefetch_units > 0:
            set_cpu_prefetch(mine, stage, depth=prefetch_units)
        state_of(stage).sharded = tuple(group)
        stage.register_forward_hook(lambda m, args, out: reshard_after_no_grad(m))
        sharded.extend(group)
    state_of(module).fsdp_root = None
    return sharded


def reshard_after_no_grad(root: nn.Module) -> None:
    """After a forward under ``no_grad`` (validation, test, predict), free every unit that stayed gathered.

    The root and the last unit are not resharded after forward, because backward needs them first; a forward without
    a backward left them gathered until the next one. FSDP2 copies a shard's ``requires_grad`` onto its gathered
    parameter only when it gathers it, so a flag changed in between (``BaseFinetuning`` unfreezes a backbone at the
    start of an epoch, right after validation) never reached the units that stayed gathered: their gradients were
    not produced in the next step. Called after the root's forward (and after the step hook that the strategy runs
    as the root's forward, :func:`run_as_forward`)."""
    if torch.is_grad_enabled() or state_of(root).in_step:
        return  # inside a step hook, the hook may still use the root's parameters: at its end
    for m in state_of(root).sharded:
        m.reshard()


def _shard_experts(module: nn.Module, mesh: Any, divide: float | None, rsf: bool, kw: dict) -> list[nn.Module]:
    """ZeRO-3 over the experts (torchtitan's ``dp_mod_ep`` FSDP, Megatron-core's expert data parallelism): each MoE
    layer's ``experts`` (weights already ``Shard(0)`` over ``ep``) is its own FSDP2 unit over ``mesh``, the ranks that
    hold the same experts. The local experts are split on dim 0 (FSDP2 writes it ``_StridedShard``) while there are
    at least as many as ranks in ``mesh``'s shard dim, else on dim 1 (torchtitan's rule; dim 1 must then divide).

    A local expert's gradient is the sum over every ep rank's tokens (the all-to-all's backward); the unit sums it
    over ``mesh`` and divides by ``divide`` (the whole data-parallel degree), once: the same mean as the dense units'
    (FSDP2 alone would divide by ``mesh``'s size). The sum goes through SUM collectives and a division after them
    (``set_force_sum_reduction_for_comms``): gloo has no PREMUL_SUM. The weights lose the ep mark (FSDP2 registers
    new parameters): from here on FSDP2 owns them, and the replica sync treats them like any stage-3 shard.
    """
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    ways = mesh.size(mesh.ndim - 1)

    def placement(p: nn.Parameter) -> Shard:
        local = _local(p)
        if local.shape[0] >= ways:
            return Shard(0)
        if local.dim() < 2 or local.shape[1] % ways:
            raise V17ConfigError(
                f"ZeRO-3 over the experts splits each rank's {local.shape[0]} local experts over {ways} ranks on "
                f"dim 1, which has {local.shape[1] if local.dim() > 1 else 0} rows ({tuple(p.shape)}): choose ep so "
                f"that dp_shard/ep <= num_experts/ep, or an expert width that {ways} divides"
            )
        return Shard(1)

    out = []
    for _, layer in find_moe_layers(module):
        experts = layer.experts
        if not any(is_expert_param(p) for p in experts.parameters()):
            continue
        fully_shard(experts, reshard_after_forward=rsf, shard_placement_fn=placement, **{**kw, "mesh": mesh})
        if ways > 1:  # a one-rank shard dim (offloaded experts at efsdp = 1) runs no reduce-scatter: FSDP2's copy
            experts.set_force_sum_reduction_for_comms(True)  # divides by `divide`, and a forced sum would again
        if divide is not None:
            experts.set_gradient_divide_factor(float(divide))
        out.append(experts)
    return out


def _child_unit_groups(module: nn.Module, unit_ids: set[int], in_units: set[int]) -> list[list[nn.Module]]:
    """``child_units``: the parameterized children of ``module`` outside the units, looking through
    ``nn.ModuleList``/``nn.ModuleDict`` containers (never called themselves), grouped so that children sharing a
    parameter (a tied embedding and head) form one group; in module order."""
    cands: list[nn.Module] = []

    def visit(m: nn.Module) -> None:
        for c in m.children():
            if id(c) in unit_ids or not any(id(p) not in in_units for p in c.parameters()):
                continue
            if isinstance(c, (nn.ModuleList, nn.ModuleDict)):
                visit(c)
            else:
                cands.append(c)

    visit(module)
    groups: list[list[nn.Module]] = []
    owner: dict[int, list[nn.Module]] = {}  # parameter id -> its group
    for c in cands:
        hit: list[list[nn.Module]] = []
        for p in c.parameters():
            g = owner.get(id(p))
            if g is not None and all(g is not h for h in hit):
                hit.append(g)
        group = hit[0] if hit else []
        if not hit:
            groups.append(group)
        for other in hit[1:]:  # this child ties groups together: one group
            group.extend(other)
            other.clear()
        group.append(c)
        for m in group:
            for p in m.parameters():
                if id(p) not in in_units:
                    owner[id(p)] = group
    order = {id(c): i for i, c in enumerate(cands)}
    return [sorted(g, key=lambda m: order[id(m)]) for g in groups if g]


def fsdp_root(module: nn.Module) -> nn.Module | None:
    """The FSDP2 root :func:`apply_fsdp` made for ``module`` (``module`` itself or its one model), or None when
    ``module`` was not sharded by it."""
    return state_of(module).fsdp_root


def run_as_forward(root: nn.Module, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """Call ``fn(*args, **kwargs)`` (a LightningModule's step hook) as the forward of the FSDP2 ``root``.

    FSDP2's root pre-forward runs first (lazy init on the first call, the root's all-gather, the first units'
    prefetch) and its post-forward after (the pre-backward hook on the returned loss, so that backward gathers the
    root again if it was freed, prefetches the last units and reduce-scatters the root's gradients in FSDP2's final
    callback). The hooks are called directly, not through ``root.__call__``: the step's batch is not the model's
    input (FSDP2 would cast its floating-point tensors to ``param_dtype``; the model's own call inside the hook still
    casts its inputs), and forward hooks the user registered on the model must not see a forward that is not one.
    The model's own forward, called inside ``fn``, runs FSDP2's hooks again as a nested call of the same state,
    which then finds the root gathered and leaves it so.
    """
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    state = root._get_fsdp_state()  # type: ignore[operator]
    rsf = state_of(root).root_reshard
    state._pre_forward(root, (), {})
    state_of(root).in_step = True
    try:
        out = fn(*args, **kwargs)
    finally:
        state_of(root).in_step = False
    # A call of the root's own forward nested in the hook ran its post-forward already and left the group idle, and
    # FSDP2's reshard() frees an idle group whatever reshard_after_forward says: back in forward, the post-forward
    # below honours it (else the root is freed here and all-gathered again at the start of backward).
    for g in state._fsdp_param_groups:
        g._training_state = TrainingState.FORWARD
    if rsf:  # an explicit reshard_after_forward=True frees the root at the end of its forward, the step hook
        root.set_reshard_after_forward(True, recurse=False)  # type: ignore[operator]
    try:
        return state._post_forward(root, (), out)
    finally:
        if rsf:
            root.set_reshard_after_forward(False, recurse=False)  # type: ignore[operator]
        reshard_after_no_grad(root)


@contextmanager
def optimizer_steps_inside(root: nn.Module) -> Generator[None, None, None]:
    """Around a step hook that steps optimizers inside itself (manual optimization), run with :func:`run_as_forward`.

    The root's own parameters (a LightningModule's ``nn.Parameter`` attributes, gathered for the whole hook) stay
    gathered across the backward passes inside it (each one still reduce-scatters their gradients) and are gathered
    again after every optimizer step (:func:`after_optimizer_step`), so each use inside the hook sees the current
    values; they are freed when the hook ends, so that the next one gathers them from the shards whatever ran in
    between. A root without parameters of its own needs nothing (the child units gather themselves at each call).
    """
    state = root._get_fsdp_state()  # type: ignore[operator]
    if not any(g.fsdp_params for g in state._fsdp_param_groups):
        yield
        return
    root.set_reshard_after_backward(False, recurse=False)  # type: ignore[operator]
    state_of(root).steps_inside = True
    try:
        yield
    finally:
        state_of(root).steps_inside = False
        root.set_reshard_after_backward(True, recurse=False)  # type: ignore[operator]
        root.reshard()  # type: ignore[operator]


@torch.no_grad()
def after_optimizer_step(module: nn.Module, optimizer: Any = None) -> None:
    """After an optimizer step inside :func:`optimizer_steps_inside`: gather the root's own parameters again from
    their (just stepped) shards. Those that ``optimizer`` updated (it holds them and they had a gradient) get their
    autograd version bumped, so that a graph saved before the step fails in backward exactly as under DDP, whose
    step updates the parameter in place (FSDP2's copy into the gathered parameter preserves the version: it expects
    the same values). Elsewhere a no-op."""
    root = fsdp_root(module)
    if root is None or not state_of(root).steps_inside:
        return
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    state = root._get_fsdp_state()  # type: ignore[operator]
    opt = optimizer
    held = None if opt is None else {id(p) for g in opt.param_groups for p in g["params"]}
    stepped = []
    for g in state._fsdp_param_groups:
        for fp in g.fsdp_params:
            if (held is None or id(fp.sharded_param) in held) and fp.sharded_param.grad is not None:
                stepped.append(fp)
        # reshard() is a no-op while FSDP2 thinks the group is in forward and keeps it gathered (it is: the hook is
        # the root's forward); outside forward it frees the gathered copy, and unshard() all-gathers it anew.
        with g.use_training_state(TrainingState.IDLE):
            g.reshard()
    root.unshard()  # type: ignore[operator]
    for fp in stepped:
        torch.autograd.graph.increment_version(fp.unsharded_param)


def set_cpu_prefetch(units: Sequence[nn.Module], root: nn.Module | None, *, depth: int) -> bool:
    """Explicit asynchronous prefetch of the next ``depth`` units' all-gathers, in forward and in backward.

    FSDP2's implicit prefetch relies on CUDA streams; on CPU its unshards are synchronous (``async_op=False``). Here
    every unit unshards with ``async_op=True`` (FSDP2 waits on the handle in the unit's own pre-forward/pre-backward)
    and names the units it prefetches (FSDP2's ``set_modules_to_forward_prefetch`` /
    ``set_modules_to_backward_prefetch``): the root prefetches the first ``depth`` units (last ones in backward),
    unit ``i`` the units ``i+1 .. i+depth`` in forward and ``i-1 .. i-depth`` in backward. Forward order is assumed
    to be the order of ``units`` (module order); a unit that runs out of that order is still waited for correctly,
    it only overlaps less. Returns False (nothing set) on a torch without FSDP2's ``_set_unshard_async_op``.
    """
    units = list(units)
    mods = [*units, *([root] if root is not None else [])]
    if not all(hasattr(m, "_set_unshard_async_op") for m in mods):
        return False
    for m in mods:
        m._set_unshard_async_op(True)
    for i, u in enumerate(units):
        if units[i + 1 : i + 1 + depth]:
            u.set_modules_to_forward_prefetch(units[i + 1 : i + 1 + depth])
        if i > 0:
            u.set_modules_to_backward_prefetch(units[max(0, i - depth) : i][::-1])
    if root is not None and units:
        root.set_modules_to_forward_prefetch(units[:depth])
        root.set_modules_to_backward_prefetch(units[::-1][:depth])
    return True


def set_requires_gradient_sync(module: nn.Module, requires: bool) -> None:
    """FSDP2's ``no_sync``: toggle gradient reduce-scatter on every FSDP module under ``module``."""
    from torch.distributed.fsdp import FSDPModule

    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.set_requires_gradient_sync(requires, recurse=False)
