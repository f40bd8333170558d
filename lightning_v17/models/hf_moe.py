"""Hugging Face MoE models under V17's expert parallelism, unchanged but for one adapter: the sparse MoE blocks of
transformers' fused-experts families (Mixtral, Qwen3-MoE, DeepSeek-V3, ...) become engine MoE layers.

transformers 5 stores a block's routed experts as one module (decorated with ``@use_experts_implementation``) with
3-D weights, ``gate_up_proj`` [E, 2I, H] (the gate rows, then the up rows) and ``down_proj`` [E, H, I], applied as
``x @ W.T``, and calls it as ``experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]`` after
the block's own router (``gate``). :func:`adapt_hf_moe` keys on that layout, not on class names, and replaces only
the experts' computation, on the instance: the router, DeepSeek-V3's shared experts, its ``e_score_correction_bias``
and group-limited routing stay transformers' code, and the module, its parameters and their FQNs stay, so
checkpoints, ``state_dict`` and ``save_pretrained`` are unchanged.

The adapted forward, for ``T`` tokens and top-``k`` routing (dropless: every assignment is kept):

1. one row per (token, slot) assignment, token-major then slot (``token_of = arange(T).repeat_interleave(k)``);
2. the rows through the block's ``dispatcher``: the engine's all-to-all under ``ep > 1`` (set by
   :func:`~lightning_v17.engine.ep.apply.apply_expert_parallel`), else
   :class:`~lightning_v17.models.moe.LocalDispatch` (stable sort by expert, run, unsort). Either runs the *local*
   experts (the weights' local dim 0, ``E / ep`` of them under ep) as one grouped GEMM per projection, with the
   experts' own gate (``_apply_gate``: ``act_fn(gate) * up`` unless the family overrides it);
3. ``out = zeros.index_add_(0, token_of, y * weight_of[:, None])``, accumulated in the promoted dtype of the rows
   and the router weights (fp32 for a bf16 model with an fp32 router, as transformers' own ``grouped_mm`` does),
   then cast to the hidden states' dtype.

Because each expert receives its rows in the same order in one process and under the all-to-all (GShard, Lepikhin
2020 §3.2: the dispatcher keeps token order within an expert), a rank's expert outputs and weight gradients equal
one process's on the concatenated batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lightning_v17.config import V17ConfigError
from lightning_v17.engine._dtensor import local
from lightning_v17.models.moe import LocalDispatch

__all__ = ["adapt_hf_moe", "is_fused_experts"]

#: the ``@use_experts_implementation`` flags and the values the adapter computes (transformers' defaults):
#: concatenated [gate; up] rows, [E, out, in] weights, no biases, a gate, no norm after the experts
_SUPPORTED_FLAGS = {"is_concatenated": True, "is_transposed": False, "has_bias": False, "has_gate": True,
                    "has_post_expert_norm": False}  # fmt: skip


def is_fused_experts(m: nn.Module) -> bool:
    """Whether ``m`` has transformers' fused experts layout: ``num_experts``, ``act_fn``, and 3-D ``gate_up_proj``
    [E, 2I, H] and ``down_proj`` [E, H, I] whose shapes agree."""
    gu, down, e = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None), getattr(m, "num_experts", None)
    if not (isinstance(gu, torch.Tensor) and isinstance(down, torch.Tensor) and isinstance(e, int)):
        return False
    if gu.dim() != 3 or down.dim() != 3 or not hasattr(m, "act_fn"):
        return False
    (e1, two_i, h), (e2, h2, i) = gu.shape, down.shape
    return e1 == e2 == e and h == h2 and two_i == 2 * i


def _has_3d_expert_weights(m: nn.Module) -> bool:
    """Experts fused on dim 0 in some layout: a parameter of ``m`` itself with 3 dims."""
    return any(p.dim() == 3 for p in m.parameters(recurse=False))


def _named(root: nn.Module, name: str, block: nn.Module) -> str:
    """The block for messages, ``<model_type>: <class> (<fqn>)``, with the first Hugging Face config's type."""
    for m in (block, root, *root.modules()):
        model_type = getattr(getattr(m, "config", None), "model_type", None)
        if isinstance(model_type, str):
            return f"{model_type}: {type(block).__name__} ({name})"
    return f"{type(block).__name__} ({name})"


def _grouped_linear(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``x`` rows grouped by expert (group g ends at ``offs[g]``) times ``w[g].T``: one ``torch._grouped_mm``."""
    y = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    if y.requires_grad:  # its CPU backward refuses a non-contiguous (e.g. zero-stride) incoming gradient
        y.register_hook(lambda g: g.contiguous())
    return y


class _LocalExperts:
    """The local experts of a fused experts module as the dispatchers call them: ``(rows grouped by local expert,
    counts per local expert) -> rows``, expert e computing ``down_e(gate(gate_up_e x))``.

    The local experts are the weights' local dim 0 (:func:`~lightning_v17.engine._dtensor.local`: differentiable,
    the whole tensor when they are not sharded). ``torch._grouped_mm`` needs 16-byte-aligned strides (H and I
    multiples of 4 in fp32, of 8 in bf16) and at least one row; otherwise a per-expert loop computes the same
    products (every expert visited, so the weights stay in the graph even with no rows: under ep > 1 a rank with
    none still joins its experts' gradient reduction).
    """

    def __init__(self, experts: nn.Module) -> None:
        self.experts = experts
        self.num_experts = local(experts.gate_up_proj).shape[0]  # LocalDispatch counts rows per local expert

    def _gate(self, gate_up_out: torch.Tensor) -> torch.Tensor:
        """The experts' own gate (``_apply_gate``, which ``@use_experts_implementation`` adds and a family may
        override), else transformers' default ``act_fn(gate) * up``."""
        apply_gate = getattr(self.experts, "_apply_gate", None)
        if apply_gate is not None:
            return apply_gate(gate_up_out)
        gate, up = gate_up_out.chunk(2, dim=-1)
        return self.experts.act_fn(gate) * up

    def __call__(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        m = self.experts
        gate_up, down = local(m.gate_up_proj), local(m.down_proj)
        x = x.to(gate_up.dtype)
        aligned = all(n * x.element_size() % 16 == 0 for n in (gate_up.shape[-1], down.shape[-1]))
        if not aligned or x.shape[0] == 0:
            return self._loop(x, counts, gate_up, down)
        offs = counts.cumsum(0).to(torch.int32)
        return _grouped_linear(self._gate(_grouped_linear(x, gate_up, offs)), down, offs)

    def _loop(self, x: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        outs, start = [], 0
        for e, n in enumerate(counts.tolist()):
            outs.append(F.linear(self._gate(F.linear(x[start : start + n], gate_up[e])), down[e]))
            start += n
        return torch.cat(outs)


class _DispatchedForward:
    """The adapted experts' forward (an instance attribute, so the class and every other instance keep theirs):
    ``(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]`` through ``block.dispatcher``.

    A plain object holding the experts module and its block (not a closure), so ``copy.deepcopy`` and pickling
    carry it to the copy's own block and dispatcher.
    """

    def __init__(self, experts: nn.Module, block: nn.Module) -> None:
        self.experts, self.block = experts, block

    def __call__(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        t, k = top_k_index.shape
        token_of = torch.arange(t, device=hidden.device).repeat_interleave(k)  # (token, slot) order, nothing dropped
        expert_of, weight_of = top_k_index.reshape(-1), top_k_weights.reshape(-1)
        dispatch = self.block.dispatcher if self.block.dispatcher is not None else LocalDispatch()
        y = dispatch(hidden[token_of], expert_of, _LocalExperts(self.experts))
        weighted = y * weight_of[:, None]  # promoted, as transformers weights the rows before summing them
        out = weighted.new_zeros((t, weighted.shape[-1])).index_add_(0, token_of, weighted)
        return out.to(hidden.dtype)


def _check_layout(root: nn.Module, name: str, block: nn.Module, experts: nn.Module) -> None:
    """Raise if ``experts`` cannot be split into whole experts the way :class:`_LocalExperts` computes them."""
    if isinstance(experts, nn.ModuleList):
        raise V17ConfigError(
            f"{_named(root, name, block)} keeps its experts as a ModuleList of per-expert MLPs; "
            "ep > 1 needs fused 3-D experts (gate_up_proj [E, 2I, H], down_proj [E, H, I]), as transformers >= 5 "
            "stores Mixtral, Qwen3-MoE and DeepSeek-V3: upgrade transformers, or use ep=1"
        )
    if not is_fused_experts(experts):
        shapes = {n: tuple(p.shape) for n, p in experts.named_parameters(recurse=False)}
        raise V17ConfigError(
            f"{_named(root, name, block)}: its experts {type(experts).__name__} have 3-D weights {shapes} but not "
            "the fused layout ep > 1 runs (num_experts, act_fn, gate_up_proj [E, 2I, H], down_proj [E, H, I]); use ep=1"
        )
    bad = {f: getattr(experts, f) for f, want in _SUPPORTED_FLAGS.items() if getattr(experts, f, want) != want}
    if bad:
        raise V17ConfigError(
            f"{_named(root, name, block)}: its experts {type(experts).__name__} have {bad}; ep > 1 runs fused "
            f"experts with {_SUPPORTED_FLAGS}; use ep=1 for this model"
        )
    if getattr(experts, "_is_expert_parallel", False):
        raise V17ConfigError(
            f"{_named(root, name, block)}: its experts are already split by transformers' own expert "
            "parallelism (a distributed_config / tp_plan with ep); load the model without it and let V17's ep shard "
            "the experts"
        )


def adapt_hf_moe(module: nn.Module) -> list[str]:
    """Make every sparse MoE block of a Hugging Face model an engine MoE layer; returns the blocks' FQNs.

    A block is a module with an ``experts`` child. For fused experts (:func:`is_fused_experts`) the block gets
    ``num_experts`` and ``dispatcher = None`` (one process: the local sort), and its experts module a forward that
    dispatches through it (see the module docstring); the engine's
    :func:`~lightning_v17.engine.ep.apply.find_moe_layers` then finds the block, and ``apply_expert_parallel``
    shards the experts and sets the dispatcher. Blocks that already have a ``dispatcher`` of their own (the
    reference model's :class:`~lightning_v17.models.moe.MoE`) are left alone. Idempotent: a second call changes
    nothing and returns the same FQNs.

    Args:
        module: any module holding a Hugging Face model (a ``*ForCausalLM``, a LightningModule around one, ...).

    Returns:
        The FQNs (in ``module``) of the blocks adapted, in module order; ``[]`` for a model without MoE blocks.

    Raises:
        V17ConfigError: a MoE block whose experts are a ``ModuleList`` of per-expert MLPs (transformers 4.x and
            other families), 3-D experts in another layout, fused experts with biases, transposed or interleaved
            weights, no gate or a post-expert norm, or experts already split by transformers' own expert
            parallelism: named, with what ``ep > 1`` needs.
    """
    done = []
    for name, block in module.named_modules():
        experts = getattr(block, "experts", None)
        if not isinstance(experts, nn.Module):
            continue
        forward = experts.__dict__.get("forward")
        if isinstance(forward, _DispatchedForward) and forward.block is block:
            done.append(name)  # adapted before
            continue
        if hasattr(block, "dispatcher"):
            continue  # an engine MoE layer of its own
        if not (isinstance(experts, nn.ModuleList) or is_fused_experts(experts) or _has_3d_expert_weights(experts)):
            continue  # an `experts` child that holds no routed experts we would shard
        _check_layout(module, name, block, experts)
        num = experts.num_experts
        if getattr(block, "num_experts", num) != num:
            raise V17ConfigError(
                f"{_named(module, name, block)} has num_experts={block.num_experts} but its experts hold {num}; "
                "ep > 1 shards the experts' weights on dim 0 and needs both to agree"
            )
        block.num_experts = num
        block.dispatcher = None
        experts.forward = _DispatchedForward(experts, block)
        done.append(name)
    return done
