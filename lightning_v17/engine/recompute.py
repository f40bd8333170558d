"""Activation checkpointing ("recompute", design §7), keyword-only and Lightning-free.

* ``full``: each unit (transformer block) keeps only its input; everything inside is recomputed in backward.
* ``selective`` (Korthikanti 2022 §4): inside each unit the outputs of the matmuls (mm/addmm/bmm and fused
  scaled-dot-product attention) are saved and the cheap elementwise ops (norms, activations, dropout, softmax) are
  recomputed, via ``torch.utils.checkpoint.create_selective_checkpoint_contexts``. This keeps most of the memory
  saving at a small fraction of the extra FLOPs.

Both use the non-reentrant implementation (``use_reentrant=False``) with ``preserve_rng_state=True``, so dropout draws
the same masks in the recomputation and losses equal the run without checkpointing.

The unit's ``forward`` is replaced on the instance rather than wrapping the module (``checkpoint_wrapper`` inserts a
``_checkpoint_wrapped_module`` level), so parameter FQNs, state dicts and checkpoints are unchanged by recompute.
FSDP2 hooks sit around ``__call__`` and keep working (its pre-backward unshard runs before the recomputation).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lightning_v17.config import Recompute
from lightning_v17.engine.state import state_of

__all__ = ["SAVED_OPS", "apply_activation_checkpointing", "selective_policy"]

log = logging.getLogger(__name__)


def _saved_ops() -> frozenset:
    aten = torch.ops.aten
    names = [
        "mm", "addmm", "bmm", "baddbmm", "_scaled_mm",
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
    ]  # fmt: skip
    return frozenset(getattr(aten, n).default for n in names if hasattr(aten, n))


#: aten ops whose outputs selective recompute saves (the matmuls and fused attention); everything else is recomputed.
SAVED_OPS = _saved_ops()


def selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Save matmul/attention outputs, recompute the rest (Korthikanti 2022 §4)."""
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _checkpointed_forward(orig, mode: Recompute, *args, **kwargs):
    if not torch.is_grad_enabled():  # eval / no_grad: nothing is saved anyway
        return orig(*args, **kwargs)
    extra = {}
    if mode == Recompute.SELECTIVE:
        extra["context_fn"] = functools.partial(create_selective_checkpoint_contexts, selective_policy)
    return checkpoint(orig, *args, use_reentrant=False, preserve_rng_state=True, **extra, **kwargs)


def _disable_kv_cache(module: nn.Module) -> None:
    """Turn off a model's key/value cache (``config.use_cache``, the Hugging Face convention).

    A cache is state the forward mutates: recomputing a block appends its keys/values a second time, and the
    recomputed attention then sees twice the sequence (torch's checkpoint raises "Recomputed values ... have
    different metadata"). Training does not use the cache; Hugging Face's own ``gradient_checkpointing_enable``
    turns it off for the same reason.
    """
    for m in module.modules():
        cfg = getattr(m, "config", None)
        if getattr(cfg, "use_cache", None) is True:
            cfg.use_cache = False
            log.info("activation checkpointing: set %s.config.use_cache=False (a KV cache cannot be recomputed)",
                     type(m).__name__)


def apply_activation_checkpointing(
    module: nn.Module, *, mode: Recompute | str, units: Sequence[nn.Module] | None = None
) -> list[nn.Module]:
    """Checkpoint each unit of ``module`` in place.

    Args:
        module: the model.
        mode: "none", "selective" or "full" (parsed with :meth:`Recompute.parse`).
        units: the modules to checkpoint; None detects the repeated blocks like ZeRO-3 does
            (:func:`lightning_v17.engine.zero.fsdp.find_wrap_units`).

    Returns:
        The units that were checkpointed (empty for "none").
    """
    mode = Recompute.parse(mode)
    if mode == Recompute.NONE:
        return []
    if units is None:
        from lightning_v17.engine.zero.fsdp import find_wrap_units

        units = find_wrap_units(module)
    _disable_kv_cache(module)
    for u in units:
        if state_of(u).recompute is not None:
            continue
        orig = u.forward
        u.forward = functools.partial(_checkpointed_forward, orig, mode)  # instance attribute: FQNs unchanged
        state_of(u).recompute = mode
    return list(units)
