"""DeepSpeed JSON -> TrainingPolicy, V17Strategy option parsing and bad-input messages, recompute (no process group)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch import nn

from lightning_v17.config import OffloadPolicy, Precision, Recompute, V17ConfigError, ZeroPolicy
from lightning_v17.config.deepspeed import from_deepspeed_config

DS = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 8,
    "gradient_clipping": 1.0,
    "train_batch_size": 64,
    "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e7},
    "fp16": {"enabled": True, "initial_scale_power": 12, "loss_scale_window": 500, "hysteresis": 3,
             "min_loss_scale": 2},
}  # fmt: skip


def test_maps_the_documented_keys() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every key here is supported: no warning
        p = from_deepspeed_config(DS)
    assert p.zero.stage == 2
    assert p.zero.bucket_mb == pytest.approx(5e7 * 4 / 2**20)
    assert p.precision == Precision.FP16_MIXED
    assert p.loss_scale.init_scale == 2.0**12
    assert p.loss_scale.growth_interval == 500
    assert p.loss_scale.hysteresis == 3
    assert p.loss_scale.min_scale == 2.0
    assert p.gradient_clipping == 1.0
    assert p.gradient_accumulation_steps == 8
    assert p.micro_batch_size == 4 and p.train_batch_size == 64


def test_keys_without_effect_are_named_with_the_reason_and_not_mismapped() -> None:
    cfg = {"zero_optimization": {"stage": 1, "overlap_comm": True, "contiguous_gradients": True},
           "activation_checkpointing": {"partition_activations": True}, "steps_per_print": 10,
           "wall_clock_breakdown": True, "zero_allow_untested_optimizer": True}  # fmt: skip
    with pytest.warns(UserWarning) as rec:
        p = from_deepspeed_config(cfg)
    msgs = [str(w.message) for w in rec if "without effect here" in str(w.message)]
    assert len(msgs) == 1
    for key in ("overlap_comm", "contiguous_gradients", "partition_activations", "steps_per_print",
                "wall_clock_breakdown", "zero_allow_untested_optimizer"):  # fmt: skip
        assert key in msgs[0]
    assert not [w for w in rec if "not supported by lightning-v17" in str(w.message)]  # known keys, said once
    # partition_activations partitions activations across model-parallel ranks in DeepSpeed: it is not recompute
    assert p.recompute == Recompute.NONE


def test_batch_keys_are_checked_against_the_real_batch() -> None:
    from lightning_v17.strategies._options import check_batch_keys

    p = from_deepspeed_config({"train_micro_batch_size_per_gpu": 4, "train_batch_size": 64})
    check_batch_keys(p, rows=4, accumulate=8, dp=2)  # 4 x 8 x 2 = 64
    with pytest.raises(V17ConfigError, match="train_micro_batch_size_per_gpu=4 but the DataLoader gives 8 rows"):
        check_batch_keys(p, rows=8, accumulate=4, dp=2)
    with pytest.raises(V17ConfigError, match=r"train_batch_size=64 but .* = 32.*accumulate_grad_batches decide"):
        check_batch_keys(p, rows=4, accumulate=4, dp=2)


def test_bf16_and_path(tmp_path) -> None:
    f = tmp_path / "ds.json"
    f.write_text(json.dumps({"bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}))
    p = from_deepspeed_config(str(f))
    assert p.precision == Precision.BF16_MIXED and p.zero.stage == 3 and p.loss_scale is None


def test_auto_values_mean_unset() -> None:
    p = from_deepspeed_config({"train_micro_batch_size_per_gpu": "auto", "gradient_clipping": "auto"})
    assert p.micro_batch_size is None and p.gradient_clipping is None


def test_unknown_keys_one_warning_listing_all() -> None:
    with pytest.warns(UserWarning) as rec:
        from_deepspeed_config({"zero_optimization": {"stage": 1, "sub_group_size": 1e9}, "optimizer": {"type": "Adam"},
                               "scheduler": {"type": "WarmupLR"}})  # fmt: skip
    msgs = [str(w.message) for w in rec if "not supported by lightning-v17" in str(w.message)]
    assert len(msgs) == 1
    for key in ("zero_optimization.sub_group_size", "optimizer.type", "scheduler.type"):
        assert key in msgs[0]


@pytest.mark.parametrize(
    ("cfg", "match"),
    [
        ({"zero_optimization": {"stage": 4}}, "zero_stage=4"),
        ({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, "both bf16.enabled and fp16.enabled"),
        ({"fp16": {"enabled": True, "loss_scale": 128}}, "static scale"),
        ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps"),
        ({"gradient_clipping": -1}, "gradient_clipping"),
    ],
)
def test_bad_config_values(cfg: dict, match: str) -> None:
    with pytest.raises(V17ConfigError, match=match):
        from_deepspeed_config(cfg)


def test_unreadable_file_names_it(tmp_path) -> None:
    with pytest.raises(V17ConfigError, match="missing.json"):
        from_deepspeed_config(str(tmp_path / "missing.json"))


# ----------------------------------------------------------------------------------------------- V17Strategy options
def test_strategy_parses_options_and_config_precedence() -> None:
    from lightning_v17.strategies import V17Strategy

    s = V17Strategy(zero=ZeroPolicy(stage=2, wrap_classes=["Block"]), activation_checkpointing="selective")
    assert s.policy.zero.stage == 2 and s.policy.recompute == Recompute.SELECTIVE
    assert s.policy.zero.wrap_classes == ("Block",)
    # config fills what the constructor left at its default; an explicit non-default argument wins
    assert V17Strategy(config={"zero_optimization": {"stage": 1}}).zero_stage == 1
    assert V17Strategy(zero_stage=2, config={"zero_optimization": {"stage": 1}}).zero_stage == 2
    assert V17Strategy(config=DS).policy.gradient_accumulation_steps == 8


def test_strategy_bad_inputs_name_the_option() -> None:
    from lightning_v17.strategies import V17Strategy

    with pytest.raises(V17ConfigError, match="zero_stage=4"):
        V17Strategy(zero_stage=4)
    with pytest.raises(V17ConfigError, match="activation_checkpointing"):
        V17Strategy(activation_checkpointing="some")
    with pytest.raises(V17ConfigError, match="dp_shard"):
        V17Strategy(dp_shard=0)
    with pytest.raises(V17ConfigError, match="does not equal the world size 2"):
        V17Strategy(dp_shard=3).resolve_mesh(2)
    with pytest.raises(V17ConfigError, match="not divisible"):
        V17Strategy(tp=3).resolve_mesh(2)
    with pytest.raises(RuntimeError, match="not built yet"):
        V17Strategy().mesh  # noqa: B018
    with pytest.raises(V17ConfigError, match="zero_stage=3"):
        V17Strategy(zero_stage=2, offload=OffloadPolicy(params="cpu"))


# ----------------------------------------------------------------------------------------------- recompute (1 process)
class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.drop = nn.Linear(8, 16), nn.Linear(16, 8), nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.fc2(torch.relu(self.fc1(x))))


def _grads(mode: str) -> tuple:
    from lightning_v17.engine.recompute import apply_activation_checkpointing

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ModuleList([_Block(), _Block()]))
    x = torch.randn(4, 8)

    def fwd(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        h = m[0](x)
        for b in m[1]:
            h = b(h)
        return h

    units = apply_activation_checkpointing(model, mode=mode)
    calls = []
    for b in model[1]:
        b.fc1.register_forward_hook(lambda *a: calls.append(1))
    torch.manual_seed(1)
    loss = fwd(model, x).pow(2).mean()
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    return loss.item(), grads, [n for n, _ in model.named_parameters()], units, len(calls)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recompute_same_grads_with_dropout_and_same_fqns(mode: str) -> None:
    base_loss, base_grads, base_names, _, base_calls = _grads("none")
    loss, grads, names, units, calls = _grads(mode)
    assert len(units) == 2
    assert (base_calls, calls) == (2, 4)  # the blocks really ran again in backward
    assert names == base_names  # FQNs unchanged (no wrapper module inserted)
    assert loss == base_loss
    for a, b in zip(grads, base_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
