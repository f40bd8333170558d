"""Offload tiers (GPU / CPU / NVMe): where each bucket lives and what moves over PCIe and NVMe per step.

Torch-free. Sources: ZeRO-Offload (Ren 2021) §4.1 and ZeRO-Infinity (Rajbhandari 2021) §5; design §4.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lightning_v17.config import Tier, ZeroPolicy
from lightning_v17.planner.memory import zero_of


@dataclass(frozen=True)
class TierBytes:
    """Per-rank bytes resident on each tier."""

    gpu: int
    cpu: int
    nvme: int


def tier_bytes(
    *,
    param_bytes: int,
    grad_bytes: int,
    optimizer_bytes: int,
    activation_bytes: int,
    temp_bytes: int,
    offload_optimizer: Tier = Tier.NONE,
    offload_params: Tier = Tier.NONE,
) -> TierBytes:
    """Split the per-rank buckets over the GPU, CPU and NVMe tiers.

    Source: ZeRO-Offload (Ren 2021) §4.1 / Fig. 2: with the optimizer offloaded, the optimizer state (fp32 master
    included) and the gradients live in CPU memory and the update runs there; ZeRO-Infinity (Rajbhandari 2021) §5:
    the optimizer state can go one tier further, to NVMe (gradients stay in CPU memory), and with ZeRO-3 the
    parameter shards can live on CPU or NVMe too. Activations and temporary buffers (the gathered unit, buckets,
    logits) always stay on the accelerator.
    """
    offload_optimizer = Tier.parse(offload_optimizer, "offload_optimizer")
    offload_params = Tier.parse(offload_params, "offload_params")
    tiers = {Tier.NONE: 0, Tier.CPU: 0, Tier.NVME: 0}
    tiers[offload_params] += param_bytes
    tiers[Tier.CPU if offload_optimizer != Tier.NONE else Tier.NONE] += grad_bytes
    tiers[offload_optimizer] += optimizer_bytes
    tiers[Tier.NONE] += activation_bytes + temp_bytes
    return TierBytes(gpu=tiers[Tier.NONE], cpu=tiers[Tier.CPU], nvme=tiers[Tier.NVME])


@dataclass(frozen=True)
class OffloadTraffic:
    """Per-rank bytes moved per step: over PCIe (accelerator <-> host) and to/from NVMe."""

    pcie_bytes: int
    nvme_bytes: int


def offload_traffic_bytes(
    *,
    optimizer_partition_params: float,
    param_partition_params: float,
    zero: ZeroPolicy | None = None,
    grad_accum_steps: int = 1,
    param_bytes: float = 2.0,
    grad_bytes: float = 2.0,
    optimizer_bytes: float = 12.0,
    offload_optimizer: Tier = Tier.NONE,
    offload_params: Tier = Tier.NONE,
    zero_stage: int | None = None,
) -> OffloadTraffic:
    """Bytes one rank moves per optimizer step because of offloading.

    Source: ZeRO-Offload (Ren 2021) §4.1: each step sends the gradient partition to the CPU and the updated
    16-bit parameters back (2Ψ/N elements); with ZeRO-2/3 and gradient accumulation the partitioned gradients leave
    the GPU every micro-batch. ZeRO-Infinity (Rajbhandari 2021) §5: an NVMe optimizer tier reads and writes the
    whole optimizer state once per step (2·K·Ψ/N bytes); an offloaded ZeRO-3 parameter shard crosses PCIe in
    forward and in backward of every micro-batch, and an NVMe one is also read from and written back to NVMe.

    Args:
        optimizer_partition_params: parameters whose optimizer state this rank owns (Ψ/(tp·pp·dp) for ZeRO >= 1).
        param_partition_params: parameters this rank stores (Ψ/(tp·pp·dp) for ZeRO-3).
        zero: the ZeRO policy (sharded gradients leave every micro-batch; only sharded parameters are offloaded).
        grad_accum_steps: micro-batches per step on this rank.
        param_bytes: bytes per 16-bit (or fp32) parameter.
        grad_bytes: bytes per gradient element.
        optimizer_bytes: K.
        offload_optimizer: tier of the optimizer state.
        offload_params: tier of the parameter shards.
        zero_stage: shortcut for ``zero=ZeroPolicy(stage=zero_stage)``.
    """
    zero = zero_of(zero, zero_stage)
    offload_optimizer = Tier.parse(offload_optimizer, "offload_optimizer")
    offload_params = Tier.parse(offload_params, "offload_params")
    pcie = 0.0
    nvme = 0.0
    if offload_optimizer != Tier.NONE:
        grad_trips = grad_accum_steps if zero.shards_grads else 1
        pcie += optimizer_partition_params * (grad_trips * grad_bytes + param_bytes)
        if offload_optimizer == Tier.NVME:
            nvme += 2 * optimizer_bytes * optimizer_partition_params
    if offload_params != Tier.NONE and zero.shards_params:
        pcie += 2 * grad_accum_steps * param_partition_params * param_bytes
        if offload_params == Tier.NVME:
            nvme += (2 * grad_accum_steps + 1) * param_partition_params * param_bytes
    return OffloadTraffic(pcie_bytes=math.ceil(pcie), nvme_bytes=math.ceil(nvme))


def offload_transfer_s(traffic: OffloadTraffic, *, pcie_bytes_per_s: float, nvme_bytes_per_s: float) -> float:
    """Seconds of offload transfer per step, assuming no overlap with compute (an upper bound).

    Source: ZeRO-Infinity (Rajbhandari 2021) §4 (bandwidth-centric analysis: time = bytes / bandwidth per tier).
    """
    if pcie_bytes_per_s <= 0 or nvme_bytes_per_s <= 0:
        raise ValueError("pcie_bytes_per_s and nvme_bytes_per_s must be > 0")
    return traffic.pcie_bytes / pcie_bytes_per_s + traffic.nvme_bytes / nvme_bytes_per_s


__all__ = ["OffloadTraffic", "TierBytes", "offload_traffic_bytes", "offload_transfer_s", "tier_bytes"]
