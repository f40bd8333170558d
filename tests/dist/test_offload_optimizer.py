"""``offload_optimizer="cpu"|"nvme"`` under V17Strategy at ZeRO-1/2/3, 2 gloo ranks, against a single-process run of
the same optimizer (``lightning_v17/engine/offload/optimizer.py``, ``lightning_v17/engine/offload/nvme.py``).

One spawned pair of ranks runs every case (a Trainer per optimizer, stage and tier, with the TinyLM, data and
LightningModule of tests/dist/test_zero_parity.py). ``CHUNK_MB`` cuts the optimizer's parameters into ~10 chunks, so
the step really runs chunk by chunk with reads ahead and write-backs. The reference is
``tests/dist/test_optim_library.py``'s plain loop in the test process, same optimizer, same global batches.

Checks:

* **Exactness**: for AdamW, CPU-Adam, Adafactor, Lion and Adam8bit at ZeRO-1, 2 and 3 with the nvme tier (AdamW and
  Adafactor with the cpu tier and a 50/50 cpu/nvme split too): losses and final parameters within ``EXACT_TOL`` =
  1e-6 relative of the single-process run. Adam8bit at ZeRO-3 quantizes each rank's shard in its own 256-value blocks
  (the 1-D tensors' shards split a block), as without offload: ``EIGHT_BIT_*`` tolerances of test_optim_library
  (measured there: update error 1.1e-2). Offload itself changes nothing: AdamW and Adafactor with offload equal the
  same V17 run without offload bit for bit, at every stage.
* **Really offloaded**: after every step of an nvme run no per-parameter state tensor is left in the optimizer's
  memory, the rank's folder under ``nvme_path`` holds the state's bytes, and the folder is gone after ``fit``.
* **Negative control**: rank 1 steps with 1.5x the lr (nvme tier, ZeRO-3): the parameters miss by > 100x the tolerance.
* **Checkpoints**: a ZeRO-3 nvme run saves a sharded checkpoint after step 3, the last batch of its first epoch (the
  state read from the tier), fresh Trainers resume from it (the state written back to the tier) at ZeRO-3 and, resharded, at ZeRO-1, and
  finish bit-identical (==) to the uninterrupted nvme run (ZeRO-1 within EXACT_TOL: another gradient reduction).
"""

from __future__ import annotations

import glob
import os

import pytest
import torch

from lightning_v17.engine.state import state_of
from tests._dist import spawn
from tests._glibc import mallinfo2, mapped_by
from tests.dist.test_offload_params import check_fp32, fit_params, too_small
from tests.dist.test_optim_library import (
    EIGHT_BIT_LOSS_TOL,
    EIGHT_BIT_UPDATE_TOL,
    EXACT_TOL,
    OPTIMIZERS,
    _cpu_adam_skip_reason,
    _loss_errors,
    _make,
    _param_errors,
    _update_errors,
    reference,
)
from tests.dist.test_zero_parity import PER_RANK_BATCH, STEPS, WORLD, _full_params, _lit_cls, make_data, make_model

#: the compositions this file checks against one process (docs/gen_layouts.py builds docs/layouts.md from them)
COMPOSES = (("offload_optimizer", "zero1"), ("offload_optimizer", "zero2"),
            ("offload_optimizer", "zero3"))  # fmt: skip

pytestmark = pytest.mark.timeout(400)

NAMES = ("adamw", "cpu_adam", "adafactor", "lion", "adam8bit")
STAGES = (1, 2, 3)
CHUNK_MB = 1e-3  # ~260 fp32 elements of this rank per chunk: the TinyLM steps in ~6-10 chunks
#: (name, tier) cases per stage beyond nvme for every optimizer
EXTRA = (("adamw", "none"), ("adamw", "cpu"), ("adamw", "split"), ("adafactor", "none"), ("adafactor", "cpu"))
EPOCH_STEPS = 3  # the resume case: one epoch is 3 steps, the checkpoint is at its end


def _malloc_maps() -> bool | str:
    """Whether glibc gives a CPU tensor too large for any free heap chunk (``fordblks``, all arenas, + 1 MiB) a
    mapping of its own rather than growing the heap: whether its mmap threshold is at most that size right now. A
    request a free chunk can hold is served from the heap whatever the threshold, so that is what the threshold
    decides. Needs the size below 32 MiB (glibc's largest dynamic threshold, the one after ``own_mappings``), else
    says how much is free."""
    nbytes = mallinfo2().fordblks + 2**20
    if nbytes >= 32 * 2**20:
        return f"{nbytes - 2**20} B free in the heap: cannot tell"
    return mapped_by(nbytes) >= nbytes


def _fit(name: str, stage: int, tier: str, root: str, *, lr_scale_rank1: float = 1.0, max_steps: int = STEPS,
         batches: int = STEPS, ckpt_dir: str | None = None, ckpt_path: str | None = None,
         host_memory: str | None = None) -> dict:  # fmt: skip
    import lightning as L
    import torch.distributed as dist
    from lightning_v17.strategies import V17Strategy
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from lightning_v17.config import OffloadPolicy
    from lightning_v17.engine.offload.handles import offload_of

    rank = int(os.environ["RANK"])
    over = {"lr": OPTIMIZERS[name]["lr"] * lr_scale_rank1} if rank == 1 else {}
    model = _lit_cls(lambda params: _make(name, params, **over))()
    x, y = make_data(batches * WORLD * PER_RANK_BATCH)
    ds = TensorDataset(x, y)
    loader = DataLoader(
        ds, batch_size=PER_RANK_BATCH, sampler=DistributedSampler(ds, num_replicas=WORLD, rank=rank, shuffle=False)
    )
    nvme_path = os.path.join(root, f"{name}-{stage}-{tier}")
    os.makedirs(nvme_path, exist_ok=True)
    offload = None
    if tier != "none":
        offload = OffloadPolicy(
            optimizer="cpu" if tier == "cpu" else "nvme", nvme_path=None if tier == "cpu" else nvme_path,
            optimizer_ratio=0.5 if tier == "split" else 1.0, chunk_mb=CHUNK_MB, host_memory=host_memory,
        )  # fmt: skip
    seen: dict = {"own_bytes": [], "disk": [], "folder": None, "chunks": 0, "nvme_chunks": 0, "mapped_from": [],
                  "maps_in_backward": [], "maps_after_step": [], "gathers_mapped": []}  # fmt: skip

    class Probe(L.Callback):
        def on_after_backward(self, trainer, pl_module) -> None:  # still inside the strategy's backward
            seen["maps_in_backward"].append(_malloc_maps())

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            opt = trainer.optimizers[0]
            tensors = [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0]
            ptrs = [(v._local_tensor if hasattr(v, "_local_tensor") else v).data_ptr() for v in tensors]
            seen["own_bytes"].append(sum(
                (v._local_tensor if hasattr(v, "_local_tensor") else v).untyped_storage().nbytes()
                for v, p in zip(tensors, ptrs) if ptrs.count(p) == 1
            ))  # fmt: skip
            # the reduce-scatter buffers (the sharded gradients) of every FSDP2 unit: own mappings under "recycle"
            seen["mapped_from"].append(sorted({str(state_of(m).reduce_scatter.mapped_from) for m in pl_module.modules()
                                               if state_of(m).reduce_scatter is not None}))  # fmt: skip
            seen["maps_after_step"].append(_malloc_maps())
            seen["gathers_mapped"].append(_gathers_mapped(pl_module))
            off = offload_of(opt)
            if off is not None:
                seen["disk"].append(off.disk_bytes())
                seen["chunks"], seen["nvme_chunks"] = len(off.chunks), off.nvme_chunks
                seen["folder"] = str(off.files.folder) if off.files is not None else None

    callbacks: list = [Probe()]
    if ckpt_dir is not None:
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(
            dirpath=ckpt_dir, every_n_train_steps=EPOCH_STEPS, save_on_train_epoch_end=False, save_top_k=-1,
        ))  # fmt: skip
    trainer = L.Trainer(
        accelerator="cpu", devices=WORLD, strategy=V17Strategy(zero_stage=stage, offload=offload),
        max_steps=max_steps, use_distributed_sampler=False, logger=False, enable_checkpointing=ckpt_dir is not None,
        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
    )  # fmt: skip
    trainer.fit(model, loader, ckpt_path=ckpt_path)
    seen["mapped_from_after"] = sorted({str(state_of(m).reduce_scatter.mapped_from) for m in model.modules()
                                        if state_of(m).reduce_scatter is not None})  # fmt: skip
    seen["gathers_mapped_after"] = _gathers_mapped(model)
    losses = torch.tensor(model.losses)
    dist.all_reduce(losses)
    return {
        "losses": (losses / WORLD).tolist(),
        "params": _full_params(model),
        "seen": seen,
        "folder_after": seen["folder"] is not None and os.path.exists(seen["folder"]),
        "left_in_nvme_path": sorted(os.listdir(nvme_path)),
    }


def _worker(rank: int, world_size: int, names: list[str], root: str) -> dict:
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    # first, while the heap is fresh: its glibc probes need less than 31 MiB free in the heap (_malloc_maps)
    out: dict = {"fit": {("adamw", 3, "nvme"): _fit("adamw", 3, "nvme", root)}}
    for stage in STAGES:
        for name in names:
            if (name, stage) != ("adamw", 3):
                out["fit"][(name, stage, "nvme")] = _fit(name, stage, "nvme", root)
        for name, tier in EXTRA:
            out["fit"][(name, stage, tier)] = _fit(name, stage, tier, root)
    out["negative"] = _fit("adamw", 3, "nvme", root, lr_scale_rank1=1.5)
    out["return"] = _fit("adamw", 3, "nvme", root, host_memory="return")
    # resume: 3-step epochs, checkpoint at the end of epoch 0, resumed by fresh Trainers for steps 4-5
    ckpt_dir = os.path.join(root, "ckpt")
    out["whole"] = _fit("adamw", 3, "nvme", root, batches=EPOCH_STEPS, ckpt_dir=ckpt_dir)
    dist.barrier()
    ckpt = sorted(glob.glob(os.path.join(ckpt_dir, "epoch=0-step=3*")))
    out["ckpt"] = ckpt
    out["resumed"] = _fit("adamw", 3, "nvme", root, batches=EPOCH_STEPS, ckpt_path=ckpt[0])
    out["resumed_zero1"] = _fit("adamw", 1, "nvme", root, batches=EPOCH_STEPS, ckpt_path=ckpt[0])
    dist.barrier()
    # offload_params="nvme" (tests/dist/test_offload_params.py holds the full matrix): the quick cases ride along here
    out["params_nvme"] = fit_params(root, "params", optimizer="nvme")
    out["params_too_small"] = too_small(root)  # last: this Trainer fails in setup
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def names() -> list[str]:
    skip = _cpu_adam_skip_reason()
    return [n for n in NAMES if not (n == "cpu_adam" and skip)]


@pytest.fixture(scope="module")
def results(names: list[str], tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = str(tmp_path_factory.mktemp("offload"))
    return spawn(_worker, world_size=WORLD, args=(names, root), timeout=380, init_process_group=False)


def _check_exact(name: str, stage: int, got: dict) -> None:
    ref = reference(name)
    loss_err = _loss_errors(got["losses"], ref["losses"])
    perr = _param_errors(got["params"], ref["params"])
    print(f"{name} stage {stage}: max loss rel err {max(loss_err):.2e}, max param err {max(perr.values()):.2e}")
    if name == "adam8bit" and stage == 3:
        uerr = _update_errors(got["params"], ref["params"], dict(make_model().named_parameters()))
        print(f"{name} stage 3: ||error|| / ||update|| {max(uerr.values()):.2e}")
        assert max(uerr.values()) <= EIGHT_BIT_UPDATE_TOL, uerr
        assert max(loss_err) <= EIGHT_BIT_LOSS_TOL, loss_err
        return
    assert max(loss_err) <= EXACT_TOL, loss_err
    assert max(perr.values()) <= EXACT_TOL, perr


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("name", NAMES)
def test_nvme_offload_matches_single_process(results, names, name: str, stage: int) -> None:
    if name not in names:
        pytest.skip(_cpu_adam_skip_reason())
    for rank, res in enumerate(results):
        got = res["fit"][(name, stage, "nvme")]
        seen = got["seen"]
        # every step ran through the nvme tier: nothing of the per-parameter state in memory, all of it on disk
        assert seen["chunks"] >= 2 and seen["nvme_chunks"] == seen["chunks"], seen  # (owner mode: fewer params)
        assert seen["own_bytes"] == [0] * STEPS, (rank, seen["own_bytes"])
        assert min(seen["disk"]) > 0, seen["disk"]
        assert not got["folder_after"] and got["left_in_nvme_path"] == []  # removed at teardown
    _check_exact(name, stage, results[0]["fit"][(name, stage, "nvme")])


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize(("name", "tier"), [c for c in EXTRA if c[1] != "none"])
def test_cpu_tier_and_split_match_single_process(results, name: str, tier: str, stage: int) -> None:
    got = results[0]["fit"][(name, stage, tier)]
    _check_exact(name, stage, got)
    seen = got["seen"]
    if tier == "cpu":
        assert seen["folder"] is None and seen["disk"] == [0] * STEPS and min(seen["own_bytes"]) > 0
    else:  # split: about half the chunks on nvme, the rest in memory
        assert 0 < seen["nvme_chunks"] < seen["chunks"] and min(seen["disk"]) > 0 and min(seen["own_bytes"]) > 0


@pytest.mark.parametrize("stage", STAGES)
def test_offload_changes_nothing_bitwise(results, stage: int) -> None:
    """The same V17 run with and without offload: identical losses and parameters, bit for bit."""
    for name, tier in [(n, t) for n in ("adamw", "adafactor") for t in ("nvme", "cpu")] + [("adamw", "split")]:
        got, plain = results[0]["fit"][(name, stage, tier)], results[0]["fit"][(name, stage, "none")]
        assert got["losses"] == plain["losses"], (name, tier)
        for n, w in plain["params"].items():
            assert (torch.as_tensor(got["params"][n]) == torch.as_tensor(w)).all(), (name, tier, n)


def _gathers_mapped(module) -> list[bool]:
    """Per FSDP2 unit: are its all-gathers wrapped (instance ``unshard`` / ``wait_for_unshard``:
    ``collectives.map_all_gathers``)?"""
    groups = [m._get_fsdp_state()._fsdp_param_group for m in module.modules() if hasattr(m, "_get_fsdp_state")]
    return [{"unshard", "wait_for_unshard"} <= set(g.__dict__) for g in groups if g is not None]


def test_host_memory_recycle_maps_the_gradients_and_changes_nothing(results) -> None:
    """host_memory="recycle" (the default, ZeRO-3, nvme): every unit's reduce-scatter outputs (the sharded gradients)
    are their own mappings from 1 MiB up during fit and back on the heap after it (``collectives.map_gradient_buffers``;
    that the mapping happens and is exact: tests/dist/test_collectives.py); inside backward glibc's mmap threshold is
    1 MiB (an allocation no free heap chunk holds gets a mapping instead of growing the heap), after the step it is
    not (``ZeroBackend.backward_context``); every unit's all-gathers run inside ``own_mappings`` during fit and are
    the class's own again after it (``collectives.map_all_gathers``); "return" maps nothing of its own; both runs
    equal bit for bit."""
    for r in results:
        ret, default = r["return"], r["fit"][("adamw", 3, "nvme")]
        assert default["seen"]["mapped_from"] == [[str(2**20)]] * STEPS, default["seen"]["mapped_from"]
        assert default["seen"]["mapped_from_after"] == ["None"], default["seen"]["mapped_from_after"]
        assert default["seen"]["maps_in_backward"] == [True] * STEPS, default["seen"]["maps_in_backward"]
        assert default["seen"]["maps_after_step"] == [False] * STEPS, default["seen"]["maps_after_step"]
        assert ret["seen"]["mapped_from"] == [["None"]] * STEPS, ret["seen"]["mapped_from"]
        gathers = default["seen"]["gathers_mapped"]
        assert len(gathers) == STEPS and all(g and all(g) for g in gathers), gathers
        assert default["seen"]["gathers_mapped_after"] and not any(default["seen"]["gathers_mapped_after"])
        assert not any(g for step in ret["seen"]["gathers_mapped"] for g in step)
    ret, default = results[0]["return"], results[0]["fit"][("adamw", 3, "nvme")]
    assert ret["losses"] == default["losses"]
    for n, w in default["params"].items():
        assert (torch.as_tensor(ret["params"][n]) == torch.as_tensor(w)).all(), n


def test_negative_control_wrong_lr_on_one_rank_fails(results) -> None:
    perr = _param_errors(results[0]["negative"]["params"], reference("adamw")["params"])
    assert max(perr.values()) > 100 * EXACT_TOL, perr


def test_checkpoint_resume_with_state_on_nvme_is_exact(results) -> None:
    r = results[0]
    assert len(r["ckpt"]) == 1, r["ckpt"]
    whole, resumed, zero1 = r["whole"], r["resumed"], r["resumed_zero1"]
    assert len(whole["losses"]) == STEPS and len(resumed["losses"]) == STEPS - EPOCH_STEPS
    assert resumed["losses"] == whole["losses"][EPOCH_STEPS:]
    for n, w in whole["params"].items():
        assert (torch.as_tensor(resumed["params"][n]) == torch.as_tensor(w)).all(), n
    # resharded to ZeRO-1 (rows of AdamW's state instead of FSDP2 shards), still on the nvme tier
    assert max(_loss_errors_n(zero1["losses"], whole["losses"][EPOCH_STEPS:])) <= EXACT_TOL
    assert max(_param_errors(zero1["params"], whole["params"]).values()) <= EXACT_TOL
    assert zero1["seen"]["nvme_chunks"] > 0 and zero1["seen"]["own_bytes"] == [0] * (STEPS - EPOCH_STEPS)


def _loss_errors_n(got: list[float], want: list[float]) -> list[float]:
    assert len(got) == len(want)
    return [abs(a - b) / abs(b) for a, b in zip(got, want)]


def test_params_on_nvme_match_single_process_and_are_really_offloaded(results) -> None:
    """offload_params="nvme" with offload_optimizer="nvme", fp32 AdamW: losses and parameters within 1e-6 of one
    process; no parameter shard in memory after any step, every shard's bytes in the rank's files, removed at the
    end (test_offload_params.check_fp32)."""
    check_fp32(results, "params_nvme")


def test_params_on_a_too_small_drive_are_refused_before_training(results) -> None:
    for res in results:
        err = res["params_too_small"]["error"]
        assert err is not None and "nvme_path=" in err and "GiB free, but this rank offloads" in err, err
