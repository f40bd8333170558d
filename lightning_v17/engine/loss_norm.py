"""One objective for every layout: the loss divided once by the optimizer step's global target count.

One process training on a global batch minimizes ``sum_t w_t CE_t / sum_t w_t`` over every target of the step
(``w_t``: 1 for a label that is not -100, times ``loss_mask``). Spread over ``D`` data-parallel x context-parallel
ranks and ``k`` accumulated micro-batches, the gradient reduction averages over ``D`` and Lightning divides each
micro-batch's loss by ``k``. A loss that returns its own micro-batch's token mean then weighs every micro-batch
``1/(D k)`` whatever its target count, and packed rows hold different counts on different ranks: that is a slightly
reweighted objective, the one DDP trains. Dividing each micro-batch's token *sum* by ``T / (D k)`` instead, ``T``
the step's global target count, gives the one-process objective exactly, on every layout (Megatron's
``calculate_per_token_loss``, torchtitan's global valid-token normalization, Hugging Face's ``num_items_in_batch``).

The strategy computes ``T`` before the micro-batch's forward (``V17Strategy(loss_normalization="tokens")``: with
gradient accumulation it reads the window's later batches ahead) and makes a :class:`TokenNormalizer` current for
the micro-batch (:func:`set_token_normalizer`). The losses that know their target count divide by it:
:func:`divide_token_sum` (the reference model's ``next_token_loss`` and its tiled loss, the pipeline's default loss,
the Hugging Face causal-LM loss the strategy wires). A loss counts only when its own count equals the count the
strategy took from the batch's labels, so a loss over other targets (a sub-batch, other labels) keeps its mean; a
module that returns a bare scalar of its own keeps today's per-rank mean.

The returned value is then this rank's share, ``sum / (T / (D k))``: its mean over the ``D`` ranks (what
``sync_dist=True`` logs) is the step's global token mean when ``k = 1``.
"""

from __future__ import annotations

import contextvars
import logging
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["TokenNormalizer", "current_token_normalizer", "divide_token_sum", "set_token_normalizer", "target_count"]

log = logging.getLogger(__name__)

IGNORE_INDEX = -100


@dataclass
class TokenNormalizer:
    """The current micro-batch's normalization.

    Attributes:
        divisor: ``T / (D k)``: the step's global target count over the ranks the gradient is averaged over and the
            micro-batches it is accumulated over.
        local: this rank's target count in the micro-batch (after the cp cut), the count a loss must have to use it.
        used: set by a loss that divided by ``divisor`` (the strategy then applies no per-rank rescaling).
    """

    divisor: float
    local: float
    used: bool = False

    def matches(self, count: torch.Tensor | float) -> bool:
        c = float(count)
        return abs(c - self.local) <= 1e-6 * max(1.0, abs(self.local))


_CURRENT: contextvars.ContextVar[TokenNormalizer | None] = contextvars.ContextVar("v17_token_norm", default=None)
_WARNED: set[str] = set()


def set_token_normalizer(norm: TokenNormalizer | None) -> None:
    """Make ``norm`` current until the next call (the strategy sets one per training micro-batch, None otherwise)."""
    _CURRENT.set(norm)


def current_token_normalizer() -> TokenNormalizer | None:
    return _CURRENT.get()


def divide_token_sum(total: torch.Tensor, count: torch.Tensor, *, where: str) -> torch.Tensor:
    """``total / count`` (the token mean), or ``total / divisor`` when a normalizer is current and ``count`` is its
    count (module docstring). ``where`` names the loss in the warning given once when the counts differ."""
    norm = _CURRENT.get()
    if norm is not None:
        if norm.matches(count):
            norm.used = True
            return total / torch.as_tensor(norm.divisor, dtype=total.dtype, device=total.device)
        if where not in _WARNED:
            _WARNED.add(where)
            log.warning(
                "%s counted %s targets where the batch's labels have %s: this loss keeps its own token mean (the "
                "per-rank mean of V17Strategy(loss_normalization='rank_mean'))", where, float(count), norm.local,
            )  # fmt: skip
    return total / count.clamp_min(1.0)


def target_count(batch: Any, *, shift: bool) -> float | None:
    """The targets of a batch as the losses count them: ``labels != -100`` (times ``loss_mask``), or with ``shift``
    (a Hugging Face causal LM, which shifts inside its loss) ``labels[:, 1:] != -100``. None: the batch has no
    ``labels`` (its loss's count is not known)."""
    if not isinstance(batch, dict) or not isinstance(batch.get("labels"), torch.Tensor):
        return None
    labels = batch["labels"]
    if shift:
        return float((labels[..., 1:] != IGNORE_INDEX).sum())
    w = (labels != IGNORE_INDEX).to(torch.float64)
    mask = batch.get("loss_mask")
    if isinstance(mask, torch.Tensor):
        w = w * mask.to(torch.float64)
    return float(w.sum())
