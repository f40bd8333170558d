"""The NVMe tier's files, I/O and checks (``lightning_v17/engine/offload/nvme.py``), and the offload options' errors before
training starts (V17Strategy construction, the DeepSpeed config mapping). Real files under pytest's tmp_path."""

from __future__ import annotations

import gc
import shutil

import pytest
import torch

from lightning_v17.config import OffloadPolicy, ParallelDims, Tier, V17ConfigError
from lightning_v17.engine.offload.nvme import NvmeFileSet, ThreadPoolIO, check_nvme_path, free_margin_bytes
from lightning_v17.engine.offload.tier_io import open_io
from tests.unit.test_nvme_aio import fs_type


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8, torch.int64])
def test_threadpool_io_round_trip(tmp_path, dtype) -> None:
    io = ThreadPoolIO()
    t = (torch.randn(3, 1001) * 50).to(dtype)
    nbytes = t.numel() * t.element_size()
    assert io.write(tmp_path / "a.bin", t).result() == nbytes
    assert (tmp_path / "a.bin").stat().st_size == nbytes
    back = io.read(tmp_path / "a.bin", nbytes).result()
    assert back.dtype == torch.uint8 and torch.equal(back.view(dtype).view(t.shape), t)
    with pytest.raises(OSError, match="truncated offload file"):
        io.read(tmp_path / "a.bin", nbytes + 8).result()
    io.close()


def test_a_read_after_writes_waits_for_them_on_the_reader_thread(tmp_path) -> None:
    """``read_into(after=...)`` returns at once and reads only once the given write-backs are done (the buffer it
    refills is theirs); a failed one fails the read with its own error."""
    from concurrent.futures import Future

    io = ThreadPoolIO()
    src = torch.arange(1000, dtype=torch.float32)
    io.write(tmp_path / "a.bin", src).result()
    pending, dst = Future(), torch.zeros(1000)
    read = io.read_into(tmp_path / "a.bin", dst, after=[pending])
    assert not read.done() and not dst.any(), "the read did not wait for the write-back it was given"
    pending.set_result(4000)
    assert torch.equal(read.result(timeout=30), src)
    failed = Future()
    failed.set_exception(OSError("disk full"))
    with pytest.raises(OSError, match="disk full"):
        io.read_into(tmp_path / "a.bin", dst, after=[failed]).result(timeout=30)
    io.close()


def test_a_finished_io_leaves_no_view_of_its_tensor_behind() -> None:
    """An executor's work item may keep its arguments after it completed its future (a thread pool's worker drops
    them only after setting the result): ``submit_io`` hands the tensor over in a box the call empties, so once the
    future is done nothing but the caller views the buffer, and the pool may refill it (``sole_owner``). Checked with
    an executor that keeps every work item forever, the worst case of that race."""
    from concurrent.futures import Future

    from lightning_v17.engine.offload.host_memory import sole_owner
    from lightning_v17.engine.offload.nvme import host_buffer, submit_io

    class KeepsWorkItems:
        def __init__(self) -> None:
            self.kept: list = []

        def submit(self, fn, *args):
            self.kept.append((fn, args))
            fut = Future()
            fut.set_result(fn(*args))
            return fut

    ex, buf = KeepsWorkItems(), host_buffer(2**20)
    assert submit_io(ex, lambda path, t: t.numel(), None, buf[:4096]).result() == 4096
    assert ex.kept and sole_owner(buf), "the finished I/O's work item still views the buffer"


def test_backend_is_named_and_libaio_used_where_it_builds(tmp_path) -> None:
    io, reason = open_io(tmp_path)
    try:
        assert "async_io" in reason
        try:
            from deepspeed.ops.op_builder import AsyncIOBuilder

            has_libaio = AsyncIOBuilder().is_compatible(verbose=False)
        except Exception:  # noqa: BLE001 - no DeepSpeed op builder: the thread pool is the only backend
            has_libaio = False
        # libaio-dev present: the tier uses it unless the folder's file system refuses O_DIRECT (tmpfs; the reason
        # says so); absent: the thread pool, with the reason
        if has_libaio and fs_type(tmp_path) not in ("tmpfs", "ramfs", ""):
            assert io.name == "deepspeed_aio", (io.name, reason)
        else:
            assert io.name == "threadpool", (io.name, reason)
    finally:
        io.close()


def test_check_nvme_path_errors_name_the_option(tmp_path) -> None:
    with pytest.raises(V17ConfigError, match=r"needs nvme_path="):
        check_nvme_path(None)
    with pytest.raises(V17ConfigError, match=r"nvme_path='.*missing' does not exist"):
        check_nvme_path(tmp_path / "missing")
    (tmp_path / "f").write_text("x")
    with pytest.raises(V17ConfigError, match=r"nvme_path=.* is not a directory"):
        check_nvme_path(tmp_path / "f")
    # sysfs refuses new files even to root (os.access would say "writable" there): the probe is a real file
    with pytest.raises(V17ConfigError, match=r"nvme_path='/sys' is not writable"):
        check_nvme_path("/sys")
    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(V17ConfigError, match=r"GiB free, but this rank offloads .*OffloadPolicy\(optimizer_ratio="):
        check_nvme_path(tmp_path, need_bytes=free)  # fits without the margin, not with it
    assert check_nvme_path(tmp_path, need_bytes=free // 4) == tmp_path
    assert free_margin_bytes(2**30) == int(2**30 * 1.1) + 64 * 2**20
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]  # probes leave nothing behind


def test_file_sets_are_per_run_and_removed(tmp_path) -> None:
    a, b = NvmeFileSet(tmp_path, rank=0), NvmeFileSet(tmp_path, rank=0)
    assert a.folder != b.folder and a.folder.name == "rank0" and a.folder.parent.name.startswith("v17-offload-")
    a.path("x.bin").write_bytes(b"1234")
    assert a.disk_bytes() == 4
    a.close()
    a.close()  # idempotent
    assert not a.folder.exists() and not a.folder.parent.exists() and a.closed
    folder = b.folder
    del b
    gc.collect()
    assert not folder.exists()  # collected: removed too (and at interpreter exit)


def test_offload_policy_values() -> None:
    p = OffloadPolicy(optimizer="nvme", nvme_path="/x", optimizer_ratio=0.25, buffer_count=3)
    assert (p.optimizer, p.optimizer_ratio, p.buffer_count) == (Tier.NVME, 0.25, 3)
    assert p.host_memory is None and OffloadPolicy(optimizer="nvme", nvme_path="/x", host_memory="recycle").host_memory
    assert OffloadPolicy(params="nvme", nvme_path="/x", host_memory="recycle").host_memory == "recycle"
    for kw, match in (
        ({"optimizer": "nvme", "nvme_path": "/x", "optimizer_ratio": 0.0}, r"\(optimizer_ratio=0.0\) must be"),
        ({"optimizer": "nvme", "nvme_path": "/x", "optimizer_ratio": 1.5}, r"\(optimizer_ratio=1.5\) must be"),
        ({"optimizer_ratio": 0.5}, r"OffloadPolicy\(optimizer_ratio=0.5\) splits an offloaded optimizer state"),
        ({"optimizer": "cpu", "buffer_count": 1}, r"OffloadPolicy\(buffer_count=1\) must be an integer >= 2"),
        ({"optimizer": "cpu", "chunk_mb": 0}, r"OffloadPolicy\(chunk_mb=0\) must be a positive"),
        ({"optimizer": "nvme"}, r"an 'nvme' offload tier needs OffloadPolicy\(nvme_path="),
        ({"optimizer": "nvme", "nvme_path": "/x", "host_memory": "keep"}, r"OffloadPolicy\(host_memory='keep'\) is not supported; choose one of 'return', 'recycle'"),
        ({"optimizer": "cpu", "host_memory": "recycle"}, r"sets glibc's malloc for an nvme tier, and there is none"),
    ):
        with pytest.raises(V17ConfigError, match=match):
            OffloadPolicy(**kw)


def test_strategy_refuses_before_training(tmp_path) -> None:
    from lightning_v17.strategies import V17Strategy

    from tests._strategy import v17  # the cases are flat option dicts

    cases = [
        ({"offload_optimizer": "nvme"}, r"needs OffloadPolicy\(nvme_path="),
        ({"offload_optimizer": "nvme", "nvme_path": str(tmp_path / "nope")}, r"nvme_path=.* does not exist"),
        ({"offload_optimizer": "nvme", "nvme_path": "/sys"}, r"nvme_path='/sys' is not writable"),
        ({"zero_stage": 2, "offload_params": "nvme", "nvme_path": str(tmp_path)},
         r"OffloadPolicy\(params='nvme'\) .* needs zero_stage=3 \(got 2\)"),
        ({"zero_stage": 1, "offload_params": "cpu"}, r"OffloadPolicy\(params='cpu'\) .* needs zero_stage=3"),
        ({"offload_optimizer_ratio": 0.5}, r"splits an offloaded optimizer state"),
    ]  # fmt: skip
    for kw, match in cases:
        with pytest.raises(V17ConfigError, match=match):
            v17(**kw)
    for stage in (1, 2, 3):
        s = V17Strategy(zero_stage=stage, offload=OffloadPolicy(optimizer="nvme", nvme_path=str(tmp_path),
                                                                optimizer_ratio=0.5))  # fmt: skip
        assert (s.policy.offload.optimizer, s.policy.offload.optimizer_ratio) == (Tier.NVME, 0.5)
        cpu = V17Strategy(zero_stage=stage, offload=OffloadPolicy(optimizer="cpu"))
        assert cpu.policy.offload.optimizer == Tier.CPU
    assert not list(tmp_path.iterdir())  # construction creates no files (each rank does, at setup)


def test_deepspeed_offload_keys_map_onto_the_policy(tmp_path) -> None:
    from lightning_v17.config.deepspeed import from_deepspeed_config

    cfg = {"zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path), "pin_memory": True, "buffer_count": 4,
                              "ratio": 0.3},
        "offload_param": {"device": "cpu", "pin_memory": True, "buffer_count": 5},
    }}  # fmt: skip
    with pytest.warns(UserWarning) as rec:
        p = from_deepspeed_config(cfg)
    off = p.offload
    assert (off.optimizer, off.params, off.nvme_path) == (Tier.NVME, Tier.CPU, str(tmp_path))
    assert (off.optimizer_ratio, off.buffer_count) == (0.3, 4)
    msgs = [str(w.message) for w in rec]
    no_effect = [m for m in msgs if "without effect" in m]
    assert len(no_effect) == 1, msgs
    for key in ("offload_optimizer.pin_memory", "offload_param.pin_memory", "offload_param.buffer_count"):
        assert key in no_effect[0]
    assert not any("not supported by lightning-v17" in m for m in msgs), msgs  # every offload key is known
    from lightning_v17.strategies import V17Strategy

    with pytest.warns(UserWarning):
        s = V17Strategy(config=cfg)
    assert s.policy.offload.optimizer_ratio == 0.3


def test_read_into_fills_a_shard_storage_in_place_and_keeps_it_resizable(tmp_path) -> None:
    """The parameter tier frees and refills a shard's storage with ``resize_`` and reads into it: the I/O must not
    pin the storage (``Tensor.numpy()`` would mark it non-resizable for good)."""
    io = ThreadPoolIO()
    padded = torch.randn(2000)
    view = padded[:1500]  # FSDP2's sharded parameter: a view of the padded shard
    want = view.clone()
    storage = padded.untyped_storage()
    byte_view = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))
    io.write(tmp_path / "p.bin", byte_view).result()
    storage.resize_(0)  # freed: the view keeps its metadata only
    assert storage.nbytes() == 0 and view.shape == (1500,)
    storage.resize_(8000)
    byte_view = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (8000,), (1,))
    io.read_into(tmp_path / "p.bin", byte_view).result()
    assert torch.equal(view, want)  # the same view object sees the refilled bytes
    storage.resize_(0)  # still resizable after the I/O
    io.close()


def test_param_offload_refused_before_training(tmp_path) -> None:
    """offload_params='nvme': below stage 3, without nvme_path, a missing or unwritable path (construction); fp8
    (parallelize's composition check, before any process touches the model; pp > 1 needs zero_stage <= 1 anyway). A too-small drive is refused in
    setup, before step 0 (tests/dist/test_offload_optimizer.py::test_params_on_a_too_small_drive_...)."""
    from lightning_v17.strategies import V17Strategy

    from lightning_v17.config import FP8Policy, TrainingPolicy
    from lightning_v17.engine.parallelize import check_composition
    from tests._strategy import v17  # the cases are flat option dicts

    cases = [
        ({"zero_stage": 2, "offload_params": "nvme", "nvme_path": str(tmp_path)},
         r"OffloadPolicy\(params='nvme'\) .* needs zero_stage=3 \(got 2\)"),
        ({"offload_params": "nvme"}, r"an 'nvme' offload tier needs OffloadPolicy\(nvme_path="),
        ({"offload_params": "nvme", "nvme_path": str(tmp_path / "nope")}, r"nvme_path=.* does not exist"),
        ({"offload_params": "nvme", "nvme_path": "/sys"}, r"nvme_path='/sys' is not writable"),
    ]  # fmt: skip
    for kw, match in cases:
        with pytest.raises(V17ConfigError, match=match):
            v17(**kw)
    s = V17Strategy(zero_stage=3, offload=OffloadPolicy(params="nvme", nvme_path=str(tmp_path)))
    assert s.policy.offload.params == Tier.NVME and s.policy.offload.optimizer == Tier.NONE
    offload = OffloadPolicy(params="nvme", nvme_path=str(tmp_path))
    check_composition(TrainingPolicy(offload=offload), ParallelDims())  # accepted
    with pytest.raises(V17ConfigError, match=r"OffloadPolicy\(params='nvme'\) with fp8 is not supported: fp8 makes each sharded weight"):
        check_composition(TrainingPolicy(offload=offload, fp8=FP8Policy()), ParallelDims())
    assert not list(tmp_path.iterdir())  # construction creates no files


def test_deepspeed_offload_param_nvme_maps_onto_the_policy(tmp_path) -> None:
    from lightning_v17.config.deepspeed import from_deepspeed_config

    cfg = {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}}}
    off = from_deepspeed_config(cfg).offload
    assert (off.params, off.optimizer, off.nvme_path) == (Tier.NVME, Tier.NONE, str(tmp_path))
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": str(tmp_path / "other")}
    with pytest.raises(V17ConfigError, match=r"offload_param.nvme_path differ .* give the same directory"):
        from_deepspeed_config(cfg)
