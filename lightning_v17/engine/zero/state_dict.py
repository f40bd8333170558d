"""FQN-keyed model / optimizer state dicts for torch.distributed.checkpoint, the same layout at every ZeRO stage.

Stages 1/2 (:class:`lightning_v17.engine.zero.stages_0_2.ZeroEngine`) describe their optimizer shards as ``DTensor``s with
FSDP2's ``Shard(0)`` placement, stage 3 is FSDP2 itself and stage 0 holds full tensors, so DCP saves each stage's
state under the same names and reshards it into any other stage, world size or mesh on load.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from torch import nn

from lightning_v17.config import V17ConfigError

if TYPE_CHECKING:
    from lightning_v17.engine.zero.backend import ZeroBackend

__all__ = [
    "get_model_state",
    "get_state_dicts",
    "merge_optim",
    "param_group_lists",
    "restore_param_group_lists",
    "set_state_dicts",
]


def get_model_state(module: nn.Module) -> dict[str, Any]:
    """FQN-keyed model state dict: plain full tensors (stages 0-2) or DTensor shards (stage 3)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=False))


def merge_optim(states: list[dict[str, Any]]) -> dict[str, Any]:
    return states[0] if len(states) == 1 else {f"optimizer_{i}": s for i, s in enumerate(states)}


def get_state_dicts(module: nn.Module, optimizers: Iterable[Any], *, backend: ZeroBackend) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}`` ready for DCP; the same FQN layout for every stage (so it reshards).

    Args:
        module: the (sharded) model.
        optimizers: its optimizers (LightningOptimizer wrappers are unwrapped).
        backend: the applied ZeRO stage, which knows how its optimizer state is laid out.

    With several optimizers, ``"optim"`` is ``{"optimizer_0": ..., "optimizer_1": ...}``.
    """
    optimizers = list(optimizers)
    out: dict[str, Any] = {"model": get_model_state(module)}
    if optimizers:
        out["optim"] = merge_optim([backend.optimizer_state_dict(o) for o in optimizers])
    return out


def _optim_states(app_state: dict[str, Any]) -> list[dict[str, Any]]:
    optim = app_state.get("optim")
    if optim is None:
        return []
    return [optim] if "param_groups" in optim else [optim[k] for k in sorted(optim)]


def param_group_lists(app_state: dict[str, Any]) -> list[list[list[Any]]]:
    """The ``params`` list of every optimizer param group in ``app_state`` (for :func:`restore_param_group_lists`)."""
    return [[list(g["params"]) for g in osd["param_groups"]] for osd in _optim_states(app_state)]


def drop_unsaved_optimizer_entries(app_state: dict[str, Any], optim_dir: Any) -> None:
    """Leave out of the load template what the checkpoint's DCP directory ``optim_dir`` does not have, so that
    the optimizers come back as ``Optimizer.load_state_dict`` would give them under DDP:

    * param-group entries the save had not: an LR scheduler built after the save adds ``initial_lr`` to every group
      (Lightning's ``lr_find`` saves, swaps in its own scheduler, then restores);
    * the state of a parameter the saved optimizer never stepped (its gradient was always None, as for a probe head
      that training does not call): the template gives every parameter state (``init_optimizer_state``), the save
      has none for it, and it stays without one. A parameter with *some* saved entries is loaded strictly.
    """
    optim = app_state.get("optim")
    if optim is None:
        return
    import torch.distributed.checkpoint as dcp

    saved = set(dcp.FileSystemReader(optim_dir).read_metadata().state_dict_metadata)  # the flattened keys
    named = {"": optim} if "param_groups" in optim else {f"{k}.": optim[k] for k in optim}
    for prefix, osd in named.items():
        for i, group in enumerate(osd["param_groups"]):
            for key in [k for k in group if k != "params" and f"{prefix}param_groups.{i}.{k}" not in saved]:
                del group[key]
        head = f"{prefix}state."
        stepped = {key[len(head) :].rsplit(".", 1)[0] for key in saved if key.startswith(head)}  # <fqn>.<entry>
        for fqn in [f for f in osd["state"] if f not in stepped]:
            del osd["state"][fqn]


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


def set_state_dicts(
    module: nn.Module, optimizers: Iterable[Any], app_state: dict[str, Any], *, backend: ZeroBackend
) -> None:
    """Load ``app_state`` (as filled in place by ``dcp.load``) into the module and optimizers."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(module, app_state["model"], options=StateDictOptions(full_state_dict=False))
    optimizers = list(optimizers)
    if not optimizers or "optim" not in app_state:
        return
    states = (
        [app_state["optim"]]
        if len(optimizers) == 1
        else [app_state["optim"][f"optimizer_{i}"] for i in range(len(optimizers))]
    )
    for opt, osd in zip(optimizers, states):
        backend.load_optimizer_state_dict(opt, osd)
