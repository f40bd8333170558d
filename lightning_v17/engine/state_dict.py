"""FQN-keyed model / optimizer state dicts for torch.distributed.checkpoint, the same layout at every ZeRO stage.

Stages 1/2 (:class:`lightning_v17.engine.zero.ZeroEngine`) describe their optimizer shards as ``DTensor``s with
FSDP2's ``Shard(0)`` placement, stage 3 is FSDP2 itself and stage 0 holds full tensors, so DCP saves each stage's
state under the same names and reshards it into any other stage, world size or mesh on load.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from lightning_v17.config import V17ConfigError

__all__ = [
    "get_model_state",
    "get_optimizer_state",
    "get_state_dicts",
    "merge_optim",
    "param_group_lists",
    "restore_param_group_lists",
    "set_state_dicts",
]


def _plain_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    return getattr(optimizer, "_optimizer", optimizer)  # unwrap LightningOptimizer


def get_model_state(module: nn.Module) -> dict[str, Any]:
    """FQN-keyed model state dict: plain full tensors (stages 0-2) or DTensor shards (stage 3)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=False))


def get_optimizer_state(module: nn.Module, optimizer: Any, *, stage: int) -> dict[str, Any]:
    """FQN-keyed optimizer state dict, initializing empty state (a zero-lr step, as torch's state_dict API does) so
    that DCP has tensors to load into."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        _init_optim_state,
        get_optimizer_state_dict,
    )

    opt = _plain_optimizer(optimizer)
    engine = getattr(opt, "_v17_zero", None)
    if engine is not None and stage in (1, 2):
        _init_optim_state(opt)
        return engine.optimizer_state_dict(opt)
    return get_optimizer_state_dict(module, opt, options=StateDictOptions(full_state_dict=False))


def merge_optim(states: list[dict[str, Any]]) -> dict[str, Any]:
    return states[0] if len(states) == 1 else {f"optimizer_{i}": s for i, s in enumerate(states)}


def get_state_dicts(module: nn.Module, optimizers: Iterable[Any], *, stage: int) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}`` ready for DCP; the same FQN layout for every stage (so it reshards).

    With several optimizers, ``"optim"`` is ``{"optimizer_0": ..., "optimizer_1": ...}``.
    """
    optimizers = list(optimizers)
    out: dict[str, Any] = {"model": get_model_state(module)}
    if optimizers:
        out["optim"] = merge_optim([get_optimizer_state(module, o, stage=stage) for o in optimizers])
    return out


def _optim_states(app_state: dict[str, Any]) -> list[dict[str, Any]]:
    optim = app_state.get("optim")
    if optim is None:
        return []
    return [optim] if "param_groups" in optim else [optim[k] for k in sorted(optim)]


def param_group_lists(app_state: dict[str, Any]) -> list[list[list[Any]]]:
    """The ``params`` list of every optimizer param group in ``app_state`` (for :func:`restore_param_group_lists`)."""
    return [[list(g["params"]) for g in osd["param_groups"]] for osd in _optim_states(app_state)]


def restore_param_group_lists(app_state: dict[str, Any], lists: list[list[list[Any]]]) -> None:
    """Put this rank's own ``params`` lists back into the param groups that ``dcp.load`` replaced.

    ``param_groups`` is a non-tensor entry: DCP saves one rank's copy and loads that copy on every rank. Under
    pipeline parallelism the saving ranks hold different parameters, so the copy lists another stage's FQNs; the
    hyperparameters (lr, betas, ...) are the same on every rank and are kept from the checkpoint.
    """
    for osd, own in zip(_optim_states(app_state), lists):
        groups = osd["param_groups"]
        if len(groups) != len(own):
            raise V17ConfigError(
                f"the checkpoint's optimizer has {len(groups)} param groups but configure_optimizers builds "
                f"{len(own)}; build the same param groups as the run that saved it"
            )
        osd["param_groups"] = [{**g, "params": params} for g, params in zip(groups, own)]


def set_state_dicts(module: nn.Module, optimizers: Iterable[Any], app_state: dict[str, Any], *, stage: int) -> None:
    """Load ``app_state`` (as filled in place by ``dcp.load``) into the module and optimizers."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=False)
    set_model_state_dict(module, app_state["model"], options=opts)
    optimizers = [_plain_optimizer(o) for o in optimizers]
    if not optimizers or "optim" not in app_state:
        return
    states = (
        [app_state["optim"]]
        if len(optimizers) == 1
        else [app_state["optim"][f"optimizer_{i}"] for i in range(len(optimizers))]
    )
    for opt, osd in zip(optimizers, states):
        engine = getattr(opt, "_v17_zero", None)
        if engine is not None and stage in (1, 2):
            engine.load_optimizer_state_dict(opt, osd)
        else:
            set_optimizer_state_dict(module, opt, osd, options=opts)
