"""The data position across restarts at another world size, and across a mid-epoch resume (no torchrun here; the
torchrun 2 -> 1 -> 2 run is ``test_elastic_agents.py``).

1. ``PackedRowSampler`` resumed from a position saved at another data-parallel size: every rank yields as many
   groups (lock-step) and the epoch's groups are each consumed once. A position saved at world size 1 can be odd;
   cutting the whole epoch's order to a multiple of 2 and then slicing from that position gave rank 0 one group
   more than rank 1: its last step would wait for rank 1 in a collective until the timeout.
2. A Lightning mid-epoch resume with ``max_epochs``: the rest of the epoch is trained, and the next epoch is whole.
   Lightning restores its count of the epoch's batches and ends the epoch when it reaches ``len(loader)``; a loader
   whose length was the remaining batches ended the resumed epoch, and every later one, that many batches early.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from lightning_v17.data.packing import PackedRowSampler

REPO = Path(__file__).resolve().parents[2]


def _take(sampler: PackedRowSampler, steps: int, batch: int) -> list[list[int]]:
    """The row ids of ``steps`` batches of this rank (all of them with steps=-1)."""
    rows = list(sampler)
    out = [rows[i : i + batch] for i in range(0, len(rows), batch)]
    return out if steps < 0 else out[:steps]


@pytest.mark.parametrize("rows", [48, 49])
def test_sampler_resumed_at_another_world_size_stays_in_lock_step(rows):
    batch, seen = 1, Counter()
    state = None
    for world, steps in ((2, 3), (1, 5), (2, -1)):  # 6 groups at 2 ranks, then 5 (odd) alone, then the rest at 2
        samplers = [PackedRowSampler(rows, num_replicas=world, rank=r, seed=3) for r in range(world)]
        for s in samplers:
            if state is not None:
                s.load_state_dict(state)
        taken = [_take(s, steps, batch) for s in samplers]
        assert len({len(t) for t in taken}) == 1, f"world {world}: ranks yield {[len(t) for t in taken]} batches"
        for t in taken:
            seen.update(i for b in t for i in b)
        state = samplers[0].state_dict(consumed_groups=len(taken[0]))
    assert max(seen.values()) == 1, [i for i, n in seen.items() if n > 1]
    # everything but at most one group, cut so that the last world's ranks stay in lock-step
    assert rows - 1 <= len(seen) <= rows and set(seen) <= set(range(rows)), sorted(set(range(rows)) - set(seen))


def _fit(ckpt: Path, *, resume: bool = False) -> list[tuple[int, list[int]]]:
    import lightning as L
    import torch

    from tests.integration._torchrun_elastic_job import make_data, make_module, sample_ids

    seen: list[tuple[int, list[int]]] = []

    class Rec(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append((trainer.current_epoch, sample_ids(batch)))
            if not resume and trainer.global_step == 2:
                trainer.save_checkpoint(ckpt)  # mid-epoch, as a periodic checkpoint is
                trainer.should_stop = True

    torch.set_num_threads(1)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=2, callbacks=[Rec()],
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False)  # fmt: skip
    trainer.fit(make_module(), datamodule=make_data(batch_size=8), ckpt_path=str(ckpt) if resume else None)
    return seen


@pytest.mark.timeout(120)
def test_mid_epoch_resume_with_max_epochs_trains_the_whole_epoch(tmp_path):
    from tests.integration._torchrun_elastic_job import DOCS

    first = _fit(tmp_path / "mid.ckpt")
    second = _fit(tmp_path / "mid.ckpt", resume=True)
    epoch0 = [i for e, ids in first + second if e == 0 for i in ids]
    epoch1 = [i for e, ids in second if e == 1 for i in ids]
    assert sorted(epoch0) == list(range(DOCS)), f"epoch 0 trained {len(epoch0)} of {DOCS} samples after the resume"
    assert sorted(epoch1) == list(range(DOCS)), f"epoch 1 trained {len(epoch1)} of {DOCS} samples"
