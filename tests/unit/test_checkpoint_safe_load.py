"""Safe loading of sharded checkpoints (issue "Hardening", item "Safe loading").

``trainer_state`` is unpickled with ``weights_only=True`` unless the caller trusts the checkpoint: a file carrying an
object whose ``__reduce__`` runs code is refused with an error that names the file and the fix, the code never runs
and nothing is loaded; ``weights_only=False`` loads it; the checkpoints our own save paths write load by default.
"""

from __future__ import annotations

import json
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
