"""The optimizer offload engine (``lightning_v17/engine/offload/optimizer.py``) in one process, on real files.

For every optimizer of the library the offloaded optimizer (cpu tier, nvme tier, and a 50/50 cpu/nvme split), stepped
chunk by chunk through 1-parameter-sized chunks, ends bit for bit where the same optimizer stepped normally ends, over
5 steps of the tiny LM of the ZeRO tests; between steps the nvme chunks' state is really out of memory (only scalars
and shared quantization maps stay) and on disk; a state-dict read gives the same tensors as the plain optimizer's, and
a load writes them back to the tier.
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch

from lightning_v17.config import Tier
from lightning_v17.engine.offload.handles import attach_offload, materialized, offload_of
from tests.dist.test_zero_parity import loss_fn, make_data, make_model

STEPS, BATCH = 5, 8
#: keyword arguments per library optimizer (the 8-bit ones quantize every tensor: min_8bit_size=0)
OPTIMIZERS = {
    "adamw": {"lr": 1e-2, "weight_decay": 0.1},
    "cpu_adam": {"lr": 1e-2, "weight_decay": 0.1},
    "adafactor": {"lr": 1e-2},
    "lion": {"lr": 1e-3, "weight_decay": 0.1},
    "adam8bit": {"lr": 1e-2, "min_8bit_size": 0},
    "lion8bit": {"lr": 1e-3, "min_8bit_size": 0},
}
CHUNK_MB = 1e-3  # ~260 fp32 elements of this rank: every weight matrix its own chunk, biases grouped


@functools.cache
def _cpu_adam_skip() -> str | None:
    from lightning_v17.optim import cpu_adam_cached

    # a cold build of DeepSpeed's op takes minutes here; tests/dist/test_optim_library.py builds it when allowed
    return None if cpu_adam_cached() else "DeepSpeed's cpu_adam op is not built yet (see test_optim_library.py)"


def _build(name: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    from lightning_v17.optim import build_optimizer

    return build_optimizer(name, model.parameters(), **OPTIMIZERS[name])


def _train(
    name: str, offload: dict | None, *, probe=None, setup=None, in_closure=None
) -> tuple[torch.nn.Module, torch.optim.Optimizer, list]:
    """5 steps of ``name`` on the tiny LM; ``offload``: attach_offload's arguments (chunk_mb defaults to CHUNK_MB);
    ``setup(optimizer)`` runs before the first step, ``probe(optimizer)`` after each, ``in_closure(optimizer)`` at the
    start of each closure (forward/backward)."""
    model = make_model()
    opt = _build(name, model)
    if offload is not None:
        attach_offload(opt, **{"chunk_mb": CHUNK_MB, **offload})
    if setup is not None:
        setup(opt)
    x, y = make_data(STEPS * BATCH)
    losses = []
    for s in range(STEPS):
        opt.zero_grad()

        def closure(s=s):
            if in_closure is not None:
                in_closure(opt)
            loss = loss_fn(model(x[s * BATCH : (s + 1) * BATCH]), y[s * BATCH : (s + 1) * BATCH])
            loss.backward()
            return loss

        losses.append(opt.step(closure).item())  # the closure runs inside the offloaded step, as Lightning calls it
        if probe is not None:
            probe(opt)
    return model, opt, losses


def _own_state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of the per-parameter state tensors in ``opt.state`` (not scalars, not tensors shared between parameters
    such as bitsandbytes' quantization maps, which stay in memory by design)."""
    tensors = [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0]
    count: dict[int, int] = {}
    for v in tensors:
        count[v.data_ptr()] = count.get(v.data_ptr(), 0) + 1
    return sum(v.numel() * v.element_size() for v in tensors if count[v.data_ptr()] == 1)


def _same(a, b) -> bool:
    """Equal, bit for bit, through the nested dicts of bitsandbytes' state dicts."""
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _skip(name: str) -> None:
    if name == "cpu_adam" and _cpu_adam_skip():
        pytest.skip(_cpu_adam_skip())


@pytest.mark.parametrize("tier", ["cpu", "nvme", "split"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_offloaded_step_is_bitwise_the_plain_step(tmp_path, name: str, tier: str) -> None:
    _skip(name)
    ref_model, ref_opt, ref_losses = _train(name, None)
    kw = {"tier": "nvme", "nvme_path": str(tmp_path), "ratio": 0.5} if tier == "split" else {"tier": tier}
    if tier == "nvme":
        kw["nvme_path"] = str(tmp_path)
    seen: list[int] = []
    model, opt, losses = _train(name, kw, probe=lambda o: seen.append(_own_state_bytes(o)))
    off = offload_of(opt)
    assert off is not None and len(off.chunks) >= 4, len(off.chunks)
    assert losses == ref_losses
    for (n, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters()):
        assert torch.equal(p, q), (name, tier, n, (p - q).abs().max().item())
    plain = ref_opt.state_dict()
    with materialized(opt):
        got = opt.state_dict()
        for i, st in plain["state"].items():
            assert st.keys() == got["state"][i].keys(), (i, st.keys(), got["state"][i].keys())
            for k, v in st.items():
                assert _same(v, got["state"][i][k]), (name, i, k)
    full = _own_state_bytes(ref_opt)
    if tier == "cpu":
        assert off.files is None and seen[-1] == full  # the cpu tier is host memory: the state stays there
        return
    on_disk = off.disk_bytes()
    nvme = [c for c in off.chunks if c.tier == Tier.NVME]
    # the libaio backend writes whole O_DIRECT blocks: each file rounded up to its alignment (the thread pool: exact)
    align, files = getattr(off.io, "alignment", 1), len(list(off.files.folder.iterdir()))
    want = sum(c.nbytes for c in nvme)
    assert all(c.spilled for c in nvme) and want <= on_disk <= want + files * (align - 1) and want > 0, (on_disk, want)
    if tier == "nvme":
        assert on_disk >= 0.9 * full, (on_disk, full)  # (8-bit: the per-block absmax and codes are on disk too)
        assert max(seen) == 0, (seen, full)  # between steps none of the per-parameter state is in memory
    else:  # the first chunks, about half of the parameter elements, on nvme; the rest of the state in memory
        on_nvme = sum(p.numel() for c in nvme for p in (off.params[i] for i in c.params))
        assert 0 < len(nvme) < len(off.chunks) and 0.3 < on_nvme / sum(p.numel() for p in off.params) < 0.8
        assert min(seen) > 0 and on_disk > 0
    folder = off.files.folder
    off.close()
    assert not folder.exists() and not list(tmp_path.iterdir())  # the run folder is gone too


def test_load_writes_back_to_the_tier(tmp_path) -> None:
    """A state dict loaded into an offloaded optimizer lands on the nvme tier and the next steps use it: train 2
    steps plain, load that state into a fresh offloaded optimizer, train 3 more; equals 5 plain steps bitwise."""
    ref_model, _, ref_losses = _train("adamw", None)
    model = make_model()
    opt = _build("adamw", model)
    x, y = make_data(STEPS * BATCH)

    def run(steps):
        out = []
        for s in steps:
            opt.zero_grad()
            loss = loss_fn(model(x[s * BATCH : (s + 1) * BATCH]), y[s * BATCH : (s + 1) * BATCH])
            loss.backward()
            opt.step()
            out.append(loss.item())
        return out

    losses = run(range(2))
    saved = {k: v for k, v in opt.state_dict().items()}
    saved = {"state": {i: {k: v.clone() for k, v in st.items()} for i, st in saved["state"].items()},
             "param_groups": saved["param_groups"]}  # fmt: skip
    fresh = _build("adamw", model)
    off = attach_offload(fresh, tier="nvme", nvme_path=str(tmp_path), chunk_mb=CHUNK_MB)
    with materialized(fresh):
        fresh.load_state_dict(saved)
    assert not fresh.state and off.disk_bytes() > 0  # loaded, then written to the tier and dropped from memory
    opt = fresh
    losses += run(range(2, STEPS))
    assert losses == ref_losses
    for (n, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters()):
        assert torch.equal(p, q), n
    off.close()


def test_closed_offload_names_the_reason(tmp_path) -> None:
    _, opt, _ = _train("adamw", {"tier": "nvme", "nvme_path": str(tmp_path)})
    offload_of(opt).close()
    assert offload_of(opt) is None and "step" not in opt.__dict__  # the optimizer's own step is back
    # a save after teardown must not hand out an empty state
    with pytest.raises(RuntimeError, match="released when the Trainer tore the strategy down"), materialized(opt):
        pass
    _, opt, _ = _train("adamw", {"tier": "cpu"})  # the cpu tier loses nothing at close: its state stays readable
    offload_of(opt).close()
    with materialized(opt):
        assert len(opt.state) == len(list(opt.param_groups[0]["params"]))


def test_free_space_checked_before_step_zero(tmp_path) -> None:
    """The planner's bytes for this rank's state (AdamW: 8 B/param) against the drive's real free space: a
    parameter on the meta device (no memory) big enough to overflow the drive is refused at attach time."""
    import shutil

    from lightning_v17.config import V17ConfigError

    free = shutil.disk_usage(tmp_path).free
    big = torch.nn.Parameter(torch.empty(free // 8 + 1, device="meta"))
    opt = torch.optim.AdamW([big])
    with pytest.raises(V17ConfigError, match=r"nvme_path=.* GiB free, but this rank offloads"):
        attach_offload(opt, tier="nvme", nvme_path=str(tmp_path))
    assert not list(tmp_path.iterdir())  # nothing was created
    small = torch.nn.Parameter(torch.empty(free // 8 // 4, device="meta"))  # fits: then the meta device is refused
    with pytest.raises(V17ConfigError, match=r"parameters on \['meta'\] is not implemented"):
        attach_offload(torch.optim.AdamW([small]), tier="nvme", nvme_path=str(tmp_path))


def test_write_back_overlaps_the_next_step(tmp_path) -> None:
    """The step leaves its last write-back in flight (it overlaps the next forward/backward, as the first reads
    do); a read of a chunk whose write is still in flight takes the buffer being written instead of reading the
    file. With writes slowed to 0.3 s each (a slow drive), that path runs, and 5 steps still equal the plain
    optimizer bit for bit; saves see the written state."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    from lightning_v17.engine.offload import optimizer as engine

    ref_model, ref_opt, ref_losses = _train("adamw", None)
    n_bytes = sum(p.numel() * 4 for p in make_model().parameters())
    pool, reads, taken = ThreadPoolExecutor(1), [], []
    lock = threading.Lock()

    def slow_writes(opt) -> None:
        off = offload_of(opt)
        assert len(off.chunks) >= 2
        real = off.io

        class SlowWrites:
            name = real.name

            def write(self, path, buf):
                return pool.submit(lambda: (time.sleep(0.3), real.write(path, buf).result())[1])

            def read(self, path, nbytes):
                with lock:
                    reads.append(path.name)
                return real.read(path, nbytes)

            def read_into(self, path, t, **kw):  # kw: the write-backs the read waits for first
                with lock:
                    reads.append(path.name)
                return real.read_into(path, t, **kw)

            def close(self):
                pool.shutdown(wait=True)
                real.close()

        off.io = SlowWrites()

    orig = engine.AfterWrite.__init__

    def spy(self, write, buf):
        taken.append(1)
        orig(self, write, buf)

    engine.AfterWrite.__init__ = spy
    try:
        kw = {"tier": "nvme", "nvme_path": str(tmp_path), "chunk_mb": n_bytes * 0.6 / 2**20}  # 2 chunks
        model, opt, losses = _train("adamw", kw, setup=slow_writes)
    finally:
        engine.AfterWrite.__init__ = orig
    off = offload_of(opt)
    assert taken, "no read took an in-flight write's buffer: the step waited for every write"
    assert losses == ref_losses
    for (n, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters()):
        assert torch.equal(p, q), n
    with materialized(opt):  # waits for the writes; the state read back equals the plain optimizer's
        for i, st in ref_opt.state_dict()["state"].items():
            assert all(_same(v, opt.state_dict()["state"][i][k]) for k, v in st.items()), i
    off.close()


def test_chunk_buffers_come_from_a_bounded_pool_refilled_only_when_nothing_else_views_them(tmp_path) -> None:
    """The nvme chunks live in at most ``buffer_count`` buffers (DeepSpeed's swap buffers; every chunk stepping, read
    ahead or being written back): over 5 steps of ~7 chunks with 3-chunk read-ahead every read goes into one of them
    (a read ahead refills the buffer of a write-back once it is written); forward and backward hold no idle buffer
    (they are given back once the reads ahead are issued), so each step allocates at most ``buffer_count - depth``
    again, and close frees them all; the steps equal the plain optimizer bit for bit. A state tensor a caller kept from a state-dict read still views its buffer: that buffer is never refilled
    with another chunk's bytes (the kept tensor keeps its values through 3 more steps), and the steps stay exact."""
    ref_model, _, ref_losses = _train("adamw", None)
    into_pool: list[bool] = []
    allocations: list[int] = []
    owned: list[int] = []
    kept: list[torch.Tensor] = []
    idle: list[int] = []

    def in_closure(opt) -> None:  # during forward/backward: the pool holds the reads ahead, no idle buffer
        idle.append(len(offload_of(opt).pool.free))

    def watch_reads(opt) -> None:
        off = offload_of(opt)
        real = off.io.read_into

        def read_into(path, t, **kw):
            into_pool.append(any(b.data_ptr() == t.data_ptr() for b in off.pool.owned.values()))
            return real(path, t, **kw)

        off.io.read_into = read_into

    def count(opt) -> None:
        allocations.append(offload_of(opt).pool.allocations)
        owned.append(len(offload_of(opt).pool.owned))
        assert owned[-1] <= offload_of(opt).pool.cap

    def keep(opt) -> None:
        if not kept:  # after step 1: a caller keeps a state tensor of the first chunk
            with materialized(opt):
                t = opt.state[opt.param_groups[0]["params"][0]]["exp_avg"]
                kept.extend([t, t.clone()])

    kw = {"tier": "nvme", "nvme_path": str(tmp_path), "buffer_count": 4}
    runs = [_train("adamw", kw, setup=watch_reads, probe=count, in_closure=in_closure), _train("adamw", kw, probe=keep)]
    off = offload_of(runs[0][1])
    assert len(off.chunks) >= 6 and off.pool.cap == 4
    assert into_pool and all(into_pool), f"{into_pool.count(False)} of {len(into_pool)} reads outside the pool"
    per_step = [b - a for a, b in itertools.pairwise(allocations)]
    # once a step ended with the pool full, the next allocates at most cap - depth (the reads ahead hold the rest);
    # how many are still being written when forward starts depends on the I/O's timing: not a constant
    after_full = [n for n, full in zip(per_step, owned) if full == off.pool.cap]
    assert all(n <= off.pool.cap - off.depth for n in after_full), f"allocated: {allocations}, owned: {owned}"
    assert idle and not any(idle), f"idle pool buffers held through forward/backward: {idle}"
    assert torch.equal(kept[0], kept[1]), "a buffer a kept state tensor views was refilled with other bytes"
    for model, opt, losses in runs:
        assert losses == ref_losses
        for (n, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters()):
            assert torch.equal(p, q), n
    off.close()
    assert not off.pool.owned and not getattr(off.io, "_locked", None), "close left pool buffers allocated"
    offload_of(runs[1][1]).close()


def test_sole_owner_counts_views() -> None:
    from lightning_v17.engine.offload.host_memory import sole_owner
    from lightning_v17.engine.offload.nvme import host_buffer

    buf = host_buffer(2**20)
    assert sole_owner(buf)
    kept = buf[64:128].view(torch.float32)  # e.g. a state tensor of that chunk a caller still holds
    assert not sole_owner(buf)
    del kept
    assert sole_owner(buf)
