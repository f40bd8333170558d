"""Activation offload to the nvme tier (``engine/offload/activations.py``), in one process, on the reference Llama.

* **Exactness.** Losses and every parameter gradient over 2 SGD steps equal the run without offload bit for bit,
  without recompute, with selective recompute (what its cache keeps is offloaded) and with full recompute (the
  block inputs are offloaded); the reference is the same model without the offload object.
* **Ahead.** Logged through the tier's I/O (its ``write`` / ``read_into``) against a gradient hook on each block's
  output (block ``b``'s backward begins when that gradient is computed): every read of block ``b`` is issued after
  block ``b + 1``'s backward began and before block ``b``'s did.
* **Resident blocks.** The last ``resident_blocks`` blocks are never written (file names carry the block).
* **Selective recompute.** What its cache keeps (the matmul and attention outputs) and the block inputs are what is
  offloaded, byte for byte against a hand count, while the elementwise ops are still recomputed in backward.
* **Parameters.** No write reads from a parameter's storage (views of parameters included).
* **Files.** The folder is empty after each backward and after a forward whose graph is dropped, and after an error
  in a block's forward; :meth:`close` removes it.
* **Refusals.** A missing or unwritable ``nvme_path`` names the option; ``"cpu"`` on this CPU-only machine says why.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from lightning_v17.config import V17ConfigError
from lightning_v17.engine.offload.activations import ActivationOffload
from lightning_v17.engine.recompute import apply_activation_checkpointing
from lightning_v17.models import Llama, ModelConfig

CFG = ModelConfig(vocab_size=128, hidden=64, layers=4, heads=4, kv_heads=2, ffn=160, max_seq_len=256)
MIN_BYTES = 1024
STEPS = 2


def _tokens(step: int) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (2, 64), generator=torch.Generator().manual_seed(step))


def _model(mode: str) -> Llama:
    m = Llama(CFG, init_seed=0)
    apply_activation_checkpointing(m, mode=mode, units=m.recompute_units())
    return m


def _train(m: Llama, steps: int = STEPS) -> list:
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    out = []
    for s in range(steps):
        ids = _tokens(s)
        loss = F.cross_entropy(m(ids).flatten(0, 1), ids.flatten())
        loss.backward()
        out.append((loss.detach().clone(), {n: p.grad.clone() for n, p in m.named_parameters()}))
        opt.step()
        opt.zero_grad()
    return out


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_losses_and_gradients_equal_no_offload_bit_for_bit(tmp_path, mode):
    ref = _train(_model(mode))
    m = _model(mode)
    with ActivationOffload(m.recompute_units(), nvme_path=tmp_path, min_bytes=MIN_BYTES, resident_blocks=1) as off:
        got = _train(m)
        assert off.stats["bytes_offloaded"] > 0 and off.stats["reads_on_demand"] == 0, dict(off.stats)
    for (la, ga), (lb, gb) in zip(ref, got):
        assert torch.equal(la, lb), (la, lb)
        for name in ga:
            assert torch.equal(ga[name], gb[name]), name


def _instrument(off: ActivationOffload, m: Llama) -> list[tuple[str, int]]:
    """A log of ("write" | "read", block) from the tier I/O and ("backward", block) from each block output's grad."""
    log: list[tuple[str, int]] = []
    io, write, read_into = off.io, off.io.write, off.io.read_into

    def block_of(path) -> int:
        return int(re.match(r"p\d+-b(\d+)-", path.name).group(1))

    def logged_write(path, t, *a, **kw):
        log.append(("write", block_of(path), t.untyped_storage().data_ptr()))
        return write(path, t, *a, **kw)

    def logged_read(path, t, *a, **kw):
        log.append(("read", block_of(path), 0))
        return read_into(path, t, *a, **kw)

    io.write, io.read_into = logged_write, logged_read
    for i, block in enumerate(m.recompute_units()):

        def on_output(mod, args, out, i=i):
            if out.requires_grad:
                out.register_hook(lambda g: log.append(("backward", i, 0)))

        block.register_forward_hook(on_output)
    return log


@pytest.mark.parametrize("mode", ["none", "selective"])
def test_reads_are_issued_one_block_ahead_and_resident_blocks_are_never_written(tmp_path, mode):
    m, resident = _model(mode), 2
    with ActivationOffload(m.recompute_units(), nvme_path=tmp_path, min_bytes=MIN_BYTES,
                           resident_blocks=resident) as off:  # fmt: skip
        log = _instrument(off, m)
        _train(m, steps=1)
    n = CFG.layers
    written = {b for kind, b, _ in log if kind == "write"}
    assert written == set(range(n - resident)), written  # the last `resident` blocks stay in memory
    pos = {(kind, b): i for i, (kind, b, _) in reversed(list(enumerate(log)))}  # first occurrence
    for b in written:
        reads = [i for i, (kind, blk, _) in enumerate(log) if kind == "read" and blk == b]
        assert reads, f"block {b} was never read back"
        began_next, began = pos[("backward", b + 1)], pos[("backward", b)]
        assert all(began_next < i < began for i in reads), (b, reads, began_next, began, log)
    assert off.stats["reads_ahead"] == sum(kind == "read" for kind, _, _ in log), dict(off.stats)


def test_parameters_and_their_views_are_never_written(tmp_path):
    m = _model("none")
    params = {p.untyped_storage().data_ptr() for p in m.parameters()}
    with ActivationOffload(m.recompute_units(), nvme_path=tmp_path, min_bytes=MIN_BYTES, resident_blocks=0) as off:
        log = _instrument(off, m)
        _train(m, steps=1)
    writes = [ptr for kind, _, ptr in log if kind == "write"]
    assert writes and not params & set(writes), "a parameter (or a view of one) was offloaded"


def _files(off: ActivationOffload) -> list[str]:
    return sorted(p.name for p in off.files.folder.iterdir())


def test_files_are_removed_after_use_without_backward_on_error_and_on_close(tmp_path):
    m = _model("none")
    off = ActivationOffload(m.recompute_units(), nvme_path=tmp_path, min_bytes=MIN_BYTES, resident_blocks=1)
    ids = _tokens(0)
    loss = F.cross_entropy(m(ids).flatten(0, 1), ids.flatten())
    off.flush()  # every write finished: the files exist before backward
    assert len(_files(off)) == off.stats["tensors_offloaded"] > 0
    loss.backward()
    assert _files(off) == [], "files left after backward"
    loss = m(ids).sum()  # a graph never backpropagated
    del loss
    assert _files(off) == [], "files of a dropped graph left"

    def fail(mod, args):  # an error inside the forward, after blocks 0 and 1 were offloaded
        raise RuntimeError("boom")

    h = m.recompute_units()[2].register_forward_pre_hook(fail, prepend=True)
    with pytest.raises(RuntimeError, match="boom"):
        m(ids).sum().backward()
    h.remove()
    off.flush()
    assert _files(off) == [], "files left after an error in forward"
    assert off._stack == []  # no block's hooks left pushed
    m(ids).sum().backward()  # still works after the error (no hook left pushed)
    folder = off.files.folder
    off.close()
    assert not folder.exists() and not folder.parent.exists()


def test_refusals_name_the_option_and_the_reason(tmp_path):
    blocks = _model("none").recompute_units()
    with pytest.raises(V17ConfigError, match="nvme_path"):
        ActivationOffload(blocks, nvme_path=None)
    with pytest.raises(V17ConfigError, match="nvme_path=.*does not exist"):
        ActivationOffload(blocks, nvme_path=tmp_path / "missing")
    if not torch.cuda.is_available():
        with pytest.raises(V17ConfigError, match="host memory to host memory: it saves nothing"):
            ActivationOffload(blocks, tier="cpu", nvme_path=tmp_path)
    with pytest.raises(V17ConfigError, match="resident_blocks"):
        ActivationOffload(blocks, nvme_path=tmp_path, resident_blocks=-1)
    # the compute device, when given, is what the tier is checked against, not where the parameters are (ZeRO-3
    # offload_params keeps the shards on the host of blocks that compute on the GPU)
    with pytest.raises(V17ConfigError, match=r"blocks on cpu .*these are on \['cuda:0'\]"):
        ActivationOffload(blocks, nvme_path=tmp_path, device="cuda:0")
    ActivationOffload(blocks, nvme_path=tmp_path, device="cpu").close()


def test_selective_recompute_offloads_what_it_saves_and_still_recomputes_the_rest(tmp_path):
    """By hand, per block (T = 2 x 64 tokens, fp32): the block input (checkpoint's input saver) and the outputs
    recompute keeps (``selective_policy``): wq, wk, wv, attention's output and log-sum-exp, wo, w1, w3, w2. In
    backward the elementwise ops are recomputed (``silu`` and ``rsqrt`` run again in every block) and no matmul is:
    its output comes back from the offloaded cache."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.calls: dict[str, int] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls[str(func)] = self.calls.get(str(func), 0) + 1
            return func(*args, **(kwargs or {}))

    b, s = _tokens(0).shape
    t, h, kv, f, heads = b * s, CFG.hidden, CFG.kv_dim, CFG.ffn, CFG.heads
    per_block = 4 * (t * h + t * h + 2 * t * kv + t * h + b * heads * s + t * h + 2 * t * f + t * h)
    m = _model("selective")
    with ActivationOffload(m.recompute_units(), nvme_path=tmp_path, min_bytes=MIN_BYTES, resident_blocks=1) as off:
        ids = _tokens(0)
        loss = F.cross_entropy(m(ids).flatten(0, 1), ids.flatten())
        assert off.stats["bytes_offloaded"] == (CFG.layers - 1) * per_block, dict(off.stats)
        counted = Count()
        with counted:
            loss.backward()
    assert counted.calls.get("aten.silu.default") == CFG.layers, counted.calls  # recomputed in every block
    assert counted.calls.get("aten.rsqrt.default") == 2 * CFG.layers, counted.calls
    assert counted.calls.get("aten.mm.default") == 2 * (7 * CFG.layers + 1), counted.calls  # gradients only


def test_block_pool_reuses_only_buffers_nothing_views_and_the_gpu_checks_import():
    """The read-back pool (``activation_buffers.BlockPool``) by itself: a buffer comes back only once no slice of it
    is alive; beyond ``cap`` a request is served outside the pool; idle pages are dropped, the buffers kept. The CUDA
    tier's GPU checks import here (they skip without a device)."""
    import importlib

    from lightning_v17.engine.offload.activation_buffers import BlockPool

    pool = BlockPool(2)
    a = pool.take(10_000)
    view = a[100:200]  # an entry's slice, still held
    del a
    b = pool.take(5_000)
    assert pool.allocations == 2 and pool.reuses == 0, vars(pool)  # the first buffer is still viewed: not reused
    c = pool.take(5_000)
    assert pool.misses == 1 and c.numel() == 5_000, vars(pool)  # both lent: outside the pool
    del view, b, c
    d = pool.take(8_000)
    assert pool.reuses == 1 and pool.allocations == 2 and d.numel() == 8_000, vars(pool)
    d.fill_(7)
    del d
    pool.idle()  # the pages leave, the mapping stays: the next take reuses it (zero-filled again)
    e = pool.take(8_000)
    assert pool.allocations == 2 and int(e.sum()) == 0, vars(pool)
    mod = importlib.import_module("tests.gpu.test_activation_offload_gpu")
    assert hasattr(mod, "test_cpu_tier_gradients_equal_no_offload_bit_for_bit")
