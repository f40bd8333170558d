"""V17Strategy ZeRO stages 0-3 on 2 gloo ranks inside a real Lightning Trainer, against a single-process reference.

One spawned pair of ranks runs every configuration (a Trainer per case) to keep the suite fast; the test functions
then check the collected results. The reference is a plain PyTorch loop in the test process (no Lightning, no
lightning_v17 code), over the same global batches.

Tolerances: fp32 losses 1e-5 relative, final parameters 1e-5 (max abs diff relative to max abs value);
bf16-mixed: see ``BF16_LOSS_RTOL`` / ``BF16_PARAM_TOL`` and ``test_bf16_mixed_parity``.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from torch import nn

from tests._dist import spawn

#: the compositions this file checks against one process (docs/gen_layouts.py builds docs/layouts.md from them)
COMPOSES = (("zero1", "accumulation"), ("zero2", "accumulation"), ("zero3", "accumulation"),
            ("zero3", "offload_params"))  # fmt: skip

VOCAB, HIDDEN, SEQ, PER_RANK_BATCH, STEPS, LR = 32, 16, 8, 4, 5, 1e-2
WORLD = 2
# bf16-mixed against the 1-process bf16-mixed reference (measured, 5 AdamW steps: losses <= 1.3e-4 (stage 2) and
# 2.8e-4 (stage 3, FSDP2 computes with bf16 parameters) relative; parameters, ||got - ref|| / ||ref - init|| per
# tensor: 1.6e-2 and 5.2e-2). A run that never steps misses by ~1e-2 (losses) and exactly 1.0 (parameters).
BF16_LOSS_RTOL, BF16_PARAM_TOL = 1e-3, 0.25


class Block(nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.fc1 = nn.Linear(HIDDEN, 2 * HIDDEN)
        self.fc2 = nn.Linear(2 * HIDDEN, HIDDEN)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x)))))


class TinyLM(nn.Module):
    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Block(dropout) for _ in range(2))
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


def make_model(seed: int = 0, dropout: float = 0.0) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(dropout)


def make_data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    x = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return x, y


def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB).float(), y.reshape(-1))


def make_optimizer(params, lr: float = LR) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.1, betas=(0.9, 0.95))


# ---------------------------------------------------------------------------------------------- reference (1 process)
@functools.cache  # each reference is shared by several tests
def reference(*, accum: int = 1, clip: float | None = None, bf16: bool = False, lr: float = LR) -> dict:
    """``lr=0`` is the run that never moves its parameters (a negative control: no optimizer step)."""
    model = make_model()
    opt = make_optimizer(model.parameters(), lr=lr)
    x, y = make_data(STEPS * accum * WORLD * PER_RANK_BATCH)
    gb = WORLD * PER_RANK_BATCH
    losses, norms = [], []
    for step in range(STEPS):
        opt.zero_grad()
        for m in range(accum):
            i = (step * accum + m) * gb
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = loss_fn(model(x[i : i + gb]), y[i : i + gb])
            (loss / accum).backward()
            losses.append(loss.item())
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        opt.step()
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}, "norms": norms}


# ---------------------------------------------------------------------------------------------- distributed worker
def _storage_bytes(tensors, seen: set) -> int:
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        if t is None:
            continue
        if isinstance(t, DTensor):
            t = t.to_local()
        s = t.untyped_storage()
        if s.data_ptr() in seen or s.nbytes() == 0:
            continue
        seen.add(s.data_ptr())
        total += s.nbytes()
    return total


def _memory(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Per-rank bytes of params, grads and optimizer state, each storage counted once (across all three buckets)."""
    seen: set = set()
    params = list(module.parameters())
    opt_params = [p for g in optimizer.param_groups for p in g["params"]]
    p_bytes = _storage_bytes(params, seen)
    g_bytes = _storage_bytes([p.grad for p in params] + [p.grad for p in opt_params], seen)
    states = [v for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
    o_bytes = _storage_bytes(states, seen)
    return {"param": p_bytes, "grad": g_bytes, "optimizer": o_bytes}


def _lit_cls(make_opt=None):
    """The LightningModule of these tests: TinyLM, per-rank losses and storage-counted memory recorded each batch,
    ``make_opt`` (default :func:`make_optimizer`) over its parameters."""
    import lightning as L

    class LitTiny(L.LightningModule):
        def __init__(self, dropout: float = 0.0) -> None:
            super().__init__()
            self.model = make_model(dropout=dropout)
            self.losses: list[float] = []
            self.memory: dict | None = None
            self.linear_dtypes: set[str] = set()  # the dtype every nn.Linear really produced

        def on_train_start(self) -> None:
            for m in self.modules():
                if isinstance(m, nn.Linear):  # FSDP2's wrapped classes subclass nn.Linear
                    m.register_forward_hook(lambda _m, _i, out: self.linear_dtypes.add(str(out.dtype)))

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = loss_fn(self.model(x), y)
            self.losses.append(loss.detach().float().item())
            return loss

        def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
            self.memory = _memory(self, self.trainer.optimizers[0])

        def configure_optimizers(self):
            return (make_opt or make_optimizer)(self.parameters())

    return LitTiny


def _full_params(module: nn.Module) -> dict:
    from torch.distributed.tensor import DTensor

    out = {}
    for n, p in module.named_parameters():
        out[n.removeprefix("model.")] = (
            (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().numpy().copy()
        )
    return out  # numpy, not tensors: torch would pass tensors through shared memory that dies with the rank


def RANK() -> int:
    import os

    return int(os.environ["RANK"])


def _fit(case: dict) -> dict:
    import lightning as L
    import torch.distributed as dist
    from lightning_v17.strategies import V17Strategy
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from lightning_v17.config import OffloadPolicy, ZeroPolicy

    accum = case.get("accum", 1)
    model = _lit_cls()(dropout=case.get("dropout", 0.0))
    x, y = make_data(STEPS * accum * WORLD * PER_RANK_BATCH)
    # Lightning's automatic DistributedSampler always shuffles training data; use an unshuffled one so that rank r's
    # k-th batch is samples {8k + r, 8k + r + 2, ...} and the union over ranks is the reference's k-th batch.
    ds = TensorDataset(x, y)
    sampler = DistributedSampler(
        ds, num_replicas=WORLD, rank=dist.get_rank() if dist.is_initialized() else RANK(), shuffle=False
    )
    loader = DataLoader(ds, batch_size=PER_RANK_BATCH, sampler=sampler)
    strategy = V17Strategy(
        zero=ZeroPolicy(stage=case["stage"], bucket_mb=case.get("bucket_mb", 25.0)),
        activation_checkpointing=case.get("recompute", "none"),
        dp_replicate=case.get("dp_replicate", 1),
        offload=OffloadPolicy(params=case.get("offload_params", "none")),
    )
    torch.manual_seed(99)  # dropout masks: same stream for every case on this rank
    trainer = L.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=strategy,
        max_steps=STEPS,
        accumulate_grad_batches=accum,
        gradient_clip_val=case.get("clip"),
        precision=case.get("precision", "32-true"),
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, loader)
    losses = torch.tensor(model.losses)
    dist.all_reduce(losses)  # mean over the 2 ranks = the loss of the global batch (equal sizes)
    return {
        "losses": (losses / WORLD).tolist(), "params": _full_params(model), "memory": model.memory,
        "dtypes": sorted(model.linear_dtypes),
    }  # fmt: skip


CASES = {
    "s0": {"stage": 0},
    "s1": {"stage": 1},
    "s2": {"stage": 2},
    "s3": {"stage": 3},
    "s1_small_buckets": {"stage": 1, "bucket_mb": 0.001},
    "s2_small_buckets": {"stage": 2, "bucket_mb": 0.001},
    "s2_hsdp": {"stage": 2, "dp_replicate": 2},
    "s3_hsdp": {"stage": 3, "dp_replicate": 2},
    "s3_offload_params_cpu": {"stage": 3, "offload_params": "cpu"},  # FSDP2 CPUOffloadPolicy, unpinned on CPU
    "s1_accum": {"stage": 1, "accum": 2},
    "s2_accum": {"stage": 2, "accum": 2},
    "s3_accum": {"stage": 3, "accum": 2},
    "s1_clip": {"stage": 1, "clip": 0.05},
    "s2_clip": {"stage": 2, "clip": 0.05},
    "s3_clip": {"stage": 3, "clip": 0.05},
    "s2_drop": {"stage": 2, "dropout": 0.2},
    "s2_drop_full": {"stage": 2, "dropout": 0.2, "recompute": "full"},
    "s2_drop_selective": {"stage": 2, "dropout": 0.2, "recompute": "selective"},
    "s3_drop": {"stage": 3, "dropout": 0.2},
    "s3_drop_full": {"stage": 3, "dropout": 0.2, "recompute": "full"},
    "s3_drop_selective": {"stage": 3, "dropout": 0.2, "recompute": "selective"},
    "s2_bf16": {"stage": 2, "precision": "bf16-mixed"},
    "s3_bf16": {"stage": 3, "precision": "bf16-mixed"},
}


def _worker(rank: int, world_size: int) -> dict:
    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    out = {name: _fit(case) for name, case in CASES.items()}
    return out if rank == 0 else {k: {"memory": v["memory"], "dtypes": v["dtypes"]} for k, v in out.items()}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return spawn(_worker, world_size=WORLD, timeout=400, init_process_group=False)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def _assert_params_close(got: dict, want: dict, tol: float) -> None:
    assert got.keys() == want.keys()
    for n, w in want.items():
        w = torch.as_tensor(w)
        scale = w.abs().max().item() or 1.0
        err = (torch.as_tensor(got[n]) - w).abs().max().item() / scale
        assert err <= tol, f"{n}: max abs diff / max abs = {err:.3e} > {tol}"


@pytest.mark.timeout(500)
@pytest.mark.parametrize(
    "name", ["s0", "s1", "s2", "s3", "s1_small_buckets", "s2_small_buckets", "s2_hsdp", "s3_hsdp", "s3_offload_params_cpu"]
)
def test_stage_parity_fp32(results: list[dict], name: str) -> None:
    ref = reference()
    got = results[0][name]
    assert len(got["losses"]) == STEPS
    for a, b in zip(got["losses"], ref["losses"]):
        assert _rel(a, b) <= 1e-5, (got["losses"], ref["losses"])
    _assert_params_close(got["params"], ref["params"], 1e-5)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_grad_accumulation_parity(results: list[dict], stage: int) -> None:
    ref = reference(accum=2)
    got = results[0][f"s{stage}_accum"]
    assert len(got["losses"]) == 2 * STEPS
    for a, b in zip(got["losses"], ref["losses"]):
        assert _rel(a, b) <= 1e-5
    _assert_params_close(got["params"], ref["params"], 1e-5)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_global_norm_clipping_parity(results: list[dict], stage: int) -> None:
    ref = reference(clip=0.05)
    assert min(ref["norms"]) > 0.05 * 2, "max_norm must be small enough that every step clips"
    unclipped = reference()
    got = results[0][f"s{stage}_clip"]
    for a, b in zip(got["losses"], ref["losses"]):
        assert _rel(a, b) <= 1e-5
    _assert_params_close(got["params"], ref["params"], 1e-5)
    # and clipping changed the result (so a per-shard norm, or no clipping, would have been caught)
    diff = max((torch.as_tensor(got["params"][n]) - unclipped["params"][n]).abs().max().item() for n in got["params"])
    assert diff > 1e-4


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recompute_with_dropout_matches_no_recompute(results: list[dict], stage: int, mode: str) -> None:
    base = results[0][f"s{stage}_drop"]
    got = results[0][f"s{stage}_drop_{mode}"]
    assert got["losses"] == pytest.approx(base["losses"], rel=1e-6)
    _assert_params_close(got["params"], base["params"], 1e-6)
    # dropout really was on: the losses differ from the dropout-free run
    assert max(_rel(a, b) for a, b in zip(base["losses"], results[0][f"s{stage}"]["losses"])) > 1e-3


def _bf16_mismatches(got: dict, ref: dict) -> list[str]:
    """Where ``got`` leaves the bf16 tolerances around ``ref`` (empty: it matches). Parameters are compared relative to
    the reference's own update: ``||got - ref|| / ||ref - init||`` per tensor, so a run that never steps scores 1."""
    init = {n: p.detach() for n, p in make_model().named_parameters()}
    bad = [f"loss {i}: {a} vs {b}" for i, (a, b) in enumerate(zip(got["losses"], ref["losses"], strict=True))
           if _rel(a, b) > BF16_LOSS_RTOL]  # fmt: skip
    for n, w in ref["params"].items():
        err = (torch.as_tensor(got["params"][n]) - w).norm().item() / (w - init[n]).norm().item()
        if err > BF16_PARAM_TOL:
            bad.append(f"{n}: ||got - ref|| / ||ref - init|| = {err:.3e}")
    return bad


@pytest.mark.parametrize("stage", [2, 3])
def test_bf16_mixed_parity(results: list[dict], stage: int) -> None:
    ref = reference(bf16=True)
    got = results[0][f"s{stage}_bf16"]
    # every Linear really ran in bf16 (an fp32 run is within the numeric tolerances below: at this size the fp32
    # and bf16 references differ by only ~1e-4 in the losses, 5.8e-2 in the parameters; this check catches it)
    for rank, res in enumerate(results):
        assert res[f"s{stage}_bf16"]["dtypes"] == ["torch.bfloat16"], (rank, res[f"s{stage}_bf16"]["dtypes"])
    assert len(got["losses"]) == STEPS
    bad = _bf16_mismatches(got, ref)
    assert not bad, bad
    # negative controls: a run that never takes an optimizer step fails both the loss and every parameter check
    # (losses by >= 5e-3 relative from step 1 on, parameters by exactly 1.0), and the fp32 run's Linears report fp32
    nostep = _bf16_mismatches(reference(bf16=True, lr=0.0), ref)
    assert sum(b.startswith("loss") for b in nostep) == STEPS - 1, nostep
    assert sum(not b.startswith("loss") for b in nostep) == len(ref["params"]), nostep
    assert results[0][f"s{stage}"]["dtypes"] == ["torch.float32"]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_memory_matches_planner(results: list[dict], stage: int) -> None:
    from lightning_v17.config import ZeroPolicy

    memory = pytest.importorskip("lightning_v17.planner.memory", reason="planner.memory not written yet")
    num_params = sum(p.numel() for p in make_model().parameters())
    want = memory.model_state_bytes_per_rank(
        num_params, zero=ZeroPolicy(stage=stage), dp=WORLD, param_bytes=4.0, grad_bytes=4.0, optimizer_bytes=8.0
    )
    for rank, res in enumerate(results):
        got = res[f"s{stage}"]["memory"]
        for bucket in ("param", "grad", "optimizer"):
            w = getattr(want, bucket)
            assert math.isclose(got[bucket], w, rel_tol=0.05), f"rank {rank} {bucket}: {got[bucket]} vs planner {w}"
