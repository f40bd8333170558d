"""The strategy registry's DeepSpeed-familiar aliases, resolved by a real Trainer."""

from __future__ import annotations

DS = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 8,
    "gradient_clipping": 1.0,
    "train_batch_size": 64,
    "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e7},
    "fp16": {"enabled": True, "initial_scale_power": 12, "loss_scale_window": 500, "hysteresis": 3,
             "min_loss_scale": 2},
}  # fmt: skip


def test_registry_aliases() -> None:
    import lightning as L
    import lightning_v17.strategies  # noqa: F401

    for name, stage in (("v17", 3), ("v17_zero1", 1), ("v17_zero2", 2), ("v17_zero3", 3)):
        t = L.Trainer(strategy=name, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
        assert type(t.strategy).__name__ == "V17Strategy" and t.strategy.zero_stage == stage
