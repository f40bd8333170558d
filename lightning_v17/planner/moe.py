"""Mixture-of-experts arithmetic of the planner: expert parallelism (``ep``), the experts' memory per rank, the
token dispatch traffic, the extra activations of a MoE block, and the ``moe`` section of a plan.

Torch-free. ``ep`` is folded out of the data-parallel ranks (torchtitan's sparse mesh; Megatron-core's "parallel
folding", Liu 2025 §3): ``dp_shard = efsdp x ep``, each of the ``ep`` ranks of a group holds ``E / ep`` whole experts
of every MoE block and trains on its own batch, and the ranks that hold the same experts (``efsdp`` of them; with no
replicated axis in the planner, ``edp = efsdp``) reduce their gradients (``lightning_v17/engine/ep/``).

What V17Strategy does with the experts decides their bytes (docs/expert-parallel.md): at ``ep = 1`` they are
ordinary parameters that ZeRO shards over ``dp_shard`` like the dense part; at ``ep > 1`` ZeRO shards each ep
rank's experts again over ``efsdp`` (as torchtitan and Megatron-core do): stage 3 with FSDP2 units of their own,
stages 1-2 with a second ZeRO engine over the efsdp group; ZeRO-0 keeps each rank's ``E / ep`` experts whole,
replicated over ``efsdp``. :func:`v17_shards_experts_over_efsdp` says which rule the plan uses, and
:func:`expert_state_bytes_per_rank` computes both.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

from lightning_v17.config import Recompute, V17ConfigError, ZeroPolicy, divisors
from lightning_v17.planner.comm import Collective, dp_comm_bytes, ring_fraction
from lightning_v17.planner.memory import ModelStateBytes, model_state_bytes_per_rank
from lightning_v17.planner.model import ModelShape


def v17_shards_experts_over_efsdp(zero: ZeroPolicy) -> bool:
    """Whether V17Strategy shards the experts over ``efsdp`` at ``ep > 1`` under ``zero``: at ZeRO-3 (FSDP2 units of
    their own, ``engine/zero/fsdp.py``) and at stages 1-2 (an expert ZeRO engine over the efsdp group,
    ``engine/zero/stages_0_2.py``); at ZeRO-0 they stay replicated over edp (``engine/ep/apply.py``)."""
    return zero.shards_optimizer

#: Bytes of an int64 index (the row orders and token ids a MoE block saves per assignment).
INDEX_BYTES = 8
#: Bytes of an fp32 element: the router runs in fp32 (models/moe.py), its scores are saved as fp32.
FP32_BYTES = 4


def check_ep(ep: int, *, dp_shard: int, num_experts: int) -> None:
    """Refuse an ``ep`` that V17Strategy cannot build, with the fix.

    Raises:
        V17ConfigError: ``ep`` on a dense model, not dividing ``dp_shard`` (MeshSpec: ep is folded out of it), or not
            dividing the experts of a MoE block (each rank holds ``E / ep`` whole experts).
    """
    if ep == 1:
        return
    if not num_experts:
        raise V17ConfigError(f"--ep {ep} shards the experts of a MoE model; this model has none (use --ep 1)")
    if dp_shard % ep:
        ok = [d for d in divisors(dp_shard) if num_experts % d == 0]
        raise V17ConfigError(
            f"--ep {ep} must divide the data-parallel size dp_shard={dp_shard} (ep is folded out of it); use --ep in "
            f"{ok} or more GPUs"
        )
    if num_experts % ep:
        ok = [d for d in divisors(num_experts) if dp_shard % d == 0]
        raise V17ConfigError(f"--ep {ep} must divide the {num_experts} experts of each MoE block; use --ep in {ok}")


def recommend_ep(num_experts: int, *, dp_shard: int) -> int:
    """The largest ``ep`` that divides ``dp_shard`` and the experts (so every rank holds ``E / ep >= 1`` whole experts,
    the engine's rule); 1 for a dense model. Spreading the experts as far as the data-parallel ranks allow divides
    their bytes by the most (GShard, Lepikhin 2020 §3.2, one expert per device at the limit)."""
    if not num_experts:
        return 1
    return max(d for d in divisors(dp_shard) if d <= num_experts and num_experts % d == 0)


def expert_state_bytes_per_rank(
    expert_params: float,
    *,
    zero: ZeroPolicy,
    ep: int,
    dp_shard: int,
    tp: int = 1,
    pp: int = 1,
    param_bytes: float = 2.0,
    grad_bytes: float = 2.0,
    optimizer_bytes: float = 12.0,
    shard_over_efsdp: bool | None = None,
) -> ModelStateBytes:
    """Parameter, gradient and optimizer bytes of the routed experts held by one rank.

    Source: ZeRO (Rajbhandari 2020) §3.1 for what each stage shards, with the experts first divided by ``ep``
    (each rank holds ``E / ep`` of them; GShard §3.2). At ``ep = 1`` the experts are ordinary parameters: ZeRO
    shards them over ``dp_shard``. At ``ep > 1`` their ZeRO group is ``efsdp = dp_shard / ep``: with
    ``shard_over_efsdp`` (torchtitan, Megatron-core) the stage's buckets are divided by it too; without it each
    replica keeps its experts' state whole.

    Args:
        expert_params: routed-expert parameters of the whole model (:attr:`ModelShape.expert_params`).
        zero: the ZeRO policy (what it shards).
        ep: expert-parallel size.
        dp_shard: data-parallel ranks ZeRO shards over (``ep`` is folded out of them).
        tp, pp: model-parallel sizes (the experts of a stage, per tensor-parallel rank).
        param_bytes, grad_bytes, optimizer_bytes: bytes per parameter of each bucket (K for the optimizer).
        shard_over_efsdp: whether ZeRO shards the experts over ``efsdp`` at ``ep > 1``; None: what V17Strategy does
            (:func:`v17_shards_experts_over_efsdp`).
    """
    if shard_over_efsdp is None:
        shard_over_efsdp = v17_shards_experts_over_efsdp(zero)
    if ep == 1:
        group = dp_shard
    else:
        group = dp_shard // ep if shard_over_efsdp else 1
    return model_state_bytes_per_rank(expert_params / ep, zero=zero, dp=group, tp=tp, pp=pp,
                                      param_bytes=param_bytes, grad_bytes=grad_bytes, optimizer_bytes=optimizer_bytes)


def alltoall_bytes_per_layer(tokens: float, *, top_k: int, hidden: int, ep: int, element_bytes: float = 2) -> int:
    """Bytes one rank sends per MoE block and micro-batch with the all-to-all dispatcher (forward and backward).

    Source: GShard (Lepikhin 2020) §3.2 and ``engine/ep/dispatch.py`` ``AllToAllDispatch``: the rank's
    ``tokens x top_k`` assignment rows of ``hidden`` elements go to their experts' ranks (dispatch) and come back
    (combine), and backward runs both exchanges again with the splits swapped. With even routing, ``(ep - 1) / ep``
    of the rows leave the rank each time: 4 x tokens x k x h x bytes x (ep - 1) / ep. The counts exchanged before
    the rows (E integers) are left out.
    """
    return math.ceil(4 * tokens * top_k * hidden * element_bytes * ring_fraction(ep))


def allgather_bytes_per_layer(tokens: float, *, top_k: int, hidden: int, ep: int, element_bytes: float = 2) -> int:
    """Bytes one rank sends per MoE block and micro-batch with the all-gather dispatcher (forward and backward).

    Source: ``engine/ep/dispatch.py`` ``AllGatherDispatch`` (Megatron-core's allgather dispatcher on assignment
    rows): every rank gathers the group's rows, ``(ep - 1)`` times its own ``tokens x top_k`` rows of ``hidden``
    elements; the outputs go back to their sources by all-to-all, ``(ep - 1) / ep`` of them. Backward mirrors both:
    the gather's gradient is a reduce-scatter of the same size (one all-to-all plus a local sum in the engine).
    In all 2 x rows x (ep - 1) + 2 x rows x (ep - 1) / ep, rows = tokens x k x h x bytes; the expert ids gathered
    with the rows (8 B each, ~1/(h/4) of a bf16 row) are left out.
    """
    rows = tokens * top_k * hidden * element_bytes
    return math.ceil(2 * rows * (ep - 1) + 2 * rows * ring_fraction(ep))


def pick_dispatcher(alltoall_bytes: int, allgather_bytes: int, *, ep: int) -> tuple[str, str]:
    """("alltoall" or "allgather", the reason in one line): the dispatcher that sends fewer bytes."""
    if ep == 1:
        return "alltoall", "ep=1: the experts are local, nothing is dispatched"
    pick = "alltoall" if alltoall_bytes <= allgather_bytes else "allgather"
    ratio = allgather_bytes / alltoall_bytes if alltoall_bytes else float("inf")
    return pick, (f"the all-gather dispatcher sends {ratio:.2f}x the all-to-all's bytes ((ep - 1)(1 + 1/ep) against "
                  f"2(ep - 1)/ep copies of each assignment row at ep={ep})")


def expert_collectives(expert_params_per_rank: float, *, zero: ZeroPolicy, efsdp: int, grad_bytes: float = 2.0,
                       param_bytes: float = 2.0, microbatches: int = 1) -> list[Collective]:
    """The experts' own data-parallel traffic per step over the ``efsdp`` ranks that hold the same experts (none with
    ``efsdp = 1``): the ZeRO stage's collectives on the rank's experts where V17Strategy shards them over efsdp
    (:func:`v17_shards_experts_over_efsdp`; :func:`~lightning_v17.planner.comm.dp_comm_bytes`), else the gradients'
    all-reduce (:func:`expert_grad_allreduce_bytes`)."""
    if efsdp == 1:
        return []
    if v17_shards_experts_over_efsdp(zero):
        return [replace(c, name=c.name.replace("dp ", "efsdp ", 1) + " of the experts", axis="efsdp")
                for c in dp_comm_bytes(expert_params_per_rank, zero=zero, dp=efsdp, grad_bytes=grad_bytes,
                                       param_bytes=param_bytes, grad_accum_steps=microbatches)]  # fmt: skip
    return [Collective("edp all-reduce (expert grads)", "edp",
                       expert_grad_allreduce_bytes(expert_params_per_rank, efsdp=efsdp, grad_bytes=grad_bytes))]


def expert_grad_allreduce_bytes(expert_params_per_rank: float, *, efsdp: int, grad_bytes: float = 2.0) -> int:
    """Bytes one rank sends per step to reduce its experts' gradients over the ranks that hold the same experts.

    Source: ``engine/ep/apply.py`` ``ExpertGradSync`` (one all-reduce over edp on the synchronising micro-step) and
    the ring all-reduce's 2 x (n - 1)/n of the buffer (Patarasuk 2009; design §3.1).
    """
    return math.ceil(2 * expert_params_per_rank * ring_fraction(efsdp) * grad_bytes)


def moe_activation_delta_bytes_per_layer(
    shape: ModelShape,
    *,
    seq: int,
    micro_batch: int,
    tp: int = 1,
    recompute: Recompute = Recompute.NONE,
    cp: int = 1,
    element_bytes: int = 2,
) -> int:
    """What a MoE block saves for backward beyond the dense llama block, per rank, for one micro-batch (may be < 0).

    Counted term by term for ``lightning_v17.models.moe`` (the reference MoE layer, grouped experts, local
    dispatch) in the way :func:`~lightning_v17.planner.memory.llama_activation_bytes_per_layer` counts the dense
    block (Korthikanti 2022 §4.1), and held against autograd's saved tensors by tests/unit/test_planner_moe.py. Per
    token, with e = ``element_bytes``, h = hidden, f = ffn, f_e = expert_width, k = top-k, S = shared experts,
    E = experts, t = tp:

    * recompute ``none``: the dense SwiGLU's 4e·f/t is gone; each of the k routed assignments keeps its experts'
      SwiGLU tensors 4e·f_e (gate/up output, silu, product) and three rows of h: the experts' input, their output
      (saved by the weighting) and the weighted output (saved by ``index_add``), 3e·k·h; the shared experts keep
      4e·S·f_e. The router keeps its fp32 scores 4E, the fp32 top-k weights and their sum 4k + 4, the weights in
      the activation dtype e·k, a mask k and three int64 indices (top-k ids, token ids, sort order) 24k. Outside
      fp32 training the router's fp32 input copy adds 4h and its bf16 logits' fp32 copy 4E, and with no shared
      experts no matmul keeps the 16-bit norm output (-e·h).
    * ``selective`` (``engine/recompute.py`` keeps matmul and attention outputs; the grouped expert GEMMs are
      recomputed): the dense MLP's outputs 2e·f/t + e·h are gone, the router logits add 4E and the shared experts'
      matmul outputs 2e·S·f_e + e·h.
    * ``full``: 0 (the block input only, as for a dense block).

    The expert terms are not divided by tp (the reference MoE layer has no tensor-parallel plan).
    """
    recompute = Recompute.parse(recompute, "recompute")
    if not shape.num_experts or recompute == Recompute.FULL:
        return 0
    e, h, f, fe, n = element_bytes, shape.hidden, shape.ffn, shape.expert_width, shape.num_experts
    k, shared = shape.experts_per_token, shape.shared_experts
    tokens = (seq / cp) * micro_batch
    if recompute == Recompute.SELECTIVE:
        shared_out = 2 * e * shared * fe + e * h if shared else 0
        per_token = -(2 * e * f / tp + e * h) + FP32_BYTES * n + shared_out
    else:
        experts = 4 * e * (k + shared) * fe + 3 * e * k * h
        router = FP32_BYTES * (n + k + 1) + e * k + k + 3 * INDEX_BYTES * k
        if e != FP32_BYTES:
            router += FP32_BYTES * (h + n) - (0 if shared else e * h)
        per_token = experts - 4 * e * f / tp + router
    return math.ceil(tokens * per_token)


def gathered_unit_params(shape: ModelShape, *, ep: int) -> int:
    """Parameters of the largest unit ZeRO-3 all-gathers: :attr:`ModelShape.largest_unit_params`, except that at
    ``ep > 1`` a MoE block's routed experts are outside FSDP2 (``ignored_params``) and are not gathered."""
    if ep == 1 or not shape.num_experts:
        return shape.largest_unit_params
    moe_block = shape.moe_block_params - shape.expert_params_per_block
    blocks = moe_block if shape.moe_blocks == shape.layers else max(shape.block_params, moe_block)
    return max(blocks, shape.embedding_params, shape.head_params)


@dataclass(frozen=True)
class MoEReport:
    """The MoE numbers of one layout (``v17 plan``'s ``moe`` section). Bytes are per rank; traffic per step.

    Args:
        num_experts, experts_per_token, shared_experts, moe_blocks: the shape's MoE fields.
        ep, efsdp: the expert-parallel size and the experts' ZeRO group (``dp_shard / ep``).
        total_params, active_params: all parameters and those a token runs through.
        expert_params, dense_params: routed experts' parameters (sharded by ep) and everything else.
        experts_per_rank: whole experts of each MoE block on one rank (``E / ep``).
        expert_params_per_rank: routed-expert parameters on one rank (``expert_params / ep``, per tp x pp rank).
        expert_state_bytes_per_rank: their parameters, gradients and optimizer state on one rank.
        experts_sharded_over_efsdp: whether ZeRO shards the experts over ``efsdp`` in these numbers.
        alltoall_bytes_per_step, allgather_bytes_per_step: dispatch traffic of each dispatcher.
        dispatcher, why: the one that sends fewer bytes, and the reason.
        active_flops_per_token: 6 x active parameters (Kaplan 2020 §2.1), for comparison with the plan's FLOPs.
    """

    num_experts: int
    experts_per_token: int
    shared_experts: int
    moe_blocks: int
    ep: int
    efsdp: int
    total_params: int
    active_params: int
    expert_params: int
    dense_params: int
    experts_per_rank: int
    expert_params_per_rank: int
    expert_state_bytes_per_rank: int
    experts_sharded_over_efsdp: bool
    alltoall_bytes_per_step: int
    allgather_bytes_per_step: int
    dispatcher: str
    why: str
    active_flops_per_token: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def moe_report(
    shape: ModelShape,
    *,
    ep: int,
    dp: int,
    tokens_per_rank: int,
    activation_bytes: float,
    state_bytes_per_param: float | None = None,
    zero: ZeroPolicy | None = None,
    tp: int = 1,
    pp: int = 1,
    microbatches: int = 1,
    param_bytes: float = 2.0,
    grad_bytes: float = 2.0,
    optimizer_bytes: float = 12.0,
) -> MoEReport:
    """The MoE numbers of one layout.

    Args:
        shape: a MoE shape (``num_experts > 0``).
        ep: the expert-parallel size; must divide ``dp`` and the experts (:func:`check_ep`).
        dp: the data-parallel ranks ``ep`` is folded out of (``dp_shard``).
        tokens_per_rank: tokens one rank routes per micro-batch (micro-batch x seq / cp).
        activation_bytes: bytes per element of the dispatched rows (2 for bf16).
        state_bytes_per_param: shortcut for ``param_bytes + grad_bytes + optimizer_bytes`` with no ZeRO sharding
            (the whole expert state on each rank: what ``zero=None`` means).
        zero: the ZeRO policy (None: stage 0).
        tp, pp: model-parallel sizes.
        microbatches: micro-batches per step (each dispatches its own tokens).
        param_bytes, grad_bytes, optimizer_bytes: bytes per parameter of each bucket.

    Raises:
        V17ConfigError: a dense shape, or ``ep`` that does not divide ``dp`` or the experts.
    """
    if not shape.num_experts:
        raise V17ConfigError("moe_report needs a MoE shape (num_experts > 0)")
    check_ep(ep, dp_shard=dp, num_experts=shape.num_experts)
    zero = zero or ZeroPolicy(stage=0)
    if state_bytes_per_param is not None:
        param_bytes, grad_bytes, optimizer_bytes = state_bytes_per_param, 0.0, 0.0
    state = expert_state_bytes_per_rank(shape.expert_params, zero=zero, ep=ep, dp_shard=dp, tp=tp, pp=pp,
                                        param_bytes=param_bytes, grad_bytes=grad_bytes,
                                        optimizer_bytes=optimizer_bytes)  # fmt: skip
    layers = math.ceil(shape.moe_blocks / pp) * microbatches
    kw = {"top_k": shape.experts_per_token, "hidden": shape.hidden, "ep": ep, "element_bytes": activation_bytes}
    alltoall = alltoall_bytes_per_layer(tokens_per_rank, **kw) * layers
    allgather = allgather_bytes_per_layer(tokens_per_rank, **kw) * layers
    pick, why = pick_dispatcher(alltoall, allgather, ep=ep)
    return MoEReport(
        num_experts=shape.num_experts, experts_per_token=shape.experts_per_token,
        shared_experts=shape.shared_experts, moe_blocks=shape.moe_blocks, ep=ep, efsdp=dp // ep,
        total_params=shape.total_params, active_params=shape.active_params, expert_params=shape.expert_params,
        dense_params=shape.dense_params, experts_per_rank=shape.num_experts // ep,
        expert_params_per_rank=math.ceil(shape.expert_params / (ep * tp * pp)), expert_state_bytes_per_rank=state.total,
        experts_sharded_over_efsdp=ep == 1 or v17_shards_experts_over_efsdp(zero),
        alltoall_bytes_per_step=alltoall, allgather_bytes_per_step=allgather, dispatcher=pick, why=why,
        active_flops_per_token=6.0 * shape.active_params,
    )  # fmt: skip


def traffic_warning(dispatch_s: float, *, compute_s: float, shape: ModelShape, ep: int, gpus_per_node: int) -> str | None:
    """One warning line when the token dispatch takes longer than the step's compute, else None.

    The dispatch sits on the critical path (a MoE block waits for its rows; Megatron-core overlaps it only across
    micro-batches), so when it exceeds the compute it, not the FLOPs, sets the step time.
    """
    if dispatch_s <= compute_s:
        return None
    fix = (f"keep the ep group inside a node (ep <= {gpus_per_node}) or lower ep" if ep > gpus_per_node else
           "lower ep (fewer rows leave each rank) or raise the micro-batch so the experts' GEMMs grow")
    return (f"MoE dispatch dominates the step: the all-to-all of k={shape.experts_per_token} rows per token over ep={ep} "
            f"takes ~{dispatch_s:.3g} s against {compute_s:.3g} s of compute; {fix}")


__all__ = [
    "MoEReport",
    "allgather_bytes_per_layer",
    "alltoall_bytes_per_layer",
    "check_ep",
    "expert_collectives",
    "expert_grad_allreduce_bytes",
    "expert_state_bytes_per_rank",
    "gathered_unit_params",
    "moe_activation_delta_bytes_per_layer",
    "moe_report",
    "pick_dispatcher",
    "recommend_ep",
    "traffic_warning",
    "v17_shards_experts_over_efsdp",
]
