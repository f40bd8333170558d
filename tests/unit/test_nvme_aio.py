"""The NVMe tier's libaio backend (DeepSpeed's async_io op): byte-exact round trips, checked with plain file reads.

Skipped with the reason where the op cannot build (no ``libaio-dev``) or O_DIRECT does not work in the test's
directory; the thread-pool backend is tested in ``test_nvme.py`` always.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_v17.engine.offload.aio import AioIO, _aio_module, aio_backend_or_reason


def fs_type(path) -> str:
    """The file system type of ``path`` from /proc/mounts (longest mount-point prefix), "" where unknown."""
    path, best, kind = str(Path(path).resolve()), -1, ""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return ""
    for line in mounts:
        _, point, typ = line.split()[:3]
        if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) > best:
            best, kind = len(point), typ
    return kind


@pytest.fixture
def aio(tmp_path):
    """The backend itself, not behind the probe (which would turn a broken backend into a skip): skipped only where
    the op cannot build or the file system refuses O_DIRECT."""
    try:
        _aio_module()
    except Exception as err:  # noqa: BLE001
        pytest.skip(f"DeepSpeed's async_io op cannot build here: {str(err).splitlines()[0][:200]}")
    if fs_type(tmp_path) in ("tmpfs", "ramfs", ""):
        pytest.skip(f"{tmp_path} is on {fs_type(tmp_path) or 'an unknown file system'}: O_DIRECT not available")
    io = AioIO()
    yield io
    io.close()


def test_probe_accepts_a_working_backend(aio, tmp_path):
    io, reason = aio_backend_or_reason(tmp_path)
    assert io is not None and io.name == "deepspeed_aio", reason
    io.close()


@pytest.mark.parametrize("dtype,numel", [(torch.float32, 1000), (torch.bfloat16, 4097), (torch.float32, 1024)])
def test_round_trip_is_byte_exact_and_on_disk(aio, tmp_path, dtype, numel):
    g = torch.Generator().manual_seed(numel)
    src = torch.randn(numel, generator=g).to(dtype)
    path = tmp_path / "t.bin"
    aio.write(path, src).result()
    raw = path.read_bytes()  # an independent reader: the bytes on disk, padded with zeros to the alignment
    nbytes = src.numel() * src.element_size()
    assert len(raw) % aio.alignment == 0 and nbytes <= len(raw) < nbytes + aio.alignment
    assert raw[:nbytes] == src.view(torch.uint8).numpy().tobytes()
    assert raw[nbytes:] == bytes(len(raw) - nbytes)
    dst = torch.empty_like(src)
    ptr = dst.data_ptr()
    out = aio.read_into(path, dst).result()
    assert out is dst and dst.data_ptr() == ptr  # read in place: a shard's storage stays where its views point
    assert torch.equal(dst.view(torch.uint8), src.view(torch.uint8))
    fresh = aio.read(path, nbytes).result()
    assert fresh.dtype == torch.uint8 and torch.equal(fresh, src.view(torch.uint8))
    assert aio.bytes_written == nbytes and aio.bytes_read == 2 * nbytes


def test_rewrite_shorter_leaves_no_stale_tail_and_truncation_is_refused(aio, tmp_path):
    path = tmp_path / "t.bin"
    aio.write(path, torch.ones(5000)).result()
    aio.write(path, torch.full((10,), 2.0)).result()
    assert len(path.read_bytes()) == aio.alignment  # 40 bytes padded to one block, not the old 20000
    assert torch.equal(aio.read_into(path, torch.empty(10)).result(), torch.full((10,), 2.0))
    with pytest.raises(OSError, match="truncated"):
        aio.read_into(path, torch.empty(5000)).result()


def test_unavailable_reason_names_the_cause(tmp_path):
    io, reason = aio_backend_or_reason(Path(tmp_path) / "missing-dir")
    assert io is None and "async_io" in reason


def test_alloc_gives_page_locked_buffers_the_op_uses_directly(aio, tmp_path):
    """``alloc``'s buffers are what DeepSpeed's op reads and writes without its per-call bounce buffer (its own
    ``is_pinned`` predicate, the one ``cpu_op_desc_t`` applies), round-trip byte-exact, and are freed by ``free``."""
    buf = aio.alloc(3 * 4096)
    assert buf.numel() == 3 * 4096 and buf.data_ptr() % 4096 == 0
    assert aio._rh.is_pinned(buf) and aio._rh.is_pinned(buf[:4096])
    assert not aio._rh.is_pinned(torch.empty(3 * 4096, dtype=torch.uint8))  # an ordinary tensor would be bounced
    g = torch.Generator().manual_seed(3)
    buf.copy_(torch.randint(0, 256, (buf.numel(),), generator=g, dtype=torch.uint8))
    aio.write(tmp_path / "a.bin", buf).result()
    assert (tmp_path / "a.bin").read_bytes() == bytes(buf.tolist())
    (tmp_path / "b.bin").write_bytes(bytes(range(256)) * 48)  # written by plain Python, read into the buffer
    aio.read_into(tmp_path / "b.bin", buf).result()
    assert bytes(buf.tolist()) == bytes(range(256)) * 48
    aio.free(buf)
    assert not aio._locked


def test_alloc_falls_back_to_a_host_buffer_when_locking_is_refused(aio, caplog):
    class Refusing:
        def __init__(self, real):
            self.real = real

        def new_cpu_locked_tensor(self, *a):
            raise RuntimeError("mlock failed")

        def __getattr__(self, name):
            return getattr(self.real, name)

    from lightning_v17.engine.offload import aio as nvme_aio

    aio._rh = Refusing(aio._rh)
    nvme_aio._WARNED.clear()
    with caplog.at_level("WARNING", logger="lightning_v17.engine.offload.aio"):
        buf = aio.alloc(8192)
    assert buf.numel() == 8192 and not aio._rh.is_pinned(buf) and not aio._locked
    assert "no page-locked buffers" in caplog.text and "mlock failed" in caplog.text
    aio.free(buf)  # not one of the op's: nothing to free


@pytest.mark.parametrize("backend", ["thread_pool", "deepspeed_aio"])
def test_in_place_slots_at_an_offset_leave_the_rest_of_the_file(request, tmp_path, backend):
    """The parameter tier's unit files: slots written in place at page-aligned offsets (``write(..., offset=)``, no
    truncation) and read back from them (``read_into(..., offset=)``), checked against the bytes on disk read
    independently; the neighbouring slots keep their bytes; an offset off the O_DIRECT alignment is refused."""
    from lightning_v17.engine.offload.nvme import ThreadPoolIO

    io = request.getfixturevalue("aio") if backend == "deepspeed_aio" else ThreadPoolIO()
    path, slot = tmp_path / "unit.bin", 4096
    with open(path, "wb") as f:
        f.truncate(3 * slot)
    a, b = torch.arange(1024, dtype=torch.float32), -torch.arange(300, dtype=torch.float32)  # 4096 B, 1200 B
    io.write(path, a, offset=0).result()
    io.write(path, b, offset=2 * slot).result()
    raw = path.read_bytes()
    assert len(raw) == 3 * slot  # not truncated
    assert raw[:slot] == a.numpy().tobytes() and raw[slot : 2 * slot] == bytes(slot)
    assert raw[2 * slot : 2 * slot + 1200] == b.numpy().tobytes()
    got = torch.empty(300)
    assert torch.equal(io.read_into(path, got, offset=2 * slot).result(), b)
    assert torch.equal(io.read_into(path, torch.empty(1024), offset=0).result(), a)
    if backend == "deepspeed_aio":
        with pytest.raises(ValueError, match="not a multiple of the O_DIRECT alignment"):
            io.write(path, b, offset=100).result()
    else:
        io.close()
