"""Expert parallelism beside tensor parallelism: ``V17Strategy(ep=2, tp=2, zero_stage=1)`` on 4 gloo ranks (dp = 2,
the ep group folded out of it), the MoE LlamaLM (``tiny-moe``, 2 blocks: a dense block whose attention and MLP are
tp-sharded, then a MoE block whose attention is tp-sharded and whose router and experts are not), against one process
on the concatenated batch, 5 steps:

* plain SGD (a constant factor on any gradient moves the weights) and AdamW with gradient clipping that clips at
  every step (the reference asserts its unclipped norm exceeds ``MOE_CLIP``): losses and every final parameter (the tp
  DTensors and the ep-sharded experts gathered to full tensors) within 1e-5 of one process;
* the unclipped global gradient norm of every step, from the gathered full gradients and as the strategy's clipping
  computed it, equal to one process's: an expert gradient counted on both tp ranks (summed over tp, or its norm
  added once per tp rank) is off by sqrt(2) here;
* tp rank 1 starts from other random weights than tp rank 0, and trains the same model: the strategy broadcasts the
  replicated parameters and the experts over tp before the first step;
* the balance losses (sequence-wise aux and z-loss) and the aux-loss-free expert bias ride along: the bias, updated
  from the load summed over the dp ranks, equals one process's bit for bit.

One spawn of 4 ranks runs both optimizers; the references run in the test process.
"""

from __future__ import annotations

import pytest
import torch

from tests._adamw_parity import assert_params_close, reference_with_amplification
from tests._dist import spawn
from tests._strategy import MOE_CLIP, MOE_OPTIMIZERS, fit_moe

#: the compositions this file checks against one process (docs/gen_layouts.py builds docs/layouts.md from them)
COMPOSES = (("ep", "tp", "zero1", "moe_balance"),)

TOL = 1e-5
OVERRIDES = {"layers": 2, "aux_loss_coef": 0.01, "z_loss_coef": 0.001, "expert_bias_rate": 0.01}


def _worker(rank: int, world: int) -> dict:
    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    from lightning_v17.strategies import V17Strategy

    return {name: fit_moe(name, world, V17Strategy(ep=2, tp=2, zero_stage=1), overrides=OVERRIDES)
            for name in MOE_OPTIMIZERS}  # fmt: skip


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return spawn(_worker, world_size=4, timeout=400, init_process_group=False)


@pytest.fixture(scope="module")
def references() -> dict:
    import warnings

    warnings.filterwarnings("ignore")
    return {name: reference_with_amplification(lambda name=name: fit_moe(name, 1, "auto", overrides=OVERRIDES))
            for name in MOE_OPTIMIZERS}  # fmt: skip


@pytest.mark.timeout(500)
@pytest.mark.parametrize("opt_name", list(MOE_OPTIMIZERS))
def test_ep2_tp2_matches_one_process(results, references, opt_name) -> None:
    ref = references[opt_name]
    if MOE_OPTIMIZERS[opt_name] is not None:  # the clipping clips at every step
        assert min(ref["norms"]) > 2 * MOE_CLIP, ref["norms"]
    assert any(bool(b.abs().sum() > 0) for b in ref["biases"]), "the expert bias never moved"
    for rank, got in enumerate(results):
        got = got[opt_name]
        # what was sharded: the MoE block's experts over ep, attention (both blocks) and the dense MLP over tp
        assert got["experts"] == ["layers.1.feed_forward.experts.down_proj",
                                  "layers.1.feed_forward.experts.gate_up_proj"], got["experts"]  # fmt: skip
        assert "layers.1.attention.wq.weight" in got["tp_sharded"], got["tp_sharded"]
        assert "layers.0.feed_forward.w1.weight" in got["tp_sharded"], got["tp_sharded"]
        assert not any("router" in n for n in got["tp_sharded"]), got["tp_sharded"]
        assert got["losses"] == pytest.approx(ref["losses"], rel=TOL, abs=TOL), (rank, got["losses"], ref["losses"])
        assert got["norms"] == pytest.approx(ref["norms"], rel=TOL), (rank, got["norms"], ref["norms"])
        if MOE_OPTIMIZERS[opt_name] is not None:
            assert got["clip_norms"] == pytest.approx(ref["norms"], rel=TOL), (rank, got["clip_norms"])
        assert got["params"].keys() == ref["params"].keys()
        assert_params_close(got["params"], ref, tol=TOL, msg=f"rank {rank}")  # AdamW: tests/_adamw_parity.py
        for b, want in zip(got["biases"], ref["biases"]):
            assert torch.equal(b, want), (rank, b, want)
