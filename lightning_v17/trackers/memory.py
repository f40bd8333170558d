"""Per-rank memory buckets measured from real tensor storage (design §1: param / grad / optimizer state / activation).

Lightning-free. Model-state bytes are counted from ``untyped_storage()`` and deduplicated by (device, storage
data_ptr), so views (DDP bucket views, FSDP2 shards inside a padded buffer, ZeRO shard views into a flat buffer,
tied weights) count once, with their whole storage, exactly as the allocator holds them. DTensors count their local
shard (``to_local()``). Buckets are disjoint: a storage already counted as a parameter is not counted again as a
gradient or optimizer state.

Activation/workspace peak:
- CUDA: ``torch.cuda.max_memory_allocated`` during the step (peak stats reset at the step start) minus the model
  state measured at that time.
- CPU: torch has no CPU allocator statistics, so it is the process RSS high-water mark during the step minus the RSS
  at the step start (Linux ``/proc/self/status`` VmHWM, reset at the step start by writing 5 to
  ``/proc/self/clear_refs``). This is an estimate: glibc keeps freed blocks, so memory reused from the previous step
  does not raise RSS again, and gradients re-allocated in backward are included.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_v17.engine._dtensor import local as _local

__all__ = [
    "MeasuredBytes",
    "StorageCounter",
    "bar_chart",
    "measure_model_state",
    "optimizer_state_tensors",
    "peak_rss_bytes",
    "reset_peak_rss",
    "rss_bytes",
]




def _storage_tensors(tensors: Iterable[Any]) -> Iterable[torch.Tensor]:
    """The tensors that own storage: a DTensor's local tensor, and a wrapper subclass's inner tensors (torchao's
    float8 all-gather weight, ``WeightWithDynamicFloat8CastTensor``, has no storage of its own: reading its
    ``data_ptr`` raises "invalid python storage")."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        t = _local(t)
        if is_traceable_wrapper_subclass(t):
            names, _ = t.__tensor_flatten__()
            yield from _storage_tensors(getattr(t, n) for n in names)
        else:
            yield t


class StorageCounter:
    """Sums storage bytes, counting each underlying storage once across all calls."""

    def __init__(self) -> None:
        self._seen: set[tuple[str, int]] = set()

    def add(self, tensors: Iterable[Any]) -> int:
        """Bytes of the storages of ``tensors`` not seen before (non-tensors and meta tensors are ignored)."""
        total = 0
        for t in _storage_tensors(tensors):
            if t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            nbytes = storage.nbytes()
            if nbytes == 0:  # freed (FSDP resized-to-zero) storages hold no memory
                continue
            key = (str(t.device), storage.data_ptr())
            if key in self._seen:
                continue
            self._seen.add(key)
            total += nbytes
        return total


def optimizer_state_tensors(optimizer: Any) -> list[torch.Tensor]:
    """Every tensor in ``optimizer.state`` (following wrapped optimizers' ``.optimizer`` / ``.optim``; the callbacks
    unwrap Lightning's ``LightningOptimizer`` before they ask)."""
    out: list[torch.Tensor] = []
    seen: set[int] = set()
    stack = [optimizer]
    while stack:
        opt = stack.pop()
        if opt is None or id(opt) in seen:
            continue
        seen.add(id(opt))
        for state in getattr(opt, "state", {}).values():
            if isinstance(state, dict):
                out.extend(v for v in state.values() if isinstance(v, torch.Tensor))
        for attr in ("optimizer", "optim"):
            inner = getattr(opt, attr, None)
            if inner is not None and hasattr(inner, "param_groups"):
                stack.append(inner)
    return out


@dataclass(frozen=True)
class MeasuredBytes:
    """Bytes one rank holds per bucket."""

    param: int
    grad: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.param + self.grad + self.optimizer


def measure_model_state(module: torch.nn.Module, optimizers: Sequence[Any]) -> MeasuredBytes:
    """Storage-deduplicated bytes of parameters, gradients and optimizer state on this rank.

    Params: the module's parameters. Grads: ``.grad`` of the module's parameters and of every tensor in the
    optimizers' ``param_groups`` (a ZeRO-1/2 engine keeps shard gradients there). Optimizer: everything in
    ``optimizer.state`` plus ``param_groups`` tensors that are not module parameters (fp32 master copies).
    """
    counter = StorageCounter()
    params = list(module.parameters())
    param_bytes = counter.add(params)
    group_params = [p for opt in optimizers for g in opt.param_groups for p in g["params"]]
    grad_bytes = counter.add(p.grad for p in params + group_params if p.grad is not None)
    opt_bytes = counter.add(t for opt in optimizers for t in optimizer_state_tensors(opt))
    opt_bytes += counter.add(group_params)  # only storages not already counted as params: master copies
    return MeasuredBytes(param=param_bytes, grad=grad_bytes, optimizer=opt_bytes)


def rss_bytes() -> int:
    """Resident set size of this process in bytes (Linux /proc; psutil elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import psutil

        return int(psutil.Process().memory_info().rss)


def reset_peak_rss() -> bool:
    """Reset the RSS high-water mark to the current RSS (Linux >= 4.0); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int | None:
    """RSS high-water mark (VmHWM) in bytes since the last :func:`reset_peak_rss`; None where unavailable."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def bar_chart(rows: Sequence[tuple[str, float, float | None]], *, width: int | None = None) -> str:
    """ASCII bars of measured vs planned bytes (the buckets of design §1.5), one pair of bars per bucket.

    Uses the planner's report helpers (:func:`lightning_v17.planner.report.bar`, ``fmt_bytes``) so measured and
    planned charts look alike. Bars are scaled to the largest value in the chart.

    Args:
        rows: (bucket label, measured bytes, planned bytes or None).
        width: characters of the longest bar (default: the planner's ``BAR_WIDTH``).
    """
    from lightning_v17.planner.report import BAR_WIDTH, bar, fmt_bytes

    width = width or BAR_WIDTH
    biggest = max([m for _, m, _ in rows] + [p for _, _, p in rows if p is not None] + [1])
    lines = []
    for label, measured, planned in rows:
        lines.append(f"{label:<10} measured {bar(measured, biggest, width):<{width}} {fmt_bytes(measured):>9}")
        if planned is not None:
            dev = f" ({(measured - planned) / planned:+.1%})" if planned else ""
            lines.append(f"{'':<10} planned  {bar(planned, biggest, width):<{width}} {fmt_bytes(planned):>9}{dev}")
    return "\n".join(lines)
