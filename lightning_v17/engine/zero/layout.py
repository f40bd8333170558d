"""The ZeRO-0/1/2 partition layout (part of :mod:`lightning_v17.engine.zero.stages_0_2`, which re-exports it): which dim-0
rows of each parameter a rank owns and the per-parameter and per-bucket bookkeeping. Which optimizers may step a
dim-0 slice (elementwise ones) or need whole parameters, the optimizer library answers
(:func:`lightning_v17.optim.local_step.is_elementwise_optimizer`, re-exported here).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Self

import torch
from torch import nn

from lightning_v17.engine._dtensor import local_tensor as _local
from lightning_v17.optim.local_step import is_elementwise_optimizer

__all__ = ["PARTITIONS", "ShardParameter", "chunk_rows", "is_elementwise_optimizer", "shard_view"]


def chunk_rows(dim0: int, world: int, rank: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of dim 0 owned by ``rank`` under ``torch.chunk(dim0, world)`` semantics.

    The chunk size is ``ceil(dim0 / world)``; trailing ranks may own fewer rows or none (the same partition DTensor
    ``Shard(0)`` and FSDP2 use, so states produced by stages 1, 2 and 3 line up element for element).
    """
    size = -(-dim0 // world) if dim0 > 0 else 0
    start = min(rank * size, dim0)
    return start, min(start + size, dim0)




def _rows(t: torch.Tensor) -> torch.Tensor:
    """View ``t`` (or a DTensor's local tensor) as [dim0, rest] (a 0-dim tensor counts as one row)."""
    t = _local(t)
    return t.reshape(1, -1) if t.dim() == 0 else t.reshape(t.shape[0], -1)


@dataclass
class _Param:
    fqn: str
    param: nn.Parameter
    rows: int  # dim 0 (1 for a scalar)
    row_numel: int
    start: int
    stop: int
    padded_rows: int  # ceil(rows / world): the size every rank's segment gets so that collectives have equal sizes
    #: what this rank's optimizer holds for the parameter (stages 1/2): a view of the local rows ("rows"); the
    #: parameter itself on its owner, an empty stand-in on the other ranks ("params")
    shard: nn.Parameter | None = None
    owner: int = -1  # partition="params": the dp_shard rank whose optimizer steps this whole parameter
    used: bool = True  # this rank had its gradient when its bucket was reduced (ZeroEngine._unused_everywhere)

    @property
    def seg_numel(self) -> int:
        return self.padded_rows * self.row_numel


class ShardParameter(nn.Parameter):
    """What a ZeRO-1/2 optimizer holds in place of a parameter: a view of this rank's dim-0 rows of it (the step
    writes the parameter's storage), or, for a parameter another rank owns (``partition="params"``), an empty view
    that never gets a gradient, so the optimizer skips it.

    Two attributes speak for the parameter, because Lightning reaches the parameters through ``param_groups``:

    * ``requires_grad`` reads and sets the *parameter's* flag. ``LightningModule.toggle_optimizer`` switches the other
      optimizers' parameters off by setting it on what their ``param_groups`` hold; it must reach the tensor autograd
      sees, on every rank alike (hence the stand-ins), or the toggled-off network still receives gradients and they
      leak into its next step.
    * setting ``grad`` to None also drops the parameter's full gradient (stage 1 keeps it; stage 2 while
      accumulating). ``optimizer.zero_grad()`` does that for each shard, whichever way it is called: a
      ``LightningOptimizer`` (what ``self.optimizers()`` returns under manual optimization) runs the class's
      ``zero_grad``, not one set on the optimizer instance, and a stale full gradient would be all-reduced again
      into the next step.
    """

    def __new__(cls, data: torch.Tensor, param: nn.Parameter) -> Self:
        shard = super().__new__(cls, data, requires_grad=True)
        shard._v17_param = param
        return shard

    @property  # type: ignore[override]
    def requires_grad(self) -> bool:
        return self._v17_param.requires_grad

    @requires_grad.setter
    def requires_grad(self, value: bool) -> None:
        self._v17_param.requires_grad_(value)

    # In a dict or set keyed by parameters, a shard finds its parameter: Lightning's ``BaseFinetuning`` names the
    # optimizer's ``param_groups`` through ``{p: name for name, p in module.named_parameters()}``. Python tries a
    # subclass's reflected ``__eq__`` first, so ``parameter == shard`` lands here too. Every other comparison is the
    # tensor's own (elementwise).
    def __hash__(self) -> int:
        return hash(self._v17_param)

    def __eq__(self, other: object) -> Any:
        if other is self._v17_param or other is self:
            return True
        return super().__eq__(other)

    @property  # type: ignore[override]
    def grad(self) -> torch.Tensor | None:
        return _TENSOR_GRAD.__get__(self)

    @grad.setter
    def grad(self, value: torch.Tensor | None) -> None:
        _TENSOR_GRAD.__set__(self, value)
        if value is None and self._v17_param.grad is not None:
            self._v17_param.grad = None


_TENSOR_GRAD = torch.Tensor.grad  # the C attribute the properties above stand in front of


def whole_grads(params: Any) -> list[torch.Tensor]:
    """The gradient tensors that a scaling or an elementwise change of the gradients of ``params`` (what an optimizer
    holds) must be applied to: clipping, and fp16's unscale. Deduplicated, local pieces of DTensors.

    At ZeRO-1 a :class:`ShardParameter`'s gradient is a view of this rank's rows of the parameter's *whole* reduced
    gradient (and with ``partition="params"`` a stand-in without one), and that whole gradient stays until
    ``zero_grad``, equal on every rank as under DDP: a step that does not zero it accumulates the next backward onto it
    and reduces again. Changed through the shards only, each rank would change its own rows and keep the others'
    rows as they were, and the next reduction would average the two. So the whole gradient is changed on every rank
    (what DDP does). Elsewhere (stage 2's shard gradients, whole parameters, DTensors) it is the tensor's own.
    """
    seen: set[int] = set()
    out: list[torch.Tensor] = []
    for p in params:
        whole = getattr(p, "_v17_param", None) if isinstance(p, ShardParameter) else None
        g = whole.grad if whole is not None and whole.grad is not None else p.grad
        if g is None:
            continue
        g = _local(g)
        if g.numel() and id(g) not in seen:
            seen.add(id(g))
            out.append(g)
    return out


def shard_view(e: _Param, *, empty: bool = False) -> torch.Tensor:
    """Rows ``[start, stop)`` of ``e``'s parameter (none with ``empty``), shaped like the parameter past dim 0."""
    start, stop = (0, 0) if empty else (e.start, e.stop)
    local = _rows(e.param.detach())[start:stop]
    shape = _local(e.param).shape
    return local.view((stop - start, *shape[1:])) if len(shape) else local.view(-1)


@dataclass
class _Bucket:
    params: list[_Param]
    seg_numel: int  # elements per rank in the padded [world, seg] layout (stages 1/2)
    work: Any = None
    buf: torch.Tensor | None = None  # flat full gradients (stages 0/1) or the [world*seg] reduce-scatter input
    out: torch.Tensor | None = None  # the [seg] reduce-scatter output (stage 2)
    ready: set[int] = field(default_factory=set)


PARTITIONS = ("auto", "rows", "params")
