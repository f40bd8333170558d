"""``V17Strategy(dp_replicate=2, cp=2)`` (HSDP beside context parallelism) on 4 ranks under a real Trainer against
one process.

torchtitan's HSDP + CP: ZeRO shards over dp_shard x cp (``dp_shard_cp``) and replicates over dp_replicate, and the
gradients are averaged over every dp x cp rank. ZeRO-1 (our engine: the gradients all-reduced over dp_replicate x
dp_shard x cp, the optimizer partitioned over dp_shard_cp), ZeRO-2 (the gradients reduce-scattered over dp_shard_cp,
then all-reduced over dp_replicate) and ZeRO-3 (FSDP2's HSDP on the 2-D (dp_replicate, dp_shard_cp) mesh). The tiny
LlamaLM (2 blocks, 8 query / 4 KV heads) on rows of 32 tokens packed with several documents each (position ids
restart per document); each dp replica trains on 2 of the reference's 4 rows per step and its two cp ranks on
halves of those rows (ulysses at ZeRO-1, allgather at ZeRO-2/3). Every token has a target (the rows are cut from a
longer random stream), so the two replicas hold equally many targets and the mean of their token means is the
reference's token mean. One spawn trains every case, 5 steps each: plain SGD (a gradient off by a constant factor,
e.g. averaged over dp but not cp, moves the weights off the reference) and AdamW with gradient clipping at
:data:`CLIP`, below every step's reference norm.

Asserted, per rank: every step's loss of the global batch within 1e-5 of one process, the pre-clip gradient norm
within 1e-5, and every parameter after the 5 steps within 1e-5 (fp32); at ZeRO-1/2 each rank steps half of every
parameter's rows (partitioned over the 2 ranks of dp_shard_cp), and the ZeRO-3 parameters are
``(Replicate(), Shard(0))`` over (dp_replicate, dp_shard_cp); the clipping bound is active.
"""

from __future__ import annotations

import pytest

from tests._dist import spawn
from tests._strategy import PACKED_ADAMW, STEPS, full

#: the compositions this file checks against one process (docs/gen_layouts.py builds docs/layouts.md from them)
COMPOSES = (("dp_replicate", "cp", "zero1"), ("dp_replicate", "cp", "zero2"),
            ("dp_replicate", "cp", "zero3"))  # fmt: skip
#: the published layouts this file runs in miniature, name -> the miniature (optional)
PUBLISHED = {"torchtitan HSDP + CP": "dp_replicate2 x cp2 at ZeRO-1, 2 and 3 (ZeRO over dp_shard x cp)"}

TOL = 1e-5
SEQ, ROWS = 32, 4  # the reference's rows per step; each dp replica gets ROWS // 2
CLIP = 0.5
SGD_LR = 0.1
CASES = {  # name -> V17Strategy kwargs of the 4-rank run
    "zero1_ulysses": {"zero_stage": 1, "dp_replicate": 2, "cp": {"size": 2, "mode": "ulysses"}},
    "zero2_allgather": {"zero_stage": 2, "dp_replicate": 2, "cp": {"size": 2, "mode": "allgather"}},
    "zero3_allgather": {"zero_stage": 3, "dp_replicate": 2, "cp": {"size": 2, "mode": "allgather"}},
}
OPTIMIZERS = ("sgd", "adamw")


def _rows():
    """``ROWS * STEPS`` rows of SEQ tokens, each packed with documents of 3 to 13 tokens (seed 11)."""
    import torch
    from torch.utils.data import Dataset

    class Rows(Dataset):
        def __len__(self) -> int:
            return ROWS * STEPS

        def __getitem__(self, i: int) -> dict:
            g = torch.Generator().manual_seed(11 + i)
            ids = torch.randint(3, 320, (SEQ + 1,), generator=g)
            pos, at = torch.empty(SEQ, dtype=torch.long), 0
            while at < SEQ:
                n = min(int(torch.randint(3, 14, (1,), generator=g)), SEQ - at)
                pos[at : at + n] = torch.arange(n)
                at += n
            return {"input_ids": ids[:-1], "labels": ids[1:], "position_ids": pos}

    return Rows()


def _loader(world: int, dp_rank: int):
    from torch.utils.data import DataLoader, Subset

    if world == 1:
        return DataLoader(_rows(), batch_size=ROWS, shuffle=False)
    per = ROWS // 2
    rows = [s * ROWS + per * dp_rank + i for s in range(STEPS) for i in range(per)]
    return DataLoader(Subset(_rows(), rows), batch_size=per, shuffle=False)


def _fit(world: int, strategy: dict, opt: str) -> dict:
    import lightning as L
    import torch
    import torch.distributed as dist
    from lightning_v17.strategies import V17Strategy

    from lightning_v17.engine.zero.grad_norms import grad_norms
    from lightning_v17.models import LlamaLM

    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    losses: list[float] = []
    norms: list[float] = []

    class Module(LlamaLM):
        def configure_optimizers(self):
            if opt == "sgd":
                return torch.optim.SGD(self.parameters(), lr=SGD_LR)
            return torch.optim.AdamW(self.parameters(), **PACKED_ADAMW)

        def on_before_optimizer_step(self, optimizer) -> None:  # before Lightning clips
            # the whole gradient, from what each stage holds of it: whole tensors (ZeRO-0/1), this rank's rows on
            # the optimizer's shards (ZeRO-2), DTensors over dp_shard_cp (ZeRO-3)
            each = grad_norms(self, self.trainer.strategy.zero, 2.0).values()
            norms.append(float(torch.stack([v.double() for v in each]).square().sum().sqrt()))
            if world > 1 and not hasattr(self, "_layout"):  # what the strategy built, read once
                q = optimizer.param_groups[0]["params"]
                meshes = (getattr(p, "device_mesh", None) for p in self.parameters())
                self._layout = {
                    "stepped": sum((t.to_local() if hasattr(t, "to_local") else t).numel() for t in q),
                    "placements": sorted({str(getattr(p, "placements", None)) for p in self.parameters()}),
                    "mesh": sorted({str(getattr(m, "mesh_dim_names", None)) for m in meshes}),
                }

        def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
            # every rank holds equally many targets: the global token mean is the mean of the ranks' own
            loss = outputs["loss"].detach().double().clone()
            if world > 1:
                dist.all_reduce(loss)
                loss /= world
            losses.append(float(loss))

    module = Module(model="tiny", model_overrides={"layers": 2}, warmup_steps=0, max_steps=STEPS)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=V17Strategy(**strategy), max_steps=STEPS,
                        gradient_clip_val=CLIP if opt == "adamw" else None, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                        num_sanity_val_steps=0, limit_val_batches=0)  # fmt: skip
    dp_rank = 0
    if world > 1:  # the mesh is (pp, dp_replicate, dp_shard, cp, tp): the dp replica is the rank // cp
        import os

        dp_rank = int(os.environ["RANK"]) // 2
    trainer.fit(module, _loader(world, dp_rank))
    return {"losses": losses, "norms": norms, "weights": {n: full(p) for n, p in module.named_parameters()},
            "layout": getattr(module, "_layout", None),
            "numel": sum(p.numel() for p in module.parameters())}  # fmt: skip


def _fit_all(rank: int, world: int) -> dict:
    if world == 1:
        return {opt: _fit(1, {"zero_stage": 0}, opt) for opt in OPTIMIZERS}
    return {(name, opt): _fit(world, kw, opt) for name, kw in CASES.items() for opt in OPTIMIZERS}


@pytest.fixture(scope="module")
def runs() -> dict[str, list[dict]]:
    return {"ref": spawn(_fit_all, world_size=1, timeout=200), "hsdp_cp": spawn(_fit_all, world_size=4, timeout=400)}


@pytest.mark.parametrize("opt", OPTIMIZERS)
@pytest.mark.parametrize("name", list(CASES))
def test_hsdp2_cp2_trains_like_one_process(runs, name, opt) -> None:
    import torch

    ref = runs["ref"][0][opt]
    assert len(ref["losses"]) == STEPS and len(set(ref["losses"])) == STEPS  # the weights moved every step
    if opt == "adamw":
        assert min(ref["norms"]) > CLIP  # the clipping changed every update
    for rank, got in enumerate(runs["hsdp_cp"]):
        got = got[(name, opt)]
        assert got["losses"] == pytest.approx(ref["losses"], rel=TOL, abs=TOL), (name, opt, rank)
        assert got["norms"] == pytest.approx(ref["norms"], rel=TOL, abs=TOL), (name, opt, rank)
        assert got["weights"].keys() == ref["weights"].keys()
        for n, w in got["weights"].items():
            torch.testing.assert_close(w, ref["weights"][n], rtol=TOL, atol=TOL, msg=f"{name} {opt} rank {rank}: {n}")


@pytest.mark.parametrize("name", list(CASES))
def test_zero_shards_over_dp_shard_cp_and_replicates_over_dp_replicate(runs, name) -> None:
    for got in runs["hsdp_cp"]:
        layout, numel = got[(name, "sgd")]["layout"], got[(name, "sgd")]["numel"]
        if not name.startswith("zero3"):  # each rank steps its half of the rows (of 2 ranks, not 4 and not 1)
            assert numel // 2 <= layout["stepped"] <= numel // 2 + 64, layout
            assert layout["placements"] == ["None"]
        else:  # FSDP2's HSDP: replicated over dp_replicate, sharded over dp_shard_cp
            assert layout["placements"] == ["(Replicate(), Shard(dim=0))"], layout
            assert layout["mesh"] == ["('dp_replicate', 'dp_shard_cp')"], layout
