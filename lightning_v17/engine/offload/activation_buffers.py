"""Host buffers and device copies of activation offload (:mod:`~lightning_v17.engine.offload.activations`).

* :class:`BlockPool`: host buffers that each hold one block's saved bytes, recycled across blocks and steps
  (DeepSpeed's swap buffers, torchtune's pinned-buffer reuse). The nvme tier reads a block back into one (``cap`` =
  prefetch depth + 1: the block being differentiated and the one read ahead); the accelerator's ``"cpu"`` tier
  copies a block's saved tensors into one in forward (``cap`` = the offloaded blocks + 1). A buffer is refilled only
  once nothing but the pool views its storage (:func:`~.host_memory.sole_owner`): no entry, no read in flight and no
  tensor autograd still holds aliases it.
* :class:`CudaCopies`: the ``"cpu"`` tier's side stream: device-to-host copies in forward and host-to-device
  prefetches in backward, ordered by events.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable
from typing import Any

import torch

from lightning_v17.engine.offload.host_memory import sole_owner

__all__ = ["ALIGN", "BlockPool", "CudaCopies", "EventRead", "EventWrite", "aligned"]

#: byte alignment of each tensor inside a block buffer (O_DIRECT's 512-byte blocks, and any dtype's element size)
ALIGN = 4096


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class _Mapped:
    """An anonymous mapping as a uint8 tensor; its pages can be dropped while it stays mapped (idle)."""

    __slots__ = ("map", "tensor")

    def __init__(self, nbytes: int) -> None:
        self.map = mmap.mmap(-1, nbytes)
        self.tensor = torch.frombuffer(self.map, dtype=torch.uint8)

    def drop_pages(self) -> None:
        self.map.madvise(mmap.MADV_DONTNEED)  # zero-filled again on next touch; out of the RSS until then


class BlockPool:
    """At most ``cap`` host buffers of one block's bytes each, reused across blocks and steps.

    Args:
        cap: buffers owned at most; a request beyond them gets a buffer outside the pool (counted in ``misses``).
        alloc: ``nbytes -> uint8 tensor`` (pinned memory for the accelerator tier); None: anonymous mappings, whose
            pages :meth:`idle` gives back to the OS while the buffers stay owned.
    """

    def __init__(self, cap: int, alloc: Callable[[int], torch.Tensor] | None = None) -> None:
        self.cap, self._alloc = max(int(cap), 1), alloc
        self.free: list[Any] = []  # _Mapped or tensors no block holds now
        self.lent: list[Any] = []  # handed out; back to ``free`` once nothing else views them
        self.allocations = 0  # buffers ever allocated for the pool
        self.misses = 0  # requests served outside the pool (all ``cap`` in use)
        self.reuses = 0  # requests served by a buffer allocated before
        self.size = 0  # the largest block's bytes seen so far (the buffers converge to it)

    @staticmethod
    def _tensor(b: Any) -> torch.Tensor:
        return b.tensor if isinstance(b, _Mapped) else b

    def reclaim(self) -> None:
        """Move the lent buffers nothing else views back to ``free``."""
        still = []
        for b in self.lent:
            (self.free if sole_owner(self._tensor(b)) else still).append(b)
        self.lent = still

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of at least ``nbytes``: a free one, a new one while fewer than ``cap`` are owned (as large
        as the largest block seen), else one outside the pool."""
        self.size = max(self.size, int(nbytes))
        self.reclaim()
        fit = [i for i, b in enumerate(self.free) if self._tensor(b).numel() >= nbytes]
        if fit:
            b = self.free.pop(fit[0])
            self.reuses += 1
        else:
            if self.free and len(self.free) + len(self.lent) >= self.cap:
                self.free.pop(0)  # too small: replaced by one of the new size
            if len(self.free) + len(self.lent) >= self.cap:
                self.misses += 1
                return self._new(nbytes)
            b = _Mapped(self.size) if self._alloc is None else self._alloc(self.size)
            self.allocations += 1
        self.lent.append(b)
        return self._tensor(b)[:nbytes]  # a view: while the caller holds it, the buffer's storage is not sole-owned

    def _new(self, nbytes: int) -> torch.Tensor:
        return _Mapped(nbytes).tensor if self._alloc is None else self._alloc(nbytes)

    def idle(self) -> None:
        """Between backward and the next forward: the free mapped buffers' pages leave the RSS (the nvme tier on a
        CPU-only machine: forward must not hold two idle blocks); pinned buffers stay as they are."""
        self.reclaim()
        for b in self.free:
            if isinstance(b, _Mapped):
                b.drop_pages()

    def close(self) -> None:
        self.free, self.lent = [], []


class EventWrite:
    """A device-to-host copy in flight, as the tier's write futures look: ``done`` / ``result`` (waits)."""

    __slots__ = ("event", "src")

    def __init__(self, event: torch.cuda.Event, src: torch.Tensor) -> None:
        self.event, self.src = event, src  # the device bytes being read, held until the copy is done

    def done(self) -> bool:
        return self.event.query()

    def result(self) -> None:
        self.event.synchronize()
        self.src = None

    def add_done_callback(self, fn: Callable[[Any], None]) -> None:  # no file to remove
        pass


class EventRead:
    """A host-to-device prefetch: ``result`` makes the current (compute) stream wait for it, without blocking the
    host, and returns the device bytes."""

    __slots__ = ("dev", "event")

    def __init__(self, dev: torch.Tensor, event: torch.cuda.Event) -> None:
        self.dev, self.event = dev, event

    def done(self) -> bool:
        return self.event.query()

    def result(self) -> torch.Tensor:
        compute = torch.cuda.current_stream(self.dev.device)
        compute.wait_event(self.event)
        # allocated on the side stream, used on the compute stream: the caching allocator must not hand its memory
        # to the side stream again before the compute stream's use of it is done
        self.dev.record_stream(compute)
        return self.dev


class CudaCopies:
    """One side stream for both directions, so a host buffer refilled in forward is ordered after the prefetch that
    read it in the step before, on the same stream, with no host synchronization.

    * Forward (:meth:`to_host`): an event recorded on the compute stream after the tensor was produced; the side
      stream waits for it, then copies into the pinned buffer. The caller holds the device tensor until the copy's
      event completes (the tier's ``_reap``): freeing it earlier would let the caching allocator hand its memory to
      the compute stream while the copy still reads it (torchtune's ``OffloadActivations(use_streams=True)`` NaN
      gradients, meta-pytorch/torchtune#1867).
    * Backward (:meth:`to_device`): the copy runs on the side stream; :class:`EventRead` makes the compute stream
      wait for its event where the tensor is used.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def to_host(self, src: torch.Tensor, host: torch.Tensor) -> EventWrite:
        """Copy the device bytes ``src`` (flat uint8) into the pinned ``host`` (flat uint8) on the side stream."""
        produced = torch.cuda.Event()
        produced.record(torch.cuda.current_stream(self.device))
        self.stream.wait_event(produced)
        with torch.cuda.stream(self.stream):
            host.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        return EventWrite(done, src)

    def to_device(self, host: torch.Tensor) -> EventRead:
        """Copy the pinned ``host`` bytes into a fresh device tensor on the side stream (after every copy into
        ``host`` queued there before)."""
        with torch.cuda.stream(self.stream):
            dev = torch.empty(host.numel(), dtype=torch.uint8, device=self.device)
            dev.copy_(host, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        return EventRead(dev, done)

    def synchronize(self) -> None:
        self.stream.synchronize()


def pinned(nbytes: int) -> torch.Tensor:
    """A page-locked uint8 host tensor (the accelerator tier's buffers)."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
