"""``v17 plan`` end to end: JSON keys and values, the decision tree, warnings, exit code 2, torch-freeness."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_v17.planner.cli import main

ROOT = Path(__file__).resolve().parents[2]


def _plan(capsys, *argv: str) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _error(capsys, *argv: str) -> str:
    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, f"expected one line on stderr, got {err!r}"
    return err


def test_json_has_the_issue_keys_as_ints(capsys):
    out = _plan(capsys, "--model", "llama3-70b", "--gpus", "512")
    int_keys = {
        "per_rank": ["param_bytes", "grad_bytes", "optimizer_bytes", "model_state_bytes", "activation_bytes",
                     "activation_bytes_per_layer", "total_bytes"],
        "tiers": ["cpu_bytes", "nvme_bytes"],
        "comm": ["bytes_per_step"],
    }
    for section, keys in int_keys.items():
        for key in keys:
            assert isinstance(out[section][key], int), (section, key)
    assert isinstance(out["model"]["params"], int)
    assert isinstance(out["pipeline"]["bubble_fraction"], float)
    assert out["flops"]["per_step"] > 0
    rec = out["recommendation"]
    assert {"tp", "pp", "dp", "zero_stage", "recompute", "warnings"} <= set(rec)
    assert isinstance(rec["warnings"], list)


def test_llama3_70b_on_512_h100_follows_the_tree_and_hand_numbers(capsys):
    out = _plan(capsys, "--model", "llama3-70b", "--gpus", "512", "--rule-of-thumb")
    rec = out["recommendation"]
    # design §17.4: 10-100B with NVLink -> TP8 + PP4 + DP (ZeRO-1); 512 / 32 = 16
    assert (rec["tp"], rec["pp"], rec["dp"], rec["zero_stage"]) == (8, 4, 16, 1)
    assert rec["recompute"] == "none" and rec["warnings"] == []  # fits without recompute (below), so none
    pr = out["per_rank"]
    # Ψ/(tp*pp) = 70,553,706,496 / 32 = 2,204,803,328; param/grad 2 B each = 4,409,606,656
    assert pr["param_bytes"] == pr["grad_bytes"] == 4_409_606_656
    # optimizer 12 B * 2,204,803,328 / dp 16 = 1,653,602,496
    assert pr["optimizer_bytes"] == 1_653_602_496
    assert pr["model_state_bytes"] == 4_409_606_656 * 2 + 1_653_602_496
    # The llama block's count (planner/memory.py llama_activation_bytes_per_layer; Korthikanti Table 2 redone for
    # RMSNorm/GQA/fused attention/SwiGLU), TP8 + SP, no recompute, bf16, per token, by hand:
    #   norms 2 * ((2*4*8192 + 4)/8 + 2*8192) = 49,153; RoPE 4*128 = 512;
    #   sharded (2*(2*8192 + 2*1024) + 4*64 + 4*2*28672) / 8 = 266,496 / 8 = 33,312  -> 82,977 B/token
    #   * s*b = 8192 tokens = 679,747,584 per layer; 1F1B first stage = L layers' worth (Eq. 5): * 80
    assert pr["activation_bytes_per_layer"] == 82_977 * 8192 == 679_747_584
    assert pr["activation_bytes"] == 679_747_584 * 80
    # temps: ZeRO-1 reduce bucket 25 MiB = 26,214,400 (no logits on the first stage); 64.9 GB of 80
    assert pr["total_bytes"] == pr["model_state_bytes"] + 679_747_584 * 80 + 26_214_400 == 64_878_836_928
    assert out["tiers"]["cpu_bytes"] == out["tiers"]["nvme_bytes"] == 0
    # m = 4p = 16 micro-batches: bubble (p-1)/m = 3/16
    assert out["layout"]["microbatches"] == 16 and out["pipeline"]["bubble_fraction"] == pytest.approx(3 / 16)
    assert out["fits"] is True


@pytest.mark.parametrize(("stage", "total"), [(0, 120_000_000_000), (1, 31_406_250_000), (2, 16_640_625_000),
                                              (3, 1_875_000_000)])
def test_zero_fig1_through_the_cli_with_dp_only(capsys, stage, total):
    # ZeRO Fig. 1 (Ψ = 7.5e9, N_d = 64, K = 12); --dp without --gpus
    out = _plan(capsys, "--params", "7.5e9", "--dp", "64", "--zero-stage", str(stage))
    assert out["per_rank"]["model_state_bytes"] == total
    assert out["cluster"]["gpus"] == 64 and out["model"]["params"] == 7_500_000_000


def test_decision_tree_other_branches(capsys):
    small = _plan(capsys, "--model", "llama2-7b", "--gpus", "8")["recommendation"]
    assert (small["tp"], small["pp"], small["zero_stage"]) == (1, 1, 3)  # ≤10B: FSDP full shard only
    big = _plan(capsys, "--model", "llama3-405b", "--gpus", "1024")["recommendation"]
    assert big["tp"] == 8 and big["pp"] >= 8 and big["zero_stage"] == 1  # >100B: TP8 + PP≥8 + ZeRO-1
    no_nvlink = _plan(capsys, "--model", "llama3-70b", "--gpu", "cpu", "--gpus", "64")["recommendation"]
    assert (no_nvlink["tp"], no_nvlink["zero_stage"]) == (1, 3)


def test_anti_pattern_warnings(capsys):
    w = _plan(capsys, "--model", "llama3-70b", "--gpus", "512", "--tp", "8", "--pp", "4", "--zero-stage", "3",
              "--microbatches", "4")["recommendation"]["warnings"]
    assert not any("PP with ZeRO-3" in x for x in w)  # pp x ZeRO-3 composes (tests/dist/test_pp_zero23.py)
    assert any("m=4 < 4·p=16" in x for x in w)
    w = _plan(capsys, "--model", "llama2-7b", "--gpus", "8", "--zero-stage", "2", "--offload-params", "cpu")
    w = w["recommendation"]["warnings"]  # a rule of config/rules.py, in the planner's words
    assert any("OffloadPolicy(params='cpu') with ZeRO-2" in x and "needs zero_stage=3" in x for x in w), w
    w = _plan(capsys, "--model", "llama2-7b", "--gpus", "32", "--tp", "16")["recommendation"]["warnings"]
    assert any("TP across nodes" in x for x in w)
    out = _plan(capsys, "--model", "llama3-70b", "--gpus", "8", "--rule-of-thumb")
    assert out["fits"] is False
    assert any("does not fit in the 72 GB a plan may use of 80 GB" in x for x in out["recommendation"]["warnings"])


def test_offload_moves_buckets_to_tiers(capsys):
    out = _plan(capsys, "--model", "llama2-7b", "--gpus", "8", "--zero-stage", "3", "--offload-optimizer", "cpu",
                "--offload-params", "nvme")
    pr, tiers = out["per_rank"], out["tiers"]
    assert tiers["nvme_bytes"] == pr["param_bytes"]
    assert tiers["cpu_bytes"] == pr["grad_bytes"] + pr["optimizer_bytes"]
    assert tiers["gpu_bytes"] == pr["activation_bytes"] + pr["temp_bytes"]
    assert out["offload"]["pcie_bytes_per_step"] > 0 and out["offload"]["transfer_s"] > 0


def test_max_model_params_only(capsys):
    # ZeRO-3 over dp=8, mixed AdamW: 16 B / 8 = 2 B per parameter on each rank, no temps without a shape;
    # a100-40gb less the default 10% reserve: 36e9 B / 2 B = 18e9 parameters; with no reserve 40e9 / 2 = 20e9
    out = _plan(capsys, "--params", "1e9", "--dp", "8", "--zero-stage", "3", "--gpu", "a100-40gb", "--max-model")
    assert out["max_model"]["params"] == pytest.approx(18e9, rel=1e-5)
    assert out["cluster"]["usable_memory_bytes"] == 36_000_000_000
    out = _plan(capsys, "--params", "1e9", "--dp", "8", "--zero-stage", "3", "--gpu", "a100-40gb", "--max-model",
                "--memory-reserve", "0")
    assert out["max_model"]["params"] == pytest.approx(20e9, rel=1e-5)


def test_memory_reserve_decides_what_fits(capsys):
    # llama3-8b's width on 8 H100 with ZeRO-3 and full recompute: the first depth whose plan needs more than the
    # 72 GB left by the default 10% reserve still fits in all 80 GB (8 more layers add < 8 GB here): not fitting
    # with the reserve, fitting without it.
    def gpu(layers: int, *reserve: str) -> dict:
        return _plan(capsys, "--model", "llama3-8b", "--gpus", "8", "--layers", str(layers), "--tp", "1", "--pp",
                     "1", "--zero-stage", "3", "--recompute", "full", *reserve)  # fmt: skip

    layers = next(n for n in range(32, 4000, 8) if gpu(n)["tiers"]["gpu_bytes"] > 72e9)
    between = gpu(layers)
    assert between["tiers"]["gpu_bytes"] <= 80e9, between["tiers"]  # the 8-layer step is < 8 GB here
    assert between["fits"] is False and gpu(layers, "--memory-reserve", "0")["fits"] is True
    assert "memory_reserve=0.95 must be a fraction in [0, 0.9]" in _error(capsys, "--model", "tiny",
                                                                          "--memory-reserve", "0.95")


def test_max_model_with_shape_is_the_deepest_that_fits(capsys):
    out = _plan(capsys, "--model", "llama3-8b", "--gpus", "8", "--max-model", "--rule-of-thumb")
    layers = out["max_model"]["layers"]
    assert layers > 32
    fits = _plan(capsys, "--model", "llama3-8b", "--gpus", "8", "--layers", str(layers), "--tp", "1", "--pp", "1",
                 "--zero-stage", "3", "--recompute", out["layout"]["recompute"])
    over = _plan(capsys, "--model", "llama3-8b", "--gpus", "8", "--layers", str(layers + 1), "--tp", "1", "--pp",
                 "1", "--zero-stage", "3", "--recompute", out["layout"]["recompute"])
    assert fits["fits"] is True and over["fits"] is False


def test_explicit_gpt_shape(capsys):
    # GPT-2 small from flags: ffn defaults to 4h, embeddings tied -> 124,439,808 parameters
    out = _plan(capsys, "--arch", "gpt", "--layers", "12", "--hidden", "768", "--heads", "12", "--vocab", "50257",
                "--seq", "1024", "--gpus", "1")
    assert out["model"]["params"] == 124_439_808


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--model", "llama9"], "unknown model preset 'llama9'; choose one of tiny, llama2-7b, llama3-8b"),
        (["--model", "llama3-70b", "--tp", "3"], "try tp in {1, 2, 4, 8}"),
        (["--model", "llama3-70b", "--gpus", "100", "--tp", "8", "--pp", "4"], "gpus=100 is not divisible by tp*pp"),
        (["--model", "tiny", "--layers", "-4"], "must be a positive integer"),
        (["--params", "-7e9"], "must be a positive number"),
        (["--model", "tiny", "--micro-batch", "0"], "must be a positive integer"),
        (["--model", "tiny", "--recompute", "sometimes"], "--recompute='sometimes' is not supported"),
        (["--model", "tiny", "--pp", "5"], "pp=5 exceeds layers=4"),
        ([], "give a model"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, argv, needle):
    assert needle in _error(capsys, *argv)


def test_help_returns_zero(capsys):
    assert main(["--help"]) == 0
    assert "--max-model" in capsys.readouterr().out


def test_recommend_picks_a_tp_that_divides_heads_and_tiles_the_node():
    from lightning_v17.planner.recipes import recommend

    # 12 heads: divisors of 8 that divide 12 and ffn 3072 are {1, 2, 4} -> tp=4; 20B is in the 10-100B branch
    rec = recommend(20e9, gpus=64, gpus_per_node=8, nvlink=True, layers=40, tp_dims=(12, 12, 3072))
    assert (rec.tp, rec.pp, rec.dp, rec.zero.stage) == (4, 4, 4, 1)
    assert any("tp=8 does not divide" in n for n in rec.notes)


def test_layout_from_tp_pp_dp_without_gpus_and_schedule_validation(capsys):
    out = _plan(capsys, "--model", "llama3-70b", "--tp", "8", "--pp", "4", "--dp", "16", "--schedule", "interleaved")
    assert out["cluster"]["gpus"] == 512
    # interleaved with the default v = 2 chunks and m = 4p = 16: bubble (p-1)/(v*m) = 3/32
    assert out["layout"]["virtual_stages"] == 2 and out["pipeline"]["bubble_fraction"] == pytest.approx(3 / 32)
    err = _error(capsys, "--model", "llama3-70b", "--gpus", "512", "--pp", "4", "--schedule", "zbv",
                 "--virtual-stages", "3")
    assert "virtual_stages=2" in err


def test_human_report_shows_max_model(capsys):
    assert main(["--model", "llama3-8b", "--gpus", "8", "--max-model"]) == 0
    text = capsys.readouterr().out
    assert "max model:" in text and "layers)" in text


def test_emit_config_keeps_json_clean_and_reports_on_stderr(capsys, tmp_path):
    path = tmp_path / "sub" / "run.yaml"
    assert main(["--model", "tiny", "--gpu", "cpu", "--gpus", "2", "--json", "--emit-config", str(path)]) == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)  # stdout is still one JSON object
    assert doc["layout"]["zero_stage"] == doc["search"]["candidates"][0]["zero_stage"] == 1
    assert captured.err.count("\n") == 1 and f"wrote {path}" in captured.err
    assert "# command: v17 plan --model tiny --gpu cpu --gpus 2 --json --emit-config" in path.read_text()


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--params", "7e9", "--gpus", "8"], "needs a model shape"),
        (["--model", "gpt3-175b", "--gpus", "64"], "llama shapes only"),
        (["--model", "llama3-8b", "--gpus", "12"], "whole number"),
    ],
)
def test_emit_config_refusals_are_one_line_and_write_nothing(capsys, tmp_path, argv, needle):
    path = tmp_path / "run.yaml"
    assert needle in _error(capsys, *argv, "--emit-config", str(path))
    assert not path.exists()
