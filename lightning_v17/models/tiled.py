"""Tiled MLP and tiled logits + loss: memory options for long sequences on one device.

At a million tokens two tensors of a decoder dwarf the rest: the logits (``tokens x vocab``; fp32 at 1.3M x 128k is
~660 GB) and each MLP's ``tokens x ffn`` intermediates (three of them in a SwiGLU). Both are computed token by token,
so both can be computed a chunk of tokens at a time without changing any value (ALST, Bekman et al. 2025 §3.2:
``TiledMLP`` and ``TiledFusedLogitsLoss``; Liger-Kernel's fused linear cross-entropy does the same for the loss).

* :func:`tiled_mlp` runs a shape-preserving module (the SwiGLU MLP) over chunks of ``chunk_tokens`` rows of its
  flattened input. Each chunk is its own non-reentrant ``torch.utils.checkpoint``: forward keeps only the input,
  backward recomputes one chunk at a time (autograd's ready queue runs the chunks' nodes one chunk after the other,
  highest sequence number first), so the ``[tokens, ffn]`` activations of only one chunk are alive.
* :func:`tiled_next_token_loss` applies the LM head to ``chunk_tokens`` hidden rows at a time and reduces each
  chunk's cross-entropy to one number inside its own checkpoint: at most one chunk's logits exist, in forward and
  in backward (recomputed there). It returns ``(mean, count)`` exactly as ``next_token_loss`` of
  :mod:`lightning_v17.models.lightning` (token mean over labels != -100, times an optional ``loss_mask``).

Why checkpoints rather than a custom ``autograd.Function`` that differentiates each chunk by hand: the chunks call
the modules themselves, so everything that hooks a module keeps working unchanged. FSDP2 (ZeRO-3) has the unit's
parameters gathered whenever the module runs, and the recomputation in backward reads the parameter object the
module holds *then*, never one saved in forward (FSDP2 happens to re-gather into the same unsharded parameter
object; nothing here relies on it). TP's ``ColwiseParallel``/``RowwiseParallel`` hooks redistribute
each chunk, and ``loss_parallel`` computes each chunk's cross-entropy on vocab shards. And the original graph is the
one differentiated, so every parameter still gets one gradient accumulation per backward (hooks such as ZeRO-1/2's
post-accumulate-grad bucketing fire once, not once per chunk).

Exactness: the forward values are the untiled ones row by row; what changes is the summation order of the
quantities summed over tokens (the weight gradients, the loss sum), a few fp32 ulps (``tests/unit/test_tiled.py``).
Composes with activation checkpointing: under ``full`` the block's recomputation runs the chunked forward again
(and each chunk's backward recomputes it once more: ALST's cost of one extra MLP forward); under ``selective``
recompute saves every matmul output wherever it runs (``engine/recompute.py``'s policy), so the tiled MLP then
bounds only the recomputed element-wise intermediates, not the saved ``[tokens, ffn]`` matmul outputs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_v17.config import V17ConfigError
from lightning_v17.data.packing import IGNORE_INDEX
from lightning_v17.engine.loss_norm import divide_token_sum

__all__ = ["check_chunk_tokens", "head_detached", "tiled_mlp", "tiled_next_token_loss"]


def check_chunk_tokens(value: Any, option: str) -> int:
    """``value`` as a chunk size in tokens (0: off), or a :class:`V17ConfigError` naming ``option``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise V17ConfigError(
            f"{option}={value!r} must be an integer >= 0 (tokens per chunk; 0 turns tiling off), e.g. {option}=8192"
        )
    return value


def _checkpointed(fn: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
    # No RNG inside (the MLP and the head have no dropout): nothing to preserve, and no device RNG state per chunk.
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False)


def _differentiable(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def tiled_mlp(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, *, chunk_tokens: int) -> torch.Tensor:
    """``fn(x)`` for a token-wise, shape-preserving ``fn`` (an MLP), ``chunk_tokens`` rows of ``x`` at a time.

    Args:
        fn: maps ``[n, h]`` to ``[n, h]`` row by row (the SwiGLU ``w2(silu(w1 x) * w3 x)``).
        x: ``[..., h]``; the leading dims are flattened into tokens (a replicated DTensor under TP is fine).
        chunk_tokens: rows per chunk (> 0); the last chunk holds the remainder.

    Returns:
        ``[..., h]``, equal to ``fn(x)``. With autograd recording, each chunk is checkpointed (only ``x`` is kept;
        backward recomputes one chunk at a time); without, the chunks simply run one after the other.

    Raises:
        V17ConfigError: ``fn`` changed a chunk's shape: under tensor parallelism with ``sequence_parallel`` the
            row-parallel ``w2`` reduce-scatters each chunk's output, which a token chunk cannot be put back from.
    """
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    grad = _differentiable(x, *_params(fn))
    outs = []
    for piece in flat.split(chunk_tokens):
        y = _checkpointed(fn, piece) if grad else fn(piece)
        if tuple(y.shape) != tuple(piece.shape):
            raise V17ConfigError(
                f"mlp_chunk_tokens={chunk_tokens}: the MLP turned a chunk of shape {tuple(piece.shape)} into "
                f"{tuple(y.shape)}; with tensor parallelism's sequence_parallel=True its row-parallel w2 "
                "reduce-scatters every chunk, so chunks cannot be put back together. Set mlp_chunk_tokens=0 or "
                "sequence_parallel=False"
            )
        outs.append(y)
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)
    return out.reshape(shape)


def _params(fn: Callable[..., Any]) -> Iterator[torch.Tensor]:
    owner = getattr(fn, "__self__", fn)
    return owner.parameters() if isinstance(owner, nn.Module) else iter(())


def _chunk_loss(
    head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor
) -> torch.Tensor:
    """Sum over one chunk of ``weight x cross-entropy``: ``next_token_loss``'s per-token terms, on ``head(hidden)``."""
    logits = head(hidden)
    per_token = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), labels, ignore_index=IGNORE_INDEX, reduction="none"
    )
    if hasattr(per_token, "full_tensor"):  # loss_parallel: vocab-sharded logits -> a (replicated) DTensor per token
        per_token = per_token.full_tensor()
    return (per_token * weight).sum()


def tiled_next_token_loss(
    hidden: torch.Tensor,
    head: nn.Module,
    labels: torch.Tensor,
    loss_mask: torch.Tensor | None = None,
    *,
    chunk_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``next_token_loss(head(hidden), labels, loss_mask)`` with the logits of only ``chunk_tokens`` tokens alive.

    Args:
        hidden: ``[B, S, h]`` final hidden states (after the last norm), the head's input. A DTensor (TP with
            sequence parallel leaves the norm's output sharded on the sequence) is chunked as a DTensor: its
            reshape gathers the sequence, as the head's own input redistribution would, and the head's TP hooks
            take the chunks as they are.
        head: the output projection (``Llama.output``), called on ``[n, h]`` chunks (its hooks run per chunk).
        labels: ``[B, S]`` next-token ids (-100: no target).
        loss_mask: optional ``[B, S]`` float weights aligned with ``labels``.
        chunk_tokens: tokens per chunk (> 0); the last chunk holds the remainder.

    Returns:
        ``(mean loss, number of counted targets as a float tensor)``, as ``next_token_loss``.
    """
    flat = hidden.reshape(-1, hidden.shape[-1])
    lab = labels.reshape(-1)
    weight = (lab != IGNORE_INDEX).float()
    if loss_mask is not None:
        weight = weight * loss_mask.reshape(-1).float()
    count = weight.sum()
    grad = _differentiable(flat, *head.parameters())
    total = None
    for hc, lc, wc in zip(flat.split(chunk_tokens), lab.split(chunk_tokens), weight.split(chunk_tokens)):
        part = _checkpointed(_chunk_loss, head, hc, lc, wc) if grad else _chunk_loss(head, hc, lc, wc)
        total = part if total is None else total + part
    return divide_token_sum(total, count, where="tiled_next_token_loss"), count


@contextmanager
def head_detached(model: nn.Module, name: str = "output") -> Iterator[nn.Module]:
    """Run ``model`` without its head: ``model.<name>`` is None inside (the reference ``Llama`` then returns hidden
    states, as a pipeline stage without the head does) and the head module is yielded, to be applied chunk-wise.

    The module object is put back afterwards, untouched: its parameters, FSDP2/TP hooks and FQNs are those it had.
    Under FSDP2 run it inside the root's forward, as the strategy runs a step hook (``run_as_forward``), or after
    the root's first forward: FSDP2's lazy init walks the module tree once, at the root's first forward, and would
    not find a head that is an FSDP2 unit of its own (manual optimization's child units) while it is detached.
    """
    head = model._modules.get(name)
    if head is None:
        raise V17ConfigError(
            f"{type(model).__name__} has no {name!r} head to apply chunk-wise (a pipeline stage without the head?); "
            "set loss_chunk_tokens=0"
        )
    model._modules[name] = None
    try:
        yield head
    finally:
        model._modules[name] = head
