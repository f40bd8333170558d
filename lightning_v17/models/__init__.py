"""Reference Llama-style decoder (``Llama``, ``ModelConfig``), varlen attention and the ``LlamaLM`` LightningModule.

``LlamaLM`` is imported lazily so that ``import lightning_v17.models`` does not pull in Lightning.
"""

from __future__ import annotations

from typing import Any

from lightning_v17.models.attention import AttentionBackend, cu_seqlens_from_position_ids, varlen_attention
from lightning_v17.models.config import ModelConfig
from lightning_v17.models.llama import (
    BLOCK_TP_PLAN,
    TOP_TP_PLAN,
    Attention,
    FeedForward,
    Llama,
    RMSNorm,
    TransformerBlock,
)
from lightning_v17.models.moe import GroupedExperts, LocalDispatch, MoE, moe_layers, update_expert_biases

__all__ = [
    "BLOCK_TP_PLAN",
    "TOP_TP_PLAN",
    "Attention",
    "AttentionBackend",
    "FeedForward",
    "GroupedExperts",
    "Llama",
    "LlamaLM",
    "LocalDispatch",
    "MoE",
    "ModelConfig",
    "RMSNorm",
    "TransformerBlock",
    "cu_seqlens_from_position_ids",
    "moe_layers",
    "update_expert_biases",
    "varlen_attention",
]


def __getattr__(name: str) -> Any:
    if name == "LlamaLM":
        from lightning_v17.models.lightning import LlamaLM

        return LlamaLM
    raise AttributeError(f"module 'lightning_v17.models' has no attribute {name!r}")
