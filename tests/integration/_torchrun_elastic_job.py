"""An elastic V17Strategy(zero_stage=3) job for the agent-kill scenario (``tests/integration/test_elastic_agents.py``,
``bench/fault.py --scenario agent-kill``): one worker per torchrun agent, the agents standing for nodes
(``torchrun --nnodes=1:2 --nproc-per-node=1 --rdzv-backend=c10d ...``), so the world size is whatever the rendezvous
round gives (2, then 1 after a node died, then 2 when a new one joined).

The tiny reference Llama (2 layers) on :class:`~lightning_v17.data.PackedDataModule` over ``DOCS`` documents shorter
than a row (``packing="none"``: one document per row, so a row's document id is its sample id), one epoch, async
sharded checkpoints every ``EVERY`` steps, ``ckpt_path="last"`` on every start. The Trainer says ``num_nodes=2,
devices=1`` as a user of a 2-node job would; the world size comes from torchrun.

Every rank appends, after each optimizer step, ``{round, world, rank, step, ids, loss}`` to ``ROOT/steps.jsonl``
(``ids``: the sample ids of its batch in batch order; ``round``: an id rank 0 draws per process group, shared with
the others), and its timeline (start, imported, group_formed, loaded, first_step, failed, held, end; wall-clock
seconds) to ``ROOT/events.jsonl``. A resumed world-size-1 round holds (sleeps) once it has trained ``HOLD`` steps and a
checkpoint of that round is published, so that the test can add a node mid-epoch; the agent's SIGTERM (it stops its
workers to re-form the group) ends the hold.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import uuid
from pathlib import Path

DOCS, SEQ, BATCH, EVERY, HOLD = 48, 16, 2, 2, 6


def _event(root: Path, **fields) -> None:
    with open(root / "events.jsonl", "a") as f:
        f.write(json.dumps({"t": time.time(), "rank": int(os.environ.get("RANK", "0")), "pid": os.getpid(),
                            "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), **fields}) + "\n")  # fmt: skip


def documents() -> list[list[int]]:
    """``DOCS`` random documents of 4..SEQ tokens (ids 3..255): each fills one row of ``SEQ`` tokens."""
    import torch

    g = torch.Generator().manual_seed(1000)
    lengths = torch.randint(4, SEQ + 1, (DOCS,), generator=g)
    return [torch.randint(3, 256, (int(n),), generator=g).tolist() for n in lengths]


def make_data(batch_size: int = BATCH):
    from lightning_v17.data import PackedDataModule

    return PackedDataModule(documents(), seq_len=SEQ, batch_size=batch_size, packing="none", seed=0)


def make_module():
    from lightning_v17.models import LlamaLM

    # a fixed cosine length: the learning rate of step k does not depend on the world size's steps per epoch
    return LlamaLM(model="tiny", model_overrides={"layers": 2, "max_seq_len": SEQ}, warmup_steps=0, lr=3e-3,
                   max_steps=DOCS // BATCH)  # fmt: skip


def sample_ids(batch: dict) -> list[int]:
    """The document id of each row (one document per row; -1 is padding)."""
    return [int(row[0]) for row in batch["doc_ids"]]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("--gloo-timeout", type=float, default=10.0, help="V17Strategy(timeout=), seconds")
    parser.add_argument("--step-sleep", type=float, default=0.4, help="seconds added to every step (a real step's "
                        "length: the tiny model's 10 ms steps would end the epoch before the harness can kill a node)")
    args = parser.parse_args()
    root = Path(args.root)
    _event(root, what="start", world=int(os.environ.get("WORLD_SIZE", "1")))  # before any import of torch

    from datetime import timedelta

    import lightning as L
    import torch
    from lightning_v17.callbacks import AsyncCheckpoint

    from lightning_v17 import V17Strategy
    from lightning_v17.checkpoint.async_save import resolve_latest

    _event(root, what="imported")
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    state: dict = {"round": None, "resumed": None, "first": False}

    class Record(L.Callback):
        def setup(self, trainer, pl_module, stage):  # after setup_environment: the process group has formed
            _event(root, what="group_formed", world=trainer.world_size)

        def on_train_start(self, trainer, pl_module):  # after the model is sharded and the checkpoint restored
            token = [uuid.uuid4().hex if trainer.global_rank == 0 else None]
            torch.distributed.broadcast_object_list(token, src=0)
            state.update(round=token[0], resumed=trainer.global_step)
            _event(root, what="loaded", world=trainer.world_size, step=trainer.global_step, round=token[0])

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            row = {"round": state["round"], "world": trainer.world_size, "rank": trainer.global_rank,
                   "step": trainer.global_step, "ids": sample_ids(batch), "loss": float(outputs["loss"]),
                   "t": time.time()}  # fmt: skip
            with open(root / "steps.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
            if not state["first"]:
                state["first"] = True
                _event(root, what="first_step", world=trainer.world_size, step=trainer.global_step)
            time.sleep(args.step_sleep)
            latest = resolve_latest(root / "ckpt")
            published = int(latest.name.split("-")[1]) if latest is not None else -1
            if (trainer.world_size == 1 and state["resumed"] and trainer.global_step >= state["resumed"] + HOLD
                    and published > state["resumed"]):  # fmt: skip
                _event(root, what="held", step=trainer.global_step, published=published)
                while not trainer.received_sigterm:  # the agent stops this worker to add the new node
                    time.sleep(0.05)
                _event(root, what="terminated", step=trainer.global_step)
                os._exit(0)

    strategy = V17Strategy(zero_stage=3, timeout=timedelta(seconds=args.gloo_timeout))
    trainer = L.Trainer(
        accelerator="cpu", devices=1, num_nodes=2, strategy=strategy, max_epochs=1,
        callbacks=[AsyncCheckpoint(root / "ckpt", every_n_steps=EVERY, keep_last=3), Record()],
        logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    try:
        trainer.fit(make_module(), datamodule=make_data(), ckpt_path="last")
    except BaseException as err:
        _event(root, what="failed", error=f"{type(err).__name__}: {err}"[:300])
        raise
    _event(root, what="end", step=trainer.global_step, world=trainer.world_size)


if __name__ == "__main__":
    main()
