"""Delayed scaling for FP8 training (``fp8="delayed"``), written here because torchao 0.18 removed it
(pytorch/ao#1680, PR #1753). Part of :mod:`lightning_v17.engine.fp8.convert`, which converts the layers.

Delayed scaling (Micikevicius 2022, "FP8 Formats for Deep Learning", §4.3; Transformer Engine's ``DelayedScaling``):
a float8 cast multiplies by a scale chosen *before* the tensor is seen, from the amaxes (max |x|) of earlier steps,
so no reduction over the tensor sits on the critical path of the cast. Each converted Linear keeps, per role
(``input``, ``weight``, ``grad_output``):

* ``amax_history[role]``: the last ``history_len`` steps' amaxes (newest first), a persistent buffer;
* ``scale[role]``: ``float8_max(role dtype) / max(amax_history[role])`` (TE's ``amax_compute_algo="max"``, margin
  0), a persistent buffer; 1.0 until a nonzero amax was seen;
* ``amax_pending[role]``: the running max over this step's forward/backward passes (every micro-batch, a recomputed
  forward), not persistent: it is folded into the history after each optimizer step.

The GEMMs: ``output = x @ W.T`` with x, W in e4m3, ``grad_input = g @ W`` and ``grad_weight = g.T @ x`` with g in e5m2
(the hybrid format, Micikevicius §3), each one ``torch._scaled_mm`` with the inverse scales, accumulating and
returning the high-precision dtype. A cast saturates at the format's max (an amax that grew since the history was
taken clips instead of overflowing to inf/nan, as in TE).

Synchronised amax (``update_scales``, after every optimizer step): the pending amaxes of all layers are stacked and
all-reduced with MAX over the data-parallel axes (dp_replicate x dp_shard, i.e. ``"dp"``) and ``tp``, one
collective per axis for the whole model, then pushed into every history and the scales recomputed. Every rank of a
pipeline stage therefore holds bitwise-identical histories and scales (TE's ``reduce_amax=True`` with an
``fp8_group``), and a data-parallel run quantizes exactly as one process that runs each rank's rows as a micro-batch.

Tensor parallelism (tp > 1, plain ``ColwiseParallel``/``RowwiseParallel`` styles from the plan): the weight is a
tp-sharded DTensor and the input a DTensor (replicated for colwise, sharded on its last dim for rowwise).
:meth:`DelayedFloat8Linear.forward` runs the same three float8 GEMMs on the local shards and hands the output back
as a DTensor (colwise: sharded on its last dim; rowwise: ``Partial``, summed by the style's output redistribution).
No cast needs a reduction: the scales are the same on every tp rank, because they come from histories of amaxes
all-reduced with MAX over tp, so a shard's local amax (of a weight shard, of a rowwise input shard, of a colwise
output-gradient shard) becomes the whole tensor's amax in the history, as Transformer Engine does over its amax
reduction group. torchao's float8 TP styles are not used here: they cast with dynamic (tensorwise) scales.

The history and scales are module buffers: they go into every checkpoint by FQN, and reshard on load (they are
replicated, so a dp=2 checkpoint loads at dp=1 unchanged).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from lightning_v17.config import V17ConfigError
from lightning_v17.engine._dtensor import local as _local

__all__ = ["DEFAULT_AMAX_HISTORY_LEN", "DelayedFloat8Linear", "convert_to_delayed", "update_scales"]

#: Transformer Engine's ``DelayedScaling`` default is 1024; torchao's removed recipe used 16. Short histories follow
#: a changing distribution sooner; 16 is what torchao measured as stable for LLM pretraining.
DEFAULT_AMAX_HISTORY_LEN = 16
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
INPUT, WEIGHT, GRAD_OUTPUT = 0, 1, 2
ROLES = ("input", "weight", "grad_output")
_ROLE_DTYPES = (E4M3, E4M3, E5M2)


def _to_float8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Saturating cast of ``x * scale`` to ``dtype`` (row-major, contiguous)."""
    fmax = torch.finfo(dtype).max
    return (x.float() * scale).clamp(-fmax, fmax).to(dtype).contiguous()




def _col_major(t: torch.Tensor) -> torch.Tensor:
    """The same matrix laid out column-major (``torch._scaled_mm`` wants its second operand so)."""
    return t.t().contiguous().t()


class _DelayedScaledMM(torch.autograd.Function):
    """``x @ W.T`` and its two gradients as float8 ``torch._scaled_mm`` with the given (delayed) scales."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, pending: torch.Tensor):
        x2 = x.reshape(-1, x.shape[-1])
        with torch.no_grad():
            pending[INPUT] = torch.maximum(pending[INPUT], x2.detach().abs().max().float())
            pending[WEIGHT] = torch.maximum(pending[WEIGHT], weight.detach().abs().max().float())
        s = scale.detach().clone()  # the scales of this step, even if the buffer is updated before backward
        x8 = _to_float8(x2, s[INPUT], E4M3)
        w8 = _to_float8(weight, s[WEIGHT], E4M3)
        inv = s.reciprocal()
        out = torch._scaled_mm(x8, w8.t(), scale_a=inv[INPUT], scale_b=inv[WEIGHT], out_dtype=x.dtype)
        ctx.save_for_backward(x8, w8, s)
        # a plain reference, not a saved tensor: later micro-batches update the buffer in place before this backward
        ctx.pending = pending
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):
        x8, w8, s = ctx.saved_tensors
        pending = ctx.pending
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        with torch.no_grad():
            pending[GRAD_OUTPUT] = torch.maximum(pending[GRAD_OUTPUT], g2.abs().max().float())
        g8 = _to_float8(g2, s[GRAD_OUTPUT], E5M2)
        inv = s.reciprocal()
        grad_x = torch._scaled_mm(g8, _col_major(w8), scale_a=inv[GRAD_OUTPUT], scale_b=inv[WEIGHT],
                                  out_dtype=ctx.x_dtype)  # fmt: skip
        grad_w = torch._scaled_mm(g8.t().contiguous(), _col_major(x8), scale_a=inv[GRAD_OUTPUT], scale_b=inv[INPUT],
                                  out_dtype=ctx.w_dtype)  # fmt: skip
        return grad_x.reshape(ctx.x_shape), grad_w, None, None


class DelayedFloat8Linear(nn.Linear):
    """An ``nn.Linear`` whose three GEMMs run in float8 with delayed scaling (module doc).

    Built from an existing Linear by :meth:`from_linear`, keeping its ``weight``/``bias`` Parameter objects (FQNs,
    ZeRO and checkpoints see the same parameters).

    Buffers: ``amax_history`` ``[3, history_len]`` fp32 (rows: input, weight, grad_output; column 0 newest),
    ``scale`` ``[3]`` fp32 (persistent); ``amax_pending`` ``[3]`` fp32 (not persistent). Under tp > 1 they are
    ``Replicate`` DTensors on the tp mesh (TP's ``distribute_module`` makes them so), equal on every tp rank.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, history_len: int = 16,
                 device: Any = None, dtype: Any = None) -> None:  # fmt: skip
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.history_len = int(history_len)
        self.register_buffer("amax_history", torch.zeros(3, self.history_len, device=device))
        self.register_buffer("scale", torch.ones(3, device=device))
        self.register_buffer("amax_pending", torch.zeros(3, device=device), persistent=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, history_len: int) -> DelayedFloat8Linear:
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, history_len=history_len)
        new.weight, new.bias = linear.weight, linear.bias
        device = linear.weight.device
        new.amax_history = torch.zeros(3, new.history_len, device=device)
        new.scale = torch.ones(3, device=device)
        new.amax_pending = torch.zeros(3, device=device)
        return new

    def reset_fp8_state(self) -> None:
        """Fresh history (zeros), scales 1.0 and no pending amax (after a meta-device model is materialized)."""
        with torch.no_grad():
            _local(self.amax_history).zero_()
            _local(self.scale).fill_(1.0)
            _local(self.amax_pending).zero_()

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if hasattr(self, "scale"):
            self.reset_fp8_state()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, DTensor):
            return self._forward_tp(x)
        out = _DelayedScaledMM.apply(x, self.weight, self.scale, self.amax_pending)
        return out + self.bias if self.bias is not None else out

    def _forward_tp(self, x: torch.Tensor) -> torch.Tensor:
        """The tensor-parallel forward (module doc): float8 GEMMs on the local shards, the output a DTensor."""
        w = self.weight
        mesh = w.device_mesh
        if mesh.ndim != 1 or not isinstance(x, DTensor) or x.device_mesh != mesh:
            raise V17ConfigError(
                "fp8='delayed' with tp > 1: a converted Linear's weight is a DTensor on a "
                f"{mesh.ndim}-D mesh and its input a {'DTensor' if isinstance(x, DTensor) else 'plain tensor'}; "
                "only the plain 'colwise'/'rowwise' tensor-parallel styles (1-D tp mesh) are supported; give the "
                "layer one of those or keep it in high precision with FP8Policy(skip=[...])"
            )
        last = x.ndim - 1
        wp, xp = w.placements[0], x.placements[0]
        x_on_last = xp.is_shard() and xp.dim % x.ndim == last
        if wp.is_shard(0) and xp.is_replicate():  # colwise: out[..., shard] = x @ W[shard].T; grad x partial
            out_placement, x_grad = Shard(last), Partial()
        elif wp.is_shard(1) and x_on_last:  # rowwise: out = sum over tp of x[..., shard] @ W[:, shard].T
            out_placement, x_grad = Partial(), Shard(last)
        elif wp.is_replicate() and xp.is_replicate():
            out_placement, x_grad = Replicate(), Replicate()
        else:
            raise V17ConfigError(
                f"fp8='delayed' with tp > 1: unsupported layout (weight {wp}, input {xp}); the delayed float8 "
                "Linear runs with the plain 'colwise' (weight Shard(0), input Replicate) or 'rowwise' (weight "
                "Shard(1), input Shard(-1)) styles; use one of them, or keep this layer in high precision with "
                "FP8Policy(skip=[...])"
            )
        x_local = x.to_local(grad_placements=[x_grad])
        out = _DelayedScaledMM.apply(x_local, w.to_local(), _local(self.scale), _local(self.amax_pending))
        out = DTensor.from_local(out, mesh, [out_placement], run_check=False)
        return out + self.bias if self.bias is not None else out

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8=delayed, history_len={self.history_len}"


def convert_to_delayed(module: nn.Module, fqns: Sequence[str], *, history_len: int) -> None:
    """Swap the ``nn.Linear`` submodules named ``fqns`` for :class:`DelayedFloat8Linear` in place (idempotent)."""
    for fqn in fqns:
        parent_name, _, name = fqn.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        child = getattr(parent, name)
        if isinstance(child, DelayedFloat8Linear):
            continue
        setattr(parent, name, DelayedFloat8Linear.from_linear(child, history_len=history_len))


def delayed_layers(module: nn.Module) -> list[DelayedFloat8Linear]:
    """The delayed-scaling Linears of ``module``, in module order (the same on every rank of a stage)."""
    return [m for m in module.modules() if isinstance(m, DelayedFloat8Linear)]


@torch.no_grad()
def update_scales(module: nn.Module, *, groups: Sequence[Any] = ()) -> None:
    """Fold this step's pending amaxes into the histories and recompute the scales (module doc).

    Args:
        module: the model (every :class:`DelayedFloat8Linear` in it is updated).
        groups: process groups to all-reduce the amaxes over with MAX (the dp and tp axes; empty: one process).
    """
    layers = delayed_layers(module)
    if not layers:
        return
    pending = torch.stack([_local(m.amax_pending) for m in layers])  # [layers, 3]: one collective per axis
    for group in groups:
        dist.all_reduce(pending, op=dist.ReduceOp.MAX, group=group)
    fmax = torch.tensor([torch.finfo(d).max for d in _ROLE_DTYPES], dtype=torch.float32, device=pending.device)
    for m, amax in zip(layers, pending, strict=True):
        hist, scale = _local(m.amax_history), _local(m.scale)
        hist.copy_(torch.roll(hist, 1, dims=1))
        hist[:, 0] = amax.to(hist.device)
        top = hist.max(dim=1).values
        scale.copy_(torch.where(top > 0, fmax.to(top.device) / top, scale))
        _local(m.amax_pending).zero_()
