"""Importing a DeepSpeed checkpoint: V17's online load against DeepSpeed's universal-checkpoint route, same files.

One invocation. Raw DeepSpeed (CPU accelerator, gloo, 2 ranks, torch AdamW) trains the reference Llama (~58M fp32
parameters by default) for one step at ZeRO-2 and at ZeRO-3 and saves with ``engine.save_checkpoint``: per save
about 0.9 GB of fp32 master weights and Adam moments in the optimizer files. Then, on each save:

* ours, in this process: ``read_deepspeed_checkpoint`` (every file read with the allow-listed loader, every
  parameter's fp32 master, ``exp_avg`` and ``exp_avg_sq`` reconstructed at full shape), ``read_s``;
* DeepSpeed's route, in this process: ``deepspeed.checkpoint.ds_to_universal.main`` with ``--inject_missing_state``
  (deepspeed already imported; one extract and one merge worker: its process pools fork, and forking a process
  whose torch threads have run hangs), ``ds_to_universal_s``; and the same as the CLI users run, ``python -m
  deepspeed.checkpoint.ds_to_universal --inject_missing_state`` with its default 4 extract / 2 merge workers in a
  subprocess (interpreter start and imports included), ``ds_to_universal_cli_s``;
* on 2 fresh ranks: a DeepSpeed engine loading the universal checkpoint (``checkpoint.load_universal``,
  ``engine.load_checkpoint``), ``universal_load_s``; and V17 loading the DeepSpeed save directly inside
  ``trainer.fit(ckpt_path=save_dir)`` at the same ZeRO stage, ``v17_restore_s`` (``Strategy.load_checkpoint``:
  read, cut to the rank's shards, set), plus ``fit_to_first_step_s`` with and without ``ckpt_path``.

Times on ranks are the slowest rank's, between barriers. In-process times are the median of ``--repeats``
(interleaved: ours, then DeepSpeed's, per round); the CLI runs ``--cli-repeats`` times. Target: the online import
(``v17_restore_s``) takes at most 1/3 of the universal route (``ds_to_universal_s + universal_load_s``).

    .venv/bin/python bench/deepspeed_ckpt.py [--layers 8] [--hidden 512] [--vocab 32000] [--repeats 3]
        [--json-out bench/results/deepspeed_ckpt.json]
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # after the path insert, so the script runs from anywhere

STAGES = (2, 3)
SEQ = 64


def _config(args: argparse.Namespace):
    from lightning_v17.models import ModelConfig

    return ModelConfig(vocab_size=args.vocab, hidden=args.hidden, layers=args.layers, heads=8, kv_heads=4,
                       ffn=3 * args.hidden, max_seq_len=SEQ, dropout=0.0)  # fmt: skip


def _ds_config(stage: int, **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
            "zero_force_ds_cpu_optimizer": False, "steps_per_print": 10**9, **extra}  # fmt: skip


def _import_deepspeed(root: str):
    os.environ["DS_ACCELERATOR"] = "cpu"
    os.environ["TORCH_EXTENSIONS_DIR"] = str(Path(root) / "torch_extensions")  # never wait on a stale shared lock
    import deepspeed
    import deepspeed.ops

    # DeepSpeed's shared-memory all-reduce is a JIT-built C++ op (about 70 s of g++); gloo does the same job
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return deepspeed


def _tokens(rank: int, vocab: int):
    import torch

    g = torch.Generator().manual_seed(100 + rank)
    return torch.randint(0, vocab, (1, SEQ + 1), generator=g)


def _slowest(seconds: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _worker(rank: int, world: int, port: int, phase: str, args: argparse.Namespace, root: str, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))  # fmt: skip
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    out = _save_phase(rank, args, root) if phase == "save" else _load_phase(rank, args, root)
    if rank == 0:
        queue.put(out)


def _save_phase(rank: int, args: argparse.Namespace, root: str) -> dict:
    import torch
    import torch.distributed as dist

    from lightning_v17.models import Llama

    deepspeed = _import_deepspeed(root)
    dist.init_process_group("gloo")
    out = {}
    for stage in STAGES:
        torch.manual_seed(0)
        model = Llama(_config(args))
        num_params = model.num_params()  # before ZeRO-3 partitions them
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=_ds_config(stage))
        tok = _tokens(rank, args.vocab)
        logits = engine(tok[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tok[:, 1:].flatten())
        engine.backward(loss)
        engine.step()
        dist.barrier()
        t0 = time.perf_counter()
        engine.save_checkpoint(str(Path(root) / f"z{stage}"))
        out[f"z{stage}"] = {"save_s": _slowest(time.perf_counter() - t0), "num_params": num_params}
        del engine, model, opt
        gc.collect()
    dist.barrier()
    return out


def _load_phase(rank: int, args: argparse.Namespace, root: str) -> dict:
    import lightning as L
    import torch
    import torch.distributed as dist
    from lightning.pytorch.callbacks import Callback
    from torch.utils.data import DataLoader

    from lightning_v17 import V17Strategy
    from lightning_v17.models import Llama

    deepspeed = _import_deepspeed(root)
    dist.init_process_group("gloo")
    out: dict = {}
    for stage in STAGES:
        name = f"z{stage}"
        tag = (Path(root) / name / "latest").read_text().strip()
        # DeepSpeed's route, second half: a fresh engine loads the universal checkpoint
        torch.manual_seed(1)
        model = Llama(_config(args))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        cfg = _ds_config(stage, checkpoint={"load_universal": True})
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
        dist.barrier()
        t0 = time.perf_counter()
        engine.load_checkpoint(str(Path(root) / f"universal_{name}"), tag=tag, load_optimizer_states=True)
        universal_load_s = _slowest(time.perf_counter() - t0)
        del engine, model, opt
        gc.collect()

        # ours: trainer.fit(ckpt_path=<the DeepSpeed save>) at the same ZeRO stage
        class Timed(V17Strategy):
            restore_s = 0.0

            def load_checkpoint(self, checkpoint_path, weights_only=None):
                t = time.perf_counter()
                res = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
                Timed.restore_s = time.perf_counter() - t
                return res

        class FirstStep(Callback):
            at = None

            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                FirstStep.at = FirstStep.at or time.perf_counter()

        class LM(L.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                torch.manual_seed(1)
                self.model = Llama(_config(args))

            def training_step(self, batch, batch_idx):
                logits = self.model(batch[:, :-1])
                return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())

            def configure_optimizers(self):
                return torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.01)

        fits = {}
        for resume in (False, True):
            FirstStep.at, Timed.restore_s = None, 0.0
            trainer = L.Trainer(accelerator="cpu", devices=2, strategy=Timed(zero_stage=stage), max_steps=1,
                                logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False, gradient_clip_val=1.0, callbacks=[FirstStep()],
                                use_distributed_sampler=False)  # fmt: skip
            data = DataLoader([_tokens(rank, args.vocab)[0]], batch_size=1)
            dist.barrier()
            t0 = time.perf_counter()
            trainer.fit(LM(), data, ckpt_path=str(Path(root) / name) if resume else None)
            fits[resume] = (_slowest(FirstStep.at - t0), _slowest(Timed.restore_s))
            del trainer
            gc.collect()
        out[name] = {"universal_load_s": universal_load_s, "v17_restore_s": fits[True][1],
                     "fit_to_first_step_s": {"fresh": fits[False][0], "resumed": fits[True][0]}}  # fmt: skip
    return out


def _spawn(phase: str, args: argparse.Namespace, root: str) -> dict:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = C.free_port()
    procs = [ctx.Process(target=_worker, args=(r, 2, port, phase, args, root, queue)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(args.timeout)
    for p in procs:
        if p.is_alive():
            p.kill()
    if any(p.exitcode != 0 for p in procs) or queue.empty():
        raise RuntimeError(f"the {phase} ranks failed: exit codes {[p.exitcode for p in procs]}")
    return queue.get()


def _universal_args(src: Path, dst: Path) -> list[str]:
    # the CLI's defaults (4 extract workers, 2 merge workers), plus what a ZeRO save without universal info needs
    return ["--input_folder", str(src), "--output_folder", str(dst), "--inject_missing_state"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--repeats", type=int, default=3, help="in-process timings per save (median)")
    p.add_argument("--cli-repeats", type=int, default=1, help="ds_to_universal CLI runs per save")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per 2-rank phase")
    p.add_argument("--dir", default=None, help="where to write (default: a temp dir, removed afterwards)")
    p.add_argument("--json-out", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    root = tempfile.mkdtemp(prefix="v17-bench-dsckpt-", dir=args.dir)
    try:
        saved = _spawn("save", args, root)
        from lightning_v17.checkpoint.deepspeed import read_deepspeed_checkpoint

        t0 = time.perf_counter()
        _import_deepspeed(root)
        from deepspeed.checkpoint import ds_to_universal

        import_s = time.perf_counter() - t0
        results: dict = {}
        for stage in STAGES:
            name = f"z{stage}"
            src = Path(root) / name
            tag = (src / "latest").read_text().strip()
            dst = Path(root) / f"universal_{name}" / tag
            # serial: its process pools fork, and a fork of this process (torch's threads already ran) hangs
            ns = argparse.Namespace(input_folder=str(src / tag), output_folder=str(dst), num_extract_workers=1,
                                    num_merge_workers=1, keep_temp_folder=False, strict=True,
                                    inject_missing_state=True)  # fmt: skip
            read_s, uni_s, cli_s = [], [], []
            for _ in range(args.repeats):
                t = time.perf_counter()
                ds = read_deepspeed_checkpoint(src)
                read_s.append(time.perf_counter() - t)
                state_bytes = sum(t.numel() * t.element_size() for t in ds.fp32.values())
                state_bytes += sum(v.numel() * v.element_size() for st in ds.optim.values() for v in st.values()
                                   if hasattr(v, "numel"))  # fmt: skip
                del ds
                gc.collect()
                shutil.rmtree(dst.parent, ignore_errors=True)
                t = time.perf_counter()
                ds_to_universal.main(ns)
                uni_s.append(time.perf_counter() - t)
            for _ in range(args.cli_repeats):
                shutil.rmtree(dst.parent, ignore_errors=True)
                t = time.perf_counter()
                cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", *_universal_args(src / tag, dst)]
                subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "DS_ACCELERATOR": "cpu"})
                cli_s.append(time.perf_counter() - t)
            results[name] = {"read_s": statistics.median(read_s), "ds_to_universal_s": statistics.median(uni_s),
                             "ds_to_universal_cli_s": statistics.median(cli_s), "state_bytes": state_bytes,
                             "all_s": {"read": read_s, "ds_to_universal": uni_s, "ds_to_universal_cli": cli_s},
                             **saved[name]}  # fmt: skip
        loaded = _spawn("load", args, root)
        ratios: dict = {}
        for name, r in results.items():
            r.update(loaded[name])
            route = r["ds_to_universal_s"] + r["universal_load_s"]
            r["universal_route_s"] = route
            ratios[f"{name} read / ds_to_universal"] = r["read_s"] / r["ds_to_universal_s"]
            ratios[f"{name} read / ds_to_universal CLI"] = r["read_s"] / r["ds_to_universal_cli_s"]
            ratios[f"{name} online restore / universal route"] = r["v17_restore_s"] / route
            ratios[f"{name} online restore / universal route (CLI)"] = r["v17_restore_s"] / (
                r["ds_to_universal_cli_s"] + r["universal_load_s"]
            )
        report = {
            "bench": "deepspeed_ckpt",
            "world_size": 2,
            "model": {"layers": args.layers, "hidden": args.hidden, "vocab": args.vocab, "dtype": "float32"},
            "deepspeed_import_s": import_s,
            "results": _rounded(results),
            "ratios": {k: round(v, 4) for k, v in ratios.items()},
            "targets": "online restore <= 1/3 of the universal route (ds_to_universal in process + universal load)",
            "meets_targets": all(v <= 1 / 3 for k, v in ratios.items() if k.endswith("restore / universal route")),
        }
        C.emit_json(report, args.json_out)
        return 0
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _rounded(x):
    if isinstance(x, float):
        return round(x, 4)
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_rounded(v) for v in x]
    return x


if __name__ == "__main__":
    sys.exit(main())
