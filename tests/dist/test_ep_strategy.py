"""``V17Strategy(ep=2)`` under a real Trainer: the MoE LlamaLM (``tiny-moe``, 2 blocks, the sequence-wise balance loss
and the aux-loss-free expert bias on) on 2 gloo ranks, 6 steps on the same packed data:

* ep=2 at ZeRO-3, ep=2 at ZeRO-1 with full activation checkpointing, and ep=2 at ZeRO-3 with the allgather
  dispatcher (``EPPolicy(dispatcher="allgather")``) give the losses of the ep=1 ZeRO-3 run within 1e-5;
* the expert bias, updated once per optimizer step from the load summed over both ranks, is bitwise the same on
  both ranks, moved at all, and the same with activation checkpointing as without (the recomputed forward does not
  count its tokens again: no halving).
"""

from __future__ import annotations

import pytest

from tests._dist import spawn

STEPS, TOL = 6, 1e-5
RUNS = {"ep1_zero3": {"zero_stage": 3}, "ep2_zero3": {"zero_stage": 3, "ep": 2},
        "ep2_zero1_full_ac": {"zero_stage": 1, "ep": 2, "activation_checkpointing": "full"},
        "ep2_zero3_allgather": {"zero_stage": 3, "ep": {"size": 2, "dispatcher": "allgather"}}}  # fmt: skip


def _fit(rank: int, world: int, name: str) -> dict:
    import lightning as L
    import torch

    from lightning_v17.data import PackedDataModule
    from lightning_v17.models import LlamaLM, moe_layers
    from lightning_v17.strategies import V17Strategy

    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(1000)
    docs = [torch.randint(3, 256, (int(n),), generator=g).tolist() for n in torch.randint(8, 40, (120,), generator=g)]
    losses: list[float] = []

    class Losses(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            losses.append(float(outputs["loss"]))

    module = LlamaLM(model="tiny-moe", model_overrides={"layers": 2, "aux_loss_coef": 0.01, "expert_bias_rate": 0.01},
                     warmup_steps=0, lr=1e-2, max_steps=STEPS)  # fmt: skip
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=V17Strategy(**RUNS[name]), max_steps=STEPS,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[Losses()])  # fmt: skip
    trainer.fit(module, datamodule=PackedDataModule(docs, seq_len=32, batch_size=2, seed=0))
    total = torch.tensor(losses)
    torch.distributed.all_reduce(total)
    experts = [n for n, p in module.named_parameters() if hasattr(p, "_v17_expert")]
    return {"losses": (total / world).tolist(), "biases": [m.expert_bias.clone() for m in moe_layers(module)],
            "sharded": experts, "dispatchers": [type(m.dispatcher).__name__ for m in moe_layers(module)]}  # fmt: skip


@pytest.fixture(scope="module")
def runs() -> dict[str, list[dict]]:
    return {name: spawn(_fit, world_size=2, args=(name,), timeout=300) for name in RUNS}


@pytest.mark.parametrize("name", ["ep2_zero3", "ep2_zero1_full_ac", "ep2_zero3_allgather"])
def test_ep2_trains_like_ep1(runs, name) -> None:
    import torch

    ref = runs["ep1_zero3"][0]
    kind = "AllGatherDispatch" if "allgather" in name else "AllToAllDispatch"
    for rank, got in enumerate(runs[name]):
        assert got["dispatchers"] == [kind], got["dispatchers"]  # EPPolicy(dispatcher=) reaches every MoE layer
        assert len(got["sharded"]) == 2 * 1  # one MoE block (the first is dense): gate_up_proj and down_proj
        assert got["losses"] == pytest.approx(ref["losses"], rel=TOL, abs=TOL), (name, rank)
        for b, want in zip(got["biases"], runs["ep2_zero3"][0]["biases"]):
            assert torch.equal(b, want), (name, rank, b, want)  # every rank, with and without recompute
    assert any(bool(b.abs().sum() > 0) for b in ref["biases"]), "the expert bias never moved"
    assert runs["ep1_zero3"][0]["sharded"] == []
