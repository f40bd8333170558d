"""Expert parallelism beside tensor parallelism: ``V17Strategy(ep=2, tp=2, zero_stage=1)`` on 4 gloo ranks (dp = 2,
the ep group folded out of it), the MoE LlamaLM (``tiny-moe``, 2 blocks: a dense block whose attention and MLP are
tp-sharded, then a MoE block whose attention is tp-sharded and whose router and experts are not), against one process
on the concatenated batch, 5 steps:

* plain SGD (a constant factor on any gradient moves the weights) and AdamW with gradient clipping that clips at
  every step (the reference asserts its unclipped norm exceeds ``CLIP``): losses and every final parameter (the tp
  DTensors and the ep-sharded experts gathered to full tensors) within 1e-5 of one process;
* the unclipped global gradient norm of every step, from the gathered full gradients and as the strategy's clipping
  computed it, equal to one process's: an expert gradient counted on both tp ranks (summed over tp, or its norm
  added once per tp rank) is off by sqrt(2) here;
* tp rank 1 starts from other random weights than tp rank 0, and trains the same model: the strategy broadcasts the
  replicated parameters and the experts over tp before the first step;
* the balance losses (sequence-wise aux and z-loss) and the aux-loss-free expert bias ride along: the bias, updated
  from the load summed over the dp ranks, equals one process's bit for bit.

One spawn of 4 ranks runs both optimizers; the references run in the test process.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests._dist import spawn

SEQ, STEPS, ROWS, CLIP, TOL = 16, 5, 4, 0.05, 1e-5
OVERRIDES = {"layers": 2, "aux_loss_coef": 0.01, "z_loss_coef": 0.001, "expert_bias_rate": 0.01}
OPTIMIZERS = {"sgd": None, "adamw_clip": CLIP}  # name -> gradient_clip_val


def _data():
    from torch.utils.data import Dataset

    class Rows(Dataset):
        def __len__(self) -> int:
            return ROWS * STEPS

        def __getitem__(self, i: int) -> dict:
            ids = torch.randint(0, 320, (SEQ + 1,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids[:-1], "labels": ids[1:], "position_ids": torch.arange(SEQ)}

    return Rows()


def _loader(devices: int, dp_rank: int):
    """One process: batches of 4 rows; 4 ranks (dp = 2): dp rank r gets rows 2r, 2r+1 of each 4, so one process's
    batch is both dp ranks' together, and every row is full: the mean of their token means is its."""
    from torch.utils.data import DataLoader, Subset

    if devices == 1:
        return DataLoader(_data(), batch_size=ROWS, shuffle=False)
    rows = [s * ROWS + 2 * dp_rank + i for s in range(STEPS) for i in (0, 1)]
    return DataLoader(Subset(_data(), rows), batch_size=2, shuffle=False)


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _fit(opt_name: str, devices: int, strategy, *, overrides: dict = OVERRIDES, dp_axis_stride: int = 2,
         stage_ranks: tuple[int, ...] = ()) -> dict:
    """Train 5 steps; with ``devices`` > 1 this rank's dp rank is ``RANK // dp_axis_stride % 2`` and, under pp, the
    global gradient norm adds the squared norms of ``stage_ranks`` (one rank per stage)."""
    import lightning as L
    import lightning_v17.strategies._precision as precision

    from lightning_v17.models import LlamaLM, moe_layers, update_expert_biases

    losses, norms, clip_norms, bias_steps = [], [], [], []

    class Rec(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            loss = outputs["loss"].detach().clone()
            if devices > 1:  # the dp ranks' means (tp ranks hold the same): the mean over one process's batch
                torch.distributed.all_reduce(loss)
                loss /= devices
            losses.append(float(loss))
            if devices == 1:  # one process under "auto": the model's own bias update after the step (V17Strategy's)
                update_expert_biases(pl_module.model)
            bias_steps.append([m.expert_bias.clone() for m in moe_layers(pl_module.model)])

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            # before Lightning clips: the unclipped norm, from every parameter's gradient gathered whole
            grads = [_full(p.grad).double() for p in pl_module.parameters() if p.grad is not None]
            squares = torch.stack([g.pow(2).sum() for g in grads]).sum()
            if stage_ranks:  # each pp rank holds its stage's parameters only
                every = [torch.zeros_like(squares) for _ in range(devices)]
                torch.distributed.all_gather(every, squares)
                squares = sum(every[r] for r in stage_ranks)
            norms.append(float(squares.sqrt()))

    class LM(LlamaLM):
        def configure_model(self) -> None:
            super().configure_model()
            if devices > 1 and int(os.environ["RANK"]) % 2:  # odd ranks (tp rank 1; dp rank 1 under pp) draw other
                with torch.no_grad():  # initial weights: the strategy hands them those of the others (experts too)
                    for p in self.model.parameters():
                        p.add_(torch.randn_like(p), alpha=0.01)

        def configure_optimizers(self):
            cls = torch.optim.SGD if opt_name == "sgd" else torch.optim.AdamW
            return cls(self.parameters(), lr=0.05 if opt_name == "sgd" else 2e-3)

    record = precision.clip_grad_norm_

    def clip_and_record(*args, **kwargs):  # the norm the strategy's clipping computed
        total = record(*args, **kwargs)
        clip_norms.append(float(total))
        return total

    precision.clip_grad_norm_ = clip_and_record
    try:
        module = LM(model="tiny-moe", model_overrides=overrides, warmup_steps=0, max_steps=STEPS)
        trainer = L.Trainer(
            accelerator="cpu", devices=devices, strategy=strategy, max_steps=STEPS,
            gradient_clip_val=OPTIMIZERS[opt_name], use_distributed_sampler=False, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, callbacks=[Rec()],
        )  # fmt: skip
        dp_rank = int(os.environ.get("RANK", "0")) // dp_axis_stride % 2  # the Trainer initializes the group in fit
        trainer.fit(module, _loader(devices, dp_rank))
    finally:
        precision.clip_grad_norm_ = record
    model = module.model
    return {
        "losses": losses, "norms": norms, "clip_norms": clip_norms,
        "params": {n: _full(p) for n, p in model.named_parameters()},
        "experts": sorted(n for n, p in model.named_parameters() if hasattr(p, "_v17_expert")),
        "tp_sharded": sorted(n for n, p in model.named_parameters() if "tp" in str(getattr(p, "device_mesh", ""))),
        "biases": [m.expert_bias.clone() for m in moe_layers(model)], "bias_steps": bias_steps,
    }  # fmt: skip


def _worker(rank: int, world: int) -> dict:
    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    from lightning_v17.strategies import V17Strategy

    return {name: _fit(name, world, V17Strategy(ep=2, tp=2, zero_stage=1)) for name in OPTIMIZERS}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return spawn(_worker, world_size=4, timeout=400, init_process_group=False)


@pytest.fixture(scope="module")
def references() -> dict:
    import warnings

    warnings.filterwarnings("ignore")
    return {name: _fit(name, 1, "auto") for name in OPTIMIZERS}


@pytest.mark.timeout(500)
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_ep2_tp2_matches_one_process(results, references, opt_name) -> None:
    ref = references[opt_name]
    if OPTIMIZERS[opt_name] is not None:  # the clipping clips at every step
        assert min(ref["norms"]) > 2 * CLIP, ref["norms"]
    assert any(bool(b.abs().sum() > 0) for b in ref["biases"]), "the expert bias never moved"
    for rank, got in enumerate(results):
        got = got[opt_name]
        # what was sharded: the MoE block's experts over ep, attention (both blocks) and the dense MLP over tp
        assert got["experts"] == ["layers.1.feed_forward.experts.down_proj",
                                  "layers.1.feed_forward.experts.gate_up_proj"], got["experts"]  # fmt: skip
        assert "layers.1.attention.wq.weight" in got["tp_sharded"], got["tp_sharded"]
        assert "layers.0.feed_forward.w1.weight" in got["tp_sharded"], got["tp_sharded"]
        assert not any("router" in n for n in got["tp_sharded"]), got["tp_sharded"]
        assert got["losses"] == pytest.approx(ref["losses"], rel=TOL, abs=TOL), (rank, got["losses"], ref["losses"])
        assert got["norms"] == pytest.approx(ref["norms"], rel=TOL), (rank, got["norms"], ref["norms"])
        if OPTIMIZERS[opt_name] is not None:
            assert got["clip_norms"] == pytest.approx(ref["norms"], rel=TOL), (rank, got["clip_norms"])
        assert got["params"].keys() == ref["params"].keys()
        for name, want in ref["params"].items():
            torch.testing.assert_close(got["params"][name], want, rtol=TOL, atol=TOL, msg=f"rank {rank} {name}")
        for b, want in zip(got["biases"], ref["biases"]):
            assert torch.equal(b, want), (rank, b, want)
