"""Train a model whose state does not fit in this machine's memory: a Llama-shaped model built on the meta device,
ZeRO-3 on 2 ranks, parameters and AdamW state on the nvme tier.

``V17Strategy(zero=ZeroPolicy(stage=3, meta_init=True), offload=OffloadPolicy(params="nvme", optimizer="nvme"))``:
``configure_model`` builds the reference Llama (``lightning_v17.models.llama``) on meta, ZeRO-3 shards it and each
unit is initialized by its modules' ``reset_parameters`` and written to the tier before the next one is allocated
(the model's own name-seeded ``init_weights`` spans the whole model, so this bench drops it: a rank would hold its
whole shard at once). fp32, ``lightning_v17.optim.AdamW``, one row of ``seq`` tokens per rank, the same rows every
step (the losses must fall), ``--steps`` steps.

Before the run, one sequential write and one read of ``--probe-mb`` through the tier's own I/O backend measure the
drive (``drive_write_bytes_per_s``, ``drive_read_bytes_per_s``). Per rank and step the JSON gives the bytes the
tiers read and wrote (``nvme_bytes``), the drive floor of those bytes (``floor_s``: read bytes over the read
bandwidth plus written bytes over the write bandwidth), the offload time (``io_active_s``: wall seconds during which
at least one of the rank's tier reads or writes was in flight) and its ratio to the floor, the seconds the step
waited for the tiers (``io_wait_s``), the step time and the loss. ``per_step`` gives the host's: both ranks' bytes,
their drive floor (the ranks share the drive) against the longer of the two ranks' offload times (a lower bound of
the time the drive was in use). Per rank: the peak RSS (``VmHWM``) at the end of
the last step, before teardown (the workers exit there: the tier's teardown brings every shard back into memory,
which a model of this size does not have room for; the driver removes the tier's files), and the RSS of both ranks
against the machine's memory.

    nice -n 10 python bench/offload_big.py --json-out bench/results/offload_big.json
    python bench/offload_big.py --shape '{"hidden": 512, "layers": 4, "heads": 8, "kv_heads": 8, "ffn": 1536}'
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import shutil
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import _common as C

#: 1.95B parameters: Llama-3.2-1B's width, heads and MLP, 31 blocks, a byte vocabulary. The largest that keeps both
#: ranks within half of this machine's 23.5 GiB: the sharded fp32 gradients stay in memory (2 B/param per rank, see
#: docs/offload.md), and each rank holds about 2 GB more at its peak (measured at 0.25B and 0.5B parameters)
DEFAULT_SHAPE = {"vocab_size": 256, "hidden": 2048, "layers": 31, "heads": 16, "kv_heads": 8, "ffn": 8192, "seq": 128}
LR = 1e-4


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


class _IOClock:
    """Wall seconds during which at least one read or write of the wrapped backends is in flight, and their bytes."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.active = 0
        self.since = 0.0
        self.busy_s = 0.0

    def wrap(self, fn):
        def wrapped(*a, **k):
            with self.lock:
                if self.active == 0:
                    self.since = time.perf_counter()
                self.active += 1
            try:
                return fn(*a, **k)
            finally:
                with self.lock:
                    self.active -= 1
                    if self.active == 0:
                        self.busy_s += time.perf_counter() - self.since

        return wrapped

    def now_s(self) -> float:
        with self.lock:
            return self.busy_s + (time.perf_counter() - self.since if self.active else 0.0)


def _worker(args: argparse.Namespace) -> None:
    rank, world = C.worker_setup()
    import lightning as L
    import torch
    import torch.distributed as dist
    from lightning_v17.strategies import V17Strategy

    from lightning_v17.config import OffloadPolicy, ZeroPolicy
    from lightning_v17.engine.offload.handles import offload_of
    from lightning_v17.models.llama import Llama, ModelConfig
    from lightning_v17.optim import AdamW

    shape = json.loads(args.shape)
    seq = shape.pop("seq")
    config = ModelConfig(**{"max_seq_len": seq, **shape})

    class UnitInitLlama(Llama):
        init_weights = None  # each module's reset_parameters, unit by unit (module docstring)

    g = torch.Generator().manual_seed(1234 + rank)
    tokens = torch.randint(0, config.vocab_size, (1, seq + 1), generator=g)
    batches = [{"input": tokens[:, :-1], "target": tokens[:, 1:]}] * args.steps
    clock = _IOClock()
    steps: list[dict] = []
    info: dict = {}
    t_fit = time.perf_counter()

    class BigLM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = None

        def configure_model(self) -> None:
            if self.model is None:
                self.model = UnitInitLlama(config)

        def training_step(self, batch, batch_idx):
            logits = self.model(batch["input"])
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch["target"].flatten())

        def configure_optimizers(self):
            return AdamW(self.parameters(), lr=LR, weight_decay=0.0)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(batches, batch_size=None, shuffle=False)

    class Probe(L.Callback):
        def _ios(self, trainer):
            ios = [getattr(offload_of(trainer.optimizers[0]), "io", None), trainer.strategy.zero.param_offload.io]
            return list({id(x): x for x in ios if x is not None}.values())

        def on_train_start(self, trainer, pl_module):
            info["setup_s"] = time.perf_counter() - t_fit  # meta build, unit-by-unit init into the tier
            info["setup_peak_rss_mb"] = _status_kb("VmHWM") / 1024
            info["num_params"] = sum(p.numel() for p in pl_module.parameters())
            for io in self._ios(trainer):
                info["io_backend"] = io.name
                for name in ("_read", "_write"):
                    setattr(io, name, clock.wrap(getattr(io, name)))

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            ios = self._ios(trainer)
            self.t0 = time.perf_counter()
            self.busy0 = clock.now_s()
            self.r0, self.w0 = sum(io.bytes_read for io in ios), sum(io.bytes_written for io in ios)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            ios = self._ios(trainer)
            po, opt = trainer.strategy.zero.param_offload, offload_of(trainer.optimizers[0])
            po.flush()  # the step's parameter write-backs belong to this step
            read = sum(io.bytes_read for io in ios) - self.r0
            written = sum(io.bytes_written for io in ios) - self.w0
            floor = read / args.read_bw + written / args.write_bw
            busy = clock.now_s() - self.busy0
            steps.append({
                "step_s": time.perf_counter() - self.t0, "loss": float(outputs["loss"]),
                "nvme_read_bytes": read, "nvme_write_bytes": written, "nvme_bytes": read + written,
                "floor_s": floor, "io_active_s": busy, "io_active_over_floor": busy / floor if floor else None,
                "io_wait_s": po.io_wait_s + getattr(opt, "io_wait_s", 0.0),
                "rss_mb": _status_kb("VmRSS") / 1024, "peak_rss_mb_so_far": _status_kb("VmHWM") / 1024,
            })  # fmt: skip
            po.io_wait_s = 0.0

        def on_train_end(self, trainer, pl_module):
            po = trainer.strategy.zero.param_offload
            off = offload_of(trainer.optimizers[0])
            info["param_disk_bytes"] = po.disk_bytes()
            info["optimizer_disk_bytes"] = off.disk_bytes()
            info["peak_rss_mb"] = _status_kb("VmHWM") / 1024
            tok = seq * len(steps)
            res = {"rank": rank, "steps": steps, "tokens_per_s": tok / sum(s["step_s"] for s in steps), **info}
            with open(args._out, "w") as f:
                json.dump(res, f)
            dist.barrier()
            # Exit here: teardown would bring every shard back into memory (module docstring)
            os._exit(0)

    trainer = L.Trainer(
        accelerator="cpu", devices=world, max_steps=args.steps,
        strategy=V17Strategy(zero=ZeroPolicy(stage=3, meta_init=True),
                             offload=OffloadPolicy(params="nvme", optimizer="nvme", nvme_path=args.nvme_path)),
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, num_sanity_val_steps=0, limit_val_batches=0, callbacks=[Probe()],
    )  # fmt: skip
    trainer.fit(BigLM())


def _drive(folder: str, nbytes: int) -> tuple[float, float, str]:
    """Sequential write and read bytes/s of ``nbytes`` through the tier's own I/O backend in ``folder``, one request
    each way (the page cache dropped in between where this process may)."""
    from pathlib import Path

    from lightning_v17.engine.offload.nvme import host_buffer
    from lightning_v17.engine.offload.tier_io import open_io

    io, _ = open_io(folder)
    buf, path = host_buffer(nbytes), Path(folder) / "bandwidth-probe.bin"
    buf.fill_(7)
    t = time.perf_counter()
    io.write(path, buf).result()
    os.sync()
    w = time.perf_counter() - t
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # read from the drive, not the page cache
    os.close(fd)
    t = time.perf_counter()
    io.read_into(path, buf).result()
    r = time.perf_counter() - t
    name = io.name
    io.close()
    path.unlink()
    return nbytes / w, nbytes / r, name


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shape", default=json.dumps(DEFAULT_SHAPE), help="ModelConfig fields and seq, as JSON")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--nvme-path", default=None, help="parent of the tier's folder (default: the temp dir)")
    ap.add_argument("--probe-mb", type=int, default=2048, help="MiB written and read to measure the drive")
    ap.add_argument("--timeout", type=float, default=3600.0)
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--_worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--_out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--read-bw", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--write-bw", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._worker:
        _worker(args)
        return {}
    folder = tempfile.mkdtemp(prefix="v17-offload-big-", dir=args.nvme_path)
    try:
        write_bw, read_bw, backend = _drive(folder, args.probe_mb * 2**20)
        print(f"drive: write {write_bw / 1e9:.2f} GB/s, read {read_bw / 1e9:.2f} GB/s ({backend})", file=sys.stderr)
        t = time.monotonic()
        res = C.launch(os.path.abspath(__file__), ["--_worker", "--shape", args.shape, "--steps", str(args.steps),
                                                    "--nvme-path", folder, "--read-bw", str(read_bw),
                                                    "--write-bw", str(write_bw)], timeout_s=args.timeout)  # fmt: skip
        wall = time.monotonic() - t
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if not res["ok"]:
        raise SystemExit(res["error"])
    ranks = res["ranks"]
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    n = ranks[0]["num_params"]
    losses = [s["loss"] for s in ranks[0]["steps"]]
    rss_sum = sum(r["peak_rss_mb"] for r in ranks) * 2**20
    per_step = []
    for i in range(len(losses)):  # the host's: both ranks share the drive
        step = {k: sum(r["steps"][i][k] for r in ranks) for k in ("nvme_bytes", "nvme_read_bytes", "nvme_write_bytes")}
        floor = step["nvme_read_bytes"] / read_bw + step["nvme_write_bytes"] / write_bw
        active = max(r["steps"][i]["io_active_s"] for r in ranks)  # at least the union of the ranks' I/O time
        per_step.append(step | {
            "step_s": max(r["steps"][i]["step_s"] for r in ranks), "drive_floor_s": floor, "io_active_s": active,
            "io_active_over_drive_floor": active / floor if floor else None,
            "io_wait_s": max(r["steps"][i]["io_wait_s"] for r in ranks),
        })  # fmt: skip
    report = {
        "bench": "offload_big",
        "command": "nice -n 10 python bench/offload_big.py " + " ".join(a for a in (argv or sys.argv[1:])),
        "host": C.host_info(),
        "shape": json.loads(args.shape),
        "num_params": n,
        "model_state_bytes_16B_per_param": 16 * n,
        "ram_bytes": ram,
        "model_state_over_ram": round(16 * n / ram, 3),
        "drive_write_bytes_per_s": write_bw,
        "drive_read_bytes_per_s": read_bw,
        "io_backend": backend,
        "peak_rss_mb_per_rank": [round(r["peak_rss_mb"]) for r in ranks],
        "peak_rss_both_over_ram": round(rss_sum / ram, 3),
        "setup_s": [round(r["setup_s"], 1) for r in ranks],
        "losses_rank0": losses,
        "losses_finite_and_decreasing": all(math.isfinite(x) for x in losses)
        and all(b < a for a, b in itertools.pairwise(losses)),
        "per_step": per_step,
        "tokens_per_s": sum(r["tokens_per_s"] for r in ranks),
        "wall_s": round(wall, 1),
        "ranks": ranks,
    }
    C.emit_json(report, args.json_out)
    return report


if __name__ == "__main__":
    C.run_main(main)
