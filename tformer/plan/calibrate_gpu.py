"""``tformer plan --calibrate`` on a CUDA device: the figures the time model divides by, measured on
this GPU in at most ``BUDGET_S`` seconds, written as a profile ``--gpu FILE`` reads.

Measured (CUDA events around each run, the best of a few after a warm-up; the device is this
process's, so best-of, not median):
- the dense GEMM rate by shape: bf16 at a large square (``LARGE``) and a thin shape (``THIN``, a
  few hundred rows: a micro-batch's chunk, a head's rows), which give the bf16 peak and the
  efficiency curve's ``gemm_half`` (solved as the CPU calibration solves it, ``gemm_max`` 1: the
  peak is the measured one); fp32 with TF32 allowed and without, at the large shape, for the
  ``tf32`` and ``fp32`` peaks. fp8 keeps the datasheet's rate (no float8 GEMM is run here);
- SDPA forward + backward in bf16 (``attention_rate``) at each of ``ATTENTION_SEQ`` lengths, head
  dim ``HEAD_DIM``: causal, with a learned additive bias that needs its gradient (T5's relative
  positions: the memory-efficient kernel) and with a plain mask; FLOPs as time.py counts them;
- a misaligned GEMM (``misaligned_gemm``): a linear layer of ``MISALIGNED``'s odd width, its
  three products against the next multiple of 8 (what GPT-2's eager head runs);
- HBM bandwidth: a ``COPY_BYTES`` device-to-device copy, bytes read + written (``hbm_efficiency``
  1: the measured copy is what a pass gets);
- the host's cost per op (``op_overhead``, plan/host.py): a chain of tiny elementwise ops forward
  and backward on the device, synchronised once at the end, so the host's issue rate (dispatch,
  autograd, the launch) sets the time, not the kernels.
One GPU cannot measure NVLink or the network: the links, memory size and fp8 rate are the
datasheet profile's of the card (``datasheet_of``; ``h100-sxm``'s where the name matches none),
as are the FSDP2 and DTensor host costs (orders of magnitude, hardware.py).

The measuring functions are one object (``Measure``) so that a CPU test can hand in fakes and
check what is derived from them; ``CudaMeasure`` is the real one.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Protocol

from ..config import ConfigError
from .calibrate import solve_gemm_half
from .hardware import ATTENTION_MASKS, PROFILES, Hardware, save_profile

BUDGET_S = 120.0  # the bound on a GPU calibration
LARGE = (8192, 8192, 8192)  # the shape NVIDIA and hardware.py quote a card's GEMM rate at
THIN = (256, 8192, 8192)  # 256 rows: two of cuBLAS's 128-row tiles, where the curve bends
ATTENTION_SEQ = (512, 1024, 2048, 4096)
HEAD_DIM = 64  # the presets' head width (GPT-2, BERT, T5, Llama-3.2-1B)
ATTENTION_TOKENS = 16384  # batch x sequence of each SDPA run: enough blocks to fill the GPU
COPY_BYTES = 2**30
MISALIGNED = (16384, 50257, 768)  # a GPT-2 head's micro-batch rows, vocabulary and width
HOST_OPS = 400


class Measure(Protocol):
    def gemm(self, m: int, n: int, k: int, dtype: str) -> float: ...  # FLOP/s; dtype bf16 | tf32 | fp32

    def attention(self, seq: int, mask: str) -> float: ...  # FLOP/s of forward + backward, time.py's count

    def bandwidth(self, nbytes: int) -> float: ...  # bytes/s read + written by a copy

    def misaligned(self) -> float: ...  # a misaligned bf16 GEMM's rate over the aligned one's

    def op_overhead(self) -> float: ...  # host seconds per aten op

    def name(self) -> str: ...


def datasheet_of(name: str) -> Hardware:
    """The datasheet profile of the card called ``name`` (torch.cuda.get_device_name): its links,
    memory and fp8 rate, which one GPU cannot measure."""
    return PROFILES[datasheet_name(name) or "h100-sxm"]


# (a substring of torch.cuda.get_device_name, lowered; its datasheet profile), the first match wins
CARDS = (("h200", "h200"), ("h100 pcie", "h100-pcie"), ("h100", "h100-sxm"), ("a100", "a100-80gb"), ("b200", "b200"))


def datasheet_name(name: str) -> str | None:
    """The datasheet profile named for the card called ``name``; None for a device without one."""
    lowered = name.lower()
    return next((profile for key, profile in CARDS if key in lowered), None)


def _timed(measure: Measure, started: float, what: str):
    """Raise one line when the budget is spent before ``what``."""
    if time.perf_counter() - started > BUDGET_S:
        raise ConfigError(f"GPU calibration ran past its {BUDGET_S:.0f} s budget before {what}; run it on an idle GPU")


def calibrate_gpu(path: str | Path, measure: Measure | None = None) -> Hardware:
    """Measure this GPU (module doc), write the profile to ``path`` and return it."""
    measure = measure or CudaMeasure()
    started = time.perf_counter()
    base = datasheet_of(measure.name())
    large = measure.gemm(*LARGE, "bf16")
    thin = measure.gemm(*THIN, "bf16")
    half = solve_gemm_half(LARGE, THIN, thin / large)

    def peak_of(rate: float) -> float:  # the rate the curve's limit reaches, from the large shape's
        for x in LARGE:
            rate /= x / (x + half)
        return rate

    _timed(measure, started, "the fp32 GEMMs")
    peak = dict(base.peak)
    peak["bf16"] = peak["fp16"] = peak_of(large)
    peak["tf32"] = peak_of(measure.gemm(*LARGE, "tf32"))
    peak["fp32"] = peak_of(measure.gemm(*LARGE, "fp32"))
    rows = []
    for seq in ATTENTION_SEQ:
        _timed(measure, started, f"SDPA at {seq} tokens")
        for mask in ATTENTION_MASKS:
            rows.append((float(seq), float(ATTENTION_MASKS.index(mask)), measure.attention(seq, mask)))
    _timed(measure, started, "the misaligned GEMM")
    misaligned = measure.misaligned()
    _timed(measure, started, "the copy")
    bandwidth = measure.bandwidth(COPY_BYTES)
    hw = dataclasses.replace(
        base,
        name=f"{measure.name()} (calibrated)",
        peak=peak,
        hbm_bandwidth=bandwidth,
        gemm_half=half,
        gemm_max=1.0,
        hbm_efficiency=1.0,
        op_overhead=measure.op_overhead(),
        attention_rate=tuple(rows),
        misaligned_gemm=misaligned,
        source=f"tformer plan --calibrate on {measure.name()}, {time.strftime('%Y-%m-%d')}; links, memory, "
        f"fp8 and the FSDP2/DTensor host costs from the {base.name} datasheet profile",
    ).check()
    save_profile(hw, path)
    return hw


class CudaMeasure:
    """The measurements on ``torch.cuda`` device 0 (module doc)."""

    def __init__(self, repeats: int = 5):
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("no CUDA device: GPU calibration needs one (on a CPU, --calibrate measures the CPU)")
        self.torch, self.repeats, self.device = torch, repeats, torch.device("cuda")

    def name(self) -> str:
        return self.torch.cuda.get_device_name(self.device)

    def _seconds(self, fn) -> float:
        torch = self.torch
        fn()
        best = float("inf")
        for _ in range(self.repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        return best

    def gemm(self, m: int, n: int, k: int, dtype: str) -> float:
        torch = self.torch
        kind = torch.bfloat16 if dtype == "bf16" else torch.float32
        a = torch.randn(m, k, device=self.device, dtype=kind)
        b = torch.randn(k, n, device=self.device, dtype=kind)
        before = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
        try:
            return 2 * m * n * k / self._seconds(lambda: torch.mm(a, b))
        finally:
            torch.backends.cuda.matmul.allow_tf32 = before

    def attention(self, seq: int, mask: str) -> float:
        torch = self.torch
        import torch.nn.functional as F

        heads = 16
        batch = max(1, ATTENTION_TOKENS // seq)
        shape = (batch, heads, seq, HEAD_DIM)
        q, k, v = (torch.randn(shape, device=self.device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        kwargs: dict = {"is_causal": True}
        if mask == "bias":  # T5's relative bias: one per head, broadcast over the batch, with its gradient
            kwargs = {
                "attn_mask": torch.randn(1, heads, seq, seq, device=self.device, dtype=torch.bfloat16, requires_grad=True)
            }
        elif mask == "plain":
            kwargs = {"attn_mask": torch.zeros(batch, 1, seq, seq, device=self.device, dtype=torch.bfloat16)}
        grad = torch.randn(shape, device=self.device, dtype=torch.bfloat16)

        def run():
            F.scaled_dot_product_attention(q, k, v, **kwargs).backward(grad)

        executed = 2 * 2 * batch * heads * seq * seq * HEAD_DIM * (0.5 if mask == "causal" else 1.0)
        return 3.5 * executed / self._seconds(run)

    def misaligned(self) -> float:
        """The three products of a linear layer of ``MISALIGNED`` (an odd output width, as GPT-2's
        head has) over the same of the aligned width beside it, in bf16."""
        torch = self.torch
        m, n, k = MISALIGNED

        def seconds(width: int) -> float:
            x = torch.randn(m, k, device=self.device, dtype=torch.bfloat16)
            w = torch.randn(width, k, device=self.device, dtype=torch.bfloat16)
            dy = torch.randn(m, width, device=self.device, dtype=torch.bfloat16)
            products = (lambda: x @ w.t(), lambda: dy @ w, lambda: dy.t() @ x)
            return sum(self._seconds(p) for p in products)

        aligned = -(-n // 8) * 8
        return seconds(aligned) / seconds(n) * n / aligned

    def bandwidth(self, nbytes: int) -> float:
        src = self.torch.empty(nbytes, dtype=self.torch.uint8, device=self.device)
        dst = self.torch.empty_like(src)
        return 2 * nbytes / self._seconds(lambda: dst.copy_(src))

    def op_overhead(self) -> float:
        torch = self.torch
        x = torch.ones(4, device=self.device, requires_grad=True)

        def run():
            y = x
            for _ in range(HOST_OPS):
                y = y * 1.0
            y.sum().backward()
            torch.cuda.synchronize()

        run()
        best = float("inf")
        for _ in range(self.repeats):
            t0 = time.perf_counter()
            run()
            best = min(best, time.perf_counter() - t0)
        return best / (2 * HOST_OPS)  # each op once forward, once backward
