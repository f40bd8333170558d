"""glibc settings of the offload tiers (``lightning_v17/engine/host_buffers.py``), in a fresh process each: mallopt
changes the whole process, so the test process itself is left alone."""

from __future__ import annotations

import subprocess
import sys

import pytest

from lightning_v17.engine.host_buffers import _libc

_MALLINFO = r"""
import torch
from lightning_v17.engine import host_buffers as hb
from tests._glibc import mapped_by
"""


def _run(body: str) -> list[int]:
    cmd = [sys.executable, "-c", _MALLINFO + body]
    out = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return [int(x) for x in out.stdout.strip().splitlines()[-1].split()]  # the last line: DeepSpeed logs to stdout


def _glibc_skip() -> None:
    libc = _libc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        pytest.skip("not glibc >= 2.33 (no mallopt/mallinfo2): own_mappings does nothing there")


def test_own_mappings_maps_state_sized_allocations_inside_and_lets_the_heap_recycle_them_after() -> None:
    """Inside (the second time: the threshold before is the 32 MiB the first left), a 4 MiB tensor is its own
    mapping; after, a 4 MiB tensor comes from the heap (recycled, not faulted in anew), and a 64 MiB one is mapped."""
    _glibc_skip()
    inside, after, large = _run(
        "with hb.own_mappings():\n    pass\n"
        "with hb.own_mappings():\n    inside = mapped_by(4 * 2**20)\n"
        "print(inside, mapped_by(4 * 2**20), mapped_by(64 * 2**20))\n"
    )
    assert inside >= 4 * 2**20, "inside own_mappings a 4 MiB allocation was not its own mapping"
    assert after == 0, "after own_mappings a 4 MiB allocation was still mapped (threshold not back at 32 MiB)"
    assert large >= 64 * 2**20


def test_own_mappings_scopes_nest_and_overlap_across_threads() -> None:
    """glibc's threshold is the process's: a scope that closes inside another (a buffer allocated inside backward's
    scope), or on another thread (the parameter tier's allocator thread), must not end the one still open. Inside
    the outer scope after both closed, a 4 MiB tensor is still its own mapping; after the outer one, it is not."""
    _glibc_skip()
    body = (
        "import threading\n"
        "with hb.own_mappings():\n"
        "    with hb.own_mappings():\n"
        "        pass\n"
        "    nested = mapped_by(4 * 2**20)\n"
        "    ready, done = threading.Event(), threading.Event()\n"
        "    def other():\n"
        "        with hb.own_mappings():\n"
        "            ready.set(); done.wait()\n"
        "    t = threading.Thread(target=other); t.start(); ready.wait(); done.set(); t.join()\n"
        "    threaded = mapped_by(4 * 2**20)\n"
        "print(nested, threaded, mapped_by(4 * 2**20))\n"
    )
    nested, threaded, after = _run(body)
    assert nested >= 4 * 2**20, "a nested own_mappings scope ended the outer one"
    assert threaded >= 4 * 2**20, "another thread's own_mappings scope ended this thread's"
    assert after == 0, "after the last scope a 4 MiB allocation was still mapped"


def test_a_process_wide_threshold_is_kept() -> None:
    """Where the parameter tier fixed the threshold for the process (1 MiB), own_mappings leaves it: after it, a
    4 MiB tensor is still its own mapping."""
    _glibc_skip()
    (after,) = _run("hb.fix_mmap_threshold()\nwith hb.own_mappings():\n    pass\nprint(mapped_by(4 * 2**20))\n")
    assert after >= 4 * 2**20


@pytest.mark.parametrize("host_memory,mapped", [("return", True), ("recycle", False), (None, False)])
def test_the_optimizer_tier_honours_host_memory(tmp_path, host_memory: str, mapped: bool) -> None:
    """After 3 offloaded steps on the nvme tier, a 4 MiB host allocation is its own mapping under "return" (the
    process-wide 1 MiB threshold) and comes from the heap under "recycle" (own mappings only in the first step), the
    default (None) without parameters on nvme; the 3 steps equal the plain optimizer's bit for bit either way."""
    _glibc_skip()
    after, same = _run(
        "import tests.unit.test_offload as t\n"
        "t.STEPS = 3\n"
        "ref_model, _, ref_losses = t._train('adamw', None)\n"
        f"model, _, losses = t._train('adamw', {{'tier': 'nvme', 'nvme_path': {str(tmp_path)!r}, "
        f"'host_memory': {host_memory!r}}})\n"
        "same = losses == ref_losses and all(torch.equal(p, q) for p, q in zip(model.parameters(), "
        "ref_model.parameters()))\n"
        "print(mapped_by(4 * 2**20), int(same))\n"
    )
    assert (after >= 4 * 2**20) == mapped, after
    assert same, f"host_memory={host_memory!r} changed the steps (they must equal the plain optimizer bit for bit)"
