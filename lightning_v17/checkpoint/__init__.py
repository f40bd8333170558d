"""Checkpoints: sharded DCP saves that reshard on load (``sharded``), asynchronous saves (``async_save``) and
loading only what is safe (``safe_load``)."""

from lightning_v17.checkpoint.async_save import AsyncSaveError, AsyncShardedSaver, PreallocatedStager, SaveResult
from lightning_v17.checkpoint.safe_load import (
    TRAINER_STATE_SAFE_GLOBALS,
    UnsafeCheckpointError,
    check_dcp_pickles,
    load_trainer_state,
)
from lightning_v17.checkpoint.sharded import (
    FORMAT,
    CheckpointCorruptError,
    consolidate,
    consolidate_main,
    is_sharded_checkpoint,
    load_full_state_dict,
    load_sharded,
    partial_path,
    save_sharded,
    verify_checkpoint,
)

__all__ = [
    "FORMAT",
    "TRAINER_STATE_SAFE_GLOBALS",
    "AsyncSaveError",
    "AsyncShardedSaver",
    "CheckpointCorruptError",
    "PreallocatedStager",
    "SaveResult",
    "UnsafeCheckpointError",
    "check_dcp_pickles",
    "consolidate",
    "consolidate_main",
    "is_sharded_checkpoint",
    "load_full_state_dict",
    "load_sharded",
    "load_trainer_state",
    "partial_path",
    "save_sharded",
    "verify_checkpoint",
]
