"""Host memory of the offload tiers: glibc's malloc settings, and the pool of chunk buffers (DeepSpeed's swap buffers).

* **glibc.** :func:`own_mappings` (the optimizer tier's first step and checkpoint loads: the state the optimizer
  creates on the heap leaves as its own mappings instead of fragmenting the heap), :func:`fix_mmap_threshold` (the
  parameter tier, for the whole process), :func:`trim_heap`; neither raises a threshold the user fixed in the
  environment (:func:`user_mmap_threshold`). Why and what they cost: ``engine/offload/optimizer.py``.
* **The pool.** :class:`BufferPool` hands out buffers from the tier's I/O backend (``alloc``: page-locked for
  DeepSpeed's op, anonymous mappings for the thread pool), takes back the buffers of finished write-backs, and
  refills a buffer only when nothing else views it (:func:`sole_owner`).
"""

from __future__ import annotations

import ctypes
import functools
import math
import threading
from collections.abc import Callable, Generator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

import torch

from lightning_v17.engine.offload import nvme

__all__ = [
    "HEAP_MMAP_THRESHOLD", "AfterWrite", "BufferPool", "PooledRead", "fix_mmap_threshold", "mapped_empty", "own_mappings",
    "sole_owner", "trim_heap", "user_mmap_threshold",
]  # fmt: skip


# ------------------------------------------------------------------------------------------------ glibc memory
@functools.cache
def _libc() -> Any:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt  # noqa: B018 - glibc only
        libc.malloc_trim  # noqa: B018
        return libc
    except (OSError, AttributeError):
        return None


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameter numbers (malloc.h)
#: glibc's largest dynamic mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX): what a process that frees large
#: blocks ends up with, and the threshold after :func:`own_mappings`
HEAP_MMAP_THRESHOLD = 32 * 2**20
_FIXED: list[int] = []  # the threshold fix_mmap_threshold set for the whole process, if it did


def _env_threshold(environ: dict[str, str]) -> int | None:
    """The mmap threshold ``environ`` fixes for glibc (``GLIBC_TUNABLES=glibc.malloc.mmap_threshold=N``, else the
    older alias ``MALLOC_MMAP_THRESHOLD_=N``), or None."""
    for item in environ.get("GLIBC_TUNABLES", "").split(":"):
        name, _, value = item.partition("=")
        if name == "glibc.malloc.mmap_threshold":
            try:
                return int(value, 0)
            except ValueError:
                return None
    try:
        return int(environ["MALLOC_MMAP_THRESHOLD_"], 0)
    except (KeyError, ValueError):
        return None


@functools.cache
def user_mmap_threshold() -> int | None:
    """The mmap threshold the user fixed for this process through its environment (what glibc read when the process
    started: ``/proc/self/environ``, as a forked worker inherits it; a later change of ``os.environ`` is not glibc's),
    or None. glibc has no getter for the threshold, so one set with ``mallopt`` from inside the process is unknown
    here: set it in the environment, and the tiers keep it."""
    try:
        with open("/proc/self/environ", "rb") as f:
            pairs = [kv.decode(errors="replace").partition("=") for kv in f.read().split(b"\0") if kv]
        environ = {k: v for k, _, v in pairs}
    except OSError:
        import os

        environ = dict(os.environ)
    return _env_threshold(environ)


def _kept_threshold() -> int | None:
    """The process-wide threshold :func:`own_mappings` must leave in place at its end: one fixed by the user's
    environment or by :func:`fix_mmap_threshold` (the lower: the lower maps more)."""
    fixed = [t for t in (user_mmap_threshold(), *_FIXED) if t is not None]
    return min(fixed) if fixed else None


@functools.cache
def fix_mmap_threshold(nbytes: int = 2**20) -> bool:
    """glibc: serve allocations of ``nbytes`` or more with their own mmap, returned to the OS when freed (and stop
    glibc's dynamic threshold raise), for the rest of the process (the parameter tier: it frees and refills shard
    storages every step). A lower threshold the user's environment fixed stays (it maps more). Once per process;
    False where it is not glibc."""
    libc = _libc()
    user = user_mmap_threshold()
    if libc is not None and user is not None and user <= nbytes:
        _FIXED.append(user)
        return True
    ok = bool(libc is not None and libc.mallopt(M_MMAP_THRESHOLD, nbytes))
    if ok:
        _FIXED.append(nbytes)
    return ok


_SCOPES = [0]  # own_mappings scopes open now (any thread): the threshold is restored when the last one closes
_SCOPES_LOCK = threading.Lock()


@contextmanager
def own_mappings(nbytes: int = 2**20) -> Generator[None, None, None]:
    """glibc: inside, allocations of ``nbytes`` or more get their own mapping, unmapped (so out of the RSS) when
    freed; afterwards the threshold is the one the process had fixed (:func:`user_mmap_threshold`: the user's
    environment, or :func:`fix_mmap_threshold`), else :data:`HEAP_MMAP_THRESHOLD` and the trim threshold twice that,
    what glibc's dynamic adjustment reaches by itself (``mallopt`` ends that adjustment for good). Nothing where the
    fixed threshold is already ``nbytes`` or lower, or where it is not glibc.

    A threshold the user set (e.g. ``MALLOC_MMAP_THRESHOLD_=65536``, so that freed tensors leave the process) is
    never replaced by a higher one: the heap would keep what the user asked to give back (a 100M-parameter MLP at
    ZeRO-3 with the optimizer on nvme: the heap grew by 90 MiB, a quarter of the offloaded Adam moments).

    The setting is the process's (every thread), so scopes nest and overlap: the threshold goes back only when the
    last open scope closes (a buffer allocated inside backward's scope must not end backward's)."""
    libc = _libc()
    kept = _kept_threshold()
    if libc is None or (kept is not None and kept <= nbytes):
        yield
        return
    with _SCOPES_LOCK:
        _SCOPES[0] += 1
        libc.mallopt(M_MMAP_THRESHOLD, nbytes)
    try:
        yield
    finally:
        with _SCOPES_LOCK:
            _SCOPES[0] -= 1
            if not _SCOPES[0]:
                kept = _kept_threshold()
                if kept is not None:
                    libc.mallopt(M_MMAP_THRESHOLD, kept)  # the trim threshold is the user's: untouched
                else:
                    libc.mallopt(M_MMAP_THRESHOLD, HEAP_MMAP_THRESHOLD)
                    libc.mallopt(M_TRIM_THRESHOLD, 2 * HEAP_MMAP_THRESHOLD)


def mapped_empty(size: Any, *, dtype: torch.dtype, min_bytes: int = 2**20) -> torch.Tensor:
    """An uninitialised CPU tensor of ``size``: its own anonymous mapping (zero-filled, unmapped when the last view of
    it is freed, whatever glibc's settings) when it has ``min_bytes`` or more, else ``torch.empty``."""
    shape = (size,) if isinstance(size, int) else tuple(size)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < min_bytes:
        return torch.empty(shape, dtype=dtype)
    return nvme.host_buffer(nbytes, mmap_from=min_bytes).view(dtype).view(shape)


def trim_heap() -> None:
    """glibc ``malloc_trim(0)``: give freed heap memory back to the OS."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


# ------------------------------------------------------------------------------------------------ the pool
def sole_owner(buf: torch.Tensor) -> bool:
    """Whether nothing but ``buf`` holds its storage (no state tensor or state dict a caller kept still views it), so
    a read of another chunk may refill it. Without torch's use count (a private API) nothing is reused."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)  # <= 2: buf's own and the temporary storage object
    return use_count is not None and use_count(buf.untyped_storage()._cdata) <= 2


class BufferPool:
    """At most ``cap`` chunk buffers from an I/O backend, recycled (DeepSpeed's swap buffers).

    The caller passes its backend to each call (``io.alloc(nbytes)`` / ``io.free(buf)``; a backend without them gets
    :func:`~.nvme.host_buffer`), so a backend swapped in later is the one used.

    Args:
        cap: buffers held at most (the optimizer tier: ``buffer_count``, every chunk stepping, read ahead or being
            written back; ``OffloadPolicy.buffer_count`` states the bound in bytes).
    """

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.owned: dict[int, torch.Tensor] = {}  # id -> every buffer of the pool
        self.free: list[torch.Tensor] = []  # owned buffers no chunk holds now
        self.retired: list[torch.Tensor] = []  # buffers something else still viewed: freed once nothing does
        self.allocations = 0  # buffers allocated through the backend, ever

    def take(self, nbytes: int, io: Any, *, size: int = 0) -> torch.Tensor | None:
        """A buffer of at least ``nbytes``: the smallest free one that fits, else a new one while fewer than ``cap``
        are owned (a free one too small is given back first), as large as ``size``, ``nbytes`` and the largest owned
        (chunk sizes differ: the buffers converge to the largest); None when all ``cap`` are in use."""
        fit = [i for i, b in enumerate(self.free) if b.numel() >= nbytes]
        if fit:  # list.remove would compare tensors by value
            return self.free.pop(min(fit, key=lambda i: self.free[i].numel()))
        if len(self.owned) >= self.cap and self.free:
            self.release(self.free.pop(0), io)  # too small for this chunk
        if len(self.owned) >= self.cap:
            return None
        size = max([nbytes, size, *(b.numel() for b in self.owned.values())])
        with own_mappings():  # DeepSpeed's locked buffers come from malloc: not pinned inside the heap
            buf = getattr(io, "alloc", nvme.host_buffer)(size)
        self.owned[id(buf)] = buf
        self.allocations += 1
        return buf

    def take_or_wait(self, nbytes: int, io: Any, wait_for_one: Callable[[], bool], *, size: int = 0) -> torch.Tensor:
        """:meth:`take`, waiting for write-backs (``wait_for_one``: wait for the oldest; False when none is in
        flight) until a buffer is back; else a plain :func:`~.nvme.host_buffer` outside the pool (more chunks in
        memory at once than the step needs: a checkpoint's whole state)."""
        while True:
            buf = self.take(nbytes, io, size=size)
            if buf is not None:
                return buf
            if not wait_for_one():
                return nvme.host_buffer(nbytes)

    def retire(self, buf: torch.Tensor) -> None:
        """``buf`` is never refilled (something else views it: a state tensor a caller kept); it stops counting
        against ``cap`` and is freed once nothing views it."""
        if self.owned.pop(id(buf), None) is not None:
            self.retired.append(buf)

    def give_back(self, buf: torch.Tensor, io: Any) -> None:
        """A finished write-back's buffer: free for the next read when nothing else views it, else retired (never
        refilled; freed once nothing views it). A buffer from outside the pool is left to the GC."""
        if id(buf) in self.owned:
            if sole_owner(buf):
                self.free.append(buf)
            else:
                del self.owned[id(buf)]
                self.retired.append(buf)
        if self.retired:
            gone = [b for b in self.retired if sole_owner(b)]
            self.retired = [b for b in self.retired if not sole_owner(b)]
            for b in gone:
                _free(b, io)

    def release(self, buf: torch.Tensor, io: Any) -> None:
        """Give an owned buffer nothing views back to the backend (DeepSpeed's op unlocks and frees it)."""
        self.owned.pop(id(buf), None)
        _free(buf, io)

    def shrink(self, io: Any) -> None:
        """Give every free buffer back to the backend (the tier calls it once the step's reads ahead are issued:
        forward and backward, where a process's memory peaks, then hold no idle buffer; the step allocates what it
        needs again)."""
        while self.free:
            self.release(self.free.pop(), io)

    def close(self, io: Any) -> None:
        """Free every buffer nothing else views (free ones, finished reads ahead, retired ones). Buffers a chunk's
        installed state still holds stay (the optimizer keeps using them; DeepSpeed's manager frees its locked ones
        at exit)."""
        for buf in [*self.owned.values(), *self.retired]:
            if sole_owner(buf):
                self.release(buf, io)
        self.free, self.retired = [], []


def _free(buf: torch.Tensor, io: Any) -> None:
    free = getattr(io, "free", None)
    if free is not None:
        free(buf)


class PooledRead:
    """A chunk's read into (a prefix of) a pooled buffer: ``result`` waits for it and returns the whole buffer."""

    def __init__(self, read: Future, buf: torch.Tensor) -> None:
        self.read, self.buf = read, buf

    def result(self) -> torch.Tensor:
        self.read.result()
        return self.buf


class AfterWrite:
    """A read of a chunk whose write-back is still in flight: its result is the buffer being written, once written
    (``result`` re-raises a failed write, as the write's own future would)."""

    def __init__(self, write: Future, buf: torch.Tensor) -> None:
        self.write, self.buf = write, buf

    def result(self) -> torch.Tensor:
        self.write.result()
        return self.buf
