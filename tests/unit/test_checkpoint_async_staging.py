"""AsyncShardedSaver's staging: one pass over every component into host buffers allocated at the first save and
reused by the next (same ``data_ptr``), holding the values as of ``start`` (checked against a clone taken then, and
against the file read back), never aliasing the live tensors. Single process, a few MB: well under a second."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from lightning_v17.checkpoint.async_save import AsyncShardedSaver
from lightning_v17.checkpoint.sharded import load_full_state_dict


def _trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    m(torch.randn(4, 64)).sum().backward()
    opt.step()
    return m, opt


def _app_state(m, opt):
    return {"model": get_model_state_dict(m), "optim": get_optimizer_state_dict(m, opt)}


def _ptrs(saver: AsyncShardedSaver) -> dict[tuple, int]:
    return {k: b.data_ptr() for k, b in saver._stager._buffers.items()}


def test_staging_buffers_are_reused_and_hold_the_values_as_of_start(tmp_path):
    m, opt = _trained()
    live = {id(t.untyped_storage()) for t in m.state_dict().values()}
    saver = AsyncShardedSaver()
    try:
        saver.start(tmp_path / "a", app_state=_app_state(m, opt), trainer_state={"global_step": 1}, meta={})
        first = _ptrs(saver)
        # model (4 tensors) and optim (step, exp_avg, exp_avg_sq per param) are staged by one stager, one pass
        assert {k[0] for k in first} == {"model", "optim"} and len(first) == 4 + 3 * 4
        assert not live & {id(b.untyped_storage()) for b in saver._stager._buffers.values()}, "a copy, not a view"
        saver.wait()
        with torch.no_grad():
            for p in m.parameters():
                p.mul_(-3.0).add_(1.0)  # the loop moves on: new values for the second save
        want = {k: v.detach().clone() for k, v in m.state_dict().items()}
        saver.start(tmp_path / "b", app_state=_app_state(m, opt), trainer_state={"global_step": 2}, meta={})
        assert _ptrs(saver) == first, "the second save must reuse the first save's staging buffers"
        with torch.no_grad():
            for p in m.parameters():
                p.zero_()  # mutated while the second write runs: the save must not see it
        for k, v in want.items():
            assert torch.equal(saver._stager._buffers[("model", k)], v)
        saver.wait()
    finally:
        saver.close()
    b = load_full_state_dict(tmp_path / "b")
    assert set(b) == set(want) and all(torch.equal(b[k], v) for k, v in want.items())
    a = load_full_state_dict(tmp_path / "a")
    assert not any(torch.equal(a[k], want[k]) for k in want), "the first checkpoint keeps its own values"


def test_unknown_app_state_key_is_refused_by_name(tmp_path):
    m, opt = _trained()
    saver = AsyncShardedSaver()
    try:
        with pytest.raises(ValueError, match=r"takes the keys \('model', 'optim'\); got \['sched'\]"):
            saver.start(tmp_path / "a", app_state={**_app_state(m, opt), "sched": {}}, trainer_state={}, meta={})
        assert not saver.in_flight
    finally:
        saver.close()
