"""The planner's activation offload: what leaves the device, what stays, and whether the transfers hide.

Expected values are worked by hand from the model the docstrings state: L - k blocks leave, the device keeps the k
resident blocks plus one block in transit, each block moves at the slower link each way, and a transfer longer than
its block's forward (write) or backward (read) stretches the step by the difference.
"""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from lightning_v17.config import Tier, V17ConfigError
from lightning_v17.planner import offload as off
from lightning_v17.planner.cli import main
from lightning_v17.planner.model import get_preset
from lightning_v17.planner.plan import make_plan
from lightning_v17.planner.specs import ClusterSpec, ModelSpec, TrainSpec


def test_blocks_off_the_device_and_the_one_in_transit() -> None:
    assert off.activation_offload_bytes(100, layers=8, resident_blocks=1) == (700, 200)
    assert off.activation_offload_bytes(100, layers=8, resident_blocks=0) == (800, 100)
    assert off.activation_offload_bytes(100, layers=8, resident_blocks=3) == (500, 400)
    assert off.activation_offload_bytes(100, layers=8, resident_blocks=8) == (0, 800)  # nothing leaves
    assert off.activation_offload_bytes(100, layers=8, resident_blocks=20) == (0, 800)


def test_the_slower_link_sets_the_rate() -> None:
    assert off.activation_transfer_bytes_per_s("cpu", pcie_bytes_per_s=25e9, nvme_bytes_per_s=3e9) == 25e9
    assert off.activation_transfer_bytes_per_s("nvme", pcie_bytes_per_s=25e9, nvme_bytes_per_s=3e9) == 3e9
    assert off.activation_transfer_bytes_per_s("nvme", pcie_bytes_per_s=2e9, nvme_bytes_per_s=3e9) == 2e9
    with pytest.raises(ValueError, match="moves nothing"):
        off.activation_transfer_bytes_per_s("none", pcie_bytes_per_s=1, nvme_bytes_per_s=1)


def test_exposed_time_is_what_compute_does_not_cover() -> None:
    # 100 B at 10 B/s = 10 s each way; forward 4 s hides 4 of the write, backward 12 s hides the whole read;
    # 8 - 1 = 7 blocks x 2 micro-batches x (10 - 4) = 84 s
    a = off.activation_offload(tier="cpu", bytes_per_block=100, layers=8, resident_blocks=1, microbatches=2,
                               forward_s_per_block=4.0, backward_s_per_block=12.0, pcie_bytes_per_s=10.0,
                               nvme_bytes_per_s=1.0)  # fmt: skip
    assert (a.blocks_offloaded, a.offloaded_bytes, a.device_bytes) == (7, 700, 200)
    assert a.transfer_s_per_block == 10.0 and a.exposed_s_per_step == 84.0 and not a.hides
    # a backward of 7 s leaves 3 s of each read exposed too: 7 x 2 x (6 + 3) = 126 s
    b = off.activation_offload(tier="cpu", bytes_per_block=100, layers=8, resident_blocks=1, microbatches=2,
                               forward_s_per_block=4.0, backward_s_per_block=7.0, pcie_bytes_per_s=10.0,
                               nvme_bytes_per_s=1.0)  # fmt: skip
    assert b.exposed_s_per_step == 126.0
    hidden = off.activation_offload(tier="nvme", bytes_per_block=100, layers=8, resident_blocks=1, microbatches=2,
                                    forward_s_per_block=4.0, backward_s_per_block=12.0, pcie_bytes_per_s=1e3,
                                    nvme_bytes_per_s=50.0)  # fmt: skip
    assert hidden.transfer_s_per_block == 2.0 and hidden.exposed_s_per_step == 0.0 and hidden.hides


def _plan(tier: str = "none", *, resident: int = 1, pcie: float = 25.0, nvme: float = 3.0, pp: int | None = None):
    model = ModelSpec(shape=get_preset("llama3-8b", planner_only=True), name="llama3-8b")
    cluster = ClusterSpec(gpu="h100-80gb", gpus=8, pcie_gbps=pcie, nvme_gbps=nvme)
    train = TrainSpec(seq=8192, recompute="selective", offload_activations=tier, resident_blocks=resident, pp=pp,
                      zero=None)  # fmt: skip
    return make_plan(model, cluster, train)


def test_the_plan_moves_the_offloaded_blocks_to_their_tier() -> None:
    base, nvme = _plan(), _plan("nvme", resident=2)
    b = base.memory.activation_per_layer
    layers = base.model.shape.layers
    assert nvme.memory.activation_per_layer == b and nvme.memory.activation == base.memory.activation
    # L - 2 blocks leave; the device keeps 2 resident + 1 in transit, i.e. L - 3 blocks fewer than without offload
    assert nvme.memory.tiers.nvme == base.memory.tiers.nvme + (layers - 2) * b
    assert base.memory.tiers.gpu - nvme.memory.tiers.gpu == (layers - 3) * b
    assert nvme.memory.activation_offloaded == (layers - 2) * b
    cpu = _plan("cpu")
    assert cpu.memory.tiers.cpu == base.memory.tiers.cpu + (layers - 1) * b and cpu.memory.tiers.nvme == 0


def test_the_step_and_the_warnings_follow_the_hiding() -> None:
    base, slow, fast = _plan(), _plan("nvme"), _plan("nvme", pcie=1e6, nvme=1e6)
    assert fast.activation_offload.hides and fast.step_time_s == pytest.approx(base.step_time_s)
    assert not any("activation offload" in w for w in fast.warnings)
    a = slow.activation_offload
    # forward is a third of the model FLOPs: its share of one block's compute, the rest is backward (+ recompute)
    block_s = (a.forward_s_per_block + a.backward_s_per_block)
    ratio = slow.model_flops_per_step / 3 / slow.flops_per_step
    assert a.forward_s_per_block == pytest.approx(block_s * ratio)
    assert a.transfer_s_per_block == pytest.approx(a.bytes_per_block / 3e9)
    assert slow.step_time_s == pytest.approx(base.step_time_s + a.exposed_s_per_step)
    assert any("activation offload to nvme" in w and "resident_blocks" in w for w in slow.warnings)


def test_what_the_planner_cannot_count_is_refused() -> None:
    with pytest.raises(V17ConfigError, match="pp=2: the planner's offload formula counts one pass"):
        _plan("nvme", pp=2)
    with pytest.raises(V17ConfigError, match="resident_blocks"):
        TrainSpec(offload_activations=Tier.NVME, resident_blocks=-1)
    with pytest.raises(V17ConfigError, match="needs the model's shape"):
        make_plan(ModelSpec(params=10**9, name="x"), ClusterSpec(gpus=8), TrainSpec(offload_activations="cpu"))


def test_the_cli_reports_it() -> None:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        main(["--model", "llama3-8b", "--gpus", "8", "--seq", "8192", "--recompute", "selective",
              "--offload-activations", "nvme", "--resident-blocks", "2", "--json"])  # fmt: skip
    d = json.loads(buf.getvalue())
    assert d["layout"]["offload_activations"] == "nvme" and d["layout"]["resident_blocks"] == 2
    assert d["activation_offload"]["blocks_offloaded"] == 30 and d["tiers"]["nvme_bytes"] > 0
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        main(["--model", "llama3-8b", "--gpus", "8", "--seq", "8192", "--offload-activations", "cpu"])
    assert "act off : 31 of 32 blocks' activations to cpu" in buf.getvalue()
