"""ZeRO-3 with FSDP2: wrap units, ``fully_shard``, deferred (meta-device) init and ``no_sync``.

Stage 3 shards parameters, gradients and optimizer state with FSDP2 ``fully_shard`` per unit (the repeated blocks,
found automatically or named by class) plus one group for the residual top-level modules; on gloo the unit groups
use the all-to-all collectives of :mod:`lightning_v17.engine.collectives`. Stages 0-2 are
:mod:`lightning_v17.engine.zero`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lightning_v17.config import V17ConfigError
from lightning_v17.engine.collectives import install_fsdp_comms, is_cpu_gloo

__all__ = [
    "apply_fsdp",
    "find_wrap_units",
    "has_meta",
    "materialize_meta_module",
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
) -> list[nn.Module]:
    """ZeRO-3 with FSDP2: ``fully_shard`` each unit, then the residual top-level children as one group.

    When everything outside the units sits in one child (a LightningModule holding ``self.model``), that child is
    the FSDP root and the LightningModule's class is left alone. Otherwise (several such children, or parameters
    owned by ``module`` itself: any plain ``nn.Module``) ``module`` itself becomes the root, as in FSDP2's usual
    ``fully_shard(model)``.

    Args:
        module: the model (parameters may be on the meta device: FSDP2 shards meta tensors too).
        mesh: 1-D ``dp_shard`` mesh, or the 2-D (``dp_replicate``, ``dp_shard``) mesh for HSDP.
        reshard_after_forward: free each unit's gathered parameters after its forward. None (default): True for
            every unit except the last one and the residual group (embeddings, norm, head), which backward needs
            first, so they stay gathered from forward to backward as in FSDP2's root and torchtitan.
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

    Returns:
        The modules that were sharded (units first, then the residual group members).
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    rsf = True if reshard_after_forward is None else bool(reshard_after_forward)
    kw = {
        "mesh": mesh,
        "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
        # Pinned host memory needs an accelerator ("Cannot access accelerator device when none is available" on a
        # CPU-only machine), and pinning buys nothing there: host and device are the same memory.
        "offload_policy": CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload_params else OffloadPolicy(),
    }
    units = find_wrap_units(module, wrap_classes)
    for i, u in enumerate(units):
        # torchtitan's optimization: by default the last unit is not resharded after forward, because backward
        # starts with it and would all-gather it again at once (one all-gather of one block saved per step).
        last_default = reshard_after_forward is None and i == len(units) - 1
        fully_shard(u, reshard_after_forward=False if last_default else rsf, **kw)
    unit_ids = {id(u) for u in units}
    residual = [c for c in module.children() if id(c) not in unit_ids and any(True for _ in c.parameters())]
    # The residual group (embeddings, final norm, head) runs last in forward and first in backward. Freeing it after
    # forward only to all-gather it again at once costs one extra all-gather per step (for a 128k vocab: the
    # embedding and head, ~2 GB in bf16). FSDP2 keeps its root unsharded for this reason; with the default
    # (reshard_after_forward=None) we do the same. An explicit True is honoured.
    root_rsf = False if reshard_after_forward is None else rsf
    own = any(True for _ in module.parameters(recurse=False))
    if own or len(residual) > 1:
        # One FSDP root must own everything outside the units: FSDP2 refuses a multi-module group as the root
        # ("FSDP requires a single root module"), so shard ``module`` itself (FSDP2's usual root).
        fully_shard(module, reshard_after_forward=root_rsf, **kw)
        root = [module]
    elif residual:
        # A LightningModule wrapping one model: shard that child, and leave the LightningModule's class alone.
        fully_shard(residual[0], reshard_after_forward=root_rsf, **kw)
        root = residual
    else:
        root = []
    sharded = units + root
    # On gloo, reduce-scatter and all-gather as one all_to_all each (engine/collectives.py: ~2x and ~1.5x faster);
    # NCCL keeps FSDP2's native collectives.
    shard_group = mesh.get_group(mesh.ndim - 1) if mesh.ndim > 1 else mesh.get_group()
    # On CPU, FSDP2's streams are no-ops: every all-gather and reduce-scatter runs synchronously on the main thread.
    # gloo runs async work on its own threads, so issuing them async is what overlaps them with compute here.
    cpu_overlap = overlap_comm and mesh.device_type == "cpu" and is_cpu_gloo(shard_group)
    # HSDP all-reduces each reduce-scatter output at once inside FSDP2, so only a 1-D shard mesh defers them.
    install_fsdp_comms(sharded, shard_group, defer_reduce_scatter=cpu_overlap and mesh.ndim == 1)
    if cpu_overlap and prefetch_units > 0:
        set_cpu_prefetch(units, root[0] if root else None, depth=prefetch_units)
    return sharded


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


def has_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


@torch.no_grad()
def materialize_meta_module(module: nn.Module, *, device: torch.device) -> None:
    """Allocate only the local shards of a meta-initialized (and already sharded) model, then initialize them.

    ``to_empty`` allocates each parameter's local storage (the shard, for FSDP2 DTensors); then the outermost
    submodules that define ``init_weights()`` re-initialize themselves (torchtitan's convention), and every other
    module with parameters calls ``reset_parameters()``. The full model is never materialized on one rank.

    Raises:
        V17ConfigError: if a module with parameters has neither method (its weights would be uninitialized memory).
    """
    if not has_meta(module):
        return
    module.to_empty(device=device)
    covered: set[int] = set()
    for m in module.modules():
        if id(m) in covered:
            continue
        if callable(getattr(m, "init_weights", None)):
            m.init_weights()
            covered.update(id(x) for x in m.modules())
    missing = set()
    for m in module.modules():
        if id(m) in covered or not any(True for _ in m.parameters(recurse=False)):
            continue
        if callable(getattr(m, "reset_parameters", None)):
            m.reset_parameters()
        else:
            missing.add(type(m).__name__)
    if missing:
        raise V17ConfigError(
            f"deferred init (zero_stage=3 builds configure_model on the meta device) cannot initialize "
            f"{sorted(missing)}: give them reset_parameters() or an init_weights() on an enclosing module, or build "
            f"the model in __init__ instead of configure_model"
        )


def set_requires_gradient_sync(module: nn.Module, requires: bool) -> None:
    """FSDP2's ``no_sync``: toggle gradient reduce-scatter on every FSDP module under ``module``."""
    from torch.distributed.fsdp import FSDPModule

    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.set_requires_gradient_sync(requires, recurse=False)
