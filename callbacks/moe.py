"""``ExpertLoadMonitor``: a Lightning adapter over :mod:`lightning_v17.trackers.moe` (per-expert load of MoE layers)."""

from __future__ import annotations

import re
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_v17.config import V17ConfigError
from lightning_v17.trackers.moe import ExpertLoadReport, ExpertLoadTracker

__all__ = ["ExpertLoadMonitor", "RouterCollapseError", "RouterCollapseWarning"]


class RouterCollapseError(RuntimeError):
    """Raised on every rank by ``ExpertLoadMonitor(raise_on_collapse=True)`` when a layer's router has collapsed.

    Attributes:
        report: the :class:`~lightning_v17.trackers.moe.ExpertLoadReport` of the check that found it.
    """

    def __init__(self, message: str, report: ExpertLoadReport) -> None:
        super().__init__(message)
        self.report = report


class RouterCollapseWarning(UserWarning):
    """Warned by rank 0 (once per layer) when a layer's router has collapsed onto one expert."""


def _natural_key(name: str) -> tuple[Any, ...]:
    """``layers.2`` before ``layers.10``: digit runs compare as numbers (``re.split`` puts them at odd positions)."""
    return tuple(int(p) if i % 2 else p for i, p in enumerate(re.split(r"(\d+)", name)))


def _moe_modules(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of every module that exposes a per-expert ``last_load`` and ``num_experts`` (duck typing: the
    reference model's MoE, or any model's layer that sets them)."""
    return [(n, m) for n, m in module.named_modules() if hasattr(m, "last_load") and hasattr(m, "num_experts")]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # a replicated DTensor's local piece is the whole count


class ExpertLoadMonitor(Callback):
    """Logs the per-expert load of every mixture-of-experts layer and reports a collapsed router.

    MoE layers are found by duck typing: any module with a ``last_load`` ([E] assignments routed to each expert by
    its last forward, after capacity dropping), ``num_experts`` and, optionally, ``last_dropped`` (assignments the
    capacity limit dropped) and ``experts_per_token`` (k; 1 when absent). A forward hook adds each training forward's
    counts into a per-step accumulator, so an optimizer step counts all of its micro-batches (gradient accumulation,
    pipeline micro-batches); a forward recomputed by activation checkpointing (it runs inside backward) and
    evaluation forwards are not counted. A skipped optimizer step (fp16 overflow) carries its counts into the next.

    Every ``every_n_steps`` optimizer steps the counts of all layers, stacked in one [layers, E + 1] tensor, are summed
    over the world in ONE all-reduce; every rank then holds the global batch's counts and computes the same
    :class:`~lightning_v17.trackers.moe.ExpertLoadReport` (definitions and citations in that module). The layer
    table is gathered once at the start of training, so a pipeline stage contributes its own layers and a rank with
    none still joins the collective; under ``V17Strategy`` the tensor-parallel ranks route the same tokens, so the
    sum is divided by ``tp``. Layer i is the i-th MoE module in the natural order of the module names
    (``layers.2`` before ``layers.10``: the model's order for a decoder).

    Logged with ``pl_module.log_dict`` on every rank (the same values, so no sync; they can be monitored), at a step
    the trainer's logger writes when ``every_n_steps`` is a multiple of ``log_every_n_steps``: ``moe/imbalance_max``,
    ``moe/imbalance_mean`` (max load / mean load, 1.0 is balanced), ``moe/cv_max``, ``moe/cv_mean`` (coefficient of
    variation), ``moe/idle_frac_max``, ``moe/idle_frac_mean`` (experts with no assignment), ``moe/top_share_max``,
    ``moe/dropped``, ``moe/dropped_frac``, and per layer ``moe/layer{i}/imbalance|cv|idle_frac|top_share|dropped|
    dropped_frac``. The last report is kept as ``last``.

    A layer whose busiest expert takes more than ``collapse_fraction`` of its tokens (``top_share``; a token's k
    assignments go to k distinct experts, so this is k times the expert's share of the assignments) in ``patience``
    consecutive checks is reported once: rank 0 warns :class:`RouterCollapseWarning` naming the layer, the expert and
    its share; with ``raise_on_collapse`` every rank raises :class:`RouterCollapseError` (the decision is taken from
    the same summed counts everywhere, so no rank is left waiting in a collective).

    Args:
        every_n_steps: check (all-reduce, log, collapse rule) every n optimizer steps, >= 1; None: the trainer's
            ``log_every_n_steps``.
        collapse_fraction: the token share of one expert above which a check of a layer counts as collapsed, in
            (0, 1).
        patience: consecutive collapsed checks before a layer is reported, >= 1.
        raise_on_collapse: raise :class:`RouterCollapseError` instead of warning.
        per_layer: log the ``moe/layer{i}/...`` keys too (six per layer), not only the aggregates.
    """

    def __init__(self, every_n_steps: int | None = None, collapse_fraction: float = 0.5, patience: int = 3,
                 raise_on_collapse: bool = False, per_layer: bool = True) -> None:  # fmt: skip
        if every_n_steps is not None and (isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int)
                                          or every_n_steps < 1):  # fmt: skip
            raise V17ConfigError(
                f"ExpertLoadMonitor(every_n_steps={every_n_steps!r}): give an integer >= 1, or None for the "
                "trainer's log_every_n_steps"
            )
        for option, value in (("raise_on_collapse", raise_on_collapse), ("per_layer", per_layer)):
            if not isinstance(value, bool):
                raise V17ConfigError(f"ExpertLoadMonitor({option}={value!r}): give True or False")
        try:
            self.tracker = ExpertLoadTracker(collapse_fraction=collapse_fraction, patience=patience)
        except V17ConfigError as err:
            raise V17ConfigError(f"ExpertLoadMonitor: {err}") from err
        self.every_n_steps = every_n_steps
        self.raise_on_collapse = raise_on_collapse
        self.per_layer = per_layer
        #: the report of the last check (every rank holds the same one); None before the first
        self.last: ExpertLoadReport | None = None
        self._table: list[tuple[str, int, int]] = []  # (name, num_experts, experts_per_token) of every layer
        self._acc: torch.Tensor | None = None  # [layers, max E + 1] counts since the last step; last column: dropped
        self._hooks: list[Any] = []
        self._replicas = 1
        self._seen_step = 0

    # ------------------------------------------------------------------------------------------------ set-up

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._remove_hooks()
        mine = _moe_modules(pl_module)
        local = [(n, int(m.num_experts), int(getattr(m, "experts_per_token", 1) or 1)) for n, m in mine]
        every_rank = [local]
        if self._world() > 1:  # once per fit: under pipeline parallelism each stage holds its own layers
            every_rank = [None] * dist.get_world_size()
            dist.all_gather_object(every_rank, local)
        layers: dict[str, tuple[int, int]] = {}
        for name, e, k in (row for rows in every_rank for row in rows):
            if layers.setdefault(name, (e, k)) != (e, k):
                raise RuntimeError(f"ExpertLoadMonitor: ranks disagree on {name}: {layers[name]} vs {(e, k)} "
                                   "(num_experts, experts_per_token); every rank must build the same model")  # fmt: skip
        self._table = [(n, *layers[n]) for n in sorted(layers, key=_natural_key)]
        self._seen_step = trainer.global_step
        if not self._table:
            rank_zero_warn("ExpertLoadMonitor found no MoE layer (a module with `last_load` and `num_experts`) in "
                           f"{type(pl_module).__name__}; it logs nothing. Remove it, or expose those attributes")  # fmt: skip
            return
        if self.every_n_steps is None and trainer.log_every_n_steps == 0:
            rank_zero_warn("ExpertLoadMonitor(every_n_steps=None) follows Trainer(log_every_n_steps=0), which turns "
                           "logging off: it checks nothing. Give it every_n_steps to check the routers anyway")  # fmt: skip
        frac = self.tracker.collapse_fraction
        balanced = [(n, k / e) for n, e, k in self._table if frac <= k / e]
        if balanced:  # under perfect balance every expert already gets k/E of the tokens
            name, share = balanced[0]
            rank_zero_warn(f"ExpertLoadMonitor(collapse_fraction={frac}) cannot tell a collapse from balance in "
                           f"{len(balanced)} MoE layer(s), e.g. {name}: a balanced router already sends each expert "
                           f"k/E = {share:.0%} of the tokens. Choose collapse_fraction between k/E and 1")  # fmt: skip
        spec = getattr(getattr(trainer.strategy, "mesh", None), "spec", None)
        self._replicas = int(getattr(spec, "tp", 1) or 1)  # V17: tp ranks route the same (replicated) tokens
        device = trainer.strategy.root_device
        dtype = torch.float32 if device.type == "mps" else torch.float64  # counts exact beyond fp32's 2**24
        width = max(e for _, e, _ in self._table) + 1
        self._acc = torch.zeros(len(self._table), width, dtype=dtype, device=device)
        row_of = {name: i for i, (name, _, _) in enumerate(self._table)}
        for name, module in mine:
            self._hooks.append(module.register_forward_hook(self._counter(row_of[name], int(module.num_experts))))

    def _counter(self, row: int, num_experts: int):
        def count(module: torch.nn.Module, args: Any, output: Any) -> None:
            # torch runs a recomputed (activation-checkpointed) forward inside backward's graph task: its tokens were
            # counted by the original forward already
            if not module.training or torch._C._current_graph_task_id() != -1 or self._acc is None:
                return
            with torch.no_grad():
                load = _local(module.last_load).detach().reshape(-1)
                self._acc[row, :num_experts] += load.to(self._acc.device, self._acc.dtype)
                dropped = getattr(module, "last_dropped", None)
                if dropped is not None:
                    self._acc[row, -1] += _local(torch.as_tensor(dropped)).detach().to(self._acc.device,
                                                                                      self._acc.dtype)  # fmt: skip

        return count

    # ---------------------------------------------------------------------------------------------- per step

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:  # fmt: skip
        if self._acc is None or trainer.global_step == self._seen_step:
            return  # no MoE layer, or a micro-batch of gradient accumulation (or a skipped step): keep counting
        self._seen_step = trainer.global_step
        every = self.every_n_steps or trainer.log_every_n_steps
        if every and trainer.global_step % every == 0:  # the step Lightning's logger writes (its `+ 1` included)
            self._check(trainer, pl_module)
        self._acc.zero_()

    def _check(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert self._acc is not None
        counts = self._acc
        if self._world() > 1:
            dist.all_reduce(counts)  # SUM: the only collective of a check
        if self._replicas > 1:
            counts = counts / self._replicas
        rows = counts.tolist()
        self.last = report = self.tracker.observe(
            [row[:e] for row, (_, e, _) in zip(rows, self._table)], [row[-1] for row in rows],
            experts_per_token=[k for _, _, k in self._table], names=[n for n, _, _ in self._table],
        )  # fmt: skip
        pl_module.log_dict(report.metrics(per_layer=self.per_layer), on_step=True, on_epoch=False, batch_size=1)
        if not report.collapsed:
            return
        msgs = [
            f"ExpertLoadMonitor: the router of MoE layer {ev.index} ({ev.name or 'the root module'}) has collapsed: "
            f"expert {ev.expert} received {ev.share:.0%} of its tokens (more than collapse_fraction="
            f"{self.tracker.collapse_fraction}) in {ev.checks} consecutive checks up to step {trainer.global_step}. "
            "Raise the balance loss (aux_loss_coef) or the aux-loss-free bias speed (expert_bias_rate), or lower the "
            "learning rate"
            for ev in report.collapsed
        ]  # fmt: skip
        if self.raise_on_collapse:
            raise RouterCollapseError("\n".join(msgs), report)
        if trainer.is_global_zero:
            for msg in msgs:
                warnings.warn(msg, RouterCollapseWarning, stacklevel=2)

    # --------------------------------------------------------------------------------------------- tear-down

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._remove_hooks()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._remove_hooks()

    def _remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks, self._acc = [], None

    def state_dict(self) -> dict[str, Any]:
        """The collapse streaks and the reported layers, so a resumed run neither restarts nor repeats a report."""
        return self.tracker.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.tracker.load_state_dict(state_dict)

    @staticmethod
    def _world() -> int:
        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
