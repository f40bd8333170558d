"""SIGKILL mid-run with the optimizer state on the nvme tier, then ``fit(ckpt_path="last")``: bit-exact resume.

V17Strategy(zero_stage=3, offload_optimizer="nvme") with ``AsyncCheckpoint`` every 4 steps on 2 gloo ranks (the
module, data and launcher of tests/dist/test_checkpoint_async.py: dropout, AdamW, a step LR scheduler and a shuffled
sampler). Rank 1 is SIGKILLed after step 11, so the state of steps 9-11 existed only in the nvme files and in memory;
the launcher then kills rank 0 too (as torchrun would). The resumed run loads the step-8 checkpoint (whose optimizer
state was read from the tier when it was saved), writes it back to a fresh nvme folder, and its losses of steps 9-11
must equal the killed run's bit for bit (==). The killed run's nvme folders are left behind (nothing runs at a
SIGKILL); the resumed run removes its own at the end.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch

from tests.dist.test_checkpoint_async import _launch, _make_module

STEPS, EVERY, KILL_AFTER = 12, 4, 11


def _run(rank: int, world: int, root: str, phase: str, params: str = "none") -> dict:
    import lightning as L
    from lightning_v17.callbacks import AsyncCheckpoint

    from lightning_v17 import OffloadPolicy, V17Strategy
    from lightning_v17.engine.offload.handles import offload_of

    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    nvme = Path(root) / "nvme"
    seen: dict = {"own_bytes": []}

    class KillAfterStep(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            opt = trainer.optimizers[0]
            assert offload_of(opt) is not None and offload_of(opt).nvme_chunks > 0
            po = trainer.strategy.zero.param_offload
            assert (po is not None) == (params == "nvme")
            if po is not None:  # after the write-backs in flight
                po.flush()
                from tests.dist.test_offload_params import forward_first_bytes

                kept = 0 if po.lean else forward_first_bytes(pl_module)  # "recycle": the next forward's first units
                seen.setdefault("param_resident", []).append(po.resident_bytes() - kept)
            seen["own_bytes"].append(sum(v._local_tensor.numel() for st in opt.state.values() for v in st.values()
                                         if hasattr(v, "_local_tensor") and v.dim() > 0))  # fmt: skip
            if phase == "first" and trainer.global_step == KILL_AFTER:
                # The step-8 save is published before the kill, whatever the disk's speed: its background write may
                # outlast three tiny steps (start() returns after staging), and a kill before it is published
                # rightly resumes from step 4. Both ranks take part (publication is collective).
                if cb._saver.in_flight:
                    cb._record(cb._saver.wait(), trainer, pl_module, log_metrics=False)
                if trainer.global_rank == 1:
                    (Path(root) / "killed").write_text(json.dumps(sorted(os.listdir(nvme))))
                    os.kill(os.getpid(), signal.SIGKILL)

    cb = AsyncCheckpoint(Path(root) / "ckpt", every_n_steps=EVERY, keep_last=3)
    trainer = L.Trainer(
        accelerator="cpu", devices=world, max_steps=STEPS, callbacks=[cb, KillAfterStep()], logger=False,
        strategy=V17Strategy(zero_stage=3, offload=OffloadPolicy(optimizer="nvme", params=params, nvme_path=str(nvme))),
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=root,
    )  # fmt: skip
    trainer.fit(
        _make_module()(str(Path(root) / f"losses-{phase}.jsonl")), ckpt_path="last" if phase == "resume" else None
    )
    return {"global_step": trainer.global_step, "own_bytes": seen["own_bytes"], "param_resident": seen.get("param_resident")}


@pytest.mark.timeout(250)
def test_sigkill_with_state_on_nvme_resumes_bit_exact(tmp_path):
    _sigkill_resume(tmp_path, "none")


@pytest.mark.fault  # ~1 min more: run by `make test-fault`
@pytest.mark.timeout(450)
def test_sigkill_with_params_and_state_on_nvme_resumes_bit_exact(tmp_path):
    """The same with offload_params="nvme" too: the step-8 checkpoint read the parameter shards from their files,
    the resumed run writes the loaded shards to its own fresh folder, and steps 9-11 equal the killed run's (==)."""
    second = _sigkill_resume(tmp_path, "nvme", timeout=200)
    # no shard in memory after any step but the next forward's first units
    assert all(b == 0 for r in second.values() for b in r["param_resident"])


def _sigkill_resume(tmp_path, params: str, timeout: float = 110) -> dict:
    (tmp_path / "nvme").mkdir()
    first, first_err = _launch(_run, 2, (str(tmp_path), "first", params), timeout=timeout)
    assert (tmp_path / "killed").exists(), f"rank 1 was not killed; {first} {first_err}"
    assert not first, "no rank may finish the killed run"
    left = json.loads((tmp_path / "killed").read_text())
    tiers = 2 if params == "nvme" else 1  # the optimizer's and the parameters' file sets: one run folder each
    assert len(left) == 2 * tiers and all(n.startswith("v17-offload-") for n in left)  # each rank's, alive
    before = set(os.listdir(tmp_path / "nvme"))

    second, second_err = _launch(_run, 2, (str(tmp_path), "resume", params), timeout=timeout)
    assert not second_err and sorted(second) == [0, 1], f"the resumed run failed: {second_err}"
    assert second[0]["global_step"] == STEPS
    assert all(b == 0 for r in second.values() for b in r["own_bytes"])  # every step's state was on the tier
    assert set(os.listdir(tmp_path / "nvme")) == before  # the resumed run removed its own folders, nothing else

    def losses(name):
        return {r["step"]: r["loss"] for r in map(json.loads, (tmp_path / name).read_text().splitlines())}

    ref, resumed = losses("losses-first.jsonl"), losses("losses-resume.jsonl")
    assert sorted(ref) == list(range(1, KILL_AFTER + 1))
    assert sorted(resumed) == list(range(2 * EVERY + 1, STEPS + 1)), "must resume after step 8"
    for step in range(2 * EVERY + 1, KILL_AFTER + 1):
        assert resumed[step] == ref[step], f"step {step}: resumed {resumed[step]!r} != killed run {ref[step]!r}"
    return second
