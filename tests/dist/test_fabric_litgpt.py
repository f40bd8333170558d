"""litgpt's own pretraining loop (``litgpt.pretrain.fit``, unchanged) under ``V17FabricStrategy`` at ZeRO-3 and at
tp = 2, against Fabric's ``"ddp"``, on 2 gloo ranks.

The model is a tiny litgpt ``GPT`` (Llama-shaped: RMSNorm, LLaMAMLP, 2 query groups; block size ``SEQ``; random
weights, nothing downloaded), set up as litgpt's ``main`` does (``fabric.setup(model)``, then the optimizer built on
its parameters and ``fabric.setup_optimizers``). ``fit`` runs its loop: learning-rate warmup and cosine decay,
``fabric.no_backward_sync`` over ``ACCUM`` micro-batches, ``chunked_cross_entropy``, ``fabric.backward``,
``fabric.clip_gradients(max_norm=...)``, ``optimizer.step``; it logs each step's running loss through ``fabric.log_dict``
(recorded here by a logger). Then the state litgpt saves (``{"model", "optimizer", "iter_num", "step_count"}``) goes
through ``fabric.save`` and ``fabric.load``.

Under ddp and ZeRO-3 each rank reads its own ``MICRO`` rows an iteration; under tp = 2 (one data-parallel rank) both
ranks read all ``2 * MICRO`` of them, with ``TrainArgs`` sized to the same rows per step. Every target is a real
token, so the mean of the ranks' token means is the batch's. Two optimizers: AdamW with ``max_norm`` below every
step's gradient norm (the clip changes each update) and plain SGD with a ``max_norm`` no norm reaches.

Asserted: each step's loss (mean over the data-parallel ranks) and every parameter after the run (DTensors gathered)
within 1e-5 (relative) of ddp's; the saved state loads back bitwise.
"""

from __future__ import annotations

import pytest

from tests._dist import spawn

pytest.importorskip("litgpt")

TOL = 1e-5
SEQ, MICRO, ACCUM, STEPS = 16, 2, 2, 3
CASES = {"ddp": None, "zero3": {"zero_stage": 3}, "tp2": {"zero_stage": 3, "tp": 2}}
OPTS = {"adamw_clip": 0.05, "sgd": 1e9}  # optimizer -> max_norm


def _rows(it: int):
    import torch

    g = torch.Generator().manual_seed(500 + it)
    return torch.randint(0, 128, (2 * MICRO, SEQ + 1), generator=g)


def _run(rank: int, name: str, opt: str, tmp: str) -> dict:
    import lightning as L
    import torch
    from lightning.fabric.loggers import Logger
    from litgpt.args import EvalArgs, TrainArgs
    from litgpt.pretrain import fit
    from torch.distributed.tensor import DTensor

    from lightning_v17 import V17FabricStrategy
    from tests._models import litgpt_gpt

    class Record(Logger):
        name, version = "record", 0

        def __init__(self) -> None:
            self.losses: list[float] = []

        def log_metrics(self, metrics, step=None) -> None:
            if "loss" in metrics:
                self.losses.append(float(metrics["loss"]))

        def log_hyperparams(self, params, *args, **kwargs) -> None:
            pass

    kwargs = CASES[name]
    dp = kwargs is None or kwargs.get("tp", 1) == 1
    record = Record()
    strategy = "ddp" if kwargs is None else V17FabricStrategy(**kwargs)
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy, precision="32-true", loggers=[record])
    fabric.launch()
    micro = MICRO if dp else 2 * MICRO
    train = TrainArgs(save_interval=None, log_interval=1, global_batch_size=2 * micro * ACCUM, micro_batch_size=micro,
                      lr_warmup_steps=1, max_tokens=2 * STEPS * ACCUM * micro * SEQ, max_norm=OPTS[opt], min_lr=0.0)  # fmt: skip
    evals = EvalArgs(interval=10**6, max_iters=1, initial_validation=False, final_validation=False)
    iters = [_rows(i) for i in range(STEPS * ACCUM + 1)]
    loader = [r.chunk(2)[rank] if dp else r for r in iters]  # litgpt's CycleIterator over a per-rank batch list
    with fabric.init_module(empty_init=False):
        model = litgpt_gpt(layers=2, seed=0, block_size=SEQ)
    model = fabric.setup(model)
    optimizer = (torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-5, weight_decay=0.0) if opt == "adamw_clip"
                 else torch.optim.SGD(model.parameters(), lr=0.5))  # fmt: skip
    optimizer = fabric.setup_optimizers(optimizer)
    norms: list[float] = []
    clip = fabric.clip_gradients  # a spy: records the norm clip_gradients returns to litgpt's loop

    def spy(*args, **kw):
        norm = clip(*args, **kw)
        norms.append(float(norm))
        return norm

    fabric.clip_gradients = spy
    state = {"model": model, "optimizer": optimizer, "iter_num": 0, "step_count": 0}
    fit(fabric, 2, state, loader, loader[:1], tmp, None, train, evals)
    out: dict = {"losses": record.losses, "step_count": state["step_count"], "norms": norms}
    whole = lambda t: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
    out["params"] = {n: whole(p) for n, p in model.module.named_parameters()}
    path = f"{tmp}/{name}-{opt}/lit_model.pth"
    fabric.save(path, state)  # litgpt's save_checkpoint calls fabric.save(checkpoint_file, state)
    if kwargs is not None:
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        again = {"model": model, "optimizer": optimizer, "iter_num": 0, "step_count": 0}
        fabric.load(path, again)
        out["reloaded"] = {n: whole(p) for n, p in model.module.named_parameters()}
        out["reloaded_counts"] = (again["iter_num"], again["step_count"])
    return out


def _all(rank: int, world: int, tmp: str) -> dict:
    return {(name, opt): _run(rank, name, opt, tmp) for name in CASES for opt in OPTS}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list:
    return spawn(_all, world_size=2, args=(str(tmp_path_factory.mktemp("litgpt")),), init_process_group=False,
                 timeout=300)  # fmt: skip


def _step_losses(runs: list, name: str, opt: str) -> list[float]:
    per_rank = [runs[r][(name, opt)]["losses"] for r in (0, 1)]
    return [(a + b) / 2 for a, b in zip(*per_rank)] if CASES[name] is None or "tp" not in CASES[name] else per_rank[0]


@pytest.mark.parametrize("opt", list(OPTS))
@pytest.mark.parametrize("name", ["zero3", "tp2"])
def test_litgpt_pretrain_loop_under_v17_matches_fabric_ddp(runs, name, opt) -> None:
    import torch

    got, ref = _step_losses(runs, name, opt), _step_losses(runs, "ddp", opt)
    assert len(ref) == STEPS and len(got) == STEPS, (got, ref)
    assert max(abs(a - b) / abs(b) for a, b in zip(got, ref)) <= TOL, (got, ref)
    for rank in (0, 1):
        mine, want = runs[rank][(name, opt)], runs[rank][("ddp", opt)]
        assert len(want["norms"]) == STEPS and (min(want["norms"]) > OPTS[opt] if opt == "adamw_clip"
                                                else max(want["norms"]) < OPTS[opt]), want["norms"]  # fmt: skip
        assert max(abs(a - b) / b for a, b in zip(mine["norms"], want["norms"])) <= TOL, (mine["norms"], want["norms"])
        assert mine["step_count"] == want["step_count"] == STEPS
        for key, b in want["params"].items():
            a = mine["params"][key]
            rel = float((a - b).norm() / b.norm().clamp_min(1e-30))
            assert rel <= TOL, f"{name}/{opt} {key}: {rel:.2e}"
        for key, a in mine["params"].items():
            assert torch.equal(mine["reloaded"][key], a), f"{key} differs after fabric.load"
        assert mine["reloaded_counts"] == (STEPS * ACCUM, STEPS)
