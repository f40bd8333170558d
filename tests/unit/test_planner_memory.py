"""planner/memory.py: ZeRO model state, optimizer K, Korthikanti activations, temporary buffers.

Every expected value is worked out by hand in a comment next to it.
"""

from __future__ import annotations

import pytest

from lightning_v17.config import OptimizerKind, Precision, Recompute, Schedule, ZeroPolicy
from lightning_v17.planner.memory import (
    ModelStateBytes,
    activation_bytes_first_stage,
    activation_bytes_per_layer,
    grad_bucket_bytes,
    logits_bytes,
    model_state_bytes_per_rank,
    optimizer_bytes_per_param,
    zero3_gather_bytes,
)


@pytest.mark.parametrize(
    ("stage", "expected_bytes", "published_gb"),
    [
        (0, 120_000_000_000, 120.0),  # (2 + 2 + 12) * 7.5e9 = 120e9
        (1, 31_406_250_000, 31.4),  # (2 + 2) * 7.5e9 + 12 * 7.5e9 / 64 = 30e9 + 1.40625e9
        (2, 16_640_625_000, 16.6),  # 2 * 7.5e9 + (2 + 12) * 7.5e9 / 64 = 15e9 + 1.640625e9
        (3, 1_875_000_000, 1.88),  # (2 + 2 + 12) * 7.5e9 / 64 = 1.875e9
    ],
)
def test_zero_fig1(stage, expected_bytes, published_gb):
    """ZeRO (Rajbhandari 2020) Fig. 1: Ψ = 7.5B, N_d = 64, K = 12 -> 120 / 31.4 / 16.6 / 1.88 GB (GB = 1e9)."""
    state = model_state_bytes_per_rank(7.5e9, zero=ZeroPolicy(stage=stage), dp=64)
    assert state.total == expected_bytes
    assert round(state.total / 1e9, 2 if published_gb < 10 else 1) == published_gb
    assert state.total == state.param + state.grad + state.optimizer


def test_model_state_divides_by_tp_pp_first():
    # Ψ = 8e9 / (tp=2 * pp=2) = 2e9; ZeRO-1 over dp=4: param 2*2e9 = 4e9, grad 4e9, optimizer 12*2e9/4 = 6e9
    assert model_state_bytes_per_rank(8e9, zero=ZeroPolicy(stage=1), dp=4, tp=2, pp=2) == ModelStateBytes(
        param=4_000_000_000, grad=4_000_000_000, optimizer=6_000_000_000, total=14_000_000_000)


def test_model_state_fp32_adamw_and_rounding_up():
    # fp32 AdamW: 4 + 4 + 8 bytes; 1000 params, ZeRO-2 over dp=3: param 4000, grad ceil(4000/3) = 1334,
    # optimizer ceil(8000/3) = 2667 -> total 8001
    s = model_state_bytes_per_rank(1000, zero=ZeroPolicy(stage=2), dp=3, param_bytes=4, grad_bytes=4, optimizer_bytes=8)
    assert (s.param, s.grad, s.optimizer, s.total) == (4000, 1334, 2667, 8001)


@pytest.mark.parametrize(
    ("kind", "precision", "k"),
    [
        ("adamw", "bf16-mixed", 12.0),  # master 4 + m 4 + v 4 (ZeRO §3.1)
        ("adam", "16-mixed", 12.0),
        ("adamw", "32-true", 8.0),  # the fp32 param is the master: m 4 + v 4
        ("adamw", "fp8", 12.0),  # fp8 keeps an fp32 master
        ("adamw", "bf16-true", 4.0),  # bf16 m 2 + v 2, no master
        ("adam8bit", "bf16-mixed", 6.03125),  # master 4 + 2 * (1 + 4/256 absmax per 256-block) = 4 + 2.03125
        ("adam8bit", "32-true", 2.03125),
        ("adafactor", "bf16-mixed", 4.0),  # master only; factored second moment ~0
        ("lion", "bf16-mixed", 8.0),  # master 4 + momentum 4
        ("sgd", "32-true", 4.0),  # momentum 4
    ],
)
def test_optimizer_bytes_per_param(kind, precision, k):
    assert optimizer_bytes_per_param(OptimizerKind.parse(kind), Precision.parse(precision)) == k


# Korthikanti 2022 Table 2 at GPT-3 175B's training shape: s = 2048, b = 1, h = 12288, a = 96, t = 8.
# sbh = 2048 * 12288 = 25,165,824; 5as/h = 5 * 96 * 2048 / 12288 = 80.
SBH = 25_165_824
GPT3 = {"seq": 2048, "micro_batch": 1, "hidden": 12288, "heads": 96}


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({}, SBH * 114),  # no parallelism: sbh(34 + 80) = 2,868,903,936
        ({"tp": 8}, SBH * 23),  # TP: sbh(10 + 24/8 + 80/8) = sbh * 23 = 578,813,952
        ({"tp": 8, "sp": True}, SBH * 114 // 8),  # TP+SP: sbh/8 * 114 = 358,612,992
        ({"tp": 8, "recompute": "selective"}, SBH * 13),  # TP + selective: sbh(10 + 3) = 327,155,712
        ({"tp": 8, "sp": True, "recompute": "selective"}, SBH * 34 // 8),  # sbh * 34/8 = 106,954,752
        ({"tp": 8, "recompute": "full"}, 2 * SBH),  # full: 2sbh = 50,331,648
        ({"tp": 8, "sp": True, "recompute": "full"}, 2 * SBH // 8),  # full + SP: 2sbh/8 = 6,291,456
        ({"cp": 2}, SBH // 2 * 114),  # cp=2 halves the leading s only: 1024*12288*(34 + 80) = 1,434,451,968
        ({"element_bytes": 4}, SBH * 210),  # fp32: (4*4+2) + 12*4 + (2*4+1)*16 = 18 + 48 + 144 = 210
    ],
)
def test_activation_bytes_per_layer_korthikanti_table2(kwargs, expected):
    assert activation_bytes_per_layer(**GPT3, **kwargs) == expected


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        # per-layer 100 B, L = 80, p = 4 -> 20 layers per stage.
        ({"pp": 4, "microbatches": 16}, 8000),  # 1F1B: 20 layers * 4 in flight * 100 = L * 100 (Eq. 5)
        ({"pp": 4, "microbatches": 2}, 4000),  # m < p: only 2 in flight: 20 * 2 * 100
        ({"pp": 4, "microbatches": 16, "schedule": "gpipe"}, 32000),  # GPipe keeps all m = 16: 20 * 16 * 100
        ({"pp": 4, "microbatches": 16, "schedule": "interleaved", "virtual_stages": 2}, 11000),  # 8000*(1 + 3/8)
        ({"pp": 4, "microbatches": 16, "schedule": "zb_h2"}, 14000),  # ZB-H2: 2p - 1 = 7 in flight: 20 * 7 * 100
        ({"pp": 1, "microbatches": 16}, 8000),  # no pipeline: one micro-batch of all 80 layers
    ],
)
def test_activation_bytes_first_stage(kwargs, expected):
    if "schedule" in kwargs:
        kwargs["schedule"] = Schedule.parse(kwargs["schedule"])
    assert activation_bytes_first_stage(100, layers=80, **kwargs) == expected


def test_temporary_buffers():
    # ZeRO-3: unit 1000 params over tp=2 -> 500; gathered current + prefetched 500*2*2 = 2000, unsharded grad 500*2
    assert zero3_gather_bytes(1000, tp=2, param_bytes=2, grad_bytes=2) == 3000
    # ZeRO-1/2 reduce bucket: 25 MiB = 25 * 1,048,576 = 26,214,400; stage 0 and 3: none
    assert grad_bucket_bytes(zero=ZeroPolicy(stage=2)) == 26_214_400
    assert grad_bucket_bytes(zero=ZeroPolicy(stage=0)) == grad_bucket_bytes(zero=ZeroPolicy(stage=3)) == 0
    # fp32 logits: 4 * 8192 * 128256 / 8 = 525,336,576
    assert logits_bytes(seq=8192, micro_batch=1, vocab=128256, tp=8) == 525_336_576


def test_recompute_strings_parse_through_config_enum():
    assert activation_bytes_per_layer(**GPT3, tp=8, recompute=Recompute.FULL) == activation_bytes_per_layer(
        **GPT3, tp=8, recompute="full")
