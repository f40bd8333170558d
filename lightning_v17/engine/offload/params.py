"""Parameter offload to NVMe at ZeRO-3 (ZeRO-Infinity, Rajbhandari 2021 §5-§6): FSDP2's sharded parameters live in
files between uses, and their memory is really freed.

FSDP2 keeps each parameter's local shard in one padded 1-D tensor (``FSDPParam._sharded_param_data``); the sharded
``DTensor`` parameter (``FSDPParam.sharded_param``, what the module, the optimizer and ``state_dict`` see) has a
local tensor that is a view of the same storage. Each FSDP2 group's shards share one file of page-aligned slots
(:mod:`~lightning_v17.engine.offload.param_store`). In memory, a shard's own storage points at its slot of the group's buffer
(``UntypedStorage._swap_data_ptr_`` with a storage that owns nothing); released, the storage is empty. Every view and
DTensor stays valid as metadata either way, so nothing that holds the parameter (the optimizer's param groups, its
state keys, FSDP2's own references) is ever re-pointed.

I/O: a group is read with one request (at 100-KiB shards a read costs its latency, not its bytes: one request per
parameter left the 3.7M-param GPT's step waiting 0.17 s for reads), changed shards are written back in runs of
neighbouring slots. The buffers come from the I/O backend (page-locked by DeepSpeed's op, which reads and writes
them directly; its per-call bounce buffer, allocated, locked and freed each time, cost as much CPU as the transfer)
and are recycled between groups (:class:`~.param_store._ShardPool`), so a refill neither faults memory in nor locks
it.

When a shard is in memory ("resident"):

* **all-gather** (forward, and backward of units resharded after forward): FSDP2's ``FSDPParamGroup.unshard`` reads
  the shard (the copy-in of ``foreach_all_gather``). Each unit's ``unshard`` is wrapped: its shards are fetched
  before (waiting for their read), released after (the copy-in is done; a world of one reads them in
  ``wait_for_unshard``, released after that). Fetching a unit issues the reads of the next ``prefetch_units``
  units that will all-gather and are not in memory, in the order of a step: root, units 0..n-1, then backward's
  units n-1..0 (so forward's last units read backward's first ones ahead; the last unit itself stays in memory from
  its forward all-gather to its backward one), then (``host_memory="recycle"``) the optimizer step's first chunks
  (read during backward's last units). The reads ahead are issued once the unit's shards are released, so its buffer
  serves the next read. Parameters are not changed by forward or backward, so a release frees the memory without
  writing.
* **optimizer step**: the optimizer's step (:class:`~lightning_v17.engine.offload.optimizer.OptimizerOffload`, attached with
  every ``offload_optimizer`` tier, "none" included, when parameters are on nvme) runs chunk by chunk and asks this
  object for each chunk's parameters (reads issued ``buffer_count - 1`` chunks ahead); after the chunk's step the
  changed shards are written back asynchronously and released when the write completes; under "recycle" except those
  the next forward all-gathers first (the root group and ``prefetch_units`` units, :meth:`ParamOffload.forward_first`):
  they stay in memory, marked changed, and are written back when forward releases them. So a rank never holds all its
  parameter shards at once, and between steps holds none (those few under "recycle").
* **FSDP2's lazy init** (``reset_sharded_param`` compares the shard's storage pointer) and **state dicts**: a
  ``state_dict`` returns fresh copies of the shards (read from their files, or copied while in memory: saves read
  the tier; the copies stay valid however long an asynchronous save holds them); ``load_state_dict`` fetches a
  module's shards before and writes the loaded values back (then releases them) after.
* :meth:`ParamOffload.resident` (``with trainer.strategy.zero.param_offload.resident(): ...``): every shard in
  memory, for user code that reads parameters outside forward and the step (an EMA, a weight norm); the rule of
  DeepSpeed's ZeRO-3 ``GatheredParameters``. Outside it a parameter's local tensor is a :class:`ReleasedShard`
  (same metadata, no data), also for the shards kept in memory between steps, and reading it raises an error that
  names the parameter and this fix (it used to read freed memory and crash the process).

glibc (``OffloadPolicy.host_memory``): "recycle" (the default) maps the tier's own buffers (on a thread that
allocates nothing else: malloc serves a request from a free chunk of the caller's heap before it maps); FSDP2's
all-gathers, whose unsharded parameters are the large allocations of forward, run inside
:func:`~lightning_v17.engine.offload.host_memory.own_mappings` (``collectives.map_all_gathers``, set by ``ZeroBackend``
with any nvme tier under "recycle"); forward's activations stay in the heap, recycled from step
to step (faster on a CPU-only machine, where activations are host memory). "return" (memory first) fixes the mmap
threshold at 1 MiB for the process, so every freed allocation of that size leaves the RSS, activations included
(each a fresh mapping every step), and keeps no idle buffer and nothing read ahead beyond ``prefetch_units``.
Figures (103M-param GPT's peak RSS, 3.7M GPT's tokens/s against DeepSpeed): README, ``bench/offload.py``
(``nvme_params`` / ``nvme_params_return``).

Gradients: FSDP2 reduce-scatters them into separate sharded tensors, which stay in memory until ``zero_grad``
(ZeRO-Infinity keeps gradients in host memory too; the planner puts them on the cpu tier with an offloaded
optimizer). ``offload_optimizer`` does not move them.

Limits of this version (each refused with a clear error before training): parameters on an accelerator (the
host bounce buffer and stream ordering are not implemented), ``fp8`` (its scales read weights after the step),
and an int ``reshard_after_forward`` (a partial reshard to a smaller group). At teardown every shard is copied back
into memory of its own and the files are removed: after ``fit`` the model is an ordinary FSDP2 model again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Generator, Iterable, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_v17.config import HostMemory, V17ConfigError, parse_enum
from lightning_v17.engine.offload import tier_io
from lightning_v17.engine.offload.param_store import ReleasedShard, _Rec, _ShardPool, _Unit

__all__ = ["ParamOffload", "ReleasedShard"]

log = logging.getLogger(__name__)


def _check_plain_shard(fp: Any) -> None:
    """The tier points the shard's storage at its files' buffers: the parameter's local tensor must be a view of
    FSDP2's own shard storage, a plain tensor."""
    data, local = fp._sharded_param_data, fp.sharded_param._local_tensor
    if type(data) is torch.Tensor and local.untyped_storage()._cdata == data.untyped_storage()._cdata:
        return
    name = fp._param_fqn or f"{type(fp._module_info.module).__name__}.{fp._module_info.param_name}"
    what = type(data).__name__ if type(data) is not torch.Tensor else type(local).__name__
    if "float8" in str(local.dtype) or "float8" in what.lower():
        why = f"a float8 tensor ({what}); the nvme tier moves plain tensors"
    elif type(data) is not torch.Tensor or type(local) is not torch.Tensor:
        why = f"a tensor subclass ({what}); the nvme tier moves plain tensors"
    else:
        why = "a tensor of its own, not a view of FSDP2's shard storage (replaced after fully_shard)"
    raise V17ConfigError(
        f'OffloadPolicy(params="nvme"): parameter {name!r} is {why}; use OffloadPolicy(params="cpu") or "none" '
        "for this model"
    )


def _groups_of(module: nn.Module) -> Any:
    state = module._get_fsdp_state() if hasattr(module, "_get_fsdp_state") else None
    return None if state is None else state._fsdp_param_group


class ParamOffload:
    """The sharded parameters of ZeRO-3 units on the nvme tier (see the module docstring).

    Args:
        units: the FSDP2 modules, in forward order (the root group first, then the units).
        nvme_path: the NVMe directory (checked: exists, writable, room for the shards).
        rank: this process's global rank (names its folder).
        prefetch_units: how many units ahead (forward and backward) to read from nvme ahead of their all-gather.
        buffer_count: the optimizer step reads the parameters of ``buffer_count - 1`` chunks ahead.
        host_memory: ``OffloadPolicy.host_memory`` (None: "recycle"): "recycle" keeps an idle unit buffer, the
            next forward's first units and the step's first chunks read ahead, and leaves glibc to ``ZeroBackend``
            (module docstring); "return" fixes glibc's mmap threshold at 1 MiB for the whole process
            (every allocation of that size, activations included, mapped anew and unmapped when freed). The units'
            buffers are their own mappings either way.
        materialize: for a model still on the meta device, ``materialize(after_group)`` allocates and initializes
            the shards (:func:`~lightning_v17.engine.zero.meta_init.materialize_meta_module`), calling
            ``after_group(group)`` once an FSDP2 group's shards are final: they are written to their files then and
            freed, so a rank holds a few units' shards at a time, never its whole shard of the model.
    """

    def __init__(
        self, units: Sequence[nn.Module], *, nvme_path: str, rank: int = 0, prefetch_units: int = 1,
        buffer_count: int = 2, host_memory: HostMemory | str | None = None,
        materialize: Callable[[Callable[[Any], None]], None] | None = None,
    ) -> None:  # fmt: skip
        from lightning_v17.engine.offload import nvme
        from lightning_v17.engine.offload.host_memory import fix_mmap_threshold

        self.groups = [g for g in (_groups_of(m) for m in units) if g is not None]
        if not self.groups:
            raise V17ConfigError(
                "OffloadPolicy(params='nvme') found no FSDP2 unit with parameters (zero_stage=3 applies it)"
            )
        self.depth = max(0, int(prefetch_units))
        self.buffer_count = buffer_count
        self.recs: list[_Rec] = []
        self.by_group: dict[int, list[_Rec]] = {}
        self.units: list[_Unit] = []
        for g in self.groups:
            if g._use_post_forward_mesh:
                raise V17ConfigError(
                    "OffloadPolicy(params='nvme') needs ZeroPolicy(reshard_after_forward=None/True/False) (not an int)"
                )
            recs = []
            for fp in g.fsdp_params:
                local = fp.sharded_param._local_tensor
                if local.is_meta and materialize is None:
                    raise V17ConfigError(
                        f'OffloadPolicy(params="nvme"): parameter {fp._param_fqn!r} is still on the meta device; '
                        "pass materialize= (parallelize does) or initialize the model first"
                    )
                if local.device.type not in ("cpu", "meta"):
                    raise V17ConfigError(
                        f'OffloadPolicy(params="nvme") with parameters on {local.device} is not implemented (the '
                        'host bounce buffer); use OffloadPolicy(params="cpu") or "none" there, or train on the CPU'
                    )
                if not local.is_meta:
                    _check_plain_shard(fp)
                nbytes = fp._sharded_param_data.untyped_storage().nbytes()
                if nbytes == 0:
                    continue
                r = _Rec(fp, len(self.recs), nbytes)
                self.recs.append(r)
                recs.append(r)
            self.by_group[id(g)] = recs
            if recs:
                u = _Unit(len(self.units), recs, 0)
                for r in recs:
                    r.unit, r.offset = u, u.nbytes
                    u.nbytes += r.slot
                self.units.append(u)
        #: bytes of parameter shards this rank keeps on the nvme tier, and of their files (each in an aligned slot)
        self.shard_bytes = sum(r.nbytes for r in self.recs)
        self.nvme_bytes = sum(u.nbytes for u in self.units)
        nvme.check_nvme_path(nvme_path, need_bytes=self.nvme_bytes)
        # the ranks of this host together, before any shard is written (a meta-initialized model streams its units to
        # the files right away: a drive that fills up half-way through would fail there, not here)
        nvme.check_node_capacity(nvme_path, self.nvme_bytes)
        host_memory = host_memory or HostMemory.RECYCLE
        self.host_memory = parse_enum(HostMemory, host_memory, option="OffloadPolicy(host_memory=...)")
        if self.host_memory == HostMemory.RETURN:
            fix_mmap_threshold()
        self.files = nvme.NvmeFileSet(nvme_path, rank=rank, run=None)
        for u in self.units:
            with open(self._path(u), "wb") as f:
                f.truncate(u.nbytes)  # slots are written in place
        self.io, reason = tier_io.open_io(self.files.folder)
        log.info("parameter offload nvme tier: I/O backend %r (%s)", self.io.name, reason)
        #: "return" puts memory first: no buffer kept idle, nothing read ahead for the step or kept for the next
        #: forward beyond ``prefetch_units`` (103M GPT: those held 30-70 MB more at the peak); "recycle" keeps them
        self.lean = self.host_memory == HostMemory.RETURN
        #: the units' buffers: idle at most the largest unit's bytes (a release hands its buffer to the next read)
        self.pool = _ShardPool(self.io, 0 if self.lean else max(u.nbytes for u in self.units))
        self.closed = False
        self._hold = 0  # > 0: inside resident() (the hooks then keep shards in memory)
        self._writes: list[tuple[Future, list[_Rec]]] = []
        #: the shards the optimizer step needs first (its first ``buffer_count - 1`` chunks'), read ahead at the end of
        #: backward (set by the offloaded step)
        self.step_first: list[_Rec] = []
        #: called (once) at backward's first all-gather: the offloaded step's reads of its first chunks' state, issued
        #: there rather than before forward, whose own parameter reads they slowed (set by OptimizerOffload.step)
        self.on_backward: Any = None
        #: seconds spent waiting for parameter reads/writes since the last :meth:`reset_stats`; bytes moved
        self.io_wait_s = 0.0
        self._handles: list[Any] = []
        self._install_hooks()
        if any(r.fp.sharded_param.is_meta for r in self.recs):
            materialize(self._materialized)  # type: ignore[misc]
        self.release(self.recs)  # all shards to the tier now: the first forward reads them
        self.flush()

    def _materialized(self, group: Any) -> None:
        """A meta-initialized group's shards are final: to the tier now (written, then freed), before the next group
        is allocated."""
        recs = self.by_group.get(id(group), [])
        for r in recs:
            _check_plain_shard(r.fp)
        self.release(recs)

    # ------------------------------------------------------------------ lookup
    def recs_of(self, params: Iterable[torch.Tensor]) -> list[_Rec]:
        """The records of those of ``params`` (sharded DTensor parameters) that are offloaded."""
        by_param = {id(r.fp.sharded_param): r for r in self.recs}  # looked up each time: a load may swap objects
        return [r for p in params if (r := by_param.get(id(p))) is not None]

    def _path(self, u: _Unit) -> Any:
        return self.files.path(f"unit{u.index:04d}.bin")

    @staticmethod
    def _units(recs: Iterable[_Rec]) -> list[_Unit]:
        return list({id(r.unit): r.unit for r in recs}.values())  # type: ignore[misc]

    # ------------------------------------------------------------------ residency
    def prefetch(self, recs: Iterable[_Rec]) -> None:
        """Make ``recs`` resident once their unit's read completes: a unit not in memory is read whole (one request)
        into a buffer, and each shard's storage points at its slot."""
        recs = [r for r in recs if not r.resident]
        for u in self._units(recs):
            if u.buf is None:
                u.buf = self.pool.take(u.nbytes)
                u.read = self.io.read_into(self._path(u), u.buf)
        for r in recs:
            r.attach()

    def fetch(self, recs: Iterable[_Rec]) -> None:
        """Make ``recs`` resident now (wait for their units' reads, and for a write-back in flight: then the shard
        stays)."""
        recs = list(recs)
        self.prefetch(recs)
        t0 = time.perf_counter()
        for u in self._units(recs):
            if u.read is not None:
                u.read.result()  # re-raises a failed read
                u.read = None
        for r in recs:
            if r.write is not None:  # written back, not yet released: keep it
                r.write.result()
                r.write = None
            r.show()
        self.io_wait_s += time.perf_counter() - t0

    def release(self, recs: Iterable[_Rec], *, dirty: bool = False, max_writes: int = 4) -> None:
        """Send ``recs`` to the tier: a changed shard (``dirty``, or never written) is written back asynchronously
        (its slot in place; neighbouring slots of a unit together) and released when the write completes (at most
        ``max_writes`` writes in flight besides this call's own); an unchanged one is released now. A unit's buffer
        goes back to the pool once none of its shards is resident."""
        recs = list(recs)
        pending = [u for u in self._units(recs) if u.read is not None]
        if pending:  # reads ahead that were never used
            self.fetch([r for r in recs if r.unit in pending])
        to_write: list[_Rec] = []
        for r in recs:
            if not r.resident or r.write is not None:
                continue
            if dirty or r.dirty:
                r.dirty = False
                to_write.append(r)
            else:
                self._detach(r)
        runs = self._runs(to_write)
        for run in runs:
            u, first = run[0].unit, run[0]
            if first.in_buffer():
                end = run[-1].offset + run[-1].slot
                fut = self.io.write(self._path(u), u.buf[first.offset : end], offset=first.offset)  # type: ignore
            else:
                fut = self.io.write(self._path(u), first.as_bytes(), offset=first.offset)
            u.writes += 1  # type: ignore[union-attr]
            for r in run:
                r.write = fut
            self._writes.append((fut, run))
        self._drain(max_writes + len(runs))  # this call's own (one per unit touched) may all be in flight

    @staticmethod
    def _runs(recs: list[_Rec]) -> list[list[_Rec]]:
        """``recs`` as runs written with one request each: neighbouring slots of one unit's buffer (a shard in memory
        of its own, after a load, alone)."""
        runs: list[list[_Rec]] = []
        for r in sorted(recs, key=lambda r: (r.unit.index, r.offset)):  # type: ignore[union-attr]
            last = runs[-1][-1] if runs else None
            if (last is not None and last.unit is r.unit and last.offset + last.slot == r.offset and last.in_buffer()
                    and r.in_buffer()):  # fmt: skip
                runs[-1].append(r)
            else:
                runs.append([r])
        return runs

    def _detach(self, r: _Rec) -> None:
        r.detach()
        self._maybe_free(r.unit)  # type: ignore[arg-type]

    def _maybe_free(self, u: _Unit) -> None:
        if u.buf is not None and not u.attached and not u.writes and u.read is None:
            self.pool.give(u.buf)
            u.buf = None

    def _drain(self, limit: int) -> None:
        t0 = time.perf_counter()
        while self._writes and (len(self._writes) > limit or self._writes[0][0].done()):
            fut, run = self._writes.pop(0)
            fut.result()  # re-raises a failed write
            run[0].unit.writes -= 1  # type: ignore[union-attr]
            for r in run:
                if r.write is fut:  # else fetched again meanwhile: it stays
                    r.write = None
                    r.detach()
            self._maybe_free(run[0].unit)  # type: ignore[arg-type]
        self.io_wait_s += time.perf_counter() - t0

    def flush(self) -> None:
        """Wait for every write in flight and release those shards."""
        self._drain(0)

    def forward_first(self) -> list[_Rec]:
        """The shards the next forward all-gathers first (the root group, then ``prefetch_units`` units): the optimizer
        step keeps them in memory (:meth:`keep`) instead of writing them back and reading them again at once. None
        under "return" (memory first)."""
        return [] if self.lean else [r for g in self.groups[: 1 + self.depth] for r in self.by_group[id(g)]]

    def keep(self, recs: Iterable[_Rec]) -> None:
        """``recs`` (resident, changed) stay in memory, hidden as released ones are; their slots are written back at
        their next release."""
        for r in recs:
            r.dirty = True
            r.hide()

    def release_all(self, *, dirty: bool = False) -> None:
        self.release(self.recs, dirty=dirty)
        self.flush()

    @contextmanager
    def resident(self) -> Generator[None, None, None]:
        """Every shard in memory for the body (which may change them); written back to the tier afterwards."""
        self.fetch(self.recs)
        self._hold += 1
        try:
            yield
        finally:
            self._hold -= 1
            if not self.closed and not self._hold:
                self.release_all(dirty=True)

    def resident_bytes(self) -> int:
        """Bytes of parameter shards in memory now: the units' buffers held (reads and writes in flight included) and
        shards in memory of their own."""
        return sum(u.nbytes for u in self.units if u.buf is not None) + sum(
            r.storage().nbytes() for r in self.recs if r.resident and not r.in_buffer()
        )

    def disk_bytes(self) -> int:
        self.flush()
        return self.files.disk_bytes()

    # ------------------------------------------------------------------ FSDP2 and state-dict hooks
    def _next_groups(self, g: Any, backward: bool) -> list[Any]:
        """The next ``prefetch_units`` groups to all-gather after ``g``: forward runs root, units 0..n-1, and then
        backward units n-1..0 (those resharded after forward), so the last units of forward read the first ones of
        backward ahead (the last unit itself stays in memory: :meth:`_after_use`). A unit counts whether or not it is
        unsharded now: FSDP2 prefetches unit k+1's all-gather in unit k's pre-forward, while k is unsharded and its
        shards already released, and k is all-gathered again first in backward (skipping it there read k-1 instead,
        and backward waited for k's read: 3.7M GPT, 5-10 ms a step)."""
        fwd, bwd = self.groups, [x for x in self.groups[1:][::-1] if x._reshard_after_forward]
        order = bwd if backward else [*fwd, *bwd]
        i = next((k for k, x in enumerate(order) if x is g), None)
        if i is None:
            return []
        out: list[Any] = []
        for x in order[i + 1 :]:
            if len(out) >= self.depth:
                break
            if x is not g and x not in out and not all(r.resident for r in self.by_group[id(x)]):
                out.append(x)  # (one whose shards are all in memory needs no read: look further)
        return out

    def _after_use(self, g: Any, recs: list[_Rec]) -> None:
        """Release ``g``'s shards after their copy into the all-gather input; except, in a training forward, the last
        unit's, which backward all-gathers again right after the loss."""
        from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

        if self._hold:
            return
        last = len(self.groups) > 1 and g is self.groups[-1] and g._reshard_after_forward
        if last and torch.is_grad_enabled() and g._training_state == TrainingState.FORWARD:
            return
        self.release(recs)

    def _install_hooks(self) -> None:
        from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, TrainingState

        for g in self.groups:
            recs = self.by_group[id(g)]
            orig_unshard, orig_wait, orig_lazy = g.unshard, g.wait_for_unshard, g.lazy_init
            world = g._all_gather_process_group.size() if isinstance(g.mesh_info, FSDPMeshInfo) else 1

            def unshard(async_op: bool = False, *, _g=g, _recs=recs, _orig=orig_unshard, _world=world) -> None:
                ahead = []
                if _g._all_gather_result is None and not _g.is_unsharded:
                    self.fetch(_recs)
                    backward = _g._training_state == TrainingState.PRE_BACKWARD
                    if backward and self.on_backward is not None:
                        start, self.on_backward = self.on_backward, None
                        start()
                    nxt = self._next_groups(_g, backward)
                    ahead = [r for x in nxt for r in self.by_group[id(x)]]
                    if backward and len(nxt) < self.depth and not self.lean:  # backward's last: the step's first
                        ahead += self.step_first
                _orig(async_op)
                if _world > 1 and _g._all_gather_result is not None:
                    self._after_use(_g, _recs)  # copied into the all-gather input: the shard is not read again
                # the reads ahead after the release: this unit's buffer is the next one's (one fewer in memory)
                self.prefetch(ahead)

            def wait_for_unshard(*, _g=g, _recs=recs, _orig=orig_wait) -> None:
                _orig()  # a world of one copies the shard into the unsharded parameter here
                self._after_use(_g, _recs)

            def lazy_init(*, _recs=recs, _orig=orig_lazy) -> None:
                self.fetch(_recs)  # reset_sharded_param compares (and may copy) the shard's storage
                try:
                    _orig()
                finally:
                    if not self._hold:
                        self.release(_recs)

            g.unshard, g.wait_for_unshard, g.lazy_init = unshard, wait_for_unshard, lazy_init
            owners: dict[int, tuple[nn.Module, list[_Rec]]] = {}
            for r in recs:
                mod = r.fp._module_info.module
                owners.setdefault(id(mod), (mod, []))[1].append(r)
            for mod, own in owners.values():
                self._handles.append(mod.register_state_dict_post_hook(self._save_hook(own)))
                self._handles.append(mod.register_load_state_dict_pre_hook(self._load_pre_hook(own)))
                # registered after FSDP2's reset_sharded_param post hook (FSDPParam.__init__), so it runs after it
                self._handles.append(mod.register_load_state_dict_post_hook(self._load_post_hook(own)))

    def _snapshot(self, r: _Rec) -> torch.Tensor:
        """A fresh copy of ``r``'s local shard: cloned while resident, else from its unit's buffer while that is held,
        else read from its slot of the unit's file."""
        local = r.fp.sharded_param._local_tensor
        if r.resident:
            self.fetch([r])
            return r.fp.sharded_param._local_tensor.detach().clone()  # the parameter's own again (not a stand-in)
        u = r.unit
        if u.buf is not None:  # type: ignore[union-attr]
            if u.read is not None:  # type: ignore[union-attr]
                u.read.result()  # type: ignore[union-attr]
                u.read = None  # type: ignore[union-attr]
            buf = u.buf[r.offset : r.offset + r.nbytes].clone()  # type: ignore[union-attr]
        else:
            buf = torch.empty(r.slot, dtype=torch.uint8)
            self.io.read_into(self._path(u), buf, offset=r.offset).result()  # type: ignore[arg-type]
        n = local.numel() * local.element_size()
        return buf[:n].view(local.dtype).view(local.shape)

    def _save_hook(self, own: list[_Rec]) -> Any:
        def hook(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
            if self.closed:
                return
            for r in own:
                key = prefix + r.fp._module_info.param_name
                v = state_dict.get(key)
                if isinstance(v, DTensor):
                    state_dict[key] = DTensor.from_local(
                        self._snapshot(r), v.device_mesh, v.placements, run_check=False, shape=v.shape,
                        stride=v.stride(),
                    )  # fmt: skip

        return hook

    def _load_pre_hook(self, own: list[_Rec]) -> Any:
        def hook(*args: Any, **kwargs: Any) -> None:
            if not self.closed:
                self.fetch(own)

        return hook

    def _load_post_hook(self, own: list[_Rec]) -> Any:
        def hook(*args: Any, **kwargs: Any) -> None:
            if not self.closed:
                for r in own:  # FSDP2's post hook may have re-padded the shard into a new storage: the same size
                    if r.storage().nbytes() != r.nbytes:
                        raise RuntimeError(
                            f"OffloadPolicy(params='nvme'): loading {r.fp._param_fqn!r} changed its shard from "
                            f"{r.nbytes} to {r.storage().nbytes()} bytes; load a checkpoint of this model and mesh"
                        )
                self.release(own, dirty=True)
                self.flush()

        return hook

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Bring every shard back into memory, remove the hooks and the files (idempotent)."""
        if self.closed:
            return
        try:
            self.flush()
            for u in self.units:  # unit by unit out of the buffers (the backend frees its own) into plain memory
                self.fetch(u.recs)
                for r in u.recs:
                    r.to_own_memory()
                self._maybe_free(u)
            self.pool.close()
        finally:
            self.closed = True
            for g in self.groups:
                for name in ("unshard", "wait_for_unshard", "lazy_init"):
                    g.__dict__.pop(name, None)
            for h in self._handles:
                h.remove()
            self._handles = []
            self.io.close()
            self.files.close()
