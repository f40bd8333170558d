import pytest

from lightning_v17.config import (
    MeshSpec,
    PipelinePolicy,
    Precision,
    Recompute,
    Schedule,
    V17ConfigError,
    ZeroPolicy,
    check_tp_divides,
)


def test_mesh_resolve_auto_and_product():
    assert MeshSpec.resolve(8, tp=2, pp=2) == MeshSpec(pp=2, dp_shard=2, tp=2)
    assert MeshSpec.resolve(8, tp=2, pp=2).world_size == 8
    with pytest.raises(V17ConfigError, match="not divisible by"):
        MeshSpec.resolve(6, tp=4)
    with pytest.raises(V17ConfigError, match="does not equal the world size 4"):
        MeshSpec.resolve(4, tp=2, dp_shard=4)
    with pytest.raises(V17ConfigError, match="tp=0 must be a positive integer"):
        MeshSpec(tp=0)


def test_tp_must_divide_heads_message():
    with pytest.raises(V17ConfigError, match=r"tp=3 must divide num_attention_heads=8; try tp in \{1, 2, 4, 8\}"):
        check_tp_divides(3, num_attention_heads=8)
    check_tp_divides(4, num_attention_heads=8, num_kv_heads=4)


def test_enums_parse_once_with_clear_errors():
    assert Recompute.parse("selective") is Recompute.SELECTIVE and Recompute.parse(None) is Recompute.NONE
    assert Schedule.parse("interleaved") is Schedule.INTERLEAVED_1F1B
    assert Precision.parse("bf16") is Precision.BF16_MIXED and Precision.parse(32) is Precision.FP32
    with pytest.raises(V17ConfigError, match="activation_checkpointing='half'"):
        Recompute.parse("half")
    with pytest.raises(V17ConfigError, match="zero_stage=4"):
        ZeroPolicy(stage=4)
    with pytest.raises(V17ConfigError, match="virtual_stages >= 2"):
        PipelinePolicy(schedule="interleaved_1f1b", virtual_stages=1)
