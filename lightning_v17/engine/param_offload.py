"""Parameter offload to NVMe at ZeRO-3 (ZeRO-Infinity, Rajbhandari 2021 §5-§6): FSDP2's sharded parameters live in
files between uses, and their memory is really freed.

FSDP2 keeps each parameter's local shard in one padded 1-D tensor (``FSDPParam._sharded_param_data``); the sharded
``DTensor`` parameter (``FSDPParam.sharded_param``, what the module, the optimizer and ``state_dict`` see) has a
local tensor that is a view of the same storage. :class:`ParamOffload` writes that storage's bytes to one file per
parameter and frees it with ``untyped_storage().resize_(0)``: every view and DTensor stays valid as metadata, and a
refill (``resize_`` back, read the file into the same storage) brings them all back in place, so nothing that holds
the parameter (the optimizer's param groups, its state keys, FSDP2's own references) is ever re-pointed.

When a shard is in memory ("resident"):

* **all-gather** (forward, and backward of units resharded after forward): FSDP2's ``FSDPParamGroup.unshard`` reads
  the shard (the copy-in of ``foreach_all_gather``). Each unit's ``unshard`` is wrapped: its shards are fetched
  before (waiting for their read), released after (the copy-in is done; a world of one reads them in
  ``wait_for_unshard``, released after that). Fetching unit i issues the reads of the next ``prefetch_units``
  units that will all-gather (forward order root, units 0..n-1; backward order root, units n-1..0), so the file
  reads overlap compute as DeepSpeed's ``offload_param.buffer_count`` read-ahead does. Parameters are not changed
  by forward or backward, so a release frees the memory without writing.
* **optimizer step**: the optimizer's step (:class:`~lightning_v17.engine.offload.OptimizerOffload`, attached with
  every ``offload_optimizer`` tier, "none" included, when parameters are on nvme) runs chunk by chunk and asks this
  object for each chunk's parameters (reads issued ``buffer_count - 1`` chunks ahead); after the chunk's step the
  changed shards are written back asynchronously and freed when the write completes. So a rank never holds all its
  parameter shards at once, during the step either.
* **FSDP2's lazy init** (``reset_sharded_param`` compares the shard's storage pointer) and **state dicts**: a
  ``state_dict`` returns fresh copies of the shards read from their files (saves read the tier; the copies stay
  valid however long an asynchronous save holds them); ``load_state_dict`` fetches a module's shards before and
  writes the loaded values back (then frees them) after.
* :meth:`ParamOffload.resident` (``with trainer.strategy.zero.param_offload.resident(): ...``): every shard in memory, for
  user code that reads parameters outside forward and the step (an EMA, a weight norm); the rule of DeepSpeed's
  ZeRO-3 ``GatheredParameters``. Outside it a released parameter's local tensor is a :class:`ReleasedShard` (same
  metadata, no data), and reading it raises an error that names the parameter and this fix (it used to read freed
  memory and crash the process).

Gradients: FSDP2 reduce-scatters them into separate sharded tensors, which stay in memory until ``zero_grad``
(ZeRO-Infinity keeps gradients in host memory too; the planner puts them on the cpu tier with an offloaded
optimizer). ``offload_optimizer`` does not move them.

Limits of this version (each refused with a clear error before training): parameters on an accelerator (the
host bounce buffer and stream ordering are not implemented), ``fp8`` (its scales read weights after the step),
and an int ``reshard_after_forward`` (pp > 1 runs ZeRO-0/1 only). At teardown every shard is read back into memory and the
files are removed: after ``fit`` the model is an ordinary FSDP2 model again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Generator, Iterable, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Self

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_v17.config import V17ConfigError

__all__ = ["ParamOffload", "ReleasedShard"]

log = logging.getLogger(__name__)


class ReleasedShard(torch.Tensor):
    """What a parameter's local tensor is while its shard is on the nvme tier (the DTensor parameter's
    ``_local_tensor``): the shard's shape, stride, dtype and device, no data. Reading or writing it raises an error
    that names the parameter and the fix (the storage is freed: a read would touch freed memory, and crash the
    process). Views (``detach``, ``to_local()``'s ``view_as``, ...) give another one, so metadata, ``state_dict()``
    (the tier's save hook puts the shard read from its file in its place) and storage accounting (an empty storage,
    as FSDP2's freed ones) still work."""

    _v17_name: str

    @staticmethod
    def __new__(cls, like: torch.Tensor, name: str, device: torch.device | None = None) -> Self:
        t = torch.Tensor._make_wrapper_subclass(
            cls, like.size(), strides=like.stride(), storage_offset=like.storage_offset(), dtype=like.dtype,
            device=device or like.device, requires_grad=False,
        )  # fmt: skip
        t._v17_name = name
        return t

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return f"ReleasedShard({self._v17_name!r}, shape={tuple(self.shape)}, dtype={self.dtype})"

    def untyped_storage(self) -> torch.UntypedStorage:  # type: ignore[override]
        return torch.UntypedStorage(0)  # freed, as a storage FSDP2 resized to zero

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch.utils._pytree import tree_leaves, tree_map_only

        kwargs = kwargs or {}
        shard = next(a for a in tree_leaves((args, kwargs)) if isinstance(a, ReleasedShard))
        if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default) or getattr(func, "is_view", False):
            def meta(t: ReleasedShard) -> torch.Tensor:
                return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device="meta")

            m_args, m_kwargs = tree_map_only(ReleasedShard, meta, (args, kwargs))
            out = func(*m_args, **m_kwargs)
            return tree_map_only(torch.Tensor, lambda m: ReleasedShard(m, shard._v17_name, shard.device), out)
        raise RuntimeError(
            f"parameter {shard._v17_name!r} is on the nvme tier (offload_params='nvme'): its shard is in memory only "
            f"during forward, backward and the optimizer step, and {func} read it outside them. Read parameters "
            "inside `with trainer.strategy.zero.param_offload.resident():` (every shard in memory, written back "
            "after), as DeepSpeed's ZeRO-3 GatheredParameters"
        )

    __torch_function__ = torch._C._disabled_torch_function_impl


@dataclass(eq=False)
class _Rec:
    """One offloaded parameter shard."""

    fp: Any  # FSDP2's FSDPParam
    index: int
    nbytes: int
    resident: bool = True
    dirty: bool = True  # the file is not current (never written, or changed since)
    read: Future | None = None
    write: Future | None = None
    local: torch.Tensor | None = None  # the parameter's local tensor while a ReleasedShard stands in for it

    def storage(self) -> torch.UntypedStorage:
        return self.fp._sharded_param_data.untyped_storage()

    def free(self) -> None:
        """Free the shard's memory; a :class:`ReleasedShard` stands in for the parameter's local tensor."""
        self.storage().resize_(0)
        self.resident = False
        sp = self.fp.sharded_param
        if not isinstance(sp._local_tensor, ReleasedShard):  # a load may have put a new local tensor there
            self.local = sp._local_tensor
            sp._local_tensor = ReleasedShard(self.local, self.fp._param_fqn or self.fp._module_info.param_name)

    def restore(self) -> None:
        """The shard is in memory again: the parameter's own local tensor back."""
        self.resident = True
        sp = self.fp.sharded_param
        if isinstance(sp._local_tensor, ReleasedShard) and self.local is not None:
            sp._local_tensor, self.local = self.local, None

    def as_bytes(self) -> torch.Tensor:
        """A uint8 tensor over the whole (padded) storage."""
        return torch.empty(0, dtype=torch.uint8).set_(self.storage(), 0, (self.nbytes,), (1,))


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
    """

    def __init__(
        self, units: Sequence[nn.Module], *, nvme_path: str, rank: int = 0, prefetch_units: int = 1, buffer_count: int = 2
    ) -> None:
        from lightning_v17.engine import nvme
        from lightning_v17.engine.host_buffers import fix_mmap_threshold

        self.groups = [g for g in (_groups_of(m) for m in units) if g is not None]
        if not self.groups:
            raise V17ConfigError("offload_params='nvme' found no FSDP2 unit with parameters (zero_stage=3 applies it)")
        self.depth = max(0, int(prefetch_units))
        self.buffer_count = buffer_count
        self.recs: list[_Rec] = []
        self.by_group: dict[int, list[_Rec]] = {}
        for g in self.groups:
            if g._use_post_forward_mesh:
                raise V17ConfigError("offload_params='nvme' needs reshard_after_forward None/True/False (not an int)")
            recs = []
            for fp in g.fsdp_params:
                local = fp.sharded_param._local_tensor
                if local.device.type != "cpu":
                    raise V17ConfigError(
                        f"offload_params='nvme' with parameters on {local.device} is not implemented yet (the host "
                        "bounce buffer); use offload_params='cpu' or 'none' there, or train on the CPU"
                    )
                if type(fp._sharded_param_data) is not torch.Tensor or (
                    local.untyped_storage()._cdata != fp._sharded_param_data.untyped_storage()._cdata
                ):
                    raise V17ConfigError(
                        f"offload_params='nvme': parameter {fp._param_fqn or fp._module_info.param_name!r} is not a "
                        "plain tensor view of FSDP2's shard storage (a tensor subclass such as float8?); use "
                        "offload_params='cpu' or 'none'"
                    )
                nbytes = fp._sharded_param_data.untyped_storage().nbytes()
                if nbytes == 0:
                    continue
                r = _Rec(fp, len(self.recs), nbytes)
                self.recs.append(r)
                recs.append(r)
            self.by_group[id(g)] = recs
        #: bytes of parameter shards this rank keeps on the nvme tier
        self.nvme_bytes = sum(r.nbytes for r in self.recs)
        nvme.check_nvme_path(nvme_path, need_bytes=self.nvme_bytes)
        fix_mmap_threshold()
        self.files = nvme.NvmeFileSet(nvme_path, rank=rank, run=None)
        self.io, reason = nvme.open_io(self.files.folder)
        log.info("parameter offload nvme tier: I/O backend %r (%s)", self.io.name, reason)
        self.closed = False
        self._hold = 0  # > 0: inside resident() (the hooks then keep shards in memory)
        self._writes: list[_Rec] = []
        #: seconds spent waiting for parameter reads/writes since the last :meth:`reset_stats`; bytes moved
        self.io_wait_s = 0.0
        self._handles: list[Any] = []
        self._install_hooks()
        self.release(self.recs)  # all shards to the tier now: the first forward reads them
        self.flush()

    # ------------------------------------------------------------------ lookup
    def recs_of(self, params: Iterable[torch.Tensor]) -> list[_Rec]:
        """The records of those of ``params`` (sharded DTensor parameters) that are offloaded."""
        by_param = {id(r.fp.sharded_param): r for r in self.recs}  # looked up each time: a load may swap objects
        return [r for p in params if (r := by_param.get(id(p))) is not None]

    def _path(self, r: _Rec) -> Any:
        return self.files.path(f"param{r.index:05d}.bin")

    # ------------------------------------------------------------------ residency
    def prefetch(self, recs: Iterable[_Rec]) -> None:
        """Issue the reads of those of ``recs`` that are on the tier (their storage is allocated now)."""
        for r in recs:
            if r.resident or r.read is not None:
                continue
            r.storage().resize_(r.nbytes)
            r.read = self.io.read_into(self._path(r), r.as_bytes())

    def fetch(self, recs: Iterable[_Rec]) -> None:
        """Make ``recs`` resident (wait for their reads, or for a write in flight: then the memory is kept)."""
        recs = list(recs)
        self.prefetch(recs)
        t0 = time.perf_counter()
        for r in recs:
            if r.read is not None:
                r.read.result()  # re-raises a failed read
                r.read = None
                r.restore()
            if r.write is not None:  # written back, not yet freed: keep it
                r.write.result()
                r.write = None
                self._writes.remove(r)
                r.restore()
        self.io_wait_s += time.perf_counter() - t0

    def release(self, recs: Iterable[_Rec], *, dirty: bool = False, max_writes: int = 2) -> None:
        """Send ``recs`` to the tier: a changed shard (``dirty``, or never written) is written back asynchronously and
        freed when the write completes (at most ``max_writes`` in flight); an unchanged one is freed now."""
        for r in recs:
            if r.read is not None:  # a read ahead that was never used
                self.fetch([r])
            if not r.resident or r.write is not None:
                continue
            if dirty or r.dirty:
                r.dirty = False
                r.write = self.io.write(self._path(r), r.as_bytes())
                self._writes.append(r)
                self._drain(max_writes)
            else:
                r.free()

    def _drain(self, limit: int) -> None:
        t0 = time.perf_counter()
        while self._writes and (len(self._writes) > limit or self._writes[0].write.done()):  # type: ignore[union-attr]
            r = self._writes.pop(0)
            r.write.result()  # type: ignore[union-attr]  # re-raises a failed write
            r.write = None
            r.free()
        self.io_wait_s += time.perf_counter() - t0

    def flush(self) -> None:
        """Wait for every write in flight and free those shards."""
        self._drain(0)

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
        """Bytes of parameter shards in memory now (reads and writes in flight included)."""
        return sum(r.storage().nbytes() for r in self.recs)

    def disk_bytes(self) -> int:
        self.flush()
        return self.files.disk_bytes()

    # ------------------------------------------------------------------ FSDP2 and state-dict hooks
    def _next_groups(self, g: Any, backward: bool) -> list[Any]:
        order = [self.groups[0], *self.groups[1:][::-1]] if backward else self.groups
        i = next((k for k, x in enumerate(order) if x is g), None)
        if i is None:
            return []
        out = []
        for x in order[i + 1 :]:
            if len(out) >= self.depth:
                break
            if x.is_sharded and (not backward or x._reshard_after_forward):
                out.append(x)
        return out

    def _after_use(self, recs: list[_Rec]) -> None:
        if not self._hold:
            self.release(recs)

    def _install_hooks(self) -> None:
        from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, TrainingState

        for g in self.groups:
            recs = self.by_group[id(g)]
            orig_unshard, orig_wait, orig_lazy = g.unshard, g.wait_for_unshard, g.lazy_init
            world = g._all_gather_process_group.size() if isinstance(g.mesh_info, FSDPMeshInfo) else 1

            def unshard(async_op: bool = False, *, _g=g, _recs=recs, _orig=orig_unshard, _world=world) -> None:
                if _g._all_gather_result is None and not _g.is_unsharded:
                    self.fetch(_recs)
                    backward = _g._training_state == TrainingState.PRE_BACKWARD
                    for nxt in self._next_groups(_g, backward):
                        self.prefetch(self.by_group[id(nxt)])
                _orig(async_op)
                if _world > 1 and _g._all_gather_result is not None:
                    self._after_use(_recs)  # copied into the all-gather input: the shard is not read again

            def wait_for_unshard(*, _recs=recs, _orig=orig_wait) -> None:
                _orig()  # a world of one copies the shard into the unsharded parameter here
                self._after_use(_recs)

            def lazy_init(*, _recs=recs, _orig=orig_lazy) -> None:
                self.fetch(_recs)  # reset_sharded_param compares (and may copy) the shard's storage
                try:
                    _orig()
                finally:
                    self._after_use(_recs)

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
        """A fresh copy of ``r``'s local shard, read from its file (or cloned while resident)."""
        local = r.fp.sharded_param._local_tensor
        if r.resident or r.read is not None or r.write is not None:
            self.fetch([r])
            return r.fp.sharded_param._local_tensor.detach().clone()  # the parameter's own again (not a stand-in)
        buf = torch.empty(r.nbytes, dtype=torch.uint8)
        self.io.read_into(self._path(r), buf).result()
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
                for r in own:  # FSDP2's post hook may have re-padded the shard into a new storage
                    r.nbytes = r.storage().nbytes()
                self.release(own, dirty=True)
                self.flush()

        return hook

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Bring every shard back into memory, remove the hooks and the files (idempotent)."""
        if self.closed:
            return
        try:
            self.fetch(self.recs)
            self.flush()
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
