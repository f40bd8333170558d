"""Context parallelism side by side: cp=2 ulysses, cp=2 allgather and dp=2 on half the sequence; chunk balancing.

**Throughput and memory.** At a fixed total sequence S per step on 2 gloo ranks, the reference Llama trains with
SGD (the same seed, the same tokens, fp32) in three arms run in one invocation, each in its own pair of fresh
processes:

- ``cp2_ulysses``: one row of S tokens per step, cut over the 2 ranks (``engine.cp.shard_batch``, head-tail chunks),
  attention by the Ulysses all-to-all (``CPContext`` current with ``use_cp_context``, as ``V17Strategy(cp=2)`` runs
  it), the loss share of ``context_parallel_cross_entropy``;
- ``cp2_allgather``: the same with all-gathered K/V;
- ``dp2_half``: each rank trains its own row of S/2 tokens (the sequence halved so that the ranks hold as many
  tokens as under cp=2): the anchor a user has without cp.

Every arm all-reduces the gradients over the 2 ranks the same way (summed under cp, averaged under dp) before the
step. tokens/s counts S per step (the slowest rank's wall clock between barriers, warm-up excluded), and tokens
per CPU-second divide the same tokens by the busier rank's own CPU time (on a host shared with other jobs the wall
clock mostly measures the neighbours); the peak
saved-activation bytes per rank are the distinct non-parameter storages that ``saved_tensors_hooks`` sees in one
forward of the whole model (embedding and logits included), next to the planner's per-rank prediction for the
blocks (``planner.memory.activation_bytes_per_layer_of`` x layers) for the same shape.

**Balance.** On packed rows of the standard-library corpus (first-fit decreasing, documents restarting the
positions), the max/mean causal attention work per rank (``engine.cp.balance_ratio``) under ``none``,
``head_tail`` and the packed-aware assignment, for cp 2, 4 and 8: mean and worst over the batches.

Usage: ``python bench/cp.py [--seq 2048] [--steps 4] [--json-out bench/results/cp.json]`` (CPU, about a minute).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # after the path insert, so the script runs from anywhere

from lightning_v17.models.config import ModelConfig

ARMS = ("cp2_ulysses", "cp2_allgather", "dp2_half")


def _config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(vocab_size=320, hidden=args.hidden, layers=args.layers, heads=args.heads,
                       kv_heads=args.kv_heads, ffn=args.ffn, max_seq_len=args.seq)  # fmt: skip


def _worker(rank: int, world: int, port: int, arm: str, args: argparse.Namespace, out_path: str) -> None:
    import torch.distributed as dist
    import torch.nn.functional as F

    from lightning_v17.engine.cp import (
        CPContext,
        context_parallel_cross_entropy,
        shard_batch,
        shift_labels,
        use_cp_context,
    )
    from lightning_v17.models.llama import Llama

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        config = _config(args)
        torch.manual_seed(0)
        model = Llama(config).train()
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(1)
        rows = torch.randint(3, config.vocab_size, (args.warmup + args.steps, 2, args.seq), generator=g)
        cp = arm.startswith("cp2")
        saved_bytes = None
        t0 = cpu0 = 0.0
        for step in range(args.warmup + args.steps):
            if step == args.warmup:
                dist.barrier()
                t0, cpu0 = time.perf_counter(), time.process_time()
            seen: dict[int, int] = {}

            def pack(t: torch.Tensor, seen=seen) -> torch.Tensor:
                if t.untyped_storage().data_ptr() not in params:
                    seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                return t

            if cp:  # one row of S tokens over the two ranks
                tokens = rows[step, :1]
                batch = {"input_ids": tokens, "labels": shift_labels(tokens)}
                part = shard_batch(batch, cp=world, rank=rank, balance="head_tail")
                ctx = CPContext.from_batch(part, mode=arm.split("_")[1], group=dist.group.WORLD)
                with use_cp_context(ctx):
                    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                        logits = model(part.local["input_ids"], part.local["position_ids"])
                    share, _ = context_parallel_cross_entropy(logits, part.local["labels"], group=dist.group.WORLD)
                    share.backward()
            else:  # each rank its own row of S/2 tokens
                tokens = rows[step, rank : rank + 1, : args.seq // 2]
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    logits = model(tokens)
                labels = shift_labels(tokens)
                F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100).backward()
            saved_bytes = sum(seen.values())
            for p in model.parameters():  # summed under cp (shares of one loss), averaged under dp
                dist.all_reduce(p.grad)
                if not cp:
                    p.grad /= world
            opt.step()
            opt.zero_grad(set_to_none=True)
        cpu1 = time.process_time()
        dist.barrier()
        seconds = time.perf_counter() - t0
        result = {"seconds": seconds, "tokens_per_s": args.seq * args.steps / seconds, "cpu_s": cpu1 - cpu0,
                  "saved_activation_bytes": saved_bytes}  # fmt: skip
        gathered: list = [None] * world
        dist.all_gather_object(gathered, result)
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(gathered, f)
    finally:
        dist.destroy_process_group()


def run_arm(arm: str, args: argparse.Namespace) -> dict:
    """One arm on 2 fresh gloo processes; the slowest rank's tokens/s and each rank's saved bytes."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "ranks.json")
        mp.spawn(_worker, args=(2, C.free_port(), arm, args, out), nprocs=2, join=True)
        with open(out) as f:
            ranks = json.load(f)
    cpu = max(r["cpu_s"] for r in ranks)  # the busier rank's own CPU seconds: what a loaded host's wall clock hides
    return {"tokens_per_s": round(min(r["tokens_per_s"] for r in ranks), 1),
            "tokens_per_cpu_s": round(args.seq * args.steps / cpu, 1),
            "seconds": round(max(r["seconds"] for r in ranks), 3),
            "cpu_s_per_rank": [round(r["cpu_s"], 3) for r in ranks],
            "peak_saved_activation_bytes_per_rank": [r["saved_activation_bytes"] for r in ranks]}  # fmt: skip


def planned_block_bytes(args: argparse.Namespace) -> dict[str, int]:
    """The planner's saved bytes of the blocks per rank (no embedding or logits) for each arm's shape."""
    from lightning_v17.planner.memory import activation_bytes_per_layer_of

    shape = _config(args).to_shape(args.seq)

    def blocks(seq: int, cp: int, mode: str | None) -> int:
        return args.layers * activation_bytes_per_layer_of(shape, seq=seq, micro_batch=1, cp=cp, cp_mode=mode,
                                                           element_bytes=4)  # fmt: skip

    return {"cp2_ulysses": blocks(args.seq, 2, "ulysses"), "cp2_allgather": blocks(args.seq, 2, "allgather"),
            "dp2_half": blocks(args.seq // 2, 1, None)}  # fmt: skip


def balance(args: argparse.Namespace) -> dict:
    """max/mean attention work per rank on packed corpus rows, per cp and assignment: mean and worst."""
    from lightning_v17.data.corpus import StdlibCorpus
    from lightning_v17.data.packing import pack
    from lightning_v17.engine.cp import balance_ratio, make_layout, segment_ids_from_position_ids

    plan = pack(StdlibCorpus("train").lengths(), args.balance_seq, mode="ffd")
    picked = list(plan.rows)
    random.Random(0).shuffle(picked)  # FFD orders rows by their longest document: sample them evenly
    rows = []
    for row in picked[: args.balance_rows]:
        pos = [i for seg in row for i in range(seg.length)]
        pos += list(range(args.balance_seq - len(pos)))  # the row's padding tail is a document of its own
        rows.append(pos)
    batches = [torch.tensor(rows[i : i + args.balance_batch]) for i in range(0, len(rows), args.balance_batch)]
    out: dict = {}
    for cp in (2, 4, 8):
        per: dict[str, list[float]] = {"none": [], "head_tail": [], "packed": []}
        for position_ids in batches:
            seg = segment_ids_from_position_ids(position_ids)
            for name, ratios in per.items():
                ratios.append(balance_ratio(make_layout(args.balance_seq, cp, name, segment_ids=seg), seg))
        out[f"cp{cp}"] = {name: {"mean": round(sum(v) / len(v), 4), "worst": round(max(v), 4)}
                          for name, v in per.items()}  # fmt: skip
        out[f"cp{cp}"]["head_tail_over_packed_mean"] = round(out[f"cp{cp}"]["head_tail"]["mean"]
                                                            / out[f"cp{cp}"]["packed"]["mean"], 4)
    return {"seq": args.balance_seq, "rows": len(rows), "rows_per_batch": args.balance_batch,
            "batches": len(batches), "max_over_mean_attention_work": out}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=2048, help="total tokens per step (one row under cp, two halves at dp)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=768)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--balance-seq", type=int, default=8192)
    p.add_argument("--balance-rows", type=int, default=64)
    p.add_argument("--balance-batch", type=int, default=4)
    p.add_argument("--json-out", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    results = {arm: run_arm(arm, args) for arm in ARMS}
    planned = planned_block_bytes(args)
    for arm, r in results.items():
        r["planned_block_bytes_per_rank"] = planned[arm]
    peak = {arm: max(r["peak_saved_activation_bytes_per_rank"]) for arm, r in results.items()}
    tps = {arm: r["tokens_per_s"] for arm, r in results.items()}
    tpc = {arm: r["tokens_per_cpu_s"] for arm, r in results.items()}
    bal = balance(args)
    ratios = {
        "ulysses/allgather tokens/s": round(tps["cp2_ulysses"] / tps["cp2_allgather"], 3),
        "ulysses/dp2_half tokens/s": round(tps["cp2_ulysses"] / tps["dp2_half"], 3),
        "allgather/dp2_half tokens/s": round(tps["cp2_allgather"] / tps["dp2_half"], 3),
        "ulysses/allgather tokens per CPU-s": round(tpc["cp2_ulysses"] / tpc["cp2_allgather"], 3),
        "ulysses/dp2_half tokens per CPU-s": round(tpc["cp2_ulysses"] / tpc["dp2_half"], 3),
        "allgather/dp2_half tokens per CPU-s": round(tpc["cp2_allgather"] / tpc["dp2_half"], 3),
        "ulysses/dp2_half saved bytes": round(peak["cp2_ulysses"] / peak["dp2_half"], 3),
        "allgather/dp2_half saved bytes": round(peak["cp2_allgather"] / peak["dp2_half"], 3),
        **{f"head_tail/packed balance cp{cp}": bal["max_over_mean_attention_work"][f"cp{cp}"][
            "head_tail_over_packed_mean"] for cp in (2, 4, 8)},
    }
    shape = {k: getattr(args, k) for k in ("seq", "hidden", "heads", "kv_heads", "ffn", "layers", "steps")}
    C.emit_json({"bench": "cp", "world_size": 2, "dtype": "fp32", "shape": shape, "results": results,
                 "balance": bal, "ratios": ratios}, args.json_out)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
