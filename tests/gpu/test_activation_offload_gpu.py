"""Activation offload ``tier="cpu"`` on one CUDA device (``engine/offload/activations.py``, ``activation_buffers.py``).

* **Exactness.** The reference Llama on cuda, fp32, 4 SGD steps: losses and every gradient equal the run without
  offload bit for bit (deterministic kernels; the reference is run twice first, so a nondeterministic kernel shows
  as itself). Steps 3..4 copy into the pinned pool allocated in step 2 (its allocation counter stays flat).
* **Overhead.** A wider Llama (8 blocks of width 2048, seq 4096, bf16 autocast), the same batch: median step time
  with offload over without, recorded as ``act_offload_cpu_overhead``; target <= 1.05.
* **Sequence at equal memory.** The same model, batch 1: the peak allocated bytes of a no-offload step at seq 2048
  are the budget; the longest seq (a multiple of 1024) whose step stays within it, with and without offload, recorded
  as ``act_offload_cpu_seq_ratio``; target >= 1.5.

Skipped without CUDA. On a CPU-only machine ``tier="cpu"`` is refused with its reason
(``tests/unit/test_activation_offload.py``).
"""

from __future__ import annotations

import os
import statistics
import time

import pytest
import torch
import torch.nn.functional as F

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS (read at its first handle)

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (activation offload tier 'cpu')"),
    pytest.mark.timeout(300),
]


def _llama(cfg_kw: dict):
    from lightning_v17.models import Llama, ModelConfig

    return Llama(ModelConfig(**cfg_kw), init_seed=0).cuda()


def _offload(model, **kw):
    from lightning_v17.engine.offload.activations import ActivationOffload

    return ActivationOffload(model.recompute_units(), tier="cpu", nvme_path=None, **kw)


def _step(model, ids, autocast: bool = False) -> torch.Tensor:
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        logits = model(ids)
    loss = F.cross_entropy(logits.float().flatten(0, 1), ids.flatten())
    loss.backward()
    return loss.detach()


def test_cpu_tier_gradients_equal_no_offload_bit_for_bit():
    cfg = {"vocab_size": 256, "hidden": 256, "layers": 4, "heads": 4, "kv_heads": 2, "ffn": 704, "max_seq_len": 512}
    batches = [torch.randint(0, 256, (2, 512), generator=torch.Generator().manual_seed(s)).cuda() for s in range(4)]

    def run(offload: bool):
        m = _llama(cfg)
        off = _offload(m, min_bytes=64 * 1024, resident_blocks=1) if offload else None
        opt = torch.optim.SGD(m.parameters(), lr=0.5)
        out, allocs = [], []
        for ids in batches:
            loss = _step(m, ids)
            out.append((loss, {n: p.grad.clone() for n, p in m.named_parameters()}))
            opt.step()
            opt.zero_grad()
            if off is not None:
                allocs.append(off.pool.allocations)
        stats = dict(off.stats) if off else {}
        if off is not None:
            off.close()
        return out, allocs, stats

    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        ref, _, _ = run(False)
        ref2, _, _ = run(False)
        got, allocs, stats = run(True)
    finally:
        torch.use_deterministic_algorithms(False)
    for (la, ga), (lb, gb) in zip(ref, ref2):
        assert torch.equal(la, lb) and all(torch.equal(ga[n], gb[n]) for n in ga), "the reference is not deterministic"
    assert stats["bytes_offloaded"] > 0 and stats["reads_on_demand"] == 0 and stats["kept_capturing"] == 0, stats
    assert allocs[1] > 0 and allocs[1] == allocs[-1], allocs  # steps 3..4 reuse step 2's pinned buffers
    for step, ((la, ga), (lb, gb)) in enumerate(zip(ref, got)):
        assert torch.equal(la, lb), (step, la, lb)
        for n in ga:
            assert torch.equal(ga[n], gb[n]), (step, n, float((ga[n] - gb[n]).abs().max()))


WIDE = {"vocab_size": 1024, "hidden": 2048, "layers": 8, "heads": 16, "kv_heads": 16, "ffn": 5632, "max_seq_len": 16384}


def _median_step_s(model, ids, steps: int = 6, warmup: int = 2) -> float:
    times = []
    for i in range(warmup + steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        _step(model, ids, autocast=True)
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=False)
    return statistics.median(times)


def test_cpu_tier_step_overhead_at_equal_batch(record_property):
    m = _llama(WIDE)
    ids = torch.randint(0, WIDE["vocab_size"], (2, 4096), device="cuda")
    base = _median_step_s(m, ids)
    with _offload(m, resident_blocks=1):
        off = _median_step_s(m, ids)
    record_property("act_offload_cpu_overhead", round(off / base, 4))
    record_property("act_offload_cpu_step_s", {"none": round(base, 4), "cpu": round(off, 4)})
    assert off / base <= 1.05, (base, off)


def _peak_bytes(model, seq: int) -> int:
    ids = torch.randint(0, WIDE["vocab_size"], (1, seq), device="cuda")
    model.zero_grad(set_to_none=False)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    _step(model, ids, autocast=True)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


def _longest(model, budget: int, start: int, stop: int) -> int:
    best = 0
    for seq in range(start, stop + 1, 1024):
        if _peak_bytes(model, seq) > budget:
            break
        best = seq
    return best


def test_cpu_tier_longer_sequence_at_equal_memory(record_property):
    m = _llama(WIDE)
    m.zero_grad(set_to_none=False)
    for p in m.parameters():
        p.grad = torch.zeros_like(p)  # allocated once: the peaks differ only in activations
    _peak_bytes(m, 1024)  # warm-up (kernels, workspaces)
    budget = _peak_bytes(m, 2048)
    plain = _longest(m, budget, 1024, 4096)
    with _offload(m, resident_blocks=1):
        _peak_bytes(m, 1024)  # the pool learns the block size
        offloaded = _longest(m, budget, 1024, 12288)
    record_property("act_offload_cpu_seq_ratio", round(offloaded / plain, 3) if plain else None)
    record_property("act_offload_cpu_seq", {"budget_bytes": budget, "none": plain, "cpu": offloaded})
    assert plain >= 2048 and offloaded >= 1.5 * plain, (budget, plain, offloaded)
