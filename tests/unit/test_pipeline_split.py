"""Pipeline split, stage placement and composition errors; TP divisibility errors. Pure: no process group."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_v17.config import PipelinePolicy, V17ConfigError
from lightning_v17.config.schedules import schedule_info
from lightning_v17.engine.pipeline.runtime import (
    PipelineLayout,
    PipelineLoss,
    balanced_split_points,
)
from lightning_v17.engine.pipeline.runtime import split_model as _split_model
from lightning_v17.engine.tp.apply import check_tensor_parallel, llama_tp_plan
from lightning_v17.models import Llama, ModelConfig
from lightning_v17.models.pp_layouts import model_pipeline_layout


def _model(**kw) -> Llama:
    cfg = {"vocab_size": 320, "hidden": 64, "layers": 8, "heads": 4, "kv_heads": 2, "ffn": 128, "max_seq_len": 64}
    cfg.update(kw)
    torch.manual_seed(0)
    return Llama(ModelConfig(**cfg))


def split_model(model, **kw):
    """The engine's split with the reference Llama's layout (what the strategy does)."""
    return _split_model(model, layout=model_pipeline_layout(model), **kw)


def _points(model, n):
    return balanced_split_points(model, n, layout=model_pipeline_layout(model))


def test_balanced_split_points_minimize_largest_stage():
    m = _model()
    # 8 equal blocks, a 20k-parameter embedding on stage 0 and a 20k head (+ norm) on the last: symmetric halves
    assert _points(m, 2) == ["layers.4"]
    assert _points(m, 4) == ["layers.2", "layers.4", "layers.6"]
    # a big vocab moves blocks away from the first and last stages
    big = _model(vocab_size=4096)
    block = sum(p.numel() for p in big.layers["0"].parameters())
    emb = big.tok_embeddings.weight.numel()
    pts = _points(big, 2)
    assert pts == ["layers.4"]  # embedding and head are equal, so still symmetric
    pts3 = _points(big, 3)
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
    got = [int(p.split(".")[1]) for p in _points(m, 3)]
    assert worst(got) == best


def test_stage_ids_looped_and_v():
    # the engine places stages by the one schedule table
    assert schedule_info("interleaved_1f1b").stage_ids(1, pp=4, virtual_stages=2) == (1, 5)
    assert schedule_info("zbv").stage_ids(1, pp=4, virtual_stages=2) == (1, 6)
    assert schedule_info("1f1b").stage_ids(0, pp=2, virtual_stages=1) == (0,)
    _, ids = split_model(_model(), pp_rank=1, pp=4, policy=PipelinePolicy(schedule="zbv", virtual_stages=2))
    assert ids == (1, 6)


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
    assert [list(v.blocks.keys()) for v in views] == [["2", "3"], ["6", "7"]]
    assert views[0].head is None and views[1].head is m.output and views[1].norm is m.norm
    # the stages share parameters with the pruned model (no copies): the optimizer over m.parameters() trains them
    assert views[0].blocks["2"].attention.wq.weight is m.layers["2"].attention.wq.weight
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
    assert list(views[0].blocks.keys()) == ["0", "1", "2"]
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
    """``resolve_tp_plan`` finds the plan (the module's hook, else the model's own); the engine shards it."""
    from lightning_v17.engine.tp.apply import apply_tensor_parallel
    from lightning_v17.models.tp_plans import resolve_tp_plan

    seen = []

    class WithHook(torch.nn.Module):
        def configure_tensor_parallel(self, mesh) -> None:
            seen.append(mesh)

    mesh, hooked = _FakeMesh(), WithHook()
    apply_tensor_parallel(hooked, tp_mesh=mesh, plan=resolve_tp_plan(hooked))
    assert seen == [mesh]  # the module's own hook wins
    with pytest.raises(V17ConfigError, match="configure_tensor_parallel"):
        resolve_tp_plan(torch.nn.Linear(4, 4))  # no plan anywhere: say how to give one
    model = _model(heads=4, kv_heads=1)
    with pytest.raises(V17ConfigError, match="tp=2 must divide num_key_value_heads=1"):
        apply_tensor_parallel(model, tp_mesh=mesh, plan=resolve_tp_plan(model))  # validated before any sharding


# ------------------------------------------------------------------------------------- the engine, model-agnostic


class _Toy(nn.Module):
    """A decoder the engine has never heard of: ``emb`` -> ``trunk.blocks`` (ModuleList) -> ``ln`` -> ``proj``."""

    def __init__(self, n: int = 4, extra: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(16, 8)
        self.trunk = nn.Module()
        self.trunk.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(n))
        self.ln = nn.LayerNorm(8)
        self.proj = nn.Linear(8, 16)
        if extra:
            self.scale = nn.Parameter(torch.ones(1))  # outside every part

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _toy_stage(self, x)


def _toy_stage(stage, x: torch.Tensor, **_) -> torch.Tensor:
    emb, blocks = (stage.emb, stage.trunk.blocks) if isinstance(stage, _Toy) else (stage.embed, stage.blocks.values())
    norm, head = (stage.ln, stage.proj) if isinstance(stage, _Toy) else (stage.norm, stage.head)
    h = emb(x) if emb is not None else x
    for b in blocks:
        h = torch.tanh(b(h))
    h = norm(h) if norm is not None else h
    return head(h) if head is not None else h


TOY = PipelineLayout(embed="emb", blocks="trunk.blocks", norm="ln", head="proj", stage_forward=_toy_stage)


def test_engine_imports_no_model_family():
    """The engine is model-agnostic: it imports nothing from lightning_v17.models, transformers or litgpt."""
    import ast
    import inspect

    import lightning_v17.engine.pipeline.runtime as engine

    imported = set()
    for node in ast.walk(ast.parse(inspect.getsource(engine))):
        if isinstance(node, ast.ImportFrom):
            imported.add(node.module or "")
        elif isinstance(node, ast.Import):
            imported.update(a.name for a in node.names)
    bad = {m for m in imported if m.startswith(("lightning_v17.models", "transformers", "litgpt"))}
    assert not bad, bad


def test_generic_layout_split_keeps_fqns_and_computes_the_same():
    full = _Toy()
    x = torch.randint(0, 16, (2, 5))
    with torch.no_grad():
        want = full(x)
    names = {k for k, _ in full.named_parameters()}
    parts = {}
    for rank in (0, 1):
        m = copy.deepcopy(full)
        stages, ids = _split_model(m, layout=TOY, pp_rank=rank, pp=2, policy=PipelinePolicy())
        parts.update(zip(ids, stages))
        assert isinstance(m.trunk.blocks, nn.ModuleDict)
        assert list(m.trunk.blocks) == (["0", "1"] if rank == 0 else ["2", "3"])
        local = {k for k, _ in m.named_parameters()}
        assert local <= names and (("emb.weight" in local) == (rank == 0)) and (("proj.weight" in local) == (rank == 1))
    with torch.no_grad():
        assert torch.equal(parts[1](parts[0](x)), want)


def test_generic_layout_refusals_name_the_fix():
    with pytest.raises(V17ConfigError, match=r"outside the pipeline layout.*\['scale'\]"):
        _split_model(_Toy(extra=True), layout=TOY, pp_rank=0, pp=2, policy=PipelinePolicy())
    tied = _Toy()
    tied.proj.weight = tied.emb.weight  # [16, 8] both
    with pytest.raises(V17ConfigError, match=r"stages \[0, 1\] would share one parameter \(emb.weight is proj.weight"):
        _split_model(tied, layout=TOY, pp_rank=1, pp=2, policy=PipelinePolicy())
    with pytest.raises(V17ConfigError, match=r"'trunk.blocks.7' is not a block.*trunk.blocks.0 \.\. trunk.blocks.3"):
        _split_model(_Toy(), layout=TOY, pp_rank=0, pp=2, policy=PipelinePolicy(split_points=("trunk.blocks.7",)))
    bad = PipelineLayout(embed="emb", blocks="ln", norm=None, head="proj", stage_forward=_toy_stage)
    with pytest.raises(V17ConfigError, match="must be a non-empty nn.ModuleList or nn.ModuleDict"):
        _split_model(_Toy(), layout=bad, pp_rank=0, pp=2, policy=PipelinePolicy())
    gone = PipelineLayout(embed="embedding", blocks="trunk.blocks", norm="ln", head="proj", stage_forward=_toy_stage)
    with pytest.raises(V17ConfigError, match="names the embedding 'embedding'"):
        _split_model(_Toy(), layout=gone, pp_rank=0, pp=2, policy=PipelinePolicy())


def _loss(labels, *, mask=None, rows=None, padded=None, shift=False, loss_fn=None, batch=None):
    loss = PipelineLoss(loss_fn)
    rows = labels.shape[0] if rows is None else rows
    parts = {"labels": labels} if mask is None else {"labels": labels, "loss_mask": mask}
    loss.prepare(batch if batch is not None else parts, parts, rows=rows, padded_rows=padded or rows, shift=shift)
    return loss


def test_token_mean_is_the_whole_batch_mean_for_any_micro_batching():
    torch.manual_seed(0)
    logits = torch.randn(4, 6, 11)
    labels = torch.randint(0, 11, (4, 6))
    labels[0, :5] = -100  # micro-batches with different numbers of valid tokens
    want = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    loss = _loss(labels)
    for chunks in ([[0], [1], [2], [3]], [[0, 1], [2, 3]]):
        got = sum(loss(logits[c[0] : c[-1] + 1], torch.tensor(c)) for c in chunks)
        assert torch.allclose(got, want, rtol=1e-6, atol=0)
    mask = torch.rand(4, 6)
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="none")
    w = (labels != -100).float().flatten() * mask.flatten()
    got = sum(_loss(labels, mask=mask)(logits[r : r + 1], torch.tensor([r])) for r in range(4))
    assert torch.allclose(got, (ce * w).sum() / w.sum(), rtol=1e-6)
    shifted = _loss(labels, shift=True)(logits, torch.arange(4))
    want = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
    assert torch.allclose(shifted, want, rtol=1e-6)


def test_padding_rows_add_nothing_and_never_reach_loss_fn():
    torch.manual_seed(0)
    logits = torch.randn(8, 6, 11)
    labels = torch.randint(0, 11, (5, 6))
    want = F.cross_entropy(logits[:5].flatten(0, 1), labels.flatten())
    tm = _loss(labels, rows=5, padded=8)
    assert torch.allclose(sum(tm(logits[r : r + 2], torch.arange(r, r + 2)) for r in (0, 2, 4, 6)), want, rtol=1e-6)
    seen = []

    def mean_ce(lg, mb):
        seen.append((lg.shape[0], mb["input_ids"].shape[0], int(mb["input_ids"][0, 0])))
        return F.cross_entropy(lg.flatten(0, 1), mb["labels"].flatten())

    ids = torch.arange(5).unsqueeze(1).expand(5, 6)
    batch = {"input_ids": ids, "labels": labels, "cu_seqlens": torch.tensor([0, 6, 12, 18, 24, 30])}
    fn = _loss(labels, rows=5, padded=8, loss_fn=mean_ce, batch=batch)
    got = sum(fn(logits[r : r + 2], torch.arange(r, r + 2)) for r in (0, 2, 4, 6))
    assert torch.allclose(got, want, rtol=1e-6)  # row-weighted mean of equal-token rows == the batch mean
    assert seen == [(2, 2, 0), (2, 2, 2), (1, 1, 4)]  # the all-padding micro-batch is not called


def test_ragged_batches_pad_to_the_established_size_per_mode():
    from types import SimpleNamespace

    from lightning_v17.engine.pipeline.runtime import _padded_rows

    rt = SimpleNamespace(policy=PipelinePolicy(microbatches=4), shapes={}, last_train=None)

    def run(rows, seq=16, train=True):
        out = _padded_rows(rt, rows, seq, train=train)
        rt.last_train = train
        return out

    assert run(6) == 8  # not a multiple of 4 micro-batches: padded from the start
    assert run(8) == 8 and run(5) == 8 and run(1) == 8
    with pytest.raises(V17ConfigError, match="has 9 rows but the pipeline stages were sized for 8"):
        run(9)
    with pytest.raises(V17ConfigError, match="sequence length 12 but the pipeline stages were sized for 16"):
        run(8, seq=12)
    assert run(3, train=False) == 4  # eval re-infers the shapes: its own size
    assert run(5) == 8  # back to training: re-inferred, at least the remembered size
    assert run(12, train=False) == 12  # a mode switch may grow


def test_batch_forms_and_errors():
    from lightning_v17.engine.pipeline.runtime import _as_dict

    ids = torch.zeros(2, 4, dtype=torch.long)
    assert set(_as_dict((ids, ids))) == {"input_ids", "labels"}
    assert set(_as_dict([ids, ids])) == {"input_ids", "labels"}
    with pytest.raises(V17ConfigError, match="needs 'input_ids'.*'labels'"):
        _as_dict({"input_ids": ids})
    with pytest.raises(V17ConfigError, match=r"labels \(2, 3\) must have the shape of input_ids \(2, 4\)"):
        _as_dict({"input_ids": ids, "labels": ids[:, :3]})
    with pytest.raises(V17ConfigError, match="dict with 'input_ids' and 'labels' or an \\(inputs, labels\\) pair"):
        _as_dict(ids)


def test_failure_watch_is_inert_without_a_process_group():
    from lightning_v17.engine.pipeline.runtime import PeerFailureWatch

    watch = PeerFailureWatch("k")
    assert not watch.active
    with pytest.raises(RuntimeError, match="own error"), watch.guard():
        raise RuntimeError("own error")
