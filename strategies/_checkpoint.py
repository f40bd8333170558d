"""V17Strategy's sharded checkpoints: every rank writes its shards (DCP, ``checkpoint/sharded.py``), and a checkpoint
loads into any ZeRO stage, world size or mesh (reshard on load). :class:`ShardedCheckpoints` holds Lightning's
checkpoint hooks, mixed into V17Strategy as ``_collectives.WorldCollectives`` holds its collectives."""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch.optim import Optimizer
from typing_extensions import override

from lightning_v17.config import AXIS_ORDER, V17ConfigError
from lightning_v17.engine.zero import state_dict as state_engine

if TYPE_CHECKING:
    from lightning_v17.strategies.v17 import V17Strategy


class ShardedCheckpoints:
    """Mixed into V17Strategy ahead of ``ParallelStrategy``: Lightning's checkpoint hooks, as sharded DCP directories."""

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # sharded states load into the already sharded model and optimizers

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint restores the optimizers itself

    @override
    def lightning_module_state_dict(self: Any) -> dict[str, Any]:
        """FQN-keyed model state: full plain tensors (stages 0-2) or DTensor shards (stage 3), for DCP."""
        return state_engine.get_model_state(self.model)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # load_checkpoint already loaded the sharded states in place

    @override
    def optimizer_state(self: Any, optimizer: Optimizer) -> dict[str, Any]:
        """FQN-keyed optimizer state with DTensor shards (stages 1-3) or full tensors (stage 0)."""
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        return self.zero.optimizer_state_dict(optimizer)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # load_checkpoint already loaded the sharded states in place

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Write a sharded checkpoint directory (every rank writes its shards; see checkpoint/sharded.py)."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint(storage_options=...) is not supported")
        save(self, checkpoint, filepath)

    @override
    def load_checkpoint(self: Any, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a sharded checkpoint into the sharded model/optimizers in place (any saved stage or world size)."""
        out, info = load(self, checkpoint_path, weights_only=weights_only)
        if info.get("writer") == "fabric":
            out = trainer_state_from_fabric(out)
        if self._parallel is not None and self._parallel.fp8 is not None:
            self._parallel.fp8.refresh_weight_scales()  # the loaded weights' float8 scales (none may be stale)
        return out

    @override
    def remove_checkpoint(self: Any, filepath: Any) -> None:
        if self.is_global_zero:
            remove(filepath)


def meta(strategy: Any, checkpoint: dict[str, Any]) -> dict[str, Any]:
    """What the checkpoint's ``meta.json`` records about the run that wrote it."""
    import lightning

    spec = strategy.mesh.spec
    return {
        "world_size": strategy.world_size,
        "mesh": {a.value: spec.size(a) for a in AXIS_ORDER},
        "zero_stage": strategy.zero.stage,
        "step": checkpoint.get("global_step"),
        "epoch": checkpoint.get("epoch"),
        "versions": {"torch": torch.__version__, "lightning": lightning.__version__},
    }


def save(
    strategy: Any, checkpoint: dict[str, Any], filepath: Any, *, fabric_keys: dict[str, Any] | None = None,
    saver: Any = None,
) -> None:  # fmt: skip
    """Write a sharded checkpoint directory; the model and optimizer states leave ``checkpoint`` for the shards.

    The Trainer's and Fabric's saves write the same layout: ``checkpoint["state_dict"]`` is the model component,
    ``checkpoint["optimizer_states"]`` the optimizer component (one optimizer as it is, several as ``optimizer_<i>``),
    the rest the trainer state. ``fabric_keys`` (a Fabric save) records which of the user's keys held the model and
    the optimizers, in ``meta.json``. With ``saver`` (an :class:`~lightning_v17.checkpoint.async_save.
    AsyncShardedSaver` with nothing in flight) the state is staged and written in the background; the saver
    publishes it."""
    from lightning_v17.checkpoint.sharded import save_sharded

    path = Path(strategy.broadcast(filepath))
    app_state: dict[str, Any] = {"model": checkpoint.pop("state_dict")}
    optim_states = checkpoint.pop("optimizer_states", [])
    if optim_states:
        app_state["optim"] = state_engine.merge_optim(optim_states)
    info = meta(strategy, checkpoint)
    info["writer"] = "trainer" if fabric_keys is None else "fabric"
    if fabric_keys is not None:
        info["fabric_keys"] = fabric_keys
    if saver is not None:
        saver.start(path, app_state=app_state, trainer_state=checkpoint, meta=info)
    else:
        save_sharded(path, app_state=app_state, trainer_state=checkpoint, meta=info)


def load(
    strategy: Any, checkpoint_path: Any, *, weights_only: bool | None = None, model: Any = None,
    optimizers: list[Optimizer] | None = None, option: str = "ckpt_path",
) -> tuple[dict[str, Any], dict[str, Any]]:  # fmt: skip
    """Load a sharded checkpoint into the sharded model and optimizers in place; returns ``(trainer state, meta)``.

    ``model``/``optimizers``: what to load into (Fabric's ``state``); None: the strategy's own (the Trainer's).
    ``option`` names the argument the path came from in the messages (``ckpt_path``, ``fabric.load(path=...)``).

    ``weights_only`` is what Lightning passes to ``Strategy.load_checkpoint``: ``None`` or ``True`` unpickle the
    trainer state and DCP's pickles safely (torch's default since 2.6; a checkpoint holding other objects is refused
    with ``UnsafeCheckpointError`` before anything is loaded), ``False`` trusts the checkpoint fully. Lightning 2.6.6
    passes ``None`` here whatever ``trainer.fit(weights_only=...)`` said (see the note below).
    """
    from lightning_v17.checkpoint.sharded import UnsafeCheckpointError, is_sharded_checkpoint, load_sharded

    path = Path(strategy.broadcast(checkpoint_path))
    fabric = model is not None
    if not path.exists():
        raise V17ConfigError(
            f"{option}={str(path)!r} does not exist; give the checkpoint directory (AsyncCheckpoint writes "
            "<dirpath>/step-NNNNNNNN and a 'latest' pointer; ckpt_path='last' resumes from the newest)"
        )
    if not is_sharded_checkpoint(path) and _is_deepspeed(path):
        if fabric:
            raise V17ConfigError(f"{option}={str(path)!r} is a DeepSpeed checkpoint, which V17FabricStrategy does not "
                                 "read yet; resume it with Trainer(strategy=V17Strategy(...)), which does")  # fmt: skip
        return load_deepspeed(strategy, path, weights_only=weights_only), {"writer": "deepspeed"}
    if not is_sharded_checkpoint(path):
        raise V17ConfigError(
            f"{option}={str(path)!r} is not a V17 sharded checkpoint directory; V17Strategy resumes from the "
            "directories it writes and from DeepSpeed's (a save_dir holding 'latest', or a global_stepN directory); "
            "convert a full checkpoint by loading it into the module before fit"
        )
    model = strategy.model if model is None else model
    optimizers = strategy.optimizers if optimizers is None else optimizers
    assert model is not None
    app_state = state_engine.get_state_dicts(model, optimizers, backend=strategy.zero)
    own_groups = state_engine.param_group_lists(app_state)
    state_engine.drop_unsaved_optimizer_entries(app_state, path / "optim")  # as Optimizer.load_state_dict gives them
    try:
        trainer_state, info = load_sharded(path, app_state=app_state, weights_only=weights_only)
    except UnsafeCheckpointError as err:
        if weights_only is not None or fabric:
            raise
        # Lightning 2.6 forwards trainer.fit(weights_only=...) only to strategies that restore BEFORE setup
        # (Trainer._run calls _restore_modules_and_callbacks(ckpt_path) without it after setup), and V17Strategy
        # restores after setup: a None here may be the user's False, dropped. Name the fix that reaches us.
        raise UnsafeCheckpointError(
            f"{err}. Note for V17Strategy: Lightning {_lightning_version()} does not pass trainer.fit's weights_only "
            "on to strategies that restore the checkpoint after setup, as V17Strategy does, so allow-list the types "
            "with torch.serialization.add_safe_globals([...]) before trainer.fit"
        ) from err.__cause__
    # A checkpoint from another pipeline split lists other stages' FQNs in its param groups: keep our own.
    state_engine.restore_param_group_lists(app_state, own_groups)
    state_engine.set_state_dicts(model, optimizers, app_state, backend=strategy.zero)
    return trainer_state, info


def trainer_state_from_fabric(state: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint ``fabric.save`` wrote, resumed by the Trainer: the model and optimizer states are loaded; the
    Trainer's loops, callbacks and LR schedulers, which a Fabric loop keeps in its own keys, start fresh (warned once).
    The Fabric state's other entries stay in the checkpoint dict ``on_load_checkpoint`` receives."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_warn

    rank_zero_warn(
        "V17Strategy: resuming from a checkpoint fabric.save wrote: the model and optimizer states are loaded; the "
        "Trainer's step counter, loops, callbacks and LR schedulers start fresh (the Fabric state's own entries "
        f"{sorted(k for k in state if k != 'pytorch-lightning_version')} reach LightningModule.on_load_checkpoint)"
    )
    return {"pytorch-lightning_version": _lightning_version(), "lr_schedulers": [], **state}


# ---------------------------------------------------------------------------------------------------- DeepSpeed
def _is_deepspeed(path: Path) -> bool:
    from lightning_v17.checkpoint.deepspeed import is_deepspeed_checkpoint

    return is_deepspeed_checkpoint(path)


def load_deepspeed(strategy: V17Strategy, path: Path, *, weights_only: bool | None = None) -> dict[str, Any]:
    """Load a DeepSpeed ZeRO checkpoint directory (raw DeepSpeed or Lightning's DeepSpeedStrategy) into the running
    layout: every rank reads the full tensors (checkpoint/deepspeed.py, no deepspeed import) and keeps its own part of
    them (checkpoint/deepspeed_convert.py); returns the trainer state (Lightning's client state when it wrote it)."""
    from lightning_v17.checkpoint.deepspeed import read_deepspeed_checkpoint
    from lightning_v17.checkpoint.deepspeed_convert import fill_app_state, trainer_state_from_deepspeed

    # every file is read and checked before anything is set: a refused or partial checkpoint leaves the model as is;
    # mapped, so each rank reads from disk little more than the shards it keeps (fill_app_state copies them)
    ds = read_deepspeed_checkpoint(path, weights_only=weights_only, mmap=True)
    assert strategy.model is not None
    app_state = state_engine.get_state_dicts(strategy.model, strategy.optimizers, backend=strategy.zero)
    fill_app_state(app_state, ds)
    state_engine.set_state_dicts(strategy.model, strategy.optimizers, app_state, backend=strategy.zero)
    _carry_loss_scale(strategy, ds)
    return trainer_state_from_deepspeed(ds, lightning_version=_lightning_version())


def _carry_loss_scale(strategy: V17Strategy, ds: Any) -> None:
    """DeepSpeed's fp16 loss scale into the strategy's loss scaler (``loss_scale_from_deepspeed``), or a warning
    that it is not used; nothing for fp32/bf16 saves. Runs after ``on_fit_start``, so it also reaches the scaler a
    ``DynamicLossScaling`` callback configured."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_warn

    from lightning_v17.checkpoint.deepspeed_convert import loss_scale_from_deepspeed
    from lightning_v17.engine.precision import ShardedLossScaler

    scale = loss_scale_from_deepspeed(ds)
    if scale is None:
        return
    scaler = getattr(strategy.precision_plugin, "scaler", None)
    if isinstance(scaler, ShardedLossScaler):
        scaler.tracker.scale = scale
        rank_zero_warn(f"V17Strategy: resuming at DeepSpeed's fp16 loss scale {scale:g} from {ds.source}; its growth "
                       "window and hysteresis counters restart from the loss-scale policy")  # fmt: skip
    else:
        precision = strategy.precision_plugin.precision
        rank_zero_warn(f"V17Strategy: {ds.source} was trained in fp16 (loss scale {scale:g}); precision="
                       f"{precision!r} does not scale the loss, so the scale is not used")  # fmt: skip


def _lightning_version() -> str:
    import lightning

    return lightning.__version__


def remove(filepath: Any) -> None:
    """Delete a checkpoint directory (or a single file) that a ``ModelCheckpoint`` rotated out."""
    path = Path(filepath)
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
