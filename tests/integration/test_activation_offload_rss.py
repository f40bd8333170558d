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
    base, base_loss = measured()
    with ActivationOffload(model.recompute_units(), nvme_path=nvme_path, min_bytes=MIN_BYTES,
                           resident_blocks=RESIDENT) as off:  # fmt: skip
        step()
        offloaded_per_step = off.stats["bytes_offloaded"]
        rise, off_loss = measured()
        offloaded_per_step = off.stats["bytes_offloaded"] - offloaded_per_step
    return {"base": base, "off": rise, "losses": (base_loss, off_loss), "offloaded": offloaded_per_step, "saved": saved}


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
    assert drop >= MIN_FRACTION * EXPECTED_DROP, figures
