"""V17Strategy with two parallel axes at once, inside a Lightning Trainer on 4 gloo ranks: tp=2 x dp=2 (ZeRO-3,
FSDP2 over dp plus TP), pp=2 x dp=2 (ZeRO-1) and pp=2 x tp=2, with global-norm clipping active, against the same
1-process run as ``test_strategy_tp_pp.py`` (the engine-level 4-rank cases are in ``test_pp_3d.py``).

Every rank reads the same 4-row batches (no distributed sampler), so the mean gradient over the 2 dp ranks equals
the 1-process gradient: a reduction that sums instead of averaging, a shard stepped twice or a norm taken over one
axis only changes the trajectory. SGD with clipping at every step, as there. Tolerance: 1e-5 relative (fp32).
"""

from __future__ import annotations

import pytest
import torch

from tests._dist import spawn
from tests.dist.test_strategy_tp_pp import _fit, reference  # noqa: F401 - reference: the shared 1-process fixture

CASES4 = {
    "tp2_dp2_zero3": {"tp": 2, "dp_shard": 2, "zero_stage": 3},
    "pp2_dp2_zero1": {"pp": 2, "dp_shard": 2, "zero_stage": 1, "microbatches": 2},
    "pp2_tp2_zero1": {"pp": 2, "tp": 2, "zero_stage": 1, "microbatches": 2},
}


def _worker(rank: int, world_size: int) -> dict:
    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    from lightning_v17.strategies import V17Strategy

    return {name: _fit(V17Strategy(**kw), 4) for name, kw in CASES4.items()}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return spawn(_worker, world_size=4, timeout=400, init_process_group=False)


@pytest.mark.timeout(500)
@pytest.mark.parametrize("name", list(CASES4))
def test_two_axes_in_a_trainer_match_single_process(
    results: list[dict],
    reference: list[float],  # noqa: F811 - the fixture imported above
    name: str,
) -> None:
    for res in results:
        assert res[name] == pytest.approx(reference, rel=1e-5), (name, res[name], reference)
