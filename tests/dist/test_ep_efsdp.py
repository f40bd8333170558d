"""ZeRO over the experts: ``V17Strategy(ep=2, zero_stage=1|2|3)`` on 4 gloo ranks (dp_shard = 4 = efsdp 2 x ep 2), the
MoE LlamaLM (``tiny-moe``, 2 blocks, the second a MoE block with 4 experts), against one process on the concatenated
batch, 5 steps:

* the optimizer of each rank steps a quarter of every routed-expert weight: its ep rank's 2 experts (``Shard(0)``
  over ``ep``) split again over the 2 ranks that hold the same experts (``efsdp``); at ZeRO-3 that quarter is all
  the rank stores of them, at ZeRO-1/2 the weights stay whole per ep rank;
* plain SGD (a gradient off by a constant factor moves the weights: FSDP2 alone would divide the experts' summed
  gradient by efsdp = 2, not by dp = 4, and so would a ZeRO-1/2 partition over efsdp) and AdamW with gradient clipping that clips at every step: losses, every
  step's unclipped global gradient norm (from the gathered gradients, not at ZeRO-2, which keeps none whole, and as
  the strategy's clipping computed it over the dense and the expert meshes or partitions) and every final parameter within 1e-5 of one process;
* the balance losses and the aux-loss-free expert bias ride along; the bias equals one process's bit for bit;
* the front door with the optimizer state offloaded: ``V17Strategy(ep=2, zero_stage=2,
  offload=OffloadPolicy(optimizer="nvme"))`` with AdamW and clipping, the same checks.
"""

from __future__ import annotations

import pytest
import torch

from tests._adamw_parity import assert_params_close, reference_with_amplification
from tests._dist import spawn
from tests._strategy import MOE_CLIP, MOE_OPTIMIZERS, fit_moe

#: the compositions this file checks against one process (docs/gen_layouts.py builds docs/layouts.md from them)
COMPOSES = (("ep", "zero1", "moe_balance"), ("ep", "zero2", "moe_balance"),
            ("ep", "zero3", "moe_balance"), ("ep", "offload_optimizer", "zero2", "moe_balance"))  # fmt: skip

TOL = 1e-5
OVERRIDES = {"layers": 2, "aux_loss_coef": 0.01, "z_loss_coef": 0.001, "expert_bias_rate": 0.01}
STAGES = (1, 2, 3)


def _worker(rank: int, world: int) -> dict:
    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    import tempfile

    from lightning_v17.strategies import V17Strategy

    from lightning_v17.config import OffloadPolicy

    out = {(stage, name): fit_moe(name, world, V17Strategy(ep=2, zero_stage=stage), overrides=OVERRIDES,
                                  dp_axis_stride=1, dp=4, perturb_odd=False)
           for stage in STAGES for name in MOE_OPTIMIZERS}  # fmt: skip
    offload = OffloadPolicy(optimizer="nvme", nvme_path=tempfile.mkdtemp(prefix="v17_ep_efsdp_"))
    out[(2, "adamw_clip", "nvme")] = fit_moe("adamw_clip", world, V17Strategy(ep=2, zero_stage=2, offload=offload),
                                             overrides=OVERRIDES, dp_axis_stride=1, dp=4, perturb_odd=False)
    return out


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
@pytest.mark.parametrize("stage", STAGES)
def test_ep2_zero_over_efsdp_matches_one_process(results, references, stage, opt_name) -> None:
    ref = references[opt_name]
    if MOE_OPTIMIZERS[opt_name] is not None:  # the clipping clips at every step
        assert min(ref["norms"]) > 2 * MOE_CLIP, ref["norms"]
    assert any(bool(b.abs().sum() > 0) for b in ref["biases"]), "the expert bias never moved"
    for rank, got in enumerate(results):
        got = got[(stage, opt_name)]
        stored = got["expert_storage"]
        assert sorted(stored) == ["layers.1.feed_forward.experts.down_proj",
                                  "layers.1.feed_forward.experts.gate_up_proj"], stored  # fmt: skip
        for name, (numel, dims) in stored.items():
            if stage == 3:  # the weights themselves split over efsdp
                assert dims == ("efsdp", "ep") and numel * 4 == ref["params"][name].numel(), (rank, name, numel)
            else:  # whole experts per ep rank; the optimizer steps (and, at stage 2, keeps gradients of) its rows
                assert dims == ("ep",) and numel * 2 == ref["params"][name].numel(), (rank, name, numel)
        for name, numel in got["expert_stepped"].items():
            assert numel * 4 == ref["params"][name].numel(), (stage, rank, name, numel)
        assert sorted(got["expert_stepped"]) == sorted(stored)
        assert got["losses"] == pytest.approx(ref["losses"], rel=TOL, abs=TOL), (rank, got["losses"], ref["losses"])
        if stage != 2:  # ZeRO-2 keeps no whole gradient to take the norm of; its clipping's norm is checked
            assert got["norms"] == pytest.approx(ref["norms"], rel=TOL), (rank, got["norms"], ref["norms"])
        if MOE_OPTIMIZERS[opt_name] is not None:
            assert got["clip_norms"] == pytest.approx(ref["norms"], rel=TOL), (rank, got["clip_norms"])
        assert got["params"].keys() == ref["params"].keys()
        assert_params_close(got["params"], ref, tol=TOL, msg=f"rank {rank}")  # AdamW: tests/_adamw_parity.py
        for b, want in zip(got["biases"], ref["biases"]):
            assert torch.equal(b, want), (rank, b, want)


@pytest.mark.parametrize("stage", STAGES)
def test_expert_bytes_from_storage_match_the_planner(results, references, stage) -> None:
    """What each rank stores of the experts (fp32 weights, AdamW's two fp32 moments), counted from tensor storage,
    equals the planner's ``expert_state_bytes_per_rank`` at ep=2 over dp_shard=4 (efsdp = 2)."""
    from lightning_v17.config import ZeroPolicy
    from lightning_v17.planner.moe import expert_state_bytes_per_rank

    experts = sum(p.numel() for n, p in references["adamw_clip"]["params"].items() if ".experts." in n)
    plan = expert_state_bytes_per_rank(experts, zero=ZeroPolicy(stage=stage), ep=2, dp_shard=4, param_bytes=4,
                                       grad_bytes=4, optimizer_bytes=8)  # fmt: skip
    # by hand: ep=2 halves everything; efsdp=2 halves the optimizer state at every stage, the weights at stage 3
    assert plan.optimizer == experts * 8 // 4 and plan.param == experts * 4 // (4 if stage == 3 else 2)
    for rank, got in enumerate(results):
        got = got[(stage, "adamw_clip")]
        assert (got["expert_param_bytes"], got["expert_optimizer_bytes"]) == (plan.param, plan.optimizer), rank


def test_ep2_zero2_with_the_optimizer_state_on_nvme_matches_one_process(results, references) -> None:
    ref = references["adamw_clip"]
    for rank, got in enumerate(results):
        got = got[(2, "adamw_clip", "nvme")]
        assert got["optimizer_offloaded"] == [True] * len(ref["losses"]), got["optimizer_offloaded"]
        assert not any(results[rank][(2, "adamw_clip")]["optimizer_offloaded"])
        assert got["losses"] == pytest.approx(ref["losses"], rel=TOL, abs=TOL), (rank, got["losses"], ref["losses"])
        assert got["clip_norms"] == pytest.approx(ref["norms"], rel=TOL), (rank, got["clip_norms"])
        assert got["params"].keys() == ref["params"].keys()
        assert_params_close(got["params"], ref, tol=TOL, msg=f"rank {rank}")  # AdamW: tests/_adamw_parity.py
        for b, want in zip(got["biases"], ref["biases"]):
            assert torch.equal(b, want), (rank, b, want)
