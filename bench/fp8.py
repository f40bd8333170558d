"""FP8 side by side on CPU: float8 tensorwise and rowwise (``V17Strategy(fp8=...)``'s engine step) against bf16, on
2 gloo ranks, one invocation.

Every configuration is the same model (``bench/_common.py``: the small GPT, seed 0, every block Linear's dims divide
16), the same synthetic batches, ZeRO-3 through ``lightning_v17.engine.parallelize`` with FSDP2 mixed precision
(bf16 compute weights, fp32 master weights and gradient reduction, ``torch.optim.AdamW``), the same steps:

* ``bf16``: the blocks' Linears are plain ``nn.Linear`` in bf16;
* ``fp8_tensorwise`` / ``fp8_rowwise``: they are torchao ``Float8Linear`` (``engine/fp8/convert.py``): their three GEMMs per
  step run as ``torch._scaled_mm`` on float8 operands, bf16 out. The embeddings, the head and the norms stay bf16.
  At ZeRO-3 ``tensorwise`` all-gathers the weights in float8 (the default ``fp8_all_gather``);
* ``fp8_delayed``: lightning-v17's delayed scaling (``engine/fp8/delayed.py``): the same three ``torch._scaled_mm``
  with scales from a 16-step amax history, the amaxes all-reduced (MAX) once per step;

Each configuration runs in its own pair of fresh processes, interleaved over ``--rounds`` rounds (order rotated),
median reported (``bench/_common.py``). Each run counts its ``torch._scaled_mm`` calls, so an fp8 number that
silently measured bf16 is visible (``scaled_mm_per_step`` must be 3 x ``fp8_layers``).

* ``fp32``: plain fp32 everywhere, for context.

There is no speed target on CPU: x86 CPUs have no float8 matmul units, so ``torch._scaled_mm`` there runs without
float8 hardware, and the float8 casts (amax, scale, cast) are extra memory passes. What the CPU ratio measures is
which kernels this CPU has: on a CPU without AVX512-BF16 (``cpu_capability`` "AVX2" in the JSON) torch's bf16 GEMM is
a slow fallback (measured here with one thread: about 0.7 GFLOP/s, against 44 for fp32 and 30-50 for
``torch._scaled_mm`` on float8 operands), so fp8 "beats" bf16 there for reasons that say nothing about a GPU. The
targets of issue 12 (>= 1.3x on large GEMMs, >= 1.15x end to end) are for H100/H200 (``bench/gpu_check.sh``);
torchao's README reports +25% tokens/s (tensorwise, float8 all-gather) and +10% (rowwise) for Llama3-8B on 8xH100.

Output: one JSON object on stdout (and in ``--json-out``) with ``results`` per configuration and ``ratios``
(``fp8_*/bf16`` and ``fp8_*/fp32``), wall clock and per CPU-second.

``--quality`` instead trains the main job (``configs/tiny-cpu.yaml``: the tiny reference Llama on the embedded
stdlib corpus, ZeRO-3 on 2 ranks) for ``--quality-steps`` (default 200) steps once per recipe, through ``v17 fit``
with only these changes: ``fp8`` on the strategy, ``precision`` (fp8 runs keep fp32 outside the converted Linears;
``bf16`` is ``bf16-mixed``, with torch's AdamW not fused, since Lightning refuses gradient clipping with a fused
optimizer under mixed precision), no time limit, validation every 50 steps, no checkpoints, logs in a temporary
directory.
It prints the final validation losses and their largest relative spread (issue 12: within 3%).

Usage::

    .venv/bin/python bench/fp8.py                 # 5 configurations, 2 rounds (about 5 minutes on 2 cores)
    .venv/bin/python bench/fp8.py --rounds 3 --shape '{"hidden": 512}'
    .venv/bin/python bench/fp8.py --quality --quality-recipes fp8_tensorwise,fp8_delayed,bf16
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # after the path insert, so `python bench/fp8.py` works from anywhere

#: name -> (fp8 recipe or None, FSDP2 param_dtype name)
CONFIGS = {
    "bf16": (None, "bfloat16"),
    "fp8_tensorwise": ("tensorwise", "bfloat16"),
    "fp8_rowwise": ("rowwise", "bfloat16"),
    "fp8_delayed": ("delayed", "bfloat16"),
    "fp32": (None, None),
}
RATIOS = [("fp8_tensorwise", "bf16"), ("fp8_rowwise", "bf16"), ("fp8_delayed", "bf16"), ("fp8_tensorwise", "fp32"),
          ("fp8_rowwise", "fp32"), ("fp8_delayed", "fp32")]  # fmt: skip
DEFAULT_SHAPE = {"batch": 2}  # bf16 GEMMs can be very slow on a CPU without AVX512-BF16 (module doc)


def _worker(args: argparse.Namespace) -> None:
    rank, world = C.worker_setup()
    import torch
    import torch.distributed as dist

    from lightning_v17.config import FP8Policy, MeshSpec, TrainingPolicy, ZeroPolicy
    from lightning_v17.engine.parallelize import parallelize
    from lightning_v17.mesh import MeshRuntime, build_device_mesh

    dist.init_process_group("gloo", rank=rank, world_size=world)
    shape = C.GPTShape(**json.loads(args.shape))
    recipe, dtype = CONFIGS[args._worker]
    calls = [0]
    orig = torch._scaled_mm

    def counted(*a, **k):
        calls[0] += 1
        return orig(*a, **k)

    torch._scaled_mm = counted  # torchao looks it up at call time
    spec = MeshSpec(dp_shard=world)
    mesh = MeshRuntime(spec, build_device_mesh(spec, device_type="cpu"))
    model = C.build_gpt(shape)
    policy = TrainingPolicy(zero=ZeroPolicy(stage=3), fp8=FP8Policy(recipe, backend="torchao") if recipe else None)
    done = parallelize(
        model,
        mesh=mesh,
        policy=policy,
        device="cpu",
        param_dtype=getattr(torch, dtype) if dtype else None,
        reduce_dtype=torch.float32,
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    timer = C.StepTimer(args.warmup, args.steps)
    loss = None
    per_step = []
    for step, batch in enumerate(C.make_batches(shape, rank, args.warmup + args.steps)):
        before = calls[0]
        loss = C.lm_loss(model(batch["input"]), batch["target"])
        loss.backward()
        opt.step()
        if done.fp8 is not None:
            done.fp8.after_optimizer_step()  # what V17Strategy does: float8 all-gather scales, delayed histories
        opt.zero_grad(set_to_none=True)
        per_step.append(calls[0] - before)
        timer.after_step(step)
    C.write_result(
        args._out, timer, shape, world,
        loss_last=float(loss), fp8_layers=len(done.fp8_layers), scaled_mm_per_step=max(per_step),
    )  # fmt: skip
    dist.destroy_process_group()


#: --quality: name -> (V17Strategy fp8 recipe or None, Trainer precision)
QUALITY = {
    "fp8_tensorwise": ("tensorwise", "32-true"),
    "fp8_delayed": ("delayed", "32-true"),
    "bf16": (None, "bf16-mixed"),
    "fp32": (None, "32-true"),
}


def _quality_config(name: str, steps: int, root: str) -> str:
    """The main job's YAML with the recipe's changes (module doc); returns the path of the written file."""
    import yaml

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(here, "configs", "tiny-cpu.yaml")) as f:
        cfg = yaml.safe_load(f)
    recipe, precision = QUALITY[name]
    tr = cfg["trainer"]
    if recipe:
        tr["strategy"]["init_args"]["fp8"] = recipe
    tr.update(precision=precision, max_steps=steps, max_time=None, val_check_interval=50, default_root_dir=root,
              enable_progress_bar=False)  # fmt: skip
    tr["logger"]["init_args"]["save_dir"] = root
    tr["callbacks"] = [c for c in tr["callbacks"] if not c["class_path"].endswith("AsyncCheckpoint")]
    if precision.endswith("-mixed"):
        # Lightning's MixedPrecision plugin refuses gradient clipping with a fused optimizer ("does not allow for
        # gradient clipping because it performs unscaling of gradients internally"): the same AdamW, not fused
        cfg["model"]["optimizer"] = {"class_path": "torch.optim.AdamW", "init_args": {"fused": False}}
    path = os.path.join(root, f"{name}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    return path


def _val_losses(root: str) -> list[tuple[int, float]]:
    """(step, val_loss) rows from the CSVLogger's metrics.csv under ``root``."""
    import csv
    import glob

    rows = []
    for path in glob.glob(os.path.join(root, "logs", "*", "metrics.csv")):
        with open(path) as f:
            for r in csv.DictReader(f):
                if r.get("val_loss"):
                    rows.append((int(r["step"]), float(r["val_loss"])))
    return sorted(rows)


def quality(args: argparse.Namespace) -> dict:
    """``--quality``: one ``v17 fit`` per recipe (module doc); final validation losses and their spread."""
    import subprocess
    import tempfile

    names = [n.strip() for n in args.quality_recipes.split(",") if n.strip()]
    v17 = os.path.join(os.path.dirname(sys.executable), "v17")
    out: dict = {"job": "configs/tiny-cpu.yaml", "steps": args.quality_steps, "results": {}}
    t_start = time.monotonic()
    for n in names:
        root = tempfile.mkdtemp(prefix=f"v17-fp8-quality-{n}-")
        t = time.monotonic()
        proc = subprocess.run([v17, "fit", "--config", _quality_config(n, args.quality_steps, root)],
                              capture_output=True, text=True, check=False)  # fmt: skip
        curve = _val_losses(root)
        res = {"seconds": round(time.monotonic() - t, 1), "rc": proc.returncode, "val_loss_curve": curve,
               "final_val_loss": curve[-1][1] if curve else None}  # fmt: skip
        if proc.returncode != 0 or not curve:
            res["error"] = proc.stderr[-1500:]
        out["results"][n] = res
        print(f"[quality] {n}: final val_loss {res['final_val_loss']} ({res['seconds']}s)", file=sys.stderr)
    finals = {n: r["final_val_loss"] for n, r in out["results"].items() if r["final_val_loss"] is not None}
    if len(finals) > 1:
        lo, hi = min(finals.values()), max(finals.values())
        out["max_relative_spread"] = round((hi - lo) / lo, 5)
        out["within_3_percent"] = (hi - lo) / lo <= 0.03
    out["cpu_capability"] = _cpu_capability()
    out["wall_s"] = round(time.monotonic() - t_start, 1)
    C.emit_json(out, args.json_out)
    return out


def _cpu_capability() -> str:
    import torch

    return torch.backends.cpu.get_cpu_capability()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=4, help="timed optimizer steps per run (default 4)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed warm-up steps before them (default 1, >= 1)")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds; the median is reported (default 2)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of: " + ", ".join(CONFIGS))
    ap.add_argument(
        "--shape", default=json.dumps(DEFAULT_SHAPE), help="GPTShape overrides as JSON (default %(default)s)"
    )
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per run before both ranks are killed")
    ap.add_argument("--json-out", default=None, help="also write the JSON here")
    ap.add_argument("--quality", action="store_true", help="train the main job per recipe; report validation losses")
    ap.add_argument("--quality-steps", type=int, default=200, help="--quality: optimizer steps per run (default 200)")
    ap.add_argument("--quality-recipes", default=",".join(QUALITY), help="--quality: subset of " + ", ".join(QUALITY))
    ap.add_argument("--_worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._worker:  # inside one rank
        _worker(args)
        return {}
    if args.quality:
        return quality(args)
    if args.warmup < 1 or args.steps < 1:
        ap.error("--warmup and --steps must be >= 1 (the timed window starts at a barrier after the warm-up)")
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        ap.error(f"unknown --configs {unknown}; choose from {list(CONFIGS)}")
    shape = C.GPTShape(**json.loads(args.shape))
    common = ["--steps", str(args.steps), "--warmup", str(args.warmup), "--shape", json.dumps(C.asdict(shape))]
    runs: dict[str, list[dict]] = {n: [] for n in names}
    t_start = time.monotonic()
    for rnd in range(args.rounds):
        for n in names[rnd % len(names) :] + names[: rnd % len(names)]:  # rotate: no fixed position
            t = time.monotonic()
            res = C.launch(os.path.abspath(__file__), ["--_worker", n, *common], timeout_s=args.timeout)
            runs[n].append(res)
            tps = f"{res['ranks'][0]['tokens_per_s']:.0f} tok/s" if res["ok"] else "FAILED: " + res["error"][:300]
            print(f"[round {rnd + 1}/{args.rounds}] {n}: {tps} ({time.monotonic() - t:.0f}s)", file=sys.stderr)
    results = {}
    for n in names:
        results[n] = C.summarize(runs[n])
        ok = [r for r in runs[n] if r["ok"]]
        if ok:
            rank0 = ok[-1]["ranks"][0]
            results[n].update(fp8_layers=rank0["fp8_layers"], scaled_mm_per_step=rank0["scaled_mm_per_step"])
    out = {
        "model": {"name": "bench._common.build_gpt (pre-LN GPT)", **C.shape_dict(shape)},
        "world_size": 2,
        "zero_stage": 3,
        "precision": "fp32 master weights and reduction; FSDP2 param_dtype bf16 (bf16, fp8_*) or fp32 (fp32)",
        "cpu_capability": _cpu_capability(),
        "steps": args.steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "threads_per_rank": 1,
        "results": results,
        **C.ratio_tables(results, names, RATIOS),
        "note": "CPU: no float8 matmul units, so no speed target; GPU targets are measured by bench/gpu_check.sh",
        "wall_s": round(time.monotonic() - t_start, 1),
    }
    C.emit_json(out, args.json_out)
    return out


if __name__ == "__main__":
    C.run_main(main)
