"""Third-party models for the tests: tiny Hugging Face and litgpt configs with random weights (nothing downloaded), and
LightningModules written as their users write them (no V17 code inside).

``transformers`` and ``litgpt`` are test extras, imported only when a model is built: the builders call
``pytest.importorskip``, so a test that builds one is skipped without them (a test module that needs them at
collection, or before spawning ranks, still calls ``pytest.importorskip`` itself).
"""

from __future__ import annotations

import contextlib
from typing import Any
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

VOCAB, SEQ, ROWS = 128, 16, 64

#: the tiny shape of every Hugging Face builder: hidden 64, 4 heads, 2 key/value heads (GQA), intermediate 128
_HF_TINY: dict[str, Any] = {
    "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
    "num_key_value_heads": 2, "tie_word_embeddings": False, "attn_implementation": "sdpa",
}  # fmt: skip
#: the same shape for litgpt, built like Llama (RMSNorm, LLaMAMLP, 2 query groups, full rotary)
_LITGPT_TINY: dict[str, Any] = {
    "n_head": 4, "n_query_groups": 2, "n_embd": 64, "block_size": 64, "vocab_size": VOCAB, "padded_vocab_size": VOCAB,
    "mlp_class_name": "LLaMAMLP", "intermediate_size": 128, "bias": False, "norm_class_name": "RMSNorm",
    "parallel_residual": False, "rotary_percentage": 1.0,
}  # fmt: skip


def _seed(seed: int | None) -> None:
    if seed is not None:
        torch.manual_seed(seed)


def hf_causal_lm(
    family: str, *, layers: int = 4, seed: int | None = 0, bias_std: float | None = None, **config_overrides: Any
) -> torch.nn.Module:
    """A tiny Hugging Face causal LM of ``model_type`` ``family`` ("llama", "qwen2", "mistral", "phi3", "olmo2", ...):
    the config is ``AutoConfig.for_model(family, ...)`` with hidden 64, 4 heads, 2 key/value heads, intermediate 128,
    vocab 128, untied embeddings and sdpa, ``config_overrides`` on top; the model is the family's ``*ForCausalLM``.

    Weights are drawn right after ``torch.manual_seed(seed)`` (``seed=None``: from the current RNG state). With
    ``bias_std`` every bias is then redrawn from N(0, bias_std): HF initializes biases to zero, and after a few Adam
    steps such a parameter is only its (lr-sized) updates, so its relative error would measure fp32 reduction order
    rather than what a test checks.
    """
    transformers = pytest.importorskip("transformers")
    cfg = transformers.AutoConfig.for_model(family, **{**_HF_TINY, "num_hidden_layers": layers, **config_overrides})
    _seed(seed)
    model = transformers.MODEL_FOR_CAUSAL_LM_MAPPING[type(cfg)](cfg)
    if bias_std is not None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(".bias"):
                    p.normal_(0.0, bias_std)
    return model


def hf_llama(layers: int = 4, *, seed: int | None = 0, **config_overrides: Any) -> torch.nn.Module:
    """A tiny ``LlamaForCausalLM`` (``hf_causal_lm``) with 64 positions."""
    return hf_causal_lm("llama", layers=layers, seed=seed, **{"max_position_embeddings": 64, **config_overrides})


def hf_qwen2(layers: int = 4, *, seed: int | None = 0, **config_overrides: Any) -> torch.nn.Module:
    """A tiny ``Qwen2ForCausalLM`` (q/k/v projections with bias, unlike Llama) with 64 positions, no sliding window."""
    overrides = {"max_position_embeddings": 64, "use_sliding_window": False, **config_overrides}
    return hf_causal_lm("qwen2", layers=layers, seed=seed, **overrides)


def litgpt_gpt(
    layers: int = 4, *, seed: int | None = 0, init_weights: bool = False, **config_overrides: Any
) -> torch.nn.Module:
    """A tiny litgpt ``GPT`` shaped like Llama (RMSNorm, LLaMAMLP, GQA with 2 query groups, block size 64),
    ``config_overrides`` on top. Weights drawn after ``torch.manual_seed(seed)`` (``None``: the current RNG state);
    ``init_weights`` then applies litgpt's own ``_init_weights`` (as its pretraining script does)."""
    litgpt = pytest.importorskip("litgpt")
    cfg = litgpt.Config(**{**_LITGPT_TINY, "n_layer": layers, **config_overrides})
    _seed(seed)
    model = litgpt.GPT(cfg)
    if init_weights:
        model.apply(model._init_weights)
    return model


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
            self.model = BUILDERS[kind](layers, seed=seed)
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


#: the Hugging Face MoE families whose fused experts run under V17's expert parallelism
HF_MOE_FAMILIES = ("mixtral", "qwen3_moe", "deepseek_v3")


def hf_moe(family: str, *, seed: int = 0):
    """A tiny random Hugging Face MoE causal LM of ``family`` (2 layers, hidden 32, 4 experts, top-2, fp32, eager
    attention; DeepSeek-V3 with tiny MLA dims, one shared expert and its first layer dense)."""
    import torch
    from transformers import AutoModelForCausalLM, DeepseekV3Config, MixtralConfig, Qwen3MoeConfig

    common = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 64, "attn_implementation": "eager"}  # fmt: skip
    if family == "mixtral":
        cfg = MixtralConfig(intermediate_size=16, num_local_experts=4, num_experts_per_tok=2, **common)
    elif family == "qwen3_moe":
        cfg = Qwen3MoeConfig(intermediate_size=32, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                             head_dim=8, **common)  # fmt: skip
    elif family == "deepseek_v3":
        cfg = DeepseekV3Config(intermediate_size=32, moe_intermediate_size=16, n_routed_experts=4,
                               num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
                               first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                               qk_rope_head_dim=8, v_head_dim=8, **{**common, "num_key_value_heads": 4})  # fmt: skip
    else:
        raise ValueError(family)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg)


def hf_moe_with(family: str, *, seed: int = 0, **config_overrides: Any):
    """``hf_moe(family)``'s tiny config with ``config_overrides`` set on it (e.g. an intermediate size that is not
    a multiple of 4), rebuilt from ``seed``."""
    from transformers import AutoModelForCausalLM

    cfg = hf_moe(family, seed=seed).config
    for key, value in config_overrides.items():
        if not hasattr(cfg, key):
            raise ValueError(f"{type(cfg).__name__} has no option {key!r}")
        setattr(cfg, key, value)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg)


@contextlib.contextmanager
def stable_sort():
    """``torch.sort`` stable while transformers' ``grouped_mm`` experts sort their rows by expert, as the engine's
    dispatchers do: CPU GEMM kernels (AVX2's, not AVX-512's) round a row by its position in the batch, so only the
    same row order within an expert gives the same bits."""
    sort = torch.sort
    with mock.patch.object(torch, "sort", lambda *a, **kw: sort(*a, **{**kw, "stable": True})):
        yield
