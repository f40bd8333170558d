"""What activation offload (:mod:`~lightning_v17.engine.offload.activations`) keeps for each saved tensor.

* :class:`_Segment`: one block's forward in one pass (its index, whether it stays resident, its offloaded entries,
  the block before it in the same pass, whose reads its backward issues ahead).
* :class:`_Kept`: a saved tensor that stays in memory.
* :class:`_Entry`: an offloaded tensor: its file (or, on the ``"cpu"`` tier, its pinned host slice), its layout, the
  write and the read in flight and the tensor restored from them; its file goes when it is read back or dropped.
* :class:`_View`: another view of an entry's bytes, restored as a view of the same buffer.
"""

from __future__ import annotations

import functools
import os
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from lightning_v17.engine.offload.activations import ActivationOffload


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t`` covers exactly ``numel`` consecutive elements of its storage (contiguous up to a permutation)."""
    expected = 1
    for size, stride in sorted(((s, st) for s, st in zip(t.shape, t.stride()) if s != 1), key=lambda p: p[1]):
        if stride != expected:
            return False
        expected *= size
    return True


class _Segment:
    """One block's forward in one pass: its position in ``blocks``, whether it stays resident, its entries."""

    __slots__ = ("count", "cursor", "entries", "host", "index", "nbytes", "param_ptrs", "pass_id", "prev",
                 "reads_issued", "resident", "used")  # fmt: skip

    def __init__(self, index: int, pass_id: int, resident: bool, prev: _Segment | None, param_ptrs: set) -> None:
        self.index, self.pass_id, self.resident, self.prev = index, pass_id, resident, prev
        self.entries: list[Any] = []  # weak references to its offloaded entries
        self.used = self.reads_issued = False
        self.param_ptrs = param_ptrs
        self.count = self.nbytes = self.cursor = 0  # nbytes: its entries' aligned bytes (a pool buffer's share)
        self.host: torch.Tensor | None = None  # the "cpu" tier: the pooled pinned buffer its copies go to


class _Kept:
    """A saved tensor that stays in memory (its segment's use still starts the prefetch of the block ahead)."""

    __slots__ = ("seg", "tensor")

    def __init__(self, seg: _Segment, tensor: torch.Tensor) -> None:
        self.seg, self.tensor = seg, tensor


class _Entry:
    """One offloaded tensor: its file, its layout, the write and the read in flight, the restored tensor."""

    __slots__ = (
        "__weakref__",
        "dense",
        "dtype",
        "flat",
        "host",
        "key",
        "nbytes",
        "owner",
        "path",
        "read",
        "seg",
        "size",
        "src",
        "stride",
        "value",
        "version",
        "write",
    )  # fmt: skip

    def __init__(self, owner: ActivationOffload, seg: _Segment, key: tuple, t: torch.Tensor, path: Path | None) -> None:
        self.owner, self.seg, self.key, self.path = owner, seg, key, path  # path: None on the "cpu" tier
        self.dtype, self.size, self.stride, self.dense = t.dtype, tuple(t.shape), t.stride(), _dense(t)
        self.nbytes, self.version, self.src = t.numel() * t.element_size(), t._version, t
        self.write: Future | None = None
        self.read: Future | None = None
        self.value: torch.Tensor | None = None
        self.flat: torch.Tensor | None = None  # the bytes read back, as a flat tensor of ``dtype``
        self.host: torch.Tensor | None = None  # the "cpu" tier: its bytes in pinned host memory until read back

    def result(self) -> torch.Tensor:
        """The saved tensor back (waits for its read; reads it now if nothing read it ahead)."""
        if self.value is None:
            owner = self.owner
            if owner.closed:
                raise RuntimeError("activation offload: backward after close(); the offload files are gone")
            if self.read is None:
                owner._read(self, ahead=False)
            owner.stats["ready_at_use"] += int(self.read.done())
            try:
                buf = self.read.result()
            except Exception as err:
                raise OSError(f"activation offload: reading {self.path} back failed ({err})") from err
            self.read = None
            if self.path is not None:
                _unlink(self.path)
            flat = self.flat = buf.view(self.dtype)
            if self.dense:
                self.value = flat.as_strided(self.size, self.stride)
            else:
                self.value = torch.empty_strided(self.size, self.stride, dtype=self.dtype, device=flat.device)
                self.value.copy_(flat.view(self.size))
        return self.value

    def __del__(self) -> None:  # dropped unused (no backward) or consumed: the file goes
        if getattr(self, "value", 0) is None and getattr(self, "path", None) is not None:
            write = self.write
            if write is not None and not write.done():
                write.add_done_callback(functools.partial(_unlink_after, self.path))
            else:
                _unlink(self.path)


class _View:
    """Another view of an offloaded entry's bytes (``x`` and ``x.view(-1, h)``, both saved): one file, and views of
    one buffer back, as the originals shared one storage."""

    __slots__ = ("entry", "seg", "size", "stride", "value")

    def __init__(self, entry: _Entry, size: tuple, stride: tuple) -> None:
        self.entry, self.seg, self.size, self.stride, self.value = entry, entry.seg, size, stride, None

    def result(self) -> torch.Tensor:
        if self.value is None:
            self.entry.result()
            self.value = self.entry.flat.as_strided(self.size, self.stride)
        return self.value


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _unlink_after(path: Path, _fut: Future) -> None:
    _unlink(path)
