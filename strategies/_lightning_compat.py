"""What Lightning's own callbacks and utilities assume of a strategy, made true under V17Strategy, or refused at setup.

* ``lightning.pytorch.utilities.grad_norm`` reads ``p.grad`` of every parameter. At ZeRO-2 no parameter keeps its
  whole gradient (each rank keeps its rows, on the optimizer's shard), and under ZeRO-3 or tensor parallelism the
  gradients are DTensors, which ``torch.tensor(list_of_norms)`` cannot read. It is made to report what it reports
  under DDP: the norms of the whole gradients (:func:`lightning_v17.engine.zero.grad_norms.grad_norms`), for a module
  that V17Strategy set up, and is left as it is for every other module.
* ``LightningOptimizer`` (what ``self.optimizers()`` returns) resolves ``zero_grad`` and ``add_param_group`` on the
  optimizer's class, so what the ZeRO engine set on the optimizer itself (clearing the full gradients too; partitioning
  an added group) is copied onto it.
* ``StochasticWeightAveraging`` deep-copies the module before setup and copies the live parameters into that copy:
  with sharded parameters (ZeRO-3, tensor, pipeline or expert parallelism) that copy is of DTensors into whole tensors, which
  fails mid-run; it is refused at setup, as Lightning refuses it for FSDP and DeepSpeed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_v17.config import V17ConfigError
from lightning_v17.engine.state import optimizer_state, state_of

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["check_callbacks", "install_filter_on_optimizer", "install_grad_norm", "share_optimizer_overrides"]


def _v17_grad_norm(module: Any, norm_type: float | str, group_separator: str = "/") -> dict[str, Any]:
    """Lightning's ``grad_norm`` with V17's whole-gradient norms (same keys, same total)."""
    import torch

    parallel = state_of(module).parallel
    if parallel is None or not parallel.zero.active:
        return _ORIGINAL[0](module, norm_type, group_separator)
    norm_type = float(norm_type)
    if norm_type <= 0:
        raise ValueError(f"`norm_type` must be a positive number or 'inf' (infinity norm). Got {norm_type}")
    from lightning_v17.engine.zero.grad_norms import grad_norms

    per_param = grad_norms(module, parallel.zero, norm_type)
    if parallel.pipeline is not None:  # each stage holds its part: every stage's norms, in the model's order
        import torch.distributed as dist

        group = module._device_mesh["pp"].get_group()
        parts: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, {n: float(v) for n, v in per_param.items()}, group=group)
        per_param = {n: torch.tensor(v) for part in parts for n, v in part.items()}
    norms = {f"grad_{norm_type}_norm{group_separator}{name}": v for name, v in per_param.items()}
    if norms:
        norms[f"grad_{norm_type}_norm_total"] = torch.stack(list(norms.values())).norm(norm_type)
    return norms


def _shim(module, norm_type, group_separator="/"):
    return _v17_grad_norm(module, norm_type, group_separator)  # looked up in grad_norm's own module globals


_ORIGINAL: list[Any] = []


def install_grad_norm() -> None:
    """Give ``lightning.pytorch.utilities.grad_norm`` V17's norms (idempotent). Its *code* is swapped, not the module
    attribute: a LightningModule imported it by name (``from lightning.pytorch.utilities import grad_norm``) before
    any strategy existed, so only the function object it holds can be reached. The swapped code calls the original
    for any module V17Strategy did not set up."""
    import types

    from lightning.pytorch.utilities import grads

    fn = grads.grad_norm
    if _ORIGINAL:
        return
    _ORIGINAL.append(types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__))
    fn.__globals__["_v17_grad_norm"] = _v17_grad_norm
    fn.__code__ = _shim.__code__


def _filter_on_optimizer(optimizer: Any, params: Any) -> list:
    """``BaseFinetuning.filter_on_optimizer`` by identity for an optimizer V17 prepared: Lightning's compares every
    parameter's *values* with every held one (``torch.equal``), which DTensors of other shapes or meshes cannot do
    (ZeRO-3, tp: it raised), and what the optimizer holds at ZeRO-1/2 are this rank's shards of the parameters
    (:class:`~lightning_v17.engine.zero.layout.ShardParameter`, which stand for their parameter)."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_warn

    from lightning_v17.optim.local_step import has_dtensor_params

    groups = optimizer.param_groups
    if optimizer_state(optimizer).zero is None and not has_dtensor_params(groups):
        return _ORIGINAL_FILTER[0](optimizer, params)
    held = {id(getattr(p, "_v17_param", p)) for g in groups for p in g["params"]}
    out, removed = [], []
    for param in params:
        (removed if id(param) in held else out).append(param)
    if removed:
        rank_zero_warn(
            "The provided params to be frozen already exist within another group of this optimizer. Those parameters "
            f"will be skipped.\nHINT: Did you init your optimizer in `configure_optimizer` as such:\n "
            f"{type(optimizer)}(filter(lambda p: p.requires_grad, self.parameters()), ...) "
        )  # Lightning's own warning
    return out


_ORIGINAL_FILTER: list[Any] = []


def install_filter_on_optimizer() -> None:
    """Give ``BaseFinetuning`` :func:`_filter_on_optimizer` (idempotent; other optimizers keep Lightning's)."""
    from lightning.pytorch.callbacks import BaseFinetuning

    if not _ORIGINAL_FILTER:
        _ORIGINAL_FILTER.append(BaseFinetuning.filter_on_optimizer)
        BaseFinetuning.filter_on_optimizer = staticmethod(_filter_on_optimizer)


def share_optimizer_overrides(strategy: Any) -> None:
    """Copy what the engine set on each optimizer (``zero_grad``, ``add_param_group``) onto its LightningOptimizer,
    which would otherwise run the class's methods on the engine's shards only."""
    for lightning_opt in getattr(strategy, "_lightning_optimizers", []):
        own = vars(lightning_opt._optimizer)
        for name in ("zero_grad", "add_param_group"):
            if name in own:
                setattr(lightning_opt, name, own[name])


def check_callbacks(strategy: Any, trainer: pl.Trainer) -> None:
    """Refuse at setup what would fail or count wrong mid-run, and make ``grad_norm`` report the whole gradients
    (module docstring)."""
    from lightning.pytorch.callbacks import (
        BackboneFinetuning,
        BaseFinetuning,
        ModelSummary,
        StochasticWeightAveraging,
        ThroughputMonitor,
        WeightAveraging,
    )

    install_grad_norm()
    install_filter_on_optimizer()
    spec, zero = strategy.mesh.spec, strategy.policy.zero
    callbacks = trainer.callbacks
    averaging = [type(c).__name__ for c in callbacks if isinstance(c, (StochasticWeightAveraging, WeightAveraging))]
    sharded = [f"zero_stage={zero.stage}"] if zero.shards_params else []
    sharded += [f"{axis}={getattr(spec, axis)}" for axis in ("tp", "pp", "ep") if getattr(spec, axis) > 1]
    if averaging and sharded:
        raise V17ConfigError(
            f"{averaging[0]} keeps a whole copy of the module, taken before setup, and copies the live parameters "
            f"into it; with {', '.join(sharded)} those parameters are sharded (DTensors, or another stage's), which "
            "that copy cannot take (Lightning refuses it for FSDP and DeepSpeed too). Use it with "
            "V17Strategy(zero_stage=0|1|2) and tp=pp=ep=1, or average the weights yourself (e.g. "
            "torch.optim.swa_utils.AveragedModel over the sharded module, built in configure_model)"
        )
    dp = spec.dp
    if dp < strategy.world_size and any(type(c) is ThroughputMonitor for c in callbacks):
        raise V17ConfigError(
            f"Lightning's ThroughputMonitor counts every one of the {strategy.world_size} ranks as a data-parallel "
            f"rank (trainer.world_size), but only {dp} are here (the others are tp/pp/cp ranks of the same rows): it "
            "would report the samples and tokens per second several times over. Use "
            "lightning_v17.callbacks.ThroughputMonitor, which counts the data-parallel ranks of the mesh"
        )
    own = [type(c).__name__ for c in callbacks if isinstance(c, BaseFinetuning) and type(c) is not BackboneFinetuning]
    if spec.pp > 1 and own:
        raise V17ConfigError(
            f"{own[0]} (a BaseFinetuning subclass) with pp={spec.pp}: each pipeline stage holds only its part of the "
            "model, and the modules of the other stages are None there, so a callback that freezes or unfreezes a "
            "module by name fails on the stages without it, after the first epoch. BackboneFinetuning (whose "
            "backbone every stage has a part of) works with pp; or finetune with pp=1"
        )
    if trainer._detect_anomaly and spec.tp > 1:
        raise V17ConfigError(
            f"Trainer(detect_anomaly=True) with tp={spec.tp}: torch's anomaly mode checks every backward output with "
            "aten._is_any_true, for which DTensor (tensor parallelism) has no sharding rule: backward would fail. "
            "Look for the NaN with tp=1 (detect_anomaly works at every ZeRO stage)"
        )
    if trainer._detect_anomaly and spec.pp > 1:
        raise V17ConfigError(
            f"Trainer(detect_anomaly=True) with pp={spec.pp}: at the first step torch.distributed.pipelining infers "
            "the shapes of the backward with one backward pass over uninitialized tensors, which anomaly mode may "
            "flag as NaN (it does, now and then), ending the run. Look for the NaN with pp=1 (detect_anomaly works "
            "at every ZeRO stage)"
        )
    if spec.pp > 1 and any(isinstance(c, ModelSummary) for c in callbacks):
        from lightning.pytorch.utilities.rank_zero import rank_zero_warn

        rank_zero_warn(
            f"ModelSummary with pp={spec.pp} lists the layers rank 0 holds, pipeline stage 0's, not the whole "
            "model; `v17 plan` gives the whole model's parameter count"
        )
