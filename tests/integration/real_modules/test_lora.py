"""peft LoRA on a Hugging Face Llama at ZeRO-0/1/2/3 against Lightning's ``"ddp"``: frozen parameters are left out of
the partition, never refused, and never stepped.

The module is what peft's examples write: ``get_peft_model(LlamaForCausalLM, LoraConfig(...))`` in ``__init__``,
and one of two optimizer forms, both common:

* ``"all"``: ``torch.optim.AdamW(self.parameters())``, the frozen base included (peft's own examples);
* ``"trainable"``: ``torch.optim.AdamW(p for p in self.parameters() if p.requires_grad)``.

Checked for every stage and both forms:

* per-step losses within 1e-4 relative of ddp's and final parameters within 1e-5 (AdamW hides a constant factor in
  the gradients, so the parameters are what shows a scale error);
* the frozen base is bitwise its value at construction;
* the optimizer state holds exactly the trainable elements twice (AdamW's ``exp_avg`` and ``exp_avg_sq``), summed
  over the ranks' local tensors: none for frozen parameters. ddp and stage 0 hold all of it on every rank; stages
  1-3 shard it, each rank holding about half.
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests._dist import spawn
from tests.integration.real_modules._common import assert_matches, full_parameters, train

pytest.importorskip("transformers")
pytest.importorskip("peft")

FORMS = ("all", "trainable")
STAGES = (0, 1, 2, 3)
ROWS_PER_RANK = 4


def _lora_module(form: str):
    import lightning as L
    from peft import LoraConfig, get_peft_model

    from tests._models import hf_llama

    class LoraLM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
            self.model = get_peft_model(hf_llama(layers=2, seed=0), config)
            # a plain dict, not state: what the frozen base must still be after training
            self.frozen_at_start = {n: p.detach().clone() for n, p in self.named_parameters() if not p.requires_grad}

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss

        def configure_optimizers(self):
            if form == "all":
                return torch.optim.AdamW(self.parameters(), lr=1e-2)
            return torch.optim.AdamW((p for p in self.parameters() if p.requires_grad), lr=1e-2)

    return LoraLM()


def _inspect(module, trainer) -> dict:
    """What the frozen base and the optimizer state look like after training (on this rank)."""
    final = full_parameters(module)  # collective at stage 3: every rank calls it in the same order
    start = module.frozen_at_start
    state_numel = 0
    for st in trainer.optimizers[0].state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            v = st[key]
            state_numel += (v._local_tensor if hasattr(v, "_local_tensor") else v).numel()
    return {
        "frozen": len(start),
        "frozen_changed": sorted(n for n, t in start.items() if not torch.equal(final[n], t)),
        "trainable_numel": sum(p.numel() for p in module.parameters() if p.requires_grad),  # global sizes (DTensor)
        "state_numel": state_numel,
    }


def _worker(rank: int, world: int, forms: tuple[str, ...], stages: tuple[int, ...]) -> dict:
    from lightning_v17 import V17Strategy
    from tests._models import token_dataset

    data = token_dataset("hf_llama")
    kw = {"batch_size": ROWS_PER_RANK, "inspect": _inspect}
    out = {}
    for form in forms:
        make = functools.partial(_lora_module, form)
        out[f"ddp_{form}"] = train(make, "ddp", data, **kw)
        for stage in stages:
            out[f"zero{stage}_{form}"] = train(make, V17Strategy(zero_stage=stage), data, **kw)
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return spawn(_worker, world_size=2, args=(FORMS, STAGES), timeout=420)


@pytest.mark.parametrize("form", FORMS)
def test_lora_matches_ddp_frozen_base_untouched_state_sharded(ranks, form: str) -> None:
    names = [f"zero{s}_{form}" for s in STAGES]
    for name in [f"ddp_{form}", *names]:
        extra = [r[name]["extra"] for r in ranks]
        trainable = extra[0]["trainable_numel"]
        assert extra[0]["frozen"] > 0 and 0 < trainable < 20_000, (name, extra[0])  # LoRA: a small trainable part
        for e in extra:
            assert e["frozen_changed"] == [], f"{name}: frozen parameters changed: {e['frozen_changed']}"
        per_rank = [e["state_numel"] for e in extra]
        if name.startswith(("ddp", "zero0")):
            assert per_rank == [2 * trainable] * len(ranks), (name, per_rank, trainable)  # replicated
        else:
            assert sum(per_rank) == 2 * trainable, (name, per_rank, trainable)  # sharded: each element once
            assert all(0.8 * trainable <= n <= 1.2 * trainable for n in per_rank), (name, per_rank, trainable)  # ~half
    print(form, assert_matches(ranks, names, ref=f"ddp_{form}"))
