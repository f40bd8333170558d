"""ZeRO stages 0-3 (Rajbhandari 2020): the one object every caller asks (``backend``), stages 0-2 over
replicated parameters (``stages_0_2``, ``layout``, ``comm``), stage 3 on FSDP2 (``fsdp``) and the sharded state dicts
(``state_dict``)."""

from lightning_v17.engine.zero.backend import ZeroBackend
from lightning_v17.engine.zero.comm import gather_bucket, pack_grad, pack_rows
from lightning_v17.engine.zero.fsdp import (
    after_optimizer_step,
    apply_fsdp,
    find_wrap_units,
    fsdp_root,
    optimizer_steps_inside,
    run_as_forward,
    set_cpu_prefetch,
    set_requires_gradient_sync,
)
from lightning_v17.engine.zero.layout import (
    PARTITIONS,
    ShardParameter,
    chunk_rows,
    is_elementwise_optimizer,
    shard_view,
)
from lightning_v17.engine.zero.meta_init import deferred_init, has_meta, materialize_meta_module
from lightning_v17.engine.zero.owner_step import OwnerStep, StepPlan, attach_owner_steps, owner_step_of, plan_step
from lightning_v17.engine.zero.stages_0_2 import ZeroEngine, apply_zero, broadcast_module
from lightning_v17.engine.zero.state_dict import (
    get_model_state,
    get_state_dicts,
    merge_optim,
    param_group_lists,
    restore_param_group_lists,
    set_state_dicts,
)

__all__ = [
    "PARTITIONS",
    "OwnerStep",
    "ShardParameter",
    "StepPlan",
    "ZeroBackend",
    "ZeroEngine",
    "after_optimizer_step",
    "apply_fsdp",
    "apply_zero",
    "attach_owner_steps",
    "broadcast_module",
    "chunk_rows",
    "deferred_init",
    "find_wrap_units",
    "fsdp_root",
    "gather_bucket",
    "get_model_state",
    "get_state_dicts",
    "has_meta",
    "is_elementwise_optimizer",
    "materialize_meta_module",
    "merge_optim",
    "optimizer_steps_inside",
    "owner_step_of",
    "pack_grad",
    "pack_rows",
    "param_group_lists",
    "plan_step",
    "restore_param_group_lists",
    "run_as_forward",
    "set_cpu_prefetch",
    "set_requires_gradient_sync",
    "set_state_dicts",
    "shard_view",
]
