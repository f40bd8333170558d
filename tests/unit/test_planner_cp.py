"""The planner's context parallelism: the cp scheme and its bytes, the activations per rank, the long-sequence recipe.

* ``planner.comm.cp_forward_elements_per_layer`` and ``planner.comm.choose_cp_mode`` (torch-free) agree with the
  engine's ``engine.cp.cp_comm_elements`` and ``engine.cp.choose_cp_mode`` on a grid of head configurations and cp
  degrees; "auto" is also held to the rule written out here (ulysses exactly when the heads allow it and
  cp > (Hq + Hkv) / Hkv), not to either implementation.
* Hand-worked bytes for Llama-3-8B (32 query heads, 8 KV heads, head width 128) at cp 2 and 8.
* ``v17 plan --model llama3-8b --gpus 8 --seq-len 131072`` recommends cp > 1 and fits, where cp = 1 does not.
"""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from lightning_v17.config import CPMode, V17ConfigError
from lightning_v17.planner import comm
from lightning_v17.planner.cli import main
from lightning_v17.planner.memory import (
    activation_bytes_per_layer_of,
    cp_allgather_delta_bytes_per_layer,
    cp_allgather_transient_bytes_per_layer,
)
from lightning_v17.planner.model import get_preset

HEADS = [(32, 8), (8, 4), (8, 1), (4, 4), (6, 3), (6, 2), (16, 2), (64, 8), (12, 12)]
CPS = [1, 2, 3, 4, 6, 8, 16]


def _plan(*argv: str) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([*argv, "--json"]) == 0
    return json.loads(out.getvalue())


def _rule(cp: int, heads: int, kv_heads: int) -> str:
    """The rule written out: ulysses where it exists and moves less, i.e. cp > (Hq + Hkv) / Hkv."""
    exists = heads % cp == 0 and (kv_heads % cp == 0 or cp % kv_heads == 0)
    if not exists:
        return "allgather"
    # with Hkv' = max(Hkv, cp): ulysses (2Hq + 2Hkv') S/cp against allgather 2 Hkv S
    return "ulysses" if (heads + max(kv_heads, cp)) / cp < kv_heads else "allgather"


@pytest.mark.parametrize(("heads", "kv_heads"), HEADS)
def test_the_planner_counts_the_elements_the_engine_counts(heads, kv_heads):
    from lightning_v17.engine.cp import cp_comm_elements

    for cp in CPS:
        for mode in ("ulysses", "allgather"):
            dims = {"cp": cp, "heads": heads, "kv_heads": kv_heads, "head_dim": 64}
            engine = cp_comm_elements(mode, seq_len=4096 * cp, **dims)
            assert comm.cp_forward_elements_per_layer(mode, seq=4096 * cp, **dims) == pytest.approx(engine, rel=1e-12)


@pytest.mark.parametrize(("heads", "kv_heads"), HEADS)
def test_auto_picks_what_the_engine_and_the_rule_pick(heads, kv_heads):
    from lightning_v17.engine.cp import choose_cp_mode as engine_choose

    for cp in CPS:
        planned, why = comm.choose_cp_mode("auto", cp=cp, heads=heads, kv_heads=kv_heads)
        assert planned == engine_choose("auto", cp=cp, heads=heads, kv_heads=kv_heads), (cp, heads, kv_heads)
        if cp > 1:
            assert planned.value == _rule(cp, heads, kv_heads), (cp, heads, kv_heads)
        assert why.startswith("auto: ") and "\n" not in why
        # an explicit ulysses is refused by both exactly where the heads do not allow it
        engine_refuses = planner_refuses = False
        try:
            engine_choose("ulysses", cp=cp, heads=heads, kv_heads=kv_heads)
        except V17ConfigError:
            engine_refuses = True
        try:
            comm.choose_cp_mode("ulysses", cp=cp, heads=heads, kv_heads=kv_heads)
        except V17ConfigError as err:
            planner_refuses = True
            assert "allgather" in str(err)
        assert engine_refuses == planner_refuses, (cp, heads, kv_heads)


def test_llama3_8b_cp_bytes_by_hand():
    # Hq = 32, Hkv = 8, D = 128, S = 131072, bf16, one row. Forward elements per layer:
    #   cp=2 ulysses (2*32 + 2*8) * 128 * 65536 * 1/2 = 335,544,320; allgather 2*8*128*131072*1/2 = 134,217,728
    #   cp=8 ulysses (64 + 16) * 128 * 16384 * 7/8 = 146,800,640;    allgather 2*8*128*131072*7/8 = 234,881,024
    # bytes per layer, x2 (bf16): ulysses x2 passes (forward, backward); allgather x3 (forward all-gather,
    # backward all-gather and reduce-scatter); recompute full: one pass more
    kw = {"seq": 131072, "micro_batch": 1, "kv_dim": 1024, "heads": 32, "kv_heads": 8, "element_bytes": 2}
    assert comm.cp_comm_bytes_per_layer(cp=2, mode="ulysses", **kw) == 335_544_320 * 2 * 2
    assert comm.cp_comm_bytes_per_layer(cp=2, mode="allgather", **kw) == 134_217_728 * 3 * 2
    assert comm.cp_comm_bytes_per_layer(cp=8, mode="ulysses", **kw) == 146_800_640 * 2 * 2
    assert comm.cp_comm_bytes_per_layer(cp=8, mode="ulysses", recompute="full", **kw) == 146_800_640 * 3 * 2
    assert comm.cp_comm_bytes_per_layer(cp=8, mode="allgather", recompute="full", **kw) == 234_881_024 * 4 * 2
    assert comm.choose_cp_mode("auto", cp=8, heads=32, kv_heads=8)[0] == CPMode.ULYSSES  # 8 > (32 + 8)/8 = 5
    assert comm.choose_cp_mode("auto", cp=4, heads=32, kv_heads=8)[0] == CPMode.ALLGATHER  # 4 < 5
    # the legacy count without a mode (Megatron-Core's, three passes) is unchanged
    assert comm.cp_comm_bytes_per_layer(seq=8192, micro_batch=1, kv_dim=1024, cp=2) == 50_331_648


def test_activations_per_rank_divide_by_cp_and_allgather_keeps_no_gathered_kv():
    shape = get_preset("llama3-8b")
    kw = {"seq": 8192, "micro_batch": 1, "element_bytes": 2}
    one = activation_bytes_per_layer_of(shape, cp=1, **kw)
    uly = activation_bytes_per_layer_of(shape, cp=4, cp_mode="ulysses", **kw)
    ag = activation_bytes_per_layer_of(shape, cp=4, cp_mode="allgather", **kw)
    assert uly == pytest.approx(one / 4, abs=1)
    # allgather, by hand: the local q, k, v are kept, not the fp32 log-sum-exp [2048 tokens x 32 heads]
    assert uly - ag == pytest.approx(2048 * 32 * 4, abs=2)
    assert cp_allgather_delta_bytes_per_layer(seq=8192, micro_batch=1, heads=32, cp=4, recompute="full") == 0
    # the transient buffers: K and V of the whole row 2*8192*1024*2 B, less the local ones (/4), plus the additive
    # mask [1, 1, 2048, 8192] of bf16: 25,165,824 + 33,554,432
    transient = cp_allgather_transient_bytes_per_layer(seq=8192, micro_batch=1, kv_dim=1024, cp=4, element_bytes=2)
    assert transient == 2 * 8192 * 1024 * 2 * 3 // 4 + 2048 * 8192 * 2


def test_a_131072_token_plan_for_llama3_8b_on_8_h100_recommends_cp():
    out = _plan("--model", "llama3-8b", "--gpus", "8", "--seq-len", "131072", "--rule-of-thumb")
    assert out["recommendation"]["cp"] > 1 and out["layout"]["cp"] == out["recommendation"]["cp"]
    assert out["fits"], out["tiers"]
    cp = out["layout"]["cp"]
    assert out["layout"]["cp_mode"] == comm.choose_cp_mode("auto", cp=cp, heads=32, kv_heads=8)[0].value
    assert out["cp"]["mode"] == out["layout"]["cp_mode"] and out["cp"]["requested"] == "auto"
    assert set(out["cp"]["bytes_per_layer"]) == {"ulysses", "allgather"}
    assert any(c["axis"] == "cp" for c in out["comm"]["collectives"])
    assert any("cp=1 do not fit" in n for n in out["recommendation"]["notes"])
    # the same plan at cp = 1 does not fit, whatever it recomputes
    single = _plan("--model", "llama3-8b", "--gpus", "8", "--seq-len", "131072", "--cp", "1", "--recompute", "full")
    assert not single["fits"]
    # a short sequence keeps cp = 1
    assert _plan("--model", "llama3-8b", "--gpus", "8")["recommendation"]["cp"] == 1


def test_cp_mode_flag():
    base = ("--model", "llama3-8b", "--gpus", "8", "--seq", "32768")
    ag = _plan(*base, "--cp", "8", "--cp-mode", "allgather")
    uly = _plan(*base, "--cp", "8")  # auto: ulysses at cp=8
    assert (ag["layout"]["cp_mode"], uly["layout"]["cp_mode"]) == ("allgather", "ulysses")
    assert ag["cp"]["why"].startswith("allgather: asked for")
    # the scheme's bytes are what the cp collective of the plan sends: bytes per layer x layers x micro-batches
    for out in (ag, uly):
        (cp_coll,) = [c for c in out["comm"]["collectives"] if c["axis"] == "cp"]
        assert cp_coll["bytes_per_step"] == out["cp"]["bytes_per_layer"][out["layout"]["cp_mode"]] * 32
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main([*base, "--cp", "8", "--hidden", "1536", "--heads", "12", "--kv-heads", "4", "--cp-mode", "ulysses"]) == 2
    assert "mode='allgather'" in err.getvalue() and "--cp-mode ulysses" in err.getvalue()
    with contextlib.redirect_stderr(err):
        assert main([*base, "--cp", "2", "--cp-mode", "ring"]) == 2
