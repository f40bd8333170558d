"""The registry aliases work after ``import lightning_v17`` alone, in either import order and in the CLI, while
``import lightning_v17`` (and the planner) stays free of torch and Lightning. Fresh interpreters: the registration
happens at import time."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TRAINER = (
    "t = L.Trainer(strategy='v17_zero3', accelerator='cpu', devices=1, logger=False, max_steps=2, "
    "enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False); "
    "from lightning_v17.models import LlamaLM; from lightning_v17.data.datamodule import PackedDataModule; "
    "t.fit(LlamaLM(model='tiny', model_overrides={'layers': 2}), "
    "datamodule=PackedDataModule([list(range(1, 40))] * 16, seq_len=32, batch_size=2)); "
    "print(type(t.strategy).__name__, t.strategy.zero_stage, t.global_step)"
)


def _py(code: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", code], check=False, cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize(
    "imports", ["import lightning_v17; import lightning as L", "import lightning as L; import lightning_v17"]
)
def test_alias_after_importing_the_package(imports):
    assert _py(f"{imports}; {TRAINER}") == "V17Strategy 3 2"  # the alias built V17 ZeRO-3, and it trained 2 steps


def test_package_import_stays_torch_free():
    assert (
        _py("import sys, lightning_v17.planner; print('torch' in sys.modules or 'lightning' in sys.modules)") == "False"
    )


def test_cli_and_the_offload_recipe_take_the_aliases_by_name():
    """What `v17 fit --trainer.strategy v17_zero2` builds: the CLI's Trainer holds a V17Strategy at stage 2 (built
    without running fit; the process imports lightning_v17.trainer_cli first, as the `v17` entry point does). Then,
    in the same interpreter, `v17_zero3_offload`: ZeRO-3 with the CPU parameter tier (FSDP2's CPUOffloadPolicy; its
    parity is in tests/dist/test_zero_parity.py). One interpreter for both: each costs a torch + Lightning import."""
    code = (
        "from lightning_v17.trainer_cli import V17CLI; from lightning_v17.models.lightning import LlamaLM; "
        "from lightning_v17.data.datamodule import PackedDataModule; "
        "cli = V17CLI(LlamaLM, PackedDataModule, run=False, args=['--config', 'configs/tiny-cpu.yaml', "
        "'--trainer.strategy', 'v17_zero2', '--trainer.logger', 'false', '--trainer.callbacks', '[]']); "
        "s = cli.trainer.strategy; "
        "import lightning as L; t = L.Trainer(strategy='v17_zero3_offload', accelerator='cpu', devices=1, "
        "logger=False); o = t.strategy; "
        "print(type(s).__name__, s.zero_stage, '|', o.zero_stage, o.policy.offload.params.value)"
    )
    assert _py(code) == "V17Strategy 2 | 3 cpu"


def test_v17_fit_trains_with_the_alias_by_name(tmp_path):
    """`v17 fit --trainer.strategy v17_zero3` trains (the main job's config, 1 rank, 2 short steps)."""
    cmd = [
        sys.executable, "-m", "lightning_v17.cli", "fit", "--config", "configs/tiny-cpu.yaml",
        "--trainer.strategy", "v17_zero3", "--trainer.devices", "1", "--trainer.max_steps", "2",
        "--trainer.logger", "false", "--trainer.callbacks", "[]", "--trainer.default_root_dir", str(tmp_path),
        "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "1",
        "--data.seq_len", "64", "--data.batch_size", "2",
    ]  # fmt: skip
    out = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert "`Trainer.fit` stopped: `max_steps=2` reached." in out.stdout + out.stderr
