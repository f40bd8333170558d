"""The design outline's decision tree (§17.4) and its anti-patterns (§17.5), as pure functions.

Torch-free. The tree (design §17.4):

    model ≤ 10B?          → FSDP FULL_SHARD (ZeRO-3) only
    intra-node NVLink?    → TP = 8 inside the node
    model ≤ 100B?         → TP8 + PP4 + DP
    otherwise             → TP8 + PP≥8 + ZeRO-1 (+ CP for long sequences / EP for MoE)

A mixture-of-experts shape whose routed experts hold most of the parameters takes the tree's EP branch first:
FSDP FULL_SHARD (ZeRO-3) over all ranks with the experts sharded over ``ep`` ranks folded out of them (torchtitan,
Megatron-core's parallel folding), since V17Strategy composes ``ep`` with data parallelism only.

Anti-patterns (design §17.5, §10.7): TP across nodes; tp not dividing the heads; fewer than 4·p micro-batches; small
DP with a huge PP; ZeRO with nothing to shard over; a plan that does not fit in device memory. Combinations that
V17Strategy refuses (PP with ZeRO-2/3, offload_params below ZeRO-3, ...) are warned from the one rules table,
:mod:`lightning_v17.config.rules`, with its message and fix.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache

from lightning_v17.config import (
    FP8Policy,
    FP8Recipe,
    MeshSpec,
    OffloadPolicy,
    ParallelDims,
    Schedule,
    Tier,
    TPPolicy,
    TrainingPolicy,
    ZeroPolicy,
    divisors,
)
from lightning_v17.config.rules import Layout as RulesLayout
from lightning_v17.config.rules import Rule, option_text, violations

SMALL_MODEL_PARAMS = 10e9  # design §17.4: "model ≤ 10B? → FSDP (FULL_SHARD) only"
MEDIUM_MODEL_PARAMS = 100e9  # design §17.4: "model ≤ 100B? → TP8 + PP4 + DP"
LONG_SEQUENCE = 32768  # beyond this, the tree's "+CP" branch applies (context parallelism)


@dataclass(frozen=True)
class Recommendation:
    """The decision tree's layout for a model on a cluster.

    Args:
        tp: tensor-parallel size.
        pp: pipeline-parallel size.
        dp: data-parallel size (None when the world size is unknown).
        cp: context-parallel size; ``recommend`` leaves 1 (with a note at long sequences) and
            ``planner.plan`` raises it where the activations at cp = 1 do not fit.
        zero: the ZeRO policy (its stage).
        sp: sequence parallelism with TP.
        schedule: pipeline schedule.
        reason: the branch of the tree that was taken.
        notes: extra advice (CP/EP, adjustments made to fit the cluster).
        ep: expert-parallel size (1: no expert parallelism), folded out of ``dp``.
    """

    tp: int
    pp: int
    dp: int | None
    cp: int
    zero: ZeroPolicy
    sp: bool
    schedule: Schedule
    reason: str
    notes: tuple[str, ...] = field(default_factory=tuple)
    ep: int = 1


#: the divisors of a model dim, once per dim (the layout search asks for the same dims many times)
_divisors = lru_cache(maxsize=256)(divisors)


def largest_tp(limit: int, *dims: int) -> int:
    """Largest divisor of ``limit`` (the node's TP budget) that divides every one of ``dims`` (heads, kv_heads,
    ffn), so that TP groups tile a node and shard every head evenly."""
    common = set.intersection(*(set(_divisors(d)) for d in dims)) if dims else set(_divisors(limit))
    return max(d for d in common if limit % d == 0)


def recommend(
    num_params: float,
    *,
    gpus: int | None,
    gpus_per_node: int,
    nvlink: bool,
    layers: int | None = None,
    tp_dims: tuple[int, ...] = (),
    seq: int | None = None,
    model_state_fits: Callable[[int, int], bool] | None = None,
    num_experts: int = 0,
    expert_params: float = 0,
) -> Recommendation:
    """Walk the design outline's decision tree (§17.4), after its EP branch for a MoE shape.

    EP branch: when the routed experts hold more than half of the parameters and some ``ep > 1`` divides both the
    world size and the experts, the experts' bytes decide what fits, and ep divides them: FSDP FULL_SHARD (ZeRO-3)
    over every rank, tp = pp = 1 (ep composes with tp and pp, but the tree keeps MoE layouts data-parallel),
    and ep = :func:`~lightning_v17.planner.moe.recommend_ep`, the largest divisor of the data-parallel size that
    divides the experts (every rank keeps >= 1 whole expert).

    Args:
        num_params: model parameters.
        gpus: world size, or None when only dp is known (then dp is left to the caller).
        gpus_per_node: devices per node (TP stays inside a node).
        nvlink: whether the node has a fast switched fabric (the tree's "intra-node NVLink?").
        layers: transformer blocks; pp never exceeds it.
        tp_dims: model dims tp must divide (heads, kv_heads, ffn); empty when only ``params`` is known.
        seq: training sequence length, for the "+CP" note.
        model_state_fits: optional ``f(tp, pp) -> bool``; for > 100B models PP doubles from 8 until it is true.
        num_experts: routed experts per MoE block (0: a dense model).
        expert_params: the routed experts' parameters (all blocks).
    """
    from lightning_v17.planner.moe import recommend_ep

    notes: list[str] = []
    max_pp = layers if layers else 10**9

    def cap(tp: int, pp: int) -> tuple[int, int]:
        # Shrink the layout to the cluster: tp*pp must divide the world size.
        if gpus is None:
            return tp, pp
        while tp > 1 and gpus % tp != 0:
            tp //= 2
        while pp > 1 and (gpus % (tp * pp) != 0):
            pp -= 1
        return tp, pp

    ep = recommend_ep(num_experts, dp_shard=gpus) if gpus is not None and expert_params > num_params / 2 else 1
    if ep > 1:
        reason = (f"MoE, the routed experts hold {expert_params / num_params:.0%} of the parameters: FSDP FULL_SHARD "
                  f"(ZeRO-3) over all ranks + EP={ep} ({num_experts // ep} of {num_experts} experts per rank), ep folded out of dp "
                  f"(torchtitan, Megatron-core parallel folding)")
        tp, pp, zero = 1, 1, ZeroPolicy(stage=3)
    elif num_params <= SMALL_MODEL_PARAMS:
        reason = "≤10B parameters: FSDP FULL_SHARD (ZeRO-3) over all ranks, no TP/PP (design §17.4)"
        tp, pp, zero = 1, 1, ZeroPolicy(stage=3)
    elif not nvlink or gpus_per_node < 2:
        reason = (">10B without an intra-node NVLink fabric: TP would cross slow links, so FSDP FULL_SHARD "
                  "(ZeRO-3) over all ranks (design §17.4-18.5)")
        tp, pp, zero = 1, 1, ZeroPolicy(stage=3)
    else:
        tp_limit = min(8, gpus_per_node)
        tp = largest_tp(tp_limit, *tp_dims) if tp_dims else tp_limit
        if tp != tp_limit:
            notes.append(f"tp={tp_limit} does not divide the model dims {tp_dims}; using tp={tp}")
        if num_params <= MEDIUM_MODEL_PARAMS:
            reason = "10-100B parameters with NVLink: TP8 inside the node + PP4 + DP (ZeRO-1) (design §17.4)"
            pp = min(4, max_pp)
        else:
            reason = ">100B parameters: TP8 + PP≥8 + ZeRO-1 (+CP/EP) (design §17.4)"
            pp = min(8, max_pp)
            while model_state_fits is not None and not model_state_fits(tp, pp) and pp * 2 <= max_pp:
                if gpus is not None and gpus % (tp * pp * 2) != 0:
                    break
                pp *= 2
        zero = ZeroPolicy(stage=1)
    capped = cap(tp, pp)
    if gpus is not None and capped[0] * capped[1] > gpus:
        capped = (1, 1)
    if capped != (tp, pp):
        notes.append(f"{gpus} devices cannot hold tp={tp} x pp={pp}; shrunk to tp={capped[0]} x pp={capped[1]}")
        tp, pp = capped
    if seq is not None and seq >= LONG_SEQUENCE:
        notes.append(f"seq={seq} ≥ {LONG_SEQUENCE}: add context parallelism (cp) to split activations (design §17.4)")
    if num_params > MEDIUM_MODEL_PARAMS and not num_experts:
        notes.append("for MoE models add expert parallelism (EP): a MoE shape and --ep")
    elif num_experts and ep == 1 and gpus is not None:
        why = ("the routed experts hold only " f"{expert_params / num_params:.0%} of the parameters"
               if expert_params <= num_params / 2 else f"no ep > 1 divides both {gpus} ranks and {num_experts} experts")
        notes.append(f"MoE without expert parallelism: {why}")
    dp = gpus // (tp * pp) if gpus is not None else None
    if dp == 1 and zero.shards_optimizer:
        notes.append(f"dp=1: nothing to shard over data parallelism, so zero_stage=0 instead of {zero.stage}")
        zero = ZeroPolicy(stage=0)
    return Recommendation(tp=tp, pp=pp, dp=dp, cp=1, zero=zero, sp=tp > 1, schedule=Schedule.ONE_F_ONE_B,
                          reason=reason, notes=tuple(notes), ep=ep)


#: The nvme directory of the policy the rules look at: the plan counts bytes on the tier, not files, so any path does.
_PLANNED_NVME_PATH = "<nvme_path>"


def _headline(rule: Rule, values: dict[str, object]) -> str:
    """A short title for a violated rule, in the planner's words: "PP with ZeRO-3",
    "TPPolicy(sequence_parallel=True) with tp=1"."""
    words = []
    for option in rule.options:
        value = values.get(option, ...)
        if option in ("pp", "tp"):
            words.append(option.upper() if value != 1 else f"{option}=1")
        elif option == "zero_stage":
            words.append(f"ZeRO-{value}")
        else:
            words.append(option_text(option, ... if value is None or value is True and "." not in option else value))
    return " with ".join(words)


def rule_warnings(
    dims: ParallelDims,
    *,
    zero: ZeroPolicy,
    sp: bool = False,
    offload_optimizer: Tier = Tier.NONE,
    offload_params: Tier = Tier.NONE,
    fp8: FP8Recipe | None = None,
) -> list[str]:
    """The rules of :mod:`lightning_v17.config.rules` the layout violates, each with the table's message and fix:
    what ``V17Strategy`` would refuse to build (the planner still plans it, and warns)."""
    tiers = (offload_optimizer, offload_params)
    offload = OffloadPolicy(optimizer=offload_optimizer, params=offload_params,
                            nvme_path=_PLANNED_NVME_PATH if Tier.NVME in tiers else None)  # fmt: skip
    policy = TrainingPolicy(zero=zero, offload=offload, tensor_parallel=TPPolicy(sequence_parallel=bool(sp)),
                            fp8=None if fp8 is None else FP8Policy(recipe=fp8))  # fmt: skip
    values = {"pp": dims.pp, "tp": dims.tp, "zero_stage": zero.stage, "OffloadPolicy.params": offload.params.value,
              "fp8": None if fp8 is None else FP8Recipe(fp8).value, "TPPolicy.sequence_parallel": bool(sp),
              "ep": dims.ep, "cp": dims.cp}  # fmt: skip
    found = violations(RulesLayout(policy, dims))
    return [f"{_headline(rule, values)}: {text}" for rule, text in found]


def anti_pattern_warnings(
    dims: MeshSpec,
    *,
    sp: bool,
    zero: ZeroPolicy,
    gpus_per_node: int,
    microbatches: int,
    offload_params: Tier = Tier.NONE,
    offload_optimizer: Tier = Tier.NONE,
    fp8: FP8Recipe | None = None,
) -> list[str]:
    """Warnings for the layout: the composition rules it violates (:func:`rule_warnings`), then its anti-patterns
    (design §17.5, §10.7). Each names the fix."""
    warnings = rule_warnings(dims, zero=zero, sp=sp, offload_optimizer=offload_optimizer,
                             offload_params=offload_params, fp8=fp8)  # fmt: skip
    tp, pp, cp, dp = dims.tp, dims.pp, dims.cp, dims.dp
    if tp > gpus_per_node:
        warnings.append(
            f"TP across nodes: tp={tp} > gpus_per_node={gpus_per_node}; TP's per-layer all-reduces need NVLink, "
            f"keep tp <= {gpus_per_node} (design §17.5)"
        )
    if pp > 1 and microbatches < 4 * pp:
        warnings.append(
            f"micro-batch count m={microbatches} < 4·p={4 * pp}: the bubble is large; raise --microbatches or "
            f"--global-batch, or use an interleaved/zero-bubble schedule (design §10.7)"
        )
    if pp >= 8 and dp <= 2:
        warnings.append(
            f"small DP with a huge PP (dp={dp}, pp={pp}): the DP gradient all-reduce cannot hide in the bubble "
            f"(design §17.5); trade pipeline stages for data parallelism"
        )
    if zero.shards_optimizer and dp * cp == 1:
        warnings.append(f"zero_stage={zero.stage} with dp=1 shards nothing; ZeRO partitions over data parallelism")
    return warnings


def fit_warning(gpu_bytes: int, memory_bytes: int, *, name: str, total_bytes: int | None = None) -> str | None:
    """The "does not fit in N GB" warning, or None when the plan fits (GB = 1e9 bytes). ``memory_bytes`` is what a
    plan may use; ``total_bytes`` the device's memory when a reserve is kept (``ClusterSpec.memory_reserve``)."""
    if gpu_bytes <= memory_bytes:
        return None
    where = f"{memory_bytes / 1e9:.0f} GB ({name})"
    if total_bytes is not None and total_bytes != memory_bytes:
        where = (f"the {memory_bytes / 1e9:.0f} GB a plan may use of {total_bytes / 1e9:.0f} GB ({name}; "
                 f"--memory-reserve keeps the rest free)")
    return (
        f"does not fit in {where}: needs {gpu_bytes / 1e9:.1f} GB per rank; "
        f"try recompute, more tp/pp/dp, a higher zero_stage or offload"
    )


def default_microbatches(pp: int) -> int:
    """m = 4·p micro-batches per step with a pipeline (design §10.7: "M ≥ 4·P → 1F1B 충분"), 1 without."""
    return 4 * pp if pp > 1 else 1


__all__ = [
    "Recommendation",
    "anti_pattern_warnings",
    "default_microbatches",
    "fit_warning",
    "largest_tp",
    "recommend",
    "rule_warnings",
]
