"""Reference Llama-style decoder with torchtitan module names (TP plans and PP splits are written against them).

``Llama``: ``tok_embeddings`` -> ``layers`` (``nn.ModuleDict`` "0".."L-1" of :class:`TransformerBlock`) -> ``norm``
-> ``output``. A ModuleDict rather than a ModuleList so that a pipeline stage that deletes blocks keeps the FQNs of
the rest (``layers.5.attention.wq.weight`` stays ``layers.5...``), as torchtitan does. Any of ``tok_embeddings``,
``norm`` and ``output`` may be ``None`` (a pipeline stage): then the input is hidden states / hidden states are
returned.

Blocks: pre-norm RMSNorm (Zhang 2019), RoPE on explicit ``position_ids`` (Su 2021), grouped-query attention
(Ainslie 2023) with varlen document masking, SwiGLU MLP ``w2(silu(w1 x) * w3 x)`` (Shazeer 2020), or in the MoE
blocks of a ``num_experts > 0`` config the mixture of experts of :mod:`lightning_v17.models.moe` under the same
``feed_forward`` name.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from lightning_v17.engine.cp import current_cp_context
from lightning_v17.models.attention import causal_attention, cu_seqlens_from_position_ids, varlen_attention
from lightning_v17.models.config import ModelConfig
from lightning_v17.models.moe import MoE
from lightning_v17.models.tiled import tiled_mlp

#: Tensor-parallel roles inside each block (Megatron-LM, Shoeybi 2019 §3): column-parallel projections shard their
#: output features (heads / MLP width), row-parallel ones shard their input features and end in an all-reduce.
BLOCK_TP_PLAN: dict[str, str] = {
    "attention.wq": "colwise",
    "attention.wk": "colwise",
    "attention.wv": "colwise",
    "attention.wo": "rowwise",
    "feed_forward.w1": "colwise",
    "feed_forward.w3": "colwise",
    "feed_forward.w2": "rowwise",
}
#: Roles outside the blocks: vocab-parallel embedding (rows sharded) and output (vocab columns sharded).
TOP_TP_PLAN: dict[str, str] = {"tok_embeddings": "rowwise", "output": "colwise"}

_INIT_STD = 0.02


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019), computed in fp32 and cast back to the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).type_as(x)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of the rotary angles ``pos * theta^(-2i/D)`` (Su 2021 eq. 15): [B, S, 1, D/2] each, fp32.

    Computed from ``position_ids`` on the fly (no buffer), so meta-device init, ``to_empty`` and pipeline stages
    need nothing special, and positions that restart per document rotate every document the same way.
    """
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim)
    angles = position_ids.to(torch.float32).unsqueeze(-1) * inv_freq
    return angles.cos().unsqueeze(2), angles.sin().unsqueeze(2)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., i], x[..., i + D/2]) of x [B, S, H, D] (the "half" layout of GPT-NeoX / HF Llama)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).type_as(x)


class Attention(nn.Module):
    """Grouped-query self-attention with RoPE; causal within each document of a packed row.

    The local head count is read from tensor shapes (``view(B, S, -1, head_dim)``), so column-parallel sharding of
    ``wq``/``wk``/``wv`` (fewer local heads) works without touching this code. Under context parallelism (a
    :func:`~lightning_v17.engine.cp.current_cp_context` set for the batch) the local tokens attend over the whole
    rows through it, documents masked from the global positions.
    """

    v17_context_parallel = True  # V17Strategy(cp > 1) accepts models whose attention reads the cp context

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.rope_theta = config.rope_theta
        self.dropout = config.dropout
        self.wq = nn.Linear(config.hidden, config.heads * config.head_dim, bias=False)
        self.wk = nn.Linear(config.hidden, config.kv_dim, bias=False)
        self.wv = nn.Linear(config.hidden, config.kv_dim, bias=False)
        self.wo = nn.Linear(config.heads * config.head_dim, config.hidden, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
    ) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        cos, sin = rope_cos_sin(position_ids, self.head_dim, self.rope_theta)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        p = self.dropout if self.training else 0.0
        cp = current_cp_context()
        if cp is not None:
            if p:
                raise ValueError("attention dropout under context parallelism is not supported; set dropout=0")
            out = cp.attention(q, k, v)
        elif cu_seqlens is None:
            out = causal_attention(q, k, v, dropout_p=p)
        else:
            flat = (t.reshape(b * s, -1, self.head_dim) for t in (q, k, v))
            out = varlen_attention(*flat, cu_seqlens, max_seqlen, dropout_p=p).view(b, s, -1, self.head_dim)
        return self.wo(out.reshape(b, s, -1))


class FeedForward(nn.Module):
    """SwiGLU MLP: ``w2(silu(w1 x) * w3 x)`` (Shazeer 2020).

    With ``config.mlp_chunk_tokens > 0`` it runs ``mlp_chunk_tokens`` tokens at a time, each chunk checkpointed
    (:func:`lightning_v17.models.tiled.tiled_mlp`, ALST's TiledMLP): the same values, with the ``[tokens, ffn]``
    activations of only one chunk alive.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.hidden, config.ffn, bias=False)
        self.w2 = nn.Linear(config.ffn, config.hidden, bias=False)
        self.w3 = nn.Linear(config.hidden, config.ffn, bias=False)
        self.chunk_tokens = config.mlp_chunk_tokens

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.chunk_tokens:
            return tiled_mlp(self.swiglu, x, chunk_tokens=self.chunk_tokens)
        return self.swiglu(x)

    def swiglu(self, x: torch.Tensor) -> torch.Tensor:
        """The untiled MLP on ``x`` [..., h]."""
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))`` then ``x + ffn(norm(x))``; the unit of recompute, ZeRO-3 and PP."""

    def __init__(self, config: ModelConfig, layer_id: int = 0) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.hidden, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.hidden, config.norm_eps)
        self.feed_forward: nn.Module = MoE(config) if config.is_moe_block(layer_id) else FeedForward(config)
        self.dropout = nn.Dropout(config.dropout)

    def forward(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
    ) -> torch.Tensor:
        x = x + self.dropout(self.attention(self.attention_norm(x), position_ids, cu_seqlens, max_seqlen))
        return x + self.dropout(self.feed_forward(self.ffn_norm(x)))


class Llama(nn.Module):
    """The reference decoder.

    Args:
        config: the model shape (e.g. ``ModelConfig.from_preset("tiny")``).
        init_seed: seed of :meth:`init_weights`; each parameter's values depend only on (seed, its name), never on
            sharding, pipeline split or device.
    """

    def __init__(self, config: ModelConfig, *, init_seed: int = 0) -> None:
        super().__init__()
        self.config = config
        self.init_seed = init_seed
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(config.vocab_size, config.hidden)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(config, i) for i in range(config.layers)})
        self.norm: RMSNorm | None = RMSNorm(config.hidden, config.norm_eps)
        self.output: nn.Linear | None = nn.Linear(config.hidden, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        if not any(p.is_meta for p in self.parameters()):
            self.init_weights()

    def forward(
        self,
        tokens: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
    ) -> torch.Tensor:
        """Logits of a (packed) batch.

        Args:
            tokens: LongTensor [B, S] (or hidden states [B, S, h] when ``tok_embeddings`` is None).
            position_ids: LongTensor [B, S], restarting at 0 per document; default ``arange(S)`` per row.
            cu_seqlens: int32 [n+1] document offsets over the flattened B*S tokens: varlen block-diagonal causal
                attention. If None but ``position_ids`` is given, documents start where ``position_ids == 0``.
                Both None: plain causal attention per row.
            max_seqlen: longest document (optional; flash-attn uses it).

        Returns:
            logits [B, S, V] (hidden states [B, S, h] when ``output`` is None).
        """
        b, s = tokens.shape[:2]
        if position_ids is None:
            position_ids = torch.arange(s, device=tokens.device).expand(b, s)
        elif cu_seqlens is None and current_cp_context() is None:  # under cp the context holds the documents
            cu_seqlens, max_seqlen = cu_seqlens_from_position_ids(position_ids)
            if cu_seqlens.numel() == b + 1:
                cu_seqlens = max_seqlen = None  # one document per row: the plain causal path is the same, and faster
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, position_ids, cu_seqlens, max_seqlen)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h

    # ---- what the engine needs -------------------------------------------------------------------------------------
    def tensor_parallel_plan(self) -> dict[str, str]:
        """FQN of every projection -> ``"colwise"`` / ``"rowwise"`` (see :data:`BLOCK_TP_PLAN`, :data:`TOP_TP_PLAN`).

        Strings, not ``ParallelStyle`` objects: ``lightning_v17.engine.tp.apply`` turns roles into styles
        (adding sequence/loss parallelism as configured). Modules absent from a pipeline stage are absent here.
        """
        plan = {name: role for name, role in TOP_TP_PLAN.items() if getattr(self, name) is not None}
        for key, block in self.layers.items():
            moe = isinstance(block.feed_forward, MoE)  # its router and experts stay whole on every tp rank
            plan.update({f"layers.{key}.{name}": role for name, role in BLOCK_TP_PLAN.items()
                         if not (moe and name.startswith("feed_forward."))})  # fmt: skip
        return plan

    def pipeline_split_points(self) -> list[str]:
        """FQNs of the blocks, in order (``"layers.0"``, ...): a pipeline stage boundary may precede any of them.

        The embedding belongs to the first stage and ``norm``/``output`` to the last.
        """
        return [f"layers.{key}" for key in self.layers]

    def recompute_units(self) -> list[TransformerBlock]:
        """The activation-checkpointing (and ZeRO-3 wrapping) units: the transformer blocks."""
        return list(self.layers.values())

    def num_params(self) -> int:
        """Parameters counted once each (tied weights once)."""
        return sum(p.numel() for p in self.parameters())

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Re-initialize every parameter in place, deterministically.

        Each parameter is drawn on CPU from a generator seeded by ``crc32(f"{seed}:{name}")`` and copied in, so its
        value does not depend on the device, on ZeRO/TP sharding (for DTensors only the local shard is copied) or on
        which blocks a pipeline stage holds. Works after meta-device construction + ``to_empty``.

        Normal(0, 0.02) for embeddings and projections, with ``wo``/``w2`` scaled by 1/sqrt(2L) (GPT-2's residual
        scaling, Radford 2019 §2.3), ``output`` with std h^-0.5, norm weights 1. In MoE blocks the router and the
        experts are drawn the same way (``experts.down_proj`` and ``shared_experts.w2`` scaled like ``w2``; an
        expert-sharded weight copies only its rank's experts), and the balance buffers ``expert_bias`` and
        ``expert_load`` restart at zero.
        """
        seed = self.init_seed if seed is None else seed
        depth_scale = 1.0 / math.sqrt(2 * self.config.layers)
        seen: set[int] = set()
        for name, param in self.named_parameters(remove_duplicate=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            clean = name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")
            if clean.endswith("norm.weight"):
                full = torch.ones(param.shape)
            else:
                std = _INIT_STD
                if clean.endswith(("attention.wo.weight", "feed_forward.w2.weight", "experts.down_proj",
                                   "shared_experts.w2.weight")):
                    std *= depth_scale
                elif clean == "output.weight" and not self.config.tie_embeddings:
                    std = self.config.hidden**-0.5
                gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{clean}".encode()))
                full = torch.empty(param.shape).normal_(0.0, std, generator=gen)
            _copy_full_into(param, full)
        for m in self.modules():
            if isinstance(m, MoE):  # the balance state starts at zero (a meta-built model's buffers are garbage)
                m.expert_bias.zero_()
                m.expert_load.zero_()


def _copy_full_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full (unsharded) CPU value into ``param``, which may be a DTensor shard."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        local = distribute_tensor(
            full.to(param.device, param.dtype), param.device_mesh, param.placements, src_data_rank=None
        )  # every rank holds the same full value: slice, no comms
        param.to_local().copy_(local.to_local())
    else:
        param.copy_(full.to(param.dtype))
