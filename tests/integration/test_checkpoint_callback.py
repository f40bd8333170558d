"""AsyncCheckpoint on one CPU process (no process group): retention, `latest`, wait reporting, Young/Daly interval,
resume with ckpt_path="last", and option validation."""

from __future__ import annotations

import pytest

from tests.dist.test_checkpoint_async import _make_module


def _trainer(callbacks, max_steps, root):
    import lightning as L

    return L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,  # Lightning's own ModelCheckpoint writes there, not into the working directory
    )


def test_keep_last_latest_and_wait_reporting(tmp_path, monkeypatch):
    import lightning as L
    from lightning_v17.callbacks import AsyncCheckpoint

    from lightning_v17.checkpoint.async_save import TEST_DELAY_ENV, complete_checkpoints

    monkeypatch.setenv(TEST_DELAY_ENV, "0.6")  # each background write takes >= 0.6 s; steps take milliseconds
    L.seed_everything(0, verbose=False)
    cb = AsyncCheckpoint(tmp_path / "ck", every_n_steps=2, keep_last=2)
    _trainer([cb], 8, tmp_path).fit(_make_module()(str(tmp_path / "l.jsonl")))
    assert (tmp_path / "ck" / "latest").read_text().strip() == "step-00000008"
    assert [s for s, _ in complete_checkpoints(tmp_path / "ck")] == [6, 8]  # older ones pruned after publication
    assert [h["step"] for h in cb.history] == [2.0, 4.0, 6.0, 8.0]
    # saves 2..4 came due while the previous one was still writing: the loop waited, and the wait was reported
    assert all(h["wait_s"] > 0.3 for h in cb.history[1:]), cb.history
    assert all(h["write_s"] >= 0.6 for h in cb.history)
    assert not list((tmp_path / "ck").glob(".*partial"))

    # resume from "last" on one process (the wrapped CheckpointIO reads the sharded directory back)
    seen = []

    class First(L.Callback):
        def on_train_batch_start(self, trainer, *args):
            seen.append(trainer.global_step)

    monkeypatch.setenv(TEST_DELAY_ENV, "0")
    cb2 = AsyncCheckpoint(tmp_path / "ck", every_n_steps=2, keep_last=2)
    tr = _trainer([cb2, First()], 10, tmp_path)
    tr.fit(_make_module()(str(tmp_path / "l2.jsonl")), ckpt_path="last")
    assert seen[0] == 8 and tr.global_step == 10


def test_mtbf_interval_from_measured_cost(tmp_path):
    import lightning as L
    from lightning_v17.callbacks import AsyncCheckpoint

    from lightning_v17.planner.resilience import daly_interval_s

    L.seed_everything(0, verbose=False)
    mtbf_h = 1e-4  # 0.36 s: a tiny MTBF keeps the interval small enough to see saves in a short run
    cb = AsyncCheckpoint(tmp_path / "ck", mtbf_hours=mtbf_h)
    _trainer([cb], 6, tmp_path).fit(_make_module()(str(tmp_path / "l.jsonl")))
    first = cb.history[0]
    assert first["step"] == 1.0  # mtbf mode saves after the first step, to measure
    # the interval was set from the first save's measured cost (later saves refine it the same way)
    last = cb.history[-1]
    expected = max(daly_interval_s(max(last["staging_s"], 1e-6), mtbf_h * 3600.0), last["write_s"])
    assert cb.interval_s == pytest.approx(expected, rel=1e-12)


def test_options_are_validated():
    from lightning_v17.callbacks import AsyncCheckpoint

    with pytest.raises(ValueError, match="every_n_steps=, every_n_minutes= or mtbf_hours="):
        AsyncCheckpoint("d")
    with pytest.raises(ValueError, match="keep_last=0"):
        AsyncCheckpoint("d", every_n_steps=1, keep_last=0)
    with pytest.raises(ValueError, match="every_n_minutes=-1"):
        AsyncCheckpoint("d", every_n_minutes=-1)
