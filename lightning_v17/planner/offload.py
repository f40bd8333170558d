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
    offload_activations: Tier = Tier.NONE,
    offloaded_activation_bytes: int = 0,
) -> TierBytes:
    """Split the per-rank buckets over the GPU, CPU and NVMe tiers.

    Source: ZeRO-Offload (Ren 2021) §4.1 / Fig. 2: with the optimizer offloaded, the optimizer state (fp32 master
    included) and the gradients live in CPU memory and the update runs there; ZeRO-Infinity (Rajbhandari 2021) §5:
    the optimizer state can go one tier further, to NVMe (gradients stay in CPU memory), and with ZeRO-3 the
    parameter shards can live on CPU or NVMe too. Temporary buffers (the gathered unit, buckets, logits) and
    ``activation_bytes`` stay on the accelerator; ``offloaded_activation_bytes`` are the saved activations that
    activation offload (:func:`activation_offload_bytes`) keeps on ``offload_activations``.
    """
    offload_optimizer = Tier.parse(offload_optimizer, "tier_bytes(offload_optimizer=...)")
    offload_params = Tier.parse(offload_params, "tier_bytes(offload_params=...)")
    tiers = {Tier.NONE: 0, Tier.CPU: 0, Tier.NVME: 0}
    tiers[offload_params] += param_bytes
    tiers[Tier.CPU if offload_optimizer != Tier.NONE else Tier.NONE] += grad_bytes
    tiers[offload_optimizer] += optimizer_bytes
    offload_activations = Tier.parse(offload_activations, "tier_bytes(offload_activations=...)")
    if offloaded_activation_bytes < 0 or (offloaded_activation_bytes and offload_activations == Tier.NONE):
        raise ValueError("offloaded_activation_bytes must be >= 0, and > 0 only with a tier to go to")
    tiers[Tier.NONE] += activation_bytes + temp_bytes
    tiers[offload_activations] += offloaded_activation_bytes
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
    offload_optimizer = Tier.parse(offload_optimizer, "offload_traffic_bytes(offload_optimizer=...)")
    offload_params = Tier.parse(offload_params, "offload_traffic_bytes(offload_params=...)")
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


@dataclass(frozen=True)
class ActivationOffload:
    """Saved activations of the repeated blocks moved off the device between forward and backward, per rank.

    Args:
        tier: where they go ("cpu": pinned host memory over PCIe; "nvme": files, through host bounce buffers).
        blocks_offloaded: blocks per micro-batch whose saved tensors leave the device (all but the resident ones).
        bytes_per_block: saved bytes of one block and micro-batch (the plan's activations per layer).
        offloaded_bytes: bytes off the device at the end of a micro-batch's forward (``blocks_offloaded`` blocks).
        device_bytes: activation bytes that stay on the device at the peak: the resident blocks plus the one block
            prefetched ahead of backward.
        bandwidth_bytes_per_s: the transfer rate of one block, each way.
        transfer_s_per_block: one block's bytes at that rate (the write in forward; the read in backward takes as long).
        forward_s_per_block, backward_s_per_block: one block's compute per micro-batch, that the transfers hide
            behind.
        exposed_s_per_step: transfer time per step that compute does not hide (0 when both directions hide).
    """

    tier: Tier
    blocks_offloaded: int
    bytes_per_block: int
    offloaded_bytes: int
    device_bytes: int
    bandwidth_bytes_per_s: float
    transfer_s_per_block: float
    forward_s_per_block: float
    backward_s_per_block: float
    exposed_s_per_step: float

    @property
    def hides(self) -> bool:
        return self.exposed_s_per_step == 0.0

    def warning(self) -> str:
        """The plan's warning when the transfers do not hide: the numbers and the fixes."""
        return (
            f"activation offload to {self.tier.value}: one block's {self.bytes_per_block / 1e9:.2f} GB take "
            f"{self.transfer_s_per_block * 1e3:.1f} ms each way at {self.bandwidth_bytes_per_s / 1e9:.0f} GB/s, "
            f"against {self.forward_s_per_block * 1e3:.1f} ms of forward and {self.backward_s_per_block * 1e3:.1f} "
            f"ms of backward: {self.exposed_s_per_step:.2f} s per step do not hide; offload fewer blocks (raise "
            "resident_blocks), use the faster tier, or recompute instead"
        )


def check_activation_offload_plan(tier: Tier, *, pp: int, has_shape: bool) -> None:
    """Refuse what the planner cannot count, naming the option and the fix."""
    from lightning_v17.config import V17ConfigError

    if not has_shape:
        raise V17ConfigError("--offload-activations needs the model's shape (the blocks' activations): give --model "
                             "or the shape flags, or drop --offload-activations")
    tier = Tier.parse(tier, "--offload-activations")
    if pp > 1:
        raise V17ConfigError(f"--offload-activations {tier.value} with pp={pp}: the planner's offload formula counts "
                             "one pass over all the blocks, not each stage's blocks for every micro-batch in flight "
                             f"(V17Strategy trains OffloadPolicy(activations={tier.value!r}) with pp > 1); plan with "
                             "--pp 1 or --offload-activations none")


def activation_offload_bytes(bytes_per_block: int, *, layers: int, resident_blocks: int) -> tuple[int, int]:
    """(offloaded, device) activation bytes per micro-batch when the blocks' saved tensors go to another tier.

    Source: torchtune's ``OffloadActivations`` and Megatron's fine-grained activation offloading: each block's saved
    tensors leave as forward passes it, the last ``resident_blocks`` stay (backward needs them first), and backward
    fetches one block ahead of the block it computes. The device peak is therefore the resident blocks plus one
    block in transit (the last write of forward, the prefetched read of backward): ``min(L, k + 1)`` blocks, and
    ``L - k`` blocks are off the device. Saved tensors under ``activation_min_kb`` stay, which this ignores (the
    small ones: norms' statistics, the router's choices).

    Args:
        bytes_per_block: saved activation bytes of one block and micro-batch.
        layers: blocks held by the rank (L; the whole model at pp = 1).
        resident_blocks: k, the last blocks that are never offloaded.
    """
    if bytes_per_block < 0 or layers < 0 or resident_blocks < 0:
        raise ValueError("bytes_per_block, layers and resident_blocks must be >= 0")
    offloaded_blocks = max(0, layers - resident_blocks)
    if offloaded_blocks == 0:
        return 0, bytes_per_block * layers
    return offloaded_blocks * bytes_per_block, min(layers, resident_blocks + 1) * bytes_per_block


def activation_transfer_bytes_per_s(tier: Tier | str, *, pcie_bytes_per_s: float, nvme_bytes_per_s: float) -> float:
    """The rate one block's saved tensors move at, each way: PCIe for "cpu"; for "nvme" the slower of PCIe and the
    drive, since the bytes go device -> host bounce buffer -> file and back (ZeRO-Infinity (Rajbhandari 2021) §4:
    each tier's time is bytes / its bandwidth; pipelined tiers run at the slowest link)."""
    tier = Tier.parse(tier, "activation_transfer_bytes_per_s(tier=...)")
    if tier == Tier.NONE:
        raise ValueError("activation_transfer_bytes_per_s(tier='none'): the 'none' tier moves nothing")
    if pcie_bytes_per_s <= 0 or nvme_bytes_per_s <= 0:
        raise ValueError("pcie_bytes_per_s and nvme_bytes_per_s must be > 0")
    return pcie_bytes_per_s if tier == Tier.CPU else min(pcie_bytes_per_s, nvme_bytes_per_s)


def activation_offload(
    *,
    tier: Tier | str,
    bytes_per_block: int,
    layers: int,
    resident_blocks: int,
    microbatches: int,
    forward_s_per_block: float,
    backward_s_per_block: float,
    pcie_bytes_per_s: float,
    nvme_bytes_per_s: float,
) -> ActivationOffload:
    """What activation offload keeps off the device and whether its transfers hide behind compute.

    Source: vDNN (Rhu 2016, "vDNN: Virtualized Deep Neural Networks for Scalable, Memory-Efficient Neural Network
    Design"), whose offloads and prefetches of each layer's saved activations overlap the computation of the layers
    around it: a block's write runs beside the next block's forward and its read beside the later block's backward,
    so each hides when it takes no longer than that compute; what does not hide stretches the step, per offloaded
    block and micro-batch: ``max(0, t_xfer - t_fwd) + max(0, t_xfer - t_bwd)`` (bandwidth from
    :func:`activation_transfer_bytes_per_s`, sizes from :func:`activation_offload_bytes`).
    """
    tier = Tier.parse(tier, "activation_offload(tier=...)")
    offloaded, device = activation_offload_bytes(bytes_per_block, layers=layers, resident_blocks=resident_blocks)
    rate = activation_transfer_bytes_per_s(tier, pcie_bytes_per_s=pcie_bytes_per_s, nvme_bytes_per_s=nvme_bytes_per_s)
    xfer = bytes_per_block / rate
    blocks = max(0, layers - resident_blocks)
    exposed = microbatches * blocks * (max(0.0, xfer - forward_s_per_block) + max(0.0, xfer - backward_s_per_block))
    return ActivationOffload(tier=tier, blocks_offloaded=blocks, bytes_per_block=bytes_per_block,
                             offloaded_bytes=offloaded, device_bytes=device, bandwidth_bytes_per_s=rate,
                             transfer_s_per_block=xfer, forward_s_per_block=forward_s_per_block,
                             backward_s_per_block=backward_s_per_block, exposed_s_per_step=exposed)


__all__ = [
    "ActivationOffload",
    "OffloadTraffic",
    "TierBytes",
    "activation_offload",
    "activation_offload_bytes",
    "activation_transfer_bytes_per_s",
    "check_activation_offload_plan",
    "offload_traffic_bytes",
    "offload_transfer_s",
    "tier_bytes",
]
