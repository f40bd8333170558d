"""The reference model's MoE layer (lightning_v17/models/moe.py) against references written here: plain-Python SwiGLU
arithmetic, a per-token loop over its top-k experts, hand-derived capacity drops, losses and bias updates, and the
planner's parameter count."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lightning_v17.config import V17ConfigError
from lightning_v17.models import GroupedExperts, Llama, LlamaLM, ModelConfig, MoE, moe_layers, update_expert_biases
from lightning_v17.planner.model import get_preset

H, E = 16, 4


def _config(**kw: object) -> ModelConfig:
    base = {"vocab_size": 32, "hidden": H, "layers": 2, "heads": 2, "kv_heads": 1, "ffn": 24, "max_seq_len": 8}
    return ModelConfig(**{**base, "num_experts": E, "experts_per_token": 2, "expert_ffn": 8, **kw})


def _moe(**kw) -> MoE:
    torch.manual_seed(0)
    m = MoE(_config(**kw))
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)
    return m


def _swiglu(m: MoE, e: int, xt: torch.Tensor) -> torch.Tensor:
    gu, dn = m.experts.gate_up_proj[e], m.experts.down_proj[e]
    inter = gu.shape[0] // 2
    return dn @ (F.silu(gu[:inter] @ xt) * (gu[inter:] @ xt))


def _naive(m: MoE, x: torch.Tensor, kept: dict[int, set[int]] | None = None) -> torch.Tensor:
    """Per token: its top-k experts by score (+ bias), each expert's SwiGLU by hand, weighted and summed; ``kept``
    (token -> experts) leaves out the dropped assignments."""
    out = torch.zeros_like(x.reshape(-1, H))
    for t, xt in enumerate(x.reshape(-1, H)):
        logits = m.router.weight.float() @ xt
        scores = logits.softmax(-1) if m.router_score == "softmax" else logits.sigmoid()
        top = torch.topk(scores + m.expert_bias, m.experts_per_token).indices
        w = scores[top] / (scores[top].sum() if m.router_norm_topk else 1.0)
        for e, we in zip(top.tolist(), w):
            if kept is None or e in kept[t]:
                out[t] += we * _swiglu(m, e, xt)
        if m.shared_experts is not None:
            out[t] += m.shared_experts(xt)
    return out.view_as(x)


def test_grouped_gemm_equals_the_per_expert_loop_with_uneven_and_empty_experts() -> None:
    torch.manual_seed(1)
    g = GroupedExperts(E, H, 8)
    loop = GroupedExperts(E, H, 8, grouped=False)
    loop.load_state_dict(g.state_dict())
    counts = torch.tensor([3, 0, 6, 1])
    x = torch.randn(10, H)
    outs = []
    for mod in (g, loop):
        xi = x.clone().requires_grad_()
        y = mod(xi, counts)
        y.sum().backward()  # the zero-stride gradient of .sum(): _grouped_mm's backward needs it contiguous
        outs.append((y, xi.grad, mod.gate_up_proj.grad, mod.down_proj.grad))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert outs[0][2][1].abs().sum() == 0 and outs[0][3][1].abs().sum() == 0  # the empty expert gets no gradient


@pytest.mark.parametrize("counts", [[2, 1], [0, 3]])
def test_two_expert_swiglu_by_hand(counts) -> None:
    torch.manual_seed(2)
    g = GroupedExperts(2, 4, 4)  # 16-byte rows in fp32: the grouped GEMM path
    x = torch.randn(3, 4)
    y = g(x, torch.tensor(counts)).tolist()
    gu, dn, rows = g.gate_up_proj.tolist(), g.down_proj.tolist(), x.tolist()
    experts = [e for e, n in enumerate(counts) for _ in range(n)]
    for r, e in enumerate(experts):
        gate = [sum(gu[e][i][j] * rows[r][j] for j in range(4)) for i in range(4)]
        up = [sum(gu[e][4 + i][j] * rows[r][j] for j in range(4)) for i in range(4)]
        hid = [a / (1 + math.exp(-a)) * b for a, b in zip(gate, up)]
        want = [sum(dn[e][o][i] * hid[i] for i in range(4)) for o in range(4)]
        assert y[r] == pytest.approx(want, rel=1e-5, abs=1e-7)


def test_sizes_the_grouped_gemm_cannot_align_take_the_loop() -> None:
    torch.manual_seed(3)
    g = GroupedExperts(3, 6, 8)  # 6 fp32 = 24-byte rows: _grouped_mm refuses them
    loop = GroupedExperts(3, 6, 8, grouped=False)
    loop.load_state_dict(g.state_dict())
    x, counts = torch.randn(5, 6), torch.tensor([2, 0, 3])
    torch.testing.assert_close(g(x, counts), loop(x, counts), rtol=0, atol=0)


@pytest.mark.parametrize("kw", [{}, {"router_score": "sigmoid"}, {"router_norm_topk": False},
                                {"shared_experts": 1, "router_score": "sigmoid"}],
                         ids=["softmax", "sigmoid", "no-norm", "shared"])  # fmt: skip
def test_moe_equals_a_per_token_loop(kw) -> None:
    m = _moe(**kw)
    x = torch.randn(2, 5, H, requires_grad=True)
    y = m(x)
    x2 = x.detach().clone().requires_grad_()
    want = _naive(m, x2)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6)
    gy = torch.randn_like(y)
    params = [m.router.weight, m.experts.gate_up_proj, m.experts.down_proj]
    if m.shared_experts is not None:
        params.append(m.shared_experts.w1.weight)
    grads = torch.autograd.grad(y, [x, *params], gy)
    ref = torch.autograd.grad(want, [x2, *params], gy)
    for a, b in zip(grads, ref):  # fp32 sums in another order: 1.5e-6 seen on AVX2 (cancelling terms)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_capacity_drops_the_late_assignments_of_each_sequence() -> None:
    m = _moe(capacity_factor=0.5, experts_per_token=1)
    with torch.no_grad():  # every token prefers expert 2
        m.router.weight.zero_()
        m.router.weight[2] = 1.0
    x = torch.ones(2, 6, H)  # capacity = ceil(0.5 * 6 * 1 / 4) = 1 per sequence and expert
    y = m(x)
    assert int(m.last_dropped) == 2 * 5 and m.last_load.tolist() == [0, 0, 2, 0]
    kept = y.reshape(12, H).abs().sum(-1) > 0
    assert kept.tolist() == [True] + [False] * 5 + [True] + [False] * 5  # the first token of each sequence


def test_capacity_is_first_come_in_token_then_slot_order() -> None:
    m = _moe(capacity_factor=0.5)  # S=4, k=2, E=4: capacity ceil(0.5 * 4 * 2 / 4) = 1
    prefs = {0: (0, 1), 1: (1, 2), 2: (0, 1), 3: (3, 2)}  # token -> (slot 0, slot 1) experts
    with torch.no_grad():
        m.router.weight.zero_()
        for t, (first, second) in prefs.items():
            m.router.weight[first, t], m.router.weight[second, t] = 3.0, 2.0
    x = torch.eye(H)[:4].unsqueeze(0)  # token t is the unit vector t
    # (token, slot) order: (0,0)->0 keep, (0,1)->1 keep, (1,0)->1 drop (token 0's slot 1 came first),
    # (1,1)->2 keep, (2,0)->0 drop, (2,1)->1 drop, (3,0)->3 keep, (3,1)->2 drop
    y = m(x)
    assert int(m.last_dropped) == 4 and m.last_load.tolist() == [1, 1, 1, 1]
    torch.testing.assert_close(y, _naive(m, x, kept={0: {0, 1}, 1: {2}, 2: set(), 3: {3}}), rtol=1e-5, atol=1e-6)


def test_routing_losses_and_loads_do_not_depend_on_the_batch_split() -> None:
    m = _moe(capacity_factor=1.0, aux_loss_coef=0.1, z_loss_coef=0.01)
    m.train()
    x = torch.randn(4, 6, H)
    whole, aux_whole, load_whole, dropped = m(x), m.aux_loss, m.last_load, int(m.last_dropped)
    parts = []
    for half in (x[:2], x[2:]):
        parts.append((m(half), m.aux_loss, m.last_load, int(m.last_dropped)))
    assert dropped > 0 and dropped == parts[0][3] + parts[1][3]
    torch.testing.assert_close(torch.cat([p[0] for p in parts]), whole, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close((parts[0][1] + parts[1][1]) / 2, aux_whole, rtol=1e-6, atol=1e-7)
    assert torch.equal(parts[0][2] + parts[1][2], load_whole)
    assert torch.equal(m.expert_load, 2 * load_whole)  # counted on every training forward


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_aux_and_z_loss_by_hand(score) -> None:
    m = _moe(aux_loss_coef=0.7, z_loss_coef=0.5, router_score=score, capacity_factor=0.5)
    x = torch.randn(2, 3, H)
    m(x)
    assert int(m.last_dropped) > 0  # f counts the assignments before capacity
    seq_losses, z = [], []
    for xb in x:
        logits = xb @ m.router.weight.T
        s = logits.softmax(-1) if score == "softmax" else logits.sigmoid()
        f = torch.zeros(E)
        for row in torch.topk(s, 2).indices:
            for e in row:
                f[e] += E / (2 * 3)
        p = (s / s.sum(-1, keepdim=True)).mean(0)
        seq_losses.append((f * p).sum())
        z += [torch.logsumexp(lt, -1) ** 2 for lt in logits]
    want = 0.7 * sum(seq_losses) / 2 + 0.5 * sum(z) / len(z)
    torch.testing.assert_close(m.aux_loss, want, rtol=1e-5, atol=1e-6)
    assert m.aux_loss.requires_grad


def test_the_bias_selects_but_does_not_weigh_and_moves_by_sign() -> None:
    m = _moe(expert_bias_rate=0.1, experts_per_token=1, router_norm_topk=False)
    x = torch.randn(1, 4, H)
    with torch.no_grad():
        m.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 100.0]))  # forces expert 3
    m(x)
    assert m.last_load.tolist() == [0, 0, 0, 4]
    torch.testing.assert_close(m(x), _naive(m, x))  # weighted by the unbiased score
    m.update_expert_bias(torch.tensor([1.0, 2.0, 3.0, 6.0]))  # mean 3: +u, +u, 0, -u
    torch.testing.assert_close(m.expert_bias, torch.tensor([0.1, 0.1, 0.0, 99.9]))
    assert m.expert_load.sum() == 0
    assert "expert_bias" in m.state_dict() and "expert_load" not in m.state_dict()


def test_update_expert_biases_reduces_every_layer_in_one_call() -> None:
    model = Llama(_config(dense_layers=0, expert_bias_rate=0.01))
    a, b = moe_layers(model)
    a.expert_load.copy_(torch.tensor([1.0, 2.0, 3.0, 6.0]))
    b.expert_load.copy_(torch.tensor([4.0, 4.0, 4.0, 4.0]))
    calls = []

    def all_reduce(t: torch.Tensor) -> None:  # another rank's loads: none for layer a, 10 on expert 0 for layer b
        calls.append(tuple(t.shape))
        t += torch.tensor([[0.0] * 4, [10.0, 0.0, 0.0, 0.0]])

    update_expert_biases(model, all_reduce)
    assert calls == [(2, E)]
    u = 0.01  # a: mean 3 -> +u, +u, 0, -u; b: [14, 4, 4, 4], mean 6.5 -> -u, +u, +u, +u
    torch.testing.assert_close(a.expert_bias, torch.tensor([u, u, 0.0, -u]))
    torch.testing.assert_close(b.expert_bias, torch.tensor([-u, u, u, u]))
    assert a.expert_load.sum() == 0 and b.expert_load.sum() == 0


def test_recomputation_and_evaluation_do_not_count_the_load() -> None:
    from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

    m = _moe()
    m.train()
    x = torch.randn(2, 4, H, requires_grad=True)
    m(x).sum().backward()
    plain = m.expert_load.clone()
    m.expert_load.zero_()
    with set_checkpoint_early_stop(False):  # recompute the whole forward, the load count included
        checkpoint(m, x, use_reentrant=False).sum().backward()
    assert torch.equal(m.expert_load, plain) and plain.sum() == 2 * 4 * 2
    m.eval()
    m(x)
    assert torch.equal(m.expert_load, plain) and m.last_load.sum() == 2 * 4 * 2


def test_a_bf16_model_keeps_the_balance_buffers_fp32() -> None:
    m = _moe().to(torch.bfloat16)
    assert m.expert_bias.dtype == m.expert_load.dtype == torch.float32 and m.router.weight.dtype == torch.bfloat16
    m.train()
    y = m(torch.randn(4, 256, H, dtype=torch.bfloat16))  # 2048 assignments: beyond bf16's exact integers
    assert y.dtype == torch.bfloat16
    assert m.expert_load.sum() == 4 * 256 * 2 and torch.equal(m.expert_load, m.last_load)


def test_moe_llama_counts_match_the_planner_and_it_trains() -> None:
    cfg = ModelConfig.from_preset("tiny-moe")
    model = Llama(cfg)
    assert model.num_params() == cfg.num_params() == get_preset("tiny-moe").num_params
    assert [type(b.feed_forward).__name__ for b in model.layers.values()] == ["FeedForward", "MoE", "MoE", "MoE"]
    plan = model.tensor_parallel_plan()  # dense blocks keep their FQNs; MoE blocks' experts stay out of TP
    assert "layers.0.feed_forward.w1" in plan and not any(k.startswith("layers.1.feed_forward") for k in plan)
    small = Llama(_config(layers=2, dense_layers=0, aux_loss_coef=0.01))
    opt = torch.optim.SGD(small.parameters(), lr=0.5)
    rows = torch.randint(0, 32, (4, 9), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(8):
        logits = small(rows[:, :-1])
        aux = sum(m.aux_loss for m in moe_layers(small))
        loss = F.cross_entropy(logits.reshape(-1, 32), rows[:, 1:].reshape(-1)) + aux
        loss.backward()
        if not losses:
            for m in moe_layers(small):
                assert (m.experts.gate_up_proj.grad.abs().sum((1, 2)) > 0).all()  # every expert got tokens
                assert m.router.weight.grad.abs().sum() > 0
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_llama_lm_adds_the_aux_losses_to_its_training_loss() -> None:
    lm = LlamaLM(model="tiny-moe", model_overrides={"layers": 2, "aux_loss_coef": 0.1, "z_loss_coef": 0.01})
    lm.configure_model()
    logged = {}
    lm.log = lambda name, value, **kw: logged.__setitem__(name, value)
    lm._dp_size = lambda: 1
    ids = torch.randint(0, 320, (2, 16), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    loss = lm.training_step(batch, 0)
    layers = moe_layers(lm.model)
    aux = sum(m.aux_loss for m in layers)
    assert len(layers) == 1 and aux > 0
    torch.testing.assert_close(loss, lm.loss(batch)[0] + aux)
    torch.testing.assert_close(logged["train/aux_loss"], aux)


def test_mixtral_preset_counts_match_the_paper() -> None:
    m = get_preset("mixtral-8x7b")  # Jiang 2024: 46.7B parameters, 12.9B active per token
    assert abs(m.num_params / 46.7e9 - 1) < 0.01 and abs(m.active_params / 12.9e9 - 1) < 0.01


@pytest.mark.parametrize(("kw", "match"), [({"experts_per_token": 5}, "experts_per_token=5 must be in"),
                                           ({"experts_per_token": 0}, "experts_per_token=0 must be in"),
                                           ({"router_score": "relu"}, "router_score='relu'"),
                                           ({"moe_every": 0}, "moe_every=0"),
                                           ({"aux_loss_coef": -1.0}, "aux_loss_coef=-1.0"),
                                           ({"capacity_factor": 0.0}, "capacity_factor=0.0")])  # fmt: skip
def test_bad_moe_options_are_named(kw, match) -> None:
    with pytest.raises(V17ConfigError, match=match):
        _config(**kw)


def test_which_blocks_are_moe() -> None:
    cfg = _config(layers=8, dense_layers=3, moe_every=2)
    assert [i for i in range(8) if cfg.is_moe_block(i)] == [3, 5, 7]
    assert not any(_config(num_experts=0, experts_per_token=0).is_moe_block(i) for i in range(2))
