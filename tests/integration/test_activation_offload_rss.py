"""Activation offload frees what it promises: peak RSS of a training step drops by the offloaded blocks' activations.

The reference Llama (8 blocks, hidden 256, 4 heads of 64, SwiGLU width 768, fp32, no recompute) on one row of 512
tokens, in a fresh interpreter started with ``MALLOC_MMAP_THRESHOLD_=65536`` (freed tensors leave the process, so the
RSS measures what is held, not the heap's fragmentation). Peak RSS is ``VmHWM`` of ``/proc/self/status`` after
``/proc/self/clear_refs`` "5" reset it before the measured step (one warm-up step each, without and then with
offload); the figure is the peak's rise above the RSS at the step's start.

**Expected, by hand.** With T = 512 tokens and h = 256 (= heads x head_dim), f = 768, 4 bytes each, a block saves,
counting only tensors of at least ``min_bytes`` = 256 KiB (each one once):

* the two RMSNorms: their input and the normalized input before the weight (2 x 2 T h), their output (2 x T h;
  ``wq``/``wk``/``wv`` save one, ``w1``/``w3`` the other);
* attention: q, k, v and the output the fused CPU attention kernel saves (4 T h; ``wo``'s input is a view of that
  output, the same bytes);
* SwiGLU: ``w1 x``, ``silu(w1 x)``, ``w3 x`` and their product (4 T f).

That is 10 T h + 4 T f = 5 MiB + 6 MiB = 11 MiB per block, 88 MiB for the 8 blocks. With ``resident_blocks=1``
the last block stays; at any time at most two more blocks are in memory (in forward the block being computed and
the one whose writes are in flight; in backward the block being differentiated and the one read ahead), so the peak
must drop by at least (8 - 1 - 2) x 11 MiB = 55 MiB, and the test asserts ``MIN_FRACTION`` of that. The offload
object's own byte count must equal the hand count for the 7 offloaded blocks, and that count must be at least
``MIN_LEAVE`` of what each block saves, counted in the warm-up step by pack hooks of the test's own (the rest: the
rotary tables, norms' reciprocals, attention's log-sum-exp, all under ``min_bytes``).

**Resident at the peak.** The same warm-up steps, without and with offload, run under a counter of live saved tensors
of its own (:class:`_LiveSaved`: ``saved_tensors_hooks`` pushed innermost in each block, delegating to the offload's
hooks when it is on): the bytes of what autograd saved that are still in memory (a storage still alive) plus what the
offload's unpack handed back and is still alive, sampled at every pack and unpack. Its peak with offload must be at
most ``MAX_RESIDENT`` of its peak without (by hand: about 2 of 8 blocks, 25%, plus what stays under ``min_bytes``).

The same check at seq 2048 and ZeRO-3 on 2 ranks, with peak RSS against the offloaded bytes, is
``python bench/offload.py --activations`` (too long for the test suite on 2 shared cores).
"""

from __future__ import annotations

import gc
from typing import Any

import pytest

from tests._dist import spawn

pytestmark = pytest.mark.timeout(240)

T, HIDDEN, FFN, BLOCKS, RESIDENT = 512, 256, 768, 8, 1
MIN_BYTES = 256 * 1024
PER_BLOCK = (10 * T * HIDDEN + 4 * T * FFN) * 4  # bytes; see the module docstring
EXPECTED_DROP = (BLOCKS - RESIDENT - 2) * PER_BLOCK
MIN_FRACTION = 0.8
MIN_LEAVE = 0.9  # of each offloaded block's saved bytes (counted by an independent hook)
MAX_RESIDENT = 0.4  # peak live saved bytes with offload / without


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _worker(rank: int, world: int, nvme_path: str) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from lightning_v17.engine.offload.activations import ActivationOffload
    from lightning_v17.models import Llama, ModelConfig

    cfg = ModelConfig(vocab_size=256, hidden=HIDDEN, layers=BLOCKS, heads=4, kv_heads=4, ffn=FFN, max_seq_len=T)
    model = Llama(cfg, init_seed=0)
    ids = torch.randint(0, 256, (1, T), generator=torch.Generator().manual_seed(0))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # allocated once: the steps then differ only in their activations

    def step() -> float:
        loss = F.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
        loss.backward()
        return float(loss)

    def measured() -> tuple[int, float]:
        gc.collect()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := the current RSS
        start = _status_kb("VmRSS")
        loss = step()
        return (_status_kb("VmHWM") - start) * 1024, loss

    saved = _count_saved(model, step)  # the warm-up step, counted by an independent hook
    with _LiveSaved(model) as live_base:
        step()
    base, base_loss = measured()
    with ActivationOffload(model.recompute_units(), nvme_path=nvme_path, min_bytes=MIN_BYTES,
                           resident_blocks=RESIDENT) as off:  # fmt: skip
        with _LiveSaved(model, off) as live_off:  # the offload's warm-up step
            step()
        offloaded_per_step = off.stats["bytes_offloaded"]
        rise, off_loss = measured()
        offloaded_per_step = off.stats["bytes_offloaded"] - offloaded_per_step
    return {"base": base, "off": rise, "losses": (base_loss, off_loss), "offloaded": offloaded_per_step, "saved": saved,
            "live_peak": (live_base.peak, live_off.peak)}


def _count_saved(model, step) -> list[int]:
    """Bytes each block saves for backward, parameters excluded, each storage region once: pack hooks pushed
    around every block's forward, independent of the offload object."""
    import torch

    saved, handles = [], []
    for i, block in enumerate(model.recompute_units()):
        seen: set = set()
        saved.append(0)

        def pack(t, i=i, seen=seen):
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel() * t.element_size())
            if key not in seen and key[0] not in _param_ptrs(model):
                seen.add(key)
                saved[i] += key[2]
            return t

        ctx = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        handles.append(block.register_forward_pre_hook(lambda m, a, ctx=ctx: ctx.__enter__()))
        handles.append(block.register_forward_hook(lambda m, a, o, ctx=ctx: ctx.__exit__(None, None, None)))
    step()
    for h in handles:
        h.remove()
    return saved


class _LiveSaved:
    """Peak bytes of live saved tensors of the blocks: ``saved_tensors_hooks`` pushed in each block after (so inside)
    the offload's, delegating to them when ``off`` is given. Live: a saved tensor whose storage is still alive, or a
    tensor the offload's unpack returned that is still referenced; each region once."""

    def __init__(self, model, off=None) -> None:
        self.model, self.off, self.peak, self._ctx = model, off, 0, []
        self._saved: dict = {}  # (storage ptr, offset, bytes) -> StorageWeakRef
        self._unpacked: dict = {}  # (data ptr, bytes) -> weakref to the tensor unpack returned
        self._params = _param_ptrs(model)
        self._handles = []
        for block in model.recompute_units():
            self._handles.append(block.register_forward_pre_hook(self._enter))
            self._handles.append(block.register_forward_hook(self._exit, prepend=True, always_call=True))

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()

    def _enter(self, mod, args) -> None:
        import torch

        stack = self.off._stack if self.off is not None else []
        inner = stack[-1][2] if stack and stack[-1][0] is mod else None
        pack, unpack = (inner.pack_hook, inner.unpack_hook) if inner is not None else (None, None)
        ctx = torch.autograd.graph.saved_tensors_hooks(
            lambda t: self._pack(t, pack), lambda p: self._unpack(p, unpack)
        )  # fmt: skip
        ctx.__enter__()
        self._ctx.append(ctx)

    def _exit(self, mod, args, out) -> None:
        self._ctx.pop().__exit__(None, None, None)

    def _pack(self, t, pack):
        from torch.multiprocessing.reductions import StorageWeakRef

        ptr = t.untyped_storage().data_ptr()
        if ptr not in self._params:
            key = (ptr, t.storage_offset(), t.numel() * t.element_size())
            ref = self._saved.get(key)
            if ref is None or ref.expired():  # a region freed since may hold a new tensor at the same address
                self._saved[key] = StorageWeakRef(t.untyped_storage())
        self._sample()
        return t if pack is None else pack(t)

    def _unpack(self, packed, unpack):
        import weakref

        v = packed if unpack is None else unpack(packed)
        if v.untyped_storage().data_ptr() not in self._params:
            key = (v.data_ptr(), v.numel() * v.element_size())
            ref = self._unpacked.get(key)
            if ref is None or ref() is None:
                self._unpacked[key] = weakref.ref(v)
        self._sample()
        return v

    def _sample(self) -> None:
        saved = {k for k, r in self._saved.items() if not r.expired()}
        live = sum(k[2] for k in saved)
        live += sum(k[1] for k, r in self._unpacked.items() if r() is not None and (k[0], 0, k[1]) not in saved)
        self.peak = max(self.peak, live)


def _param_ptrs(model) -> set:
    return {p.untyped_storage().data_ptr() for p in model.parameters()}


def test_offload_drops_peak_rss_by_the_offloaded_blocks(tmp_path, monkeypatch):
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError as err:
        pytest.skip(f"/proc/self/clear_refs is not writable here ({err}): VmHWM cannot be reset")
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    (r,) = spawn(_worker, world_size=1, args=(str(tmp_path),), timeout=220, init_process_group=False,
                 fresh_interpreter=True)  # fmt: skip
    mib = 2**20
    drop = r["base"] - r["off"]
    figures = (f"peak rise {r['base'] / mib:.1f} -> {r['off'] / mib:.1f} MiB: drop {drop / mib:.1f} MiB = "
               f"{drop / EXPECTED_DROP:.2f} x the expected {EXPECTED_DROP / mib:.1f} MiB; offloaded "
               f"{r['offloaded'] / mib:.1f} MiB per step")  # fmt: skip
    print(figures)
    assert r["losses"][0] == r["losses"][1], r["losses"]
    assert r["offloaded"] == (BLOCKS - RESIDENT) * PER_BLOCK, figures  # the hand count, exactly
    assert all(s > 0 for s in r["saved"]), r["saved"]
    left = [PER_BLOCK / s for s in r["saved"][: BLOCKS - RESIDENT]]  # of what each offloaded block saves
    print(f"each offloaded block: {min(left):.3f} of its saved bytes leave memory")
    assert min(left) >= MIN_LEAVE, (left, r["saved"])
    base_peak, off_peak = r["live_peak"]
    print(f"live saved bytes at the peak: {base_peak / mib:.1f} -> {off_peak / mib:.1f} MiB "
          f"({off_peak / base_peak:.3f} of no offload)")  # fmt: skip
    assert 0 < off_peak <= MAX_RESIDENT * base_peak, (base_peak, off_peak)
    assert drop >= MIN_FRACTION * EXPECTED_DROP, figures
