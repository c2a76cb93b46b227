"""``tformer plan --calibrate``: measure this machine's figures and write a CPU profile.

Measured, each the best of a few repeats (the machine may be shared: best, not mean) unless said:
- fp32 GEMM FLOP/s at a large and a thin shape, operands out of the caches; the large one sets the peak, the thin one
  ``gemm_half`` of the time model's efficiency curve (solved from the ratio of the two), so the curve
  is measured once here and not fitted to any run;
- memory bandwidth: a 64 MiB copy, bytes read + written;
- the host's cost per operation (plan/host.py): ``op_overhead``, one tiny elementwise op forward
  and backward (dispatch, autograd bookkeeping, allocation), per aten op;
- gloo all-reduce between 2 processes on loopback: a 4 KiB message gives the latency per hop, a
  16 MiB one the bandwidth (ring formulas of time.py with n = 2);
- on the same 2-rank gloo mesh: ``dtensor_op_overhead``, what a model's op costs more on a DTensor
  under tensor parallelism (tformer's TP plan over ``TP_MODEL``: matmuls, views, attention,
  redistributes, the waits at its all-reduces), ``dtensor_optimizer_overhead``, what an optimizer op costs more on a DTensor
  parameter, and ``fsdp_unit_overhead``, what FSDP2 adds per ``fully_shard``-ed module and
  micro-batch (its hooks, gathering and reduce-scatter launches, the copies in and out) beyond the
  three collectives' latency and bandwidth the time model already prices; ``fsdp_local_overhead``,
  the same over a 1-rank group (the trainer's FSDP2 beside tp or pp at dp_shard 1: hooks, no
  collectives).
  What two processes do together is timed as a median (``_median``), the rest as a best-of.
- for the time model's CPU pricing (hardware.py): ``gemm_table``, fp32 FLOP/s over a grid of
  small shapes (``GEMM_GRID``) in the three products of a linear layer, operands out of the caches;
  ``attention_rate``, SDPA forward + backward FLOP/s by sequence length and mask;
  ``exp_rate`` and ``activation_rate``, elements per second of exp and of each FFN activation's step
  (compute-bound on a CPU, in cache).
A host figure that comes out non-positive (a disturbed measurement) is refused when the profile
is checked: calibrate again on a quiet machine.
Every process this starts has a deadline, after which it is killed and calibration fails.
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import statistics
import time
from pathlib import Path
from typing import Any, Callable

from ..config import ConfigError
from .hardware import Hardware, save_profile
from .comm import Link, ring

DEADLINE_S = 300.0


def _best(fn, repeats: int = 5, pick=min) -> float:
    """Best (or ``pick`` of the) seconds of ``fn`` over ``repeats``, after one warm-up run."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return pick(times)


def _median(fn, repeats: int = 9) -> float:
    """Median seconds of ``fn`` (after one warm-up run). For what two processes do together: each
    collective waits for the later of the two, so on a shared machine the typical run pays the
    scheduling jitter a best-of would leave out, and the step times the model is held against are
    medians too."""
    return _best(fn, repeats, statistics.median)


def gemm_rate(m: int, n: int, k: int) -> float:
    """FLOP/s of an (m x k) @ (k x n) fp32 GEMM whose operands come from memory, as in a training
    step (the layer before wrote other data since, the weights were last read a pass ago): a 64
    MiB buffer is written between repeats to push them out of the caches, outside the timing."""
    import torch

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
    return 2 * m * n * k / _best_cold(lambda: torch.mm(a, b), torch.empty(16 * 2**20), repeats=7)


def _best_cold(fn, flush, repeats: int, pick=min) -> float:
    """Best (or ``pick`` of the) seconds of ``fn`` over ``repeats``, ``flush`` (a 64 MiB buffer)
    written before each run, outside the timing, so that ``fn``'s operands come from memory."""
    times = []
    for _ in range(repeats):
        flush.add_(1.0)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return pick(times)


GEMM_GRID = ((32, 128, 512, 2048), (32, 128, 512, 4096), (32, 128, 512))  # m, n, k (hardware.gemm_table)


def _linear_products(m: int, n: int, k: int):
    """The three GEMMs of a linear layer ``y = x W^T`` (x: m x k, W: n x k) as autograd runs them:
    the forward, the input gradient ``dy W`` and the weight gradient ``dy^T x`` (transposed views)."""
    import torch

    g = torch.Generator().manual_seed(0)
    x, w, dy = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(m, n, generator=g)
    return (lambda: torch.mm(x, w.t()), lambda: torch.mm(dy, w), lambda: torch.mm(dy.t(), x))


def gemm_table(grid=GEMM_GRID, repeats: int = 7) -> tuple[tuple[float, ...], ...]:
    """fp32 FLOP/s of every (m, n, k) of ``grid`` in its three linear-layer products, operands out of
    the caches (a 64 MiB buffer written before each, outside the timing), the median of
    ``repeats``: a step's many small GEMMs run at their typical rate, and a best-of of a few moved
    by up to 4x between two calibrations of this shared machine (medians: within 20%)."""
    import torch

    flush = torch.empty(16 * 2**20)
    rows = []
    for m, n, k in itertools.product(*grid):
        rates = []
        for product in _linear_products(m, n, k):
            product()
            rates.append(2 * m * n * k / _best_cold(product, flush, repeats, statistics.median))
        rows.append((float(m), float(n), float(k), *rates))
    return tuple(rows)


ATTENTION_SEQ = (32, 64, 128, 256)


def attention_rates(batch_heads: tuple[int, int] = (16, 4), head_dim: int = 32) -> tuple[tuple[float, ...], ...]:
    """FLOP/s of SDPA forward + backward as nn/attention.py calls it, at each of ``ATTENTION_SEQ``:
    causal (half the scores executed), with a learned additive bias (T5's relative positions:
    the bias needs its gradient) and with a plain mask; FLOPs counted as time.py counts them; the
    median of a few runs, as for the GEMM table."""
    import torch
    import torch.nn.functional as F

    from .hardware import ATTENTION_MASKS

    b, h = batch_heads
    rows = []
    for seq in ATTENTION_SEQ:
        q, k, v = (torch.randn(b, h, seq, head_dim, requires_grad=True) for _ in range(3))
        masks = {
            "causal": dict(is_causal=True),
            "bias": dict(attn_mask=torch.randn(1, h, seq, seq, requires_grad=True)),
            "plain": dict(attn_mask=torch.zeros(b, 1, seq, seq)),
        }
        for mask, kwargs in masks.items():

            def run(kwargs=kwargs, qkv=(q, k, v)):
                F.scaled_dot_product_attention(*qkv, **kwargs).sum().backward()

            executed = 2 * 2 * b * h * seq * seq * head_dim * (0.5 if mask == "causal" else 1.0)
            rows.append((float(seq), float(ATTENTION_MASKS.index(mask)), 3.5 * executed / _median(run, repeats=7)))
    return tuple(rows)


def exp_rate(numel: int = 2**16, repeats: int = 20) -> float:
    """Elements per second of fp32 ``exp`` with its data in cache: the compute rate, which the time
    model sets against the bytes over the bandwidth."""
    import torch

    x, out = torch.randn(numel), torch.empty(numel)
    return numel * repeats / _best(lambda: [torch.exp(x, out=out) for _ in range(repeats)])


def activation_rates(numel: int = 2**16, repeats: int = 10) -> dict[str, float]:
    """Elements per second of each ungated transcendental FFN activation as a feed-forward runs it in
    a training step (nn/ffn.py with nn/rebuild.py): the forward, the forward rebuilt in backward, the
    backward (its aten kernel, without autograd's bookkeeping, which host.py counts)."""
    import torch

    from ..nn.ffn import FFN_KINDS

    aten = torch.ops.aten
    backward: dict[Any, Callable] = {
        "gelu": lambda g, x: aten.gelu_backward(g, x),
        "gelu_tanh": lambda g, x: aten.gelu_backward(g, x, approximate="tanh"),
        "silu": lambda g, x: aten.silu_backward(g, x),
    }
    x, grad = torch.randn(numel), torch.randn(numel)
    rates = {}
    for name, back in backward.items():
        act = FFN_KINDS[name][0]

        def step(act=act, back=back):
            for _ in range(repeats):
                act(x)
                act(x)
                back(grad, x)

        rates[name] = numel * repeats / _best(step)
    return rates


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


TP_MODEL, TP_TOKENS = "llama-tiny", (8, 64)  # what ``dtensor_op_overhead`` is measured on: batch, sequence


def dtensor_op_overhead(mesh, latency: float, bandwidth: float, repeats: int = 9) -> float:
    """Seconds a model's op costs more on a DTensor than on a plain tensor, as tensor parallelism
    runs it in a step: the ``TP_MODEL`` preset at its own widths over ``TP_TOKENS``, forward + loss +
    backward split by tformer's TP plan with loss parallelism over ``mesh``, less half the same
    model's time unsplit (each rank's share of the arithmetic: TP halves every matmul and attention
    head) and less its all-reduces as the time model prices them (``time.ring``, each of a
    (tokens x d_model) fp32 activation), over the DTensor ops plan/host.py counts in it. What is
    left is the ops' sharding propagation and redistributes, and what each all-reduce waits for the
    other rank beyond the link's latency: real ops between real collectives, which an elementwise
    op's propagation at tiny sizes understated by 2-3x on this machine."""
    import copy

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from ..models import preset, spec_of
    from ..parallel.tp import apply_tensor_parallel, loss_context
    from .host import _run, _shrunk

    cfg = preset(TP_MODEL)
    torch.manual_seed(0)
    plain = spec_of(cfg).build(cfg)
    split = copy.deepcopy(plain)
    apply_tensor_parallel(split, mesh, False, True)
    batch, seq = TP_TOKENS
    ids = torch.randint(1, cfg.vocab_size, (batch, seq))

    def run(model, parallel: bool):
        with loss_context(parallel):
            model(ids, labels=ids.clone(), return_logits=False).loss.backward()

    class Collectives(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += "all_reduce" in str(func)
            return func(*args, **(kwargs or {}))

    counter = Collectives()
    with counter:
        run(split, True)
    all_reduce = ring("all_reduce", batch * seq * cfg.d_model * 4, mesh.size(), Link(bandwidth, latency))
    extra = _median(lambda: run(split, True), repeats) - _median(lambda: run(plain, False), repeats) / 2
    ops = _run(_shrunk(cfg, cfg.num_layers, cfg.decoder_layers), True)[1]
    return (extra - counter.count * all_reduce) / ops


def dtensor_optimizer_overhead(mesh, tensors: int = 16, repeats: int = 9) -> float:
    """Seconds an optimizer op costs more on a DTensor parameter than on a plain one: the trainer's
    step on the CPU (the gradient norm and clip of ``parallel.tp.grad_norm_and_clip``, AdamW's
    per-parameter loop, zeroing) over ``tensors`` parameters sharded on ``mesh``, against the same
    over plain ones, per op of plan/host.py's ``optimizer_ops("loop")``. Cached elementwise ops on
    local shards: cheaper than a model's DTensor op."""
    import torch
    from torch.distributed.tensor import Shard, distribute_tensor

    from ..parallel.tp import grad_norm_and_clip
    from .host import optimizer_ops

    def build(sharded: bool):
        params = []
        for i in range(tensors):
            t = torch.ones(8, 4) if i % 2 else torch.ones(8)
            params.append(torch.nn.Parameter(distribute_tensor(t, mesh, [Shard(0)]) if sharded else t))
        groups = [{"params": params[1::2], "weight_decay": 0.1}, {"params": params[::2], "weight_decay": 0.0}]
        opt = torch.optim.AdamW(groups, lr=1e-3, foreach=False)

        def step():
            for p in params:
                p.grad = torch.ones_like(p)
            grad_norm_and_clip(((str(i), p) for i, p in enumerate(params)), 1e-6)
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step

    sharded, plain = build(True), build(False)
    extra = _median(sharded, repeats) - _median(plain, repeats)
    return extra / optimizer_ops("loop").ops(tensors)


FSDP_UNIT = (128, 512)  # one unit: Linear(128, 512) + Linear(512, 128), 131k parameters (a tiny model's FFN)


def fsdp_unit_overhead(mesh, latency: float, bandwidth: float, units: int = 4, rows: int = 512) -> float:
    """Host seconds FSDP2 adds per sharded module and micro-batch (forward and backward), on units of
    a tiny model's size (``FSDP_UNIT``; its copies in and out and its hooks grow with the parameters
    a unit holds, so a trivial module would understate them): ``units`` of them, each
    ``fully_shard``-ed, against the same unsharded, over ``rows`` tokens; less the three collectives
    of a unit (all-gather in forward and backward, reduce-scatter of fp32 gradients) over 2 ranks
    at ``latency`` and ``bandwidth``, as the time model prices them (time.ring)."""
    import copy

    import torch
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    d, ff = FSDP_UNIT
    plain = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(d, ff), torch.nn.Linear(ff, d)) for _ in range(units)))
    sharded = copy.deepcopy(plain)
    for unit in sharded:
        fully_shard(unit, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    x = torch.ones(rows, d)

    def run(model):
        model(x).sum().backward()

    unit_bytes = sum(p.numel() for p in plain[0].parameters()) * 4
    collective = ring("all_gather", unit_bytes, mesh.size(), Link(bandwidth, latency))
    return (_median(lambda: run(sharded)) - _median(lambda: run(plain))) / units - 3 * collective


def _gloo_worker(rank: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    times: dict[str, Any] = {}
    dist.barrier()  # both processes at once: the rates one rank of a full machine gets
    times["gemm_table_shared"] = gemm_table()
    dist.barrier()
    times["hbm_bandwidth_shared"] = memory_bandwidth()
    small, large = torch.ones(1024), torch.ones(4 * 2**20)
    dist.barrier()
    # the latency as a step pays it: the mean of many (a 4 KiB all-reduce's median here is half its
    # mean: a long tail of wake-ups, which a step of tens of collectives meets in proportion)
    times["small"] = _median(lambda: [dist.all_reduce(small) for _ in range(200)], 3) / 200
    dist.barrier()
    times["large"] = _median(lambda: dist.all_reduce(large))
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("peers", "alone"))
    latency, bandwidth = _ring_link(times["small"], times["large"])
    for name, measure in (
        ("dtensor", lambda: dtensor_op_overhead(mesh["peers"], latency, bandwidth)),
        ("optimizer", lambda: dtensor_optimizer_overhead(mesh["peers"])),
        ("fsdp", lambda: fsdp_unit_overhead(mesh["peers"], latency, bandwidth)),
        ("fsdp_local", lambda: fsdp_unit_overhead(mesh["alone"], latency, bandwidth)),
    ):
        dist.barrier()
        times[name] = measure()
    if rank == 0:
        Path(out).write_text(json.dumps(times))
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


def _ring_link(small: float, large: float) -> tuple[float, float]:
    """(latency per hop, bandwidth) from the seconds of a 2-rank all-reduce of 4 KiB and of 16 MiB:
    an all-reduce over 2 ranks is 2 ring hops, and each moves half the buffer twice (the whole)."""
    return small / 2, 4 * 4 * 2**20 / max(large - small, 1e-9)


def gloo_link(tmp: Path) -> dict[str, Any]:
    """Between 2 local processes over gloo: ``latency`` per hop, ``bandwidth``, and the host costs
    ``dtensor_op_overhead``, ``dtensor_optimizer_overhead``, ``fsdp_unit_overhead`` and
    ``fsdp_local_overhead``, each a median (``_median``); and the GEMM table and memory bandwidth
    measured in both processes at once (``gemm_table_shared``, ``hbm_bandwidth_shared``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp / "gloo.txt"
    spawn_with_deadline(_gloo_worker, (port, str(out)), 2, DEADLINE_S, "calibration's gloo processes")
    times = json.loads(out.read_text())
    latency, bandwidth = _ring_link(times["small"], times["large"])
    return {
        "latency": latency,
        "bandwidth": bandwidth,
        "dtensor_op_overhead": times["dtensor"],
        "dtensor_optimizer_overhead": times["optimizer"],
        "fsdp_unit_overhead": times["fsdp"],
        "fsdp_local_overhead": times["fsdp_local"],
        "gemm_table_shared": times["gemm_table_shared"],
        "hbm_bandwidth_shared": times["hbm_bandwidth_shared"],
    }


def shared_ratio(alone, shared) -> float:
    """The median over every shape and product of the GEMM rates measured with both processes at
    work over those measured alone: one figure, as the single shapes' ratios are noisy."""
    return statistics.median(s / a for row, other in zip(alone, shared) for a, s in zip(row[3:], other[3:]))


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
    link = gloo_link(tmp)
    latency, bandwidth = link["latency"], link["bandwidth"]
    alone = gemm_table()
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
        dtensor_op_overhead=link["dtensor_op_overhead"],
        dtensor_optimizer_overhead=link["dtensor_optimizer_overhead"],
        fsdp_unit_overhead=link["fsdp_unit_overhead"],
        fsdp_local_overhead=link["fsdp_local_overhead"],
        gemm_table=alone,
        shared_gemm=shared_ratio(alone, link["gemm_table_shared"]),
        hbm_bandwidth_shared=link["hbm_bandwidth_shared"],
        exp_rate=exp_rate(),
        attention_rate=attention_rates(),
        activation_rate=activation_rates(),
        overlap=False,
        device="cpu",
        source=f"tformer plan --calibrate, {threads} thread(s) per process, {time.strftime('%Y-%m-%d')}",
    ).check()
    save_profile(hw, path)
    return hw
