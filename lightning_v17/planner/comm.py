"""Communication volume per training step, per collective, per rank (bytes each rank sends).

Torch-free. Ring collectives over n ranks move (n - 1)/n of the buffer per rank for a reduce-scatter or an
all-gather, and twice that for an all-reduce (= reduce-scatter + all-gather, design §3.1; ZeRO §7.1 writes this 2Ψ,
dropping (n - 1)/n ≈ 1). We keep the (n - 1)/n factor so that one rank communicates nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lightning_v17.config import Recompute, ZeroPolicy


@dataclass(frozen=True)
class Collective:
    """One collective's traffic in a step.

    Args:
        name: e.g. "dp all-reduce (grads)".
        axis: mesh axis it runs over ("dp", "tp", "pp", "cp").
        bytes_per_step: bytes each rank sends per optimizer step.
    """

    name: str
    axis: str
    bytes_per_step: int


def ring_fraction(n: int) -> float:
    """(n - 1)/n: the share of a buffer each rank sends in a ring reduce-scatter or all-gather (Patarasuk 2009)."""
    return (n - 1) / n if n > 1 else 0.0


def dp_comm_bytes(
    params_per_rank: float,
    *,
    zero: ZeroPolicy,
    dp: int,
    grad_bytes: float = 2.0,
    param_bytes: float = 2.0,
    grad_accum_steps: int = 1,
) -> list[Collective]:
    """Data-parallel traffic per step for ZeRO stage 0-3, per rank.

    Source: ZeRO (Rajbhandari 2020) §7.2: stage 0 (DDP) all-reduces the gradients, 2Ψ; stages 1-2 reduce-scatter
    the gradients (Ψ) and all-gather the updated parameters (Ψ), 2Ψ in all; stage 3 all-gathers the parameters
    in forward and again in backward and reduce-scatters the gradients, 3Ψ. Ψ is in elements; bytes multiply by
    the gradient or parameter dtype size and by the ring fraction (dp - 1)/dp.

    Gradient accumulation (``grad_accum_steps`` micro-batches per step) leaves stages 0-1 unchanged (grads are
    reduced once, DDP ``no_sync``) but repeats stage 2's reduce-scatter and stage 3's gathers and reduce-scatter
    every micro-batch, because partitioned gradients cannot accumulate locally. This is why PP (many
    micro-batches) pairs with ZeRO-1 only (design §17.5, anti-patterns: "PP + ZeRO-3 → ZeRO-1만").

    Args:
        params_per_rank: Ψ = parameters per model-parallel rank (num_params / (tp·pp)).
        zero: the ZeRO policy (what it shards decides the collectives).
        dp: data-parallel ranks.
        grad_bytes: bytes per gradient element on the wire.
        param_bytes: bytes per parameter element on the wire.
        grad_accum_steps: micro-batches per optimizer step on this rank.
    """
    f = ring_fraction(dp)
    m = grad_accum_steps
    psi = params_per_rank
    if not zero.shards_optimizer:  # DDP: every rank keeps and steps everything
        return [Collective("dp all-reduce (grads)", "dp", math.ceil(2 * psi * f * grad_bytes))]
    if zero.shards_params:  # gathered in forward and backward, reduce-scattered, every micro-batch
        return [
            Collective("dp all-gather (params, fwd+bwd)", "dp", math.ceil(m * 2 * psi * f * param_bytes)),
            Collective("dp reduce-scatter (grads)", "dp", math.ceil(m * psi * f * grad_bytes)),
        ]
    # replicated parameters: reduce-scatter the gradients (each micro-batch once they are sharded), all-gather the
    # updated partitions once per step
    reductions = m if zero.shards_grads else 1
    return [
        Collective("dp reduce-scatter (grads)", "dp", math.ceil(reductions * psi * f * grad_bytes)),
        Collective("dp all-gather (params)", "dp", math.ceil(psi * f * param_bytes)),
    ]


def tp_comm_bytes_per_layer(
    *, seq: int, micro_batch: int, hidden: int, tp: int, element_bytes: int = 2, recompute: Recompute = Recompute.NONE
) -> int:
    """Tensor-parallel traffic of one layer for one micro-batch, per rank, in bytes.

    Source: Narayanan 2021 (Efficient Large-Scale LM Training on GPU Clusters) §3.3.2: two all-reduces of b·s·h
    elements in forward and two in backward per layer, 8bsh(t - 1)/t elements per rank. With sequence parallelism
    each all-reduce becomes a reduce-scatter + all-gather of the same volume (Korthikanti 2022 §4.2.2). Full
    recompute re-runs the forward's two all-reduces in backward: 12bsh(t - 1)/t.
    """
    recompute = Recompute.parse(recompute, "recompute")
    allreduces = 6 if recompute == Recompute.FULL else 4
    bsh = seq * micro_batch * hidden
    return math.ceil(allreduces * 2 * bsh * ring_fraction(tp) * element_bytes)


def pp_comm_bytes_per_microbatch(
    *, seq: int, micro_batch: int, hidden: int, tp: int = 1, element_bytes: int = 2, virtual_stages: int = 1
) -> int:
    """Pipeline point-to-point traffic for one micro-batch, per rank, in bytes (forward send + backward send).

    Source: Narayanan 2021 §3.3.2 ("bsh per micro-batch between consecutive stages", for each of forward and
    backward) and §4.1 (the scatter/gather optimization sends bsh/t when tp > 1). An interleaved schedule with v
    chunks per rank crosses v times as many stage boundaries (§2.2.2).
    """
    return math.ceil(2 * seq * micro_batch * hidden / tp * element_bytes * virtual_stages)


def cp_comm_bytes_per_layer(
    *, seq: int, micro_batch: int, kv_dim: int, cp: int, element_bytes: int = 2, recompute: Recompute = Recompute.NONE
) -> int:
    """Context-parallel traffic of one layer for one micro-batch, per rank, in bytes.

    Source: Megatron-Core context parallelism (all-gather K and V in forward, all-gather again and reduce-scatter
    dK/dV in backward; ring attention, Liu 2023, moves the same volume point-to-point). K and V together are
    2·b·s·kv_dim elements, so three passes move 6·b·s·kv_dim·(cp - 1)/cp elements per rank. Full recompute adds
    the forward's gather once more.
    """
    recompute = Recompute.parse(recompute, "recompute")
    passes = 4 if recompute == Recompute.FULL else 3
    return math.ceil(passes * 2 * micro_batch * seq * kv_dim * ring_fraction(cp) * element_bytes)


__all__ = [
    "Collective",
    "cp_comm_bytes_per_layer",
    "dp_comm_bytes",
    "pp_comm_bytes_per_microbatch",
    "ring_fraction",
    "tp_comm_bytes_per_layer",
]
