"""The fp16 loss scaler over every shard (design §13.2): :class:`ShardedLossScaler` drives the pure
:class:`~lightning_v17.trackers.LossScaleTracker` with real tensors.

It duck-types the part of ``torch.amp.GradScaler`` that Lightning's ``MixedPrecision`` plugin calls (``scale``,
``unscale_``, ``step``, ``update``), so it can be installed as that plugin's ``scaler``. Unlike ``GradScaler`` it

* reads the gradients of the tensors the *optimizer* holds in ``param_groups`` (plain tensors, DTensors via
  ``to_local()``, or a ZeRO-1/2 engine's shard tensors), so every shard is checked exactly once;
* combines the local inf/NaN flags of all devices and dtypes into one tensor and runs ONE all-reduce (MAX) over the
  whole world, so a single rank's overflow skips the step on every rank (TP, PP and DP ranks alike).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from lightning_v17.engine.zero.layout import whole_grads
from lightning_v17.trackers.loss_scale import LossScaleTracker

__all__ = ["ShardedLossScaler", "optimizer_grads"]


def optimizer_grads(optimizer: Any) -> list[torch.Tensor]:
    """The local gradient tensors of everything ``optimizer`` updates (its ``param_groups``), deduplicated.

    Whatever the param_groups hold is what gets stepped: full parameters (DDP), DTensor shards (FSDP2 / ZeRO-3),
    or a ZeRO-1/2 engine's shards; at ZeRO-1 the whole reduced gradient behind the shards, which must be unscaled on
    every rank alike (:func:`~lightning_v17.engine.zero.layout.whole_grads`).
    """
    return whole_grads(p for group in optimizer.param_groups for p in group["params"])


class ShardedLossScaler:
    """fp16 loss scaler over a :class:`LossScaleTracker` with one world all-reduce per step.

    Implements the ``torch.amp.GradScaler`` methods that Lightning's ``MixedPrecision`` plugin calls:
    ``scale(loss)`` before backward, ``unscale_(optimizer)`` after the closure and before gradient clipping,
    ``step(optimizer)`` (skipped on overflow), ``update()``.

    Args:
        tracker: the state machine holding the scale and counters.
        group: process group of the inf/NaN all-reduce; ``None`` = the whole world (every TP/PP/DP rank).
        on_skip: called (no arguments) when a step is skipped, before ``update()`` (the Lightning adapter uses it to
            hold back ``global_step`` and the LR scheduler).
    """

    def __init__(
        self, tracker: LossScaleTracker, *, group: Any = None, on_skip: Callable[[], None] | None = None
    ) -> None:
        self.tracker = tracker
        self.group = group
        self.on_skip = on_skip
        self._found_inf: dict[int, bool] = {}  # id(optimizer) -> global overflow flag of this iteration
        self._last_loss: torch.Tensor | None = None
        self.last_step_skipped = False

    # -- GradScaler surface -------------------------------------------------------------------------------------
    def is_enabled(self) -> bool:
        return True

    def get_scale(self) -> float:
        return self.tracker.scale

    def scale(self, outputs: Any) -> Any:
        """Multiply the loss (a tensor or nested list/tuple of tensors) by S, in fp32 so S itself cannot overflow."""
        if isinstance(outputs, torch.Tensor):
            self._last_loss = outputs.detach()
            return outputs * torch.tensor(self.tracker.scale, dtype=torch.float32, device=outputs.device)
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(o) for o in outputs)
        raise TypeError(f"cannot scale outputs of type {type(outputs).__name__}")

    def unscale_(self, optimizer: Any) -> None:
        """Divide this rank's gradient shards by S in place and decide, across all ranks, whether any overflowed.

        Runs once per optimizer per iteration (a second call raises, as in GradScaler, because it would unscale
        twice). Call it before clipping gradients so the clip threshold sees true, unscaled norms (design §13.8).
        """
        if id(optimizer) in self._found_inf:
            raise RuntimeError("unscale_() was already called on this optimizer since the last update()")
        self._found_inf[id(optimizer)] = self._unscale_and_check(optimizer)

    def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        """``optimizer.step()`` unless any rank overflowed this iteration (then nothing is updated)."""
        if id(optimizer) not in self._found_inf:
            self.unscale_(optimizer)
        if self._found_inf[id(optimizer)]:
            self.last_step_skipped = True
            if self.on_skip is not None:
                self.on_skip()
            return None
        self.last_step_skipped = False
        return optimizer.step(*args, **kwargs)

    def update(self, new_scale: float | None = None) -> None:
        """Advance the tracker by one step (an overflow on any optimizer counts as one overflowing step)."""
        if new_scale is not None:
            self.tracker.scale = float(new_scale)
        found_inf = any(self._found_inf.values())
        self._found_inf.clear()
        self.tracker.update(found_inf, cause=self._likely_cause)

    def state_dict(self) -> dict[str, Any]:
        """The tracker's state (scale and counters): saved with the precision plugin in every checkpoint."""
        return self.tracker.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state and "good_steps" in state:
            self.tracker.load_state_dict(state)
        elif state and "scale" in state:  # a checkpoint written by a plain GradScaler: take over its scale
            self.tracker.scale = float(state["scale"])

    def configure(self, tracker: LossScaleTracker, *, on_skip: Callable[[], None] | None = None) -> None:
        """Drive ``tracker`` (its policy and counters) from now on; used by the ``DynamicLossScaling`` callback so
        that it configures the strategy's scaler instead of installing a second one."""
        self.tracker = tracker
        self.on_skip = on_skip

    # -- internals ----------------------------------------------------------------------------------------------
    def _unscale_and_check(self, optimizer: Any) -> bool:
        grads = optimizer_grads(optimizer)
        inv_scale = 1.0 / self.tracker.scale
        # One flag per (device, dtype) bucket for the fused check, then summed into a single flag tensor.
        buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for g in grads:
            buckets.setdefault((g.device, g.dtype), []).append(g)
        comm_device = self._comm_device(grads)
        found = torch.zeros(1, dtype=torch.float32, device=comm_device)
        for (device, _dtype), tensors in buckets.items():
            flag = torch.zeros(1, dtype=torch.float32, device=device)
            inv = torch.full((1,), inv_scale, dtype=torch.float32, device=device)
            # GradScaler's own fused kernel: multiplies by inv_scale and sets flag=1 on any inf/NaN.
            torch._amp_foreach_non_finite_check_and_unscale_(tensors, flag, inv)
            found += flag.to(comm_device)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1:
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self.group)  # the ONE collective per step
        return bool(found.item() > 0)

    def _comm_device(self, grads: list[torch.Tensor]) -> torch.device:
        if dist.is_available() and dist.is_initialized() and dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return grads[0].device if grads and grads[0].device.type == "cpu" else torch.device("cpu")

    def _likely_cause(self) -> str:
        loss = self._last_loss
        if loss is not None and not bool(torch.isfinite(loss.float()).all()):
            return (
                "Likely cause: the loss itself is NaN/inf before scaling, so no scale can fix it: the forward pass "
                "produces non-finite values (bad input data, log/division by zero, or a diverged model: lower the "
                "learning rate, check the data, or resume from an earlier checkpoint)."
            )
        return (
            "Likely cause: the gradients overflow fp16 even at a small scale (fp16 range is too narrow for this "
            "model): train with precision='bf16-mixed', lower the learning rate, or clip gradients; also check "
            "for a diverging model."
        )
