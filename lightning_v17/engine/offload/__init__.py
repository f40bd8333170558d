"""Offload tiers (ZeRO-Offload, ZeRO-Infinity): the optimizer tier (``optimizer``, reached from its optimizer
through ``handles``), the parameter tier (``params``, ``param_store``), host memory that is page-locked or recycled
(``host_memory``) and the nvme file I/O (``nvme``: a thread pool; ``aio``: DeepSpeed's libaio op)."""

from lightning_v17.engine.offload.activations import ActivationOffload, check_activation_tier
from lightning_v17.engine.offload.aio import AioIO, aio_backend_or_reason, prebuild
from lightning_v17.engine.offload.handles import attach_offload, materialized, offload_of
from lightning_v17.engine.offload.host_memory import (
    HEAP_MMAP_THRESHOLD,
    AfterWrite,
    BufferPool,
    PooledRead,
    fix_mmap_threshold,
    mapped_empty,
    own_mappings,
    sole_owner,
    trim_heap,
    user_mmap_threshold,
)
from lightning_v17.engine.offload.nvme import (
    NvmeFileSet,
    ThreadPoolIO,
    check_nvme_path,
    free_margin_bytes,
    host_buffer,
    submit_io,
)
from lightning_v17.engine.offload.optimizer import OptimizerOffload, planned_state_bytes
from lightning_v17.engine.offload.param_store import SLOT_ALIGN, ReleasedShard
from lightning_v17.engine.offload.params import ParamOffload
from lightning_v17.engine.offload.tier_io import TierIO, open_io

__all__ = [
    "HEAP_MMAP_THRESHOLD",
    "SLOT_ALIGN",
    "ActivationOffload",
    "AfterWrite",
    "AioIO",
    "BufferPool",
    "NvmeFileSet",
    "OptimizerOffload",
    "ParamOffload",
    "PooledRead",
    "ReleasedShard",
    "ThreadPoolIO",
    "TierIO",
    "aio_backend_or_reason",
    "attach_offload",
    "check_activation_tier",
    "check_nvme_path",
    "fix_mmap_threshold",
    "free_margin_bytes",
    "host_buffer",
    "mapped_empty",
    "materialized",
    "offload_of",
    "open_io",
    "own_mappings",
    "planned_state_bytes",
    "prebuild",
    "sole_owner",
    "submit_io",
    "trim_heap",
    "user_mmap_threshold",
]
