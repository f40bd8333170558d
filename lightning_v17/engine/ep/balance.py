"""The aux-loss-free balance of DeepSeek-V3 (Liu 2024 §2.1.2): after each optimizer step, every MoE layer's expert
bias moves by ``u * sign(mean load - load)``, the load being the tokens each expert received during the step, summed
over every data-parallel rank, so that the bias is the same on every rank, bit for bit.

The MoE layer counts its routed tokens itself (``expert_load``, not while activation checkpointing recomputes a
forward) and applies the update (``update_expert_bias(total_load)``); here the loads of all layers are summed over
the ranks with one all-reduce and handed back. The reference LightningModule calls it after each optimizer step
under any strategy (``LlamaLM.step_expert_biases``), over that strategy's data-parallel ranks.

Inside a pipeline schedule (pp > 1) two more things hold, both set by the pipeline runtime
(``engine/pipeline/runtime.py``), which alone knows the schedule:

* The schedule's loss is the last stage's cross-entropy; a MoE layer on any stage adds its balance losses to the
  objective by attaching them to its output activations (:func:`attach_aux_loss`, Megatron-core's
  ``MoEAuxLossAutoScaler``): the output passes through unchanged and its backward adds ``scale * ones_like(aux)`` as
  the aux loss's gradient, ``scale`` being what the micro-batch's main loss is back-propagated with (the fp16 loss
  scale, Lightning's ``1 / accumulate_grad_batches``) over the micro-batches ``M``: the micro-batches' aux losses are
  means over their rows, and ``1/M`` each makes their sum the mean over the step's rows, what one process adds.
* torch's pipelining infers the stages' shapes with an extra forward (and a backward for the gradients' shapes) of
  micro-batch 0 on its first step and after each switch between training and evaluation (torch
  ``pipelining/stage.py``, ``_prepare_forward_infra`` / ``_prepare_backward_infra``); the later stages run it on
  uninitialized activations. Inside :func:`shape_inference` the layers count no load and keep no aux loss.
"""

from __future__ import annotations

import contextlib
import contextvars
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["AuxLossScaler", "PipelineBalanceStep", "attach_aux_loss", "balanced_layers", "current_pipeline_step",
           "in_shape_inference", "pipeline_balance_step", "shape_inference", "step_expert_biases",
           "warn_padding_once"]  # fmt: skip


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


# ------------------------------------------------------------------------------------------ inside a pipeline schedule


@dataclass(frozen=True)
class PipelineBalanceStep:
    """The pipeline step being run, as the MoE layers need it.

    Attributes:
        aux_scale: the factor of every micro-batch's aux-loss gradient: the main loss's backward scale over the
            micro-batches (a float, or the fp16 loss scale as a tensor).
        padding_rows: rows the runtime appended to a ragged batch (copies of row 0, no loss targets): routed like
            real rows, so they count in the load and the aux losses of this step.
    """

    aux_scale: torch.Tensor | float
    padding_rows: int = 0


_STEP: contextvars.ContextVar[PipelineBalanceStep | None] = contextvars.ContextVar("v17_moe_pp_step", default=None)
_INFERRING: contextvars.ContextVar[bool] = contextvars.ContextVar("v17_moe_shape_inference", default=False)
_WARNED: set[str] = set()


@contextlib.contextmanager
def pipeline_balance_step(aux_scale: torch.Tensor | float, *, padding_rows: int = 0) -> Iterator[None]:
    """Run a pipeline training step: the MoE layers attach their aux losses scaled by ``aux_scale`` (module
    docstring); ``padding_rows`` (> 0: a ragged batch) is warned about once by a layer with a balance term."""
    token = _STEP.set(PipelineBalanceStep(aux_scale, padding_rows))
    try:
        yield
    finally:
        _STEP.reset(token)


def current_pipeline_step() -> PipelineBalanceStep | None:
    """The pipeline step being run (:func:`pipeline_balance_step`), or None outside a schedule."""
    return _STEP.get()


@contextlib.contextmanager
def shape_inference() -> Iterator[None]:
    """A forward that only infers shapes: MoE layers count no routed load in it and keep no aux loss from it."""
    token = _INFERRING.set(True)
    try:
        yield
    finally:
        _INFERRING.reset(token)


def in_shape_inference() -> bool:
    return _INFERRING.get()


def warn_padding_once(step: PipelineBalanceStep) -> None:
    """Warn once per process that a ragged batch's padding rows count in the MoE balance terms of their step."""
    if step.padding_rows <= 0 or "padding" in _WARNED:
        return
    _WARNED.add("padding")
    warnings.warn(
        f"a pipeline step padded a ragged batch with {step.padding_rows} rows (copies of row 0, without targets) to "
        "the stages' fixed shape; the MoE layers route them, so they count in that step's expert load (the "
        "expert-bias update) and balance losses. Give every step the same number of rows, a multiple of "
        "PipelinePolicy(microbatches=...), for exact balance terms (e.g. drop_last=True)",
        stacklevel=3,
    )


class AuxLossScaler(torch.autograd.Function):
    """Megatron-core's ``MoEAuxLossAutoScaler`` (``megatron/core/transformer/moe/moe_utils.py``): returns
    ``output`` unchanged and, in backward, hands ``aux`` the gradient ``scale * ones_like(aux)``, as if
    ``scale * aux`` had been added to the loss whose backward reaches ``output``."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, aux: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
        ctx.aux_like = (aux.shape, aux.dtype, aux.device)
        ctx.scale = scale
        return output

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        shape, dtype, device = ctx.aux_like
        scale = ctx.scale
        if isinstance(scale, torch.Tensor):
            scale = scale.to(device=device, dtype=dtype)
        return grad_output, torch.ones(shape, dtype=dtype, device=device) * scale, None


def attach_aux_loss(output: torch.Tensor, aux: torch.Tensor) -> torch.Tensor | None:
    """``output`` carrying ``aux`` into the backward of the pipeline step being run (:class:`AuxLossScaler` at
    the step's ``aux_scale``); None outside a pipeline training step (the caller adds ``aux`` to its loss itself)."""
    step = _STEP.get()
    if step is None or not torch.is_grad_enabled() or not aux.requires_grad:
        return None
    return AuxLossScaler.apply(output, aux, step.aux_scale)
