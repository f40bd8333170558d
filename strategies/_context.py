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

Under pp the schedule runs the step: the strategy hands it this scale as part of its loss scale
(``_pipeline.training_step``), and the pipeline runtime cuts the batch's context to each micro-batch's rows
(``CPContext.split_rows``) around every stage action on that micro-batch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from lightning_v17.config import V17ConfigError
from lightning_v17.engine.state import state_of

IGNORE_INDEX = -100


HF_ATTENTION = "v17_cp"  # the name of the context-parallel attention in transformers' AttentionInterface


def _hf_models(model: nn.Module) -> list[nn.Module]:
    """The Hugging Face ``PreTrainedModel`` roots in ``model`` (outermost only)."""
    found: list[nn.Module] = []
    covered: set[int] = set()
    for m in model.modules():
        if id(m) not in covered and hasattr(m, "set_attn_implementation") and hasattr(m, "config"):
            found.append(m)
            covered.update(id(x) for x in m.modules())
    return found


def prepare_context_parallel_model(strategy: Any, model: nn.Module, cp: int) -> None:
    """Make ``model``'s attention run context-parallel, or refuse it: under cp each rank holds S/cp tokens, and an
    attention that does not gather the rest would train on fragments without an error.

    A Hugging Face model is wired without edits: the engine's attention registered in transformers'
    ``AttentionInterface`` and set as the model's implementation; its forward gets the batch's global
    ``position_ids`` when the caller passes none; its causal-LM loss takes the targets shifted on the full rows
    before the cut (it would shift inside each shard, losing every shard's last target and pairing tokens across
    the head-tail reordering). The reference Llama's attention opts in by ``v17_context_parallel = True``.
    """
    hf_models = _hf_models(model)
    for hf in hf_models:
        _wire_hf_loss(strategy, hf)
    strategy._token_shift = any(hasattr(hf, "loss_function") for hf in hf_models)  # their loss shifts the labels
    if cp == 1:
        return
    pp = strategy.dims.pp
    if hf_models and pp > 1:
        raise V17ConfigError(
            f"cp={cp} with pp={pp} on a Hugging Face model ({type(hf_models[0]).__name__}) is not implemented: the "
            "pipeline's loss shifts the labels inside each rank's sequence shard; use the reference "
            "lightning_v17.models.Llama with cp and pp, or pp=1 for this model"
        )
    for hf in hf_models:
        _wire_hf(strategy, hf)
    strategy._cp_hf = bool(hf_models)  # batch_to_device shifts the labels on the full rows for them
    if not hf_models and not any(getattr(type(m), "v17_context_parallel", False) for m in model.modules()):
        raise V17ConfigError(
            f"cp={cp}: no attention module of {type(model).__name__} runs context-parallel (the reference "
            "lightning_v17.models.Llama's and Hugging Face models' do; a module of your own opts in with a class "
            "attribute v17_context_parallel = True and calls "
            "lightning_v17.engine.cp.current_cp_context().attention(q, k, v)); use cp=1"
        )


def _wire_hf(strategy: Any, hf: nn.Module) -> None:
    from transformers import AttentionInterface

    from lightning_v17.engine.cp import current_cp_context, hf_attention_forward

    AttentionInterface.register(HF_ATTENTION, hf_attention_forward)
    hf.set_attn_implementation(HF_ATTENTION)

    def positions(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        ctx = current_cp_context()
        if ctx is not None and kwargs.get("position_ids") is None and strategy._cp_positions is not None:
            kwargs["position_ids"] = strategy._cp_positions
        return args, kwargs

    hf.register_forward_pre_hook(positions, with_kwargs=True)


def _wire_hf_loss(strategy: Any, hf: nn.Module) -> None:
    """The Hugging Face causal-LM loss under V17: under cp it takes the targets shifted on the full rows (it would
    shift inside each shard), and under ``loss_normalization="tokens"`` it divides its token sum by the step's
    global count (``num_items_in_batch``, transformers' own argument for it; ``engine/loss_norm.py``)."""
    if not hasattr(hf, "loss_function") or state_of(hf).loss_wired:
        return
    from lightning_v17.engine.cp import current_cp_context
    from lightning_v17.engine.loss_norm import current_token_normalizer

    inner = hf.loss_function

    def loss(logits: Tensor, labels: Tensor | None, vocab_size: int, num_items_in_batch: Any = None,
             ignore_index: int = IGNORE_INDEX, shift_labels: Tensor | None = None, **kwargs: Any) -> Tensor:  # fmt: skip
        if shift_labels is None and current_cp_context() is not None:
            if strategy._cp_shift_labels is None:
                raise V17ConfigError("under cp the Hugging Face loss needs the batch's 'labels' (or shift_labels=)")
            shift_labels = strategy._cp_shift_labels
            strategy._cp_scale = strategy._cp_shift_scale  # this loss is the mean over the shifted local targets
            num_items_in_batch = None
        norm = current_token_normalizer()
        if norm is not None and num_items_in_batch is None and (labels is not None or shift_labels is not None):
            targets = shift_labels if shift_labels is not None else labels[..., 1:]
            if norm.matches((targets != ignore_index).sum()):
                norm.used, num_items_in_batch = True, torch.tensor(norm.divisor, dtype=torch.float64)
        return inner(logits, labels, vocab_size, num_items_in_batch=num_items_in_batch, ignore_index=ignore_index,
                     shift_labels=shift_labels, **kwargs)  # fmt: skip

    hf.loss_function = loss
    state_of(hf).loss_wired = True


class ContextSteps:
    """The cp part of V17Strategy: shard each batch, hold its context, scale the loss (module docstring)."""

    _cp_scale: Tensor | None = None
    _cp_hf = False  # a Hugging Face model is wired: its loss takes the targets shifted before the cut
    _cp_shift_scale: Tensor | None = None  # the scale of a Hugging Face loss (targets shifted on the full rows)
    _cp_shift_labels: Tensor | None = None  # this rank's share of those targets
    _cp_positions: Tensor | None = None  # this rank's global position ids, for a forward called without them

    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        batch = super().batch_to_device(batch, device, dataloader_idx)  # type: ignore[misc]
        spec = getattr(self, "_mesh", None)
        spec = getattr(spec, "spec", None)
        if spec is None:
            return batch
        if spec.tp > 1 and self.policy.tensor_parallel.sequence_parallel:  # type: ignore[attr-defined]
            _check_sequence_parallel_rows(batch, spec, self.policy.context)  # type: ignore[attr-defined]
        if spec.cp == 1:
            return batch
        from lightning_v17.engine.cp import CPContext, set_cp_context, shard_batch, shift_labels

        if not isinstance(batch, dict) or "input_ids" not in batch:
            raise V17ConfigError(
                f"cp={spec.cp} shards the batch's sequence dim, which needs a dict batch with 'input_ids' [B, S] (and "
                f"'labels' shifted before the split, 'position_ids', 'loss_mask'); got {type(batch).__name__}"
            )
        policy = self.policy.context  # type: ignore[attr-defined]
        group = self._mesh.group("cp")  # type: ignore[attr-defined]
        rank = self._mesh.rank("cp")  # type: ignore[attr-defined]
        if self._cp_hf and "labels" in batch:  # a Hugging Face loss shifts its labels: here, on the full rows
            batch = {**batch, "_v17_shift": shift_labels(batch["labels"])}
        cpb = shard_batch(batch, cp=spec.cp, rank=rank, balance=policy.balance.value,
                          chunks_per_rank=policy.chunks_per_rank)  # fmt: skip
        shifted = cpb.local.pop("_v17_shift", None)
        self._cp_positions = cpb.local["position_ids"]
        self._cp_shift_labels = shifted
        # "auto" is resolved from q/k's head counts at the attention call (engine.cp.choose_cp_mode)
        set_cp_context(CPContext.from_batch(cpb, mode=policy.mode, group=group))  # until the next batch: forward, backward
        self._cp_scale = _loss_scale(cpb.local.get("labels"), cpb.local.get("loss_mask"), cp=spec.cp, group=group)
        self._cp_shift_scale = None if shifted is None else _loss_scale(shifted, None, cp=spec.cp, group=group)
        return cpb.local

    def scale_loss(self, loss: Tensor) -> Tensor:
        """The step's loss as the backward under cp needs it (module docstring); unchanged at cp = 1, and unchanged
        when the loss already divided by the step's global target count (``_tokens.py``)."""
        if self._cp_scale is None or self.token_normalized():  # type: ignore[attr-defined]
            return loss
        return loss * self._cp_scale

    def clear_context(self) -> None:
        from lightning_v17.engine.cp import set_cp_context
        from lightning_v17.engine.loss_norm import set_token_normalizer

        set_cp_context(None)
        set_token_normalizer(None)
        self._cp_scale = None


def _check_sequence_parallel_rows(batch: Any, spec: Any, context: Any) -> None:
    """Under sequence parallelism each rank holds S/(cp*tp) tokens of the residual stream: refuse rows that the
    ranks cannot share evenly, before the first forward (DTensor's sequence shards are equal ones)."""
    from lightning_v17.engine.cp import check_sequence_parallel_split

    tokens = batch.get("input_ids") if isinstance(batch, dict) else None
    if isinstance(tokens, Tensor) and tokens.dim() >= 2:
        check_sequence_parallel_split(tokens.shape[1], cp=spec.cp, tp=spec.tp, balance=context.balance,
                                      chunks_per_rank=context.chunks_per_rank)  # fmt: skip


def _loss_scale(labels: Tensor | None, loss_mask: Tensor | None, *, cp: int, group: Any) -> Tensor | None:
    """``cp x w / sum_cp(w)``, w = this rank's target tokens (labels not ignored, times ``loss_mask``); None
    without labels (equal shares: the plain mean over each rank's equal token count already averages right)."""
    import torch.distributed as dist

    if labels is None:
        return None
    w = (labels != IGNORE_INDEX).to(torch.float64)
    if loss_mask is not None:
        w = w * loss_mask.to(torch.float64)
    mine = w.sum()
    total = mine.clone()
    dist.all_reduce(total, group=group)
    if float(total) == 0.0:
        return None
    return (cp * mine / total).to(torch.float32)
