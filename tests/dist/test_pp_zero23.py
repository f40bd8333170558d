"""Pipeline parallelism with ZeRO-2 and ZeRO-3: ``V17Strategy(pp=2, zero_stage=2|3)`` on 4 gloo ranks (pp2 x dp2)
under a real Trainer, against one process.

The tiny LlamaLM (2 blocks: one per stage) on fixed rows of ``SEQ`` random tokens, 4 rows a step: one process takes
all 4, each dp rank 2 of them, which the schedule cuts into 2 micro-batches of 1 row. Every row is full (no -100
label), so each dp rank's token mean weighs its rows as one process's does, and the dp ranks' mean is its mean. One
spawn trains every case, 5 steps each:

* ZeRO-2 under 1F1B and ZeRO-3 under GPipe and 1F1B, each with plain SGD and no clipping (a gradient off by a
  constant factor moves the weights) and with AdamW clipped at ``CLIP`` (the reference's pre-clip norm exceeds it at
  every step, so the clipping changes every update);
* ZeRO-3 keeps every unit gathered across the step's micro-batches: exactly one all-gather per FSDP2 group per step
  (the first step's shape inference aside), not one per micro-batch;
* the MoE LlamaLM (one MoE block per stage) with ep = 2 inside each stage's dp pair at ZeRO-3, plain SGD: the
  ep-sharded experts (outside FSDP2) are reduced once after the schedule, the dense parts by the FSDP2 stages;
* a pp2 x ZeRO-3 checkpoint: 3 steps, ``trainer.save_checkpoint``, then a fresh Trainer and module resume from it
  (``fit(ckpt_path=...)``) for steps 4-5 on the rows of those steps: its losses and parameters equal the
  uninterrupted ZeRO-3 1F1B AdamW run's.

Asserted, per rank: every step's loss within 1e-5 of one process; the whole model's pre-clip gradient norm (each
stage's gradients, whatever ZeRO holds of them, summed over the pp axis) within 1e-5, and with clipping the norm the
strategy's clipping computed too; every parameter of the rank's stage after the 5 steps within 1e-5 (fp32); each
parameter is sharded as the stage says (ZeRO-3: a dim-0 half on each dp rank; ZeRO-2: whole parameters, gradients
only on the optimizer's shards); the two stages together hold every parameter.
"""

from __future__ import annotations

import pytest

from tests._dist import spawn
from tests._strategy import PACKED_ADAMW, STEPS, full

#: the compositions this file checks against one process (docs/gen_layouts.py builds docs/layouts.md from them)
COMPOSES = (("pp", "zero2"), ("pp", "zero3"), ("pp", "ep", "zero3"))
#: the published layouts this file runs in miniature, name -> the miniature (optional)
PUBLISHED = {"torchtitan PP + FSDP": "pp2 x dp_shard2 at ZeRO-3 (and ZeRO-2)"}

TOL = 1e-5
SEQ, ROWS, CLIP = 32, 4, 0.5
OPTS = ("sgd", "adamw_clip")
CASES = {  # name -> V17Strategy kwargs (pp2 x dp2 on 4 ranks)
    "zero2_1f1b": {"zero_stage": 2, "pp": {"size": 2, "schedule": "1f1b", "microbatches": 2}},
    "zero3_gpipe": {"zero_stage": 3, "pp": {"size": 2, "schedule": "gpipe", "microbatches": 2}},
    "zero3_1f1b": {"zero_stage": 3, "pp": {"size": 2, "schedule": "1f1b", "microbatches": 2}},
}
RESUME_AT = 3  # the checkpoint case saves after this many steps of zero3_1f1b / adamw_clip
#: the MoE LlamaLM (one MoE block per stage) with its experts over ep = 2 inside each stage's dp pair, at ZeRO-3
MOE = {
    "overrides": {"layers": 2, "dense_layers": 0},
    "strategy": {"pp": 2, "ep": 2, "zero_stage": 3, "microbatches": 2},
}


def _loader(world: int, first_step: int = 0):
    """Batches of ``ROWS`` rows per step (one process) or ``ROWS / 2`` (each of the 2 dp ranks: dp rank r takes rows
    2r, 2r + 1 of each step's 4), beginning with step ``first_step``'s: a resumed fit restarts a loader without state
    from its start and counts on from the saved batch index, so the epoch still has ``STEPS`` batches."""
    import os

    import torch
    from torch.utils.data import DataLoader, Dataset

    class Rows(Dataset):
        def __init__(self, index: list[int]) -> None:
            self.index = index

        def __len__(self) -> int:
            return len(self.index)

        def __getitem__(self, i: int) -> dict:
            g = torch.Generator().manual_seed(self.index[i])
            ids = torch.randint(3, 320, (SEQ + 1,), generator=g)
            return {"input_ids": ids[:-1], "labels": ids[1:], "position_ids": torch.arange(SEQ)}

    per = ROWS if world == 1 else ROWS // 2
    dp_rank = 0 if world == 1 else int(os.environ["RANK"]) % 2  # pp outermost: ranks 0, 1 hold stage 0
    steps = [*range(first_step, STEPS), *range(first_step)]
    index = [s * ROWS + per * dp_rank + i for s in steps for i in range(per)]
    return DataLoader(Rows(index), batch_size=per, shuffle=False)


def _fit(world: int, strategy: dict | None, opt: str, *, max_steps: int = STEPS, first_step: int = 0,
         save: str | None = None, resume: str | None = None, layers: int = 2, sgd_lr: float = 0.5) -> dict:  # fmt: skip
    """One Trainer run of the tiny LlamaLM with ``layers`` blocks; returns each step's loss (the mean over the dp
    ranks), the whole model's pre-clip gradient norm, the norm the strategy's clipping computed, every parameter of
    this rank (gathered whole), its layout, the all-gathers per step and the activation offload's counters after
    each step."""
    import lightning as L
    import lightning_v17.strategies._precision as precision
    import torch
    import torch.distributed as dist
    from lightning_v17.strategies import V17Strategy

    from lightning_v17.engine.zero.grad_norms import grad_norms
    from lightning_v17.models import LlamaLM

    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    losses, norms, clip_norms, gathers, offload = [], [], [], [], []

    class LM(LlamaLM):
        def configure_optimizers(self):
            if opt == "sgd":
                return torch.optim.SGD(self.parameters(), lr=sgd_lr)
            return torch.optim.AdamW(self.parameters(), **PACKED_ADAMW)

    class Rec(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            gathers.append(0)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            loss = outputs["loss"].detach().double().clone()
            if world > 1:  # equal on the pp ranks; the dp ranks' token means over equal token counts
                dist.all_reduce(loss)
                loss /= world
            losses.append(float(loss))
            off = getattr(getattr(trainer.strategy, "parallel", None), "activations", None)
            if off is not None:
                offload.append(dict(off.stats))

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:  # before Lightning clips
            if world == 1:
                sq = sum(p.grad.double().square().sum() for p in pl_module.parameters() if p.grad is not None)
            else:  # each stage's whole-gradient norms (ZeRO-2's shards, ZeRO-3's DTensors), over the pp axis
                each = grad_norms(pl_module, trainer.strategy.zero, 2.0).values()
                sq = torch.stack([n.double().square() for n in each]).sum()
                dist.all_reduce(sq, group=trainer.strategy.mesh.group("pp"))
            norms.append(float(torch.as_tensor(sq).sqrt()))

    record = precision.clip_grad_norm_

    def clip_and_record(*args, **kwargs):  # the norm the strategy's clipping computed (its own all-reduces)
        total = record(*args, **kwargs)
        clip_norms.append(float(total))
        return total

    precision.clip_grad_norm_ = clip_and_record
    count = _count_all_gathers(gathers) if world > 1 and strategy["zero_stage"] == 3 else None
    try:
        module = LM(model="tiny", model_overrides={"layers": layers}, warmup_steps=0, max_steps=STEPS)
        trainer = L.Trainer(
            accelerator="cpu", devices=world, strategy="auto" if world == 1 else V17Strategy(**strategy), max_steps=max_steps,
            gradient_clip_val=CLIP if opt == "adamw_clip" else None, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, callbacks=[Rec()], use_distributed_sampler=False,
            num_sanity_val_steps=0, limit_val_batches=0,
        )  # fmt: skip
        trainer.fit(module, _loader(world, first_step), ckpt_path=resume)
        if save is not None:
            trainer.save_checkpoint(save)
    finally:
        precision.clip_grad_norm_ = record
        if count is not None:
            count()
    params = dict(module.named_parameters())
    return {
        "losses": losses, "norms": norms, "clip_norms": clip_norms, "gathers": gathers, "offload": offload,
        "weights": {n: full(p) for n, p in params.items()},
        "local_numel": {n: (p.to_local() if hasattr(p, "to_local") else p).numel() for n, p in params.items()},
        "grads_on_params": [n for n, p in params.items() if p.grad is not None],
    }  # fmt: skip


def _count_all_gathers(out: list[int]):
    """Count the FSDP2 groups' all-gathers (FSDP2's ``foreach_all_gather`` calls) into ``out[-1]`` (the callback
    starts each step's count); returns the undo."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    inner = _fsdp_param_group.foreach_all_gather

    def counted(*args, **kwargs):
        if out:
            out[-1] += 1
        return inner(*args, **kwargs)

    _fsdp_param_group.foreach_all_gather = counted

    def undo() -> None:
        _fsdp_param_group.foreach_all_gather = inner

    return undo


def _fit_all(rank: int, world: int, tmp: str) -> dict:
    import warnings

    warnings.filterwarnings("ignore")
    from tests._strategy import fit_moe, v17

    if world == 1:
        return {
            **{opt: _fit(1, None, opt) for opt in OPTS},
            "moe": fit_moe("sgd", 1, "auto", overrides=MOE["overrides"]),
        }
    out = {(name, opt): _fit(world, kw, opt) for name, kw in CASES.items() for opt in OPTS}
    # ZeRO-3 shards rather than broadcasts over dp_shard: every rank starts from the same weights (perturb_odd off)
    out["moe"] = fit_moe("sgd", world, v17(**MOE["strategy"]), overrides=MOE["overrides"], dp_axis_stride=1,
                         stage_ranks=(0, 2), perturb_odd=False)  # fmt: skip
    ckpt = f"{tmp}/pp2_zero3.ckpt"
    kw = CASES["zero3_1f1b"]
    _fit(world, kw, "adamw_clip", max_steps=RESUME_AT, save=ckpt)
    out["resumed"] = _fit(world, kw, "adamw_clip", first_step=RESUME_AT, resume=ckpt)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    tmp = str(tmp_path_factory.mktemp("pp_zero23"))
    return {"ref": spawn(_fit_all, world_size=1, args=(tmp,), timeout=200),
            "pp": spawn(_fit_all, world_size=4, args=(tmp,), timeout=500)}  # fmt: skip


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("name", "opt"), [(n, o) for n in CASES for o in OPTS])
def test_zero23_inside_pp2_trains_like_one_process(runs, name, opt) -> None:
    import torch

    ref = runs["ref"][0][opt]
    assert len(ref["losses"]) == STEPS and len(set(ref["losses"])) == STEPS  # the weights moved every step
    if opt == "adamw_clip":
        assert min(ref["norms"]) > CLIP, ref["norms"]  # the clipping changed every update
    held: set[str] = set()
    for rank, got in enumerate(runs["pp"]):
        got = got[(name, opt)]
        assert got["losses"] == pytest.approx(ref["losses"], rel=TOL, abs=TOL), (name, opt, rank)
        assert got["norms"] == pytest.approx(ref["norms"], rel=TOL, abs=TOL), (name, opt, rank)
        if opt == "adamw_clip":
            assert got["clip_norms"] == pytest.approx(ref["norms"], rel=TOL, abs=TOL), (name, rank)
        assert got["weights"] and got["weights"].keys() < ref["weights"].keys(), (name, rank)  # one stage's part
        held |= got["weights"].keys()
        for n, w in got["weights"].items():
            torch.testing.assert_close(w, ref["weights"][n], rtol=TOL, atol=TOL, msg=f"{name} {opt} rank {rank}: {n}")
            whole = ref["weights"][n].numel()
            if name.startswith("zero3"):  # ZeRO-3: each dp rank stores its dim-0 half
                assert got["local_numel"][n] == whole // 2, (name, rank, n)
            else:  # ZeRO-2: whole parameters, whose gradients live only on the optimizer's shards
                assert got["local_numel"][n] == whole, (name, rank, n)
        if name.startswith("zero2"):
            assert got["grads_on_params"] == [], (name, rank)
        if name.startswith("zero3"):
            # per step, one all-gather per FSDP2 group of this stage (a block unit and the stage root holding the
            # embedding or the norm and head): not one per micro-batch. The first step adds the shape inference's.
            assert got["gathers"][1:] == [2] * (STEPS - 1), (name, opt, rank, got["gathers"])
    assert held == ref["weights"].keys()
    worst = {k: max(abs(a - b) for out in runs["pp"] for a, b in zip(out[(name, opt)][k], ref[k]))
             for k in ("losses", "norms")}  # fmt: skip
    worst["params"] = max(float((w - ref["weights"][n]).abs().max()) for out in runs["pp"]
                          for n, w in out[(name, opt)]["weights"].items())  # fmt: skip
    print(f"{name} {opt}: max |difference| to one process {worst}")


@pytest.mark.timeout(600)
def test_pp2_zero3_checkpoint_resumes_like_an_uninterrupted_run(runs) -> None:
    import torch

    for rank, out in enumerate(runs["pp"]):
        whole, resumed = out[("zero3_1f1b", "adamw_clip")], out["resumed"]
        assert resumed["losses"] == pytest.approx(whole["losses"][RESUME_AT:], rel=TOL, abs=TOL), rank
        assert resumed["weights"].keys() == whole["weights"].keys()
        for n, w in resumed["weights"].items():
            torch.testing.assert_close(w, whole["weights"][n], rtol=TOL, atol=TOL, msg=f"rank {rank}: {n}")
        worst = max(float((w - whole["weights"][n]).abs().max()) for n, w in resumed["weights"].items())
        print(
            f"rank {rank}: resumed vs uninterrupted, max |loss difference| "
            f"{max(abs(a - b) for a, b in zip(resumed['losses'], whole['losses'][RESUME_AT:]))}, params {worst}"
        )


@pytest.mark.timeout(600)
def test_ep2_inside_pp2_zero3_trains_like_one_process(runs) -> None:
    """ep x pp x ZeRO-3: the experts (ep-sharded, outside FSDP2 at efsdp = 1) accumulate over the micro-batches and
    are reduced once after the schedule (the backend's ``pipeline_reducer``), the dense parts by the FSDP2 stages."""
    import torch

    ref = runs["ref"][0]["moe"]
    params: set[str] = set()
    for rank, out in enumerate(runs["pp"]):
        got = out["moe"]
        stage = rank // 2
        assert got["experts"] == [f"layers.{stage}.feed_forward.experts.down_proj",
                                  f"layers.{stage}.feed_forward.experts.gate_up_proj"], (rank, got["experts"])  # fmt: skip
        assert got["losses"] == pytest.approx(ref["losses"], rel=TOL, abs=TOL), (rank, got["losses"], ref["losses"])
        assert got["norms"] == pytest.approx(ref["norms"], rel=TOL), (rank, got["norms"], ref["norms"])
        for n, w in got["params"].items():
            torch.testing.assert_close(w, ref["params"][n], rtol=TOL, atol=TOL, msg=f"rank {rank}: {n}")
        params |= got["params"].keys()
    assert params == ref["params"].keys()
    worst = max(
        float((w - ref["params"][n]).abs().max()) for out in runs["pp"] for n, w in out["moe"]["params"].items()
    )
    print(f"ep2 x pp2 x ZeRO-3 sgd: max |parameter difference| to one process {worst}")
