"""Every YAML file in configs/ parses through the real LightningCLI, and its strategy builds.

`--print_config` resolves class_path/init_args with jsonargparse, so a misspelled option, a wrong type or a class
that cannot be imported fails here instead of at launch. The size recipes (files emitted by ``v17 plan
--emit-config``) are also re-planned from the command recorded in their header: the file must still be exactly
what the planner emits for it, and the planner must say it fits on the stated cluster.
"""

import contextlib
import io
from pathlib import Path

import pytest
import yaml

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))
#: The size recipes the issue asks for ("Planner fidelity and recipes", item 5): file -> (preset, world size).
RECIPES = {
    "llama3-8b-8xh100.yaml": ("llama3-8b", 8),
    "llama3-70b-64x8xh100.yaml": ("llama3-70b", 64 * 8),
    "llama3-405b-128x8xh100.yaml": ("llama3-405b", 128 * 8),
}


#: configs layered on another (``v17 fit --config BASE --config LAYER``): layer -> base
LAYERED = {"tiny-cpu-tokens.yaml": "tiny-cpu.yaml"}


def _recorded(path: Path) -> list[str] | None:
    from lightning_v17.planner.emit import recorded_command

    return recorded_command(path.read_text())


def test_there_are_configs():
    assert any(p.name == "tiny-cpu.yaml" for p in CONFIGS)
    names = {p.name for p in CONFIGS}
    assert set(RECIPES) <= names, f"missing recipes: {sorted(set(RECIPES) - names)}"
    for name in RECIPES:
        assert _recorded(next(p for p in CONFIGS if p.name == name)), f"{name} records no `v17 plan` command"


def print_config(path) -> tuple[dict, dict]:
    """(the config as the Lightning CLI resolves it with ``fit --print_config``, the file as written); a layered
    file is resolved on its base, and its sections are laid over the base's (what ``--config`` twice does)."""
    from lightning_v17.trainer_cli import run_lightning_cli

    path = Path(path)
    files = [path.parent / LAYERED[path.name], path] if path.name in LAYERED else [path]
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
        run_lightning_cli(["fit", *[a for f in files for a in ("--config", str(f))], "--print_config"])
    assert exit_info.value.code == 0
    raw: dict = {}
    for f in files:
        for section, value in yaml.safe_load(f.read_text()).items():
            raw[section] = {**raw[section], **value} if isinstance(value, dict) and section in raw else value
    return yaml.safe_load(out.getvalue()), raw


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_config_parses(path):
    from lightning_v17.strategies import V17Strategy


    resolved, raw = print_config(path)
    # what the file says survives resolution (nothing silently dropped or renamed)
    assert resolved["trainer"]["strategy"]["class_path"] == raw["trainer"]["strategy"]["class_path"]
    got = [c["class_path"] for c in resolved["trainer"].get("callbacks") or []]
    assert got == [c["class_path"] for c in raw["trainer"].get("callbacks") or []]
    # ... and the strategy builds from it, with a mesh that tiles the trainer's devices x num_nodes
    assert raw["trainer"]["strategy"]["class_path"] == "lightning_v17.strategies.V17Strategy"
    init_args = resolved["trainer"]["strategy"].get("init_args") or {}
    for key, value in (raw["trainer"]["strategy"].get("init_args") or {}).items():
        assert init_args[key] == value, key
    for key, value in (raw.get("data") or {}).items():  # the data options survive too (a layer's among them)
        assert resolved["data"][key] == value, key
    strategy = V17Strategy(**init_args)
    trainer = resolved["trainer"]
    strategy.resolve_mesh(int(trainer["devices"]) * int(trainer.get("num_nodes") or 1))


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_is_the_planners_fitting_recommendation(name):
    """Re-run the recorded `v17 plan` as the CLI plans it (torch-free planner code: the search's fastest layout that
    passes the rules and fits): the file is its emission, and the plan fits every tier."""
    from lightning_v17.planner.cli import build_parser, planned, specs_from_args
    from lightning_v17.planner.emit import emit_config

    path = next(p for p in CONFIGS if p.name == name)
    argv = _recorded(path)
    args = build_parser().parse_args(argv)
    plan, found = planned(args, *specs_from_args(args))
    preset, world = RECIPES[name]
    # the stated cluster and model
    assert (plan.model.name, plan.layout.gpus, plan.cluster.gpu) == (preset, world, "h100-80gb")
    # the recommendation, not a hand-pinned layout: the search's best
    pinned = {"tp", "pp", "dp", "cp", "zero_stage", "recompute", "schedule", "virtual_stages", "microbatches"}
    assert not [k for k in pinned if getattr(args, k) is not None], f"{name}: the command pins the layout"
    assert found is not None and found.best is plan
    # it fits every tier, with no warnings
    assert plan.fits and plan.memory.tiers.gpu <= plan.cluster.accelerator.memory_bytes
    assert plan.warnings == ()
    # the file is exactly what --emit-config writes for this plan (regenerate it if the planner changed)
    assert yaml.safe_load(path.read_text()) == emit_config(plan).config
