"""Hugging Face models on the installed (newest) transformers at pp=2 and tp=2, under V17 against Lightning's ``"ddp"``.

The user's module is the one HF users write: ``self.model(input_ids=..., labels=...).loss`` with
``torch.optim.SGD(self.parameters())``; nothing in it names a plan or a layout.

* ``pp2_gpipe`` / ``pp2_1f1b``: the pipeline cuts the model where its own ``base_model_pp_plan`` says and runs each
  stage through the model's public forward (``lightning_v17.models.pp_layouts``), 4 micro-batches.
* ``tp2``: the model's own tensor-parallel plan as the installed release defines it; the test checks that the
  sharded parameters are exactly the ones HF's own ``model.tp_plan`` property names (with this release that
  includes the vocab-parallel input embedding), so a plan that dropped or added a module fails even though it
  would still compute the right numbers.

Families: ``LlamaForCausalLM`` (both schedules and tp), ``Qwen2ForCausalLM`` (q/k/v biases; its forward picks each
layer's mask by ``config.layer_types[i]``) and ``GraniteForCausalLM`` (it multiplies the input embeddings and the
logits outside the parts the pipeline moves). The adapter has no branch for either family: a test reads its code
and finds no family name and nothing of what a family's forward computes around its blocks.

6 SGD steps on 8 rows a step (ddp: 4 per rank; pp and tp here have one data-parallel rank, which reads all 8), fp32.
Per-step losses within 1e-4 relative of ddp's (``_common.LOSS_RTOL``); parameters within 1e-5 absolute
(``_common.PARAM_ATOL``): at tp the gathered full parameters, at pp each rank's stage parameters against ddp's
parameters of the same name, the two stages together holding every parameter exactly once. One spawn runs all.
"""

from __future__ import annotations

import re
import traceback
from typing import Any

import pytest

from tests._dist import spawn
from tests.integration.real_modules._common import LOSS_RTOL, PARAM_ATOL, assert_matches, loss_error, train

transformers = pytest.importorskip("transformers")

ROWS_PER_STEP = 8
LR = 0.5
PP = {"pp": 2, "zero_stage": 1, "microbatches": 4}
CONFIGS: dict[str, dict[str, dict[str, Any]]] = {
    "llama": {
        "pp2_gpipe": {**PP, "pp_schedule": "gpipe"},
        "pp2_1f1b": {**PP, "pp_schedule": "1f1b"},
        "tp2": {"tp": 2, "zero_stage": 1},
    },
    "qwen2": {"pp2_1f1b": {**PP, "pp_schedule": "1f1b"}, "tp2": {"tp": 2, "zero_stage": 1}},
    "granite": {"pp2_1f1b": {**PP, "pp_schedule": "1f1b"}},
}
#: on top of tests._models' tiny shape (hidden 64, 4 heads, 2 kv heads, 4 layers, vocab 128, untied embeddings)
OVERRIDES: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen2": {"use_sliding_window": False},
    "granite": {"embedding_multiplier": 3.0, "logits_scaling": 2.0},
}


def _module(family: str) -> Any:
    import lightning as L
    import torch

    from tests._models import hf_causal_lm

    class HFModule(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            # random q/k/v biases where the family has them (HF draws zeros, which only ever hold lr-sized updates)
            self.model = hf_causal_lm(family, seed=0, bias_std=0.02, max_position_embeddings=64, **OVERRIDES[family])

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR)

    return HFModule()


def _layout(module: Any, trainer: Any) -> dict[str, Any]:
    """What was sharded, and what HF's own plan names (``model.tp_plan``, the release's public property), as
    module names with layer indices written ``*`` the way HF's plans write them."""
    model = module.model
    sharded = {
        n.rsplit(".", 1)[0]
        for n, p in model.named_parameters()
        if hasattr(p, "placements") and any(pl.is_shard() for pl in p.placements)
    }
    generic = {re.sub(r"\.\d+(\.|$)", r".*\1", n) for n in sharded}
    return {
        "sharded": sorted(generic),
        "hf_plan": sorted(model.tp_plan),
        "blocks": list(model.model.layers) if hasattr(model.model.layers, "keys") else None,
    }


def _data() -> list[dict[str, Any]]:
    from tests._models import token_dataset

    return token_dataset("hf", rows=6 * ROWS_PER_STEP)


def _run(family: str, strategy: Any, dp: int) -> dict[str, Any]:
    """One fit, or the traceback it raised (the other runs still go ahead; this run's test fails)."""
    try:
        return train(lambda: _module(family), strategy, _data(), batch_size=ROWS_PER_STEP // dp, inspect=_layout)
    except Exception:  # noqa: BLE001 - reported by the run's own test
        return {"error": traceback.format_exc()}


def _worker(rank: int, world: int) -> dict[str, dict[str, Any]]:
    from tests._strategy import v17  # the configurations are flat option dicts

    out: dict[str, dict[str, Any]] = {}
    for family, configs in CONFIGS.items():
        out[family] = {"ddp": _run(family, "ddp", world)}
        for name, kw in configs.items():
            out[family][name] = _run(family, v17(**kw), world // (kw.get("tp", 1) * kw.get("pp", 1)))
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict[str, dict[str, Any]]]:
    return spawn(_worker, world_size=2, init_process_group=False, timeout=420)


CASES = [(f, n) for f, configs in CONFIGS.items() for n in configs]


def _no_errors(ranks: list[dict[str, Any]], family: str, name: str) -> None:
    for run in ("ddp", name):
        errors = [r[run]["error"] for r in ranks if "error" in r[run]]
        assert not errors, f"{family} under {run} (transformers {transformers.__version__}) raised:\n{errors[0]}"


def _pipeline_param_error(ranks: list[dict[str, Any]], name: str) -> float:
    """Max abs difference of each rank's stage parameters against ddp's of the same name; the stages must hold
    every ddp parameter exactly once between them."""
    held = [n for r in ranks for n in r[name]["params"]]
    assert sorted(held) == sorted(ranks[0]["ddp"]["params"]), sorted(set(held) ^ set(ranks[0]["ddp"]["params"]))
    return max(float((p - r["ddp"]["params"][k]).abs().max()) for r in ranks for k, p in r[name]["params"].items())


@pytest.mark.timeout(480)
@pytest.mark.parametrize(("family", "name"), CASES, ids=[f"{f}-{n}" for f, n in CASES])
def test_current_transformers_matches_ddp(runs, family, name):
    ranks = [r[family] for r in runs]
    _no_errors(ranks, family, name)
    layouts = [r[name]["extra"] for r in ranks]
    if name.startswith("pp"):
        # split by parameter count into 2 + 2 blocks, FQNs kept (the ModuleList became a ModuleDict by index)
        assert [lay["blocks"] for lay in layouts] == [["0", "1"], ["2", "3"]], layouts
        loss, param = loss_error(ranks, name), _pipeline_param_error(ranks, name)
        assert loss <= LOSS_RTOL and param <= PARAM_ATOL, (name, loss, param)
    else:
        for lay in layouts:  # every module HF's own plan names is sharded, and nothing else
            assert lay["sharded"] == lay["hf_plan"], (lay["sharded"], lay["hf_plan"])
        loss, param = assert_matches(ranks, [name])[name]
    print(f"transformers {transformers.__version__} {family} {name}: loss rel {loss:.2e}, param abs {param:.2e}")


def test_pipeline_adapter_holds_no_family_code():
    """Qwen2 and Granite train above with no code of their own: the adapter's code (docstrings aside) names no
    family, no HF helper and none of what a family's forward computes around its blocks."""
    from lightning_v17.models import pp_layouts
    from tests.unit.test_pp_layouts import _code_words

    code = " ".join(sorted(w.lower() for w in _code_words(pp_layouts)))
    for word in ("qwen", "granite", "llamafor", "model_type", "masking", "causal_mask", "rotary", "multiplier"):
        assert word not in code, word
