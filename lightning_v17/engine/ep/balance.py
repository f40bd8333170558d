"""The aux-loss-free balance of DeepSeek-V3 (Liu 2024 §2.1.2): after each optimizer step, every MoE layer's expert
bias moves by ``u * sign(mean load - load)``, the load being the tokens each expert received during the step, summed
over every data-parallel rank, so that the bias is the same on every rank, bit for bit.

The MoE layer counts its routed tokens itself (``expert_load``, not while activation checkpointing recomputes a
forward) and applies the update (``update_expert_bias(total_load)``); here the loads of all layers are summed over
the ranks with one all-reduce and handed back. The reference LightningModule calls it after each optimizer step
under any strategy (``LlamaLM.step_expert_biases``), over that strategy's data-parallel ranks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["balanced_layers", "step_expert_biases"]


def balanced_layers(module: nn.Module) -> list[nn.Module]:
    """The MoE layers of ``module`` that count their load and update a bias from it, in module order."""
    return [m for m in module.modules() if hasattr(m, "update_expert_bias") and hasattr(m, "expert_load")]


@torch.no_grad()
def step_expert_biases(layers: list[nn.Module], *, group: Any = None) -> None:
    """One bias update for every layer: the loads summed over ``group`` (one all-reduce), then each layer's
    ``update_expert_bias``. Every rank of ``group`` must call it after the same optimizer step."""
    if not layers:
        return
    loads = torch.stack([m.expert_load.detach().float() for m in layers])
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(loads, group=group)  # integer counts in fp32: exact up to 2**24 tokens per expert and step
    for m, load in zip(layers, loads):
        m.update_expert_bias(load)
