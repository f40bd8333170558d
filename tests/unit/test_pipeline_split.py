"""Pipeline split, stage placement and composition errors; TP divisibility errors. Pure: no process group."""

from __future__ import annotations

import pytest
import torch

from lightning_v17.config import PipelinePolicy, Schedule, V17ConfigError
from lightning_v17.engine.pipeline import (
    balanced_split_points,
    check_pipeline_composition,
    split_model,
    stage_ids_for_rank,
)
from lightning_v17.engine.tensor_parallel import check_tensor_parallel, llama_tp_plan
from lightning_v17.models import Llama, ModelConfig


def _model(**kw) -> Llama:
    cfg = {"vocab_size": 320, "hidden": 64, "layers": 8, "heads": 4, "kv_heads": 2, "ffn": 128, "max_seq_len": 64}
    cfg.update(kw)
    torch.manual_seed(0)
    return Llama(ModelConfig(**cfg))


def test_balanced_split_points_minimize_largest_stage():
    m = _model()
    # 8 equal blocks, a 20k-parameter embedding on stage 0 and a 20k head (+ norm) on the last: symmetric halves
    assert balanced_split_points(m, 2) == ["layers.4"]
    assert balanced_split_points(m, 4) == ["layers.2", "layers.4", "layers.6"]
    # a big vocab moves blocks away from the first and last stages
    big = _model(vocab_size=4096)
    block = sum(p.numel() for p in big.layers["0"].parameters())
    emb = big.tok_embeddings.weight.numel()
    pts = balanced_split_points(big, 2)
    assert pts == ["layers.4"]  # embedding and head are equal, so still symmetric
    pts3 = balanced_split_points(big, 3)
    first = int(pts3[0].split(".")[1])
    assert first < 8 // 3 + 1 and emb > block  # stage 0 carries the table, so it gets fewer blocks


def test_balanced_split_brute_force_optimal():
    m = _model(layers=6, vocab_size=2000)
    w = [sum(p.numel() for p in m.layers[str(i)].parameters()) for i in range(6)]
    head, tail = m.tok_embeddings.weight.numel(), m.norm.weight.numel() + m.output.weight.numel()
    import itertools

    def worst(cuts):
        b = [0, *cuts, 6]
        loads = [sum(w[x:y]) for x, y in itertools.pairwise(b)]
        loads[0] += head
        loads[-1] += tail
        return max(loads)

    best = min(worst(c) for c in itertools.combinations(range(1, 6), 2))
    got = [int(p.split(".")[1]) for p in balanced_split_points(m, 3)]
    assert worst(got) == best


def test_stage_ids_looped_and_v():
    assert stage_ids_for_rank(1, pp=4, virtual_stages=2, schedule=Schedule.INTERLEAVED_1F1B) == (1, 5)
    assert stage_ids_for_rank(1, pp=4, virtual_stages=2, schedule=Schedule.ZBV) == (1, 6)
    assert stage_ids_for_rank(0, pp=2, virtual_stages=1, schedule=Schedule.ONE_F_ONE_B) == (0,)


def test_split_model_prunes_in_place_and_keeps_fqns():
    full = _model()
    ref = {k: v.clone() for k, v in full.state_dict().items()}
    m = _model()
    views, ids = split_model(
        m, pp_rank=1, pp=2, policy=PipelinePolicy(schedule="interleaved_1f1b", virtual_stages=2, microbatches=4)
    )
    assert ids == (1, 3)
    assert sorted(m.layers.keys()) == ["2", "3", "6", "7"]
    assert m.tok_embeddings is None and m.output is not None and m.norm is not None
    assert [sorted(v.layers.keys()) for v in views] == [["2", "3"], ["6", "7"]]
    assert views[0].output is None and views[1].output is m.output
    # the views share parameters with the pruned model (no copies): the optimizer over m.parameters() trains them
    assert views[0].layers["2"].attention.wq.weight is m.layers["2"].attention.wq.weight
    sd = m.state_dict()
    assert "layers.6.attention.wq.weight" in sd and "layers.0.attention.wq.weight" not in sd
    for k, v in sd.items():
        assert torch.equal(v, ref[k]), k
    # the stage view computes blocks 2-3 on hidden states
    h = torch.randn(2, 8, 64)
    assert views[0](h, position_ids=torch.arange(8).expand(2, 8)).shape == (2, 8, 64)


def test_split_points_user_and_errors():
    m = _model()
    views, _ = split_model(m, pp_rank=0, pp=2, policy=PipelinePolicy(split_points=("layers.3",)))
    assert sorted(views[0].layers.keys()) == ["0", "1", "2"]
    with pytest.raises(V17ConfigError, match="gives 3 stages"):
        split_model(_model(), pp_rank=0, pp=2, policy=PipelinePolicy(split_points=("layers.2", "layers.4")))
    with pytest.raises(V17ConfigError, match="strictly increasing"):
        split_model(_model(), pp_rank=0, pp=3, policy=PipelinePolicy(split_points=("layers.4", "layers.2")))
    with pytest.raises(V17ConfigError, match="at least one block"):
        split_model(_model(layers=2), pp_rank=0, pp=4, policy=PipelinePolicy())
    with pytest.raises(V17ConfigError, match="virtual_stages=1"):
        split_model(_model(), pp_rank=0, pp=2, policy=PipelinePolicy(schedule="gpipe", virtual_stages=2))
    with pytest.raises(V17ConfigError, match="tie_embeddings"):
        split_model(_model(tie_embeddings=True), pp_rank=0, pp=2, policy=PipelinePolicy())
    with pytest.raises(V17ConfigError, match="zb_h2"):
        split_model(_model(), pp_rank=0, pp=2, policy=PipelinePolicy(schedule="zb_h2", virtual_stages=2))


def test_pp_with_zero3_is_refused_with_the_seed_reason():
    check_pipeline_composition(pp=2, zero_stage=1)
    check_pipeline_composition(pp=1, zero_stage=3)
    for stage in (2, 3):
        with pytest.raises(V17ConfigError, match=r"zero_stage=1.*§17.5|§17.5.*zero_stage=1") as e:
            check_pipeline_composition(pp=2, zero_stage=stage)
        assert f"zero_stage={stage}" in str(e.value) and "ZeRO-1" in str(e.value)


def test_tp_must_divide_heads_and_lists_valid_values():
    m = _model(hidden=64, heads=8, kv_heads=4, ffn=192)
    with pytest.raises(V17ConfigError) as e:
        check_tensor_parallel(m, tp=3)
    assert "tp=3 must divide num_attention_heads=8" in str(e.value)
    assert "try tp in {1, 2, 4}" in str(e.value)  # common divisors of 8 heads, 4 kv heads, ffn 192
    check_tensor_parallel(m, tp=4)
    with pytest.raises(V17ConfigError, match="vocab_size=330"):
        check_tensor_parallel(_model(vocab_size=330, heads=8, kv_heads=4), tp=4, vocab_parallel=True)


def test_default_plan_covers_stage_modules_only():
    m = _model(layers=4)
    split_model(m, pp_rank=1, pp=2, policy=PipelinePolicy())
    plan = llama_tp_plan(m, sequence_parallel=True, loss_parallel=True)
    assert "tok_embeddings" not in plan and "output" in plan and "norm" in plan
    assert "layers.2.attention.wq" in plan and "layers.0.attention.wq" not in plan
    assert type(plan["layers.3.feed_forward.w2"]).__name__ == "RowwiseParallel"
    assert type(plan["layers.3.attention_norm"]).__name__ == "SequenceParallel"


class _FakeMesh:
    """Stands in for a 1-D tp DeviceMesh of size 2: plan dispatch happens before any collective."""

    def size(self) -> int:
        return 2


def test_tensor_parallel_plan_sources():
    from lightning_v17.engine.tensor_parallel import apply_tensor_parallel

    seen = []

    class WithHook(torch.nn.Module):
        def configure_tensor_parallel(self, mesh) -> None:
            seen.append(mesh)

    mesh = _FakeMesh()
    apply_tensor_parallel(WithHook(), tp_mesh=mesh)
    assert seen == [mesh]  # the module's own hook wins
    with pytest.raises(V17ConfigError, match="configure_tensor_parallel"):
        apply_tensor_parallel(torch.nn.Linear(4, 4), tp_mesh=mesh)  # no plan anywhere: say how to give one
    with pytest.raises(V17ConfigError, match="tp=2 must divide num_key_value_heads=1"):
        apply_tensor_parallel(_model(heads=4, kv_heads=1), tp_mesh=mesh)  # validated before any sharding
