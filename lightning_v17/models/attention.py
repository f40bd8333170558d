"""Varlen (packed, document-masked) causal attention with three exact backends.

Given ``cu_seqlens`` (int32 offsets of the documents in the flattened ``B*S`` tokens, flash-attn's convention),
attention is causal *within* each document and zero across documents. No dense ``N x N`` mask is ever built:

- CUDA with flash-attn installed and half-precision inputs: ``flash_attn_varlen_func`` (Dao 2023, FlashAttention-2).
- CUDA otherwise: FlexAttention with a document block mask (its block sparsity skips cross-document tiles).
- CPU: one ``scaled_dot_product_attention(is_causal=True)`` call per document, O(sum len^2). FlexAttention has no
  CPU backward in torch 2.13 and nested-jagged SDPA refuses ``is_causal=True``, so this is the exact CPU path.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
from enum import StrEnum
from typing import Any

import torch
import torch.nn.functional as F

from lightning_v17.config import parse_enum


class AttentionBackend(StrEnum):
    """``auto`` picks flash -> flex -> sdpa by device and installed packages; the others force one backend."""

    AUTO = "auto"
    FLASH = "flash"
    FLEX = "flex"
    SDPA = "sdpa"

    @classmethod
    def parse(cls, value: Any) -> AttentionBackend:
        return parse_enum(cls, value, option="varlen_attention(backend=...)")  # type: ignore[return-value]


@functools.cache
def flash_attn_available() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None


@functools.cache
def flex_attention_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_backend(
    q: torch.Tensor, backend: str | AttentionBackend = "auto", *, dropout_p: float = 0.0
) -> AttentionBackend:
    """The backend that will run for ``q``; a forced GPU backend on CPU raises with the fix.

    ``auto`` never picks FlexAttention when ``dropout_p > 0``: flex_attention has no dropout, so such calls go to
    per-document SDPA instead (forcing ``flex`` with dropout raises with the fix).
    """
    backend = AttentionBackend.parse(backend)
    if backend is AttentionBackend.AUTO:
        if q.is_cuda and flash_attn_available() and q.dtype in (torch.float16, torch.bfloat16):
            return AttentionBackend.FLASH
        if q.is_cuda and flex_attention_available() and not dropout_p:
            return AttentionBackend.FLEX
        return AttentionBackend.SDPA
    if backend is not AttentionBackend.SDPA and not q.is_cuda:
        raise ValueError(f"attention backend {backend.value!r} needs CUDA tensors; use 'sdpa' (or 'auto') on CPU")
    if backend is AttentionBackend.FLASH and not flash_attn_available():
        raise ValueError("attention backend 'flash' needs the flash-attn package (pip install flash-attn)")
    if backend is AttentionBackend.FLEX and dropout_p:
        raise ValueError(
            f"attention backend 'flex' has no attention dropout (dropout_p={dropout_p}); set the model's dropout=0, "
            "or use backend='auto'/'sdpa' (per-document SDPA supports dropout)"
        )
    return backend


def _host_offsets(cu: torch.Tensor) -> list[int]:
    """``cu_seqlens`` as a Python list, converted once per tensor object: every layer of a forward gets the same
    ``cu_seqlens`` tensor, so on CUDA this is one device->host sync per forward instead of one per layer."""
    cached = getattr(cu, "_v17_host_offsets", None)
    if cached is None:
        cached = cu.tolist()
        cu._v17_host_offsets = cached  # a plain Python attribute on this tensor object
    return cached


def _max_seqlen(cu: torch.Tensor) -> int:
    """Longest document of ``cu_seqlens`` from the cached host offsets (no extra sync)."""
    offsets = _host_offsets(cu)
    return max((b - a for a, b in itertools.pairwise(offsets)), default=0)


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Document boundaries where ``position_ids == 0`` (and at every row start), as int32 ``cu_seqlens``.

    Args:
        position_ids: [B, S] positions restarting at 0 per document.

    Returns:
        (cu_seqlens [n+1] int32 over the flattened B*S tokens, max_seqlen).
    """
    b, s = position_ids.shape
    starts = position_ids.reshape(-1) == 0
    starts = starts.view(b, s).clone()
    starts[:, 0] = True  # attention never crosses rows, whatever the row starts with
    idx = torch.nonzero(starts.reshape(-1), as_tuple=False).reshape(-1)
    total = torch.tensor([b * s], device=idx.device, dtype=idx.dtype)
    cu = torch.cat([idx, total]).to(torch.int32)
    max_seqlen = int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0
    return cu, max_seqlen


def _sdpa_per_document(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: list[int], dropout_p: float, scale: float | None
) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]: one causal SDPA per document (exact, O(sum len^2))."""
    gqa = q.shape[1] != k.shape[1]
    outs = []
    for start, end in itertools.pairwise(cu):
        if end <= start:
            continue
        # [1, H, L, D]: CPU SDPA's fused (flash) kernel needs 4-D inputs; 3-D ones fall back to the math kernel,
        # which materializes the L x L scores and is 5-8x slower here.
        qs, ks, vs = (t[start:end].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        out = F.scaled_dot_product_attention(
            qs, ks, vs, dropout_p=dropout_p, is_causal=True, scale=scale, enable_gqa=gqa
        )
        outs.append(out.squeeze(0).transpose(0, 1))
    return torch.cat(outs, dim=0)


def _flash_varlen(q, k, v, cu: torch.Tensor, max_seqlen: int, dropout_p: float, scale: float | None) -> torch.Tensor:
    from flash_attn import flash_attn_varlen_func

    cu = cu.to(device=q.device, dtype=torch.int32)
    return flash_attn_varlen_func(
        q, k, v, cu, cu, max_seqlen, max_seqlen, dropout_p=dropout_p, softmax_scale=scale, causal=True
    )


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    # Uncompiled flex_attention materializes the scores; compiled, it runs as a fused block-sparse kernel.
    # dynamic=None (automatic dynamic shapes): the first new token count recompiles once with symbolic shapes, and no
    # later shape recompiles (dynamic=False recompiled on every new batch shape).
    return torch.compile(flex_attention, dynamic=None)


def _flex_varlen(q, k, v, cu: torch.Tensor, dropout_p: float, scale: float | None) -> torch.Tensor:
    from torch.nn.attention.flex_attention import create_block_mask

    if dropout_p:  # resolve_backend never gets here with dropout; direct callers get the same message
        raise ValueError(f"attention backend 'flex' has no attention dropout (dropout_p={dropout_p}); use 'sdpa'")
    total = q.shape[0]
    cu = cu.to(device=q.device, dtype=torch.int64)
    lengths = cu[1:] - cu[:-1]
    document = torch.repeat_interleave(torch.arange(lengths.numel(), device=q.device), lengths, output_size=total)

    def document_causal(b, h, q_idx, kv_idx):
        return (document[q_idx] == document[kv_idx]) & (q_idx >= kv_idx)

    mask = create_block_mask(document_causal, None, None, total, total, device=q.device)
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, H, T, D]
    out = _compiled_flex()(qh, kh, vh, block_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out.squeeze(0).transpose(0, 1)


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int | None = None,
    *,
    dropout_p: float = 0.0,
    scale: float | None = None,
    backend: str | AttentionBackend = "auto",
) -> torch.Tensor:
    """Causal attention within each document of a packed sequence.

    Args:
        q: [T, Hq, D] queries of all T = B*S tokens, flattened.
        k: [T, Hkv, D] keys (``Hq % Hkv == 0``: grouped-query attention).
        v: [T, Hkv, D] values.
        cu_seqlens: [n+1] int32 document offsets, 0 first and T last.
        max_seqlen: longest document (flash-attn needs it; when None it is read from ``cu_seqlens`` once per tensor,
            i.e. once per forward, not once per layer).
        dropout_p: attention dropout probability (training only).
        scale: softmax scale; default 1/sqrt(D).
        backend: see :class:`AttentionBackend`.

    Returns:
        [T, Hq, D].
    """
    which = resolve_backend(q, backend, dropout_p=dropout_p)
    if which is AttentionBackend.FLASH:
        if max_seqlen is None:  # the data pipeline provides it (collate_rows); else one host read per forward
            max_seqlen = _max_seqlen(cu_seqlens)
        return _flash_varlen(q, k, v, cu_seqlens, max_seqlen, dropout_p, scale)
    if which is AttentionBackend.FLEX:
        return _flex_varlen(q, k, v, cu_seqlens, dropout_p, scale)  # the mask is built on the device: no host sync
    return _sdpa_per_document(q, k, v, _host_offsets(cu_seqlens), dropout_p, scale)


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, dropout_p: float = 0.0, scale: float | None = None
) -> torch.Tensor:
    """Plain causal attention per row: q [B, S, Hq, D], k/v [B, S, Hkv, D] -> [B, S, Hq, D]."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        dropout_p=dropout_p,
        is_causal=True,
        scale=scale,
        enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2)
