"""Throughput / MFU arithmetic, batch counting and the CPU peak probe (no process group)."""

from __future__ import annotations

import time

import pytest
import torch
from lightning_v17.callbacks.throughput import _batch_counts, model_shape_of

from lightning_v17.trackers.throughput import (
    StepSample,
    ThroughputTracker,
    mfu,
    probe_peak_flops_per_s,
)


def test_window_arithmetic_by_hand():
    tr = ThroughputTracker(flops_per_token=100.0, peak_flops_per_s=1e6)
    tr.record(StepSample(data_wait_s=0.1, fwd_bwd_s=0.3, optimizer_s=0.05, checkpoint_s=0.05, tokens=1000, samples=4))
    tr.record(StepSample(data_wait_s=0.0, fwd_bwd_s=0.4, optimizer_s=0.1, checkpoint_s=0.0, tokens=1000, samples=4))
    s = tr.compute()
    # 2000 tokens in 1.0 s; 100 FLOPs/token -> 2e5 FLOP/s; peak 1e6 -> MFU 0.2
    assert s.seconds == pytest.approx(1.0)
    assert s.tokens_per_s == pytest.approx(2000.0)
    assert s.samples_per_s == pytest.approx(8.0)
    assert s.flops_per_s == pytest.approx(2e5)
    assert s.mfu == pytest.approx(0.2)
    assert (s.data_wait_share, s.fwd_bwd_share, s.optimizer_share, s.checkpoint_share) == pytest.approx(
        (0.1, 0.7, 0.15, 0.05)
    )
    assert s.as_metrics()["throughput/tflops_per_s"] == pytest.approx(2e-7)
    with pytest.raises(ValueError, match="no timed steps"):
        tr.compute()  # the window was reset


def test_mfu_rejects_zero_peak():
    with pytest.raises(ValueError, match="peak"):
        mfu(1.0, 0.0)


def test_cpu_probe_is_plausible_and_cached():
    peak = probe_peak_flops_per_s(torch.float32)
    # one or two cores of any x86 from the last decade: between 1 and 1000 GFLOP/s
    assert 1e9 < peak < 1e12
    t0 = time.perf_counter()
    assert probe_peak_flops_per_s(torch.float32) == peak
    assert time.perf_counter() - t0 < 0.01


def test_batch_counts():
    ids = torch.zeros(2, 8, dtype=torch.long)
    doc = torch.zeros(2, 8, dtype=torch.long)
    doc[1, 5:] = -1  # 3 padding positions
    assert _batch_counts({"input_ids": ids, "doc_ids": doc}) == (13, 2, 8)
    assert _batch_counts({"input_ids": ids}) == (16, 2, 8)
    assert _batch_counts(ids) == (16, 2, 8)
    assert _batch_counts((torch.randn(5, 3), torch.randn(5))) == (5, 5, 1)
    assert _batch_counts({"x": torch.randn(4, 8, 16)}) == (4, 4, 1)


def test_model_shape_from_llama_config():
    from lightning_v17.models.config import ModelConfig
    from lightning_v17.planner.model import get_preset

    class HasConfig:
        config = ModelConfig.from_preset("tiny")

    shape = model_shape_of(HasConfig(), seq=64)
    tiny = get_preset("tiny")
    assert (shape.layers, shape.hidden, shape.heads, shape.kv_heads, shape.ffn, shape.vocab, shape.seq) == (
        tiny.layers,
        tiny.hidden,
        tiny.heads,
        tiny.kv_heads,
        tiny.ffn,
        tiny.vocab,
        64,
    )
    assert model_shape_of(object(), seq=8) is None


@pytest.mark.parametrize(
    ("precision", "dtype"), [("32-true", "float32"), ("bf16-mixed", "bfloat16"), ("bf16-true", "bfloat16")]
)
def test_cpu_mfu_peak_follows_the_precision_in_use(precision, dtype):
    """On CPU the MFU peak is probed in the dtype the matmuls run in (bf16 units are ~4x the fp32 ones here), and
    the log names it; an fp32 probe under bf16-mixed overstated MFU about 4x."""
    from types import SimpleNamespace

    from lightning_v17.callbacks import ThroughputMonitor

    from lightning_v17.trackers.throughput import probe_peak_flops_per_s

    mon = ThroughputMonitor()
    trainer = SimpleNamespace(
        precision_plugin=SimpleNamespace(precision=precision), strategy=SimpleNamespace(root_device=torch.device("cpu"))
    )
    peak = mon._resolve_peak(trainer)
    assert mon.peak_source == f"cpu-matmul-probe:{dtype}"
    assert peak == probe_peak_flops_per_s(getattr(torch, dtype))  # cached per dtype: the same probe result
