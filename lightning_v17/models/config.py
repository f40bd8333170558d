"""``ModelConfig``: the reference decoder's hyper-parameters, built from the planner's presets.

The planner (``lightning_v17.planner.model``) is the single source of truth for the preset shapes; this module only
adds what the PyTorch model needs on top (norm epsilon, dropout), so the parameter counts cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from lightning_v17.config import V17ConfigError


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
        )  # fmt: skip

    def num_params(self) -> int:
        """Exact parameter count (tied embeddings counted once), by the planner's formula (one definition)."""
        return self.to_shape().num_params
