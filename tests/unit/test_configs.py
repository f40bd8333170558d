"""Every YAML file in configs/ parses through the real LightningCLI and instantiates its classes.

`--print_config` resolves class_path/init_args with jsonargparse, so a misspelled option, a wrong type or a class
that cannot be imported fails here instead of at launch.
"""

import contextlib
import io
from pathlib import Path

import pytest
import yaml

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


def test_there_are_configs():
    assert any(p.name == "tiny-cpu.yaml" for p in CONFIGS)


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_config_parses(path):
    from lightning_v17.trainer_cli import run_lightning_cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
        run_lightning_cli(["fit", "--config", str(path), "--print_config"])
    assert exit_info.value.code == 0
    resolved = yaml.safe_load(out.getvalue())
    raw = yaml.safe_load(path.read_text())
    # what the file says survives resolution (nothing silently dropped or renamed)
    assert resolved["trainer"]["strategy"]["class_path"] == raw["trainer"]["strategy"]["class_path"]
    got = [c["class_path"] for c in resolved["trainer"].get("callbacks") or []]
    assert got == [c["class_path"] for c in raw["trainer"].get("callbacks") or []]
