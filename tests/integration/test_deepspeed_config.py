"""The strategy registry's DeepSpeed-familiar aliases, resolved by a real Trainer."""

from __future__ import annotations


def test_registry_aliases() -> None:
    import lightning as L
    import lightning_v17.strategies  # noqa: F401

    for name, stage in (("v17", 3), ("v17_zero1", 1), ("v17_zero2", 2), ("v17_zero3", 3)):
        t = L.Trainer(strategy=name, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
        assert type(t.strategy).__name__ == "V17Strategy" and t.strategy.zero_stage == stage
