"""glibc's malloc statistics for the tests of the offload tiers' glibc settings (``mallinfo2``, glibc >= 2.33)."""

from __future__ import annotations

import ctypes

import torch


class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                               "uordblks", "fordblks", "keepcost")]  # fmt: skip


def mallinfo2() -> MallInfo2:
    """glibc's ``mallinfo2()``: ``hblkhd`` the bytes malloc serves from their own mappings, ``fordblks`` the free
    bytes in its heaps (all arenas)."""
    fn = ctypes.CDLL("libc.so.6").mallinfo2
    fn.restype = MallInfo2
    return fn()


def mapped_by(nbytes: int, count: int = 1) -> int:
    """Bytes malloc serves from their own mappings (mallinfo2's hblkhd) while ``count`` tensors of ``nbytes`` each
    are alive. malloc maps a request above its threshold only when no free chunk in its heap can serve it, and the
    free chunks an import leaves differ from process to process: a size that such a chunk can hold (hundreds of KiB)
    needs ``count`` > 1, so that most of the tensors are past what the heap has free."""
    m0 = mallinfo2().hblkhd
    ts = [torch.empty(nbytes, dtype=torch.uint8) for _ in range(count)]
    m = mallinfo2().hblkhd - m0
    del ts
    return m
