"""``ModelConfig``: the reference decoder's hyper-parameters, built from the planner's presets.

The planner (``lightning_v17.planner.model``) is the single source of truth for the preset shapes; this module only
adds what the PyTorch model needs on top (norm epsilon, dropout), so the parameter counts cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from lightning_v17.config import V17ConfigError

#: the MoE fields the planner's ModelShape shares (its parameter counts use them)
MOE_SHAPE_FIELDS = ("num_experts", "experts_per_token", "shared_experts", "expert_ffn", "moe_every", "dense_layers")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the Llama-style decoder.

    Args:
        vocab_size: embedding rows / output classes (V).
        hidden: model width (h).
        layers: transformer blocks (L).
        heads: query heads.
        kv_heads: key/value heads (grouped-query attention); must divide ``heads``.
        ffn: SwiGLU inner width.
        max_seq_len: longest sequence the model is meant for (RoPE needs no table, so this is informational).
        rope_theta: RoPE base frequency (Su 2021; 5e5 for Llama 3).
        norm_eps: RMSNorm epsilon.
        dropout: dropout after attention and MLP (and inside attention) while training.
        tie_embeddings: share ``tok_embeddings.weight`` with ``output.weight``.
        num_experts: routed experts of each MoE block (0: a dense model).
        experts_per_token: experts each token is routed to (top-k), in [1, num_experts].
        shared_experts: always-on experts of each MoE block (DeepSeek's), summed into one SwiGLU of that many times
            ``expert_ffn``.
        expert_ffn: each expert's SwiGLU width (0: ``ffn``).
        moe_every: every n-th block (after ``dense_layers``) is a MoE block.
        dense_layers: the first n blocks stay dense (DeepSeek-V3's first 3).
        router_score: "softmax" (Mixtral, Qwen3-MoE) or "sigmoid" (DeepSeek-V3) router scores.
        router_norm_topk: renormalise the top-k weights to sum 1 (DeepSeek-V3's ``norm_topk_prob``).
        capacity_factor: per sequence and expert at most ``ceil(capacity_factor * S * k / E)`` assignments, the
            rest dropped (Switch, GShard); None: dropless.
        aux_loss_coef: weight of the sequence-wise balance loss (DeepSeek-V3 eqs. 17-20; Switch's f * P per sequence).
        z_loss_coef: weight of the router z-loss (ST-MoE, Zoph 2022).
        expert_bias_rate: the aux-loss-free balance's update speed u (DeepSeek-V3 §2.1.2); 0: off.
        mlp_chunk_tokens: tiled MLP (ALST's TiledMLP): the dense blocks' SwiGLU runs this many tokens at a time, each
            chunk checkpointed, so its ``[tokens, ffn]`` activations exist for one chunk only (forward keeps the
            MLP's input; backward recomputes chunk by chunk: one more MLP forward per step). The same values; the
            weight gradients are summed chunk by chunk (a few fp32 ulps). 0: off. Not with tensor parallelism's
            ``sequence_parallel`` (refused at the first forward). See ``lightning_v17/models/tiled.py``.
    """

    vocab_size: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    max_seq_len: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    dropout: float = 0.0
    tie_embeddings: bool = False
    num_experts: int = 0
    experts_per_token: int = 0
    shared_experts: int = 0
    expert_ffn: int = 0
    moe_every: int = 1
    dense_layers: int = 0
    router_score: str = "softmax"
    router_norm_topk: bool = True
    capacity_factor: float | None = None
    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0
    expert_bias_rate: float = 0.0
    mlp_chunk_tokens: int = 0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden", "layers", "heads", "kv_heads", "ffn", "max_seq_len"):
            if int(getattr(self, name)) < 1:
                raise V17ConfigError(f"{name}={getattr(self, name)} must be a positive integer")
        if self.hidden % self.heads:
            raise V17ConfigError(f"hidden={self.hidden} must be divisible by heads={self.heads}")
        if self.heads % self.kv_heads:
            divisors = [d for d in range(1, self.heads + 1) if self.heads % d == 0]
            raise V17ConfigError(f"kv_heads={self.kv_heads} must divide heads={self.heads}; try one of {divisors}")
        if (self.hidden // self.heads) % 2:
            raise V17ConfigError(f"head_dim={self.hidden // self.heads} must be even for RoPE; change hidden or heads")
        if not 0.0 <= self.dropout < 1.0:
            raise V17ConfigError(f"dropout={self.dropout} must be in [0, 1)")
        if isinstance(self.mlp_chunk_tokens, bool) or not isinstance(self.mlp_chunk_tokens, int) or (
            self.mlp_chunk_tokens < 0
        ):
            raise V17ConfigError(
                f"mlp_chunk_tokens={self.mlp_chunk_tokens!r} must be an integer >= 0 (tokens per MLP chunk; 0: off)"
            )
        self._check_moe()

    def _check_moe(self) -> None:
        for name in ("num_experts", "experts_per_token", "shared_experts", "expert_ffn", "dense_layers"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise V17ConfigError(f"{name}={getattr(self, name)!r} must be an integer >= 0")
        if self.num_experts == 0:
            return
        if not 1 <= self.experts_per_token <= self.num_experts:
            raise V17ConfigError(
                f"experts_per_token={self.experts_per_token} must be in [1, num_experts={self.num_experts}]"
            )
        if self.moe_every < 1:
            raise V17ConfigError(f"moe_every={self.moe_every} must be >= 1")
        if self.router_score not in ("softmax", "sigmoid"):
            raise V17ConfigError(f"router_score={self.router_score!r}; choose 'softmax' or 'sigmoid'")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise V17ConfigError(f"capacity_factor={self.capacity_factor!r} must be > 0, or None (dropless)")
        for name in ("aux_loss_coef", "z_loss_coef", "expert_bias_rate"):
            if getattr(self, name) < 0:
                raise V17ConfigError(f"{name}={getattr(self, name)!r} must be >= 0")

    def is_moe_block(self, i: int) -> bool:
        """Whether block ``i`` is a MoE block."""
        return self.num_experts > 0 and i >= self.dense_layers and (i - self.dense_layers) % self.moe_every == 0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> ModelConfig:
        """The config of a planner preset (``tiny``, ``llama3-8b``, ...), with optional field overrides.

        Raises:
            V17ConfigError: unknown preset (listing the known ones), a non-llama preset, or an unknown override.
        """
        from lightning_v17.planner.model import get_preset

        shape = get_preset(name)
        if str(getattr(shape.arch, "value", shape.arch)) != "llama":
            raise V17ConfigError(
                f"preset {name!r} is a {shape.arch} model; the reference model implements llama presets only"
            )
        config = cls(
            vocab_size=shape.vocab,
            hidden=shape.hidden,
            layers=shape.layers,
            heads=shape.heads,
            kv_heads=shape.kv_heads,
            ffn=shape.ffn,
            max_seq_len=shape.seq,
            rope_theta=float(shape.rope_theta),
            tie_embeddings=bool(shape.tie_embeddings),
            **{f: getattr(shape, f) for f in MOE_SHAPE_FIELDS if hasattr(shape, f)},
        )
        valid = {f.name for f in fields(cls)}
        unknown = sorted(set(overrides) - valid)
        if unknown:
            raise V17ConfigError(f"unknown model override(s) {unknown}; valid fields: {sorted(valid)}")
        return replace(config, **overrides) if overrides else config

    def to_shape(self, seq: int | None = None) -> Any:
        """This config as the planner's ``ModelShape`` (llama arch), for FLOPs and memory formulas.

        Args:
            seq: sequence length to plan for (default: ``max_seq_len``).
        """
        from lightning_v17.planner.model import ModelShape

        return ModelShape(
            arch="llama", layers=self.layers, hidden=self.hidden, heads=self.heads, kv_heads=self.kv_heads,
            ffn=self.ffn, vocab=self.vocab_size, seq=max(seq or self.max_seq_len, 1),
            tie_embeddings=self.tie_embeddings, rope_theta=self.rope_theta,
            **{f: getattr(self, f) for f in MOE_SHAPE_FIELDS},
        )  # fmt: skip

    def num_params(self) -> int:
        """Exact parameter count (tied embeddings counted once), by the planner's formula (one definition)."""
        return self.to_shape().num_params
