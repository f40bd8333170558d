"""The option enums (parsed once at the boundary, so no code deep inside dispatches on free strings)."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from lightning_v17.config.errors import V17ConfigError, parse_enum, spell


class Axis(StrEnum):
    """Device-mesh axes, outermost first (design §9.8: pp outermost, tp innermost on the fastest fabric)."""

    PP = "pp"
    DP_REPLICATE = "dp_replicate"
    DP_SHARD = "dp_shard"
    CP = "cp"
    TP = "tp"


class Recompute(StrEnum):
    """Activation checkpointing mode of the repeated blocks (``V17Strategy(activation_checkpointing=...)``): "none",
    "selective" (save the matmul outputs, recompute the rest; Korthikanti 2022 §4) or "full" (keep each block's
    input, recompute the block). A model without repeated blocks is refused unless ``ZeroPolicy.wrap_classes`` names
    them."""

    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"

    @classmethod
    def parse(cls, value: Any, option: str = "activation_checkpointing") -> Recompute:
        if value is None or value is False:
            return cls.NONE
        if value is True:
            return cls.FULL
        return parse_enum(cls, value, option=option)  # type: ignore[return-value]


class Dispatcher(StrEnum):
    """How a MoE layer's token assignments reach the ranks of their experts under ep > 1 (``EPPolicy.dispatcher``)."""

    ALLTOALL = "alltoall"
    ALLGATHER = "allgather"

    @classmethod
    def parse(cls, value: Any, option: str = "EPPolicy(dispatcher=...)") -> Dispatcher:
        return parse_enum(cls, value, option=option)  # type: ignore[return-value]


class CPMode(StrEnum):
    """The attention scheme under cp > 1 (``CPPolicy.mode``); ``auto`` takes the one that sends fewer elements."""

    AUTO = "auto"
    ULYSSES = "ulysses"
    ALLGATHER = "allgather"

    @classmethod
    def parse(cls, value: Any, option: str = "CPPolicy(mode=...)") -> CPMode:
        if isinstance(value, str) and value.strip().lower() == "ring":
            raise V17ConfigError(f"{spell(option, 'ring')} (ring attention) is not built; use 'ulysses' or 'allgather'")
        return parse_enum(cls, value, option=option)  # type: ignore[return-value]


class CPBalance(StrEnum):
    """How a row's chunks are assigned to the cp ranks (``CPPolicy.balance``)."""

    NONE = "none"
    HEAD_TAIL = "head_tail"
    PACKED = "packed"

    @classmethod
    def parse(cls, value: Any, option: str = "CPPolicy(balance=...)") -> CPBalance:
        return parse_enum(cls, value, option=option)  # type: ignore[return-value]


class Schedule(StrEnum):
    """Pipeline schedules (design §10)."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved_1f1b"
    # Names follow the papers (Qi 2023): "zero_bubble" is torch's ScheduleInterleavedZeroBubble (ZB-1P on looped
    # chunks), "zb_h1"/"zb_h2" are the handcrafted one-stage-per-rank schedules of Qi 2023 §3.1/§3.2, "zbv" §6.
    ZERO_BUBBLE = "zero_bubble"
    ZB_H1 = "zb_h1"
    ZB_H2 = "zb_h2"
    ZBV = "zbv"

    @classmethod
    def parse(cls, value: Any, option: str = "PipelinePolicy(schedule=...)") -> Schedule:
        aliases = {"interleaved": cls.INTERLEAVED_1F1B, "interleaved_zero_bubble": cls.ZERO_BUBBLE}
        if isinstance(value, str) and value.strip().lower() in aliases:
            return aliases[value.strip().lower()]
        return parse_enum(cls, value, option=option)  # type: ignore[return-value]


class Tier(StrEnum):
    """Where a bucket of model state lives (design §4, ZeRO-Infinity tiers)."""

    NONE = "none"  # stays on the accelerator
    CPU = "cpu"
    NVME = "nvme"

    @classmethod
    def parse(cls, value: Any, option: str = "OffloadPolicy(<tier>=...)") -> Tier:
        if value is None or value is False:
            return cls.NONE
        return parse_enum(cls, value, option=option)  # type: ignore[return-value]


class HostMemory(StrEnum):
    """How an nvme offload tier sets glibc's malloc (``OffloadPolicy.host_memory``)."""

    RETURN = "return"  # mmap threshold 1 MiB for the whole process: freed host memory leaves the RSS
    #: 1 MiB only where the tier's own allocations happen and (ZeRO-3) in backward and FSDP2's all-gathers; the heap
    #: recycles the rest (forward's activations, the step)
    RECYCLE = "recycle"  # the default (``host_memory=None``), with the parameters on the nvme tier too


class Precision(StrEnum):
    """Training precision, in Lightning's spelling where Lightning has one."""

    FP32 = "32-true"
    BF16_MIXED = "bf16-mixed"
    FP16_MIXED = "16-mixed"
    BF16_TRUE = "bf16-true"
    FP8 = "fp8"  # fp8 matmuls, bf16 elsewhere, fp32 master weights

    @classmethod
    def parse(cls, value: Any, option: str = "precision") -> Precision:
        aliases = {
            "32": cls.FP32, "fp32": cls.FP32, "32-true": cls.FP32,
            "bf16": cls.BF16_MIXED, "bf16-mixed": cls.BF16_MIXED,
            "16": cls.FP16_MIXED, "fp16": cls.FP16_MIXED, "16-mixed": cls.FP16_MIXED, "fp16-mixed": cls.FP16_MIXED,
            "bf16-true": cls.BF16_TRUE, "fp8": cls.FP8, "fp8-mixed": cls.FP8,
        }  # fmt: skip
        if isinstance(value, cls):
            return value
        key = str(value).strip().lower()
        if key in aliases:
            return aliases[key]
        raise V17ConfigError(f"precision={value!r} is not supported; choose one of {sorted(set(aliases))}")

    @classmethod
    def lookup(cls, value: Any) -> Precision | None:
        """:meth:`parse`, or None for a precision without a member here (Lightning's "64-true", "16-true",
        "transformer-engine"): what a precision plugin reports is read with this."""
        try:
            return cls.parse(value)
        except V17ConfigError:
            return None

    # What each precision stores and computes in, answered once (the planner's buckets, FSDP2's mixed-precision
    # dtypes, the throughput monitor's peak). Source: ZeRO (Rajbhandari 2020) §3.1; Micikevicius 2018 §3.
    @property
    def param_bytes(self) -> float:
        """Bytes of the working copy of one parameter: 4 in fp32, 2 in every 16-bit or fp8 mode (ZeRO §3.1, "2Ψ
        bytes for fp16 parameters"; fp8 training keeps bf16 weights and casts them per matmul)."""
        return 4.0 if self is Precision.FP32 else 2.0

    @property
    def grad_bytes(self) -> float:
        """Bytes of one parameter's gradient: 4 in fp32, 2 otherwise (ZeRO §3.1)."""
        return 4.0 if self is Precision.FP32 else 2.0

    @property
    def activation_bytes(self) -> int:
        """Bytes of an activation element: 4 in fp32, 2 otherwise (16-bit activations, Korthikanti 2022 §4.1)."""
        return 4 if self is Precision.FP32 else 2

    @property
    def compute_dtype(self) -> str:
        """The ``torch`` dtype name the matmuls run in: "float32", "float16" for fp16, else "bfloat16" (fp8's
        float8 GEMMs aside, it computes in bf16)."""
        return {Precision.FP32: "float32", Precision.FP16_MIXED: "float16"}.get(self, "bfloat16")

    @property
    def has_master(self) -> bool:
        """Whether an fp32 master copy of the parameters exists besides a 16-bit working copy (mixed precision,
        Micikevicius 2018 §3.1): not in fp32 (the parameter is the master) nor in bf16-true (no master)."""
        return self not in (Precision.FP32, Precision.BF16_TRUE)

    @property
    def state_bytes(self) -> float:
        """Bytes per element of the optimizer's states: 4 (fp32), except bf16-true, where they take the parameter
        dtype (2)."""
        return 2.0 if self is Precision.BF16_TRUE else 4.0

    @property
    def needs_scaler(self) -> bool:
        """fp16 needs dynamic loss scaling (its 5-bit exponent underflows small gradients, Micikevicius 2018 §3.2);
        bf16 has fp32's exponent range and fp32 needs none."""
        return self is Precision.FP16_MIXED


class OptimizerKind(StrEnum):
    """Optimizers the factory and the planner know (design §12). K is the optimizer-state bytes per parameter."""

    ADAMW = "adamw"
    ADAM = "adam"
    ADAM8BIT = "adam8bit"
    ADAFACTOR = "adafactor"
    LION = "lion"
    LION8BIT = "lion8bit"
    SGD = "sgd"

    @classmethod
    def parse(cls, value: Any, option: str = "optimizer") -> OptimizerKind:
        return parse_enum(cls, value, option=option)  # type: ignore[return-value]
