"""Activation offload inside pipeline stages: ``V17Strategy(pp=2, offload=OffloadPolicy(activations="nvme"))`` on 4
gloo ranks (pp2 x dp2) under a real Trainer, against one process.

The tiny LlamaLM with 4 blocks on the fixed rows of ``tests/dist/test_pp_zero23.py`` (every row full, so the dp
ranks' token means average to one process's), 2 micro-batches a step. The schedules run several micro-batches'
forwards before their backwards, so the offload keeps one pass per micro-batch (``ActivationOffload.micro_batch``,
entered by the pipeline runtime around each stage forward) and each backward reads its own micro-batch's blocks.
One spawn trains every case, 5 steps each, with the blocks' saved tensors of 4 KiB or more written to files under
the test's tmp dir:

* 1F1B, 2 blocks per stage (the second resident), ZeRO-1: plain SGD (no clipping) and AdamW clipped at ``CLIP``;
* interleaved 1F1B (2 stages of 1 block per rank: block 0 and 2 on the first rank), ZeRO-1, SGD: a micro-batch's
  blocks on one rank run with other micro-batches' between them, so only a pass per micro-batch links block 2's
  backward to the read-ahead of the same micro-batch's block 0;
* 1F1B with ZeRO-3 and selective recompute (the recompute cache's outputs go to the files), SGD.

Asserted, per rank: every step's loss, the whole model's pre-clip gradient norm and every parameter of the rank's
stages within 1e-5 of one process (fp32); bytes really went to the tier at every step (the offload's byte and
tensor counters grow each step) and came back (reads); with the last block resident (1F1B) or one block per stage
(interleaved), every read after the first step was issued ahead, none on demand; the offload's folder is gone after
fit. The ``"cpu"`` tier serves blocks on a CUDA device only (on a CPU-only machine it would move host memory to host
memory and is refused at setup with that reason), so only the nvme tier runs here.
"""

from __future__ import annotations

import pytest

from tests._dist import spawn
from tests._strategy import STEPS
from tests.dist.test_pp_zero23 import CLIP, OPTS, _fit

#: the compositions this file checks against one process (docs/gen_layouts.py builds docs/layouts.md from them)
COMPOSES = (("pp", "offload_activations", "zero1"), ("pp", "offload_activations", "zero3", "recompute"))

TOL = 1e-5
LAYERS = 4
#: plain SGD's step size: at 0.5 (tests/dist/test_pp_zero23.py's, on 2 blocks) the 4-block model's gradient norm
#: falls from 14 to 1.3 in 5 steps, and fp32 rounding alone moves one process's step-3 norm by 4e-5 (1.2e-5
#: relative) between ATEN_CPU_CAPABILITY=avx2 and =default; at 0.05 by 2e-6 relative, while a gradient off by a
#: factor still moves the weights and every later norm
SGD_LR = 0.05
OFFLOAD = {"activations": "nvme", "activation_min_kb": 4, "resident_blocks": 1}
CASES = {  # name -> (optimizers, V17Strategy kwargs); nvme_path is the test's tmp dir
    "1f1b": (OPTS, {"zero_stage": 1, "pp": {"size": 2, "schedule": "1f1b", "microbatches": 2}}),
    "interleaved_1f1b": (("sgd",), {"zero_stage": 1, "pp": {"size": 2, "schedule": "interleaved_1f1b",
                                                            "microbatches": 2, "virtual_stages": 2}}),
    "1f1b_zero3_selective": (("sgd",), {"zero_stage": 3, "activation_checkpointing": "selective",
                                        "pp": {"size": 2, "schedule": "1f1b", "microbatches": 2}}),
}  # fmt: skip


def _fit_all(rank: int, world: int, tmp: str) -> dict:
    import glob
    import os
    import warnings

    warnings.filterwarnings("ignore")
    if world == 1:
        return {opt: _fit(1, None, opt, layers=LAYERS, sgd_lr=SGD_LR) for opt in OPTS}
    out = {}
    for name, (opts, kw) in CASES.items():
        for opt in opts:
            nvme = os.path.join(tmp, f"{name}-{opt}")
            os.makedirs(nvme, exist_ok=True)
            got = _fit(world, {**kw, "offload": {**OFFLOAD, "nvme_path": nvme}}, opt, layers=LAYERS, sgd_lr=SGD_LR)
            # this rank's folder (<nvme_path>/v17-offload-<run>/rank<r>) after fit: teardown closes the offload
            got["left"] = sorted(glob.glob(os.path.join(nvme, "*", f"rank{rank}")))
            out[(name, opt)] = got
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    tmp = str(tmp_path_factory.mktemp("pp_offload"))
    return {"ref": spawn(_fit_all, world_size=1, args=(tmp,), timeout=200),
            "pp": spawn(_fit_all, world_size=4, args=(tmp,), timeout=500)}  # fmt: skip


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("name", "opt"), [(n, o) for n, (opts, _) in CASES.items() for o in opts])
def test_activation_offload_inside_pp2_trains_like_one_process(runs, name, opt) -> None:
    import torch

    ref = runs["ref"][0][opt]
    assert len(set(ref["losses"])) == STEPS  # the weights moved every step
    if opt == "adamw_clip":
        assert min(ref["norms"]) > CLIP, ref["norms"]  # the clipping changed every update
    held: set[str] = set()
    for rank, got in enumerate(runs["pp"]):
        got = got[(name, opt)]
        assert got["losses"] == pytest.approx(ref["losses"], rel=TOL, abs=TOL), (name, opt, rank)
        assert got["norms"] == pytest.approx(ref["norms"], rel=TOL, abs=TOL), (name, opt, rank)
        if opt == "adamw_clip":
            assert got["clip_norms"] == pytest.approx(ref["norms"], rel=TOL, abs=TOL), (name, rank)
        held |= got["weights"].keys()
        for n, w in got["weights"].items():
            torch.testing.assert_close(w, ref["weights"][n], rtol=TOL, atol=TOL, msg=f"{name} {opt} rank {rank}: {n}")
        stats = got["offload"]
        assert len(stats) == STEPS, (name, rank)
        for before, after in zip([dict.fromkeys(stats[0], 0), *stats], stats):  # every step wrote and read back
            for key in ("tensors_offloaded", "bytes_offloaded"):
                assert after[key] > before[key], (name, opt, rank, key, stats)
            assert after["reads_ahead"] + after["reads_on_demand"] > before["reads_ahead"] + before["reads_on_demand"]
        if name != "1f1b_zero3_selective":  # each micro-batch's backward read its blocks ahead, none on demand
            assert stats[-1]["reads_on_demand"] == stats[0]["reads_on_demand"], (name, opt, rank, stats)
        assert got["left"] == [], (name, rank, got["left"])  # teardown removed the offload's folder
    assert held == ref["weights"].keys()
    worst = {k: max(abs(a - b) for out in runs["pp"] for a, b in zip(out[(name, opt)][k], ref[k]))
             for k in ("losses", "norms")}  # fmt: skip
    worst["params"] = max(float((w - ref["weights"][n]).abs().max()) for out in runs["pp"]
                          for n, w in out[(name, opt)]["weights"].items())  # fmt: skip
    print(f"{name} {opt}: max |difference| to one process {worst}")
