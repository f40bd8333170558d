"""The one rules table (lightning_v17/config/rules.py): every rule, constructed as a user would write the violating
strategy, raises its own message and fix at construction; the engine's check and the planner read the same table."""

from __future__ import annotations

import re

import pytest

from lightning_v17.config import MeshSpec, ParallelDims, TPPolicy, TrainingPolicy, V17ConfigError, ZeroPolicy
from lightning_v17.config.rules import RULES, Layout, violations


def _example(rule, tmp_path) -> dict:
    """The rule's example, an nvme_path (inside a policy's dict) pointed at ``tmp_path``."""
    return {k: ({**v, "nvme_path": str(tmp_path)} if isinstance(v, dict) and "nvme_path" in v else v)
            for k, v in rule.example.items()}  # fmt: skip


@pytest.mark.parametrize("rule", RULES, ids=[r.name for r in RULES])
def test_every_rule_is_raised_by_the_strategy_with_its_message(rule, tmp_path) -> None:
    from lightning_v17 import V17Strategy

    kwargs = _example(rule, tmp_path)
    with pytest.raises(V17ConfigError) as err:
        V17Strategy(**kwargs)
    msg = str(err.value)
    assert msg.endswith(rule.fix), (rule.name, msg)
    for option in rule.options:  # the message names every option the rule is about, as the user writes it
        cls, _, field = option.rpartition(".")
        spelled = rf"\b{cls}\({field}=" if cls else rf"\b{option}\b"  # OffloadPolicy(params=..., or zero_stage
        assert re.search(spelled, msg), (rule.name, option, msg)


@pytest.mark.parametrize("rule", RULES, ids=[r.name for r in RULES])
def test_each_example_violates_only_its_own_rule_first(rule, tmp_path) -> None:
    """The example is what the test constructs: it must trip this rule (not an earlier one by accident)."""
    import inspect

    from lightning_v17.strategies._options import build_policy, parallel_dims

    from lightning_v17 import V17Strategy

    given = {n: p.default for n, p in inspect.signature(V17Strategy.__init__).parameters.items() if n != "self"}
    given.update(_example(rule, tmp_path))
    policy = build_policy(**{n: given[n] for n in inspect.signature(build_policy).parameters})
    dims = parallel_dims(policy, dp_replicate=given["dp_replicate"], dp_shard=given["dp_shard"])
    found = violations(Layout(policy, dims))
    assert found and found[0][0] is rule, [r.name for r, _ in found]


def test_a_valid_layout_violates_nothing() -> None:
    assert violations(Layout(TrainingPolicy(zero=ZeroPolicy(stage=1)), ParallelDims(pp=2, tp=2))) == []
    assert violations(Layout(TrainingPolicy(), ParallelDims(pp=1, tp=1))) == []
    assert violations(Layout(TrainingPolicy(), ParallelDims(pp=1, tp=2, cp=2))) == []  # cp x tp (tests/dist/test_cp_tp.py)
    # cp beside HSDP (tests/dist/test_hsdp_cp.py) and beside tp with sequence parallelism (tests/dist/test_cp_tp.py)
    assert violations(Layout(TrainingPolicy(zero=ZeroPolicy(stage=1)), ParallelDims(cp=2, dp_replicate=2))) == []
    sp = TrainingPolicy(zero=ZeroPolicy(stage=3), tensor_parallel=TPPolicy(size=2, sequence_parallel=True))
    assert violations(Layout(sp, ParallelDims(tp=2, cp=2))) == []
    # cp inside pipeline stages composes (tests/dist/test_cp_pp.py)
    assert violations(Layout(TrainingPolicy(zero=ZeroPolicy(stage=1)), ParallelDims(pp=2, cp=2))) == []
    # experts over ep beside tp (tests/dist/test_ep_tp.py) and inside pipeline stages (tests/dist/test_ep_pp.py)
    assert violations(Layout(TrainingPolicy(zero=ZeroPolicy(stage=1)), ParallelDims(tp=2, ep=2))) == []
    assert violations(Layout(TrainingPolicy(zero=ZeroPolicy(stage=1)), ParallelDims(pp=2, ep=2))) == []


def test_rule_names_are_unique() -> None:
    assert len({r.name for r in RULES}) == len(RULES)


def test_the_axis_sizes_have_one_owner() -> None:
    """The strategy resolves its arguments into one ParallelDims; the rules, parallelize's check and the planner read
    that object (or the MeshSpec it resolves to, which is one), never a policy's size or a dict of their own."""
    import inspect

    from lightning_v17 import V17Strategy
    from lightning_v17.config import TPPolicy as TP
    from lightning_v17.engine.parallelize import check_composition
    from lightning_v17.planner import make_plan
    from lightning_v17.planner.cli import build_parser, specs_from_args

    s = V17Strategy(tp=TP(size=2, sequence_parallel=True), pp=2, cp=2, ep=2, dp_replicate=2, zero_stage=1)
    assert s.dims == ParallelDims(pp=2, dp_replicate=2, dp_shard="auto", cp=2, tp=2, ep=2)
    mesh = s.resolve_mesh(32)
    assert isinstance(mesh, ParallelDims) and mesh == MeshSpec(pp=2, dp_replicate=2, dp_shard=2, cp=2, tp=2, ep=2)
    assert list(inspect.signature(check_composition).parameters) == ["policy", "dims"]
    assert not hasattr(s, "_axes")
    with pytest.raises(V17ConfigError, match=r"ep=4 is folded out of the dp_shard=2"):
        V17Strategy(ep=4, dp_shard=2, zero_stage=1)
    with pytest.raises(V17ConfigError, match=r"dp_shard='x' must be a positive integer or 'auto'"):
        ParallelDims(dp_shard="x")
    args = build_parser().parse_args(["--model", "llama2-7b", "--gpus", "16", "--tp", "2", "--pp", "2"])
    plan = make_plan(*specs_from_args(args))
    assert isinstance(plan.layout.dims, MeshSpec) and (plan.layout.dims.tp, plan.layout.dims.pp) == (2, 2)
    assert plan.layout.gpus == plan.layout.dims.world_size == 16
