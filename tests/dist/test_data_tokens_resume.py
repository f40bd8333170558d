"""Token files through Lightning: a blend of two ``.bin/.idx`` corpora trained on 2 gloo ranks, checkpointed mid-epoch,
resumed on 1 rank at the same global batch. Every step trains the rows of the global positions an uninterrupted run
trains at that step (the index itself, read in this process, is the reference), and over the epoch every row is
trained exactly once."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from tests._dist import spawn

SEQ, PER_RANK, STEPS_BEFORE = 16, 2, 3


def _corpora(root: Path) -> list[str]:
    from lightning_v17.data.indexed import write_indexed

    rng = np.random.default_rng(0)
    paths = []
    for c, n_docs in enumerate((30, 14)):
        lengths = rng.integers(0, 3 * SEQ, n_docs)
        write_indexed(root / f"corpus{c}", [rng.integers(0, 256, int(n)) for n in lengths])
        paths.append(str(root / f"corpus{c}"))
    return paths


def _data(paths: list[str], batch_size: int):
    from lightning_v17.data import PackedDataModule

    return PackedDataModule(paths=paths, weights=[0.7, 0.3], seq_len=SEQ, batch_size=batch_size, seed=5,
                            prefetch_batches=2)  # fmt: skip


def _fit(paths, batch_size, devices, max_steps, ckpt_in=None, ckpt_out=None):
    import lightning as L
    import torch

    from lightning_v17.models import LlamaLM

    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    rows: list[list[tuple[int, ...]]] = []

    class Rec(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            rows.append([tuple(r.tolist()) for r in batch["input_ids"]])
            if ckpt_out and trainer.global_step == STEPS_BEFORE:
                trainer.save_checkpoint(ckpt_out)
                trainer.should_stop = True

    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto",
                        max_steps=max_steps, max_epochs=1, callbacks=[Rec()], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False)  # fmt: skip
    module = LlamaLM(model="tiny", model_overrides={"layers": 1, "max_seq_len": SEQ}, warmup_steps=0, max_steps=100)
    trainer.fit(module, datamodule=_data(paths, batch_size), ckpt_path=ckpt_in)
    return rows


def _phase_two_ranks(rank: int, world: int, paths: list[str], ckpt: str) -> list:
    return _fit(paths, PER_RANK, devices=2, max_steps=-1, ckpt_out=ckpt)


@pytest.mark.timeout(300)
def test_token_files_resume_from_2_ranks_on_1_with_the_same_global_order(tmp_path):
    from lightning_v17.data.blend import BlendedTokens

    paths = _corpora(tmp_path)
    ckpt = str(tmp_path / "mid.ckpt")
    per_rank = spawn(_phase_two_ranks, world_size=2, args=(paths, ckpt), timeout=240, init_process_group=False)
    after = _fit(paths, 2 * PER_RANK, devices=1, max_steps=-1, ckpt_in=ckpt)

    index = BlendedTokens(paths, weights=[0.7, 0.3], seq_len=SEQ, seed=5, pad_id=258)
    glob = 2 * PER_RANK
    expect = [Counter(tuple(index[i]["input_ids"].tolist()) for i in range(t * glob, min((t + 1) * glob, len(index))))
              for t in range(-(-len(index) // glob))]  # fmt: skip
    before = [Counter(per_rank[0][t] + per_rank[1][t]) for t in range(STEPS_BEFORE)]
    trained = before + [Counter(step) for step in after]
    assert len(before) == STEPS_BEFORE and len(trained) == len(expect), (len(before), len(trained), len(expect))
    assert trained == expect, "a step trained other rows than the uninterrupted global order"
    total = sum(trained, Counter())
    assert total == sum(expect, Counter()) and sum(total.values()) == len(index)
