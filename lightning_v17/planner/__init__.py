"""The torch-free planner: per-rank memory, communication, pipeline bubble, FLOPs/MFU and a recommended layout.

One concern per module, every formula a function with its units in its name and its source in its docstring:

- ``model``: :class:`ModelShape`, the presets (the single source of truth for the reference model's sizes).
- ``hardware``: the accelerator table (memory, peak FLOP/s, link bandwidths).
- ``memory``: ZeRO model state (Rajbhandari 2020 §3.1), activations (Korthikanti 2022 Table 2 / Eq. 5), temps.
- ``comm``: bytes per step per collective (ZeRO §7, Narayanan 2021 §3).
- ``pipeline``: bubble fraction per schedule (Narayanan 2021 §2.2, Qi 2023).
- ``throughput``: FLOPs per token/step (Narayanan 2021 Eq. 3, Korthikanti App. A) and the MFU-based step time.
- ``offload``: GPU/CPU/NVMe tiers and transfer time (ZeRO-Offload, ZeRO-Infinity).
- ``resilience``: checkpoint interval (Young 1974, Daly 2006).
- ``moe``: mixture-of-experts arithmetic: expert parallelism, the experts' bytes, token dispatch traffic.
- ``recipes``: the design outline's decision tree and anti-pattern warnings.
- ``search``: every layout the rules accept, kept when it fits every tier, ranked by predicted time.
- ``capacity``: what a node's ranks share (host memory, NVMe, on ``cpu`` its cores).
- ``job``: a ``v17 fit`` YAML (``v17 plan --config``) read into the input dataclasses, without instantiating it.
- ``specs``: the input dataclasses; ``plan``: :func:`make_plan`; ``report``: text and JSON; ``cli``: ``v17 plan``.

Nothing here imports torch (a test checks it), so ``v17 plan`` starts instantly on any machine.
"""

from __future__ import annotations

from lightning_v17.planner.hardware import ACCELERATORS, Accelerator, get_accelerator
from lightning_v17.planner.memory import (
    ModelStateBytes,
    activation_bytes_per_layer,
    model_state_bytes_per_rank,
    optimizer_bytes_per_param,
)
from lightning_v17.planner.model import PRESETS, Arch, ModelShape, get_preset
from lightning_v17.planner.model_search import max_model
from lightning_v17.planner.plan import ClusterSpec, ModelSpec, Plan, TrainSpec, make_plan
from lightning_v17.planner.resilience import daly_interval_s, young_interval_s
from lightning_v17.planner.search import SearchResult
from lightning_v17.planner.throughput import flops_per_token

__all__ = [
    "ACCELERATORS",
    "PRESETS",
    "Accelerator",
    "Arch",
    "ClusterSpec",
    "ModelShape",
    "ModelSpec",
    "ModelStateBytes",
    "Plan",
    "SearchResult",
    "TrainSpec",
    "activation_bytes_per_layer",
    "daly_interval_s",
    "flops_per_token",
    "get_accelerator",
    "get_preset",
    "make_plan",
    "max_model",
    "model_state_bytes_per_rank",
    "optimizer_bytes_per_param",
    "young_interval_s",
]
