"""``fabric.save`` / ``fabric.load`` under ``V17FabricStrategy``, and ``fabric.init_module(empty_init=True)``.

One LightningModule (the tiny reference Llama, 2 blocks, fp32, AdamW lr 1e-3 eps 1e-5, no clipping) trains ``STEPS``
steps on fixed rows; under data parallelism each rank takes half of a step's rows, under tp = 2 and at one rank a
process takes all of them (every row full, so the mean of the ranks' token means is the batch's). The reference is
the uninterrupted Fabric run at ZeRO-3 on 2 ranks, which saves a sharded checkpoint after step ``SAVE`` (``fab``) with
``async_save=True`` (not on disk when ``fabric.save`` returns, published by teardown at the latest). From the
checkpoints:

* 2 ranks, ZeRO-3, ``fabric.load(fab)``: steps ``SAVE+1..STEPS`` bitwise equal to the uninterrupted run (losses and
  every parameter), and the user's own entries (``step``, a Stateful counter) restored;
* 1 rank (another world size): the loaded parameters and AdamW state bitwise equal to the saved run's, gathered; the
  next steps within ``TOL`` of the uninterrupted run (one process reduces in another order);
* tp = 2 (another layout) and ZeRO-1: within ``TOL``;
* the Trainer with ``V17Strategy`` resumes ``fab`` (``ckpt_path=``) and continues within ``TOL``; a checkpoint the
  Trainer wrote after ``SAVE`` steps loads under Fabric, which continues within ``TOL`` and gets ``global_step`` back.

A script whose last act is an asynchronous ``fabric.save`` exits: its checkpoint is complete (the atexit hook).

``empty_init``: the parameters of a 24 x Linear(1024, 1024) model (96 MiB) are built on the meta device and
materialized by ``fabric.setup`` at ZeRO-3: the growth of each rank's peak RSS over ``init_module`` + ``setup``
(VmHWM, reset through ``/proc/self/clear_refs``; glibc's mmap threshold fixed at 1 MiB, so that the RSS follows
the live tensors) stays within the rank's shard (half), one unit (a Linear, initialized whole) and ``SLACK``, and under
3/4 of the full model, while the same model built with
real tensors grows it by at least 9/10 of the full model (the measurement can see it; measured first in each worker,
before the other runs leave freed heap chunks that an allocation could reuse without growing the RSS).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests._dist import spawn

TOL = 1e-5
STEPS, SAVE, SEQ, ROWS = 6, 3, 16, 4
ADAMW = {"lr": 1e-3, "eps": 1e-5}
WIDTH, DEPTH = 1024, 24
SLACK = 16 * 2**20  # what setup allocates besides the parameters (measured: ~9.6 MiB, the same at 8 and 24 layers)
FULL_BYTES = DEPTH * (WIDTH * WIDTH + WIDTH) * 4


def _rows(step: int):
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, 320, (ROWS, SEQ), generator=g)
    labels = torch.full_like(tokens, -100)
    labels[:, :-1] = tokens[:, 1:]
    return tokens, labels


def _lit():
    import lightning as L
    import torch

    from tests.dist.test_tp import tiny_model, token_mean_loss

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = tiny_model(seed=0, layers=2)
            self.losses: list[float] = []

        def forward(self, tokens):
            return self.model(tokens)

        def training_step(self, batch, _):
            tokens, labels = batch
            loss = token_mean_loss(self(tokens), labels)
            self.losses.append(float(self.trainer.strategy.reduce(loss.detach(), reduce_op="mean")))
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), **ADAMW)

    return Lit(), token_mean_loss


class Counter:
    """A Stateful entry of the user's own (fabric.save stores its state_dict, fabric.load calls load_state_dict)."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, state: dict) -> None:
        self.n = state["n"]


def _chunk(tokens, labels, rank: int, dp: int):
    return (tokens.chunk(dp)[rank], labels.chunk(dp)[rank]) if dp > 1 else (tokens, labels)


def _full_state(model, optimizer, zero) -> dict:
    """Every parameter and AdamW state tensor, gathered whole (DTensors), by FQN (the optimizer's through the applied
    ZeRO stage's FQN-keyed state dict: stages 1-2 step flat shards of their own)."""
    import torch
    from torch.distributed.tensor import DTensor

    whole = lambda t: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
    model = getattr(model, "module", model)  # Fabric's wrapper: the names of the module it wraps
    params = {n: whole(p) for n, p in model.named_parameters()}
    osd = zero.optimizer_state_dict(getattr(optimizer, "optimizer", optimizer))  # Fabric's wrapper: its optimizer
    state = {f"{fqn}.{k}": whole(v) for fqn, s in osd["state"].items() for k, v in s.items() if torch.is_tensor(v)}
    return {"params": params, "optim": state}


def _fabric_run(rank: int, world: int, strategy, *, steps: range, load: str | None = None, save: str | None = None,
                dp: int | None = None) -> dict:  # fmt: skip
    import lightning as L

    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy, precision="32-true")
    fabric.launch()
    lit, loss_fn = _lit()
    model, optimizer = fabric.setup(lit, lit.configure_optimizers())
    dp = world if dp is None else dp
    counter, out = Counter(), {"losses": []}
    if load is not None:
        state = {"model": model, "optimizer": optimizer, "step": -1, "counter": counter}
        out["remainder"] = sorted(fabric.load(load, state, strict=False))
        out["step"], out["counter"] = state["step"], counter.n
        out["loaded"] = _full_state(model, optimizer, fabric.strategy.zero)
    for step in steps:
        tokens, labels = _chunk(*_rows(step), fabric.global_rank, dp)
        loss = loss_fn(model(tokens), labels)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        counter.n += 1
        out["losses"].append(float(fabric.all_reduce(loss.detach(), reduce_op="mean")) if dp > 1 else float(loss))
        if save is not None and step + 1 == SAVE:
            out["saved"] = _full_state(model, optimizer, fabric.strategy.zero)
            fabric.save(save, {"model": model, "optimizer": optimizer, "step": step + 1, "counter": counter})
            out["published_at_return"] = Path(save).exists()  # async: staged, not yet written
    out["final"] = _full_state(model, optimizer, fabric.strategy.zero)["params"]
    if save is not None:
        fabric.strategy.teardown()  # publishes a save still in flight (at process exit, an atexit hook does)
        out["published_at_teardown"] = Path(save, "meta.json").exists()
    return out


def _trainer_run(world: int, *, steps: range, ckpt_path: str | None = None, save: str | None = None) -> dict:
    import lightning as L
    from torch.utils.data import DataLoader, Dataset

    from lightning_v17 import V17Strategy

    class Steps(Dataset):
        def __len__(self) -> int:
            return len(steps)

        def __getitem__(self, i: int):
            return _chunk(*_rows(steps[i]), int(os.environ["RANK"]), world)

    lit, _ = _lit()
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=V17Strategy(zero_stage=3,
                        loss_normalization="rank_mean"), max_steps=len(steps), logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False)  # fmt: skip
    loader = DataLoader(Steps(), batch_size=None, shuffle=False)
    trainer.fit(lit, loader, ckpt_path=ckpt_path)
    if save is not None:
        trainer.save_checkpoint(save)
    opt = trainer.optimizers[0]
    out = {
        "losses": lit.losses,
        "final": _full_state(lit, opt, trainer.strategy.zero)["params"],
        "global_step": trainer.global_step,
    }
    return out


def _rss_peak_growth(rank: int, world: int, empty_init: bool) -> int:
    """The growth of this process's peak RSS over building the Linear stack and fabric.setup at ZeRO-3, in bytes."""
    import lightning as L
    import torch
    from torch.distributed.tensor import DTensor

    from lightning_v17 import V17FabricStrategy

    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=V17FabricStrategy(zero_stage=3), precision="32-true")
    fabric.launch()

    def hwm() -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmHWM")

    import ctypes
    import gc

    # every allocation of 1 MiB or more its own mapping, unmapped when freed: the RSS follows the live tensors, not
    # what glibc's heap kept free from the runs before (M_MMAP_THRESHOLD = -3)
    assert ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20) == 1
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # the peak RSS restarts from the current RSS
    start = hwm()

    class Stack(torch.nn.Module):  # each Linear a ZeRO-3 unit (the children of a ModuleList)
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    with fabric.init_module(empty_init=empty_init):
        model = Stack()
    model = fabric.setup(model)
    grown = hwm() - start
    local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters()) * 4
    std = float(torch.stack([p.full_tensor().std() for p in model.parameters() if p.dim() == 2]).mean())
    return {"grown": grown, "local": local, "weight_std": std}


def _two(rank: int, world: int, tmp: str) -> dict:
    from lightning_v17 import V17FabricStrategy

    fab, tr = f"{tmp}/fab", f"{tmp}/trainer"
    rss = {e: _rss_peak_growth(rank, world, e) for e in (True, False)}  # first: the heap has least to reuse
    ref = V17FabricStrategy(zero_stage=3, async_save=True)
    out = {"ref": _fabric_run(rank, world, ref, steps=range(STEPS), save=fab)}
    out["resume"] = _fabric_run(rank, world, V17FabricStrategy(zero_stage=3), steps=range(SAVE, STEPS), load=fab)
    out["tp2"] = _fabric_run(rank, world, V17FabricStrategy(zero_stage=3, tp=2), steps=range(SAVE, STEPS), load=fab,
                             dp=1)  # fmt: skip
    out["trainer_from_fabric"] = _trainer_run(world, steps=range(SAVE, STEPS), ckpt_path=fab)
    _trainer_run(world, steps=range(SAVE), save=tr)
    out["fabric_from_trainer"] = _fabric_run(rank, world, V17FabricStrategy(zero_stage=1), steps=range(SAVE, STEPS),
                                             load=tr)  # fmt: skip
    out["rss"] = rss
    return out


def _one(rank: int, world: int, tmp: str) -> dict:
    from lightning_v17 import V17FabricStrategy

    return _fabric_run(rank, world, V17FabricStrategy(zero_stage=3), steps=range(SAVE, STEPS), load=f"{tmp}/fab")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    tmp = str(tmp_path_factory.mktemp("fabric_ckpt"))
    two = spawn(_two, world_size=2, args=(tmp,), init_process_group=False, timeout=300)
    one = spawn(_one, world_size=1, args=(tmp,), init_process_group=False, timeout=120)[0]
    return {"two": two, "one": one}


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _close(got: dict, ref: dict, tol: float) -> None:
    import torch

    want = ref["losses"][SAVE:]
    assert len(got["losses"]) == len(want)
    for a, b in zip(got["losses"], want):
        assert (a == b) if tol == 0 else abs(a - b) / abs(b) <= tol, (got["losses"], want)
    assert got["final"].keys() == ref["final"].keys()
    for key, b in ref["final"].items():
        a = got["final"][key]
        assert torch.equal(a, b) if tol == 0 else _rel(a, b) <= tol, f"{key}: {_rel(a, b):.2e}"


def test_fabric_resume_at_the_same_world_size_is_bitwise(runs) -> None:
    for rank in (0, 1):
        ref = runs["two"][rank]["ref"]
        assert not ref["published_at_return"] and ref["published_at_teardown"], "async_save: staged, then published"
        got, ref = runs["two"][rank]["resume"], runs["two"][rank]["ref"]
        _close(got, ref, 0)
        assert got["step"] == SAVE and got["counter"] == SAVE, (got["step"], got["counter"])
        assert got["remainder"] == [], got["remainder"]


def test_fabric_checkpoint_from_two_ranks_loads_bitwise_at_one_rank(runs) -> None:
    import torch

    one, saved = runs["one"], runs["two"][0]["ref"]["saved"]
    for part in ("params", "optim"):
        assert one["loaded"][part].keys() == saved[part].keys() and saved[part], part
        for key, want in saved[part].items():
            assert torch.equal(one["loaded"][part][key], want), f"{part} {key} differs after the 2 -> 1 reshard"
    _close(one, runs["two"][0]["ref"], TOL)


@pytest.mark.parametrize("run", ["tp2", "fabric_from_trainer", "trainer_from_fabric"])
def test_fabric_checkpoint_reshards_and_crosses_to_the_trainer(runs, run) -> None:
    for rank in (0, 1):
        _close(runs["two"][rank][run], runs["two"][rank]["ref"], TOL)
    if run == "fabric_from_trainer":
        assert "global_step" in runs["two"][0][run]["remainder"]


_SCRIPT = """
import os, sys
import lightning as L
import torch
from lightning_v17 import V17FabricStrategy

if __name__ == "__main__":
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=V17FabricStrategy(zero_stage=3, async_save=True))
    fabric.launch()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters()))
    fabric.backward(model(torch.ones(4, 256)).square().mean())
    optimizer.step()
    fabric.save(sys.argv[1], {"model": model, "optimizer": optimizer, "step": 1})
    assert not os.path.exists(sys.argv[1]), "an asynchronous save is published after fabric.save returns"
"""


def test_fabric_async_save_is_published_when_the_script_exits(tmp_path) -> None:
    """A script whose last act is an asynchronous fabric.save (litgpt's final save) exits: the checkpoint is complete."""
    import subprocess
    import sys

    from lightning_v17.checkpoint.sharded import verify_checkpoint

    script, ckpt = tmp_path / "train.py", tmp_path / "final"
    script.write_text(_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                              "MASTER_PORT", "NODE_RANK")}  # fmt: skip
    done = subprocess.run([sys.executable, str(script), str(ckpt)], check=False, env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=180)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    meta = verify_checkpoint(ckpt, no_dist=True)  # meta.json, every file's size and sha256
    assert meta["writer"] == "fabric" and meta["world_size"] == 2 and set(meta["components"]) == {"model", "optim"}


def test_fabric_empty_init_never_holds_the_whole_model(runs) -> None:
    for rank in (0, 1):
        meta, real = runs["two"][rank]["rss"][True], runs["two"][rank]["rss"][False]
        assert meta["local"] == FULL_BYTES // 2, meta
        assert real["grown"] >= 0.9 * FULL_BYTES, f"the control must see the whole model: {real}"
        bound = meta["local"] + FULL_BYTES // DEPTH + SLACK  # its shard, one unit whole while it initializes, SLACK
        assert meta["grown"] <= min(bound, 0.75 * FULL_BYTES), f"empty_init grew the peak RSS: {meta}"
        assert 0.005 < meta["weight_std"] < 0.05, f"materialized weights look uninitialized: {meta}"
