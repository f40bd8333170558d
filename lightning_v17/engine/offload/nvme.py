"""The NVMe tier (ZeRO-Infinity, Rajbhandari 2021 §5-§6): a per-rank set of files, asynchronous reads and writes.

* **Files.** :class:`NvmeFileSet` makes one run-specific folder per rank, ``<nvme_path>/v17-offload-<run>/rank<r>``,
  and removes it on :meth:`~NvmeFileSet.close` (the strategy's teardown, which Lightning also runs when ``fit``
  raises), at interpreter exit, and when the object is collected. A SIGKILLed run leaves its folder behind (nothing
  can run then); the checkpoint, not the tier, is what a resume reads (``engine/offload/optimizer.py``).
* **I/O.** :func:`~lightning_v17.engine.offload.tier_io.open_io` picks the backend once per tier folder:
  DeepSpeed's ``async_io`` op (libaio, O_DIRECT; :mod:`~lightning_v17.engine.offload.aio`) when it builds (it needs the Debian package ``libaio-dev``) and a probe round trip works in the
  folder, else :class:`ThreadPoolIO`: ``os.pwrite`` / ``os.preadv`` on a small thread pool (both release the GIL, so
  reads ahead of use and write-back overlap the optimizer's compute). The offload engines log the backend in use
  and the reason once.
* **Checks before step 0.** :func:`check_nvme_path`: the path exists, is a writable directory, and has room for the
  bytes the planner puts there plus a margin; each failure names the option and the fix. Then
  :func:`check_node_capacity`: the ranks of one host that offload to one drive need room for all their bytes together.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import shutil
import socket
import tempfile
import uuid
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from lightning_v17.config import V17ConfigError

__all__ = [
    "NvmeFileSet", "ThreadPoolIO", "check_node_capacity", "check_nvme_path", "free_margin_bytes", "host_buffer",
    "submit_io",
]  # fmt: skip

log = logging.getLogger(__name__)

#: free space kept on top of the planned bytes: 10% plus 64 MiB (file system metadata, other runs' growth)
MARGIN_FRACTION, MARGIN_BYTES = 0.10, 64 * 2**20


def free_margin_bytes(planned: int) -> int:
    """Bytes the drive must have free for ``planned`` bytes of offloaded state: the bytes plus the margin."""
    return int(planned * (1 + MARGIN_FRACTION)) + MARGIN_BYTES


def check_nvme_path(path: str | os.PathLike | None, *, need_bytes: int = 0, option: str = "nvme_path") -> Path:
    """Refuse, before step 0, an NVMe tier that cannot work: no path, a missing or unwritable one, a full drive.

    Args:
        path: the ``nvme_path`` option.
        need_bytes: bytes this rank will write there (the planner's count); checked with
            :func:`free_margin_bytes` against the drive's free space.
        option: the option's name, for the messages.

    Raises:
        V17ConfigError: naming the option, the value and the fix.
    """
    if not path:
        raise V17ConfigError(f"an 'nvme' offload tier needs {option}=<directory on a local NVMe drive>")
    p = Path(path)
    if not p.exists():
        raise V17ConfigError(f"{option}={str(path)!r} does not exist; create the directory or point {option} at one")
    if not p.is_dir():
        raise V17ConfigError(f"{option}={str(path)!r} is not a directory; point {option} at a directory")
    try:  # a real probe: os.access answers "writable" for root even where the file system refuses (sysfs, ro mounts)
        with tempfile.NamedTemporaryFile(dir=p, prefix=".v17-probe-"):
            pass
    except OSError as err:
        raise V17ConfigError(
            f"{option}={str(path)!r} is not writable by this process ({err.strerror}); fix its permissions or choose "
            "another directory"
        ) from err
    if need_bytes > 0:
        free = shutil.disk_usage(p).free
        need = free_margin_bytes(need_bytes)
        if free < need:
            raise V17ConfigError(
                f"{option}={str(path)!r} has {free / 2**30:.2f} GiB free, but this rank offloads "
                f"{need_bytes / 2**30:.2f} GiB there ({need / 2**30:.2f} GiB with a "
                f"{MARGIN_FRACTION:.0%} + {MARGIN_BYTES // 2**20} MiB margin); free space, choose a larger drive, "
                "lower OffloadPolicy(optimizer_ratio=...), or use OffloadPolicy(optimizer='cpu')"
            )
    return p


def check_node_capacity(
    path: str | os.PathLike, need_bytes: int, *, held_bytes: int = 0, option: str = "OffloadPolicy(nvme_path=...)"
) -> None:
    """Refuse, before step 0, a drive that holds one rank's offloaded bytes but not those of every rank of its host.

    Every rank calls this at the same point of setup (one ``all_gather_object`` over the default group): the ranks
    on this host whose ``path`` is on the same file system add their ``need_bytes``; the drive's free space now,
    plus the ``held_bytes`` their tier files already occupy (counted in the need, no longer free), must hold the sum
    and :func:`free_margin_bytes`' margin. Without a process group of more than one rank :func:`check_nvme_path`'s
    per-rank check is the whole check.

    Raises:
        V17ConfigError: naming the path, its free space, the ranks and their bytes, and the fixes.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    p = Path(path)
    key = (socket.gethostname(), os.stat(p).st_dev)
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, (key, int(need_bytes), int(held_bytes)))
    mine = [(need, held) for k, need, held in every if k == key]
    total = sum(need for need, _ in mine)
    if total == 0:
        return
    free = shutil.disk_usage(p).free + sum(held for _, held in mine)
    if free < free_margin_bytes(total):
        gib = 2**30
        raise V17ConfigError(
            f"{option}: {str(path)!r} has {free / gib:.2f} GiB free for the offload, but the {len(mine)} ranks on "
            f"this host offload {total / gib:.2f} GiB there together (this rank {int(need_bytes) / gib:.2f} GiB; "
            f"{free_margin_bytes(total) / gib:.2f} GiB with a {MARGIN_FRACTION:.0%} + {MARGIN_BYTES // 2**20} MiB "
            "margin); free space, give the ranks nvme_path directories on different drives, use more nodes, lower "
            "OffloadPolicy(optimizer_ratio=...), or offload to 'cpu'"
        )


#: buffers of at least this many bytes get their own anonymous mapping (host_buffer)
HOST_BUFFER_MMAP_BYTES = 2**20


def host_buffer(nbytes: int, *, mmap_from: int = HOST_BUFFER_MMAP_BYTES) -> torch.Tensor:
    """A uint8 host tensor of ``nbytes`` for the tier's I/O: from ``mmap_from`` bytes up in its own anonymous ``mmap``
    (zero-filled, page-aligned as O_DIRECT wants), unmapped, so returned to the OS, as soon as the last tensor viewing
    it is freed, whatever glibc's malloc settings (a freed heap buffer may stay in the process and keep the RSS up)."""
    if nbytes < mmap_from:
        return torch.zeros(nbytes, dtype=torch.uint8)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)


def submit_io(
    executor: ThreadPoolExecutor, fn: Callable[..., Any], path: Path, t: torch.Tensor, *args: Any,
    after: Sequence[Future] = (),
) -> Future:  # fmt: skip
    """``executor.submit(fn, path, t, *args)``, but the tensor is handed over in a box ``fn``'s call empties, and,
    with ``after``, only once those futures are done (their errors raised first).

    The box: an executor's work item keeps its arguments until *after* it has completed the future, so a caller woken
    by the result could still see the tensor's storage viewed by the worker, and take a buffer a write-back has
    finished with for one something else still views (the pool refills only buffers nothing else views:
    ``host_buffers.sole_owner``). ``after``: a read into a buffer that a write-back still reads from, or from a file
    still being written, waits on the I/O thread instead of the training thread; the writer never waits for a
    reader, so the two threads cannot deadlock."""
    box, futures = [t], tuple(after)

    def run() -> Any:
        for f in futures:
            f.result()
        return fn(path, box.pop(), *args)

    return executor.submit(run)


def _as_bytes(t: torch.Tensor) -> memoryview:
    """A writable/readable byte view of a contiguous CPU tensor's memory (any dtype, bf16 included); the caller keeps
    ``t`` alive while the view is used. Through ctypes, not ``Tensor.numpy()``: exporting a storage to numpy marks it
    non-resizable for good, and the parameter tier frees and refills shard storages with ``resize_``."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("NVMe I/O needs a contiguous CPU tensor")
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


class ThreadPoolIO:
    """Asynchronous whole-file reads and writes of CPU tensors with ``os.pwrite`` / ``os.preadv`` on threads.

    Reads and writes run on separate single-thread pools, so a read ahead of use never waits behind a write-back.

    Args:
        fsync: ``os.fsync`` after each write (off by default: the tier is scratch space, not a checkpoint; a crash
            loses it either way).
    """

    name = "threadpool"

    def __init__(self, *, fsync: bool = False) -> None:
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="v17-nvme-read")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="v17-nvme-write")
        self.fsync = fsync
        self.bytes_read = self.bytes_written = 0

    @staticmethod
    def _write(path: Path, t: torch.Tensor, fsync: bool, offset: int | None = None) -> int:
        buf = _as_bytes(t)
        flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if offset is None else 0)
        fd = os.open(path, flags, 0o600)
        try:
            off, at = 0, offset or 0
            while off < len(buf):
                off += os.pwrite(fd, buf[off:], at + off)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        return off

    @staticmethod
    def _read(path: Path, t: torch.Tensor, offset: int = 0) -> torch.Tensor:
        buf = _as_bytes(t)
        fd = os.open(path, os.O_RDONLY)
        try:
            off = 0
            while off < len(buf):
                n = os.preadv(fd, [buf[off:]], offset + off)
                if n == 0:
                    raise OSError(f"{path}: file ends at {offset + off} of {offset + len(buf)} bytes (truncated offload file)")
                off += n
        finally:
            os.close(fd)
        return t

    @staticmethod
    def alloc(nbytes: int) -> torch.Tensor:
        """A buffer for this backend's reads and writes (:func:`host_buffer`: page-aligned, its own mapping)."""
        return host_buffer(nbytes)

    @staticmethod
    def free(t: torch.Tensor) -> None:
        """Nothing to do: the mapping is unmapped with the last tensor viewing it."""

    def write(self, path: Path, t: torch.Tensor, offset: int | None = None) -> Future:
        """Write ``t``'s bytes to ``path`` asynchronously: the whole file, or (``offset``) in place at that byte of
        an existing file; the future holds ``t`` until done."""
        self.bytes_written += t.numel() * t.element_size()
        return submit_io(self._writer, self._write, path, t, self.fsync, offset)

    def read(self, path: Path, nbytes: int) -> Future:
        """Read ``path`` into a fresh uint8 tensor of ``nbytes`` asynchronously; the future's result is it."""
        self.bytes_read += nbytes
        return submit_io(self._reader, self._read, path, host_buffer(nbytes))

    def read_into(self, path: Path, t: torch.Tensor, offset: int = 0, *, after: Sequence[Future] = ()) -> Future:
        """Read ``path`` (from byte ``offset``) into the existing contiguous CPU tensor ``t`` (its bytes)
        asynchronously; the result is ``t``. The caller must not touch ``t`` until the future is done. ``after``:
        futures (write-backs, e.g. of ``t``'s previous bytes or of ``path``) the read waits for on the reader thread
        first, without blocking the caller; a failed one fails the read with its error."""
        self.bytes_read += t.numel() * t.element_size()
        return submit_io(self._reader, self._read, path, t, offset, after=after)

    def close(self) -> None:
        self._reader.shutdown(wait=True)
        self._writer.shutdown(wait=True)


def _remove(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)
    try:
        folder.parent.rmdir()  # the run folder, once the last rank's folder is gone
    except OSError:
        pass


class NvmeFileSet:
    """One rank's files under ``<nvme_path>/v17-offload-<run>/rank<rank>``, removed on close or exit.

    Args:
        nvme_path: the checked ``nvme_path`` directory.
        rank: this process's global rank (names its folder).
        run: the run's name (default: a fresh random id per process, so that runs never share files).
    """

    def __init__(self, nvme_path: str | os.PathLike, *, rank: int, run: str | None = None) -> None:
        run = run or uuid.uuid4().hex[:12]
        self.folder = Path(nvme_path) / f"v17-offload-{run}" / f"rank{rank}"
        try:
            self.folder.mkdir(parents=True, exist_ok=False)
        except OSError as err:
            raise V17ConfigError(
                f"nvme_path={str(nvme_path)!r}: cannot create the offload folder {self.folder} ({err}); fix the "
                "directory's permissions or choose another nvme_path"
            ) from err
        # runs at close(), when this object is collected, or at interpreter exit (finalize's own atexit hook)
        self._finalizer = weakref.finalize(self, _remove, self.folder)

    def path(self, name: str) -> Path:
        return self.folder / name

    def disk_bytes(self) -> int:
        """Bytes of the files in this rank's folder now."""
        return sum(f.stat().st_size for f in self.folder.iterdir()) if self.folder.exists() else 0

    def allocated_bytes(self) -> int:
        """Bytes the drive has given this rank's files now (sparse files count only what was written)."""
        return sum(f.stat().st_blocks * 512 for f in self.folder.iterdir()) if self.folder.exists() else 0

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Remove the folder (idempotent)."""
        self._finalizer()
