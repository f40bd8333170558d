"""Expert parallelism (design §9; GShard, Lepikhin 2020; torchtitan, Megatron-core MoE): the experts of MoE layers
sharded over the ``ep`` axis (``apply``), the tokens dispatched to them by all-to-all (``dispatch``) and the
aux-loss-free expert bias updated once per step over every rank (``balance``), and the per-sequence statistics
of MoE layers that route slices of the sequences under sequence or context parallelism (``tokens``)."""

from lightning_v17.engine.ep.apply import (
    ExpertGradSync,
    ExpertParallel,
    apply_expert_parallel,
    check_pipeline_moe,
    expert_params,
    find_moe_layers,
    is_expert_param,
)
from lightning_v17.engine.ep.balance import balanced_layers, step_expert_biases
from lightning_v17.engine.ep.dispatch import (
    AllGatherDispatch,
    AllToAllDispatch,
    all_gather_rows,
    all_to_all,
    make_dispatcher,
)
from lightning_v17.engine.ep.tokens import TokenSplit

__all__ = [
    "AllGatherDispatch",
    "AllToAllDispatch",
    "ExpertGradSync",
    "ExpertParallel",
    "TokenSplit",
    "all_gather_rows",
    "all_to_all",
    "apply_expert_parallel",
    "balanced_layers",
    "check_pipeline_moe",
    "expert_params",
    "find_moe_layers",
    "is_expert_param",
    "make_dispatcher",
    "step_expert_biases",
]
