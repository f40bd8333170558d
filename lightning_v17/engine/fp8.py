"""FP8 training: the blocks' ``nn.Linear`` layers run their three matmuls in float8 (the FP8 step of ``parallelize``).

A converted Linear computes ``output = input @ weight.T``, ``grad_input = grad_output @ weight`` and
``grad_weight = grad_output.T @ input`` as ``torch._scaled_mm`` on float8 operands with dynamic scales
(e4m3 forward, e5m2 for gradients under ``tensorwise``; e4m3 everywhere under ``rowwise``), accumulating and
returning the high-precision dtype; the master weights, the optimizer and everything outside the converted
Linears stay in high precision (Micikevicius 2022, "FP8 Formats for Deep Learning", §3-4; torchao's
``torchao/float8/README.md``, "float8 training"). The backend is torchao 0.18's
``convert_to_float8_training`` with ``Float8LinearConfig.from_recipe_name(recipe)``.

Which layers (DESIGN.md, issue 12 "Which layers go to FP8"):

* every ``nn.Linear`` inside the repeated blocks (the ZeRO-3 / recompute units, ``fsdp.find_wrap_units``) whose
  ``in_features`` and ``out_features`` both divide 16, the shape constraint of ``torch._scaled_mm`` (torchao's
  ``config.py``, ``pad_inner_dim``; cuBLASLt's FP8 GEMM). The others are kept and listed in ONE warning;
* never the embeddings, the output head or the norms: they sit outside the blocks (the head's logits and the first
  layer are the most precision-sensitive, Micikevicius 2022 §4.1; torchtitan keeps ``output`` high-precision too);
* never a module matching a user's ``fp8_skip`` pattern (``fnmatch`` on its FQN or an ancestor's).

Sharding: under ZeRO-3 FSDP2 all-gathers the fp32 (or ``param_dtype``) weights and each Linear casts the whole
gathered weight to float8, so every rank quantizes exactly as a single process would. FSDP2's float8 all-gather
(torchao's ``enable_fsdp_float8_all_gather``, a quarter of the bytes) is a later slice: on gloo it fails with
"Invalid scalar type" and needs the float8 bytes gathered as a ``uint8`` view (DESIGN.md, "FP8 on CPU"). tp > 1
(torchao's ``Float8ColwiseParallel``/``Float8RowwiseParallel`` styles) is a later slice too and refused here.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from lightning_v17.config import FP8Backend, FP8Policy, V17ConfigError

__all__ = [
    "FP8_DIM_MULTIPLE",
    "FP8Selection",
    "apply_fp8",
    "check_fp8_composition",
    "resolve_fp8_backend",
    "select_fp8_linears",
    "transformer_engine_status",
]

#: ``torch._scaled_mm`` needs the inner and outer GEMM dims to be multiples of 16 (torchao ``config.py``:
#: "_scaled_mm ... has the strong constraint that for M,N,K N, K must be a multiple of 16").
FP8_DIM_MULTIPLE = 16
#: Transformer Engine's FP8 GEMMs need Ada (8.9) or Hopper (9.0) tensor cores or newer.
TE_MIN_CAPABILITY = (8, 9)

_TE_FIX = (
    "install transformer-engine (pip install 'transformer-engine[pytorch]') on a GPU with FP8 support (compute "
    "capability >= 8.9: L4, L40, H100, H200, B200), or set fp8_backend='torchao' (torchao float8, any device, CPU "
    "included)"
)


def transformer_engine_status(device: torch.device | str) -> tuple[bool, str]:
    """Whether Transformer Engine can run FP8 on ``device``, and if not why (for the error message)."""
    device = torch.device(device)
    if device.type != "cuda":
        return False, f"this run's device is {device.type!r}, not a CUDA GPU"
    if not torch.cuda.is_available():
        return False, "CUDA is not available"
    cap = torch.cuda.get_device_capability(device)
    if tuple(cap) < TE_MIN_CAPABILITY:
        return False, f"the GPU's compute capability is {cap[0]}.{cap[1]} < 8.9 (no FP8 tensor cores)"
    if importlib.util.find_spec("transformer_engine") is None:
        return False, "transformer_engine is not installed"
    return True, f"Transformer Engine on compute capability {cap[0]}.{cap[1]}"


def resolve_fp8_backend(policy: FP8Policy, device: torch.device | str) -> FP8Backend:
    """``policy.backend`` for ``device``. "auto" is torchao in this version, on every device: the Transformer Engine
    path is not implemented yet, and "auto" must never pick a path that then refuses to run (once it exists, "auto"
    will pick Transformer Engine where it is installed and the device has FP8 tensor cores, compute capability >= 8.9).

    Raises:
        V17ConfigError: ``fp8_backend='te'`` where Transformer Engine cannot run, naming the reason and the fix.
    """
    if policy.backend in (FP8Backend.TORCHAO, FP8Backend.AUTO):
        return FP8Backend.TORCHAO
    ok, why = transformer_engine_status(device)
    if not ok:
        raise V17ConfigError(f"fp8_backend='te' needs Transformer Engine on an FP8 GPU, but {why}; {_TE_FIX}")
    return FP8Backend.TE


def check_fp8_composition(policy: FP8Policy | None, *, tp: int) -> None:
    """The FP8 combinations refused before any process touches the model.

    Raises:
        V17ConfigError: fp8 with tp > 1 (torchao's float8 tensor-parallel styles are not wired in yet).
    """
    if policy is not None and tp > 1:
        raise V17ConfigError(
            f"fp8={policy.recipe.value!r} with tp={tp} is not supported yet (torchao's float8 tensor-parallel styles "
            "are the next step); use fp8 with tp=1 (any zero_stage, pp), or drop fp8 for tp > 1"
        )


@dataclass(frozen=True)
class FP8Selection:
    """Which ``nn.Linear`` FQNs go to float8, and why the others do not.

    Attributes:
        convert: block Linears that are converted.
        kept_for_dims: ``(fqn, in_features, out_features)`` of block Linears kept because a dim does not divide 16.
        kept_by_skip: block Linears kept because they match a ``fp8_skip`` pattern.
        outside_blocks: Linears outside the repeated blocks (the output head, ...), always kept.
    """

    convert: tuple[str, ...]
    kept_for_dims: tuple[tuple[str, int, int], ...]
    kept_by_skip: tuple[str, ...]
    outside_blocks: tuple[str, ...]


def _skipped(fqn: str, patterns: Sequence[str]) -> bool:
    parts = fqn.split(".")
    prefixes = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return any(fnmatch.fnmatchcase(p, pat) for p in prefixes for pat in patterns)


def select_fp8_linears(module: nn.Module, *, units: Sequence[nn.Module], skip: Sequence[str] = ()) -> FP8Selection:
    """Apply the layer rule (module doc) to ``module`` without changing it.

    Args:
        module: the model (FQNs are relative to it).
        units: its repeated blocks (``fsdp.find_wrap_units``).
        skip: ``fnmatch`` patterns; a Linear whose FQN, or an ancestor's FQN, matches one is kept.

    Raises:
        V17ConfigError: a ``skip`` pattern that matches no module of ``module`` (a typo would silently convert).
    """
    names = {id(m): n for n, m in module.named_modules()}
    fqns = list(names.values())
    unmatched = [p for p in skip if not any(_skipped(f, [p]) for f in fqns if f)]
    if unmatched:
        raise V17ConfigError(
            f"fp8_skip={list(skip)}: {unmatched} match no module of {type(module).__name__}; patterns are fnmatch "
            f"on FQNs such as {[f for f in fqns if f][:4]}"
        )
    in_blocks: set[str] = set()
    for unit in units:
        prefix = names[id(unit)]
        for sub, m in unit.named_modules():
            if isinstance(m, nn.Linear):
                in_blocks.add(f"{prefix}.{sub}" if sub else prefix)
    convert, dims, by_skip, outside = [], [], [], []
    for fqn, m in module.named_modules():
        if not isinstance(m, nn.Linear):
            continue
        if fqn not in in_blocks:
            outside.append(fqn)
        elif _skipped(fqn, skip):
            by_skip.append(fqn)
        elif m.in_features % FP8_DIM_MULTIPLE or m.out_features % FP8_DIM_MULTIPLE:
            dims.append((fqn, m.in_features, m.out_features))
        else:
            convert.append(fqn)
    return FP8Selection(tuple(convert), tuple(dims), tuple(by_skip), tuple(outside))


def float8_config(policy: FP8Policy):
    """torchao's ``Float8LinearConfig`` for the policy's recipe (float8 all-gather off: see the module doc)."""
    from torchao.float8 import Float8LinearConfig

    return Float8LinearConfig.from_recipe_name(policy.recipe.value)


def apply_fp8(
    module: nn.Module, *, policy: FP8Policy, units: Sequence[nn.Module], device: torch.device | str
) -> tuple[str, ...]:
    """Swap the selected ``nn.Linear`` layers of ``module`` for torchao ``Float8Linear`` in place (FQNs and the
    weight ``Parameter`` objects unchanged, so meta-device models, ZeRO and checkpoints see the same parameters).

    Args:
        module: the model, after PP split and activation checkpointing, before ZeRO (module doc).
        policy: the FP8 policy.
        units: the repeated blocks; only Linears inside them are converted.
        device: this rank's device (decides ``fp8_backend='auto'``).

    Returns:
        The FQNs of the converted Linears.

    Raises:
        V17ConfigError: ``fp8_backend='te'`` where Transformer Engine cannot run or is chosen (its path is not
            implemented yet), a model without repeated blocks, a selection that converts nothing, an unmatched
            ``fp8_skip`` pattern.
    """
    backend = resolve_fp8_backend(policy, device)
    if backend == FP8Backend.TE:
        raise V17ConfigError(
            "fp8_backend='te': the Transformer Engine path (te.fp8_autocast with the data-parallel fp8_group) is not "
            "implemented in this version; set fp8_backend='torchao' (or 'auto')"
        )
    what = f"fp8={policy.recipe.value!r}"
    if not units:
        raise V17ConfigError(
            f"{what} converts the Linears of each repeated block, but {type(module).__name__} has no repeated blocks "
            "(no nn.ModuleList/ModuleDict of blocks was found); name the block classes with wrap_classes=[...]"
        )
    sel = select_fp8_linears(module, units=units, skip=policy.skip)
    if sel.kept_for_dims:
        listed = ", ".join(f"{f} (in={i}, out={o})" for f, i, o in sel.kept_for_dims)
        warnings.warn(
            f"{what}: {len(sel.kept_for_dims)} Linear layer(s) stay in high precision because torch._scaled_mm needs "
            f"in_features and out_features divisible by {FP8_DIM_MULTIPLE}: {listed}",
            UserWarning,
            stacklevel=2,
        )
    if not sel.convert:
        raise V17ConfigError(
            f"{what} would convert no Linear of {type(module).__name__} (kept for dims: {len(sel.kept_for_dims)}, by "
            f"fp8_skip: {len(sel.kept_by_skip)}); drop fp8, or loosen fp8_skip"
        )
    from torchao.float8 import convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    done = {n for n, m in module.named_modules() if isinstance(m, Float8Linear)}
    chosen = set(sel.convert) - done  # idempotent: a Float8Linear is an nn.Linear too, never wrapped twice
    convert_to_float8_training(module, module_filter_fn=lambda _m, fqn: fqn in chosen, config=float8_config(policy))
    return sel.convert
