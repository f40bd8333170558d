"""Module patterns users write that the ZeRO/TP tests do not cover, under V17 against Lightning's own ``"ddp"``.

* ``t5``: an encoder-decoder Hugging Face model, ``T5ForConditionalGeneration`` from a tiny config (random weights,
  nothing downloaded). Its one ``shared`` embedding is tied into three children (``encoder.embed_tokens``,
  ``decoder.embed_tokens`` and ``lm_head``, HF ``tie_word_embeddings=True``), and its units are two ``ModuleList``s
  of blocks (encoder and decoder), so ZeRO-3 shards blocks of two stacks around one tied root group.
* ``tied_children``: the user's own tiny LM with an embedding tied to an output head that lives in another child of
  the LightningModule (``self.head.weight = self.embed.weight``), and no ``forward`` at all: several parameterized
  children, so at ZeRO-3 the LightningModule itself is the FSDP root and its ``__call__`` never runs.
* ``forward_never_called``: an HF Llama with ``tie_word_embeddings=True`` whose ``training_step`` never calls the
  model's ``forward``: it calls the base model (``self.model.model``) and the head (``self.model.lm_head``) directly
  and computes its own loss, as users do for a custom or chunked loss. The FSDP root (``self.model``) never runs its
  pre-forward hook; its tied embedding/head are used through its children only. At tp=2 the model's own plan
  shards the layers and keeps the tied head replicated.

Every pattern trains 6 SGD steps (SGD, so a wrong gradient scale shows in the parameters, which AdamW would hide)
on 8 rows a step (4 per rank; at tp=2 the one data-parallel rank reads all 8), under ``"ddp"`` and under V17 at
ZeRO-1, 2 and 3 in the same process pair, compared with the tier's harness
(:func:`~tests.integration.real_modules._common.assert_matches`: per-step loss within 1e-4 relative, final
parameters within 1e-5 absolute). Every row holds the same number of targets, so the per-rank mean losses average
to the global mean and the data-parallel mean gradient is the one-process gradient.

One spawn runs every pattern (the spawn is the cost on 2 cores); a run that raises is recorded with its traceback
and fails its own test, so one broken pattern does not hide the others' results.
"""

from __future__ import annotations

import traceback
from typing import Any

import pytest

from tests._dist import spawn
from tests.integration.real_modules._common import assert_matches, train

pytest.importorskip("transformers")

VOCAB = 128
ROWS_PER_STEP = 8
LR = 0.5

#: V17 configurations per pattern (every one is compared to that pattern's "ddp" run)
ZERO = {"zero1": {"zero_stage": 1}, "zero2": {"zero_stage": 2}, "zero3": {"zero_stage": 3}}
CONFIGS: dict[str, dict[str, dict[str, Any]]] = {
    "t5": ZERO,  # T5 ships no tensor-parallel plan
    "tied_children": ZERO,  # the user's own module: no plan
    "forward_never_called": {**ZERO, "tp2": {"tp": 2, "zero_stage": 1}},
}


def _t5() -> Any:
    import lightning as L
    import torch
    import transformers

    class T5Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            cfg = transformers.T5Config(
                vocab_size=VOCAB, d_model=32, d_ff=64, d_kv=8, num_layers=2, num_decoder_layers=2, num_heads=4,
                dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, tie_word_embeddings=True,
            )  # fmt: skip
            torch.manual_seed(0)
            self.model = transformers.T5ForConditionalGeneration(cfg)
            assert self.tied(), "the tie is what this pattern is about"

        def tied(self) -> bool:
            m = self.model  # one tensor in the embedding, both stacks' inputs and the head
            return m.lm_head.weight is m.shared.weight and m.decoder.embed_tokens.weight is m.shared.weight

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR)

    return T5Module()


def _tied_children() -> Any:
    import lightning as L
    import torch
    import torch.nn.functional as F
    from torch import nn

    class TiedLM(L.LightningModule):
        """Embedding -> residual MLP -> norm -> head, the head's weight being the embedding's (no ``forward``)."""

        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.embed = nn.Embedding(VOCAB, 32)
            self.body = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 32))
            self.norm = nn.LayerNorm(32)
            self.head = nn.Linear(32, VOCAB, bias=False)
            self.head.weight = self.embed.weight

        def tied(self) -> bool:
            return self.head.weight is self.embed.weight

        def training_step(self, batch, batch_idx):
            h = self.embed(batch["input_ids"])
            h = h + self.body(h)
            logits = self.head(self.norm(h))
            return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR)

    return TiedLM()


def _forward_never_called() -> Any:
    import lightning as L
    import torch
    import torch.nn.functional as F

    from tests._models import hf_llama

    class BaseAndHead(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = hf_llama(2, seed=0, tie_word_embeddings=True)
            assert self.tied()

        def tied(self) -> bool:
            return self.model.lm_head.weight is self.model.model.embed_tokens.weight

        def training_step(self, batch, batch_idx):
            hidden = self.model.model(input_ids=batch["input_ids"]).last_hidden_state
            logits = self.model.lm_head(hidden[:, :-1])
            return F.cross_entropy(logits.flatten(0, 1), batch["input_ids"][:, 1:].flatten())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR)

    return BaseAndHead()


def _data(pattern: str) -> list[dict[str, Any]]:
    """64 rows of random tokens (ids >= 1: T5's pad and decoder-start id is 0); every row the same length."""
    import torch

    g = torch.Generator().manual_seed(7)
    if pattern == "t5":
        src = torch.randint(1, VOCAB, (64, 12), generator=g)
        tgt = torch.randint(1, VOCAB, (64, 8), generator=g)
        return [{"input_ids": s, "labels": t} for s, t in zip(src, tgt)]
    rows = torch.randint(1, VOCAB, (64, 17), generator=g)
    if pattern == "tied_children":
        return [{"input_ids": r[:-1], "labels": r[1:].clone()} for r in rows]
    return [{"input_ids": r[:-1]} for r in rows]


MODULES = {"t5": _t5, "tied_children": _tied_children, "forward_never_called": _forward_never_called}


def _still_tied(module: Any, trainer: Any) -> bool:
    """After training: the shared parameter is still one object in every owner (a strategy that replaced it per
    module, as a sharding pass can, would train two diverging copies)."""
    return module.tied()


def _run(make, strategy, pattern: str, dp: int) -> dict[str, Any]:
    """One fit, or the traceback it raised (the remaining runs still go ahead; the test of this run fails)."""
    try:
        return train(make, strategy, _data(pattern), batch_size=ROWS_PER_STEP // dp, inspect=_still_tied)
    except Exception:  # noqa: BLE001 - reported by the run's own test
        return {"error": traceback.format_exc()}


def _worker(rank: int, world: int) -> dict[str, dict[str, Any]]:
    from tests._strategy import v17  # the configurations are flat option dicts

    out: dict[str, dict[str, Any]] = {}
    for pattern, configs in CONFIGS.items():
        make = MODULES[pattern]
        out[pattern] = {"ddp": _run(make, "ddp", pattern, world)}
        for name, kw in configs.items():
            dp = world // kw.get("tp", 1)
            out[pattern][name] = _run(make, v17(**kw), pattern, dp)
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict[str, dict[str, Any]]]:
    return spawn(_worker, world_size=2, init_process_group=False, timeout=420)


CASES = [(p, n) for p, configs in CONFIGS.items() for n in configs]


@pytest.mark.timeout(480)
@pytest.mark.parametrize(("pattern", "name"), CASES, ids=[f"{p}-{n}" for p, n in CASES])
def test_pattern_matches_ddp(runs, pattern, name):
    ranks = [r[pattern] for r in runs]
    for run in ("ddp", name):
        errors = [r[run]["error"] for r in ranks if "error" in r[run]]
        assert not errors, f"{pattern} under {run} raised:\n{errors[0]}"
    assert all(r[name]["extra"] for r in ranks), f"{pattern} under {name}: the tied parameter was split into copies"
    errs = assert_matches(ranks, [name])
    print(f"{pattern} {name}: loss rel err {errs[name][0]:.2e}, param abs err {errs[name][1]:.2e}")
