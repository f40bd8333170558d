"""FLOPs per token and step, and an MFU-based step-time estimate.

Torch-free. "Model FLOPs" are the FLOPs of one forward and backward pass with no recomputation (Korthikanti 2022
App. A): MFU is always measured against them. "Hardware FLOPs" add what recomputation re-runs.
"""

from __future__ import annotations

from lightning_v17.config import Recompute
from lightning_v17.planner.model import ModelShape


def flops_per_token(shape: ModelShape, *, seq: int, recompute: Recompute = Recompute.NONE) -> float:
    """Training FLOPs per token (forward + backward + recomputation), for a sequence length ``seq``.

    Source: Narayanan 2021 Eq. 3 and Korthikanti 2022 App. A, generalized from GPT's 12h² block to any block:
    a forward pass costs 2 FLOPs per matmul weight per token (2·L·W, W = :attr:`ModelShape.matmul_params_per_block`),
    4·s·h per layer for attention (QKᵀ and attention × V, counted over the full s × s matrix as both papers do),
    and 2·V·h for the logits. Backward costs twice the forward. Recomputation adds, per layer: the whole forward
    (``full``) or the attention core, 4·s·h (``selective``, Korthikanti §4.3); the logits are never recomputed.
    For GPT-3's shape (W = 12h²) this is 72·L·h²·(1 + s/(6h) + V/(12·L·h)) per token without recomputation, and
    Narayanan's 96·L·h²·(1 + s/(6h) + V/(16·L·h)) with full recomputation.

    A mixture-of-experts shape counts the weights a token runs through (:attr:`ModelShape.active_matmul_params`:
    attention, router, its top-k and the shared experts; Fedus 2022 §2: compute per token follows the active, not
    the total, parameters), so MFU is measured against active FLOPs. The attention term is 2·s·(d_qk + d_v) with
    the query/key and value widths summed over heads (4·s·h when both are h; MLA and an explicit head_dim differ).

    Args:
        shape: the model shape.
        seq: training sequence length s (tokens per sample).
        recompute: none (model FLOPs), selective or full (hardware FLOPs).
    """
    recompute = Recompute.parse(recompute, "recompute")
    L, h, V = shape.layers, shape.hidden, shape.vocab
    matmul = 2.0 * shape.active_matmul_params  # L x 2W for a dense shape
    qk, v = shape.attention_core_widths
    attention = 2.0 * seq * (qk + v)
    forward = matmul + L * attention + 2.0 * V * h
    total = 3.0 * forward
    if recompute == Recompute.FULL:
        total += matmul + L * attention
    elif recompute == Recompute.SELECTIVE:
        total += L * attention
    return total


def flops_per_token_from_params(num_params: float, *, recompute: Recompute = Recompute.NONE) -> float:
    """Training FLOPs per token from the parameter count alone: 6N, or 8N with full recomputation.

    Source: Kaplan 2020 (Scaling Laws for Neural Language Models) §2.1, C ≈ 6N per token (attention omitted);
    full recomputation adds one forward (2N), Narayanan 2021 §5.1. Selective recomputation only re-runs attention,
    which this approximation does not count.
    """
    recompute = Recompute.parse(recompute, "recompute")
    return (8.0 if recompute == Recompute.FULL else 6.0) * num_params


def compute_time_s(
    hardware_flops_per_step: float,
    *,
    model_flops_per_step: float,
    gpus: int,
    peak_flops: float,
    mfu: float,
    bubble_fraction: float = 0.0,
) -> float:
    """Step time in seconds: the compute at ``mfu`` of peak, stretched by recomputation and the pipeline bubble.

    Source: MFU as defined by Chowdhery 2022 (PaLM) App. B and Korthikanti 2022 App. A: MFU = model FLOP/s /
    peak FLOP/s. ``mfu`` is the utilization the model FLOPs would reach with no recomputation and no bubble; the
    recomputed FLOPs run at the same rate and the bubble idles the pipeline for (1 + bubble) × the ideal time
    (Narayanan 2021 §2.2): t = hardware_flops / (N · peak · mfu) × (1 + bubble).

    Args:
        hardware_flops_per_step: FLOPs per step including recomputation (all ranks).
        model_flops_per_step: FLOPs per step without recomputation (unused in the formula; kept for validation).
        gpus: devices N.
        peak_flops: peak FLOP/s of one device.
        mfu: assumed utilization, 0 < mfu <= 1.
        bubble_fraction: pipeline bubble fraction.
    """
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu={mfu} must be in (0, 1]")
    if hardware_flops_per_step < model_flops_per_step:
        raise ValueError("hardware FLOPs (with recomputation) cannot be below model FLOPs")
    return hardware_flops_per_step / (gpus * peak_flops * mfu) * (1.0 + bubble_fraction)


def mfu_from_step_time(model_flops_per_step: float, *, step_time_s: float, gpus: int, peak_flops: float) -> float:
    """Achieved MFU = model FLOPs per step / (step time · N · peak FLOP/s). Source: PaLM (Chowdhery 2022) App. B."""
    return model_flops_per_step / (step_time_s * gpus * peak_flops)


__all__ = ["compute_time_s", "flops_per_token", "flops_per_token_from_params", "mfu_from_step_time"]
