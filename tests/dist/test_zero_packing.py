"""ZeRO-1/2 bucket packing (issue 16, lightning_v17/engine/zero/comm.py), checked bit for bit on 2 gloo ranks.

Against an independent reference built from plain ``torch.distributed.all_gather`` of each rank's raw gradients:

* the reduced gradients are exactly ``sum_r cast(g_r) / dp`` (the mean folded into the packing copy gives the bits
  of "cast, then divide"), at stage 1 (full gradients) and stage 2 (this rank's rows), fp32 and bf16 reduction, over
  parameters whose rows do not divide evenly by the world size (padding) and a scalar;
* stage 1's gradients are views of the reduced bucket (no copy back), one storage per bucket;
* after ``optimizer.step()`` + ``gather_params()`` every parameter equals a full, unsharded AdamW step on the
  reference gradients, bit for bit, on both ranks;
* the all-gather copies back only the other ranks' rows: this rank's rows are left as they are.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from tests._dist import spawn


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 5)  # weight rows 5 over 2 ranks: 3 + 2 (one padding row on rank 1)
        self.b = nn.Linear(5, 3)  # 3 rows: 2 + 1
        self.scale = nn.Parameter(torch.tensor(1.5))  # a scalar: rank 1 owns no rows
        self.c = nn.Linear(3, 2)  # even rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x))) * self.scale))


def _case(rank: int, world: int, stage: int, reduce_dtype: torch.dtype | None) -> dict:
    import torch.distributed as dist

    from lightning_v17.engine.zero.stages_0_2 import ZeroEngine

    torch.manual_seed(0)
    model = _Net()
    ref = copy.deepcopy(model)
    engine = ZeroEngine(model, stage=stage, shard_group=dist.group.WORLD, bucket_mb=2e-5, reduce_dtype=reduce_dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    engine.shard_optimizer(opt)
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(100 + rank))
    model(x).square().mean().backward()

    ref(x).square().mean().backward()
    rd = reduce_dtype or torch.float32
    want = {}
    for n, p in ref.named_parameters():
        parts = [torch.empty_like(p.grad) for _ in range(world)]
        dist.all_gather(parts, p.grad)
        total = parts[0].to(rd) / world
        for g in parts[1:]:
            total = total + g.to(rd) / world
        want[n] = total.to(p.dtype)
        p.grad = want[n].clone()

    out = {"buckets": len(engine.buckets), "grad_ok": [], "storages": set()}
    by_name = {e.fqn: e for e in engine.params}
    for n, w in want.items():
        e = by_name[n]
        if stage == 1:
            out["grad_ok"].append((n, torch.equal(e.param.grad, w)))
            out["storages"].add((engine.bucket_of[id(e.param)], e.param.grad.untyped_storage().data_ptr()))
        elif e.shard is not None:
            rows = w.reshape(1, -1) if w.dim() == 0 else w.reshape(w.shape[0], -1)
            out["grad_ok"].append((n, torch.equal(e.shard.grad, rows[e.start : e.stop].reshape(e.shard.shape))))
    opt.step()
    engine.gather_params()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1)
    ref_opt.step()
    out["param_ok"] = [(n, torch.equal(p, dict(ref.named_parameters())[n])) for n, p in model.named_parameters()]
    engine.remove()
    return out


def _local_rows_untouched(rank: int, world: int) -> list:
    """Start a bucket's all-gather, overwrite this rank's rows, wait: those rows must keep the new values (not be
    copied back from the receive buffer) and the other ranks' rows must be the peer's."""
    import torch.distributed as dist

    from lightning_v17.engine.zero.stages_0_2 import ZeroEngine
    from lightning_v17.engine.zero.comm import gather_bucket

    torch.manual_seed(0)
    model = _Net()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(rank + 1))  # rank r's values are r + 1 everywhere
    engine = ZeroEngine(model, stage=1, shard_group=dist.group.WORLD, bucket_mb=1.0)
    checks = []
    for b in engine.buckets:
        pending = gather_bucket(b, world=world, rank=rank, group=dist.group.WORLD)
        for e in b.params:
            with torch.no_grad():
                _rows_of(e.param)[e.start : e.stop] = -7.0
        pending.wait()
        for e in b.params:
            rows = _rows_of(e.param)
            for r in range(world):
                lo = min(r * e.padded_rows, e.rows)
                hi = min(lo + e.padded_rows, e.rows)
                want = -7.0 if r == rank else float(r + 1)
                checks.append((e.fqn, r, bool((rows[lo:hi] == want).all())))
    engine.remove()
    return checks


def _rows_of(p: torch.Tensor) -> torch.Tensor:
    t = p.detach()
    return t.reshape(1, -1) if t.dim() == 0 else t.reshape(t.shape[0], -1)


def _worker(rank: int, world: int) -> dict:
    out = {(s, rd): _case(rank, world, s, rd) for s in (1, 2) for rd in (None, torch.bfloat16)}
    out["local_rows"] = _local_rows_untouched(rank, world)
    return out


def test_zero12_packing_is_bitwise_and_gradients_are_bucket_views() -> None:
    results = spawn(_worker, world_size=2, timeout=180)
    for rank, res in enumerate(results):
        for (stage, rd), out in ((k, v) for k, v in res.items() if k != "local_rows"):
            assert out["buckets"] >= 3, out["buckets"]
            assert out["grad_ok"] and all(ok for _, ok in out["grad_ok"]), (rank, stage, rd, out["grad_ok"])
            assert all(ok for _, ok in out["param_ok"]), (rank, stage, rd, out["param_ok"])
            if stage == 1 and rd is None:  # one storage per bucket: the gradients are views of the reduced bucket
                assert len(out["storages"]) == out["buckets"], out["storages"]
                assert len({b for b, _ in out["storages"]}) == out["buckets"]
        bad = [c for c in res["local_rows"] if not c[2]]
        assert res["local_rows"] and not bad, (rank, bad)
