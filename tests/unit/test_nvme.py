"""The NVMe tier's files, I/O and checks (``lightning_v17/engine/nvme.py``), and the offload options' errors before
training starts (V17Strategy construction, the DeepSpeed config mapping). Real files under pytest's tmp_path."""

from __future__ import annotations

import gc
import shutil

import pytest
import torch

from lightning_v17.config import OffloadPolicy, Tier, V17ConfigError
from lightning_v17.engine.nvme import NvmeFileSet, ThreadPoolIO, check_nvme_path, free_margin_bytes, io_backend


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


def test_backend_is_named() -> None:
    backend, reason = io_backend()
    assert backend == "threadpool" and "async_io" in reason


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
    with pytest.raises(V17ConfigError, match=r"GiB free, but this rank offloads .*offload_optimizer_ratio"):
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
    for kw, match in (
        ({"optimizer": "nvme", "nvme_path": "/x", "optimizer_ratio": 0.0}, r"offload_optimizer_ratio=0.0 must be"),
        ({"optimizer": "nvme", "nvme_path": "/x", "optimizer_ratio": 1.5}, r"offload_optimizer_ratio=1.5 must be"),
        ({"optimizer_ratio": 0.5}, r"offload_optimizer_ratio=0.5 splits an offloaded optimizer state"),
        ({"optimizer": "cpu", "buffer_count": 1}, r"buffer_count=1 must be an integer >= 2"),
        ({"optimizer": "cpu", "chunk_mb": 0}, r"chunk_mb=0 must be a positive"),
        ({"optimizer": "nvme"}, r"an 'nvme' offload tier needs nvme_path="),
    ):
        with pytest.raises(V17ConfigError, match=match):
            OffloadPolicy(**kw)


def test_strategy_refuses_before_training(tmp_path) -> None:
    from lightning_v17.strategies import V17Strategy

    cases = [
        ({"offload_optimizer": "nvme"}, r"needs nvme_path="),
        ({"offload_optimizer": "nvme", "nvme_path": str(tmp_path / "nope")}, r"nvme_path=.* does not exist"),
        ({"offload_optimizer": "nvme", "nvme_path": "/sys"}, r"nvme_path='/sys' is not writable"),
        ({"zero_stage": 2, "offload_params": "nvme", "nvme_path": str(tmp_path)},
         r"offload_params='nvme' .* needs zero_stage=3 \(got 2\)"),
        ({"zero_stage": 1, "offload_params": "cpu"}, r"offload_params='cpu' .* needs zero_stage=3"),
        ({"offload_optimizer_ratio": 0.5}, r"splits an offloaded optimizer state"),
    ]  # fmt: skip
    for kw, match in cases:
        with pytest.raises(V17ConfigError, match=match):
            V17Strategy(**kw)
    for stage in (1, 2, 3):
        s = V17Strategy(zero_stage=stage, offload_optimizer="nvme", nvme_path=str(tmp_path),
                        offload_optimizer_ratio=0.5)  # fmt: skip
        assert (s.policy.offload.optimizer, s.policy.offload.optimizer_ratio) == (Tier.NVME, 0.5)
        assert V17Strategy(zero_stage=stage, offload_optimizer="cpu").policy.offload.optimizer == Tier.CPU
    assert not list(tmp_path.iterdir())  # construction creates no files (each rank does, at setup)


def test_deepspeed_offload_keys_map_onto_the_policy(tmp_path) -> None:
    from lightning_v17.deepspeed_config import from_deepspeed_config

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
