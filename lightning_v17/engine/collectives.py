"""Reduce-scatter and all-gather that are fast on gloo: both as one ``all_to_all_single``.

Gloo's ``reduce_scatter_tensor`` is slower than its ``all_reduce`` of the same tensor, and its
``all_gather_into_tensor`` no faster than an ``all_to_all_single`` that moves the same bytes. Measured on this
project's CI machine (``bench/collectives.py``: 2 ranks, 1 thread each, fp32, median of 20 calls), for an input of
3M elements: ``all_reduce`` 9.3 ms, ``reduce_scatter_tensor`` 12.0 ms, this all-to-all reduce-scatter 6.3 ms (1.9x);
at 0.2M / 0.8M elements 1.5x / 1.4x. The all-gather gains 1.26x / 1.16x / 1.02x at the same sizes. ZeRO-2/3
reduce-scatter every gradient each step (ZeRO-3 also all-gathers every parameter twice), and on CPU FSDP2 runs these
collectives synchronously, so they sit on the critical path.

* reduce-scatter: rank ``r`` receives chunk ``r`` of every rank's input (``all_to_all_single``) and sums the ``W``
  received chunks locally, in rank order, so every rank reduces in the same order.
* all-gather: every rank sends its shard to every rank (``all_to_all_single`` of the shard repeated ``W`` times).

Memory: each call holds one transient buffer the size of the unsharded input (the receive buffer of the
reduce-scatter, the repeated send buffer of the all-gather), freed when the call returns.

NCCL (and every other backend) keeps its native collectives: :func:`use_all_to_all` is true only for gloo. On
GPUs the native ring/tree collectives are bandwidth-optimal; these are not. Setting the environment variable
``LIGHTNING_V17_NATIVE_COLLECTIVES=1`` keeps the native collectives on gloo too (for A/B measurements and debugging).

:class:`FSDPAllToAllReduceScatter` and :class:`FSDPAllToAllAllGather` plug the same algorithms into FSDP2 through
its public ``set_custom_reduce_scatter`` / ``set_custom_all_gather`` hooks (ZeRO-3), and :func:`reduce_scatter`
serves the ZeRO-2 engine.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch
import torch.distributed as dist

from lightning_v17.engine.state import state_of

__all__ = [
    "DeferredReduceScatters",
    "FSDPAllToAllAllGather",
    "FSDPAllToAllReduceScatter",
    "PendingReduceScatter",
    "all_gather",
    "install_fsdp_comms",
    "is_cpu_gloo",
    "map_all_gathers",
    "map_gradient_buffers",
    "reduce_scatter",
    "use_all_to_all",
]


def use_all_to_all(group: Any) -> bool:
    """True when ``group`` is a gloo group of more than one rank (where the all-to-all forms are faster)."""
    if group is None or not dist.is_initialized() or os.environ.get("LIGHTNING_V17_NATIVE_COLLECTIVES") == "1":
        return False
    try:
        return dist.get_backend(group) == "gloo" and dist.get_world_size(group) > 1
    except (RuntimeError, ValueError):
        return False


def _is(op: Any, kind: Any) -> bool:
    try:
        return bool(op == kind)
    except (TypeError, RuntimeError):
        return False


class PendingReduceScatter:
    """An asynchronous all-to-all reduce-scatter: :meth:`wait` finishes the transfer, then sums into ``out``."""

    def __init__(self, work: Any, recv: torch.Tensor, out: torch.Tensor, world: int, average: bool) -> None:
        self._work, self._recv, self._out, self._world, self._average = work, recv, out, world, average

    def is_completed(self) -> bool:
        """Whether the transfer has finished (then :meth:`wait` only sums locally); True once waited."""
        return self._work is None or bool(self._work.is_completed())

    def wait(self) -> bool:
        if self._work is not None:
            self._work.wait()
            torch.sum(self._recv.view(self._world, -1), dim=0, out=self._out)
            if self._average:
                self._out.div_(self._world)
            self._work = self._recv = None
        return True


class DeferredReduceScatters:
    """ZeRO-3 gradient reduce-scatters left in flight on gloo's worker threads while backward computes, finished at
    the end of the backward pass (an autograd final callback, queued after FSDP2's own root callback).

    On CUDA, FSDP2 overlaps its reduce-scatters with compute on a separate stream. On CPU its "streams" are no-ops,
    so the reduce-scatter of every unit runs synchronously inside that unit's post-backward hook and backward waits
    for it. Here the all-to-all is started there and only its local sum (``PendingReduceScatter.wait``) is left for
    later; the sharded gradients FSDP2 installs are views of the output, which nothing reads before backward ends
    (:class:`FSDPAllToAllReduceScatter` keeps the synchronous path whenever something would: an existing gradient to
    accumulate into, a post-accumulate-grad hook, a dtype cast, an HSDP all-reduce). Clipping, gradient-norm
    callbacks, loss-scaler inf checks and the optimizer all run after backward, so they see finished gradients.

    The arithmetic is the same as the synchronous path (the same sum in rank order, the same division), so the
    results are bitwise identical. Memory: each reduce-scatter in flight holds its receive buffer (one unit's
    unsharded gradients); at most ``max_pending`` are kept, the oldest is finished when one more starts, and those
    already transferred are finished whenever another one starts.
    """

    def __init__(self, max_pending: int = 2) -> None:
        self.max_pending = max_pending
        self.pending: list[PendingReduceScatter] = []
        self._queued_for: int | None = None  # the autograd graph task a drain callback is queued in

    def add(self, pending: PendingReduceScatter) -> None:
        """Keep ``pending`` in flight; first finish the earlier ones that are done, or the oldest beyond the cap."""
        done = [p for p in self.pending if p.is_completed()]
        for p in done:
            p.wait()
        self.pending = [p for p in self.pending if p not in done]
        self.pending.append(pending)
        while len(self.pending) > self.max_pending:
            self.pending.pop(0).wait()
        task = torch._C._current_graph_task_id()
        if not self.pending or self._queued_for == task:
            return
        if task < 0:  # not inside a backward pass: no callback would run, finish now
            self.drain()
            return
        torch.autograd.Variable._execution_engine.queue_callback(self.drain)
        self._queued_for = task

    def drain(self) -> None:
        """Finish every reduce-scatter in flight (in issue order)."""
        self._queued_for = None
        while self.pending:
            self.pending.pop(0).wait()


def reduce_scatter(
    out: torch.Tensor, inp: torch.Tensor, *, group: Any, average: bool = False, async_op: bool = False
) -> Any:
    """``out = sum_r inp_r[rank]`` (or the mean with ``average``), with ``inp`` laid out as ``[world, out.numel()]``.

    On gloo: one ``all_to_all_single`` plus a local sum (see the module docstring); elsewhere
    ``reduce_scatter_tensor``. Returns a waitable handle with ``async_op`` (call ``wait()`` before reading ``out``).
    """
    world = dist.get_world_size(group)
    if not use_all_to_all(group):
        op = dist.ReduceOp.AVG if average else dist.ReduceOp.SUM
        return dist.reduce_scatter_tensor(out, inp, op=op, group=group, async_op=async_op)
    if inp.numel() != world * out.numel():
        raise ValueError(f"reduce_scatter: input has {inp.numel()} elements, expected {world} x {out.numel()}")
    recv = torch.empty_like(inp)
    work = dist.all_to_all_single(recv, inp.contiguous(), group=group, async_op=True)
    pending = PendingReduceScatter(work, recv, out, world, average)
    if async_op:
        return pending
    pending.wait()
    return None


def all_gather(out: torch.Tensor, inp: torch.Tensor, *, group: Any, async_op: bool = False) -> Any:
    """``out = cat(inp_0, ..., inp_{W-1})``: on gloo one ``all_to_all_single`` of ``inp`` repeated W times.

    1-byte float dtypes (float8, which FSDP2 gathers under torchao's float8 all-gather) travel as ``uint8`` views:
    gloo has no float8 types ("Invalid scalar type") and a gather only moves bytes.
    """
    if out.dtype.itemsize == 1 and out.dtype.is_floating_point:
        out, inp = out.view(torch.uint8), inp.view(torch.uint8)
    world = dist.get_world_size(group)
    if not use_all_to_all(group):
        return dist.all_gather_into_tensor(out, inp, group=group, async_op=async_op)
    send = inp.reshape(1, -1).expand(world, -1).contiguous().view(-1)
    return dist.all_to_all_single(out.view(-1), send, group=group, async_op=async_op)


class _Alloc:
    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)


def _fsdp_api() -> tuple[type, type]:
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    return AllGather, ReduceScatter


try:  # FSDP2's comm interfaces (torch >= 2.8)
    _AllGatherBase, _ReduceScatterBase = _fsdp_api()
except ImportError:  # pragma: no cover - older torch: install_fsdp_comms is a no-op
    _AllGatherBase = _ReduceScatterBase = object  # type: ignore[assignment,misc]


class FSDPAllToAllReduceScatter(_Alloc, _ReduceScatterBase):  # type: ignore[misc,valid-type]
    """FSDP2 ``ReduceScatter`` for gloo groups: all-to-all + local sum. Ops other than SUM/AVG (FSDP2 uses
    PREMUL_SUM for a custom gradient divide factor) fall back to the native collective.

    With ``deferred`` (one per FSDP module, ``fsdp_state`` its FSDP2 state), an AVG reduce-scatter (what FSDP2 uses
    for fp32/bf16 gradients) is left in flight and finished at the end of backward (:class:`DeferredReduceScatters`)
    whenever FSDP2 would only *view* the output until then: no sharded gradient of the unit exists yet (otherwise
    FSDP2 adds into it at once), no post-accumulate-grad hook would read it, and no dtype cast follows.
    """

    #: outputs of at least this many bytes on the host are their own anonymous mappings (:func:`map_gradient_buffers`)
    mapped_from: int | None = None

    def __init__(self, deferred: DeferredReduceScatters | None = None, fsdp_state: Any = None, world: int = 1) -> None:
        self.deferred, self.fsdp_state, self.world = deferred, fsdp_state, world
        self._input_numel = -1  # the last allocation's, until the output that follows it
        self.mapped = 0  # outputs allocated as their own mappings, ever

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """FSDP2's ``foreach_reduce`` allocates the input (``world`` x the output), then the output, which its
        parameters' sharded gradients view until ``zero_grad``; with :attr:`mapped_from` only the output is mapped
        (the input is freed when the call returns: the heap recycles it)."""
        numel = math.prod(size) if not isinstance(size, int) else size
        is_output = numel * self.world == self._input_numel
        self._input_numel = -1 if is_output else numel
        if is_output and self.mapped_from is not None and torch.device(device).type == "cpu":
            from lightning_v17.engine.offload.host_memory import mapped_empty

            out = mapped_empty(size, dtype=dtype, min_bytes=self.mapped_from)
            self.mapped += out.untyped_storage().nbytes() >= self.mapped_from
            return out
        return torch.empty(size, dtype=dtype, device=device)

    def _can_defer(self, output: torch.Tensor) -> bool:
        if self.deferred is None or self.fsdp_state is None:
            return False
        try:
            for pg in self.fsdp_state._fsdp_param_groups:
                for fp in pg.fsdp_params:
                    p = fp.sharded_param
                    if p.grad is not None or getattr(p, "_post_accumulate_grad_hooks", None) or p.dtype != output.dtype:
                        return False
        except AttributeError:  # FSDP2 internals moved: keep the synchronous path
            return False
        return True

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any, async_op: bool = False
    ) -> Any:
        average = _is(op, dist.ReduceOp.AVG)
        if not (average or _is(op, dist.ReduceOp.SUM)):
            return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        if not async_op and average and self._can_defer(output_tensor):
            self.deferred.add(reduce_scatter(output_tensor, input_tensor, group=group, average=True, async_op=True))
            return None
        return reduce_scatter(output_tensor, input_tensor, group=group, average=average, async_op=async_op)


class FSDPAllToAllAllGather(_Alloc, _AllGatherBase):  # type: ignore[misc,valid-type]
    """FSDP2 ``AllGather`` for gloo groups: the shard sent to every rank with one ``all_to_all_single``."""

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, async_op: bool = False
    ) -> Any:
        return all_gather(output_tensor, input_tensor, group=group, async_op=async_op)


def install_fsdp_comms(modules: list[Any], group: Any, *, defer_reduce_scatter: bool = False) -> bool:
    """Give every FSDP2 module in ``modules`` the all-to-all collectives when ``group`` (the dp_shard group) is gloo.

    Args:
        modules: FSDP2 modules (``fully_shard`` applied).
        group: their dp_shard process group.
        defer_reduce_scatter: leave gradient reduce-scatters in flight until the end of backward
            (:class:`DeferredReduceScatters`); only for a 1-D shard mesh (HSDP all-reduces the output at once).

    Returns whether they were installed (False on NCCL and other backends, or a torch without the hooks).
    """
    if _AllGatherBase is object or not use_all_to_all(group):
        return False
    ag = FSDPAllToAllAllGather()
    deferred = DeferredReduceScatters() if defer_reduce_scatter else None
    per_state: dict[int, Any] = {}
    for m in modules:
        state = m._get_fsdp_state() if hasattr(m, "_get_fsdp_state") else None
        # The modules of one grouped unit (``fully_shard([a, b])``: children sharing a parameter) share one state,
        # hence one reduce-scatter; a root without parameters of its own has no group, and nothing to install.
        if state is not None and getattr(state, "_fsdp_param_groups", None) == []:
            continue
        key = id(state) if state is not None else id(m)
        if key not in per_state:
            world = dist.get_world_size(group)
            per_state[key] = FSDPAllToAllReduceScatter(deferred, state if deferred is not None else None, world=world)
        state_of(m).reduce_scatter = rs = per_state[key]
        m.set_custom_reduce_scatter(rs)
        m.set_custom_all_gather(ag)
    return True


def map_gradient_buffers(module: torch.nn.Module, min_bytes: int | None = 2**20) -> int:
    """Allocate the reduce-scatter outputs of the FSDP2 units under ``module`` (installed by
    :func:`install_fsdp_comms`) of ``min_bytes`` or more as their own anonymous mappings, outside glibc's heap
    (``None``: back to ``torch.empty``). The output *is* the unit's sharded gradient (FSDP2 views it) and lives
    from the unit's backward to ``zero_grad``, while forward and backward allocate and free around it: on the heap it
    pins the heap's top and fragments it (the nvme optimizer tier, ``engine/offload/optimizer.py``, wants the heap to shrink
    back). A mapping costs its page faults each step (the gradient bytes / 4 KiB). Returns the number of units."""
    n = 0
    for m in module.modules():
        rs = state_of(m).reduce_scatter
        if rs is not None:
            rs.mapped_from = min_bytes
            n += 1
    return n


def map_all_gathers(module: torch.nn.Module, enable: bool = True) -> int:
    """Run the all-gather of every FSDP2 unit under ``module`` and its copy-out (``FSDPParamGroup.unshard`` /
    ``wait_for_unshard``: the unsharded parameters' storages, allocated there and freed at reshard) inside
    :func:`~lightning_v17.engine.offload.host_memory.own_mappings` (``enable=False``: undo). On glibc's heap each unit's
    unsharded parameters, allocated before its activations and freed after them, left a hole the next unit's did not
    fit: 103M-param GPT, the heap grew by 32 MB per unit in the first forward and kept it (``bench/offload.py`` with a
    ``mallinfo2`` probe per unit). Inside, peak RSS per rank (medians of 3 rounds) fell from 1,327 / 1,301 to 1,152 /
    1,143 MB with the optimizer on nvme, and to 979 / 981 MB with the parameters there too (1,337 / 1,312 before: the
    freed shards had bought nothing). Costs each unsharded parameter of 1 MiB or more its page faults per all-gather
    (3.7M GPT: no more faults per step than before within the rounds' spread, 6,400-7,500). Undo before
    anything else that replaced these methods removes its own (the parameter tier's ``close``). Returns the number of
    units."""
    from lightning_v17.engine.offload.host_memory import own_mappings

    n = 0
    for m in module.modules():
        get_state = getattr(m, "_get_fsdp_state", None)
        g = getattr(get_state(), "_fsdp_param_group", None) if get_state is not None else None
        if g is None:
            continue
        saved = g.__dict__.pop("_v17_mapped_all_gather", None)
        if saved is not None:  # undo: the methods as they were (the class's, or another wrapper's)
            for name, fn in saved.items():
                if fn is None:
                    g.__dict__.pop(name, None)
                else:
                    setattr(g, name, fn)
        if enable:
            g._v17_mapped_all_gather = {name: g.__dict__.get(name) for name in ("unshard", "wait_for_unshard")}
            orig_unshard, orig_wait = g.unshard, g.wait_for_unshard

            def unshard(async_op: bool = False, *, _orig: Any = orig_unshard) -> Any:
                with own_mappings():
                    return _orig(async_op)

            def wait_for_unshard(*, _orig: Any = orig_wait) -> Any:
                with own_mappings():
                    return _orig()

            g.unshard, g.wait_for_unshard = unshard, wait_for_unshard
        n += 1
    return n


def is_cpu_gloo(group: Any) -> bool:
    """True when ``group`` is a gloo group of more than one rank (its async work runs on gloo's worker threads)."""
    if group is None or not dist.is_initialized():
        return False
    try:
        return dist.get_backend(group) == "gloo" and dist.get_world_size(group) > 1
    except (RuntimeError, ValueError):
        return False
