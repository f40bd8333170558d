"""BadStepGuard on 2 gloo ranks under V17Strategy(zero_stage=3): a NaN loss injected on ONE rank at one batch.

* ``action="skip"``: both ranks withhold that optimizer step (the max-over-ranks loss is +inf on both), the step
  counts neither in ``global_step`` nor in the step LR scheduler, and the final parameters equal a single-process
  reference whose data never contained that batch (within 1e-6).
* ``action="rollback"``: the first attempt raises ``BadStepRollback`` on both ranks after recording the batch in
  ``ckpt/bad_steps.json``; a second attempt in fresh processes (what ``torchrun --max-restarts`` would start) calls
  ``fit(ckpt_path="last")``, resumes from the newest complete AsyncCheckpoint, skips the recorded batch, finishes,
  logs both events, and ends on the same reference parameters.

The reference is plain torch in this process: the 2 ranks' micro-batches concatenated (ZeRO-3 averages the ranks'
gradients, which for an MSE mean over equal micro-batches is the gradient of the concatenated batch), AdamW and a
StepLR stepped once per applied step, the poisoned batch left out.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch import nn

EPOCHS, BATCHES, BS = 3, 4, 4  # 4 batches per epoch per rank; 12 batches, 11 applied
POISON = (1, 2)  # (epoch, batch_idx) whose loss is NaN on rank 1 only
POISON_RANK = 1


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(2, BATCHES * BS, 8, generator=g)  # [rank, sample, feature]
    y = x.sum(dim=-1, keepdim=True) + 0.1 * torch.randn(2, BATCHES * BS, 1, generator=g)
    return x, y


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def _optim(params):
    opt = torch.optim.AdamW(params, lr=2e-2)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def _reference() -> list[torch.Tensor]:
    torch.manual_seed(0)
    net = _net()
    opt, sched = _optim(net.parameters())
    x, y = _data()
    for epoch in range(EPOCHS):
        for b in range(BATCHES):
            if (epoch, b) == POISON:
                continue  # the data without the offending batch
            sl = slice(b * BS, (b + 1) * BS)
            xb, yb = torch.cat([x[0, sl], x[1, sl]]), torch.cat([y[0, sl], y[1, sl]])
            opt.zero_grad()
            nn.functional.mse_loss(net(xb), yb).backward()
            opt.step()
            sched.step()
    return [p.detach().clone() for p in net.parameters()]


def _run(rank: int, world: int, root: str, action: str, phase: str) -> dict:
    import lightning as L
    from lightning_v17.callbacks import AsyncCheckpoint, BadStepGuard, BadStepRollback, GoodputMonitor

    from lightning_v17 import V17Strategy

    torch.set_num_threads(1)
    messages: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    logging.getLogger("lightning_v17.callbacks.bad_steps").addHandler(_Keep())

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _net()

        def training_step(self, batch, batch_idx):
            xb, yb = batch
            loss = nn.functional.mse_loss(self.net(xb), yb)
            if (self.current_epoch, batch_idx) == POISON and self.global_rank == POISON_RANK:
                loss = loss * float("nan")  # a bad batch: bad on every attempt
            return loss

        def configure_optimizers(self):
            opt, sched = _optim(self.parameters())
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

        def train_dataloader(self):
            x, y = _data()
            ds = torch.utils.data.TensorDataset(x[self.global_rank], y[self.global_rank])
            return torch.utils.data.DataLoader(ds, batch_size=BS, shuffle=False)

    L.seed_everything(0, verbose=False)
    model = Tiny()
    guard = BadStepGuard(action=action, patience=1)
    goodput = GoodputMonitor(dirpath=None if action == "rollback" else root)
    callbacks: list = [guard, goodput]
    if action == "rollback":
        callbacks.append(AsyncCheckpoint(Path(root) / "ckpt", every_n_steps=BATCHES))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=V17Strategy(zero_stage=3),
        max_epochs=EPOCHS,
        callbacks=callbacks,
        use_distributed_sampler=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=action == "rollback",
        num_sanity_val_steps=0,
    )
    out: dict = {"messages": messages}
    try:
        trainer.fit(model, ckpt_path="last" if phase == "resume" else None)
    except BadStepRollback as err:
        out.update(rollback=str(err), offending=err.offending, skip_file=str(err.skip_file))
        return out
    params = []
    for p in model.net.parameters():
        p = p.full_tensor() if hasattr(p, "full_tensor") else p  # ZeRO-3 DTensor shards -> full values
        params.append(p.detach().clone())
    out.update(
        params=params,
        global_step=trainer.global_step,
        lr=trainer.optimizers[0].param_groups[0]["lr"],
        events=guard.events,
        goodput=goodput.last,
    )
    return out


def _close(params: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    assert len(params) == len(ref)
    return max(float((p - r).abs().max()) for p, r in zip(params, ref, strict=True))


@pytest.mark.timeout(150)
def test_bad_step_skip_equals_reference_without_the_batch(tmp_path):
    from tests._dist import spawn

    res = spawn(_run, world_size=2, args=(str(tmp_path), "skip", "first"), init_process_group=False, timeout=120)
    ref = _reference()
    applied = EPOCHS * BATCHES - 1
    for rank, r in enumerate(res):
        assert r["global_step"] == applied, f"rank {rank}: the skipped step must not count in global_step"
        assert [(e["epoch"], e["batch_idx"], e["reason"]) for e in r["events"]] == [(*POISON, "nonfinite")]
        assert r["lr"] == pytest.approx(2e-2 * 0.5 ** (applied // 2)), "the step LR scheduler must be held back"
        err = _close(r["params"], ref)
        print(f"rank {rank}: max |param - reference| = {err:.3g}")
        assert err <= 1e-6, f"rank {rank}: params differ from the reference without batch {POISON} by {err}"
    assert any("skipped" in m and "nonfinite" in m for m in res[0]["messages"]), res[0]["messages"]
    g = res[0]["goodput"]
    print(g.table())
    assert g.attempts == 1 and g.bad_step_s > 0 and g.restart_s == 0 and g.redo_s == 0 and 0 < g.goodput < 1


@pytest.mark.timeout(200)
def test_bad_step_rollback_restarts_skips_the_batch_and_matches_reference(tmp_path):
    import json

    from tests._dist import spawn

    first = spawn(_run, world_size=2, args=(str(tmp_path), "rollback", "first"), init_process_group=False, timeout=120)
    for r in first:
        assert "rolling back" in r["rollback"] and r["offending"] == [POISON], r
    record = json.loads((tmp_path / "ckpt" / "bad_steps.json").read_text())
    assert record["skip_batches"] == [list(POISON)] and record["events"][0]["reason"] == "nonfinite"
    assert any("rollback" in m for m in first[0]["messages"]), first[0]["messages"]
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == f"step-{BATCHES:08d}"  # the step-4 save, complete

    second = spawn(
        _run, world_size=2, args=(str(tmp_path), "rollback", "resume"), init_process_group=False, timeout=120
    )
    ref = _reference()
    for rank, r in enumerate(second):
        assert r["global_step"] == EPOCHS * BATCHES - 1
        assert [(e["epoch"], e["batch_idx"], e["reason"]) for e in r["events"]] == [(*POISON, "recorded")]
        err = _close(r["params"], ref)
        print(f"rank {rank}: max |param - reference| = {err:.3g}")
        assert err <= 1e-6, f"rank {rank}: params differ from the reference without batch {POISON} by {err}"
    g = second[0]["goodput"]
    print(g.table())  # the withheld batch is bad_step_s; steps 5-6 ran twice (after the step-4 save): redo_s
    assert g.attempts == 2 and g.restart_s > 0 and g.redo_s > 0 and g.bad_step_s > 0 and 0 < g.goodput < 1
    logged = second[0]["messages"]
    assert any("after a rollback" in m for m in logged) and any("recorded by a rollback" in m for m in logged), logged
