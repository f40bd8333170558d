"""FP8 training (Micikevicius 2022): converting the blocks' Linears (``convert``) and delayed scaling (``delayed``)."""

from lightning_v17.engine.fp8.convert import (
    FP8_DIM_MULTIPLE,
    FP8Runtime,
    FP8Selection,
    apply_fp8,
    float8_tp_plan,
    resolve_fp8_backend,
    select_fp8_linears,
    transformer_engine_status,
)
from lightning_v17.engine.fp8.delayed import (
    DEFAULT_AMAX_HISTORY_LEN,
    DelayedFloat8Linear,
    convert_to_delayed,
    update_scales,
)

__all__ = [
    "DEFAULT_AMAX_HISTORY_LEN",
    "FP8_DIM_MULTIPLE",
    "DelayedFloat8Linear",
    "FP8Runtime",
    "FP8Selection",
    "apply_fp8",
    "convert_to_delayed",
    "float8_tp_plan",
    "resolve_fp8_backend",
    "select_fp8_linears",
    "transformer_engine_status",
    "update_scales",
]
