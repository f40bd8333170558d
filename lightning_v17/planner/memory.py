"""Per-rank memory: model state (ZeRO), activations (Korthikanti; counted term by term for llama), temp buffers.

Torch-free. Every function has its units in its name and its source in its docstring. Bytes are per rank.

Conventions (design §1-§2, ZeRO Table 1): mixed precision keeps 16-bit parameters (2 B) and gradients (2 B); the
optimizer bucket holds everything the optimizer owns, the fp32 master copy included (K = 12 for Adam). In fp32
training the parameter itself is the master, so K = 8 for Adam (exp_avg + exp_avg_sq).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lightning_v17.config import CPMode, FP8Recipe, OptimizerKind, Precision, Recompute, Schedule, ZeroPolicy
from lightning_v17.planner.model import Arch, ModelShape

#: Activation element size in bytes behind Korthikanti 2022 Table 2 (16-bit activations, 1-byte dropout masks).
ACT_ELEMENT_BYTES_16BIT = 2
#: Bytes of an fp32 element: RMSNorm statistics, RoPE tables and the attention log-sum-exp are fp32 in any precision.
FP32_BYTES = 4
#: Linears of a llama block that FP8 converts: wq, wk, wv, wo, w1, w2, w3 (``engine/fp8/convert.py``'s layer rule).
FP8_LINEARS_PER_LLAMA_BLOCK = 7


def param_bytes_per_param(precision: Precision) -> float:
    """Bytes of the working copy of one parameter: 4 in fp32, 2 in every 16-bit or fp8 mode
    (:attr:`Precision.param_bytes <lightning_v17.config.Precision.param_bytes>`).

    Source: ZeRO (Rajbhandari 2020) §3.1 ("2Ψ bytes for fp16 parameters"). fp8 training (Transformer Engine,
    torchao) keeps bf16 weights and casts to fp8 per matmul, so it also counts 2 B.
    """
    return Precision.parse(precision).param_bytes


def grad_bytes_per_param(precision: Precision) -> float:
    """Bytes of one parameter's gradient: 4 in fp32, 2 otherwise (:attr:`Precision.grad_bytes
    <lightning_v17.config.Precision.grad_bytes>`). Source: ZeRO (Rajbhandari 2020) §3.1."""
    return Precision.parse(precision).grad_bytes


def optimizer_state_components(kind: OptimizerKind, precision: Precision) -> tuple[tuple[str, float], ...]:
    """The optimizer bucket split into named parts, each in bytes per parameter (their sum is K).

    Sources:
      - Adam/AdamW: ZeRO (Rajbhandari 2020) §3.1: fp32 master 4 B + momentum 4 B + variance 4 B = K 12.
      - Adam8bit: Dettmers 2022 (8-bit Optimizers) §2: two uint8 states plus one fp32 absmax per block; bitsandbytes
        0.50 ``optim/optimizer.py`` uses blocksize 256, so each state costs 1 + 4/256 B. (Tensors under
        ``min_8bit_size`` = 4096 elements keep 32-bit state; ignored here.)
      - Adafactor: Shazeer & Stern 2018 §3: the second moment is factored into row and column vectors,
        O(rows + cols) per matrix, i.e. under 0.01 B/param for h >= 1024; no first moment (beta1 = None). Counted
        as 0.
      - Lion: Chen 2023 (Symbolic Discovery of Optimization Algorithms) Alg. 1: one momentum buffer; Lion8bit
        (bitsandbytes) keeps it as uint8 plus one fp32 absmax per 256-block: 1 + 4/256 B (measured 1.0176 B on the
        tiny model, whose biases under 4096 elements stay 32-bit).
      - SGD: one momentum buffer (torch.optim.SGD with momentum > 0).

    States are fp32, except in ``bf16-true`` where they take the parameter dtype (2 B) and there is no master. In
    fp32 the parameter is the master, so no extra copy is counted.
    """
    kind = OptimizerKind.parse(kind)
    precision = Precision.parse(precision)
    state = precision.state_bytes
    parts: list[tuple[str, float]] = []
    if precision.has_master:
        parts.append(("master", 4.0))
    if kind in (OptimizerKind.ADAM, OptimizerKind.ADAMW):
        parts += [("moment", state), ("var", state)]
    elif kind == OptimizerKind.ADAM8BIT:
        parts += [("moment", 1.0 + 4.0 / 256), ("var", 1.0 + 4.0 / 256)]
    elif kind == OptimizerKind.ADAFACTOR:
        parts += [("var", 0.0)]
    elif kind in (OptimizerKind.LION, OptimizerKind.SGD):
        parts += [("moment", state)]
    elif kind == OptimizerKind.LION8BIT:
        parts += [("moment", 1.0 + 4.0 / 256)]
    return tuple(parts)


def optimizer_bytes_per_param(kind: OptimizerKind, precision: Precision) -> float:
    """K, the optimizer-state bytes per parameter (fp32 master included when one exists).

    Source: ZeRO (Rajbhandari 2020) §3.1 (K = 12 for mixed-precision Adam); other optimizers per
    :func:`optimizer_state_components`. Examples: (adamw, bf16-mixed) -> 12; (adamw, fp32) -> 8;
    (adam8bit, bf16-mixed) -> 4 + 2 * (1 + 4/256) = 6.03125.
    """
    return float(sum(b for _, b in optimizer_state_components(kind, precision)))


@dataclass(frozen=True)
class ModelStateBytes:
    """Per-rank model-state bytes (ints, rounded up: the largest shard decides what must fit)."""

    param: int
    grad: int
    optimizer: int
    total: int


def zero_of(zero: ZeroPolicy | None, zero_stage: int | None = None) -> ZeroPolicy:
    """The :class:`~lightning_v17.config.ZeroPolicy` a formula asks: ``zero``, or ``zero_stage`` (the DeepSpeed-style
    shortcut some callers still pass) parsed once into one. Exactly one of them must be given."""
    if (zero is None) == (zero_stage is None):
        raise TypeError("give zero=ZeroPolicy(stage=...) (or the zero_stage= shortcut), not both or neither")
    return zero if zero is not None else ZeroPolicy(stage=zero_stage)  # type: ignore[arg-type]


def model_state_bytes_per_rank(
    num_params: float,
    *,
    zero: ZeroPolicy | None = None,
    dp: int,
    tp: int = 1,
    pp: int = 1,
    param_bytes: float = 2.0,
    grad_bytes: float = 2.0,
    optimizer_bytes: float = 12.0,
    zero_stage: int | None = None,
) -> ModelStateBytes:
    """Parameter, gradient and optimizer bytes held by one rank under ZeRO stage 0-3.

    Source: ZeRO (Rajbhandari 2020) §3.1 and Fig. 1. With Ψ = num_params / (tp * pp) per model-parallel rank and
    N_d = dp: stage 0 keeps (2 + 2 + K)Ψ; stage 1 (P_os) divides the optimizer state by N_d; stage 2 (P_os+g) also
    the gradients; stage 3 (P_os+g+p) also the parameters. Fig. 1 (Ψ = 7.5e9, N_d = 64, K = 12): 120 / 31.4 /
    16.6 / 1.88 GB.

    Args:
        num_params: parameters of the whole model (Ψ before model parallelism).
        zero: the ZeRO policy: what it shards (``shards_optimizer`` / ``shards_grads`` / ``shards_params``).
        dp: data-parallel ranks that ZeRO shards over (N_d).
        tp: tensor-parallel size; model state is divided by tp * pp first.
        pp: pipeline-parallel size.
        param_bytes: bytes per parameter of the working copy (2 mixed, 4 fp32).
        grad_bytes: bytes per gradient element (2 mixed, 4 fp32).
        optimizer_bytes: K, see :func:`optimizer_bytes_per_param`.
        zero_stage: shortcut for ``zero=ZeroPolicy(stage=zero_stage)``.
    """
    zero = zero_of(zero, zero_stage)
    for name, value in (("num_params", num_params), ("dp", dp), ("tp", tp), ("pp", pp)):
        if value < 1 and not (name == "num_params" and value == 0):
            raise ValueError(f"{name}={value!r} must be positive")
    psi = num_params / (tp * pp)
    param = math.ceil(psi * param_bytes / (dp if zero.shards_params else 1))
    grad = math.ceil(psi * grad_bytes / (dp if zero.shards_grads else 1))
    optimizer = math.ceil(psi * optimizer_bytes / (dp if zero.shards_optimizer else 1))
    return ModelStateBytes(param=param, grad=grad, optimizer=optimizer, total=param + grad + optimizer)


def activation_bytes_per_layer(
    *,
    seq: int,
    micro_batch: int,
    hidden: int,
    heads: int,
    tp: int = 1,
    sp: bool = False,
    recompute: Recompute = Recompute.NONE,
    cp: int = 1,
    element_bytes: int = ACT_ELEMENT_BYTES_16BIT,
) -> int:
    """Activation bytes one transformer layer keeps for backward, per rank, for one micro-batch.

    Source: Korthikanti 2022 (Reducing Activation Recomputation) Table 2, with s = seq, b = micro_batch,
    h = hidden, a = heads, t = tp:

    ==============================  ===========================
    no parallelism                  sbh(34 + 5as/h)
    tensor parallel (TP)            sbh(10 + 24/t + 5as/(ht))
    TP + sequence parallel (SP)     sbh/t (34 + 5as/h)
    TP + selective recompute        sbh(10 + 24/t)
    TP + SP + selective recompute   sbh · 34/t
    full recompute                  2sbh  (2sbh/t with SP, Megatron keeps the layer input sharded)
    ==============================  ===========================

    The constants come from §4.1's count with 16-bit activations and 1-byte dropout masks: 34 = 16 elements × 2 B
    + 2 masks; 10 = 4 replicated elements × 2 B + 2 masks; 24 = 12 TP-sharded elements × 2 B; 5 = 2 score
    elements × 2 B + 1 mask. ``element_bytes`` = 4 (fp32 training) rescales the elements, not the masks. The
    count is derived for a GPT block (LayerNorm, MHA, 4h GeLU MLP, dropout, materialized scores); the planner uses
    it as published for ``gpt`` shapes, and :func:`llama_activation_bytes_per_layer`, the same count redone for our
    llama blocks, for ``llama`` ones (:func:`activation_bytes_per_layer_of` picks). The 5as/h term is the attention
    score matrix: selective recompute (and FlashAttention) removes it. Context parallelism (cp) splits the queries:
    the leading s becomes s/cp, the s inside 5as/h stays.

    Args:
        seq: sequence length s (tokens per sample).
        micro_batch: micro-batch size b (samples).
        hidden: h.
        heads: a.
        tp: tensor-parallel size t.
        sp: sequence parallelism on (only meaningful with tp > 1).
        recompute: none, selective or full.
        cp: context-parallel size.
        element_bytes: bytes per activation element (2 for 16-bit training, 4 for fp32).
    """
    recompute = Recompute.parse(recompute, "recompute")
    e = element_bytes
    sbh = (seq / cp) * micro_batch * hidden
    if recompute == Recompute.FULL:
        return math.ceil(e * sbh / (tp if sp else 1))
    replicated = 4 * e + 2  # 10 for 16-bit: LayerNorm inputs, attention/MLP inputs, dropout masks
    sharded = 12 * e  # 24 for 16-bit: Q, K, V, attention output, MLP intermediates
    scores = 0.0 if recompute == Recompute.SELECTIVE else (2 * e + 1) * heads * seq / hidden  # 5as/h
    if sp:
        per_sbh = (replicated + sharded + scores) / tp
    else:
        per_sbh = replicated + (sharded + scores) / tp
    return math.ceil(sbh * per_sbh)


def llama_activation_bytes_per_layer(
    *,
    seq: int,
    micro_batch: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    ffn: int,
    tp: int = 1,
    sp: bool = False,
    recompute: Recompute = Recompute.NONE,
    cp: int = 1,
    element_bytes: int = ACT_ELEMENT_BYTES_16BIT,
) -> int:
    """Activation bytes one block of the reference Llama keeps for backward, per rank, for one micro-batch.

    Source: Korthikanti 2022 (Reducing Activation Recomputation) Table 2 and its §4.1 count, redone term by term for
    ``lightning_v17.models.llama`` (pre-norm RMSNorm computed in fp32, RoPE, GQA, fused SDPA / FlashAttention,
    SwiGLU, no dropout) and for what autograd and ``engine/recompute.py`` really save. Per token, with e =
    ``element_bytes``, h = hidden, kv = kv_heads·head_dim, f = ffn, a = heads, D = head_dim, t = tp:

    ===========================================  =====================  ================================================
    Korthikanti §4.1 term (GPT block, 16-bit)    bytes/token in paper   here (llama block)
    ===========================================  =====================  ================================================
    2 LayerNorm inputs                           4h                     2·(8h + 4): RMSNorm upcasts to fp32 and keeps
                                                                        x (4h), x·rsqrt (4h), rsqrt (4)
    QKV input; MLP input                         2h + 2h                2·e·h: the two norm outputs the matmuls save
    Q, K (for QKᵀ); V                            4h + 2h                e·h + 2·e·kv: rotated Q, rotated K, V (GQA: K
                                                                        and V are kv wide, not h)
    softmax out 2as, its dropout mask as,        5as                    4a: the fused kernel keeps the fp32 log-sum-exp
    dropout out 2as                                                     only, no a·s² scores (Dao 2022); no dropout
    attention output (input of out-proj)         2h                     e·h (the SDPA output, saved once)
    RoPE (absent in GPT)                         -                      4D: fp32 cos and sin, D/2 each
    GeLU input 8h, fc2 input 8h                  16h                    4·e·f: w1 x, silu(w1 x), w3 x, their product
                                                                        (SwiGLU, f wide; GPT's 4h GeLU has 2 tensors)
    2 dropout masks (attention out, MLP out)     2h                     0 (dropout is 0: no masks)
    ===========================================  =====================  ================================================

    So recompute ``none`` keeps (16 + 4e)h + 2e·kv + 4e·f + 4a + 4D + 8 bytes per token: 24h + 4kv + 8f + ... in
    bf16, 32h + 8kv + 16f + ... in fp32. Under TP the head- and f-sharded terms (Q, K, V, SDPA output, log-sum-exp,
    SwiGLU) divide by t and the rest stays (Table 2 row 2); with SP the RMSNorm's own fp32 tensors divide by t too
    (row 3), but the norm output e·h stays whole: the column-parallel matmul saves the all-gathered input (DTensor
    SP, as in torchtitan), where Megatron stores only its 1/t and gathers again in backward (§4.2.2).

    ``selective`` (``engine/recompute.py``: Korthikanti's selective recomputation through PyTorch's selective
    checkpointing) keeps the block input (e·h, /t with SP) and the outputs of every matmul and of SDPA: Q e·h/t, K
    and V e·kv/t each, the SDPA output e·h/t with its log-sum-exp 4a/t, w1 and w3 outputs e·f/t each, and the
    out-projection and w2 outputs, e·h each (whole under TP: the partial sums before the all-reduce /
    reduce-scatter). So 5e·h + 2e·kv + 2e·f + 4a per token at t = 1, against Table 2's 34h. ``full`` keeps the
    block input only: e·h, /t with SP, as Table 2's last row (2sbh in 16-bit).

    Context parallelism splits the queries: every term is per local token, s/cp (none is a·s²).

    Held against a run by ``tests/unit/test_activation_bytes.py`` (tp = 1) and ``bench/activations.py`` (tp = 1, and
    ``--tp 2`` on gloo ranks with and without SP), fp32 and bf16, to within 0.3%. Not counted: bf16-mixed under
    autocast (ZeRO 0-2) keeps an fp32 residual stream and bf16 weight copies; the CPU varlen path (packed documents)
    adds one e·h copy (``torch.cat`` of the per-document outputs); the fp32 copies of the two norm weights (8h
    bytes per block in 16-bit).

    Args:
        seq: sequence length s (tokens per sample).
        micro_batch: micro-batch size b (samples).
        hidden: h.
        heads: query heads a.
        kv_heads: key/value heads (GQA).
        ffn: SwiGLU inner width f.
        tp: tensor-parallel size t.
        sp: sequence parallelism on (only meaningful with tp > 1).
        recompute: none, selective or full.
        cp: context-parallel size.
        element_bytes: bytes per activation element (2 for 16-bit training, 4 for fp32).
    """
    recompute = Recompute.parse(recompute, "recompute")
    e, f32 = element_bytes, FP32_BYTES
    head_dim = hidden // heads
    kv = kv_heads * head_dim
    tokens = (seq / cp) * micro_batch
    t_seq = tp if sp else 1  # what sequence parallelism shards: the residual stream and the norms
    block_input = e * hidden / t_seq
    if recompute == Recompute.FULL:
        return math.ceil(tokens * block_input)
    if recompute == Recompute.SELECTIVE:
        sharded = e * (2 * hidden + 2 * kv + 2 * ffn) + f32 * heads  # Q, SDPA out, K, V, w1, w3; log-sum-exp
        whole = 2 * e * hidden  # out-projection and w2 matmul outputs (partial sums under TP)
        return math.ceil(tokens * (block_input + whole + sharded / tp))
    norms = 2 * ((2 * f32 * hidden + f32) / t_seq + e * hidden)  # fp32 x, x·rsqrt, rsqrt; the bf16/fp32 output
    rope = f32 * head_dim  # cos and sin, D/2 fp32 each
    sharded = e * (2 * hidden + 2 * kv) + f32 * heads + 4 * e * ffn  # Q, SDPA out, K, V; log-sum-exp; SwiGLU
    return math.ceil(tokens * (norms + rope + sharded / tp))


def activation_bytes_per_layer_of(
    shape: ModelShape,
    *,
    seq: int,
    micro_batch: int,
    tp: int = 1,
    sp: bool = False,
    recompute: Recompute = Recompute.NONE,
    cp: int = 1,
    element_bytes: int = ACT_ELEMENT_BYTES_16BIT,
    fp8: FP8Recipe | str | None = None,
    cp_mode: CPMode | str | None = None,
) -> int:
    """Activation bytes per block for ``shape``, per rank, for one micro-batch: the count that fits its family.

    Context parallelism divides every per-token term by cp (each rank holds S/cp tokens); under ``cp_mode``
    ``allgather`` (cp > 1) :func:`cp_allgather_delta_bytes_per_layer` is added to the llama count (the gpt count has
    no fused-attention log-sum-exp to drop).

    ``llama`` (the reference model): :func:`llama_activation_bytes_per_layer`, Korthikanti 2022 Table 2 redone term
    by term for RMSNorm, RoPE, GQA, fused attention and SwiGLU, and held against a run. ``gpt``: Korthikanti 2022
    Table 2 as published (:func:`activation_bytes_per_layer`): the block it was derived for (LayerNorm, MHA with
    materialized a·s² scores and dropout, 4h GeLU MLP), so the paper's rows are reproduced as they are.

    ``fp8`` (the strategy's ``fp8`` recipe, None: off) adds :func:`fp8_activation_delta_bytes_per_layer` to the
    llama count (``element_bytes`` is then the precision outside the float8 GEMMs). For ``gpt`` shapes only
    ``tensorwise``/``rowwise`` are counted (their delta is 0); ``delayed`` raises ``ValueError``: its count is derived
    for the llama block's Linears.
    """
    kwargs = {"seq": seq, "micro_batch": micro_batch, "hidden": shape.hidden, "heads": shape.heads, "tp": tp,
              "sp": sp, "recompute": recompute, "cp": cp, "element_bytes": element_bytes}
    recipe = None if fp8 is None else FP8Recipe(fp8)
    gathered = 0
    if cp > 1 and cp_mode is not None and CPMode.parse(cp_mode) == CPMode.ALLGATHER:
        gathered = cp_allgather_delta_bytes_per_layer(seq=seq, micro_batch=micro_batch, heads=shape.heads, cp=cp,
                                                      tp=tp, recompute=recompute)
    if Arch.parse(shape.arch) == Arch.LLAMA:
        base = gathered + llama_activation_bytes_per_layer(kv_heads=shape.kv_heads, ffn=shape.ffn, **kwargs)
        if recipe is None:
            return base
        return base + fp8_activation_delta_bytes_per_layer(
            recipe, seq=seq, micro_batch=micro_batch, hidden=shape.hidden, heads=shape.heads,
            kv_heads=shape.kv_heads, ffn=shape.ffn, tp=tp, recompute=recompute, cp=cp, element_bytes=element_bytes,
        )  # fmt: skip
    if recipe == FP8Recipe.DELAYED:
        raise ValueError(
            "fp8='delayed' activation bytes are derived for the llama block (RMSNorm, GQA, SwiGLU Linears); this "
            f"shape's arch is {shape.arch!r}: plan it without fp8 or as a llama shape"
        )
    return activation_bytes_per_layer(**kwargs)


def cp_allgather_delta_bytes_per_layer(
    *,
    seq: int,
    micro_batch: int,
    heads: int,
    cp: int,
    tp: int = 1,
    recompute: Recompute = Recompute.NONE,
) -> int:
    """What all-gathered K/V context parallelism changes in one block's saved activations, per rank, per
    micro-batch, against :func:`llama_activation_bytes_per_layer` at the same cp (<= 0).

    Sources: Llama 3 (Dubey 2024 §3.3.2) all-gathers the K and V of the whole row; Megatron-Core's ``all_gather``
    ``cp_comm_type`` (``AttnFuncWithCPAndKVAllGather``) keeps only the local K/V and gathers them again in backward.
    Our ``engine/cp/allgather.py`` (``_AllGatherAttention``) does the same: it keeps the local q, k, v and the
    ``[B, S]`` document ids (stored once per batch, shared by every block) and recomputes the attention in backward,
    so neither the whole row's K/V nor the ``[B, 1, S/cp, S]`` mask is saved
    (:func:`cp_allgather_transient_bytes_per_layer` counts them as temporary buffers). The kernel's own saved
    tensors are not kept either: its output is the out-projection's input (already counted), and the fp32
    log-sum-exp that the llama count includes, ``4·b·(s/cp)·heads/t`` bytes, is not saved. Under recompute
    ``selective`` (the fused attention's outputs, log-sum-exp included, are what it keeps) and ``full`` the count
    is unchanged: 0. Measured on CPU (fp32, 2 gloo ranks, ``tests/dist/test_cp_memory.py``).
    """
    recompute = Recompute.parse(recompute, "recompute")
    if cp <= 1 or recompute != Recompute.NONE:
        return 0
    return -math.ceil(FP32_BYTES * micro_batch * (seq / cp) * heads / tp)


def cp_allgather_transient_bytes_per_layer(
    *,
    seq: int,
    micro_batch: int,
    kv_dim: int,
    cp: int,
    tp: int = 1,
    element_bytes: int = ACT_ELEMENT_BYTES_16BIT,
) -> int:
    """The temporary buffers of one block's all-gathered K/V attention, per rank, per micro-batch (forward, and
    again in backward, where ``engine/cp/allgather.py`` gathers K/V once more; one block at a time).

    Sources: Llama 3 (Dubey 2024 §3.3.2). With s = seq, b = micro_batch, kv = kv_dim, e = ``element_bytes``, t = tp:
    the whole row's K and V beyond the local ones, ``2·b·s·(kv/t)·e·(cp - 1)/cp``, and the additive mask SDPA makes
    of the engine's boolean ``[B, 1, S/cp, S]`` document mask, ``b·(s/cp)·s·e``, quadratic in s (a FlexAttention
    block mask or a varlen kernel would not have it).
    """
    if cp <= 1:
        return 0
    e = element_bytes
    kv = 2 * micro_batch * seq * (kv_dim / tp) * e * (cp - 1) / cp
    mask = micro_batch * (seq / cp) * seq * e
    return math.ceil(kv + mask)


def fp8_activation_delta_bytes_per_layer(
    recipe: FP8Recipe | str,
    *,
    seq: int,
    micro_batch: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    ffn: int,
    tp: int = 1,
    recompute: Recompute = Recompute.NONE,
    cp: int = 1,
    element_bytes: int = ACT_ELEMENT_BYTES_16BIT,
) -> int:
    """What FP8 training changes in one llama block's saved activations, per rank, per micro-batch (may be < 0).

    Sources: torchao 0.18 ``float8/float8_linear.py`` (``matmul_with_hp_or_float8_args.forward`` saves
    ``input_hp`` and ``weight_hp_t``, the high-precision tensors, and casts them again in backward) and our
    ``engine/fp8/delayed.py`` (``_DelayedScaledMM`` saves the float8 casts ``x8`` and ``w8``, as Transformer
    Engine's ``Linear`` saves its fp8 input and weight; Micikevicius 2022 §4). With h = hidden, kv =
    kv_heads·head_dim, f = ffn, e = ``element_bytes``, t = tp, per token:

    * ``tensorwise``, ``rowwise``: 0. The saved tensors are the ones a plain Linear saves (the casts are transient);
      at tp > 1 torchao's float8 styles hand the colwise Linears an input already cast to float8, not counted here.
    * ``delayed``, recompute ``none``: each of the 7 converted Linears keeps a 1-byte copy of its input: the
      attention-norm output for wq, wk, wv (3h), the mlp-norm output for w1, w3 (2h), the SDPA output for wo (h/t)
      and the SwiGLU product for w2 (f/t), 5h + (h + f)/t; the high-precision tensors whose only consumers were
      these Linears are freed: the two norm outputs (2·e·h) and the SwiGLU product (e·f/t). The SDPA output stays
      (the attention kernel saves it for its own backward). Per block, not per token: a 1-byte copy of every
      converted weight (w8), (h·(2h + 2kv) + 3h·f)/t bytes, and each Linear's three fp32 scales of that step (the
      backward uses them even if the buffer is updated meanwhile), 7·12 bytes.
    * ``delayed`` with recompute ``selective`` or ``full``: 0 (measured: 168 B of per-layer scale copies). Full
      recompute keeps the block input only; selective keeps the matmul outputs and reruns the float8 casts.

    Held against a run at tp = 1 (fp32 and bf16, recompute none/selective/full) by ``tests/unit/test_fp8_planner.py``
    to the byte. The ``/t`` terms follow the colwise/rowwise plan (wo and w2 row-parallel) and are not measured.

    Args:
        recipe: the ``fp8`` recipe.
        seq: sequence length s (tokens per sample).
        micro_batch: micro-batch size b (samples).
        hidden: h.
        heads: query heads a.
        kv_heads: key/value heads (GQA).
        ffn: SwiGLU inner width f.
        tp: tensor-parallel size t.
        recompute: none, selective or full.
        cp: context-parallel size (tokens are per rank, s/cp).
        element_bytes: bytes per element outside the float8 GEMMs (2 for 16-bit training, 4 for fp32).
    """
    recipe = FP8Recipe(recipe)
    recompute = Recompute.parse(recompute, "recompute")
    if recipe != FP8Recipe.DELAYED or recompute != Recompute.NONE:
        return 0
    e, kv = element_bytes, kv_heads * (hidden // heads)
    tokens = (seq / cp) * micro_batch
    copies = 5 * hidden + (hidden + ffn) / tp  # 1-byte float8 inputs of the 7 Linears
    freed = 2 * e * hidden + e * ffn / tp  # the norm outputs and the SwiGLU product, no longer saved
    weights = (hidden * (2 * hidden + 2 * kv) + 3 * hidden * ffn) / tp  # w8: 1 byte per converted weight element
    scales = FP8_LINEARS_PER_LLAMA_BLOCK * 3 * FP32_BYTES  # input, weight, grad_output scales saved per Linear
    return math.ceil(tokens * (copies - freed) + weights + scales)


def microbatches_in_flight(*, schedule: Schedule, pp: int, microbatches: int) -> int:
    """Micro-batches whose activations the first pipeline stage holds at its peak.

    Sources: GPipe (Huang 2019) keeps all m; 1F1B (Narayanan 2021 §2.2.1, Korthikanti 2022 §4.2.3) at most p;
    ZB-H1 and ZBV the same as 1F1B, ZB-H2 about 2p - 1 (Qi 2023, Zero Bubble Pipeline Parallelism §3).
    """
    from lightning_v17.config.schedules import schedule_info

    if pp <= 1:
        return 1
    return schedule_info(Schedule.parse(schedule, "schedule")).microbatches_in_flight(pp=pp, microbatches=microbatches)


def activation_bytes_first_stage(
    per_layer_bytes: int,
    *,
    layers: int,
    pp: int = 1,
    microbatches: int = 1,
    schedule: Schedule = Schedule.ONE_F_ONE_B,
    virtual_stages: int = 1,
) -> int:
    """Activation bytes on the first pipeline stage (the peak), per rank.

    Source: Korthikanti 2022 §4.2.3 / Eq. 5: under 1F1B the first stage holds p micro-batches of L/p layers, i.e.
    L layers' worth, whatever p is; the interleaved schedule multiplies this by (1 + (p - 1)/(p·v)) for v model
    chunks per rank. GPipe holds all m micro-batches (Huang 2019). With pp = 1 one micro-batch is live at a time
    (gradient accumulation frees it before the next).

    Args:
        per_layer_bytes: :func:`activation_bytes_per_layer`.
        layers: L, transformer blocks of the whole model.
        pp: pipeline stages p.
        microbatches: micro-batches per step per pipeline (m).
        schedule: pipeline schedule.
        virtual_stages: v, model chunks per rank (interleaved schedules).
    """
    schedule = Schedule.parse(schedule, "schedule")
    layers_per_stage = math.ceil(layers / pp)
    in_flight = microbatches_in_flight(schedule=schedule, pp=pp, microbatches=microbatches)
    factor = 1.0
    if pp > 1 and schedule in (Schedule.INTERLEAVED_1F1B, Schedule.ZERO_BUBBLE) and virtual_stages > 1:
        factor = 1.0 + (pp - 1) / (pp * virtual_stages)
    return math.ceil(per_layer_bytes * layers_per_stage * in_flight * factor)


def fp8_gathered_params(shape: ModelShape, recipe: FP8Recipe | str | None) -> int:
    """Parameters of the largest ZeRO-3 unit that are all-gathered in float8: with ``tensorwise`` (``fp8_all_gather``
    on, the strategy's default) the Linear weights of a block (``ModelShape.matmul_params_per_block``) when the block
    is the largest unit and every Linear dimension divides 16 (``engine/fp8/convert.py``'s layer rule); else 0."""
    if recipe is None or FP8Recipe(recipe) != FP8Recipe.TENSORWISE or shape.largest_unit_params != shape.block_params:
        return 0
    if any(d % 16 for d in (shape.hidden, shape.kv_dim, shape.ffn)):
        return 0
    return shape.matmul_params_per_block


def zero3_gather_bytes(
    largest_unit_params: int,
    *,
    tp: int = 1,
    param_bytes: float = 2.0,
    grad_bytes: float = 2.0,
    prefetch: int = 1,
    float8_params: int = 0,
) -> int:
    """Temporary bytes of ZeRO-3/FSDP: the all-gathered largest unit, plus prefetched units, plus its full grad.

    Source: ZeRO (Rajbhandari 2020) §5.3 (parameters are gathered per layer and freed after use), design §3.7
    and §5.8 ("full param (AG 직후): P_i ← temporary"); FSDP2 prefetches one unit ahead by default, so
    (1 + prefetch) units are gathered at once. In backward the unit's unsharded gradient exists until its
    reduce-scatter. Under TP the gathered unit is the rank's TP shard, hence / tp.

    ``float8_params``: parameters of that unit gathered in float8 (FP8 ``tensorwise`` with ``fp8_all_gather``, the
    converted Linears' weights: torchao's ``WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather`` sends and
    receives 1 byte per element); their gradients stay ``grad_bytes``.
    """
    unit = largest_unit_params / tp
    gathered = (unit - float8_params / tp) * param_bytes + float8_params / tp
    return math.ceil(gathered * (1 + prefetch) + unit * grad_bytes)


def grad_bucket_bytes(*, zero: ZeroPolicy) -> int:
    """Temporary gradient-reduction bucket for ZeRO-1/2 (DeepSpeed ``reduce_bucket_size``), in bytes.

    Source: ZeRO (Rajbhandari 2020) §5.2 (gradients are reduced in buckets) and ``zero.bucket_mb`` (MiB). Stage 0
    (DDP, nothing sharded) reduces gradients in place (``gradient_as_bucket_view``) and stage 3 (parameters
    sharded) is covered by :func:`zero3_gather_bytes`, so both count 0.
    """
    return int(zero.bucket_mb * 2**20) if zero.shards_optimizer and not zero.shards_params else 0


def logits_bytes(*, seq: int, micro_batch: int, vocab: int, tp: int = 1) -> int:
    """fp32 logits of one micro-batch on the rank that computes the loss, in bytes: 4·b·s·V/t.

    Source: the output layer and cross entropy of Korthikanti 2022 §4.3 (the logits are upcast to fp32 for a
    stable softmax and kept for its backward; vocab-parallel under TP).
    """
    return math.ceil(4 * seq * micro_batch * vocab / tp)


__all__ = [
    "ModelStateBytes",
    "activation_bytes_first_stage",
    "activation_bytes_per_layer",
    "activation_bytes_per_layer_of",
    "cp_allgather_delta_bytes_per_layer",
    "cp_allgather_transient_bytes_per_layer",
    "fp8_activation_delta_bytes_per_layer",
    "fp8_gathered_params",
    "grad_bucket_bytes",
    "grad_bytes_per_param",
    "llama_activation_bytes_per_layer",
    "logits_bytes",
    "microbatches_in_flight",
    "model_state_bytes_per_rank",
    "optimizer_bytes_per_param",
    "optimizer_state_components",
    "param_bytes_per_param",
    "zero3_gather_bytes",
    "zero_of",
]
