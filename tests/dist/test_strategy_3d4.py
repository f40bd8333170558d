"""V17Strategy with two parallel axes at once, inside a Lightning Trainer on 4 gloo ranks: tp=2 x dp=2 (ZeRO-3,
FSDP2 over dp plus TP), pp=2 x dp=2 (ZeRO-1) and pp=2 x tp=2; and with three axes on 8 ranks (2 cores are enough
for the tiny model): pp=2 x dp=2 x tp=2 (ZeRO-1) and HSDP x TP (dp_replicate=2 x dp_shard=2 x tp=2, ZeRO-3); all
with global-norm clipping, against a 1-process
Lightning run of the same LlamaLM, data order and seed (``test_strategy_tp_pp._fit``; the engine-level 4-rank cases
are in ``test_pp_3d.py``).

Every rank reads the same 4-row batches (no distributed sampler), so the mean gradient over the 2 dp ranks equals
the 1-process gradient. SGD, and a clipping threshold ``CLIP`` between the steps' gradient norms: step 0 clips
(norm ~1.25 x CLIP), so a norm taken over one axis or shard only changes its clipping factor; step 1 does not clip
(norm ~0.74 x CLIP), so a gradient off by a uniform factor (a dp reduction that sums instead of averaging, a shard
stepped twice) changes its update. (Clipping at every step would hide a uniform factor: clipping to a norm is
invariant to the gradient's scale.) The 1-process reference asserts both conditions. Tolerance: 1e-5 relative (fp32).
"""

from __future__ import annotations

import pytest
import torch

from tests._dist import spawn
from tests.dist.test_strategy_tp_pp import STEPS, _fit

#: the compositions this file checks against one process (docs/gen_layouts.py builds docs/layouts.md from them)
COMPOSES = (("tp", "zero3"), ("pp", "zero1"), ("pp", "tp"), ("pp", "tp", "zero1"),
            ("dp_replicate", "tp", "zero3"))  # fmt: skip

CLIP = 11.0  # 1-process pre-clip norms at this threshold: 13.7 (clips), 8.1 (does not), 5.7 (its update is unseen)

CASES4 = {
    "tp2_dp2_zero3": {"tp": 2, "dp_shard": 2, "zero_stage": 3},
    "pp2_dp2_zero1": {"pp": 2, "dp_shard": 2, "zero_stage": 1, "microbatches": 2},
    "pp2_tp2_zero1": {"pp": 2, "tp": 2, "zero_stage": 1, "microbatches": 2},
}


CASES8 = {
    "pp2_dp2_tp2_zero1": {"pp": 2, "dp_shard": 2, "tp": 2, "zero_stage": 1, "microbatches": 2},
    "hsdp2x2_tp2_zero3": {"dp_replicate": 2, "dp_shard": 2, "tp": 2, "zero_stage": 3},
}


def _worker(rank: int, world_size: int) -> dict:
    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    from tests._strategy import v17  # the cases are flat option dicts

    out = {}
    for name, kw in (CASES4 if world_size == 4 else CASES8).items():
        strategy = v17(**kw)
        out[name] = _fit(strategy, world_size, clip=CLIP)
        out[name + "_mesh"] = repr(strategy.mesh.spec)  # the axes the run really had
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return spawn(_worker, world_size=4, timeout=400, init_process_group=False)


@pytest.fixture(scope="module")
def results8() -> list[dict]:
    return spawn(_worker, world_size=8, timeout=600, init_process_group=False)


@pytest.fixture(scope="module")
def reference() -> list[float]:
    import warnings

    warnings.filterwarnings("ignore")
    norms: list[float] = []
    losses = _fit("auto", 1, norms, clip=CLIP)
    # the losses see the updates of steps 0 and 1: step 0 must clip and step 1 must not, each with a margin
    assert len(norms) == STEPS and norms[0] > 1.2 * CLIP and norms[1] < CLIP / 1.2, norms
    return losses


@pytest.mark.timeout(500)
@pytest.mark.parametrize("name", list(CASES4))
def test_two_axes_in_a_trainer_match_single_process(results: list[dict], reference: list[float], name: str) -> None:
    assert len(reference) == STEPS
    for res in results:
        assert res[name] == pytest.approx(reference, rel=1e-5), (name, res[name], reference)


@pytest.mark.timeout(700)
@pytest.mark.parametrize("name", list(CASES8))
def test_three_axes_on_8_ranks_match_single_process(results8: list[dict], reference: list[float], name: str) -> None:
    assert len(reference) == STEPS and len(results8) == 8
    for res in results8:
        spec = res[name + "_mesh"]
        assert all(f"{axis}={size}" in spec for axis, size in CASES8[name].items() if axis != "zero_stage" and
                   axis != "microbatches"), spec  # fmt: skip
        assert res[name] == pytest.approx(reference, rel=1e-5), (name, res[name], reference, spec)
