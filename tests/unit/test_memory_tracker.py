"""Storage-deduplicated model-state bytes and RSS helpers (no process group)."""

from __future__ import annotations

import mmap

import torch

from lightning_v17.trackers.memory import (
    StorageCounter,
    bar_chart,
    measure_model_state,
    peak_rss_bytes,
    reset_peak_rss,
    rss_bytes,
)


def test_views_count_once():
    t = torch.zeros(100)
    c = StorageCounter()
    assert c.add([t, t[10:], t.view(10, 10)]) == 400
    assert c.add([t[3:5]]) == 0
    assert c.add([torch.zeros(3, dtype=torch.float16), "not a tensor"]) == 6


def test_adamw_fp32_buckets_by_hand():
    torch.manual_seed(0)
    m = torch.nn.Linear(10, 10)  # 110 params
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    m(torch.randn(4, 10)).sum().backward()
    opt.step()
    got = measure_model_state(m, [opt])
    # params 110 * 4; grads 110 * 4; exp_avg + exp_avg_sq 2 * 110 * 4 plus two fp32 scalar `step` tensors (4 B each)
    assert (got.param, got.grad, got.optimizer) == (440, 440, 888)


def test_shared_flat_buffer_and_master_copies():
    flat = torch.zeros(100)
    m = torch.nn.Module()
    m.a = torch.nn.Parameter(flat[:50].view(5, 10))
    m.b = torch.nn.Parameter(flat[50:].view(50))
    # an optimizer stepping separate fp32 "master" copies of bf16 working params
    w = torch.nn.Linear(4, 4, bias=False).to(torch.bfloat16)
    master = [w.weight.detach().float().requires_grad_()]
    opt = torch.optim.SGD(master, lr=0.1, momentum=0.9)
    master[0].grad = torch.ones_like(master[0])
    opt.step()
    got = measure_model_state(m, [])
    assert got.param == 400  # two params, one storage
    both = torch.nn.ModuleDict({"m": m, "w": w})
    got = measure_model_state(both, [opt])
    assert got.param == 400 + 32  # + bf16 4x4
    assert got.grad == 64  # the master's fp32 grad
    assert got.optimizer == 64 + 64  # momentum buffer + the fp32 master copy itself


def test_bar_chart_shows_measured_planned_and_deviation():
    text = bar_chart([("param", 1000, 1000), ("grad", 500, 1000), ("act/ws", 300, None)], width=10)
    lines = text.splitlines()
    assert lines[0].startswith("param") and "measured " + "█" * 10 in lines[0]
    assert "planned  " + "█" * 10 in lines[1] and "(+0.0%)" in lines[1]
    assert "measured " + "█" * 5 + " " in lines[2] and "(-50.0%)" in lines[3]
    assert len(lines) == 5


def test_rss_high_water_mark_sees_a_touched_allocation():
    assert rss_bytes() > 0
    if not reset_peak_rss():
        return  # kernels without clear_refs: nothing more to check here
    base = rss_bytes()
    # 64 MiB of fresh anonymous memory, touched: a tensor from malloc may reuse heap pages an earlier test in this
    # process left resident (then the RSS does not grow), whatever the tracker does
    buf = mmap.mmap(-1, 64 * 2**20)
    x = torch.frombuffer(buf, dtype=torch.uint8)
    x.fill_(1)
    del x
    buf.close()  # unmapped: only the high-water mark still sees it
    peak = peak_rss_bytes()
    assert peak is not None and peak - base > 48 * 2**20
