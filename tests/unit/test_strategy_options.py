"""V17Strategy's arguments: the axis sizes, one policy object per concern (or the dict of its fields, the YAML
spelling) and two DeepSpeed-familiar shortcuts, parsed once with given > config > default; options that cannot apply
are refused or warned about, not ignored; and the one schedule table that the policy, the planner and the engine
read."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch

from lightning_v17.config import (
    FP8Policy,
    OffloadPolicy,
    PipelinePolicy,
    Schedule,
    TPPolicy,
    V17ConfigError,
    ZeroPolicy,
)
from lightning_v17.config.schedules import SCHEDULES, Placement, schedule_info


def _strategy(**kw):
    from lightning_v17.strategies import V17Strategy

    return V17Strategy(**kw)


def _warnings(*calls) -> list[str]:
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for call in calls:
            call()
    return [str(w.message) for w in rec if "V17Strategy:" in str(w.message)]


def test_the_front_door_is_axes_policies_and_the_process_group():
    from lightning_v17.strategies import V17Strategy

    params = inspect.signature(V17Strategy.__init__).parameters
    names = [n for n in params if n != "self"]
    assert names == [
        "zero_stage", "activation_checkpointing", "dp_replicate", "dp_shard", "tp", "pp", "cp", "ep", "zero", "offload",
        "fp8", "config", "process_group_backend", "timeout", "hang_timeout", "loss_normalization", "fault_tolerance",
    ]  # fmt: skip
    assert len(names) <= 17
    assert not any(p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL) for p in params.values())
    # Lightning's plumbing is set by the Trainer's accelerator connector through the property setters
    import torch
    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning.pytorch.accelerators import CPUAccelerator
    from lightning.pytorch.plugins.precision import Precision

    s = V17Strategy()
    s.accelerator, s.parallel_devices = CPUAccelerator(), [torch.device("cpu")] * 2
    s.cluster_environment, s.precision_plugin = LightningEnvironment(), Precision()
    assert (s.num_processes, s.root_device, type(s.precision_plugin)) == (2, torch.device("cpu"), Precision)


def test_policy_objects_and_their_dicts_are_accepted_and_the_shortcuts_equal_them():
    with pytest.raises(V17ConfigError, match=r"needs zero_stage=3 \(got 2\)"):  # a policy object is validated the same
        _strategy(zero=ZeroPolicy(stage=2), offload=OffloadPolicy(params="cpu"))
    objs = _strategy(
        zero=ZeroPolicy(stage=1, bucket_mb=8.0),
        pp=PipelinePolicy(size=2, schedule="gpipe", microbatches=8, split_points=("x",)),
    )  # fmt: skip
    dicts = _strategy(  # the YAML spelling: the mapping of the policy's fields
        zero={"stage": 1, "bucket_mb": 8.0},
        pp={"size": 2, "schedule": "gpipe", "microbatches": 8, "split_points": ["x"]},
    )  # fmt: skip
    assert objs.policy == dicts.policy
    assert objs.policy.zero.stage == 1 and objs.policy.pipeline.schedule == Schedule.GPIPE
    assert objs.dims.pp == 2 and _strategy(zero_stage=1, pp=2).policy.pipeline == PipelinePolicy(size=2)
    assert _strategy(tp=TPPolicy(size=2, sequence_parallel=True), zero_stage=1).dims.tp == 2
    with pytest.raises(V17ConfigError, match=r"tp='2' must be a positive integer \(its size\) or TPPolicy"):
        _strategy(tp="2")
    with pytest.raises(V17ConfigError, match="pp=0 must be a positive integer"):
        _strategy(pp=PipelinePolicy(size=0))
    assert _strategy(zero_stage=1).policy.zero == ZeroPolicy(stage=1)  # the shortcut
    assert _strategy(offload=OffloadPolicy(params="cpu")).policy.offload.params.value == "cpu"
    assert _strategy(fp8="rowwise").policy.fp8 == _strategy(fp8=FP8Policy(recipe="rowwise")).policy.fp8
    assert _strategy(activation_checkpointing="full").policy.recompute.value == "full"
    with pytest.raises(V17ConfigError, match=r"zero: \['bucket'\] not fields of ZeroPolicy; its fields are"):
        _strategy(zero={"bucket": 8})
    with pytest.raises(V17ConfigError, match=r"offload=3 must be OffloadPolicy\(\.\.\.\) or the dict of its fields"):
        _strategy(offload=3)


def test_zero_stage_and_a_zero_policy_are_refused_together():
    with pytest.raises(V17ConfigError, match=r"zero_stage=1 and zero=ZeroPolicy\(stage=3.*give the stage once"):
        _strategy(zero=ZeroPolicy(stage=3), zero_stage=1)
    with pytest.raises(V17ConfigError, match="give the stage once"):  # equal values too: no equality test
        _strategy(zero=ZeroPolicy(stage=3), zero_stage=3)
    _strategy(zero=ZeroPolicy(stage=3), tp=1, activation_checkpointing="full")  # options the policy does not cover


def test_given_beats_config_and_config_beats_default_and_a_policy_wins_as_a_whole():
    config = {"zero_optimization": {"stage": 2, "reduce_bucket_size": 2**20}}  # 4 MiB of fp32 elements
    assert _strategy(config=config).policy.zero == ZeroPolicy(stage=2, bucket_mb=4.0)
    assert _strategy(zero_stage=3, config=config).policy.zero == ZeroPolicy(stage=3, bucket_mb=4.0)
    assert _strategy(zero=ZeroPolicy(stage=1), config=config).policy.zero == ZeroPolicy(stage=1)  # as a whole
    offload = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}
    assert _strategy(config=offload).policy.offload.params.value == "cpu"
    assert _strategy(offload=OffloadPolicy(), config=offload).policy.offload == OffloadPolicy()
    assert _strategy().policy.zero == ZeroPolicy()  # neither: the defaults (stage 3)


def test_options_that_cannot_apply_are_refused():
    with pytest.raises(V17ConfigError, match=r"TPPolicy\(sequence_parallel=\.\.\.\) applies only with tp > 1"):
        _strategy(tp=TPPolicy(sequence_parallel=True))
    with pytest.raises(V17ConfigError, match=r"TPPolicy\(plan=\.\.\.\) applies only with tp > 1"):
        _strategy(tp=TPPolicy(plan={"model.layers.*.mlp.up_proj": "colwise"}))
    with pytest.raises(V17ConfigError, match=r"PipelinePolicy\(split_points=\.\.\.\) applies only with pp > 1"):
        _strategy(pp=PipelinePolicy(split_points=["model.layers.2"]))
    s = _strategy(zero_stage=1, tp=TPPolicy(size=2, plan={"model.layers.*.mlp.up_proj": "colwise"}))
    assert s.policy.tensor_parallel.plan == {"model.layers.*.mlp.up_proj": "colwise"}
    with pytest.raises(V17ConfigError, match=r"TPPolicy\(sequence_parallel=1\) must be True or False"):
        TPPolicy(sequence_parallel=1)
    with pytest.raises(V17ConfigError, match=r"TPPolicy\(plan=.*\) must be a dict"):
        TPPolicy(plan=["colwise"])


def test_one_schedule_table_answers_policy_planner_and_engine():
    from lightning_v17.planner.memory import microbatches_in_flight

    assert set(SCHEDULES) == set(Schedule)
    # the policy validates chunks per rank from the table
    for s, info in SCHEDULES.items():
        ok_v = {Placement.SINGLE: 1, Placement.LOOP: 2, Placement.V: 2}[info.placement]
        PipelinePolicy(schedule=s, virtual_stages=ok_v)
        bad_v = {Placement.SINGLE: 2, Placement.LOOP: 1, Placement.V: 3}[info.placement]
        with pytest.raises(V17ConfigError, match="virtual_stages"):
            PipelinePolicy(schedule=s, virtual_stages=bad_v)
    # zbv is multi-chunk (the V shape) everywhere now
    assert schedule_info("zbv").multi_chunk and schedule_info("zbv").stage_ids(0, pp=2, virtual_stages=2) == (0, 3)
    assert schedule_info("interleaved_1f1b").stage_ids(1, pp=2, virtual_stages=2) == (1, 3)
    # the planner's in-flight micro-batches come from the same rows (GPipe m, 1F1B p, ZB-H2 2p-1)
    assert microbatches_in_flight(schedule="gpipe", pp=4, microbatches=16) == 16
    assert microbatches_in_flight(schedule="1f1b", pp=4, microbatches=16) == 4
    assert microbatches_in_flight(schedule="zb_h2", pp=4, microbatches=16) == 7
    # what the engine cannot run is said, with the runnable alternatives
    with pytest.raises(V17ConfigError, match="no torch.distributed.pipelining implementation.*'zbv'"):
        schedule_info("zb_h2").check_runnable()
    for s, info in SCHEDULES.items():
        if info.runnable:
            from torch.distributed import pipelining

            assert hasattr(pipelining, info.torch_class), s


def test_options_set_but_inapplicable_warn_once_each():
    """A given policy's fields that differ from the policy's own defaults, where they cannot apply."""
    msgs = _warnings(
        lambda: _strategy(
            zero=ZeroPolicy(stage=3, bucket_mb=8.0, optimizer_partition="params"),
            pp=PipelinePolicy(microbatches=8),
        ),
        lambda: _strategy(zero=ZeroPolicy(stage=1, reshard_after_forward=True)),
        lambda: _strategy(zero_stage=3),  # nothing set: no warning
        lambda: _strategy(zero=ZeroPolicy(stage=3), pp=PipelinePolicy()),  # only defaults: no warning
    )
    assert len(msgs) == 4, msgs
    assert any("bucket_mb=8.0 applies to zero_stage 0-2" in m for m in msgs)
    assert any("optimizer_partition='params'" in m for m in msgs)
    assert any("microbatches=8 applies only with pp > 1" in m for m in msgs)
    assert any("reshard_after_forward applies to zero_stage=3 only" in m for m in msgs)
    assert _warnings(lambda: _strategy(zero=ZeroPolicy(bucket_mb=8)))[0].startswith(  # stage 3 by default: once
        "V17Strategy: zero.bucket_mb=8 applies to zero_stage 0-2"
    )


def test_wrap_classes_nvme_path_and_checkpoint_io_warn_when_unused():
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    def checkpoint_io():
        s = _strategy(zero_stage=3)
        s.checkpoint_io = TorchCheckpointIO()  # what the Trainer's connector does with plugins=[CheckpointIO]

    msgs = _warnings(
        lambda: _strategy(zero=ZeroPolicy(stage=1, wrap_classes=["Block"])),
        lambda: _strategy(zero_stage=3, offload=OffloadPolicy(nvme_path="/tmp")),
        checkpoint_io,
        lambda: _strategy(zero=ZeroPolicy(stage=1, wrap_classes=["Block"]), activation_checkpointing="full"),  # used
        lambda: _strategy(zero=ZeroPolicy(stage=3, wrap_classes=["Block"])),  # the ZeRO-3 units
    )
    assert len(msgs) == 3, msgs
    assert "wrap_classes names the ZeRO-3 units and the recompute blocks" in msgs[0]
    assert "nvme_path='/tmp' applies only to an 'nvme' offload tier" in msgs[1]
    assert "checkpoint_io: V17Strategy writes sharded DCP checkpoint directories itself" in msgs[2]


def test_missing_ckpt_path_says_it_does_not_exist(tmp_path):
    s = _strategy()
    with pytest.raises(V17ConfigError, match=r"ckpt_path='.*nope' does not exist"):
        s.load_checkpoint(tmp_path / "nope")
    (tmp_path / "file.ckpt").write_text("x")
    with pytest.raises(V17ConfigError, match="is not a V17 sharded checkpoint directory"):
        s.load_checkpoint(tmp_path / "file.ckpt")


def test_microbatches_torch_cannot_schedule_are_refused_at_construction():
    def pipe(pp, **kw):
        return _strategy(zero_stage=1, pp=PipelinePolicy(size=pp, **kw))

    with pytest.raises(V17ConfigError, match=r"microbatches=2 < pp=4; set microbatches >= 4"):
        pipe(4, schedule="1f1b", microbatches=2)
    with pytest.raises(V17ConfigError, match=r"microbatches=5 with pp=2 is not; try one of"):
        pipe(2, schedule="interleaved_1f1b", virtual_stages=2, microbatches=5)
    with pytest.raises(V17ConfigError, match="no torch.distributed.pipelining implementation"):
        pipe(2, schedule="zb_h2")  # Qi's ZB-H2: one stage per rank
    pipe(2, schedule="interleaved_1f1b", virtual_stages=2, microbatches=6)  # 3 rounds of 2
    pipe(4, schedule="gpipe", microbatches=2)  # GPipe has no such limit


def test_cp_takes_its_size_or_its_policy_and_refuses_what_is_not_built():
    from lightning_v17.config import CPBalance, CPMode, CPPolicy

    s = _strategy(cp={"size": 2, "mode": "allgather", "balance": "packed"})
    assert s.dims.cp == 2 and s.policy.context == CPPolicy(size=2, mode="allgather", balance="packed")
    assert (s.policy.context.mode, s.policy.context.balance) == (CPMode.ALLGATHER, CPBalance.PACKED)
    assert _strategy(cp=2).policy.context == CPPolicy(size=2)  # auto scheme, head-tail chunks
    with pytest.raises(V17ConfigError, match=r"CPPolicy\(mode='ring'\) \(ring attention\) is not built"):
        CPPolicy(size=2, mode="ring")
    with pytest.raises(V17ConfigError, match=r"CPPolicy\(balance='zigzag'\) is not supported"):
        CPPolicy(balance="zigzag")
    assert _strategy(cp=2, ep=2, zero_stage=1).policy.context.size == 2  # cp x ep composes (tests/dist/test_ep_cp.py)
    msgs = _warnings(lambda: _strategy(cp=CPPolicy(mode="ulysses")))
    assert msgs == ["V17Strategy: cp.mode='ulysses' applies only with cp > 1; it is ignored here"], msgs


def test_ep_takes_its_size_or_its_policy():
    from lightning_v17.config import Dispatcher, EPPolicy

    s = _strategy(ep={"size": 2, "dispatcher": "allgather"})
    assert s.dims.ep == 2 and s.policy.expert == EPPolicy(size=2, dispatcher=Dispatcher.ALLGATHER)
    assert _strategy(ep=2).policy.expert == EPPolicy(size=2)  # all-to-all by default
    with pytest.raises(V17ConfigError, match=r"EPPolicy\(dispatcher='flex'\) is not supported"):
        EPPolicy(size=2, dispatcher="flex")
    msgs = _warnings(lambda: _strategy(ep=EPPolicy(dispatcher="allgather")))
    assert msgs == ["V17Strategy: ep.dispatcher='allgather' applies only with ep > 1; it is ignored here"], msgs


def test_activation_offload_options_are_checked_at_construction(tmp_path):
    s = _strategy(offload=OffloadPolicy(activations="nvme", nvme_path=str(tmp_path), resident_blocks=2))
    assert s.policy.offload.activations.value == "nvme" and s.policy.offload.resident_blocks == 2
    if not torch.cuda.is_available():  # the CUDA tier: refused by the strategy where torch sees no CUDA device
        with pytest.raises(V17ConfigError, match=r"OffloadPolicy\(activations='cpu'\) on a machine without an accel"):
            _strategy(offload=OffloadPolicy(activations="cpu"))
    with pytest.raises(V17ConfigError, match=r"needs OffloadPolicy\(nvme_path="):
        OffloadPolicy(activations="nvme")
    with pytest.raises(V17ConfigError, match="does not exist"):
        _strategy(offload=OffloadPolicy(activations="nvme", nvme_path=str(tmp_path / "gone")))
    with pytest.raises(V17ConfigError, match=r"OffloadPolicy\(resident_blocks=-1\) must be an integer >= 0"):
        OffloadPolicy(activations="nvme", nvme_path=str(tmp_path), resident_blocks=-1)
    msgs = _warnings(lambda: _strategy(offload=OffloadPolicy(resident_blocks=3)))
    want = ("V17Strategy: offload.resident_blocks=3 applies only with offload.activations='nvme' or 'cpu'; it is "
            "ignored here")
    assert msgs == [want], msgs
