"""Throughput, MFU and memory figures."""

from __future__ import annotations

import time

import torch

# Dense peak FLOP/s per GPU (no sparsity) for MFU: (bf16/fp16 tensor core, fp32/tf32).
GPU_PEAKS = {
    "H100 SXM": (989e12, 494e12),
    "H100": (756e12, 378e12),
    "H200": (989e12, 494e12),
    "A100": (312e12, 156e12),
    "A10G": (125e12, 62.5e12),
    "A10": (125e12, 62.5e12),
    "L40S": (362e12, 181e12),
    "L4": (121e12, 60e12),
    "V100": (125e12, 15.7e12),
    "RTX 4090": (165e12, 82.6e12),
    "RTX 3090": (71e12, 35.6e12),
}


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
        name = torch.cuda.get_device_name(device)
        for key, (half, single) in GPU_PEAKS.items():
            if key in name:
                return (half if dtype in (torch.bfloat16, torch.float16) else single), f"table ({key})"
        return float("nan"), f"unknown GPU {name!r}: MFU not reported"
    return measured_matmul_peak(dtype), "measured torch.mm on this CPU"
