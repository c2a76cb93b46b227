"""``tformer plan --calibrate``: measure this machine's figures and write a CPU profile.

Measured, each the best of a few repeats (the machine may be shared: best, not mean):
- fp32 GEMM FLOP/s at a large and a thin shape; the large one sets the peak, the thin one
  ``gemm_half`` of the time model's efficiency curve (solved from the ratio of the two), so the curve
  is measured once here and not fitted to any run;
- memory bandwidth: a 64 MiB copy, bytes read + written;
- ``op_overhead``: the time of one tiny elementwise op (dispatch, autograd bookkeeping);
- gloo all-reduce between 2 processes on loopback: a 4 KiB message gives the latency per hop, a
  16 MiB one the bandwidth (ring formulas of time.py with n = 2).
Every process this starts has a deadline, after which it is killed and calibration fails.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

from ..config import ConfigError
from .hardware import Hardware, save_profile

DEADLINE_S = 300.0


def _best(fn, repeats: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def gemm_rate(m: int, n: int, k: int) -> float:
    import torch

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
    return 2 * m * n * k / _best(lambda: torch.mm(a, b))


def solve_gemm_half(large: tuple[int, int, int], small: tuple[int, int, int], ratio: float) -> float:
    """The ``h`` with prod(x / (x + h)) over ``small`` / the same over ``large`` = ``ratio`` (the
    measured rate of the small shape over the large one), by bisection."""

    def curve(h: float) -> float:
        out = 1.0
        for s, big in zip(small, large):
            out *= (s / (s + h)) / (big / (big + h))
        return out

    low, high = 0.0, 1e5
    if ratio >= 1:
        return 1e-3  # the thin shape runs as fast: no measurable fall-off
    for _ in range(100):
        mid = (low + high) / 2
        low, high = (mid, high) if curve(mid) > ratio else (low, mid)
    return max(high, 1e-3)


def memory_bandwidth(nbytes: int = 64 * 2**20) -> float:
    import torch

    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    return 2 * nbytes / _best(lambda: dst.copy_(src))


def op_overhead() -> float:
    import torch

    x = torch.ones(4, requires_grad=True)
    ops = 200

    def run():
        y = x
        for _ in range(ops):
            y = y * 1.0
        y.sum().backward()

    return _best(run) / (2 * ops)  # each op once forward, once backward


def _gloo_worker(rank: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    times = {}
    for name, numel in (("small", 1024), ("large", 4 * 2**20)):
        t = torch.ones(numel)
        dist.barrier()
        times[name] = _best(lambda t=t: dist.all_reduce(t), repeats=7)
    if rank == 0:
        Path(out).write_text(f"{times['small']} {times['large']}\n")
    dist.barrier()
    dist.destroy_process_group()


def spawn_with_deadline(fn, args: tuple, nprocs: int, deadline_s: float, what: str) -> None:
    """Run ``fn(rank, *args)`` in ``nprocs`` spawned processes; kill them all and fail after
    ``deadline_s`` seconds."""
    import torch.multiprocessing as mp

    ctx = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + deadline_s
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise ConfigError(f"{what} did not finish in {deadline_s:.0f} s; run it again")


def gloo_link(tmp: Path) -> tuple[float, float]:
    """(latency per hop, bandwidth) of gloo between 2 local processes."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp / "gloo.txt"
    spawn_with_deadline(_gloo_worker, (port, str(out)), 2, DEADLINE_S, "calibration's gloo processes")
    small, large = map(float, out.read_text().split())
    latency = small / 2  # an all-reduce over 2 ranks is 2 ring hops
    bandwidth = 4 * 4 * 2**20 / max(large - small, 1e-9)  # one hop moves half, twice: the whole buffer
    return latency, bandwidth


def calibrate(path: str | Path, tmp: Path) -> Hardware:
    """Measure this machine (module doc), write the profile to ``path`` and return it."""
    threads = int(os.environ.get("OMP_NUM_THREADS", "1"))
    import torch

    torch.set_num_threads(threads)
    large, small = (512, 512, 512), (32, 512, 512)
    big = gemm_rate(*large)
    half = solve_gemm_half(large, small, gemm_rate(*small) / big)
    peak = big
    for x in large:
        peak /= x / (x + half)
    latency, bandwidth = gloo_link(tmp)
    hw = Hardware(
        name="cpu (calibrated)",
        peak={"fp32": peak},
        memory=float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")),
        hbm_bandwidth=memory_bandwidth(),
        intra_bandwidth=bandwidth,
        inter_bandwidth=bandwidth,
        gpus_per_node=2,
        intra_latency=latency,
        inter_latency=latency,
        gemm_half=half,
        gemm_max=1.0,
        hbm_efficiency=1.0,
        op_overhead=op_overhead(),
        overlap=False,
        device="cpu",
        source=f"tformer plan --calibrate, {threads} thread(s) per process, {time.strftime('%Y-%m-%d')}",
    ).check()
    save_profile(hw, path)
    return hw
