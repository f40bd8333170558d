"""AsyncCheckpoint: sharded checkpoints written in the background, published atomically, resumable with "last".

A thin adapter over ``lightning_v17.checkpoint.async_save.AsyncShardedSaver``; the protocol (one staging pass into
reused host buffers, the DCP writes on a dedicated gloo group in one background thread, the all-reduce of "done"
flags at batch end, meta.json last + rename) is documented there.
"""

from __future__ import annotations

import logging
import random
import time
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_v17.checkpoint.async_save import (
    AsyncShardedSaver,
    SaveResult,
    load_lightning_checkpoint,
    prune,
    resolve_latest,
    write_latest,
)
from lightning_v17.checkpoint.sharded import is_sharded_checkpoint

log = logging.getLogger(__name__)
RNG_KEY = "v17_rng_states"  # per-rank RNG states, a list indexed by global rank, in the trainer state


def _rng_state() -> dict[str, Any]:
    import numpy as np

    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class _ShardedAwareCheckpointIO(CheckpointIO):
    """Wraps a strategy's CheckpointIO so that ``trainer.fit(ckpt_path=<v17 sharded dir>)`` works on strategies that
    hold full tensors (Lightning's "ddp", single device); everything else goes to the wrapped IO unchanged."""

    def __init__(self, inner: CheckpointIO) -> None:
        self.inner = inner

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        self.inner.save_checkpoint(checkpoint, path, storage_options=storage_options)

    def load_checkpoint(self, path: Any, map_location: Any | None = None, weights_only: bool | None = None):
        if is_sharded_checkpoint(path):
            return load_lightning_checkpoint(path, weights_only=weights_only)
        return self.inner.load_checkpoint(path, map_location=map_location, weights_only=weights_only)

    def remove_checkpoint(self, path: Any) -> None:
        self.inner.remove_checkpoint(path)

    def teardown(self) -> None:
        self.inner.teardown()


class AsyncCheckpoint(ModelCheckpoint):
    """Save model + optimizer shards, loop/callback/scheduler/scaler/data state and every rank's RNG in the
    background; the loop blocks only for the device->host staging copy.

    Each save goes to ``dirpath/step-<global_step>``; it becomes visible, and ``dirpath/latest`` moves to it, only
    after every rank's write finished and its checksums are recorded; then checkpoints beyond ``keep_last`` are
    deleted. ``trainer.fit(ckpt_path="last")`` resumes from the newest complete checkpoint (incomplete ones are
    ignored). At most one save is in flight: if the next one comes due first, the loop waits and the wait is
    logged (``ckpt/wait_s``).

    It subclasses ``ModelCheckpoint`` only because Lightning resolves ``ckpt_path="last"`` by asking
    ``ModelCheckpoint`` instances (``_find_last_checkpoints``); none of ModelCheckpoint's saving logic runs.

    Works with ``V17Strategy`` (sharded DTensor state through ``engine/zero/stages_0_2.py``) and with strategies that hold full
    tensors such as Lightning's ``"ddp"`` (FQN state dicts from ``torch.distributed.checkpoint.state_dict``; a
    wrapper on the strategy's CheckpointIO reads the sharded directory back on resume).

    Args:
        dirpath: directory holding the checkpoints and the ``latest`` pointer.
        every_n_steps: save every N optimizer steps.
        every_n_minutes: save when this many minutes passed since the last save started (rank 0's clock decides).
        mtbf_hours: job mean time between failures; the interval is then Daly's optimum (Daly 2006, Eq. 37; Young
            1974 logged alongside) from the measured blocking cost of a save, never shorter than the measured
            background write. The first save happens after the first step, to measure.
        keep_last: number of published checkpoints to keep (>= 1).
    """

    def __init__(
        self,
        dirpath: str | Path,
        every_n_steps: int | None = None,
        every_n_minutes: float | None = None,
        mtbf_hours: float | None = None,
        keep_last: int = 3,
    ) -> None:
        if every_n_steps is None and every_n_minutes is None and mtbf_hours is None:
            raise ValueError("AsyncCheckpoint needs every_n_steps=, every_n_minutes= or mtbf_hours= (none was given)")
        for name, value in (
            ("every_n_steps", every_n_steps),
            ("every_n_minutes", every_n_minutes),
            ("mtbf_hours", mtbf_hours),
        ):
            if value is not None and not value > 0:
                raise ValueError(f"AsyncCheckpoint({name}={value!r}) must be > 0")
        if int(keep_last) < 1:
            raise ValueError(f"AsyncCheckpoint(keep_last={keep_last!r}) must be >= 1 (the newest is always kept)")
        super().__init__(dirpath=str(dirpath), save_top_k=0, save_last=False)
        self.root = Path(dirpath).absolute()
        self.every_n_steps = every_n_steps
        self.every_n_minutes = every_n_minutes
        self.mtbf_hours = mtbf_hours
        self.keep_last = int(keep_last)
        self.interval_s: float | None = every_n_minutes * 60.0 if every_n_minutes else None
        self.history: list[dict[str, float]] = []  # one entry per published save (staging/write/wait seconds)
        self._saver: AsyncShardedSaver | None = None
        self._last_saved_step = -1
        self._last_save_t: float | None = None
        self._rng_pending = False
        self._rng_to_restore: list[dict[str, Any]] | None = None
        self._pending_wait_s = 0.0
        #: Cumulative seconds the training loop was blocked by saves (waiting + staging); ThroughputMonitor reads it.
        self.checkpoint_blocking_s = 0.0

    # ------------------------------------------------------------------------------------------------ Lightning glue
    @property
    def state_key(self) -> str:
        return self._generate_state_key(dirpath=str(self.root))

    def _find_last_checkpoints(self, trainer: Trainer) -> set[str]:
        latest = resolve_latest(self.root)
        return {str(latest)} if latest is not None else set()

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        if not _is_v17(strategy) and not isinstance(strategy.checkpoint_io, _ShardedAwareCheckpointIO):
            strategy.checkpoint_io = _ShardedAwareCheckpointIO(strategy.checkpoint_io)
        if stage == "fit" and self._saver is None:
            self._saver = AsyncShardedSaver()
            if trainer.is_global_zero:
                self.root.mkdir(parents=True, exist_ok=True)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        pass  # ModelCheckpoint's bookkeeping is not used

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        pass

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {"last_saved_step": self._last_saved_step, "interval_s": self.interval_s}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._last_saved_step = int(state_dict.get("last_saved_step", -1))
        if self.mtbf_hours and state_dict.get("interval_s"):
            self.interval_s = float(state_dict["interval_s"])

    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        self._rng_to_restore = checkpoint.get(RNG_KEY)

    # ------------------------------------------------------------------------------------------------ the loop hooks
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._rng_to_restore is not None:
            states, self._rng_to_restore = self._rng_to_restore, None
            if len(states) == trainer.world_size:
                _set_rng_state(states[trainer.global_rank])
            else:
                rank_zero_info(
                    f"AsyncCheckpoint: checkpoint RNG states are for {len(states)} ranks, this run has "
                    f"{trainer.world_size}; RNG streams are not restored"
                )
        if self._rng_pending:
            # Captured here, at the start of the step after the save, so that RNG drawn between steps (a new
            # epoch's DataLoader iterator, validation) is included: the resumed step sees exactly these states.
            self._attach_rng(trainer)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._saver is None:
            return
        if self._saver.in_flight and not self._rng_pending:
            self._record(self._saver.poll(), trainer, pl_module)
        if self._due(trainer):
            self._save(trainer, pl_module)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._saver is not None and self._saver.in_flight:
            if self._rng_pending:
                self._attach_rng(trainer)
            self._record(self._saver.wait(), trainer, pl_module, log_metrics=False)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        # No collective here (other ranks may be dead); the partial directory stays unpublished and is ignored.
        if self._saver is not None:
            self._saver.close()
            self._saver = None

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._saver is not None and not self._saver.in_flight:
            self._saver.close()
            self._saver = None

    # ------------------------------------------------------------------------------------------------ internals
    def _due(self, trainer: Trainer) -> bool:
        step = trainer.global_step
        if step <= 0 or step == self._last_saved_step:
            return False
        if self.every_n_steps and step % self.every_n_steps == 0:
            return True
        if self.interval_s is None and not self.mtbf_hours:
            return False
        # Time-based triggers: clocks differ per rank, so rank 0 decides and broadcasts (one tiny collective).
        now = time.monotonic()
        if self.interval_s is None:  # mtbf mode before the first measurement: save now to measure the cost
            due = self._last_save_t is None
        else:
            due = self._last_save_t is None or now - self._last_save_t >= self.interval_s
        return bool(trainer.strategy.broadcast(due, src=0))

    def _save(self, trainer: Trainer, pl_module: LightningModule) -> None:
        assert self._saver is not None
        wait_s = 0.0
        if self._saver.in_flight:  # at most one in flight: wait for it (and publish it) first
            if self._rng_pending:
                self._attach_rng(trainer)
            t0 = time.perf_counter()
            self._record(self._saver.wait(), trainer, pl_module)
            wait_s = time.perf_counter() - t0
            rank_zero_info(f"AsyncCheckpoint: the previous save was still writing; waited {wait_s:.3f}s")
        step = trainer.global_step
        self._last_saved_step = step
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        checkpoint.pop("state_dict", None)
        checkpoint.pop("optimizer_states", None)
        app_state = _app_state(trainer)
        self._last_save_t = time.monotonic()
        blocked_s = self._saver.start(
            self.root / f"step-{step:08d}", app_state=app_state, trainer_state=checkpoint, meta=_meta(trainer, step)
        )
        self._rng_pending = True
        self._pending_wait_s = wait_s
        self.checkpoint_blocking_s += wait_s + blocked_s
        pl_module.log_dict({"ckpt/blocked_s": blocked_s, "ckpt/wait_s": wait_s}, on_step=True, rank_zero_only=True)

    def _attach_rng(self, trainer: Trainer) -> None:
        import torch.distributed as dist

        mine = _rng_state()
        if dist.is_available() and dist.is_initialized():
            everyone: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)
        else:
            everyone = [mine]
        assert self._saver is not None
        self._saver.amend_trainer_state({RNG_KEY: everyone})
        self._rng_pending = False

    def _record(
        self, res: SaveResult | None, trainer: Trainer, pl_module: LightningModule, log_metrics: bool = True
    ) -> None:
        if res is None:
            return
        entry = {
            "step": float(self._last_saved_step),
            "staging_s": res.staging_s,
            "write_s": res.write_s,
            "publish_wait_s": res.publish_wait_s,
            "wait_s": self._pending_wait_s,
        }
        self.history.append(entry)
        if trainer.is_global_zero:
            write_latest(self.root, res.path.name)  # only now, after full publication
            removed = prune(self.root, keep_last=self.keep_last, keep=res.path)
            log.debug("AsyncCheckpoint published %s; removed %s", res.path, removed)
        trainer.strategy.barrier("v17_async_ckpt_latest")
        self.last_model_path = str(res.path)
        if self.mtbf_hours:
            self._update_interval(res)
        if log_metrics:
            pl_module.log("ckpt/write_s", res.write_s, on_step=True, rank_zero_only=True)

    def _update_interval(self, res: SaveResult) -> None:
        from lightning_v17.planner.resilience import daly_interval_s, young_interval_s

        mtbf_s = float(self.mtbf_hours) * 3600.0
        delta_s = max(res.staging_s, 1e-6)  # δ: seconds the job is blocked per checkpoint
        daly_s = daly_interval_s(delta_s, mtbf_s)
        self.interval_s = max(daly_s, res.write_s)  # never queue saves faster than they are written
        rank_zero_info(
            f"AsyncCheckpoint: save blocks {delta_s:.3f}s, writes {res.write_s:.3f}s in the background; "
            f"MTBF {mtbf_s:.0f}s -> interval {self.interval_s:.1f}s (Daly {daly_s:.1f}s, "
            f"Young {young_interval_s(delta_s, mtbf_s):.1f}s)"
        )


def _is_v17(strategy: Any) -> bool:
    """V17Strategy writes sharded checkpoints itself, and its ZeRO backend knows the optimizer layout."""
    from lightning_v17.strategies import V17Strategy

    return isinstance(strategy, V17Strategy)


def _app_state(trainer: Trainer) -> dict[str, Any]:
    """``{"model", "optim"}`` in the FQN layout DCP reshards: V17Strategy's engine for its sharded state, torch's
    ``state_dict`` API for strategies with whole tensors (keys match ``LightningModule.state_dict()``)."""
    strategy = trainer.strategy
    optimizers = [getattr(o, "_optimizer", o) for o in trainer.optimizers]
    if _is_v17(strategy):
        from lightning_v17.engine.zero.state_dict import get_state_dicts

        return get_state_dicts(strategy.model, optimizers, backend=strategy.zero)
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    module = trainer.lightning_module
    out: dict[str, Any] = {"model": get_model_state_dict(module)}
    if len(optimizers) == 1:
        out["optim"] = get_optimizer_state_dict(module, optimizers[0])
    elif optimizers:
        out["optim"] = {f"optimizer_{i}": get_optimizer_state_dict(module, o) for i, o in enumerate(optimizers)}
    return out


def _meta(trainer: Trainer, step: int) -> dict[str, Any]:
    strategy = trainer.strategy
    meta: dict[str, Any] = {
        "step": step,
        "epoch": trainer.current_epoch,
        "strategy": type(strategy).__name__,
        "zero_stage": getattr(strategy, "zero_stage", 0),
    }
    try:
        spec = strategy.mesh.spec  # V17Strategy's MeshRuntime (raises before setup / absent elsewhere)
        meta["mesh"] = {a: spec.size(a) for a in ("pp", "dp_replicate", "dp_shard", "cp", "tp")}
    except Exception as err:  # noqa: BLE001 - the mesh is informational
        log.debug("no mesh recorded in checkpoint meta: %s", err)
    return meta
