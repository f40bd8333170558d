"""In-process restart: a rank dies, the surviving processes re-form the group and re-enter the training function.

Torch-only, Lightning-free. This covers the case replica groups (``ft.py``) cannot: there is no healthy replica to
take over (one replica group, or a fault that hits all of them). Instead of a job restart, where every process exits,
re-imports torch and reloads the newest checkpoint from disk, the survivors keep their processes:

1. A small launcher process (:class:`InProcessLauncher`) serves the TCPStore, so the store outlives every rank,
   rank 0 included. It starts the ranks and one or more *warm spares*: processes that already imported torch and the
   user's module and wait on the store for a rank to take over.
2. Every rank runs its training function inside :func:`run_in_process`. The process group of generation ``g`` forms
   on the store under the prefix ``v17/inproc/gen<g>/``, so no key of an earlier generation is ever read again (the
   failure mode ``elastic.py`` describes for torchrun's shared store).
3. At each step boundary the training function calls :meth:`InProcessContext.snapshot`: the rank's state is
   serialized in host memory and a copy goes to its ring neighbour (rank r keeps its own snapshot and rank r-1's).
4. A rank is killed. Its peers' next collective fails on the closed gloo connection; :func:`run_in_process` catches
   the error, destroys the process group and waits for the next generation. The launcher sees the dead process,
   hands its rank to a warm spare (or starts a new process when none is left) and opens generation ``g + 1``.
5. The new group agrees on the newest snapshot step every rank can restore: a survivor from its own copy, the
   replacement of rank r from the copy rank r+1 keeps, sent over the new group. The training function runs again
   with :attr:`InProcessContext.restored` set and re-enters its loop at that step. When no snapshot is complete
   (two neighbours lost at once), ``restored`` is None and the function falls back to its disk checkpoint.

This is what NVIDIA Resiliency Extension's ``inprocess.Wrapper`` does on NCCL (Gemini, SOSP 2023, for snapshots kept
in peer host memory). Its abort step aborts only ``ProcessGroupNCCL`` backends; on a gloo group it only calls
``destroy_process_group``, which does not unblock a pending collective. On gloo a dead peer's closed sockets fail
the pending collective at once, which is what step 4 relies on. A rank that hangs without dying is not detected here:
:class:`~lightning_v17.resilience.watchdog.StepWatchdog` turns a hang into an exit, which this path then handles.
"""

from __future__ import annotations

import argparse
import io
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["InProcessContext", "InProcessLauncher", "run_in_process"]

log = logging.getLogger(__name__)

_ROOT = "v17/inproc"
_GEN, _FAULT, _DONE = f"{_ROOT}/gen", f"{_ROOT}/fault", f"{_ROOT}/done"
#: the environment a worker reads: the launcher's store, its rank (absent for a spare) and the spare's index
ENV_STORE, ENV_SPARE = "V17_INPROC_STORE", "V17_INPROC_SPARE"
_KEEP = 2  # snapshots kept per rank: the newest may be incomplete on some ranks when the fault hits mid-exchange


def _spare_key(i: int) -> str:
    return f"{_ROOT}/spare/{i}"


def _connect(addr: str, timeout: timedelta) -> dist.TCPStore:
    host, _, port = addr.rpartition(":")
    return dist.TCPStore(host, int(port), is_master=False, timeout=timeout, wait_for_workers=False)


def _generation(store: dist.Store) -> int:
    return int(store.add(_GEN, 0))


# ------------------------------------------------------------------------------------------------- the launcher
class InProcessLauncher:
    """Serve the store, start ``world_size`` ranks and ``spares`` warm spares, and replace a rank that dies.

    Each process runs ``python *argv``; ``argv`` must end in a call of :func:`run_in_process`. A rank gets the
    torchrun variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``) and ``V17_INPROC_STORE``; a spare gets
    ``V17_INPROC_SPARE`` instead of a rank and waits until it is handed one.

    Args:
        argv: the worker command after the Python executable, e.g. ``["-m", "my_project.train"]``.
        world_size: ranks of the group.
        spares: warm spares started before the ranks; a spare that takes over a rank is replaced by a new one.
        env: extra environment for every process (on top of this process's).
        max_restarts: generations after the first; one more failure ends the job.
        grace_s: after a rank reports a failure and no process died, how long to wait for a death before the
            next generation opens without a replacement (the failure was a raised error, not a lost rank).
        replenish: start a new spare for each one that took over a rank (after the group's first step).
    """

    def __init__(
        self,
        argv: Sequence[str],
        *,
        world_size: int,
        spares: int = 1,
        env: dict[str, str] | None = None,
        max_restarts: int = 3,
        grace_s: float = 0.2,
        replenish: bool = True,
    ) -> None:
        self.argv, self.world_size, self.spares = list(argv), world_size, spares
        self.env = {**os.environ, **(env or {})}
        self.max_restarts, self.grace_s, self.replenish = max_restarts, grace_s, replenish
        self.store = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
        )
        self.addr = f"127.0.0.1:{self.store.port}"
        self.store.add(_GEN, 0)
        self.ranks: dict[int, subprocess.Popen] = {}
        self.waiting: dict[int, subprocess.Popen] = {}  # spare index -> a warm spare not handed a rank yet
        self._next_spare, self._owed = 0, 0
        #: what happened, in order: ("start"|"spare"|"dead"|"takeover"|"generation", detail, time.time())
        self.events: list[tuple[str, Any, float]] = []

    def _popen(self, extra: dict[str, str]) -> subprocess.Popen:
        env = {**self.env, ENV_STORE: self.addr, "WORLD_SIZE": str(self.world_size), **extra}
        return subprocess.Popen([sys.executable, *self.argv], env=env)

    def _start_spare(self, wait_ready: bool, timeout_s: float = 120.0) -> None:
        i = self._next_spare
        self._next_spare += 1
        self.waiting[i] = self._popen({ENV_SPARE: str(i)})
        self.events.append(("spare", i, time.time()))
        if wait_ready:
            self.store.wait([f"{_spare_key(i)}/ready"], timedelta(seconds=timeout_s))

    def start(self) -> None:
        """Start the spares (and wait until each has imported what it needs), then the ranks."""
        for _ in range(self.spares):
            self._start_spare(wait_ready=True)
        for r in range(self.world_size):
            self.ranks[r] = self._popen({"RANK": str(r), "LOCAL_RANK": str(r)})
            self.events.append(("start", r, time.time()))

    def _replace(self, rank: int, generation: int) -> None:
        if self.waiting:
            i = min(self.waiting)
            self.ranks[rank] = self.waiting.pop(i)
            self.store.set(_spare_key(i), f"{rank}:{generation}")
            self.events.append(("takeover", (i, rank), time.time()))
            self._owed += int(
                self.replenish
            )  # a new spare starts after the group's first step: its imports would slow the recovery
        else:
            self.ranks[rank] = self._popen({"RANK": str(rank), "LOCAL_RANK": str(rank)})
            self.events.append(("start", rank, time.time()))

    def wait(self, timeout_s: float | None = None, poll_s: float = 0.005) -> list[int]:
        """Supervise until every rank exited 0 (returns the exit codes) or the restarts are spent (raises); with
        ``timeout_s``, raise ``TimeoutError`` after that many seconds."""
        deadline, restarts = time.monotonic() + (timeout_s if timeout_s is not None else float("inf")), 0
        finished: dict[int, int] = {}
        try:
            while len(finished) < self.world_size:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the in-process job did not finish within {timeout_s} s")
                dead = []
                for r, p in self.ranks.items():
                    code = p.poll()
                    if code == 0:
                        finished[r] = 0
                    elif code is not None:
                        dead.append(r)
                generation = _generation(self.store)
                reported = int(self.store.add(f"{_FAULT}/{generation}", 0)) > 0  # reports of earlier ones are stale
                grace = time.monotonic() + self.grace_s
                while reported and not dead and time.monotonic() < grace:  # a rank raised: did a peer die?
                    time.sleep(poll_s)
                    dead = [r for r, p in self.ranks.items() if p.poll() not in (None, 0)]
                if self._owed and self.store.check([f"{_ROOT}/gen{generation}/stepped"]):
                    for _ in range(self._owed):  # replenish once the group trains again, not while it recovers
                        self._start_spare(wait_ready=False)
                    self._owed = 0
                if dead or reported:
                    restarts += 1
                    if restarts > self.max_restarts:
                        raise RuntimeError(
                            f"the job failed again after {self.max_restarts} in-process restarts ("
                            + (f"ranks {dead} died)" if dead else "a rank raised; see its log)")
                        )
                    generation += 1
                    for r in dead:
                        self.events.append(("dead", (r, self.ranks[r].returncode), time.time()))
                        self._replace(r, generation)
                    self.store.add(_GEN, 1)
                    self.events.append(("generation", generation, time.time()))
                time.sleep(poll_s)
            return [finished[r] for r in range(self.world_size)]
        finally:
            self.close()

    def close(self) -> None:
        """Release the waiting spares and end every process still running."""
        self.store.set(_DONE, "1")
        for p in [*self.ranks.values(), *self.waiting.values()]:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


# ---------------------------------------------------------------------------------------------- the snapshots
@dataclass
class _Snapshots:
    """This process's snapshots, kept across generations: its own, and its ring predecessor's (step -> bytes)."""

    own: dict[int, bytes] = field(default_factory=dict)
    peer: dict[int, bytes] = field(default_factory=dict)

    def keep(self, table: dict[int, bytes], step: int, blob: bytes) -> None:
        table[step] = blob
        for old in sorted(table)[:-_KEEP]:
            del table[old]


def _to_bytes(state: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def _from_bytes(blob: bytes) -> Any:
    return torch.load(io.BytesIO(blob), weights_only=True)


def _send_bytes(blob: bytes, dst: int) -> None:
    dist.send(torch.tensor([len(blob)], dtype=torch.int64), dst)
    dist.send(torch.frombuffer(bytearray(blob), dtype=torch.uint8), dst)


def _recv_bytes(src: int) -> bytes:
    n = torch.empty(1, dtype=torch.int64)
    dist.recv(n, src)
    buf = torch.empty(int(n), dtype=torch.uint8)
    dist.recv(buf, src)
    return buf.numpy().tobytes()


class InProcessContext:
    """What the training function sees in one generation: its rank, the restored snapshot, and the snapshot call.

    Attributes:
        rank, world_size: of this generation's default process group (a replacement takes the lost rank's).
        generation: 0 for the first group, then one more per restart.
        restored: ``(step, state)`` of the snapshot every rank agreed on, or None (first run, or no complete
            snapshot: fall back to the disk checkpoint).
        store: the launcher's store (outlives every rank).
    """

    def __init__(self, *, rank: int, world_size: int, generation: int, store: dist.Store, snaps: _Snapshots) -> None:
        self.rank, self.world_size, self.generation, self.store = rank, world_size, generation, store
        self._snaps, self._stepped = snaps, False
        self.restored: tuple[int, Any] | None = None
        #: seconds spent agreeing on and moving the snapshot at this generation's start
        self.restore_s = 0.0

    def snapshot(self, step: int, state: Any) -> None:
        """Keep ``state`` (tensors and plain values, as ``torch.save`` with ``weights_only`` loads them) as the
        snapshot of the step boundary ``step``, here and on the ring neighbour. Collective: every rank calls it at
        the same step. The tensors are serialized at once, so the caller may go on changing them."""
        blob = _to_bytes(state)
        self._snaps.keep(self._snaps.own, step, blob)
        if self.world_size == 1:
            return
        nxt, prv = (self.rank + 1) % self.world_size, (self.rank - 1) % self.world_size
        size = torch.tensor([len(blob)], dtype=torch.int64)
        sizes = [torch.empty(1, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(sizes, size)
        buf = torch.empty(int(sizes[prv]), dtype=torch.uint8)
        ops = [
            dist.P2POp(dist.isend, torch.frombuffer(bytearray(blob), dtype=torch.uint8), nxt),
            dist.P2POp(dist.irecv, buf, prv),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        self._snaps.keep(self._snaps.peer, step, buf.numpy().tobytes())
        if not self._stepped and self.rank == 0:
            self.store.set(f"{_ROOT}/gen{self.generation}/stepped", str(step))  # the launcher may replenish now
        self._stepped = True

    def _restore(self) -> None:
        """Agree on the newest step every rank can restore and move the lost ranks' copies to them (collective)."""
        t0 = time.perf_counter()
        snaps, world = self._snaps, self.world_size
        have: list[Any] = [None] * world
        dist.all_gather_object(have, (sorted(snaps.own), sorted(snaps.peer)))
        holder = [(r + 1) % world for r in range(world)]  # who keeps rank r's copy

        def restorable(step: int, r: int) -> bool:
            return step in have[r][0] or (world > 1 and step in have[holder[r]][1])

        steps = {s for own, _ in have for s in own}
        good = [s for s in steps if all(restorable(s, r) for r in range(world))]
        if not good:
            snaps.own.clear()
            snaps.peer.clear()
            return
        step = max(good)
        for r in range(world):  # a replacement (or a rank that lost this step) receives its copy from its holder
            if step in have[r][0]:
                continue
            if self.rank == holder[r]:
                _send_bytes(snaps.peer[step], r)
            elif self.rank == r:
                snaps.keep(snaps.own, step, _recv_bytes(holder[r]))
        for table in (snaps.own, snaps.peer):  # newer, incomplete snapshots would mix two boundaries later
            for s in [s for s in table if s > step]:
                del table[s]
        self.restored = (step, _from_bytes(snaps.own[step]))
        self.restore_s = time.perf_counter() - t0


# ----------------------------------------------------------------------------------------------- the wrapper
_SNAPSHOTS = _Snapshots()  # one per process: it must outlive the generations


def _warm_up(warmup: Callable[[], Any], backend: str) -> None:
    """Run ``warmup`` in a private one-rank group: the first FSDP2/DTensor use in a process loads torch's lazily
    imported modules (``torch._dynamo`` among them; about 1 s on 2 cores), which a spare should pay before it is
    needed, not after."""
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        warmup()
    finally:
        dist.destroy_process_group()


def _await_rank(store: dist.Store, spare: int) -> tuple[int, int] | None:
    """A warm spare: announce readiness and wait until the launcher hands over a rank (or ends the job)."""
    store.set(f"{_spare_key(spare)}/ready", str(os.getpid()))
    key = _spare_key(spare)
    while True:
        if store.check([key]):
            rank, _, generation = store.get(key).decode().partition(":")
            return int(rank), int(generation)
        if store.check([_DONE]):
            return None
        time.sleep(0.002)


def run_in_process(
    fn: Callable[[InProcessContext], Any],
    *,
    backend: str = "gloo",
    timeout: timedelta = timedelta(seconds=30),
    max_restarts: int = 3,
    on_restart: Callable[[BaseException], None] | None = None,
    warmup: Callable[[], Any] | None = None,
) -> Any:
    """Run ``fn(ctx)`` in a process group that re-forms, in this process, each time a rank fails.

    Call it from a process the :class:`InProcessLauncher` started. ``fn`` builds its model and optimizer on the
    group that exists when it is called, restores ``ctx.restored`` when set (else its disk checkpoint, if any),
    trains from that step, and calls ``ctx.snapshot(step, state)`` at step boundaries. When ``fn`` raises (its own
    error or a failed collective), the group is destroyed, the launcher opens the next generation and ``fn`` runs
    again. Returns ``fn``'s return value; None for a spare that was never needed.

    Args:
        fn: the training function; it must re-build everything bound to the process group on every call.
        backend: the process-group backend.
        timeout: collective and store timeout of each generation's group; also how long the peers of a rank that
            raised (rather than died) wait before they re-form, since that rank's gloo connections stay open.
        max_restarts: runs of ``fn`` after the first; the last error is raised after that.
        on_restart: called with the error before this process waits for the next generation (logging, metrics).
        warmup: what a warm spare runs before it reports ready, inside a private one-rank process group: build the
            model and run a step once, so that the lazy first-use costs are paid before a rank is lost.
    """
    store = _connect(os.environ[ENV_STORE], timeout)
    world = int(os.environ["WORLD_SIZE"])
    if ENV_SPARE in os.environ:
        if warmup is not None:
            _warm_up(warmup, backend)
        got = _await_rank(store, int(os.environ[ENV_SPARE]))
        if got is None:
            return None
        rank, generation = got
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank))
    else:
        rank, generation = int(os.environ["RANK"]), 0
    for attempt in range(max_restarts + 1):
        while _generation(store) < generation:  # a spare told of the generation before the launcher opened it
            time.sleep(0.002)
        prefix = f"{_ROOT}/gen{generation}/"
        try:
            dist.init_process_group(
                backend, store=dist.PrefixStore(prefix, store), rank=rank, world_size=world, timeout=timeout
            )
            ctx = InProcessContext(rank=rank, world_size=world, generation=generation, store=store, snaps=_SNAPSHOTS)
            ctx._restore()
            out = fn(ctx)
            dist.barrier()
            return out
        except Exception as err:  # any failure of this generation: re-form and run again
            if attempt == max_restarts:
                raise
            log.warning(
                "rank %d: generation %d failed (%s); re-forming the group in this process", rank, generation, err
            )
            if on_restart is not None:
                on_restart(err)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        store.add(f"{_FAULT}/{generation}", 1)
        while _generation(store) <= generation:
            time.sleep(0.002)
        generation = _generation(store)
    raise AssertionError("unreachable")


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m lightning_v17.resilience.inprocess --nproc 8 --spares 1 -- train.py --lr 3e-4``: serve the store,
    start the ranks and the spares, replace a rank that dies; exits non-zero when the restarts are spent."""
    parser = argparse.ArgumentParser(prog="python -m lightning_v17.resilience.inprocess", description=main.__doc__)
    parser.add_argument("--nproc", type=int, required=True, help="ranks of the group (one replica)")
    parser.add_argument("--spares", type=int, default=1, help="warm spares waiting to take a lost rank")
    parser.add_argument("--max-restarts", type=int, default=3, help="in-process restarts before the job fails")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="after --: the worker's Python arguments")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("name the worker after --, e.g. -- train.py or -- -m my_project.train")
    launcher = InProcessLauncher(command, world_size=args.nproc, spares=args.spares, max_restarts=args.max_restarts)
    launcher.start()
    launcher.wait()


if __name__ == "__main__":
    main()
