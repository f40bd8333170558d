"""Optimizer offload (ZeRO-Offload, Ren 2021 §4; ZeRO-Infinity, Rajbhandari 2021 §5): the optimizer state lives on
the cpu or nvme tier and the step runs chunk by chunk, around the user's own optimizer.

``attach_offload`` (:mod:`lightning_v17.engine.offload.handles`) wraps any ``torch.optim.Optimizer`` in place (only
the instance's ``step`` is replaced) after the ZeRO backend has partitioned it, so it composes with every ZeRO stage
without knowing it. For chunks of the optimizer's parameters (up to ``chunk_mb`` of this rank's fp32 elements each):
wait for the chunk's state read, install it in ``optimizer.state``, read ahead chunk k + ``buffer_count`` - 1, run the
optimizer's own ``step`` narrowed to the chunk, write the state back asynchronously. An nvme rank holds the state of
``buffer_count`` chunks at most. With ``params="nvme"`` (:mod:`lightning_v17.engine.offload.params`) the step streams
the parameter shards the same way.

The tiers, the ratio split, the buffers, glibc's heap (``OffloadPolicy.host_memory``) and what each costs, measured:
docs/offload.md ("The optimizer tier in detail").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Generator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from lightning_v17.config import HostMemory, Tier, V17ConfigError, parse_enum
from lightning_v17.engine._dtensor import local_tensor as _local
from lightning_v17.engine.offload import nvme, tier_io
from lightning_v17.engine.offload.host_memory import (
    AfterWrite,
    BufferPool,
    PooledRead,
    fix_mmap_threshold,
    own_mappings,
    sole_owner,
    trim_heap,
)
from lightning_v17.engine.state import optimizer_state

__all__ = ["OptimizerOffload", "own_mappings", "planned_state_bytes"]

log = logging.getLogger(__name__)

_ALIGN = 64  # byte alignment of each state tensor inside a chunk's buffer (any dtype's view stays aligned)
_PAGE = 4096  # a chunk's buffer and file size: a multiple of the O_DIRECT alignment




# ------------------------------------------------------------------------------------------------ planner bytes
def planned_state_bytes(optimizer: torch.optim.Optimizer, params: list[torch.Tensor] | None = None) -> int:
    """The planner's optimizer-state bytes of ``params`` (default: all of ``optimizer``'s) on this rank:
    ``optimizer_bytes_per_param(kind, fp32)`` (``planner/memory.py``) x their local elements. An optimizer the planner
    does not know counts as AdamW (8 B/param, the largest fp32 state of the library)."""
    from lightning_v17.config import OptimizerKind, Precision
    from lightning_v17.optim.factory import optimizer_kind_of
    from lightning_v17.planner.memory import optimizer_bytes_per_param

    name = optimizer_kind_of(optimizer)
    kind = (name.planner_kind if name is not None else None) or OptimizerKind.ADAMW
    per_param = optimizer_bytes_per_param(kind, Precision.FP32)
    if params is None:
        params = [p for g in optimizer.param_groups for p in g["params"]]
    return int(per_param * sum(_local(p).numel() for p in params))


# ------------------------------------------------------------------------------------------------ chunks
@dataclass
class _Entry:
    """Where one spilled state tensor sits in its chunk's file."""

    index: int  # parameter index in the optimizer (param-group order)
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    #: a DTensor state's own DTensorSpec (mesh, placements, global shape, stride, dtype): wraps the chunk's view again
    spec: Any | None


@dataclass
class _Chunk:
    params: list[int]  # parameter indices
    tier: Tier  # Tier.NVME: spilled between steps; else resident in optimizer.state
    nbytes: int = 0  # file size once spilled
    entries: list[_Entry] = field(default_factory=list)
    resident: dict[int, dict[str, Any]] = field(default_factory=dict)  # scalars, shared and empty tensors
    order: dict[int, list[str]] = field(default_factory=dict)  # each parameter's state keys, in order
    spilled: bool = False
    buf: torch.Tensor | None = None  # the buffer the installed state was read into (its tensors are views of it)


class OptimizerOffload:
    """The optimizer state of one optimizer on an offload tier, stepped chunk by chunk (see the module docstring).

    Args:
        optimizer: the optimizer (already partitioned by the ZeRO backend, before its first step).
        tier: ``Tier.CPU`` or ``Tier.NVME``.
        nvme_path: the NVMe directory (nvme tier).
        ratio: fraction of the state (bytes, chunk granularity) on ``tier``; the rest one tier up.
        rank: this process's global rank (names its nvme folder).
        chunk_mb: ``OffloadPolicy.chunk_mb``.
        buffer_count: ``OffloadPolicy.buffer_count`` (the bound on the tier's buffers).
        params: the :class:`~lightning_v17.engine.offload.params.ParamOffload` of parameters on the nvme tier (then
            ``tier`` may be ``Tier.NONE``): each chunk's parameter shards are read ahead like its state, and written
            back after its step.
        host_memory: ``OffloadPolicy.host_memory`` with an nvme tier (None: "recycle"; backward's scope is the
            strategy's).
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, *, tier: Tier, nvme_path: str | None = None, ratio: float = 1.0,
        rank: int = 0, chunk_mb: float = 4.0, buffer_count: int = 2, params: Any = None,
        host_memory: HostMemory | str | None = None,
    ) -> None:  # fmt: skip
        tier = Tier.parse(tier, "OffloadPolicy(optimizer=...)")
        host_memory = parse_enum(HostMemory, host_memory or HostMemory.RECYCLE, option="OffloadPolicy(host_memory=...)")
        if tier == Tier.NONE and params is None:
            raise ValueError("OptimizerOffload needs tier 'cpu' or 'nvme' (or parameters on the nvme tier)")
        self.param_tier = params
        if not 0.0 < ratio <= 1.0:
            raise V17ConfigError(f"OffloadPolicy(optimizer_ratio={ratio!r}) must be in (0, 1]")
        if buffer_count < 2:
            raise V17ConfigError(
                f"OffloadPolicy(buffer_count={buffer_count!r}) must be >= 2 (one chunk stepping, one read)"
            )
        self.optimizer = optimizer
        self.tier = tier
        self.ratio = ratio
        self.depth = buffer_count - 1
        self.params: list[torch.Tensor] = [p for g in optimizer.param_groups for p in g["params"]]
        if optimizer.state:
            raise RuntimeError("attach_offload must run before the optimizer's first step (it has state)")
        self.chunks = self._make_chunks(chunk_mb * 2**20, ratio)
        self.files = self.io = None
        self.backend = "memory"
        nvme_params = [self.params[i] for c in self.chunks if c.tier == Tier.NVME for i in c.params]
        #: the planner's optimizer-state bytes this rank puts on the nvme tier (the free-space check's figure)
        self.planned_nvme_bytes = planned_state_bytes(optimizer, nvme_params) if nvme_params else 0
        if nvme_params:
            nvme.check_nvme_path(nvme_path, need_bytes=self.planned_nvme_bytes)
        off_cpu = sorted({str(_local(p).device) for p in self.params if _local(p).device.type != "cpu"})
        if off_cpu:
            raise V17ConfigError(
                f"OffloadPolicy(optimizer={tier.value!r}) with parameters on {off_cpu} is not implemented yet (the "
                "host-side step of accelerator parameters); use OffloadPolicy(optimizer='none') there, or train on the "
                "CPU"
            )
        if nvme_params:
            self.files = nvme.NvmeFileSet(nvme_path, rank=rank)  # type: ignore[arg-type]
            self.io, reason = tier_io.open_io(self.files.folder)
            self.backend = self.io.name
            _log_backend_once(self.backend, reason)
            if host_memory == HostMemory.RETURN:
                fix_mmap_threshold()  # for the whole process (else own_mappings scopes it to the first step and loads)
        self._inner_step: Callable[..., Any] = optimizer.step
        self._own_step = optimizer.__dict__.get("step")  # an instance-level step to put back at close (else none)
        self._reads: dict[int, Any] = {}
        self._writes: list[Future] = []
        #: chunk -> (its last write, the pool buffer being written), until a read takes the buffer (the same chunk's
        #: read: no read needed; another chunk's: refilled once written)
        self._written: dict[int, tuple[Future, torch.Tensor]] = {}
        #: chunk -> its last write-back while in flight (a read of its file waits for it)
        self._writing: dict[int, Future] = {}
        #: the nvme chunks' buffers (module docstring): every chunk stepping, read ahead or being written back
        self.pool = BufferPool(buffer_count)
        self._buf_bytes = 0  # the largest chunk's bytes on the tier: the size of every pool buffer once known
        self._repacked = False
        self._stepped = False  # the first step creates the state on the heap: it runs inside own_mappings
        self._materialized = False
        self.closed = self.lost_state = False
        #: seconds the last step waited for reads and writes (I/O not hidden behind compute), and its total time
        self.io_wait_s = self.step_s = 0.0
        optimizer.step = self.step  # type: ignore[method-assign]
        optimizer_state(optimizer).offload = self

    # -------------------------------------------------------------- layout
    def _make_chunks(self, chunk_bytes: float, ratio: float) -> list[_Chunk]:
        """Chunks of consecutive parameters by this rank's fp32 size, each at most ``max(chunk_bytes, the largest
        parameter)``; the first ones (by bytes, up to ``ratio`` of the total) on the tier."""
        sizes_b = [_local(p).numel() * 4 for p in self.params]
        # a chunk is closed before a parameter would take it past the limit, so that no chunk (and no buffer of the
        # pool, sized by the largest chunk) exceeds max(chunk_mb, the largest parameter): the tier's memory bound
        limit = max([chunk_bytes, *sizes_b])
        chunks: list[list[int]] = []
        cur: list[int] = []
        cur_bytes = 0
        for i, n in enumerate(sizes_b):
            if cur and cur_bytes + n > limit:
                chunks.append(cur)
                cur, cur_bytes = [], 0
            cur.append(i)
            cur_bytes += n
        if cur:
            chunks.append(cur)
        sizes = [sum(_local(self.params[i]).numel() for i in c) for c in chunks]
        total, on_tier, out = sum(sizes), 0, []
        for c, n in zip(chunks, sizes):
            to_tier = ratio >= 1.0 or on_tier < ratio * total
            on_tier += n if to_tier else 0
            out.append(_Chunk(params=c, tier=self.tier if to_tier else Tier.NONE))
        return out

    @property
    def nvme_chunks(self) -> int:
        return sum(c.tier == Tier.NVME for c in self.chunks)

    # -------------------------------------------------------------- spill / install (nvme chunks)
    def _path(self, k: int) -> Any:
        return self.files.path(f"chunk{k:05d}.bin")  # type: ignore[union-attr]

    def _spill(self, k: int) -> None:
        """Pop chunk k's state out of ``optimizer.state`` and write it to its file asynchronously."""
        c = self.chunks[k]
        state = self.optimizer.state
        popped = {i: state.pop(self.params[i]) for i in c.params if self.params[i] in state}
        if not popped:
            return
        seen: dict[int, int] = {}
        for st in popped.values():
            for v in st.values():
                if torch.is_tensor(v) and v.dim() > 0 and v.numel() > 0:
                    ptr = _local(v).data_ptr()
                    seen[ptr] = seen.get(ptr, 0) + 1
        entries, tensors, resident, order, off = [], [], {}, {}, 0
        for i, st in popped.items():
            order[i] = list(st)
            for key, v in st.items():
                local = _local(v) if torch.is_tensor(v) else None
                if local is None or v.dim() == 0 or v.numel() == 0 or seen[local.data_ptr()] > 1:
                    resident.setdefault(i, {})[key] = v
                    continue
                if type(local) is not torch.Tensor:
                    raise V17ConfigError(
                        f"OffloadPolicy(optimizer='nvme'): {type(self.optimizer).__name__} keeps state {key!r} as a "
                        f"{type(local).__name__} tensor subclass, which cannot be written as bytes; use a library "
                        "optimizer with plain state (e.g. Adam8bit(backend='bitsandbytes')) or "
                        "OffloadPolicy(optimizer='cpu')"
                    )
                local = local.contiguous()
                n = local.numel() * local.element_size()
                spec = v._spec if isinstance(v, DTensor) else None  # its mesh, placements, global shape and stride
                entries.append(_Entry(i, key, local.dtype, tuple(local.shape), off, n, spec))
                tensors.append((off, local))
                off += -(-n // _ALIGN) * _ALIGN
        off = -(-off // _PAGE) * _PAGE  # whole pages: O_DIRECT writes and reads it as is, no padded copy
        c.entries, c.resident, c.order, c.nbytes, c.spilled = entries, resident, order, off, True
        self._buf_bytes = max(self._buf_bytes, off)
        buf, c.buf = c.buf, None
        if buf is None or buf.numel() < off or any(t.data_ptr() != buf.data_ptr() + o for o, t in tensors):
            # first step (the optimizer made its own tensors) or state replaced: pack it into one buffer
            buf = self.pool.take_or_wait(off, self.io, self._wait_for_one_write, size=self._buf_bytes)
            self._repacked = True  # the optimizer's own state tensors are freed now: trim the heap after the step
            for o, t in tensors:
                buf[o : o + t.numel() * t.element_size()].view(t.dtype).view(t.shape).copy_(t)
        # else: every state tensor is still the view of the buffer it was read into, updated in place: write it as is
        del tensors, popped
        st = v = local = t = None  # the loops' last state tensor (a view of buf) must not count as a viewer below
        self._reap()
        # a state tensor a caller kept from a state-dict read still views the buffer: never refill it (nothing else
        # can take a new view now: the state is out of optimizer.state)
        refill = id(buf) in self.pool.owned and sole_owner(buf)
        if not refill:
            self.pool.retire(buf)
        fut = self.io.write(self._path(k), buf[:off])  # type: ignore[union-attr]
        self._writes.append(fut)
        self._writing[k] = fut
        if refill:
            self._written[k] = (fut, buf)

    def _read(self, k: int) -> None:
        """Issue the asynchronous read of chunk k (an nvme chunk that was spilled)."""
        c = self.chunks[k]
        if c.tier == Tier.NVME and c.spilled and k not in self._reads:
            self._prune()
            pending = self._written.pop(k, None)
            if pending is not None:
                # still being written back (the step does not wait for its last writes: they overlap the next
                # forward/backward): the bytes are in the buffer being written, so no read is needed. The state
                # becomes views of it again, as a plain optimizer's state stays the same tensors step after step
                self._reads[k] = AfterWrite(*pending)
            else:
                buf, after = self._buffer_for_read(c.nbytes)
                own = self._writing.get(k)  # its file is still being written (from a buffer another read took)
                after = [f for f in (after, own) if f is not None]
                read = self.io.read_into(self._path(k), buf[: c.nbytes], after=after)  # type: ignore[union-attr]
                self._reads[k] = PooledRead(read, buf)

    def _buffer_for_read(self, nbytes: int) -> tuple[torch.Tensor, Future | None]:
        """A buffer for a chunk's read, and the write-back the read must wait for first (None: none). A free or new
        pool buffer while fewer than ``buffer_count`` are in use; else the buffer of the oldest write-back in
        flight, refilled once that write is done: the read waits for it on the I/O's reader thread, so the training
        thread goes on stepping (ZeRO-Infinity's overlap of I/O with compute) and the tier never holds more than
        ``buffer_count`` buffers; else (no write-back's buffer fits) wait for writes, and past them a buffer outside
        the pool."""
        buf = self.pool.take(nbytes, self.io, size=self._buf_bytes)
        if buf is not None:
            return buf, None
        for j, (fut, b) in self._written.items():  # oldest first
            if b.numel() >= nbytes:
                del self._written[j]
                return b, fut
        return self.pool.take_or_wait(nbytes, self.io, self._wait_for_one_write, size=self._buf_bytes), None

    def _install(self, k: int) -> None:
        """Wait for chunk k's read and put its state back into ``optimizer.state`` (views of the read buffer)."""
        c = self.chunks[k]
        if c.tier != Tier.NVME or not c.spilled:
            return
        self._read(k)
        t0 = time.perf_counter()
        buf = self._reads.pop(k).result()
        self.io_wait_s += time.perf_counter() - t0
        states: dict[int, dict[str, Any]] = {i: dict(r) for i, r in c.resident.items()}
        for e in c.entries:
            t = buf[e.offset : e.offset + e.nbytes].view(e.dtype).view(e.shape)
            if e.spec is not None:
                # DTensor.from_local's own constructor, without its autograd Function (~70 us a call; this loop runs
                # for every state tensor every step: 106 per step for the 3.7M GPT with Adam, 2-3% of its step)
                t = DTensor(t, e.spec, requires_grad=False)
            states.setdefault(e.index, {})[e.key] = t
        for i, st in states.items():
            self.optimizer.state[self.params[i]] = {key: st[key] for key in c.order[i]}
        c.spilled, c.buf = False, buf

    def _bound_writes(self, limit: int) -> None:
        """Wait until at most ``limit`` writes are in flight."""
        t0 = time.perf_counter()
        while len(self._writes) > limit:
            self._writes.pop(0).result()  # re-raises a failed write
        self.io_wait_s += time.perf_counter() - t0
        self._reap()

    def _reap(self) -> None:
        """Forget finished writes (re-raising a failed one) and give their buffers back to the pool."""
        while self._writes and self._writes[0].done():
            self._writes.pop(0).result()
        self._prune()

    def _prune(self) -> None:
        """Forget finished writes and give their buffers back to the pool."""
        for k in [k for k, fut in self._writing.items() if fut.done()]:
            del self._writing[k]
        for k in [k for k, (fut, _) in self._written.items() if fut.done()]:
            self.pool.give_back(self._written.pop(k)[1], self.io)

    def _wait_for_one_write(self) -> bool:
        """Wait for the oldest write-back in flight (its buffer goes back to the pool); False when there is none."""
        if not self._writes:
            return False
        self._bound_writes(len(self._writes) - 1)
        return True

    # -------------------------------------------------------------- the step
    def _check_open(self) -> None:
        if self.closed and self.lost_state:
            raise RuntimeError(
                "this optimizer's offloaded state was released when the Trainer tore the strategy down (its nvme "
                "files are removed then); save checkpoints during fit"
            )

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """The optimizer's step, chunk by chunk through the tier (the closure, i.e. forward and backward, first)."""
        self._check_open()
        t_start = time.perf_counter()
        self.io_wait_s = 0.0
        pt = self.param_tier

        def read_first() -> None:  # read ahead while backward runs (without a parameter tier: forward too)
            for k in range(min(self.depth, len(self.chunks))):
                self._read(k)

        if pt is not None and closure is not None:
            pt.on_backward = read_first  # forward reads parameters: leave the drive to them
        else:
            read_first()
        self._prune()
        self.pool.shrink(self.io)  # no idle buffer through forward/backward, where the process's memory peaks
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if pt is not None and pt.on_backward is not None:  # backward all-gathered nothing (or did not run)
            pt.on_backward = None
            read_first()
        t_closure = time.perf_counter() - t_start
        with own_mappings() if self.files is not None and not self._stepped else _nothing():
            self._step_chunks()
        self._stepped = True
        if self._repacked:
            # once (first step, or a load replaced the state): give the heap the optimizer's own tensors lived on
            # back to the OS. Not every step: trimming returns the freed activations too, which the next forward
            # then faults back in (8,000 page faults a step for a 3.7M-parameter GPT here)
            trim_heap()
            self._repacked = False
        self.step_s = time.perf_counter() - t_start - t_closure
        return loss

    def _step_chunks(self) -> None:
        """The optimizer's own step over each chunk in turn, with the reads ahead and the write-backs."""
        opt = self.optimizer
        pt = self.param_tier
        precs = [pt.recs_of(self.params[i] for i in c.params) for c in self.chunks] if pt is not None else []
        keep: set[int] = set()
        if pt is not None:
            pt.step_first = [r for k in range(min(self.depth, len(self.chunks))) for r in precs[k]]
            first = {id(r) for r in pt.step_first}
            pt.release([r for r in pt.recs if id(r) not in first])  # reads ahead that forward/backward left unused
            pt.prefetch(pt.step_first)  # (read ahead at the end of backward, but for the first step)
            keep = {id(r) for r in pt.forward_first()}  # stay in memory for the next forward's first all-gathers
        groups = opt.param_groups
        group_of = [gi for gi, g in enumerate(groups) for _ in g["params"]]
        originals = [g["params"] for g in groups]
        try:
            for k, c in enumerate(self.chunks):
                self._install(k)
                if k + self.depth < len(self.chunks):
                    self._read(k + self.depth)
                if pt is not None:
                    pt.fetch(precs[k])
                    if k + self.depth < len(self.chunks):
                        pt.prefetch(precs[k + self.depth])
                members: dict[int, list[torch.Tensor]] = {}
                for i in c.params:
                    members.setdefault(group_of[i], []).append(self.params[i])
                for gi, ps in members.items():
                    groups[gi]["params"] = ps
                opt.param_groups = [groups[gi] for gi in sorted(members)]
                try:
                    self._inner_step()
                finally:
                    opt.param_groups = groups
                    for g, ps in zip(groups, originals):
                        g["params"] = ps
                if c.tier == Tier.NVME:
                    self._spill(k)
                if pt is not None:  # the stepped shards back to their tier, but the next forward's first ones
                    pt.release([r for r in precs[k] if id(r) not in keep], dirty=True)
                    pt.keep(r for r in precs[k] if id(r) in keep)
        finally:
            opt.param_groups = groups
            # the last chunks' writes stay in flight into the next forward/backward (at most buffer_count - 1:
            # _spill bounds them); a read of such a chunk takes the buffer being written (_read), and saves, close
            # and disk_bytes wait for them. The parameter tier's too (released as they complete)

    # -------------------------------------------------------------- checkpoints and lifetime
    @contextmanager
    def materialized(self) -> Generator[None, None, None]:
        """Every chunk's state in ``optimizer.state`` and the optimizer's own ``step`` in place, for a state-dict
        save or load; afterwards the state goes back to its tier (written again: a load may have replaced it)."""
        if self._materialized or self.closed:
            self._check_open()  # closed: nothing to bring back, unless the state was on the nvme files (then raise)
            yield
            return
        self._bound_writes(0)
        # a load creates the state anew as ordinary tensors, which the spill below packs and frees (see the module
        # docstring): their own mappings, not holes in the heap
        with own_mappings() if self.files is not None else _nothing():
            for k in range(len(self.chunks)):
                self._install(k)
            self._materialized = True
            self.optimizer.step = self._inner_step  # type: ignore[method-assign]
            try:
                with self.param_tier.resident() if self.param_tier is not None else _nothing():
                    yield  # (a state-dict read of an empty state runs a zero-lr step over the parameters)
            finally:
                self.optimizer.step = self.step  # type: ignore[method-assign]
                self._materialized = False
                for k, c in enumerate(self.chunks):
                    if c.tier == Tier.NVME:
                        self._spill(k)
                self._bound_writes(0)
        if self.files is not None:
            trim_heap()

    def disk_bytes(self) -> int:
        """Bytes of this optimizer's files on the nvme tier now (0 without one)."""
        self._bound_writes(0)
        return self.files.disk_bytes() if self.files is not None else 0

    def close(self) -> None:
        """Wait for pending I/O, remove the nvme files, and give the optimizer its own ``step`` back (idempotent)."""
        if self.closed:
            return
        self.closed = True
        #: True when state that only the nvme files held was dropped by close (a later save or step raises)
        self.lost_state = any(c.tier == Tier.NVME and c.spilled for c in self.chunks)
        try:
            self._bound_writes(0)
            for f in self._reads.values():
                try:
                    f.result()  # a read may still be filling a pooled buffer: never free it under the I/O
                except Exception as err:  # noqa: BLE001 - the state is dropped anyway
                    log.debug("offload close: a pending read failed (%s)", err)
            self._reads.clear()
            self._written.clear()
            self._writing.clear()
            for c in self.chunks:  # installed state keeps its buffer (the optimizer still holds it)
                c.buf = None
            self.pool.close(self.io)
        finally:
            if self.io is not None:
                self.io.close()
            if self.files is not None:
                self.files.close()
            if self.optimizer.__dict__.get("step") == self.step:
                if self._own_step is not None:
                    self.optimizer.step = self._own_step  # type: ignore[method-assign]
                else:
                    del self.optimizer.__dict__["step"]  # the class's step again
            for c in self.chunks:  # what only the nvme files held is gone now
                c.entries, c.resident, c.spilled, c.buf = [], {}, False, None


_LOGGED: set[str] = set()


@contextmanager
def _nothing() -> Generator[None, None, None]:
    yield


def _log_backend_once(backend: str, reason: str) -> None:
    if backend not in _LOGGED:
        _LOGGED.add(backend)
        log.info("offload nvme tier: I/O backend %r (%s)", backend, reason)
