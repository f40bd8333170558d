"""glibc settings of the offload tiers (``lightning_v17/engine/offload/host_memory.py``), in a fresh process each: mallopt
changes the whole process, so the test process itself is left alone."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lightning_v17.engine.offload.host_memory import _env_threshold, _libc

_MALLINFO = r"""
import torch
from lightning_v17.engine.offload import host_memory as hb
from tests._glibc import mapped_by
"""


def _run(body: str, env: dict[str, str] | None = None) -> list[int]:
    """Run ``body`` in a fresh interpreter (``env`` on top of this one's environment, read by glibc at its start)."""
    cmd = [sys.executable, "-c", _MALLINFO + body]
    environ = {**os.environ, **(env or {})}
    out = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=120, env=environ)
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


@pytest.mark.parametrize(
    "env",
    [{"MALLOC_MMAP_THRESHOLD_": "65536"}, {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"}],
    ids=["MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES"],
)
def test_a_threshold_the_user_fixed_in_the_environment_is_kept(env: dict[str, str]) -> None:
    """A user who set a 64 KiB threshold (so that freed tensors leave the process) keeps it: after an own_mappings
    scope and after the parameter tier's fix_mmap_threshold (1 MiB) 32 tensors of 256 KiB are (mostly) their own
    mappings (with the threshold set back to 32 MiB, or raised to 1 MiB, they would come from the heap and stay there
    when freed). Half of the 8 MiB is the bar: the heap's free chunks may serve a few of them."""
    _glibc_skip()
    body = (
        "before = mapped_by(256 * 2**10, 32)\n"
        "with hb.own_mappings():\n    pass\n"
        "after_scope = mapped_by(256 * 2**10, 32)\n"
        "hb.fix_mmap_threshold()\n"
        "print(before, after_scope, mapped_by(256 * 2**10, 32), hb.user_mmap_threshold())\n"
    )
    before, after_scope, after_fix, seen = _run(body, env)
    assert seen == 65536, "the threshold in the environment was not read"
    assert before >= 4 * 2**20, "the environment's threshold did not reach glibc (test set-up)"
    assert after_scope >= 4 * 2**20, "own_mappings replaced the user's 64 KiB threshold"
    assert after_fix >= 4 * 2**20, "fix_mmap_threshold raised the user's 64 KiB threshold"


def test_the_environment_threshold_is_read_from_glibc_tunables_or_its_alias() -> None:
    """GLIBC_TUNABLES's mmap_threshold (any position, any base), else the MALLOC_MMAP_THRESHOLD_ alias; else None."""
    tunables = "glibc.malloc.trim_threshold=1:glibc.malloc.mmap_threshold=0x10000"
    assert _env_threshold({"GLIBC_TUNABLES": tunables, "MALLOC_MMAP_THRESHOLD_": "4096"}) == 65536
    assert _env_threshold({"MALLOC_MMAP_THRESHOLD_": "131072"}) == 131072
    assert _env_threshold({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"}) is None
    assert _env_threshold({}) is None


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
