"""Activation offload to the nvme tier: what autograd saves inside the repeated blocks goes to files in forward and
comes back, read one block ahead, in backward (torchtune's ``OffloadActivations``; Megatron's fine-grained
activation offloading; here through the nvme tier's I/O, :mod:`~lightning_v17.engine.offload.tier_io`).

* **What leaves.** Inside each block's forward, ``torch.autograd.graph.saved_tensors_hooks`` sees every tensor
  autograd saves; a plain, strided CPU tensor of at least ``min_bytes`` goes to a file under ``nvme_path`` through
  the tier's backend (DeepSpeed's ``async_io`` op or the thread pool, :func:`~.tier_io.open_io`). Parameters and any
  view of one (same storage: autograd hands pack a detached alias, so identity is by storage) and buffers never
  leave. A tensor saved several times in a block (the normed input of ``wq``/``wk``/``wv``) is written once.
* **One block at a time.** Writes are asynchronous; when block ``i``'s forward ends, the writes of the blocks
  before it are waited for and their sources released, so at most the current block and one block of writes in
  flight stay in memory. A write still in flight is checked against autograd's version counter when it completes:
  a tensor modified in place meanwhile raises, as autograd would.
* **Ahead in backward.** The first use of block ``i``'s saved tensors in backward (an unpack, or a selective
  recompute cache hit) issues the reads of block ``i - 1`` in the background; the last ``resident_blocks`` blocks
  are never written (backward needs them first). Each file is removed once read back, when its tensor is dropped
  unused (a graph never backpropagated), and with the folder on :meth:`ActivationOffload.close`.
* **Recompute.** ``full``: a checkpointed block saves only its inputs (``torch.utils.checkpoint``'s input saver),
  and those are what leaves; the recomputation's own saves are checkpoint's. ``selective``
  (:func:`~lightning_v17.engine.recompute.selective_policy`): the matmul/attention outputs recompute keeps live in
  its cache (not in autograd), so the block's checkpoint is rebuilt with a cache that offloads them; what recompute
  recomputes is never saved, so never written. torch 2.13's eager ``CheckpointPolicy.MUST_CPU_OFFLOAD`` recomputes
  instead of offloading; this is the eager path that does offload.
* **Buffers.** Reads come back into a pool of host buffers, each holding one block's bytes
  (:class:`~.activation_buffers.BlockPool`, two of them: the block being differentiated and the one read ahead),
  reused across blocks and steps; a buffer is refilled only once nothing views it (no entry, no read in flight, no
  tensor autograd still holds). Between backward and the next forward the idle buffers' pages leave the RSS.
* **Tiers.** ``"nvme"`` for CPU blocks. ``"cpu"`` for blocks on a CUDA device: saved tensors are copied into pinned
  host buffers from a pool (one block each, reused across steps) on a side stream in forward and prefetched back on
  it in backward (:class:`~.activation_buffers.CudaCopies`); never while a CUDA graph is being captured (the tensor
  stays on the device). On a machine without an accelerator ``"cpu"`` would move host memory to host memory and
  save nothing, so it is refused with that reason.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections import defaultdict, deque
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from lightning_v17.config import Recompute, Tier, V17ConfigError
from lightning_v17.config.errors import spell
from lightning_v17.engine import recompute as _recompute
from lightning_v17.engine.offload.activation_buffers import BlockPool, CudaCopies, aligned, pinned
from lightning_v17.engine.offload.activation_entries import _dense, _Entry, _Kept, _Segment, _View
from lightning_v17.engine.offload.nvme import NvmeFileSet, check_nvme_path, host_buffer
from lightning_v17.engine.offload.tier_io import TierIO, open_io

__all__ = ["DEFAULT_MIN_BYTES", "ActivationOffload", "check_activation_tier"]

log = logging.getLogger(__name__)

STAT_KEYS = ("tensors_offloaded", "bytes_offloaded", "bytes_kept", "tensors_shared", "reads_ahead", "reads_on_demand",
             "ready_at_use", "kept_capturing")  # fmt: skip
#: saved tensors smaller than this stay in memory (many small files cost more than they free)
DEFAULT_MIN_BYTES = 2**20


def check_activation_tier(tier: Tier | str, *, option: str = "OffloadPolicy(activations=...)") -> Tier:
    """The activation tier, or a refusal that names the option and the reason.

    Raises:
        V17ConfigError: ``"cpu"`` without a CUDA device (a host-to-host move saves nothing), or a tier that is
            neither ``"nvme"`` nor ``"cpu"``.
    """
    t = Tier.parse(tier, option)
    if t == Tier.CPU and not torch.cuda.is_available():
        raise V17ConfigError(
            f"{spell(option, 'cpu')} on a machine without an accelerator moves saved activations from host memory "
            f"to host memory: it saves nothing. Use {spell(option, 'nvme')} with nvme_path=<directory>, or turn it "
            "off"
        )
    if t not in (Tier.NVME, Tier.CPU):
        raise V17ConfigError(
            f"{spell(option, t.value)}: activation offload needs {spell(option, 'nvme')} (or 'cpu' on CUDA)"
        )
    return t


class _SacLeaf:
    """A selective-recompute cache entry (torch's ``_VersionWrapper`` API: ``get_val``) whose tensor is offloaded
    (``entry``) or kept (``kept``); either way its use starts the prefetch of the block ahead."""

    __slots__ = ("entry", "kept", "owner", "seg")

    def __init__(self, owner: ActivationOffload, seg: _Segment, entry: Any = None, kept: Any = None) -> None:
        self.owner, self.seg, self.entry, self.kept = owner, seg, entry, kept

    def get_val(self, allow_cache_entry_mutation: bool) -> Any:
        self.owner._use(self.seg)
        if self.entry is not None:
            return self.entry.result()
        return self.kept.get_val(allow_cache_entry_mutation)


class _SacSlots(dict):
    """One op's slots of the selective-recompute cache; a cached output is offloaded as it is stored."""

    def __init__(self, owner: ActivationOffload, seg: _Segment) -> None:
        super().__init__()
        self._owner, self._seg = owner, seg

    def __setitem__(self, idx: int, value: Any) -> None:
        if isinstance(value, (tuple, list)) or hasattr(value, "get_val"):
            value = tree_map(self._leaf, value)
        super().__setitem__(idx, value)

    def _leaf(self, leaf: Any) -> Any:
        if isinstance(leaf, _SacLeaf) or not hasattr(leaf, "get_val"):
            return leaf
        val = getattr(leaf, "val", None)
        if isinstance(val, torch.Tensor) and self._owner._offloadable(val, self._seg):
            return _SacLeaf(self._owner, self._seg, entry=self._owner._pack(self._seg, val))
        return _SacLeaf(self._owner, self._seg, kept=leaf)


class _SacStorage(defaultdict):
    def __init__(self, owner: ActivationOffload, seg: _Segment) -> None:
        super().__init__(functools.partial(_SacSlots, owner, seg))


def _selective_forward(owner: ActivationOffload, orig: Any, recompute_forward: Any, *args: Any, **kwargs: Any) -> Any:
    """recompute's selective checkpoint of a block (same policy, same options), with the offloading cache; the block
    called outside its ``__call__`` (no segment open) gets recompute's own."""
    if not torch.is_grad_enabled() or not owner._stack:
        return recompute_forward(*args, **kwargs)
    ctx = functools.partial(owner._sac_contexts, owner._stack[-1][1])
    return checkpoint(orig, *args, use_reentrant=False, preserve_rng_state=True, context_fn=ctx, **kwargs)


class ActivationOffload:
    """Offload what autograd saves inside ``blocks`` to the nvme tier, prefetched one block ahead in backward.

    Attached on construction (forward hooks on the blocks; selective-recompute blocks get the offloading cache);
    :meth:`close` (or leaving a ``with`` block) detaches it and removes its files. Nothing is needed around
    forward/backward: each block's forward pushes and pops the hooks itself.

    Args:
        blocks: the model's repeated blocks in forward order (the recompute / ZeRO-3 units), after recompute and ZeRO
            are applied.
        tier: ``"nvme"`` (CPU blocks: files under ``nvme_path``) or ``"cpu"`` (blocks on a CUDA device: pinned host
            memory; refused without one, :func:`check_activation_tier`).
        nvme_path: directory on a local drive (``"nvme"``); checked with :func:`~.nvme.check_nvme_path`.
        min_bytes: saved tensors smaller than this stay in memory.
        resident_blocks: the last this many blocks are never offloaded (backward needs them first).
        rank: this process's rank (names its folder).
        option: the user option's name, for error messages.
        device: the device the blocks compute on; None: the one their parameters are on. Pass it when the
            parameters live elsewhere between uses (ZeRO-3 ``offload_params="cpu"`` keeps the shards on the host,
            and gathers them onto the compute device for each block's forward and backward).
        passes_in_flight: how many forward passes may hold offloaded blocks at once: 1 without a pipeline; the
            micro-batches of a step under pp, whose schedule runs several micro-batches' forwards before their
            backwards (:meth:`micro_batch`). Sizes the ``"cpu"`` tier's pool of pinned buffers.

    Raises:
        V17ConfigError: a missing or unwritable ``nvme_path``, ``"cpu"`` without CUDA, a negative
            ``resident_blocks`` or ``min_bytes``, no blocks, or blocks on a device the tier does not serve
            (``"nvme"``: CPU blocks; ``"cpu"``: CUDA blocks).
    """

    def __init__(
        self, blocks: Sequence[nn.Module], *, tier: Tier | str = Tier.NVME, nvme_path: str | os.PathLike | None,
        min_bytes: int = DEFAULT_MIN_BYTES, resident_blocks: int = 1, rank: int = 0,
        option: str = "OffloadPolicy(activations=...)", device: torch.device | str | None = None,
        passes_in_flight: int = 1,
    ) -> None:  # fmt: skip
        self.tier = check_activation_tier(tier, option=option)
        path = check_nvme_path(nvme_path, option="nvme_path") if self.tier == Tier.NVME else None
        blocks = list(blocks)
        if not blocks:
            raise V17ConfigError(f"{option}: the model has no repeated blocks to offload; set wrap_classes")
        if resident_blocks < 0 or min_bytes < 0:
            raise V17ConfigError(
                f"{option}: ActivationOffload(resident_blocks={resident_blocks}, min_bytes={min_bytes}) must be >= 0 "
                "(OffloadPolicy's resident_blocks and activation_min_kb)"
            )
        if device is not None:
            devices = {torch.device(device)}
        else:
            devices = {p.device for b in blocks for p in b.parameters()} - {torch.device("meta")}
        want = "cpu" if self.tier == Tier.NVME else "cuda"
        if any(d.type != want for d in devices) or (want == "cuda" and len(devices) != 1):
            raise V17ConfigError(
                f"{spell(option, self.tier.value)} offloads activations of blocks on {want} (one device); these are "
                f"on {sorted(map(str, devices))}: use {spell(option, 'nvme')} for CPU blocks, 'cpu' for blocks on one "
                "CUDA device"
            )
        self.blocks, self.min_bytes, self.resident_blocks = blocks, int(min_bytes), int(resident_blocks)
        self.device_type = want
        self.files: NvmeFileSet | None = None
        self.io: TierIO | None = None
        self.copies: CudaCopies | None = None
        if self.tier == Tier.NVME:
            self.files = NvmeFileSet(path, rank=rank)
            self.io, why = open_io(self.files.folder)
            log.info("activation offload: %s I/O (%s)", self.io.name, why)
            #: read-back buffers: the block being differentiated and the one read ahead (prefetch depth 1, + 1)
            self.pool = BlockPool(2)
        else:
            self.copies = CudaCopies(next(iter(devices)))
            #: pinned buffers holding the offloaded blocks between forward and backward (+ 1: the next pass's first
            #: block may start before the last one's buffer is reclaimed)
            offloaded = max(len(blocks) - self.resident_blocks, 0) * max(int(passes_in_flight), 1)
            self.pool = BlockPool(offloaded + 1, alloc=pinned)
        #: bytes/tensors offloaded (each file once), saved bytes kept in memory, saves shared with a file already
        #: written, reads issued one block ahead / on demand, reads already finished when their tensor was needed
        self.stats: dict[str, int] = dict.fromkeys(STAT_KEYS, 0)
        self.closed = False
        self._stack: list[tuple[nn.Module, _Segment, Any]] = []  # the blocks whose forward is running
        self._pending: deque[_Entry] = deque()  # writes in flight, oldest first
        self._live: dict[tuple, _Entry] = {}  # sources held (writes in flight): a second save of one is shared
        self._pass_id = 0
        #: per micro-batch (None without a pipeline): the last block entered and its segment, so that each
        #: micro-batch's blocks form one pass whatever the schedule runs between them
        self._last: dict[Any, tuple[int, _Segment]] = {}
        self._micro_batch: Any = None
        self._names = 0
        self._end_queued = False
        self._handles: list[Any] = []
        self._forwards: list[tuple[nn.Module, Any]] = []
        try:
            self._attach()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------------------------------- attach / close
    def _attach(self) -> None:
        for i, block in enumerate(self.blocks):
            fwd = block.__dict__.get("forward")
            if isinstance(fwd, functools.partial) and fwd.func is _recompute._checkpointed_forward:
                orig, mode = fwd.args[0], Recompute.parse(fwd.args[1])
                if mode == Recompute.SELECTIVE:
                    self._forwards.append((block, fwd))
                    block.forward = functools.partial(_selective_forward, self, orig, fwd)
            self._handles.append(block.register_forward_pre_hook(functools.partial(self._enter, i)))
            self._handles.append(block.register_forward_hook(functools.partial(self._exit, i), always_call=True))

    def close(self) -> None:
        """Detach (hooks removed, recompute's forwards restored), wait for writes in flight, remove the files
        (idempotent)."""
        if self.closed:
            return
        self.closed = True
        for h in self._handles:
            h.remove()
        for block, fwd in self._forwards:
            block.forward = fwd
        self._handles, self._forwards = [], []
        while self._stack:
            self._stack.pop()[2].__exit__(None, None, None)
        try:
            if getattr(self, "io", None) is not None:
                self.io.close()
            if getattr(self, "copies", None) is not None:
                self.copies.synchronize()
        finally:
            self._pending.clear()
            self._live.clear()
            if getattr(self, "pool", None) is not None:
                self.pool.close()
            if getattr(self, "files", None) is not None:
                self.files.close()

    def flush(self) -> None:
        """Wait for every write in flight and release its source (e.g. before measuring memory)."""
        self._reap(older_than=_ALL)

    @contextlib.contextmanager
    def micro_batch(self, key: Any) -> Iterator[None]:
        """Run the blocks' forwards inside as micro-batch ``key``'s (the pipeline runtime wraps each stage's forward
        of a micro-batch in it). A pipeline schedule interleaves micro-batches (1F1B: forwards of later ones before
        the backward of the first; interleaved stages: one micro-batch's blocks of two local stages with other
        micro-batches' between), so the blocks' order alone does not tell whose pass a block continues: each
        micro-batch's blocks form their own pass (its segments linked in block order, and its backward reads the
        block ahead of that micro-batch's), and the last ``resident_blocks`` blocks of each pass stay in memory."""
        prev, self._micro_batch = self._micro_batch, key
        try:
            yield
        finally:
            self._micro_batch = prev

    def __enter__(self) -> ActivationOffload:  # noqa: PYI034
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------------- forward
    def _enter(self, index: int, module: nn.Module, args: Any) -> None:
        if not torch.is_grad_enabled() or self.closed:
            return
        key = self._micro_batch
        last = self._last.get(key)
        if last is None or index <= last[0]:  # a new forward of this micro-batch (another step, or accumulation)
            self._pass_id += 1
            last = None
            self.pool.idle()
        ptrs = {_storage_ptr(t) for t in _tensors(module)}
        resident = index >= len(self.blocks) - self.resident_blocks
        seg = _Segment(index, self._pass_id, resident, None if last is None else last[1], ptrs)
        self._last[key] = (index, seg)
        hooks = torch.autograd.graph.saved_tensors_hooks(functools.partial(self._pack_hook, seg), self._unpack)
        hooks.__enter__()
        self._stack.append((module, seg, hooks))

    def _exit(self, index: int, module: nn.Module, args: Any, output: Any) -> None:
        if not self._stack or self._stack[-1][0] is not module:
            return
        _, seg, hooks = self._stack.pop()
        hooks.__exit__(None, None, None)
        self.pool.size = max(self.pool.size, seg.nbytes)  # the "cpu" tier's next pass fits each block in one buffer
        seg.host = None  # its entries hold their slices; the buffer is back once they are read back or dropped
        self._reap(older_than=seg)  # one block at a time: the blocks before this one are written now

    def _offloadable(self, t: torch.Tensor, seg: _Segment) -> bool:
        if seg.resident or type(t) is not torch.Tensor or t.device.type != self.device_type or t.layout != torch.strided:
            return False
        if t.is_quantized or t.numel() * t.element_size() < self.min_bytes:
            return False
        if any(st == 0 and s > 1 for s, st in zip(t.shape, t.stride())):
            return False  # an expanded view: its storage is far smaller than it looks
        return _storage_ptr(t) not in seg.param_ptrs  # a parameter, a view of one, or a buffer: never

    def _pack_hook(self, seg: _Segment, t: torch.Tensor) -> Any:
        # An output a node saves arrives with that node as its grad_fn: held as is, it would make a cycle through
        # autograd's C++ graph that Python's collector cannot see (a graph never backpropagated would leak). The
        # detached alias shares its storage and version counter; autograd re-attaches the history on unpack.
        t = t.detach()
        if self._offloadable(t, seg):
            if self.copies is not None and torch.cuda.is_current_stream_capturing():
                # No side-stream copy inside a CUDA graph capture: the graph records the copy, the event waits and
                # the device addresses of this one pass; a replay then reads and writes memory the caching allocator
                # has handed to other tensors since, and gradients come out silently wrong (the hazard torchtitan
                # and Megatron-LM hit combining offload with CUDA graphs, NVIDIA/Megatron-LM#7474). It stays on the
                # device, counted in ``kept_capturing``.
                self.stats["kept_capturing"] += 1
                self.stats["bytes_kept"] += t.numel() * t.element_size()
                return _Kept(seg, t)
            return self._pack(seg, t)
        self.stats["bytes_kept"] += t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0
        return _Kept(seg, t)

    def _pack(self, seg: _Segment, t: torch.Tensor) -> _Entry:
        self._reap()
        nbytes, dense = t.numel() * t.element_size(), _dense(t)
        if dense:  # the same bytes under any view
            key = (_storage_ptr(t), t.storage_offset(), nbytes, t.dtype)
        else:
            key = (_storage_ptr(t), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        e = self._live.get(key)
        if e is not None:  # the same bytes saved again while their source is held: one file
            self.stats["tensors_shared"] += 1
            if e.size == tuple(t.shape) and e.stride == t.stride():
                return e
            return _View(e, tuple(t.shape), t.stride())
        self._names += 1
        seg.count += 1
        seg.nbytes += aligned(nbytes)
        name = f"p{seg.pass_id}-b{seg.index}-{seg.count}-{self._names}.act"
        e = _Entry(self, seg, key, t, self.files.path(name) if self.files is not None else None)
        src = t.as_strided((t.numel(),), (1,), t.storage_offset()) if e.dense else t.contiguous()
        if self.copies is None:
            e.write = self.io.write(e.path, src)
        else:  # ``t`` (as ``e.src``) and ``src`` (by the copy) are held until the copy's event completes (_reap)
            e.host = self._host_slice(seg, nbytes)
            e.write = self.copies.to_host(src.view(-1).view(torch.uint8), e.host)
        seg.entries.append(_weak(e))
        self._live[key] = e
        self._pending.append(e)
        self.stats["tensors_offloaded"] += 1
        self.stats["bytes_offloaded"] += e.nbytes
        return e

    def _host_slice(self, seg: _Segment, nbytes: int) -> torch.Tensor:
        """The "cpu" tier: ``nbytes`` of pinned memory in the segment's pooled buffer (sized by the largest block
        of the passes before), or a buffer of its own when it does not fit (the first pass)."""
        if seg.host is None and self.pool.size:
            seg.host, seg.cursor = self.pool.take(self.pool.size), 0
        if seg.host is not None and seg.cursor + nbytes <= seg.host.numel():
            out = seg.host[seg.cursor : seg.cursor + nbytes]
            seg.cursor += aligned(nbytes)
            return out
        self.pool.misses += 1
        return pinned(nbytes)

    def _reap(self, older_than: _Segment | None = None) -> None:
        """Release the sources of finished writes of the blocks whose forward is over (waiting for those of the
        segments before ``older_than``). The running block's stay held, so a second save of one is shared."""
        running = self._stack[-1][1] if self._stack else None
        while self._pending:
            e = self._pending[0]
            wait = older_than is not None and e.seg is not older_than
            if not wait and (e.seg is running or not e.write.done()):
                return
            self._pending.popleft()
            try:
                e.write.result()
            except Exception as err:
                raise OSError(f"activation offload: writing {e.path} failed ({err}); check nvme_path's drive") from err
            finally:
                self._live.pop(e.key, None)
            if e.src._version != e.version:
                raise RuntimeError(
                    "activation offload: a tensor saved for backward was modified by an inplace operation while "
                    "it was being written (autograd's version counter changed); make the operation out of place"
                )
            e.src = None

    def _sac_contexts(self, seg: _Segment) -> tuple[Any, Any]:
        caching, cached = create_selective_checkpoint_contexts(_recompute.selective_policy)
        caching.storage = cached.storage = _SacStorage(self, seg)
        return caching, cached

    # ------------------------------------------------------------------------------------------------ backward
    def _unpack(self, packed: Any) -> torch.Tensor:
        self._use(packed.seg)
        return packed.tensor if isinstance(packed, _Kept) else packed.result()  # an _Entry or a _View

    def _use(self, seg: _Segment) -> None:
        """Block ``seg``'s backward has begun: its reads (if none ahead) and the block ahead's, in the background."""
        if seg.used:
            return
        seg.used = True
        if not self._end_queued and torch._C._current_graph_task_id() != -1:
            # at the end of this backward the read-back buffers are idle: their pages leave now, not after the
            # optimizer step and the next forward's first block (FSDP's end-of-backward callback)
            self._end_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
        if not self.closed:
            self._reap()
            self._prefetch(seg, ahead=False)
            if seg.prev is not None:
                self._prefetch(seg.prev, ahead=True)

    def _backward_done(self) -> None:
        self._end_queued = False
        self.pool.idle()

    def _prefetch(self, seg: _Segment, *, ahead: bool) -> None:
        if seg.reads_issued:
            return
        seg.reads_issued = True
        todo = [e for e in (ref() for ref in seg.entries) if e is not None and e.read is None and e.value is None]
        if not todo:
            return
        buf, at = None, 0
        if self.copies is None:  # one pooled buffer for the block's reads, each at an aligned offset
            buf = self.pool.take(sum(aligned(e.nbytes) for e in todo))
        for e in todo:
            self._read(e, ahead=ahead, into=None if buf is None else buf[at : at + e.nbytes])
            at += aligned(e.nbytes)

    def _read(self, e: _Entry, *, ahead: bool, into: torch.Tensor | None = None) -> None:
        if self.copies is not None:  # same side stream as the copy out: ordered after it
            e.read = self.copies.to_device(e.host)
            e.host = None  # a refill of its buffer is queued on that stream after this copy
        else:
            after = (e.write,) if not e.write.done() else ()
            e.read = self.io.read_into(e.path, host_buffer(e.nbytes) if into is None else into, after=after)
        self.stats["reads_ahead" if ahead else "reads_on_demand"] += 1


_ALL = _Segment(-1, -1, True, None, set())  # older_than=_ALL: every write in flight


def _weak(e: _Entry) -> Any:
    import weakref

    return weakref.ref(e)


def _tensors(module: nn.Module) -> Iterable[torch.Tensor]:
    for t in (*module.parameters(), *module.buffers()):
        yield getattr(t, "_local_tensor", t)  # a DTensor's shard


def _storage_ptr(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor without storage (a subclass): never offloaded anyway
        return -1
