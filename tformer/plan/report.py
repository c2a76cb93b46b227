"""``tformer plan``'s speed report: every layout that fits, priced; the fastest recommended.

The memory planner (search.py: ``recommend``, then the context-parallel layouts of
``recommend_cp`` and, for an MoE model, the expert-parallel versions of the FSDP2 ones,
``ep_variants``) gives each layout and activation-checkpointing mode that fits with its largest
micro-batch, in its memory-first order; this prices each one (time.py) and prints step time,
tokens/s per device, MFU and the time to train ``--tokens``. The recommendation is the fastest
layout that fits; the memory-only choice is printed beside it, with its predicted speed, when it
differs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..args import parse_bytes
from ..config import ConfigError
from ..models import spec_of
from . import memory as memory_plan
from . import memory_report, search
from .hardware import Hardware, load_profile, profile
from .layout import Layout, NotPriced, StepTime, rank_stages
from .replicas import CHECKPOINT_READ, Replicas, replica_cost, restart_cost
from .time import step_time


def add_options(p: argparse.ArgumentParser, number) -> None:
    """The speed options of ``tformer plan`` (``number``: the CLI's range-checked number type)."""
    p.add_argument(
        "--gpu",
        default="h100-sxm",
        help="hardware profile: h100-sxm, h100-pcie, h200, a100-80gb, b200, or a file from --calibrate",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIGURE=VALUE",
        help="override a profile figure (e.g. inter_bandwidth=25e9, peak_bf16=800e12); repeatable",
    )
    p.add_argument("--tokens", type=number(float, "(0, inf)"), default=None, help="tokens to train: prints the time")
    p.add_argument("--calibrate", metavar="PROFILE", default=None, help="measure this machine and write PROFILE")


def hardware(gpu: str, figures: list[str], gpus_per_node: int | None = None) -> Hardware:
    """The profile named (or the calibration file) with ``NAME=VALUE`` overrides, checked."""
    overrides: dict[str, float] = {}
    for item in figures:
        name, _, value = item.partition("=")
        try:
            overrides[name.strip()] = float(value)
        except ValueError:
            raise ConfigError(f"--set {item!r}: give FIGURE=NUMBER, e.g. --set inter_bandwidth=25e9") from None
    if gpus_per_node is not None:
        overrides.setdefault("gpus_per_node", gpus_per_node)
    if Path(gpu).suffix == ".json" or Path(gpu).is_file():
        from .hardware import override

        return override(load_profile(gpu), **overrides)
    return profile(gpu, **overrides)


def layout_of(
    e: memory_plan.Estimate,
    precision: str,
    loss_chunk: int | None = None,
    float8: str | None = None,
    compile: bool = False,
) -> Layout:
    """The time model's layout of a planned estimate, run with the trainer's ``loss.chunk_size``,
    ``compile`` (true or model) and, for precision=fp8, its float8 recipe beside bf16."""
    return Layout(
        float8=float8,
        compile=compile,
        strategy=e.strategy,
        micro_batch=e.micro_batch,
        dp_replicate=e.dp_replicate,
        dp_shard=e.dp_shard,
        tp=e.tp,
        sp=e.sp,
        pp=e.pp,
        schedule=e.schedule or "1f1b",
        stages_per_rank=e.stages_per_rank,
        n_micro=e.n_micro if e.pp > 1 else None,
        ac=e.ac,
        precision=precision,
        cp=e.cp,
        ep=e.ep,
        loss_chunk=loss_chunk,
    )


def _duration(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.1f} s"


def _name(e: memory_plan.Estimate) -> str:
    pipe = f" pp{e.pp} {e.schedule}{'' if e.stages_per_rank == 1 else f'x{e.stages_per_rank}'}" if e.pp > 1 else ""
    cp = f" cp{e.cp}" if e.cp > 1 else ""
    ep = f" ep{e.ep}" if e.ep > 1 else ""
    return f"{e.strategy} {e.dp_replicate}x{e.dp_shard}{cp} tp{e.tp}{pipe}{ep}"


def speed_report(
    cfg,
    fits: list[memory_plan.Estimate],
    hw: Hardware,
    seq: int,
    target: int | None,
    tokens: float | None,
    replicas: Replicas | None = None,
) -> int:
    """Print the priced table of ``fits`` (``candidates``, best for memory first), the fastest
    layout's breakdown and, when it differs, the memory-only choice's speed. With fault
    tolerance's ``replicas``, ``fits`` are one group's layouts and a line adds what the groups
    cost (replicas.py)."""
    precision = "bf16" if cfg.precision in ("auto", "bf16", "fp8") else cfg.precision
    # precision=fp8: the blocks' linear layers in float8 (the recipe's), the rest in bf16
    float8 = cfg.float8.recipe if cfg.precision == "fp8" else None
    compiled = cfg.compile not in (False, "false")  # true (the blocks) or model: fused elementwise chains
    model = cfg.model
    what = f"bf16, the blocks' linear layers in float8 ({float8})" if float8 else precision
    print(f"\npredicted speed on {hw.name} ({hw.gpus_per_node} per node; {what}; time model: tformer/plan/time.py):")
    head = f"  {'layout':<40}{'AC':<6}{'micro':>6}{'GiB':>7}{'step s':>9}{'tok/s/dev':>11}{'MFU':>6}"
    print(head + (f"{'to train':>11}" if tokens else ""))
    priced: list[tuple[memory_plan.Estimate, StepTime]] = []
    # loss.chunk_size=auto as the trainer would resolve it on this device (plan/head.py)
    chunk = memory_plan.training_memory(cfg, hw.memory if hw.device == "cuda" else None)["chunk"]
    for e in fits:
        try:
            r = step_time(model, layout_of(e, precision, chunk, float8, compiled), hw, seq, target, memory=False)
        except NotPriced as why:
            print(f"  {_name(e):<40}{e.ac:<6}{e.micro_batch:>6}{e.total / 2**30:>7.1f}  {why}")
            continue
        priced.append((e, r))
        line = f"  {_name(e):<40}{e.ac:<6}{e.micro_batch:>6}{e.total / 2**30:>7.1f}{r.step:>9.3f}"
        line += f"{r.tokens_per_s_per_device:>11,.0f}{r.mfu:>6.0%}"
        print(line + (f"{_duration(r.time_to_train(tokens)):>11}" if tokens else ""))
    if not priced:
        print("speed: no layout that fits could be priced")
        return 1
    best, fastest = max(priced, key=lambda pair: pair[1].tokens_per_s_per_device)
    print(
        f"fastest that fits: {_name(best)}, AC {best.ac}, micro_batch_size={best.micro_batch}: "
        f"{fastest.step:.3f} s per step, {fastest.tokens_per_s_per_device:,.0f} tokens/s per device, MFU {fastest.mfu:.0%}"
        + (f", {_duration(fastest.time_to_train(tokens))} for {tokens:.3g} tokens" if tokens else "")
    )
    print("  breakdown: " + ", ".join(f"{k} {v:.3f} s" for k, v in fastest.breakdown.items() if v > 0))
    if cfg.optim.name == "muon":
        from .optimizer import time_line

        m = cfg.optim.muon
        layout = layout_of(best, precision, chunk, float8, compiled)
        print(time_line(model, layout, hw, fastest.step, m.ns_steps, m.ns_dtype))
    if replicas is not None:
        layout = layout_of(best, precision, chunk, float8, compiled)
        print(replicas_line(model, layout, hw, fastest, replicas, tokens, cfg.save_every))
    first, first_time = priced[0]
    if first is not fits[0]:
        print(f"  (the memory-first choice {_name(fits[0])} could not be priced)")
    elif first is not best:
        print(
            f"  the memory-only choice, {_name(first)}, AC {first.ac}, micro_batch_size={first.micro_batch}, "
            f"would run {first_time.tokens_per_s_per_device:,.0f} tokens/s per device "
            f"({first_time.tokens_per_s_per_device / fastest.tokens_per_s_per_device:.2f}x the fastest)"
        )
    return 0


def replicas_line(
    model, layout: Layout, hw: Hardware, one: StepTime, rep: Replicas, tokens: float | None, save_every: int = 0
) -> str:
    """What ``rep`` replica groups of ``layout`` (one group's step: ``one``) cost per step, and
    what a failure would cost the job without them (a cluster restart, replicas.restart_cost)."""
    cost = replica_cost(layout, rank_stages(model, layout)[0], hw, rep)
    step = one.step + cost.seconds_per_step
    where = "inside a node" if layout.devices * rep.groups <= hw.gpus_per_node else "network"
    line = (
        f"replicas: {rep.groups} fault-tolerance groups x {layout.devices} devices ({rep.name}): "
        f"{cost.bytes_per_step / 2**20:,.1f} MiB per rank per step across the groups over the {where} "
        f"({cost.link.bandwidth / 1e9:g} GB/s): {cost.seconds_per_step:.3f} s per step, "
        f"step {one.step:.3f} -> {step:.3f} s, "
        f"{one.tokens_per_step * rep.groups / step / (layout.devices * rep.groups):,.0f} tokens/s per device"
    )
    if tokens:
        line += f", {_duration(tokens / (one.tokens_per_step * rep.groups) * step)} for {tokens:.3g} tokens"
    if cost.device_bytes:
        line += (
            f"; DiLoCo keeps {cost.device_bytes / 2**30:.2f} GiB more per device (outer momentum, counted in the memory "
            "table and the fit) and "
            f"{cost.host_bytes / 2**30:.2f} GiB of host memory per rank (the parameters' backup)"
        )
    restart = restart_cost(layout, rank_stages(model, layout)[0], one.step, save_every)  # the job without the groups
    if restart is None:
        line += "; without fault tolerance a failure restarts the job from step 0 (save_every=0: no checkpoint till the end)"
    else:
        line += (
            f"; without fault tolerance a failure costs a cluster restart, about {restart.total_s:,.0f} s: relaunch "
            f"{restart.relaunch_s:.0f} s (assumed), checkpoint reload {restart.reload_s:.1f} s (at "
            f"{CHECKPOINT_READ / 1e9:g} GB/s per rank), {restart.retrain_steps:g} steps since the last save (half of "
            f"save_every={save_every}) {restart.retrain_s:,.1f} s; with it the live groups wait about the heartbeat "
            "timeout (launch/ft.sh: 5 s) and a step or two"
        )
    return line


def ft_runnable(e: memory_plan.Estimate) -> bool:
    """A layout a fault-tolerance group can run (train/resilience/ft.py refuses the rest): no pipeline, no
    DeepSpeed, no HSDP replica dimension (torchft's groups are the replicas)."""
    return e.pp == 1 and e.dp_replicate == 1 and not e.strategy.startswith("zero")


def candidates(
    cfg,
    devices: int,
    device_memory: str,
    gpus_per_node: int = 8,
    n_micro: int | None = None,
    max_pp: int | None = None,
    max_cp: int | None = None,
) -> list[memory_plan.Estimate]:
    """Every layout and AC that fits for the run config ``cfg``, memory-first (as
    memory_report.plan_main searches them): ``recommend``'s, then the context-parallel ones, then,
    for an MoE model, the expert-parallel versions of the FSDP2 ones."""
    model = cfg.model
    memory = parse_bytes(device_memory)
    mixed = cfg.precision != "fp32"
    seq, target = cfg.data.seq_len, _target(cfg)
    settings = {**memory_plan.training_memory(cfg, memory), "loss_parallel": cfg.parallel.loss_parallel}
    settings["outer_momentum"] = memory_report.diloco(cfg)
    refused = memory_report._pp_refused(cfg)
    fits = search.recommend(
        model,
        devices,
        memory,
        seq,
        target,
        mixed,
        settings=settings,
        gpus_per_node=gpus_per_node,
        max_pp=1 if refused else (max_pp or devices),
        n_micro=n_micro,
        replica_group=cfg.fault_tolerance.enabled,
    )
    if not memory_report.cp_searched(model, max_cp):
        fits += search.recommend_cp(
            model, devices, memory, seq, target, mixed, settings=settings, gpus_per_node=gpus_per_node, max_cp=max_cp
        )
    return fits + search.ep_variants(model, fits, devices, memory, seq, target, mixed, settings=settings)


def _target(cfg) -> int | None:
    if not spec_of(cfg.model).seq2seq:
        return None
    from ..data import t5_lengths

    return cfg.data.target_len or t5_lengths(cfg.data.seq_len)[1]


def plan_speed(
    cfg,
    devices: int,
    device_memory: str,
    gpus_per_node: int,
    n_micro,
    max_pp,
    hw: Hardware,
    tokens,
    max_cp: int | None = None,
) -> int:
    """``candidates`` for the run config ``cfg``, priced; under fault tolerance ``devices`` are one
    replica group's, and the groups' cost is added (replicas.py)."""
    fits = candidates(cfg, devices, device_memory, gpus_per_node, n_micro, max_pp, max_cp)
    replicas = Replicas.of(cfg.fault_tolerance)
    if replicas is not None:
        fits = [e for e in fits if ft_runnable(e)]
    if not fits:
        return 1
    return speed_report(cfg, fits, hw, cfg.data.seq_len, _target(cfg), tokens, replicas)


def calibrate_main(path: str) -> int:
    import tempfile

    import torch

    from .calibrate import calibrate

    if torch.cuda.is_available():  # this machine's GPU (calibrate_gpu.py); a CPU-only one measures the CPU
        return calibrate_gpu_main(path)

    with tempfile.TemporaryDirectory() as tmp:
        hw = calibrate(path, Path(tmp))
    print(
        f"wrote {path}: fp32 peak {hw.peak['fp32'] / 1e9:.1f} GFLOP/s (gemm_half {hw.gemm_half:.0f}), memory "
        f"{hw.hbm_bandwidth / 1e9:.1f} GB/s, gloo {hw.intra_bandwidth / 1e9:.2f} GB/s + {hw.intra_latency * 1e6:.0f} us "
        f"per hop; host {hw.op_overhead * 1e6:.1f} us per op, {hw.dtensor_op_overhead * 1e6:.0f} us more on a DTensor "
        f"under TP ({hw.dtensor_optimizer_overhead * 1e6:.0f} in the optimizer), {hw.fsdp_unit_overhead * 1e3:.2f} ms "
        f"per FSDP2 module and micro-batch ({hw.fsdp_local_overhead * 1e3:.2f} on a 1-rank group); with every "
        f"core at work, GEMMs at {hw.shared_gemm:.2f} of their rate and "
        f"{(hw.hbm_bandwidth_shared or hw.hbm_bandwidth) / 1e9:.1f} GB/s of memory each; "
        f"use it with: tformer plan CONFIG --gpu {path}"
    )
    return 0


def calibrate_gpu_main(path: str, measure=None) -> int:
    """``--calibrate`` on a CUDA device (calibrate_gpu.py; ``measure``: the measuring object)."""
    from .calibrate_gpu import calibrate_gpu

    hw = calibrate_gpu(path, measure)
    bias = [row for row in hw.attention_rate if row[1] == 1]
    print(
        f"wrote {path}: bf16 peak {hw.peak['bf16'] / 1e12:.0f} TFLOP/s (gemm_half {hw.gemm_half:.0f}), tf32 "
        f"{hw.peak['tf32'] / 1e12:.0f}, fp32 {hw.peak['fp32'] / 1e12:.1f}; HBM {hw.hbm_bandwidth / 1e12:.2f} TB/s; "
        f"SDPA causal/bias/plain at {int(bias[0][0])} tokens "
        + "/".join(f"{row[2] / 1e12:.0f}" for row in hw.attention_rate[:3])
        + f" TFLOP/s; host {hw.op_overhead * 1e6:.1f} us per op; use it with: tformer plan CONFIG --gpu {path}"
    )
    return 0
