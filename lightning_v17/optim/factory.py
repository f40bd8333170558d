"""The optimizer factory: a name parsed once into :class:`OptimizerName`, the class behind it, and its construction.

``build_optimizer("lion", params, lr=1e-4)`` or ``build_optimizer({"class_path": ..., "init_args": {...}}, params)``:
the second form is what the Lightning CLI writes in YAML. Keyword defaults the target class does not accept (``eps``
for Lion, ``betas`` for Adafactor) or takes with another meaning (Adafactor's ``eps`` pair) are dropped, so a
LightningModule can pass its AdamW hyperparameters to any kind.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from enum import StrEnum
from typing import Any

import torch

from lightning_v17.config import OptimizerKind, V17ConfigError, parse_enum

__all__ = ["OptimizerName", "bitsandbytes_optimizer_base", "build_optimizer", "optimizer_class", "optimizer_kind_of",
           "planner_kind_of"]


class OptimizerName(StrEnum):
    """The optimizers of :mod:`lightning_v17.optim` (AdamW, CPU-Adam, Adam8bit, Adafactor, Lion 32/8-bit).

    The planner's :class:`~lightning_v17.config.OptimizerKind` counts state bytes; :attr:`planner_kind` maps each
    name onto it (CPU-Adam keeps AdamW's fp32 moments).
    """

    ADAMW = "adamw"
    CPU_ADAM = "cpu_adam"
    ADAM8BIT = "adam8bit"
    ADAFACTOR = "adafactor"
    LION = "lion"
    LION8BIT = "lion8bit"

    @classmethod
    def parse(cls, value: Any, option: str = "optimizer") -> OptimizerName:
        return parse_enum(cls, value, option=option)  # type: ignore[return-value]

    @property
    def planner_kind(self) -> OptimizerKind | None:
        """The planner's kind (its bytes per parameter), or None when the planner does not count this one yet."""
        return _PLANNER_KIND.get(self)


_PLANNER_KIND: dict[OptimizerName, OptimizerKind] = {
    OptimizerName.ADAMW: OptimizerKind.ADAMW,
    OptimizerName.CPU_ADAM: OptimizerKind.ADAMW,  # DeepSpeedCPUAdam: fp32 exp_avg + exp_avg_sq
    OptimizerName.ADAM8BIT: OptimizerKind.ADAM8BIT,
    OptimizerName.ADAFACTOR: OptimizerKind.ADAFACTOR,
    OptimizerName.LION: OptimizerKind.LION,
    OptimizerName.LION8BIT: OptimizerKind.LION8BIT,
}

_CLASSES: dict[OptimizerName, str] = {
    OptimizerName.ADAMW: "lightning_v17.optim.library.AdamW",
    OptimizerName.CPU_ADAM: "lightning_v17.optim.library.CPUAdam",
    OptimizerName.ADAM8BIT: "lightning_v17.optim.library.Adam8bit",
    OptimizerName.ADAFACTOR: "lightning_v17.optim.adafactor.Adafactor",
    OptimizerName.LION: "lightning_v17.optim.library.Lion",
    OptimizerName.LION8BIT: "lightning_v17.optim.library.Lion8bit",
}


def _import(path: str) -> Any:
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise V17ConfigError(f"optimizer class_path={path!r} cannot be imported: {err}") from err


def optimizer_class(name: OptimizerName | str) -> type[torch.optim.Optimizer]:
    """The library class for ``name`` (parsed with :meth:`OptimizerName.parse`)."""
    return _import(_CLASSES[OptimizerName.parse(name)])


def _same_shape_of_value(default: Any, value: Any) -> bool:
    """Whether ``value`` can mean what the parameter's ``default`` means: both sequences or both scalars. Adam's
    ``eps=1e-8`` is one float; Adafactor's ``eps=(None, 1e-3)`` is a pair with another meaning."""
    if default is inspect.Parameter.empty or default is None or value is None:
        return True
    return isinstance(default, (tuple, list)) == isinstance(value, (tuple, list))


def _accepted(cls: type, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` restricted to what ``cls.__init__`` accepts with the same kind of value (all of them when it
    takes ``**kwargs``)."""
    params = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(kwargs)
    return {k: v for k, v in kwargs.items() if k in params and _same_shape_of_value(params[k].default, v)}


def build_optimizer(spec: Any, params: Any, **defaults: Any) -> torch.optim.Optimizer:
    """Build an optimizer over ``params`` (tensors or param groups).

    Args:
        spec: an :class:`OptimizerName` or its value (``"adamw"``, ``"cpu_adam"``, ``"adam8bit"``, ``"adafactor"``,
            ``"lion"``, ``"lion8bit"``); a ``{"class_path": ..., "init_args": {...}}`` dict naming any optimizer class
            (ours or a foreign ``torch.optim.Optimizer``); or an optimizer class.
        params: what ``torch.optim.Optimizer`` takes: an iterable of tensors or of param-group dicts.
        defaults: keyword arguments for the class (e.g. a module's ``lr``, ``betas``, ``eps``); those the class does
            not accept, or takes with another kind of value (Adafactor's ``eps`` is a pair), are dropped, and a
            spec's ``init_args`` override them.

    Returns:
        The optimizer. Library classes carry ``v17_kind`` (their :class:`OptimizerName`), which ``MemoryBuckets``
        reads instead of guessing from the class name.
    """
    init_args: dict[str, Any] = {}
    if isinstance(spec, dict):
        if "class_path" not in spec:
            raise V17ConfigError(f"optimizer={spec!r}: a dict spec needs 'class_path' (and optional 'init_args')")
        cls = _import(str(spec["class_path"]))
        init_args = dict(spec.get("init_args") or {})
    elif isinstance(spec, type):
        cls = spec
    else:
        cls = optimizer_class(spec)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise V17ConfigError(f"optimizer={spec!r} is not a torch.optim.Optimizer class")
    return cls(params, **{**_accepted(cls, defaults), **init_args})


def optimizer_kind_of(optimizer: Any) -> OptimizerName | None:
    """The :class:`OptimizerName` a library optimizer declares (``v17_kind``), else None (a foreign optimizer)."""
    kind = getattr(optimizer, "v17_kind", None)
    return OptimizerName.parse(kind) if kind is not None else None


def bitsandbytes_optimizer_base() -> type | None:
    """bitsandbytes' optimizer base class if bitsandbytes is imported (a user's bitsandbytes optimizer imported it;
    importing it here would cost ~8 s for nothing)."""
    mod = sys.modules.get("bitsandbytes.optim.optimizer")
    return getattr(mod, "Optimizer8bit", None)


#: bitsandbytes' optimizers by the update they were built with (``optimizer_name``) and their state bits
#: (``optim_bits``): Adam/AdamW keep two moments, Lion and momentum SGD one (32-bit: fp32; 8-bit: uint8 + absmax).
_BITSANDBYTES_KINDS: dict[tuple[str, int], OptimizerKind] = {
    ("adam", 32): OptimizerKind.ADAMW, ("adam", 8): OptimizerKind.ADAM8BIT,
    ("lion", 32): OptimizerKind.LION, ("lion", 8): OptimizerKind.LION8BIT, ("momentum", 32): OptimizerKind.SGD,
}  # fmt: skip


def planner_kind_of(optimizer: Any) -> OptimizerKind | None:
    """The planner's :class:`~lightning_v17.config.OptimizerKind` of ``optimizer`` (its optimizer-state bytes per
    parameter), asked of the optimizer itself, once: what a library class declares (``v17_kind``); torch's Adam and
    AdamW, Adafactor and SGD with momentum, subclasses included; bitsandbytes' optimizers by the update and the state
    bits they were built with. None when the state is not known (``MemoryBuckets(optimizer_bytes=...)`` gives it).
    """
    declared = optimizer_kind_of(optimizer)
    if declared is not None:
        return declared.planner_kind
    bnb = bitsandbytes_optimizer_base()
    if bnb is not None and isinstance(optimizer, bnb):
        bits = int(getattr(getattr(optimizer, "args", None), "optim_bits", 32))
        return _BITSANDBYTES_KINDS.get((str(getattr(optimizer, "optimizer_name", "")), bits))
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return OptimizerKind.ADAMW
    if isinstance(optimizer, torch.optim.Adafactor):
        return OptimizerKind.ADAFACTOR
    if isinstance(optimizer, torch.optim.SGD) and any(g.get("momentum", 0) for g in optimizer.param_groups):
        return OptimizerKind.SGD
    return None
