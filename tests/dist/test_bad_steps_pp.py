"""BadStepGuard under pipeline parallelism (V17Strategy(pp=2), 2 gloo ranks): a NaN loss at one batch is skipped.

Under pp > 1 the schedule runs forward and backward, so Lightning's ``on_before_backward`` (where the guard reads the
loss) never fires; the strategy hands the loss to the guard's ``on_pipeline_loss`` after the schedule. The last
stage's loss is made NaN at batch ``POISON`` (its gradients, back-propagated through both stages, are NaN too). The
guard must withhold that step on both ranks, and every other batch's loss must equal a single-process reference that
never saw the poisoned batch: the same tiny Llama and AdamW/LR schedule, each batch's loss the mean over its two
rows (the pipeline's two micro-batches).
"""

from __future__ import annotations

import math

import pytest
import torch

from tests._dist import spawn

POISON, STEPS, RTOL = 2, 5, 1e-5  # batch index poisoned; applied steps; tolerance on the losses


def _data():
    from lightning_v17.data import PackedDataModule
    from tests.integration._torchrun_elastic_job import SEQ, documents

    return PackedDataModule(documents(), seq_len=SEQ, batch_size=2, seed=0)  # packed rows of one length


def _worker(rank: int, world: int) -> dict:
    import lightning as L
    from lightning_v17.callbacks import BadStepGuard

    from lightning_v17 import PipelinePolicy, V17Strategy
    from lightning_v17.models.lightning import next_token_loss
    from tests.integration._torchrun_elastic_job import make_module

    torch.set_num_threads(1)
    module = make_module()
    seen: dict[int, float] = {}

    def pipeline_loss(logits, batch):
        loss = next_token_loss(logits, batch["labels"], batch.get("loss_mask"))[0]
        return loss * float("nan") if module._batch_idx == POISON else loss

    class Record(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            module._batch_idx = batch_idx

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen[batch_idx] = float(outputs["loss"])

    module.pipeline_loss = pipeline_loss
    guard = BadStepGuard(action="skip", patience=1)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, max_steps=STEPS,
        strategy=V17Strategy(zero_stage=1, pp=PipelinePolicy(size=2, microbatches=2)),
        callbacks=[guard, Record()], logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, num_sanity_val_steps=0, limit_val_batches=0,
    )  # fmt: skip
    trainer.fit(module, datamodule=_data())
    return {"losses": seen, "global_step": trainer.global_step, "events": [e["action"] for e in guard.events]}


def _reference() -> dict[int, float]:
    from lightning_v17.data.packing import collate_rows
    from lightning_v17.models.lightning import next_token_loss
    from tests.integration._torchrun_elastic_job import make_module

    dm = _data()
    dm.setup("fit")
    dm.train_dataloader()
    order = list(dm.train_sampler)
    module = make_module()
    module.configure_model()
    conf = module.configure_optimizers()
    opt, sched = conf["optimizer"], conf["lr_scheduler"]["scheduler"]
    out: dict[int, float] = {}
    for b in range(STEPS + 1):
        if b == POISON:
            continue  # never seen
        micro = [collate_rows([dm.train_rows[i]], pad_id=dm.tokenizer.pad_id) for i in order[2 * b : 2 * b + 2]]
        loss = torch.stack([next_token_loss(module(m), m["labels"], m.get("loss_mask"))[0] for m in micro]).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        out[b] = loss.item()
    return out


@pytest.mark.timeout(240)
def test_nan_under_pp2_is_skipped_and_the_rest_equals_a_reference_without_the_batch():
    results = spawn(_worker, world_size=2, timeout=200)
    ref = _reference()
    for rank, r in enumerate(results):
        got = r["losses"]
        assert r["global_step"] == STEPS, (rank, r)
        assert sorted(got) == list(range(STEPS + 1)) and math.isnan(got[POISON]), (rank, got)
        for b, want in ref.items():
            assert abs(got[b] - want) <= RTOL * abs(want), (rank, b, got[b], want, got, ref)
        assert len(r["events"]) == 1, (rank, r["events"])
    worst = max(abs(r["losses"][b] - w) / abs(w) for r in results for b, w in ref.items())
    print(f"max relative loss difference to the reference: {worst:.2e}")
