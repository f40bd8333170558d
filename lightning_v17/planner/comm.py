"""Communication volume per training step, per collective, per rank (bytes each rank sends).

Torch-free. Ring collectives over n ranks move (n - 1)/n of the buffer per rank for a reduce-scatter or an
all-gather, and twice that for an all-reduce (= reduce-scatter + all-gather, design §3.1; ZeRO §7.1 writes this 2Ψ,
dropping (n - 1)/n ≈ 1). We keep the (n - 1)/n factor so that one rank communicates nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from lightning_v17.config import CPMode, Recompute, V17ConfigError, ZeroPolicy


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


def check_replicas(replicate: int, *, dp: int, zero: ZeroPolicy) -> int:
    """``replicate`` once checked against the data-parallel size and the ZeRO stage (HSDP needs a sharding stage).

    Raises:
        V17ConfigError: a ``dp_replicate`` that does not divide ``dp``, or one above 1 at ZeRO-0 (every rank is
            then a replica already).
    """
    if dp % replicate:
        raise V17ConfigError(f"dp_replicate={replicate} must divide the data-parallel size {dp}")
    if replicate > 1 and not zero.shards_optimizer:
        raise V17ConfigError(f"dp_replicate={replicate} needs a ZeRO stage that shards (1-3); at ZeRO-0 every "
                             "data-parallel rank is a replica already")
    return replicate


def replicate_comm_bytes(params_per_rank: float, *, zero: ZeroPolicy, shard: int, replicate: int,
                         grad_bytes: float = 2.0, grad_accum_steps: int = 1) -> list[Collective]:
    """HSDP's second collective, per rank: the gradient shard all-reduced over the ``replicate`` groups.

    Source: PyTorch FSDP (Zhao 2023) §3.2.2, hybrid sharding: the gradients are reduce-scattered within the
    sharding group (:func:`dp_comm_bytes` over ``shard`` ranks) and the ``Ψ/shard`` shard is then all-reduced
    across the replication group, ``2 (r - 1)/r`` of it per rank in a ring. Like the reduce-scatter, once per
    micro-batch when the gradients are sharded (ZeRO-2/3), once per step at ZeRO-1. None at ``replicate`` = 1.
    """
    if replicate <= 1:
        return []
    reductions = grad_accum_steps if zero.shards_grads else 1
    size = params_per_rank / shard
    return [Collective("dp_replicate all-reduce (grad shards)", "dp_replicate",
                       math.ceil(reductions * 2 * size * ring_fraction(replicate) * grad_bytes))]


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


def ulysses_kv_replication(cp: int, *, heads: int, kv_heads: int) -> int | None:
    """How many times Ulysses replicates each KV head so that every cp rank receives whole KV groups (1: none), or
    None where Ulysses cannot run: cp must divide the query heads, and divide the KV heads or be a multiple of them.

    Source: DeepSpeed-Ulysses (Jacobs 2023) shards the heads over the sequence-parallel ranks; ALST (Bekman 2025)
    replicates KV heads when cp exceeds them. The same rule as ``lightning_v17.engine.cp.check_ulysses_heads``.
    """
    if heads % cp:
        return None
    if kv_heads % cp == 0:
        return 1
    return cp // kv_heads if cp % kv_heads == 0 else None


def cp_forward_elements_per_layer(mode: CPMode | str, *, seq: int, cp: int, heads: int, kv_heads: int,
                                  head_dim: int) -> float:
    """Elements one rank sends through the cp collectives of one attention layer, per row, in forward.

    Sources: DeepSpeed-Ulysses (Jacobs 2023 §3.1): an all-to-all of q, k, v before attention and of the output
    after it, each rank keeping 1/cp of its S/cp tokens' heads and sending the rest, so
    ``(2 Hq + 2 Hkv') D (S/cp) (cp-1)/cp`` with ``Hkv' = max(Hkv, cp)`` after ALST's KV replication; all-gathered
    K/V (Llama 3, Dubey 2024 §3.3.2): a ring all-gather of the ``2 Hkv D S`` elements of K and V sends
    ``2 Hkv D S (cp-1)/cp``. The backward passes are :func:`cp_comm_bytes_per_layer`'s (ulysses: the all-to-alls'
    adjoints, the same again; allgather: the all-gather again and the reduce-scatter of the gathered K/V's
    gradient, twice the forward). ``lightning_v17.engine.cp.cp_comm_elements`` is the engine's copy of this count,
    and a test holds the two equal.
    """
    mode = CPMode.parse(mode)
    frac = ring_fraction(cp)
    if mode == CPMode.ULYSSES:
        return (2 * heads + 2 * max(kv_heads, cp)) * head_dim * (seq / cp) * frac
    if mode == CPMode.ALLGATHER:
        return 2 * kv_heads * head_dim * seq * frac
    raise ValueError("cp_forward_elements_per_layer needs a concrete mode (ulysses or allgather), not 'auto'")


def choose_cp_mode(mode: CPMode | str, *, cp: int, heads: int, kv_heads: int) -> tuple[CPMode, str]:
    """The cp attention scheme and why, by the engine's rule (``lightning_v17.engine.cp.choose_cp_mode``).

    ``auto`` takes ulysses where the heads allow it (:func:`ulysses_kv_replication`) and it sends fewer elements
    (:func:`cp_forward_elements_per_layer`), which is when ``cp > (Hq + Hkv) / Hkv`` (cp > 5 for Llama-3-8B);
    allgather otherwise. An explicit ``ulysses`` the heads do not allow raises, naming the fix.

    Returns:
        (mode, reason): ``ulysses`` or ``allgather``, and one sentence for the report.
    """
    mode = CPMode.parse(mode)
    ok = ulysses_kv_replication(cp, heads=heads, kv_heads=kv_heads) is not None
    if mode == CPMode.ULYSSES and not ok:
        raise V17ConfigError(
            f"CPPolicy(mode='ulysses') (v17 plan --cp-mode ulysses) with cp={cp}: cp must divide the {heads} query "
            f"heads and divide or be a multiple of the {kv_heads} KV heads; use mode='allgather' (any cp degree) or "
            "another cp"
        )
    if mode == CPMode.ALLGATHER:
        return mode, "allgather: asked for (--cp-mode allgather)"
    if mode == CPMode.ULYSSES:
        return mode, "ulysses: asked for (--cp-mode ulysses)"
    if not ok:
        return CPMode.ALLGATHER, (f"auto: allgather, since ulysses needs cp={cp} to divide the {heads} query heads "
                                  f"and to divide or be a multiple of the {kv_heads} KV heads")
    if cp == 1:
        return CPMode.ALLGATHER, "auto: cp=1 sends nothing either way (allgather, as the engine resolves it)"
    dims = {"seq": cp, "cp": cp, "heads": heads, "kv_heads": kv_heads, "head_dim": 1}
    uly, ag = (cp_forward_elements_per_layer(m, **dims) for m in (CPMode.ULYSSES, CPMode.ALLGATHER))
    pick = CPMode.ULYSSES if uly < ag else CPMode.ALLGATHER
    return pick, (f"auto: {pick.value} sends {min(uly, ag) / max(uly, ag):.2f}x the elements of "
                  f"{(CPMode.ALLGATHER if pick == CPMode.ULYSSES else CPMode.ULYSSES).value} per layer; ulysses "
                  f"moves less only when cp > (Hq + Hkv)/Hkv = {(heads + kv_heads) / kv_heads:g}")


def cp_comm_bytes_per_layer(
    *,
    seq: int,
    micro_batch: int,
    kv_dim: int,
    cp: int,
    element_bytes: int = 2,
    recompute: Recompute = Recompute.NONE,
    mode: CPMode | str | None = None,
    heads: int | None = None,
    kv_heads: int | None = None,
) -> int:
    """Context-parallel traffic of one layer for one micro-batch, per rank, in bytes.

    ``mode`` ``ulysses`` or ``allgather`` (what ``V17Strategy(cp=...)`` runs): :func:`cp_forward_elements_per_layer`
    per pass, times ``micro_batch`` rows. Ulysses (Jacobs 2023 §3.1): two passes, the forward's all-to-alls and their
    adjoints in backward. Allgather: three, as Megatron-Core's ``all_gather`` ``cp_comm_type``
    (``AttnFuncWithCPAndKVAllGather``, which keeps only the local K/V for backward) and our
    ``engine/cp/allgather.py`` run it: all-gather K and V in forward, all-gather them again in backward and
    reduce-scatter dK/dV. Recompute (selective or full, which rerun the attention's inputs, the collectives
    included) sends the forward once more. Ulysses needs ``heads`` and ``kv_heads`` (the head width is
    ``kv_dim / kv_heads``).

    ``mode`` None: that all-gather scheme counted from ``kv_dim`` alone (ring attention, Liu 2023, moves the same
    volume point-to-point). K and V together are 2·b·s·kv_dim elements, so three passes move
    6·b·s·kv_dim·(cp - 1)/cp elements per rank. Full recompute adds the forward's gather once more.
    """
    recompute = Recompute.parse(recompute, "recompute")
    if mode is None:
        passes = 4 if recompute == Recompute.FULL else 3
        return math.ceil(passes * 2 * micro_batch * seq * kv_dim * ring_fraction(cp) * element_bytes)
    mode = CPMode.parse(mode)
    kv_heads = kv_heads or 1
    if mode == CPMode.ULYSSES and heads is None:
        raise ValueError("cp_comm_bytes_per_layer(mode='ulysses') needs heads= and kv_heads=")
    forward = cp_forward_elements_per_layer(mode, seq=seq, cp=cp, heads=heads or 0, kv_heads=kv_heads,
                                            head_dim=kv_dim // kv_heads)
    passes = 2 if mode == CPMode.ULYSSES else 3
    passes += recompute != Recompute.NONE
    return math.ceil(passes * forward * micro_batch * element_bytes)


@dataclass(frozen=True)
class CPReport:
    """The cp attention scheme of a plan and what each scheme would send (``planner.comm``).

    Args:
        mode: the scheme the plan uses (``ulysses`` or ``allgather``).
        requested: what was asked (``auto`` or the mode itself).
        why: the reason, in one sentence.
        bytes_per_layer: {scheme: bytes one rank sends per layer and micro-batch, forward and backward (and the
            recompute's forward)}; ulysses is absent where the heads do not allow it.
    """

    mode: CPMode
    requested: CPMode
    why: str
    bytes_per_layer: dict[str, int]

    def to_dict(self) -> dict:
        return {"mode": self.mode.value, "requested": self.requested.value, "why": self.why,
                "bytes_per_layer": dict(self.bytes_per_layer)}



def cp_report(shape: Any, lay: Any, requested: CPMode, element: int) -> CPReport:
    """The plan's cp report for its layout ``lay`` (``planner.plan.Layout``): both schemes' bytes per layer (ulysses only where the heads allow it) and why the plan's was chosen."""
    heads, kv_heads = shape.heads // lay.tp, max(1, shape.kv_heads // lay.tp)  # one tp rank's, as the engine
    _, why = choose_cp_mode(requested, cp=lay.cp, heads=heads, kv_heads=kv_heads)
    modes = [CPMode.ALLGATHER]
    if ulysses_kv_replication(lay.cp, heads=heads, kv_heads=kv_heads) is not None:
        modes.insert(0, CPMode.ULYSSES)
    per = {m.value: cp_comm_bytes_per_layer(seq=lay.seq, micro_batch=lay.micro_batch, kv_dim=shape.kv_dim // lay.tp,
                                                  cp=lay.cp, element_bytes=element, recompute=lay.recompute, mode=m,
                                                  heads=heads, kv_heads=kv_heads)
           for m in modes}  # fmt: skip
    return CPReport(mode=lay.cp_mode, requested=requested, why=why, bytes_per_layer=per)


__all__ = [
    "CPReport",
    "Collective",
    "check_replicas",
    "choose_cp_mode",
    "cp_comm_bytes_per_layer",
    "cp_forward_elements_per_layer",
    "cp_report",
    "dp_comm_bytes",
    "pp_comm_bytes_per_microbatch",
    "replicate_comm_bytes",
    "ring_fraction",
    "tp_comm_bytes_per_layer",
    "ulysses_kv_replication",
]
