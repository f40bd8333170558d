"""Expert parallelism inside pipeline stages: ``V17Strategy(pp=2, ep=2, zero_stage=1)`` on 4 gloo ranks (each stage
on a dp = 2 pair whose ep group dispatches its MoE tokens), the MoE LlamaLM (``tiny-moe``, 2 MoE blocks: one per
stage, 2 micro-batches per step) against one process on the concatenated batch, 5 steps:

* plain SGD and AdamW with gradient clipping that clips at every step: losses and every final parameter (each
  stage's, the ep-sharded experts gathered whole) within 1e-5 of one process;
* the unclipped global gradient norm of every step (the stages' gathered full gradients) and the norm the strategy's
  clipping computed equal one process's: each micro-batch's expert gradient accumulates unreduced and is divided by
  dp once, after the schedule (a division per micro-batch, or none, is off by a factor here);
* tp is absent here, dp rank 1 starts from other random weights and trains the same model;
* on 8 ranks, ``V17Strategy(pp=2, ep=2, zero_stage=1, pp_schedule="zb_h1")``: each stage on dp_shard = 4 ranks, so
  efsdp = 2 and ZeRO-1 partitions the experts over it (the expert engine), under a zero-bubble schedule, whose
  weight gradients are accumulated by hand (no gradient hook fires): the same checks.

The balance terms are off here; ``tests/dist/test_moe_pp_balance.py`` runs the same layout with the balance loss, the
z-loss and the expert bias on.
"""

from __future__ import annotations

import pytest
import torch

from tests._adamw_parity import assert_params_close, reference_with_amplification
from tests._dist import spawn
from tests._strategy import MOE_CLIP, MOE_OPTIMIZERS, fit_moe, v17

#: the compositions this file checks against one process (docs/gen_layouts.py builds docs/layouts.md from them)
COMPOSES = (("pp", "ep", "zero1"),)

TOL = 1e-5
OVERRIDES = {"layers": 2, "dense_layers": 0}
STRATEGY = {"pp": 2, "ep": 2, "zero_stage": 1, "microbatches": 2}
STRATEGY_8 = {**STRATEGY, "pp_schedule": "zb_h1"}


def _worker(rank: int, world: int, strategy: dict) -> dict:
    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    # ranks = pp x dp_shard (dp innermost): stage 0 on ranks 0 .. world/2 - 1, stage 1 on the others
    dp = world // 2
    return {name: fit_moe(name, world, v17(**strategy), overrides=OVERRIDES, dp_axis_stride=1, dp=dp,
                          stage_ranks=(0, dp)) for name in MOE_OPTIMIZERS}  # fmt: skip


@pytest.fixture(scope="module", params=[4, 8], ids=["pp2_dp2", "pp2_dp4_efsdp2_zb"])
def results(request) -> list[dict]:
    world = request.param
    return spawn(_worker, world_size=world, args=(STRATEGY if world == 4 else STRATEGY_8,), timeout=500,
                 init_process_group=False)  # fmt: skip


@pytest.fixture(scope="module")
def references() -> dict:
    import warnings

    warnings.filterwarnings("ignore")
    return {name: reference_with_amplification(lambda name=name: fit_moe(name, 1, "auto", overrides=OVERRIDES))
            for name in MOE_OPTIMIZERS}  # fmt: skip


@pytest.mark.timeout(500)
@pytest.mark.parametrize("opt_name", list(MOE_OPTIMIZERS))
def test_ep2_inside_pp2_matches_one_process(results, references, opt_name) -> None:
    ref = references[opt_name]
    if MOE_OPTIMIZERS[opt_name] is not None:
        assert min(ref["norms"]) > 2 * MOE_CLIP, ref["norms"]
    params: dict[str, torch.Tensor] = {}
    for rank, got in enumerate(results):
        got = got[opt_name]
        stage = rank // (len(results) // 2)
        assert got["experts"] == [f"layers.{stage}.feed_forward.experts.down_proj",
                                  f"layers.{stage}.feed_forward.experts.gate_up_proj"], (rank, got["experts"])
        if len(results) == 8:  # efsdp = 2: the optimizer steps half of the ep rank's half of each expert weight
            assert sorted(got["expert_stepped"]) == got["experts"], (rank, got["expert_stepped"])
            for name, numel in got["expert_stepped"].items():
                assert numel * 4 == ref["params"][name].numel(), (rank, name, numel)
        assert got["losses"] == pytest.approx(ref["losses"], rel=TOL, abs=TOL), (rank, got["losses"], ref["losses"])
        assert got["norms"] == pytest.approx(ref["norms"], rel=TOL), (rank, got["norms"], ref["norms"])
        if MOE_OPTIMIZERS[opt_name] is not None:
            assert got["clip_norms"] == pytest.approx(ref["norms"], rel=TOL), (rank, got["clip_norms"])
        assert_params_close(got["params"], ref, tol=TOL, msg=f"rank {rank}")  # AdamW: tests/_adamw_parity.py
        params.update(got["params"])
    assert params.keys() == ref["params"].keys()  # the two stages hold the whole model between them
