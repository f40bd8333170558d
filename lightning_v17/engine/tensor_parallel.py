"""Megatron-style tensor parallelism (and sequence parallelism) through DTensor ``parallelize_module``.

Plan for one transformer block (Shoeybi 2019 §3, Fig. 3; Korthikanti 2022 §4.2.2 for sequence parallel):

* attention: ``wq``/``wk``/``wv`` column-parallel (each rank owns ``heads/tp`` query heads and ``kv_heads/tp`` key/value
  heads; the model derives its local head count from tensor shapes), ``wo`` row-parallel.
* feed-forward: ``w1``/``w3`` column-parallel, ``w2`` row-parallel.
* That is one all-reduce in the forward (at the row-parallel output) and one in the backward (at the shared input of
  the column-parallel projections) per sublayer. The shared input is made a single DTensor *before* the three
  projections, so their three partial input-gradients add up as one ``Partial`` and are all-reduced once.
* ``sequence_parallel=True``: the residual stream between sublayers is sharded along the sequence dim (``Shard(1)``);
  norms (and residual dropout) run on the local slice; the all-reduce becomes an all-gather before the column-parallel
  projections and a reduce-scatter after the row-parallel one (same bytes, 1/tp of the activation memory).
* Options: vocab-parallel embedding (``RowwiseParallel`` on ``tok_embeddings``, input replicated) and loss-parallel
  cross entropy (the head's logits stay sharded on the vocab dim, ``Shard(-1)``; the loss must then be computed and
  back-propagated inside :func:`loss_parallel_context`).

Where the plan comes from (first match wins): a ``configure_tensor_parallel(mesh)`` method on the module (it applies
its own plan), a ``tp_plan`` dict (FQN -> ``ParallelStyle``) on the module, or the default plan for every Llama-shaped
submodule (``tok_embeddings`` -> ``layers`` ModuleDict of blocks -> ``norm`` -> ``output``, torchtitan names).

Every parameter ends up a DTensor on the tp mesh (sharded, or ``Replicate`` for norms/unsharded embeddings), so FSDP2
can be applied on the dp axes afterwards and see one uniform 2-D layout (torchtitan's order: TP first, then
``fully_shard`` over the dp mesh).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.placement_types import Placement

from lightning_v17.config import V17ConfigError, check_tp_divides

__all__ = [
    "apply_tensor_parallel",
    "check_tensor_parallel",
    "find_llama_modules",
    "llama_tp_plan",
    "loss_parallel_context",
]


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


def _config_dims(model: nn.Module) -> dict[str, int]:
    """Model dimensions TP must divide, read from ``model.config`` (a ModelConfig) or from the weight shapes."""
    cfg = getattr(model, "config", None)
    if cfg is not None and all(hasattr(cfg, k) for k in ("heads", "kv_heads", "ffn", "vocab_size")):
        return {"heads": cfg.heads, "kv_heads": cfg.kv_heads, "ffn": cfg.ffn, "vocab": cfg.vocab_size}
    block = next(iter(model.layers.values()))
    attn, ff = block.attention, block.feed_forward
    head_dim = getattr(attn, "head_dim", None)
    if head_dim is None:
        raise V17ConfigError(
            f"cannot read heads/kv_heads from {type(model).__name__}: give it a `config` with heads, kv_heads, ffn and "
            f"vocab_size, or a `head_dim` attribute on its attention, or provide tp_plan/configure_tensor_parallel"
        )
    emb = getattr(model, "tok_embeddings", None)
    out = getattr(model, "output", None)
    vocab = emb.num_embeddings if emb is not None else (out.out_features if out is not None else 1)
    return {
        "heads": attn.wq.out_features // head_dim,
        "kv_heads": attn.wk.out_features // head_dim,
        "ffn": ff.w1.out_features,
        "vocab": vocab,
    }


def check_tensor_parallel(
    model: nn.Module, *, tp: int, vocab_parallel: bool = False, loss_parallel: bool = False
) -> None:
    """Raise a :class:`V17ConfigError` listing the valid tp values unless ``tp`` divides the sharded dims.

    Args:
        model: a Llama-shaped module (``tok_embeddings``/``layers``/``norm``/``output``).
        tp: tensor-parallel size.
        vocab_parallel: the embedding is split along the vocab, so tp must divide it too.
        loss_parallel: the head's logits are split along the vocab, so tp must divide it too.
    """
    dims = _config_dims(model)
    named = {"num_attention_heads": dims["heads"], "num_key_value_heads": dims["kv_heads"], "ffn_hidden": dims["ffn"]}
    if vocab_parallel or loss_parallel:
        named["vocab_size"] = dims["vocab"]
    check_tp_divides(tp, **named)


def find_llama_modules(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """(prefix, module) for every Llama-shaped submodule (including ``module`` itself), outermost only."""
    found: list[tuple[str, nn.Module]] = []
    for name, sub in module.named_modules():
        if any(name.startswith(p + ".") or p == "" for p, _ in found):
            continue
        if isinstance(getattr(sub, "layers", None), nn.ModuleDict) and all(
            hasattr(sub, a) for a in ("tok_embeddings", "norm", "output")
        ):
            found.append((name, sub))
    return found


def _projection_roles(model: nn.Module) -> dict[str, str]:
    """FQN -> "colwise"/"rowwise", from the model's ``tensor_parallel_plan()`` if it has one (the reference Llama
    does), else the Megatron default for torchtitan names."""
    hook = getattr(model, "tensor_parallel_plan", None)
    if callable(hook):
        roles = dict(hook())
    else:
        # Megatron's roles (Shoeybi 2019 §3) under torchtitan's names, which the reference model also uses.
        from lightning_v17.models.llama import BLOCK_TP_PLAN, TOP_TP_PLAN

        roles = dict(TOP_TP_PLAN)
        for key in model.layers:
            roles.update({f"layers.{key}.{n}": r for n, r in BLOCK_TP_PLAN.items()})
    bad = {k: v for k, v in roles.items() if v not in ("colwise", "rowwise")}
    if bad:
        raise V17ConfigError(f"tensor_parallel_plan() roles must be 'colwise' or 'rowwise'; got {bad}")
    return roles


def llama_tp_plan(
    model: nn.Module,
    *,
    sequence_parallel: bool = False,
    vocab_parallel: bool = False,
    loss_parallel: bool = False,
) -> dict[str, ParallelStyle]:
    """The default TP plan for a Llama-shaped model, keyed by FQN relative to ``model``.

    Modules that a pipeline stage deleted (``tok_embeddings``/``norm``/``output`` set to None, blocks removed from
    ``layers``) are simply absent from the plan, so the same function serves a whole model and any PP stage.

    Args:
        model: the Llama (or a PP stage of it).
        sequence_parallel: shard norms and residual dropout along the sequence dim (Korthikanti 2022).
        vocab_parallel: split the embedding table along the vocab (``RowwiseParallel``, input replicated).
        loss_parallel: keep logits sharded on the vocab dim (``Shard(-1)``) for a vocab-parallel cross entropy.

    Returns:
        ``{fqn: ParallelStyle}`` for :func:`torch.distributed.tensor.parallel.parallelize_module`.
    """
    seq = Shard(1) if sequence_parallel else Replicate()
    roles = _projection_roles(model)
    plan: dict[str, ParallelStyle] = {}
    if getattr(model, "tok_embeddings", None) is not None:
        if vocab_parallel and roles.get("tok_embeddings") == "rowwise":
            # Each rank looks up its vocab slice (zeros elsewhere): the partial sums are all-reduced, or
            # reduce-scattered along the sequence under SP.
            plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
        else:
            plan["tok_embeddings"] = _ReplicateParallel(output_layout=seq)

    def norm_style() -> ParallelStyle:
        return SequenceParallel(use_local_output=False) if sequence_parallel else _ReplicateParallel()

    for key, block in model.layers.items():
        pre = f"layers.{key}"
        plan[f"{pre}.attention_norm"] = norm_style()
        plan[f"{pre}.ffn_norm"] = norm_style()
        # one DTensor input shared by the column-parallel projections: a single all-reduce (or reduce-scatter)
        # of its gradient in backward instead of one per projection
        plan[f"{pre}.attention"] = _PrepareFirstInput(input_layout=seq, desired_layout=Replicate())
        plan[f"{pre}.feed_forward"] = _PrepareFirstInput(input_layout=seq, desired_layout=Replicate())
        for fqn, role in roles.items():
            if not fqn.startswith(f"{pre}."):
                continue
            plan[fqn] = ColwiseParallel() if role == "colwise" else RowwiseParallel(output_layouts=seq)
        if sequence_parallel:
            # Residual dropout acts on the sequence-sharded local slice; as a DTensor op each shard draws its own mask.
            for name, child in block.named_children():
                if isinstance(child, nn.Dropout):
                    plan[f"{pre}.{name}"] = SequenceParallel(use_local_output=True)
    if getattr(model, "norm", None) is not None:
        plan["norm"] = norm_style()
    if getattr(model, "output", None) is not None:
        plan["output"] = ColwiseParallel(
            input_layouts=seq,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    if sequence_parallel:
        for name, child in model.named_children():
            if isinstance(child, nn.Dropout):
                plan[name] = SequenceParallel(use_local_output=True)
    return plan


def apply_tensor_parallel(
    module: nn.Module,
    *,
    tp_mesh: DeviceMesh,
    sequence_parallel: bool = False,
    vocab_parallel: bool = False,
    loss_parallel: bool = False,
) -> nn.Module:
    """Apply tensor (and sequence) parallelism in place over ``tp_mesh``; returns ``module``.

    Call it after the PP split and before activation checkpointing and ZeRO/FSDP2 (torchtitan's order). With a
    size-1 mesh it does nothing.

    Args:
        module: a LightningModule, a Llama, or a PP stage. Plan source, first match: ``module.configure_tensor_parallel
            (mesh)`` (the module applies its own plan), ``module.tp_plan`` (a dict FQN -> ParallelStyle), else the
            default plan of every Llama-shaped submodule (see :func:`llama_tp_plan`).
        tp_mesh: the 1-D "tp" mesh axis (``mesh["tp"]``).
        sequence_parallel: shard norms/dropout along the sequence dim (all-gather + reduce-scatter instead of the
            all-reduce; Korthikanti 2022 §4.2.2).
        vocab_parallel: split the embedding table along the vocab dim.
        loss_parallel: leave the logits sharded along the vocab dim; the loss and its backward must then run inside
            :func:`loss_parallel_context` (the pipeline engine does that itself).

    Raises:
        V17ConfigError: tp does not divide heads/kv_heads/ffn (or the vocab when vocab/loss parallel), naming the
            valid values; or the module has no plan.
    """
    tp = tp_mesh.size()
    if tp == 1:
        return module
    hook = getattr(module, "configure_tensor_parallel", None)
    if callable(hook):
        hook(tp_mesh)
        return module
    user_plan = getattr(module, "tp_plan", None)
    if isinstance(user_plan, dict) and user_plan:
        parallelize_module(module, tp_mesh, user_plan)
        return module
    llamas = find_llama_modules(module)
    if not llamas:
        raise V17ConfigError(
            f"tp={tp} needs a tensor-parallel plan but {type(module).__name__} has none: implement "
            f"configure_tensor_parallel(self, mesh) or set a `tp_plan` dict {{fqn: ParallelStyle}}, or use a model "
            f"with torchtitan-style names (tok_embeddings, layers ModuleDict, norm, output)"
        )
    for _, llama in llamas:
        check_tensor_parallel(llama, tp=tp, vocab_parallel=vocab_parallel, loss_parallel=loss_parallel)
        if getattr(getattr(llama, "config", None), "tie_embeddings", False) and (vocab_parallel or loss_parallel):
            raise V17ConfigError(
                "vocab_parallel/loss_parallel with tie_embeddings=True would shard the shared table two ways; "
                "set tie_embeddings=False or turn the vocab-parallel options off"
            )
        plan = llama_tp_plan(
            llama, sequence_parallel=sequence_parallel, vocab_parallel=vocab_parallel, loss_parallel=loss_parallel
        )
        parallelize_module(llama, tp_mesh, plan)
    return module


@contextlib.contextmanager
def loss_parallel_context(enabled: bool = True) -> Iterator[None]:
    """``torch.distributed.tensor.parallel.loss_parallel()`` when enabled, else nothing.

    With loss parallel the logits are a DTensor sharded on the vocab dim; ``F.cross_entropy`` and its backward must
    both run inside this context (wrap the training step's forward/loss and ``backward``).
    """
    if not enabled:
        yield
        return
    from torch.distributed.tensor.parallel import loss_parallel

    with loss_parallel():
        yield
