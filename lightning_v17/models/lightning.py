"""``LlamaLM``: the reference decoder as a LightningModule, trained on packed batches (``lightning_v17.data``)."""

from __future__ import annotations

import math
import time
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule

from lightning_v17.config import V17ConfigError
from lightning_v17.data.packing import IGNORE_INDEX
from lightning_v17.engine.ep.balance import balanced_layers, step_expert_biases
from lightning_v17.engine.loss_norm import divide_token_sum
from lightning_v17.engine.zero.fsdp import fsdp_root
from lightning_v17.models.config import ModelConfig
from lightning_v17.models.llama import Llama
from lightning_v17.models.moe import moe_layers
from lightning_v17.models.tiled import check_chunk_tokens, head_detached, tiled_next_token_loss
from lightning_v17.optim.factory import OptimizerName, build_optimizer


def next_token_loss(
    logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean cross-entropy over the tokens whose label is not -100 (times ``loss_mask`` if given).

    Under ``V17Strategy(loss_normalization="tokens")`` (the default) the token sum is divided by the optimizer step's
    global target count instead, scaled to this rank's share (:mod:`lightning_v17.engine.loss_norm`).

    Args:
        logits: [B, S, V] (any float dtype; the loss is computed in fp32).
        labels: [B, S] next-token ids, already shifted within each document (-100: no target).
        loss_mask: optional [B, S] float weights aligned with ``labels`` (SFT: 0 on prompt targets).

    Returns:
        (mean loss, number of counted targets as a float tensor).
    """
    per_token = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="none"
    )
    if hasattr(per_token, "full_tensor"):  # loss_parallel: vocab-sharded logits -> a (replicated) DTensor per token
        per_token = per_token.full_tensor()
    weight = (labels.reshape(-1) != IGNORE_INDEX).float()
    if loss_mask is not None:
        weight = weight * loss_mask.reshape(-1).float()
    count = weight.sum()
    return divide_token_sum((per_token * weight).sum(), count, where="next_token_loss"), count


class LlamaLM(L.LightningModule):
    """Next-token language modelling with the reference Llama decoder on packed batches.

    The model is built in :meth:`configure_model`, so a strategy can build it on the meta device and materialize
    only its shards (ZeRO-3); calling it twice is a no-op.

    Args:
        model: planner preset name (``tiny``, ``llama2-7b``, ``llama3-8b``, ``llama3-70b``, ``llama3-405b``).
        model_overrides: ModelConfig fields to override, e.g. ``{"layers": 2, "dropout": 0.1}``.
        lr: peak learning rate (AdamW).
        weight_decay: decoupled weight decay on matrices (norm weights are not decayed).
        betas: AdamW betas.
        eps: AdamW epsilon.
        warmup_steps: linear warm-up steps from 0 to ``lr``.
        max_steps: length of the cosine decay in optimizer steps; None: the trainer's ``max_steps`` (or its
            estimated stepping batches when ``max_steps`` is -1).
        min_lr_ratio: the cosine decays to ``lr * min_lr_ratio``.
        init_seed: seed of the deterministic weight init (:meth:`Llama.init_weights`).
        optimizer: the optimizer, from :mod:`lightning_v17.optim`: a name (``adamw``, ``cpu_adam``, ``adam8bit``,
            ``adafactor``, ``lion``, ``lion8bit``) or a ``{"class_path": ..., "init_args": {...}}`` spec naming any
            optimizer class. ``lr``, ``betas``, ``eps`` and ``weight_decay`` above are passed where the class takes
            them; a spec's ``init_args`` override them. Default: fused AdamW.
        loss_chunk_tokens: tiled logits + loss (ALST's TiledFusedLogitsLoss, Liger's fused linear cross-entropy):
            the model returns its final hidden states and the output head and cross-entropy run this many tokens at
            a time, each chunk checkpointed, so the ``[tokens, vocab]`` logits exist for one chunk only, in forward
            and in backward (recomputed there: one more head matmul per step). The same ``(mean, count)`` as
            without; the head's gradient is summed chunk by chunk (a few fp32 ulps). Works with ZeRO, tp (also
            ``loss_parallel``) and cp; refused with pp > 1, whose schedule computes the loss from the last stage's
            logits. 0 (default): off. See ``lightning_v17/models/tiled.py``.
    """

    def __init__(
        self,
        model: str = "tiny",
        model_overrides: dict[str, Any] | None = None,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        warmup_steps: int = 20,
        max_steps: int | None = None,
        min_lr_ratio: float = 0.1,
        init_seed: int = 0,
        optimizer: str | dict[str, Any] = "adamw",
        loss_chunk_tokens: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        if lr <= 0:
            raise ValueError(f"lr={lr} must be positive")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps={warmup_steps} must be >= 0")
        if not isinstance(optimizer, dict):
            OptimizerName.parse(optimizer)  # a bad name fails here, naming the option and the valid names
        check_chunk_tokens(loss_chunk_tokens, "loss_chunk_tokens")
        self.config = ModelConfig.from_preset(model, **(model_overrides or {}))
        self.model: Llama | None = None
        self._last_step_time: float | None = None
        self._bias_step: int | None = None  # the global step whose expert-bias update has been applied

    def configure_model(self) -> None:
        chunk = self.hparams.get("loss_chunk_tokens", 0)
        mesh = getattr(self, "_device_mesh", None)  # set by the strategy before configure_model
        pp = mesh["pp"].size() if chunk and mesh is not None and "pp" in (mesh.mesh_dim_names or ()) else 1
        if pp > 1:
            raise V17ConfigError(
                f"loss_chunk_tokens={chunk} with pp={pp} is not supported: the pipeline schedule computes the loss on "
                "the last stage from its whole [tokens, vocab] logits, outside LlamaLM.loss; set loss_chunk_tokens=0 "
                "with pp > 1, or train with pp=1"
            )
        if self.model is None:
            self.model = Llama(self.config, init_seed=self.hparams.init_seed)

    def forward(self, batch: dict[str, Any]) -> torch.Tensor:
        """Logits [B, S, V] of a packed batch (``input_ids`` and optional ``position_ids``/``cu_seqlens``)."""
        if self.model is None:
            self.configure_model()
        return self.model(
            batch["input_ids"], batch.get("position_ids"), batch.get("cu_seqlens"), batch.get("max_seqlen")
        )

    def loss(self, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean next-token loss, counted targets) of a packed batch; see :func:`next_token_loss`.

        With ``loss_chunk_tokens`` the model runs without its head and
        :func:`~lightning_v17.models.tiled.tiled_next_token_loss` applies it chunk by chunk: the same pair.
        """
        chunk = self.hparams.get("loss_chunk_tokens", 0)
        if not chunk:
            return next_token_loss(self(batch), batch["labels"], batch.get("loss_mask"))
        if self.model is None:
            self.configure_model()
        root = fsdp_root(self)
        if root is not None and root is not self.model and isinstance(self.model, FSDPModule):
            raise V17ConfigError(
                f"loss_chunk_tokens={chunk} under ZeRO-3 with manual optimization: the model is then a ZeRO-3 unit of "
                "its own, whose head is gathered only inside the model's forward, while the tiled loss applies the "
                "head after it; use automatic optimization, or loss_chunk_tokens=0"
            )
        with head_detached(self.model) as head:
            hidden = self(batch)
        return tiled_next_token_loss(hidden, head, batch["labels"], batch.get("loss_mask"), chunk_tokens=chunk)

    def _dp_size(self) -> int:
        kwargs = getattr(self.trainer, "distributed_sampler_kwargs", None) or {}
        return int(kwargs.get("num_replicas", 1))

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        loss, _count = self.loss(batch)
        bsz = batch["input_ids"].shape[0]
        # Real (non-pad) input tokens this step, over all data-parallel ranks (ranks' rows are equally full to <1%).
        tokens = float((batch["doc_ids"] >= 0).sum()) if "doc_ids" in batch else float(batch["input_ids"].numel())
        tokens *= self._dp_size()
        now = time.perf_counter()
        self.log("train_loss", loss, prog_bar=True, batch_size=bsz)
        self.log("tokens_per_step", tokens, batch_size=bsz)
        if self._last_step_time is not None:
            self.log("tokens_per_s", tokens / max(now - self._last_step_time, 1e-9), prog_bar=True, batch_size=bsz)
        self._last_step_time = now
        if "doc_ids" in batch:
            pad = float((batch["doc_ids"] < 0).sum()) / batch["doc_ids"].numel()
            self.log("padding_fraction", pad, batch_size=bsz)
        moe = moe_layers(self.model) if self.model is not None else []
        if moe:  # the MoE layers' balance and z-losses of this forward, already times their coefficients
            aux = sum(m.aux_loss for m in moe)
            self.log("train/aux_loss", aux, batch_size=bsz)
            loss = loss + aux
        return loss

    def on_train_epoch_start(self) -> None:
        self._last_step_time = None

    def on_train_start(self) -> None:
        self._bias_step = self.trainer.global_step

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        """Lightning's step, then the MoE layers' expert bias (:meth:`step_expert_biases`), under every strategy."""
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        self.step_expert_biases()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        # Manual optimization steps inside training_step, without optimizer_step above: update once the global step
        # has advanced (not after a batch that only accumulated).
        if not self.automatic_optimization and self.trainer.global_step != self._bias_step:
            self._bias_step = self.trainer.global_step
            self.step_expert_biases()

    def step_expert_biases(self) -> None:
        """DeepSeek-V3's aux-loss-free bias update (§2.1.2) of every MoE layer; called once per optimizer step.

        The load is what the layers counted since the last update: every micro-batch of the step (gradient
        accumulation), summed over the data-parallel ranks (``strategy.mesh.group("dp")`` under V17Strategy, every
        rank under Lightning's ddp, none on one device), so every rank moves its bias the same way. Lightning calls
        it from :meth:`optimizer_step` (manual optimization: from ``on_train_batch_end`` after a step); a subclass
        overriding ``optimizer_step``, ``on_train_start`` or ``on_train_batch_end`` calls ``super()``. A plain
        PyTorch loop calls :func:`lightning_v17.models.update_expert_biases` instead.
        """
        if self.model is None:
            return
        layers = balanced_layers(self.model)
        strategy = self.trainer.strategy
        if not layers:
            return
        step_expert_biases(layers, group=_data_parallel_group(strategy))

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        loss, _ = self.loss(batch)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True, batch_size=batch["input_ids"].shape[0])
        self._last_step_time = None  # validation time is not training throughput
        return loss

    def test_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        """Token-mean loss on a held-out batch, logged as ``test_loss`` (``trainer.test``)."""
        loss, _ = self.loss(batch)
        self.log("test_loss", loss, sync_dist=True, batch_size=batch["input_ids"].shape[0])
        return loss

    def _total_steps(self) -> int:
        if self.hparams.max_steps:
            return int(self.hparams.max_steps)
        if self.trainer.max_steps and self.trainer.max_steps > 0:
            return int(self.trainer.max_steps)
        return int(self.trainer.estimated_stepping_batches)

    def configure_optimizers(self) -> dict[str, Any]:
        if self.model is None:
            self.configure_model()
        decay = [p for p in self.model.parameters() if p.requires_grad and p.ndim >= 2]
        no_decay = [p for p in self.model.parameters() if p.requires_grad and p.ndim < 2]
        optimizer = build_optimizer(
            self.hparams.optimizer,
            [{"params": decay, "weight_decay": self.hparams.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=self.hparams.lr,
            betas=tuple(self.hparams.betas),
            eps=self.hparams.eps,
        )
        warmup, total, floor = self.hparams.warmup_steps, max(self._total_steps(), 1), self.hparams.min_lr_ratio

        def lr_factor(step: int) -> float:
            # Linear warm-up, then cosine decay to min_lr_ratio (Loshchilov & Hutter 2017, SGDR without restarts).
            if step < warmup:
                return (step + 1) / (warmup + 1)
            progress = min((step - warmup) / max(total - warmup, 1), 1.0)
            return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _data_parallel_group(strategy: Any) -> Any:
    """The ranks whose batches differ: the mesh's ``dp`` axis when the strategy has a device mesh (V17Strategy), else
    every rank (Lightning's ddp), else None (one process)."""
    mesh = getattr(strategy, "mesh", None)
    if callable(getattr(mesh, "group", None)):
        return mesh.group("dp")
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.group.WORLD
    return None
