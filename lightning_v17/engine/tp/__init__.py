"""Tensor (and sequence) parallelism (Shoeybi 2019, Korthikanti 2022): applying a plan over the tp axis (``apply``)
and the styles beyond torch's own (``styles``)."""

from lightning_v17.engine.tp.apply import (
    PARALLEL_STYLES,
    SegmentedColwiseParallel,
    TPPlan,
    apply_tensor_parallel,
    check_tensor_parallel,
    expand_plan,
    find_llama_modules,
    llama_tp_plan,
    loss_parallel_context,
    parallel_style,
)

__all__ = [
    "PARALLEL_STYLES",
    "SegmentedColwiseParallel",
    "TPPlan",
    "apply_tensor_parallel",
    "check_tensor_parallel",
    "expand_plan",
    "find_llama_modules",
    "llama_tp_plan",
    "loss_parallel_context",
    "parallel_style",
]
