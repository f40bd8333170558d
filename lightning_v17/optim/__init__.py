"""The optimizer library: AdamW (fused), CPU-Adam (DeepSpeed), Adam8bit (bitsandbytes / torchao), Adafactor, Lion
(32- and 8-bit), built by name with :func:`build_optimizer` or named in YAML by ``class_path``.

Every class steps DTensor parameters (ZeRO-3's FSDP2 shards, tensor-parallel pieces) on their local tensors, with
the state still keyed by the parameters and held as DTensors, so DCP checkpoints reshard
(:mod:`lightning_v17.optim.local_step`); Adafactor completes its factored reductions over the shards
(:mod:`lightning_v17.optim.adafactor`).
"""

from __future__ import annotations

from lightning_v17.optim.adafactor import Adafactor
from lightning_v17.optim.factory import OptimizerName, build_optimizer, optimizer_class, optimizer_kind_of
from lightning_v17.optim.library import Adam8bit, AdamW, CPUAdam, Lion, Lion8bit, cpu_adam_cached, cpu_adam_unavailable
from lightning_v17.optim.local_step import LocalShardStep, local_shards

__all__ = [
    "Adafactor",
    "Adam8bit",
    "AdamW",
    "CPUAdam",
    "Lion",
    "Lion8bit",
    "LocalShardStep",
    "OptimizerName",
    "build_optimizer",
    "cpu_adam_cached",
    "cpu_adam_unavailable",
    "local_shards",
    "optimizer_class",
    "optimizer_kind_of",
]
