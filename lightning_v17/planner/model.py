"""Model shapes and the preset table: the single source of truth for the reference model's sizes.

Torch-free. ``lightning_v17.models.ModelConfig.from_preset`` builds the real model from these numbers, so the
planner's parameter count and the real model's parameter count agree by construction (a test checks it).
Mixture-of-experts shapes (``num_experts > 0``) count their routers and experts exactly too; ``total_params`` and
``active_params`` (per token) are what MoE papers publish, and the published presets reproduce them
(tests/unit/test_planner_moe.py).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from enum import StrEnum
from typing import Any

from lightning_v17.config import V17ConfigError, parse_enum

_MOE_FIELDS = ("num_experts", "experts_per_token", "shared_experts", "expert_ffn", "moe_every", "dense_layers")
#: fields that may be 0 (their "off" or "derive it" value) or are not sizes at all
_NOT_POSITIVE_SIZES = ("arch", "tie_embeddings", "rope_theta", "head_dim", "mla", *_MOE_FIELDS)


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
class MLA:
    """Multi-head latent attention, the attention of DeepSeek-V2/V3 (DeepSeek-V2 report §2.1; DeepSeek-V3 §2.1.1).

    Queries go through a low-rank down-projection (``q_lora_rank``) with an RMSNorm, keys and values through one
    compressed latent (``kv_lora_rank``, RMSNorm) that is projected up per head; each head's query/key has a part
    without RoPE (``qk_nope_head_dim``) and a RoPE part (``qk_rope_head_dim``) whose key is shared by all heads.
    The parameters are those of Hugging Face's ``DeepseekV3Attention``.

    Args:
        q_lora_rank: rank of the query down-projection (0: queries projected directly from the hidden state).
        kv_lora_rank: rank of the key-value latent (d_c).
        qk_nope_head_dim: per-head query/key width without RoPE.
        qk_rope_head_dim: per-head RoPE width of the query and of the shared key.
        v_head_dim: per-head value width.
    """

    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            low = 0 if f.name == "q_lora_rank" else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise V17ConfigError(f"MLA {f.name}={value!r} must be an integer >= {low}")

    def matmul_params(self, hidden: int, heads: int) -> int:
        """Weights of the attention's projections: q (direct, or down h x r_q and up r_q x heads*(nope+rope)),
        the key-value down-projection h x (r_kv + rope), its up-projection r_kv x heads*(nope+v), the output
        heads*v x h."""
        qk = heads * (self.qk_nope_head_dim + self.qk_rope_head_dim)
        q = hidden * self.q_lora_rank + self.q_lora_rank * qk if self.q_lora_rank else hidden * qk
        kv = hidden * (self.kv_lora_rank + self.qk_rope_head_dim)
        kv += self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
        return q + kv + heads * self.v_head_dim * hidden

    @property
    def norm_params(self) -> int:
        """The RMSNorm weights of the query latent (when it exists) and of the key-value latent."""
        return self.q_lora_rank + self.kv_lora_rank


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
        num_experts: routed experts of each MoE block (0: dense). A MoE block's MLP is a router (h x E) and E
            SwiGLU experts of width ``expert_ffn`` (+ ``shared_experts`` always-on ones) in place of the dense MLP.
        experts_per_token: experts per token (top-k).
        shared_experts: always-on experts per MoE block.
        expert_ffn: each expert's SwiGLU width (0: ``ffn``).
        moe_every: every n-th block after ``dense_layers`` is a MoE block.
        dense_layers: the first n blocks are dense. Block i is a MoE block iff ``num_experts > 0``,
            ``i >= dense_layers`` and ``(i - dense_layers) % moe_every == 0``.
        head_dim: width of one attention head (0: ``hidden / heads``). Qwen3 uses 128 with h / a = 64; the query
            and output projections are then h x heads*head_dim (``llama`` only).
        mla: DeepSeek's multi-head latent attention in place of GQA (:class:`MLA`; None: GQA). ``kv_heads`` and
            ``head_dim`` do not apply to it (``llama`` only).
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
    num_experts: int = 0
    experts_per_token: int = 0
    shared_experts: int = 0
    expert_ffn: int = 0
    moe_every: int = 1
    dense_layers: int = 0
    head_dim: int = 0
    mla: MLA | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "arch", Arch.parse(self.arch))
        for name in _MOE_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < (1 if name == "moe_every" else 0):
                raise V17ConfigError(f"{name}={value!r} must be an integer >= {1 if name == 'moe_every' else 0}")
        if self.num_experts and not 1 <= self.experts_per_token <= self.num_experts:
            raise V17ConfigError(
                f"experts_per_token={self.experts_per_token} must be in [1, num_experts={self.num_experts}]"
            )
        for f in fields(self):
            if f.name in _NOT_POSITIVE_SIZES:
                continue
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise V17ConfigError(f"{f.name}={value!r} must be a positive integer")
        if not isinstance(self.head_dim, int) or isinstance(self.head_dim, bool) or self.head_dim < 0:
            raise V17ConfigError(f"head_dim={self.head_dim!r} must be an integer >= 0 (0: hidden / heads)")
        if self.mla is not None and not isinstance(self.mla, MLA):
            raise V17ConfigError(f"mla={self.mla!r} must be an MLA(...) or None")
        if self.arch == Arch.GPT and (self.num_experts or self.head_dim or self.mla is not None):
            raise V17ConfigError(
                "num_experts, head_dim and mla are counted for llama shapes only (SwiGLU experts, RMSNorm); "
                "use arch='llama' or leave them at their defaults"
            )
        if self.head_dim == 0 and self.mla is None and self.hidden % self.heads != 0:
            raise V17ConfigError(
                f"hidden={self.hidden} must be divisible by heads={self.heads} (head_dim = hidden/heads), or give "
                f"head_dim"
            )
        if self.heads % self.kv_heads != 0:
            raise V17ConfigError(
                f"kv_heads={self.kv_heads} must divide heads={self.heads} (each KV head serves heads/kv_heads "
                f"query heads); use kv_heads={self.heads} for MHA"
            )

    @property
    def head_width(self) -> int:
        """Width of one GQA attention head: ``head_dim``, or ``hidden / heads`` when it is 0."""
        return self.head_dim or self.hidden // self.heads

    @property
    def q_dim(self) -> int:
        """Width of the query (and of the attention output) projection: heads * head_width."""
        return self.heads * self.head_width

    @property
    def kv_dim(self) -> int:
        """Width of the K (and of the V) projection: kv_heads * head_width."""
        return self.kv_heads * self.head_width

    @property
    def attention_matmul_params(self) -> int:
        """Weights of one block's attention projections (llama: wq, wk, wv, wo; MLA: :meth:`MLA.matmul_params`)."""
        h, kv = self.hidden, self.kv_dim
        if self.arch == Arch.GPT:
            return h * (h + 2 * kv) + h * h
        if self.mla is not None:
            return self.mla.matmul_params(h, self.heads)
        return 2 * h * self.q_dim + 2 * h * kv

    @property
    def attention_core_widths(self) -> tuple[int, int]:
        """(query/key width, value width) summed over heads: what QK^T and attention x V contract over."""
        if self.mla is not None:
            return self.heads * (self.mla.qk_nope_head_dim + self.mla.qk_rope_head_dim), self.heads * self.mla.v_head_dim
        width = self.hidden if self.arch == Arch.GPT else self.q_dim
        return width, width

    @property
    def block_params(self) -> int:
        """Parameters of one dense transformer block (exact)."""
        h, f, kv = self.hidden, self.ffn, self.kv_dim
        if self.arch == Arch.LLAMA:
            # attention (wq, wo: h*q_dim each; wk, wv: h*kv each; or MLA's projections and latent norms);
            # w1, w3: h*f, w2: f*h; two RMSNorm weights: 2h.
            latent_norms = self.mla.norm_params if self.mla is not None else 0
            return self.attention_matmul_params + latent_norms + 3 * h * f + 2 * h
        # GPT: qkv weight h*(h+2kv) + bias (h+2kv); out proj h*h + h; fc1 h*f + f; fc2 f*h + h; 2 LayerNorms 4h.
        return (h * (h + 2 * kv) + (h + 2 * kv)) + (h * h + h) + (2 * h * f + f + h) + 4 * h

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def moe_blocks(self) -> int:
        """How many blocks are MoE blocks (block i is iff i >= dense_layers and (i - dense_layers) % moe_every == 0)."""
        if not self.num_experts:
            return 0
        return len(range(self.dense_layers, self.layers, self.moe_every))

    @property
    def expert_width(self) -> int:
        """Each expert's SwiGLU width: ``expert_ffn``, or ``ffn`` when it is 0."""
        return self.expert_ffn or self.ffn

    @property
    def expert_params_per_block(self) -> int:
        """The routed experts' parameters of one MoE block: E x 3 x h x expert_width (each a SwiGLU, no bias)."""
        return self.num_experts * 3 * self.hidden * self.expert_width

    @property
    def moe_block_params(self) -> int:
        """Parameters of one MoE block: the dense block without its MLP, the router (h x E, no bias), the routed
        experts and the shared experts (each a SwiGLU of width expert_width)."""
        if not self.num_experts:
            return self.block_params
        h = self.hidden
        return (self.block_params - 3 * h * self.ffn + h * self.num_experts + self.expert_params_per_block
                + self.shared_experts * 3 * h * self.expert_width)  # fmt: skip

    @property
    def expert_params(self) -> int:
        """All routed experts' parameters: what expert parallelism shards over ``ep`` (shared experts and routers
        stay with the dense part)."""
        return self.moe_blocks * self.expert_params_per_block

    @property
    def dense_params(self) -> int:
        """Every parameter that is not a routed expert's (attention, norms, routers, shared experts, embeddings)."""
        return self.num_params - self.expert_params

    @property
    def total_params(self) -> int:
        """All parameters (:attr:`num_params`), the "total" MoE papers publish."""
        return self.num_params

    @property
    def active_params(self) -> int:
        """Parameters one token runs through: all but the ``num_experts - experts_per_token`` routed experts per
        MoE block it is not sent to (the dense part, the router, its top-k and the shared experts). Embeddings are
        included, as Mixtral (Jiang 2024, 12.9B) and Qwen3 (3.3B) count; equal to :attr:`num_params` when dense."""
        skipped = (self.num_experts - self.experts_per_token) * 3 * self.hidden * self.expert_width
        return self.num_params - self.moe_blocks * skipped

    @property
    def active_matmul_params(self) -> int:
        """Matmul weights one token runs through in all blocks (no norms, no embeddings): the 2-FLOPs-per-token
        weights of :func:`~lightning_v17.planner.throughput.flops_per_token`. Dense: L x matmul_params_per_block;
        a MoE block: its attention, the router and the top-k + shared experts."""
        h = self.hidden
        moe = self.attention_matmul_params + h * self.num_experts
        moe += (self.experts_per_token + self.shared_experts) * 3 * h * self.expert_width
        return (self.layers - self.moe_blocks) * self.matmul_params_per_block + self.moe_blocks * moe

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
        6,738,415,616 (Touvron 2023, the count HF ``LlamaForCausalLM`` reports). MoE blocks count
        :attr:`moe_block_params` instead.
        """
        dense = self.layers - self.moe_blocks
        blocks = dense * self.block_params + self.moe_blocks * self.moe_block_params
        return self.embedding_params + blocks + self.head_params

    @property
    def largest_unit_params(self) -> int:
        """Parameters of the largest ZeRO-3/FSDP unit when every block, the embedding and the head are units.

        This is what one all-gather materializes at once (design §5.8: "full param (AG 직후): P_i ← temporary").
        """
        return max(self.block_params, self.moe_block_params, self.embedding_params, self.head_params)

    @property
    def matmul_params_per_block(self) -> int:
        """Weights of one dense block that take part in matmuls (no biases or norms): the 2-FLOPs-per-token
        weights."""
        h, f = self.hidden, self.ffn
        mlp = 3 * h * f if self.arch == Arch.LLAMA else 2 * h * f
        return self.attention_matmul_params + mlp


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
    "tiny-moe": ModelShape(Arch.LLAMA, layers=4, hidden=128, heads=8, kv_heads=4, ffn=384, vocab=320, seq=512,
                           num_experts=4, experts_per_token=2, expert_ffn=128, dense_layers=1),
    # Jiang 2024 (Mixtral of Experts) §2, Table 1: 8 experts of width 14336, top-2; 46.7B parameters, 12.9B active
    # per token. Counted: 46,702,792,704 and 12,879,925,248.
    "mixtral-8x7b": ModelShape(Arch.LLAMA, layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=32000,
                               seq=32768, rope_theta=1e6, num_experts=8, experts_per_token=2),
}  # fmt: skip

#: Published shapes the planner counts exactly but the reference model does not build (an attention it does not
#: implement: Qwen3's head_dim 128 != hidden / heads, DeepSeek's MLA). ``v17 plan --model`` takes them;
#: ``ModelConfig.from_preset`` does not (:func:`get_preset` refuses them unless ``planner_only``).
PLANNER_ONLY_PRESETS: dict[str, ModelShape] = {
    # Qwen3 Technical Report (Yang 2025) Table 2 and the Qwen3-30B-A3B model card: 48 layers, 32 query / 4 KV heads
    # of width 128, 128 experts of width 768, top-8, untied embeddings; 30.5B parameters, 3.3B activated. Counted:
    # 30,532,110,336 and 3,353,020,416 (the card's "3.3B" is 3.35B cut to two digits). Not counted: the per-head
    # q/k RMSNorm weights (2 x 128 per block, 12,288 in all). ffn is the config's unused dense width.
    "qwen3-30b-a3b": ModelShape(Arch.LLAMA, layers=48, hidden=2048, heads=32, kv_heads=4, ffn=6144, vocab=151936,
                                seq=4096, rope_theta=1e6, num_experts=128, experts_per_token=8, expert_ffn=768,
                                head_dim=128),
    # DeepSeek-V3 Technical Report (DeepSeek-AI 2024) §2.1, §4.2: MLA (q rank 1536, kv rank 512, 128 heads of
    # 128 + 64 RoPE query/key and 128 value width), the first 3 blocks dense (ffn 18432), then 1 shared + 256 routed
    # experts of width 2048, top-8; 671B parameters, 37B activated. Counted: 671,026,404,352 (the report's 671B
    # excludes the 14B multi-token-prediction module) and 37,552,282,624 with the 0.93B input embedding (36.6B
    # without it, the convention of DeepSeek-V2-Lite's "2.4B activated").
    "deepseek-v3-671b": ModelShape(Arch.LLAMA, layers=61, hidden=7168, heads=128, kv_heads=128, ffn=18432,
                                   vocab=129280, seq=4096, num_experts=256, experts_per_token=8, shared_experts=1,
                                   expert_ffn=2048, dense_layers=3, mla=MLA(q_lora_rank=1536, kv_lora_rank=512,
                                   qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)),
}  # fmt: skip


def get_preset(name: str, *, planner_only: bool = False) -> ModelShape:
    """Return the preset called ``name``: one of :data:`PRESETS`, or with ``planner_only`` also one of
    :data:`PLANNER_ONLY_PRESETS` (shapes the planner counts but the reference model does not build).

    Raises:
        V17ConfigError: naming the unknown (or planner-only) preset and listing the known ones.
    """
    key = str(name).strip().lower()
    if key in PRESETS:
        return PRESETS[key]
    if key in PLANNER_ONLY_PRESETS:
        if planner_only:
            return PLANNER_ONLY_PRESETS[key]
        raise V17ConfigError(
            f"preset {name!r} is counted by the planner only: the reference model does not implement its attention "
            f"(head_dim != hidden/heads or MLA); plan it with `v17 plan --model {key}`, or build one of "
            f"{', '.join(PRESETS)}"
        )
    known = ", ".join([*PRESETS, *PLANNER_ONLY_PRESETS]) if planner_only else ", ".join(PRESETS)
    raise V17ConfigError(f"unknown model preset {name!r}; choose one of {known}")


def with_overrides(shape: ModelShape, **overrides: Any) -> ModelShape:
    """A copy of ``shape`` with the non-None ``overrides`` applied (validated again)."""
    given = {k: v for k, v in overrides.items() if v is not None}
    return replace(shape, **given) if given else shape


__all__ = ["MLA", "PLANNER_ONLY_PRESETS", "PRESETS", "Arch", "ModelShape", "get_preset", "with_overrides"]
