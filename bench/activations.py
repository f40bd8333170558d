"""Saved-activation bytes per transformer block, measured on the reference Llama, against the planner.

For recompute none, selective and full, in fp32 and bf16, a stack of blocks of ``lightning_v17.models.llama`` runs
one forward with ``engine/recompute.py`` applied, and we count what the autograd graph keeps alive for backward:

* **retained** (the number reported): a ``TorchDispatchMode`` records the storage of every tensor an aten op
  returns during the forward, with a weak reference (``StorageWeakRef``). After the forward only the graph holds
  anything, so the storages still alive are exactly what backward will read: tensors saved by autograd,
  the outputs that selective checkpointing caches (``create_selective_checkpoint_contexts`` keeps them in its own
  dict, out of reach of saved-tensor hooks) and the inputs that checkpointing saves. Storages are deduplicated
  (views count once) and parameter storages are left out (they are not activations).
* **hooks** (a cross-check for ``none``): ``torch.autograd.graph.saved_tensors_hooks`` sees every tensor autograd
  saves when no checkpointing hides them; the unique non-parameter storages must add up to the same bytes.

The total over L blocks, divided by L, is the peak saved-activation bytes per block (saving only grows during the
forward; the block input counts in the block that reads it). ``planned`` is
:func:`lightning_v17.planner.memory.activation_bytes_per_layer_of` for the same shape (the llama count), and
``korthikanti`` is Korthikanti 2022 Table 2 as published (GPT block, 16-bit with 1-byte masks; 4-byte elements for
fp32), for comparison.

Under ``--tp N`` the whole model runs with ``engine/tp/apply.py`` on N gloo ranks (CPU), without and with
sequence parallelism; one block's bytes are the retained bytes with two blocks minus those with one.

Run: ``python bench/activations.py`` (CPU, about a minute) prints one JSON object and exits 1 if a row is off by
more than ``--tolerance`` (15%); ``--tp 2`` measures TP/SP; ``--device cuda`` measures the CUDA kernels (flash
SDPA). ``tests/unit/test_activation_bytes.py`` runs the same measurement on a tiny shape.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import sys
import tempfile
from collections.abc import Callable
from dataclasses import replace

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lightning_v17.config import Recompute
from lightning_v17.engine.recompute import apply_activation_checkpointing
from lightning_v17.engine.tp.apply import apply_tensor_parallel
from lightning_v17.models.config import ModelConfig
from lightning_v17.models.llama import Llama
from lightning_v17.models.tp_plans import resolve_tp_plan
from lightning_v17.planner import memory as mem

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _storage(t: torch.Tensor):
    """The storage holding ``t``'s data on this rank (a DTensor's local shard); None for a storage-less wrapper."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t._local_tensor
    if t.device.type == "meta":
        return None
    try:
        storage = t.untyped_storage()
        storage.data_ptr()
    except (RuntimeError, NotImplementedError):  # e.g. the wrapper of an in-flight functional collective
        return None
    return storage


class _StorageRecorder(TorchDispatchMode):
    """Weakly records the storage of every tensor an aten op returns: StorageImpl address -> (weak ref, ptr, bytes).

    Under TP the ops on DTensors are seen here (the mode runs before the subclass), so each output's local shard is
    recorded; the collectives that redistribute them run as ops of their own and are recorded too.
    """

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, tuple[StorageWeakRef, int, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            storage = _storage(t) if isinstance(t, torch.Tensor) else None
            if storage is not None:
                ref = StorageWeakRef(storage)
                old = self.storages.get(ref.cdata)
                if old is None or old[0].expired():  # a freed StorageImpl's address can be reused
                    self.storages[ref.cdata] = (ref, storage.data_ptr(), storage.nbytes())
        return out

    def alive_bytes(self, skip_ptrs: set[int]) -> int:
        return sum(n for ref, ptr, n in self.storages.values() if not ref.expired() and ptr not in skip_ptrs)


def _blocks(config: ModelConfig, *, recompute: Recompute | str, dtype: torch.dtype, device: str):
    torch.manual_seed(0)
    model = Llama(config).to(device=device, dtype=dtype).train()
    blocks = model.recompute_units()
    apply_activation_checkpointing(model, mode=recompute, units=blocks)
    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return model, blocks, param_ptrs


def _forward(blocks, config: ModelConfig, *, dtype: torch.dtype, device: str, seq: int, micro_batch: int,
             context: Callable[[], object]) -> torch.Tensor:
    """Run the blocks on a fresh input under ``context``; return a scalar whose graph holds what backward needs."""
    x0 = torch.randn(micro_batch, seq, config.hidden, dtype=dtype, device=device, requires_grad=True)
    position_ids = torch.arange(seq, device=device).expand(micro_batch, seq)
    with context():
        h = x0.clone()  # not a leaf: it stays alive only if the first block saves it, like an embedding output
        for block in blocks:
            h = block(h, position_ids)
        return h.sum()  # sum's backward saves nothing; dropping h leaves the graph as the only owner


def measure_saved_activation_bytes_per_layer(
    config: ModelConfig, *, recompute: Recompute | str, dtype: torch.dtype, seq: int, micro_batch: int,
    device: str = "cpu",
) -> float:
    """Bytes the autograd graph keeps per block after the forward of ``config.layers`` blocks ("retained").

    Args:
        config: the model shape; ``config.layers`` blocks are stacked (no embedding, norm or output).
        recompute: none, selective or full (``engine/recompute.py``).
        dtype: parameter and activation dtype (torch.float32 or torch.bfloat16, the latter as FSDP2's
            ``param_dtype`` or bf16-true run it).
        seq: tokens per sample (s).
        micro_batch: samples (b).
        device: "cpu" or "cuda".
    """
    model, blocks, param_ptrs = _blocks(config, recompute=recompute, dtype=dtype, device=device)
    recorder = _StorageRecorder()
    out = _forward(blocks, config, dtype=dtype, device=device, seq=seq, micro_batch=micro_batch,
                   context=lambda: recorder)
    gc.collect()
    total = recorder.alive_bytes(param_ptrs | {out.untyped_storage().data_ptr()})
    out.backward()  # the graph was usable: nothing counted was freed early
    del model
    return total / config.layers


def hooked_saved_bytes_per_layer(
    config: ModelConfig, *, dtype: torch.dtype, seq: int, micro_batch: int, device: str = "cpu"
) -> float:
    """Unique non-parameter storages that ``saved_tensors_hooks`` sees, per block (recompute none only)."""
    model, blocks, param_ptrs = _blocks(config, recompute=Recompute.NONE, dtype=dtype, device=device)
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in param_ptrs:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    _forward(blocks, config, dtype=dtype, device=device, seq=seq, micro_batch=micro_batch,
             context=lambda: torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
    del model
    return sum(seen.values()) / config.layers


def measure_tp_saved_activation_bytes_per_layer(
    config: ModelConfig, *, tp_mesh, sequence_parallel: bool, recompute: Recompute | str, dtype: torch.dtype,
    seq: int, micro_batch: int,
) -> float:
    """Retained bytes per block on this rank under tensor (and sequence) parallelism, inside a process group.

    The whole model runs (``apply_tensor_parallel``, then recompute: torchtitan's order), once with one block and
    once with two; the difference is one block's bytes, with the embedding, head and the block input's layout
    (sharded along the sequence under SP) exactly as in training.
    """
    totals = []
    for layers in (1, 2):
        torch.manual_seed(0)
        model = Llama(replace(config, layers=layers)).to(dtype=dtype).train()
        apply_tensor_parallel(model, tp_mesh=tp_mesh, plan=resolve_tp_plan(model, sequence_parallel=sequence_parallel))
        apply_activation_checkpointing(model, mode=recompute, units=model.recompute_units())
        param_ptrs = {_storage(p).data_ptr() for p in model.parameters()}
        tokens = torch.randint(0, config.vocab_size, (micro_batch, seq))
        recorder = _StorageRecorder()
        with recorder:
            logits = model(tokens)
            out = (logits.to_local() if hasattr(logits, "to_local") else logits).float().sum()
        del logits
        gc.collect()
        totals.append(recorder.alive_bytes(param_ptrs | {out.untyped_storage().data_ptr()}))
        out.backward()
        del model
    return float(totals[1] - totals[0])


def compare(config: ModelConfig, *, seq: int, micro_batch: int, device: str = "cpu",
            dtypes: tuple[str, ...] = ("fp32", "bf16"), tp_mesh=None) -> list[dict]:
    """One row per (dtype, recompute[, sp]): measured, planned (llama count), Korthikanti Table 2, and their ratios.

    With ``tp_mesh`` (inside a process group) every row is measured under TP, without and with SP.
    """
    shape = config.to_shape(seq)
    tp = 1 if tp_mesh is None else tp_mesh.size()
    rows = []
    for name in dtypes:
        element = torch.finfo(DTYPES[name]).bits // 8
        for sp in (False,) if tp == 1 else (False, True):
            for mode in Recompute:
                if tp == 1:
                    measured = measure_saved_activation_bytes_per_layer(
                        config, recompute=mode, dtype=DTYPES[name], seq=seq, micro_batch=micro_batch, device=device)
                else:
                    measured = measure_tp_saved_activation_bytes_per_layer(
                        config, tp_mesh=tp_mesh, sequence_parallel=sp, recompute=mode, dtype=DTYPES[name], seq=seq,
                        micro_batch=micro_batch)
                kw = {"seq": seq, "micro_batch": micro_batch, "tp": tp, "sp": sp, "recompute": mode,
                      "element_bytes": element}
                planned = mem.activation_bytes_per_layer_of(shape, **kw)
                paper = mem.activation_bytes_per_layer(hidden=config.hidden, heads=config.heads, **kw)
                rows.append({"dtype": name, "tp": tp, "sp": sp, "recompute": mode.value,
                             "measured_bytes": round(measured), "planned_bytes": planned,
                             "measured_over_planned": round(measured / planned, 4), "korthikanti_bytes": paper,
                             "measured_over_korthikanti": round(measured / paper, 4)})
    return rows


def _tp_worker(rank: int, world_size: int, port: int, config: ModelConfig, seq: int, micro_batch: int,
               dtypes: tuple[str, ...], out_path: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world_size))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
        rows = compare(config, seq=seq, micro_batch=micro_batch, dtypes=dtypes, tp_mesh=mesh["tp"])
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(rows, f)
    finally:
        dist.destroy_process_group()


def compare_tp(config: ModelConfig, *, tp: int, seq: int, micro_batch: int, dtypes: tuple[str, ...]) -> list[dict]:
    """:func:`compare` under TP on ``tp`` gloo ranks of this machine (CPU); rank 0's rows."""
    import torch.multiprocessing as mp

    with socket.socket() as s:  # a free port chosen by the OS, never a fixed one
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "rows.json")
        mp.spawn(_tp_worker, args=(tp, port, config, seq, micro_batch, dtypes, out_path), nprocs=tp, join=True)
        with open(out_path) as f:
            return json.load(f)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # Defaults: a GQA block 4x the test's width and 8x its sequence that runs in about a minute on 2 CPU cores
    # (bf16 matmuls are slow on CPU); pass a bigger shape (and --device cuda) where there is time.
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--ffn", type=int, default=1536, help="SwiGLU width (8h/3 rounded up to 256, as llama does)")
    p.add_argument("--layers", type=int, default=2, help="blocks stacked; the result is per block")
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtypes", default="fp32,bf16", help="comma-separated: fp32, bf16")
    p.add_argument("--tp", type=int, default=1, help="> 1: measure under TP (and SP) on that many gloo ranks (CPU)")
    p.add_argument("--tolerance", type=float, default=0.15, help="exit 1 if |measured/planned - 1| exceeds it")
    p.add_argument("--json-out", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    dtypes = tuple(d.strip() for d in args.dtypes.split(","))
    config = ModelConfig(vocab_size=256, hidden=args.hidden, layers=args.layers, heads=args.heads,
                         kv_heads=args.kv_heads, ffn=args.ffn, max_seq_len=args.seq)
    if args.tp > 1:
        rows = compare_tp(config, tp=args.tp, seq=args.seq, micro_batch=args.micro_batch, dtypes=dtypes)
    else:
        rows = compare(config, seq=args.seq, micro_batch=args.micro_batch, device=args.device, dtypes=dtypes)
    within = all(abs(r["measured_over_planned"] - 1) <= args.tolerance for r in rows)
    shape = {k: getattr(args, k) for k in ("hidden", "heads", "kv_heads", "ffn", "layers", "seq", "micro_batch", "tp")}
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # here, not at import: tests import this module
    import _common as C

    C.emit_json({"bench": "activations", "device": args.device, "torch": torch.__version__, "shape": shape,
                 "tolerance": args.tolerance, "within_tolerance": within, "rows": rows}, args.json_out)
    return 0 if within else 1


if __name__ == "__main__":
    sys.exit(main())
