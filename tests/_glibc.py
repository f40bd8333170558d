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


def mapped_by(nbytes: int) -> int:
    """Bytes malloc serves from their own mappings (mallinfo2's hblkhd) while a tensor of ``nbytes`` is alive."""
    m0 = mallinfo2().hblkhd
    t = torch.empty(nbytes, dtype=torch.uint8)
    m = mallinfo2().hblkhd - m0
    del t
    return m
