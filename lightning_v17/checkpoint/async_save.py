"""Asynchronous sharded saves: the training loop blocks only for staging; publication is collective and atomic.

Protocol (one save, at most one in flight):

1. ``start`` (the only part the training loop waits for; no collective after the first save): one pass of
   :class:`PreallocatedStager` copies every component's local tensors (model, optim) into host buffers allocated at
   the first save and reused after (pinned on CUDA), rank 0 snapshots ``trainer_state`` with ``torch.save``, and one
   background task is submitted. Staging every component *before* any write starts matters: with one DCP
   ``async_save`` per component, the model's background write (planning collectives, pickling, file writes) ran
   while the optimizer state was still being copied and slowed that copy about 2x on a busy host.
2. The background task (one thread, so its collectives never interleave): rank 0 clears a stale partial directory
   of an earlier crashed save, one all-reduce on the saver's *dedicated gloo group* tells every rank it may write
   (and whether rank 0 failed to prepare), then ``torch.distributed.checkpoint.save`` writes each component into
   its own DCP directory on that group (the DCP docs' advice for async saves: no background thread issues a
   collective on the main group), and this rank hashes the files it wrote.
3. ``poll`` (called by the callback at batch end, on every rank): while a save is in flight, one all-reduce of
   ``[not_finished, failed]`` flags on the main group. Only when every rank has finished does ``_finalize`` gather
   the digests to rank 0, which writes ``trainer_state`` and ``meta.json`` last and renames the directory into
   place (``checkpoint.publish``). A failure on any rank deletes the partial directory on every rank's behalf and
   raises; the previous checkpoint is never touched.

Test-only knob: ``V17_CKPT_TEST_WRITE_DELAY_S`` makes the background writer sleep that many seconds before declaring this
rank's write finished, so a test can kill a rank reliably "during the write".
"""

from __future__ import annotations

import copy
import io
import os
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from lightning_v17.checkpoint.sharded import (
    COMPONENTS,
    TRAINER_STATE_FILE,
    _barrier,
    _collective_device,
    _dist_on,
    _rank_world,
    _write_bytes_durably,
    build_meta,
    file_digest,
    gather_file_digests,
    hash_own_files,
    partial_path,
    publish,
)

TEST_DELAY_ENV = "V17_CKPT_TEST_WRITE_DELAY_S"

__all__ = ["AsyncSaveError", "AsyncShardedSaver", "PreallocatedStager", "SaveResult"]


class AsyncSaveError(RuntimeError):
    """A background checkpoint write failed on at least one rank; the partial checkpoint was discarded."""


@dataclass
class SaveResult:
    """What one published asynchronous save cost.

    Attributes:
        path: the published checkpoint.
        staging_s: seconds the loop blocked in ``start`` (staging + launching the writes).
        write_s: seconds from ``start`` until this rank's write and hashing finished.
        publish_wait_s: seconds ``wait`` blocked for the background write (0 when ``poll`` found it done).
    """

    path: Path
    staging_s: float
    write_s: float
    publish_wait_s: float = 0.0


@dataclass
class _InFlight:
    target: Path
    tmp: Path
    finisher: Future
    trainer_state: bytes
    meta: dict[str, Any]
    step: Any
    staging_s: float
    t_start: float
    t_done: list[float] = field(default_factory=list)
    amendments: dict[str, Any] = field(default_factory=dict)


class PreallocatedStager:
    """A DCP ``AsyncStager`` that copies the state into host buffers allocated at the first save and reused after.

    Why not DCP's ``DefaultStager``: it deep-copies the state dict and copies each tensor's *storage* with
    ``UntypedStorage.copy_``, one thread, about 4x slower here than ``Tensor.copy_``, which torch parallelizes over
    the intra-op threads; and its storage cache is keyed by storage objects that ``state_dict()`` recreates. Here each
    tensor (a DTensor's local shard) is copied with ``Tensor.copy_`` into a buffer keyed by its path in the state
    dict (re-allocated only if its shape or dtype changes), pinned when CUDA is there; DTensors come back as DTensors
    over those buffers with the original mesh, placements, global shape and stride, so DCP writes the same shards.
    Staging is synchronous (the copy is done when ``stage`` returns), and buffers are reused by the next save, which
    :class:`AsyncShardedSaver` starts only after the previous write finished.

    What it costs besides the copy: one walk of the state dict. The DTensor wrappers over the buffers are built once
    and reused while the source keeps its mesh, placements, global shape and stride (building ~100 of them took as
    long as copying 126 MB here), and all copies go through one ``torch._foreach_copy_`` call (the op FSDP2's own
    copies use) instead of one Python-level ``copy_`` per tensor.
    """

    _synchronize_after_execute = False  # stage() is synchronous: nothing to wait for after async_save launches

    def __init__(self) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._wrappers: dict[tuple, Any] = {}  # key -> DTensor over self._buffers[key]

    @property
    def should_synchronize_after_execute(self) -> bool:
        return self._synchronize_after_execute

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Copy ``state_dict`` (tensors, DTensors, nested dicts/lists, other values deep-copied) into the buffers;
        returns the same structure over them."""
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        with torch.no_grad():
            out = self._walk(state_dict, (), dst, src)
            if dst:
                torch._foreach_copy_(dst, src)
        return out

    def synchronize_staging(self) -> None:
        return None

    def close(self) -> None:
        self._buffers.clear()
        self._wrappers.clear()

    def _buffer(self, key: tuple, like: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(key)
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
            buf = torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=torch.cuda.is_available())
            self._buffers[key] = buf
            self._wrappers.pop(key, None)
        return buf

    def _walk(self, obj: Any, key: tuple, dst: list[torch.Tensor], src: list[torch.Tensor]) -> Any:
        from torch.distributed.tensor import DTensor

        if isinstance(obj, dict):
            return {k: self._walk(v, (*key, k), dst, src) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._walk(v, (*key, i), dst, src) for i, v in enumerate(obj))
        if isinstance(obj, DTensor):
            local = obj.to_local()
            buf = self._buffer(key, local)
            dst.append(buf)
            src.append(local)
            staged = self._wrappers.get(key)
            if (
                staged is None
                or staged.device_mesh is not obj.device_mesh
                or staged.placements != obj.placements
                or staged.shape != obj.shape
                or staged.stride() != obj.stride()
            ):
                staged = DTensor.from_local(
                    buf, obj.device_mesh, obj.placements, run_check=False, shape=obj.shape, stride=obj.stride()
                )
                self._wrappers[key] = staged
            return staged
        if isinstance(obj, torch.Tensor):
            buf = self._buffer(key, obj)
            dst.append(buf)
            src.append(obj)
            return buf
        return copy.deepcopy(obj)


class AsyncShardedSaver:
    """Asynchronous counterpart of :func:`lightning_v17.checkpoint.sharded.save_sharded` (same directory format).

    Args:
        process_group: the main group over which ranks coordinate at synchronous points (``None`` = default
            group, or a single process without torch.distributed). DCP's own collectives run in the background on
            one dedicated gloo group, created at the first save (a collective on ``process_group``'s ranks: the
            first ``start`` is the only one that synchronizes the ranks).
    """

    def __init__(self, *, process_group: Any = None) -> None:
        self._pg = process_group
        self._group: Any = None
        self._stager = PreallocatedStager()
        self._inflight: _InFlight | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="v17-ckpt-writer")

    @property
    def in_flight(self) -> bool:
        return self._inflight is not None

    @property
    def in_flight_path(self) -> Path | None:
        return self._inflight.target if self._inflight else None

    # -------------------------------------------------------------------------------------------------------------
    def _write_group(self) -> Any:
        if self._group is None and _dist_on():
            ranks = None if self._pg is None else dist.get_process_group_ranks(self._pg)
            self._group = dist.new_group(ranks=ranks, backend="gloo")
        return self._group

    # -------------------------------------------------------------------------------------------------------------
    def start(
        self,
        path: str | os.PathLike,
        *,
        app_state: dict[str, Any],
        trainer_state: dict[str, Any],
        meta: dict[str, Any],
    ) -> float:
        """Stage ``app_state`` and launch the background write of ``path``. Call it on every rank; the first call
        creates the dedicated write group (a collective on the main group), later calls issue no collective.

        Args:
            path: the checkpoint directory to create or replace (published by :meth:`poll` / :meth:`wait`).
            app_state: ``{"model": state_dict, "optim": state_dict}`` (either may be absent), FQN keys, plain
                tensors or DTensors; copied before this returns, so the loop may change it right after.
            trainer_state: everything else; snapshotted with ``torch.save`` on rank 0 before this returns.
            meta: JSON-serializable facts recorded in ``meta.json``.

        Returns:
            Seconds this call blocked (staging plus launching).

        Raises:
            RuntimeError: a save is still in flight (call :meth:`wait` first: the callback does).
            ValueError: ``app_state`` has keys other than ``model`` / ``optim``.
        """
        if self._inflight is not None:
            raise RuntimeError(f"a save of {self._inflight.target} is in flight; call wait() before starting another")
        unknown = sorted(set(app_state) - set(COMPONENTS))
        if unknown:
            raise ValueError(f"AsyncShardedSaver.start(app_state=...) takes the keys {COMPONENTS}; got {unknown}")
        t0 = time.perf_counter()
        target = Path(path).absolute()
        rank, _ = _rank_world(self._pg)
        group = self._write_group()
        comps = [c for c in COMPONENTS if c in app_state]
        staged = self._stager.stage({c: app_state[c] for c in comps})  # every component before any write starts
        buf = io.BytesIO()
        if rank == 0:
            torch.save(trainer_state, buf)  # snapshot now: the loop mutates its state right after we return
        tmp = partial_path(target)
        delay_s = float(os.environ.get(TEST_DELAY_ENV, "0") or 0)
        finisher = self._pool.submit(self._write_local, tmp, staged, rank, group, delay_s)
        staging_s = time.perf_counter() - t0
        self._inflight = _InFlight(
            target=target,
            tmp=tmp,
            finisher=finisher,
            trainer_state=buf.getvalue(),
            meta=dict(meta),
            step=trainer_state.get("global_step"),
            staging_s=staging_s,
            t_start=t0,
        )
        finisher.add_done_callback(lambda _f, rec=self._inflight: rec.t_done.append(time.perf_counter()))
        return staging_s

    @staticmethod
    def _write_local(tmp: Path, staged: dict[str, Any], rank: int, group: Any, delay_s: float) -> dict:
        """Background thread: prepare the partial directory, write each staged component with DCP on ``group``, hash
        this rank's files. Every collective here is on ``group``, issued by this one thread in the same order on
        every rank."""
        use_dist = group is not None
        prep_err: BaseException | None = None
        if rank == 0:
            try:
                if tmp.exists():
                    shutil.rmtree(tmp)  # a stale partial directory of an earlier crashed save
                tmp.mkdir(parents=True)
            except BaseException as err:  # noqa: BLE001 - re-raised below, after the peers heard about it
                prep_err = err
        if use_dist:
            # Nobody writes before rank 0 cleared the directory; a failure to prepare stops every rank here instead
            # of leaving the peers blocked in DCP's planning collectives.
            flag = torch.tensor([1 if prep_err is not None else 0])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
            if prep_err is None and flag.item():
                raise RuntimeError(f"rank 0 could not prepare the partial checkpoint directory {tmp}")
        if prep_err is not None:
            raise prep_err
        files: dict[str, dict[str, Any]] = {}
        for comp, state in staged.items():
            dcp.save(
                state,
                storage_writer=dcp.FileSystemWriter(tmp / comp, sync_files=True),
                process_group=group,
                no_dist=not use_dist,
            )
            files.update(hash_own_files(tmp, comp, rank, coordinator=rank == 0))
        if delay_s > 0:
            time.sleep(delay_s)
        return files

    def amend_trainer_state(self, updates: dict[str, Any]) -> None:
        """Add entries to the in-flight save's ``trainer_state`` (kept on rank 0) before it is published, e.g. the
        RNG states captured at the next step's start."""
        if self._inflight is None:
            raise RuntimeError("no save in flight to amend")
        self._inflight.amendments.update(updates)

    # -------------------------------------------------------------------------------------------------------------
    def poll(self) -> SaveResult | None:
        """If every rank's write has finished, publish and return the result; else ``None``. Collective on the main
        group (one all-reduce of two flags) while a save is in flight; free otherwise."""
        rec = self._inflight
        if rec is None:
            return None
        done = rec.finisher.done()
        failed = done and rec.finisher.exception() is not None
        if _dist_on():
            flags = torch.tensor([0 if done else 1, 1 if failed else 0], device=_collective_device(self._pg))
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._pg)
            running, any_failed = (int(x) for x in flags.tolist())
        else:
            running, any_failed = (0 if done else 1), int(failed)
        if running:
            return None
        return self._finalize(bool(any_failed), publish_wait_s=0.0)

    def wait(self) -> SaveResult | None:
        """Block until this rank's write finished, then publish (collective). Returns ``None`` if nothing in flight."""
        rec = self._inflight
        if rec is None:
            return None
        t0 = time.perf_counter()
        try:
            rec.finisher.result()
            failed = False
        except BaseException:  # noqa: BLE001 - DCP raises CheckpointException, a BaseException; reported below
            failed = True
        waited = time.perf_counter() - t0
        if _dist_on():
            flag = torch.tensor([1 if failed else 0], device=_collective_device(self._pg))
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._pg)
            failed = bool(flag.item())
        return self._finalize(failed, publish_wait_s=waited)

    def _finalize(self, failed: bool, *, publish_wait_s: float) -> SaveResult:
        rec = self._inflight
        assert rec is not None  # internal invariant, not user input
        self._inflight = None
        rank, world = _rank_world(self._pg)
        if failed:
            local = rec.finisher.exception() if rec.finisher.done() else None
            _barrier(self._pg)
            if rank == 0:
                shutil.rmtree(rec.tmp, ignore_errors=True)
            _barrier(self._pg)
            raise AsyncSaveError(
                f"asynchronous save of {rec.target} failed on at least one rank"
                + (f" (this rank: {type(local).__name__}: {local})" if local else " (not on this rank)")
                + "; the partial checkpoint was discarded and the previous one is intact"
            ) from local
        files = rec.finisher.result()
        all_files = gather_file_digests(files, process_group=self._pg)
        if rank == 0:
            state_bytes = rec.trainer_state
            if rec.amendments:
                # Our own bytes, pickled by torch.save in start() in this process a moment ago (never a file): there
                # is no trust boundary to cross, and the user's trainer state may legitimately hold types that are
                # not allow-listed for loading. Loading a checkpoint from disk goes through load_trainer_state.
                state = torch.load(io.BytesIO(state_bytes), map_location="cpu", weights_only=False)
                state.update(rec.amendments)
                buf = io.BytesIO()
                torch.save(state, buf)
                state_bytes = buf.getvalue()
            _write_bytes_durably(rec.tmp / TRAINER_STATE_FILE, state_bytes)
            all_files[TRAINER_STATE_FILE] = file_digest(rec.tmp / TRAINER_STATE_FILE)
            components = sorted({k.split("/", 1)[0] for k in all_files if "/" in k}, key=COMPONENTS.index)
            full = build_meta(rec.meta, world_size=world, components=components, files=all_files, step=rec.step)
            publish(rec.tmp, rec.target, full)
        _barrier(self._pg)
        write_s = (rec.t_done[0] if rec.t_done else time.perf_counter()) - rec.t_start
        return SaveResult(path=rec.target, staging_s=rec.staging_s, write_s=write_s, publish_wait_s=publish_wait_s)

    def close(self) -> None:
        """Release staging buffers and the writer thread. Does not publish: call :meth:`wait` first."""
        self._stager.close()
        self._pool.shutdown(wait=False)


# ----------------------------------------------------------------------------------------------------------------
# `latest` pointer, retention, and full-state reading for strategies that keep whole tensors (Lightning "ddp")
# ----------------------------------------------------------------------------------------------------------------
LATEST_FILE = "latest"


def write_latest(dirpath: str | os.PathLike, name: str) -> None:
    """Atomically point ``dirpath/latest`` at checkpoint ``name`` (rank 0; after the checkpoint is published)."""
    from lightning_v17.checkpoint.sharded import _fsync_dir

    d = Path(dirpath)
    tmp = d / f".{LATEST_FILE}.tmp"
    _write_bytes_durably(tmp, (name + "\n").encode())
    os.replace(tmp, d / LATEST_FILE)
    _fsync_dir(d)


def complete_checkpoints(dirpath: str | os.PathLike) -> list[tuple[int, Path]]:
    """Published checkpoints under ``dirpath`` as ``(step, path)`` sorted by step; partial directories (no
    ``meta.json``, dot-prefixed) are skipped."""
    import json

    from lightning_v17.checkpoint.sharded import FORMAT, META_FILE

    out: list[tuple[int, Path]] = []
    d = Path(dirpath)
    if not d.is_dir():
        return out
    for p in d.iterdir():
        if p.name.startswith(".") or not (p / META_FILE).is_file():
            continue
        try:
            meta = json.loads((p / META_FILE).read_text())
        except (OSError, ValueError):
            continue
        if meta.get("format") == FORMAT:
            out.append((int(meta.get("step") or 0), p))
    return sorted(out, key=lambda sp: (sp[0], sp[1].name))


def resolve_latest(dirpath: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint: ``latest`` if it names a published one, else the highest-step one found."""
    from lightning_v17.checkpoint.sharded import META_FILE

    d = Path(dirpath)
    try:
        name = (d / LATEST_FILE).read_text().strip()
    except OSError:
        name = ""
    if name and (d / name / META_FILE).is_file():
        return (d / name).absolute()
    found = complete_checkpoints(d)
    return found[-1][1].absolute() if found else None


def prune(dirpath: str | os.PathLike, *, keep_last: int, keep: Path) -> list[Path]:
    """Delete published checkpoints beyond the newest ``keep_last`` (never ``keep``), and partial directories of
    crashed saves older than ``keep`` (rank 0, after publication). Returns what was removed."""
    from lightning_v17.checkpoint.sharded import _PARTIAL_SUFFIX

    removed: list[Path] = []
    found = complete_checkpoints(dirpath)
    for _, p in found[: max(0, len(found) - keep_last)]:
        if p.absolute() != keep.absolute():
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    for p in Path(dirpath).glob(f".*{_PARTIAL_SUFFIX}"):
        if p.name < f".{keep.name}":  # names are step-ordered ("step-00000012"): older crashed saves only
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def fqn_optim_to_torch(osd: dict[str, Any]) -> list[dict[str, Any]]:
    """FQN-layout optimizer state (``torch.distributed.checkpoint.state_dict``) -> ``torch.optim`` id layout, one per
    optimizer. Ids follow the order of the params in ``param_groups``, which is how ``Optimizer.state_dict`` numbers
    them, so no optimizer instance is needed. ``{"optimizer_0": ..., ...}`` holds several optimizers."""
    if "param_groups" not in osd:
        return [fqn_optim_to_torch(osd[k])[0] for k in sorted(osd, key=lambda k: int(k.rsplit("_", 1)[1]))]
    ids: dict[str, int] = {}
    groups = []
    for g in osd["param_groups"]:
        g2 = dict(g)
        g2["params"] = [ids.setdefault(fqn, len(ids)) for fqn in g["params"]]
        groups.append(g2)
    state = {ids[fqn]: s for fqn, s in osd.get("state", {}).items() if fqn in ids}
    return [{"state": state, "param_groups": groups}]


def load_lightning_checkpoint(
    path: str | os.PathLike, *, process_group: Any = None, weights_only: bool | None = None
) -> dict[str, Any]:
    """A sharded checkpoint as a Lightning checkpoint dict with FULL tensors (``state_dict``, ``optimizer_states``
    in torch id layout, plus the saved trainer state), for strategies that hold whole tensors (``"ddp"``).
    Verified first (collective over ``process_group`` when torch.distributed is initialized).

    ``weights_only``: ``None``/``True`` unpickle the trainer state safely (``UnsafeCheckpointError`` otherwise, see
    :func:`~lightning_v17.checkpoint.sharded.load_trainer_state`); ``False`` only for a trusted checkpoint."""
    from lightning_v17.checkpoint.sharded import _recover, load_full_state_dict, load_trainer_state, verify_checkpoint

    target = Path(path).absolute()
    rank, _ = _rank_world(process_group)
    if rank == 0:
        _recover(target)
    _barrier(process_group)
    meta = verify_checkpoint(target, process_group=process_group)
    ckpt = load_trainer_state(target / TRAINER_STATE_FILE, weights_only=weights_only)
    ckpt["state_dict"] = load_full_state_dict(target, "model", verify=False, weights_only=weights_only)
    if "optim" in meta.get("components", []):
        optim = load_full_state_dict(target, "optim", verify=False, weights_only=weights_only)
        ckpt["optimizer_states"] = fqn_optim_to_torch(optim)
    return ckpt
