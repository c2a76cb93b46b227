"""``tformer profile-report OUTPUT``: where each traced step's time went, per rank, beside the
planner's prediction (tformer/plan/time.py).

A step's window is its ``tformer/step`` range. On a CPU the ops run on the training thread
itself, so its timeline is split by self time (an op's time less its children's): GEMMs,
attention, other compute, collectives the thread waited in (exposed), the optimizer and data
loading (everything inside those two ranges), and idle (time in no op: Python, the trainer's own
bookkeeping). On a GPU the device's timeline is split instead: each instant goes to the kernel
running then (compute before communication, so a collective kernel beside compute is
overlapped, alone exposed), kernels launched inside ``tformer/optimizer`` to the optimizer,
and an idle device during ``tformer/data`` to data loading; the rest is idle. Either way the
parts add up to the window; collectives that ran beside other work are shown apart, not added.
"""

from __future__ import annotations

import gzip
import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ...config import ConfigError
from .profiling import PREFIX, STEPS_FILE

PARTS = ("GEMMs", "attention", "other compute", "collectives exposed", "optimizer", "data loading", "idle")
OVERLAPPED = "collectives overlapped"
TRACE = re.compile(r"step(\d+)\.trace\.json(\.gz)?$")
COLLECTIVE = re.compile(
    r"nccl|gloo|c10d|all_?reduce|all_?gather|reduce_?scatter|broadcast|all_?to_?all|send|recv|wait_tensor|record_param_comms",
    re.I,
)
GEMM = re.compile(
    r"^aten::(mm|addmm|addmm_|bmm|baddbmm|addmv|mv|dot|_grouped_mm|_scaled_mm)$|gemm|cutlass|xmma|cublas", re.I
)
ATTENTION = re.compile(r"attention|flash|fmha|sdpa", re.I)


@dataclass
class StepSplit:
    rank: int
    step: int
    window: float  # seconds: the tformer/step range
    measured: float | None  # the trainer's step_time for this step (steps.json)
    parts: dict[str, float] = field(default_factory=dict)  # PARTS, adding up to window
    overlapped: float = 0.0
    top: list[tuple[str, float]] = field(default_factory=list)  # (op, self seconds), 10 largest


def find_traces(run: Path) -> dict[int, dict[int, Path]]:
    """{rank: {step: trace}} under ``run/profile``; a clear error when there are none."""
    root = Path(run) / "profile"
    found: dict[int, dict[int, Path]] = {}
    for d in sorted(root.glob("rank*")):
        if not d.name[4:].isdigit():
            continue
        for f in d.iterdir():
            m = TRACE.match(f.name)
            if m:
                found.setdefault(int(d.name[4:]), {})[int(m.group(1))] = f
    if not found:
        raise ConfigError(
            f"{run} holds no profiler traces ({root}/rank*/step*.trace.json.gz); train with "
            "profile.steps=3-4 (for example) to record some"
        )
    return found


def load(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def _category(name: str, phase: str | None) -> str:
    if COLLECTIVE.search(name):
        return "collectives exposed"
    if phase == "data":
        return "data loading"
    if phase == "optimizer":
        return "optimizer"
    if GEMM.search(name):
        return "GEMMs"
    if ATTENTION.search(name):
        return "attention"
    return "other compute"


def split_step(events: list[dict], rank: int, step: int, measured: float | None = None) -> StepSplit:
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    window = next((e for e in spans if e.get("name") == PREFIX + "step"), None)
    if window is None:
        raise ConfigError(f"the trace of rank {rank} step {step} has no {PREFIX}step range; was it written by tformer?")
    t0, t1 = float(window["ts"]), float(window["ts"]) + float(window["dur"])
    kernels = [e for e in spans if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    out = StepSplit(rank, step, (t1 - t0) / 1e6, measured)
    if kernels:
        _device_split(out, spans, kernels, t0, t1)
    else:
        _host_split(out, spans, window, t0, t1)
    return out


def _host_split(out: StepSplit, spans: list[dict], window: dict, t0: float, t1: float) -> None:
    main = sorted(
        (e for e in spans if e.get("tid") == window.get("tid") and e["ts"] >= t0 and e["ts"] + e["dur"] <= t1 + 1),
        key=lambda e: (float(e["ts"]), -float(e["dur"])),
    )
    parts = dict.fromkeys(PARTS, 0.0)
    ops: Counter = Counter()
    stack: list[list] = []  # [event, end, children's time, phase]

    def close(entry: list) -> None:
        e, _, children, phase = entry
        own = max(0.0, float(e["dur"]) - children)
        name = e["name"]
        if name.startswith(PREFIX):  # a range's own time: Python between ops
            part = {"data": "data loading", "optimizer": "optimizer"}.get(name[len(PREFIX) :], "idle")
        else:
            part = _category(name, phase)
            ops[name] += own
        parts[part] += own

    for e in main:
        start, end = float(e["ts"]), float(e["ts"]) + float(e["dur"])
        while stack and stack[-1][1] <= start:
            close(stack.pop())
        if stack:
            stack[-1][2] += float(e["dur"])
        phase = stack[-1][3] if stack else None
        if e["name"].startswith(PREFIX) and e["name"] != PREFIX + "step":
            phase = e["name"][len(PREFIX) :]
        stack.append([e, end, 0.0, phase])
    while stack:
        close(stack.pop())
    out.parts = {k: v / 1e6 for k, v in parts.items()}
    out.top = [(k, v / 1e6) for k, v in ops.most_common(10)]
    # collectives that ran on other threads (gloo's, a pipeline's) beside the training thread
    others = [
        (max(t0, float(e["ts"])), min(t1, float(e["ts"]) + float(e["dur"])))
        for e in spans
        if e.get("tid") != window.get("tid") and COLLECTIVE.search(e.get("name", ""))
    ]
    out.overlapped = _union([iv for iv in others if iv[1] > iv[0]]) / 1e6


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _device_split(out: StepSplit, spans: list[dict], kernels: list[dict], t0: float, t1: float) -> None:
    """Each instant of the window goes to the highest-ranked label active then (a sweep)."""
    optimizer = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in spans if e.get("name") == PREFIX + "optimizer"]
    launched_in_optimizer = {
        e.get("args", {}).get("correlation")
        for e in spans
        if e.get("cat") == "cuda_runtime" and any(a <= float(e["ts"]) <= b for a, b in optimizer)
    }
    rank = {"GEMMs": 0, "attention": 1, "optimizer": 2, "other compute": 3, "collectives exposed": 4, "data loading": 5}
    marks: list[tuple[float, int, str]] = []
    ops: dict[str, float] = {}
    comm = []
    for k in kernels:
        a, b = max(t0, float(k["ts"])), min(t1, float(k["ts"]) + float(k["dur"]))
        if b <= a:
            continue
        name = k.get("name", "")
        if COLLECTIVE.search(name):
            label = "collectives exposed"
            comm.append((a, b))
        elif k.get("args", {}).get("correlation") in launched_in_optimizer:
            label = "optimizer"
        else:
            label = "GEMMs" if GEMM.search(name) else "attention" if ATTENTION.search(name) else "other compute"
        ops[name] = ops.get(name, 0.0) + b - a
        marks += [(a, 1, label), (b, -1, label)]
    for e in spans:
        if e.get("name") == PREFIX + "data":
            a, b = max(t0, float(e["ts"])), min(t1, float(e["ts"]) + float(e["dur"]))
            if b > a:
                marks += [(a, 1, "data loading"), (b, -1, "data loading")]
    marks.sort()
    parts = dict.fromkeys(PARTS, 0.0)
    active: Counter[str] = Counter()
    last = t0
    for at, delta, label in marks:
        live = [lab for lab, n in active.items() if n > 0]
        parts[min(live, key=rank.__getitem__) if live else "idle"] += at - last
        active[label] += delta
        last = at
    parts["idle"] += t1 - last
    out.parts = {k: v / 1e6 for k, v in parts.items()}
    out.overlapped = max(0.0, _union(comm) / 1e6 - out.parts["collectives exposed"])
    out.top = [(k, v / 1e6) for k, v in sorted(ops.items(), key=lambda kv: -kv[1])[:10]]


def analyse(run: Path) -> list[StepSplit]:
    splits = []
    for r, steps in sorted(find_traces(run).items()):
        meta_file = Path(run) / "profile" / f"rank{r}" / STEPS_FILE
        meta = json.loads(meta_file.read_text()) if meta_file.exists() else {}
        for s, path in sorted(steps.items()):
            splits.append(split_step(load(path), r, s, meta.get("step_time", {}).get(str(s))))
    return splits


# the planner's parts (plan/time.py StepTime.breakdown) under the report's names; its compute is
# the GEMMs and attention together, and it does not model data loading
PLANNED = {"compute": "GEMMs", "memory-bound": "other compute", "optimizer": "optimizer", "bubble": "idle"}
PLANNED_IDLE = ("host/dispatch",)


def predicted(run: Path, about: dict, gpu: str) -> tuple[dict[str, float], float]:
    """The planner's split of this run's step (its layout, from config.yaml and steps.json) on
    ``gpu`` (a hardware profile name or a calibration file), and its step seconds."""
    from ...parallel.mesh import ParallelDims
    from ...plan.layout import Layout
    from ...plan.report import hardware
    from ...plan.time import step_time
    from ..config import load_config

    cfg = load_config(Path(run) / "config.yaml")
    p = cfg.parallel
    dims = ParallelDims.from_config(p, int(about.get("world_size", 1)))
    precision = about.get("precision", "fp32")
    layout = Layout(
        strategy=p.strategy if p.strategy != "deepspeed" else f"zero{p.zero_stage}",
        micro_batch=cfg.micro_batch_size,
        dp_replicate=dims.dp_replicate,
        dp_shard=dims.dp_shard,
        tp=dims.tp,
        sp=p.sp,
        pp=dims.pp,
        schedule=p.pp_schedule,
        stages_per_rank=p.pp_stages_per_rank,
        grad_accum=cfg.grad_accum,
        ac={"none": "none", "full": "full"}.get(p.activation_checkpointing, "op"),
        precision="fp32" if precision == "fp32" else "bf16",
        compile=bool(cfg.compile),
        cp=dims.cp,
        ep=dims.ep,
        loss_chunk=cfg.loss.chunk_size if isinstance(cfg.loss.chunk_size, int) else None,
    )
    hw = hardware(gpu, [], None)
    result = step_time(cfg.model, layout, hw, cfg.data.seq_len, cfg.data.target_len, memory=False)
    parts = dict.fromkeys(PARTS, 0.0)
    for k, v in result.breakdown.items():
        parts[PLANNED.get(k, "idle" if k in PLANNED_IDLE else "collectives exposed")] += v
    return parts, result.step


def report(run: Path, gpu: str | None = None, png: bool = True) -> str:
    """The text ``tformer profile-report`` prints (and the PNG beside the traces)."""
    run = Path(run)
    splits = analyse(run)
    lines: list[str] = []
    about_files = sorted((run / "profile").glob(f"rank*/{STEPS_FILE}"))
    about = json.loads(about_files[0].read_text()) if about_files else {}
    plan: tuple[dict[str, float], float] | None = None
    device = about.get("device", "cpu")
    if gpu is None and device == "cuda":
        gpu = "h100-sxm"
    if gpu is None:
        lines.append(
            "predicted: a CPU run is priced with a calibration of this machine: tformer plan --calibrate "
            "cpu.json, then tformer profile-report RUN --gpu cpu.json"
        )
    else:
        try:
            plan = predicted(run, about, gpu)
        except ConfigError as e:  # a layout the time model does not price: say why, report the rest
            lines.append(f"predicted: {e}")
    for s in splits:
        measured = f"; the trainer measured {s.measured:.4f} s" if s.measured is not None else ""
        lines.append(f"rank {s.rank}, step {s.step}: {s.window:.4f} s traced{measured}")
        head = f"  {'part':<22}{'seconds':>9}{'share':>7}"
        if plan is not None:
            head += f"{'predicted (' + str(gpu) + ')':>30}"
        lines.append(head)
        for part in PARTS:
            v = s.parts[part]
            row = f"  {part:<22}{v:>9.4f}{v / s.window:>7.0%}"
            if plan is not None:
                pv = plan[0][part]
                note = "(in GEMMs)" if part == "attention" else "(not modelled)" if part == "data loading" else ""
                row += f"{pv:>12.4f} s {pv / plan[1]:>5.0%}" if not note else f"{note:>30}"
            lines.append(row)
        lines.append(f"  {OVERLAPPED:<22}{s.overlapped:>9.4f}  (beside other work: not in the sum)")
        if plan is not None:
            lines.append(f"  {'step':<22}{s.window:>9.4f}{'':>7}{plan[1]:>12.4f} s")
        lines.append("  top 10 ops by self time:")
        lines += [f"    {name[:70]:<72}{t:>9.4f} s" for name, t in s.top]
    if png:
        lines.append(f"picture: {plot_split(splits, run / 'profile' / 'split.png')}")
    return "\n".join(lines)


def plot_split(splits: list[StepSplit], out: Path) -> Path:
    """One stacked bar per traced (rank, step): the parts of its time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 1.6 + 0.45 * len(splits)))
    labels = [f"rank {s.rank} step {s.step}" for s in splits]
    left = [0.0] * len(splits)
    colours = plt.get_cmap("tab10")
    for i, part in enumerate(PARTS):
        widths = [1000 * s.parts[part] for s in splits]
        ax.barh(labels, widths, left=left, label=part, color=colours(i))
        left = [a + b for a, b in zip(left, widths)]
    ax.invert_yaxis()
    ax.set_xlabel("milliseconds")
    ax.set_title("where each traced step's time went (tformer profile-report)")
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
