"""Recompute on an unchanged Hugging Face model, and HSDP replicas that start from different random weights.

* Recompute: inside a Trainer (V17Strategy, ZeRO-3, 2 ranks), the ops that run during ``backward`` are counted with a
  ``TorchDispatchMode`` and the blocks' ``q_proj`` calls with forward hooks. Without recompute no block forward runs
  in backward; with "full" every block's forward re-runs, matmuls included; with "selective" the blocks re-run but
  their matmuls are not recomputed (their saved outputs are reused, Korthikanti 2022 §4), while the elementwise SiLU
  is. The losses of all three modes are equal (recompute changes memory, not math).
* Replicas: HSDP ``dp_replicate=2 x dp_shard=2`` at ZeRO-3 on 4 ranks, every rank drawing the model from its *own*
  seed. After setup and after 3 steps, the two replicas of every shard must be bitwise equal.
"""

from __future__ import annotations

import pytest

from tests._dist import spawn
from tests._models import fit

pytest.importorskip("transformers")

LAYERS = 2


def _recompute_worker(rank: int, world: int, mode: str) -> dict:
    import lightning as L
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from lightning_v17 import V17Strategy

    aten = torch.ops.aten
    mm_ops = {aten.mm.default, aten.addmm.default, aten.bmm.default}

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.mm = self.silu = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.mm += func in mm_ops
            self.silu += func == aten.silu.default
            return func(*args, **(kwargs or {}))

    class BackwardProbe(L.Callback):
        def __init__(self) -> None:
            self.stats: list[dict] = []
            self.in_backward = False
            self.q_calls = 0

        def on_fit_start(self, trainer, pl_module) -> None:
            for name, m in pl_module.named_modules():
                if name.endswith("self_attn.q_proj"):
                    m.register_forward_hook(self._q_hook)

        def _q_hook(self, *_args) -> None:
            self.q_calls += self.in_backward

        def on_before_backward(self, trainer, pl_module, loss) -> None:
            self.q_calls, self.in_backward = 0, True
            self.mode = Count()
            self.mode.__enter__()

        def on_after_backward(self, trainer, pl_module) -> None:
            self.mode.__exit__(None, None, None)
            self.in_backward = False
            self.stats.append({"mm": self.mode.mm, "silu": self.mode.silu, "q_calls": self.q_calls})

    probe = BackwardProbe()
    losses = fit(
        "hf_llama", V17Strategy(zero_stage=3, activation_checkpointing=mode), devices=world, batch_size=4, steps=2,
        layers=LAYERS, callbacks=(probe,),
    )  # fmt: skip
    return {"losses": losses, "stats": probe.stats}


@pytest.mark.timeout(300)
def test_recompute_reruns_hf_blocks_and_selective_differs_from_full():
    out = {
        mode: spawn(_recompute_worker, world_size=2, args=(mode,), init_process_group=False)[0]
        for mode in ("none", "selective", "full")
    }
    none, sel, full = (out[m]["stats"][-1] for m in ("none", "selective", "full"))
    assert none["q_calls"] == 0 and none["silu"] == 0, f"no recompute: nothing re-runs in backward: {none}"
    assert full["q_calls"] == LAYERS and sel["q_calls"] == LAYERS, f"each block re-runs once: {sel}, {full}"
    assert full["silu"] == LAYERS and sel["silu"] == LAYERS, f"the activations are recomputed: {sel}, {full}"
    # Projections are matmuls: full recompute re-runs them, selective reuses their saved outputs. Full re-runs 6 of
    # the 7 per block (q, k, v, o, gate, up): torch's checkpoint stops recomputing once every tensor backward needs
    # is back (early stop), and down_proj's output is not needed by any backward.
    assert full["mm"] >= none["mm"] + 6 * LAYERS, f"full recompute re-runs the matmuls: {full} vs {none}"
    assert sel["mm"] == none["mm"], f"selective recompute saves matmul outputs: {sel} vs {none}"
    for mode in ("selective", "full"):
        assert out[mode]["losses"] == pytest.approx(out["none"]["losses"], rel=1e-6), mode


def _replica_worker(rank: int, world: int) -> dict:
    import lightning as L

    from lightning_v17 import V17Strategy

    class Snapshot(L.Callback):
        def __init__(self) -> None:
            self.snaps: dict[str, dict] = {}

        def setup(self, trainer, pl_module, stage) -> None:  # before the strategy touches the model
            self.snaps["init_head_sum"] = float(pl_module.model.lm_head.weight.sum())

        def _take(self, key: str, pl_module) -> None:
            self.snaps[key] = {n: p.to_local().detach().clone() for n, p in pl_module.named_parameters()}

        def on_train_start(self, trainer, pl_module) -> None:
            self._take("setup", pl_module)

        def on_train_end(self, trainer, pl_module) -> None:
            self._take("step3", pl_module)

    snap = Snapshot()
    # Each rank draws its own model (seed = rank): only the strategy's broadcast can make the replicas agree.
    fit("hf_llama", V17Strategy(zero_stage=3, dp_replicate=2, dp_shard=2), devices=world, batch_size=2, steps=3,
        layers=LAYERS, seed=rank, callbacks=(snap,))  # fmt: skip
    return snap.snaps


@pytest.mark.timeout(300)
def test_hsdp_replicas_equal_after_setup_and_steps_despite_different_seeds():
    snaps = spawn(_replica_worker, world_size=4, init_process_group=False)
    # mesh (dp_replicate, dp_shard): global rank = replica * 2 + shard, so ranks r and r + 2 hold the same shard.
    for shard in (0, 1):
        a, b = snaps[shard], snaps[shard + 2]
        for when in ("setup", "step3"):
            diff = [n for n in a[when] if not a[when][n].equal(b[when][n])]
            assert not diff, f"replicas of shard {shard} differ {when}: {diff[:4]}"
    # and the replicas really started apart: before setup, ranks 0 and 2 held different draws
    assert snaps[0]["init_head_sum"] != snaps[2]["init_head_sum"]
