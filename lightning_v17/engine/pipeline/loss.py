"""The pipeline's batches and the last stage's loss (part of :mod:`lightning_v17.engine.pipeline.runtime`, which
re-exports it): a batch checked and cut into the schedule's micro-batch rows, and :class:`PipelineLoss`, the loss
the schedule calls once per micro-batch on the last stage.

Loss normalization (default token-mean cross-entropy): the last stage's loss for one micro-batch is
``sum(CE * w) / W`` where ``W`` is the total weight (tokens with label != -100, times ``loss_mask``) of the *whole*
batch, and the schedule does not rescale gradients (``scale_grads=False``). The sum over micro-batches is then
exactly the non-pipelined token-mean loss, so parity with a single-process run holds even when micro-batches hold
different numbers of valid tokens. A user loss (``loss_fn``, the LightningModule's ``pipeline_loss``) returns each
micro-batch's mean; the step loss is their mean weighted by rows.

Loss parallelism (``TPPolicy(loss_parallel=True)``): the tp plan keeps the head's logits a DTensor sharded along the
vocabulary (``Shard(-1)``), and torch's vocab-parallel cross-entropy works on those shards only inside its
``loss_parallel()`` context, for the loss *and* its backward. The pipeline schedule calls the loss on the last stage
and runs its backward later, in its own backward actions (and once more in the first step's shape inference), so the
loss itself opens the context when it first sees vocab-sharded logits and the runtime closes it when the step ends
(:meth:`PipelineLoss.end_step`): every loss of the step and every backward through it run inside, as the strategy
runs the whole training step inside it without pipelining. The divisor is unchanged: torch reduces the vocabulary
shards' log-sum-exp and target logits over tp, so each tp rank gets the whole micro-batch's cross-entropy sum.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from lightning_v17.config import V17ConfigError
from lightning_v17.engine.loss_norm import current_token_normalizer

__all__ = ["PipelineLoss", "vocab_sharded"]


# ---------------------------------------------------------------------------------------------------------- batches


def _as_dict(batch: Any) -> dict[str, Any]:
    """The batch as a dict: a mapping with ``input_ids`` and ``labels``, or an ``(inputs, labels)`` pair."""
    if isinstance(batch, Mapping):
        if "input_ids" not in batch or "labels" not in batch:
            raise V17ConfigError(
                "a pipeline batch dict needs 'input_ids' [B, S] and 'labels' [B, S] (optional: 'position_ids', "
                f"'loss_mask'); got keys {sorted(batch)}"
            )
        out = dict(batch)
    elif isinstance(batch, (tuple, list)) and len(batch) == 2:
        out = {"input_ids": batch[0], "labels": batch[1]}
    else:
        raise V17ConfigError(
            "a pipeline batch must be a dict with 'input_ids' and 'labels' or an (inputs, labels) pair; got "
            + type(batch).__name__
        )
    ids, labels = out["input_ids"], out["labels"]
    if not (isinstance(ids, torch.Tensor) and isinstance(labels, torch.Tensor)) or ids.dim() != 2:
        raise V17ConfigError("pipeline batches need token ids as a [B, S] tensor and labels of the same shape")
    if labels.shape != ids.shape:
        raise V17ConfigError(f"labels {tuple(labels.shape)} must have the shape of input_ids {tuple(ids.shape)}")
    return out


def _slice_rows(batch: Any, start: int, stop: int, rows: int) -> Any:
    """Rows ``start:stop`` of every tensor with ``rows`` rows in ``batch`` (a dict, tuple or list, kept as such).

    ``cu_seqlens`` (document offsets over the whole flattened batch) means nothing for a slice and is left out.
    """

    def cut(v: Any) -> Any:
        return v[start:stop] if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == rows else v

    if isinstance(batch, Mapping):
        return {k: cut(v) for k, v in batch.items() if k != "cu_seqlens"}
    return type(batch)(cut(v) for v in batch)


def _pad_rows(t: torch.Tensor, rows: int, fill: float | None = None) -> torch.Tensor:
    """``t`` with rows appended up to ``rows``: copies of row 0 (valid ids / positions / masks for any model), or
    ``fill`` when given (-100 labels, 0 loss weights), so that padding rows add exactly nothing to the loss."""
    pad = rows - t.shape[0]
    if pad <= 0:
        return t
    extra = t[:1].expand(pad, *t.shape[1:]) if fill is None else t.new_full((pad, *t.shape[1:]), fill)
    return torch.cat([t, extra])


# ------------------------------------------------------------------------------------------------------------ loss


def vocab_sharded(logits: torch.Tensor) -> bool:
    """Whether ``logits`` [..., V] are a DTensor sharded along V (what a tp plan with loss parallelism emits)."""
    placements = getattr(logits, "placements", None)
    last = logits.dim() - 1
    return placements is not None and any(p.is_shard() and p.dim % logits.dim() == last for p in placements)


class PipelineLoss:
    """The last stage's loss, called by the schedule once per micro-batch as ``loss(logits, rows)``.

    The schedule splits its ``target`` along dim 0 like the inputs; the target is ``arange(B)``, so ``rows`` are the
    micro-batch's row indices into the step's batch, which this object holds (:meth:`prepare`).

    * Default: token-mean cross-entropy, ``sum(CE(logits, labels) * w) / W`` with ``W`` the weight of the whole
      batch (labels != -100, times ``loss_mask``), labels shifted by one first when the layout says so; under a
      current :class:`~lightning_v17.engine.loss_norm.TokenNormalizer` whose count is ``W``, ``W`` is its
      ``divisor`` (the step's global target count over the data-parallel ranks and accumulated batches).
    * ``loss_fn(logits, batch)``: called with the micro-batch's logits and its rows of the batch (only real rows,
      never ragged-batch padding; labels as given, unshifted); returns that micro-batch's mean loss, scaled here by
      its share of the real rows so that the step loss is the row-weighted mean.

    Logits may be a vocab-sharded DTensor (loss parallel): the loss then opens torch's ``loss_parallel()`` for the
    rest of the step (see the module docstring), and ``loss_fn`` gets them as they are.
    """

    def __init__(self, loss_fn: Callable[[torch.Tensor, Any], torch.Tensor] | None = None) -> None:
        self.loss_fn = loss_fn
        #: fp16 loss scale (GradScaler): the backward runs on loss * scale; pipeline_step divides it out again
        self.scale: torch.Tensor | float = 1.0
        self.busy_s = 0.0  # time spent here, counted as the last stage's compute by BubbleTimer
        #: when a list (``BubbleTimer.trace`` of the same runtime), each call appends ("loss", -1, -1, t0, t1)
        self.trace: list[tuple[str, int, int, float, float]] | None = None
        self._batch: Any = None
        self._labels: torch.Tensor | None = None
        self._weight: torch.Tensor | None = None
        self._normalizer: torch.Tensor | float = 1.0
        self._divisor: float | None = None
        self._rows = 0
        #: weigh each micro-batch mean of ``loss_fn`` by its share of the batch's target tokens instead of its rows
        #: (under cp, where each rank's rows hold different numbers of this rank's tokens)
        self.token_shares = False
        self._row_weight: torch.Tensor | None = None
        #: torch's loss_parallel() while open (from the first vocab-sharded logits to :meth:`end_step`)
        self._loss_parallel: contextlib.ExitStack | None = None

    def open_loss_parallel(self) -> None:
        """Enter torch's ``loss_parallel()`` until :meth:`end_step`, once: it is not re-entrant (leaving an inner one
        removes the op handlers an outer one still needs)."""
        if self._loss_parallel is None:
            from lightning_v17.engine.tp.apply import loss_parallel_context

            stack = contextlib.ExitStack()
            stack.enter_context(loss_parallel_context())
            self._loss_parallel = stack

    def end_step(self) -> None:
        """Leave ``loss_parallel()`` if this step opened it (the runtime calls this after the schedule, also when
        the step failed: torch's context does not clean up after an exception passing through it)."""
        stack, self._loss_parallel = self._loss_parallel, None
        if stack is not None:
            stack.close()

    def prepare(self, batch: Any, parts: dict[str, Any], *, rows: int, padded_rows: int, shift: bool) -> None:
        """Hold one step's batch: ``batch`` as given (for ``loss_fn``), ``parts`` its dict form (``labels``,
        optional ``loss_mask``) for the token mean; ``rows`` real rows, padded to ``padded_rows``."""
        self._batch, self._rows = batch, rows
        labels = parts["labels"]
        mask = parts.get("loss_mask")
        if shift:
            # Hugging Face ForCausalLMLoss: pad labels with -100 and take labels[..., 1:] (loss/loss_utils.py).
            labels = F.pad(labels[:, 1:], (0, 1), value=-100)
            mask = None if mask is None else F.pad(mask[:, 1:], (0, 1), value=0)
        weight = (labels != -100).to(torch.float32)
        if mask is not None:
            weight = weight * mask.to(torch.float32)
        self._normalizer = weight.sum().clamp_min(1.0)
        self._divisor = None  # the default loss's divisor: this batch's weight, or the step's global share of it
        norm = current_token_normalizer() if self.loss_fn is None else None
        if norm is not None and norm.matches(weight.sum()):
            norm.used, self._divisor = True, norm.divisor  # engine/loss_norm.py: T / (D k)
        self._row_weight = weight.sum(1)
        self._labels = _pad_rows(labels, padded_rows, -100)
        self._weight = None if mask is None else _pad_rows(weight, padded_rows, 0.0)

    def __call__(self, logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        start, n = int(rows[0]), rows.numel()  # the schedule's chunks of arange(B) are contiguous
        if vocab_sharded(logits):  # the cross-entropy and, later in the step, its backward run on the shards
            self.open_loss_parallel()
        if self.loss_fn is None:
            labels = self._labels[start : start + n]
            flat = logits.flatten(0, 1).float()
            if self._weight is None:
                loss = F.cross_entropy(flat, labels.flatten(), ignore_index=-100, reduction="sum")
            else:
                ce = F.cross_entropy(flat, labels.flatten(), ignore_index=-100, reduction="none")
                if hasattr(ce, "full_tensor"):  # loss parallel: every token's loss, on every tp rank
                    ce = ce.full_tensor()
                loss = (ce * self._weight[start : start + n].flatten().to(ce.dtype)).sum()
            out = loss / (self._normalizer if self._divisor is None else self._divisor)
        else:
            real = max(0, min(n, self._rows - start))
            if real == 0:  # only ragged-batch padding: no loss, but a graph for the schedule's backward
                out = logits.sum() * 0.0
            else:
                part = logits if real == n else logits[:real]
                mean = self.loss_fn(part, _slice_rows(self._batch, start, start + real, self._rows))
                share = self._row_weight[start : start + real].sum() / self._normalizer if self.token_shares else None
                out = mean * (real / self._rows if share is None else share)
        if not (isinstance(self.scale, float) and self.scale == 1.0):
            out = out * self.scale
        t1 = time.perf_counter()
        self.busy_s += t1 - t0
        if self.trace is not None:
            self.trace.append(("loss", -1, -1, t0, t1))
        return out
