"""Precision (design §2, §13): gradient clipping over shards (``clip``), the fp16 loss scaler over every shard
(``loss_scale``) and the dtypes a mixed precision asks of FSDP2 and the reductions (``dtypes``)."""

from lightning_v17.engine.precision.clip import clip_grad_norm_, global_grad_norm
from lightning_v17.engine.precision.dtypes import mixed_precision_dtypes
from lightning_v17.engine.precision.loss_scale import ShardedLossScaler, optimizer_grads

__all__ = ["ShardedLossScaler", "clip_grad_norm_", "global_grad_norm", "mixed_precision_dtypes", "optimizer_grads"]
