"""Reshard on load through V17Strategy's own checkpoints, inside Lightning Trainers on 2 gloo ranks (issue 6).

Each case trains 2 steps on one layout, saves with ``ModelCheckpoint`` (a sharded DCP directory written by
``V17Strategy.save_checkpoint``), then a fresh Trainer on another layout resumes with ``fit(ckpt_path=...)`` and
trains a third step:

* pp=2 (ZeRO-1) -> pp=1 (ZeRO-0, dp=2)           the acceptance case "pp=2 loads at pp=1"
* tp=2 (ZeRO-1) -> tp=1 (ZeRO-1, dp_shard=2)     "tp=2 loads at tp=1"; the TP optimizer state of stages 1/2
* tp=2 (ZeRO-2) -> tp=1 (ZeRO-2, dp_shard=2)
* tp=2 (ZeRO-3) -> pp=2 (ZeRO-1)                 2-D FSDP2 x TP state into pipeline stages
* dp=2 (ZeRO-1) -> pp=2 (ZeRO-1)                 and the other way round

Checks, against a single-process Lightning run of the same LlamaLM, data and seed (no V17 code):
the parameters right after loading equal the saved ones exactly (reshard is a copy), and the parameters after the
third step match the reference's third step within 1e-5 relative (fp32): that step only comes out right if the
AdamW moments, the step counter and the LR schedule were restored and resharded correctly too.

A second, engine-level test on 4 ranks covers what 2 ranks cannot: ZeRO-1 over dp_shard=2 *and* tp=2, whose optimizer
rows are chunks of TP pieces, saved and reloaded at dp_shard=4, tp=1 (moments compared with a 1-process AdamW step).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from tests._dist import spawn

SEQ, ROWS, SAVE_AT, RTOL = 16, 4, 2, 1e-5
CASES = {
    "pp2z1_to_pp1z0": ({"pp": 2, "zero_stage": 1, "microbatches": 2}, {"zero_stage": 0}),
    "tp2z1_to_tp1z1": ({"tp": 2, "zero_stage": 1}, {"zero_stage": 1}),
    "tp2z2_to_tp1z2": ({"tp": 2, "zero_stage": 2}, {"zero_stage": 2}),
    "tp2z3_to_pp2z1": ({"tp": 2, "zero_stage": 3}, {"pp": 2, "zero_stage": 1, "microbatches": 2}),
    "dp2z1_to_pp2z1": ({"zero_stage": 1}, {"pp": 2, "zero_stage": 1, "microbatches": 2, "pp_schedule": "gpipe"}),
}


def _sample(i: int) -> dict:
    g = torch.Generator().manual_seed(i)
    ids = torch.randint(0, 320, (SEQ + 1,), generator=g)
    return {"input_ids": ids[:-1], "labels": ids[1:], "position_ids": torch.arange(SEQ)}


def _loader(dp: int = 1, dp_rank: int = 0):
    """Every step sees rows 0..ROWS-1 (split over dp ranks), so the step a resumed run takes next is known whatever
    Lightning does with the epoch position. All labels are valid, so the mean of the dp ranks' token means is the
    global token mean."""
    from torch.utils.data import DataLoader, Dataset

    rows = ROWS // dp

    class Packed(Dataset):
        def __len__(self) -> int:
            return rows * 8

        def __getitem__(self, i: int) -> dict:
            return _sample(dp_rank * rows + i % rows)

    return DataLoader(Packed(), batch_size=rows, shuffle=False)


def _module():
    from lightning_v17.models import LlamaLM

    # max_steps fixes the cosine schedule independently of each Trainer's max_steps. eps=1e-5 (as tests/dist/test_tp.py
    # explains): with Adam's default 1e-8, gradients at the fp32 noise floor take lr-sized steps of either sign, so
    # parameters would compare reduction order, not the parallelism; a wrong gradient still moves them by ~lr.
    return LlamaLM(model="tiny", model_overrides={"layers": 2}, warmup_steps=0, max_steps=10, eps=1e-5)


def _full_params(lm) -> dict[str, torch.Tensor]:
    """FQN -> full tensor of every parameter this rank holds (DTensors gathered: collective, same order everywhere)."""
    out = {}
    for name, p in lm.named_parameters():
        t = p.detach()
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        out[name] = t.clone()
    return out


def _fit(strategy, devices: int, max_steps: int, data, *, ckpt_dir: str | None = None, ckpt_path: str | None = None):
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    rec: dict = {}

    class Rec(L.Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            rec["start_step"] = trainer.global_step
            rec["start"] = _full_params(pl_module)

        def on_train_end(self, trainer, pl_module) -> None:
            rec["end"] = _full_params(pl_module)

    callbacks: list = [Rec()]
    if ckpt_dir is not None:
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, filename="saved", every_n_train_steps=SAVE_AT))
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=max_steps, use_distributed_sampler=False,
        logger=False, enable_checkpointing=ckpt_dir is not None, enable_progress_bar=False,
        enable_model_summary=False, callbacks=callbacks, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(_module(), data, ckpt_path=ckpt_path)
    return rec


def _layout(kw: dict, world: int, rank: int) -> tuple[int, int]:
    """(dp, dp_rank) of ``rank`` for the strategy kwargs ``kw`` (mesh order pp, dp, tp: tp innermost)."""
    dp = world // (kw.get("pp", 1) * kw.get("tp", 1))
    if dp == 1:
        return 1, 0
    return dp, rank // kw.get("tp", 1) % dp


def _worker(rank: int, world: int, root: str) -> dict:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    from tests._strategy import v17  # the cases are flat option dicts

    out = {}
    for name, (save_kw, load_kw) in CASES.items():
        d = str(Path(root) / name)
        saved = _fit(v17(**save_kw), world, SAVE_AT, _loader(*_layout(save_kw, world, rank)), ckpt_dir=d)
        ckpt = str(Path(d) / "saved.ckpt")
        loaded = _fit(v17(**load_kw), world, SAVE_AT + 1, _loader(*_layout(load_kw, world, rank)),
                      ckpt_path=ckpt)  # fmt: skip
        out[name] = {"saved": saved["end"], "loaded": loaded["start"], "start_step": loaded["start_step"],
                     "after": loaded["end"]}  # fmt: skip
    return out


def _reference() -> dict[str, dict[str, torch.Tensor]]:
    """Single process, plain Lightning (strategy "auto"): full params after step SAVE_AT and SAVE_AT + 1."""
    import lightning as L

    rec: dict = {}

    class Rec(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            rec[trainer.global_step] = {n: p.detach().clone() for n, p in pl_module.named_parameters()}

    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy="auto", max_steps=SAVE_AT + 1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[Rec()],
    )  # fmt: skip
    trainer.fit(_module(), _loader())
    return rec


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("reshard")
    return spawn(_worker, world_size=2, args=(str(root),), timeout=300, init_process_group=False)


@pytest.fixture(scope="module")
def reference() -> dict:
    warnings.filterwarnings("ignore")
    return _reference()


def _union(results: list[dict], name: str, key: str) -> dict[str, torch.Tensor]:
    """All FQNs over the ranks (pipeline stages hold different ones); replicas must agree exactly."""
    full: dict[str, torch.Tensor] = {}
    for res in results:
        for fqn, t in res[name][key].items():
            if fqn in full:
                torch.testing.assert_close(t, full[fqn], rtol=0, atol=0, msg=f"{name} {key} {fqn}: ranks disagree")
            full[fqn] = t
    return full


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error of a whole tensor, ||a - b|| / ||b|| (elementwise ratios blow up on near-zero entries)."""
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", list(CASES))
def test_checkpoint_reshards_across_tp_pp(results: list[dict], reference: dict, name: str) -> None:
    saved, loaded, after = (_union(results, name, k) for k in ("saved", "loaded", "after"))
    ref_saved, ref_after = reference[SAVE_AT], reference[SAVE_AT + 1]
    assert set(saved) == set(loaded) == set(after) == set(ref_saved), name
    assert all(r[name]["start_step"] == SAVE_AT for r in results)
    for fqn in ref_saved:
        assert _rel(saved[fqn], ref_saved[fqn]) < RTOL, (name, "saved", fqn, _rel(saved[fqn], ref_saved[fqn]))
        assert torch.equal(loaded[fqn], saved[fqn]), (name, "loaded != saved", fqn)
        assert _rel(after[fqn], ref_after[fqn]) < RTOL, (name, "step 3", fqn, _rel(after[fqn], ref_after[fqn]))
    # the third step really moved the parameters (the comparison above would be vacuous otherwise)
    assert min(_rel(ref_after[f], ref_saved[f]) for f in ref_saved) > 100 * RTOL


# ------------------------------------------------------------------ dp_shard x tp (4 ranks, engine level)
def _tp_dp_worker(rank: int, world: int, root: str) -> dict:
    """ZeRO-1 on a (dp_shard=2, tp=2) mesh: the optimizer rows are a dim-0 chunk of each TP piece, so the state dict
    all-gathers them over dp_shard (ZeroEngine._gather_piece). Save, reload at (dp_shard=4, tp=1), and compare the
    AdamW moments and parameters with a single-process AdamW step computed on every rank."""
    import torch.nn.functional as F

    from lightning_v17.checkpoint.sharded import load_sharded, save_sharded
    from lightning_v17.config import MeshSpec
    from lightning_v17.engine.tp.apply import apply_tensor_parallel
    from lightning_v17.engine.zero import stages_0_2 as Z
    from lightning_v17.engine.zero import state_dict as SD
    from lightning_v17.engine.zero.backend import ZeroBackend
    from lightning_v17.mesh import build_device_mesh
    from lightning_v17.models import Llama, ModelConfig
    from lightning_v17.models.tp_plans import resolve_tp_plan

    torch.set_num_threads(1)
    cfg = ModelConfig.from_preset("tiny", layers=1, hidden=64, heads=4, kv_heads=2, ffn=96)
    rows = [_sample(i) for i in range(ROWS)]
    ids = torch.stack([r["input_ids"] for r in rows])
    labels = torch.stack([r["labels"] for r in rows])
    pos = torch.stack([r["position_ids"] for r in rows])

    def step(model, opt, engine=None):
        logits = model(ids, pos)
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1)).backward()
        opt.step()
        if engine is not None:
            engine.after_optimizer_step()

    ref = Llama(cfg, init_seed=0)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    step(ref, ref_opt)
    ref_state = {n: ref_opt.state[p] for n, p in ref.named_parameters()}

    def build(spec: MeshSpec):
        mesh = build_device_mesh(spec, device_type="cpu")
        model = Llama(cfg, init_seed=0)
        apply_tensor_parallel(model, tp_mesh=mesh["tp"], plan=resolve_tp_plan(model))
        engine = Z.apply_zero(model, stage=1, mesh=mesh)
        opt = engine.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
        backend = ZeroBackend(
            model, stage=1, engine=engine, shard_group=mesh["dp_shard"].get_group(), shard_size=spec.dp_shard
        )
        return model, backend, opt

    model, engine, opt = build(MeshSpec(dp_shard=2, tp=2))
    step(model, opt, engine)  # every dp rank sees the same rows: the dp mean is the single-process gradient
    path = Path(root) / "tp_dp"
    save_sharded(path, app_state=SD.get_state_dicts(model, [opt], backend=engine), trainer_state={}, meta={})

    model2, engine2, opt2 = build(MeshSpec(dp_shard=4))
    app = SD.get_state_dicts(model2, [opt2], backend=engine2)
    own = SD.param_group_lists(app)
    load_sharded(path, app_state=app)
    SD.restore_param_group_lists(app, own)
    SD.set_state_dicts(model2, [opt2], app, backend=engine2)
    errs: dict[str, float] = {}
    for name, p in model2.named_parameters():
        errs[f"param {name}"] = _rel(p.detach(), dict(ref.named_parameters())[name].detach())
    for group in opt2.param_groups:
        for shard in group["params"]:
            e = engine2.engine.by_shard[id(shard)]
            for key in ("exp_avg", "exp_avg_sq"):
                want = ref_state[e.fqn][key].reshape(e.rows, -1)[e.start : e.stop].reshape(shard.shape)
                errs[f"{key} {e.fqn}"] = _rel(opt2.state[shard][key], want)
            errs[f"step {e.fqn}"] = abs(float(opt2.state[shard]["step"]) - 1.0)
    return errs


@pytest.mark.timeout(300)
def test_zero1_tp_optimizer_state_reshards_from_dp_shard_x_tp(tmp_path) -> None:
    results = spawn(_tp_dp_worker, world_size=4, args=(str(tmp_path),), timeout=280)
    for rank, errs in enumerate(results):
        assert len(errs) > 10
        bad = {k: v for k, v in errs.items() if not v < RTOL}
        assert not bad, (rank, bad)
