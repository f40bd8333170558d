"""``V17Strategy(pp=2, tp=TPPolicy(size=2, loss_parallel=True))`` on 4 ranks under a real Trainer against one
process, without and with sequence parallelism.

The tiny LlamaLM (2 blocks: one per stage) on packed rows of several documents each. tp splits each stage's heads
and its head's output over the vocabulary: with loss parallelism the last stage's logits stay a vocab-sharded DTensor
(``Shard(-1)``), and the schedule's loss (the default token-mean cross-entropy over the step's targets) and its
backward run inside torch's ``loss_parallel()`` on those shards, never gathering the whole vocabulary. One spawn
trains every case on the same batches, 5 steps each, under 1F1B with 2 micro-batches: plain SGD (a gradient off by a
constant factor moves the weights off the reference) and AdamW with gradient clipping at 0.5 (the clipped norm is the
whole model's, over both stages and the tp shards).

Asserted, per rank: every step's loss within 1e-5 of one process, the whole model's pre-clip gradient norm within
1e-5, and every parameter of the rank's stage after the 5 steps within 1e-5 (fp32); the two stages together hold
every parameter; the clipping bound is active (the reference's pre-clip norm exceeds it); the last stage's loss saw
its logits as a vocab-sharded DTensor holding half the vocabulary on each tp rank. In the same spawn, the default
loss's per-token path (a ``loss_mask``, shifted labels; two micro-batches) and a module's own ``pipeline_loss`` on
vocab shards equal them on the whole logits, loss and gradient.
"""

from __future__ import annotations

import pytest

from tests._dist import spawn
from tests._strategy import PACKED_CLIP, STEPS, fit_packed, packed_docs

#: the compositions this file checks against one process (docs/gen_layouts.py builds docs/layouts.md from them)
COMPOSES = (("pp", "loss_parallel"), ("pp", "tp"), ("pp", "sp"), ("sp", "loss_parallel"), ("tp", "loss_parallel"))

TOL = 1e-5
PP = {"size": 2, "schedule": "1f1b", "microbatches": 2}
CASES = {  # name -> V17Strategy kwargs of the 4-rank run (pp outermost: ranks 0, 1 hold stage 0)
    "loss_parallel": {"zero_stage": 1, "pp": PP, "tp": {"size": 2, "loss_parallel": True}},
    "loss_parallel_sp": {"zero_stage": 1, "pp": PP,
                         "tp": {"size": 2, "sequence_parallel": True, "loss_parallel": True}},
}  # fmt: skip
OPTIMIZERS = ("sgd", "adamw")


def _fit_all(rank: int, world: int) -> dict:
    docs = packed_docs(60)

    def fit(kw: dict, opt: str) -> dict:
        with _logit_layouts() as seen:
            out = fit_packed(world, kw, opt, docs, batch_size=4, grad_norm=_norm)
        out["logits"] = seen
        return out

    if world == 1:
        return {opt: fit({"zero_stage": 1}, opt) for opt in OPTIMIZERS}
    out = {(name, opt): fit(kw, opt) for name, kw in CASES.items() for opt in OPTIMIZERS}
    out["loss_mask"], out["pipeline_loss"] = _losses_on_shards(user=False), _losses_on_shards(user=True)
    return out


def _user_loss(logits, batch):
    import torch

    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())


def _losses_on_shards(*, user: bool) -> tuple[float, float]:
    """On vocab-sharded logits over tp = 2 against the whole logits, over two micro-batches: the pipeline's default
    loss with a ``loss_mask`` and shifted labels (its per-token path), or a module's own ``pipeline_loss`` (``user``).
    Returns |loss difference| and the max |gradient difference|."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from lightning_v17.engine.pipeline.loss import PipelineLoss

    tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))["tp"]
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 6, 10, generator=g)
    labels = torch.randint(0, 10, (4, 6), generator=g)
    labels[0, :2] = -100
    batch = {"input_ids": labels.clamp_min(0), "labels": labels, "loss_mask": (torch.rand(4, 6, generator=g) > 0.3)}
    half = slice(tp.get_local_rank() * 5, tp.get_local_rank() * 5 + 5)
    got = {}
    for sharded in (False, True):
        x = logits.clone().requires_grad_(True)
        inp = DTensor.from_local(x[..., half], tp, [Shard(2)]) if sharded else x
        loss = PipelineLoss(_user_loss if user else None)
        loss.prepare(batch, batch, rows=4, padded_rows=4, shift=True)
        total = loss(inp[:2], torch.arange(2)) + loss(inp[2:], torch.arange(2, 4))  # two micro-batches
        total = total.full_tensor() if hasattr(total, "full_tensor") else total
        total.backward()
        loss.end_step()
        got[sharded] = (float(total), x.grad[..., half])
    return abs(got[True][0] - got[False][0]), float((got[True][1] - got[False][1]).abs().max())


class _logit_layouts:
    """Record what the pipeline's loss was called with: (type name, placements, vocabulary size, local one)."""

    def __enter__(self) -> set:
        from lightning_v17.engine.pipeline import loss

        self.seen: set = set()
        self.inner = call = loss.PipelineLoss.__call__

        def record(obj, logits, rows):
            placements = tuple((type(p).__name__, getattr(p, "dim", None)) for p in getattr(logits, "placements", ()))
            local = logits.to_local() if hasattr(logits, "to_local") else logits
            self.seen.add((type(logits).__name__, placements, logits.shape[-1], local.shape[-1]))
            return call(obj, logits, rows)

        loss.PipelineLoss.__call__ = record
        return self.seen

    def __exit__(self, *exc) -> None:
        from lightning_v17.engine.pipeline import loss

        loss.PipelineLoss.__call__ = self.inner


def _norm(module, world: int) -> float:
    """The whole model's pre-clip gradient norm: each pp rank holds its stage's gradients (tp-sharded DTensors,
    gathered whole here), summed over the pp axis."""
    import torch
    import torch.distributed as dist

    from tests._strategy import full

    sq = sum(full(p.grad).double().square().sum() for p in module.parameters() if p.grad is not None)
    sq = torch.as_tensor(sq, dtype=torch.float64)
    if world > 1:
        dist.all_reduce(sq, group=module.trainer.strategy.mesh.group("pp"))
    return float(sq.sqrt())


@pytest.fixture(scope="module")
def runs() -> dict[str, list[dict]]:
    return {"ref": spawn(_fit_all, world_size=1, timeout=200), "pp_tp": spawn(_fit_all, world_size=4, timeout=400)}


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("name", "opt"), [(n, o) for n in CASES for o in OPTIMIZERS])
def test_loss_parallel_inside_pp2_tp2_trains_like_one_process(runs, name, opt) -> None:
    import torch

    ref = runs["ref"][0][opt]
    assert len(ref["losses"]) == STEPS and len(set(ref["losses"])) == STEPS  # the weights moved every step
    if opt == "adamw":
        assert min(ref["norms"]) > PACKED_CLIP, ref["norms"]  # the clipping changed every update
    held: set[str] = set()
    for rank, got in enumerate(runs["pp_tp"]):
        got = got[(name, opt)]
        assert got["losses"] == pytest.approx(ref["losses"], rel=TOL, abs=TOL), (name, opt, rank)
        assert got["norms"] == pytest.approx(ref["norms"], rel=TOL, abs=TOL), (name, opt, rank)
        assert got["weights"] and got["weights"].keys() < ref["weights"].keys(), (name, rank)  # one stage's part
        held |= got["weights"].keys()
        for n, w in got["weights"].items():
            torch.testing.assert_close(w, ref["weights"][n], rtol=TOL, atol=TOL, msg=f"{name} {opt} rank {rank}: {n}")
        if rank >= 2:  # the last stage: its loss took vocab-sharded logits, half the vocabulary on each tp rank
            (kind, placements, vocab, local), *more = got["logits"]
            assert not more and (kind, placements) == ("DTensor", (("Shard", 2),)), got["logits"]
            assert local * 2 == vocab, got["logits"]
        else:
            assert got["logits"] == set(), got["logits"]
    assert held == ref["weights"].keys()
    worst = {k: max(abs(a - b) for out in runs["pp_tp"] for a, b in zip(out[(name, opt)][k], ref[k]))
             for k in ("losses", "norms")}  # fmt: skip
    worst["params"] = max(float((w - ref["weights"][n]).abs().max()) for out in runs["pp_tp"]
                          for n, w in out[(name, opt)]["weights"].items())  # fmt: skip
    print(f"{name} {opt}: max |difference| to one process {worst}")


@pytest.mark.parametrize("kind", ["loss_mask", "pipeline_loss"])
def test_the_loss_on_vocab_shards_equals_it_on_the_whole_vocabulary(runs, kind) -> None:
    for rank, out in enumerate(runs["pp_tp"]):
        loss_diff, grad_diff = out[kind]
        assert loss_diff < TOL and grad_diff < TOL, (rank, kind, out[kind])
    worst = [max(o[kind][i] for o in runs["pp_tp"]) for i in (0, 1)]
    print(f"{kind} on vocab shards: max |difference| (loss, gradient) {worst}")
