"""Throughput, MFU and memory figures."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import time
from pathlib import Path

import torch

from ...files import cache_home

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


CPU_PEAKS = "cpu_peak.json"


def _cpu_key(dtype: torch.dtype) -> str:
    """What a CPU matmul peak depends on: the processor, torch's build, the threads, the dtype."""
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    model = model or platform.processor() or platform.machine()
    return f"{model} | torch {torch.__version__} | {torch.get_num_threads()} threads | {str(dtype).removeprefix('torch.')}"


class CpuPeak:
    """The MFU denominator on a CPU: the fastest square matmul this machine has been measured to
    run, at this thread count and dtype, kept in ``$TFORMER_CACHE/cpu_peak.json``.

    A peak timed once at start-up is as low as the machine is busy: beside another process (a
    second replica group, a build) it read half the quiet figure and MFU read 96-127%. Each run
    measures again and the file keeps the best figure ever seen, so a quiet measurement, once
    made, is the figure every later run divides by; a step that runs faster than the known peak
    raises it (``raise_to``), so MFU never exceeds 100%."""

    def __init__(self, dtype: torch.dtype, cache: Path | None = None):
        self.dtype, self.key = dtype, _cpu_key(dtype)
        self.path = cache_home(cache) / CPU_PEAKS
        now = measured_matmul_peak(dtype)
        if dtype != torch.float32:
            # A CPU without native bf16 GEMMs (AVX2) runs a bare bf16 torch.mm in a scalar fallback (~1-2
            # GFLOP/s), while autocast's products of small operands take faster paths: against that figure a
            # tiny model's MFU read 1.8-2.6. The peak is the faster of the two measured products.
            now = max(now, measured_matmul_peak(torch.float32))
        known = self._known().get(self.key, 0.0)
        self.flops = max(now, known)
        if self.flops > known:
            self._keep()

    def _known(self) -> dict:
        try:
            got = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return got if isinstance(got, dict) else {}

    def _keep(self) -> None:
        known = self._known()
        known[self.key] = self.flops
        with contextlib.suppress(OSError):  # a read-only cache still runs; the figure is this run's
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{CPU_PEAKS}.{os.getpid()}")
            tmp.write_text(json.dumps(known, indent=1, sort_keys=True) + "\n")
            os.replace(tmp, self.path)

    def raise_to(self, achieved: float) -> bool:
        """A step ran at ``achieved`` FLOP/s per process: when that beats the known peak, it is the
        new peak (kept for later runs). True when it was raised."""
        if achieved <= self.flops:
            return False
        self.flops = achieved
        self._keep()
        return True

    @property
    def source(self) -> str:
        return f"the best torch.mm measured on this CPU ({self.key}; {self.path})"


def peak_flops(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """(peak FLOP/s per device, where the figure comes from)."""
    if device.type == "cuda":
        return gpu_peak(torch.cuda.get_device_name(device), dtype in (torch.bfloat16, torch.float16))
    peak = CpuPeak(dtype)
    return peak.flops, peak.source


def cpu_peak_at_least(dtype: torch.dtype, achieved: float) -> float:
    """The CPU peak after a step that ran at ``achieved`` FLOP/s: raised to it (and kept) when the
    step beat it, so that MFU stays a fraction of what this CPU can do."""
    peak = CpuPeak(dtype)
    peak.raise_to(achieved)
    return peak.flops
