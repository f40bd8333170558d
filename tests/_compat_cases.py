"""The harness of the Lightning compatibility matrix: the model, the data, the Trainer scaffolding and the workers.

A case (``tests/_compat_catalogue.py``) builds one or more small Trainers through :func:`trainer` and returns what the
features it exercises produce (the losses, the parameters gathered whole, a suggestion, a logged norm, the kept
checkpoints) as ``{feature: observables}``. Every case runs under each V17 layout (:func:`run_layout`, one spawn per
layout) and under the references (:func:`run_reference`, one spawn): Lightning's ``"ddp"`` on the same 2 ranks, and
one process on the global batch (each rank of that spawn runs half of those cases with the launcher's variables
hidden). ``tests/_compat_matrix.py`` compares the observables and turns them into verdicts.

The model is a tiny reference Llama (2 blocks) with a pipeline layout and a tensor-parallel plan of its own, so one
LightningModule, written as a user writes one, runs under every layout. It trains with SGD and momentum (a gradient
off by a constant factor moves the weights off the reference; the momentum makes the optimizer state matter on
resume) and a per-step LR schedule.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

SHAPE = {"vocab_size": 64, "hidden": 32, "layers": 2, "heads": 4, "kv_heads": 2, "ffn": 64, "max_seq_len": 8}
SEQ = 8
ROWS = 4  # rows per step on each data rank; one process takes ROWS * dp, the global batch
DATASET = 512  # rows; a fixed dataset, so that every batch size reads the same rows in the same order
LR = 0.1
LR_DECAY = 0.9  # LambdaLR per step: the LR monitor and the checkpoint's scheduler state have something to show
SPIKE = 5.0  # the loss factor of the corrupt batch SpikeDetection must catch (rtol=2: a spike is >= 3x the mean)

#: name -> (V17Strategy keyword arguments, data-parallel size on 2 ranks)
LAYOUTS: dict[str, tuple[dict[str, Any], int]] = {
    "zero0": ({"zero_stage": 0}, 2),
    "zero1": ({"zero_stage": 1}, 2),
    "zero2": ({"zero_stage": 2}, 2),
    "zero3": ({"zero_stage": 3}, 2),
    "tp2": ({"tp": 2, "zero_stage": 3}, 1),
    "pp2": ({"pp": ("1f1b", 2), "zero_stage": 1}, 1),  # (schedule, microbatches): PipelinePolicy(size=2, ...)
}


def full(t: torch.Tensor) -> torch.Tensor:
    """A detached fp64 copy of ``t``, gathered whole when it is a DTensor (a collective: every rank calls it)."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().double().clone()


# ---------------------------------------------------------------------------------------------------- data and model
class Rows(torch.utils.data.Dataset):
    """DATASET rows of SEQ random token ids (each row from its own seed), labels already shifted, one document a row.

    ``scale`` multiplies the loss of each row: SPIKE for the rows in ``spike`` (a corrupt batch), else 1."""

    def __init__(self, *, seed: int = 0, spike: tuple[int, ...] = ()) -> None:
        self.seed, self.spike = seed, spike

    def __len__(self) -> int:
        return DATASET

    def __getitem__(self, i: int) -> dict:
        ids = torch.randint(0, SHAPE["vocab_size"], (SEQ + 1,), generator=torch.Generator().manual_seed(self.seed + i))
        return {"input_ids": ids[:-1], "labels": ids[1:], "position_ids": torch.arange(SEQ),
                "scale": torch.tensor(SPIKE if i in self.spike else 1.0)}  # fmt: skip


def global_order(epoch: int, dp: int) -> list[int]:
    """The training rows in the order the dp ranks together read them under Lightning's distributed sampler, which
    shuffles training data (torch's ``DistributedSampler``: a permutation seeded ``PL_GLOBAL_SEED + epoch``, rank r
    taking every dp-th row from r), as one process reads them: global batch b is the ranks' batches b in rank order."""
    seed = int(os.environ.get("PL_GLOBAL_SEED", "0")) + epoch
    perm = torch.randperm(DATASET, generator=torch.Generator().manual_seed(seed)).tolist()
    ranks = [perm[r::dp] for r in range(dp)]
    return [i for b in range(DATASET // (dp * ROWS)) for r in ranks for i in r[b * ROWS : (b + 1) * ROWS]]


class GlobalOrder(torch.utils.data.Sampler):
    """One process's sampler: :func:`global_order` of each epoch (Lightning calls ``set_epoch``, as on its own)."""

    def __init__(self, dp: int) -> None:
        self.dp, self.epoch = dp, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        return iter(global_order(self.epoch, self.dp))

    def __len__(self) -> int:
        return DATASET


def module_class() -> type:
    """``CompatLM``, built on first use (Lightning is imported in the ranks, not at collection)."""
    global _MODULE
    if _MODULE is not None:
        return _MODULE
    import lightning as L

    from lightning_v17.models.config import ModelConfig
    from lightning_v17.models.llama import Llama

    class CompatLM(L.LightningModule):
        """The tiny Llama as a user writes a LightningModule; every knob a case needs is a constructor argument."""

        def __init__(self, *, opt: str = "sgd", rows: int = ROWS, one_process: bool = False, probe: bool = False,
                     trainable_only: bool = False, sched: bool = True, spike: tuple[int, ...] = ()) -> None:  # fmt: skip
            super().__init__()
            self.lr = LR  # the attribute lr_find reads
            self.batch_size = rows  # the attribute scale_batch_size reads and sets
            self.opt, self.trainable_only, self.sched, self.spike = opt, trainable_only, sched, spike
            # one process reads the rows in the order the dp ranks of a distributed run read them together
            self.sampler = GlobalOrder(dp=rows // ROWS) if one_process else None
            self.model = Llama(ModelConfig(**SHAPE), init_seed=0)
            if probe:  # an auxiliary head used only at evaluation: training never calls it
                torch.manual_seed(1)
                self.probe = torch.nn.Linear(SHAPE["vocab_size"], 2)
            self.val_losses: list[torch.Tensor] = []
            self.record: dict[str, Any] = {}

        def forward(self, batch: dict) -> torch.Tensor:
            return self.model(batch["input_ids"], batch["position_ids"])

        def pipeline_loss(self, logits: torch.Tensor, batch: dict) -> torch.Tensor:
            """The loss of a batch (under pp, of one micro-batch): token-mean cross-entropy times the rows' scale."""
            ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch["labels"].reshape(-1))
            return ce * batch["scale"].float().mean()

        def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
            loss = self.pipeline_loss(self(batch), batch)
            self.log("train_loss", loss, sync_dist=True, batch_size=ROWS)
            return loss

        def validation_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
            logits = self(batch)
            loss = self.pipeline_loss(logits, batch)
            self.log("val_loss", loss, sync_dist=True, batch_size=ROWS)
            if hasattr(self, "probe"):
                self.log("val_probe", self.probe(logits.float()).mean(), sync_dist=True, batch_size=ROWS)
            return loss

        def test_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
            loss = self.pipeline_loss(self(batch), batch)
            self.log("test_loss", loss, sync_dist=True, batch_size=ROWS)
            return loss

        def predict_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
            logits = self(batch)
            return F.cross_entropy(logits.float().transpose(1, 2), batch["labels"], reduction="none").mean(1)

        # hooks that run under every layout (under pp the step methods above do not: the schedule runs the stages)
        def on_validation_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
            self.val_losses.append(outputs.detach().float().reshape(()))

        def on_validation_epoch_end(self) -> None:
            mine = torch.stack(self.val_losses)
            self.val_losses = []
            self.record.setdefault("all_gather", []).append(self.all_gather(mine).double())
            self.log("val_sync_mean", mine.mean(), sync_dist=True)

        def configure_optimizers(self) -> Any:
            params = [p for p in self.parameters() if p.requires_grad or not self.trainable_only]
            if self.opt == "adamw":
                # eps above fp32 reduction-order noise on near-zero gradients (tests/_strategy.py, PACKED_ADAMW)
                opt = torch.optim.AdamW(params, lr=1e-2, eps=1e-5, weight_decay=0.1)
            else:
                opt = torch.optim.SGD(params, lr=self.lr, momentum=0.9)
            if not self.sched:  # a finetuning callback adds param groups, which a LambdaLR built before refuses
                return opt
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: LR_DECAY**step)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(Rows(spike=self.spike), batch_size=self.batch_size, sampler=self.sampler)

        def val_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(Rows(seed=10_000), batch_size=ROWS)

        test_dataloader = predict_dataloader = val_dataloader

    _MODULE = CompatLM
    return CompatLM


_MODULE: Any = None


# ---------------------------------------------------------------------------------------------------- the harness
@dataclass
class Ctx:
    """Where a case runs: ``kind`` is "v17", "ddp" or "one" (one process on ``rows`` = the global batch)."""

    kind: str
    strategy: Any  # a zero-argument callable: a fresh strategy for each Trainer
    devices: int
    rows: int  # rows per step of this process's loader
    dp: int  # data-parallel ranks: the global batch is rows * dp
    tmp: str
    batches: int = 0  # batches the current entry point (fit, validate, test, predict, a tuner) has completed

    def batch_rows(self, batch: int) -> tuple[int, ...]:
        """The dataset rows of global batch ``batch`` of epoch 0, whichever process reads them."""
        g = self.rows * self.dp
        return tuple(global_order(0, g // ROWS)[batch * g : (batch + 1) * g])

    def module(self, cls: type | None = None, **kw: Any) -> Any:
        """A fresh CompatLM (or subclass ``cls``) for this context: one process reads the rows in the order of the
        distributed runs."""
        return (cls or module_class())(rows=self.rows, one_process=self.kind == "one", **kw)


def _world(ctx: Ctx) -> int:
    import torch.distributed as dist

    return dist.get_world_size() if ctx.kind != "one" and dist.is_initialized() else 1


def global_mean(value: float, ctx: Ctx) -> float:
    """The mean of ``value`` over the ranks (tp/pp ranks hold the same value; dp ranks their own halves)."""
    import torch.distributed as dist

    t = torch.tensor([float(value)], dtype=torch.float64)
    if _world(ctx) > 1:
        dist.all_reduce(t)
        t /= dist.get_world_size()
    return float(t)


def broadcast(obj: Any, ctx: Ctx) -> Any:
    """Rank 0's ``obj`` on every rank (for what Lightning computes on rank 0 only)."""
    import torch.distributed as dist

    if _world(ctx) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, 0)
    return box[0]


def trainer(ctx: Ctx, *, callbacks: list | None = None, losses: list[float] | None = None, **kw: Any) -> Any:
    """A small Trainer for ``ctx``: no progress bar, logger, checkpointing or summary unless the case asks.

    ``losses`` collects each step's loss, the mean over the data-parallel ranks (one process's global-batch loss)."""
    import lightning as L

    ctx.batches = 0

    class Record(L.Callback):
        def setup(self, trainer, pl_module, stage) -> None:
            ctx.batches = 0

        def teardown(self, trainer, pl_module, stage) -> None:
            ctx.batches = 0

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            ctx.batches += 1
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            if losses is not None and loss is not None:
                losses.append(global_mean(float(loss.detach()), ctx))

        def on_validation_batch_end(self, *args: Any, **kwargs: Any) -> None:
            ctx.batches += 1

        on_test_batch_end = on_predict_batch_end = on_validation_batch_end

    opts = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False,
            "num_sanity_val_steps": 0, "limit_val_batches": 2, "default_root_dir": ctx.tmp, **kw}  # fmt: skip
    return L.Trainer(accelerator="cpu", devices=ctx.devices, strategy=ctx.strategy(),
                     callbacks=[Record(), *(callbacks or [])], **opts)  # fmt: skip


def mem_logger() -> Any:
    """A logger that keeps what it is given, on every rank: ``.rows`` is ``[(step, {name: value})]``."""
    from lightning.pytorch.loggers import Logger

    class MemLogger(Logger):
        def __init__(self) -> None:
            super().__init__()
            self.rows: list[tuple[int | None, dict[str, float]]] = []

        name = property(lambda self: "mem")
        version = property(lambda self: 0)

        def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
            self.rows.append((step, {k: float(v) for k, v in metrics.items()}))

        def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
            pass

    return MemLogger()


def params(module: Any, ctx: Ctx) -> dict[str, torch.Tensor]:
    """Every parameter gathered whole; under pp each rank adds the stages it does not hold from the others."""
    import torch.distributed as dist

    mine = {n: full(p) for n, p in module.named_parameters()}
    if _world(ctx) == 1:
        return mine
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    for other in every:
        for n, t in other.items():
            mine.setdefault(n, t)
    return mine


def metrics(trainer: Any, *names: str) -> dict[str, float]:
    """The named ``trainer.callback_metrics`` as floats (a missing one is left out, so a comparison names it)."""
    return {n: float(trainer.callback_metrics[n]) for n in names if n in trainer.callback_metrics}


@contextmanager
def one_process_env():
    """A one-process Trainer inside a spawned rank: hide the launcher's variables, so Lightning sees no job, and be
    rank 0 for Lightning's ``rank_zero_only`` callbacks (ThroughputMonitor runs on rank 0 only)."""
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    keys = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
            "NODE_RANK")  # fmt: skip
    saved = {k: os.environ.pop(k) for k in keys if k in os.environ}
    rank, rank_zero_only.rank = getattr(rank_zero_only, "rank", 0), 0
    try:
        yield
    finally:
        os.environ.update(saved)
        rank_zero_only.rank = rank


# ---------------------------------------------------------------------------------------------------- the workers
def layout_strategy(layout: str) -> Any:
    from datetime import timedelta

    from lightning_v17.strategies import V17Strategy

    from lightning_v17.config import PipelinePolicy

    kw = dict(LAYOUTS[layout][0])
    if "pp" in kw:
        schedule, micro = kw["pp"]
        kw["pp"] = PipelinePolicy(size=2, schedule=schedule, microbatches=micro)
    # a rank that failed alone leaves its peer in a collective: a short timeout turns that hang into an error
    return V17Strategy(**kw, timeout=timedelta(seconds=20))


def error_info(err: BaseException, ctx: Ctx) -> dict:
    """What the matrix needs of a failure: its type and message, the traceback's last lines, and whether the entry
    point that raised it had completed a batch (a refusal comes before the first)."""
    import traceback

    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    from lightning_v17.config import V17ConfigError

    tb = "".join(traceback.format_exception(err)).strip().splitlines()
    return {"type": type(err).__name__, "message": str(err), "tb": tb[-14:], "batches": ctx.batches,
            "config_error": isinstance(err, (V17ConfigError, MisconfigurationException))}  # fmt: skip


def attempt(fn: Callable[[], Any], ctx: Ctx) -> Any:
    """``fn()``, or ``{ERROR: error_info}`` when it raises (one feature of a case that exercises several)."""
    try:
        return fn()
    except Exception as err:  # noqa: BLE001 - the matrix judges it
        return {ERROR: error_info(err, ctx)}


ERROR = "__error__"


def _run(case: Any, ctx: Ctx) -> dict:
    """``{"ok": {feature: observables}}`` or ``{"error": error_info}``, and the seconds it took."""
    import time

    t0, c0 = time.perf_counter(), time.process_time()
    try:
        out: dict[str, Any] = {"ok": case(ctx)}
    except BaseException as err:  # noqa: BLE001 - every failure is a verdict
        out = {"error": error_info(err, ctx)}
    out["seconds"], out["cpu_seconds"] = time.perf_counter() - t0, time.process_time() - c0
    return out


def _in_step(ctx: Ctx) -> bool:
    """After a case, whether every rank finished the same case (a rank that failed alone may leave a peer behind)."""
    import torch.distributed as dist

    if _world(ctx) == 1:
        return True
    try:
        flag = torch.ones(1)
        dist.all_reduce(flag)
        return int(flag) == dist.get_world_size()
    except Exception:  # noqa: BLE001 - a broken group: the remaining cases cannot run
        return False


def run_layout(rank: int, world: int, layout: str, tmp: str, start: int = 0) -> dict:
    """The cases from ``start`` on under ``V17Strategy`` with ``layout``: ``{case: _run's result}``. It stops after a
    case that left the ranks unable to communicate (one rank failed alone, its peer timed out): the caller spawns
    again from the next case."""
    import warnings

    from tests._compat_catalogue import CASES

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    os.environ["PL_GLOBAL_SEED"] = "0"  # the distributed sampler's seed, which global_order reproduces
    dp = LAYOUTS[layout][1]
    out: dict[str, Any] = {}
    for case in CASES[start:]:
        d = os.path.join(tmp, layout, case.__name__)
        os.makedirs(d, exist_ok=True)
        if rank == 0:  # which case a spawn that died was running
            with open(os.path.join(tmp, layout, "running"), "w") as f:
                f.write(case.__name__)
        ctx = Ctx("v17", lambda: layout_strategy(layout), world, ROWS, dp, d)
        out[case.__name__] = _run(case, ctx)
        if not _in_step(ctx):
            break
    return out


def run_reference(rank: int, world: int, tmp: str) -> dict:
    """The references on this rank: ``{"one": {(case, rows): ...}, "ddp": {case: ...}}``. Each rank runs half of the
    one-process cases alone (the launcher's variables hidden), then every case under ``"ddp"`` with the other rank."""
    import warnings

    from tests._compat_catalogue import CASES

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    os.environ["PL_GLOBAL_SEED"] = "0"
    out: dict[str, Any] = {"one": {}, "ddp": {}}
    jobs = [(case, rows) for case in CASES for rows in case.one_rows]
    for i, (case, rows) in enumerate(jobs):
        if i % world == rank:
            d = os.path.join(tmp, f"one{rows}", case.__name__)
            os.makedirs(d, exist_ok=True)
            with one_process_env():
                out["one"][(case.__name__, rows)] = _run(case, Ctx("one", lambda: "auto", 1, rows, 1, d))
    for case in CASES:
        if not case.ddp:
            continue
        d = os.path.join(tmp, "ddp", case.__name__)
        os.makedirs(d, exist_ok=True)
        ctx = Ctx("ddp", lambda s=case.ddp: s, world, ROWS, world, d)
        out["ddp"][case.__name__] = _run(case, ctx)
        if not _in_step(ctx):
            break
    return out
