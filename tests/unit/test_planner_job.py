"""``v17 plan --config``: the plan of the job a ``v17 fit`` config trains (its model, layout, batch and sequence),
configs merged as jsonargparse merges them, and what cannot be planned refused with the option's path."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from lightning_v17.config import V17ConfigError
from lightning_v17.planner.cli import main
from lightning_v17.planner.job import job_specs, load_configs, merge

ROOT = Path(__file__).resolve().parents[2]
MAIN_JOB = [str(ROOT / "configs" / "tiny-cpu.yaml"), str(ROOT / "configs" / "tiny-cpu-tokens.yaml")]


def _plan_json(capsys, *argv: str) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_main_job_is_planned_with_its_own_batch_sequence_and_layout(capsys):
    # Hand-read from configs/tiny-cpu.yaml: devices 2 on cpu, V17Strategy zero_stage 3 (dp_shard auto -> 2),
    # precision 32-true, model tiny, data.batch_size 8 rows per rank, seq_len 512, no accumulation.
    doc = _plan_json(capsys, "--config", MAIN_JOB[0], "--config", MAIN_JOB[1])
    assert doc["job"] == MAIN_JOB
    assert doc["model"]["name"] == "tiny"
    layout = doc["layout"]
    assert (layout["tp"], layout["pp"], layout["cp"], layout["dp"], layout["zero_stage"]) == (1, 1, 1, 2, 3)
    assert (layout["micro_batch"], layout["seq"], layout["microbatches"], layout["global_batch"]) == (8, 512, 1, 16)
    assert doc["cluster"]["gpu"] == "cpu" and doc["cluster"]["gpus"] == 2
    assert layout["precision"] == "32-true"
    assert doc["search"]["candidates"], "the search at the job's batch is printed beside the job's plan"


def test_make_run_plans_the_configs_it_trains():
    lines = (ROOT / "Makefile").read_text().splitlines()
    start = lines.index(next(line for line in lines if line.startswith("run:")))
    recipe = [line.strip() for line in lines[start + 1:] if line.startswith("\t")][:2]
    plan = next(line for line in recipe if " plan " in line)
    fit = next(line for line in recipe if " fit " in line)
    assert re.findall(r"--config (\S+)", plan) == re.findall(r"--config (\S+)", fit) != []


def test_later_configs_override_key_by_key_and_a_changed_class_replaces_its_section(tmp_path):
    extra = tmp_path / "more.yaml"
    extra.write_text(yaml.safe_dump({
        "trainer": {"devices": 4, "accumulate_grad_batches": 3, "precision": "bf16-mixed",
                    "strategy": {"init_args": {"zero_stage": 2, "tp": {"size": 2, "sequence_parallel": True}}}},
        "data": {"batch_size": 4, "seq_len": 256},
    }))  # fmt: skip
    model, cluster, train = job_specs(load_configs([*MAIN_JOB, extra]))
    assert model.name == "tiny" and cluster.gpus == 4 and cluster.gpu == "cpu"
    assert (train.tp, train.pp, train.cp, train.dp, train.zero.stage, train.sp) == (2, 1, 1, 2, 2, True)
    assert (train.micro_batch, train.microbatches, train.seq) == (4, 3, 256)
    assert train.precision.value == "bf16-mixed"
    assert merge({"s": {"class_path": "a.A", "init_args": {"x": 1}}}, {"s": {"class_path": "b.B"}}) == {
        "s": {"class_path": "b.B"}
    }
    assert merge({"cb": [1, 2], "k": {"a": 1}}, {"cb": [3], "k": {"b": 2}}) == {"cb": [3], "k": {"a": 1, "b": 2}}


def test_a_pipeline_splits_each_ranks_rows_into_its_microbatches(tmp_path):
    extra = tmp_path / "pp.yaml"
    extra.write_text(yaml.safe_dump({"trainer": {"strategy": {"init_args": {
        "zero_stage": 1, "pp": {"size": 2, "schedule": "interleaved_1f1b", "microbatches": 4, "virtual_stages": 2}}}}}))
    _, _, train = job_specs(load_configs([MAIN_JOB[0], extra]))
    assert (train.pp, train.dp, train.micro_batch, train.microbatches, train.virtual_stages) == (2, 1, 2, 4, 2)
    assert train.schedule.value == "interleaved_1f1b"


def test_the_jobs_layout_is_the_one_v17strategy_builds_from_the_same_init_args(tmp_path):
    from lightning_v17.strategies import V17Strategy

    extra = tmp_path / "more.yaml"
    extra.write_text(yaml.safe_dump({"trainer": {"devices": 4, "strategy": {"init_args": {"zero_stage": 2,
                                                                                          "tp": 2}}}}))
    doc = load_configs([MAIN_JOB[0], extra])
    _, _, train = job_specs(doc)
    strategy = V17Strategy(**doc["trainer"]["strategy"]["init_args"])
    dims = strategy.dims.mesh(4)
    assert (dims.tp, dims.pp, dims.cp, dims.dp_shard * dims.dp_replicate) == (train.tp, train.pp, train.cp, train.dp)
    assert strategy.zero_stage == train.zero.stage


def test_hsdp_is_planned_as_v17strategy_builds_it(tmp_path):
    from lightning_v17.strategies import V17Strategy

    from lightning_v17.planner.plan import make_plan

    extra = tmp_path / "hsdp.yaml"
    extra.write_text(yaml.safe_dump({"trainer": {"devices": 4, "strategy": {"init_args": {"zero_stage": 3,
                                                                                          "dp_replicate": 2}}}}))
    doc = load_configs([MAIN_JOB[0], extra])
    plan = make_plan(*job_specs(doc))
    dims = V17Strategy(**doc["trainer"]["strategy"]["init_args"]).dims.mesh(4)
    assert (plan.layout.dims.dp_replicate, plan.layout.dims.dp_shard) == (dims.dp_replicate, dims.dp_shard) == (2, 2)
    # ZeRO-3 shards the 16 B/param of fp32 AdamW over the 2 ranks of a shard group, not over all 4
    assert plan.memory.model_state == pytest.approx(16 * plan.model.num_params / 2, rel=1e-3)


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ({"model": {"model": "llama9-1t"}}, "model.model: unknown model preset 'llama9-1t'"),
        ({"model": {"model": "qwen3-30b-a3b"}}, "model.model: preset 'qwen3-30b-a3b' is counted by the planner only"),
        ({"model": {"model_overrides": {"hiddn": 64}}}, "model.model_overrides: ['hiddn'] are not planned"),
        ({"trainer": {"strategy": "deepspeed"}}, "trainer.strategy: 'deepspeed' cannot be planned"),
        ({"trainer": {"devices": "auto"}}, "trainer.devices='auto'"),
        ({"trainer": {"devices": 3, "strategy": {"init_args": {"tp": 2}}}}, "3 devices are not a multiple of tp"),
        ({"trainer": {"strategy": {"init_args": {"zero_stage": 0, "dp_replicate": 2}}}},
         "dp_replicate=2 needs a ZeRO stage that shards"),
        ({"trainer": {"strategy": {"init_args": {"tp": {"size": 2, "sequence": True}}}}}, "not fields of TPPolicy"),
    ],
)
def test_what_cannot_be_planned_is_one_line_naming_the_option(capsys, tmp_path, override, needle):
    extra = tmp_path / "bad.yaml"
    extra.write_text(yaml.safe_dump(override))
    assert main(["--config", MAIN_JOB[0], "--config", str(extra)]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1, err


def test_the_job_flags_are_refused_with_config_and_bad_files_are_named(capsys, tmp_path):
    assert main(["--config", MAIN_JOB[0], "--model", "tiny", "--micro-batch", "2"]) == 2
    assert "drop --model, --micro-batch" in capsys.readouterr().err
    assert main(["--config", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml: cannot read it" in capsys.readouterr().err
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(V17ConfigError, match="top level must be a mapping"):
        load_configs([tmp_path / "list.yaml"])
