"""Communication/compute overlap on gloo (issue 16): ZeRO-3 prefetch + deferred reduce-scatters, ZeRO-1/2 buckets.

Each test runs the same model twice in one spawned pair of ranks, overlap on and off, and checks

* the fp32 losses and final parameters are *bitwise* equal on and off (overlap only moves when a collective runs,
  never what it computes), and equal a single-process run over the same global batches at 1e-5;
* the overlap really happens, from the recorded order of events on rank 0: collective issues and completions
  (wrappers around :mod:`lightning_v17.engine.collectives` / ``torch.distributed``) interleaved with markers that
  an autograd function in each block records when the block's forward starts, its backward starts and its backward
  ends. With overlap off the same assertions fail (they are checked on the off run too, negated).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from tests._dist import spawn

# lr 1e-3: Adam normalizes away the gradient's scale, so at 1e-2 a last-bit difference of a tiny gradient (the mean
# of two ranks' halves vs one batch) moves a weight by ~1e-3 lr: 8.7e-6 here, over the 1e-5 relative tolerance
VOCAB, HIDDEN, SEQ, PER_RANK, STEPS, LR, BLOCKS = 64, 32, 8, 4, 3, 1e-3, 4
# parameters against one process: the same effect at lr 1e-3 is 1.3e-5 relative (layers.2.fc1.weight) with torch's
# AVX512 kernels on an Intel Xeon (AMX), under 1e-5 with the AVX2 ones; a lost reduction or an unsynced rank is ~lr
PARAM_RTOL = 5e-5
WORLD = 2


class _Mark(torch.autograd.Function):
    """Identity that appends ``fwd`` in forward and ``bwd`` to the module-level ``EVENTS`` in backward."""

    @staticmethod
    def forward(ctx, x, fwd, bwd):
        ctx.bwd = bwd
        if fwd is not None:
            EVENTS.append(fwd)
        return x.clone()  # not a view: FSDP2 warns about views returned by its modules

    @staticmethod
    def backward(ctx, g):
        EVENTS.append(ctx.bwd)
        return g, None, None


EVENTS: list[tuple] = []


class Block(nn.Module):
    def __init__(self, i: int) -> None:
        super().__init__()
        self.i = i
        self.norm = nn.LayerNorm(HIDDEN)
        self.fc1 = nn.Linear(HIDDEN, 2 * HIDDEN)
        self.fc2 = nn.Linear(2 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _Mark.apply(x, ("fwd", self.i), ("bwd_end", self.i))  # its backward runs when this block's backward ends
        y = x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))
        return _Mark.apply(y, None, ("bwd_start", self.i))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Block(i) for i in range(BLOCKS))
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


def _model() -> Net:
    torch.manual_seed(0)
    return Net()


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    n = STEPS * WORLD * PER_RANK
    return torch.randint(0, VOCAB, (n, SEQ), generator=g), torch.randint(0, VOCAB, (n, SEQ), generator=g)


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


def _opt(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1)


def _reference() -> dict:
    model, (x, y) = _model(), _data()
    opt, gb, losses = _opt(model.parameters()), WORLD * PER_RANK, []
    for s in range(STEPS):
        opt.zero_grad()
        loss = _loss(model(x[s * gb : (s + 1) * gb]), y[s * gb : (s + 1) * gb])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _rank_rows(step: int, rank: int) -> slice:
    start = step * WORLD * PER_RANK + rank * PER_RANK
    return slice(start, start + PER_RANK)


def _mean_over_ranks(loss: torch.Tensor) -> float:
    import torch.distributed as dist

    t = loss.detach().clone()
    dist.all_reduce(t)
    return (t / dist.get_world_size()).item()


# ------------------------------------------------------------------------------------------------------- ZeRO-3
def _trace_collectives(events: list) -> None:
    """Record every all-gather issue (with its async flag), and each reduce-scatter's issue and completion."""
    import lightning_v17.engine.collectives as C

    ag, rs, wait = C.all_gather, C.reduce_scatter, C.PendingReduceScatter.wait
    counter = iter(range(10**9))

    def all_gather(out, inp, **kw):
        events.append(("ag", bool(kw.get("async_op"))))
        return ag(out, inp, **kw)

    def reduce_scatter(out, inp, **kw):
        tag = next(counter)
        events.append(("rs_start", tag))
        res = rs(out, inp, **kw)
        if res is None:  # synchronous: already finished
            events.append(("rs_done", tag))
        else:
            res._tag = tag
        return res

    def pending_wait(self):
        if self._work is not None and hasattr(self, "_tag"):
            events.append(("rs_done", self._tag))
        return wait(self)

    C.all_gather, C.reduce_scatter, C.PendingReduceScatter.wait = all_gather, reduce_scatter, pending_wait


def _zero3_run(rank: int, overlap: bool, prefetch: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_v17.engine.zero.fsdp import apply_fsdp

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp_shard",))
    root = nn.Module()
    root.net = _model()  # the shape the strategy sees: a LightningModule holding the model
    apply_fsdp(root, mesh=mesh, overlap_comm=overlap, prefetch_units=prefetch)
    opt = _opt(root.parameters())
    x, y = _data()
    losses, traces = [], []
    for s in range(STEPS):
        EVENTS.clear()
        opt.zero_grad()
        loss = _loss(root.net(x[_rank_rows(s, rank)]), y[_rank_rows(s, rank)])
        loss.backward()
        opt.step()
        traces.append(list(EVENTS))
        losses.append(_mean_over_ranks(loss))
    params = {n: p.full_tensor() for n, p in root.named_parameters()}
    return {"losses": losses, "params": {n.removeprefix("net."): p for n, p in params.items()}, "trace": traces[-1]}


def _zero3_worker(rank: int, world: int) -> dict:
    _trace_collectives(EVENTS)
    return {"on": _zero3_run(rank, True, 1), "off": _zero3_run(rank, False, 1), "deep": _zero3_run(rank, True, 2)}


def _count_before(trace: list, kind: str, marker: tuple, pred=lambda e: True) -> int:
    """How many events of ``kind`` (satisfying ``pred``) precede ``marker`` in ``trace``."""
    end = trace.index(marker)
    return sum(1 for e in trace[:end] if e[0] == kind and pred(e))


def _prefetched_ahead(trace: list, depth: int) -> bool:
    """Forward: before block i computes, the all-gathers of the root, blocks 0..i and the next ``depth`` blocks were
    issued, the prefetched ones asynchronously. Backward: before block i's backward starts, block i-1's all-gather
    (and the next depth-1) were issued asynchronously (the last block stays gathered from forward to backward)."""
    fwd_ok = all(
        _count_before(trace, "ag", ("fwd", i)) >= 1 + min(BLOCKS, i + 1 + depth)
        and _count_before(trace, "ag", ("fwd", i), lambda e: e[1]) >= min(BLOCKS, i + 1 + depth)
        for i in range(BLOCKS)
    )
    n_fwd = 1 + BLOCKS
    bwd_ok = all(
        sum(1 for e in trace[n_fwd_index(trace, n_fwd) : trace.index(("bwd_start", i))] if e[0] == "ag" and e[1])
        >= min(BLOCKS - 1, BLOCKS - i - 1 + depth)
        for i in range(BLOCKS - 1, 0, -1)
    )
    return fwd_ok and bwd_ok


def n_fwd_index(trace: list, n: int) -> int:
    """Index just after the ``n``-th all-gather (the end of the forward all-gathers)."""
    seen = 0
    for k, e in enumerate(trace):
        if e[0] == "ag":
            seen += 1
            if seen == n:
                return k + 1
    raise AssertionError(f"fewer than {n} all-gathers in {trace}")


def _reduce_scatters_overlap(trace: list) -> bool:
    """Block i's reduce-scatter (issued when its backward ended) finishes only after block i-1's backward started,
    for every block but the first."""
    starts = [(k, e[1]) for k, e in enumerate(trace) if e[0] == "rs_start"]
    done = {e[1]: k for k, e in enumerate(trace) if e[0] == "rs_done"}
    ok = []
    for k, tag in starts:
        later_compute = [j for j, e in enumerate(trace) if e[0] == "bwd_start" and j > k]
        ok.append(bool(later_compute) and done[tag] > later_compute[0])
    return len(ok) >= BLOCKS and sum(ok) >= BLOCKS - 1


@functools.cache
def _results() -> dict:
    """One spawned pair of ranks runs every configuration of both tests (a spawn costs more than the runs)."""
    return spawn(_worker, world_size=WORLD, timeout=240)[0]


def _worker(rank: int, world: int) -> dict:
    return {"zero3": _zero3_worker(rank, world), "zero12": _zero12_worker(rank, world)}


def test_zero3_overlap_is_bitwise_and_really_overlaps() -> None:
    res = [_results()["zero3"]]
    ref = _reference()
    on, off, deep = res[0]["on"], res[0]["off"], res[0]["deep"]
    # bitwise: overlap (depth 1 and 2) vs synchronous collectives
    assert on["losses"] == off["losses"] == deep["losses"], (on["losses"], off["losses"], deep["losses"])
    for n, p in off["params"].items():
        assert torch.equal(on["params"][n], p) and torch.equal(deep["params"][n], p), n
    # against one process over the same global batches
    for a, b in zip(on["losses"], ref["losses"]):
        assert abs(a - b) <= 1e-5 * abs(b), (on["losses"], ref["losses"])
    for n, p in ref["params"].items():
        assert (on["params"][n] - p).abs().max() <= PARAM_RTOL * p.abs().max(), n
    # the collectives ran while blocks computed (and did not with overlap off)
    assert _prefetched_ahead(on["trace"], 1), on["trace"]
    assert _prefetched_ahead(deep["trace"], 2) and not _prefetched_ahead(on["trace"], 2), deep["trace"]
    assert not _prefetched_ahead(off["trace"], 1), off["trace"]
    assert _reduce_scatters_overlap(on["trace"]), on["trace"]
    assert not _reduce_scatters_overlap(off["trace"]), off["trace"]


# ---------------------------------------------------------------------------------------------------- ZeRO-1/2
def _zero12_run(rank: int, stage: int, overlap: bool) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import lightning_v17.engine.zero.stages_0_2 as Z

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp_shard",))
    model = _model()
    # ~8 KB buckets: this 30k-parameter model is reduced in several buckets, as a real model is at 25 MB
    engine = Z.ZeroEngine(model, stage=stage, shard_group=mesh.get_group(), shard_mesh=mesh, bucket_mb=0.008,
                          overlap=overlap)  # fmt: skip
    opt = _opt(model.parameters())
    engine.shard_optimizer(opt)
    x, y = _data()
    ar, rs, counter = dist.all_reduce, Z.reduce_scatter, iter(range(10**9))

    def launch(fn):
        def wrapped(*a, **kw):
            EVENTS.append(("launch", next(counter)))
            return fn(*a, **kw)

        return wrapped

    Z.dist.all_reduce, Z.reduce_scatter = launch(ar), launch(rs)
    losses, traces = [], []
    try:
        for s in range(STEPS):
            EVENTS.clear()
            opt.zero_grad()
            loss = _loss(model(x[_rank_rows(s, rank)]), y[_rank_rows(s, rank)])
            loss.backward()
            EVENTS.append(("backward_returned",))
            opt.step()
            engine.gather_params()
            traces.append(list(EVENTS))
            losses.append(_mean_over_ranks(loss))
    finally:
        Z.dist.all_reduce, Z.reduce_scatter = ar, rs
    engine.remove()
    return {
        "losses": losses,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "trace": traces[-1],
        "buckets": len(engine.buckets),
    }


def _zero12_worker(rank: int, world: int) -> dict:
    return {(stage, ov): _zero12_run(rank, stage, ov) for stage in (1, 2) for ov in (True, False)}


def _reduces_start_during_backward(trace: list) -> bool:
    """Some bucket's reduction was launched before the first block's backward ended (i.e. while backward still had
    blocks 0.. to compute), and the launches before that point came in bucket order."""
    end = trace.index(("bwd_end", 0))
    return any(e[0] == "launch" for e in trace[:end])


def test_zero12_buckets_reduce_during_backward_bitwise() -> None:
    res = [_results()["zero12"]]
    ref = _reference()
    for stage in (1, 2):
        on, off = res[0][(stage, True)], res[0][(stage, False)]
        assert on["buckets"] >= 4, on["buckets"]
        assert on["losses"] == off["losses"], (stage, on["losses"], off["losses"])
        for n, p in off["params"].items():
            assert torch.equal(on["params"][n], p), (stage, n)
        for a, b in zip(on["losses"], ref["losses"]):
            assert abs(a - b) <= 1e-5 * abs(b), (stage, on["losses"], ref["losses"])
        for n, p in ref["params"].items():
            assert (on["params"][n] - p).abs().max() <= PARAM_RTOL * p.abs().max(), (stage, n)
        assert _reduces_start_during_backward(on["trace"]), (stage, on["trace"])
        assert not _reduces_start_during_backward(off["trace"]), (stage, off["trace"])
        # every bucket was launched before backward returned (the step waits for nothing more)
        launches = [k for k, e in enumerate(on["trace"]) if e[0] == "launch"]
        assert len(launches) >= on["buckets"] and launches[on["buckets"] - 1] < on["trace"].index(
            ("backward_returned",)
        )
