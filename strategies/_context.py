"""Context parallelism at the strategy boundary (cp > 1; ``lightning_v17/engine/cp/``).

A cp group is the ranks that train on one data-parallel rank's batch (the sampler hands every cp rank the same rows,
``distributed_sampler_kwargs`` counts data-parallel ranks only). :meth:`ContextSteps.batch_to_device` cuts each
batch's sequence dim to this rank's chunks (``engine.cp.shard_batch``: labels arrive shifted, so no target is lost at
a shard boundary; position ids keep their global values) and makes the batch's :class:`~lightning_v17.engine.cp.CPContext`
current for the step's forward and backward (activation recompute included), where a context-parallel attention
(the reference Llama's, or any module whose class sets ``v17_context_parallel = True`` and calls
``current_cp_context()``) runs over the whole rows.

The step's loss is then this rank's token mean. :meth:`ContextSteps.scale_loss` makes its gradient that of the
rows' token mean: it multiplies by ``cp x (this rank's target tokens) / (the cp group's)``, and the gradient
average over dp_shard x cp (ZeRO's group under cp) divides by cp again. What the module logs from its step is its
rank's own token mean (``sync_dist=True`` averages them).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from lightning_v17.config import V17ConfigError

IGNORE_INDEX = -100


def check_context_parallel_model(model: nn.Module, cp: int) -> None:
    """Refuse a model whose attention does not run context-parallel: under cp each rank holds S/cp tokens, and an
    attention that does not gather the rest would train on fragments without an error."""
    if cp > 1 and not any(getattr(type(m), "v17_context_parallel", False) for m in model.modules()):
        raise V17ConfigError(
            f"cp={cp}: no attention module of {type(model).__name__} runs context-parallel (the reference "
            "lightning_v17.models.Llama's does; a module of your own opts in with a class attribute "
            "v17_context_parallel = True and calls lightning_v17.engine.cp.current_cp_context().attention(q, k, v)); "
            "a Hugging Face model is not wired into V17Strategy(cp) (its built-in loss shifts the labels inside each "
            "shard): use cp=1"
        )


class ContextSteps:
    """The cp part of V17Strategy: shard each batch, hold its context, scale the loss (module docstring)."""

    _cp_scale: Tensor | None = None

    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        batch = super().batch_to_device(batch, device, dataloader_idx)  # type: ignore[misc]
        spec = getattr(self, "_mesh", None)
        spec = getattr(spec, "spec", None)
        if spec is None or spec.cp == 1:
            return batch
        from lightning_v17.engine.cp import CPContext, choose_cp_mode, set_cp_context, shard_batch

        if not isinstance(batch, dict) or "input_ids" not in batch:
            raise V17ConfigError(
                f"cp={spec.cp} shards the batch's sequence dim, which needs a dict batch with 'input_ids' [B, S] (and "
                f"'labels' shifted before the split, 'position_ids', 'loss_mask'); got {type(batch).__name__}"
            )
        policy = self.policy.context  # type: ignore[attr-defined]
        group = self._mesh.group("cp")  # type: ignore[attr-defined]
        rank = self._mesh.rank("cp")  # type: ignore[attr-defined]
        cpb = shard_batch(batch, cp=spec.cp, rank=rank, balance=policy.balance.value,
                          chunks_per_rank=policy.chunks_per_rank)  # fmt: skip
        mode = choose_cp_mode(policy.mode.value, cp=spec.cp, heads=self._heads[0], kv_heads=self._heads[1])
        set_cp_context(CPContext.from_batch(cpb, mode=mode, group=group))  # until the next batch: forward, backward
        self._cp_scale = _loss_scale(cpb.local, cp=spec.cp, group=group)
        return cpb.local

    @property
    def _heads(self) -> tuple[int, int]:
        """(query heads, KV heads) of the model's attention, for ``CPPolicy(mode="auto")``."""
        cfg = getattr(getattr(self.lightning_module, "model", None), "config", None)  # type: ignore[attr-defined]
        heads = getattr(cfg, "heads", None)
        if heads is None:
            raise V17ConfigError("cp > 1 needs the model's head counts (model.config.heads / kv_heads)")
        return heads, getattr(cfg, "kv_heads", None) or heads

    def scale_loss(self, loss: Tensor) -> Tensor:
        """The step's loss as the backward under cp needs it (module docstring); unchanged at cp = 1."""
        return loss if self._cp_scale is None else loss * self._cp_scale

    def clear_context(self) -> None:
        from lightning_v17.engine.cp import set_cp_context

        set_cp_context(None)
        self._cp_scale = None


def _loss_scale(local: dict[str, Any], *, cp: int, group: Any) -> Tensor | None:
    """``cp x w / sum_cp(w)``, w = this rank's target tokens (labels not ignored, times ``loss_mask``); None
    without labels (equal shares: the plain mean over each rank's equal token count already averages right)."""
    import torch.distributed as dist

    labels = local.get("labels")
    if labels is None:
        return None
    w = (labels != IGNORE_INDEX).to(torch.float64)
    if local.get("loss_mask") is not None:
        w = w * local["loss_mask"].to(torch.float64)
    mine = w.sum()
    total = mine.clone()
    dist.all_reduce(total, group=group)
    if float(total) == 0.0:
        return None
    return (cp * mine / total).to(torch.float32)
