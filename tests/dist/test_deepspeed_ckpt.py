"""Reading DeepSpeed checkpoints, against DeepSpeed itself, on CPU gloo ranks.

The inputs are real: raw DeepSpeed (``deepspeed.initialize``, CPU accelerator, gloo, torch AdamW, gradient clipping
1.0) trains a small 3-layer MLP for 4 steps at ZeRO-1/2/3 (fp32) and ZeRO-2/3 (bf16) on 2 ranks, and at ZeRO-1/3
on 1 rank, and saves with ``engine.save_checkpoint``; the 2-rank ZeRO-2 run then continues 4 more steps as the
reference. Lightning's own ``DeepSpeedStrategy`` (its CUDA-only guards lifted in a subclass, nothing else changed)
writes a checkpoint with Lightning's client state. DeepSpeed's universal-checkpoint conversion (``ds_to_universal
--inject_missing_state``) of every save is the reader's reference.

Tolerances: the reader equals ds_to_universal bitwise. V17 at ZeRO-3 and ZeRO-1 on 2 ranks, resumed from the ZeRO-2
save, matches DeepSpeed's continued losses and final weights within 1e-6 absolute (measured: losses equal, weights
3e-8). V17 at tp=2 on 2 ranks (dp=1; the middle Linear pair column/row-sharded, the full fp32 master weights and
Adam moments cut onto those DTensor placements, clipping on) sees both DeepSpeed ranks' batches at once and matches
within 1e-6 relative on the losses and 1e-6 absolute on the gathered final weights (measured 1.2e-7, 3e-8). V17 at
ZeRO-1 on 1 rank, on both DeepSpeed ranks' batches at once, matches within 1e-5 relative (the fp32
summation order of the doubled batch differs from the all-reduce's; measured 8e-8). The loaded optimizer state owns
its memory (the load maps the DeepSpeed files). DeepSpeed refuses fp16 on CPU, so the fp16 loss-scale mapping is
checked on DeepSpeed's own scaler objects, pickled by the DeepSpeed worker as its optimizer files pickle them.
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import pytest
import torch

from tests._dist import spawn

pytest.importorskip("deepspeed")

B, N_SAVE, N_MORE = 4, 4, 4  # per-rank batch, steps before the save, steps after it
N = 2 * B * (N_SAVE + N_MORE)
# name -> (ZeRO stage, bf16, dp size that saves it)
CONFIGS = {"z1": (1, False, 2), "z2": (2, False, 2), "z3": (3, False, 2), "z2_bf16": (2, True, 2),
           "z3_bf16": (3, True, 2), "z1_dp1": (1, False, 1), "z3_dp1": (3, False, 1)}  # fmt: skip
DS_CFG = {"train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
          "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False,
          "steps_per_print": 10**9}  # fmt: skip
TOL = 1e-6


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return torch.randn(N, 5, generator=g), 3 * torch.randn(N, 3, generator=g)  # large targets: clipping is active


def _mlp() -> torch.nn.Module:
    # 133 parameters: stage 1/2 pad the flat group, stage 3 pads the odd-sized tensors (35, 7, 3 elements), and the
    # middle pair is even-sized, so TP_PLAN shards it (a DTensor chunking of 7 rows is uneven, which TP refuses)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 8), torch.nn.ReLU(),
                               torch.nn.Linear(8, 3))  # fmt: skip


PARAMS = sorted(f"{i}.{k}" for i in (0, 2, 4) for k in ("bias", "weight"))
TP_PLAN = {"model.2": "colwise", "model.4": "rowwise"}  # Megatron's MLP pair (Shoeybi 2019 §3)


def _rank_batch(step: int, rank: int) -> list[int]:
    # rank `rank`'s samples at `step`: interleaved over the 2 ranks
    return [(step * B + j) * 2 + rank for j in range(B)]


def _module_class():
    import lightning as L

    class Regressor(L.LightningModule):
        """A user's module: ``self.model`` + AdamW + StepLR; records its batch indices, losses, lr and epoch."""

        def __init__(self, scheduler: bool = True) -> None:
            super().__init__()
            self.scheduler = scheduler
            self.model = _mlp()
            self.seen: list[tuple[int, float, float]] = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.model(x.to(self.dtype)).float(), y)
            lr = self.trainer.optimizers[0].param_groups[0]["lr"]
            self.seen.append((batch_idx, float(loss.detach()), lr, self.trainer.current_epoch))
            return loss

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)
            if not self.scheduler:  # raw DeepSpeed ran without one
                return opt
            sched = torch.optim.lr_scheduler.StepLR(opt, 3, 0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return Regressor


def _cpu_deepspeed_strategy(**kw):
    """Lightning's DeepSpeedStrategy with only its accelerator guards lifted: DeepSpeed's CPU accelerator runs it."""
    from lightning.fabric.utilities.seed import reset_seed
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy

    class CPUDeepSpeedStrategy(DeepSpeedStrategy):
        def setup_environment(self) -> None:  # skips "only supported on CUDA GPUs"
            DDPStrategy.setup_environment(self)

        def setup_distributed(self) -> None:  # skips the CUDA device-index check
            reset_seed()
            self.set_world_ranks()
            self._init_deepspeed_distributed()

        @property
        def root_device(self) -> torch.device:  # DeepSpeedEngine needs a device index
            return torch.device("cpu", self.local_rank)

    return CPUDeepSpeedStrategy(**kw)


def _deepspeed_worker(rank: int, world: int, root: str) -> dict:
    """Raw DeepSpeed at dp=`world`: the saves of CONFIGS at that dp size, their ds_to_universal conversions, and at
    dp=2 the continued ZeRO-2 run and Lightning's DeepSpeedStrategy save."""
    import os

    os.environ["DS_ACCELERATOR"] = "cpu"
    os.environ["TORCH_EXTENSIONS_DIR"] = str(Path(root) / "torch_extensions")  # never wait on a stale shared lock
    import deepspeed
    import deepspeed.ops

    # DeepSpeed's shared-memory all-reduce is a JIT-built C++ op (about 70 s of g++ here); gloo does the same job
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    x, y = _data()
    out: dict = {"losses": [], "timings": {}}
    names = [n for n, (_, _, dp) in CONFIGS.items() if dp == world]
    for name in names:
        stage, bf16, _ = CONFIGS[name]
        torch.manual_seed(0)
        model = _mlp()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        cfg = {**DS_CFG, "zero_optimization": {"stage": stage}, **({"bf16": {"enabled": True}} if bf16 else {})}
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)

        def step(i: int, engine=engine, bf16=bf16) -> float:
            idx = _rank_batch(i, rank)
            pred = engine(x[idx].bfloat16() if bf16 else x[idx]).float()
            loss = torch.nn.functional.mse_loss(pred, y[idx])
            engine.backward(loss)
            engine.step()
            return float(loss)

        for i in range(N_SAVE):
            step(i)
        # z1 carries a class outside the allow-list in its client state: the reader must refuse it by name
        client = {"hparams": argparse.Namespace(lr=1e-2)} if name == "z1" else {"note": name}
        engine.save_checkpoint(str(Path(root) / name), client_state=client)
        if name == "z2":
            out["losses"] = [step(i) for i in range(N_SAVE, N_SAVE + N_MORE)]
            out["final"] = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    if world == 2:
        _lightning_deepspeed_run(root)
    if world == 2 and rank == 0:  # DeepSpeed's fp16 scaler objects (no fp16 save runs on CPU), as its files pickle them
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler

        scalers = {"dynamic": DynamicLossScaler(init_scale=2.0**12, scale_window=100, min_scale=1, delayed_shift=2,
                                                consecutive_hysteresis=False),
                   "static128": LossScaler(scale=128), "static1": LossScaler()}  # fmt: skip
        for key, scaler in scalers.items():
            torch.save({"loss_scaler": scaler, "dynamic_loss_scale": scaler.dynamic}, Path(root) / f"scaler_{key}.pt")
    if rank == 0:  # DeepSpeed's own conversion of every save, the reader's reference
        from deepspeed.checkpoint import ds_to_universal

        for name in names:
            src = Path(root) / name
            tag = (src / "latest").read_text().strip()
            t0 = time.perf_counter()
            ds_to_universal.main(argparse.Namespace(
                input_folder=str(src / tag), output_folder=str(Path(root) / f"universal_{name}" / tag),
                num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False, strict=True,
                inject_missing_state=True))  # fmt: skip
            out["timings"][name] = time.perf_counter() - t0
    torch.distributed.barrier()
    return out


def _lightning_deepspeed_run(root: str) -> None:
    """Lightning's DeepSpeedStrategy (ZeRO-2) trains 4 steps and saves: Lightning's checkpoint dict as client_state."""
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    L.seed_everything(0, verbose=False)
    keep = ("train_micro_batch_size_per_gpu", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer")
    strategy = _cpu_deepspeed_strategy(config={**{k: DS_CFG[k] for k in keep}, "zero_optimization": {"stage": 2}})
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=N_SAVE, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(_module_class()(), DataLoader(TensorDataset(*_data()), batch_size=B))
    trainer.save_checkpoint(str(Path(root) / "lightning_z2"))


@pytest.fixture(scope="module")
def ds_root(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("deepspeed")
    results = spawn(_deepspeed_worker, world_size=2, args=(str(root),), timeout=300)
    single = spawn(_deepspeed_worker, world_size=1, args=(str(root),), timeout=300)
    timings = {**results[0]["timings"], **single[0]["timings"]}
    print(f"ds_to_universal in-process seconds per save (deepspeed imported already): {timings}")
    return root, {"rank": results}


def _universal(root: Path, name: str) -> dict[str, dict[str, torch.Tensor]]:
    base = root / f"universal_{name}" / (root / name / "latest").read_text().strip() / "zero"
    out: dict[str, dict[str, torch.Tensor]] = {}
    for d in base.iterdir():
        if d.is_dir():
            for f in d.glob("*.pt"):
                v = torch.load(f, weights_only=False)  # DeepSpeed's own output, trusted
                out.setdefault(d.name, {})[f.stem] = v["param"] if isinstance(v, dict) else v
    return out


def _read(root: Path, name: str):
    import sys

    from lightning_v17.checkpoint.deepspeed import read_deepspeed_checkpoint

    saved = sys.modules.get("deepspeed", "absent")
    sys.modules["deepspeed"] = None  # any `import deepspeed` while reading raises ImportError
    try:
        return read_deepspeed_checkpoint(root / name, safe_globals=[argparse.Namespace] if name == "z1" else [])
    finally:
        if saved == "absent":
            del sys.modules["deepspeed"]
        else:
            sys.modules["deepspeed"] = saved


@pytest.mark.parametrize("name", list(CONFIGS))
def test_reader_equals_ds_to_universal_bitwise(ds_root, name: str) -> None:
    from lightning_v17.checkpoint.deepspeed import read_deepspeed_checkpoint

    root, _ = ds_root
    ours = _read(root, name)
    ref = _universal(root, name)
    stage, bf16, dp = CONFIGS[name]
    assert (ours.saved_stage, ours.dp_world_size, ours.bf16) == (stage, dp, bf16)
    assert sorted(ref) == sorted(ours.fp32) == PARAMS
    for p, states in ref.items():
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            mine = ours.fp32[p] if key == "fp32" else ours.optim[p][key]
            # stage 3's universal files are flat; ours have the parameter's shape
            assert torch.equal(mine.flatten(), states[key].flatten()), (name, p, key)
        if "step" in states:
            assert torch.equal(ours.optim[p]["step"], states["step"]), (name, p)
        assert ours.optim[p]["step"].item() == N_SAVE
    assert ours.weights["0.weight"].dtype == (torch.bfloat16 if bf16 else torch.float32)
    assert ours.global_steps == N_SAVE and ours.param_groups[0]["lr"] == 1e-2
    # fp32 and bf16 runs pickle a static LossScaler that scales nothing: V17's fp32/bf16 (no scaler), nothing to map
    from lightning_v17.checkpoint.deepspeed_convert import loss_scale_from_deepspeed

    assert ours.loss_scaler == {"cur_scale": 1.0, "dynamic": False, "dynamic_loss_scale": False, "overflow": False}
    assert loss_scale_from_deepspeed(ours) is None
    # mmap=True (the online load's): the same tensors, as views of the mapped partitions where a parameter lies in
    # one fragment (the V17 loads must copy them: _aliased_state)
    allow = [argparse.Namespace] if name == "z1" else []
    mapped = read_deepspeed_checkpoint(root / name, safe_globals=allow, mmap=True)
    views = 0
    for p in ref:
        for key in ("exp_avg", "exp_avg_sq"):
            t = mapped.optim[p][key]
            assert torch.equal(t, ours.optim[p][key]), (name, p, key)
            views += t.untyped_storage().nbytes() > t.numel() * t.element_size()
    assert views > 0 or dp == 2 and stage == 3  # at stage 3 on 2 ranks every parameter is cat from 2 pieces


def test_deepspeed_fp16_loss_scale_reaches_the_v17_scaler(ds_root) -> None:
    """DeepSpeed refuses fp16 on CPU, so no fp16 save exists here; DeepSpeed's own scaler objects (the classes its
    fp16 optimizer files pickle, saved by the DeepSpeed worker) go through the allow-listed loader, and their scale
    into V17's loss scaler."""
    from lightning.pytorch.plugins.precision import MixedPrecision
    from lightning_v17.strategies._checkpoint import _carry_loss_scale

    from lightning_v17 import V17Strategy
    from lightning_v17.checkpoint.deepspeed import DeepSpeedState, _load
    from lightning_v17.checkpoint.deepspeed_convert import loss_scale_from_deepspeed
    from lightning_v17.engine.precision import ShardedLossScaler
    from lightning_v17.trackers import LossScaleTracker

    root, _ = ds_root
    scales, states = {}, {}
    for name in ("dynamic", "static128", "static1"):
        loaded = _load(root / f"scaler_{name}.pt", weights_only=None, safe_globals=())
        states[name] = DeepSpeedState(source=root, saved_stage=2, dp_world_size=1, bf16=False, loss_scaler={
            **vars(loaded["loss_scaler"]), "dynamic_loss_scale": loaded["dynamic_loss_scale"]})  # fmt: skip
        scales[name] = loss_scale_from_deepspeed(states[name])
    assert scales == {"dynamic": 4096.0, "static128": 128.0, "static1": None}
    strategy = V17Strategy()
    strategy.precision_plugin = MixedPrecision("16-mixed", "cpu", scaler=ShardedLossScaler(LossScaleTracker()))
    with pytest.warns(UserWarning, match=r"DeepSpeed's fp16 loss scale 4096.*counters restart"):
        _carry_loss_scale(strategy, states["dynamic"])
    assert strategy.precision_plugin.scaler.get_scale() == 4096.0
    strategy.precision_plugin = MixedPrecision("bf16-mixed", "cpu")
    with pytest.warns(UserWarning, match=r"in fp16 \(loss scale 4096\); precision='bf16-mixed'.*not used"):
        _carry_loss_scale(strategy, states["dynamic"])


def _aliased_state(opt: torch.optim.Optimizer) -> list[str]:
    """Optimizer state tensors that do not own their memory: views of a bigger buffer (a DeepSpeed flat partition
    of the checkpoint file the load mapped, which must not outlive the load)."""
    from torch.distributed.tensor import DTensor

    out = []
    for i, st in enumerate(opt.state.values()):
        for k, v in st.items():
            t = v.to_local() if isinstance(v, DTensor) else v
            if torch.is_tensor(t) and t.dim() > 0 and t.untyped_storage().nbytes() != t.numel() * t.element_size():
                out.append(f"{i}.{k}")
    return out


def _v17_worker(rank: int, world: int, root: str) -> dict:
    import lightning as L
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor
    from torch.utils.data import DataLoader, TensorDataset

    from tests._strategy import v17

    x, y = _data()
    out: dict = {}
    common = {"accelerator": "cpu", "devices": 2, "logger": False, "enable_checkpointing": False,
              "enable_progress_bar": False, "enable_model_summary": False, "gradient_clip_val": 1.0}  # fmt: skip
    # raw DeepSpeed ZeRO-2 -> V17 ZeRO-3 and ZeRO-1, and the same save converted once (`v17 convert-deepspeed`)
    for run, (ckpt, stage) in {3: ("z2", 3), 1: ("z2", 1), "converted": ("converted_z2", 3)}.items():
        L.seed_everything(123, verbose=False)  # another init: the loaded weights must replace it
        module = _module_class()(scheduler=False)
        trainer = L.Trainer(strategy=v17(zero_stage=stage), max_steps=N_MORE, use_distributed_sampler=False, **common)
        # raw DeepSpeed saves no data position: each rank is served the batches DeepSpeed's rank saw after the save
        idx = [i for step in range(N_SAVE, N_SAVE + N_MORE) for i in _rank_batch(step, rank)]
        trainer.fit(module, DataLoader(TensorDataset(x[idx], y[idx]), batch_size=B), ckpt_path=str(Path(root) / ckpt))
        full = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
        out[run] = {"losses": [s[1] for s in module.seen], "final": {k: v.detach().clone() for k, v in full.items()},
                    "aliased": _aliased_state(trainer.optimizers[0])}  # fmt: skip
    # raw DeepSpeed ZeRO-2 -> V17 tp=2 (dp=1): both ranks hold shards of model.2/model.4 and see the same batch, both
    # DeepSpeed ranks' batches at once (its gradient is the mean of theirs, as DeepSpeed's all-reduce averages)
    L.seed_everything(123, verbose=False)
    module = _module_class()(scheduler=False)
    trainer = L.Trainer(strategy=v17(tp=2, tp_plan=TP_PLAN), max_steps=N_MORE, use_distributed_sampler=False, **common)
    idx = [i for step in range(N_SAVE, N_SAVE + N_MORE) for r in (0, 1) for i in _rank_batch(step, r)]
    trainer.fit(module, DataLoader(TensorDataset(x[idx], y[idx]), batch_size=2 * B), ckpt_path=str(Path(root) / "z2"))
    opt = trainer.optimizers[0]
    layouts = {n: (str(p.placements), p.to_local().shape, str(opt.state[p]["exp_avg"].placements))
               for n, p in module.named_parameters() if isinstance(p, DTensor)}  # fmt: skip
    full = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
    out["tp2"] = {"losses": [s[1] for s in module.seen], "final": {k: v.detach().clone() for k, v in full.items()},
                  "layouts": layouts, "zero_stage": trainer.strategy.zero.stage}  # fmt: skip
    # Lightning's DeepSpeedStrategy checkpoint: epoch, global step, data position and scheduler resume
    L.seed_everything(123, verbose=False)
    module = _module_class()()
    trainer = L.Trainer(strategy=v17(zero_stage=3), max_steps=N_SAVE + 2, **common)
    trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=B), ckpt_path=str(Path(root) / "lightning_z2"))
    out["lightning"] = {"seen": module.seen, "global_step": trainer.global_step}
    # under trainer.fit a class outside the allow-list is refused by name, with the opt-in that reaches V17
    from lightning_v17.checkpoint import UnsafeCheckpointError

    trainer = L.Trainer(strategy=v17(zero_stage=3), max_steps=1, **common)
    try:
        trainer.fit(_module_class()(), DataLoader(TensorDataset(x, y), batch_size=B), ckpt_path=str(Path(root) / "z1"))
        out["refusal"] = None
    except UnsafeCheckpointError as err:
        out["refusal"] = str(err)
    return out


def test_v17_resumes_deepspeed_zero2_at_zero3_zero1_and_tp2(ds_root) -> None:
    root, res = ds_root
    from lightning_v17.checkpoint.deepspeed_convert import convert_deepspeed

    convert_deepspeed(root / "z2", root / "converted_z2", prefix="model.")
    v17_ranks = spawn(_v17_worker, world_size=2, args=(str(root),), timeout=240, init_process_group=False)
    worst = {"loss": 0.0, "weight": 0.0}
    for rank in range(2):
        ds = res["rank"][rank]
        for stage in (3, 1, "converted"):
            got = v17_ranks[rank][stage]
            assert got["aliased"] == [], (rank, stage, got["aliased"])
            diff = max(abs(a - b) for a, b in zip(got["losses"], ds["losses"]))
            assert len(got["losses"]) == N_MORE and diff <= TOL, (rank, stage, got["losses"], ds["losses"])
            worst["loss"] = max(worst["loss"], diff)
            for k, ref in ds["final"].items():
                w = (got["final"][f"model.{k}"] - ref).abs().max().item()
                assert w <= TOL, (rank, stage, k, w)
                worst["weight"] = max(worst["weight"], w)
    print(
        f"V17 ZeRO-3/ZeRO-1 (and from the converted save) resumed from DeepSpeed ZeRO-2, max abs difference over "
        f"{N_MORE} steps: {worst}"
    )
    # tp=2: the loss of both DeepSpeed ranks' batches is the mean of their losses
    ref = [(a + b) / 2 for a, b in zip(res["rank"][0]["losses"], res["rank"][1]["losses"])]
    for rank in range(2):
        got = v17_ranks[rank]["tp2"]
        print(f"V17 tp=2 (zero_stage={got['zero_stage']}) rank {rank} layouts {got['layouts']}")
        lay = got["layouts"]  # the tp axis is the mesh's last (ZeRO-3's dp_shard axis has size 1 here)
        assert lay["model.2.weight"][0].endswith("Shard(dim=0))") and lay["model.2.weight"][1] == (4, 7), lay
        assert lay["model.4.weight"][0].endswith("Shard(dim=1))") and lay["model.4.weight"][1] == (3, 4), lay
        assert all(param == moment for param, _, moment in lay.values()), lay  # exp_avg on the weights' placements
        assert len(got["losses"]) == N_MORE
        diff = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref))
        w = max((got["final"][f"model.{k}"] - v).abs().max().item() for k, v in res["rank"][0]["final"].items())
        print(f"V17 tp=2 rank {rank} from DeepSpeed ZeRO-2: max relative loss difference {diff:.2e}, weights {w:.2e}")
        assert diff <= TOL and w <= TOL, (rank, got["losses"], ref, w)
    lit = v17_ranks[0]["lightning"]
    # Lightning saved after its 4 steps (epoch=1 in its dict: a stop at max_steps counts the epoch as started);
    # the resume continues at batch 4 of that epoch, global step 4, with StepLR(3, 0.5) already stepped 4 times
    assert [(s[0], s[3]) for s in lit["seen"]] == [(N_SAVE, 1), (N_SAVE + 1, 1)]
    assert lit["global_step"] == N_SAVE + 2
    assert [s[2] for s in lit["seen"]] == [5e-3, 5e-3]
    refusal = v17_ranks[0]["refusal"]
    assert refusal is not None and "argparse.Namespace" in refusal and "add_safe_globals" in refusal


def _v17_single_worker(rank: int, world: int, root: str) -> dict:
    """V17 ZeRO-1 on 1 rank from DeepSpeed's dp=2 save: each step's batch is both DeepSpeed ranks' batches."""
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from tests._strategy import v17

    x, y = _data()
    L.seed_everything(123, verbose=False)
    module = _module_class()(scheduler=False)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=v17(zero_stage=1), max_steps=N_MORE, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        gradient_clip_val=1.0, use_distributed_sampler=False)  # fmt: skip
    idx = [i for step in range(N_SAVE, N_SAVE + N_MORE) for r in (0, 1) for i in _rank_batch(step, r)]
    trainer.fit(module, DataLoader(TensorDataset(x[idx], y[idx]), batch_size=2 * B), ckpt_path=str(Path(root) / "z2"))
    return {
        "losses": [s[1] for s in module.seen],
        "final": {k: v.detach().clone() for k, v in module.state_dict().items()},
    }


def test_v17_resumes_deepspeed_dp2_on_one_rank(ds_root) -> None:
    """The same ZeRO-2 dp=2 save at dp=1: the loss of the doubled batch is the mean of DeepSpeed's two ranks' losses;
    fp32 summation order differs, so 1e-5 relative."""
    root, res = ds_root
    got = spawn(_v17_single_worker, world_size=1, args=(str(root),), timeout=240, init_process_group=False)[0]
    ref = [(a + b) / 2 for a, b in zip(res["rank"][0]["losses"], res["rank"][1]["losses"])]
    assert len(got["losses"]) == N_MORE
    rel = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref))
    w = max((got["final"][f"model.{k}"] - v).abs().max().item() for k, v in res["rank"][0]["final"].items())
    print(f"V17 ZeRO-1 on 1 rank from DeepSpeed ZeRO-2 dp=2: max relative loss difference {rel:.2e}, weights {w:.2e}")
    assert rel <= 1e-5 and w <= 1e-5, (got["losses"], ref, w)


def test_lightning_deepspeed_client_state_is_read(ds_root) -> None:
    root, _ = ds_root
    from lightning_v17.checkpoint.deepspeed import read_deepspeed_checkpoint

    ds = read_deepspeed_checkpoint(root / "lightning_z2")
    assert ds.written_by_lightning and ds.source.name == "checkpoint"
    assert ds.client_state["global_step"] == N_SAVE
    assert sorted(ds.fp32) == [f"model.{n}" for n in PARAMS]
    assert ds.client_state["lr_schedulers"][0]["last_epoch"] == N_SAVE


def test_convert_deepspeed_cli_writes_a_v17_checkpoint(ds_root, tmp_path, capsys) -> None:
    root, _ = ds_root
    from lightning_v17.checkpoint.sharded import load_full_state_dict
    from lightning_v17.cli import main

    assert main(["convert-deepspeed", str(root / "z3"), str(tmp_path / "v17"), "--prefix", "model."]) == 0
    model = load_full_state_dict(tmp_path / "v17", "model")
    optim = load_full_state_dict(tmp_path / "v17", "optim")
    ref = _universal(root, "z3")
    for p, states in ref.items():
        assert torch.equal(model[f"model.{p}"].flatten(), states["fp32"].flatten())
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(optim["state"][f"model.{p}"][key].flatten(), states[key].flatten())
    assert main(["convert-deepspeed", str(root / "z1"), str(tmp_path / "refused")]) == 2
    err = capsys.readouterr().err
    assert "argparse.Namespace" in err and "--safe-global" in err


def test_refuses_partial_corrupt_and_unsafe_checkpoints(ds_root, tmp_path) -> None:
    from lightning_v17.checkpoint import CheckpointCorruptError, UnsafeCheckpointError
    from lightning_v17.checkpoint.deepspeed import read_deepspeed_checkpoint

    root, _ = ds_root
    with pytest.raises(UnsafeCheckpointError, match=r"argparse\.Namespace.*safe_globals"):
        read_deepspeed_checkpoint(root / "z1")

    def damaged(name: str) -> Path:
        d = tmp_path / name
        shutil.copytree(root / "z2", d)
        return d

    d = damaged("missing")
    (d / "global_step4" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(CheckpointCorruptError, match=r"missing: \[.*zero_pp_rank_1_mp_rank_00_optim_states\.pt"):
        read_deepspeed_checkpoint(d)
    d = damaged("truncated")
    f = d / "global_step4" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(CheckpointCorruptError, match=r"zero_pp_rank_0_mp_rank_00_optim_states\.pt: unreadable"):
        read_deepspeed_checkpoint(d)
    d = damaged("stale_rank")  # a rank file of an earlier save at dp=3 left behind
    shutil.copy(d / "global_step4" / "zero_pp_rank_1_mp_rank_00_optim_states.pt",
                d / "global_step4" / "zero_pp_rank_2_mp_rank_00_optim_states.pt")  # fmt: skip
    with pytest.raises(CheckpointCorruptError, match=r"dp_world_size=2.*unexpected.*zero_pp_rank_2"):
        read_deepspeed_checkpoint(d)
    d = damaged("bad_latest")
    (d / "latest").write_text("global_step9")
    with pytest.raises(CheckpointCorruptError, match=r"latest names the save 'global_step9'"):
        read_deepspeed_checkpoint(d)
