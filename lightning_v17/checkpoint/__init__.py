"""Checkpoints: sharded DCP saves that reshard on load (``sharded``), asynchronous saves (``async_save``) and
loading only what is safe (``safe_load``); DeepSpeed ZeRO checkpoints read without deepspeed (``deepspeed``) and
converted once into sharded ones (``deepspeed_convert``)."""

from lightning_v17.checkpoint.async_save import AsyncSaveError, AsyncShardedSaver, PreallocatedStager, SaveResult
from lightning_v17.checkpoint.deepspeed import (
    DEEPSPEED_SAFE_GLOBALS,
    DeepSpeedState,
    is_deepspeed_checkpoint,
    read_deepspeed_checkpoint,
)
from lightning_v17.checkpoint.deepspeed_convert import convert_deepspeed
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
    "DEEPSPEED_SAFE_GLOBALS",
    "FORMAT",
    "TRAINER_STATE_SAFE_GLOBALS",
    "AsyncSaveError",
    "AsyncShardedSaver",
    "CheckpointCorruptError",
    "DeepSpeedState",
    "PreallocatedStager",
    "SaveResult",
    "UnsafeCheckpointError",
    "check_dcp_pickles",
    "consolidate",
    "consolidate_main",
    "convert_deepspeed",
    "is_deepspeed_checkpoint",
    "is_sharded_checkpoint",
    "load_full_state_dict",
    "load_sharded",
    "load_trainer_state",
    "partial_path",
    "read_deepspeed_checkpoint",
    "save_sharded",
    "verify_checkpoint",
]
