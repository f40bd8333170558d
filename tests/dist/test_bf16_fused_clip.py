"""bf16-mixed with gradient clipping and torch's fused AdamW (the optimizer library's default) under V17Strategy.

Lightning's ``MixedPrecision.clip_gradients`` refuses any optimizer that "unscales internally" (fused AdamW sets
``_step_supports_amp_scaling``), a check meant for fp16's GradScaler; bf16-mixed has no scaler, so V17 clips there as
for fp32. Checked against a hand value: the gradient the fused step receives has the global norm ``CLIP`` (the
pre-clip norm is far above it), on 2 ranks at ZeRO-0 (whole gradients, so each rank's local norm is the global one).
"""

from __future__ import annotations

import pytest
import torch

from tests._dist import spawn

CLIP = 0.05


def _worker(rank: int, world_size: int) -> dict:
    import warnings

    import lightning as L
    from lightning_v17.strategies import V17Strategy

    from lightning_v17.models.lightning import LlamaLM
    from tests.dist.test_strategy_tp_pp import _data

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    seen: list[float] = []

    class Recording(torch.optim.AdamW):
        def step(self, closure=None):
            loss = None
            if closure is not None:  # Lightning's closure: forward, backward, then its clipping
                with torch.enable_grad():
                    loss = closure()
            grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
            seen.append(float(torch.linalg.vector_norm(torch.stack([x.float().norm() for x in grads]))))
            super().step()
            return loss

    class LM(LlamaLM):
        def configure_optimizers(self):
            return Recording(self.parameters(), lr=1e-3, fused=True)

    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy=V17Strategy(zero_stage=0), precision="bf16-mixed",
        gradient_clip_val=CLIP, max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False,
    )  # fmt: skip
    trainer.fit(LM(model="tiny", model_overrides={"layers": 2}), _data())
    return {"norms": seen}


@pytest.mark.timeout(300)
def test_bf16_mixed_clips_with_fused_adamw() -> None:
    for res in spawn(_worker, world_size=2, timeout=240, init_process_group=False):
        assert len(res["norms"]) == 2, res
        assert res["norms"] == pytest.approx([CLIP, CLIP], rel=1e-4), res  # clipped to the global norm CLIP
