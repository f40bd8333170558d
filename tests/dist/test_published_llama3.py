"""Llama 3 405B's long-context layout in miniature: ``V17Strategy(tp=TPPolicy(size=2, sequence_parallel=True), cp=2,
pp=2, zero_stage=3)`` on 8 gloo ranks under a real Trainer, against one process.

Llama 3 405B trains its long-context phase at TP8 with sequence parallelism, CP16, PP16 and FSDP over the rest
(Dubey 2024 §3.3.1-3.3.2). Here every axis is 2: pp outermost (ranks 0-3 hold stage 0), then cp, then tp; dp_shard is
1, so ZeRO-3 shards each stage's parameters over dp_shard x cp (the ``dp_shard_cp`` axis): FSDP is real over cp,
beside tp. The tiny LlamaLM (2 blocks, one per stage; 8 query / 4 KV heads, so 4 / 2 per tp rank) on rows of 32
tokens packed with several documents each (position ids restarting inside a row, unequal documents): the schedule
cuts each step's 4 rows into 2 micro-batches of 2; each stage's cp ranks take the head-tail chunks of the rows
(S/cp = 16 tokens each), and under SP each tp rank's residual stream holds S/(cp*tp) = 8 of them between the
sublayers, the SP all-gather over tp giving the attention its cp rank's whole S/cp.

One spawn trains every case on the same batches, 5 steps each: plain SGD without clipping (a gradient off by a
constant factor moves the weights off the reference) and AdamW with gradient clipping at ``PACKED_CLIP`` (below the
reference's pre-clip norm, so it clips):

* ``zero3``: the layout above, ulysses attention (cp=2 divides the 4 local query and 2 local KV heads), 1F1B;
* ``zero1``: the same axes at ZeRO-1 (the optimizer partitioned over dp_shard_cp), all-gathered K/V, GPipe.

Asserted, per rank: every step's loss of the whole rows within 1e-5 of one process; the whole model's pre-clip
gradient norm (what each stage holds of its gradients, summed over the pp axis) within 1e-5, and with clipping the
norm the strategy's clipping computed too; every parameter of the rank's stage after the 5 steps within 1e-5 (fp32;
plain 1e-5 after AdamW too, without tests/_adamw_parity.py's allowance); the two stages together hold every
parameter; the tokens each rank's norms and attention saw (S/(cp*tp) and S/cp); how each stage is stored (ZeRO-3:
DTensors over (dp_shard_cp, tp), dim 0 sharded over dp_shard_cp; ZeRO-1: DTensors over tp, the optimizer stepping
half of them).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests._dist import spawn
from tests._strategy import PACKED_CLIP, STEPS, fit_packed, packed_docs
from tests.dist.test_cp_tp import _local_tokens, _sgd_lr

#: the compositions this file checks against one process (docs/gen_layouts.py builds docs/layouts.md from them)
COMPOSES = (("pp", "cp", "tp", "zero3"), ("pp", "cp", "sp", "zero3"),  # tp's heads split, with SP between them
            ("pp", "cp", "tp", "zero1"), ("pp", "cp", "sp", "zero1"))  # fmt: skip
#: the published layouts this file runs in miniature, name -> the miniature (optional)
PUBLISHED = {"Llama 3 405B (TP8+SP, CP16, PP16, FSDP)": "tp2+SP x cp2 x pp2, ZeRO-3 over cp"}

TOL = 1e-5
SEQ = 32  # fit_packed's row length: a multiple of 2 * cp * tp (head-tail chunks, each split over tp under SP)
TP_SP = {"size": 2, "sequence_parallel": True}
CASES = {  # name -> V17Strategy kwargs of the 8-rank run
    "zero3": {"zero_stage": 3, "tp": TP_SP, "cp": {"size": 2, "mode": "ulysses"},
              "pp": {"size": 2, "schedule": "1f1b", "microbatches": 2}},
    "zero1": {"zero_stage": 1, "tp": TP_SP, "cp": {"size": 2, "mode": "allgather"},
              "pp": {"size": 2, "schedule": "gpipe", "microbatches": 2}},
}  # fmt: skip
OPTIMIZERS = ("sgd", "adamw")
# SGD at tests/dist/test_cp_tp.py's SGD_LR (its _sgd_lr hook): fit_packed's lr 0.5 is past the edge of stability on
# this model, where fp32 rounding differences grow about 100x over 5 steps.
_LAYOUT: dict[str, Any] = {}  # parameter name -> (mesh axes, placements, local numel); "stepped": the optimizer's


def _fit_all(rank: int, world: int) -> dict:
    import warnings

    import torch
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    docs = packed_docs(80)
    handle = register_optimizer_step_pre_hook(_sgd_lr)
    try:
        if world == 1:
            return {opt: _fit(1, {"zero_stage": 3}, opt, docs) for opt in OPTIMIZERS}
        out = {}
        for name, kw in CASES.items():
            for opt in OPTIMIZERS:
                with _local_tokens() as seen:
                    out[name, opt] = _fit(world, kw, opt, docs)
                out[name, opt]["tokens"] = seen
        return out
    finally:
        handle.remove()


def _fit(world: int, strategy: dict, opt: str, docs: list[list[int]]) -> dict:
    """fit_packed, plus the norm the strategy's own clipping computed at each step."""
    import lightning_v17.strategies._precision as precision

    clip_norms: list[float] = []
    _LAYOUT.clear()
    record = precision.clip_grad_norm_

    def clip_and_record(*args, **kwargs):
        total = record(*args, **kwargs)
        clip_norms.append(float(total))
        return total

    precision.clip_grad_norm_ = clip_and_record
    try:
        out = fit_packed(world, strategy, opt, docs, batch_size=4, grad_norm=_norm)
    finally:
        precision.clip_grad_norm_ = record
    return {**out, "clip_norms": clip_norms, "layout": dict(_LAYOUT)}


def _norm(module, world: int) -> float:
    """The whole model's pre-clip gradient norm: each stage's whole-gradient norms (ZeRO-1's reduced gradients,
    ZeRO-3's and tp's DTensors), summed over the pp axis."""
    import torch
    import torch.distributed as dist

    from lightning_v17.engine.zero.grad_norms import grad_norms

    strategy = module.trainer.strategy
    if world > 1 and not _LAYOUT:  # what the strategy built, read once per run
        for n, p in module.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            mesh = getattr(getattr(p, "device_mesh", None), "mesh_dim_names", None)
            _LAYOUT[n] = (mesh, tuple(repr(pl) for pl in getattr(p, "placements", ())), local.numel())
        stepped = module.trainer.optimizers[0].param_groups[0]["params"]  # ZeRO-1: the optimizer's shards
        _LAYOUT["stepped"] = sum((q.to_local() if hasattr(q, "to_local") else q).numel() for q in stepped)
    each = grad_norms(module, strategy.zero, 2.0).values()
    sq = torch.stack([n.double().square() for n in each]).sum()
    if world > 1:
        dist.all_reduce(sq, group=strategy.mesh.group("pp"))
    return float(sq.sqrt())


@pytest.fixture(scope="module")
def runs() -> dict[str, list[dict]]:
    return {"ref": spawn(_fit_all, world_size=1, timeout=200), "llama3": spawn(_fit_all, world_size=8, timeout=500)}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("opt", OPTIMIZERS)
def test_tp_sp_cp_pp_fsdp_trains_like_one_process(runs, name, opt) -> None:
    import torch

    ref = runs["ref"][0][opt]
    assert len(ref["losses"]) == STEPS and len(set(ref["losses"])) == STEPS  # the weights moved every step
    if opt == "adamw":
        assert min(ref["norms"]) > PACKED_CLIP  # the clipping changed every update
    held: set[str] = set()
    for rank, got in enumerate(runs["llama3"]):
        got = got[name, opt]
        assert got["losses"] == pytest.approx(ref["losses"], rel=TOL, abs=TOL), (name, opt, rank)
        assert got["norms"] == pytest.approx(ref["norms"], rel=TOL, abs=TOL), (name, opt, rank)
        if opt == "adamw":
            assert got["clip_norms"] == pytest.approx(ref["norms"], rel=TOL, abs=TOL), (name, rank)
        assert got["weights"] and got["weights"].keys() < ref["weights"].keys(), (name, rank)  # one stage's part
        held |= got["weights"].keys()
        for n, w in got["weights"].items():
            torch.testing.assert_close(w, ref["weights"][n], rtol=TOL, atol=TOL, msg=f"{name} {opt} rank {rank}: {n}")
    assert held == ref["weights"].keys()


@pytest.mark.parametrize("name", list(CASES))
def test_the_residual_stream_holds_s_over_cp_tp_tokens_on_every_stage(runs, name) -> None:
    """The norms (the residual stream) of every rank of both stages see S/(cp*tp) tokens, the attention S/cp."""
    for rank, got in enumerate(runs["llama3"]):
        for opt in OPTIMIZERS:
            assert got[name, opt]["tokens"] == {"norm": {SEQ // 4}, "attention": {SEQ // 2}}, (name, opt, rank)


@pytest.mark.parametrize("name", list(CASES))
def test_each_stage_is_sharded_over_tp_and_over_cp(runs, name) -> None:
    """ZeRO-3: every parameter is a DTensor over (dp_shard_cp, tp) with its dim 0 sharded over dp_shard_cp (FSDP
    over the cp ranks: half of the tp-local rows on each); ZeRO-1: DTensors over tp, the optimizer stepping half of
    every stage's tp-local elements (its partition over dp_shard_cp)."""
    for rank, got in enumerate(runs["llama3"]):
        layout = dict(got[name, "sgd"]["layout"])
        stepped = layout.pop("stepped")
        assert layout.keys() == got[name, "sgd"]["weights"].keys(), (name, rank)
        tp_local = 0
        for n, (mesh, placements, numel) in layout.items():
            whole = got[name, "sgd"]["weights"][n].numel()
            tp_shard = placements[mesh.index("tp")].startswith("Shard(")
            tp_local += whole // (2 if tp_shard else 1)
            if name == "zero3":
                assert mesh == ("dp_shard_cp", "tp") and "Shard(dim=0" in placements[0], (rank, n, placements)
                assert numel * 2 * (2 if tp_shard else 1) == whole, (rank, n, numel, whole)
            else:
                assert mesh == ("tp",) and numel * (2 if tp_shard else 1) == whole, (rank, n, numel, whole)
        if name == "zero1":
            assert stepped * 2 == tp_local, (rank, stepped, tp_local)
