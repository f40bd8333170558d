"""The ranks of one host that offload to one drive need room for all their bytes together, refused before step 0.

* ``check_node_capacity`` on 2 gloo ranks against the real free space of the test's directory: each rank asking for
  half of it fits alone (``check_nvme_path``'s per-rank check passes) and is refused together, naming the path, the
  2 ranks and their bytes; a third each fits together; bytes the ranks' tier files already hold count as free.
* ``V17Strategy(zero_stage=1, offload=OffloadPolicy(optimizer="nvme"))`` under a real Trainer on 2 ranks whose
  ``nvme_path`` is a 96 MiB tmpfs: each rank's 20 MiB of AdamW state fits the drive (86 MiB with the 10% + 64 MiB
  margin), the two ranks' do not (108 MiB): ``fit`` raises at setup, no step runs, and no offload folder is left. Skipped where this process
  may not mount a tmpfs (the reason is given).
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from tests._dist import spawn

TMPFS_MB = 96
LAYERS, HIDDEN = 5, 1024  # 5.25M parameters: AdamW's two fp32 moments, halved by ZeRO-1, are 20 MiB per rank


def _checks(rank: int, world: int, path: str) -> dict:
    from lightning_v17.config import V17ConfigError
    from lightning_v17.engine.offload.nvme import check_node_capacity, check_nvme_path

    free = shutil.disk_usage(path).free
    out: dict = {}
    half = free // 2
    check_nvme_path(path, need_bytes=half)  # one rank alone fits
    try:
        check_node_capacity(path, half)
        out["half"] = None
    except V17ConfigError as err:
        out["half"] = str(err)
    check_node_capacity(path, free // 3)  # 2/3 of the free space and the margin fit
    out["third"] = "ok"
    check_node_capacity(path, half, held_bytes=free // 4)  # the files already written are counted as free again
    out["held"] = "ok"
    return out


def test_the_ranks_of_a_host_share_the_drive(tmp_path) -> None:
    res = spawn(_checks, world_size=2, args=(str(tmp_path),), timeout=120)
    for r in res:
        msg = r["half"]
        assert msg is not None, "two ranks asking for half the free space each must be refused"
        assert str(tmp_path) in msg and "the 2 ranks on this host offload" in msg, msg
        assert "OffloadPolicy(nvme_path=...)" in msg and "optimizer_ratio" in msg, msg
        assert r["third"] == r["held"] == "ok"


def _fit(rank: int, world: int, nvme: str) -> dict:
    import lightning as L
    import torch
    from lightning_v17.strategies import V17Strategy
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_v17.config import OffloadPolicy, V17ConfigError

    steps: list[int] = []

    class MLP(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN) for _ in range(LAYERS))

        def training_step(self, batch, batch_idx):
            steps.append(batch_idx)
            x = batch[0]
            for b in self.blocks:
                x = b(x)
            return x.square().mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    data = DataLoader(TensorDataset(torch.randn(8, HIDDEN)), batch_size=4)
    trainer = L.Trainer(accelerator="cpu", devices=world, max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=nvme,
                        strategy=V17Strategy(zero_stage=1, offload=OffloadPolicy(optimizer="nvme", nvme_path=nvme)))  # fmt: skip
    try:
        trainer.fit(MLP(), data)
        err = None
    except V17ConfigError as e:
        err = str(e)
    runs = [d for d in os.listdir(nvme) if d.startswith("v17-offload-")]  # this rank's folder, if it is left
    return {"error": err, "steps": steps, "left": [d for d in runs if os.path.exists(os.path.join(nvme, d, f"rank{rank}"))]}


def test_a_run_whose_ranks_overfill_the_drive_is_refused_at_setup(tmp_path) -> None:
    mnt = tmp_path / "nvme"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_MB}m", "tmpfs", str(mnt)], capture_output=True,
                          text=True, check=False)  # fmt: skip
    if done.returncode != 0:
        pytest.skip(f"cannot mount a {TMPFS_MB} MiB tmpfs here to stand in for a small drive: {done.stderr.strip()}")
    try:
        res = spawn(_fit, world_size=2, args=(str(mnt),), timeout=240, init_process_group=False)
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
    for r in res:
        assert r["error"] is not None, "2 ranks x 20 MiB of state (+ margin) on a 96 MiB drive must be refused"
        assert "the 2 ranks on this host offload" in r["error"] and str(mnt) in r["error"], r["error"]
        assert r["steps"] == [], "refused before the first step"
        assert r["left"] == [], r["left"]  # the refused rank removed its offload folder
