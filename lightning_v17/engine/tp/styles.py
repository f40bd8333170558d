"""Tensor-parallel styles (part of :mod:`lightning_v17.engine.tp.apply`, which re-exports them): the one table
of string style names -> DTensor ``ParallelStyle`` and the styles of our own (replicate, prepare-first-input,
segmented colwise for fused projections).
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
)
from torch.distributed.tensor.placement_types import Placement

from lightning_v17.config import V17ConfigError


class _ReplicateParallel(ParallelStyle):
    """Make every parameter of a module a ``Replicate`` DTensor and run it on a replicated (or Shard(1)) input.

    Used for modules TP does not split (norms without sequence parallel, a non-vocab-parallel embedding): all
    parameters then live on the tp mesh, which is what FSDP2 expects when it composes a 2-D (dp, tp) layout.

    Args:
        output_layout: ``Replicate()`` keeps the output replicated; ``Shard(1)`` slices it along the sequence dim
            (sequence parallel after an unsharded embedding; its backward is the matching all-gather).
        use_local_output: return a plain tensor (True) or the DTensor.
    """

    def __init__(self, *, output_layout: Placement | None = None, use_local_output: bool = True) -> None:
        super().__init__()
        self.output_layout = output_layout or Replicate()
        self.use_local_output = use_local_output

    @staticmethod
    def _replicate_params(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for p_name, param in list(module.named_parameters(recurse=False)):
            if isinstance(param, DTensor):
                continue
            # Every tp rank built the same weights from the same seed; from_local avoids a broadcast per tensor.
            dt = DTensor.from_local(param.detach(), mesh, [Replicate()], run_check=False)
            module.register_parameter(p_name, nn.Parameter(dt, requires_grad=param.requires_grad))

    def _prepare_input(self, mod: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        x = inputs[0]
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor):
            # token ids too: a DTensor op needs every tensor operand to be a DTensor
            x = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        return (x, *inputs[1:])

    def _prepare_output(self, mod: nn.Module, outputs: Any, mesh: DeviceMesh) -> Any:
        if outputs.placements != (self.output_layout,):
            outputs = outputs.redistribute(placements=[self.output_layout])
        return outputs.to_local() if self.use_local_output else outputs

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module,
            device_mesh,
            self._replicate_params,
            lambda mod, inputs, mesh: self._prepare_input(mod, inputs, mesh),
            lambda mod, outputs, mesh: self._prepare_output(mod, outputs, mesh),
        )


class _PrepareFirstInput(ParallelStyle):
    """Turn only the first positional input of a module into a DTensor and redistribute it.

    ``PrepareModuleInput`` needs one layout per positional argument, which ties the plan to the exact call signature
    of ``attention(x, position_ids, cu_seqlens, max_seqlen)``; this style touches ``x`` and passes everything else
    through, whatever the signature.

    Args:
        input_layout: layout of the incoming plain tensor (``Shard(1)`` under sequence parallel, else ``Replicate()``).
        desired_layout: layout the module body receives (``Replicate()``: the column-parallel projections need the
            whole sequence; the redistribution Shard(1) -> Replicate is SP's all-gather and its backward the
            reduce-scatter).
    """

    def __init__(self, *, input_layout: Placement, desired_layout: Placement) -> None:
        super().__init__()
        self.input_layout = input_layout
        self.desired_layout = desired_layout

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def hook(_mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            x = args[0]
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, [self.input_layout], run_check=False)
            if x.placements != (self.desired_layout,):
                x = x.redistribute(placements=[self.desired_layout])
            return (x, *args[1:]), kwargs

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


class _RowwiseReplicatedInput(RowwiseParallel):
    """``RowwiseParallel(input_layouts=Replicate())``; on an ``nn.Embedding`` (the vocab-parallel lookup) the weight's
    gradient is kept in the weight's ``Shard(0)`` layout.

    DTensor's embedding backward returns the table's gradient ``Replicate`` (every rank computes the whole dense
    gradient from the replicated output gradient). Code that reads gradients shard by shard -- ZeRO-1/2 buckets,
    norms of local gradients -- needs them in the parameter's layout, as FSDP2 redistributes them before its
    reduce-scatter (``FSDPParam._get_grad_inner_tensor``); from ``Replicate`` that is a local slice, no communication.
    """

    def __init__(self) -> None:
        super().__init__(input_layouts=Replicate())

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = super()._apply(module, device_mesh)
        weight = getattr(module, "weight", None)
        if isinstance(module, nn.Embedding) and isinstance(weight, DTensor):

            def in_weight_layout(grad: torch.Tensor) -> torch.Tensor:
                if isinstance(grad, DTensor) and grad.placements != weight.placements:
                    return grad.redistribute(placements=weight.placements)
                return grad

            weight.register_hook(in_weight_layout)
        return module


#: Style names -> factories (a fresh ``ParallelStyle`` per module). Names follow Hugging Face transformers 5.x
#: (``transformers/distributed/tensor_parallel.py`` in 5.24) where the DTensor style means the same thing.
PARALLEL_STYLES: Mapping[str, Callable[[], ParallelStyle]] = types.MappingProxyType(
    {
        # weight Shard(0) (output features); input replicated, output the local shard of the last dim
        "colwise": lambda: ColwiseParallel(),
        # weight Shard(1) (input features; an Embedding's table Shard(0)); input the local shard, output all-reduced
        "rowwise": lambda: RowwiseParallel(),
        # column-parallel with the output all-gathered (an LM head whose logits the loss needs whole)
        "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        # row-parallel on a replicated input: split locally (no communication) before the matmul. On an
        # nn.Embedding this is the vocab-parallel lookup (table Shard(0), masked, partial sums all-reduced).
        "rowwise_rep": _RowwiseReplicatedInput,
        "rowwise_split_input": _RowwiseReplicatedInput,
        "embedding_rowwise": _RowwiseReplicatedInput,
        # norms on a sequence-sharded (Shard(1)) residual stream, parameters replicated
        "sequence_parallel": lambda: SequenceParallel(),
        # every parameter a Replicate DTensor; the module computes on the replicated input
        "replicate": lambda: _ReplicateParallel(),
    }
)


def parallel_style(style: str | ParallelStyle, *, key: str | None = None) -> ParallelStyle:
    """The ``ParallelStyle`` for one plan entry: a style object as is, or a fresh one for a name.

    Args:
        style: a name from :data:`PARALLEL_STYLES` (e.g. ``"colwise"``) or a ``ParallelStyle``.
        key: the plan key it belongs to, named in the error.

    Returns:
        The ``ParallelStyle``.

    Raises:
        V17ConfigError: an unknown name or a value of another type; the message lists the supported names.
    """
    if isinstance(style, ParallelStyle):
        return style
    if isinstance(style, str) and style in PARALLEL_STYLES:
        return PARALLEL_STYLES[style]()
    where = f" for {key!r}" if key is not None else ""
    raise V17ConfigError(
        f"unknown tensor-parallel style {style!r}{where}; supported names: {', '.join(PARALLEL_STYLES)} "
        f"(or pass a torch.distributed.tensor.parallel.ParallelStyle object)"
    )


class SegmentedColwiseParallel(ParallelStyle):
    """Column-parallel ``nn.Linear`` whose output features are a concatenation of segments, e.g. a fused
    ``[q; k; v]`` projection: each rank computes its contiguous 1/tp of *every* segment.

    A plain ``ColwiseParallel`` would give rank 0 the first 1/tp of the fused rows (all of q, say) and rank 1 the
    rest, which is not a head partition. Here the parameter is stored as a ``Shard(0)`` DTensor in the module's true
    layout (same FQN, same state dict, any checkpoint reshards it), and each forward all-gathers it and keeps rank
    r's rows ``[seg_i[r*s_i/tp : (r+1)*s_i/tp] for each segment i]``; the backward reduce-scatters the weight gradient
    (one all-gather + one reduce-scatter of this weight per step, FSDP's cost for it) and all-reduces the input
    gradient, as ``ColwiseParallel`` does. The output is the plain local tensor ``[..., sum(s_i) / tp]`` in segment
    order, so the module consuming it must split it with local sizes (``s_i / tp``).

    Args:
        segments: the output-feature sizes of the segments, in order; they must sum to ``out_features`` and each
            must be divisible by the tp size.
    """

    def __init__(self, segments: Sequence[int]) -> None:
        super().__init__()
        self.segments = tuple(int(s) for s in segments)

    def _rows(self, rank: int, tp: int) -> list[tuple[int, int]]:
        spans, start = [], 0
        for size in self.segments:
            chunk = size // tp
            spans.append((start + rank * chunk, chunk))
            start += size
        return spans

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Linear):
            raise V17ConfigError(f"SegmentedColwiseParallel applies to nn.Linear; got {type(module).__name__}")
        tp = device_mesh.size()
        if sum(self.segments) != module.out_features or any(s % tp for s in self.segments):
            raise V17ConfigError(
                f"SegmentedColwiseParallel segments {self.segments} must sum to out_features={module.out_features} "
                f"and each be divisible by tp={tp}"
            )
        for name, param in list(module.named_parameters(recurse=False)):
            if not isinstance(param, DTensor):
                dt = distribute_tensor(param.detach(), device_mesh, [Shard(0)])
                module.register_parameter(name, nn.Parameter(dt, requires_grad=param.requires_grad))
        spans = self._rows(device_mesh.get_local_rank(), tp)

        def local(p: DTensor) -> torch.Tensor:
            # All-gather; the gradient of the gathered copy is this rank's rows only, i.e. a Partial sum over ranks,
            # which Redistribute's backward reduce-scatters back to Shard(0).
            full = p.redistribute(device_mesh, [Replicate()]).to_local(grad_placements=[Partial()])
            return torch.cat([full.narrow(0, start, n) for start, n in spans], dim=0)

        def forward(mod: nn.Linear, x: torch.Tensor) -> torch.Tensor:
            if isinstance(x, DTensor):
                x = x.redistribute(device_mesh, [Replicate()]).to_local(grad_placements=[Partial()])
            else:
                # identity forward; backward all-reduces the input gradient (each rank saw only its heads)
                x = DTensor.from_local(x, device_mesh, [Replicate()], run_check=False)
                x = x.to_local(grad_placements=[Partial()])
            bias = local(mod.bias) if mod.bias is not None else None
            return F.linear(x, local(mod.weight), bias)

        module.forward = types.MethodType(forward, module)
        return module
