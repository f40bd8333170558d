"""The pure loss-scale state machine and the scaler on plain tensors (no process group).

Expected sequences are the design §13.2 algorithm applied by hand.
"""

from __future__ import annotations

import pytest
import torch

from lightning_v17.config import LossScalePolicy
from lightning_v17.engine.precision import ShardedLossScaler
from lightning_v17.trackers import LossScaleError, LossScaleTracker


def test_seed_algorithm_up_skip_down():
    t = LossScaleTracker(LossScalePolicy(init_scale=8.0, growth_interval=2))
    found = [False, False, True, False, True, True, False, False]
    applied = [t.update(f) for f in found]
    # by hand: 8 -> (n_ok 1) 8 -> (n_ok 2: grow) 16 -> skip 8 -> 8 -> skip 4 -> skip 2 -> 2 -> (n_ok 2) 4
    assert applied == [True, True, False, True, False, False, True, True]
    assert t.scale == 4.0
    assert (t.total_steps, t.skipped_steps, t.good_steps, t.consecutive_skips) == (8, 3, 0, 0)
    assert t.overflow_rate == pytest.approx(3 / 8)


def test_hysteresis_backs_off_every_second_overflow():
    t = LossScaleTracker(LossScalePolicy(init_scale=8.0, growth_interval=100, hysteresis=2))
    scales = []
    for f in [True, True, True, False, True]:
        t.update(f)
        scales.append(t.scale)
    # DeepSpeed delayed_shift: first overflow tolerated, second backs off (and re-arms), clean steps don't re-arm
    assert scales == [8.0, 4.0, 4.0, 4.0, 2.0]
    assert t.skipped_steps == 4


def test_collapse_below_min_scale_raises_with_cause():
    t = LossScaleTracker(LossScalePolicy(init_scale=4.0, min_scale=1.0, max_consecutive_skips=100))
    t.update(True)
    t.update(True)
    assert t.scale == 1.0
    with pytest.raises(LossScaleError, match="min_scale=1.*CAUSE"):
        t.update(True, cause=lambda: "CAUSE")


def test_max_consecutive_skips_raises_and_clean_step_resets_the_count():
    t = LossScaleTracker(LossScalePolicy(init_scale=2.0**16, max_consecutive_skips=3))
    t.update(True)
    t.update(True)
    t.update(False)  # resets the consecutive count
    t.update(True)
    t.update(True)
    with pytest.raises(LossScaleError, match="3 consecutive"):
        t.update(True)


def test_state_dict_round_trip_and_missing_keys():
    t = LossScaleTracker(LossScalePolicy(init_scale=32.0, growth_interval=3))
    for f in [False, True, False, False]:
        t.update(f)
    u = LossScaleTracker(LossScalePolicy(init_scale=32.0, growth_interval=3))
    u.load_state_dict(t.state_dict())
    assert u.state_dict() == t.state_dict()
    for f in [False, True]:
        assert u.update(f) == t.update(f)
    assert u.state_dict() == t.state_dict()
    with pytest.raises(KeyError, match="good_steps"):
        u.load_state_dict({"scale": 1.0, "total_steps": 1, "skipped_steps": 0})


@pytest.mark.parametrize(
    "kwargs",
    [
        {"init_scale": 0.0},
        {"growth_factor": 1.0},
        {"backoff_factor": 1.0},
        {"growth_interval": 0},
        {"min_scale": 2.0**20},
        {"max_consecutive_skips": 0},
    ],
)
def test_invalid_options_are_named(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        LossScaleTracker(LossScalePolicy(**kwargs))


def _model_and_batch():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    x = torch.randn(32, 8)
    return model, x


def test_scaler_unscales_exactly_before_clipping_and_steps():
    model, x = _model_and_batch()
    ref, _ = _model_and_batch()
    ref.load_state_dict(model.state_dict())
    ref(x).pow(2).mean().backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm=1e9)

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ShardedLossScaler(LossScaleTracker(LossScalePolicy(init_scale=2.0**10)))
    scaler.scale(model(x).pow(2).mean()).backward()
    scaler.unscale_(opt)
    # a power-of-two scale is exact in fp32; tolerance 1e-6 relative covers summation order only
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e9)
    assert torch.allclose(norm, ref_norm, rtol=1e-6)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=0)
    before = [p.detach().clone() for p in model.parameters()]
    scaler.step(opt)
    scaler.update()
    assert not scaler.last_step_skipped
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    with pytest.raises(RuntimeError, match="already called"):
        scaler.unscale_(opt)
        scaler.unscale_(opt)


def test_scaler_skips_on_inf_and_backs_off():
    model, x = _model_and_batch()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    skipped = []
    scaler = ShardedLossScaler(LossScaleTracker(LossScalePolicy(init_scale=2.0**10)), on_skip=lambda: skipped.append(True))
    scaler.scale(model(x).pow(2).mean()).backward()
    model[2].bias.grad[1] = float("nan")
    before = [p.detach().clone() for p in model.parameters()]
    scaler.step(opt)  # step without an explicit unscale_ unscales itself first
    scaler.update()
    assert scaler.last_step_skipped and skipped == [True]
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert scaler.get_scale() == 2.0**9


def test_scaler_error_names_nonfinite_loss():
    model, x = _model_and_batch()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ShardedLossScaler(LossScaleTracker(LossScalePolicy(init_scale=4.0, max_consecutive_skips=2)))
    with pytest.raises(LossScaleError, match="loss itself is NaN"):
        for _ in range(3):
            opt.zero_grad()
            scaler.scale(model(x).pow(2).mean() * float("nan")).backward()
            scaler.step(opt)
            scaler.update()
