"""The planner's inputs: what is trained (:class:`ModelSpec`), where (:class:`ClusterSpec`) and how
(:class:`TrainSpec`). Torch-free; the CLI maps flags onto them and :func:`~lightning_v17.planner.plan.make_plan`
resolves what they leave unset.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from lightning_v17.config import (
    CPMode,
    FP8Recipe,
    OptimizerKind,
    Precision,
    Recompute,
    Schedule,
    Tier,
    V17ConfigError,
    ZeroPolicy,
)
from lightning_v17.planner import capacity
from lightning_v17.planner.hardware import Accelerator, get_accelerator
from lightning_v17.planner.model import ModelShape
from lightning_v17.planner.pipeline import OpTimes


def _positive(name: str, value: Any, *, allow_none: bool = True, kind: type = int) -> None:
    if value is None and allow_none:
        return
    ok = isinstance(value, kind) and not isinstance(value, bool) and value > 0
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
    if not ok:
        raise V17ConfigError(f"{name}={value!r} must be a positive {'integer' if kind is int else 'number'}")


@dataclass(frozen=True)
class ModelSpec:
    """What is trained: a full shape, or only a parameter count (model-state questions).

    Args:
        shape: the model shape (preset or explicit). None when only ``params`` is known.
        params: parameter count, used when ``shape`` is None.
        name: preset name or "custom", for the report.
    """

    shape: ModelShape | None = None
    params: int | None = None
    name: str = "custom"

    def __post_init__(self) -> None:
        if self.shape is None and self.params is None:
            raise V17ConfigError("give a model: --model PRESET, the shape flags (--layers ... --vocab), or --params N")
        _positive("params", self.params)

    @property
    def num_params(self) -> int:
        return self.shape.num_params if self.shape is not None else int(self.params)  # type: ignore[arg-type]


@dataclass(frozen=True)
class ClusterSpec:
    """Where it is trained.

    Args:
        gpu: accelerator name in ``hardware.ACCELERATORS``.
        gpus: world size (None: derived from dp, or one node).
        gpus_per_node: devices per node (None: the accelerator's usual server).
        pcie_gbps: host <-> device bandwidth per rank, GB/s (offload transfers).
        nvme_gbps: NVMe bandwidth per rank, GB/s.
        storage_gbps: checkpoint write bandwidth per node, GB/s.
        node_mtbf_hours: mean time between failures of one node, hours. The default, 6000 h, is what Meta's
            Llama 3 run saw (Dubey 2024 §3.3.4: 419 unexpected interruptions in 54 days on 16,384 GPUs, i.e. one per
            ~50,700 GPU-hours, ~6,300 h per 8-GPU node).
        memory_reserve: fraction of each device's memory the plan leaves free, in [0, 0.9]: what the buckets do not
            count (the CUDA context, NCCL's communication buffers, the caching allocator's fragmentation and
            whatever else a process holds). A plan "fits" when its device bytes stay within the rest
            (:attr:`usable_memory_bytes`). Default 0.1: 8 GB of an 80 GB H100, about what a CUDA context
            (~0.5-1 GB), NCCL buffers (~1-2 GB) and a few percent of fragmentation take. 0 plans to the last byte.
        host_memory_gb: host memory of one node, GB (1e9 bytes), shared by the node's ranks' cpu-tier bytes (and on
            ``cpu``, where the device is the host, by their device bytes too). None: on ``cpu`` this machine's
            memory (``os.sysconf``, /proc/meminfo's MemTotal); else 250 GB per device of the node, the 2 TB of an
            8-GPU DGX H100/H200 or DGX A100 640GB (:data:`~lightning_v17.planner.capacity.SERVER_HOST_BYTES_PER_DEVICE`).
        host_reserve: fraction of the node's host memory the plan leaves free, in [0, 0.9]: what the tiers do not
            count (the operating system, other processes, the page cache that data loading reads through, and each
            rank's Python/torch runtime, about 0.5-1 GB of resident memory per process before its first tensor). A
            plan's host bytes must stay within the rest (:attr:`usable_host_memory_bytes`). Default 0.1: 2.4 GB of a
            24 GB development machine, 200 GB of a 2 TB DGX. 0 plans to the last byte.
        nvme_capacity_gb: NVMe space of one node for the nvme tier, GB, shared by the node's ranks. None: the free
            space at ``nvme_path`` on this machine.
        nvme_path: the directory the nvme tier writes to (``OffloadPolicy``'s NVMe path); its free space is the
            default ``nvme_capacity_gb``. Default: the current directory.
        cpu_cores: on ``cpu``, the cores of one machine its ranks share; a rank computes at the ``cpu`` row's
            one-core peak times ``min(1, cpu_cores / ranks per node)`` (:func:`~lightning_v17.planner.capacity.
            core_share`). None: the cores this process may run on.
        restart_s: seconds from a failure to the first step of the job torchrun restarts, before it reads its
            checkpoint (the planner adds the read): the failure's detection, the new processes' imports and the
            process group. Default 9.0: ``bench/fault.py``'s torchrun restart on a 2-core CPU host (of which 5.2 s
            are imports); measure yours (``python bench/fault.py --scenario side-by-side``).
        replica_drop_s: seconds from a failure to the surviving replica groups' next step
            (``FTPolicy``, torchft). Default 1.1: ``bench/fault.py``'s replica drop on the same host.
        inprocess_restart_s: seconds from a failure to the next step when the surviving processes re-form the
            group with a warm spare and restore from a peer's in-memory snapshot, before the planner adds the
            snapshot's transfer. Default 0.23: ``bench/fault.py``'s in-process restart on the same host. None: that
            path is not reported.
    """

    gpu: str = "h100-80gb"
    gpus: int | None = None
    gpus_per_node: int | None = None
    pcie_gbps: float = 25.0
    nvme_gbps: float = 3.0
    storage_gbps: float = 5.0
    node_mtbf_hours: float = 6000.0
    memory_reserve: float = 0.1
    host_memory_gb: float | None = None
    host_reserve: float = 0.1
    nvme_capacity_gb: float | None = None
    nvme_path: str = "."
    cpu_cores: int | None = None
    restart_s: float = 9.0
    replica_drop_s: float = 1.1
    inprocess_restart_s: float | None = 0.23

    def __post_init__(self) -> None:
        _positive("host_memory_gb", self.host_memory_gb, kind=float)
        _positive("nvme_capacity_gb", self.nvme_capacity_gb, kind=float)
        if self.nvme_capacity_gb is None and not os.path.isdir(self.nvme_path):
            raise V17ConfigError(f"nvme_path={self.nvme_path!r} is not a directory: give the directory on the NVMe "
                                 "drive the nvme tier writes to (--nvme-path), or its size (--nvme-capacity GB)")
        if not (isinstance(self.memory_reserve, (int, float)) and 0 <= self.memory_reserve <= 0.9):
            raise V17ConfigError(f"memory_reserve={self.memory_reserve!r} must be a fraction in [0, 0.9]")
        if not (isinstance(self.host_reserve, (int, float)) and 0 <= self.host_reserve <= 0.9):
            raise V17ConfigError(f"host_reserve={self.host_reserve!r} must be a fraction in [0, 0.9]")
        get_accelerator(self.gpu)
        _positive("gpus", self.gpus)
        _positive("gpus_per_node", self.gpus_per_node)
        _positive("cpu_cores", self.cpu_cores)
        for name in ("pcie_gbps", "nvme_gbps", "storage_gbps", "node_mtbf_hours", "restart_s", "replica_drop_s"):
            _positive(name, getattr(self, name), allow_none=False, kind=float)
        _positive("inprocess_restart_s", self.inprocess_restart_s, kind=float)

    @property
    def accelerator(self) -> Accelerator:
        return get_accelerator(self.gpu)

    @property
    def usable_memory_bytes(self) -> int:
        """Device bytes a plan may use: the accelerator's memory less ``memory_reserve``."""
        return int(self.accelerator.memory_bytes * (1.0 - self.memory_reserve))

    @property
    def host_memory_bytes(self) -> int:
        """Host memory of one node (``host_memory_gb``, or its default: see the class docstring)."""
        if self.host_memory_gb is not None:
            return int(self.host_memory_gb * 1e9)
        if self.accelerator.name == "cpu":
            return capacity.machine_memory_bytes()
        return capacity.SERVER_HOST_BYTES_PER_DEVICE * (self.gpus_per_node or self.accelerator.gpus_per_node)

    @property
    def usable_host_memory_bytes(self) -> int:
        """Host bytes a plan may use on one node: :attr:`host_memory_bytes` less ``host_reserve``."""
        return int(self.host_memory_bytes * (1.0 - self.host_reserve))

    @property
    def host_memory_source(self) -> str:
        """Where :attr:`usable_host_memory_bytes` comes from, for the report."""
        if self.host_memory_gb is not None:
            where = "--host-memory"
        elif self.accelerator.name == "cpu":
            where = "this machine's memory"
        else:
            where = "default: a DGX's 250 GB per device; --host-memory"
        return f"{where}, less a {self.host_reserve:.0%} reserve" if self.host_reserve else where

    @property
    def nvme_capacity_bytes(self) -> int:
        """NVMe space of one node (``nvme_capacity_gb``, or the free space at ``nvme_path``)."""
        if self.nvme_capacity_gb is not None:
            return int(self.nvme_capacity_gb * 1e9)
        return capacity.free_disk_bytes(self.nvme_path)

    @property
    def nvme_capacity_source(self) -> str:
        """Where :attr:`nvme_capacity_bytes` comes from, for the report."""
        if self.nvme_capacity_gb is not None:
            return "--nvme-capacity"
        return f"free at {os.path.abspath(self.nvme_path)}"


@dataclass(frozen=True)
class TrainSpec:
    """How it is trained. ``None`` means "let the planner choose" (decision tree, or the cheapest fit).

    Args:
        tp, pp, dp, cp: mesh sizes.
        sp: sequence parallelism (None: on whenever tp > 1).
        zero: the ZeRO policy (``v17 plan --zero-stage N`` is ``ZeroPolicy(stage=N)``).
        optimizer: optimizer kind.
        precision: training precision.
        micro_batch: samples per micro-batch (b).
        seq: training sequence length (None: the shape's ``seq``; 2048 with ``params`` only).
        global_batch: samples per optimizer step, all replicas (G = dp·b·m).
        microbatches: micro-batches per step per replica (m).
        recompute: none/selective/full (None: the cheapest that fits).
        schedule: pipeline schedule.
        virtual_stages: model chunks per rank for interleaved/zero-bubble schedules.
        offload_optimizer, offload_params: tiers.
        offload_activations: where the blocks' saved activations go between forward and backward
            (``OffloadPolicy.activations``): "none", "cpu" (pinned host memory over PCIe) or "nvme"; the plan counts
            what leaves the device and whether the transfers hide behind each block's compute
            (:func:`~lightning_v17.planner.offload.activation_offload`).
        resident_blocks: the last blocks that keep their saved activations (``OffloadPolicy.resident_blocks``).
        fp8: the strategy's ``fp8`` recipe ("tensorwise", "rowwise", "delayed"; None: off, or "tensorwise" when
            ``precision`` is "fp8"). It changes the saved activations (``delayed`` keeps float8 casts,
            :func:`~lightning_v17.planner.memory.fp8_activation_delta_bytes_per_layer`) and, at ZeRO-3 with
            ``tensorwise``, the all-gathered unit (its Linear weights travel in float8, 1 B each).
        mfu: assumed MFU without bubble and recomputation, for the step-time estimate.
        checkpoint_write_s: seconds to write a checkpoint (None: model state / storage bandwidth).
        op_times: T_F, T_B, T_W of one micro-batch on one stage, with their coefficients of variation, for the
            pipeline bubble simulation (``planner.pipeline.bubble_fraction``); None: the FLOP split
            T_F = T_B = T_W and no jitter. Any unit; only the ratios and ``p2p_time`` relative to them matter.
        p2p_time: one activation/gradient transfer between pipeline ranks, in the unit of ``op_times``.
        dp_replicate: replicated data-parallel groups (HSDP: ZeRO shards over ``dp / dp_replicate`` ranks and the
            replicas all-reduce the gradient shards; ``V17Strategy(dp_replicate=...)``); None: 1.
        ep: expert-parallel size of a MoE shape, folded out of ``dp`` (which it must divide, as must the experts);
            None: the decision tree's when it recommends expert parallelism and the layout is data-parallel only,
            else 1.
        cp_mode: the attention scheme under cp > 1 (``CPPolicy.mode``): "ulysses", "allgather" or "auto" (the one
            that sends fewer elements where the heads allow it, ``planner.comm.choose_cp_mode``).
    """

    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    cp: int | None = None
    sp: bool | None = None
    zero: ZeroPolicy | None = None
    optimizer: OptimizerKind = OptimizerKind.ADAMW
    precision: Precision = Precision.BF16_MIXED
    micro_batch: int = 1
    seq: int | None = None
    global_batch: int | None = None
    microbatches: int | None = None
    recompute: Recompute | None = None
    schedule: Schedule | None = None
    virtual_stages: int | None = None
    offload_optimizer: Tier = Tier.NONE
    offload_params: Tier = Tier.NONE
    offload_activations: Tier = Tier.NONE
    resident_blocks: int = 1
    fp8: FP8Recipe | None = None
    mfu: float = 0.5
    checkpoint_write_s: float | None = None
    op_times: OpTimes | None = None
    p2p_time: float = 0.0
    ep: int | None = None
    dp_replicate: int | None = None
    cp_mode: CPMode = CPMode.AUTO

    def __post_init__(self) -> None:
        object.__setattr__(self, "cp_mode", CPMode.parse(self.cp_mode, "TrainSpec(cp_mode=...)"))
        if self.p2p_time < 0:
            raise ValueError(f"p2p_time={self.p2p_time} must be >= 0")
        object.__setattr__(self, "optimizer", OptimizerKind.parse(self.optimizer))
        object.__setattr__(self, "precision", Precision.parse(self.precision))
        if self.fp8 is not None:
            try:
                object.__setattr__(self, "fp8", FP8Recipe(self.fp8))
            except ValueError:
                raise V17ConfigError(
                    f"fp8={self.fp8!r}; choose one of {[r.value for r in FP8Recipe]} (or leave it unset)"
                ) from None
        elif self.precision == Precision.FP8:
            object.__setattr__(self, "fp8", FP8Recipe.TENSORWISE)  # what an fp8 run of V17Strategy uses
        if self.recompute is not None:
            object.__setattr__(self, "recompute", Recompute.parse(self.recompute, "recompute"))
        if self.schedule is not None:
            object.__setattr__(self, "schedule", Schedule.parse(self.schedule, "schedule"))
        for name in ("offload_optimizer", "offload_params", "offload_activations"):  # TrainSpec's own, flat, fields
            object.__setattr__(self, name, Tier.parse(getattr(self, name), f"TrainSpec({name}=...)"))
        if isinstance(self.resident_blocks, bool) or not isinstance(self.resident_blocks, int) or self.resident_blocks < 0:
            raise V17ConfigError(f"resident_blocks={self.resident_blocks!r} must be an integer >= 0")
        for name in ("tp", "pp", "dp", "cp", "seq", "global_batch", "microbatches", "virtual_stages", "ep",
                     "dp_replicate"):
            _positive(name, getattr(self, name))
        _positive("micro_batch", self.micro_batch, allow_none=False)
        if not 0 < self.mfu <= 1:
            raise V17ConfigError(f"mfu={self.mfu!r} must be in (0, 1]")
        _positive("checkpoint_write_s", self.checkpoint_write_s, kind=float)


__all__ = ["ClusterSpec", "ModelSpec", "TrainSpec"]
