"""The NVMe optimizer tier frees what it promises, with its defaults, on a model a user writes:
``OffloadPolicy(optimizer="nvme")`` on a plain stack of ``nn.LayerNorm``/``nn.Linear``/GELU residual blocks (39M
parameters), ``torch.optim.AdamW`` (fp32), ZeRO-3, 2 ranks, every other offload option at its default.

* **Memory.** Peak RSS per rank is ``VmHWM`` of ``/proc/self/status``, reset (``/proc/self/clear_refs`` "5") at
  ``on_train_start``, after the model is built and sharded, and read at ``on_train_end``: the peak of the training
  steps (forward, backward, optimizer step), not of the model's construction. It must drop against the same run
  without offload by at least 0.8 x the rank's Adam moments (2 fp32 tensors per parameter of its shard: 149 MiB).
  The ranks run with ``MALLOC_MMAP_THRESHOLD_=65536`` in their environment (fresh interpreters, so that glibc reads
  it at start), a threshold low enough that freed tensors leave the process: the drop then measures what the tier
  keeps resident (its chunk buffers, bounded by ``OffloadPolicy.buffer_count``), not the heap's fragmentation.
* **The bound.** During the steps the tier's pool never holds more than ``buffer_count`` chunk buffers, none larger
  than the largest chunk's state (``OffloadPolicy.buffer_count``'s docstring).
* **Exactness.** Losses per step and each rank's final parameter shards (their digest) equal the run without offload
  bit for bit, and the losses of both match Lightning's ``"ddp"`` in the same process pair (``assert_matches``, 1e-4
  relative; the final parameters are compared as digests only: full copies would stay resident in the next run).

The runs share one process pair (one start of fresh interpreters): no offload first, then nvme (what the first run
leaves resident, ~11 MiB, counts against the nvme run), then ddp (after the measured runs: it holds the whole model
on every rank).
"""

from __future__ import annotations

import gc
from typing import Any

import pytest

from tests._dist import spawn
from tests.integration.real_modules._common import assert_matches, train

WIDTH, BLOCKS, IN_FEATURES = 640, 12, 64  # 39.4M parameters: 149 MiB of Adam moments per rank on 2 ranks
ROWS_PER_RANK, STEPS = 4, 3
MALLOC_MMAP_THRESHOLD = 65536
MIN_DROP = 0.8  # of the Adam moments per rank (the acceptance bar)


def _data() -> list[Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2 * ROWS_PER_RANK * STEPS, IN_FEATURES, generator=g)
    return list(zip(x, x[:, :4].sum(-1).tanh()))


def _module(measure: bool):
    """The user's module (a LightningModule over its own nn.Module); ``measure`` adds the test's instruments in a
    subclass, so the user's class stays as they wrote it."""
    import lightning as L
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(WIDTH)
            self.up = nn.Linear(WIDTH, 4 * WIDTH)
            self.down = nn.Linear(4 * WIDTH, WIDTH)

        def forward(self, x):
            return x + self.down(F.gelu(self.up(self.norm(x))))

    class MLPStack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(IN_FEATURES, WIDTH)
            self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
            self.out = nn.Linear(WIDTH, 1)

        def forward(self, x):
            x = self.inp(x)
            for b in self.blocks:
                x = b(x)
            return self.out(x).squeeze(-1)

    class Regressor(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = MLPStack()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    class Measured(Regressor):
        peak_kb = start_kb = 0
        pool_most = 0  # the most buffers the tier's pool held at once
        pool_largest = 0  # bytes of its largest buffer
        largest_chunk = 0  # bytes of the largest chunk's state on the tier
        buffer_count = 0

        def on_train_start(self) -> None:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # VmHWM := the current RSS
            self.start_kb = _status_kb("VmRSS")
            from lightning_v17.engine.offload.handles import offload_of

            off = offload_of(self.trainer.optimizers[0])
            if off is not None:  # count the pool's buffers after every take (inside the step, not only between)
                pool, take, me = off.pool, off.pool.take, self

                def counted(*a, **kw):
                    buf = take(*a, **kw)
                    me.pool_most = max(me.pool_most, len(pool.owned))
                    me.pool_largest = max([me.pool_largest, *(b.numel() for b in pool.owned.values())])
                    return buf

                pool.take = counted
                self.buffer_count = off.depth + 1

        def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
            from lightning_v17.engine.offload.handles import offload_of

            off = offload_of(self.trainer.optimizers[0])
            if off is not None:
                self.largest_chunk = max(c.nbytes for c in off.chunks)

        def on_train_end(self) -> None:
            self.peak_kb = _status_kb("VmHWM")

    return Measured() if measure else Regressor()


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _inspect(module, trainer) -> dict[str, Any]:
    """The figures, and a digest of this rank's parameter shards (their bytes: equal digests are equal bits). Full
    parameters would stay in the process through the next run and raise its RSS (150 MiB here)."""
    import hashlib

    import torch

    digest = hashlib.sha256()
    shard = 0
    for name, p in module.named_parameters():
        local = p.detach().to_local() if hasattr(p, "to_local") else p.detach()
        digest.update(name.encode() + local.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        shard += local.numel()
    keys = ("start_kb", "peak_kb", "pool_most", "pool_largest", "largest_chunk", "buffer_count")
    return {"moments_bytes": 8 * shard, "digest": digest.hexdigest(), **{k: getattr(module, k) for k in keys}}


def _measured() -> Any:
    return _module(True)


def _plain() -> Any:
    return _module(False)


def _worker(rank: int, world: int, nvme_path: str) -> dict[str, Any]:
    from lightning_v17 import V17Strategy
    from lightning_v17.config import OffloadPolicy
    from lightning_v17.engine.offload.tier_io import open_io

    # The tier's I/O backend opened once before both runs: where libaio is installed it is DeepSpeed's op, whose
    # first write imports DeepSpeed (~27 MiB per process, whatever the model: 7% of the 100M-parameter acceptance
    # model's moments, 18% of this one's). That library cost then counts in both runs; the drop is the tier's own.
    io, _ = open_io(nvme_path)
    io.close()
    data, kw = _data(), {"batch_size": ROWS_PER_RANK, "steps": STEPS, "params": False}
    out = {"zero3": train(_measured, V17Strategy(zero_stage=3), data, inspect=_inspect, **kw)}
    gc.collect()  # the last run's trainer, module and optimizer state are a reference cycle: free them first
    nvme = V17Strategy(zero_stage=3, offload=OffloadPolicy(optimizer="nvme", nvme_path=nvme_path))  # the defaults
    out["zero3_nvme"] = train(_measured, nvme, data, inspect=_inspect, **kw)
    gc.collect()
    out["ddp"] = train(_plain, "ddp", data, **kw)
    return out


def test_nvme_tier_with_defaults_drops_peak_rss_by_the_adam_moments_and_changes_nothing(tmp_path, monkeypatch):
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError as err:
        pytest.skip(f"/proc/self/clear_refs is not writable here ({err}): VmHWM cannot be reset before the steps")
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(MALLOC_MMAP_THRESHOLD))
    ranks = spawn(_worker, world_size=2, args=(str(tmp_path),), timeout=240, fresh_interpreter=True)

    for r in ranks:  # offload changes nothing: losses and this rank's parameter shards bit for bit
        assert r["zero3_nvme"]["losses"] == r["zero3"]["losses"]
        assert r["zero3_nvme"]["extra"]["digest"] == r["zero3"]["extra"]["digest"], "the parameters differ"
    assert_matches(ranks, ["zero3", "zero3_nvme"])  # and the losses match ddp's

    figures = []
    for rank, r in enumerate(ranks):
        base, off = r["zero3"]["extra"], r["zero3_nvme"]["extra"]
        moments = off["moments_bytes"]
        drop = (base["peak_kb"] - off["peak_kb"]) * 1024
        figures.append(f"rank {rank}: at the first step {base['start_kb'] >> 10} / {off['start_kb'] >> 10} MiB, "
                       f"peak {base['peak_kb'] >> 10} -> {off['peak_kb'] >> 10} MiB, drop "
                       f"{drop / 2**20:.0f} MiB = {drop / moments:.2f} x the Adam moments ({moments / 2**20:.0f} MiB)")
        assert off["buffer_count"] == 2, off  # the default
        assert 0 < off["pool_most"] <= off["buffer_count"], off
        assert off["pool_largest"] <= off["largest_chunk"], off
    for rank, r in enumerate(ranks):
        base, off = r["zero3"]["extra"], r["zero3_nvme"]["extra"]
        drop = (base["peak_kb"] - off["peak_kb"]) * 1024
        assert drop >= MIN_DROP * off["moments_bytes"], "; ".join(figures)
    print("; ".join(figures))
