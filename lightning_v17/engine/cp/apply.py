"""The entry points of context parallelism: which scheme, and the one attention call a model switches to.

A model's attention computes q, k, v of its local tokens (``[B, S/cp, H, D]``, RoPE applied with the *global*
``position_ids`` that :func:`~lightning_v17.engine.cp.sharding.shard_batch` kept) and, under cp > 1, calls
:func:`context_parallel_attention` (or :meth:`CPContext.attention`) instead of its kernel; the output has the same
shape as the kernel's would have had on the local tokens, so ``wo`` and everything after run unchanged.

Choosing the scheme (:func:`choose_cp_mode`, ``cp_mode="auto"``) by the elements each rank sends per layer and row
in forward (backward moves the same again under ulysses, twice that under allgather, which gathers K/V again rather
than keep them):

- ulysses: q, k, v and the output through an all-to-all, ``(2 Hq + 2 Hkv') D (S/cp) (cp-1)/cp`` with
  ``Hkv' = max(Hkv, cp)`` KV heads after ALST's replication;
- allgather: K and V all-gathered, ``2 Hkv D S (cp-1)/cp``.

Ulysses moves less exactly when ``cp > (Hq + Hkv) / Hkv`` (cp > 5 for Llama-3-8B, Hq = 32, Hkv = 8), and only
exists when cp divides Hq and cp divides or is a multiple of Hkv.

A model whose attention cannot take an extra argument (a Hugging Face attention-registry function) reads the batch's
context from :func:`current_cp_context`, set by ``with use_cp_context(ctx):`` (or :func:`set_cp_context`) around the
forward *and* the backward (activation checkpointing recomputes the attention during backward, and it must find the
same context then).
:func:`hf_attention_forward` is such a function, with the signature of ``transformers.AttentionInterface``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_v17.config import CPMode, V17ConfigError
from lightning_v17.engine.cp.allgather import allgather_attention
from lightning_v17.engine.cp.sharding import CPBatch, SequenceLayout, cu_seqlens_from_segment_ids
from lightning_v17.engine.cp.ulysses import AttentionFn, check_ulysses_heads, ulysses_attention

__all__ = ["CPContext", "CPMode", "choose_cp_mode", "context_parallel_attention", "cp_comm_elements",
           "current_cp_context", "hf_attention_forward", "set_cp_context", "use_cp_context"]  # fmt: skip


def cp_comm_elements(mode: str | CPMode, *, seq_len: int, cp: int, heads: int, kv_heads: int, head_dim: int) -> float:
    """Elements one rank sends per layer and row in forward (see the module docstring; backward: the same again
    under ulysses, twice this under allgather)."""
    mode = CPMode.parse(mode)
    frac = (cp - 1) / cp
    if mode is CPMode.ULYSSES:
        return (2 * heads + 2 * max(kv_heads, cp)) * head_dim * (seq_len / cp) * frac
    if mode is CPMode.ALLGATHER:
        return 2 * kv_heads * head_dim * seq_len * frac
    raise ValueError("cp_comm_elements needs a concrete mode, not 'auto'")


def choose_cp_mode(mode: str | CPMode, *, cp: int, heads: int, kv_heads: int) -> CPMode:
    """Resolve ``mode``: ``auto`` takes the scheme that sends fewer elements (ulysses only where the heads allow);
    an explicit ``ulysses`` is checked against the heads (a user error names the fix)."""
    mode = CPMode.parse(mode)
    if mode is CPMode.ULYSSES:
        check_ulysses_heads(cp, heads, kv_heads)
    if mode is not CPMode.AUTO:
        return mode
    try:
        check_ulysses_heads(cp, heads, kv_heads)
    except V17ConfigError:
        return CPMode.ALLGATHER
    dims = {"seq_len": cp, "cp": cp, "heads": heads, "kv_heads": kv_heads, "head_dim": 1}
    ulysses, allgather = cp_comm_elements(CPMode.ULYSSES, **dims), cp_comm_elements(CPMode.ALLGATHER, **dims)
    return CPMode.ULYSSES if ulysses < allgather else CPMode.ALLGATHER


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mode: str | CPMode,
    group: Any,
    layout: SequenceLayout,
    segment_ids: torch.Tensor | None = None,
    attention_fn: AttentionFn | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal (document-masked) attention of this rank's tokens over the whole rows.

    Args:
        q: [B, S/cp, Hq, D] this rank's tokens in local order; k, v: [B, S/cp, Hkv, D].
        mode: ``ulysses`` or ``allgather`` (``auto`` is resolved from the head counts).
        group: the cp process group (its size must be ``layout.cp``).
        layout: the :class:`SequenceLayout` the batch was sharded with.
        segment_ids: [B, S] documents of the full rows in token order (``CPBatch.segment_ids``); None: one causal
            document per row.
        attention_fn: ulysses only: the kernel on whole rows in token order, ``fn(q, k, v)`` with q [B, S, h, D]
            (default: exact per-document SDPA); allgather always uses masked SDPA.
        scale: softmax scale; default 1/sqrt(D).

    Returns:
        [B, S/cp, Hq, D].
    """
    mode = choose_cp_mode(mode, cp=dist.get_world_size(group), heads=q.shape[2], kv_heads=k.shape[2])
    if mode is CPMode.ULYSSES:
        return ulysses_attention(q, k, v, group=group, layout=layout, segment_ids=segment_ids,
                                 attention_fn=attention_fn, scale=scale)  # fmt: skip
    if attention_fn is not None:
        raise ValueError("attention_fn is a ulysses option; CPPolicy(mode='allgather') runs document-masked SDPA")
    return allgather_attention(q, k, v, group=group, layout=layout, segment_ids=segment_ids, scale=scale)


@dataclass(frozen=True)
class CPContext:
    """What a model's attention needs under cp > 1 for one batch: built once per batch, read by every layer.

    Args:
        mode: the resolved scheme (``ulysses`` or ``allgather``).
        group: the cp process group.
        layout: the batch's :class:`SequenceLayout`.
        segment_ids: [B, S] documents of the full rows, or None.
    """

    mode: CPMode
    group: Any
    layout: SequenceLayout
    segment_ids: torch.Tensor | None = None

    @classmethod
    def from_batch(cls, batch: CPBatch, *, mode: str | CPMode, group: Any) -> CPContext:
        return cls(mode=CPMode.parse(mode), group=group, layout=batch.layout, segment_ids=batch.segment_ids)

    @property
    def cu_seqlens(self) -> torch.Tensor | None:
        """int32 document offsets of the full rows (for a varlen ``attention_fn`` under ulysses), or None."""
        if self.segment_ids is None:
            return None
        cached = self.__dict__.get("_cu")
        if cached is None:
            cached = cu_seqlens_from_segment_ids(self.segment_ids)
            object.__setattr__(self, "_cu", cached)
        return cached

    def split_rows(self, n: int, *, rows: int | None = None) -> list[CPContext]:
        """This batch's context for each of ``n`` micro-batches of its rows: ``segment_ids`` padded to ``rows`` rows
        with copies of row 0 (as the pipeline pads a short batch) and cut with ``torch.tensor_split`` on dim 0, as
        ``torch.distributed.pipelining`` cuts its inputs. The layout is the batch's (every row is sharded alike)."""
        seg = self.segment_ids
        if seg is None:
            return [self] * n
        if rows is not None and rows > seg.shape[0]:
            seg = torch.cat([seg, seg[:1].expand(rows - seg.shape[0], *seg.shape[1:])])
        return [dataclasses.replace(self, segment_ids=part) for part in seg.tensor_split(n)]

    def attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, attention_fn: AttentionFn | None = None,
        scale: float | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """:func:`context_parallel_attention` with this batch's layout and documents."""
        return context_parallel_attention(q, k, v, mode=self.mode, group=self.group, layout=self.layout,
                                          segment_ids=self.segment_ids, attention_fn=attention_fn, scale=scale)  # fmt: skip


_CURRENT: contextvars.ContextVar[CPContext | None] = contextvars.ContextVar("v17_cp_context", default=None)


@contextlib.contextmanager
def use_cp_context(ctx: CPContext | None) -> Iterator[CPContext | None]:
    """Make ``ctx`` the :func:`current_cp_context` inside the block (wrap the forward and the backward)."""
    token = _CURRENT.set(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.reset(token)


def set_cp_context(ctx: CPContext | None) -> None:
    """Make ``ctx`` the :func:`current_cp_context` until the next call (a strategy sets each batch's context when it
    shards the batch, and clears it with ``None`` after the step's backward)."""
    _CURRENT.set(ctx)


def current_cp_context() -> CPContext | None:
    """The context set by the innermost :func:`use_cp_context`, or None (cp off)."""
    return _CURRENT.get()


def hf_attention_forward(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Context-parallel attention with Hugging Face's attention-function signature (register it with
    ``transformers.AttentionInterface.register(name, hf_attention_forward)`` and set the model's attention
    implementation to ``name``): query [B, Hq, S/cp, D], key/value [B, Hkv, S/cp, D] of the local tokens ->
    ([B, S/cp, Hq, D], None), under the :func:`current_cp_context`.

    The ``attention_mask`` the model built for its local tokens is ignored: the context's documents (from the full
    rows' ``position_ids``) mask instead, so a padding mask must be expressed as its own documents. A layer that
    asks for more than causal attention (a sliding window, logit soft-capping, attention sinks, a non-causal
    module) is refused by name rather than computed differently.
    """
    ctx = current_cp_context()
    if ctx is None:
        raise RuntimeError("the context-parallel attention ran outside `with use_cp_context(ctx):`; wrap the forward "
                           "and the backward of every cp batch in it")  # fmt: skip
    if dropout:
        raise ValueError(f"context-parallel attention has no attention dropout (dropout={dropout}); set it to 0")
    unsupported = {k: kwargs[k] for k in ("sliding_window", "softcap", "s_aux") if kwargs.get(k) is not None}
    if unsupported or not getattr(module, "is_causal", True):
        raise ValueError(
            f"context-parallel attention is causal attention within documents only; {type(module).__name__} asks "
            f"for {unsupported or 'non-causal attention'}: this model family is not supported under cp > 1"
        )
    out = ctx.attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), scale=scaling)
    return out, None
