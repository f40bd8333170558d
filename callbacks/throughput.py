"""``ThroughputMonitor``: a Lightning adapter over :mod:`lightning_v17.trackers.throughput`."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_v17.config import Precision, V17ConfigError
from lightning_v17.trackers.throughput import (
    StepSample,
    ThroughputStats,
    ThroughputTracker,
    probe_peak_flops_per_s,
)

__all__ = ["CHECKPOINT_BLOCKING_ATTR", "ThroughputMonitor", "model_shape_of"]

#: Contract with checkpointing code: a callback (or the strategy) that blocks the training loop to save exposes a
#: float attribute of this name holding the *cumulative* seconds the loop has been blocked by saves so far.
#: ThroughputMonitor reads its increase per step and reports it as the ``checkpoint`` share (and removes it from the
#: data-wait share, where Lightning's hook order would otherwise put it).
CHECKPOINT_BLOCKING_ATTR = "checkpoint_blocking_s"

# torch.cuda.get_device_name() substrings -> planner.hardware.ACCELERATORS keys (first match wins).
_CUDA_NAMES = (
    ("H200", "h200-141gb"),
    ("H100", "h100-80gb"),
    ("A100-SXM4-40GB", "a100-40gb"),
    ("A100-PCIE-40GB", "a100-40gb"),
    ("A100", "a100-80gb"),
    ("V100", "v100-32gb"),
)


def model_shape_of(pl_module: Any, seq: int) -> Any:
    """The planner's ``ModelShape`` of a module that exposes one, else ``None``.

    Recognized: an attribute ``model_shape`` (a ``ModelShape``), or ``config`` being a
    :class:`lightning_v17.models.ModelConfig` (as :class:`~lightning_v17.models.LlamaLM` has).
    """
    from lightning_v17.planner.model import ModelShape

    shape = getattr(pl_module, "model_shape", None)
    if isinstance(shape, ModelShape):
        return shape
    cfg = getattr(pl_module, "config", None)
    to_shape = getattr(cfg, "to_shape", None)
    return to_shape(seq=max(seq, 1)) if callable(to_shape) else None


def _batch_counts(batch: Any) -> tuple[int, int, int]:
    """(tokens, samples, seq) of a batch: a packed dict (input_ids [B, S]; non-padding tokens if doc_ids is present),
    a LongTensor [B, S], a float tensor [B, ...] (one token per sample), or a tuple/list whose first item is one."""
    if isinstance(batch, dict):
        ids = batch.get("input_ids")
        if ids is None:
            ids = next((v for v in batch.values() if isinstance(v, torch.Tensor)), None)
        if ids is None:
            return 0, 0, 0
        doc_ids = batch.get("doc_ids")
        if isinstance(doc_ids, torch.Tensor) and ids.dim() >= 2:
            # padding is not useful work; count real tokens as LlamaLM's own tokens_per_s does
            return int((doc_ids >= 0).sum()), int(ids.shape[0]), int(ids.shape[1])
        batch = ids
    if isinstance(batch, (list, tuple)) and batch and isinstance(batch[0], torch.Tensor):
        batch = batch[0]
    if isinstance(batch, torch.Tensor) and batch.dim() >= 1:
        if batch.dim() >= 2 and not batch.is_floating_point():
            return int(batch.shape[0] * batch.shape[1]), int(batch.shape[0]), int(batch.shape[1])
        return int(batch.shape[0]), int(batch.shape[0]), 1
    return 0, 0, 0


class ThroughputMonitor(Callback):
    """Tokens/s, samples/s, TFLOP/s per rank and MFU, with a step-time breakdown.

    FLOPs per token, in order of preference: ``flops_per_token`` if given; the planner's
    ``flops_per_token(shape, seq=...)`` (Narayanan 2021 Eq. 3 with the attention term) when the module exposes its
    shape (``model_shape`` or a ``ModelConfig`` as ``config``; seq is read from the first batch); otherwise 6N
    (Kaplan 2020, no attention term) with a warning. MFU = flops_per_token x tokens/s per rank / peak FLOP/s per rank
    (PaLM App. B; see :mod:`lightning_v17.trackers.throughput`).

    Peak FLOP/s per rank: ``peak_flops_per_s`` if given; else the planner's accelerator table
    (``accelerator="h100-80gb"``, or recognized from ``torch.cuda.get_device_name()``) at the trainer's precision;
    on CPU, a cached ~0.2 s matmul probe run once at the start with this rank's threads (fp32 GEMM, the "cpu" row's
    convention).

    Step-time breakdown per rank, as shares of the wall time: ``data_wait`` (end of the previous batch to this
    batch's start, minus checkpoint blocking and minus any validation run in between, which belongs to no training
    step: Lightning's per-batch sigterm broadcast and the batch fetch), ``fwd_bwd`` (batch start to
    ``on_before_optimizer_step``, i.e.
    forward, backward, gradient reduction, unscale), ``optimizer`` (the rest of the batch: clipping, step, zero-grad
    bookkeeping), ``checkpoint`` (the increase of ``checkpoint_blocking_s`` -- cumulative seconds -- exposed by any
    callback or by the strategy; see :data:`CHECKPOINT_BLOCKING_ATTR`).

    Logged every ``log_every_n_steps`` batches: ``throughput/{tokens_per_s, samples_per_s, tflops_per_s, mfu,
    data_wait_share, fwd_bwd_share, optimizer_share, checkpoint_share}``; ``last`` holds the latest
    :class:`ThroughputStats`, ``history`` all of them.

    Args:
        flops_per_token: model training FLOPs per token (no recomputation); None = derive as above.
        peak_flops_per_s: peak FLOP/s of one rank's device; None = table or probe.
        accelerator: a key of ``lightning_v17.planner.hardware.ACCELERATORS`` to take the peak from.
        log_every_n_steps: batches per reported window.
        warmup_steps: batches excluded at the start (allocation, compilation, dataloader start-up).
        batch_counts: optional ``batch -> (tokens, samples)`` for batch layouts not recognized by default.
    """

    def __init__(
        self,
        flops_per_token: float | None = None,
        peak_flops_per_s: float | None = None,
        accelerator: str | None = None,
        log_every_n_steps: int = 10,
        warmup_steps: int = 2,
        batch_counts: Callable[[Any], tuple[int, int]] | None = None,
    ) -> None:
        if flops_per_token is not None and flops_per_token <= 0:
            raise V17ConfigError(f"flops_per_token={flops_per_token} must be positive")
        if peak_flops_per_s is not None and peak_flops_per_s <= 0:
            raise V17ConfigError(f"peak_flops_per_s={peak_flops_per_s} must be positive")
        if not isinstance(log_every_n_steps, int) or log_every_n_steps < 1:
            raise V17ConfigError(f"log_every_n_steps={log_every_n_steps!r} must be a positive integer")
        self.flops_per_token = flops_per_token
        self.peak_flops_per_s = peak_flops_per_s
        self.accelerator = accelerator
        self.log_every_n_steps = log_every_n_steps
        self.warmup_steps = max(0, int(warmup_steps))
        self.batch_counts = batch_counts
        self.flops_source = ""
        self.peak_source = ""
        self.tracker: ThroughputTracker | None = None
        self.last: ThroughputStats | None = None
        self.resolved_peak_flops_per_s = 0.0  # the peak actually used, set at on_train_start
        self.history: list[ThroughputStats] = []
        self._seen = 0
        self._t_prev_end: float | None = None
        self._t_start = 0.0
        self._t_opt: float | None = None
        self._wait = 0.0
        self._ckpt_prev = 0.0
        self._t_val: float | None = None
        self._val_s = 0.0  # validation seconds since the last training batch ended (not part of any step)

    # -- resolution of FLOPs and peak ---------------------------------------------------------------------------
    def _resolve_peak(self, trainer: pl.Trainer) -> float:
        if self.peak_flops_per_s is not None:
            self.peak_source = "user"
            return float(self.peak_flops_per_s)
        from lightning_v17.planner.hardware import ACCELERATORS, get_accelerator

        name = self.accelerator
        root = trainer.strategy.root_device
        if name is None and root.type == "cuda":
            device_name = torch.cuda.get_device_name(root)
            name = next((key for sub, key in _CUDA_NAMES if sub in device_name), None)
            if name is None:
                raise V17ConfigError(
                    f"ThroughputMonitor: GPU {device_name!r} is not in the planner's accelerator table "
                    f"({', '.join(ACCELERATORS)}); pass peak_flops_per_s= or accelerator="
                )
        precision = Precision.lookup(getattr(trainer.precision_plugin, "precision", "32-true"))
        if name is not None:
            self.peak_source = f"table:{name}"
            return float(get_accelerator(name).peak_flops_for(precision or Precision.BF16_MIXED))
        # The peak of the dtype the matmuls really run in: bf16 units are ~4x the fp32 ones on this kind of CPU, so
        # an fp32 probe under bf16-mixed overstated MFU about 4x.
        dtype = torch.float32 if precision is None else getattr(torch, precision.compute_dtype)
        self.peak_source = f"cpu-matmul-probe:{str(dtype).removeprefix('torch.')}"
        return probe_peak_flops_per_s(dtype)

    def _resolve_flops(self, pl_module: pl.LightningModule, seq: int) -> float:
        if self.flops_per_token is not None:
            self.flops_source = "user"
            return float(self.flops_per_token)
        from lightning_v17.planner.throughput import flops_per_token, flops_per_token_from_params

        shape = model_shape_of(pl_module, seq)
        if shape is not None:
            self.flops_source = "planner:flops_per_token(shape)"
            return float(flops_per_token(shape, seq=max(seq, 1)))
        n = sum(p.numel() for p in pl_module.parameters())  # DTensor.numel() is the global count
        rank_zero_warn(
            "ThroughputMonitor: the module exposes no model shape; using 6N FLOPs per token (Kaplan 2020, no "
            "attention term). Pass flops_per_token= for an exact MFU."
        )
        self.flops_source = "6N"
        return float(flops_per_token_from_params(n))

    # -- hooks --------------------------------------------------------------------------------------------------
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.resolved_peak_flops_per_s = self._resolve_peak(trainer)
        self.tracker = None
        self._seen = 0
        self._t_prev_end = None
        self._t_val, self._val_s = None, 0.0
        self._ckpt_prev = self._checkpoint_blocking(trainer)

    @staticmethod
    def _checkpoint_blocking(trainer: pl.Trainer) -> float:
        total = float(getattr(trainer.strategy, CHECKPOINT_BLOCKING_ATTR, 0.0) or 0.0)
        for cb in trainer.callbacks:
            total += float(getattr(cb, CHECKPOINT_BLOCKING_ATTR, 0.0) or 0.0)
        return total

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._t_val = time.perf_counter() if self._t_prev_end is not None else None

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._t_val is not None:
            self._val_s += time.perf_counter() - self._t_val
            self._t_val = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int):
        now = time.perf_counter()
        # a validation run between two training batches is not data wait (nor any part of a training step)
        gap = now - self._t_prev_end - self._val_s if self._t_prev_end is not None else 0.0
        self._wait, self._val_s = max(0.0, gap), 0.0
        self._t_start = now
        self._t_opt = None

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self._t_opt = time.perf_counter()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = time.perf_counter()
        ckpt_total = self._checkpoint_blocking(trainer)
        ckpt_s, self._ckpt_prev = max(0.0, ckpt_total - self._ckpt_prev), ckpt_total
        t_opt = self._t_opt if self._t_opt is not None else now
        first = self._t_prev_end is None
        self._t_prev_end = now
        self._seen += 1
        if self.batch_counts is not None:
            tokens, samples = self.batch_counts(batch)
            seq = max(1, tokens // max(samples, 1))
        else:
            tokens, samples, seq = _batch_counts(batch)
        if self.tracker is None:
            self.tracker = ThroughputTracker(
                flops_per_token=self._resolve_flops(pl_module, seq), peak_flops_per_s=self.resolved_peak_flops_per_s
            )
        if self._seen <= self.warmup_steps or first:
            return
        self.tracker.record(
            StepSample(
                # a save in the previous batch's end hooks lands in this gap; book it as checkpoint time instead
                data_wait_s=max(0.0, self._wait - ckpt_s),
                fwd_bwd_s=t_opt - self._t_start,
                optimizer_s=now - t_opt,
                checkpoint_s=ckpt_s,
                tokens=tokens,
                samples=samples,
            )
        )
        if len(self.tracker.samples) >= self.log_every_n_steps:
            self.last = self.tracker.compute()
            self.history.append(self.last)
            pl_module.log_dict(self.last.as_metrics(), on_step=True, on_epoch=False, rank_zero_only=True)
            # the logging itself is not data wait of the next batch
            self._t_prev_end = time.perf_counter()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        s = self.last
        if s is None:
            return
        rank_zero_info(
            f"throughput (rank 0, last window of {s.steps} steps): {s.tokens_per_s:,.0f} tokens/s, "
            f"{s.samples_per_s:,.1f} samples/s, {s.flops_per_s / 1e12:.4f} TFLOP/s, MFU {s.mfu:.1%} "
            f"[flops/token {self.tracker.flops_per_token:,.0f} from {self.flops_source}; peak "
            f"{self.resolved_peak_flops_per_s / 1e9:,.1f} GFLOP/s from {self.peak_source}]; time: data "
            f"{s.data_wait_share:.1%}, fwd+bwd {s.fwd_bwd_share:.1%}, optimizer {s.optimizer_share:.1%}, "
            f"checkpoint {s.checkpoint_share:.1%}"
        )
