"""Spawn N real gloo ranks on this machine for a test, with a free port and a hard timeout.

Usage::

    def _worker(rank: int, world_size: int, tmp: str) -> dict:   # module-level, so spawn can pickle it
        ...  # torch.distributed is initialized (gloo); env has RANK/LOCAL_RANK/WORLD_SIZE/MASTER_*
        return {"loss": 1.0}                                     # any picklable value

    results = spawn(_worker, world_size=2, args=(str(tmp_path),))  # list indexed by rank

Each rank's return value comes back; an exception in any rank fails the test with that rank's traceback; a hang
fails after ``timeout`` seconds and the children are killed. The env vars are the torchrun ones, so a
``lightning.Trainer(devices=N)`` built inside the worker sees an externally launched job and does not re-launch.
"""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def free_port() -> int:
    """A free TCP port chosen by the OS (bind to port 0); never a fixed one."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(
    rank: int, world_size: int, port: int, fn: Callable, args: tuple, init_pg: bool, queue, env: dict[str, str]
) -> None:
    # The forkserver was started with the environment of the first spawn; each rank gets the parent's of now.
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world_size),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        GROUP_RANK="0",
        NODE_RANK="0",
    )
    import sys

    import torch

    if "lightning" in sys.modules:  # preloaded by the forkserver, which read its rank from an environment without one
        from lightning.fabric.utilities.rank_zero import rank_zero_only

        rank_zero_only.rank = rank  # the same function object as lightning_utilities' (fabric sets it on import)
    # 2 cores shared by `world_size` ranks: one intra-op thread each avoids oversubscription.
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world_size))
    try:
        if init_pg:
            import torch.distributed as dist

            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        out = fn(rank, world_size, *args)
        # Serialize with torch.save: a torch tensor put on the queue directly travels as a shared-memory handle that
        # dies with this process, so the parent could fail to read it after the rank exits.
        import io

        buf = io.BytesIO()
        torch.save(out, buf)
        queue.put((rank, True, buf.getvalue()))
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001, S110 - teardown after a failure must not mask the real error
            pass


#: Imported once by the forkserver; every rank is forked from it instead of importing torch and lightning afresh
#: (about 7 s of CPU per rank on this machine, the largest share of a short 2-rank test). A module that is absent
#: (an optional test extra) is skipped by the forkserver.
_PRELOAD = [
    "torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.tensor", "lightning",
    "lightning.pytorch", "lightning_v17", "lightning_v17.strategies", "lightning_v17.callbacks", "tests._dist",
    "tests._models", "transformers", "transformers.models.llama.modeling_llama", "litgpt",
]  # fmt: skip
_CTX: Any = None


def _context(fresh: bool = False) -> Any:
    """The multiprocessing context for ranks: a forkserver with torch and lightning preloaded.

    ``fresh`` (or ``V17_TEST_START_METHOD=spawn``) gives fresh interpreters: each rank imports what it needs itself,
    for tests that check what a worker imports.
    """
    global _CTX
    if fresh:
        return mp.get_context("spawn")
    if _CTX is None:
        method = os.environ.get("V17_TEST_START_METHOD", "forkserver")
        _CTX = mp.get_context(method)
        if method == "forkserver":
            _CTX.set_forkserver_preload(_PRELOAD)
    return _CTX


def spawn(
    fn: Callable[..., Any],
    *,
    world_size: int = 2,
    args: tuple = (),
    timeout: float = 240.0,
    init_process_group: bool = True,
    fresh_interpreter: bool = False,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes and return their results by rank.

    Args:
        fn: a module-level function (spawn pickles it by reference).
        world_size: number of ranks.
        args: extra picklable arguments.
        timeout: seconds before the whole group is killed and the test fails.
        init_process_group: initialize a gloo process group before calling ``fn`` (set False when the worker
            lets Lightning do it).
        fresh_interpreter: start each rank as a fresh interpreter instead of forking it from the forkserver that
            has torch and lightning imported (for a test that checks which modules the worker imports).

    A port taken by another process between choosing it and binding it (EADDRINUSE) is retried once with a new one.
    """
    try:
        return _spawn_once(fn, world_size, args, timeout, init_process_group, fresh_interpreter)
    except AssertionError as err:
        if "EADDRINUSE" not in str(err) and "address already in use" not in str(err).lower():
            raise
        return _spawn_once(fn, world_size, args, timeout, init_process_group, fresh_interpreter)


def _spawn_once(
    fn: Callable[..., Any], world_size: int, args: tuple, timeout: float, init_process_group: bool, fresh: bool
) -> list[Any]:
    ctx = _context(fresh)
    queue = ctx.SimpleQueue()
    port = free_port()
    env = dict(os.environ)
    procs = [
        ctx.Process(target=_entry, args=(r, world_size, port, fn, args, init_process_group, queue, env), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    import time

    deadline = time.monotonic() + timeout
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    while len(results) + len(errors) < world_size:
        if not queue.empty():
            rank, ok, payload = queue.get()
            (results if ok else errors)[rank] = payload
            if errors:
                break  # one rank failed: the others may be blocked in a collective forever
            continue
        if time.monotonic() > deadline:
            break
        if all(not p.is_alive() for p in procs) and queue.empty():
            break
        time.sleep(0.05)
    for p in procs:
        p.join(timeout=5 if not errors else 1)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    if errors:
        rank = min(errors)
        raise AssertionError(f"rank {rank} failed:\n{errors[rank]}")
    missing = [r for r in range(world_size) if r not in results]
    if missing:
        codes = {r: procs[r].exitcode for r in missing}
        raise AssertionError(f"ranks {missing} gave no result within {timeout}s (exit codes {codes}): hung or crashed")
    return [decode_result(results[r]) for r in range(world_size)]


def decode_result(payload: bytes) -> Any:
    """A rank's return value as ``_entry`` serialized it (torch.save bytes)."""
    import io

    import torch

    return torch.load(io.BytesIO(payload), weights_only=False)
