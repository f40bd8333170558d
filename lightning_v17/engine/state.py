"""What V17 keeps on the torch objects it changes: one :class:`ModuleState` per ``nn.Module`` and one
:class:`OptimizerState` per optimizer, in the object's ``__dict__`` under one key.

FSDP2 keeps its own state the same way, one ``FSDPState`` per module (``torch.distributed.fsdp._fully_shard``'s
``_get_module_fsdp_state``). One object, not loose attributes: ``state_of(module)`` lists every field V17 may have set,
and a plain ``__dict__`` entry is neither a submodule nor a parameter, so it never shows in ``named_modules``,
``state_dict`` or an FQN.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["ModuleState", "OptimizerState", "optimizer_state", "peek", "state_of"]

_KEY = "_v17_state"


@dataclass
class ModuleState:
    """V17's state on one ``nn.Module``; every field is unset (None/False/()) until the engine sets it.

    Attributes:
        parallel: on the module given to ``parallelize``: what it did (``engine.parallelize.Parallelized``).
        fsdp_root: on that module at ZeRO-3: the FSDP2 root module the step hooks gather through.
        root_reshard: on the FSDP2 root: the root's own ``reshard_after_forward`` (kept across pipeline micro-batches).
        sharded: on the FSDP2 root: the FSDP2 units under it, outermost first.
        in_step: on the FSDP2 root: inside the optimizer step (the units are gathered for it).
        steps_inside: on the FSDP2 root: the optimizer steps inside the schedule's backward (no gather around it).
        recompute: on a block: the activation checkpointing mode its forward was wrapped with.
        loss_wired: on a Hugging Face causal LM: its ``loss_function`` divides by the step's token count.
        reduce_scatter: on an FSDP2 unit: the custom reduce-scatter installed on it (``engine.collectives``).
    """

    parallel: Any = None
    fsdp_root: Any = None
    root_reshard: Any = False
    sharded: tuple = ()
    in_step: bool = False
    steps_inside: bool = False
    recompute: Any = None
    loss_wired: bool = False
    reduce_scatter: Any = None


@dataclass
class OptimizerState:
    """V17's state on one optimizer.

    Attributes:
        zero: the ZeRO-1/2 engine that partitioned its state (dense parameters).
        zero_experts: the ZeRO-1/2 engine that partitioned its experts' state (ep > 1).
        owner_step: the step that updates each shard on its owner (``engine.zero.owner_step``).
        offload: the optimizer tier that holds its state off the device (``engine.offload.optimizer``).
        local_step: its ``step`` runs on the local shards of DTensor parameters (``optim.local_step``).
    """

    zero: Any = None
    zero_experts: Any = None
    owner_step: Any = None
    offload: Any = None
    local_step: bool = False


def _get(obj: Any, cls: type, create: bool) -> Any:
    d = getattr(obj, "__dict__", None)
    if d is None:
        return None
    st = d.get(_KEY)
    if st is None and create:
        st = d[_KEY] = cls()
    return st


def state_of(module: Any) -> ModuleState:
    """The module's :class:`ModuleState`, created empty on first use."""
    return _get(module, ModuleState, True)


def peek(obj: Any) -> Any:
    """The object's state (:class:`ModuleState` or :class:`OptimizerState`) if V17 set any, else None."""
    return _get(obj, object, False)


def optimizer_state(optimizer: Any, *, create: bool = True) -> OptimizerState | None:
    """The optimizer's :class:`OptimizerState` (created empty on first use unless ``create=False``). Lightning's
    ``LightningOptimizer`` is looked through to the optimizer it wraps."""
    optimizer = getattr(optimizer, "_optimizer", optimizer)
    return _get(optimizer, OptimizerState, create)
