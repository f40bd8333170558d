"""The loss divided once by the optimizer step's global target count, at the strategy boundary.

``V17Strategy(loss_normalization="tokens")`` (the default): before each training micro-batch's forward,
:meth:`TokenSteps.batch_to_device` counts the batch's targets (``lightning_v17.engine.loss_norm.target_count``),
sums them over the data-parallel ranks and over the micro-batches of the accumulation window, ``T``, and makes a
:class:`~lightning_v17.engine.loss_norm.TokenNormalizer` with divisor ``T / (D n)`` current (``D = dp x cp``, the
ranks the gradient is averaged over; ``n`` the window's batches: Lightning's ``accumulate_grad_batches`` ``k``, which
divides each micro-batch's loss, or fewer in an epoch's last window, where the step's gradient is then ``n / k`` of
the window's token mean, as Lightning's own accumulation scales it). The losses that know their count divide by it (the reference model's, the pipeline's default loss, the
Hugging Face causal-LM loss ``_context.py`` wires): every layout then trains one process's objective on the same
global batch. ``"rank_mean"``: no normalizer; each rank's loss is its own mean (DDP's objective).

With ``accumulate_grad_batches = k > 1`` the window's later batches are read ahead: the train dataloader is wrapped
(:class:`LookAheadLoader`, a pass-through for everything Lightning asks of it) and its iterator pulls the window's
batches when its first one is transferred, counting each; they are then handed to Lightning in order. The window is
Lightning's own (``batch_idx // k``, cut at the epoch's last batch), read from the loop's progress. A module or
datamodule that rewrites batches in ``on_before_batch_transfer`` could count differently from what was read ahead:
where a read-ahead count differs from the batch's, every rank falls back to the per-rank mean for the rest of the run,
with a warning.

Manual optimization (``automatic_optimization = False``) keeps the per-rank mean: the module calls backward itself,
and Lightning's accumulation does not divide its loss.
"""

from __future__ import annotations

import collections
import logging
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import RunningStage

from lightning_v17.config import V17ConfigError
from lightning_v17.engine.loss_norm import TokenNormalizer, current_token_normalizer, set_token_normalizer, target_count

log = logging.getLogger(__name__)

LOSS_NORMALIZATIONS = ("tokens", "rank_mean")


def check_loss_normalization(value: Any) -> str:
    if value not in LOSS_NORMALIZATIONS:
        raise V17ConfigError(
            f"V17Strategy(loss_normalization={value!r}) must be 'tokens' (the loss divided once by the step's global "
            "target count: one process's objective on every layout) or 'rank_mean' (each rank's own mean, as DDP)"
        )
    return value


class _LookAheadIter:
    """The train loader's iterator, which can pull batches ahead and counts every batch it pulls, in order."""

    def __init__(self, it: Any, count: Any) -> None:
        self._it, self._count = it, count
        self._ahead: collections.deque = collections.deque()  # pulled, not yet handed to Lightning
        self.counts: collections.deque = collections.deque()  # every pulled batch not yet transferred, in order

    def __iter__(self) -> _LookAheadIter:
        return self

    def _pull(self) -> Any:
        batch = next(self._it)
        self.counts.append(self._count(batch))
        return batch

    def __next__(self) -> Any:
        return self._ahead.popleft() if self._ahead else self._pull()

    def peek(self, n: int) -> list[float | None]:
        """The counts of the next ``n`` batches after the one being transferred (fewer at the end of the data)."""
        while len(self.counts) < n:
            try:
                self._ahead.append(self._pull())
            except StopIteration:
                break
        return list(self.counts)[:n]


class LookAheadLoader:
    """A train dataloader whose iterator reads ahead (:class:`_LookAheadIter`); every other attribute (``sampler``,
    ``batch_sampler``, ``state_dict``, ``len``) is the wrapped loader's, so Lightning treats it as that loader."""

    def __init__(self, loader: Any, strategy: Any) -> None:
        object.__setattr__(self, "_v17_loader", loader)
        object.__setattr__(self, "_v17_strategy", strategy)

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "_v17_loader"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._v17_loader, name, value)

    def __len__(self) -> int:
        return len(self._v17_loader)

    def __iter__(self) -> _LookAheadIter:
        strategy = self._v17_strategy
        it = _LookAheadIter(iter(self._v17_loader), lambda b: target_count(b, shift=strategy._token_shift))
        strategy._lookahead = it
        return it


class TokenSteps:
    """The token normalization part of V17Strategy (module docstring)."""

    _loss_normalization = "tokens"
    _token_shift = False  # a Hugging Face causal LM is wired: its loss shifts the labels inside
    _lookahead: _LookAheadIter | None = None
    _token_window: tuple[int, int, int, float] | None = None  # (epoch, first batch, end, T) of the accumulation window
    _token_off = False  # a read-ahead count differed from its batch's: per-rank mean from then on

    def process_dataloader(self, dataloader: Any) -> Any:
        dataloader = super().process_dataloader(dataloader)  # type: ignore[misc]
        module = getattr(self, "_lightning_module", None)
        trainer = getattr(module, "_trainer", None)
        if self._loss_normalization == "tokens" and trainer is not None and trainer.state.stage == RunningStage.TRAINING:
            return LookAheadLoader(dataloader, self)
        return dataloader

    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        divisor = self._token_divisor(batch)
        set_token_normalizer(None)
        out = super().batch_to_device(batch, device, dataloader_idx)  # type: ignore[misc]  # (cp: cut the sequence)
        if divisor is not None:
            shifted = getattr(self, "_cp_shift_labels", None) if self._token_shift else None
            if shifted is not None:  # cp x Hugging Face: the targets were shifted on the full rows, then cut
                local = float((shifted != -100).sum())
            else:
                local = target_count(out, shift=self._token_shift)
            set_token_normalizer(TokenNormalizer(divisor=divisor, local=float(local)))
        return out

    def token_normalized(self) -> bool:
        """Whether this micro-batch's loss divided by the step's global count (no per-rank rescaling is due)."""
        norm = current_token_normalizer()
        return norm is not None and norm.used

    def _token_divisor(self, batch: Any) -> float | None:
        """``T / (D n)`` for this training batch, or None (module docstring)."""
        module = getattr(self, "_lightning_module", None)
        trainer = getattr(module, "_trainer", None)
        if trainer is None or not trainer.training or trainer.sanity_checking:
            return None
        ahead = self._lookahead
        read = ahead.counts.popleft() if ahead is not None and ahead.counts else None  # this batch, as read ahead
        if self._loss_normalization != "tokens" or self._token_off or not module.automatic_optimization:
            return None
        mine = target_count(batch, shift=self._token_shift)
        if mine is None:
            return None
        spec = self.mesh.spec  # type: ignore[attr-defined]
        k = int(trainer.accumulate_grad_batches)
        i = int(trainer.fit_loop.epoch_loop.batch_progress.current.ready)  # this batch's index in the epoch
        window, epoch = self._token_window, int(trainer.current_epoch)
        if k > 1 and window is not None and window[0] == epoch and window[1] <= i < window[2]:
            return window[3] / (spec.dp * spec.cp * (window[2] - window[1]))
        n = 1
        later: list[float | None] = []
        if k > 1:
            total = trainer.num_training_batches
            n = int(min(k - i % k, total - i)) if total != float("inf") else k - i % k
            later = ahead.peek(n - 1) if ahead is not None else [None] * (n - 1)
            n = 1 + len(later)  # an iterable dataset of unknown length may end the epoch inside the window
        bad = k > 1 and (read != mine or any(c is None for c in later))
        local = torch.tensor([mine + sum(c for c in later if c is not None), float(bad)], dtype=torch.float64,
                             device=self.root_device)  # type: ignore[attr-defined]  # fmt: skip
        if spec.dp > 1:
            dist.all_reduce(local, group=self.mesh.group("dp"))  # type: ignore[attr-defined]
        if float(local[1]) > 0:  # on any rank: the same decision everywhere
            self._token_off = True
            log.warning(
                "V17Strategy(loss_normalization='tokens') with accumulate_grad_batches=%d reads the window's batches "
                "ahead, and a batch's targets differed from what was read ahead (on_before_batch_transfer rewrites "
                "batches?) or a batch has no 'labels': the loss stays each rank's own mean from here on", k,
            )  # fmt: skip
            return None
        total_t = float(local[0])
        self._token_window = (epoch, i, i + n, total_t)
        return total_t / (spec.dp * spec.cp * n) if total_t > 0 else None  # no target in the step: a zero loss
