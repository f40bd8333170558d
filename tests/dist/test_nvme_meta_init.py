"""A model built on the meta device (``ZeroPolicy(stage=3, meta_init=True)``) with its parameters and optimizer state
offloaded (``OffloadPolicy(params="nvme", optimizer="nvme")``, and ``"cpu"``) under V17Strategy on 2 gloo ranks,
against the same model trained all in memory.

The path a model that does not fit takes: ``configure_model`` builds on meta, ZeRO-3 shards it, and each unit's
shards are allocated, initialized and written to the nvme tier one unit after another
(:func:`~lightning_v17.engine.zero.meta_init.materialize_meta_module` with the tier's ``after_group``), so a rank
never holds its whole shard of the model. The model: an MLP of ``BLOCKS`` residual blocks (norm, up, GELU, down) between an
input and an output projection, 4.2M parameters, fp32, MSE on fixed random data, 3 steps; plain SGD without clipping
and AdamW with clipping at :data:`CLIP` (below every step's norm, so it clips).

* **Name-seeded init** (every Linear draws its whole weight from a generator seeded by its name and copies this
  rank's rows; the norms are ones): the values do not depend on sharding, so a one-process run of the eagerly built
  model is the reference. nvme/nvme, cpu/cpu and no offload each match it: every step's loss, the unclipped gradient
  norm and every parameter after the steps within 1e-5.
* **Modules' own init** (``nn.Linear.reset_parameters``, global RNG, seed 0 on every rank): each unit is initialized
  on its whole tensors and each rank keeps its rows, so nvme/nvme matches the one-process model built eagerly after
  ``torch.manual_seed(0)``, and the same 2-rank meta-init run without offload, within 1e-5.
* **Refused before training**: a drive with room for one rank's bytes but not for both ranks' (``shutil.disk_usage``
  reports that much free): for the parameters alone, the host's check refuses before the first unit is written; for
  parameters and AdamW state, before step 0 (the message names the path, the free space and the bytes).
* **Streamed**: while the shards are written, the parameter bytes in memory never exceed three units' (the one
  initialized, two in write-back) and the root group's, under 40% of the rank's shard of the model (a tier that took the shards only after all were allocated
  held the whole shard).
"""

from __future__ import annotations

import itertools
import os

import pytest

from tests._dist import spawn

#: the compositions this file checks against one process (docs/gen_layouts.py builds docs/layouts.md from them)
COMPOSES = (("offload_params", "offload_optimizer", "zero3"),)

pytestmark = pytest.mark.timeout(300)

TOL = 1e-5
STEPS = 3
WORLD = 2
BATCH = 8  # rows per rank and step
IN, HIDDEN, OUT, BLOCKS = 64, 256, 32, 8
CLIP = 0.05
SGD_LR = 0.05
ADAMW = {"lr": 1e-3, "eps": 1e-5, "weight_decay": 0.1}
CASES = {  # name -> (init, V17Strategy offload keywords or None)
    "seeded_nvme": ("seeded", {"params": "nvme", "optimizer": "nvme"}),
    "seeded_cpu": ("seeded", {"params": "cpu", "optimizer": "cpu"}),
    "seeded_memory": ("seeded", None),
    "own_nvme": ("own", {"params": "nvme", "optimizer": "nvme"}),
    "own_memory": ("own", None),
}
OPTIMIZERS = ("sgd", "adamw")
#: bytes of one rank's fp32 parameter shards (half of every weight, each in 4096-byte slots of its unit's file)
SHARD_BYTES = (IN * HIDDEN + HIDDEN + HIDDEN * OUT) * 2 + BLOCKS * (HIDDEN + 8 * HIDDEN * HIDDEN) * 2


def _data():
    import torch

    g = torch.Generator().manual_seed(3)
    n = STEPS * WORLD * BATCH
    return torch.randn(n, IN, generator=g), torch.randn(n, OUT, generator=g)


def _net(init: str):
    """The MLP; ``init="seeded"``: every Linear's values depend only on its name (any sharding, any device)."""
    import zlib

    import torch
    from torch import nn

    class SeededLinear(nn.Linear):
        def __init__(self, i: int, o: int, name: str) -> None:
            self.name = name
            super().__init__(i, o, bias=False)

        @torch.no_grad()
        def reset_parameters(self) -> None:
            from torch.distributed.tensor import DTensor, distribute_tensor

            gen = torch.Generator().manual_seed(zlib.crc32(self.name.encode()))
            whole = torch.randn(self.weight.shape, generator=gen) * self.in_features**-0.5
            w = self.weight
            if isinstance(w, DTensor):  # this rank's rows of the whole value (every rank draws the same)
                w.to_local().copy_(distribute_tensor(whole, w.device_mesh, w.placements, src_data_rank=None).to_local())
            else:
                w.copy_(whole)

    def linear(i: int, o: int, name: str) -> nn.Linear:
        return SeededLinear(i, o, name) if init == "seeded" else nn.Linear(i, o, bias=False)

    class Norm(nn.Module):
        def __init__(self, dim: int) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(dim))

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight

        def reset_parameters(self) -> None:
            nn.init.ones_(self.weight)

    class Block(nn.Module):
        def __init__(self, k: int) -> None:
            super().__init__()
            self.norm = Norm(HIDDEN)
            self.up = linear(HIDDEN, 4 * HIDDEN, f"blocks.{k}.up")
            self.down = linear(4 * HIDDEN, HIDDEN, f"blocks.{k}.down")

        def forward(self, x):
            return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = linear(IN, HIDDEN, "inp")
            self.blocks = nn.ModuleList(Block(k) for k in range(BLOCKS))
            self.norm = Norm(HIDDEN)
            self.out = linear(HIDDEN, OUT, "out")

        def forward(self, x):
            h = self.inp(x)
            for b in self.blocks:
                h = b(h)
            return self.out(self.norm(h))

    return Net()


def _optimizer(opt: str, params):
    import torch

    return torch.optim.SGD(params, lr=SGD_LR) if opt == "sgd" else torch.optim.AdamW(params, **ADAMW)


def _reference(rank: int, world: int) -> dict:
    """One process, the eagerly built model (seed 0), the whole batch of both ranks per step."""
    import torch

    x, y = _data()
    out = {}
    for init, opt in itertools.product(("seeded", "own"), OPTIMIZERS):
        torch.manual_seed(0)  # the V17 runs' seed_everything(0)
        net = _net(init)
        o = _optimizer(opt, net.parameters())
        losses, norms = [], []
        for s in range(STEPS):
            rows = slice(s * WORLD * BATCH, (s + 1) * WORLD * BATCH)  # rank r's rows of step s: the r-th BATCH of them
            loss = torch.nn.functional.mse_loss(net(x[rows]), y[rows])
            o.zero_grad()
            loss.backward()
            clip = CLIP if opt == "adamw" else float("inf")
            norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), clip)))
            losses.append(float(loss))
            o.step()
        out[(init, opt)] = {"losses": losses, "norms": norms,
                    "weights": {n: p.detach().numpy().copy() for n, p in net.named_parameters()}}  # fmt: skip
    return out


def _fit(rank: int, name: str, opt: str, nvme: str) -> dict:
    import lightning as L
    import torch
    import torch.distributed as dist
    from lightning_v17.strategies import V17Strategy
    from torch.utils.data import DataLoader, Subset, TensorDataset

    from lightning_v17.config import OffloadPolicy, ZeroPolicy
    from lightning_v17.engine.offload.params import ParamOffload
    from lightning_v17.engine.zero.grad_norms import grad_norms

    init, offload = CASES[name]
    losses: list[float] = []
    norms: list[float] = []
    held: list[int] = []  # parameter bytes in memory whenever a unit went to the tier

    class Lit(L.LightningModule):
        def configure_model(self) -> None:
            if not hasattr(self, "net"):
                self.net = _net(init)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def on_before_optimizer_step(self, optimizer) -> None:  # before Lightning clips
            each = grad_norms(self, self.trainer.strategy.zero, 2.0).values()
            norms.append(float(torch.stack([v.double() for v in each]).square().sum().sqrt()))

        def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
            loss = outputs["loss"].detach().double().clone()
            dist.all_reduce(loss)
            losses.append(float(loss) / WORLD)

        def configure_optimizers(self):
            return _optimizer(opt, self.parameters())

    orig = ParamOffload._materialized

    def materialized(self, group) -> None:
        held.append(sum(r.storage().nbytes() for r in self.recs if not r.fp.sharded_param.is_meta))
        orig(self, group)

    ParamOffload._materialized = materialized
    x, y = _data()
    rows = [s * WORLD * BATCH + rank * BATCH + i for s in range(STEPS) for i in range(BATCH)]
    loader = DataLoader(Subset(TensorDataset(x, y), rows), batch_size=BATCH, shuffle=False)
    kw = {"zero": ZeroPolicy(stage=3, meta_init=True)}
    if offload is not None:
        kw["offload"] = OffloadPolicy(**offload, nvme_path=nvme)
    L.seed_everything(0, verbose=False)
    module = Lit()
    trainer = L.Trainer(accelerator="cpu", devices=WORLD, strategy=V17Strategy(**kw), max_steps=STEPS,
                        gradient_clip_val=CLIP if opt == "adamw" else None, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                        num_sanity_val_steps=0, limit_val_batches=0)  # fmt: skip
    try:
        trainer.fit(module, loader)
    finally:
        ParamOffload._materialized = orig
    units = [sum(p.to_local().numel() * 4 for p in b.parameters()) for b in module.net.blocks]
    shard = sum(p.to_local().numel() * 4 for p in module.parameters())
    weights = {n.removeprefix("net."): p.full_tensor().detach().numpy().copy() for n, p in module.named_parameters()}
    return {"losses": losses, "norms": norms, "weights": weights, "held": held, "unit_bytes": max(units),
            "root_bytes": shard - sum(units), "shard_bytes": shard, "left": sorted(os.listdir(nvme))}  # fmt: skip


def _refused(rank: int, nvme: str, free: int) -> dict:
    """The seeded_nvme AdamW run on a drive that reports ``free`` bytes free: the error, and whether a step ran."""
    import shutil

    from lightning_v17.config import V17ConfigError

    def written() -> int:  # what the tier's files hold now: no longer free on a real drive
        return sum(os.stat(os.path.join(d, f)).st_blocks * 512 for d, _, fs in os.walk(nvme) for f in fs)

    from lightning_v17.engine.zero import meta_init

    allocated = []  # the shards materialized (and streamed to the drive) before the refusal
    orig = meta_init._materialize_fsdp_param
    meta_init._materialize_fsdp_param = lambda fp, device: allocated.append(1) or orig(fp, device)
    real = shutil.disk_usage
    shutil.disk_usage = lambda path: real(path)._replace(free=free - written())
    try:
        _fit(rank, "seeded_nvme", "adamw", nvme)
        return {"error": None}
    except V17ConfigError as err:
        import torch.distributed as dist

        dist.barrier()  # both ranks' teardowns done: the tier folder is shared
        return {
            "error": str(err),
            "allocated": len(allocated),
            "left": sorted(
                os.path.relpath(os.path.join(d, f), nvme) for d, ds, fs in os.walk(nvme) for f in [*ds, *fs]
            ),
        }
    finally:
        shutil.disk_usage = real
        meta_init._materialize_fsdp_param = orig


def _fit_all(rank: int, world: int, tmp: str) -> dict:
    from lightning_v17.engine.offload.nvme import free_margin_bytes

    out = {}
    for name in CASES:
        for opt in OPTIMIZERS:
            nvme = os.path.join(tmp, f"{name}_{opt}")
            os.makedirs(nvme, exist_ok=True)
            out[(name, opt)] = _fit(rank, name, opt, nvme)
    # the drive holds one rank's bytes (each rank's own check passes) but not both ranks' (the host's check refuses)
    params = SHARD_BYTES
    for what, need in (("params", params), ("params+optimizer", 3 * params)):
        nvme = os.path.join(tmp, f"refused_{what}")
        os.makedirs(nvme, exist_ok=True)
        free = (free_margin_bytes(need) + free_margin_bytes(2 * need)) // 2
        out[("refused", what)] = _refused(rank, nvme, free) | {"free": free, "need": 2 * need}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    tmp = str(tmp_path_factory.mktemp("nvme_meta"))
    return {"ref": spawn(_reference, world_size=1, timeout=120)[0],
            "v17": spawn(_fit_all, world_size=WORLD, args=(tmp,), timeout=280, init_process_group=False)}  # fmt: skip


def _close(got: dict, want: dict, what: str) -> None:
    import torch

    assert got["losses"] == pytest.approx(want["losses"], rel=TOL, abs=TOL), what
    assert got["norms"] == pytest.approx(want["norms"], rel=TOL, abs=TOL), what
    assert got["weights"].keys() == want["weights"].keys(), what
    for n, w in got["weights"].items():
        torch.testing.assert_close(torch.as_tensor(w), torch.as_tensor(want["weights"][n]), rtol=TOL, atol=TOL,
                                   msg=f"{what}: {n}")  # fmt: skip


@pytest.mark.parametrize("opt", OPTIMIZERS)
@pytest.mark.parametrize("name", ["seeded_nvme", "seeded_cpu", "seeded_memory", "own_nvme"])
def test_meta_init_into_the_tier_trains_like_one_process(runs, name, opt) -> None:
    ref = runs["ref"][(CASES[name][0], opt)]
    assert len(set(ref["losses"])) == STEPS  # the weights moved every step
    if opt == "adamw":
        assert min(ref["norms"]) > CLIP  # the clipping changed every update
    for rank, got in enumerate(runs["v17"]):
        _close(got[(name, opt)], ref, f"{name} {opt} rank {rank}")


@pytest.mark.parametrize("opt", OPTIMIZERS)
def test_modules_own_init_equals_the_all_in_memory_run(runs, opt) -> None:
    for rank, got in enumerate(runs["v17"]):
        want = got[("own_memory", opt)]
        assert len(set(want["losses"])) == STEPS
        _close(got[("own_nvme", opt)], want, f"own init {opt} rank {rank}")


@pytest.mark.parametrize("name", ["seeded_nvme", "own_nvme"])
def test_units_stream_into_the_tier(runs, name) -> None:
    for got in runs["v17"]:
        got = got[(name, "sgd")]
        assert len(got["held"]) == BLOCKS + 1, got["held"]  # every unit and the root's group, each once
        # the unit being written, the earlier units' write-backs in flight (ParamOffload.release: at most 4 besides
        # the unit's own, here 2 units' weights) and the root's group (its input and output projections are
        # initialized first and last): not the rank's whole shard
        assert max(got["held"]) <= 3 * got["unit_bytes"] + got["root_bytes"] + 4 * 4096, got
        assert max(got["held"]) < 0.4 * got["shard_bytes"], got
        assert got["left"] == [], got["left"]  # the tier's files are gone after fit


@pytest.mark.parametrize("what", ["params", "params+optimizer"])
def test_a_drive_without_room_for_both_ranks_is_refused_before_training(runs, what) -> None:
    for got in runs["v17"]:
        got = got[("refused", what)]
        msg = got["error"]
        assert msg is not None, f"{what}: a drive with room for one rank's bytes only must be refused"
        assert "the 2 ranks on this host offload" in msg and "GiB free" in msg, msg
        assert "refused_" in msg, msg  # the path
        assert got["left"] == [], got["left"]  # no file left behind
        # the parameters alone: refused before the first shard is allocated and streamed to the drive
        assert (got["allocated"] == 0) == (what == "params"), got["allocated"]
