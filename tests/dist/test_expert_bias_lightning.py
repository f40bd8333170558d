"""The MoE LlamaLM's aux-loss-free expert bias (DeepSeek-V3 §2.1.2) moves under every strategy, once per optimizer
step, from the load of the step's micro-batches summed over the data-parallel ranks.

Each run records, after every micro-batch, the load each MoE layer routed (``last_load``) and the biases. The
reference is a hand-rolled loop over those recorded loads: per optimizer step, the loads of its ``ACCUM``
micro-batches summed over every rank, then ``bias += rate * sign(mean(load) - load)``. After each step every rank's
bias must equal it.

* Lightning's single-device strategy, in this process, with automatic and with manual optimization;
* Lightning's ``"ddp"`` on 2 gloo ranks (the ranks route different tokens: the rank-local reference differs);
* ``V17Strategy(zero_stage=1)`` on 2 gloo ranks: the update is applied exactly once per step, whether the strategy
  or the module applies it.
"""

from __future__ import annotations

import pytest

from tests._dist import spawn

STEPS, ACCUM, RATE, SEQ, ROWS = 3, 2, 0.01, 32, 2
OVERRIDES = {"layers": 2, "dense_layers": 0, "hidden": 32, "heads": 4, "kv_heads": 2, "ffn": 64, "expert_ffn": 32,
             "expert_bias_rate": RATE}  # fmt: skip


def _fit(devices: int, strategy, manual: bool = False) -> dict:
    import lightning as L
    import torch

    from lightning_v17.data import PackedDataModule
    from lightning_v17.models import LlamaLM, moe_layers

    L.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(1000)
    docs = [torch.randint(3, 256, (int(n),), generator=g).tolist() for n in torch.randint(8, 40, (160,), generator=g)]
    loads: list[list[torch.Tensor]] = []
    biases: list[list[torch.Tensor]] = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            loads.append([m.last_load.clone() for m in moe_layers(pl_module)])
            biases.append([m.expert_bias.clone() for m in moe_layers(pl_module)])

    class Manual(LlamaLM):
        def __init__(self, **kwargs) -> None:
            super().__init__(**kwargs)
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.manual_backward(loss / ACCUM)
            if (batch_idx + 1) % ACCUM == 0:
                self.optimizers().step()
                self.optimizers().zero_grad()
            return loss

    module = (Manual if manual else LlamaLM)(model="tiny-moe", model_overrides=OVERRIDES, warmup_steps=0, lr=1e-2,
                                             max_steps=STEPS)  # fmt: skip
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=STEPS,
                        accumulate_grad_batches=1 if manual else ACCUM, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0, callbacks=[Record()])  # fmt: skip
    trainer.fit(module, datamodule=PackedDataModule(docs, seq_len=SEQ, batch_size=ROWS, seed=0))
    biases.append([m.expert_bias.clone() for m in moe_layers(module)])  # after fit
    return {"loads": loads, "biases": biases, "strategy": type(trainer.strategy).__name__}


def _worker(rank: int, world: int) -> dict:
    import torch
    from lightning_v17.strategies import V17Strategy

    torch.set_num_threads(1)
    return {"ddp": _fit(world, "ddp"), "v17": _fit(world, V17Strategy(zero_stage=1))}


def _reference(runs: list[dict]):
    """The bias after each optimizer step, from the recorded loads of every rank in ``runs``."""
    import torch

    layers = len(runs[0]["loads"][0])
    bias = [torch.zeros_like(runs[0]["loads"][0][i]) for i in range(layers)]
    out = []
    for step in range(STEPS):
        batches = range(step * ACCUM, (step + 1) * ACCUM)
        for i in range(layers):
            load = sum(r["loads"][b][i] for r in runs for b in batches)
            bias[i] = bias[i] + RATE * torch.sign(load.mean() - load)
        out.append([b.clone() for b in bias])
    return out


def _check(runs: list[dict], lag: int = 0) -> None:
    """Every rank's bias after each step against :func:`_reference`. ``lag=1``: manual optimization, whose update
    runs in the module's ``on_train_batch_end``, after the callbacks' (the recording one sees it one batch later)."""
    import torch

    want = _reference(runs)
    assert any(float(b.abs().sum()) > 0 for b in want[-1])  # the bias moved: a missing update cannot pass
    for rank, r in enumerate(runs):
        assert len(r["loads"]) == STEPS * ACCUM, (rank, len(r["loads"]))
        for step in range(STEPS):
            got = r["biases"][(step + 1) * ACCUM - 1 + lag]  # after the step's last micro-batch, i.e. its update
            for i, (g, w) in enumerate(zip(got, want[step])):
                assert torch.allclose(g, w, rtol=0, atol=1e-7), (rank, step, i, g, w)
            if step < STEPS - 1:  # not yet moved by a partial load in the middle of the next step
                mid = r["biases"][(step + 1) * ACCUM + lag]
                assert all(torch.equal(a, b) for a, b in zip(mid, got)), (rank, step)


@pytest.mark.timeout(60)
def test_single_device_bias_equals_hand_rolled_update() -> None:
    import torch

    torch.set_num_threads(1)
    run = _fit(1, "auto")
    assert run["strategy"] == "SingleDeviceStrategy"
    _check([run])


@pytest.mark.timeout(60)
def test_manual_optimization_bias_once_per_optimizer_step() -> None:
    import torch

    torch.set_num_threads(1)
    run = _fit(1, "auto", manual=True)
    _check([run], lag=1)


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return spawn(_worker, world_size=2, init_process_group=False, timeout=110)


@pytest.mark.timeout(120)
def test_ddp_bias_uses_the_load_of_both_ranks(two_ranks) -> None:
    runs = [r["ddp"] for r in two_ranks]
    assert [r["strategy"] for r in runs] == ["DDPStrategy"] * 2
    local = _reference(runs[:1])  # rank 0's load alone would move the bias another way
    assert any(not a.equal(b) for a, b in zip(local[-1], _reference(runs)[-1]))
    _check(runs)


@pytest.mark.timeout(120)
def test_v17_bias_updated_exactly_once_per_step(two_ranks) -> None:
    runs = [r["v17"] for r in two_ranks]
    assert [r["strategy"] for r in runs] == ["V17Strategy"] * 2
    _check(runs)
