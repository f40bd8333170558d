"""``v17 plan --plot PATH``: a real PNG (memory buckets per tier, traffic per collective), matplotlib optional."""

from __future__ import annotations

import json
import sys

import pytest

from lightning_v17.planner.cli import build_parser, main, specs_from_args
from lightning_v17.planner.plan import make_plan
from lightning_v17.planner.plot import MISSING_MATPLOTLIB, bucket_tier_bytes

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_plot_writes_a_non_trivial_png_and_keeps_the_ascii_report(capsys, tmp_path):
    import matplotlib.image

    path = tmp_path / "sub" / "p.png"
    assert main(["--model", "llama3-70b", "--gpus", "512", "--plot", str(path)]) == 0
    captured = capsys.readouterr()
    assert "per-rank memory" in captured.out and "█" in captured.out  # the ASCII report is still the output
    assert captured.err.strip() == f"v17 plan: wrote {path}"
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) > 10_000, len(data)
    image = matplotlib.image.imread(path)  # H x W x 4 floats
    assert image.ndim == 3 and image.shape[0] > 300 and image.shape[1] > 600
    assert (image != image[0, 0]).any(axis=-1).mean() > 0.02  # not one colour: bars and text cover the canvas
    colours = {tuple(px) for px in image[::7, ::7, :3].reshape(-1, 3).round(2).tolist()}
    assert len(colours) > 10


def test_plot_with_json_keeps_stdout_one_json_object(capsys, tmp_path):
    path = tmp_path / "p.png"
    assert main(["--model", "llama2-7b", "--gpus", "8", "--zero-stage", "3", "--offload-optimizer", "cpu",
                 "--offload-params", "nvme", "--json", "--plot", str(path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tiers"]["nvme_bytes"] > 0 and path.read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize(
    "argv",
    [
        ["--model", "llama3-70b", "--gpus", "512"],
        ["--model", "llama2-7b", "--gpus", "8", "--zero-stage", "3", "--offload-optimizer", "cpu", "--offload-params",
         "nvme"],
        ["--model", "llama2-7b", "--gpus", "8", "--zero-stage", "2", "--offload-optimizer", "nvme"],
        ["--params", "7.5e9", "--dp", "64", "--zero-stage", "3", "--offload-params", "cpu"],
    ],
)
def test_buckets_per_tier_add_up_to_the_plan(argv):
    plan = make_plan(*specs_from_args(build_parser().parse_args(argv)))
    placed = bucket_tier_bytes(plan)
    m = plan.memory
    assert {name: sum(t.values()) for name, t in placed.items()} == {
        "params": m.param, "grads": m.grad, "optimizer": m.optimizer, "activations": m.activation, "buffers": m.temp}
    for tier in ("gpu", "cpu", "nvme"):
        assert sum(t[tier] for t in placed.values()) == getattr(m.tiers, tier)
    assert all(v >= 0 for t in placed.values() for v in t.values())


def test_missing_matplotlib_is_one_line_naming_the_extra(capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    path = tmp_path / "p.png"
    assert main(["--model", "tiny", "--plot", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"v17 plan: error: {MISSING_MATPLOTLIB}\n"
    assert "pip install 'lightning-v17[plot]'" in captured.err and not path.exists()
