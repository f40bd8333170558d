"""Pipeline parallelism inside Lightning's loop: what V17Strategy does instead of the module's step when pp > 1.

With pp > 1 the schedule runs forward *and* backward of every micro-batch inside ``training_step``, so (DESIGN.md,
"Pipeline parallelism inside Lightning's loop"):

* the LightningModule's ``training_step`` / ``validation_step`` / ``test_step`` are **not called**: the stages run
  the model. What does run of the user's module: ``configure_model``, ``configure_optimizers``, the optional
  ``pipeline_loss(logits, batch)`` (the loss of one micro-batch; default: token-mean cross-entropy against
  ``batch["labels"]``, shifted for models that shift inside their own loss, e.g. Hugging Face causal LMs), the
  optional ``pipeline_split_points()`` (FQNs of the blocks that start stages 2..n), the hooks
  ``on_before_zero_grad`` and ``on_after_backward`` (once per step, with the reduced gradients), every
  ``on_train_batch_*`` hook and the callbacks. ``on_before_backward`` is not called: forward and backward
  interleave per micro-batch, so there is no single moment before backward with the loss in hand.
* Every stage returns the step's loss (the last stage's value, summed over the pp axis) so that Lightning logs it
  and steps the optimizer (it skips the step when ``training_step`` returns None); ``backward`` is a no-op (NeMo's
  ``MegatronStrategy`` skips backward the same way) and Lightning's own ``zero_grad`` is skipped.
* Batches are dicts (``input_ids``, ``labels``, optional ``position_ids`` / ``loss_mask``) or ``(inputs, labels)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.trainer import call
from lightning_v17.strategies._precision import loss_scale
from torch import Tensor

from lightning_v17.config import PipelinePolicy, V17ConfigError
from lightning_v17.engine.loss_norm import current_token_normalizer

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning_v17.strategies.v17 import V17Strategy


def pipeline_options(module: Any, policy: PipelinePolicy) -> tuple[PipelinePolicy, Any, Any]:
    """Resolve how to cut ``module`` and what loss to use: ``(policy with split points, layout, loss_fn)``.

    Split points, first match: the strategy's ``PipelinePolicy.split_points``, the LightningModule's
    ``pipeline_split_points()`` hook, else balanced by parameter count. The layout comes from the model
    (``lightning_v17.models.pp_layouts``); the loss from the LightningModule's ``pipeline_loss`` when defined.
    """
    from dataclasses import replace

    from lightning_v17.models.pp_layouts import model_pipeline_layout

    hook = getattr(module, "pipeline_split_points", None)
    if policy.split_points is None and callable(hook):
        policy = replace(policy, split_points=tuple(hook()))
    loss_fn = getattr(module, "pipeline_loss", None)
    return policy, model_pipeline_layout(module), loss_fn if callable(loss_fn) else None


def check_pipeline_trainer(strategy: V17Strategy, trainer: pl.Trainer) -> None:
    """What pp > 1 needs from the Trainer and the LightningModule (the schedule owns forward and backward)."""
    if not strategy.lightning_module.automatic_optimization:
        raise V17ConfigError(
            f"pp={strategy.mesh.spec.pp} runs forward and backward inside the pipeline schedule, so manual "
            "optimization (self.automatic_optimization = False) cannot call backward itself; use automatic "
            "optimization with pp>1, or pp=1 for manual optimization"
        )


def _batch(args: tuple, kwargs: dict) -> Any:
    return args[0] if args else kwargs["batch"]


def rows(batch: Any) -> int:
    """Rows (sequences) in a tensor, dict or ``(inputs, labels)`` batch."""
    if isinstance(batch, Tensor):
        x = batch
    elif isinstance(batch, Mapping):
        x = batch["input_ids"] if "input_ids" in batch else next(iter(batch.values()))
    else:
        x = batch[0]
    return int(x.shape[0])


def training_step(strategy: V17Strategy, args: tuple, kwargs: dict) -> Tensor:
    """One optimizer micro-step through the schedule (see the module docstring)."""
    from lightning_v17.engine.pipeline.runtime import pipeline_step

    runtime = strategy.parallel.pipeline
    module = strategy.lightning_module
    trainer = module.trainer
    batch = _batch(args, kwargs)
    batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
    # Lightning's own zero_grad is skipped (fit_loop._skip_backward): zero here, at the first batch of each
    # accumulation window, *before* the schedule accumulates this step's gradients.
    if batch_idx % trainer.accumulate_grad_batches == 0:
        for opt in strategy.optimizers:  # the hook Lightning's skipped zero_grad would have called
            call._call_callback_hooks(trainer, "on_before_zero_grad", opt)
            call._call_lightning_module_hook(trainer, "on_before_zero_grad", opt)
        module.zero_grad(set_to_none=True)
        for opt in strategy.optimizers:
            opt.zero_grad(set_to_none=True)
    # Lightning back-propagates training_step's loss / accumulate_grad_batches; the schedule runs the backward here,
    # so it gets that factor (and the fp16 loss scale) as its loss scale. The returned loss is unscaled.
    scale = loss_scale(strategy)
    if trainer.accumulate_grad_batches > 1:
        scale = (1.0 if scale is None else scale) / trainer.accumulate_grad_batches
    # cp: the rows' token mean from this rank's (ContextSteps.scale_loss), unless the default loss divides by the
    # step's global target count (the current TokenNormalizer, strategies/_tokens.py), which already is that
    global_tokens = current_token_normalizer() is not None and runtime.loss_fn.loss_fn is None
    if strategy._cp_scale is not None and not global_tokens:
        scale = strategy._cp_scale if scale is None else scale * strategy._cp_scale
    with strategy.precision_plugin.train_step_context():
        loss = pipeline_step(runtime, batch, grad_sync=strategy.zero.pipeline_reducer, loss_scale=scale)
    if global_tokens and not strategy.token_normalized():
        raise RuntimeError("the pipeline's default loss counted other targets than the strategy's token count")
    call._call_callback_hooks(trainer, "on_after_backward")
    call._call_lightning_module_hook(trainer, "on_after_backward")
    # No on_before_backward here (no single moment before the interleaved backward): callbacks that judge the step's
    # loss (BadStepGuard) get it through their on_pipeline_loss, before the optimizer step.
    for cb in trainer.callbacks:
        if callable(getattr(cb, "on_pipeline_loss", None)):
            cb.on_pipeline_loss(trainer, module, loss)
    bsz = rows(batch)
    module.log("train_loss", loss, prog_bar=True, batch_size=bsz)
    if runtime.bubble_over_busy is not None:
        module.log("pipeline/bubble_fraction", runtime.bubble_over_busy, batch_size=bsz)
    module.log("pipeline/bubble_planned", runtime.planned_bubble, batch_size=bsz)
    return loss


def refuse_predict(strategy: V17Strategy) -> None:
    raise V17ConfigError(
        f"predict with pp={strategy.mesh.spec.pp} is not supported (only the last stage would hold the outputs); "
        "predict with pp=1 (a pp checkpoint loads at pp=1)"
    )


def eval_step(strategy: V17Strategy, stage: str, args: tuple, kwargs: dict) -> Tensor:
    """The schedule's forward-only path for ``validation_step`` / ``test_step``; logs ``{stage}_loss``."""
    from lightning_v17.engine.pipeline.runtime import pipeline_eval

    batch = _batch(args, kwargs)
    plugin = strategy.precision_plugin
    ctx = {"val": plugin.val_step_context, "test": plugin.test_step_context}[stage]
    with ctx(), torch.no_grad():
        loss = pipeline_eval(strategy.parallel.pipeline, batch)
    # Same value on every pp (and tp) rank; sync_dist averages the data-parallel replicas.
    strategy.lightning_module.log(
        f"{stage}_loss", loss, prog_bar=stage == "val", sync_dist=True, batch_size=rows(batch)
    )
    return loss
