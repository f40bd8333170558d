"""Presets and exact parameter counts (planner/model.py). Expected values are worked out by hand below."""

from __future__ import annotations

import pytest

from lightning_v17.config import V17ConfigError
from lightning_v17.planner.model import PRESETS, Arch, ModelShape, get_preset


def test_llama2_7b_param_count_matches_published():
    # V*h*2 = 32000*4096*2 = 262,144,000 (untied embedding + output)
    # per block: 2h^2 = 33,554,432; 2h*kv = 2*4096*4096 = 33,554,432; 3h*ffn = 3*4096*11008 = 135,266,304; 2h = 8,192
    #   = 202,383,360; x 32 = 6,476,267,520; + final norm 4,096 -> 6,738,415,616 (Touvron 2023, HF LlamaForCausalLM)
    assert get_preset("llama2-7b").num_params == 6_738_415_616


def test_llama3_param_counts_match_published():
    # llama3-8b: 2*128256*4096 = 1,050,673,152; block 2*4096^2 + 2*4096*1024 + 3*4096*14336 + 8192 = 218,112,000;
    #   x32 = 6,979,584,000; + 4096 -> 8,030,261,248 (HF Meta-Llama-3-8B)
    assert get_preset("llama3-8b").num_params == 8_030_261_248
    # llama3-70b: 2*128256*8192 = 2,101,346,304; block 2*8192^2 + 2*8192*1024 + 3*8192*28672 + 16384 = 855,654,400;
    #   x80 = 68,452,352,000; + 8192 -> 70,553,706,496 (HF Meta-Llama-3-70B)
    assert get_preset("llama3-70b").num_params == 70_553_706_496
    # llama3-405b: 2*128256*16384 = 4,202,692,608; block 2*16384^2 + 2*16384*1024 + 3*16384*53248 + 32768
    #   = 536,870,912 + 33,554,432 + 2,617,245,696 + 32,768 = 3,187,703,808; x126 = 401,650,679,808;
    #   + 16384 -> 405,853,388,800 (HF Meta-Llama-3.1-405B)
    assert get_preset("llama3-405b").num_params == 405_853_388_800


def test_tiny_and_gpt3_param_counts_by_hand():
    # tiny: 2*320*128 = 81,920; block 2*128^2 + 2*128*64 + 3*128*384 + 256 = 32,768 + 16,384 + 147,456 + 256
    #   = 196,864; x4 = 787,456; + 128 -> 869,504
    assert get_preset("tiny").num_params == 869_504
    # gpt3-175b (MHA+biases, 4h MLP, learned positions, 2 LN/block, final LN, tied):
    #   block 12h^2 + 13h = 12*150,994,944 + 13*12288 = 1,812,099,072; x96 = 173,961,510,912
    #   + tokens 50257*12288 = 617,558,016 + positions 2048*12288 = 25,165,824 + final LN 2*12288 = 24,576
    #   -> 174,604,259,328 (Brown 2020 calls it 175B)
    assert get_preset("gpt3-175b").num_params == 174_604_259_328


def test_gpt2_small_matches_published_count():
    # GPT-2 small (L=12, h=768, V=50257, 1024 positions, tied): 12*(12*768^2 + 13*768) = 85,054,464
    #   + 50257*768 = 38,597,376 + 1024*768 = 786,432 + 2*768 = 1,536 -> 124,439,808 (HF gpt2)
    shape = ModelShape(Arch.GPT, layers=12, hidden=768, heads=12, kv_heads=12, ffn=3072, vocab=50257, seq=1024,
                       tie_embeddings=True)
    assert shape.num_params == 124_439_808


def test_preset_table_is_the_contract():
    t = PRESETS["llama3-70b"]
    assert (t.arch, t.layers, t.hidden, t.heads, t.kv_heads, t.ffn, t.vocab, t.seq, t.tie_embeddings) == (
        "llama", 80, 8192, 64, 8, 28672, 128256, 8192, False)
    assert t.rope_theta == 5e5
    assert set(PRESETS) == {"tiny", "llama2-7b", "llama3-8b", "llama3-70b", "llama3-405b", "gpt3-175b", "tiny-moe",
                            "mixtral-8x7b"}
    tiny = PRESETS["tiny"]
    assert (tiny.layers, tiny.hidden, tiny.heads, tiny.kv_heads, tiny.ffn, tiny.vocab, tiny.seq) == (
        4, 128, 8, 4, 384, 320, 512)
    assert PRESETS["gpt3-175b"].tie_embeddings and PRESETS["gpt3-175b"].arch == Arch.GPT


def test_largest_unit_is_the_output_head_for_llama3_70b():
    # block 855,654,400 (above) < head = output 128256*8192 = 1,050,673,152 + norm 8192 = 1,050,681,344
    assert get_preset("llama3-70b").largest_unit_params == 1_050_681_344


def test_unknown_preset_lists_presets():
    with pytest.raises(V17ConfigError, match="unknown model preset 'llama9'.*tiny, llama2-7b"):
        get_preset("llama9")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [({"hidden": 100}, "hidden=100 must be divisible by heads=8"), ({"kv_heads": 3}, "kv_heads=3 must divide"),
     ({"layers": -1}, "layers=-1 must be a positive integer"), ({"arch": "bert"}, "arch='bert'")],
)
def test_shape_validation_names_the_option(overrides, message):
    base = {"arch": "llama", "layers": 2, "hidden": 128, "heads": 8, "kv_heads": 4, "ffn": 256, "vocab": 10,
            "seq": 16}
    with pytest.raises(V17ConfigError, match=message):
        ModelShape(**{**base, **overrides})
