"""Optimizer offload: peak RSS per rank and tokens/s, V17 ZeRO-3 with ``offload_optimizer`` none / cpu / nvme.

Memory (issue 11 acceptance): a >= 100M-parameter GPT (``bench._common.build_gpt``, fp32, built in ``configure_model``
so that ZeRO-3 materializes only each rank's shards), fp32 AdamW, ZeRO-3, 2 ranks. Each arm runs in a fresh pair of
processes; the report gives per rank the planner's optimizer-state bytes (``planned_state_bytes``: AdamW 8 B/param
of the rank's shard), the peak RSS (``ru_maxrss``), the drop against ``none`` as a fraction of the planned bytes
(target >= 0.8 for nvme), the bytes of the rank's files on the nvme tier after the last step, and the losses (which
must be identical across arms).

``nvme`` runs the default ``host_memory="recycle"`` (glibc's heap recycles forward's and the step's allocations; the
tier's own and the sharded gradients are their own mappings, backward's large buffers never grow the heap); ``nvme_return`` is the nvme arm with
``OffloadPolicy(host_memory="return")`` (glibc's mmap threshold at 1 MiB for the process: every freed host allocation
of 1 MiB or more leaves the RSS, and on this CPU-only machine every activation of that size is faulted in anew each
step). Each result also has rank 0's system CPU seconds and minor page faults per timed step.

``nvme_params`` adds ``offload_params="nvme" to the nvme arm (ZeRO-Infinity: the parameter shards on nvme too,
``lightning_v17/engine/offload/params.py``); its row gives the planner's fp32 parameter shard of the rank
(``planned_param_bytes``: 4 B/param over dp=2, ``model_state_bytes_per_rank``), the bytes of the rank's parameter
files and of shards left in memory after the last step (the next forward's first units), and the RSS drop against
the ``nvme`` arm (the same glibc setting, the default ``host_memory="recycle"``) as a fraction of the planned shard
(``drop_vs_nvme_over_planned_params``; target >= 0.8). ``nvme_params_return`` and ``nvme_params_bf16_return`` are
those arms with ``host_memory="return"`` (the first against the ``nvme_return`` arm).

On this CPU-only machine the cpu tier shares memory with compute (no drop expected; it shows the chunked step's
cost), and the nvme tier is a directory on the local disk (``--nvme-path``; the page cache may serve the reads).
``io_wait_share``: the fraction of the optimizer step's wall time spent waiting for reads and write-backs (the I/O
not hidden behind the optimizer's compute or the forward/backward that the first reads overlap).

Speed anchors, raw DeepSpeed ZeRO-3 (``deepspeed.initialize`` + a hand loop, DeepSpeedCPUAdam; compare with
``--optimizer cpu_adam``), each against the V17 arm that offloads the same things (``ratios``):

* ``ds_cpu``: ``offload_optimizer.device="cpu"``, fp32 (against ``cpu``);
* ``ds_nvme``: ``offload_optimizer.device="nvme"``, fp32 (against ``nvme`` and ``nvme_return``);
* ``ds_nvme_params_bf16``: optimizer and parameters on nvme, ``bf16.enabled`` (DeepSpeed's fp32 parameter swapper
  is broken: it allocates bf16 buffers), against ``nvme_params_bf16`` (V17 with ``precision="bf16-mixed"``) and
  ``nvme_params_bf16_return``.

Planner against the run (nvme arms): before the arms, one 64 MiB write and read through the tier's own I/O backend
measures the drive (``drive_bytes_per_s``); each nvme arm then reports per rank the planner's nvme bytes per step
(``planner.offload.offload_traffic_bytes``) and its transfer seconds at that bandwidth (``offload_transfer_s``, no
overlap; no PCIe term on a CPU-only machine), next to the tier's measured I/O-thread busy seconds per step
(``planner_vs_measured_io``) and the share of the offloaded step spent waiting (``io_wait_share``).

DeepSpeed's nvme tier needs its ``async_io`` op (Debian's ``libaio-dev``); without it the ``ds_nvme*`` arms fail at
start with DeepSpeed's own message, and the V17 arms use the thread-pool backend (``io_backend`` in the JSON).

Activation offload (``--activations``): the reference Llama (tiny but wide: activations dominate) at ZeRO-3 on 2
ranks through ``engine.parallelize`` at seq 2048, without offload (``act_none``) and with
``ActivationOffload(tier="nvme")`` (``act_nvme``, ``resident_blocks=1``), the same model, data and SGD, each arm in a
fresh pair of processes started with ``MALLOC_MMAP_THRESHOLD_=65536`` (freed tensors leave the RSS). Per rank: the
peak RSS rise of one step above its start (``VmHWM`` after ``/proc/self/clear_refs`` reset it, warm-up excluded),
the bytes offloaded per step, and ``rss_drop_over_offloaded`` (target >= 0.8); ``ratios`` has the step-time
overhead (``act_nvme/act_none`` tokens/s) and ``losses_identical``. It writes ``bench/results/offload-activations.json``
with ``--json-out``.

    python bench/offload.py                       # every arm, 1 round
    python bench/offload.py --arms none,nvme,nvme_params   # the parameter-offload table
    python bench/offload.py --arms none,nvme --rounds 2 --shape '{"hidden": 512, "layers": 4}'
    python bench/offload.py --activations --json-out bench/results/offload-activations.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import _common as C

#: none_mmap: no offload, but glibc's mmap threshold fixed at 1 MiB as the nvme tier does (separates the allocator's
#: share of the RSS drop from the offload's)
#: nvme_return: the nvme arm with OffloadPolicy(host_memory="return"): a process-wide 1 MiB mmap threshold instead of
#: the default "recycle", where glibc's heap recycles forward's and the step's allocations (config.OffloadPolicy)
#: nvme_params: offload_optimizer="nvme" and offload_params="nvme" (ZeRO-Infinity: the parameter shards on nvme too);
#: nvme_params_bf16: the same under precision="bf16-mixed"
#: ds_*: raw DeepSpeed ZeRO-3 with DeepSpeedCPUAdam, the same tiers (module docstring)
ARMS = (
    "none",
    "none_mmap",
    "cpu",
    "nvme",
    "nvme_return",
    "nvme_params",
    "nvme_params_return",
    "nvme_params_bf16",
    "nvme_params_bf16_return",
    "ds_cpu",
    "ds_nvme",
    "ds_nvme_params_bf16",
)
#: ours -> DeepSpeed's arm with the same tiers and precision
DS_ANCHOR = {"cpu": "ds_cpu", "nvme": "ds_nvme", "nvme_return": "ds_nvme", "nvme_params_bf16": "ds_nvme_params_bf16",
             "nvme_params_bf16_return": "ds_nvme_params_bf16"}  # fmt: skip
LR, WEIGHT_DECAY = 1e-4, 0.01
#: >= 100M parameters (103.3M): 8 blocks of width 1024; short sequences keep a step near a second on 2 cores
DEFAULT_SHAPE = {"vocab": 1024, "hidden": 1024, "layers": 8, "heads": 16, "seq": 64, "batch": 1}


def _worker(args: argparse.Namespace, arm: str) -> None:
    rank, world = C.worker_setup()
    import lightning as L
    import torch
    from lightning_v17.strategies import V17Strategy

    from lightning_v17.config import OffloadPolicy, ZeroPolicy
    from lightning_v17.engine.offload.handles import offload_of
    from lightning_v17.engine.offload.optimizer import planned_state_bytes
    from lightning_v17.optim import AdamW

    shape = C.GPTShape(**json.loads(args.shape))
    batches = C.make_batches(shape, rank, args.warmup + args.steps)
    timer = C.StepTimer(args.warmup, args.steps)
    losses: list[float] = []
    info: dict = {"io_wait_s": 0.0, "opt_step_s": 0.0}
    busy = {"s": 0.0, "after_warmup": 0.0}

    class BenchLM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = None

        def configure_model(self) -> None:  # meta device (meta_init=True): only the shards are ever allocated
            if self.model is None:
                self.model = C.build_gpt(shape)

        def training_step(self, batch, batch_idx):
            return C.lm_loss(self.model(batch["input"]), batch["target"])

        def configure_optimizers(self):
            if args.optimizer == "cpu_adam":
                from lightning_v17.optim import CPUAdam

                return CPUAdam(self.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
            return AdamW(self.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(batches, batch_size=None, shuffle=False)

    class Timing(L.Callback):
        def on_train_start(self, trainer, pl_module):
            from lightning_v17.planner.memory import model_state_bytes_per_rank

            info["planned_optimizer_bytes"] = planned_state_bytes(trainer.optimizers[0])
            info["num_params"] = n = sum(p.numel() for p in pl_module.parameters())
            # the planner's fp32 parameter shard of this rank (ZeRO §3.1: 4 B/param over dp=2 at stage 3)
            info["planned_param_bytes"] = model_state_bytes_per_rank(
                n, zero_stage=3, dp=world, param_bytes=4, grad_bytes=4, optimizer_bytes=8
            ).param
            # the tier's I/O threads' busy seconds (reads and writes), for the planner comparison
            ios = [getattr(offload_of(trainer.optimizers[0]), "io", None), getattr(trainer.strategy.zero.param_offload,
                                                                                 "io", None)]  # fmt: skip
            for io in {id(x): x for x in ios if x is not None}.values():
                for name in ("_read", "_write"):
                    setattr(io, name, _timed(getattr(io, name), busy))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))
            off = offload_of(trainer.optimizers[0])
            if off is not None and batch_idx >= args.warmup:
                info["io_wait_s"] += off.io_wait_s
                info["opt_step_s"] += off.step_s
            if batch_idx == args.warmup - 1:
                busy["after_warmup"] = busy["s"]
            po = trainer.strategy.zero.param_offload
            if po is not None:
                info["param_io_wait_s"] = round(po.io_wait_s, 3)
            timer.after_step(batch_idx)

        def on_train_end(self, trainer, pl_module):
            # after the timed steps (both wait for the write-backs in flight)
            off, po = offload_of(trainer.optimizers[0]), trainer.strategy.zero.param_offload
            if po is not None:  # left in memory: the next forward's first units (ParamOffload.forward_first)
                info["param_disk_bytes"] = po.disk_bytes()
                info["param_resident_bytes"] = po.resident_bytes()
            if off is not None:
                info["disk_bytes"] = off.disk_bytes()
                info["chunks"], info["nvme_chunks"], info["io_backend"] = len(off.chunks), off.nvme_chunks, off.backend

    offload = None
    if arm == "none_mmap":
        from lightning_v17.engine.offload.host_memory import fix_mmap_threshold

        fix_mmap_threshold()
    elif arm.startswith("nvme_params"):
        offload = OffloadPolicy(optimizer="nvme", params="nvme", nvme_path=args.nvme_path, **_tier_options(args),
                                host_memory="return" if arm.endswith("_return") else None)  # fmt: skip
    elif arm != "none":
        tier = arm.removesuffix("_return")
        offload = OffloadPolicy(optimizer=tier, nvme_path=args.nvme_path if tier == "nvme" else None,
                                **_tier_options(args),
                                host_memory="return" if arm.endswith("_return") else None)  # fmt: skip
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=V17Strategy(zero=ZeroPolicy(stage=3, meta_init=True), offload=offload),
        precision="bf16-mixed" if "_bf16" in arm else "32-true",
        max_steps=args.warmup + args.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False, num_sanity_val_steps=0, limit_val_batches=0,
        callbacks=[Timing()],
    )  # fmt: skip
    t0 = time.perf_counter()
    trainer.fit(BenchLM())
    left = sorted(os.listdir(args.nvme_path)) if arm.startswith("nvme") else []
    planned = _planned_io(trainer, arm, args)
    C.write_result(
        args._out, timer, shape, world, losses=losses, fit_s=time.perf_counter() - t0,
        io_busy_s_per_step=(busy["s"] - busy["after_warmup"]) / args.steps if arm.startswith("nvme") else None,
        **planned,
        io_wait_share=info["io_wait_s"] / info["opt_step_s"] if info["opt_step_s"] else None,
        left_in_nvme_path_after_fit=left, **info,
    )  # fmt: skip


def _tier_options(args: argparse.Namespace) -> dict:
    """``chunk_mb`` / ``buffer_count`` given on the command line; the policy's defaults otherwise."""
    return {k: v for k, v in (("chunk_mb", args.chunk_mb), ("buffer_count", args.buffer_count)) if v is not None}


def _timed(fn, busy: dict):
    """``fn`` (an I/O backend's ``_read``/``_write``, run on its threads) adding its seconds to ``busy["s"]``."""
    import threading

    lock = threading.Lock()

    def wrapped(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            with lock:
                busy["s"] += time.perf_counter() - t

    return wrapped


def _planned_io(trainer, arm: str, args: argparse.Namespace) -> dict:
    """The planner's nvme traffic of this rank per step (``planner.offload.offload_traffic_bytes``, ZeRO-Infinity §5)
    and its transfer time at the drive bandwidth measured before the arms ran (``offload_transfer_s``, no overlap:
    an upper bound). There is no PCIe hop on a CPU-only machine (host memory is the device's), so its term is 0."""
    from lightning_v17.config import Tier
    from lightning_v17.planner.offload import OffloadTraffic, offload_traffic_bytes, offload_transfer_s

    if not arm.startswith("nvme") or not args.nvme_bw:
        return {}
    params = trainer.lightning_module.parameters()
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in params)
    traffic = offload_traffic_bytes(
        optimizer_partition_params=local, param_partition_params=local, zero_stage=3,
        param_bytes=4, grad_bytes=4, optimizer_bytes=8, offload_optimizer=Tier.NVME,
        offload_params=Tier.NVME if arm.startswith("nvme_params") else Tier.NONE,
    )  # fmt: skip
    nvme_only = OffloadTraffic(pcie_bytes=0, nvme_bytes=traffic.nvme_bytes)
    seconds = offload_transfer_s(nvme_only, pcie_bytes_per_s=1.0, nvme_bytes_per_s=args.nvme_bw)
    return {"planned_nvme_bytes_per_step": traffic.nvme_bytes, "planned_io_s_per_step": seconds}


def _drive_bandwidth(folder: str, nbytes: int = 64 * 2**20) -> float:
    """Bytes/s of one write plus one read of ``nbytes`` through the tier's own I/O backend in ``folder``."""
    from pathlib import Path

    from lightning_v17.engine.offload.nvme import host_buffer
    from lightning_v17.engine.offload.tier_io import open_io

    io, _ = open_io(folder)
    buf, path = host_buffer(nbytes), Path(folder) / "bandwidth-probe.bin"
    buf.fill_(7)
    t = time.perf_counter()
    io.write(path, buf).result()
    io.read(path, nbytes).result()
    s = time.perf_counter() - t
    io.close()
    path.unlink()
    return 2 * nbytes / s


def _deepspeed_worker(args: argparse.Namespace, arm: str) -> None:
    """Raw DeepSpeed ZeRO-3, DeepSpeedCPUAdam, gloo: ``ds_cpu`` / ``ds_nvme`` offload the optimizer (fp32),
    ``ds_nvme_params_bf16`` the optimizer and the parameters (bf16)."""
    rank, world = C.worker_setup()
    import deepspeed
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    torch.set_num_threads(1)
    shape = C.GPTShape(**json.loads(args.shape))
    batches = C.make_batches(shape, rank, args.warmup + args.steps)
    model = C.build_gpt(shape)
    opt = DeepSpeedCPUAdam(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, adamw_mode=True)
    nvme = os.path.join(args.nvme_path, f"ds-{arm}")
    zero: dict = {"stage": 3, "contiguous_gradients": True, "overlap_comm": False, "reduce_bucket_size": int(5e8),
                  "stage3_prefetch_bucket_size": int(5e7), "stage3_param_persistence_threshold": int(1e5)}  # fmt: skip
    if arm == "ds_cpu":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    else:
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme, "pin_memory": False}
        if args.buffer_count is not None:  # else DeepSpeed's own default (4)
            zero["offload_optimizer"]["buffer_count"] = args.buffer_count
    if arm == "ds_nvme_params_bf16":
        zero["offload_param"] = {"device": "nvme", "nvme_path": nvme, "pin_memory": False, "buffer_count": 5,
                                 "buffer_size": int(1e8), "max_in_cpu": 0}  # fmt: skip
    config = {
        "train_micro_batch_size_per_gpu": shape.batch, "gradient_accumulation_steps": 1, "zero_optimization": zero,
        "zero_allow_untested_optimizer": True, "steps_per_print": 10**9, "wall_clock_breakdown": False,
        "aio": {"block_size": 1048576, "queue_depth": 8, "thread_count": 1, "single_submit": False,
                "overlap_events": True},
    }  # fmt: skip
    if arm.endswith("_bf16"):
        config["bf16"] = {"enabled": True}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    torch.set_num_threads(1)
    timer = C.StepTimer(args.warmup, args.steps)
    losses: list[float] = []
    for i, b in enumerate(batches):
        loss = C.lm_loss(engine(b["input"]), b["target"])
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
        timer.after_step(i)
    C.write_result(args._out, timer, shape, world, losses=losses, planned_optimizer_bytes=None)


def _median_io_wait(runs: list[dict]) -> float | None:
    import statistics

    per_round = [statistics.mean(rk["io_wait_share"] for rk in r["ranks"]) for r in runs
                 if r["ok"] and all(rk.get("io_wait_share") is not None for rk in r["ranks"])]  # fmt: skip
    return round(statistics.median(per_round), 3) if per_round else None


def _rounds(args: argparse.Namespace, arms: list[str], common: list[str], runs: dict[str, list[dict]]) -> None:
    """Each round runs every arm once in a fresh pair of processes, rotated by one arm per round."""
    for rnd in range(args.rounds):
        for a in arms[rnd % len(arms) :] + arms[: rnd % len(arms)]:
            t = time.monotonic()
            res = C.launch(os.path.abspath(__file__), ["--_worker", a, *common], timeout_s=args.timeout)
            runs[a].append(res)
            msg = f"peak RSS {[round(r['peak_rss_mb']) for r in res['ranks']]} MB" if res["ok"] else res["error"][-400:]
            print(f"[round {rnd + 1}] {a}: {msg} ({time.monotonic() - t:.0f}s)", file=sys.stderr, flush=True)


#: the activation arms' reference Llama: 8 blocks of width 128, one row of 2048 tokens per rank
ACT_SHAPE = {"vocab_size": 256, "hidden": 128, "layers": 8, "heads": 2, "kv_heads": 2, "ffn": 384, "seq": 2048}
ACT_ARMS = ("act_none", "act_nvme")


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _activation_worker(args: argparse.Namespace, arm: str) -> None:
    rank, world = C.worker_setup()
    import gc

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from lightning_v17.config import MeshSpec, TrainingPolicy, ZeroPolicy
    from lightning_v17.engine.offload.activations import ActivationOffload
    from lightning_v17.engine.parallelize import parallelize
    from lightning_v17.mesh import MeshRuntime, build_device_mesh
    from lightning_v17.models import Llama, ModelConfig

    dist.init_process_group("gloo")
    shape = dict(ACT_SHAPE, **json.loads(args.shape)) if args.shape != json.dumps(DEFAULT_SHAPE) else dict(ACT_SHAPE)
    seq = shape.pop("seq")
    cfg = ModelConfig(**shape, max_seq_len=seq)
    spec = MeshSpec(dp_shard=world)
    mesh = MeshRuntime(spec, build_device_mesh(spec, device_type="cpu"))
    model = Llama(cfg, init_seed=0)
    done = parallelize(model, mesh=mesh, policy=TrainingPolicy(zero=ZeroPolicy(stage=3)), device="cpu")
    off = None
    if arm == "act_nvme":
        off = ActivationOffload(done.units, nvme_path=args.nvme_path, min_bytes=256 * 1024, resident_blocks=1,
                                rank=rank)  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1234 + rank)
    batches = [torch.randint(0, cfg.vocab_size, (1, seq), generator=g) for _ in range(args.warmup + args.steps)]
    timer, losses, rise, offloaded = C.StepTimer(args.warmup, args.steps), [], None, None
    for step, ids in enumerate(batches):
        measure = step == args.warmup  # the first timed step also measures the peak RSS rise
        if measure:
            gc.collect()
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # VmHWM := the current RSS
            start, before = _status_kb("VmRSS"), off.stats["bytes_offloaded"] if off else 0
        loss = F.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
        loss.backward()
        if measure:
            rise = (_status_kb("VmHWM") - start) * 1024
            offloaded = (off.stats["bytes_offloaded"] - before) if off else 0
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
        timer.after_step(step)
    extra = {"losses": losses, "rss_rise_bytes": rise, "offloaded_bytes_per_step": offloaded,
             "pool_allocations": off.pool.allocations if off else None, "pool_misses": off.pool.misses if off else None,
             "io_backend": off.io.name if off else None}  # fmt: skip
    if off is not None:
        off.close()
    C.write_result(args._out, timer, C.GPTShape(vocab=cfg.vocab_size, hidden=cfg.hidden, layers=cfg.layers,
                   heads=cfg.heads, seq=seq, batch=1), world, **extra)  # fmt: skip
    dist.destroy_process_group()


def _activations_main(args: argparse.Namespace) -> dict:
    nvme_path = args.nvme_path or tempfile.mkdtemp(prefix="v17-act-offload-bench-")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # both arms: freed tensors leave the process
    common = ["--activations", "--steps", str(args.steps), "--warmup", str(args.warmup), "--shape", args.shape,
              "--nvme-path", nvme_path]  # fmt: skip
    runs: dict[str, list[dict]] = {a: [] for a in ACT_ARMS}
    t_start = time.monotonic()
    try:
        for r in range(args.rounds):
            for arm in ACT_ARMS if r % 2 == 0 else ACT_ARMS[::-1]:
                runs[arm].append(C.launch(__file__, [*common, "--_worker", arm], timeout_s=args.timeout))
    finally:
        if args.nvme_path is None:
            shutil.rmtree(nvme_path, ignore_errors=True)
    results = {a: C.summarize(runs[a]) for a in ACT_ARMS}
    rows = []
    last = {a: [r for r in runs[a] if r["ok"]][-1]["ranks"] for a in ACT_ARMS if any(r["ok"] for r in runs[a])}
    if set(last) == set(ACT_ARMS):
        for k, (base, got) in enumerate(zip(last["act_none"], last["act_nvme"])):
            drop = base["rss_rise_bytes"] - got["rss_rise_bytes"]
            rows.append({
                "rank": k, "rss_rise_mb_none": round(base["rss_rise_bytes"] / 2**20, 1),
                "rss_rise_mb_nvme": round(got["rss_rise_bytes"] / 2**20, 1),
                "offloaded_mb_per_step": round(got["offloaded_bytes_per_step"] / 2**20, 1),
                "rss_drop_over_offloaded": round(drop / got["offloaded_bytes_per_step"], 3),
                "pool_allocations": got["pool_allocations"], "pool_misses": got["pool_misses"],
                "io_backend": got["io_backend"],
            })  # fmt: skip
    out = {
        "model": {"name": "lightning_v17.models.Llama (fp32, SGD)", **ACT_SHAPE, **json.loads(args.shape)}
        if args.shape != json.dumps(DEFAULT_SHAPE) else {"name": "lightning_v17.models.Llama (fp32, SGD)", **ACT_SHAPE},
        "world_size": 2, "zero_stage": 3, "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds,
        "min_kb": 256, "resident_blocks": 1,
        **C.ratio_tables(results, ACT_ARMS, [("act_nvme", "act_none")]),
        "rss_table": rows,
        "losses_identical": all(a["losses"] == b["losses"] for a, b in zip(last.get("act_none", []),
                                                                            last.get("act_nvme", [None]))),
        "results": results, "wall_s": round(time.monotonic() - t_start, 1),
    }  # fmt: skip
    C.emit_json(out, args.json_out)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=2, help="timed optimizer steps per run (default 2)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed warm-up steps (default 1, >= 1)")
    ap.add_argument("--rounds", type=int, default=1, help="rounds in rotated order; medians reported (default 1)")
    ap.add_argument("--arms", default=",".join(ARMS), help="comma-separated subset of: " + ", ".join(ARMS))
    ap.add_argument("--shape", default=json.dumps(DEFAULT_SHAPE), help="GPTShape as JSON (default: 103M params)")
    ap.add_argument("--chunk-mb", type=float, default=None, help="OffloadPolicy.chunk_mb (default: the policy's)")
    ap.add_argument("--buffer-count", type=int, default=None,
                    help="nvme chunk buffers, the same for both: OffloadPolicy.buffer_count and DeepSpeed's "
                    "offload_optimizer.buffer_count (default: each its own, V17 2, DeepSpeed 4)")  # fmt: skip
    ap.add_argument("--nvme-path", default=None, help="directory of the nvme tier (default: a fresh temp dir)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per run before both ranks are killed")
    ap.add_argument(
        "--optimizer",
        choices=["adamw", "cpu_adam"],
        default="adamw",
        help="V17 arms: lightning_v17.optim.AdamW (fused, default) or CPUAdam (DeepSpeed's op)",
    )
    ap.add_argument("--json-out", default=None, help="also write the JSON here")
    ap.add_argument("--activations", action="store_true",
                    help="the activation-offload arms instead (act_none, act_nvme; module docstring)")  # fmt: skip
    ap.add_argument("--_worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--nvme-bw", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._worker and args.activations:
        _activation_worker(args, args._worker)
        return {}
    if args.activations:
        return _activations_main(args)
    if args._worker:
        _deepspeed_worker(args, args._worker) if args._worker.startswith("ds_") else _worker(args, args._worker)
        return {}
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if any(a not in ARMS for a in arms):
        ap.error(f"--arms: choose from {ARMS}")
    nvme_path = args.nvme_path or tempfile.mkdtemp(prefix="v17-offload-bench-")
    # the drive's bandwidth through the tier's own backend, the planner's nvme_bytes_per_s for the comparison
    nvme_bw = _drive_bandwidth(nvme_path) if any(a.startswith("nvme") for a in arms) else None
    shape = C.GPTShape(**json.loads(args.shape))
    common = ["--steps", str(args.steps), "--warmup", str(args.warmup), "--shape", json.dumps(C.asdict(shape)),
              "--nvme-path", nvme_path,
              *(["--chunk-mb", str(args.chunk_mb)] if args.chunk_mb is not None else []),
              *(["--buffer-count", str(args.buffer_count)] if args.buffer_count is not None else []),
              "--optimizer", args.optimizer, *(["--nvme-bw", str(nvme_bw)] if nvme_bw else [])]  # fmt: skip
    runs: dict[str, list[dict]] = {a: [] for a in arms}
    t_start = time.monotonic()
    try:
        _rounds(args, arms, common, runs)
    finally:
        if args.nvme_path is None:  # our temporary folder: DeepSpeed leaves its swap files in it (~40 MB per arm)
            shutil.rmtree(nvme_path, ignore_errors=True)
    results = {a: C.summarize(runs[a]) for a in arms}
    table = []
    base = results.get("none", {}).get("peak_rss_mb")
    base_mmap = results.get("none_mmap", {}).get("peak_rss_mb")
    # the parameters' own drop against the optimizer-only arm with the same glibc setting, when that arm ran
    base_nvme = {"nvme_params": results.get("nvme", {}).get("peak_rss_mb"),
                 "nvme_params_return": results.get("nvme_return", {}).get("peak_rss_mb")}  # fmt: skip
    for a in arms:
        ok = [r for r in runs[a] if r["ok"]]
        if not ok:
            continue
        last = ok[-1]["ranks"]
        for k, rk in enumerate(last if not a.startswith("ds_") else []):
            row = {
                "arm": a, "rank": k, "planned_optimizer_bytes": rk["planned_optimizer_bytes"],
                "peak_rss_mb": results[a]["peak_rss_mb"][k], "disk_bytes": rk.get("disk_bytes", 0),
                "chunks": rk.get("chunks"), "io_wait_share": rk.get("io_wait_share"),
                "planned_param_bytes": rk.get("planned_param_bytes"), "param_disk_bytes": rk.get("param_disk_bytes"),
                "param_resident_bytes": rk.get("param_resident_bytes"),
            }  # fmt: skip
            if base_nvme.get(a) is not None:  # the parameters' own share (target >= 0.8)
                drop = (base_nvme[a][k] - row["peak_rss_mb"]) * 2**20
                row["drop_vs_nvme_over_planned_params"] = round(drop / rk["planned_param_bytes"], 3)
            if base is not None:
                drop = (base[k] - row["peak_rss_mb"]) * 2**20
                row["rss_drop_mb"] = round(drop / 2**20, 1)
                row["drop_over_planned"] = round(drop / rk["planned_optimizer_bytes"], 3)
            if base_mmap is not None:  # against the same allocator setting: the offload's own share
                drop = (base_mmap[k] - row["peak_rss_mb"]) * 2**20
                row["drop_over_planned_vs_none_mmap"] = round(drop / rk["planned_optimizer_bytes"], 3)
            table.append(row)
    losses = {a: [r for r in runs[a] if r["ok"]][-1]["ranks"][0]["losses"] for a in arms if results[a]["tokens_per_s"]}
    # DeepSpeed reduces in another order; bf16 arms compute in another precision: compare like with like
    v17_losses = {a: v for a, v in losses.items() if not a.startswith("ds_") and "_bf16" not in a}
    first = next(iter(v17_losses.values()), None)
    out = {
        "model": {"name": "bench._common.build_gpt (pre-LN GPT, fp32)", **C.shape_dict(shape)},
        "world_size": 2, "zero_stage": 3,
        "optimizer": f"lightning_v17.optim.AdamW(lr={LR}, fused)" if args.optimizer == "adamw"
        else f"lightning_v17.optim.CPUAdam(lr={LR}, DeepSpeed's op)",
        # None: each side's default (OffloadPolicy's: chunk_mb 4, buffer_count 2; DeepSpeed's buffer_count 4)
        "chunk_mb": args.chunk_mb, "buffer_count": args.buffer_count, "steps": args.steps, "warmup": args.warmup,
        "rounds": args.rounds,
        "nvme_path": nvme_path, "load_average": os.getloadavg(), "v17_optimizer": args.optimizer,
        "ratios": {f"{a}/{d}": C.ratio(results, a, d) for a, d in DS_ANCHOR.items() if {a, d} <= set(arms)},
        "ratios_per_cpu_s": {f"{a}/{d}": C.ratio(results, a, d, "tokens_per_cpu_s") for a, d in DS_ANCHOR.items()
                             if {a, d} <= set(arms)},
        # median over rounds of the mean over ranks: the share of the offloaded optimizer step spent waiting for I/O
        "io_wait_share": {a: _median_io_wait(runs[a]) for a in arms if not a.startswith("ds_")},
        # the planner's nvme transfer seconds per step and rank (no overlap, at the probed bandwidth) next to the
        # tier's measured I/O-thread busy seconds and the step's exposed wait (io_wait_share x offloaded step)
        "drive_bytes_per_s": nvme_bw,
        "planner_vs_measured_io": {
            a: [{k: rk.get(k) for k in ("planned_nvme_bytes_per_step", "planned_io_s_per_step", "io_busy_s_per_step")}
                for rk in [r for r in runs[a] if r["ok"]][-1]["ranks"]]
            for a in arms if a.startswith("nvme") and any(r["ok"] for r in runs[a])
        },
        "results": results, "memory_table": table,
        "losses": losses, "v17_losses_identical": all(v == first for v in v17_losses.values()),
        "wall_s": round(time.monotonic() - t_start, 1),
    }  # fmt: skip
    C.emit_json(out, args.json_out)
    return out


if __name__ == "__main__":
    C.run_main(main)
