"""Pretrained weights loaded in ``configure_model`` survive ZeRO-3, against Lightning's own ``"ddp"``.

A tiny Hugging Face ``LlamaForCausalLM`` (2 layers, drawn from seed 123) is saved once, with ``save_pretrained`` and
as a ``torch.save`` of its state dict. Inside the same process pair:

* ``from_pretrained``: ``configure_model`` calls ``LlamaForCausalLM.from_pretrained(dir)`` (transformers refuses it
  on the meta device, where ZeRO-3 used to build every ``configure_model``);
* ``load_state_dict``: ``configure_model`` builds the model (random weights) and loads the saved state dict into it
  (on the meta device this load was lost, and the deferred init then re-initialized every weight: it trained from
  random weights, silently), and the same under ``meta_init=True`` with ``load_state_dict(..., assign=True)``;

each under ``"ddp"`` and under V17 at ZeRO-3. A callback at ``on_train_start`` gathers every parameter whole: under
V17 it must equal the saved one bitwise, the step-0 loss must equal ddp's, and 6 SGD steps match ddp (the tier's
tolerances: per-step loss 1e-4 relative, final parameters 1e-5 absolute).

The opt-in meta path (``ZeroPolicy(meta_init=True)``) keeps working and allocates only the shards:
``configure_model`` sees meta parameters, each rank then holds half of every parameter, and the model is initialized
by its own ``init_weights`` (RMSNorm weights exactly 1, linear weights with HF's std 0.02). Loads there are refused
with the fix (``load_state_dict`` into meta tensors would be dropped) and ``assign=True`` loads are kept: a full
one matches ddp (above), a partial one (the embedding and the query projections; the biases of those
projections stay meta, so one module is part loaded, part meta) keeps the loaded tensors bitwise while the rest is
initialized. Two tests without ranks: the per-tensor materialization on a small module (a part-loaded Linear, a tied
pair, a module with nothing on meta), and the option's errors.
"""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any

import pytest

from tests._dist import spawn
from tests.integration.real_modules._common import assert_matches, train

pytest.importorskip("transformers")

ROWS_PER_RANK = 4
STEPS = 6
LR = 0.5
MODEL = {"layers": 2, "attention_bias": True}  # q/k/v/o biases: a partial load leaves modules part meta


def _module(kind: str, folder: str):
    import lightning as L
    import torch

    from tests._models import hf_llama

    class StartParams(L.Callback):
        """Every parameter of the model, whole, before the first step (collectives on every rank)."""

        def on_train_start(self, trainer, pl_module) -> None:
            pl_module.start_params = {
                n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                for n, p in pl_module.model.named_parameters()
            }

    class Pretrained(L.LightningModule):
        """The model comes from ``folder`` in ``configure_model``, the way ``kind`` says."""

        def __init__(self) -> None:
            super().__init__()
            self.model = None
            self.built_on_meta: bool | None = None

        def configure_model(self) -> None:
            if self.model is not None:
                return
            if kind == "from_pretrained":
                import transformers

                self.model = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
                return
            model = hf_llama(MODEL["layers"], seed=None, attention_bias=True)  # random weights, then the load
            self.built_on_meta = all(p.is_meta for p in model.parameters())
            saved = torch.load(Path(folder, "weights.pt"), weights_only=True)
            if kind == "load_state_dict":
                model.load_state_dict(saved)
            elif kind == "assign":
                model.load_state_dict(saved, assign=True)
            elif kind == "assign_partial":
                part = {k: v for k, v in saved.items() if k == "model.embed_tokens.weight" or "q_proj.weight" in k}
                model.load_state_dict(part, strict=False, assign=True)
            self.model = model

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR)

        def configure_callbacks(self):
            return [StartParams()]

    return Pretrained()


def _inspect(module: Any, trainer: Any) -> dict[str, Any]:
    """The parameters at step 0 (rank 0 keeps them), whether ``configure_model`` built on meta, and each
    parameter's local share of its elements on this rank."""
    shares = {n: (p.to_local() if hasattr(p, "to_local") else p).numel() / p.numel() for n, p in module.named_parameters()}
    start = module.start_params if trainer.global_rank == 0 else None
    return {"start": start, "built_on_meta": module.built_on_meta, "shares": shares}


def _run(kind: str, folder: str, strategy: Any) -> dict[str, Any]:
    from tests._models import token_dataset

    try:
        return train(
            lambda: _module(kind, folder), strategy, token_dataset("hf_llama", rows=48), batch_size=ROWS_PER_RANK,
            steps=STEPS, inspect=_inspect,
        )  # fmt: skip
    except Exception:  # noqa: BLE001 - reported by the run's own test
        return {"error": traceback.format_exc()}


def _worker(rank: int, world: int, folder: str) -> dict[str, dict[str, Any]]:
    from lightning_v17 import V17Strategy, ZeroPolicy

    meta = {"zero": ZeroPolicy(stage=3, meta_init=True)}
    out: dict[str, dict[str, Any]] = {}
    for kind in ("from_pretrained", "load_state_dict"):
        out[kind] = {"ddp": _run(kind, folder, "ddp")}
        out[kind]["zero3"] = _run(kind, folder, V17Strategy(zero_stage=3))
    # the same saved weights at step 0 as ddp's load_state_dict run: the same trajectory
    out["load_state_dict"]["zero3_meta_assign"] = _run("assign", folder, V17Strategy(**meta))
    out["assign_partial"] = {"zero3_meta": _run("assign_partial", folder, V17Strategy(**meta))}
    out["refused"] = {"zero3_meta": _run("load_state_dict", folder, V17Strategy(**meta))}
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any]]:
    import torch

    from tests._models import hf_llama

    folder = tmp_path_factory.mktemp("pretrained")
    model = hf_llama(MODEL["layers"], seed=123, attention_bias=True)
    with torch.no_grad():  # HF initializes biases to zero: draw them, so that a lost load shows in them too
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.02)
    model.save_pretrained(folder)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.save(state, folder / "weights.pt")
    return str(folder), state


@pytest.fixture(scope="module")
def runs(saved) -> list[dict[str, dict[str, Any]]]:
    return spawn(_worker, world_size=2, args=(saved[0],), init_process_group=False, timeout=420)


def _ok(ranks: list[dict[str, Any]], *names: str) -> None:
    for name in names:
        errors = [r[name]["error"] for r in ranks if "error" in r[name]]
        assert not errors, f"{name} raised:\n{errors[0]}"


def _assert_start_is_saved(start: dict[str, Any], state: dict[str, Any], names: Any = None) -> None:
    names = start.keys() if names is None else names
    assert start.keys() <= state.keys()
    differ = {n: float((start[n] - state[n]).abs().max()) for n in names if not start[n].equal(state[n])}
    assert not differ, f"parameters at step 0 differ from the saved ones: {differ}"


@pytest.mark.timeout(480)
@pytest.mark.parametrize("kind", ["from_pretrained", "load_state_dict"])
def test_weights_loaded_in_configure_model_survive_zero3(runs, saved, kind):
    """``load_state_dict`` also under ``meta_init=True`` with ``assign=True`` (compared with ddp's plain load)."""
    ranks = [r[kind] for r in runs]
    names = ["zero3", "zero3_meta_assign"] if kind == "load_state_dict" else ["zero3"]
    _ok(ranks, "ddp", *names)
    state = saved[1]
    for name in ["ddp", *names]:
        start = ranks[0][name]["extra"]["start"]
        assert start.keys() == state.keys(), sorted(start.keys() ^ state.keys())  # every parameter, nothing else
        _assert_start_is_saved(start, state)
    errors = assert_matches(ranks, names)
    for name in names:  # the first forward runs on the same weights: the same loss
        step0 = [sum(r[n]["losses"][0] for r in ranks) / len(ranks) for n in (name, "ddp")]
        assert step0[0] == step0[1], (name, step0)
        shares = ranks[0][name]["extra"]["shares"]
        assert all(s <= 0.5 for s in shares.values()), shares  # sharded over the 2 ranks
    print(kind, errors, "step-0 loss", ranks[0]["ddp"]["losses"][0])


@pytest.mark.timeout(480)
def test_meta_init_allocates_only_shards_and_keeps_assigned_weights(runs, saved):
    ranks = [r["assign_partial"] for r in runs]
    _ok(ranks, "zero3_meta")
    state = saved[1]
    for r in ranks:
        extra = r["zero3_meta"]["extra"]
        assert extra["built_on_meta"] is True, "meta_init=True must build configure_model on the meta device"
        assert all(s <= 0.5 for s in extra["shares"].values()), extra["shares"]  # only shards were ever allocated
    start = ranks[0]["zero3_meta"]["extra"]["start"]
    loaded = [n for n in start if n == "model.embed_tokens.weight" or "q_proj.weight" in n]
    assert len(loaded) == 1 + MODEL["layers"]
    _assert_start_is_saved(start, state, loaded)
    for n, t in start.items():  # the rest: initialized by the model's own init_weights, not left as empty memory
        if n in loaded:
            continue
        if "norm" in n:
            assert bool((t == 1.0).all()), n
        elif n.endswith(".bias"):
            assert bool((t == 0.0).all()), n  # HF initializes biases to zero (the saved ones are not)
        else:
            assert abs(float(t.std()) - 0.02) < 0.006 and abs(float(t.mean())) < 0.005, (n, t.mean(), t.std())
    losses = ranks[0]["zero3_meta"]["losses"]
    assert len(losses) == STEPS and all(abs(x) < 10 for x in losses), losses


def test_meta_init_refuses_a_load_into_the_meta_model(runs):
    for r in runs:
        err = r["refused"]["zero3_meta"].get("error", "")
        assert "configure_model copied values into a tensor on the meta device" in err, err[-2000:]
        assert "assign=True" in err and "meta_init=False" in err, err[-2000:]


def test_materialize_touches_only_what_is_still_on_meta():
    """Per tensor, in one process: a Linear whose weight was loaded (``assign=True``) while its bias is still meta
    gets its bias initialized (``reset_parameters``) and keeps the loaded weight bitwise; a tied pair stays one
    tensor; a module with nothing on meta is not re-initialized. (``to_empty`` + ``reset_parameters`` per module, the
    former materialization, re-drew the loaded weight and untied the pair.)"""
    import torch
    from torch import nn

    from lightning_v17.engine.zero.meta_init import materialize_meta_module

    with torch.device("meta"):
        model = nn.ModuleDict({"embed": nn.Embedding(10, 4), "proj": nn.Linear(4, 4), "head": nn.Linear(4, 10)})
    model["head"].weight = model["embed"].weight  # tied, both on meta
    loaded = torch.randn(4, 4, generator=torch.Generator().manual_seed(3))
    model["proj"].load_state_dict({"weight": loaded}, strict=False, assign=True)  # the bias stays on meta
    keep = nn.Linear(2, 2)  # real from the start: untouched
    model["keep"] = keep
    before = keep.weight.detach().clone()
    materialize_meta_module(model, device=torch.device("cpu"))
    assert not any(t.is_meta for t in (*model.parameters(), *model.buffers()))
    assert torch.equal(model["proj"].weight, loaded)
    bound = 1 / 4**0.5  # nn.Linear's bias init: U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    assert bool((model["proj"].bias.abs() <= bound).all()) and float(model["proj"].bias.abs().sum()) > 0
    assert model["head"].weight is model["embed"].weight and float(model["embed"].weight.std()) > 0  # initialized
    assert torch.equal(keep.weight, before)


def test_meta_init_needs_zero_stage_3():
    from lightning_v17 import V17Strategy, ZeroPolicy
    from lightning_v17.config import V17ConfigError

    with pytest.raises(V17ConfigError, match=r"ZeroPolicy\(meta_init=True\) .* ZeroPolicy\(stage=2\) .* use stage=3"):
        ZeroPolicy(stage=2, meta_init=True)
    with pytest.raises(V17ConfigError, match=r"ZeroPolicy\(meta_init='yes'\) must be True or False"):
        ZeroPolicy(meta_init="yes")
    assert V17Strategy(zero=ZeroPolicy(stage=3, meta_init=True)).policy.zero.meta_init is True
    assert V17Strategy(zero_stage=3).policy.zero.meta_init is False  # Lightning's semantics by default
