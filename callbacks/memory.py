"""``MemoryBuckets``: a Lightning adapter over :mod:`lightning_v17.trackers.memory`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_v17.config import OptimizerKind, Precision, V17ConfigError, ZeroPolicy
from lightning_v17.trackers.memory import (
    MeasuredBytes,
    bar_chart,
    measure_model_state,
    peak_rss_bytes,
    reset_peak_rss,
    rss_bytes,
)

__all__ = ["MemoryBuckets", "MemoryLayout"]


@dataclass(frozen=True)
class MemoryLayout:
    """How the model state is partitioned, as the planner needs it: what ZeRO shards, over how many ranks."""

    zero: ZeroPolicy
    dp: int
    tp: int = 1
    pp: int = 1


def _optimizer_kind(optimizer: Any) -> OptimizerKind | None:
    """The planner's kind of ``optimizer``, as the optimizer library answers it
    (:func:`lightning_v17.optim.factory.planner_kind_of`; None when unknown)."""
    from lightning_v17.optim.factory import planner_kind_of

    return planner_kind_of(optimizer)


def _unwrap_optimizer(optimizer: Any) -> Any:
    # LightningOptimizer / ZeRO wrappers keep the torch optimizer one level down
    for attr in ("_optimizer", "optimizer", "optim"):
        inner = getattr(optimizer, attr, None)
        if inner is not None and hasattr(inner, "param_groups") and inner is not optimizer:
            return _unwrap_optimizer(inner)
    return optimizer


def layout_of(strategy: Any) -> MemoryLayout | None:
    """The ZeRO stage and dp/tp/pp sizes of a strategy: V17Strategy, Lightning's DDP/FSDP/ModelParallel/single."""
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy, SingleDeviceStrategy

    world = int(getattr(strategy, "world_size", 1) or 1)
    parallel = getattr(strategy, "parallel", None)  # V17Strategy after setup: ask its ZeRO backend
    if parallel is not None:
        spec = strategy.mesh.spec
        # Every stage partitions over the dp_shard axis only; HSDP's dp_replicate axis holds full replicas.
        return MemoryLayout(zero=strategy.policy.zero, dp=parallel.zero.shard_size, tp=int(spec.tp), pp=int(spec.pp))
    if isinstance(strategy, ModelParallelStrategy):
        dp = int(getattr(strategy, "_data_parallel_size", 0) or 0) or world
        tp = int(getattr(strategy, "_tensor_parallel_size", 1) or 1)
        return MemoryLayout(zero=ZeroPolicy(stage=3), dp=dp, tp=tp)
    if isinstance(strategy, FSDPStrategy):
        return MemoryLayout(zero=ZeroPolicy(stage=3), dp=world)
    if isinstance(strategy, DDPStrategy):
        return MemoryLayout(zero=ZeroPolicy(stage=0), dp=world)
    if isinstance(strategy, SingleDeviceStrategy):
        return MemoryLayout(zero=ZeroPolicy(stage=0), dp=1)
    return None


class MemoryBuckets(Callback):
    """Per-rank memory buckets (params, grads, optimizer state, activation/workspace peak) next to the planner.

    Measured on each rank from real storage, deduplicated by storage (see
    :mod:`lightning_v17.trackers.memory`): params and grads and optimizer state in
    ``on_before_optimizer_step`` (gradients are complete and, from the second step on, the optimizer state exists);
    the activation/workspace peak per step (CUDA: max-allocated minus model state; CPU: RSS high-water mark minus
    the RSS at the step start, an estimate, documented in the tracker).

    Planned: ``lightning_v17.planner.memory.model_state_bytes_per_rank`` (ZeRO §3.1) with the model's parameter
    count (the global count; with PP the stage's own count), the strategy's ZeRO stage and dp/tp sizes (V17Strategy,
    or Lightning's DDP = stage 0, FSDP/ModelParallel = stage 3), bytes per element from the parameters' real dtype,
    and K from ``optimizer_bytes_per_param(kind, precision)`` where the optimizer library knows the kind
    (:func:`lightning_v17.optim.factory.planner_kind_of`: its own classes, torch's Adam/AdamW/Adafactor/SGD with
    momentum, bitsandbytes' Adam/Lion/momentum in 32 or 8 bits). Every one can be overridden.

    Logged: ``memory/{param,grad,optimizer,act_ws}_bytes`` and ``memory/{param,grad,optimizer}_planned_bytes``.
    At the end of fit rank 0 prints the seed-style bar chart of measured vs planned; ``measured``, ``planned`` and
    ``act_ws_peak_bytes`` keep the numbers.

    Args:
        every_n_steps: measure the model state every this many batches (plus the first measurable one).
        zero_stage: override the ZeRO stage used for the plan.
        dp: override the number of ranks ZeRO shards over.
        param_bytes: override bytes per parameter element.
        grad_bytes: override bytes per gradient element.
        optimizer_bytes: override K (optimizer-state bytes per parameter).
        print_chart: print the bar chart at the end of fit.
    """

    def __init__(
        self,
        every_n_steps: int = 50,
        zero_stage: int | None = None,
        dp: int | None = None,
        param_bytes: float | None = None,
        grad_bytes: float | None = None,
        optimizer_bytes: float | None = None,
        print_chart: bool = True,
    ) -> None:
        if not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise V17ConfigError(f"every_n_steps={every_n_steps!r} must be a positive integer")
        self.every_n_steps = every_n_steps
        self.overrides = {
            "zero": None if zero_stage is None else ZeroPolicy(stage=zero_stage),  # validates the stage
            "dp": dp,
            "param_bytes": param_bytes,
            "grad_bytes": grad_bytes,
            "optimizer_bytes": optimizer_bytes,
        }
        self.print_chart = print_chart
        self.measured: MeasuredBytes | None = None
        self.planned: Any = None  # planner ModelStateBytes, or None when it cannot be derived
        self.plan_note = ""
        self.act_ws_peak_bytes = 0
        self._batches = 0
        self._rss0 = 0
        self._cuda = False

    # -- plan ---------------------------------------------------------------------------------------------------
    def _plan(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from lightning_v17.planner.memory import model_state_bytes_per_rank, optimizer_bytes_per_param

        layout = layout_of(trainer.strategy)
        zero = self.overrides["zero"]
        dp = self.overrides["dp"]
        if layout is None and (zero is None or dp is None):
            self.plan_note = f"no plan: unknown strategy {type(trainer.strategy).__name__}; pass zero_stage= and dp="
            return
        zero = layout.zero if zero is None else zero
        dp = layout.dp if dp is None else dp
        tp = layout.tp if layout else 1
        pp = layout.pp if layout else 1
        params = [p for p in pl_module.parameters()]
        if not params:
            self.plan_note = "no plan: the module has no parameters"
            return
        # DTensor.numel() is the global (unsharded) count; with TP the planner divides by tp itself. With PP the module
        # holds one stage, so plan that stage alone (pp=1): stages need not be equal.
        num_params = sum(p.numel() for p in params)
        elem = params[0].element_size()
        pbytes = self.overrides["param_bytes"] or elem
        gbytes = self.overrides["grad_bytes"] or elem
        kbytes = self.overrides["optimizer_bytes"]
        if kbytes is None:
            optimizers = [_unwrap_optimizer(o) for o in trainer.optimizers]
            kinds = {_optimizer_kind(o) for o in optimizers}
            if len(kinds) != 1 or None in kinds:
                self.plan_note = (
                    f"no plan: optimizer(s) {[type(o).__name__ for o in optimizers]} not recognized; pass "
                    "optimizer_bytes="
                )
                return
            # fp32 working params are their own master copy (K = moments only); 16-bit params carry an fp32 master.
            precision = Precision.FP32 if elem == 4 else Precision.BF16_MIXED
            kbytes = optimizer_bytes_per_param(kinds.pop(), precision)
        self.planned = model_state_bytes_per_rank(
            num_params,
            zero=zero,
            dp=dp,
            tp=tp,
            pp=1,
            param_bytes=pbytes,
            grad_bytes=gbytes,
            optimizer_bytes=kbytes,
        )
        self.plan_note = (
            f"plan: model_state_bytes_per_rank({num_params}, zero_stage={zero.stage}, dp={dp}, tp={tp}, pp={pp} (stage "
            f"count), param_bytes={pbytes}, grad_bytes={gbytes}, optimizer_bytes={kbytes})"
        )

    # -- hooks --------------------------------------------------------------------------------------------------
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._cuda = trainer.strategy.root_device.type == "cuda"
        self._batches = 0
        self._plan(trainer, pl_module)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int):
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(trainer.strategy.root_device)
        else:
            reset_peak_rss()
            self._rss0 = rss_bytes()

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        # From the second step on the optimizer state exists; measure then and every every_n_steps batches.
        due = self.measured is None or self._batches % self.every_n_steps == 0
        if trainer.global_step >= 1 and due:
            self.measured = measure_model_state(pl_module, [_unwrap_optimizer(o) for o in trainer.optimizers])

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._batches += 1
        if self._cuda:
            state = self.measured.total if self.measured else 0
            act = torch.cuda.max_memory_allocated(trainer.strategy.root_device) - state
        else:
            peak = peak_rss_bytes()
            act = (peak - self._rss0) if peak is not None else 0
        if self._batches > 2:  # the first steps allocate grads and optimizer state: not activations
            self.act_ws_peak_bytes = max(self.act_ws_peak_bytes, int(act))
        if self.measured is not None and (self._batches % self.every_n_steps == 0 or self._batches == 3):
            m = self.measured
            metrics = {
                "memory/param_bytes": float(m.param),
                "memory/grad_bytes": float(m.grad),
                "memory/optimizer_bytes": float(m.optimizer),
                "memory/act_ws_bytes": float(self.act_ws_peak_bytes),
            }
            if self.planned is not None:
                metrics.update(
                    {
                        "memory/param_planned_bytes": float(self.planned.param),
                        "memory/grad_planned_bytes": float(self.planned.grad),
                        "memory/optimizer_planned_bytes": float(self.planned.optimizer),
                    }
                )
            pl_module.log_dict(metrics, on_step=True, on_epoch=False, rank_zero_only=True)

    def chart(self) -> str:
        """The measured-vs-planned bar chart of this rank."""
        if self.measured is None:
            return "memory buckets: nothing measured (fewer than 2 optimizer steps)"
        m, p = self.measured, self.planned
        rows = [
            ("param", m.param, p.param if p else None),
            ("grad", m.grad, p.grad if p else None),
            ("optimizer", m.optimizer, p.optimizer if p else None),
            ("act/ws", self.act_ws_peak_bytes, None),
        ]
        how = "CUDA max-allocated - model state" if self._cuda else "RSS high-water - step-start RSS (estimate)"
        return f"memory buckets per rank (act/ws: {how})\n{bar_chart(rows)}\n{self.plan_note}"

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.print_chart:
            rank_zero_info(self.chart())
