"""Deferred (meta-device) init: build a model without storage, then allocate and initialize only what is still on meta.

``ZeroPolicy(meta_init=True)`` runs ``configure_model`` on the meta device (:func:`deferred_init`), refusing loads
there; after ZeRO-3 has sharded the model, :func:`materialize_meta_module` gives each tensor still on meta storage
for this rank's shard only and initializes it, tensor by tensor, never touching what was loaded. The same path serves
Lightning's ``trainer.init_module(empty_init=True)`` and a user's own ``torch.device("meta")``.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_v17.config import V17ConfigError
from lightning_v17.engine._dtensor import local as _local

__all__ = ["deferred_init", "has_meta", "materialize_meta_module"]


def has_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


class _RefuseMetaLoads(TorchFunctionMode):
    """Refuse copying real values into a meta tensor: torch drops them silently (the meta device holds no data), and
    the tensor would later be initialized afresh, so a ``load_state_dict`` (its ``param.copy_``) would be lost."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.copy_ and args:
            dst = args[0]
            src = args[1] if len(args) > 1 else kwargs.get("src")
            if isinstance(src, torch.Tensor) and dst.is_meta and not src.is_meta:
                raise V17ConfigError(
                    "configure_model copied values into a tensor on the meta device (a load: load_state_dict, a "
                    "checkpoint): ZeroPolicy(meta_init=True) builds configure_model on the meta device, where they "
                    "are lost and the tensor is initialized afresh. Load with load_state_dict(..., assign=True) (the "
                    "loaded tensors then stay and only what is still on meta is initialized), or keep meta_init=False "
                    "(the default) to load weights in configure_model"
                )
        return func(*args, **kwargs)


@contextmanager
def deferred_init() -> Generator[None, None, None]:
    """Build on the meta device (``ZeroPolicy(meta_init=True)``, around ``configure_model``), refusing loads.

    Inside, modules are built without storage; :func:`materialize_meta_module` later allocates only each rank's
    shards and initializes them. A value copied into a meta tensor (``load_state_dict``) raises
    :class:`~lightning_v17.config.V17ConfigError` instead of being dropped silently, and any other error (transformers'
    ``from_pretrained`` refuses the meta device) gets a note naming the option.
    """
    with torch.device("meta"), _RefuseMetaLoads():
        try:
            yield
        except Exception as err:
            err.add_note(
                "lightning-v17: configure_model ran on the meta device because ZeroPolicy(meta_init=True); build there "
                "only what init_weights()/reset_parameters() initialize, or keep meta_init=False (the default) to load "
                "weights (from_pretrained, load_state_dict) in configure_model"
            )
            raise


@contextmanager
def _keep_values(module: nn.Module, fresh: set[int]) -> Generator[None, None, None]:
    """Restore, after an init call on ``module``, every tensor of its subtree that was not just allocated (ids in
    ``fresh``): an init method writes all of its module's tensors, and a loaded one must keep its value. Tensors
    still on meta, and shards already handed to their tier (no storage in memory), have nothing to keep."""
    kept = [
        (name, is_param, _local(t).clone())
        for is_param, named in ((True, module.named_parameters()), (False, module.named_buffers()))
        for name, t in named
        if id(t) not in fresh and not t.is_meta and _local(t).untyped_storage().nbytes() > 0
    ]
    yield
    for name, is_param, value in kept:
        t = module.get_parameter(name) if is_param else module.get_buffer(name)  # an init may replace a buffer
        _local(t).copy_(value)


def _materialize_param(p: nn.Parameter, device: torch.device) -> None:
    """Storage on ``device`` for one meta parameter, keeping the Parameter object: tied parameters stay one tensor
    and FSDP2 keeps its reference to the sharded parameter. ``to_empty`` instead registers a new Parameter per
    module for a plain tensor (meta and real tensors cannot share ``.data``), which unties tied weights."""
    torch.utils.swap_tensors(p, nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad))


def _materialize_fsdp_param(fp: Any, device: torch.device) -> None:
    """Storage for one ZeRO-3 shard still on meta, allocated as FSDP2's own padded shard storage
    (``FSDPParam._sharded_param_data``, what its all-gather copies from) with the parameter's local tensor a view of
    it, as ``fully_shard`` lays out a real parameter. A fresh tensor of the local shape instead (``empty_like`` on
    the DTensor) left FSDP2 a meta storage until its lazy init re-padded the shard into a new one: the nvme tier,
    which takes the shards before that, found no storage of FSDP2's to point at its files."""
    from torch.distributed.tensor import DTensor

    p = fp.sharded_param
    dim = fp.fsdp_placement.dim
    local = p._local_tensor
    length = local.size(dim) if local.numel() > 0 else 0
    where = torch.device("cpu") if fp.offload_to_cpu else device  # OffloadPolicy(params="cpu"): FSDP2 keeps it there
    padded = torch.zeros(fp.padded_sharded_param_size, dtype=p.dtype, device=where)  # the padding is zeros in FSDP2
    shard = DTensor.from_local(
        padded.narrow(dim, 0, length), p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
    )
    torch.utils.swap_tensors(p, nn.Parameter(shard, requires_grad=p.requires_grad))
    fp._sharded_param_data = padded.view(-1)


def _owners(fp: Any) -> list[tuple[nn.Module, str]]:
    """The (module, name) pairs that register FSDP2 parameter ``fp`` (tied weights: several)."""
    mi = fp._module_info
    return [(mi.module, mi.param_name), *zip(mi.shared_modules, mi.shared_param_names)]


def _gatherable(fp: Any) -> bool:
    """Whether ``fp`` is a plain parameter that FSDP2 alone shards (its rows over the shard axis, replicated over
    HSDP's): its init can run on the whole tensor, of which each rank keeps its rows. A tensor-parallel piece is
    initialized on its shard."""
    return not getattr(fp, "is_dtensor", True) and not getattr(fp.mesh_info, "is_spmd_mesh", False)


def _gather_unit(fps: list[Any], device: torch.device) -> list[tuple[Any, nn.Parameter, torch.Tensor]]:
    """Whole tensors for a unit's meta parameters, registered in their modules in place of the sharded parameters (an
    init method then sees the tensor a single process builds)."""
    out = []
    for fp in fps:
        p = fp.sharded_param
        whole = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), requires_grad=p.requires_grad)
        for m, name in _owners(fp):
            m._parameters[name] = whole
        out.append((fp, p, whole))
    return out


def _shard_unit(gathered: list[tuple[Any, nn.Parameter, torch.Tensor]], device: torch.device) -> None:
    """Each rank keeps its rows of the whole tensors (FSDP2's own chunking) in FSDP2's shard storage; the sharded
    parameters go back into their modules."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import _chunk_with_empty

    for fp, p, whole in gathered:
        _materialize_fsdp_param(fp, device)
        rows = _chunk_with_empty(whole.detach(), fp.mesh_info.shard_mesh_size, dim=fp.fsdp_placement.dim)
        local = p._local_tensor
        if local.numel():
            local.copy_(rows[fp.mesh_info.shard_mesh_rank])
        for m, name in _owners(fp):
            m._parameters[name] = p


def _fsdp_groups(module: nn.Module) -> list[Any]:
    """The FSDP2 parameter groups under ``module``, in module order (a root's group before its units')."""
    groups = []
    for m in module.modules():
        state = m._get_fsdp_state() if hasattr(m, "_get_fsdp_state") else None
        g = None if state is None else state._fsdp_param_group
        if g is not None:
            groups.append(g)
    return groups


def _init_calls(module: nn.Module, meta: set[int]) -> list[tuple[nn.Module, str, list[torch.Tensor]]]:
    """The init methods that give the tensors in ``meta`` (ids) their values, in module order, each with the meta
    tensors it writes: the outermost modules defining ``init_weights()`` their subtree, every other module owning
    such a tensor its ``reset_parameters()``.

    Raises:
        V17ConfigError: if a module with a meta parameter has neither method.
    """

    def owned(m: nn.Module, recurse: bool, *, params_only: bool = False) -> list[torch.Tensor]:
        ts = m.parameters(recurse=recurse) if params_only else (*m.parameters(recurse=recurse), *m.buffers(recurse))
        return [t for t in ts if id(t) in meta]

    calls: list[tuple[nn.Module, str, list[torch.Tensor]]] = []
    covered: set[int] = set()
    for m in module.modules():  # outermost first
        if id(m) in covered:
            continue
        if callable(getattr(m, "init_weights", None)) and (ts := owned(m, recurse=True)):
            calls.append((m, "init_weights", ts))
            covered.update(id(x) for x in m.modules())
    missing = set()
    for m in module.modules():
        if id(m) in covered or not (ts := owned(m, recurse=False)):
            continue
        if callable(getattr(m, "reset_parameters", None)):
            calls.append((m, "reset_parameters", ts))
        elif owned(m, recurse=False, params_only=True):
            missing.add(type(m).__name__)
    if missing:
        raise V17ConfigError(
            f"deferred init (the model was built on the meta device: ZeroPolicy(meta_init=True) or "
            f"empty_init=True) cannot initialize {sorted(missing)}: give them reset_parameters() or an init_weights() "
            f"on an enclosing module, or build the model with real tensors (meta_init=False, the default)"
        )
    order = {id(m): i for i, m in enumerate(module.modules())}
    return sorted(calls, key=lambda c: order[id(c[0])])  # init_weights subtrees and reset_parameters in module order


@torch.no_grad()
def materialize_meta_module(
    module: nn.Module, *, device: torch.device, after_group: Callable[[Any], None] | None = None
) -> None:
    """Allocate and initialize the parameters and buffers that are still on the meta device, and only those.

    A model, or part of one, built on the meta device (``ZeroPolicy(meta_init=True)``, Lightning's
    ``trainer.init_module(empty_init=True)``, the user's own ``torch.device("meta")``) has no values yet. Each
    tensor still on meta gets storage on ``device`` (for a ZeRO-3 parameter only this rank's shard, in FSDP2's own
    shard storage: the full model is never materialized on one rank). The modules that own such a tensor initialize
    it (a ZeRO-3 unit whose init calls write only that unit on its whole tensors, each rank keeping its rows, so the
    values are those of one process with the same random state; a tensor-parallel piece, or a unit an init call
    shares with others, on its shards): the outermost ones defining ``init_weights()`` their subtree (torchtitan's convention), every other one its
    ``reset_parameters()``, in module order. Tensors that were not on meta (weights loaded in ``configure_model``,
    with ``load_state_dict(assign=True)`` or next to a meta-built part) are never re-initialized: per tensor, not
    per module (``to_empty`` would give a module's loaded tensors new storage too), and an init call that also
    writes them (``reset_parameters`` of a module whose other tensors were meta, ``init_weights`` over a partly
    loaded subtree) has their values restored.

    ZeRO-3 units stream: a unit's shards are allocated just before the first init call that writes them, and once
    its last one has run, ``after_group(group)`` (the FSDP2 parameter group) may take them (the nvme tier writes them
    to its files and frees them). With per-module inits (``reset_parameters``, or an ``init_weights`` per block) a
    rank then holds a few units' shards at a time, not its whole shard of the model; an ``init_weights`` over the
    whole model needs all of them at once. The values do not depend on ``after_group``: the calls run in the same
    order either way.

    Raises:
        V17ConfigError: if a module with a meta parameter has neither method (its weights would be uninitialized
            memory).
    """
    if not has_meta(module):
        return
    meta = {id(t) for t in (*module.parameters(), *module.buffers()) if t.is_meta}
    calls = _init_calls(module, meta)  # refused before anything is allocated
    group_of: dict[int, int] = {}
    groups = _fsdp_groups(module)
    by_param: dict[int, Any] = {}
    for i, g in enumerate(groups):
        for fp in g.fsdp_params:
            if fp.sharded_param.is_meta:
                group_of[id(fp.sharded_param)] = i
                by_param[id(fp.sharded_param)] = fp
    fresh: set[int] = set()
    buffers: dict[int, torch.Tensor] = {}  # a buffer shared by several modules stays one tensor
    for m in module.modules():  # outside the units: now (buffers, parameters no FSDP2 group holds)
        for p in m._parameters.values():
            if p is not None and p.is_meta and id(p) not in group_of:
                _materialize_param(p, device)
                fresh.add(id(p))
        for name, b in list(m._buffers.items()):
            if b is not None and b.is_meta:
                if id(b) not in buffers:
                    buffers[id(b)] = torch.empty_like(b, device=device)
                    fresh.add(id(buffers[id(b)]))
                m._buffers[name] = buffers[id(b)]
    pending = [0] * len(groups)  # init calls still to run per group
    touched = [sorted({group_of[id(t)] for t in ts if id(t) in group_of}) for _, _, ts in calls]
    whole_ok = [True] * len(groups)  # every call writing the unit writes only it: it is initialized whole
    for gs in touched:
        for i in gs:
            pending[i] += 1
            whole_ok[i] = whole_ok[i] and len(gs) == 1
    allocated: dict[int, list[Any]] = {}  # group -> its gathered (whole) parameters, if initialized whole

    def allocate(i: int) -> None:
        if i in allocated:
            return
        fps = [fp for fp in groups[i].fsdp_params if id(fp.sharded_param) in by_param]
        whole = [fp for fp in fps if whole_ok[i] and _gatherable(fp)]
        for fp in fps:
            if fp not in whole:
                _materialize_fsdp_param(fp, device)
        allocated[i] = _gather_unit(whole, device)
        fresh.update(id(x) for x in (*(fp.sharded_param for fp in fps), *(w for _, _, w in allocated[i])))

    def finish(i: int) -> None:
        _shard_unit(allocated[i], device)
        allocated[i] = []
        if after_group is not None:
            after_group(groups[i])

    for (m, method, _), gs in zip(calls, touched):
        for i in gs:
            allocate(i)
        with _keep_values(m, fresh):
            getattr(m, method)()
        for i in gs:
            pending[i] -= 1
            if pending[i] == 0:
                finish(i)
    for i in range(len(groups)):  # meta shards no call writes (buffers-only modules own none; kept for safety)
        if i not in allocated and any(id(fp.sharded_param) in by_param for fp in groups[i].fsdp_params):
            allocate(i)
            finish(i)
