"""V17Strategy's options: flat arguments (Lightning CLI) or policy objects (Python), parsed once; options that cannot
apply are refused, not ignored; and the one schedule table that the policy, the planner and the engine read."""

from __future__ import annotations

import pytest

from lightning_v17.config import OffloadPolicy, PipelinePolicy, Schedule, V17ConfigError, ZeroPolicy
from lightning_v17.planner.schedules import SCHEDULES, Placement, schedule_info


def _strategy(**kw):
    from lightning_v17.strategies import V17Strategy

    return V17Strategy(**kw)


def test_policy_objects_are_accepted_and_equal_the_flat_arguments():
    with pytest.raises(V17ConfigError, match="pp=2 with zero_stage=2"):  # a policy object is validated the same
        _strategy(zero=ZeroPolicy(stage=2), pp=2)
    flat = _strategy(zero_stage=1, bucket_mb=8.0, pp=2, pp_schedule="gpipe", microbatches=8, pp_split_points=["x"])
    objs = _strategy(
        zero=ZeroPolicy(stage=1, bucket_mb=8.0), pp=2,
        pipeline=PipelinePolicy(schedule="gpipe", microbatches=8, split_points=("x",)),
    )  # fmt: skip
    assert flat.policy == objs.policy
    assert objs.policy.zero.stage == 1 and objs.policy.pipeline.schedule == Schedule.GPIPE
    assert _strategy(offload=OffloadPolicy(params="cpu")).policy.offload.params.value == "cpu"


def test_a_policy_object_and_a_flat_argument_it_covers_are_refused_together():
    with pytest.raises(V17ConfigError, match=r"\['zero_stage'\] either inside zero=\.\.\. or as arguments"):
        _strategy(zero=ZeroPolicy(stage=3), zero_stage=1)
    with pytest.raises(V17ConfigError, match=r"\['microbatches'\] either inside pipeline="):
        _strategy(pp=2, zero_stage=1, pipeline=PipelinePolicy(), microbatches=8)
    _strategy(zero=ZeroPolicy(stage=3), tp=1)  # options the policy does not cover are fine


def test_options_that_cannot_apply_are_refused():
    with pytest.raises(V17ConfigError, match="sequence_parallel applies only with tp > 1"):
        _strategy(sequence_parallel=True)
    with pytest.raises(V17ConfigError, match="tp_plan applies only with tp > 1"):
        _strategy(tp_plan={"model.layers.*.mlp.up_proj": "colwise"})
    with pytest.raises(V17ConfigError, match="pp_split_points applies only with pp > 1"):
        _strategy(pp_split_points=["model.layers.2"])
    s = _strategy(tp=2, zero_stage=1, tp_plan={"model.layers.*.mlp.up_proj": "colwise"})
    assert s.policy.tp_plan == {"model.layers.*.mlp.up_proj": "colwise"}


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
    import warnings

    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        _strategy(zero_stage=3, bucket_mb=8.0, optimizer_partition="params", microbatches=8)
        _strategy(zero_stage=1, reshard_after_forward=True)
        _strategy(zero_stage=3)  # nothing set: no warning
    msgs = [str(w.message) for w in rec if "V17Strategy:" in str(w.message)]
    assert len(msgs) == 4, msgs
    assert any("bucket_mb=8.0 applies to zero_stage 0-2" in m for m in msgs)
    assert any("optimizer_partition='params'" in m for m in msgs)
    assert any("microbatches=8 applies only with pp > 1" in m for m in msgs)
    assert any("reshard_after_forward applies to zero_stage=3 only" in m for m in msgs)


def test_wrap_classes_nvme_path_and_checkpoint_io_warn_when_unused():
    import warnings

    from lightning.pytorch.plugins.io import TorchCheckpointIO

    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        _strategy(zero_stage=1, wrap_classes=["Block"])
        _strategy(zero_stage=3, nvme_path="/tmp")
        _strategy(zero_stage=3, checkpoint_io=TorchCheckpointIO())
        _strategy(zero_stage=1, wrap_classes=["Block"], activation_checkpointing="full")  # used by recompute
        _strategy(zero_stage=3, wrap_classes=["Block"])  # the ZeRO-3 units
    msgs = [str(w.message) for w in rec if "V17Strategy:" in str(w.message)]
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
    with pytest.raises(V17ConfigError, match=r"microbatches=2 < pp=4; set microbatches >= 4"):
        _strategy(pp=4, zero_stage=1, pp_schedule="1f1b", microbatches=2)
    with pytest.raises(V17ConfigError, match=r"microbatches=5 with pp=2 is not; try one of"):
        _strategy(pp=2, zero_stage=1, pp_schedule="interleaved_1f1b", virtual_stages=2, microbatches=5)
    with pytest.raises(V17ConfigError, match="no torch.distributed.pipelining implementation"):
        _strategy(pp=2, zero_stage=1, pp_schedule="zb_h2")  # Qi's ZB-H2: one stage per rank
    _strategy(pp=2, zero_stage=1, pp_schedule="interleaved_1f1b", virtual_stages=2, microbatches=6)  # 3 rounds of 2
    _strategy(pp=4, zero_stage=1, pp_schedule="gpipe", microbatches=2)  # GPipe has no such limit
