"""Single-process checks of the sharded checkpoint engine (no process group: DCP's no_dist path)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from lightning_v17.checkpoint.async_save import AsyncShardedSaver
from lightning_v17.checkpoint.sharded import (
    CheckpointCorruptError,
    consolidate,
    consolidate_main,
    is_sharded_checkpoint,
    load_full_state_dict,
    load_sharded,
    partial_path,
    save_sharded,
)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(8, 16)
        self.l2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.l2(torch.relu(self.l1(x)))


class Holder(nn.Module):  # stands for a LightningModule holding `self.model`
    def __init__(self) -> None:
        super().__init__()
        self.model = Net()


def _trained(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    m = Net()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    for _ in range(2):
        m(torch.randn(5, 8)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return m, opt


def _app_state(m, opt):
    return {"model": get_model_state_dict(m), "optim": get_optimizer_state_dict(m, opt)}


def _params(m):
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def _save(path, m, opt, step=2):
    return save_sharded(path, app_state=_app_state(m, opt), trainer_state={"global_step": step}, meta={"zero_stage": 0})


def test_roundtrip_meta_and_inplace_load(tmp_path):
    m, opt = _trained(0)
    ck = _save(tmp_path / "ck", m, opt)
    meta = json.loads((ck / "meta.json").read_text())
    assert meta["world_size"] == 1 and meta["step"] == 2 and meta["zero_stage"] == 0
    assert {"torch", "lightning", "lightning_v17"} <= set(meta["versions"])
    assert (
        "model/.metadata" in meta["files"] and "optim/.metadata" in meta["files"] and "trainer_state" in meta["files"]
    )
    assert all(len(v["sha256"]) == 64 and v["bytes"] > 0 for v in meta["files"].values())
    assert is_sharded_checkpoint(ck) and not is_sharded_checkpoint(tmp_path) and not partial_path(ck).exists()

    m2, opt2 = _trained(1)  # different weights and optimizer state
    app = _app_state(m2, opt2)
    trainer_state, meta2 = load_sharded(ck, app_state=app)
    assert trainer_state == {"global_step": 2} and meta2["step"] == 2
    for k, v in _params(m).items():
        torch.testing.assert_close(m2.state_dict()[k], v, rtol=0, atol=0)
    exp = get_optimizer_state_dict(m, opt)["state"]
    for fqn, st in app["optim"]["state"].items():
        torch.testing.assert_close(st["exp_avg"], exp[fqn]["exp_avg"], rtol=0, atol=0)


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "meta"])
def test_corrupt_file_named_and_nothing_loaded(tmp_path, damage):
    m, opt = _trained(0)
    ck = _save(tmp_path / "ck", m, opt)
    shard = next((ck / "model").glob("__0_*.distcp"))
    if damage == "flip":
        raw = bytearray(shard.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        shard.write_bytes(bytes(raw))
        named = shard.name
    elif damage == "truncate":
        raw = shard.read_bytes()
        shard.write_bytes(raw[: len(raw) // 2])
        named = shard.name
    elif damage == "delete":
        os.remove(ck / "trainer_state")
        named = "trainer_state"
    else:
        (ck / "meta.json").write_text('{"format": "lightning')
        named = "meta.json"
    m2, opt2 = _trained(1)
    before = _params(m2)
    with pytest.raises(CheckpointCorruptError, match=named):
        load_sharded(ck, app_state=_app_state(m2, opt2))
    for k, v in before.items():
        assert torch.equal(m2.state_dict()[k], v), "a corrupt checkpoint must not be half-loaded"


class _Boom:
    def __reduce__(self):
        raise RuntimeError("disk full (simulated)")


def test_crash_mid_save_keeps_previous_and_ignores_partial(tmp_path):
    m, opt = _trained(0)
    ck = _save(tmp_path / "ck", m, opt, step=2)
    m3, opt3 = _trained(3)
    app = _app_state(m3, opt3)
    app["model"]["boom"] = _Boom()  # serialization fails after the tensors of this rank were written
    with pytest.raises(BaseException) as info:  # DCP wraps it in CheckpointException (a BaseException!)
        save_sharded(ck, app_state=app, trainer_state={"global_step": 9}, meta={})
    assert "disk full" in "".join(map(str, getattr(info.value, "failures", {}).values())) + str(info.value)
    assert partial_path(ck).exists(), "the crashed save's partial directory stays behind (and is ignored)"
    m2, opt2 = _trained(1)
    ts, _ = load_sharded(ck, app_state=_app_state(m2, opt2))
    assert ts["global_step"] == 2
    for k, v in _params(m).items():
        assert torch.equal(m2.state_dict()[k], v)
    _save(ck, m3, opt3, step=4)  # the next save cleans the partial directory up
    assert not partial_path(ck).exists()


def test_interrupted_overwrite_recovers_aside_copy(tmp_path):
    m, opt = _trained(0)
    ck = _save(tmp_path / "ck", m, opt, step=2)
    aside = ck.parent / f".{ck.name}.v17-old"
    os.replace(ck, aside)  # the crash window between "rename old aside" and "rename new in"
    assert is_sharded_checkpoint(ck)
    m2, opt2 = _trained(1)
    ts, _ = load_sharded(ck, app_state=_app_state(m2, opt2))
    assert ts["global_step"] == 2 and ck.is_dir() and not aside.exists()
    # crash after the new one was renamed in but before the old one was deleted: the new one wins
    shutil.copytree(ck, aside)
    _save(ck, m2, opt2, step=5)
    assert not aside.exists() and load_full_state_dict(ck)["l1.weight"].equal(m2.l1.weight.detach())


def test_consolidate_torch_and_safetensors_with_prefix(tmp_path):
    torch.manual_seed(0)
    h = Holder()
    opt = torch.optim.SGD(h.parameters(), lr=0.1)
    ck = save_sharded(tmp_path / "ck", app_state=_app_state(h, opt), trainer_state={}, meta={})
    for out in (tmp_path / "full.pt", tmp_path / "full.safetensors"):
        consolidate(ck, out, prefix_to_strip="model.")
        if out.suffix == ".safetensors":
            from safetensors.torch import load_file

            sd = load_file(out)
        else:
            sd = torch.load(out, weights_only=True)
        plain = Net()
        plain.load_state_dict(sd, strict=True)
        for k, v in h.model.state_dict().items():
            assert torch.equal(plain.state_dict()[k], v)
    with pytest.raises(ValueError, match="prefix_to_strip='nope.'"):
        consolidate(ck, tmp_path / "x.pt", prefix_to_strip="nope.")


def test_consolidate_main_exit_codes(tmp_path, capsys):
    m, opt = _trained(0)
    ck = _save(tmp_path / "ck", m, opt)
    assert consolidate_main([str(ck), str(tmp_path / "o.pt")]) == 0
    assert torch.load(tmp_path / "o.pt", weights_only=True)["l1.weight"].equal(m.l1.weight.detach())
    capsys.readouterr()
    assert consolidate_main([str(tmp_path / "missing"), str(tmp_path / "o2.pt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not exist" in err[0]
    (tmp_path / "plain").mkdir()
    assert consolidate_main([str(tmp_path / "plain"), str(tmp_path / "o3.pt")]) == 2
    assert "not a v17 sharded checkpoint" in capsys.readouterr().err
    next((ck / "model").glob("__0_*.distcp")).write_bytes(b"junk")
    assert consolidate_main([str(ck), str(tmp_path / "o4.pt")]) == 2
    assert "__0_0.distcp" in capsys.readouterr().err and not (tmp_path / "o4.pt").exists()


def test_async_saver_single_process_snapshots_at_start(tmp_path):
    m, opt = _trained(0)
    snap = _params(m)
    saver = AsyncShardedSaver()
    blocked_s = saver.start(tmp_path / "a", app_state=_app_state(m, opt), trainer_state={"global_step": 2}, meta={})
    assert blocked_s >= 0 and saver.in_flight
    with torch.no_grad():  # the loop moves on while the write runs
        for p in m.parameters():
            p.add_(1.0)
    saver.amend_trainer_state({"extra": 7})
    res = saver.wait()
    assert res is not None and not saver.in_flight and res.path == (tmp_path / "a").absolute()
    saver.close()
    full = load_full_state_dict(tmp_path / "a")
    for k, v in snap.items():
        assert torch.equal(full[k], v), "the async save must hold the weights as of start(), not later ones"
    ts = torch.load(tmp_path / "a" / "trainer_state", weights_only=False)
    assert ts == {"global_step": 2, "extra": 7}
