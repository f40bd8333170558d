"""Third-party models for the tests: tiny Hugging Face and litgpt configs with random weights (nothing downloaded), and
LightningModules written as their users write them (no V17 code inside).

``transformers`` and ``litgpt`` are test extras; a test module that needs them calls ``pytest.importorskip``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

VOCAB, SEQ, ROWS = 128, 16, 64


def hf_llama(layers: int = 4) -> torch.nn.Module:
    """A tiny ``LlamaForCausalLM``: hidden 64, 4 heads, 2 key/value heads (GQA), intermediate 128."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, attn_implementation="sdpa",
    )  # fmt: skip
    return LlamaForCausalLM(cfg)


def hf_qwen2(layers: int = 4) -> torch.nn.Module:
    """A tiny ``Qwen2ForCausalLM`` (q/k/v projections with bias, unlike Llama)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, use_sliding_window=False,
        attn_implementation="sdpa",
    )  # fmt: skip
    return Qwen2ForCausalLM(cfg)


def litgpt_gpt(layers: int = 4) -> torch.nn.Module:
    """A tiny litgpt ``GPT`` shaped like Llama (RMSNorm, LLaMAMLP, GQA with 2 query groups)."""
    from litgpt import GPT, Config

    cfg = Config(
        n_layer=layers, n_head=4, n_query_groups=2, n_embd=64, block_size=64, vocab_size=VOCAB, padded_vocab_size=VOCAB,
        mlp_class_name="LLaMAMLP", intermediate_size=128, bias=False, norm_class_name="RMSNorm",
        parallel_residual=False, rotary_percentage=1.0,
    )  # fmt: skip
    return GPT(cfg)


BUILDERS = {"hf_llama": hf_llama, "hf_qwen2": hf_qwen2, "litgpt": litgpt_gpt}


def token_dataset(kind: str, rows: int = ROWS, seed: int = 7) -> list[dict[str, torch.Tensor]]:
    """Random token rows as dicts. HF models shift labels inside their loss, so their ``labels`` are the inputs; for
    litgpt (no loss of its own) ``labels`` are the next tokens, as its users prepare them."""
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=g)
    if kind.startswith("hf"):
        return [{"input_ids": r[:-1], "labels": r[:-1].clone()} for r in data]
    return [{"input_ids": r[:-1], "labels": r[1:].clone()} for r in data]


def lightning_module(kind: str, *, lr: float = 0.5, layers: int = 4, seed: int = 0, **hooks: Any):
    """The minimal LightningModule a user of ``kind`` writes: HF ``model(input_ids, labels=...).loss``, litgpt
    cross-entropy of the logits. The model is drawn from ``seed``; ``hooks`` become attributes (``tp_plan={...}``)."""
    import lightning as L

    class UserModule(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(seed)
            self.model = BUILDERS[kind](layers)
            for k, v in hooks.items():
                setattr(self, k, v)

        def training_step(self, batch, batch_idx):
            if kind.startswith("hf"):
                return self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
            logits = self.model(batch["input_ids"])
            return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=lr)

    return UserModule()


def loss_recorder():
    """A Callback recording each step's returned loss on this rank (built lazily: Lightning imports on use)."""
    import lightning as L

    class LossRecorder(L.Callback):
        def __init__(self) -> None:
            self.losses: list[float] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.losses.append(float(outputs["loss"]))

    return LossRecorder()


def fit(
    kind: str, strategy: Any, *, devices: int, batch_size: int, steps: int = 6, callbacks: tuple = (), **module_kw: Any
) -> list[float]:
    """Train ``steps`` steps inside a spawned rank; returns this rank's per-step losses."""
    import lightning as L
    from torch.utils.data import DataLoader

    L.seed_everything(1, verbose=False)
    module = lightning_module(kind, **module_kw)
    rec = loss_recorder()
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=False, callbacks=[rec, *callbacks],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(module, DataLoader(token_dataset(kind), batch_size=batch_size, shuffle=False))
    return rec.losses


def mean_over_ranks(per_rank: list[list[float]]) -> list[float]:
    """Per-step mean of the ranks' losses: the data-parallel mean (ranks of one tp/pp group hold the same value)."""
    return [sum(r[i] for r in per_rank) / len(per_rank) for i in range(len(per_rank[0]))]


def max_rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (a, b)
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))
