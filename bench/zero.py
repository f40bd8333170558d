"""ZeRO side by side: V17Strategy stages 1/2/3 against Lightning's ModelParallelStrategy (FSDP2) and "ddp", and raw
DeepSpeed ZeRO-1/2/3 (``deepspeed.initialize`` + a hand-written loop), on 2 CPU ranks (gloo), one invocation.

Same model (``bench/_common.py``: a small fp32 GPT, seed 0), same synthetic token batches (fixed seed per rank), same
optimizer (``torch.optim.AdamW``, lr 1e-3, weight decay 0.01, torch defaults otherwise; DeepSpeed gets the same
torch optimizer object with ``zero_allow_untested_optimizer`` and ``zero_force_ds_cpu_optimizer: false``, or its
JIT-built ``DeepSpeedCPUAdam`` with ``--ds-optimizer cpu_adam``), same number of steps, one intra-op thread per rank.
Each configuration runs in its own pair of fresh processes; configurations are interleaved over ``--rounds`` rounds
(order rotated each round) and the median is reported, so machine drift hits all of them alike.

Output: one JSON object on stdout (and in ``--json-out``)::

    {"model": {...}, "world_size": 2, "results": {name: {"tokens_per_s", "peak_rss_mb": [r0, r1], ...}},
     "ratios": {"v17_zero3/lightning_model_parallel": ..., ...}}

``exposed_comm_share`` (per configuration) is the share of the timed window that rank 0 and rank 1 (mean) spent
blocked in collectives on the main thread (``_common.CommTimer``: synchronous collectives timed whole, asynchronous
ones while waited for), i.e. communication not hidden behind compute, peer skew included; the ``v17_zero*_sync``
configurations run the same strategy with ``overlap_comm=False``, the "before" of the overlap. DDP's reducer issues
its collectives from C++, which this timer does not see. ``V17_BENCH_COMM_TIMER=0`` leaves the DeepSpeed workers
untimed (to rule the timer out when DeepSpeed misbehaves). Note: DeepSpeed JIT-builds its ``deepspeed_shm_comm`` op
at the first CPU run (minutes on a busy machine); a run killed by ``--timeout`` during that build leaves a stale
``~/.cache/torch_extensions/py311_cpu/deepspeed_shm_comm/lock`` that makes every later DeepSpeed start wait forever:
give the first run a long ``--timeout``.

tokens/s is global (both ranks) over the timed steps, between barriers; warm-up steps are excluded. Peak RSS is
``ru_maxrss`` of each rank's process, in MB. ``tokens_per_cpu_s`` (and ``ratios_per_cpu_s``) divide the same tokens
by the process CPU time of both ranks over the same steps: when other jobs share the cores, wall-clock ratios mostly
measure when each run happened to be scheduled, while CPU seconds per token measure the work of each code path (it
does not charge time spent blocked waiting for the peer rank, so compare it together with the wall-clock ratio).

Usage::

    .venv/bin/python bench/zero.py                          # all configurations, 2 rounds
    .venv/bin/python bench/zero.py --configs v17_zero3,lightning_model_parallel,deepspeed_zero3 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # after the path insert, so `python bench/zero.py` works from anywhere

LR = 1e-3
WEIGHT_DECAY = 0.01

# name -> (family, argument). Lightning configurations share one LightningModule; DeepSpeed shares one loop.
CONFIGS: dict[str, tuple[str, str]] = {
    "v17_zero1": ("lightning", "v17:1"),
    "v17_zero2": ("lightning", "v17:2"),
    "v17_zero3": ("lightning", "v17:3"),
    # the same with every collective synchronous (overlap_comm=False): the "before" of the overlap, for its share of
    # exposed communication and its speed-up, in the same invocation
    "v17_zero1_sync": ("lightning", "v17:1:sync"),
    "v17_zero2_sync": ("lightning", "v17:2:sync"),
    "v17_zero3_sync": ("lightning", "v17:3:sync"),
    # ZeRO-3 with reshard_after_forward=False: gathered blocks kept from forward to backward (one all-gather of each
    # per step less), what DeepSpeed's default stage3_max_reuse_distance (1e9 elements) does on a model this small
    "v17_zero3_keep": ("lightning", "v17:3:keep"),
    "lightning_model_parallel": ("lightning", "model_parallel"),
    "lightning_ddp": ("lightning", "ddp"),
    "deepspeed_zero1": ("deepspeed", "1"),
    "deepspeed_zero2": ("deepspeed", "2"),
    "deepspeed_zero3": ("deepspeed", "3"),
}
RATIOS = [
    ("v17_zero3", "lightning_model_parallel"),
    ("v17_zero3", "deepspeed_zero3"),
    ("v17_zero1", "deepspeed_zero1"),
    ("v17_zero2", "deepspeed_zero2"),
    ("v17_zero3", "lightning_ddp"),
    ("v17_zero3_keep", "lightning_ddp"),
    ("v17_zero3_keep", "deepspeed_zero3"),
    ("v17_zero1", "lightning_ddp"),
    ("v17_zero2", "lightning_model_parallel"),
    ("v17_zero2", "lightning_ddp"),
    ("v17_zero1", "v17_zero1_sync"),
    ("v17_zero2", "v17_zero2_sync"),
    ("v17_zero3", "v17_zero3_sync"),
]


# ------------------------------------------------------------------------------------------------------ workers


def _lightning_worker(args: argparse.Namespace, which: str) -> None:
    rank, world = C.worker_setup()
    C.COMM.install()
    import lightning as L
    import torch

    shape = C.GPTShape(**json.loads(args.shape))
    batches = C.make_batches(shape, rank, args.warmup + args.steps)
    timer = C.StepTimer(args.warmup, args.steps)
    losses: list[float] = []

    class BenchLM(L.LightningModule):
        """Written the way Lightning's docs write it: the model is built in ``configure_model``; for
        ModelParallelStrategy that hook also applies FSDP2 ``fully_shard`` per block and at the root."""

        def __init__(self, fsdp2: bool) -> None:
            super().__init__()
            self.fsdp2 = fsdp2
            self.model = None

        def configure_model(self) -> None:
            if self.model is not None:
                return
            self.model = C.build_gpt(shape)
            if self.fsdp2:
                from torch.distributed.fsdp import fully_shard

                mesh = self.device_mesh["data_parallel"]
                for blk in self.model.blocks:
                    fully_shard(blk, mesh=mesh)
                fully_shard(self.model, mesh=mesh)

        def training_step(self, batch, batch_idx):
            return C.lm_loss(self.model(batch["input"]), batch["target"])

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(batches, batch_size=None, shuffle=False)

    class Timing(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))
            timer.after_step(batch_idx)

    if which.startswith("v17:"):
        from lightning_v17.strategies import V17Strategy

        from lightning_v17.config import ZeroPolicy

        parts = which.split(":")
        zero = ZeroPolicy(stage=int(parts[1]), overlap_comm=parts[-1] != "sync",
                          reshard_after_forward=False if parts[-1] == "keep" else None)  # fmt: skip
        strategy = V17Strategy(zero=zero)
    elif which == "model_parallel":
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    else:
        strategy = which
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        precision="32-true",
        max_steps=args.warmup + args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[Timing()],
    )
    if args.profile and rank == 0:
        _profiled(lambda: trainer.fit(BenchLM(fsdp2=which == "model_parallel")), args.profile)
    else:
        trainer.fit(BenchLM(fsdp2=which == "model_parallel"))
    C.write_result(args._out, timer, shape, world, loss_last=losses[-1], strategy=type(trainer.strategy).__name__)


def _deepspeed_config(stage: int, shape: C.GPTShape) -> dict:
    """DeepSpeed's recommended settings for each stage, fp32. Buckets are large so that a model this small is
    reduced/gathered in few collectives (the latency of gloo, not its bandwidth, is what costs here)."""
    zero: dict = {"stage": stage, "contiguous_gradients": True, "overlap_comm": False}
    if stage in (1, 2):
        zero.update(reduce_scatter=True, reduce_bucket_size=int(5e8), allgather_bucket_size=int(5e8))
    if stage == 3:
        zero.update(
            reduce_bucket_size=int(5e8),
            stage3_prefetch_bucket_size=int(5e7),
            stage3_param_persistence_threshold=int(1e5),
            stage3_max_live_parameters=int(1e9),
            stage3_max_reuse_distance=int(1e9),
        )
    return {
        "train_micro_batch_size_per_gpu": shape.batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def _deepspeed_worker(args: argparse.Namespace, stage: int) -> None:
    rank, world = C.worker_setup()
    import deepspeed
    import torch

    if os.environ.get("V17_BENCH_COMM_TIMER", "1") == "1":
        C.COMM.install()
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    torch.set_num_threads(1)  # in case an import reset it
    shape = C.GPTShape(**json.loads(args.shape))
    batches = C.make_batches(shape, rank, args.warmup + args.steps)
    model = C.build_gpt(shape)
    if args.ds_optimizer == "cpu_adam":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        opt = DeepSpeedCPUAdam(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, adamw_mode=True)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=_deepspeed_config(stage, shape))
    torch.set_num_threads(1)
    timer = C.StepTimer(args.warmup, args.steps)
    losses: list[float] = []

    def loop() -> None:
        for i, b in enumerate(batches):
            loss = C.lm_loss(engine(b["input"]), b["target"])
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
            timer.after_step(i)

    if args.profile and rank == 0:
        _profiled(loop, args.profile)
    else:
        loop()
    C.write_result(args._out, timer, shape, world, loss_last=losses[-1], ds_optimizer=args.ds_optimizer)


def _profiled(fn, path: str) -> None:
    """torch.profiler over the whole run on rank 0; the top ops by self CPU time go to ``path`` (text)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    with open(path, "w") as f:
        f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))


# --------------------------------------------------------------------------------------------------------- driver


def _v17_importable() -> str | None:
    """None if ``lightning_v17.strategies.V17Strategy`` imports in a fresh interpreter, else the error's last line."""
    p = subprocess.run(
        [sys.executable, "-c", "from lightning_v17.strategies import V17Strategy"],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if p.returncode == 0:
        return None
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    return lines[-1] if lines else f"exit code {p.returncode}"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=6, help="timed optimizer steps per run (default 6)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed warm-up steps before them (default 2, >= 1)")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds; the median is reported (default 2)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of: " + ", ".join(CONFIGS))
    ap.add_argument("--json-out", default=None, help="also write the JSON here")
    ap.add_argument(
        "--ds-optimizer",
        choices=["torch", "cpu_adam"],
        default="torch",
        help="DeepSpeed's optimizer: torch.optim.AdamW (default) or its JIT-built DeepSpeedCPUAdam",
    )
    ap.add_argument("--shape", default="{}", help="GPTShape overrides as JSON, e.g. '{\"hidden\": 384}'")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per run before both ranks are killed")
    ap.add_argument("--profile", default=None, help="write rank 0's torch.profiler table here (single config only)")
    ap.add_argument("--_worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args._worker:  # inside one rank
        family, which = CONFIGS[args._worker]
        if family == "lightning":
            _lightning_worker(args, which)
        else:
            _deepspeed_worker(args, int(which))
        return {}

    if args.warmup < 1 or args.steps < 1:
        ap.error("--warmup and --steps must be >= 1 (the timed window starts at a barrier after the warm-up)")
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        ap.error(f"unknown --configs {unknown}; choose from {list(CONFIGS)}")
    shape = C.GPTShape(**json.loads(args.shape))

    skipped: dict[str, str] = {}
    if any(n.startswith("v17_") for n in names):
        err = _v17_importable()
        if err:
            for n in names:
                if n.startswith("v17_"):
                    skipped[n] = f"V17Strategy not importable: {err}"
    todo = [n for n in names if n not in skipped]

    worker_common = [
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--shape",
        json.dumps(C.asdict(shape)),
        "--ds-optimizer",
        args.ds_optimizer,
    ]
    if args.profile:
        worker_common += ["--profile", args.profile]
    runs: dict[str, list[dict]] = {n: [] for n in todo}
    t_start = time.monotonic()
    for rnd in range(args.rounds):
        order = todo[rnd % len(todo) :] + todo[: rnd % len(todo)] if todo else []  # rotate: no fixed position
        for n in order:
            t = time.monotonic()
            res = C.launch(os.path.abspath(__file__), ["--_worker", n, *worker_common], timeout_s=args.timeout)
            runs[n].append(res)
            tps = f"{res['ranks'][0]['tokens_per_s']:.0f} tok/s" if res["ok"] else "FAILED: " + res["error"][:300]
            print(
                f"[round {rnd + 1}/{args.rounds}] {n}: {tps} ({time.monotonic() - t:.0f}s)", file=sys.stderr, flush=True
            )

    results = {n: C.summarize(runs[n]) for n in todo}
    results.update({n: {"tokens_per_s": None, "peak_rss_mb": None, "skipped": why} for n, why in skipped.items()})
    out = {
        "model": {"name": "bench._common.build_gpt (pre-LN GPT, fp32)", **C.shape_dict(shape)},
        "world_size": 2,
        "steps": args.steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "optimizer": "torch.optim.AdamW(lr=1e-3, weight_decay=0.01)"
        + ("; DeepSpeed: DeepSpeedCPUAdam (adamw_mode)" if args.ds_optimizer == "cpu_adam" else " for every config"),
        "threads_per_rank": 1,
        "results": results,
        **C.ratio_tables(results, names, RATIOS),
        "exposed_comm_share": {n: results[n].get("exposed_comm_share") for n in todo},
        "wall_s": round(time.monotonic() - t_start, 1),
    }
    C.emit_json(out, args.json_out)
    return out


if __name__ == "__main__":
    C.run_main(main)
