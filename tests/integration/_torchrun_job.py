"""A V17Strategy(zero_stage=3) job for the torchrun restart checks (``tests/integration/test_torchrun_restart.py`` and
``bench/fault.py``). Launched as ``torchrun --standalone --nproc-per-node 2 [--max-restarts 1] -m
tests.integration._torchrun_job ROOT [--kill-at K]``.

Async sharded checkpoints every 4 steps (an epoch: 16 samples per rank, batch 4) and ``ckpt_path="last"`` on every
start. With ``--kill-at K``, rank 1 of the first attempt hard-exits (``os._exit(1)``, no cleanup) after step K; the
agent restarts both workers, which resume from the newest complete checkpoint. With ``--hang-at K`` rank 1 of the
first attempt sleeps before an all-reduce of step K (the watchdog, ``--hang-timeout``, must end the job); with
``--raise-at K`` it raises in the forward of step K; with ``--straggler raise`` it is slowed by 0.3 s a step in the
first attempt, under ``StragglerDetector(action="raise")``. Rank 0 appends every step's loss to
``ROOT/losses-<attempt>.jsonl``; every rank appends its timeline (start, imported, group_formed, loaded, first_step,
kill, end; wall-clock seconds) to ``ROOT/events.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

STEPS, EVERY = 12, 4


def _event(root: Path, **fields) -> None:
    with open(root / "events.jsonl", "a") as f:
        f.write(json.dumps({"t": time.time(), "rank": int(os.environ.get("RANK", "0")), **fields}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("--kill-at", type=int, default=0)
    parser.add_argument("--hang-at", type=int, default=0, help="rank 1 sleeps before an all-reduce in this step")
    parser.add_argument("--hang-timeout", type=float, default=None, help="V17Strategy(hang_timeout=)")
    parser.add_argument("--raise-at", type=int, default=0, help="rank 1 raises in the forward of this step")
    parser.add_argument("--pp-raise-at", type=int, default=0,
                        help="pp=2 (the tiny Llama): rank 1, the last stage, raises in its loss of this step")  # fmt: skip
    parser.add_argument("--straggler", choices=("raise", "warn"), default=None,
                        help="StragglerDetector(action=...); rank 1 of the first attempt is slowed by 0.3 s a step")  # fmt: skip
    args = parser.parse_args()
    root = Path(args.root)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    _event(root, what="start", attempt=attempt)

    import lightning as L
    from lightning_v17.callbacks import AsyncCheckpoint

    from lightning_v17 import V17Strategy
    from tests.dist.test_checkpoint_async import _make_module

    _event(root, what="imported", attempt=attempt)
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)

    class Timeline(L.Callback):
        def setup(self, trainer, pl_module, stage):  # after setup_environment: the process group has formed
            _event(root, what="group_formed", attempt=attempt)

        def on_train_start(self, trainer, pl_module):  # after the model is sharded and the checkpoint restored
            _event(root, what="loaded", attempt=attempt, step=trainer.global_step)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if not getattr(self, "_first", False):
                self._first = True
                _event(root, what="first_step", attempt=attempt, step=trainer.global_step)
            if args.kill_at and attempt == 0 and trainer.global_rank == 1 and trainer.global_step == args.kill_at:
                _event(root, what="kill", attempt=attempt, step=trainer.global_step)
                os._exit(1)

    class Job(_make_module()):
        def training_step(self, batch, batch_idx):
            step = self.trainer.global_step + 1  # the step being run, 1-based
            if attempt == 0 and step == args.hang_at:
                if self.global_rank == 1:
                    _event(root, what="hang", attempt=attempt, step=step)
                    time.sleep(max(30.0, 10 * (args.hang_timeout or 0)))
                torch.distributed.all_reduce(torch.ones(1))  # rank 0 waits here for the sleeping rank 1
            if attempt == 0 and step == args.raise_at and self.global_rank == 1:
                _event(root, what="raise", attempt=attempt, step=step)
                raise RuntimeError(f"injected failure on rank 1 in the forward of step {step}")
            return super().training_step(batch, batch_idx)

    if args.pp_raise_at:
        return _pipeline_job(root, args.pp_raise_at, attempt)
    extra = []
    if args.straggler:
        from lightning_v17.callbacks import StragglerDetector
        from lightning_v17.callbacks.straggler import TEST_SLEEP_ENV

        if attempt == 0:
            os.environ[TEST_SLEEP_ENV] = "1:0.3"  # rank 1's host is slow in the first attempt only
        extra.append(StragglerDetector(every_n_steps=3, patience=1, warmup_steps=1, action=args.straggler))
    strategy = V17Strategy(zero_stage=3, hang_timeout=args.hang_timeout)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=STEPS,
        callbacks=[*extra, AsyncCheckpoint(root / "ckpt", every_n_steps=EVERY, keep_last=3), Timeline()],
        logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        default_root_dir=root,  # Lightning's own ModelCheckpoint writes there, not into the repository
    )  # fmt: skip
    trainer.fit(Job(str(root / f"losses-{attempt}.jsonl")), ckpt_path="last")
    _event(root, what="end", attempt=attempt, step=trainer.global_step)


def _pipeline_job(root: Path, raise_at: int, attempt: int) -> None:
    """V17Strategy(pp=2): rank 1 (the last stage) raises inside the schedule, in its micro-batch loss, at step
    ``raise_at``; rank 0 is then inside the same schedule (a P2P receive)."""
    import lightning as L

    from lightning_v17 import PipelinePolicy, V17Strategy
    from lightning_v17.data import PackedDataModule
    from lightning_v17.models.lightning import next_token_loss
    from tests.integration._torchrun_elastic_job import SEQ, documents, make_module

    torch.set_num_threads(1)
    module = make_module()

    def pipeline_loss(logits, batch):
        step = module.trainer.global_step + 1
        if attempt == 0 and step == raise_at and module.global_rank == 1:
            _event(root, what="raise", attempt=attempt, step=step)
            raise RuntimeError(f"injected failure on rank 1 in pipeline stage 2 (its loss) of step {step}")
        return next_token_loss(logits, batch["labels"], batch.get("loss_mask"))[0]

    module.pipeline_loss = pipeline_loss
    trainer = L.Trainer(
        accelerator="cpu", devices=2, max_steps=STEPS,
        strategy=V17Strategy(zero_stage=1, pp=PipelinePolicy(size=2, microbatches=2)),
        logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
    )  # fmt: skip
    trainer.fit(module, datamodule=PackedDataModule(documents(), seq_len=SEQ, batch_size=2))  # rows of one length
    _event(root, what="end", attempt=attempt, step=trainer.global_step)


if __name__ == "__main__":
    main()
