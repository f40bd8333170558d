"""Throughput and MFU arithmetic, the step-time breakdown, and the cached CPU peak-FLOP/s probe. Lightning-free.

MFU (model FLOPs utilization), Chowdhery 2022 (PaLM) App. B::

    achieved_flops_per_s_per_rank = flops_per_token * tokens_per_s_per_rank
    mfu                           = achieved_flops_per_s_per_rank / peak_flops_per_s_per_rank

``flops_per_token`` is the model's training FLOPs per token without recomputation (forward + backward = 3 x forward;
:func:`lightning_v17.planner.throughput.flops_per_token`, Narayanan 2021 Eq. 3 / Korthikanti 2022 App. A), or 6N
(Kaplan 2020 §2.1) when only the parameter count is known. Time is the wall time of whole iterations, data wait
included, so MFU is what the run actually achieved.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch

__all__ = ["StepSample", "ThroughputStats", "ThroughputTracker", "mfu", "probe_peak_flops_per_s"]


def mfu(achieved_flops_per_s: float, peak_flops_per_s: float) -> float:
    """Model FLOPs utilization = achieved model FLOP/s / peak FLOP/s of the same device (PaLM App. B)."""
    if peak_flops_per_s <= 0:
        raise ValueError(f"peak_flops_per_s={peak_flops_per_s} must be positive")
    return achieved_flops_per_s / peak_flops_per_s


@functools.lru_cache(maxsize=8)
def _probe(dtype: torch.dtype, n: int, min_time_s: float, threads: int) -> float:
    a = torch.randn(n, n, dtype=torch.float32).to(dtype)
    b = torch.randn(n, n, dtype=torch.float32).to(dtype)
    # F.linear (x @ w.T), the kernel nn.Linear runs: for bf16 on CPU it takes oneDNN's path, about 10x torch.mm's
    # there (measured on an AVX2-only host: linear 8.6 GFLOP/s, mm 0.9); for fp32 both are the same BLAS GEMM.
    for _ in range(2):  # warm up the kernel choice and the caches
        torch.nn.functional.linear(a, b)
    best = 0.0
    iters = 0
    start = time.perf_counter()
    while True:
        t0 = time.perf_counter()
        torch.nn.functional.linear(a, b)
        dt = time.perf_counter() - t0
        best = max(best, 2.0 * n**3 / dt)  # an n x n x n GEMM is 2n^3 FLOPs (one multiply + one add per MAC)
        iters += 1
        if time.perf_counter() - start >= min_time_s and iters >= 3:
            return best


def probe_peak_flops_per_s(dtype: torch.dtype = torch.float32, *, n: int = 512, min_time_s: float = 0.2) -> float:
    """Peak FLOP/s of this process's CPU threads from a short square-matmul probe (best of several GEMMs).

    Cached per (dtype, n, min_time_s, torch.get_num_threads()), so the ~0.2 s probe runs once per process. The best
    (not the mean) GEMM rate is taken, as a peak should be; a 512^3 fp32 GEMM reaches the vendor BLAS's steady rate.

    Args:
        dtype: matmul dtype (fp32 for fp32 training; bf16 where the CPU has bf16 units).
        n: matrix size.
        min_time_s: minimum probing time in seconds.
    """
    return _probe(dtype, n, min_time_s, torch.get_num_threads())


@dataclass(frozen=True)
class StepSample:
    """One training iteration on one rank (seconds; counts of this rank's batch)."""

    data_wait_s: float
    fwd_bwd_s: float
    optimizer_s: float
    checkpoint_s: float
    tokens: int
    samples: int

    @property
    def total_s(self) -> float:
        return self.data_wait_s + self.fwd_bwd_s + self.optimizer_s + self.checkpoint_s


@dataclass(frozen=True)
class ThroughputStats:
    """Per-rank throughput over a window. ``*_share`` are fractions of the window's wall time."""

    steps: int
    seconds: float
    tokens_per_s: float
    samples_per_s: float
    flops_per_s: float  # achieved model FLOP/s of this rank
    mfu: float
    data_wait_share: float
    fwd_bwd_share: float
    optimizer_share: float
    checkpoint_share: float

    def as_metrics(self, prefix: str = "throughput/") -> dict[str, float]:
        return {
            f"{prefix}tokens_per_s": self.tokens_per_s,
            f"{prefix}samples_per_s": self.samples_per_s,
            f"{prefix}tflops_per_s": self.flops_per_s / 1e12,
            f"{prefix}mfu": self.mfu,
            f"{prefix}data_wait_share": self.data_wait_share,
            f"{prefix}fwd_bwd_share": self.fwd_bwd_share,
            f"{prefix}optimizer_share": self.optimizer_share,
            f"{prefix}checkpoint_share": self.checkpoint_share,
        }


class ThroughputTracker:
    """Accumulates :class:`StepSample` s and turns a window of them into :class:`ThroughputStats`.

    Args:
        flops_per_token: model training FLOPs per token (no recomputation).
        peak_flops_per_s: peak FLOP/s of one rank's device.
    """

    def __init__(self, *, flops_per_token: float, peak_flops_per_s: float) -> None:
        if flops_per_token <= 0 or peak_flops_per_s <= 0:
            raise ValueError("flops_per_token and peak_flops_per_s must be positive")
        self.flops_per_token = float(flops_per_token)
        self.peak_flops_per_s = float(peak_flops_per_s)
        self.samples: list[StepSample] = []

    def record(self, sample: StepSample) -> None:
        self.samples.append(sample)

    def compute(self, *, reset: bool = True) -> ThroughputStats:
        """Statistics of the samples recorded since the last reset."""
        window = self.samples
        if reset:
            self.samples = []
        seconds = sum(s.total_s for s in window)
        if not window or seconds <= 0:
            raise ValueError("no timed steps in the window")
        tokens = sum(s.tokens for s in window)
        tokens_per_s = tokens / seconds
        flops_per_s = self.flops_per_token * tokens_per_s
        return ThroughputStats(
            steps=len(window),
            seconds=seconds,
            tokens_per_s=tokens_per_s,
            samples_per_s=sum(s.samples for s in window) / seconds,
            flops_per_s=flops_per_s,
            mfu=mfu(flops_per_s, self.peak_flops_per_s),
            data_wait_share=sum(s.data_wait_s for s in window) / seconds,
            fwd_bwd_share=sum(s.fwd_bwd_s for s in window) / seconds,
            optimizer_share=sum(s.optimizer_s for s in window) / seconds,
            checkpoint_share=sum(s.checkpoint_s for s in window) / seconds,
        )
