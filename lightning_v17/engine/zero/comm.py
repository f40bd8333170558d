"""The ZeRO-1/2 engine's packing of buckets (part of :mod:`lightning_v17.engine.zero.stages_0_2`): gradients into the flat
reduce buffers, updated rows into the post-step all-gather, and the gathered rows back into the parameters.

Each copy is one pass over the bytes it moves, and nothing is copied that is already in place (ZeRO-1/2
must keep up with Lightning's "ddp", which pays none of the all-gather):

* the mean over the dp ranks is taken inside the copy that packs a gradient (``torch.div(..., out=)``), not as a
  second pass over the whole bucket; when the gradient is cast to another reduce dtype the cast comes first, as
  before, so the bits are those of "cast, then divide";
* stage 2's ``[world, padded rows]`` layout is written in place, zeroing only the padding rows;
* the all-gather's send buffer is written straight from the parameters, once per destination rank when gloo's
  all-to-all form is used (:func:`lightning_v17.engine.collectives.all_gather` would copy it twice), and only the
  other ranks' rows are copied back (this rank's rows are already the stepped ones).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lightning_v17.engine.collectives import all_gather, use_all_to_all
from lightning_v17.engine.zero.layout import _Bucket, _Param, _rows

__all__ = ["gather_bucket", "pack_grad", "pack_rows"]


def pack_grad(dst: torch.Tensor, src: torch.Tensor, dp: int) -> None:
    """``dst = src / dp`` in ``dst``'s dtype: bitwise what copying (casting) into ``dst`` then ``dst.div_(dp)`` gives."""
    if src.dtype == dst.dtype:
        torch.div(src, dp, out=dst)
    else:  # cast first, then divide in the reduce dtype: the rounding of the unfused path
        dst.copy_(src)
        dst.div_(dp)


def pack_rows(dst: torch.Tensor, grad: torch.Tensor, e: _Param, world: int, dp: int) -> None:
    """Write ``grad / dp`` (the full gradient of ``e``) into ``dst`` = ``[world, padded_rows, row_numel]`` (a view of
    the reduce-scatter input): rank r's rows in ``dst[r]``, the padding rows zero."""
    g = _rows(grad)
    if e.rows == e.padded_rows * world:
        pack_grad(dst, g.reshape(world, e.padded_rows, e.row_numel), dp)
        return
    for r in range(world):
        n = max(0, min(e.padded_rows, e.rows - r * e.padded_rows))
        if n:
            pack_grad(dst[r, :n], g[r * e.padded_rows : r * e.padded_rows + n], dp)
        dst[r, n:].zero_()


class PendingGather:
    """A bucket's post-step all-gather in flight; :meth:`wait` copies the other ranks' rows into the parameters."""

    def __init__(self, work: Any, recv: torch.Tensor, b: _Bucket, world: int, rank: int) -> None:
        self._work, self._recv, self._b, self._world, self._rank = work, recv, b, world, rank

    @torch.no_grad()
    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
        recv = self._recv.view(self._world, self._b.seg_numel)
        off = 0
        for e in self._b.params:
            if e.rows:
                full = recv[:, off : off + e.seg_numel].reshape(self._world * e.padded_rows, e.row_numel)
                rows = _rows(e.param.detach())
                rows[: e.start].copy_(full[: e.start])  # this rank's rows [start, stop) are already the stepped ones
                rows[e.stop :].copy_(full[e.stop : e.rows])
            off += e.seg_numel
        self._work = self._recv = None


@torch.no_grad()
def gather_bucket(b: _Bucket, *, world: int, rank: int, group: Any) -> PendingGather:
    """Start the all-gather of every rank's rows of bucket ``b`` (async); ``wait()`` the result before reading them."""
    first = b.params[0].param
    dtype, device = first.dtype, _rows(first.detach()).device
    repeat = use_all_to_all(group)  # gloo: the all-to-all sends the shard to every rank, so it is written W times
    send = torch.empty(world if repeat else 1, b.seg_numel, dtype=dtype, device=device)
    off = 0
    for e in b.params:
        n = (e.stop - e.start) * e.row_numel
        src = _rows(e.param.detach())[e.start : e.stop].reshape(1, -1)
        send[:, off : off + n].copy_(src.expand(send.shape[0], -1))
        send[:, off + n : off + e.seg_numel].zero_()  # padding rows only
        off += e.seg_numel
    recv = torch.empty(world * b.seg_numel, dtype=dtype, device=device)
    if repeat:
        work = dist.all_to_all_single(recv, send.view(-1), group=group, async_op=True)
    else:
        work = all_gather(recv, send.view(-1), group=group, async_op=True)
    return PendingGather(work, recv, b, world, rank)
