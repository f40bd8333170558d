"""Model shapes and the preset table: the single source of truth for the reference model's sizes.

Torch-free. ``lightning_v17.models.ModelConfig.from_preset`` builds the real model from these numbers, so the
planner's parameter count and the real model's parameter count agree by construction (a test checks it).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from enum import StrEnum
from typing import Any

from lightning_v17.config import V17ConfigError, parse_enum


class Arch(StrEnum):
    """Decoder families the planner counts exactly.

    - ``llama``: GQA attention, SwiGLU MLP of width ``ffn``, RoPE (no position table), RMSNorm, no biases.
    - ``gpt``: MHA with biases, GeLU MLP of width ``ffn`` (4h for GPT-3) with biases, learned positions,
      LayerNorm with bias, tied input/output embeddings.
    """

    LLAMA = "llama"
    GPT = "gpt"

    @classmethod
    def parse(cls, value: Any, option: str = "arch") -> Arch:
        return parse_enum(cls, value, option=option)  # type: ignore[return-value]


@dataclass(frozen=True)
class ModelShape:
    """The shape of a decoder-only transformer.

    Args:
        arch: "llama" or "gpt" (see :class:`Arch`).
        layers: transformer blocks (L).
        hidden: model width (h).
        heads: attention heads (a).
        kv_heads: key/value heads (GQA); equal to ``heads`` for MHA.
        ffn: MLP inner width (SwiGLU width for llama, 4h for GPT-3).
        vocab: vocabulary size (V).
        seq: maximum sequence length (s). Only ``gpt`` has parameters that depend on it (learned positions).
        tie_embeddings: share the input embedding with the output projection.
        rope_theta: RoPE base (llama only; no effect on sizes).
    """

    arch: Arch
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq: int
    tie_embeddings: bool = False
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "arch", Arch.parse(self.arch))
        for f in fields(self):
            if f.name in ("arch", "tie_embeddings", "rope_theta"):
                continue
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise V17ConfigError(f"{f.name}={value!r} must be a positive integer")
        if self.hidden % self.heads != 0:
            raise V17ConfigError(
                f"hidden={self.hidden} must be divisible by heads={self.heads} (head_dim = hidden/heads)"
            )
        if self.heads % self.kv_heads != 0:
            raise V17ConfigError(
                f"kv_heads={self.kv_heads} must divide heads={self.heads} (each KV head serves heads/kv_heads "
                f"query heads); use kv_heads={self.heads} for MHA"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        """Width of the K (and of the V) projection: kv_heads * head_dim."""
        return self.kv_heads * self.head_dim

    @property
    def block_params(self) -> int:
        """Parameters of one transformer block (exact)."""
        h, f, kv = self.hidden, self.ffn, self.kv_dim
        if self.arch == Arch.LLAMA:
            # wq, wo: h*h each; wk, wv: h*kv each; w1, w3: h*f, w2: f*h; two RMSNorm weights: 2h.
            return 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h
        # GPT: qkv weight h*(h+2kv) + bias (h+2kv); out proj h*h + h; fc1 h*f + f; fc2 f*h + h; 2 LayerNorms 4h.
        return (h * (h + 2 * kv) + (h + 2 * kv)) + (h * h + h) + (2 * h * f + f + h) + 4 * h

    @property
    def embedding_params(self) -> int:
        """Input-side parameters outside the blocks: token embeddings (+ learned positions for gpt)."""
        positions = self.seq * self.hidden if self.arch == Arch.GPT else 0
        return self.vocab * self.hidden + positions

    @property
    def head_params(self) -> int:
        """Output-side parameters: final norm (+ bias for gpt) and the output projection unless tied."""
        norm = 2 * self.hidden if self.arch == Arch.GPT else self.hidden
        return norm + (0 if self.tie_embeddings else self.vocab * self.hidden)

    @property
    def num_params(self) -> int:
        """Exact parameter count (embeddings + L blocks + final norm + untied output).

        llama: V*h*(1 if tied else 2) + L*(2h^2 + 2h*kv_dim + 3h*ffn + 2h) + h. For llama2-7b this is
        6,738,415,616 (Touvron 2023, the count HF ``LlamaForCausalLM`` reports).
        """
        return self.embedding_params + self.layers * self.block_params + self.head_params

    @property
    def largest_unit_params(self) -> int:
        """Parameters of the largest ZeRO-3/FSDP unit when every block, the embedding and the head are units.

        This is what one all-gather materializes at once (design §5.8: "full param (AG 직후): P_i ← temporary").
        """
        return max(self.block_params, self.embedding_params, self.head_params)

    @property
    def matmul_params_per_block(self) -> int:
        """Weights of one block that take part in matmuls (no biases or norms): the 2-FLOPs-per-token weights."""
        h, f, kv = self.hidden, self.ffn, self.kv_dim
        mlp = 3 * h * f if self.arch == Arch.LLAMA else 2 * h * f
        return 2 * h * h + 2 * h * kv + mlp


#: The presets (brief's table). ``lightning_v17.models`` builds the real model from these numbers.
PRESETS: dict[str, ModelShape] = {
    "tiny": ModelShape(Arch.LLAMA, layers=4, hidden=128, heads=8, kv_heads=4, ffn=384, vocab=320, seq=512),
    "llama2-7b": ModelShape(Arch.LLAMA, layers=32, hidden=4096, heads=32, kv_heads=32, ffn=11008, vocab=32000,
                            seq=4096),
    "llama3-8b": ModelShape(Arch.LLAMA, layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256,
                            seq=8192, rope_theta=500000.0),
    "llama3-70b": ModelShape(Arch.LLAMA, layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=128256,
                             seq=8192, rope_theta=500000.0),
    "llama3-405b": ModelShape(Arch.LLAMA, layers=126, hidden=16384, heads=128, kv_heads=8, ffn=53248, vocab=128256,
                              seq=8192, rope_theta=500000.0),
    "gpt3-175b": ModelShape(Arch.GPT, layers=96, hidden=12288, heads=96, kv_heads=96, ffn=49152, vocab=50257,
                            seq=2048, tie_embeddings=True),
}  # fmt: skip


def get_preset(name: str) -> ModelShape:
    """Return the preset called ``name``.

    Raises:
        V17ConfigError: naming the unknown preset and listing the known ones.
    """
    key = str(name).strip().lower()
    if key not in PRESETS:
        raise V17ConfigError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[key]


def with_overrides(shape: ModelShape, **overrides: Any) -> ModelShape:
    """A copy of ``shape`` with the non-None ``overrides`` applied (validated again)."""
    given = {k: v for k, v in overrides.items() if v is not None}
    return replace(shape, **given) if given else shape


__all__ = ["PRESETS", "Arch", "ModelShape", "get_preset", "with_overrides"]
