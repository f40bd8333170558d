"""``V17Strategy(pp=2, cp=2, zero_stage=1)`` on 4 ranks under a real Trainer against one process.

The tiny LlamaLM (2 blocks, 8 query / 4 KV heads, one block per stage) on packed rows of several documents each: the
batch's sequence dim is cut over the cp ranks of each stage, the schedule cuts its rows into 2 micro-batches of 2
rows, and each stage's attention runs context-parallel over the micro-batch's whole rows (its own documents).
ZeRO-1 shards the optimizer over cp. One spawn trains every case on the same batches, 5 steps each: plain SGD (a
gradient off by a constant factor moves the weights off the reference) and AdamW with gradient clipping at 0.5 (the
clipped norm is the whole model's, over both stages); GPipe with ulysses, 1F1B with allgather, and 1F1B with ulysses
under full activation checkpointing (the recompute in each micro-batch's backward must see that micro-batch's
documents), where the module also defines its own ``pipeline_loss`` (each micro-batch's token mean, weighted by
its share of the rank's targets under cp).

Asserted, per rank: every step's loss of the whole rows within 1e-5 of one process, the whole model's pre-clip
gradient norm within 1e-5, and every parameter of the rank's stage after the 5 steps within 1e-5 (fp32); the two
stages together hold every parameter; the clipping bound is active (the reference's pre-clip norm exceeds it).
"""

from __future__ import annotations

import pytest

from tests._dist import spawn
from tests._strategy import PACKED_CLIP, STEPS, fit_packed, packed_docs

#: the compositions this file checks against one process (docs/gen_layouts.py builds docs/layouts.md from them)
COMPOSES = (("pp", "cp", "zero1"), ("pp", "cp", "zero1", "recompute"))

TOL = 1e-5
CASES = {  # name -> (optimizers, V17Strategy kwargs)
    "gpipe_ulysses": (("sgd", "adamw"), {"pp": {"size": 2, "schedule": "gpipe", "microbatches": 2},
                                         "cp": {"size": 2, "mode": "ulysses"}}),
    "1f1b_allgather": (("sgd", "adamw"), {"pp": {"size": 2, "schedule": "1f1b", "microbatches": 2},
                                          "cp": {"size": 2, "mode": "allgather"}}),
    "1f1b_ulysses_recompute_user_loss": (("sgd",), {"pp": {"size": 2, "schedule": "1f1b", "microbatches": 2},
                                                    "cp": {"size": 2, "mode": "ulysses"},
                                                    "activation_checkpointing": "full"}),
}  # fmt: skip


def _fit_all(rank: int, world: int) -> dict:
    docs = packed_docs(80)

    def fit(name: str, opt: str, kwargs: dict) -> dict:
        loss = _pipeline_loss if "user_loss" in name else None
        return fit_packed(world, {"zero_stage": 1, **kwargs}, opt, docs, batch_size=4, grad_norm=_norm,
                          pipeline_loss=loss)  # fmt: skip

    if world == 1:
        return {opt: fit("ref", opt, {}) for opt in ("sgd", "adamw")}
    return {(name, opt): fit(name, opt, kw) for name, (opts, kw) in CASES.items() for opt in opts}


def _pipeline_loss(self, logits, batch):
    import torch

    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())


def _norm(module, world: int) -> float:
    """The whole model's pre-clip gradient norm: each pp rank holds its stage's gradients (whole, after ZeRO-1's
    reduction)."""
    import torch
    import torch.distributed as dist

    sq = sum(p.grad.double().square().sum() for p in module.parameters() if p.grad is not None)
    sq = torch.as_tensor(sq, dtype=torch.float64)
    if world > 1:
        dist.all_reduce(sq, group=module.trainer.strategy._mesh.group("pp"))
    return float(sq.sqrt())


@pytest.fixture(scope="module")
def runs() -> dict[str, list[dict]]:
    return {"ref": spawn(_fit_all, world_size=1, timeout=200), "cp_pp": spawn(_fit_all, world_size=4, timeout=400)}


@pytest.mark.parametrize(("name", "opt"), [(n, o) for n, (opts, _) in CASES.items() for o in opts])
def test_cp2_inside_pp2_trains_like_one_process(runs, name, opt) -> None:
    import torch

    ref = runs["ref"][0][opt]
    assert len(ref["losses"]) == STEPS and len(set(ref["losses"])) == STEPS  # the weights moved every step
    if opt == "adamw":
        assert max(ref["norms"]) > PACKED_CLIP  # the clipping changed the update
    held: set[str] = set()
    for rank, got in enumerate(runs["cp_pp"]):
        got = got[(name, opt)]
        assert got["losses"] == pytest.approx(ref["losses"], rel=TOL, abs=TOL), (name, opt, rank)
        assert got["norms"] == pytest.approx(ref["norms"], rel=TOL, abs=TOL), (name, opt, rank)
        assert got["weights"] and got["weights"].keys() < ref["weights"].keys(), (name, rank)  # one stage's part
        held |= got["weights"].keys()
        for n, w in got["weights"].items():
            torch.testing.assert_close(w, ref["weights"][n], rtol=TOL, atol=TOL, msg=f"{name} {opt} rank {rank}: {n}")
    assert held == ref["weights"].keys()


def test_a_hugging_face_model_under_cp_and_pp_is_refused() -> None:
    """The pipeline's loss would shift a Hugging Face model's labels inside each sequence shard: refused at setup.
    A model is Hugging Face's by what the strategy reads (``config`` and ``set_attn_implementation``), so a module
    with those stands in for one without importing transformers here."""
    from types import SimpleNamespace

    from lightning_v17.strategies._context import prepare_context_parallel_model
    from torch import nn

    from lightning_v17.config import ParallelDims, V17ConfigError

    class LlamaForCausalLM(nn.Module):
        config = SimpleNamespace()

        def set_attn_implementation(self, name: str) -> None:
            raise AssertionError("refused before wiring")

    strategy = SimpleNamespace(dims=ParallelDims(pp=2, cp=2))
    with pytest.raises(V17ConfigError, match=r"cp=2 with pp=2 on a Hugging Face model \(LlamaForCausalLM\)"):
        prepare_context_parallel_model(strategy, LlamaForCausalLM(), 2)
