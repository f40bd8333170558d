"""AsyncCheckpoint end to end on 2 gloo ranks with Lightning: a rank is SIGKILLed while the third save is being
written; ``fit(ckpt_path="last")`` resumes from the second (the newest COMPLETE) save and the losses from there are
bit-identical (==, no tolerance) to the run that was not interrupted before those steps.

The strategy is Lightning's "ddp" (full tensors, the torch.distributed.checkpoint.state_dict FQN layout) and
V17Strategy(zero_stage=3) (DTensor shards through engine/zero/stages_0_2.py), each killed the same way. Dropout, AdamW state, a step LR scheduler and a shuffled
DistributedSampler make every piece of the saved state (model, optimizer, scheduler, loops, RNG of each rank) matter.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from torch import nn

STEPS, EVERY = 12, 4


def _make_module():
    import lightning as L

    class Tiny(L.LightningModule):
        def __init__(self, loss_file: str) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 1))
            self.loss_file = loss_file

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            if self.global_rank == 0:  # appended as it goes: the killed run leaves its losses behind
                with open(self.loss_file, "a") as f:
                    f.write(json.dumps({"step": self.global_step + 1, "loss": loss.item()}) + "\n")
            return loss

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=3e-2)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

        def train_dataloader(self):
            g = torch.Generator().manual_seed(1234)
            x = torch.randn(32, 8, generator=g)
            y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(32, 1, generator=g)
            # 16 samples per rank, batch 4 -> 4 steps per epoch; Lightning injects a shuffling DistributedSampler
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4, shuffle=True)

    return Tiny


def _run(rank: int, world: int, root: str, phase: str, strategy: str = "ddp") -> dict:
    import lightning as L
    from lightning_v17.callbacks import AsyncCheckpoint

    from lightning_v17 import V17Strategy

    torch.set_num_threads(1)
    root_p = Path(root)
    L.seed_everything(0, verbose=False)

    class KillDuringThirdSave(L.Callback):
        def on_train_end(self, trainer, pl_module):
            # Runs before AsyncCheckpoint.on_train_end (Lightning orders checkpoint callbacks last): the save started
            # at step 12 is still in its (slowed) background write and has not been published.
            partial = root_p / "ckpt" / f".step-{STEPS:08d}.v17-partial"
            for _ in range(100):  # rank 0's background writer creates the partial directory right after start()
                if trainer.global_rank != 1 or partial.exists():
                    break
                time.sleep(0.01)
            if trainer.global_rank == 1 and partial.exists() and not (root_p / "ckpt" / f"step-{STEPS:08d}").exists():
                (root_p / "killed").write_text("1")
                os.kill(os.getpid(), signal.SIGKILL)

    ckpt_cb = AsyncCheckpoint(root_p / "ckpt", every_n_steps=EVERY, keep_last=3)
    callbacks = [ckpt_cb] + ([KillDuringThirdSave()] if phase == "first" else [])
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=V17Strategy(zero_stage=3) if strategy == "v17_zero3" else strategy,
        max_steps=STEPS,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    model = _make_module()(str(root_p / f"losses-{phase}.jsonl"))
    trainer.fit(model, ckpt_path="last" if phase == "resume" else None)
    return {"history": ckpt_cb.history, "global_step": trainer.global_step}


def _launch(fn, world: int, args: tuple, timeout: float) -> tuple[dict[int, object], dict[int, str]]:
    """Like tests._dist.spawn, but when a rank dies the others are killed at once (what torchrun does); returns
    ``(results, errors)`` by rank instead of raising."""

    from tests._dist import _context, _entry, decode_result, free_port

    ctx = _context()  # the forkserver with torch and lightning preloaded, as tests._dist.spawn uses
    queue = ctx.SimpleQueue()
    port = free_port()
    env = dict(os.environ)
    procs = [
        ctx.Process(target=_entry, args=(r, world, port, fn, args, False, queue, env), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        while not queue.empty():
            r, ok, payload = queue.get()
            if ok:
                results[r] = decode_result(payload)
            else:
                errors[r] = payload
        if len(results) + len(errors) == world:
            break
        if any(p.exitcode not in (None, 0) for p in procs):  # a rank died: take the job down, as torchrun does
            break
        time.sleep(0.05)
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(5)
    return results, errors


@pytest.mark.timeout(280)
@pytest.mark.parametrize("strategy", ["ddp", "v17_zero3"])
def test_async_checkpoint_sigkill_resume_exact(tmp_path, monkeypatch, strategy):
    """Under Lightning's "ddp" and under V17Strategy(zero_stage=3) (DTensor shards, FQN-keyed sharded optimizer
    state): SIGKILL mid-save, then resume from the newest complete save, bit-exact."""
    from lightning_v17.checkpoint.sharded import is_sharded_checkpoint
    from lightning_v17.checkpoint.async_save import TEST_DELAY_ENV, resolve_latest

    monkeypatch.setenv(TEST_DELAY_ENV, "1.5")  # test-only: every rank's background write takes >= 1.5 s
    first, first_err = _launch(_run, 2, (str(tmp_path), "first", strategy), timeout=150)
    assert (tmp_path / "killed").exists(), f"rank 1 was not killed during the third save; {first} {first_err}"
    assert not first, "no rank may finish the killed run"
    ck = tmp_path / "ckpt"
    assert (ck / "latest").read_text().strip() == f"step-{2 * EVERY:08d}"
    assert (ck / f".step-{STEPS:08d}.v17-partial").is_dir() and not (ck / f"step-{STEPS:08d}").exists()
    assert resolve_latest(ck) == (ck / f"step-{2 * EVERY:08d}").absolute()
    assert is_sharded_checkpoint(ck / f"step-{EVERY:08d}") and is_sharded_checkpoint(ck / f"step-{2 * EVERY:08d}")

    monkeypatch.setenv(TEST_DELAY_ENV, "0")
    second, second_err = _launch(_run, 2, (str(tmp_path), "resume", strategy), timeout=150)
    assert not second_err and sorted(second) == [0, 1], f"the resumed run failed: {second_err}"
    assert second[0]["global_step"] == STEPS

    def losses(name):
        rows = [json.loads(line) for line in (tmp_path / name).read_text().splitlines()]
        return {r["step"]: r["loss"] for r in rows}

    ref, resumed = losses("losses-first.jsonl"), losses("losses-resume.jsonl")
    assert sorted(ref) == list(range(1, STEPS + 1))
    assert sorted(resumed) == list(range(2 * EVERY + 1, STEPS + 1)), "must resume after step 8, the newest complete"
    for step, loss in resumed.items():
        assert loss == ref[step], f"step {step}: resumed loss {loss!r} != uninterrupted {ref[step]!r} (bit-exact)"
    # the resumed run published its own step-12 save; latest moved only then; keep_last=3 kept all three
    assert (ck / "latest").read_text().strip() == f"step-{STEPS:08d}"
    assert not (ck / f".step-{STEPS:08d}.v17-partial").exists()
    hist = second[0]["history"]
    assert len(hist) == 1 and hist[0]["staging_s"] >= 0


def _run_v17(rank: int, world: int, root: str, phase: str) -> dict:
    import lightning as L
    from lightning_v17.callbacks import AsyncCheckpoint

    from lightning_v17 import V17Strategy

    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    cb = AsyncCheckpoint(Path(root) / "ckpt", every_n_steps=2)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=V17Strategy(zero_stage=3),
        max_steps=6,
        callbacks=[cb],
        logger=False,
        default_root_dir=root,  # Lightning's own ModelCheckpoint writes there, not into the working directory
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(
        _make_module()(str(Path(root) / f"losses-{phase}.jsonl")), ckpt_path="last" if phase == "resume" else None
    )
    return {"global_step": trainer.global_step, "published": len(cb.history)}


@pytest.mark.timeout(200)
def test_async_checkpoint_v17_zero3_resume_exact(tmp_path):
    """The same callback over V17Strategy(zero_stage=3) (DTensor shards via engine/zero/stages_0_2.py): the newest checkpoint is
    lost (deleted with its `latest` pointer), "last" falls back to the newest complete one, losses match exactly."""
    import shutil

    from tests._dist import spawn

    first = spawn(_run_v17, world_size=2, args=(str(tmp_path), "first"), init_process_group=False, timeout=150)
    assert first[0] == {"global_step": 6, "published": 3}
    ck = tmp_path / "ckpt"
    shutil.rmtree(ck / "step-00000006")
    (ck / "latest").unlink()
    second = spawn(_run_v17, world_size=2, args=(str(tmp_path), "resume"), init_process_group=False, timeout=150)
    assert second[0]["global_step"] == 6

    def losses(name):
        return {r["step"]: r["loss"] for r in map(json.loads, (tmp_path / name).read_text().splitlines())}

    ref, resumed = losses("losses-first.jsonl"), losses("losses-resume.jsonl")
    assert sorted(resumed) == [5, 6]
    assert all(resumed[s] == ref[s] for s in resumed), (ref, resumed)
