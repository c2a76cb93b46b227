"""Throughput, MFU and memory figures."""

from __future__ import annotations

import time

import torch

# Dense peak FLOP/s per GPU (no sparsity) for MFU: (bf16/fp16 tensor core, fp32/tf32), from the
# vendors' datasheets. Matched in order against ``torch.cuda.get_device_name``: the more specific
# name first. An H100 or H200 that names no form factor ("NVIDIA H100 80GB HBM3") is the SXM part.
GPU_PEAKS: tuple[tuple[str, float, float], ...] = (
    ("H100 PCIe", 756e12, 378e12),
    ("H100 NVL", 835e12, 418e12),
    ("H100", 989e12, 494e12),  # SXM5
    ("H200 NVL", 835e12, 418e12),
    ("H200", 989e12, 494e12),  # SXM, and GH200
    ("B200", 2250e12, 1100e12),
    ("A100", 312e12, 156e12),
    ("A10G", 125e12, 62.5e12),
    ("A10", 125e12, 62.5e12),
    ("L40S", 362e12, 181e12),
    ("L4", 121e12, 60e12),
    ("V100", 125e12, 15.7e12),
    ("RTX 4090", 165e12, 82.6e12),
    ("RTX 3090", 71e12, 35.6e12),
)


def gpu_peak(name: str, half: bool) -> tuple[float, str]:
    """(dense peak FLOP/s, its table entry) of the GPU ``name``; NaN for one the table lacks."""
    for key, bf16, fp32 in GPU_PEAKS:
        if key in name:
            return (bf16 if half else fp32), f"table ({key}, {'bf16' if half else 'tf32'} dense)"
    return float("nan"), f"unknown GPU {name!r}: MFU not reported"


_MEASURED: dict[torch.dtype, float] = {}


def measured_matmul_peak(dtype: torch.dtype, size: int = 512, repeats: int = 3) -> float:
    """FLOP/s of a square matmul on this CPU (the best of a few runs, measured once per process):
    the MFU denominator on CPU, where no vendor table applies."""
    if dtype in _MEASURED:
        return _MEASURED[dtype]
    g = torch.Generator().manual_seed(0)  # never the global RNG: a resumed run must not shift it
    a = torch.randn(size, size, generator=g).to(dtype)
    b = torch.randn(size, size, generator=g).to(dtype)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    _MEASURED[dtype] = 2 * size**3 / best
    return _MEASURED[dtype]


def peak_flops(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """(peak FLOP/s per device, where the figure comes from)."""
    if device.type == "cuda":
        return gpu_peak(torch.cuda.get_device_name(device), dtype in (torch.bfloat16, torch.float16))
    if dtype == torch.float32:
        return measured_matmul_peak(dtype), "measured torch.mm on this CPU"
    # A CPU without native bf16 GEMMs (AVX2) runs a bare bf16 torch.mm in a scalar fallback (~1-2
    # GFLOP/s), while autocast's products of small operands take faster paths: against that figure a
    # tiny model's MFU read 1.8-2.6. The peak is the faster of the two measured products.
    return max(measured_matmul_peak(dtype), measured_matmul_peak(torch.float32)), "measured torch.mm on this CPU"
