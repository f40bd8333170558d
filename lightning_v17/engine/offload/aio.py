"""The NVMe tier's libaio backend: DeepSpeed's ``async_io`` op (DeepNVMe) behind :class:`~.nvme.ThreadPoolIO`'s API.

DeepSpeed's op opens files with ``O_DIRECT`` and submits libaio requests from its own C++ threads, so reads and
writes bypass the page cache and overlap compute without holding the GIL. It needs the Debian package
``libaio-dev`` to build (JIT, once, into ``~/.cache/torch_extensions``); :func:`aio_backend_or_reason` builds it and
probes it on the tier's own directory (``O_DIRECT`` is refused by some file systems, e.g. tmpfs), and the tier
falls back to the thread pool with the reason logged when anything fails.

``O_DIRECT`` transfers whole 512-byte blocks, so each file is written padded to :meth:`AioIO.alignment` bytes and
read back through an aligned bounce buffer when the tensor's size is not a multiple of it; file sizes on disk are
therefore rounded up (at most ``alignment - 1`` bytes per file).
"""

from __future__ import annotations

import functools
import logging
import tempfile
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from lightning_v17._extras import require
from lightning_v17.engine.offload.nvme import host_buffer, submit_io

__all__ = ["AioIO", "aio_backend_or_reason", "prebuild"]

log = logging.getLogger(__name__)

#: DeepSpeed's defaults for its swapper (``aio`` config section): 1 MiB blocks, queue depth 8, one thread per op
BLOCK_SIZE, QUEUE_DEPTH, INTRA_OP_PARALLELISM = 2**20, 8, 1


#: libaio's names: its soname, Ubuntu 24.04's (package libaio1t64), and the development symlink
_LIBAIO = ("libaio.so.1", "libaio.so.1t64", "libaio.so")


@functools.cache
def _aio_module():
    """DeepSpeed's ``async_io`` op, built once per machine (raises when it cannot build).

    Importing DeepSpeed costs each rank ~27 MiB of resident memory for the rest of the process (7% of a
    100M-parameter model's offloaded Adam moments per rank at ZeRO-3 on 2 ranks), so without libaio on the machine,
    where the op can neither build nor load, that is found out first with ``dlopen``. Where the op works it costs
    that import anyway: its first write imports DeepSpeed's logger (to warn about SSD wear)."""
    import ctypes

    for soname in _LIBAIO:
        try:
            ctypes.CDLL(soname)
            break
        except OSError:
            continue
    else:
        raise RuntimeError(f"libaio is not installed (none of {', '.join(_LIBAIO)} loads); install libaio-dev")
    op_builder = require("deepspeed.ops.op_builder", feature="the nvme tier's libaio backend (DeepSpeed's async_io op)")
    builder = op_builder.AsyncIOBuilder()
    if not builder.is_compatible(verbose=False):
        raise RuntimeError("DeepSpeed's async_io op is not compatible here (libaio-dev is missing)")
    return builder.load(verbose=False)


def prebuild() -> str:
    """Build DeepSpeed's ``async_io`` op now (``make``'s set-up calls this, so that no run or test pays for the JIT
    build): "built", or why it cannot be (e.g. ``libaio-dev`` missing: the nvme tier then uses the thread pool)."""
    try:
        _aio_module()
    except Exception as err:  # noqa: BLE001 - report, never fail the set-up
        return f"not available ({str(err).splitlines()[0][:200]}); the nvme tier uses the thread pool"
    return "built"


_UINT8 = torch.empty(0, dtype=torch.uint8)  # the dtype example new_cpu_locked_tensor takes
_WARNED: list[int] = []


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous CPU tensor (any dtype), sharing its memory."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("NVMe I/O needs a contiguous CPU tensor")
    return t.reshape(-1).view(torch.uint8)


class AioIO:
    """Whole-file reads and writes of CPU tensors through DeepSpeed's libaio op, one handle per direction.

    The same API as :class:`~.nvme.ThreadPoolIO` (``write``, ``read``, ``read_into``, ``close``, byte counters):
    each call returns a future, completed on a single-thread executor that runs the handle's synchronous parallel
    read or write (which releases the GIL while libaio works). Reads and writes have their own handles and threads,
    so a read ahead of use never waits behind a write-back.
    """

    name = "deepspeed_aio"

    def __init__(self) -> None:
        mod = _aio_module()
        self._rh = mod.aio_handle(BLOCK_SIZE, QUEUE_DEPTH, False, True, INTRA_OP_PARALLELISM)
        self._wh = mod.aio_handle(BLOCK_SIZE, QUEUE_DEPTH, False, True, INTRA_OP_PARALLELISM)
        self.alignment = int(self._rh.get_alignment())
        self._locked: dict[int, int] = {}  # data_ptr -> bytes of the page-locked buffers alloc handed out
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="v17-aio-read")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="v17-aio-write")
        self.bytes_read = self.bytes_written = 0

    def alloc(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of ``nbytes`` the op reads and writes directly: page-locked by DeepSpeed's pinned-tensor
        manager (``new_cpu_locked_tensor``), as DeepSpeed's own swap buffers are. The op copies any other CPU buffer
        through a bounce buffer it allocates, locks and frees on every call (on the I/O thread: the copies cost CPU
        and the freed bounce buffers grow that thread's malloc arena). Where ``mlock`` is refused (``ulimit -l``) it
        falls back to :func:`~.nvme.host_buffer`, logged once. Give it back with :meth:`free` once nothing views it."""
        try:
            t = self._rh.new_cpu_locked_tensor(max(nbytes, 1), _UINT8)  # at least 1 byte
        except RuntimeError as err:
            t, why = None, str(err).splitlines()[0][:200]
        else:
            why = "mlock refused (RLIMIT_MEMLOCK, see `ulimit -l`)"
        if t is None or t.data_ptr() == 0:
            if not _WARNED:
                _WARNED.append(1)
                log.warning("offload nvme tier: no page-locked buffers (%s): DeepSpeed's op copies through bounce "
                            "buffers", why)  # fmt: skip
            return host_buffer(nbytes)
        self._locked[t.data_ptr()] = nbytes
        return t  # not a slice: a view keeps its base alive, and the pool's "nothing else views it" check counts it

    def free(self, t: torch.Tensor) -> None:
        """Unlock and free a buffer from :meth:`alloc` (nothing may view it any more); others are left to the GC."""
        if self._locked.pop(t.data_ptr(), None) is not None:
            self._rh.free_cpu_locked_tensor(t)

    def _padded(self, n: int) -> int:
        return -(-n // self.alignment) * self.alignment

    def _write(self, path: Path, t: torch.Tensor, offset: int | None = None) -> int:
        src = _as_bytes(t)
        n = src.numel()
        buf = src
        if n % self.alignment:
            buf = host_buffer(self._padded(n))  # zero-filled: the padding stays 0
            buf[:n].copy_(src)
        if offset is None and path.exists() and path.stat().st_size != buf.numel():
            path.unlink()  # O_DIRECT writes do not truncate: a shorter file must not keep an old tail
        if (offset or 0) % self.alignment:
            raise ValueError(f"{path}: offset {offset} is not a multiple of the O_DIRECT alignment {self.alignment}")
        rc = self._wh.sync_pwrite(buf, str(path), offset or 0)
        size = path.stat().st_size if path.exists() else -1
        end = (offset or 0) + buf.numel()
        if rc < 0 or size < end or (offset is None and size != end):  # the op can report success for a refused write
            raise OSError(f"{path}: DeepSpeed async_io write of {buf.numel()} bytes failed (rc {rc}, file {size} B)")
        return n

    def _read(self, path: Path, t: torch.Tensor, offset: int = 0) -> torch.Tensor:
        dst = _as_bytes(t)
        n = dst.numel()
        m = self._padded(n)  # O_DIRECT reads whole blocks: the file holds them (written padded)
        if offset % self.alignment:
            raise ValueError(f"{path}: offset {offset} is not a multiple of the O_DIRECT alignment {self.alignment}")
        size = path.stat().st_size
        if size < offset + m:
            raise OSError(f"{path}: file ends at {size} of {offset + m} bytes (truncated offload file)")
        buf = dst if m == n else host_buffer(m)
        if self._rh.sync_pread(buf, str(path), offset) < 0:
            raise OSError(f"{path}: DeepSpeed async_io read of {buf.numel()} bytes failed")
        if buf is not dst:
            dst.copy_(buf[:n])
        return t

    def write(self, path: Path, t: torch.Tensor, offset: int | None = None) -> Future:
        """Write ``t``'s bytes to ``path`` asynchronously: the whole file (padded), or (``offset``, a multiple of
        :attr:`alignment`) in place at that byte of an existing file; the future holds ``t`` until done."""
        self.bytes_written += t.numel() * t.element_size()
        return submit_io(self._writer, self._write, path, t, offset)

    def read(self, path: Path, nbytes: int) -> Future:
        """Read ``path`` into a fresh uint8 tensor of ``nbytes`` asynchronously; the future's result is it."""
        self.bytes_read += nbytes
        return submit_io(self._reader, self._read, path, host_buffer(nbytes))

    def read_into(self, path: Path, t: torch.Tensor, offset: int = 0, *, after: Sequence[Future] = ()) -> Future:
        """Read ``path`` (from byte ``offset``, a multiple of :attr:`alignment`) into the existing contiguous CPU tensor
        ``t`` asynchronously; the result is ``t``. ``after``: futures the read waits for first, on the reader thread
        (:meth:`~.nvme.ThreadPoolIO.read_into`)."""
        self.bytes_read += t.numel() * t.element_size()
        return submit_io(self._reader, self._read, path, t, offset, after=after)

    def close(self) -> None:
        self._reader.shutdown(wait=True)
        self._writer.shutdown(wait=True)


def aio_backend_or_reason(folder: str | Path) -> tuple[AioIO | None, str]:
    """An :class:`AioIO` for ``folder`` when DeepSpeed's op builds and an O_DIRECT round trip of an unaligned tensor
    works there (the same object, kept), else ``(None, reason)``."""
    try:
        io = AioIO()
    except Exception as err:  # noqa: BLE001 - a probe: any failure means "use the thread pool"
        return None, f"DeepSpeed's async_io op is unavailable ({type(err).__name__}: {str(err).splitlines()[0][:200]})"
    try:
        with tempfile.TemporaryDirectory(dir=folder, prefix=".v17-aio-probe-") as d:
            src = torch.arange(1000, dtype=torch.float32)  # 4000 bytes: not a multiple of the alignment
            io.write(Path(d) / "probe", src).result()
            if not torch.equal(io.read_into(Path(d) / "probe", torch.empty_like(src)).result(), src):
                io.close()
                return None, "DeepSpeed's async_io op read back different bytes than it wrote"
    except Exception as err:  # noqa: BLE001
        io.close()
        return None, f"DeepSpeed's async_io op failed in {folder} ({type(err).__name__}: {err}; O_DIRECT unsupported?)"
    return io, "DeepSpeed's async_io op (libaio, O_DIRECT)"
