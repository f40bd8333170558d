"""FP8 checks that need an FP8 GPU (issue 12 targets, H100/H200): a large-GEMM microbenchmark (float8
``torch._scaled_mm`` against a bf16 matmul) and an end-to-end step of a ~1B reference Llama (torchao tensorwise
float8, with ``torch.compile``, against bf16) on one GPU. They run from ``bash bench/gpu_check.sh``, which prints one
JSON summary with the figures recorded here (``record_property``).

Targets (issue 12): >= 1.3x on large GEMMs, >= 1.15x tokens/s end to end. Not yet measured: no GPU was lent when
this was written; on CPU they skip with a reason.
"""

from __future__ import annotations

import time

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
        reason="float8 tensor cores need compute capability >= 8.9 (L4, L40, H100, H200, B200)",
    ),
]

GEMM_TARGET, E2E_TARGET = 1.3, 1.15


def _cuda_time(fn, iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / iters


def test_fp8_large_gemm_is_faster_than_bf16(record_property):
    m = n = k = 8192
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    t_bf16 = _cuda_time(lambda: a @ b.t(), 20)
    t_fp8 = _cuda_time(lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16), 20)
    ratio = t_bf16 / t_fp8
    flops = 2 * m * n * k
    record_property("fp8_gemm_8192_tflops", round(flops / t_fp8 / 1e12, 1))
    record_property("bf16_gemm_8192_tflops", round(flops / t_bf16 / 1e12, 1))
    record_property("fp8_gemm_speedup", round(ratio, 3))
    assert ratio >= GEMM_TARGET, f"fp8 GEMM {ratio:.2f}x bf16 < target {GEMM_TARGET}x"


def _llama_1b():
    from lightning_v17.models import ModelConfig
    from lightning_v17.models.llama import Llama

    # ~1.1B parameters: hidden 2048, 22 blocks, ffn 5632, 32 heads, 4 kv heads (TinyLlama-1.1B's shape)
    cfg = ModelConfig(vocab_size=32000, hidden=2048, layers=22, heads=32, kv_heads=4, ffn=5632, max_seq_len=2048,
                      dropout=0.0)  # fmt: skip
    return Llama(cfg)


def _tokens_per_s(fp8: bool, steps: int = 6, batch: int = 4, seq: int = 2048) -> float:
    from lightning_v17.config import FP8Policy
    from lightning_v17.engine.fp8.convert import apply_fp8
    from lightning_v17.engine.zero.fsdp import find_wrap_units

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = _llama_1b().to(torch.bfloat16)
    if fp8:
        apply_fp8(model, policy=FP8Policy("tensorwise"), units=find_wrap_units(model), device="cuda")
    model = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ids = torch.randint(0, 32000, (batch, seq), device="cuda")

    def step():
        logits = model(ids)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):  # compile and warm up
        step()
    return batch * seq / _cuda_time(step, steps)


def test_fp8_end_to_end_1b_llama_is_faster_than_bf16(record_property):
    bf16 = _tokens_per_s(False)
    fp8 = _tokens_per_s(True)
    record_property("bf16_1b_tokens_per_s", round(bf16))
    record_property("fp8_1b_tokens_per_s", round(fp8))
    record_property("fp8_1b_speedup", round(fp8 / bf16, 3))
    assert fp8 / bf16 >= E2E_TARGET, f"fp8 end to end {fp8 / bf16:.2f}x bf16 < target {E2E_TARGET}x"
