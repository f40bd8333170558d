"""Expert parallelism beside context parallelism: ``V17Strategy(ep=2, cp=2, zero_stage=1)`` on 4 gloo ranks (dp_shard
= 2 = ep, each row's 16 tokens split over 2 cp ranks in the head-tail layout), the MoE LlamaLM (``tiny-moe``, 2
blocks: a dense block, then a MoE block), against one process on the concatenated batch, 5 steps.

Each cp rank routes its ``S / cp`` tokens and dispatches them over the ep group of its cp index; the experts are
held alike by the cp ranks of a row and their gradients are summed over ``edp`` = cp here (``lightning_v17/mesh.py``),
divided by dp x cp like the dense ones. The capacity's arrival order (``capacity_factor=1.0`` drops assignments)
and the sequence-wise balance loss use the whole rows' statistics, gathered over cp in the cp layout's token order
(``engine/ep/tokens.py``).

* plain SGD (a constant factor on any gradient moves the weights) and AdamW with gradient clipping that clips at
  every step (the reference asserts its unclipped norm exceeds ``MOE_CLIP``): losses and every final parameter within
  1e-5 of one process;
* the unclipped global gradient norm of every step (and the clipping's) equal to one process's;
* the balance losses (sequence-wise aux, z-loss) and the aux-loss-free expert bias ride along: the bias equals one
  process's bit for bit;
* the rows every rank's experts ran, summed over the 4 ranks, equal one process's (each token routed once).

Every row has all its 16 targets, so the cp ranks' target counts are equal (the cp loss scale is 1).
One spawn of 4 ranks runs both optimizers; the references run in the test process.
"""

from __future__ import annotations

import pytest
import torch

from tests._adamw_parity import assert_params_close, reference_with_amplification
from tests._dist import spawn
from tests._strategy import MOE_CLIP, MOE_OPTIMIZERS, fit_moe
from tests.dist.test_ep_tp_sp import _count_expert_rows

#: the compositions this file checks against one process (docs/gen_layouts.py builds docs/layouts.md from them)
COMPOSES = (("ep", "cp", "zero1", "moe_balance"),)

TOL = 1e-5
OVERRIDES = {"layers": 2, "aux_loss_coef": 0.01, "z_loss_coef": 0.001, "expert_bias_rate": 0.01,
             "capacity_factor": 1.0, "shared_experts": 1}  # fmt: skip


def _worker(rank: int, world: int) -> dict:
    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    from lightning_v17.strategies import V17Strategy

    rows = _count_expert_rows()
    out = {}
    for name in MOE_OPTIMIZERS:
        rows.clear()
        # mesh (dp_shard, cp): rank = 2 * dp_shard + cp, so the dp rank is RANK // 2 (fit_moe's dp_axis_stride)
        out[name] = fit_moe(name, world, V17Strategy(ep=2, cp=2, zero_stage=1), overrides=OVERRIDES)
        out[name]["expert_rows"] = sum(rows)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return spawn(_worker, world_size=4, timeout=400, init_process_group=False)


@pytest.fixture(scope="module")
def references() -> dict:
    import warnings

    warnings.filterwarnings("ignore")
    rows = _count_expert_rows()
    out = {}
    for name in MOE_OPTIMIZERS:
        rows.clear()
        out[name] = reference_with_amplification(lambda name=name: fit_moe(name, 1, "auto", overrides=OVERRIDES))
        out[name]["expert_rows"] = sum(rows)
    return out


@pytest.mark.timeout(500)
@pytest.mark.parametrize("opt_name", list(MOE_OPTIMIZERS))
def test_ep2_cp2_matches_one_process(results, references, opt_name) -> None:
    ref = references[opt_name]
    if MOE_OPTIMIZERS[opt_name] is not None:  # the clipping clips at every step
        assert min(ref["norms"]) > 2 * MOE_CLIP, ref["norms"]
    assert any(bool(b.abs().sum() > 0) for b in ref["biases"]), "the expert bias never moved"
    assert sum(r[opt_name]["expert_rows"] for r in results) == ref["expert_rows"], (
        [r[opt_name]["expert_rows"] for r in results], ref["expert_rows"])  # fmt: skip
    for rank, got in enumerate(results):
        got = got[opt_name]
        assert got["experts"] == ["layers.1.feed_forward.experts.down_proj",
                                  "layers.1.feed_forward.experts.gate_up_proj"], got["experts"]  # fmt: skip
        assert got["losses"] == pytest.approx(ref["losses"], rel=TOL, abs=TOL), (rank, got["losses"], ref["losses"])
        assert got["norms"] == pytest.approx(ref["norms"], rel=TOL), (rank, got["norms"], ref["norms"])
        if MOE_OPTIMIZERS[opt_name] is not None:
            assert got["clip_norms"] == pytest.approx(ref["norms"], rel=TOL), (rank, got["clip_norms"])
        assert got["params"].keys() == ref["params"].keys()
        assert_params_close(got["params"], ref, tol=TOL, msg=f"rank {rank}")  # AdamW: tests/_adamw_parity.py
        for b, want in zip(got["biases"], ref["biases"]):
            assert torch.equal(b, want), (rank, b, want)
