"""Checks that need CUDA: NCCL collectives, the CUDA varlen-attention backends, and a real MFU figure.

Skipped with a reason on machines without a GPU (CI and the CPU development machines). Run them with
``bash bench/gpu_check.sh`` on a lent GPU machine: it prints one JSON summary.
"""

from __future__ import annotations

import importlib.util
import os
import time

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (NCCL, flash-attn, FlexAttention)"),
]


def _random_packed(total: int, lengths: list[int], heads: int, kv_heads: int, dim: int, dtype):
    assert sum(lengths) == total
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(total, heads, dim, device="cuda", dtype=dtype, generator=g, requires_grad=True)
    k = torch.randn(total, kv_heads, dim, device="cuda", dtype=dtype, generator=g, requires_grad=True)
    v = torch.randn(total, kv_heads, dim, device="cuda", dtype=dtype, generator=g, requires_grad=True)
    return q, k, v, cu


@pytest.mark.parametrize("backend", ["flex", "flash"])
def test_cuda_varlen_backends_match_per_document_sdpa(backend):
    """The CUDA backends equal the exact per-document SDPA path (bf16 tolerance 2e-2 on outputs and grads)."""
    from lightning_v17.models.attention import flash_attn_available, flex_attention_available, varlen_attention

    if backend == "flash" and not flash_attn_available():
        pytest.skip("flash-attn is not installed (optional `gpu` extra)")
    if backend == "flex" and not flex_attention_available():
        pytest.skip("FlexAttention is not available in this torch build")
    lengths = [100, 7, 300, 1, 105]
    q, k, v, cu = _random_packed(sum(lengths), lengths, 8, 4, 64, torch.bfloat16)
    out = varlen_attention(q, k, v, cu, max(lengths), backend=backend)
    out.float().square().sum().backward()
    got = [out.detach().float(), q.grad.float(), k.grad.float(), v.grad.float()]
    for t in (q, k, v):
        t.grad = None
    ref = varlen_attention(q, k, v, cu, max(lengths), backend="sdpa")
    ref.float().square().sum().backward()
    want = [ref.detach().float(), q.grad.float(), k.grad.float(), v.grad.float()]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


def test_flex_does_not_recompile_per_token_count():
    """FlexAttention is compiled with automatic dynamic shapes: three packed batches with different token counts
    compile at most two graphs (one static, one dynamic), where dynamic=False compiled one per shape. (On CPU,
    inductor's flex C++ template fails to compile the dynamic document-mask kernel in torch 2.13, CppCompileError
    "cur_qSplitSize8", so this check can only run on CUDA.)"""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from lightning_v17.models.attention import _compiled_flex, flex_attention_available, varlen_attention

    if not flex_attention_available():
        pytest.skip("FlexAttention is not available in this torch build")
    torch._dynamo.reset()
    _compiled_flex.cache_clear()
    counters.clear()
    for lengths in ([100, 156], [17, 300, 75], [128, 64, 64, 10, 500]):
        q, k, v, cu = _random_packed(sum(lengths), lengths, 8, 4, 64, torch.bfloat16)
        with torch.no_grad():
            out = varlen_attention(q, k, v, cu, max(lengths), backend="flex")
            ref = varlen_attention(q, k, v, cu, max(lengths), backend="sdpa")
        torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])


def _nccl_worker(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    torch.cuda.set_device(rank % torch.cuda.device_count())
    x = torch.full((1024,), float(rank + 1), device="cuda")
    dist.all_reduce(x)
    out = torch.empty(1024 // world_size, device="cuda")
    dist.reduce_scatter_tensor(out, torch.ones(1024, device="cuda"))
    return {"allreduce": x[0].item(), "reduce_scatter": out[0].item()}


def test_nccl_collectives():
    """NCCL all-reduce and reduce-scatter give the arithmetic sums on this machine's GPUs (1 rank per GPU)."""
    import torch.distributed as dist

    from tests._dist import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        res = _nccl_worker(0, 1)
    finally:
        dist.destroy_process_group()
    assert res == {"allreduce": 1.0, "reduce_scatter": 1.0}


def test_llama_bf16_mfu_on_gpu(record_property):
    """Train a ~100M-param reference Llama in bf16 for a few steps and report the measured MFU.

    MFU = (6·N + 12·L·h·S) FLOPs/token x tokens/s / peak (Narayanan 2021 Eq. 3 without recompute), with the peak
    from the planner's accelerator table for the detected GPU. The test asserts the run is sane (MFU in (0, 1]).
    """
    from lightning_v17.models import Llama, ModelConfig
    from lightning_v17.planner.hardware import ACCELERATORS

    name = torch.cuda.get_device_name().lower()
    key = next((k for k in ACCELERATORS if k.split("-")[0] in name), None)
    if key is None:
        pytest.skip(f"no peak-FLOP/s entry for {name!r} in the planner's accelerator table")
    cfg = ModelConfig(vocab_size=32000, hidden=768, layers=12, heads=12, kv_heads=12, ffn=2048, max_seq_len=2048)
    model = Llama(cfg).cuda().to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    B, S = 8, 2048
    tokens = torch.randint(0, cfg.vocab_size, (B, S), device="cuda")
    n = sum(p.numel() for p in model.parameters())

    def step():
        logits = model(tokens)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    t0, steps = time.perf_counter(), 10
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    tok_s = B * S * steps / (time.perf_counter() - t0)
    flops_per_token = 6 * n + 12 * cfg.layers * cfg.hidden * S
    mfu = flops_per_token * tok_s / ACCELERATORS[key].peak_flops
    record_property("mfu", round(mfu, 4))
    record_property("tokens_per_s", round(tok_s))
    print(f"gpu={name} params={n} tokens/s={tok_s:.0f} MFU={mfu:.3f}")
    assert 0 < mfu <= 1.0


def test_v17_zero3_one_gpu_bf16_mfu(record_property):
    """V17Strategy(zero_stage=3) on one GPU inside a Lightning Trainer, bf16-mixed, the reference LlamaLM at ~100M
    parameters: the ThroughputMonitor's MFU against the planner's bf16 peak for this GPU (warm-up excluded)."""
    import lightning as L
    from lightning_v17.callbacks import ThroughputMonitor

    from lightning_v17 import V17Strategy
    from lightning_v17.models import LlamaLM

    B, S, steps = 8, 2048, 14
    overrides = {"vocab_size": 32000, "hidden": 768, "layers": 12, "heads": 12, "kv_heads": 12, "ffn": 2048,
                 "max_seq_len": S}  # fmt: skip

    class Tokens(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return B * steps

        def __getitem__(self, i: int) -> dict:
            ids = torch.randint(0, 32000, (S + 1,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids[:-1], "labels": ids[1:]}

    tput = ThroughputMonitor(log_every_n_steps=5)
    trainer = L.Trainer(
        accelerator="gpu", devices=1, strategy=V17Strategy(zero_stage=3), precision="bf16-mixed", max_steps=steps,
        callbacks=[tput], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(LlamaLM(model="tiny", model_overrides=overrides, warmup_steps=0), torch.utils.data.DataLoader(
        Tokens(), batch_size=B))  # fmt: skip
    last = tput.last
    assert last is not None, "no ThroughputMonitor window completed"
    record_property("v17_zero3_mfu", round(last.mfu, 4))
    record_property("v17_zero3_tokens_per_s", round(last.tokens_per_s))
    record_property("v17_zero3_peak_source", str(tput.peak_source))
    print(f"V17 ZeRO-3 1 GPU bf16: tokens/s={last.tokens_per_s:.0f} MFU={last.mfu:.3f} peak={tput.peak_source}")
    assert 0 < last.mfu <= 1.0


def _v17_nccl_worker(rank: int, world_size: int) -> dict:
    import warnings

    warnings.filterwarnings("ignore")
    from tests._strategy import v17  # flat option dicts
    from tests.dist.test_strategy_tp_pp import _fit

    cases = {"zero3": {"zero_stage": 3}, "tp2_zero3": {"tp": 2, "zero_stage": 3},
             "pp2_zero1": {"pp": 2, "zero_stage": 1, "microbatches": 2}}  # fmt: skip
    return {name: _fit(v17(**kw), 2, accelerator="gpu") for name, kw in cases.items()}


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL between two ranks)")
def test_v17_two_gpu_nccl_parity():
    """V17Strategy on 2 GPUs over NCCL (ZeRO-3, tp=2, pp=2) against the 1-GPU run of the same model, data and seed
    (``tests/dist/test_strategy_tp_pp._fit``, clipping on every step). fp32 (TF32 off, torch's default for matmuls):
    1e-4 relative, looser than the CPU 1e-5 for the GPU's reduction orders."""
    from tests._dist import spawn
    from tests.dist.test_strategy_tp_pp import _fit

    want = _fit("auto", 1, accelerator="gpu")
    results = spawn(_v17_nccl_worker, world_size=2, timeout=400, init_process_group=False)
    for res in results:
        for name, got in res.items():
            assert got == pytest.approx(want, rel=1e-4), (name, got, want)


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None, reason="transformer-engine not installed")
def test_transformer_engine_fp8_linear_trains():
    """Transformer Engine's FP8 Linear runs forward+backward under fp8_autocast (Hopper: e4m3 fwd / e5m2 bwd)."""
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import DelayedScaling, Format

    layer = te.Linear(1024, 1024, bias=False).cuda()
    x = torch.randn(64, 1024, device="cuda", requires_grad=True)
    with te.fp8_autocast(enabled=True, fp8_recipe=DelayedScaling(fp8_format=Format.HYBRID)):
        y = layer(x)
    y.float().square().mean().backward()
    ref = x.detach() @ layer.weight.detach().t()
    rel = (y.detach().float() - ref).norm() / ref.norm()
    assert rel < 0.1 and torch.isfinite(layer.weight.grad).all()
