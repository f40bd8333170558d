"""Expert parallelism beside tensor parallelism with sequence parallelism: ``V17Strategy(ep=2, tp=TPPolicy(size=2,
sequence_parallel=True), zero_stage=1)`` on 4 gloo ranks (dp = 2, the ep group folded out of it), the MoE LlamaLM
(``tiny-moe``, 2 blocks: a dense block, then a MoE block), against one process on the concatenated batch, 5 steps.

Under SP the MoE block's input stays sequence-sharded: each tp rank routes and dispatches its own ``S / tp`` tokens
(``engine/ep/tokens.py``), the capacity's arrival order and the sequence-wise balance loss use the whole sequences'
statistics (gathered over tp as integers, never the activations), and the router's, the shared and the routed
experts' gradients are summed over tp.

* plain SGD (a constant factor on any gradient moves the weights) and AdamW with gradient clipping that clips at
  every step (the reference asserts its unclipped norm exceeds ``MOE_CLIP``): losses and every final parameter within
  1e-5 of one process;
* the unclipped global gradient norm of every step equal to one process's (an expert gradient not summed over tp is
  half of it; one summed twice, double);
* the balance losses (sequence-wise aux, z-loss, with a capacity factor that drops assignments) and the
  aux-loss-free expert bias ride along: the bias equals one process's bit for bit;
* no expert work is repeated: the rows every rank's experts ran, summed over the 4 ranks, equal one process's rows
  (without SP each tp rank runs its dp rank's whole batch: twice as many).

One spawn of 4 ranks runs both optimizers; the references run in the test process.
"""

from __future__ import annotations

import pytest
import torch

from tests._adamw_parity import assert_params_close, reference_with_amplification
from tests._dist import spawn
from tests._strategy import MOE_CLIP, MOE_OPTIMIZERS, fit_moe

#: the compositions this file checks against one process (docs/gen_layouts.py builds docs/layouts.md from them)
COMPOSES = (("ep", "sp", "zero1", "moe_balance"),)
#: the published layouts this file runs in miniature, name -> the miniature (optional)
PUBLISHED = {"Megatron-Core MoE EP x TP+SP": "ep2 x tp2+SP at ZeRO-1, the balance terms on"}

TOL = 1e-5
# capacity 1.0: ceil(16 * 2 / 4) = 8 assignments per sequence and expert, so some are dropped at random init
OVERRIDES = {"layers": 2, "aux_loss_coef": 0.01, "z_loss_coef": 0.001, "expert_bias_rate": 0.01,
             "capacity_factor": 1.0, "shared_experts": 1}  # fmt: skip


def _count_expert_rows() -> list[int]:
    """Count the rows the routed experts run (forward only), appended to the returned list."""
    from lightning_v17.models.moe import GroupedExperts

    rows: list[int] = []
    forward = GroupedExperts.forward

    def counted(self, x, counts, weight_fn=None):
        if torch.is_grad_enabled():
            rows.append(int(x.shape[0]))
        return forward(self, x, counts, weight_fn)

    GroupedExperts.forward = counted
    return rows


def _worker(rank: int, world: int) -> dict:
    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    from lightning_v17.strategies import V17Strategy

    from lightning_v17.config import TPPolicy

    rows = _count_expert_rows()
    out = {}
    for name in MOE_OPTIMIZERS:
        rows.clear()
        strategy = V17Strategy(ep=2, tp=TPPolicy(size=2, sequence_parallel=True), zero_stage=1)
        out[name] = fit_moe(name, world, strategy, overrides=OVERRIDES) | {"expert_rows": sum(rows)}
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
def test_ep2_tp2_sp_matches_one_process(results, references, opt_name) -> None:
    ref = references[opt_name]
    if MOE_OPTIMIZERS[opt_name] is not None:  # the clipping clips at every step
        assert min(ref["norms"]) > 2 * MOE_CLIP, ref["norms"]
    assert any(bool(b.abs().sum() > 0) for b in ref["biases"]), "the expert bias never moved"
    # each of the 4 ranks ran a quarter of one process's expert rows: no repeated expert work over tp
    assert sum(r[opt_name]["expert_rows"] for r in results) == ref["expert_rows"], (
        [r[opt_name]["expert_rows"] for r in results], ref["expert_rows"])  # fmt: skip
    for rank, got in enumerate(results):
        got = got[opt_name]
        assert got["experts"] == ["layers.1.feed_forward.experts.down_proj",
                                  "layers.1.feed_forward.experts.gate_up_proj"], got["experts"]  # fmt: skip
        assert "layers.1.attention.wq.weight" in got["tp_sharded"], got["tp_sharded"]
        assert got["losses"] == pytest.approx(ref["losses"], rel=TOL, abs=TOL), (rank, got["losses"], ref["losses"])
        assert got["norms"] == pytest.approx(ref["norms"], rel=TOL), (rank, got["norms"], ref["norms"])
        if MOE_OPTIMIZERS[opt_name] is not None:
            assert got["clip_norms"] == pytest.approx(ref["norms"], rel=TOL), (rank, got["clip_norms"])
        assert got["params"].keys() == ref["params"].keys()
        assert_params_close(got["params"], ref, tol=TOL, msg=f"rank {rank}")  # AdamW: tests/_adamw_parity.py
        for b, want in zip(got["biases"], ref["biases"]):
            assert torch.equal(b, want), (rank, b, want)
