"""lightning-v17: DeepSpeed-style training systems for PyTorch Lightning.

The public API is re-exported here lazily, so that ``import lightning_v17`` (and the torch-free planner) stays cheap.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import Any

__version__ = "0.1.0"

# name -> module that defines it. Modules are imported on first attribute access.
_EXPORTS: dict[str, str] = {
    "V17Strategy": "lightning_v17.strategies",
    "V17FabricStrategy": "lightning_v17.strategies",
    "MeshSpec": "lightning_v17.config",
    "ZeroPolicy": "lightning_v17.config",
    "OffloadPolicy": "lightning_v17.config",
    "PipelinePolicy": "lightning_v17.config",
    "TPPolicy": "lightning_v17.config",
    "FP8Policy": "lightning_v17.config",
    "LossScalePolicy": "lightning_v17.config",
    "TrainingPolicy": "lightning_v17.config",
    "Recompute": "lightning_v17.config",
    "Schedule": "lightning_v17.config",
    "Precision": "lightning_v17.config",
    "V17ConfigError": "lightning_v17.config",
}

__all__ = ["__version__"]
__all__ += list(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_v17' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(__all__)


class _RegisterAfterLightning(importlib.abc.MetaPathFinder):
    """Register the strategy aliases ("v17", "v17_zero1/2/3") as soon as ``lightning.pytorch`` has finished importing.

    ``import lightning_v17`` must stay cheap and torch-free (the planner), so it cannot import Lightning itself; yet
    ``import lightning_v17; L.Trainer(strategy="v17_zero3")`` should work in either import order. This finder wraps
    the loader of ``lightning.pytorch`` once and imports ``lightning_v17.strategies`` (which registers) right after
    that package's ``__init__`` has run, when the whole of ``lightning.pytorch`` is importable.
    """

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "lightning.pytorch":
            return None
        sys.meta_path.remove(self)  # find the real spec with the other finders; this hook fires once
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module: Any) -> None:
            exec_module(module)
            importlib.import_module("lightning_v17.strategies")

        spec.loader.exec_module = exec_then_register  # type: ignore[method-assign]
        return spec


def _register_strategies() -> None:
    if "lightning.pytorch" in sys.modules:
        importlib.import_module("lightning_v17.strategies")
    elif not any(isinstance(f, _RegisterAfterLightning) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterLightning())


_register_strategies()
