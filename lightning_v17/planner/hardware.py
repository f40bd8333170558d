"""The accelerator table: memory, peak FLOP/s and link bandwidths per device.

Torch-free. ``peak_flops`` is the dense 16-bit tensor-core peak (what MFU is measured against, as in PaLM App. B and
nanoGPT's ``estimate_mfu``); the ``cpu`` row is one core of this project's machines in fp32 instead (see below).
Memory is given in GB = 1e9 bytes, the vendors' unit, which also leaves headroom: an "80GB" H100 reports 85.0e9
bytes to CUDA, and the difference covers the CUDA context, NCCL buffers and allocator fragmentation.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_v17.config import Precision, V17ConfigError

GB = 1e9


@dataclass(frozen=True)
class Accelerator:
    """One device model.

    Args:
        name: table key, e.g. "h100-80gb".
        memory_bytes: device memory budget in bytes.
        peak_flops: dense bf16/fp16 tensor-core peak in FLOP/s (fp32 for ``cpu``).
        peak_flops_fp8: dense fp8 peak in FLOP/s (0 where the device has no fp8 units).
        intra_node_bytes_per_s: per-device, per-direction bandwidth inside a node (NVLink), bytes/s.
        inter_node_bytes_per_s: per-device, per-direction network bandwidth between nodes, bytes/s.
        nvlink: whether devices inside a node share a fast switched fabric (the decision tree asks this).
        gpus_per_node: devices per node in the usual server (DGX/HGX: 8).
    """

    name: str
    memory_bytes: int
    peak_flops: float
    peak_flops_fp8: float
    intra_node_bytes_per_s: float
    inter_node_bytes_per_s: float
    nvlink: bool
    gpus_per_node: int

    def peak_flops_for(self, precision: Precision) -> float:
        """Peak FLOP/s that ``precision``'s matmuls can reach on this device.

        16-bit modes use :attr:`peak_flops`; fp8 uses the fp8 peak where the device has fp8 units; fp32 on a GPU
        runs on TF32 tensor cores at half the 16-bit peak (A100/H100 datasheets: 156 vs 312, 494.7 vs 989.4
        TFLOP/s). The ``cpu`` row is already an fp32 figure and is used for every precision (conservative).
        """
        precision = Precision.parse(precision)
        if self.name == "cpu":
            return self.peak_flops
        if precision == Precision.FP8 and self.peak_flops_fp8 > 0:
            return self.peak_flops_fp8
        if precision == Precision.FP32:
            return self.peak_flops / 2
        return self.peak_flops


#: Vendor datasheet numbers (dense, no sparsity). NVLink per direction = half the quoted bidirectional figure;
#: network = one 400 Gb/s (H100/H200), 200 Gb/s (A100) or 100 Gb/s (V100) NIC per GPU.
ACCELERATORS: dict[str, Accelerator] = {
    # H100 SXM5: 989.4 TFLOP/s bf16 dense, 1978.9 fp8; NVLink4 900 GB/s bidirectional.
    "h100-80gb": Accelerator("h100-80gb", int(80 * GB), 989.4e12, 1978.9e12, 450e9, 50e9, True, 8),
    # H200 SXM: same compute as H100, 141 GB HBM3e.
    "h200-141gb": Accelerator("h200-141gb", int(141 * GB), 989.4e12, 1978.9e12, 450e9, 50e9, True, 8),
    # A100 SXM4: 312 TFLOP/s bf16 dense, no fp8; NVLink3 600 GB/s bidirectional.
    "a100-80gb": Accelerator("a100-80gb", int(80 * GB), 312e12, 0.0, 300e9, 25e9, True, 8),
    "a100-40gb": Accelerator("a100-40gb", int(40 * GB), 312e12, 0.0, 300e9, 25e9, True, 8),
    # V100 SXM2: 125 TFLOP/s fp16 tensor core (no bf16); NVLink2 300 GB/s bidirectional.
    "v100-32gb": Accelerator("v100-32gb", int(32 * GB), 125e12, 0.0, 150e9, 12.5e9, True, 8),
    # One CPU core as one rank (the tests run one thread per rank). DESIGN.md measured fp32 GEMM at about
    # 105-110 GFLOP/s per core on this project's AMD EPYC machines; we take the low end, 105e9. Memory: the 24 GiB
    # of the development machine, shared by all ranks on it. No NVLink: ranks talk through shared memory/loopback.
    "cpu": Accelerator("cpu", 24 * 2**30, 105e9, 0.0, 5e9, 1.25e9, False, 2),
}


def get_accelerator(name: str) -> Accelerator:
    """Return the accelerator called ``name``.

    Raises:
        V17ConfigError: naming the unknown accelerator and listing the known ones.
    """
    key = str(name).strip().lower()
    if key not in ACCELERATORS:
        raise V17ConfigError(f"unknown accelerator {name!r} for --gpu; choose one of {', '.join(ACCELERATORS)}")
    return ACCELERATORS[key]


__all__ = ["ACCELERATORS", "GB", "Accelerator", "get_accelerator"]
