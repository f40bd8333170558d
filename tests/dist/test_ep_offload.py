"""Expert parallelism with parameter offload: ``V17Strategy(ep=2, zero_stage=3, offload=OffloadPolicy(params=...))``
on 2 gloo ranks (dp_shard = 2 = ep, so efsdp = 1: no other rank holds a rank's experts), the MoE LlamaLM
(``tiny-moe``, 2 blocks: a dense block, then a MoE block), against one process on the concatenated batch, 5 steps,
with ``params='cpu'`` (FSDP2's ``CPUOffloadPolicy``) and ``params='nvme'`` (``engine/offload/params.py``, files under
``tmp_path``).

At ZeRO-3 with parameter offload the experts are an FSDP2 unit of their own even at efsdp = 1 (over the one-rank
``efsdp`` axis, ``lightning_v17/mesh.py`` ``expert_shard_mesh(offloaded=True)``), so the tier moves their shards like
every other unit's; FSDP2 then divides their gradients by dp (the all-to-all already summed the ep ranks' tokens).

* plain SGD and AdamW with gradient clipping that clips at every step (the reference asserts its unclipped norm
  exceeds ``MOE_CLIP``): losses, the unclipped norm and the clipping's norm of every step, and every final parameter
  within 1e-5 of one process; the balance losses and the aux-loss-free expert bias ride along;
* the experts really are on the tier: with 'cpu' their FSDP2 unit carries FSDP2's ``CPUOffloadPolicy``; with 'nvme'
  the offload holds a record for each expert weight, after every step their shards are out of memory (a
  ``ReleasedShard`` storage of 0 bytes) and the rank's files hold their bytes.

One spawn of 2 ranks runs the 4 cases; the references run in the test process.
"""

from __future__ import annotations

import pytest
import torch

from tests._adamw_parity import assert_params_close, reference_with_amplification
from tests._dist import spawn
from tests._strategy import MOE_CLIP, MOE_OPTIMIZERS, fit_moe

#: the compositions this file checks against one process (docs/gen_layouts.py builds docs/layouts.md from them)
COMPOSES = (("ep", "offload_params", "zero3", "moe_balance"),)

TOL = 1e-5
OVERRIDES = {"layers": 2, "aux_loss_coef": 0.01, "z_loss_coef": 0.001, "expert_bias_rate": 0.01}
TIERS = ("cpu", "nvme")


def _watch_tier(seen: list) -> None:
    """After every step, what the offload tier holds of the experts (appended to ``seen``)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

    from lightning_v17.models import LlamaLM

    base = LlamaLM.on_train_batch_end

    def after_step(self, outputs, batch, batch_idx) -> None:
        base(self, outputs, batch, batch_idx)
        units = [m for n, m in self.model.named_modules() if n.endswith("feed_forward.experts")]
        po = self.trainer.strategy.zero.param_offload
        state = {"cpu_policy": all(isinstance(m, FSDPModule) and isinstance(
            m._get_fsdp_state()._fsdp_param_group.offload_policy, CPUOffloadPolicy) for m in units)}  # fmt: skip
        if po is not None and not po.closed:
            po.flush()  # the step's write-backs complete
            experts = [r for r in po.recs if ".experts." in (r.fp._param_fqn or "")]
            state |= {"nvme_experts": sorted(r.fp._param_fqn for r in experts),
                      "resident": [r.resident for r in experts], "expert_bytes": sum(r.nbytes for r in experts),
                      "disk_bytes": po.disk_bytes()}  # fmt: skip
        seen.append(state)

    LlamaLM.on_train_batch_end = after_step


def _worker(rank: int, world: int, tmp: str) -> dict:
    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    from lightning_v17.strategies import V17Strategy

    from lightning_v17.config import OffloadPolicy

    seen: list = []
    _watch_tier(seen)
    out = {}
    for tier in TIERS:
        for name in MOE_OPTIMIZERS:
            seen.clear()
            offload = OffloadPolicy(params=tier, nvme_path=tmp if tier == "nvme" else None)
            strategy = V17Strategy(ep=2, zero_stage=3, offload=offload)
            out[tier, name] = fit_moe(name, world, strategy, overrides=OVERRIDES, dp_axis_stride=1,
                                      perturb_odd=False) | {"tier": list(seen)}  # fmt: skip
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return spawn(_worker, world_size=2, args=(str(tmp_path_factory.mktemp("nvme")),), timeout=400,
                 init_process_group=False)  # fmt: skip


@pytest.fixture(scope="module")
def references() -> dict:
    import warnings

    warnings.filterwarnings("ignore")
    return {name: reference_with_amplification(lambda name=name: fit_moe(name, 1, "auto", overrides=OVERRIDES))
            for name in MOE_OPTIMIZERS}  # fmt: skip


@pytest.mark.timeout(500)
@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("opt_name", list(MOE_OPTIMIZERS))
def test_ep2_param_offload_matches_one_process(results, references, tier, opt_name) -> None:
    ref = references[opt_name]
    if MOE_OPTIMIZERS[opt_name] is not None:  # the clipping clips at every step
        assert min(ref["norms"]) > 2 * MOE_CLIP, ref["norms"]
    for rank, got in enumerate(results):
        got = got[tier, opt_name]
        assert got["losses"] == pytest.approx(ref["losses"], rel=TOL, abs=TOL), (rank, got["losses"], ref["losses"])
        assert got["norms"] == pytest.approx(ref["norms"], rel=TOL), (rank, got["norms"], ref["norms"])
        if MOE_OPTIMIZERS[opt_name] is not None:
            assert got["clip_norms"] == pytest.approx(ref["norms"], rel=TOL), (rank, got["clip_norms"])
        assert got["params"].keys() == ref["params"].keys()
        assert_params_close(got["params"], ref, tol=TOL, msg=f"rank {rank}")  # AdamW: tests/_adamw_parity.py
        for b, want in zip(got["biases"], ref["biases"]):
            assert torch.equal(b, want), (rank, b, want)
        assert len(got["tier"]) == 5, got["tier"]
        for step in got["tier"]:
            if tier == "cpu":
                assert step["cpu_policy"], step
                continue
            assert step["nvme_experts"] == ["layers.1.feed_forward.experts.down_proj",
                                            "layers.1.feed_forward.experts.gate_up_proj"], step  # fmt: skip
            assert not any(step["resident"]), step  # out of memory between steps
            assert step["expert_bytes"] > 0 and step["disk_bytes"] >= step["expert_bytes"], step
