"""Every composition rule, once: which combinations of options cannot work, the options each names, and the fix.

Torch-free vocabulary. The strategy raises from this table at construction (:func:`check`), the engine's
``parallelize`` checks it again for callers that build policies themselves, and the planner warns from it
(:func:`violations`). A rule is a row ``(name, options, violated, message, fix, example)``: ``example`` is a set of
``V17Strategy`` arguments that violates it (a policy written as the dict of its fields, the YAML spelling), which
``tests/unit/test_rules.py`` constructs for every row. ``options`` name the options as the user writes them: a
``V17Strategy`` argument (``pp``, ``zero_stage``) or a policy's field as ``Policy.field`` (``OffloadPolicy.params``),
which the messages spell as the call, ``OffloadPolicy(params='cpu')`` (:func:`option_text`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from lightning_v17.config.errors import V17ConfigError
from lightning_v17.config.mesh_spec import ParallelDims

__all__ = ["RULES", "Layout", "Rule", "check", "option_text", "violations"]


@dataclass(frozen=True)
class Layout:
    """What the rules look at: the parsed policy and the axis sizes.

    Attributes:
        policy: the :class:`~lightning_v17.config.TrainingPolicy`.
        dims: the axis sizes (:class:`~lightning_v17.config.ParallelDims`, or the ``MeshSpec`` it resolved to).
    """

    policy: Any
    dims: ParallelDims = field(default_factory=ParallelDims)

    @property
    def stage(self) -> int:
        return self.policy.zero.stage

    @property
    def pp(self) -> int:
        return self.dims.pp

    @property
    def tp(self) -> int:
        return self.dims.tp

    @property
    def ep(self) -> int:
        return self.dims.ep

    @property
    def cp(self) -> int:
        return self.dims.cp

    @property
    def dp_replicate(self) -> int:
        return self.dims.dp_replicate


@dataclass(frozen=True)
class Rule:
    """One composition rule.

    Attributes:
        name: a short identifier.
        options: the options the rule names (what a user changes to satisfy it).
        violated: ``violated(layout) -> bool``.
        message: ``message(layout) -> str``: what is wrong, naming the values.
        fix: what to change.
        example: ``V17Strategy`` keyword arguments that violate the rule.
    """

    name: str
    options: tuple[str, ...]
    violated: Callable[[Layout], bool]
    message: Callable[[Layout], str]
    fix: str
    example: Mapping[str, Any] = field(default_factory=dict)

    def text(self, layout: Layout) -> str:
        return f"{self.message(layout)}; {self.fix}"


def _tier(layout: Layout, which: str) -> str:
    return str(getattr(layout.policy.offload, which).value)


def _fp8(layout: Layout) -> Any:
    return layout.policy.fp8


def option_text(option: str, value: Any = ...) -> str:
    """A rule's option as a message spells it: ``("OffloadPolicy.params", "cpu")`` -> ``OffloadPolicy(params='cpu')``,
    ``("tp", 2)`` -> ``tp=2``; without a value, ``OffloadPolicy(params=...)`` and ``tp``."""
    cls, _, field = option.rpartition(".")
    if cls:
        return f"{cls}({field}={'...' if value is ... else repr(value)})"
    return option if value is ... else f"{option}={value!r}"


#: a policy whose fields shape one axis -> (the TrainingPolicy field holding it, the V17Strategy argument taking it)
_AXIS_POLICIES: dict[str, tuple[str, str]] = {
    "TPPolicy": ("tensor_parallel", "tp"), "PipelinePolicy": ("pipeline", "pp"),
}  # fmt: skip


def _needs_axis(option: str) -> Rule:
    """``option`` (``Policy.field``) shapes its policy's axis and means nothing when that axis has size 1."""
    cls, name = option.split(".")
    policy, axis = _AXIS_POLICIES[cls]  # V17Strategy(tp=TPPolicy(...)) etc.

    def violated(lay: Layout) -> bool:
        return bool(getattr(getattr(lay.policy, policy), name)) and getattr(lay, axis) == 1

    value: Any = {"plan": {"x": "colwise"}, "split_points": ["x"]}.get(name, True)
    return Rule(
        name=f"{name}_needs_{axis}",
        options=(option, axis),
        violated=violated,
        message=lambda lay: f"{option_text(option)} applies only with {axis} > 1 (got {axis}=1)",
        fix=f"set {axis} > 1 or drop {name}",
        example={axis: {name: value}},
    )


#: Every rule, in the order they are checked (the first one violated is raised).
RULES: tuple[Rule, ...] = (
    Rule(
        name="offload_params_needs_stage_3",
        options=("OffloadPolicy.params", "zero_stage"),
        violated=lambda lay: _tier(lay, "params") != "none" and lay.stage != 3,
        message=lambda lay: (
            f"OffloadPolicy(params={_tier(lay, 'params')!r}) offloads ZeRO-3 parameter shards and needs zero_stage=3 "
            f"(got {lay.stage})"
        ),
        fix="set zero_stage=3, or offload only the optimizer with offload=OffloadPolicy(optimizer=...)",
        example={"zero_stage": 2, "offload": {"params": "cpu"}},
    ),
    Rule(
        name="nvme_params_without_fp8",
        options=("OffloadPolicy.params", "fp8"),
        violated=lambda lay: _tier(lay, "params") == "nvme" and _fp8(lay) is not None,
        message=lambda lay: (
            "OffloadPolicy(params='nvme') with fp8 is not supported: fp8 makes each sharded weight a torchao float8 "
            "tensor whose storage the nvme parameter tier (which pages FSDP2's plain shard storage to files) cannot "
            "page out, and its scales read every weight after each optimizer step"
        ),
        fix="use OffloadPolicy(params='cpu' or 'none') with fp8, or drop fp8",
        example={"zero_stage": 3, "offload": {"params": "nvme", "nvme_path": "."}, "fp8": "tensorwise"},
    ),
    Rule(
        name="fp8_all_gather_needs_stage_3",
        options=("FP8Policy.all_gather", "zero_stage"),
        violated=lambda lay: _fp8(lay) is not None and _fp8(lay).all_gather is True and lay.stage != 3,
        message=lambda lay: (
            f"FP8Policy(all_gather=True) applies to zero_stage=3, which all-gathers the weights (got zero_stage="
            f"{lay.stage}, where every rank keeps whole weights)"
        ),
        fix="set zero_stage=3 or drop all_gather",
        example={"zero_stage": 2, "fp8": {"recipe": "tensorwise", "all_gather": True}},
    ),
    Rule(
        # rowwise scales one row of each GEMM operand, and torchao quantizes a weight along a different dim for each
        # GEMM: a tp shard holds whole rows of one and parts of the other, so it has no local cast equal to one
        # process's; torchao's float8 TP styles cast tensorwise only
        name="fp8_rowwise_without_tp",
        options=("fp8", "tp"),
        violated=lambda lay: _fp8(lay) is not None and lay.tp > 1 and str(_fp8(lay).recipe.value) == "rowwise",
        message=lambda lay: (
            f"fp8='rowwise' with tp={lay.tp} is not supported: torchao's float8 tensor-parallel styles "
            "(Float8ColwiseParallel/Float8RowwiseParallel) cast with tensorwise scales, and a tp-sharded weight "
            "cannot be scaled per row for both GEMMs"
        ),
        fix="use fp8='tensorwise' or fp8='delayed' with tp > 1, or tp=1",
        example={"tp": 2, "zero_stage": 1, "fp8": "rowwise"},
    ),
    _needs_axis("TPPolicy.sequence_parallel"),
    _needs_axis("TPPolicy.plan"),
    _needs_axis("TPPolicy.vocab_parallel"),
    _needs_axis("TPPolicy.loss_parallel"),
    _needs_axis("PipelinePolicy.split_points"),
    # TPPolicy(loss_parallel=True) composes with pp (tests/dist/test_pp_loss_parallel.py): the last stage's loss and
    # its backward run inside loss_parallel() on the vocab-sharded logits (engine/pipeline/loss.py)
    # ep x tp with sequence parallelism (tests/dist/test_ep_tp_sp.py) and ep x cp (tests/dist/test_ep_cp.py) compose:
    # the MoE layers route their slice of each sequence with the whole sequences' statistics (engine/ep/tokens.py)
    # cp beside HSDP (tests/dist/test_hsdp_cp.py) and beside tp with sequence parallelism (tests/dist/test_cp_tp.py)
    # compose
    # ep with OffloadPolicy(params=...) composes (tests/dist/test_ep_offload.py): at ZeRO-3 the experts are FSDP2
    # units of their own (over the one-rank efsdp axis at efsdp = 1), whose shards the parameter tier moves
)


def violations(layout: Layout) -> list[tuple[Rule, str]]:
    """Every rule ``layout`` violates, with its full message (the planner warns with these)."""
    return [(rule, rule.text(layout)) for rule in RULES if rule.violated(layout)]


def check(policy: Any, dims: ParallelDims) -> None:
    """Raise for the first rule the policy and axis sizes violate.

    Raises:
        V17ConfigError: the rule's message and fix, naming the options.
    """
    found = violations(Layout(policy, dims))
    if found:
        raise V17ConfigError(found[0][1])
