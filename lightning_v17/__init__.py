"""lightning-v17: DeepSpeed-style training systems for PyTorch Lightning.

The public API is re-exported here lazily, so that ``import lightning_v17`` (and the torch-free planner) stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# name -> module that defines it. Modules are imported on first attribute access.
_EXPORTS: dict[str, str] = {
    "V17Strategy": "lightning_v17.strategies",
    "MeshSpec": "lightning_v17.config",
    "ZeroPolicy": "lightning_v17.config",
    "OffloadPolicy": "lightning_v17.config",
    "PipelinePolicy": "lightning_v17.config",
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
