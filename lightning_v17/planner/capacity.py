"""What one node holds: the ranks of a node share its host memory and its NVMe drive.

Torch-free. The buckets (memory.py) and their tiers (offload.py) are per rank; a node runs several ranks, and the
host memory and the NVMe drive are the node's, not the rank's. A plan fits when, on each node, every tier holds
what all of the node's ranks put there (ZeRO-Infinity (Rajbhandari 2021) §4, Table 2: the memory available to a
node is its GPUs' memory, its CPU memory and its NVMe, each shared by the node's ranks).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lightning_v17.planner.offload import TierBytes

if TYPE_CHECKING:
    from lightning_v17.planner.specs import ClusterSpec

#: Host memory of an 8-GPU server: DGX H100, DGX H200 and DGX A100 (640 GB) ship 2 TB of system memory
#: (NVIDIA's DGX datasheets). A node with another device count gets the same 250 GB per device.
SERVER_HOST_BYTES_PER_DEVICE = 250 * 10**9


def machine_memory_bytes() -> int:
    """This machine's physical memory (``os.sysconf``: pages x page size; /proc/meminfo's MemTotal on Linux)."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):  # no sysconf names: read /proc/meminfo
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
        raise OSError("cannot read this machine's memory; give --host-memory GB") from None


def machine_cores() -> int:
    """The cores this process may run on (``os.sched_getaffinity``; ``os.cpu_count`` where that is missing)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def core_share(cluster: ClusterSpec, gpus: int) -> float:
    """The cores one rank computes with on ``cpu``, as a share of the one core the ``cpu`` row's peak is: the ranks
    of one machine beyond its cores share them, ``min(1, cores / ranks per node)`` (4 ranks on 2 cores: 0.5 each).
    1 on an accelerator, whose ranks each own a device."""
    if cluster.accelerator.name != "cpu":
        return 1.0
    cores = cluster.cpu_cores or machine_cores()
    return min(1.0, cores / ranks_per_node(cluster, gpus))


def free_disk_bytes(path: str) -> int:
    """Free bytes of the file system that holds ``path`` (``shutil.disk_usage``: what an unprivileged user may
    write)."""
    return int(shutil.disk_usage(path).free)


def ranks_per_node(cluster: ClusterSpec, gpus: int) -> int:
    """Ranks that share one node's host memory and NVMe: ``min(gpus, gpus_per_node)``.

    On ``cpu`` every rank of the plan runs on this machine (its memory is the default host memory), unless
    ``gpus_per_node`` says otherwise."""
    if cluster.accelerator.name == "cpu" and cluster.gpus_per_node is None:
        return gpus
    return min(gpus, cluster.gpus_per_node or cluster.accelerator.gpus_per_node)


@dataclass(frozen=True)
class TierCheck:
    """One tier of one node against its capacity.

    Args:
        tier: "device" (per rank: each device has its own memory), "host" or "nvme" (per node).
        ranks: ranks whose bytes share this capacity (1 for "device").
        bytes_per_rank: what one rank puts on the tier (for "host" on ``cpu``: its device and cpu-tier bytes).
        need_bytes: ``ranks x bytes_per_rank``.
        capacity_bytes: what the tier holds (the device's usable memory; the node's host memory; the NVMe space).
        source: where the capacity comes from, in words (e.g. "free at /scratch").
    """

    tier: str
    ranks: int
    bytes_per_rank: int
    need_bytes: int
    capacity_bytes: int
    source: str

    @property
    def fits(self) -> bool:
        return self.need_bytes <= self.capacity_bytes

    def warning(self) -> str:
        """The refusal: the tier, the bytes, the capacity and where it comes from, and the fixes."""
        fix = {
            "host": "give --host-memory, offload to nvme instead of cpu, or more ranks (more nodes)",
            "nvme": "give --nvme-path on a larger drive or --nvme-capacity, offload less, or more nodes",
        }
        return (
            f"{self.tier} does not fit: {self.ranks} rank{'s' * (self.ranks > 1)} per node x "
            f"{self.bytes_per_rank / 1e9:.1f} GB = {self.need_bytes / 1e9:.1f} GB > {self.capacity_bytes / 1e9:.1f}"
            f" GB ({self.source}); {fix.get(self.tier, 'see the device warning')}"
        )

    def to_dict(self) -> dict[str, object]:
        return {
            "ranks": self.ranks,
            "bytes_per_rank": self.bytes_per_rank,
            "need_bytes": self.need_bytes,
            "capacity_bytes": self.capacity_bytes,
            "source": self.source,
            "fits": self.fits,
        }


def capacity_checks(tiers: TierBytes, cluster: ClusterSpec, *, gpus: int) -> tuple[TierCheck, ...]:
    """Device, host and NVMe of one node against what its ranks put there.

    Device: per rank, within ``usable_memory_bytes`` (the reserve kept). Host: the cpu tier of all the node's
    ranks, within ``usable_host_memory_bytes`` (its reserve kept); on ``cpu`` the device is the host too, so each
    rank's device and cpu-tier bytes share it. NVMe: the nvme tier of all the node's ranks.
    """
    n = ranks_per_node(cluster, gpus)
    host_per_rank = tiers.cpu + (tiers.gpu if cluster.accelerator.name == "cpu" else 0)
    usable = cluster.usable_memory_bytes
    return (
        TierCheck("device", 1, tiers.gpu, tiers.gpu, usable, f"{cluster.accelerator.name} less the reserve"),
        TierCheck("host", n, host_per_rank, n * host_per_rank, cluster.usable_host_memory_bytes,
                  cluster.host_memory_source),
        TierCheck("nvme", n, tiers.nvme, n * tiers.nvme, cluster.nvme_capacity_bytes, cluster.nvme_capacity_source),
    )


__all__ = [
    "SERVER_HOST_BYTES_PER_DEVICE",
    "TierCheck",
    "capacity_checks",
    "core_share",
    "free_disk_bytes",
    "machine_cores",
    "machine_memory_bytes",
    "ranks_per_node",
]
