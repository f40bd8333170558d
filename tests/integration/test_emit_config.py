"""``v17 plan --emit-config``: the emitted YAML loads into V17Strategy with the plan's values, and `v17 fit` runs it.

The acceptance test spawns the real console script twice (plan, then a 5-step fit of the tiny model on 2 CPU ranks),
writing only into ``tmp_path``.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lightning_v17.config import MeshSpec, OffloadPolicy, Tier, V17ConfigError
from lightning_v17.planner.cli import build_parser, main, planned, specs_from_args
from lightning_v17.planner.emit import (
    IMPLEMENTED_OFFLOAD_OPTIMIZER,
    IMPLEMENTED_OFFLOAD_PARAMS,
    STRATEGY_CLASS,
    emit_config,
    recorded_command,
)

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--model", "tiny", "--gpu", "cpu", "--gpus", "2"]


def _v17() -> list[str]:
    script = Path(sys.executable).with_name("v17")
    return [str(script)] if script.exists() else [sys.executable, "-m", "lightning_v17.cli"]


def _plan(argv: list[str]):
    """The plan ``v17 plan argv`` emits: the searched layout unless the flags fix one."""
    args = build_parser().parse_args(argv)
    return planned(args, *specs_from_args(args))[0]


def _emit(tmp_path: Path, argv: list[str]) -> tuple[str, dict]:
    path = tmp_path / "run.yaml"
    assert main([*argv, "--emit-config", str(path)]) == 0
    text = path.read_text()
    return text, yaml.safe_load(text)


def _strategy(doc: dict):
    from lightning_v17.strategies import V17Strategy

    strategy = doc["trainer"]["strategy"]
    assert strategy["class_path"] == STRATEGY_CLASS
    return V17Strategy(**strategy["init_args"])


def _assert_matches_plan(doc: dict, plan) -> None:
    """Every value the plan decided is in the YAML, and the strategy built from it holds the same values."""
    lay = plan.layout
    trainer = doc["trainer"]
    strategy = _strategy(doc)
    world = trainer["devices"] * trainer["num_nodes"]
    assert world == lay.gpus
    assert strategy.resolve_mesh(world) == MeshSpec(pp=lay.pp, dp_replicate=1, dp_shard=lay.dp, cp=lay.cp, tp=lay.tp,
                                                    ep=lay.ep)
    assert strategy.zero_stage == lay.zero.stage
    assert strategy.policy.recompute == lay.recompute
    assert strategy.policy.tensor_parallel.sequence_parallel == (lay.sp and lay.tp > 1)
    if lay.pp > 1:
        pipe = strategy.policy.pipeline
        assert (pipe.schedule, pipe.microbatches, pipe.virtual_stages) == (lay.schedule, lay.microbatches,
                                                                           lay.virtual_stages)
    assert trainer["precision"] == lay.precision.value
    assert trainer["accelerator"] == ("cpu" if plan.cluster.gpu == "cpu" else "gpu")
    data = doc["data"]
    assert data["seq_len"] == lay.seq
    # G = dp * b * m: the pipeline splits each rank's batch into m micro-batches; without one, m is accumulation.
    accumulate = trainer.get("accumulate_grad_batches", 1)
    assert lay.dp * data["batch_size"] * accumulate == lay.global_batch


def test_tiny_cpu_plan_emits_the_recommended_layout(tmp_path):
    text, doc = _emit(tmp_path, TINY)
    plan = _plan(TINY)
    _assert_matches_plan(doc, plan)
    assert doc["trainer"]["strategy"]["init_args"] == {  # tp=1, pp=1: no tensor_parallel or pipeline policy
        "zero_stage": 1, "tp": 1, "pp": 1, "dp_replicate": 1, "dp_shard": 2, "activation_checkpointing": "none",
    }  # fmt: skip
    assert (doc["trainer"]["devices"], doc["trainer"]["num_nodes"], doc["trainer"]["precision"]) == (2, 1, "32-true")
    assert doc["model"] == {"model": "tiny"}
    assert doc["data"] == {"seq_len": 512, "batch_size": 1}
    # the exact producing command is recorded, and reads back
    assert f"# command: v17 plan {shlex.join([*TINY, '--emit-config', str(tmp_path / 'run.yaml')])}" in text
    assert recorded_command(text) == [*TINY, "--emit-config", str(tmp_path / "run.yaml")]
    assert "NOT EMITTED" not in text


@pytest.mark.parametrize(
    "argv",
    [
        ["--model", "llama3-70b", "--gpus", "512"],
        ["--model", "llama3-405b", "--gpus", "1024"],
        ["--model", "llama3-70b", "--gpus", "256", "--tp", "4", "--pp", "4", "--schedule", "interleaved",
         "--microbatches", "8"],
        ["--model", "llama3-8b", "--gpus", "16", "--global-batch", "64"],  # pp=1, m=4: gradient accumulation
        ["--model", "llama2-7b", "--gpus", "8", "--zero-stage", "3", "--offload-params", "cpu"],
    ],
    ids=["70b-512", "405b-1024", "70b-interleaved", "8b-accumulate", "7b-offload-params-cpu"],
)
def test_emitted_yaml_builds_a_strategy_with_the_plans_values(tmp_path, argv):
    _, doc = _emit(tmp_path, argv)
    plan = _plan(argv)
    _assert_matches_plan(doc, plan)
    assert doc["trainer"]["num_nodes"] == plan.nodes
    if plan.layout.offload_params == Tier.CPU:
        assert _strategy(doc).policy.offload.params == Tier.CPU


def test_interleaved_and_accumulation_details(tmp_path):
    _, doc = _emit(tmp_path, ["--model", "llama3-70b", "--gpus", "256", "--tp", "4", "--pp", "4", "--schedule",
                              "interleaved", "--microbatches", "8"])  # fmt: skip
    args = doc["trainer"]["strategy"]["init_args"]
    pipe = args["pp"]
    assert (pipe["size"], pipe["schedule"], pipe["virtual_stages"], pipe["microbatches"]) == (4, "interleaved_1f1b", 2, 8)
    assert doc["data"]["batch_size"] == 8 and "accumulate_grad_batches" not in doc["trainer"]
    _, doc = _emit(tmp_path, ["--model", "llama3-8b", "--gpus", "16", "--global-batch", "64", "--rule-of-thumb"])
    assert doc["trainer"]["accumulate_grad_batches"] == 4 and doc["data"]["batch_size"] == 1
    assert doc["trainer"]["strategy"]["init_args"]["pp"] == 1  # pp=1: a plain size (options would warn)


@pytest.mark.parametrize(
    ("flags", "missing", "comment"),
    [
        (["--offload-optimizer", "cpu"], "offload", "NOT EMITTED: OffloadPolicy(optimizer='cpu')"),
        (["--zero-stage", "3", "--offload-params", "nvme"], "offload", "NOT EMITTED: OffloadPolicy(params='nvme')"),
        (["--zero-stage", "2", "--offload-params", "cpu"], "offload", "needs zero_stage=3"),
    ],
)
def test_unimplemented_offload_is_a_comment_not_an_option(tmp_path, flags, missing, comment):
    text, doc = _emit(tmp_path, ["--model", "llama2-7b", "--gpus", "8", *flags])
    assert comment in text
    assert missing not in doc["trainer"]["strategy"]["init_args"]
    _strategy(doc)  # the file still loads


@pytest.mark.parametrize("tier", list(Tier))
def test_implemented_offload_tiers_match_the_strategy(tier):
    """emit.py's sets are what V17Strategy really accepts (no drift when the strategy gains a tier)."""
    from lightning_v17.strategies import V17Strategy

    for option, implemented in (("optimizer", IMPLEMENTED_OFFLOAD_OPTIMIZER),
                                ("params", IMPLEMENTED_OFFLOAD_PARAMS)):  # fmt: skip
        try:
            V17Strategy(zero_stage=3, offload=OffloadPolicy(**{option: tier.value}))
            accepted = True
        except V17ConfigError:
            accepted = False
        assert accepted == (tier in implemented), (option, tier)


def test_shape_overrides_reach_the_model(tmp_path):
    from lightning_v17.models.lightning import LlamaLM

    for argv in (["--model", "tiny", "--gpu", "cpu", "--gpus", "2", "--layers", "2"],
                 ["--layers", "3", "--hidden", "64", "--heads", "4", "--vocab", "300", "--gpu", "cpu", "--gpus", "2"]):
        _, doc = _emit(tmp_path, argv)
        plan = _plan(argv)
        module = LlamaLM(**doc["model"])  # builds the config only; the weights come in configure_model
        assert module.config.to_shape().num_params == plan.model.num_params


def test_fp8_is_emitted_and_other_optimizers_are_noted(tmp_path):
    text, doc = _emit(tmp_path, ["--model", "llama3-8b", "--gpus", "8", "--precision", "fp8", "--optimizer", "lion"])
    # fp8 runs as V17Strategy(fp8=...) with bf16-mixed outside the float8 matmuls; the recipe loads into the strategy
    assert doc["trainer"]["precision"] == "bf16-mixed"
    assert doc["trainer"]["strategy"]["init_args"]["fp8"] == "tensorwise"
    assert _strategy(doc).policy.fp8.recipe.value == "tensorwise"
    assert "NOT EMITTED: precision" not in text and "NOT EMITTED: optimizer=lion" in text
    _, doc = _emit(tmp_path, ["--model", "llama3-8b", "--gpus", "8", "--precision", "fp8", "--fp8", "delayed"])
    assert doc["trainer"]["strategy"]["init_args"]["fp8"] == "delayed"
    _, doc = _emit(tmp_path, ["--model", "llama3-8b", "--gpus", "8"])
    assert "fp8" not in doc["trainer"]["strategy"]["init_args"]


def test_emit_refuses_what_cannot_run():
    plan = _plan(["--params", "7e9", "--gpus", "8"])
    with pytest.raises(V17ConfigError, match="needs a model shape"):
        emit_config(plan)
    with pytest.raises(V17ConfigError, match="llama shapes only"):
        emit_config(_plan(["--model", "gpt3-175b", "--gpus", "64"]))
    with pytest.raises(V17ConfigError, match="whole number"):
        emit_config(_plan(["--model", "llama3-8b", "--gpus", "12"]))


def test_context_parallel_is_emitted_and_its_rules_warn(tmp_path):
    _, doc = _emit(tmp_path, ["--model", "llama3-8b", "--gpus", "8", "--cp", "2", "--tp", "1"])
    strategy = _strategy(doc)
    assert doc["trainer"]["strategy"]["init_args"]["cp"] == 2
    assert strategy.resolve_mesh(8) == MeshSpec(dp_shard=4, cp=2)
    # cp x tp composes, with tp's sequence parallelism (on by default at tp > 1) and without: no rule warns
    for extra in ([], ["--no-sp"]):
        quiet = _plan(["--model", "llama3-70b", "--gpus", "64", "--cp", "2", "--tp", "8", *extra]).warnings
        assert not any("is not" in w or "needs" in w for w in quiet), (extra, quiet)


def test_emitted_yaml_passes_the_lightning_cli(tmp_path):
    """jsonargparse resolves the emitted file against the real signatures (typos and wrong types fail here)."""
    from tests.unit.test_configs import print_config

    path = tmp_path / "run.yaml"
    assert main([*TINY, "--emit-config", str(path)]) == 0
    resolved, raw = print_config(path)
    for key, value in raw["trainer"]["strategy"]["init_args"].items():
        assert resolved["trainer"]["strategy"]["init_args"][key] == value, key
    assert resolved["data"]["batch_size"] == raw["data"]["batch_size"]


@pytest.mark.timeout(240)
def test_acceptance_plan_emit_then_fit_five_steps(tmp_path):
    """`v17 plan --model tiny --gpu cpu --gpus 2 --emit-config x.yaml && v17 fit --config x.yaml --trainer.max_steps 5`."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    plan = subprocess.run([*_v17(), "plan", *TINY, "--emit-config", "x.yaml"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert plan.returncode == 0, plan.stderr
    assert "wrote x.yaml" in plan.stderr
    doc = yaml.safe_load((tmp_path / "x.yaml").read_text())
    assert doc["trainer"]["strategy"]["init_args"]["zero_stage"] == 1  # the search's choice (ZeRO-1 beats ZeRO-3)
    fit = subprocess.run(
        [*_v17(), "fit", "--config", "x.yaml", "--trainer.max_steps", "5", "--trainer.limit_val_batches", "2",
         "--trainer.default_root_dir", str(tmp_path / "run")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=200, check=False,
    )  # fmt: skip
    log = fit.stdout + fit.stderr
    assert fit.returncode == 0, log[-4000:]
    assert "max_steps=5" in log, log[-4000:]
    # the run's resolved config and its checkpoint went into tmp_path
    saved = list((tmp_path / "run").rglob("config.yaml"))
    assert saved and yaml.safe_load(saved[0].read_text())["trainer"]["strategy"]["init_args"]["dp_shard"] == 2
    assert list((tmp_path / "run").rglob("*step=5*")), "no checkpoint at step 5"

