"""FP8 training: the blocks' ``nn.Linear`` layers run their three matmuls in float8 (the FP8 step of ``parallelize``).

A converted Linear computes ``output = input @ weight.T``, ``grad_input = grad_output @ weight`` and
``grad_weight = grad_output.T @ input`` as ``torch._scaled_mm`` on float8 operands with dynamic scales
(e4m3 forward, e5m2 for gradients under ``tensorwise``; e4m3 everywhere under ``rowwise``), accumulating and
returning the high-precision dtype; the master weights, the optimizer and everything outside the converted
Linears stay in high precision (Micikevicius 2022, "FP8 Formats for Deep Learning", §3-4; torchao's
``torchao/float8/README.md``, "float8 training"). The backend is torchao 0.18's
``convert_to_float8_training`` with ``Float8LinearConfig.from_recipe_name(recipe)``.

Which layers (DESIGN.md; docs/fp8.md "Which layers"):

* every ``nn.Linear`` inside the repeated blocks (the ZeRO-3 / recompute units, ``fsdp.find_wrap_units``) whose
  ``in_features`` and ``out_features`` both divide 16, the shape constraint of ``torch._scaled_mm`` (torchao's
  ``config.py``, ``pad_inner_dim``; cuBLASLt's FP8 GEMM). The others are kept and listed in ONE warning;
* never the embeddings, the output head or the norms: they sit outside the blocks (the head's logits and the first
  layer are the most precision-sensitive, Micikevicius 2022 §4.1; torchtitan keeps ``output`` high-precision too);
* never a module matching a user's ``fp8_skip`` pattern (``fnmatch`` on its FQN or an ancestor's).

Recipes: ``tensorwise`` and ``rowwise`` are torchao's dynamic scaling; ``delayed`` (scales from an amax history,
synced over dp and tp) is ours, ``engine/fp8/delayed.py``, since torchao 0.18 removed it.

Sharding:

* ZeRO-3 with ``tensorwise`` all-gathers the converted weights in float8 by default (``FP8Policy.all_gather``;
  torchao's ``enable_fsdp_float8_all_gather``: a quarter of the fp32 bytes). Each weight's scale is a function of the
  whole weight (amax all-reduced), computed for all weights in one all-reduce after every optimizer step
  (:meth:`FP8Runtime.after_optimizer_step`, torchao's ``precompute_float8_dynamic_scale_for_fsdp``), so every rank
  quantizes its shard exactly as one process quantizes the whole tensor. On gloo the float8 bytes travel as a
  ``uint8`` view (gloo has no float8 types: "Invalid scalar type"; ``engine/collectives.all_gather``). ``rowwise``
  gathers in its own dtype (torchao quantizes a rowwise weight along a different dim for each GEMM).
* tp > 1 (``tensorwise`` and ``delayed``; ``rowwise`` is refused): the conversion runs before TP. Under
  ``tensorwise`` the converted Linears get torchao's ``Float8ColwiseParallel``/``Float8RowwiseParallel`` in place of
  the plan's plain colwise/rowwise styles (:func:`float8_tp_plan`); under ``delayed`` they keep the plain styles and
  run their GEMMs on the local shards with scales from tp-synced amax histories (``engine/fp8/delayed.py``). The
  dims rule becomes "divisible by 16 x tp".
* pp > 1: the split runs first, so each stage converts its own blocks.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_v17._extras import require_installed
from lightning_v17.config import FP8Backend, FP8Policy, FP8Recipe, V17ConfigError

__all__ = [
    "FP8_DIM_MULTIPLE",
    "FP8Runtime",
    "FP8Selection",
    "apply_fp8",
    "float8_tp_plan",
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
    "capability >= 8.9: L4, L40, H100, H200, B200), or set FP8Policy(backend='torchao') (torchao float8, any "
    "device, CPU included)"
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

    torchao is an optional extra; the "delayed" recipe is ours and runs without it.

    Raises:
        V17ConfigError: ``fp8_backend='te'`` where Transformer Engine cannot run, naming the reason and the fix.
        MissingExtraError: torchao is needed (recipe "tensorwise" or "rowwise") and not installed.
    """
    if policy.backend in (FP8Backend.TORCHAO, FP8Backend.AUTO):
        if policy.recipe != FP8Recipe.DELAYED:
            feature = f"fp8={policy.recipe.value!r} (torchao's Float8Linear; fp8='delayed' needs no torchao)"
            require_installed("torchao", feature=feature)
        return FP8Backend.TORCHAO
    ok, why = transformer_engine_status(device)
    if not ok:
        raise V17ConfigError(f"FP8Policy(backend='te') needs Transformer Engine on an FP8 GPU, but {why}; {_TE_FIX}")
    return FP8Backend.TE


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


def select_fp8_linears(
    module: nn.Module, *, units: Sequence[nn.Module], skip: Sequence[str] = (), tp: int = 1
) -> FP8Selection:
    """Apply the layer rule (module doc) to ``module`` without changing it.

    Args:
        module: the model (FQNs are relative to it).
        units: its repeated blocks (``fsdp.find_wrap_units``).
        skip: ``fnmatch`` patterns; a Linear whose FQN, or an ancestor's FQN, matches one is kept.
        tp: tensor-parallel size: each rank's ``_scaled_mm`` sees one dim divided by tp, so both dims must divide
            ``16 * tp`` (conservative: the rule does not ask which dim the plan splits).

    Raises:
        V17ConfigError: a ``skip`` pattern that matches no module of ``module`` (a typo would silently convert).
    """
    names = {id(m): n for n, m in module.named_modules()}
    fqns = list(names.values())
    unmatched = [p for p in skip if not any(_skipped(f, [p]) for f in fqns if f)]
    if unmatched:
        raise V17ConfigError(
            f"FP8Policy(skip={list(skip)}): {unmatched} match no module of {type(module).__name__}; patterns are "
            f"fnmatch on FQNs such as {[f for f in fqns if f][:4]}"
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
        elif m.in_features % (FP8_DIM_MULTIPLE * tp) or m.out_features % (FP8_DIM_MULTIPLE * tp):
            dims.append((fqn, m.in_features, m.out_features))
        else:
            convert.append(fqn)
    return FP8Selection(tuple(convert), tuple(dims), tuple(by_skip), tuple(outside))


def float8_config(policy: FP8Policy, *, all_gather: bool = False):
    """torchao's ``Float8LinearConfig`` for the policy's recipe; ``all_gather``: FSDP2 gathers the weights in float8
    (``enable_fsdp_float8_all_gather``, tensorwise only)."""
    import dataclasses

    from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig.from_recipe_name(policy.recipe.value)
    return dataclasses.replace(config, enable_fsdp_float8_all_gather=True) if all_gather else config


@dataclass
class FP8Runtime:
    """What the FP8 step did to a model, and what it needs at run time (``Parallelized.fp8``).

    Attributes:
        module: the converted model.
        layers: FQNs of the converted Linears.
        float8_all_gather: ZeRO-3 gathers their weights in float8; their scales are then computed once per step,
            after the optimizer step, for all weights in one all-reduce (:meth:`after_optimizer_step`), and once
            at set-up. A caller of ``parallelize`` must call :meth:`after_optimizer_step` after every optimizer
            step (V17Strategy does): the precomputed scales would otherwise stay those of the old weights.
        delayed: the layers use delayed scaling (``engine/fp8/delayed.py``): :meth:`after_optimizer_step` folds the
            step's amaxes into their histories.
        amax_groups: the process groups the delayed amaxes are all-reduced over with MAX (the dp and tp axes).
    """

    module: nn.Module
    layers: tuple[str, ...]
    float8_all_gather: bool = False
    delayed: bool = False
    amax_groups: tuple[Any, ...] = ()

    def init_state(self) -> None:
        """``delayed``: fresh amax histories and scales (after ZeRO-3 materialized a meta-device model, whose buffers
        hold uninitialized memory)."""
        if self.delayed:
            from lightning_v17.engine.fp8.delayed import delayed_layers

            for m in delayed_layers(self.module):
                m.reset_fp8_state()

    def refresh_weight_scales(self) -> None:
        """After every optimizer step and after a checkpoint load: with float8 all-gather, compute each
        weight's tensorwise scale from its new values now, all weights in one all-reduce of their amaxes
        (torchao's ``precompute_float8_dynamic_scale_for_fsdp``), instead of one all-reduce per weight inside
        every all-gather. The scale is a function of the whole weight, so every rank casts its shard with the
        scale one process would use for the whole tensor.

        At set-up too: before any precomputed scale exists, torchao's all-gather reduces each weight's amax over the
        FSDP mesh only, which under TP is a tp shard's amax (each tp rank would then quantize with its own scale).
        """
        if self.float8_all_gather:
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            precompute_float8_dynamic_scale_for_fsdp(self.module)

    def after_optimizer_step(self) -> None:
        """Called once after every optimizer step (V17Strategy.optimizer_step): :meth:`refresh_weight_scales`, and
        for ``delayed`` the step's amaxes, all-reduced with MAX over :attr:`amax_groups`, pushed into the histories
        and the scales recomputed (``fp8_delayed.update_scales``)."""
        self.refresh_weight_scales()
        if self.delayed:
            from lightning_v17.engine.fp8.delayed import update_scales

            update_scales(self.module, groups=self.amax_groups)


def apply_fp8(
    module: nn.Module,
    *,
    policy: FP8Policy,
    units: Sequence[nn.Module],
    device: torch.device | str,
    float8_all_gather: bool = False,
    tp: int = 1,
) -> tuple[str, ...]:
    """Swap the selected ``nn.Linear`` layers of ``module`` for torchao ``Float8Linear`` in place (FQNs and the
    weight ``Parameter`` objects unchanged, so meta-device models, ZeRO and checkpoints see the same parameters).

    Args:
        module: the model, after PP split and activation checkpointing, before ZeRO (module doc).
        policy: the FP8 policy.
        units: the repeated blocks; only Linears inside them are converted.
        device: this rank's device (decides ``fp8_backend='auto'``).
        float8_all_gather: the weights become torchao's ``WeightWithDynamicFloat8CastTensor``, which FSDP2 (applied
            next) all-gathers in float8 (``FP8Policy.float8_all_gather``).
        tp: tensor-parallel size (the dims rule becomes "divisible by 16 x tp"; see :func:`select_fp8_linears`).

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
            "FP8Policy(backend='te'): the Transformer Engine path (te.fp8_autocast with the data-parallel fp8_group) "
            "is not implemented in this version; set FP8Policy(backend='torchao') (or 'auto')"
        )
    what = f"fp8={policy.recipe.value!r}"
    if not units:
        raise V17ConfigError(
            f"{what} converts the Linears of each repeated block, but {type(module).__name__} has no repeated blocks "
            "(no nn.ModuleList/ModuleDict of blocks was found); name the block classes with wrap_classes=[...]"
        )
    sel = select_fp8_linears(module, units=units, skip=policy.skip, tp=tp)
    multiple = f"{FP8_DIM_MULTIPLE}" if tp == 1 else f"{FP8_DIM_MULTIPLE} x tp={tp} = {FP8_DIM_MULTIPLE * tp}"
    if sel.kept_for_dims:
        listed = ", ".join(f"{f} (in_features={i}, out_features={o})" for f, i, o in sel.kept_for_dims)
        warnings.warn(
            f"{what}: {len(sel.kept_for_dims)} Linear layer(s) stay in high precision because torch._scaled_mm needs "
            f"in_features and out_features divisible by {multiple}: {listed}",
            UserWarning,
            stacklevel=2,
        )
    if not sel.convert:
        raise V17ConfigError(
            f"{what} would convert no Linear of {type(module).__name__} (kept for dims: {len(sel.kept_for_dims)}, by "
            f"FP8Policy(skip=...): {len(sel.kept_by_skip)}); drop fp8, or loosen FP8Policy(skip=...)"
        )
    if policy.recipe == FP8Recipe.DELAYED:
        from lightning_v17.engine.fp8.delayed import convert_to_delayed

        convert_to_delayed(module, sel.convert, history_len=policy.history_len)
        return sel.convert
    from torchao.float8 import convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    done = {n for n, m in module.named_modules() if isinstance(m, Float8Linear)}
    chosen = set(sel.convert) - done  # idempotent: a Float8Linear is an nn.Linear too, never wrapped twice
    config = float8_config(policy, all_gather=float8_all_gather)
    convert_to_float8_training(module, module_filter_fn=lambda _m, fqn: fqn in chosen, config=config)
    return sel.convert


def _float8_style(fqn: str, style: Any, *, delayed: bool = False) -> Any:
    """torchao's float8 twin of a plain ``ColwiseParallel``/``RowwiseParallel`` (same layouts), for a converted
    Linear. Its input is cast to float8 as a DTensor (one amax over the whole replicated input, as one process
    computes it), its weight shard with the all-reduced amax of the whole weight, and the gradient of its output
    likewise (``NoopFwToFloat8BwDynamic``), so every rank quantizes as one process would. ``delayed``: the plain
    style itself, checked (the layer scales from tp-synced histories, no per-cast reduction)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    kind = {ColwiseParallel: Float8ColwiseParallel, RowwiseParallel: Float8RowwiseParallel}.get(type(style))
    if delayed:  # the plain style: the delayed Linear casts its local shards itself (engine/fp8/delayed.py)
        if kind is None:
            raise V17ConfigError(
                f"fp8='delayed' with tensor parallelism: {fqn!r} is converted to float8 but its tensor-parallel "
                f"style is {type(style).__name__}; the delayed float8 Linear runs under the plain 'colwise'/'rowwise' "
                f"styles only; give it one of those, or keep it in high precision with FP8Policy(skip=[{fqn!r}])"
            )
        return style
    if kind is None:
        if isinstance(style, (Float8ColwiseParallel, Float8RowwiseParallel)):
            return style
        raise V17ConfigError(
            f"fp8 with tensor parallelism: {fqn!r} is converted to float8 but its tensor-parallel style "
            f"{type(style).__name__} has no float8 version (torchao has Float8ColwiseParallel and "
            f"Float8RowwiseParallel, for plain colwise/rowwise styles); keep it in high precision with "
            f"FP8Policy(skip=[{fqn!r}]), or give it a 'colwise'/'rowwise' style"
        )
    return kind(
        input_layouts=style.input_layouts[0], output_layouts=style.output_layouts[0],
        use_local_output=style.use_local_output,
    )  # fmt: skip


def float8_tp_plan(module: nn.Module, plan: Any, *, layers: Sequence[str]) -> Any:
    """The tensor-parallel plan with torchao's float8 styles for the converted Linears ``layers`` (torchao
    ``float8_tensor_parallel``; torchtitan's ``apply_tp`` with float8): called after :func:`apply_fp8`, before
    ``apply_tensor_parallel``. Delayed-scaling Linears keep their plain colwise/rowwise styles (checked).

    Args:
        module: the converted model (plan keys are relative to it).
        plan: ``{fqn: style}`` (wildcards, style names) or a model's own plan object with ``styles`` (a
            ``ModelTPPlan``, returned with its styles replaced).
        layers: FQNs of the converted Linears.

    Raises:
        V17ConfigError: a plan given as a callable (a ``configure_tensor_parallel`` hook: its styles cannot be
            checked here); a converted Linear whose style has no float8 version.
    """
    import dataclasses
    from collections.abc import Mapping

    from lightning_v17.engine.tp.apply import expand_plan

    styles = plan.styles if dataclasses.is_dataclass(plan) and hasattr(plan, "styles") else plan
    if not isinstance(styles, Mapping):
        raise V17ConfigError(
            "fp8 with tp > 1 needs the tensor-parallel plan as {fqn: style} (TPPolicy(plan=...), a tp_plan dict on "
            "the LightningModule, or the model's own plan) so that V17 can give the converted Linears torchao's "
            "float8 styles; a configure_tensor_parallel hook applies its own styles. Return a tp_plan dict instead, "
            "or drop fp8"
        )
    chosen = set(layers)
    expanded = expand_plan(module, styles)
    from lightning_v17.engine.fp8.delayed import DelayedFloat8Linear

    delayed = {n for n, m in module.named_modules() if isinstance(m, DelayedFloat8Linear)}
    swapped = {f: _float8_style(f, st, delayed=f in delayed) if f in chosen else st for f, st in expanded.items()}
    return dataclasses.replace(plan, styles=swapped) if styles is not plan else swapped
