"""The DeepSpeed reader's pieces that need no DeepSpeed file: name matching and the allow-listed loader's refusals.
Real DeepSpeed checkpoints (ZeRO-1/2/3, fp32/bf16, raw and Lightning's) are tested in
tests/dist/test_deepspeed_ckpt.py."""

from __future__ import annotations

import pytest
import torch

from lightning_v17.checkpoint.deepspeed import _load, is_deepspeed_checkpoint
from lightning_v17.checkpoint.deepspeed_convert import DeepSpeedMismatchError, match_names
from lightning_v17.checkpoint.safe_load import UnsafeCheckpointError
from lightning_v17.checkpoint.sharded import CheckpointCorruptError, save_sharded

DS = {"0.weight", "0.bias", "2.weight", "2.bias"}


def test_match_names_finds_the_one_prefix() -> None:
    assert match_names(sorted(DS), DS) == ("", "")
    # V17 holds the LightningModule, raw DeepSpeed was given its self.model
    assert match_names(sorted(f"model.{n}" for n in DS), DS) == ("model.", "")
    # DeepSpeed saved the LightningModule's names, the V17 module is the bare network
    assert match_names(sorted(DS), {f"net.{n}" for n in DS}) == ("", "net.")
    # a pipeline stage holds a subset of the names
    assert match_names(["model.2.bias"], DS) == ("model.", "")


def test_match_names_refuses_what_does_not_fit() -> None:
    with pytest.raises(DeepSpeedMismatchError, match=r"do not match.*'model\.9\.weight'"):
        match_names(["model.0.weight", "model.9.weight"], DS)


class Hparams:
    """A user class in a checkpoint: allow-listed by nobody (argparse.Namespace is not a safe probe: importing
    megatron-core, as the token-file tests do, allow-lists it for the whole process)."""

    def __init__(self, lr: float) -> None:
        self.lr = lr


def test_allow_listed_loader_refuses_other_classes_by_name(tmp_path) -> None:
    f = tmp_path / "client.pt"
    torch.save({"hparams": Hparams(lr=0.1), "w": torch.ones(2)}, f)
    with pytest.raises(UnsafeCheckpointError, match=r"client\.pt.*test_deepspeed_ckpt\.Hparams.*safe_globals=\[TheClass\]"):
        _load(f, weights_only=None, safe_globals=())
    out = _load(f, weights_only=None, safe_globals=[Hparams])  # the user's opt-in
    assert out["hparams"].lr == 0.1 and torch.equal(out["w"], torch.ones(2))


def test_truncated_and_missing_files_are_named(tmp_path) -> None:
    f = tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"w": torch.ones(1000)}, f)
    f.write_bytes(f.read_bytes()[:300])
    with pytest.raises(CheckpointCorruptError, match=r"zero_pp_rank_0_mp_rank_00_optim_states\.pt: unreadable"):
        _load(f, weights_only=None, safe_globals=())
    with pytest.raises(CheckpointCorruptError, match=r"absent\.pt: missing"):
        _load(tmp_path / "absent.pt", weights_only=None, safe_globals=())


def test_a_v17_checkpoint_is_not_taken_for_a_deepspeed_one(tmp_path) -> None:
    from lightning_v17.checkpoint.async_save import write_latest

    path = save_sharded(
        tmp_path / "step-00000002", app_state={"model": {"w": torch.ones(2)}}, trainer_state={}, meta={}
    )
    write_latest(tmp_path, path.name)  # AsyncCheckpoint's dirpath: a `latest` pointer too, to a V17 checkpoint
    assert not is_deepspeed_checkpoint(path)
    assert not is_deepspeed_checkpoint(tmp_path)
    assert not is_deepspeed_checkpoint(tmp_path / "nothing")
