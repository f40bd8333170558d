"""Safe loading of sharded checkpoints (issue "Hardening", item "Safe loading").

``trainer_state`` is unpickled with ``weights_only=True`` unless the caller trusts the checkpoint: a file carrying an
object whose ``__reduce__`` runs code is refused with an error that names the file and the fix, the code never runs
and nothing is loaded; ``weights_only=False`` loads it; the checkpoints our own save paths write load by default.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from lightning_v17.checkpoint.async_save import load_lightning_checkpoint
from lightning_v17.checkpoint.sharded import (
    META_FILE,
    TRAINER_STATE_FILE,
    UnsafeCheckpointError,
    file_digest,
    load_sharded,
    load_trainer_state,
    save_sharded,
)
from tests._dist import spawn
from tests.dist.test_checkpoint_async import _make_module


def _touch_marker(path: str) -> str:
    """What the malicious object runs when unpickled without restriction: it leaves a file behind."""
    Path(path).write_text("pwned")
    return path


class _CodeOnLoad:
    """Pickles as a call of :func:`_touch_marker`, i.e. code that ``pickle`` executes while loading."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (_touch_marker, (self.marker,))


def _inject(ckpt: Path, marker: Path) -> None:
    """Add a code-running object to a published checkpoint's trainer state and re-record its checksum, as a
    tampered (or foreign) checkpoint would look: it passes verification, so only safe unpickling stops it."""
    state = load_trainer_state(ckpt / TRAINER_STATE_FILE)
    state.setdefault("hyper_parameters", {})["payload"] = _CodeOnLoad(marker)
    torch.save(state, ckpt / TRAINER_STATE_FILE)
    meta = json.loads((ckpt / META_FILE).read_text())
    meta["files"][TRAINER_STATE_FILE] = file_digest(ckpt / TRAINER_STATE_FILE)
    (ckpt / META_FILE).write_text(json.dumps(meta))


def _net(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    m(torch.randn(3, 4)).sum().backward()
    opt.step()
    return m, opt


def _app(m, opt):
    return {"model": get_model_state_dict(m), "optim": get_optimizer_state_dict(m, opt)}


def _params(m):
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def _assert_refusal_message(err: pytest.ExceptionInfo, ckpt: Path) -> None:
    msg = str(err.value)
    assert str(ckpt / TRAINER_STATE_FILE) in msg, msg  # names the file
    assert "not allow-listed" in msg and "_touch_marker" in msg, msg  # says why, names the object
    assert "weights_only=False" in msg and "ckpt_path=" in msg, msg  # names the fix (trainer.fit's parameter)


@pytest.fixture
def tampered(tmp_path):
    m, opt = _net(0)
    ckpt = tmp_path / "ck"
    save_sharded(ckpt, app_state=_app(m, opt), trainer_state={"global_step": 1}, meta={})
    marker = tmp_path / "marker"
    _inject(ckpt, marker)
    return ckpt, marker, _params(m)


def test_code_running_object_is_refused_and_nothing_runs_or_loads(tampered):
    ckpt, marker, _saved = tampered
    m2, opt2 = _net(1)
    before = _params(m2)
    with pytest.raises(UnsafeCheckpointError) as err:
        load_sharded(ckpt, app_state=_app(m2, opt2))  # the default is weights_only=True, as in torch.load
    _assert_refusal_message(err, ckpt)
    assert not marker.exists(), "the pickled code ran"
    assert all(torch.equal(before[k], v) for k, v in _params(m2).items()), "a refused checkpoint was half-loaded"
    for wo in (True, None):
        with pytest.raises(UnsafeCheckpointError):
            load_sharded(ckpt, app_state=_app(m2, opt2), weights_only=wo)
    with pytest.raises(UnsafeCheckpointError):
        load_lightning_checkpoint(ckpt)
    assert not marker.exists()


def test_the_same_checkpoint_loads_when_trusted_explicitly(tampered):
    ckpt, marker, saved = tampered
    m2, opt2 = _net(1)
    ts, _ = load_sharded(ckpt, app_state=_app(m2, opt2), weights_only=False)
    assert marker.exists() and ts["hyper_parameters"]["payload"] == str(marker) and ts["global_step"] == 1
    assert all(torch.equal(saved[k], v) for k, v in _params(m2).items())
    marker.unlink()
    assert load_lightning_checkpoint(ckpt, weights_only=False)["global_step"] == 1 and marker.exists()


def test_our_trainer_state_types_load_by_default_and_the_allow_list_stays_scoped(tmp_path):
    import random
    from collections import OrderedDict

    m, opt = _net(0)
    state = {
        "global_step": 3,
        "loops": OrderedDict(fit_loop={"epoch_progress": {"total": {"ready": 1}}}),
        "callbacks": {"ModelCheckpoint{'monitor': None}": {"best_model_score": torch.tensor(0.5), "dirpath": "/x"}},
        "lr_schedulers": [{"base_lrs": [0.1], "last_epoch": 3, "_get_lr_called_within_step": False}],
        "hyper_parameters": {"betas": (0.9, 0.95), "model_overrides": None},
        "v17_rng_states": [
            {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
        ],
    }
    save_sharded(tmp_path / "ck", app_state=_app(m, opt), trainer_state=state, meta={})
    before = set(map(id, torch.serialization.get_safe_globals()))
    ts, _ = load_sharded(tmp_path / "ck", app_state=_app(*_net(1)))
    # Other libraries may register their own safe globals meanwhile (torchao does on import); ours must not stay.
    leaked = [g for g in torch.serialization.get_safe_globals() if id(g) not in before and "numpy" in repr(g)]
    assert not leaked, f"the allow-list leaked into the global one: {leaked}"
    got, want = ts["v17_rng_states"][0]["numpy"], np.random.get_state()
    assert got[0] == want[0] and np.array_equal(got[1], want[1]) and got[1].dtype == np.uint32
    assert ts["loops"] == state["loops"] and ts["hyper_parameters"] == state["hyper_parameters"]
    # an object-dtype array would unpickle arbitrary items: only the uint32 RNG array is allowed
    torch.save({"a": np.array([1, "x"], dtype=object)}, tmp_path / "obj")
    with pytest.raises(UnsafeCheckpointError, match="not allow-listed"):
        load_trainer_state(tmp_path / "obj")


def test_dcp_index_with_code_is_refused_before_dcp_unpickles_it(tmp_path):
    """DCP reads ``.metadata`` with a plain ``pickle.load``: our gate reads it first with a restricted unpickler."""
    import pickle

    m, opt = _net(0)
    ckpt, marker = tmp_path / "ck", tmp_path / "marker"
    save_sharded(ckpt, app_state=_app(m, opt), trainer_state={"global_step": 1}, meta={})
    md_path = ckpt / "optim" / ".metadata"
    with open(md_path, "rb") as f:
        md = pickle.load(f)
    md.payload = _CodeOnLoad(marker)
    md_path.write_bytes(pickle.dumps(md, protocol=4))
    meta = json.loads((ckpt / META_FILE).read_text())
    meta["files"]["optim/.metadata"] = file_digest(md_path)
    (ckpt / META_FILE).write_text(json.dumps(meta))
    m2, opt2 = _net(1)
    before = _params(m2)
    with pytest.raises(UnsafeCheckpointError) as err:
        load_sharded(ckpt, app_state=_app(m2, opt2))
    assert (
        str(md_path) in str(err.value) and "_touch_marker" in str(err.value) and "weights_only=False" in str(err.value)
    )
    assert not marker.exists() and all(torch.equal(before[k], v) for k, v in _params(m2).items())
    load_sharded(ckpt, app_state=_app(m2, opt2), weights_only=False)
    assert marker.exists()


def test_consolidate_refuses_a_pickled_non_tensor_entry_unless_trusted(tmp_path, capsys):
    """DCP stores non-tensor values as torch.save bytes and reads them back with weights_only=False."""
    from lightning_v17.checkpoint.sharded import consolidate_main, load_full_state_dict

    ckpt, marker = tmp_path / "ck", tmp_path / "marker"
    state = {"w": torch.ones(2), "payload": _CodeOnLoad(marker)}
    save_sharded(ckpt, app_state={"model": state}, trainer_state={}, meta={})
    with pytest.raises(UnsafeCheckpointError, match="entry 'payload'"):
        load_full_state_dict(ckpt)
    assert consolidate_main([str(ckpt), str(tmp_path / "o.pt")]) == 2
    err = capsys.readouterr().err
    assert "not allow-listed" in err and "--no-weights-only" in err and "_touch_marker" in err, err
    assert not marker.exists() and not (tmp_path / "o.pt").exists()
    assert consolidate_main([str(ckpt), str(tmp_path / "o.pt"), "--no-weights-only"]) == 0
    assert marker.exists() and torch.equal(torch.load(tmp_path / "o.pt")["w"], torch.ones(2))


def test_lightning_resume_through_async_checkpoint_honours_weights_only(tmp_path):
    """Lightning's ``trainer.fit(ckpt_path=..., weights_only=...)`` on a full-tensor strategy (AsyncCheckpoint's
    CheckpointIO wrapper reads our directory): a real checkpoint, with numpy RNG states, resumes by default."""
    import lightning as L
    from lightning_v17.callbacks import AsyncCheckpoint

    def fit(max_steps, ckpt_path=None, **kw):
        L.seed_everything(0, verbose=False)
        trainer = L.Trainer(
            accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_progress_bar=False,
            enable_model_summary=False, callbacks=[AsyncCheckpoint(tmp_path / "ck", every_n_steps=2)],
        )  # fmt: skip
        trainer.fit(_make_module()(str(tmp_path / "l.jsonl")), ckpt_path=ckpt_path, **kw)
        return trainer

    fit(2)
    ckpt = tmp_path / "ck" / "step-00000002"
    assert isinstance(load_trainer_state(ckpt / TRAINER_STATE_FILE)["v17_rng_states"][0]["numpy"][1], np.ndarray)
    assert fit(3, str(ckpt)).global_step == 3  # default weights_only (None -> True)

    evil, marker = tmp_path / "evil" / "step-00000002", tmp_path / "marker"
    shutil.copytree(ckpt, evil)
    _inject(evil, marker)
    with pytest.raises(UnsafeCheckpointError) as err:
        fit(3, str(evil))
    _assert_refusal_message(err, evil)
    assert not marker.exists()
    assert fit(3, str(evil), weights_only=False).global_step == 3 and marker.exists()


# ---------------------------------------------------------------------------------------------------------------
# V17Strategy (a spawned process: the strategy initializes a process group, which must not leak into this one)
# ---------------------------------------------------------------------------------------------------------------
def _v17_child(rank: int, world: int, root: str) -> dict:
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning_v17.callbacks import AsyncCheckpoint
    from lightning_v17.strategies import V17Strategy

    torch.set_num_threads(1)
    out: dict = {}

    def fit(max_steps, callbacks=(), ckpt_path=None, **kw):
        L.seed_everything(0, verbose=False)
        trainer = L.Trainer(
            accelerator="cpu", devices=1, strategy=V17Strategy(zero_stage=3), max_steps=max_steps, logger=False,
            enable_checkpointing=bool(callbacks), enable_progress_bar=False, enable_model_summary=False,
            callbacks=list(callbacks),
        )  # fmt: skip
        trainer.fit(_make_module()(f"{root}/l.jsonl"), ckpt_path=ckpt_path, **kw)
        return trainer.global_step

    mc = ModelCheckpoint(dirpath=f"{root}/mc", filename="s{step}", every_n_train_steps=2, save_top_k=-1)
    fit(2, [mc, AsyncCheckpoint(f"{root}/ack", every_n_steps=2)])  # both of V17's save paths: sync and async
    ckpt, evil, marker = Path(root, "mc", "sstep=2.ckpt"), Path(root, "evil"), Path(root, "marker")
    out["resumed_step"] = fit(3, ckpt_path=str(ckpt))  # default weights_only
    shutil.copytree(ckpt, evil)
    _inject(evil, marker)
    try:
        fit(3, ckpt_path=str(evil))
        out["refused"] = ""
    except UnsafeCheckpointError as err:
        out["refused"] = str(err)
    out["marker_after_refusal"] = marker.exists()
    try:
        out["trusted_step"] = fit(3, ckpt_path=str(evil), weights_only=False)
    except UnsafeCheckpointError as err:
        out["trusted_step"] = f"refused: {err}"
    out["marker_after_trusted"] = marker.exists()
    torch.serialization.add_safe_globals([_touch_marker])  # the fix the error names for V17Strategy (this process)
    out["allow_listed_step"] = fit(3, ckpt_path=str(evil))
    out["marker_after_allow_list"] = marker.exists()
    return out


@pytest.fixture(scope="module")
def v17_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("v17")
    result = spawn(_v17_child, world_size=1, args=(str(root),), timeout=240, init_process_group=False)[0]
    return root, result


@pytest.mark.timeout(300)
def test_v17_strategy_checkpoints_load_safely_by_default_and_refuse_code(v17_run):
    root, r = v17_run
    ours = [p for p in sorted(root.rglob(TRAINER_STATE_FILE)) if "evil" not in p.parts]
    assert {p.relative_to(root).parts[0] for p in ours} == {"mc", "ack"}  # V17's sync and async save paths
    for ts in ours:
        load_trainer_state(ts)
    assert r["resumed_step"] == 3
    evil = root / "evil"
    assert str(evil / TRAINER_STATE_FILE) in r["refused"] and "not allow-listed" in r["refused"], r["refused"]
    assert "_touch_marker" in r["refused"] and "add_safe_globals" in r["refused"], r["refused"]
    assert "Note for V17Strategy" in r["refused"], r["refused"]  # Lightning drops fit(weights_only=) for us
    assert not r["marker_after_refusal"]
    assert r["allow_listed_step"] == 3 and r["marker_after_allow_list"]  # the user's explicit trust works


@pytest.mark.timeout(300)
@pytest.mark.xfail(
    strict=True,
    reason="Lightning 2.6.6 Trainer._run drops weights_only for strategies with restore_checkpoint_after_setup "
    "(V17Strategy); V17Strategy.load_checkpoint passes what it receives on to _checkpoint.load, so remove this "
    "marker once Lightning forwards it",
)
def test_v17_strategy_passes_weights_only_false_from_trainer_fit(v17_run):
    _root, r = v17_run
    assert r["trusted_step"] == 3 and r["marker_after_trusted"], r["trusted_step"]
