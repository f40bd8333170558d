"""Precision: gradient clipping over shards (``clip``)."""

from lightning_v17.engine.precision.clip import clip_grad_norm_, global_grad_norm

__all__ = ["clip_grad_norm_", "global_grad_norm"]
