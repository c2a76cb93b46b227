"""Hardware profiles: the few published figures the time model divides by.

Every figure is per GPU and from the vendor's datasheet (dense rates: the sparsity figures a
datasheet prints beside them are halved), except where a comment says it was measured:
- H100 SXM5 / H100 PCIe: NVIDIA H100 Tensor Core GPU datasheet (2023): bf16/fp16 989.4 / 756 TFLOP/s,
  tf32 494.7 / 378, fp32 66.9 / 51.2, fp8 1978.9 / 1513; HBM3 80 GB at 3.35 TB/s / HBM2e 80 GB at
  2.0 TB/s; NVLink 900 GB/s (both directions together) on SXM; the PCIe card talks over PCIe Gen5 x16
  (128 GB/s both directions). DGX H100: one 400 Gb/s ConnectX-7 port per GPU (50 GB/s).
- H200 SXM: NVIDIA H200 datasheet (2024): the H100 SXM's rates, HBM3e 141 GB at 4.8 TB/s, NVLink 900 GB/s;
  HGX H200 with one 400 Gb/s NIC per GPU.
- A100 80GB SXM: NVIDIA A100 datasheet (2021): bf16/fp16 312 TFLOP/s, tf32 156, fp32 19.5, no fp8;
  HBM2e 80 GB at 2.039 TB/s; NVLink 600 GB/s; DGX A100: one 200 Gb/s HDR InfiniBand port per GPU (25 GB/s).
- B200: NVIDIA DGX B200 datasheet (2024): 72 PFLOP/s fp8 training for 8 GPUs with sparsity, i.e. 4.5 dense
  fp8 and 2.25 bf16 per GPU, tf32 1.1 dense; 1,440 GB of HBM3e at 64 TB/s for 8 GPUs (180 GB, 8 TB/s each);
  NVLink 5 at 1.8 TB/s; 8 x 400 Gb/s ConnectX-7 ports. The datasheet gives no plain fp32 rate, so the
  profile has none: an fp32 layout on it is reported as not priced.

NVLink figures are halved to the bandwidth one direction carries (a ring sends and receives at once).
Latencies are orders of magnitude (a few microseconds per NVLink hop, ~10 over the network), not
measurements; they only matter for small messages.

Two measured constants describe how much of the peak a GEMM reaches (``time.gemm_efficiency``):
``gemm_half`` = 128, the tile edge of Hopper's and Ampere's cuBLAS kernels (a dimension of 128 fills
half of what a large one does), and ``gemm_max`` chosen so that an 8192^3 bf16 GEMM runs at 798 TFLOP/s
on an H100 SXM, as measured once on the lent H100 of this workplace (/work/.library/device/KINDS.md,
2026-11-13): 798 / 989.4 / (8192 / 8320)^3 = 0.845. ``hbm_efficiency`` 0.9: the same machine copied at
3.0 of its 3.35 TB/s. These two are used for every GPU profile.

The host's costs (plan/host.py) have no datasheet: the GPU profiles state orders of magnitude, the
same for every GPU, since the host CPU issues the work whichever GPU runs it: 5 us per aten op (a
CUDA kernel launch is a few microseconds, eager dispatch and autograd about as much again), 50 us
more per op on a DTensor, in the model and in the optimizer alike (sharding propagation in Python:
this workplace's CPU calibration measures that order) and 300 us per FSDP2 module and micro-batch
(its four hooks, copies and collective launches), with or without peers. On a GPU the host runs
ahead of the device, so these are exposed only where they exceed the device's work (time.py); for
the published rows they never do.

On a machine with a CUDA GPU, ``tformer plan --calibrate`` measures that GPU instead
(calibrate_gpu.py): the bf16 peak and ``gemm_half`` from two GEMM shapes, the tf32 and fp32 peaks,
``attention_rate`` by length and mask in bf16 (T5's bias kernel included), ``misaligned_gemm`` (the
share of the aligned rate a GEMM with a dimension off a multiple of 8 keeps; no datasheet gives it,
so the datasheet profiles have None and price such GEMMs aligned), the HBM copy bandwidth and the
host's cost per op; the links, memory and fp8 rate stay the card's datasheet figures.

The CPU profile is not published anywhere: ``tformer plan --calibrate`` measures it (calibrate.py),
with three figures no GPU profile has (None there: the curve and the bandwidth price everything):
- ``gemm_table``: fp32 FLOP/s measured on a grid of (m, n, k) shapes around the small GEMMs of a
  tiny model, each as a linear layer runs it forward and in its two backward products (input and
  weight gradients, with their transposed operands). A CPU's small GEMMs fall off far more, and less
  regularly, than one efficiency curve says (measured: 33-64 GFLOP/s for d=128 shapes against
  80-90 for 512^3 on this workplace's AVX2 CPU); the time model interpolates the table
  (``gemm_rate``) instead of the curve;
- ``attention_rate``: FLOP/s of torch's SDPA forward + backward as tformer calls it (causal; with
  a learned additive bias, T5's, which takes another kernel; with a plain mask) at a few sequence
  lengths, head dim 32: its blocks stay in cache and its exps are part of it, so neither the GEMM
  table nor the exp rate prices it well;
- ``shared_gemm`` and ``hbm_bandwidth_shared``: the cores of a CPU share its last-level cache and
  memory bus, so one rank of a 2-process layout gets less than a process alone. Calibration
  measures the GEMM table again in both of its processes at once and keeps the median ratio of
  the two tables (one figure: a single shape's ratio moved between 0.34 and 1.5 from run to run,
  the median between 0.72 and 0.81), and the memory bandwidth with both copying. SDPA's in-cache
  rate did not move (1.0). A layout of more than one rank is priced with them (``Hardware.shared``);
- ``exp_rate``: elements per second of ``exp`` with its data in cache, and ``activation_rate``: of
  each transcendental FFN activation (GELU exact and tanh, SiLU) as the feed-forward runs it in a
  step (forward, the forward again that nn/rebuild.py runs in backward, and the backward). On a CPU
  these are compute-bound, slower than their bytes over the bandwidth; the time model prices them
  at whichever is slower.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import ConfigError

TFLOPS, GBPS, GB = 1e12, 1e9, 1e9
GEMM_HALF = 128.0  # cuBLAS tile edge on Ampere/Hopper
GEMM_MAX = 0.845  # measured once: 8192^3 bf16 at 798 TFLOP/s on an H100 SXM (module doc)
HBM_EFFICIENCY = 0.9  # measured once: 3.0 of 3.35 TB/s on the same machine
# A GPU's host costs (plan/host.py), orders of magnitude, not measurements (module doc)
HOST_OP = 5e-6
HOST_DTENSOR_OP = 50e-6
HOST_FSDP_UNIT = 300e-6


@dataclass(frozen=True)
class Hardware:
    """One device kind. Rates in FLOP/s and bytes/s per device; ``intra_*``: the link inside a node
    (NVLink, PCIe, or shared memory for the CPU), one direction; ``inter_*``: the network, per device."""

    name: str
    peak: dict[str, float]  # dense FLOP/s by precision: bf16, fp16, tf32, fp32, fp8
    memory: float  # bytes of device memory
    hbm_bandwidth: float
    intra_bandwidth: float
    inter_bandwidth: float
    gpus_per_node: int = 8
    intra_latency: float = 3e-6
    inter_latency: float = 10e-6
    gemm_half: float = GEMM_HALF
    gemm_max: float = GEMM_MAX
    hbm_efficiency: float = HBM_EFFICIENCY
    # host seconds (plan/host.py): per aten op; more per op on a DTensor, in the model under TP and in
    # the optimizer over DTensor parameters; per FSDP2 module and micro-batch, sharded over peers
    # and over a 1-rank group (FSDP2 beside tp or pp with dp_shard 1: its hooks, no collectives)
    op_overhead: float = HOST_OP
    dtensor_op_overhead: float = HOST_DTENSOR_OP
    dtensor_optimizer_overhead: float = HOST_DTENSOR_OP
    fsdp_unit_overhead: float = HOST_FSDP_UNIT
    fsdp_local_overhead: float = HOST_FSDP_UNIT
    # measured on the CPU only (module doc): rows (m, n, k, forward, input-gradient, weight-gradient FLOP/s)
    gemm_table: tuple[tuple[float, ...], ...] = ()
    # with every process of the machine at work (``gpus_per_node`` of them sharing its caches and
    # memory): the fraction of ``gemm_table``'s rates one keeps, and the memory bandwidth it gets
    shared_gemm: float = 1.0
    hbm_bandwidth_shared: float | None = None
    exp_rate: float | None = None  # elements/s of exp
    # rows (sequence, mask: 0 causal, 1 bias, 2 plain, FLOP/s of SDPA forward + backward) (module doc)
    attention_rate: tuple[tuple[float, ...], ...] = ()
    # elements/s of an FFN activation (gelu, gelu_tanh, silu) as a step runs it: forward, rebuilt forward, backward
    activation_rate: dict[str, float] = dataclasses.field(default_factory=dict)
    # measured on a GPU only (calibrate_gpu.py): the share of an aligned bf16 GEMM's rate one reaches
    # when a dimension is not a multiple of 8 (its rows miss the 16-byte alignment Hopper's TMA
    # loads need; GPT-2's 50,257-word head); None: no datasheet gives it, such GEMMs priced as aligned
    misaligned_gemm: float | None = None
    overlap: bool = True  # communication runs beside compute (GPU: its own engines; CPU gloo: the same cores)
    device: str = "cuda"  # which kernels tformer runs there (cuda | cpu): context parallelism's differ (time.py)
    source: str = ""

    def __post_init__(self):  # a profile read from JSON gives lists; the table is kept hashable
        for name in ("gemm_table", "attention_rate"):
            object.__setattr__(self, name, tuple(tuple(float(x) for x in row) for row in getattr(self, name)))

    def check(self) -> "Hardware":
        figures = {f"peak.{k}": v for k, v in self.peak.items()}
        figures.update((f.name, getattr(self, f.name)) for f in dataclasses.fields(self) if f.type in ("float", "int"))
        if self.exp_rate is not None:
            figures["exp_rate"] = self.exp_rate
        if self.hbm_bandwidth_shared is not None:
            figures["hbm_bandwidth_shared"] = self.hbm_bandwidth_shared
        if self.misaligned_gemm is not None:
            figures["misaligned_gemm"] = self.misaligned_gemm
        figures.update((f"activation_rate.{k}", v) for k, v in self.activation_rate.items())
        for row in self.gemm_table:
            figures[f"gemm_table{tuple(int(x) for x in row[:3])}"] = min(row) if len(row) == 6 else 0.0
        for row in self.attention_rate:
            figures[f"attention_rate{tuple(int(x) for x in row[:2])}"] = row[2] if len(row) == 3 else 0.0
        for name, value in figures.items():
            if not value > 0:
                raise ConfigError(f"hardware figure {name}={value} of {self.name} must be positive; give a number > 0")
        if self.gemm_table:
            _grid(self.gemm_table)  # a whole grid, or one line saying which shape is missing
        return self

    def shared(self, ranks: int) -> "Hardware":
        """The figures one of ``ranks`` processes on this machine gets: a CPU profile's GEMM rates
        times ``shared_gemm`` and its memory bandwidth measured with the machine full (module doc)
        when more than one runs; unchanged otherwise, and for a GPU, whose ranks each have their
        own device."""
        if ranks <= 1 or self.hbm_bandwidth_shared is None:
            return self
        table = tuple((*row[:3], *(rate * self.shared_gemm for rate in row[3:])) for row in self.gemm_table)
        return dataclasses.replace(self, gemm_table=table, hbm_bandwidth=self.hbm_bandwidth_shared)

    def gemm_rate(self, m: float, n: float, k: float, which: int = 0) -> float:
        """FLOP/s of an (m x k) @ (k x n) GEMM from ``gemm_table`` (a CPU profile): ``which`` 0 the
        forward, 1 the input gradient, 2 the weight gradient of a linear layer of that shape;
        interpolated linearly in log(rate) over log(m), log(n), log(k), clamped to the grid's edges."""
        axes, rates = _grid(self.gemm_table)
        corners = []
        for axis, x in zip(axes, (m, n, k)):
            i = max(0, min(len(axis) - 2, sum(1 for a in axis if a <= x) - 1)) if len(axis) > 1 else 0
            lo, hi = axis[i], axis[min(i + 1, len(axis) - 1)]
            t = 0.0 if hi == lo else (math.log(max(lo, min(x, hi))) - math.log(lo)) / (math.log(hi) - math.log(lo))
            corners.append(((lo, 1 - t), (hi, t)))
        log_rate = 0.0
        for a, wa in corners[0]:
            for b, wb in corners[1]:
                for c, wc in corners[2]:
                    log_rate += wa * wb * wc * math.log(rates[(a, b, c)][which])
        return math.exp(log_rate)

    def attention_flops(self, seq: float, mask: str) -> float:
        """FLOP/s of the CPU's SDPA forward + backward (``attention_rate``; FLOPs as the time model
        counts them: the forward's two products and 2.5 times them backward) for ``seq`` queries
        under ``mask``, interpolated in log(rate) over log(seq), clamped to the measured lengths."""
        kind = ATTENTION_MASKS.index(mask)
        points = sorted((row[0], row[2]) for row in self.attention_rate if row[1] == kind)
        if not points:
            raise ConfigError(
                f"hardware attention_rate of {self.name} has no {mask} row; run `tformer plan --calibrate` again"
            )
        x = max(points[0][0], min(seq, points[-1][0]))
        for (s0, r0), (s1, r1) in zip(points, points[1:]):
            if s0 <= x <= s1:
                t = math.log(x / s0) / math.log(s1 / s0)
                return math.exp((1 - t) * math.log(r0) + t * math.log(r1))
        return points[0][1]


ATTENTION_MASKS = ("causal", "bias", "plain")


@functools.lru_cache(maxsize=8)
def _grid(table: tuple[tuple[float, ...], ...]) -> tuple[tuple[tuple[float, ...], ...], dict]:
    """The sorted axes of ``table`` and its rates by shape; a shape of the grid that is missing is
    one ``ConfigError`` line."""
    rates = {row[:3]: row[3:] for row in table}
    axes = tuple(tuple(sorted({row[i] for row in table})) for i in range(3))
    for shape in itertools.product(*axes):
        if shape not in rates:
            raise ConfigError(
                f"hardware gemm_table lacks the shape {tuple(int(x) for x in shape)} of its grid; "
                "run `tformer plan --calibrate` again"
            )
    return axes, rates


def _sxm_h100(name: str, memory: float, hbm: float, source: str) -> Hardware:
    return Hardware(
        name,
        {
            "bf16": 989.4 * TFLOPS,
            "fp16": 989.4 * TFLOPS,
            "tf32": 494.7 * TFLOPS,
            "fp32": 66.9 * TFLOPS,
            "fp8": 1978.9 * TFLOPS,
        },
        memory,
        hbm,
        intra_bandwidth=450 * GBPS,
        inter_bandwidth=50 * GBPS,
        source=source,
    )


PROFILES: dict[str, Hardware] = {
    "h100-sxm": _sxm_h100("h100-sxm", 80 * GB, 3.35e12, "NVIDIA H100 datasheet (SXM5); DGX H100"),
    "h100-pcie": Hardware(
        "h100-pcie",
        {"bf16": 756 * TFLOPS, "fp16": 756 * TFLOPS, "tf32": 378 * TFLOPS, "fp32": 51.2 * TFLOPS, "fp8": 1513 * TFLOPS},
        80 * GB,
        2.0e12,
        intra_bandwidth=64 * GBPS,
        inter_bandwidth=50 * GBPS,
        intra_latency=5e-6,
        source="NVIDIA H100 datasheet (PCIe); PCIe Gen5 x16",
    ),
    "h200": _sxm_h100("h200", 141 * GB, 4.8e12, "NVIDIA H200 datasheet (SXM); HGX H200"),
    "a100-80gb": Hardware(
        "a100-80gb",
        {"bf16": 312 * TFLOPS, "fp16": 312 * TFLOPS, "tf32": 156 * TFLOPS, "fp32": 19.5 * TFLOPS},
        80 * GB,
        2.039e12,
        intra_bandwidth=300 * GBPS,
        inter_bandwidth=25 * GBPS,
        source="NVIDIA A100 datasheet (80GB SXM); DGX A100",
    ),
    "b200": Hardware(
        "b200",
        {"bf16": 2250 * TFLOPS, "fp16": 2250 * TFLOPS, "tf32": 1100 * TFLOPS, "fp8": 4500 * TFLOPS},
        180 * GB,
        8.0e12,
        intra_bandwidth=900 * GBPS,
        inter_bandwidth=50 * GBPS,
        source="NVIDIA DGX B200 datasheet",
    ),
}

# figures a user may override, with what each one means (the CLI's --set NAME=VALUE)
OVERRIDABLE = (
    "memory",
    "hbm_bandwidth",
    "intra_bandwidth",
    "inter_bandwidth",
    "gpus_per_node",
    "intra_latency",
    "inter_latency",
    "gemm_half",
    "gemm_max",
    "hbm_efficiency",
    "op_overhead",
    "dtensor_op_overhead",
    "dtensor_optimizer_overhead",
    "fsdp_unit_overhead",
    "fsdp_local_overhead",
    "shared_gemm",
    "hbm_bandwidth_shared",
    "exp_rate",
    "misaligned_gemm",
)


def profile(name: str, **overrides: float) -> Hardware:
    """The profile ``name`` with figures replaced: any of ``OVERRIDABLE``, or ``peak_<precision>``.
    Every figure is checked to be positive (one line naming it otherwise)."""
    if name not in PROFILES:
        raise ConfigError(f"unknown gpu {name!r}; use one of: {', '.join(PROFILES)} (or a calibration file)")
    return override(PROFILES[name], **overrides)


def override(hw: Hardware, **overrides: float) -> Hardware:
    peak = dict(hw.peak)
    plain: dict[str, Any] = {}
    for key, value in overrides.items():
        if key.startswith("peak_"):
            peak[key[len("peak_") :]] = float(value)
        elif key in OVERRIDABLE:
            plain[key] = int(value) if key == "gpus_per_node" else float(value)
        else:
            allowed = ", ".join((*OVERRIDABLE, "peak_bf16", "peak_fp32", "..."))
            raise ConfigError(f"unknown hardware figure {key!r}; use one of: {allowed}")
    return dataclasses.replace(hw, peak=peak, **plain).check()


def load_profile(path: str | Path) -> Hardware:
    """A profile written by ``tformer plan --calibrate`` (JSON of ``Hardware``'s fields)."""
    try:
        data = json.loads(Path(path).read_text())
        return Hardware(**data).check()
    except (OSError, ValueError, TypeError) as e:
        raise ConfigError(f"cannot read the hardware profile {path}: {e}; run `tformer plan --calibrate` again") from e


def save_profile(hw: Hardware, path: str | Path) -> None:
    from ..files import write_bytes_durable

    write_bytes_durable(Path(path), (json.dumps(dataclasses.asdict(hw), indent=1) + "\n").encode())
