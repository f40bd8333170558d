"""Hugging Face MoE models under V17's expert parallelism, unchanged: the sparse MoE blocks of transformers'
fused-experts families (Mixtral, Qwen3-MoE, DeepSeek-V3, ...) become engine MoE layers.

transformers >= 5 stores a block's routed experts as one module with 3-D weights, ``gate_up_proj`` [E, 2I, H]
(gate rows, then up rows) and ``down_proj`` [E, H, I], called as ``experts(hidden [T, H], top_k_index [T, k],
top_k_weights [T, k])`` after the block's own router. :func:`adapt_hf_moe` keys on that layout, not on class names:
the router, the shared experts, DeepSeek's score-correction bias and group-limited routing stay the model's own code;
only the experts' computation is replaced, on the instance (the module, its parameters and their FQNs stay, so
checkpoints and ``save_pretrained`` are unchanged). The new forward makes one row per (token, slot) assignment, hands
the rows to the block's ``dispatcher`` (the engine's all-to-all under ``ep > 1``; the local sort otherwise), which
runs the local experts as one grouped GEMM per projection through the experts' own gate (``_apply_gate``), and
combines the rows as transformers' ``grouped_mm`` implementation does (weights applied per row, the k rows of a
token summed).
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn

from lightning_v17.config import V17ConfigError
from lightning_v17.engine._dtensor import local
from lightning_v17.models.moe import LocalDispatch

__all__ = ["adapt_hf_moe", "is_fused_experts"]


def is_fused_experts(m: nn.Module) -> bool:
    """Whether ``m`` is a transformers experts module in the fused layout this adapter runs."""
    gu, down = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)
    return isinstance(gu, torch.Tensor) and isinstance(down, torch.Tensor) and gu.dim() == 3 and down.dim() == 3


def _unsupported(m: nn.Module) -> str | None:
    for flag, want in (("has_bias", False), ("has_gate", True), ("is_transposed", False), ("is_concatenated", True),
                       ("has_post_expert_norm", False)):  # fmt: skip
        if getattr(m, flag, want) != want:
            return f"{flag}={getattr(m, flag)}"
    return None


class _Grouped:
    """The local experts of a fused experts module, as the dispatchers call them: ``(rows by local expert,
    counts) -> rows``."""

    def __init__(self, experts: nn.Module) -> None:
        self.experts = experts
        self.num_experts = experts.gate_up_proj.shape[0]

    def __call__(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        gate_up, down = local(self.experts.gate_up_proj), local(self.experts.down_proj)
        offs = counts.cumsum(0).to(torch.int32)
        h = torch._grouped_mm(x, gate_up.transpose(-2, -1), offs=offs)
        if h.requires_grad:
            h.register_hook(lambda g: g.contiguous())
        y = torch._grouped_mm(self.experts._apply_gate(h), down.transpose(-2, -1), offs=offs)
        if y.requires_grad:
            y.register_hook(lambda g: g.contiguous())
        return y


def _forward(block: nn.Module) -> Any:
    def forward(self: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        t, k = top_k_index.shape
        rows = hidden[torch.arange(t, device=hidden.device).repeat_interleave(k)]  # (token, slot) order
        dispatch = block.dispatcher if block.dispatcher is not None else LocalDispatch()
        y = dispatch(rows, top_k_index.reshape(-1), _Grouped(self))
        out = (y * top_k_weights.reshape(-1, 1).to(y.dtype)).view(t, k, -1).sum(dim=1)
        return out.to(hidden.dtype)

    return forward


def adapt_hf_moe(module: nn.Module) -> list[str]:
    """Make every sparse MoE block of a Hugging Face model an engine MoE layer; the FQNs of the blocks adapted.

    A block is a module with an ``experts`` child in the fused layout; it gets ``num_experts`` and
    ``dispatcher = None`` (one process), and its experts a forward that dispatches through it. Idempotent.

    Raises:
        V17ConfigError: MoE blocks whose experts are not fused 3-D weights (a ``ModuleList`` of per-expert MLPs, as
            older transformers releases and other families have), or fused experts with biases, transposed or
            interleaved weights, or a post-expert norm: named, with what ``ep > 1`` needs.
    """
    done = []
    for name, block in module.named_modules():
        experts = getattr(block, "experts", None)
        if not isinstance(experts, nn.Module) or block is module:
            continue
        if isinstance(experts, nn.ModuleList):
            raise V17ConfigError(
                f"{type(block).__name__} ({name}) keeps its experts as a ModuleList of per-expert MLPs; ep > 1 shards "
                "experts fused as 3-D weights (gate_up_proj [E, 2I, H], down_proj [E, H, I]), as transformers >= 5 "
                "stores Mixtral, Qwen3-MoE and DeepSeek-V3: upgrade transformers, or use ep=1"
            )
        if not is_fused_experts(experts) or not hasattr(experts, "_apply_gate"):
            continue  # not transformers' fused experts (the reference model's MoE is an engine layer already)
        bad = _unsupported(experts)
        if bad is not None:
            raise V17ConfigError(
                f"{type(experts).__name__} ({name}.experts) has {bad}; ep > 1 runs fused gate-up experts without "
                "biases, transposition or a post-expert norm; use ep=1 for this model"
            )
        if getattr(block, "_v17_hf_moe", False):
            done.append(name)
            continue
        if hasattr(block, "dispatcher"):
            continue
        block.num_experts = experts.gate_up_proj.shape[0]
        block.dispatcher = None
        experts.forward = types.MethodType(_forward(block), experts)
        block._v17_hf_moe = True
        done.append(name)
    return done
