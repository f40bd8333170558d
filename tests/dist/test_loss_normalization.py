"""``V17Strategy(loss_normalization="tokens")``: every data-parallel layout trains one process's objective.

Rows of 16 tokens whose first targets are masked (-100) by a different amount per row (prompt masking), so the
data-parallel ranks and the accumulated micro-batches of one step hold different numbers of targets. One process
(plain Lightning, ``devices=1``, no V17 code in the loss) trains on each step's whole global batch; the layouts below
train the same rows spread over their data-parallel ranks and micro-batches, with plain SGD and no clipping (a
gradient weighted differently moves the weights off the reference):

* dp=2 with ``accumulate_grad_batches=2`` (2 ranks, ZeRO-1): the window's second batch is read ahead; again from an
  ``IterableDataset`` without a length (Lightning counts its batches as infinite);
* HSDP 2 x 2 (``dp_replicate=2``, ``dp_shard=2``, ZeRO-3, 4 ranks);
* ep=2 x pp=2 (4 ranks, the MoE model, ZeRO-1, 2 micro-batches): the pipeline's default loss divides by the count.

Asserted: every step's global loss (the ranks' shares summed) and the pre-clip gradient norm within 1e-5, every
parameter after 5 steps within 1e-5 (fp32). The same HSDP run with ``loss_normalization="rank_mean"`` (each rank's
own mean: DDP's objective) must be farther than 1e-5 from one process: the data really does reweight.
"""

from __future__ import annotations

import pytest

from tests._dist import spawn

#: the compositions this file checks against one process (docs/gen_layouts.py builds docs/layouts.md from them)
COMPOSES = (("accumulation", "zero1"), ("dp_replicate", "zero3"), ("ep", "pp", "zero1"))

STEPS, SEQ, ROWS = 5, 16, 2  # ROWS: rows per rank and micro-batch
TOL = 1e-5
CASES = {  # name -> (world, dp, accumulate, model, V17Strategy kwargs)
    "dp2_accum2": (2, 2, 2, "tiny", {"zero_stage": 1}),
    "dp2_accum2_iterable": (2, 2, 2, "tiny", {"zero_stage": 1}),
    "hsdp2x2": (4, 4, 1, "tiny", {"zero_stage": 3, "dp_replicate": 2}),
    "hsdp2x2_rank_mean": (4, 4, 1, "tiny", {"zero_stage": 3, "dp_replicate": 2, "loss_normalization": "rank_mean"}),
    "ep2_pp2": (4, 2, 1, "tiny-moe", {"zero_stage": 1, "ep": 2, "pp": 2, "microbatches": 2}),
}
OVERRIDES = {"tiny": {"layers": 2}, "tiny-moe": {"layers": 2, "dense_layers": 0}}


def _rows(n: int):
    import torch
    from torch.utils.data import Dataset

    class Rows(Dataset):
        def __len__(self) -> int:
            return n

        def __getitem__(self, i: int) -> dict:
            ids = torch.randint(0, 320, (SEQ + 1,), generator=torch.Generator().manual_seed(i))
            labels = ids[1:].clone()
            labels[: (i * 5) % 13] = -100  # 0..12 masked targets: unequal counts per row, rank and micro-batch
            return {"input_ids": ids[:-1], "labels": labels, "position_ids": torch.arange(SEQ)}

    return Rows()


def _Stream(rows):
    """``rows`` as an ``IterableDataset`` without ``__len__``."""
    from torch.utils.data import IterableDataset

    class Stream(IterableDataset):
        def __iter__(self):
            return (rows[i] for i in range(len(rows)))

    return Stream()


def _fit(world: int, dp: int, accumulate: int, model: str, kwargs: dict | None, iterable: bool = False) -> dict:
    """One run; ``kwargs`` None: the one-process reference (plain Lightning) on every step's global batch."""
    import os

    import lightning as L
    import torch
    from lightning_v17.strategies import V17Strategy
    from torch.utils.data import DataLoader, Subset

    from lightning_v17.models import LlamaLM
    from tests._strategy import full, policies

    torch.manual_seed(0)
    per_step = ROWS * dp * accumulate
    rows = _rows(per_step * STEPS)
    shares: list[float] = []
    norms: list[float] = []
    rank = int(os.environ.get("RANK", "0"))
    pp = 2 if kwargs and "pp" in kwargs else 1
    dp_rank = rank % dp if pp > 1 else rank  # mesh order pp, dp_replicate, dp_shard (cp, tp = 1)

    class Rec(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            # Lightning's outputs hold the loss divided by accumulate_grad_batches already
            share = outputs["loss"].detach().double().clone()
            if kwargs is not None:  # the ranks' shares of the step's global token mean (the same on the pp ranks)
                torch.distributed.all_reduce(share, group=trainer.strategy.mesh.group("dp"))
                share /= dp
            shares.append(float(share))

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            sq = torch.stack([full(p.grad).double().pow(2).sum() for p in pl_module.parameters()
                              if p.grad is not None]).sum()  # fmt: skip
            if pp > 1:  # each pp rank holds its stage: add the other stage's (pp peers: rank +- dp)
                every = [torch.zeros_like(sq) for _ in range(world)]
                torch.distributed.all_gather(every, sq)
                sq = every[dp_rank] + every[dp_rank + dp]
            norms.append(float(sq.sqrt()))

    class LM(LlamaLM):
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.5)

    module = LM(model=model, model_overrides=OVERRIDES[model], warmup_steps=0, max_steps=STEPS)
    if kwargs is None:
        loader = DataLoader(rows, batch_size=per_step, shuffle=False)
        strategy, devices = "auto", 1
    else:  # micro-batch m of step j on dp rank r: rows j*per_step + (m*dp + r)*ROWS ...
        mine = [j * per_step + (m * dp + dp_rank) * ROWS + t
                for j in range(STEPS) for m in range(accumulate) for t in range(ROWS)]  # fmt: skip
        data = Subset(rows, mine)
        if iterable:
            data = _Stream(data)
        loader = DataLoader(data, batch_size=ROWS, shuffle=False)
        strategy, devices = V17Strategy(**policies(**kwargs)), world
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=STEPS, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        accumulate_grad_batches=accumulate if kwargs else 1, callbacks=[Rec()],
                        use_distributed_sampler=False)  # fmt: skip
    trainer.fit(module, loader)
    steps = [sum(shares[j * accumulate : (j + 1) * accumulate]) for j in range(STEPS)] if kwargs else shares
    return {"losses": steps, "norms": norms, "params": {n: full(p) for n, p in module.model.named_parameters()}}


def _worker(rank: int, world: int, cases: dict) -> dict:
    return {name: _fit(*case, iterable=name.endswith("iterable")) for name, case in cases.items()}


@pytest.fixture(scope="module")
def runs() -> dict:
    two = {k: v for k, v in CASES.items() if v[0] == 2}
    four = {k: v for k, v in CASES.items() if v[0] == 4}
    out = {name: res for name, res in spawn(_worker, world_size=2, args=(two,), timeout=400)[0].items()}
    results = spawn(_worker, world_size=4, args=(four,), timeout=500)
    return {**out, **{name: [r[name] for r in results] for name in four}, "_two": two}


@pytest.fixture(scope="module")
def references() -> dict:
    refs = {}
    for _world, dp, accumulate, model, _ in CASES.values():
        key = (dp * accumulate, model)
        if key not in refs:
            refs[key] = _fit(1, dp, accumulate, model, None)
    return {name: refs[(dp * acc, model)] for name, (_, dp, acc, model, _) in CASES.items()}


def _max_param_diff(got: dict, ref: dict) -> float:
    return max(float((v - ref["params"][n]).abs().max()) for n, v in got["params"].items())


@pytest.mark.parametrize("name", [n for n in CASES if not n.endswith("rank_mean")])
def test_layout_trains_one_process_objective(runs, references, name) -> None:
    ref = references[name]
    per_rank = runs[name] if isinstance(runs[name], list) else [runs[name]]
    for got in per_rank:
        assert len(got["losses"]) == STEPS and len(got["norms"]) == STEPS
        for a, b in zip(got["losses"], ref["losses"]):
            assert abs(a - b) <= TOL, (name, got["losses"], ref["losses"])
        for a, b in zip(got["norms"], ref["norms"]):
            assert abs(a - b) <= TOL * max(1.0, b), (name, got["norms"], ref["norms"])
        assert got["params"], name
        assert _max_param_diff(got, ref) <= TOL, (name, _max_param_diff(got, ref))


def test_rank_mean_is_the_reweighted_objective(runs, references) -> None:
    """Each rank's own mean (DDP's objective) is measurably off one process on this data, and the tokens run is
    not: the test above can fail."""
    off = max(_max_param_diff(g, references["hsdp2x2_rank_mean"]) for g in runs["hsdp2x2_rank_mean"])
    on = max(_max_param_diff(g, references["hsdp2x2"]) for g in runs["hsdp2x2"])
    assert off > 20 * TOL, off
    assert on <= TOL, on
