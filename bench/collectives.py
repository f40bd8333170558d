"""gloo collectives side by side: ``lightning_v17.engine.collectives`` (all-to-all forms) against the native
``reduce_scatter_tensor`` / ``all_gather_into_tensor`` (and ``all_reduce`` for scale), 2 ranks, one invocation.

Each size runs every collective ``--iters`` times after 3 warm-up calls, interleaved per iteration (A B C A B C ...),
between barriers; the median per call is reported, with the ratio native / ours (> 1: ours is faster) as JSON.

Usage::

    .venv/bin/python bench/collectives.py
    .venv/bin/python bench/collectives.py --sizes 200000,3000000 --iters 30
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # after the path insert, so the script runs from anywhere (spawned ranks re-import it too)


def _worker(rank: int, port: int, sizes: list[int], iters: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    from lightning_v17.engine.collectives import all_gather, reduce_scatter

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    g = dist.group.WORLD
    out: dict[str, dict[str, float]] = {}
    try:
        for n in sizes:
            x = torch.randn(2 * n)
            shard, full = torch.empty(n), torch.empty(2 * n)
            fns = {
                "all_reduce": lambda x=x: dist.all_reduce(x),
                "reduce_scatter_native": lambda x=x, shard=shard: dist.reduce_scatter_tensor(shard, x),
                "reduce_scatter_v17": lambda x=x, shard=shard: reduce_scatter(shard, x, group=g),
                "all_gather_native": lambda full=full, shard=shard: dist.all_gather_into_tensor(full, shard),
                "all_gather_v17": lambda full=full, shard=shard: all_gather(full, shard, group=g),
            }
            times: dict[str, list[float]] = {k: [] for k in fns}
            for _ in range(3):
                for fn in fns.values():
                    fn()
            for _ in range(iters):
                for k, fn in fns.items():
                    dist.barrier()
                    t0 = time.perf_counter()
                    fn()
                    times[k].append(time.perf_counter() - t0)
            out[str(2 * n)] = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        queue.put((rank, out))
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="100000,400000,1500000", help="elements per rank shard, comma-separated")
    ap.add_argument("--iters", type=int, default=20, help="timed calls per collective and size")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import torch.multiprocessing as mp

    sizes = [int(s) for s in args.sizes.split(",")]
    port = C.free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=_worker, args=(r, port, sizes, args.iters, queue)) for r in range(2)]
    for p in procs:
        p.start()
    res = dict(queue.get() for _ in procs)
    for p in procs:
        p.join()
    results = {}
    for size, ms in res[0].items():  # rank 0's view; the barrier-bracketed calls cost the same on both ranks
        results[size] = {
            "ms": {k: round(v, 3) for k, v in ms.items()},
            "reduce_scatter_native/v17": round(ms["reduce_scatter_native"] / ms["reduce_scatter_v17"], 3),
            "all_gather_native/v17": round(ms["all_gather_native"] / ms["all_gather_v17"], 3),
        }
    report = {
        "bench": "collectives",
        "backend": "gloo",
        "world_size": 2,
        "dtype": "fp32",
        "iters": args.iters,
        "results_by_input_numel": results,
    }
    C.emit_json(report, args.json_out)
    return report


if __name__ == "__main__":
    main()
