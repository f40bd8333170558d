"""Activation bytes against a run, and held-out paper figures through ``v17 plan --json``.

* The saved-activation bytes per block of the reference Llama, measured with ``bench/activations.py``'s storage
  count (tiny shape, CPU), are within 15% of the planner's for recompute none, selective and full, fp32 and bf16
  (issue 14). The measurement runs the real ``engine/recompute.py``.
* Korthikanti 2022 Table 2 (every row) and ZeRO (Rajbhandari 2020) Table 1 through the CLI. Their expected values
  are written here from the papers (formulas and printed figures), not computed with the planner's functions.
"""

from __future__ import annotations

import contextlib
import io
import json
import math

import pytest
import torch

from bench.activations import hooked_saved_bytes_per_layer, measure_saved_activation_bytes_per_layer
from lightning_v17.models.config import ModelConfig
from lightning_v17.planner.cli import main
from lightning_v17.planner.memory import activation_bytes_per_layer_of, llama_activation_bytes_per_layer
from lightning_v17.planner.model import get_preset

#: Tiny GQA shape: head_dim 16, kv_dim 64, SwiGLU 384; two blocks of s = 64 tokens, b = 2.
TINY = ModelConfig(vocab_size=64, hidden=128, layers=2, heads=8, kv_heads=4, ffn=384, max_seq_len=64)
SEQ, BATCH = 64, 2
DTYPES = {"fp32": (torch.float32, 4), "bf16": (torch.bfloat16, 2)}
TOLERANCE = 0.15  # issue 14's acceptance


def _plan(*argv: str) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([*argv, "--json"]) == 0
    return json.loads(out.getvalue())


def _measure(dtype_name: str, recompute: str) -> float:
    return measure_saved_activation_bytes_per_layer(TINY, recompute=recompute, dtype=DTYPES[dtype_name][0], seq=SEQ,
                                                    micro_batch=BATCH)


# ------------------------------------------------------------------------------------------- measured vs planned


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("dtype_name", ["fp32", "bf16"])
def test_measured_saved_activations_match_the_planner(dtype_name, recompute):
    measured = _measure(dtype_name, recompute)
    planned = activation_bytes_per_layer_of(TINY.to_shape(SEQ), seq=SEQ, micro_batch=BATCH, recompute=recompute,
                                            element_bytes=DTYPES[dtype_name][1])
    assert abs(measured / planned - 1) <= TOLERANCE, (measured, planned)


@pytest.mark.parametrize("dtype_name", ["fp32", "bf16"])
def test_recompute_keeps_less_and_full_keeps_only_the_block_input(dtype_name):
    none, selective, full = (_measure(dtype_name, r) for r in ("none", "selective", "full"))
    # full: the block input only, s*b*h elements = 64 * 2 * 128 = 16,384 (Korthikanti Table 2's last row)
    assert full == 16_384 * DTYPES[dtype_name][1]
    # selective keeps the matmul/SDPA outputs: well under none, well over full
    assert full * 4 < selective < none * 0.75


@pytest.mark.parametrize("dtype_name", ["fp32", "bf16"])
def test_saved_tensor_hooks_see_the_same_bytes_without_recompute(dtype_name):
    # Without checkpointing every saved tensor passes through saved_tensors_hooks: two independent counts agree.
    hooked = hooked_saved_bytes_per_layer(TINY, dtype=DTYPES[dtype_name][0], seq=SEQ, micro_batch=BATCH)
    assert hooked == _measure(dtype_name, "none")


@pytest.mark.parametrize(("recompute", "precision", "element"), [("none", "fp32", 4), ("selective", "fp32", 4),
                                                                  ("full", "bf16-mixed", 2),
                                                                  ("selective", "bf16-mixed", 2)])
def test_plan_json_reports_the_llama_count(recompute, precision, element):
    # `v17 plan` for the tiny shape: per_rank.activation_bytes_per_layer is the llama count (not Table 2's GPT one)
    out = _plan("--layers", "2", "--hidden", "128", "--heads", "8", "--kv-heads", "4", "--ffn", "384", "--vocab",
                "64", "--seq", str(SEQ), "--micro-batch", str(BATCH), "--gpu", "cpu", "--gpus", "1", "--tp", "1",
                "--pp", "1", "--recompute", recompute, "--precision", precision)
    planned = out["per_rank"]["activation_bytes_per_layer"]
    assert planned == activation_bytes_per_layer_of(TINY.to_shape(SEQ), seq=SEQ, micro_batch=BATCH,
                                                    recompute=recompute, element_bytes=element)


# ------------------------------------------------------------------------------------ the llama count, by hand


def test_llama_count_by_hand_tiny():
    # Per token, e = 4 (fp32), h = 128, kv = 64, f = 384, a = 8, D = 16:
    #   none: (16 + 4e)h + 2e*kv + 4e*f + 4a + 4D + 8 = 4096 + 512 + 6144 + 32 + 64 + 8 = 10,856
    #   selective: e(5h + 2kv + 2f) + 4a = 4 * 1536 + 32 = 6,176;  full: e*h = 512.   Tokens: 64 * 2 = 128.
    kw = {"seq": 64, "micro_batch": 2, "hidden": 128, "heads": 8, "kv_heads": 4, "ffn": 384, "element_bytes": 4}
    assert llama_activation_bytes_per_layer(**kw, recompute="none") == 10_856 * 128
    assert llama_activation_bytes_per_layer(**kw, recompute="selective") == 6_176 * 128
    assert llama_activation_bytes_per_layer(**kw, recompute="full") == 512 * 128


@pytest.mark.parametrize(
    ("kwargs", "per_token"),
    [
        # llama3-70b: h = 8192, kv = 1024, f = 28672, a = 64, D = 128, bf16 (e = 2), t = 8.
        # TP+SP+selective: e*h/t + 2e*h + (2e*h + 2e*kv + 2e*f + 4a)/t = 2048 + 32768 + 151,808/8 = 53,792
        ({"tp": 8, "sp": True, "recompute": "selective"}, 53_792),
        # TP+selective (no SP): the block input is whole: 16,384 + 32,768 + 18,976 = 68,128
        ({"tp": 8, "recompute": "selective"}, 68_128),
        # TP+SP+none: norms 2*((8h + 4)/t + e*h) = 2*(8192.5 + 16384) = 49,153; RoPE 4D = 512;
        #   (2e*h + 2e*kv + 4a + 4e*f)/t = (32768 + 4096 + 256 + 229,376)/8 = 33,312 -> 82,977
        ({"tp": 8, "sp": True, "recompute": "none"}, 82_977),
        # no parallelism, none: (16 + 8)*8192 + 4*1024 + 8*28672 + 256 + 512 + 8 = 430,856
        ({"recompute": "none"}, 430_856),
        # full + SP: e*h/t = 2048 (Table 2's 2sbh, divided by t with SP)
        ({"tp": 8, "sp": True, "recompute": "full"}, 2_048),
    ],
)
def test_llama_count_by_hand_llama3_70b(kwargs, per_token):
    shape = get_preset("llama3-70b")
    assert activation_bytes_per_layer_of(shape, seq=8192, micro_batch=1, **kwargs) == math.ceil(8192 * per_token)


# -------------------------------------------------- Korthikanti 2022 Table 2 through `v17 plan --json` (gpt arch)

# Korthikanti Table 3: GPT-3 175B (a = 96, h = 12288, L = 96) and 530B (a = 128, h = 20480, L = 105), s = 2048,
# t = 8, V = 51200. Table 2 rows, in bytes per layer (16-bit activations, 1-byte dropout masks):
TABLE2 = {
    "no parallelism": ({"tp": 1, "sp": False, "recompute": "none"},
                       lambda s, b, h, a, t: s * b * h * (34 + 5 * a * s / h)),
    "tensor parallel": ({"tp": 8, "sp": False, "recompute": "none"},
                        lambda s, b, h, a, t: s * b * h * (10 + 24 / t + 5 * a * s / (h * t))),
    "tensor + sequence parallel": ({"tp": 8, "sp": True, "recompute": "none"},
                                   lambda s, b, h, a, t: s * b * h * (34 / t + 5 * a * s / (h * t))),
    "tensor parallel + selective recompute": ({"tp": 8, "sp": False, "recompute": "selective"},
                                              lambda s, b, h, a, t: s * b * h * (10 + 24 / t)),
    "tensor + sequence parallel + selective recompute": ({"tp": 8, "sp": True, "recompute": "selective"},
                                                         lambda s, b, h, a, t: s * b * h * 34 / t),
    "full recompute": ({"tp": 8, "sp": False, "recompute": "full"}, lambda s, b, h, a, t: s * b * h * 2),
}
GPT = {"175B": {"layers": 96, "hidden": 12288, "heads": 96}, "530B": {"layers": 105, "hidden": 20480, "heads": 128}}


@pytest.mark.parametrize("model", list(GPT))
@pytest.mark.parametrize("row", list(TABLE2))
def test_korthikanti_table2_through_the_cli(row, model):
    layout, formula = TABLE2[row]
    g = GPT[model]
    out = _plan("--arch", "gpt", "--layers", str(g["layers"]), "--hidden", str(g["hidden"]), "--heads",
                str(g["heads"]), "--vocab", "51200", "--seq", "2048", "--micro-batch", "1", "--pp", "1", "--dp", "1",
                "--tp", str(layout["tp"]), "--sp" if layout["sp"] else "--no-sp", "--recompute", layout["recompute"],
                "--precision", "bf16-mixed")
    expected = formula(2048, 1, g["hidden"], g["heads"], layout["tp"])
    assert out["per_rank"]["activation_bytes_per_layer"] == pytest.approx(expected, rel=1e-9)


# ---------------------------------------------------------- ZeRO (Rajbhandari 2020) Table 1 through the CLI

# Per-device model-state memory (GB) under P_os, P_os+g, P_os+g+p for each DP degree N_d, mixed-precision Adam
# (K = 12), as printed in the paper (three significant figures, so compared to the printed precision).
ZERO_TABLE1 = {
    "7.5e9": {1: ("120", "120", "120"), 4: ("52.5", "41.3", "30"), 16: ("35.6", "21.6", "7.5"),
              64: ("31.4", "16.6", "1.88"), 256: ("30.4", "15.4", "0.47"), 1024: ("30.1", "15.1", "0.12")},
    "128e9": {1: ("2048", "2048", "2048"), 4: ("896", "704", "512"), 16: ("608", "368", "128"),
              64: ("536", "284", "32"), 256: ("518", "263", "8"), 1024: ("513", "257", "2")},
    "1e12": {1: ("16000", "16000", "16000"), 4: ("7000", "5500", "4000"), 16: ("4750", "2875", "1000"),
             64: ("4187", "2218", "250"), 256: ("4046", "2054", "62.5"), 1024: ("4011", "2013", "15.6")},
}  # fmt: skip
ZERO_CASES = [(params, nd, stage, row[stage - 1]) for params, rows in ZERO_TABLE1.items() for nd, row in rows.items()
              for stage in (1, 2, 3)]


@pytest.mark.parametrize(("params", "nd", "stage", "published"), ZERO_CASES)
def test_zero_table1_through_the_cli(params, nd, stage, published):
    out = _plan("--params", params, "--dp", str(nd), "--tp", "1", "--pp", "1", "--zero-stage", str(stage))
    gb = out["per_rank"]["model_state_bytes"] / 1e9
    last_digit = 10.0 ** -len(published.partition(".")[2])  # "1.88" -> 0.01, "513" -> 1
    assert abs(gb - float(published)) < last_digit, (gb, published)  # the paper rounds or truncates
