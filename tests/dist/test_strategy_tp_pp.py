"""V17Strategy's TP and PP slots on 2 gloo ranks (dp = 1), with global-norm clipping active, against a 1-process
Lightning run of the same LlamaLM, data order and seed.

Clipping crosses every axis here: pp (each rank holds other stages), tp (sharded vs replicated parameters) and the
ZeRO shards, so a norm computed on any subset would change the losses. The reference asserts that every step clips
(unclipped norm > 2 * max_norm), and the optimizer is SGD so that the clipping factor shows in the losses.
Tolerance: 1e-5 relative (fp32).
"""

from __future__ import annotations

import pytest
import torch

from tests._dist import spawn

#: the compositions this file checks against one process (docs/gen_layouts.py builds docs/layouts.md from them)
COMPOSES = (("pp", "accumulation"), ("sp", "loss_parallel"))

SEQ, STEPS, CLIP, LR = 16, 3, 0.5, 2.0
CASES = {
    "pp2_zero1": {"pp": 2, "zero_stage": 1, "microbatches": 2},
    "tp2_zero0": {"tp": 2, "zero_stage": 0},
    "tp2_zero1": {"tp": 2, "zero_stage": 1},
    "tp2_zero3": {"tp": 2, "zero_stage": 3},
    # the strategy options for the model's own plan: norms sequence-sharded, embedding vocab-sharded, logits kept
    # vocab-sharded with the loss computed on the shards (training_step and backward inside loss_parallel())
    "tp2_zero3_sp_vocab_loss": {
        "tp": 2, "zero_stage": 3, "sequence_parallel": True, "vocab_parallel": True, "loss_parallel": True
    },
}
# The multi-chunk schedules inside a Trainer: a 4-block model (2 chunks per rank of 1 block each), against the same
# 4-block model in one process.
SCHEDULE_CASES = {
    "pp2_interleaved_1f1b": {"pp": 2, "zero_stage": 1, "pp_schedule": "interleaved_1f1b", "virtual_stages": 2,
                             "microbatches": 2},
    "pp2_zero_bubble": {"pp": 2, "zero_stage": 1, "pp_schedule": "zero_bubble", "virtual_stages": 2,
                        "microbatches": 2},
    # Qi's ZB-H1: one stage per rank (2 blocks each), split backward, through torch's interleaved zero-bubble runtime
    "pp2_zb_h1": {"pp": 2, "zero_stage": 1, "pp_schedule": "zb_h1", "microbatches": 2},
}  # fmt: skip
# fp16 with dynamic loss scaling (Lightning's CPU "16-mixed" turns into bf16 without a scaler; the DeepSpeed-style
# config builds MixedPrecision("16-mixed") with a GradScaler). The pipeline back-propagates loss * scale itself; the
# reference is the same run without PP (Lightning's own scaler.scale(loss).backward()). No clipping and plain SGD, so
# a gradient left scaled by 2**8 would blow the losses up.
FP16 = {"fp16": {"enabled": True, "initial_scale_power": 8}}
FP16_CASES = {
    "fp16_pp2_zero1": {"pp": 2, "zero_stage": 1, "microbatches": 2},
    "fp16_dp2_zero1": {"zero_stage": 1},
}
FP16_RTOL = 2e-3  # fp16 autocast: the pipeline's micro-batches of 2 rows round differently from one batch of 4
# bf16-mixed (autocast, fp32 master weights) through the pipeline and through TP, against the 1-process bf16-mixed
# run. bf16 keeps 8 mantissa bits and the micro-batches / sharded matmuls round differently.
BF16_CASES = {
    "bf16_pp2_zero1": {"pp": 2, "zero_stage": 1, "microbatches": 2},
    "bf16_tp2_zero3": {"tp": 2, "zero_stage": 3},
}
BF16_RTOL = 1e-3  # measured: 1.0e-4 (pp2) and 2.0e-4 (tp2) max relative difference over the 3 steps


def _data():
    from torch.utils.data import DataLoader, Dataset

    class Packed(Dataset):
        def __len__(self) -> int:
            return 4 * STEPS

        def __getitem__(self, i: int) -> dict:
            g = torch.Generator().manual_seed(i)
            ids = torch.randint(0, 320, (SEQ + 1,), generator=g)
            return {"input_ids": ids[:-1], "labels": ids[1:], "position_ids": torch.arange(SEQ)}

    return DataLoader(Packed(), batch_size=4, shuffle=False)


def _fit(
    strategy,
    devices: int,
    norms: list[float] | None = None,
    clip: float | None = CLIP,
    accumulate: int = 1,
    precision: str = "32-true",
    dtypes: set[str] | None = None,
    layers: int = 2,
    layouts: dict | None = None,
    accelerator: str = "cpu",
) -> list[float]:
    import lightning as L

    from lightning_v17.models import LlamaLM

    losses: list[float] = []

    class Rec(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            losses.append(float(outputs["loss"]))

        def on_train_start(self, trainer, pl_module) -> None:
            if dtypes is not None:  # what the Linear layers really compute in (the stages are the same modules)
                for m in pl_module.modules():
                    if isinstance(m, torch.nn.Linear):
                        m.register_forward_hook(lambda _m, _i, out: dtypes.add(str(out.dtype)))

            if layouts is not None:  # how the embedding, the norms and the logits are really laid out on tp
                model = pl_module.model
                layouts["embedding"] = str(model.tok_embeddings.weight.placements)
                model.output.register_forward_hook(
                    lambda _m, _i, out: layouts.__setitem__("logits", str(getattr(out, "placements", "plain")))
                )
                model.norm.register_forward_hook(
                    lambda _m, _i, out: layouts.__setitem__("norm_out", str(getattr(out, "placements", "plain")))
                )

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            if norms is not None:  # runs before Lightning clips: the unclipped global norm (1 process: plain grads)
                grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
                norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))

    trainer = L.Trainer(
        accelerator=accelerator, devices=devices, strategy=strategy, max_steps=STEPS, gradient_clip_val=clip,
        accumulate_grad_batches=accumulate, precision=precision,
        use_distributed_sampler=False, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[Rec()],
    )  # fmt: skip

    class SGDLM(LlamaLM):
        # Plain SGD: the clipping factor scales the update itself. (AdamW's update m / sqrt(v) is nearly invariant to
        # a gradient scale, so a wrong clipping norm would hardly move its losses.)
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR)

    trainer.fit(SGDLM(model="tiny", model_overrides={"layers": layers}), _data())
    return losses


def _worker(rank: int, world_size: int) -> dict:
    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    from tests._strategy import v17  # the cases are flat option dicts

    out = {name: _fit(v17(**kw), 2) for name, kw in CASES.items() if name != "tp2_zero3_sp_vocab_loss"}
    out["layouts"] = {}
    out["tp2_zero3_sp_vocab_loss"] = _fit(v17(**CASES["tp2_zero3_sp_vocab_loss"]), 2, layouts=out["layouts"])
    out.update({name: _fit(v17(**kw), 2, layers=4) for name, kw in SCHEDULE_CASES.items()})
    for name, kw in FP16_CASES.items():
        out[name] = _fit(v17(**kw, config=FP16), 2, clip=None)
    out["pp2_zero1_accumulate2"] = _fit(v17(**CASES["pp2_zero1"]), 2, clip=None, accumulate=2)
    for name, kw in BF16_CASES.items():
        seen: set[str] = set()
        out[name] = _fit(v17(**kw), 2, precision="bf16-mixed", dtypes=seen)
        out[name + "_dtypes"] = sorted(seen)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return spawn(_worker, world_size=2, timeout=300, init_process_group=False)


@pytest.fixture(scope="module")
def reference() -> list[float]:
    import warnings

    warnings.filterwarnings("ignore")
    norms: list[float] = []
    losses = _fit("auto", 1, norms)
    # clipping is active at every step, so a per-stage / per-shard norm would change the trajectory
    assert len(norms) == STEPS and min(norms) > 2 * CLIP, norms
    return losses


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", list(CASES))
def test_tp_pp_with_clipping_match_single_process(results: list[dict], reference: list[float], name: str) -> None:
    assert len(reference) == STEPS
    for res in results:
        got = res[name]
        assert got == pytest.approx(reference, rel=1e-5), (name, got, reference)


@pytest.mark.timeout(400)
def test_sp_vocab_loss_parallel_options_shard_what_they_name(results: list[dict]) -> None:
    """Equal losses alone would not show the options were applied; the layouts do (mesh axes: dp_shard, tp)."""
    for res in results:
        lay = res["layouts"]
        assert lay["embedding"].endswith("Shard(dim=0))"), lay  # vocab-parallel: rows of the table split on tp
        assert lay["logits"] == "(Shard(dim=2),)", lay  # loss-parallel: [B, S, V] logits stay split on the vocab
        assert lay["norm_out"] == "(Shard(dim=1),)", lay  # sequence-parallel: the final norm runs on sequence shards


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", list(SCHEDULE_CASES))
def test_multi_chunk_schedules_in_a_trainer_match_single_process(results: list[dict], name: str) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    norms: list[float] = []
    want = _fit("auto", 1, norms, layers=4)
    assert min(norms) > 2 * CLIP, norms  # clipping active at every step here too
    for res in results:
        assert res[name] == pytest.approx(want, rel=1e-5), (name, res[name], want)


@pytest.mark.timeout(400)
def test_fp16_loss_scaling_through_the_pipeline(results: list[dict]) -> None:
    for res in results:
        got, want = res["fp16_pp2_zero1"], res["fp16_dp2_zero1"]
        assert len(got) == STEPS and all(torch.isfinite(torch.tensor(got))), got
        assert got == pytest.approx(want, rel=FP16_RTOL), (got, want)


def test_strategy_errors_name_the_option_and_the_fix() -> None:
    """No processes needed: the checks run at construction, in resolve_mesh, and in the plan resolution and split
    that V17Strategy._setup_model runs before anything is split or sharded."""
    from lightning_v17.strategies import V17Strategy

    from lightning_v17.config import PipelinePolicy, TPPolicy, V17ConfigError
    from lightning_v17.engine.pipeline.runtime import split_model
    from lightning_v17.models import LlamaLM
    from lightning_v17.models.pp_layouts import model_pipeline_layout
    from lightning_v17.models.tp_plans import resolve_tp_plan

    lm = LlamaLM(model="tiny")  # 8 heads, 4 kv heads, 4 blocks
    lm.configure_model()
    with pytest.raises(V17ConfigError, match=r"tp=3 must divide num_attention_heads=8.*try tp in \{1, 2, 4\}"):
        resolve_tp_plan(lm).validate(3)
    with pytest.raises(V17ConfigError, match=r"= 8 does not equal the world size 4.*dp_shard='auto'"):
        V17Strategy(pp=2, tp=2, dp_shard=2, zero_stage=1).resolve_mesh(4)
    with pytest.raises(V17ConfigError, match=r"world size 2 is not divisible by .* = 3"):
        V17Strategy(tp=3).resolve_mesh(2)
    for stage in (2, 3):  # pp composes with ZeRO-2/3 (tests/dist/test_pp_zero23.py), from a DS config too
        assert V17Strategy(pp=2, zero_stage=stage).policy.zero.stage == stage
    assert V17Strategy(pp=2, config={"zero_optimization": {"stage": 2}}).policy.zero.stage == 2
    with pytest.raises(V17ConfigError, match=r"8 pipeline stages but the model has only 4 blocks.*lower pp"):
        policy = PipelinePolicy(schedule="interleaved_1f1b", virtual_stages=2)
        split_model(lm, layout=model_pipeline_layout(lm), pp_rank=0, pp=4, policy=policy)
    for option in ({"sequence_parallel": True}, {"plan": {"model.x": "colwise"}}, {"vocab_parallel": True},
                   {"loss_parallel": True}):  # accepted but unusable  # fmt: skip
        with pytest.raises(V17ConfigError, match="applies only with tp > 1"):
            V17Strategy(tp=TPPolicy(**option))
    with pytest.raises(V17ConfigError, match="applies only with pp > 1"):
        V17Strategy(pp=PipelinePolicy(split_points=["model.layers.2"]))
    # loss parallelism composes with pp (tests/dist/test_pp_loss_parallel.py)
    assert V17Strategy(pp=2, zero_stage=1, tp=TPPolicy(size=2, loss_parallel=True)).policy.tensor_parallel.loss_parallel


@pytest.mark.timeout(400)
def test_pipeline_gradient_accumulation_matches_single_process(results: list[dict]) -> None:
    """accumulate_grad_batches=2 with pp=2: each schedule's backward carries Lightning's 1/accumulate factor and the
    data-parallel reduction runs once per window. No clipping (it would hide a gradient off by the factor 2); SGD.
    1e-5 relative."""
    import warnings

    warnings.filterwarnings("ignore")
    want = _fit("auto", 1, clip=None, accumulate=2)
    assert len(want) == 5  # 3 batches per epoch: steps after batches (0, 1), (2,) at the epoch end, then (0, 1)
    for res in results:
        assert res["pp2_zero1_accumulate2"] == pytest.approx(want, rel=1e-5), (res["pp2_zero1_accumulate2"], want)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", list(BF16_CASES))
def test_bf16_mixed_through_pipeline_and_tp(results: list[dict], name: str) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    ref = _fit("auto", 1, precision="bf16-mixed")
    for res in results:
        # the stages / TP shards really ran their matmuls in bf16 (losses alone barely move at this size: the
        # bf16 reference differs from fp32 by ~1e-4 relative)
        assert res[name + "_dtypes"] == ["torch.bfloat16"], (name, res[name + "_dtypes"])
        assert res[name] == pytest.approx(ref, rel=BF16_RTOL), (name, res[name], ref)
