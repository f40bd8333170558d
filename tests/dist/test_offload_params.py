"""``offload_params="nvme"`` (ZeRO-Infinity parameter offload, ``lightning_v17/engine/offload/params.py``) under
V17Strategy at ZeRO-3 on 2 gloo ranks, against a single-process run of the same optimizer.

One spawned pair of ranks runs every case (the TinyLM, data and LightningModule of tests/dist/test_zero_parity.py).
``CHUNK_MB`` cuts the optimizer's parameters into several chunks, so the step streams the shards chunk by chunk.
The matrix below is part of ``make test`` (``V17_PARAM_OFFLOAD_FULL=0`` leaves it out); the first case (fp32 AdamW,
parameters and optimizer state on nvme) and the too-small drive also run inside tests/dist/test_offload_optimizer.py's
spawned pair, with :func:`check_fp32`.
The SIGKILL resume with parameters on nvme is tests/dist/test_offload_resume.py (``make test-fault``).

* **Exactness (fp32)**: AdamW (torch, test_zero_parity's reference) with ``offload_optimizer`` "none" and "nvme", and
  the library's Lion (test_optim_library's reference): losses and final parameters within ``EXACT_TOL`` = 1e-6
  relative of the single-process run; the AdamW runs equal the same V17 run without offload bit for bit.
* **bf16**: ``bf16-mixed`` (fp32 shards, bf16 all-gather) against the single-process bf16-autocast run with
  test_zero_parity's bf16 tolerances (FSDP2 computes with bf16 parameters, the reference with autocast: measured
  there 2.8e-4 loss, 5.2e-2 of the update), and bit for bit against V17 bf16-mixed without offload;
  ``bf16-true`` (bf16 shards: 2-byte files) bit for bit against V17 bf16-true without offload.
* **Really offloaded**: after every step no parameter shard is in memory (``resident_bytes()``, after the
  write-backs in flight) but, under the default ``host_memory="recycle"``, the next forward's first units
  (``forward_first_bytes``; none under "return"), and the rank's files hold every shard's bytes; the folder is gone
  after ``fit`` and the parameters are in memory again.
* **Checkpoint**: a run saves at step 3 (the shards read from their files), a fresh Trainer resumes (the loaded
  shards written back) and finishes bit-identical to the uninterrupted 5-step run.
* **Errors before training**: a drive too small for the shards (``shutil.disk_usage`` reports 1 MiB free): a
  V17ConfigError naming ``nvme_path`` from ``setup`` (before step 0).
"""

from __future__ import annotations

import glob
import itertools
import os

import pytest
import torch

from tests._dist import spawn
from tests.dist.test_optim_library import EXACT_TOL, _make
from tests.dist.test_optim_library import reference as lib_reference
from tests.dist.test_zero_parity import (
    PER_RANK_BATCH,
    STEPS,
    WORLD,
    _bf16_mismatches,
    _full_params,
    _lit_cls,
    make_data,
    reference,
)

#: the compositions this file checks against one process (docs/gen_layouts.py builds docs/layouts.md from them)
COMPOSES = (("offload_params", "zero3"), ("offload_params", "offload_optimizer", "zero3"))

pytestmark = pytest.mark.timeout(300)

#: set to 1 to run this matrix (~2 min on 2 idle cores, 5 on a loaded one). ``make test`` runs the quick cases in
#: tests/dist/test_offload_optimizer.py's spawned pair (:func:`check_fp32`: fp32 AdamW with the parameters and the
#: optimizer state on nvme; the too-small drive), to stay within the suite's time budget
FULL_ENV = "V17_PARAM_OFFLOAD_FULL"
CHUNK_MB = 1e-3  # ~260 fp32 elements per chunk: the TinyLM steps in several chunks
EPOCH_STEPS = 3


def fit_params(root: str, tag: str, *, params: str = "nvme", optimizer: str = "none", precision: str = "32-true",
         opt: str | None = None, batches: int = STEPS, ckpt_dir: str | None = None, ckpt_path: str | None = None,
         max_steps: int = STEPS, probe_reads: bool = False, host_memory: str | None = None) -> dict:  # fmt: skip
    import lightning as L
    import torch.distributed as dist
    from lightning_v17.strategies import V17Strategy
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from lightning_v17.config import OffloadPolicy
    from lightning_v17.engine.offload import host_memory as host_buffers
    from lightning_v17.engine.offload.handles import offload_of

    rank = int(os.environ["RANK"])
    model = _lit_cls((lambda p: _make(opt, p)) if opt else None)()
    x, y = make_data(batches * WORLD * PER_RANK_BATCH)
    ds = TensorDataset(x, y)
    loader = DataLoader(
        ds, batch_size=PER_RANK_BATCH, sampler=DistributedSampler(ds, num_replicas=WORLD, rank=rank, shuffle=False)
    )
    nvme_path = os.path.join(root, tag)
    os.makedirs(nvme_path, exist_ok=True)
    nvme = "nvme" in (params, optimizer)
    offload = OffloadPolicy(optimizer=optimizer, params=params, nvme_path=nvme_path if nvme else None,
                            chunk_mb=CHUNK_MB, host_memory=host_memory)  # fmt: skip
    seen: dict = {"resident": [], "kept": [], "disk": [], "shard_bytes": [], "folder": None, "outside": [], "inside": [],
                  "reads": [], "read_calls": 0, "pool_allocations": [], "fixed_threshold": [],
                  "gathered_mapped": set(), "cold": [], "step": -1, "opt_reads": [], "opt_depth": 0}  # fmt: skip

    class Probe(L.Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            po = trainer.strategy.zero.param_offload
            if po is not None:
                gathered_memory_probe(seen["gathered_mapped"])
            if po is not None:  # count the tier's read requests
                read_into = po.io.read_into

                def counted(*args, **kwargs):
                    seen["read_calls"] += 1
                    return read_into(*args, **kwargs)

                po.io.read_into = counted
                fetch = po.fetch

                def watched(recs):  # in backward, a fetch that must issue its unit's read itself (none ahead)
                    recs = list(recs)
                    cold = sorted({r.unit.index for r in recs if not r.resident and r.unit.buf is None})
                    if cold and torch._C._current_graph_task_id() >= 0:
                        seen["cold"].append((seen["step"], cold))
                    return fetch(recs)

                po.fetch = watched
                off = offload_of(trainer.optimizers[0])
                if off is not None and off.io is not None:  # the optimizer state's reads: which chunk, when
                    seen["opt_depth"] = off.depth
                    opt_read = off.io.read_into

                    def opt_watched(path, *args, **kwargs):
                        k = int(path.stem.removeprefix("chunk"))
                        seen["opt_reads"].append((seen["step"], k, torch._C._current_graph_task_id() >= 0))
                        return opt_read(path, *args, **kwargs)

                    off.io.read_into = opt_watched

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            seen["step"] = batch_idx

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            po = trainer.strategy.zero.param_offload
            if po is not None:
                seen["disk"].append(po.disk_bytes())  # (waits for the write-backs in flight)
                seen["resident"].append(po.resident_bytes())
                seen["kept"].append(0 if po.lean else forward_first_bytes(pl_module))  # "return" keeps none
                seen["reads"].append(seen["read_calls"])
                seen["read_calls"] = 0
                seen["pool_allocations"].append(po.pool.allocations)
                seen["fixed_threshold"].append(list(host_buffers._FIXED))
                seen["shard_bytes"].append(po.shard_bytes)
                seen["units"] = len(fsdp_groups_with_params(pl_module))
                seen["params"] = sum(len(g.fsdp_params) for g in fsdp_groups_with_params(pl_module))
                seen["folder"] = str(po.files.folder)
            if po is not None and probe_reads:  # user code reading a parameter between steps (a weight norm)
                p = next(pl_module.parameters())
                try:
                    seen["outside"].append(("read", float(p.to_local().sum()), p.numel(), tuple(p.shape)))
                except RuntimeError as err:
                    seen["outside"].append(("error", str(err), p.numel(), tuple(p.shape)))
                with po.resident():
                    seen["inside"].append(p.to_local().detach().clone())

    callbacks: list = [Probe()]
    if ckpt_dir is not None:
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(
            dirpath=ckpt_dir, every_n_train_steps=EPOCH_STEPS, save_on_train_epoch_end=False, save_top_k=-1,
        ))  # fmt: skip
    trainer = L.Trainer(
        accelerator="cpu", devices=WORLD, strategy=V17Strategy(zero_stage=3, offload=offload), max_steps=max_steps,
        precision=precision, use_distributed_sampler=False, logger=False, enable_checkpointing=ckpt_dir is not None,
        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
    )  # fmt: skip
    try:
        trainer.fit(model, loader, ckpt_path=ckpt_path)
    finally:
        gathered_memory_probe(None)
    losses = torch.tensor(model.losses)
    dist.all_reduce(losses)
    local = [p._local_tensor for p in model.parameters()]
    return {
        "losses": (losses / WORLD).tolist(), "params": _full_params(model), "seen": seen,
        "dtypes": sorted(model.linear_dtypes),
        "folder_after": seen["folder"] is not None and os.path.exists(seen["folder"]),
        "left_in_nvme_path": sorted(os.listdir(nvme_path)),
        "in_memory_after": sum(t.untyped_storage().nbytes() for t in local),
    }  # fmt: skip


def too_small(root: str) -> dict:
    """A drive with 1 MiB free: the parameter tier refuses in setup, before step 0."""
    import shutil
    from collections import namedtuple

    from lightning_v17.config import V17ConfigError

    real = shutil.disk_usage
    shutil.disk_usage = lambda p: namedtuple("usage", "total used free")(2**30, 2**30 - 2**20, 2**20)
    try:
        fit_params(root, "small")
    except V17ConfigError as err:
        return {"error": str(err)}
    finally:
        shutil.disk_usage = real
    return {"error": None}


def _full_worker(rank: int, world_size: int, root: str) -> dict:
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    out: dict = {}
    out["plain"] = fit_params(root, "plain", params="none")
    out["nvme"] = fit_params(root, "nvme", probe_reads=True)
    out["nvme_opt_nvme"] = fit_params(root, "both", optimizer="nvme")
    out["lion"] = fit_params(root, "lion", opt="lion")
    for prec in ("bf16-mixed", "bf16-true"):
        out[f"plain_{prec}"] = fit_params(root, f"plain-{prec}", params="none", precision=prec)
        out[f"nvme_{prec}"] = fit_params(root, f"nvme-{prec}", precision=prec)
    ckpt_dir = os.path.join(root, "ckpt")
    out["whole"] = fit_params(root, "whole", optimizer="nvme", batches=EPOCH_STEPS, ckpt_dir=ckpt_dir)
    dist.barrier()
    ckpt = sorted(glob.glob(os.path.join(ckpt_dir, "epoch=0-step=3*")))
    out["ckpt"] = ckpt
    out["resumed"] = fit_params(root, "resumed", optimizer="nvme", batches=EPOCH_STEPS, ckpt_path=ckpt[0])
    dist.barrier()
    # last: "return" fixes glibc's threshold for the rest of the process
    out["nvme_return"] = fit_params(root, "return", host_memory="return")
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    if os.environ.get(FULL_ENV) == "0":
        pytest.skip(f"{FULL_ENV}=0: the full offload_params matrix (~1-2 min on 2 cores) is left out")
    root = str(tmp_path_factory.mktemp("param_offload"))
    return spawn(_full_worker, world_size=WORLD, args=(root,), timeout=280, init_process_group=False)


def _rel_errors(got: dict, want: dict) -> tuple[float, float]:
    loss = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], want["losses"], strict=True))
    par = max(
        (torch.as_tensor(got["params"][n]) - w).norm().item() / w.norm().item() for n, w in want["params"].items()
    )
    return loss, par


def _bitwise(a: dict, b: dict) -> bool:
    return a["losses"] == b["losses"] and all(
        (torch.as_tensor(a["params"][n]) == torch.as_tensor(w)).all() for n, w in b["params"].items()
    )


def gathered_memory_probe(into: set | None) -> None:
    """Record in ``into`` whether a 4 MiB host allocation is its own mapping (glibc's threshold) at the moment FSDP2
    allocates a unit's all-gather output and, in its copy-out, the unsharded parameters (``None``: unpatch). At the
    TinyLM's size nothing of FSDP2's own is that large; the probe asks glibc what it would do with something that is.
    """
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as pg

    from lightning_v17.engine.offload.host_memory import trim_heap
    from tests._glibc import mapped_by

    for name in ("foreach_all_gather", "foreach_all_gather_copy_out"):
        orig = getattr(pg, f"_v17_orig_{name}", None) or getattr(pg, name)
        setattr(pg, f"_v17_orig_{name}", orig)
        if into is None:
            setattr(pg, name, orig)
            continue

        def probed(*args, _orig=orig, _name=name, **kwargs):
            trim_heap()  # else a free top of the heap left by an earlier probe serves the 4 MiB whatever the threshold
            into.add((_name, mapped_by(4 * 2**20) >= 4 * 2**20))
            return _orig(*args, **kwargs)

        setattr(pg, name, probed)


def fsdp_groups_with_params(module) -> list:
    from torch.distributed.fsdp import FSDPModule

    groups = [m._get_fsdp_state()._fsdp_param_group for m in module.modules() if isinstance(m, FSDPModule)]
    return [g for g in groups if g is not None and g.fsdp_params]


def forward_first_bytes(module) -> int:
    """What the parameter tier keeps in memory between steps (``ParamOffload.forward_first``, ``prefetch_units=1``):
    the shards the next forward all-gathers first, those of the first two FSDP2 groups with parameters (the root's and
    the first unit's), each in a 4096-byte-aligned slot of its unit's buffer."""
    groups = fsdp_groups_with_params(module)
    return sum(-(-d.numel() * d.element_size() // 4096) * 4096 for g in groups[:2]
               for d in (fp._sharded_param_data for fp in g.fsdp_params))  # fmt: skip


def check_fp32(results: list[dict], case: str) -> None:
    loss, par = _rel_errors(results[0][case], reference())
    print(f"{case}: max loss rel err {loss:.2e}, max param rel err {par:.2e}")
    assert loss <= EXACT_TOL and par <= EXACT_TOL
    for rank, res in enumerate(results):
        seen = res[case]["seen"]
        # no shard in memory between steps but (the default "recycle") the next forward's first units
        assert seen["resident"] == seen["kept"], (rank, seen["resident"], seen["kept"])
        assert min(seen["disk"]) >= seen["shard_bytes"][0] > 0, (rank, seen)  # every shard's bytes on disk
        assert not res[case]["folder_after"] and res[case]["left_in_nvme_path"] == []
        assert res[case]["in_memory_after"] >= seen["shard_bytes"][0]  # back in memory after fit
        if seen["opt_depth"]:  # the optimizer state's first chunks are read while backward runs (forward reads
            # parameters), each once a step; the step reads the others
            first = [(step, k, bwd) for step, k, bwd in seen["opt_reads"] if k < seen["opt_depth"]]
            want = [(step, k, True) for step in range(1, STEPS) for k in range(seen["opt_depth"])]
            assert first == want and all(k >= seen["opt_depth"] for _, k, bwd in seen["opt_reads"] if not bwd), (
                rank, seen["opt_depth"], seen["opt_reads"])  # fmt: skip


@pytest.mark.parametrize("case", ["nvme", "nvme_opt_nvme"])
def test_full_fp32_adamw_equals_no_offload_bitwise(results, case: str) -> None:
    check_fp32(results, case)
    assert _bitwise(results[0][case], results[0]["plain"])  # offloading changes nothing, bit for bit


@pytest.mark.parametrize("case", ["nvme", "nvme_return"])
def test_parameter_io_is_one_read_per_unit_into_recycled_buffers(results, case: str) -> None:
    """The tier reads a unit's shards with one request (not one per parameter: the TinyLM's 3 groups hold 17
    parameters), at most once each in forward, backward and the step. The default host_memory ("recycle") leaves
    glibc's threshold alone except around FSDP2's all-gathers (there a 4 MiB allocation is its own mapping; the
    unsharded parameters on the heap grew it by a hole per unit), recycles one unit's buffer (fewer allocations, so
    page faults and locking, than reads), keeps the next forward's first units in memory between steps (reading them
    outside resident() still raises), and changes nothing in the arithmetic. "return" puts memory first: glibc's mmap
    threshold fixed at 1 MiB for the process, no idle buffer, no shard in memory between steps.

    Reads ahead: backward never fetches a unit whose read was not issued ahead (FSDP2 prefetches the last unit's
    all-gather while the one before it computes; that one is all-gathered first in backward and is read ahead then)."""
    for rank, r in enumerate(results):
        seen = r[case]["seen"]
        units, params = seen["units"], seen["params"]
        assert (units, params) == (3, 17), (units, params)
        extra = units if case == "nvme" else 0  # that case's probe reads every parameter inside resident()
        first, rest = seen["reads"][0], seen["reads"][1:]  # (the first step also reads for FSDP2's lazy init)
        assert 0 < first <= 4 * units + extra and all(0 < n <= 3 * units + extra for n in rest), (rank, seen["reads"])
        allocs = seen["pool_allocations"]
        new = [b - a for a, b in itertools.pairwise(allocs)]
        assert seen["gathered_mapped"] == {("foreach_all_gather", True), ("foreach_all_gather_copy_out", True)}, (
            rank, seen["gathered_mapped"])  # fmt: skip
        assert seen["cold"] == [], (rank, seen["cold"])  # (step, units whose backward fetch issued the read)
        if case == "nvme":  # one unit's buffer kept idle: fewer allocations than reads; between steps the
            # next forward's first units stay in memory
            assert all(a < n for a, n in zip(new, rest)), (rank, allocs, seen["reads"])
            assert seen["resident"] == seen["kept"] and 0 < seen["kept"][0] < seen["disk"][0], (rank, seen)
            assert seen["fixed_threshold"] == [[]] * STEPS, (rank, seen["fixed_threshold"])
        else:  # "return", memory first: no idle buffer (one allocation per read), nothing kept between steps
            assert new == rest, (rank, allocs, seen["reads"])
            assert seen["resident"] == [0] * STEPS, (rank, seen["resident"])
            assert seen["fixed_threshold"] == [[2**20]] * STEPS, (rank, seen["fixed_threshold"])
    assert _bitwise(results[0][case], results[0]["plain"])


def test_reading_a_released_parameter_raises_a_clear_error(results) -> None:
    """Between steps a parameter on the nvme tier has its metadata but no data: reading it raises an error naming
    the parameter and ``resident()`` (it used to read freed memory: a segfault); inside ``resident()`` it reads the
    shard as stepped, equal to the rank's part of the run without offload after the same steps (the final step)."""
    for rank, r in enumerate(results):
        outside, inside = r["nvme"]["seen"]["outside"], r["nvme"]["seen"]["inside"]
        assert len(outside) == STEPS and len(inside) == STEPS
        name = next(iter(r["plain"]["params"]))
        full = torch.as_tensor(r["plain"]["params"][name])
        for kind, msg, numel, shape in outside:
            assert kind == "error", (kind, msg)
            assert "OffloadPolicy(params='nvme')" in msg and "param_offload.resident()" in msg, msg
            assert name in msg, (name, msg)
            assert numel == full.numel() and shape == tuple(full.shape), (numel, shape)
        rows = full.shape[0] // WORLD + (full.shape[0] % WORLD > 0)
        want = full[rank * rows : (rank + 1) * rows]
        assert torch.equal(inside[-1][: want.shape[0]], want), rank


def test_lion_matches_single_process(results) -> None:
    loss, par = _rel_errors(results[0]["lion"], lib_reference("lion"))
    print(f"lion: max loss rel err {loss:.2e}, max param rel err {par:.2e}")
    assert loss <= EXACT_TOL and par <= EXACT_TOL


def test_bf16_mixed_matches_single_process(results) -> None:
    got = results[0]["nvme_bf16-mixed"]
    assert got["dtypes"] == ["torch.bfloat16"]
    assert not _bf16_mismatches(got, reference(bf16=True))
    assert _bitwise(got, results[0]["plain_bf16-mixed"])
    seen = results[1]["nvme_bf16-mixed"]["seen"]
    assert seen["resident"] == seen["kept"]


def test_bf16_true_equals_no_offload(results) -> None:
    got = results[0]["nvme_bf16-true"]
    assert got["dtypes"] == ["torch.bfloat16"]
    assert _bitwise(got, results[0]["plain_bf16-true"])
    # bf16 shards: half the bytes of the fp32 run's files
    assert got["seen"]["shard_bytes"][0] * 2 == results[0]["nvme"]["seen"]["shard_bytes"][0]
    assert got["seen"]["resident"] == got["seen"]["kept"]


def test_checkpoint_resume_is_bit_exact(results) -> None:
    r = results[0]
    assert len(r["ckpt"]) == 1, r["ckpt"]
    whole, resumed = r["whole"], r["resumed"]
    assert len(resumed["losses"]) == STEPS - EPOCH_STEPS
    assert resumed["losses"] == whole["losses"][EPOCH_STEPS:]
    assert _bitwise(resumed, {"losses": resumed["losses"], "params": whole["params"]})
    assert resumed["seen"]["resident"] == resumed["seen"]["kept"]
