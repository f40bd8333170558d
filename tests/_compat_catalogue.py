"""The catalogue of the Lightning compatibility matrix: one function per case, each a few small Trainer runs.

A case returns ``{feature: observables}`` for the features it exercises (``tests/_compat_matrix.py`` names them for
users). Observables are what the feature produces, compared with the reference's at 1e-5: the losses, every parameter
gathered whole, and whatever else the feature makes (a suggestion, a logged norm, the kept checkpoints). The
decorator names the features (default: the case's name) and says where the reference comes from: ``ddp`` is the Lightning strategy that runs the case on 2 ranks (None:
the dp=2 layouts compare with one process too), ``one_rows`` the batch sizes of the one-process runs (ROWS for the
dp=1 layouts; 2 * ROWS for a dp=2 layout compared with one process).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tests._compat_cases import (
    ROWS,
    Ctx,
    attempt,
    broadcast,
    full,
    mem_logger,
    metrics,
    module_class,
    params,
    trainer,
)

CASES: list[Callable[[Ctx], dict]] = []


def case(*, ddp: str | None = "ddp", one_rows: tuple[int, ...] = (ROWS,), features: tuple[str, ...] = ()) -> Callable:
    def register(fn: Callable[[Ctx], dict]) -> Callable[[Ctx], dict]:
        fn.ddp, fn.one_rows, fn.features = ddp, one_rows, features or (fn.__name__,)  # type: ignore[attr-defined]
        CASES.append(fn)
        return fn

    return register


def fit(ctx: Ctx, module: Any = None, **kw: Any) -> dict:
    """A fit of ``module`` (default: CompatLM) with ``kw`` for the Trainer: its losses and parameters after."""
    losses: list[float] = []
    m = module if module is not None else ctx.module()
    tr = trainer(ctx, losses=losses, **kw)
    tr.fit(m)
    return {"losses": losses, "params": params(m, ctx), "global_step": tr.global_step}


# ---------------------------------------------------------------------------------------------------- callbacks
def _backbone_module(ctx: Ctx) -> Any:
    class WithBackbone(module_class()):
        @property
        def backbone(self) -> torch.nn.Module:  # BackboneFinetuning's contract: the module to freeze, then unfreeze
            return self.model.layers

    return ctx.module(WithBackbone, trainable_only=True, sched=False)


def _groups(tr: Any) -> list[float]:
    """The LR of each param group (the parameters in them are compared whole; under pp each rank holds its stage's)."""
    return [g["lr"] for g in tr.optimizers[0].param_groups]


@case(ddp=None, one_rows=(ROWS, 2 * ROWS))  # DDP's reducer leaves out what was frozen when it was built
def backbone_finetuning(ctx: Ctx) -> dict:
    from lightning.pytorch.callbacks import BackboneFinetuning

    m = _backbone_module(ctx)
    losses: list[float] = []
    tr = trainer(ctx, callbacks=[BackboneFinetuning(unfreeze_backbone_at_epoch=1)], losses=losses, max_epochs=3,
                 limit_train_batches=2)  # fmt: skip
    tr.fit(m)
    return {"backbone_finetuning": {"losses": losses, "params": params(m, ctx), "groups": _groups(tr)}}


@case(ddp=None, one_rows=(ROWS, 2 * ROWS))
def own_finetuning(ctx: Ctx) -> dict:
    from lightning.pytorch.callbacks import BaseFinetuning

    class FreezeEmbedding(BaseFinetuning):
        """A user's own BaseFinetuning: the embedding frozen at setup, unfrozen at epoch 1 at a tenth of the LR."""

        def freeze_before_training(self, pl_module: Any) -> None:
            self.freeze(pl_module.model.tok_embeddings)

        def finetune_function(self, pl_module: Any, epoch: int, optimizer: Any) -> None:
            if epoch == 1:
                lr = optimizer.param_groups[0]["lr"] / 10
                self.unfreeze_and_add_param_group(pl_module.model.tok_embeddings, optimizer, lr=lr)

    m = ctx.module(trainable_only=True, sched=False)
    losses: list[float] = []
    tr = trainer(ctx, callbacks=[FreezeEmbedding()], losses=losses, max_epochs=2, limit_train_batches=2)
    tr.fit(m)
    return {"own_finetuning": {"losses": losses, "params": params(m, ctx), "groups": _groups(tr)}}


@case()
def swa(ctx: Ctx) -> dict:
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    cb = StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1, annealing_epochs=1)
    return {"swa": fit(ctx, callbacks=[cb], max_epochs=3, limit_train_batches=2)}


@case()
def ema(ctx: Ctx) -> dict:
    from lightning.pytorch.callbacks import EMAWeightAveraging

    return {"ema": fit(ctx, callbacks=[EMAWeightAveraging(decay=0.5)], max_steps=4)}


@case()
def model_checkpoint(ctx: Ctx) -> dict:
    """Top-2 by the synced train_loss plus last, every step; then a new Trainer resumes from last for 2 more steps."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    d = os.path.join(ctx.tmp, "ckpt")

    def cb() -> Any:
        return ModelCheckpoint(dirpath=d, filename="{step}", monitor="train_loss", save_top_k=2, save_last=True,
                               every_n_train_steps=1)  # fmt: skip

    first = cb()
    fit(ctx, callbacks=[first], max_steps=4, enable_checkpointing=True)
    kept = sorted(os.listdir(d))
    best = {os.path.basename(k): float(v) for k, v in first.best_k_models.items()}
    resumed = ctx.module()
    losses: list[float] = []
    tr = trainer(ctx, callbacks=[cb()], losses=losses, max_steps=6, enable_checkpointing=True)
    tr.fit(resumed, ckpt_path=first.last_model_path)
    return {"model_checkpoint": {"kept": kept, "best_k": best, "best": os.path.basename(first.best_model_path),
                                 "resumed_losses": losses, "params": params(resumed, ctx)}}  # fmt: skip


@case()
def early_stopping(ctx: Ctx) -> dict:
    """min_delta=10 on val_loss: epoch 0 improves on inf, epoch 1 cannot improve by 10, so patience=1 stops there."""
    from lightning.pytorch.callbacks import EarlyStopping

    es = EarlyStopping(monitor="val_loss", min_delta=10.0, patience=1)
    out = fit(ctx, callbacks=[es], max_epochs=5, limit_train_batches=2, limit_val_batches=1)
    return {"early_stopping": {**out, "stopped_epoch": es.stopped_epoch, "best": float(es.best_score)}}


@case()
def lr_monitor(ctx: Ctx) -> dict:
    from lightning.pytorch.callbacks import LearningRateMonitor

    log = mem_logger()
    out = fit(ctx, callbacks=[LearningRateMonitor(logging_interval="step")], logger=log, log_every_n_steps=1,
              max_steps=3)  # fmt: skip
    lrs = [(step, {k: v for k, v in row.items() if k.startswith("lr-")}) for step, row in log.rows]
    return {"lr_monitor": {**out, "lrs": [r for r in lrs if r[1]]}}


@case()
def grad_accum_scheduler(ctx: Ctx) -> dict:
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    cb = GradientAccumulationScheduler(scheduling={0: 1, 1: 2})
    return {"grad_accum_scheduler": fit(ctx, callbacks=[cb], max_epochs=2, limit_train_batches=4)}


@case()
def model_summary(ctx: Ctx) -> dict:
    from lightning.pytorch.callbacks import ModelSummary

    seen: dict[str, Any] = {}

    class Recorded(ModelSummary):
        def summarize(self, summary_data, total_parameters, trainable_parameters, model_size, *args, **kw) -> None:
            cols = dict(summary_data)
            # the layer names and their parameter counts (the types are a fact: ZeRO-3 shows FSDP2's FSDPLlama)
            seen.update(total=total_parameters, trainable=trainable_parameters, size_mb=model_size,
                        layers=dict(zip(cols["Name"], cols["Params"])), _types=cols["Type"])  # fmt: skip

    out = fit(ctx, callbacks=[Recorded(max_depth=2)], enable_model_summary=True, max_steps=1)
    return {"model_summary": {"summary": broadcast(seen, ctx), "params": out["params"]}}  # rank 0 summarizes


@case()
def throughput_monitor(ctx: Ctx) -> dict:
    """Lightning's ThroughputMonitor: per-device counts, and the global rate over the data-parallel ranks only."""
    from lightning.pytorch.callbacks import ThroughputMonitor

    log = mem_logger()
    cb = ThroughputMonitor(batch_size_fn=lambda b: b["input_ids"].shape[0], window_size=2)
    out = fit(ctx, callbacks=[cb], logger=log, log_every_n_steps=1, max_steps=4)
    rows = [row for _step, row in log.rows if "train/samples" in row]
    last = broadcast(rows[-1] if rows else {}, ctx)  # the monitor runs on rank 0 only
    counts = {k: last.get(f"train/{k}") for k in ("samples", "batches")}
    dev, glob = last.get("train/device/samples_per_sec"), last.get("train/samples_per_sec")
    # one process logs no global rate; the dp ranks together process dp times one device's samples
    ratio = 1.0 if glob is None or dev is None else glob / dev
    return {"throughput_monitor": {"counts": counts, "global_samples_over_device": ratio, "params": out["params"]}}


@case()
def spike_detection(ctx: Ctx) -> dict:
    """A corrupt batch (3, loss x SPIKE) stops training on every rank, writes the batches to skip, and
    OnExceptionCheckpoint saves the state at the exception."""
    from lightning.fabric.utilities.spike import TrainingSpikeException
    from lightning.pytorch.callbacks import OnExceptionCheckpoint, SpikeDetection

    m = ctx.module(spike=ctx.batch_rows(3))
    path = os.path.join(ctx.tmp, "skip.json")
    exc = os.path.join(ctx.tmp, "exc")
    losses: list[float] = []
    tr = trainer(ctx, callbacks=[SpikeDetection(warmup=1, window=2, exclude_batches_path=path),
                                 OnExceptionCheckpoint(dirpath=exc)], losses=losses, max_steps=6,
                 enable_checkpointing=True)  # fmt: skip
    try:
        tr.fit(m)
        raised = None
    except TrainingSpikeException as err:
        raised = str(err)
    with open(path) as f:
        skip = f.read()
    return {"spike_detection": {"raised": raised, "skip": skip, "losses": losses, "params": params(m, ctx),
                                "on_exception_ckpt": os.path.exists(os.path.join(exc, "on_exception.ckpt"))}}


# ---------------------------------------------------------------------------------------------------- tuner
@case()
def lr_find(ctx: Ctx) -> dict:
    from lightning.pytorch.tuner import Tuner

    m = ctx.module()
    tr = trainer(ctx, max_steps=2)
    found = Tuner(tr).lr_find(m, min_lr=1e-3, max_lr=1.0, num_training=6, early_stop_threshold=None)
    left = sorted(f for f in os.listdir(ctx.tmp) if f.startswith(".lr_find"))
    tr.fit(m)  # the restored model trains on
    return {"lr_find": {"lr": found.results["lr"], "loss": found.results["loss"],
                        "suggestion": found.suggestion(skip_begin=1, skip_end=1), "left_behind": left,
                        "params": params(m, ctx)}}  # fmt: skip


@case()
def scale_batch_size(ctx: Ctx) -> dict:
    from lightning.pytorch.tuner import Tuner

    m = ctx.module()
    tr = trainer(ctx, max_steps=2)
    size = Tuner(tr).scale_batch_size(m, mode="power", steps_per_trial=1, init_val=2, max_trials=2)
    left = sorted(f for f in os.listdir(ctx.tmp) if f.startswith(".scale_batch_size"))
    tr.fit(m)
    return {"scale_batch_size": {"size": size, "left_behind": left, "params": params(m, ctx)}}


# ---------------------------------------------------------------------------------------------------- utilities
@case()
def grad_norm(ctx: Ctx) -> dict:
    from lightning.pytorch.utilities import grad_norm as lightning_grad_norm

    class GradNorm(module_class()):
        def on_before_optimizer_step(self, optimizer: Any) -> None:
            norms = lightning_grad_norm(self, norm_type=2)
            self.log_dict(norms)
            self.record.setdefault("norms", []).append({k: float(v) for k, v in norms.items()})

    m = ctx.module(GradNorm)
    out = fit(ctx, m, max_steps=3)
    return {"grad_norm": {"norms": m.record.get("norms"), "params": out["params"]}}


@case(features=("validate", "test", "predict", "log_sync_dist", "all_gather"))
def evaluate(ctx: Ctx) -> dict:
    """fit, then validate, test and predict; ``self.log(sync_dist=True)`` and ``self.all_gather`` in the hooks."""
    m = ctx.module()
    tr = trainer(ctx, max_steps=2, limit_test_batches=2, limit_predict_batches=2)
    tr.fit(m)
    out: dict[str, Any] = {}
    synced = metrics(tr, "train_loss")
    val = tr.validate(m, verbose=False)
    out["validate"] = {"metrics": val, "params": params(m, ctx)}
    out["log_sync_dist"] = {**synced, **metrics(tr, "val_sync_mean")}
    gathered = m.record["all_gather"][-1]
    if ctx.kind == "one":  # what 2 ranks holding the same batch (tp, pp) each gather: the same losses twice
        gathered = torch.stack([gathered, gathered])
    out["all_gather"] = {"gathered": gathered}
    out["test"] = attempt(lambda: {"metrics": tr.test(m, verbose=False)}, ctx)
    out["predict"] = attempt(lambda: {"predictions": [p.double() for p in tr.predict(m)]}, ctx)
    return out


# ---------------------------------------------------------------------------------------------------- optimization
#: the zero_grad form of each manual step, in turn: before backward (set_to_none True, False), after the step
ZERO_GRAD_FORMS = ("before:set_to_none=True", "before:set_to_none=False", "after:opt.zero_grad()",
                   "after:opt.zero_grad()")  # fmt: skip


@case()
def manual_optimization(ctx: Ctx) -> dict:
    """Manual optimization with every zero_grad form (step 2 accumulates onto step 1's gradients: nothing zeroed them
    in between) and ``self.clip_gradients``."""

    class Manual(module_class()):
        def __init__(self, **kw: Any) -> None:
            super().__init__(**kw)
            self.automatic_optimization = False

        def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
            opt, sched = self.optimizers(), self.lr_schedulers()
            where, form = ZERO_GRAD_FORMS[batch_idx % len(ZERO_GRAD_FORMS)].split(":")
            if form != "opt.zero_grad()":
                opt.zero_grad(set_to_none=form.endswith("True"))
            loss = self.pipeline_loss(self(batch), batch)
            self.manual_backward(loss)
            self.clip_gradients(opt, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
            opt.step()
            sched.step()
            if where == "after":
                opt.zero_grad()
            return loss.detach()

    return {"manual_optimization": fit(ctx, ctx.module(Manual), max_steps=len(ZERO_GRAD_FORMS) + 1)}


@case()
def gradient_clipping_hook(ctx: Ctx) -> dict:
    """``configure_gradient_clipping`` overridden: by norm at 0.3 on even steps, by value at 0.01 on odd ones (the
    Trainer sets no gradient_clip_val: Lightning refuses a hook's value that differs from the Trainer's)."""
    pre_clip: list[float] = []

    class Clip(module_class()):
        def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
            grads = [full(p.grad) for p in self.parameters() if p.grad is not None]
            pre_clip.append(float(torch.stack([g.norm() for g in grads]).norm()) if grads else float("nan"))
            if self.global_step % 2 == 0:
                self.clip_gradients(optimizer, gradient_clip_val=0.3, gradient_clip_algorithm="norm")
            else:
                self.clip_gradients(optimizer, gradient_clip_val=0.01, gradient_clip_algorithm="value")

    out = fit(ctx, ctx.module(Clip), max_steps=4)
    return {"gradient_clipping_hook": {**out, "_pre_clip_norms": pre_clip}}  # "_": a fact of the run, not compared


@case(ddp="ddp_find_unused_parameters_true")  # plain "ddp" raises at the 2nd step on the probe's missing gradient
def unused_probe_adamw(ctx: Ctx) -> dict:
    """An auxiliary head training never calls (a probe used at evaluation) under AdamW with weight decay: its .grad
    stays None, so AdamW skips it (no decay either); the other parameters must match ddp bitwise."""
    m = ctx.module(probe=True, opt="adamw")
    tr = trainer(ctx, max_steps=4)
    tr.fit(m)
    grad_none = m.probe.weight.grad is None and m.probe.bias.grad is None
    val = tr.validate(m, verbose=False)
    return {"unused_probe_adamw": {"params": params(m, ctx), "probe_grad_is_none": grad_none, "validate": val}}


# ---------------------------------------------------------------------------------------------------- Trainer flags
@case()
def fast_dev_run(ctx: Ctx) -> dict:
    out = fit(ctx, fast_dev_run=2)
    return {"fast_dev_run": out}


@case()
def overfit_batches(ctx: Ctx) -> dict:
    return {"overfit_batches": fit(ctx, overfit_batches=2, max_steps=4)}


@case()
def limit_batches(ctx: Ctx) -> dict:
    m = ctx.module()
    losses: list[float] = []
    tr = trainer(ctx, losses=losses, max_epochs=2, limit_train_batches=3, limit_val_batches=2)
    tr.fit(m)
    return {"limit_batches": {"losses": losses, "params": params(m, ctx), "val": metrics(tr, "val_loss"),
                              "global_step": tr.global_step}}  # fmt: skip


@case()
def accumulate_grad_batches(ctx: Ctx) -> dict:
    return {"accumulate_grad_batches": fit(ctx, accumulate_grad_batches=2, max_steps=3)}


@case()
def detect_anomaly(ctx: Ctx) -> dict:
    return {"detect_anomaly": fit(ctx, detect_anomaly=True, max_steps=2)}


#: the actions both profilers must record (a pattern: "*" is the strategy's or the module's class name)
PROFILED = ("run_training_epoch", "run_training_batch", "[Strategy]*.training_step", "[LightningModule]*.optimizer_step")


def _profiled(names: list[str]) -> dict[str, int]:
    """How often each PROFILED action occurs in ``names`` (ddp, V17 and one process differ only in the class)."""
    import fnmatch

    return {action: sum(fnmatch.fnmatchcase(n, action.replace("[", "[[]")) for n in names) for action in PROFILED}


@case()
def profiler_simple(ctx: Ctx) -> dict:
    m = ctx.module()
    tr = trainer(ctx, profiler="simple", max_steps=3)
    tr.fit(m)
    names = [n for n, durations in tr.profiler.recorded_durations.items() for _ in durations]
    return {"profiler_simple": {"actions": _profiled(names), "params": params(m, ctx)}}


@case()
def profiler_advanced(ctx: Ctx) -> dict:
    """``profiler="advanced"`` is this profiler without a file; with one, its report (cleared at teardown) is read."""
    from lightning.pytorch.profilers import AdvancedProfiler

    m = ctx.module()
    mine = os.path.join(ctx.tmp, f"rank{os.environ.get('RANK', '0')}")  # each rank's own report
    tr = trainer(ctx, profiler=AdvancedProfiler(dirpath=mine, filename="advanced"), max_steps=3)
    tr.fit(m)
    lines = [line for f in sorted(Path(mine).iterdir()) for line in f.read_text().splitlines()]
    headers = [line[len("Profile stats for: ") :] for line in lines if line.startswith("Profile stats for: ")]
    names = [re.sub(r" rank: \d+$", "", h.strip()) for h in headers]  # distributed runs name the rank
    return {"profiler_advanced": {"actions": _profiled(names), "params": params(m, ctx)}}
