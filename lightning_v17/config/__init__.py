"""Frozen policy dataclasses: the one place where user-facing strings become typed values.

Everything here is torch-free so that the planner and the CLI can import it without torch. Strings given by a user
(YAML, CLI flags, constructor arguments) are parsed once, here, into an ``Enum`` or a policy; code deeper down only
ever sees the typed value (DESIGN.md, "Config is typed").

Vocabulary (torchtitan's rule): an *axis* is a device-mesh axis (pp, dp_replicate, dp_shard, cp, tp); a *dim* is a
tensor dimension.
"""

from __future__ import annotations

from lightning_v17.config.deepspeed import DEEPSPEED_NO_EFFECT_KEYS, DEEPSPEED_SUPPORTED_KEYS, from_deepspeed_config
from lightning_v17.config.enums import (
    Axis,
    CPBalance,
    CPMode,
    Dispatcher,
    HostMemory,
    OptimizerKind,
    Precision,
    Recompute,
    Schedule,
    Tier,
)
from lightning_v17.config.errors import V17ConfigError, parse_enum
from lightning_v17.config.fault import FTPolicy
from lightning_v17.config.fp8 import FP8Backend, FP8Policy, FP8Recipe
from lightning_v17.config.mesh_spec import AXIS_ORDER, MeshSpec, ParallelDims, check_tp_divides, divisors
from lightning_v17.config.policies import (
    CPPolicy,
    EPPolicy,
    LossScalePolicy,
    OffloadPolicy,
    PipelinePolicy,
    TPPolicy,
    TrainingPolicy,
    ZeroPolicy,
)

__all__ = [
    "AXIS_ORDER",
    "DEEPSPEED_NO_EFFECT_KEYS",
    "DEEPSPEED_SUPPORTED_KEYS",
    "Axis",
    "CPBalance",
    "CPMode",
    "CPPolicy",
    "Dispatcher",
    "EPPolicy",
    "FP8Backend",
    "FP8Policy",
    "FP8Recipe",
    "FTPolicy",
    "HostMemory",
    "LossScalePolicy",
    "MeshSpec",
    "OffloadPolicy",
    "OptimizerKind",
    "ParallelDims",
    "PipelinePolicy",
    "Precision",
    "Recompute",
    "Schedule",
    "TPPolicy",
    "Tier",
    "TrainingPolicy",
    "V17ConfigError",
    "ZeroPolicy",
    "check_tp_divides",
    "divisors",
    "from_deepspeed_config",
    "parse_enum",
]
