"""The parameter tier's memory (:mod:`~lightning_v17.engine.offload.params`): where a shard's bytes are between
uses and while in use.

* :class:`_Unit`: one FSDP2 group's shards, one file of page-aligned slots (:data:`SLOT_ALIGN`) and, while any of
  them is in memory, one buffer: a unit is read with one request, written back in runs of neighbouring slots.
* :class:`_Rec`: one shard. In memory, FSDP2's own shard storage (``FSDPParam._sharded_param_data``, which the DTensor's
  local tensor views) points at its slot of the unit's buffer (``UntypedStorage._swap_data_ptr_`` with a storage that
  owns nothing); released, the storage is empty. Nothing that holds the parameter is re-pointed.
* :class:`ReleasedShard`: what the parameter's local tensor is outside forward, backward, the step and ``resident()``.
* :class:`_ShardPool`: the units' buffers from the I/O backend, recycled between units.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Self

import torch

from lightning_v17.engine.offload.host_memory import own_mappings

__all__ = ["SLOT_ALIGN", "ReleasedShard"]


class ReleasedShard(torch.Tensor):
    """What a parameter's local tensor is while its shard is on the nvme tier (the DTensor parameter's
    ``_local_tensor``): the shard's shape, stride, dtype and device, no data. Reading or writing it raises an error
    that names the parameter and the fix (the storage is freed: a read would touch freed memory, and crash the
    process). Views (``detach``, ``to_local()``'s ``view_as``, ...) give another one, so metadata, ``state_dict()``
    (the tier's save hook puts the shard read from its file in its place) and storage accounting (an empty storage,
    as FSDP2's freed ones) still work."""

    _v17_name: str

    @staticmethod
    def __new__(cls, like: torch.Tensor, name: str, device: torch.device | None = None) -> Self:
        t = torch.Tensor._make_wrapper_subclass(
            cls, like.size(), strides=like.stride(), storage_offset=like.storage_offset(), dtype=like.dtype,
            device=device or like.device, requires_grad=False,
        )  # fmt: skip
        t._v17_name = name
        return t

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return f"ReleasedShard({self._v17_name!r}, shape={tuple(self.shape)}, dtype={self.dtype})"

    def untyped_storage(self) -> torch.UntypedStorage:  # type: ignore[override]
        return torch.UntypedStorage(0)  # freed, as a storage FSDP2 resized to zero

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch.utils._pytree import tree_leaves, tree_map_only

        kwargs = kwargs or {}
        shard = next(a for a in tree_leaves((args, kwargs)) if isinstance(a, ReleasedShard))
        if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default) or getattr(func, "is_view", False):
            def meta(t: ReleasedShard) -> torch.Tensor:
                return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device="meta")

            m_args, m_kwargs = tree_map_only(ReleasedShard, meta, (args, kwargs))
            out = func(*m_args, **m_kwargs)
            return tree_map_only(torch.Tensor, lambda m: ReleasedShard(m, shard._v17_name, shard.device), out)
        raise RuntimeError(
            f"parameter {shard._v17_name!r} is on the nvme tier (OffloadPolicy(params='nvme')): its shard is in "
            f"memory only during forward, backward and the optimizer step, and {func} read it outside them. Read "
            "parameters inside `with trainer.strategy.zero.param_offload.resident():` (every shard in memory, "
            "written back after), as DeepSpeed's ZeRO-3 GatheredParameters"
        )

    __torch_function__ = torch._C._disabled_torch_function_impl


#: bytes each shard's slot in its unit's file and buffer is aligned to: a page, the largest logical block O_DIRECT
#: asks of an in-place write (4096 on 4Kn drives; AioIO refuses an offset that is not a multiple of it)
SLOT_ALIGN = 4096


@dataclass(eq=False)
class _Rec:
    """One offloaded parameter shard: ``nbytes`` at byte ``offset`` of its unit's file and buffer."""

    fp: Any  # FSDP2's FSDPParam
    index: int
    nbytes: int
    unit: _Unit | None = None
    offset: int = 0
    dirty: bool = True  # the file is not current (never written, or changed since)
    write: Future | None = None
    local: torch.Tensor | None = None  # the parameter's local tensor while a ReleasedShard stands in for it
    holder: torch.UntypedStorage | None = None  # the storage pointed into the unit's buffer (kept: a load may swap it)

    @property
    def slot(self) -> int:
        return -(-self.nbytes // SLOT_ALIGN) * SLOT_ALIGN

    @property
    def resident(self) -> bool:
        return self.storage().nbytes() > 0

    def storage(self) -> torch.UntypedStorage:
        return self.fp._sharded_param_data.untyped_storage()

    def in_buffer(self) -> bool:
        """The shard's storage is its slot of the unit's buffer (not memory of its own: FSDP2's first storage, or one a
        load put there)."""
        u = self.unit
        return u is not None and u.buf is not None and self.storage().data_ptr() == u.buf.data_ptr() + self.offset

    def attach(self) -> None:
        """Point the shard's (empty) storage at its slot of the unit's buffer: every view of the storage stays valid
        (``UntypedStorage._swap_data_ptr_``); :meth:`show` once the slot holds the shard."""
        u = self.unit
        view = torch._C._construct_storage_from_data_pointer(u.buf.data_ptr() + self.offset, u.buf.device, self.nbytes)
        self.holder = self.storage()
        self.holder._swap_data_ptr_(view)  # a pointer that owns nothing: the buffer is the unit's
        u.attached.add(self.index)

    def detach(self) -> None:
        """Empty the shard's storage (its bytes are in the file, and in the unit's buffer while that is held) and
        :meth:`hide` it."""
        u = self.unit
        own = not self.in_buffer() and self.storage().nbytes() > 0
        if own and u.buf is not None:  # keep the buffer current: a later attach reads no file
            u.buf[self.offset : self.offset + self.nbytes].copy_(self.as_bytes())
        if self.holder is not None:
            self.holder._swap_data_ptr_(torch.UntypedStorage(0))  # drops the pointer into the buffer
            self.holder = None
        if own:
            torch.UntypedStorage(0)._swap_data_ptr_(self.storage())  # frees memory of its own with the temporary
        u.attached.discard(self.index)
        self.hide()

    def to_own_memory(self) -> None:
        """The shard, in memory in its unit's buffer, moves into memory of its own (the tier closes: the buffer goes
        back to the backend)."""
        if self.in_buffer():
            data = self.as_bytes().clone()
            self.holder._swap_data_ptr_(torch.UntypedStorage(0))  # type: ignore[union-attr]
            self.holder = None
            self.storage()._swap_data_ptr_(data.untyped_storage())
            self.unit.attached.discard(self.index)  # type: ignore[union-attr]

    def show(self) -> None:
        """The parameter's own local tensor back (the shard is in memory)."""
        sp = self.fp.sharded_param
        if isinstance(sp._local_tensor, ReleasedShard) and self.local is not None:
            sp._local_tensor, self.local = self.local, None

    def hide(self) -> None:
        """A :class:`ReleasedShard` stands in for the parameter's local tensor: reads outside forward, backward, the
        step and ``resident()`` raise, whether the shard happens to be in memory or not."""
        sp = self.fp.sharded_param
        if not isinstance(sp._local_tensor, ReleasedShard):  # a load may have put a new local tensor there
            self.local = sp._local_tensor
            sp._local_tensor = ReleasedShard(self.local, self.fp._param_fqn or self.fp._module_info.param_name)

    def as_bytes(self) -> torch.Tensor:
        """A uint8 tensor over the whole (padded) storage."""
        return torch.empty(0, dtype=torch.uint8).set_(self.storage(), 0, (self.nbytes,), (1,))


@dataclass(eq=False)
class _Unit:
    """One FSDP2 group's shards: one file of aligned slots, and one buffer while any of them is in memory (one read
    per unit, not one per parameter: at 100-KiB shards a read costs its latency, not its bytes)."""

    index: int
    recs: list[_Rec]
    nbytes: int
    buf: torch.Tensor | None = None
    read: Future | None = None  # the whole file into buf
    attached: set[int] = field(default_factory=set)  # the recs whose storage points into buf
    writes: int = 0  # write-backs in flight from buf


class _ShardPool:
    """The units' buffers, recycled from a unit's release to the next unit's read (DeepSpeed's parameter swap
    buffers): by exact size, from the I/O backend (``io.alloc``: page-locked by DeepSpeed's op, which then reads and
    writes them directly instead of through a bounce buffer it allocates, locks and frees per call; anonymous mappings
    for the thread pool), so a refill neither faults memory in nor locks it. At most ``cap`` bytes are kept idle, the
    oldest buffers given back to the backend first."""

    def __init__(self, io: Any, cap: int) -> None:
        self.io, self.cap = io, cap
        self.idle: list[torch.Tensor] = []  # buffers no unit holds, oldest first
        self.idle_bytes = 0
        self.allocations = 0  # buffers allocated through the backend, ever
        self._allocator = ThreadPoolExecutor(1, thread_name_prefix="v17-param-alloc")

    def take(self, nbytes: int) -> torch.Tensor:
        for i in range(len(self.idle) - 1, -1, -1):  # the most recently released of that size
            if self.idle[i].numel() == nbytes:
                self.idle_bytes -= nbytes
                return self.idle.pop(i)
        from lightning_v17.engine.offload.nvme import host_buffer

        self.allocations += 1
        # DeepSpeed's locked buffers come from malloc, which serves a request from a free chunk of the calling
        # thread's heap before it considers a mapping: on the training thread they would pin holes of its heap. A
        # thread that allocates nothing else has no free chunks: there they are their own mappings (unmapped when
        # freed), as inside own_mappings they are meant to be
        with own_mappings():
            return self._allocator.submit(getattr(self.io, "alloc", host_buffer), nbytes).result()

    def give(self, buf: torch.Tensor) -> None:
        self.idle.append(buf)
        self.idle_bytes += buf.numel()
        while self.idle_bytes > self.cap:  # the oldest first: the unit just released is the next one's buffer
            self._drop(0)

    def _drop(self, i: int) -> None:
        buf = self.idle.pop(i)
        self.idle_bytes -= buf.numel()
        free = getattr(self.io, "free", None)
        if free is not None:
            free(buf)  # DeepSpeed's op unlocks and frees its own; other memory goes with its last reference

    def close(self) -> None:
        while self.idle:
            self._drop(0)
        self._allocator.shutdown(wait=True)
