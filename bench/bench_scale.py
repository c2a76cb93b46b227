"""Scale benchmark (2 CPU processes, gloo):

1. Model-state memory per rank (parameters + gradients + optimizer states, counted as tensor bytes,
   after a backward) for ddp, ZeRO-1/2/3 (DeepSpeed) and FSDP2 on a ~50M-parameter GPT, bf16 mixed
   precision and fp32, next to the ZeRO paper's formulas (and their fp32 variants). Target: within
   15%. DeepSpeed's gradient-reduction buckets are shown apart (communication buffers, not model
   state), and for fp32 also DeepSpeed's as-built formula (it keeps an fp32 master copy anyway).
2. Activation checkpointing on a 12-layer, seq-512, d-512 GPT (one process, fp32): peak activation
   memory tracked op by op (torch's MemTracker), peak total, bytes saved for backward, step time,
   AC vs none. Target: >= 50% less activation memory at <= 40% extra step time.
3. Step throughput of FSDP2 and DeepSpeed relative to DDP on 2 processes x 1 thread, fp32, ~50M
   params: the trainer's median step time after two warm-up steps, best of interleaved rounds
   (the machine is shared). Target: >= 0.8x.
4. The device mesh (``--part mesh``; 2 and 4 CPU processes, gloo, fp32) on an 8-layer, d-512 GPT at
   seq 512, one sequence per data-parallel rank, from real trainer runs: ddp (2 ranks), tp=2,
   tp=2 + sequence parallel (and torch's sequence parallel alone, without tformer's re-gather),
   dp_shard=2 x tp=2 (FSDP2, 4 ranks). Measured per rank: model states after a backward (as part
   1), bytes saved for backward by one training forward (saved-tensor hooks, unique storages, each
   DTensor's local shard), the trainer's step time. Targets: model states within 5% of the formula
   (16 bytes per TP-local parameter / dp_shard); SP's saved activations <= 0.6x of tp=2 without SP;
   ``tformer plan``'s rank_memory total within 15% of the measured per-rank peak, taken as model
   states + saved activations (tensor bytes: what a rank holds at the end of forward, plus its
   gradients); tp=2 throughput against DDP printed (informational).

5. Pipeline parallelism (``--part pipeline``; 2 CPU processes, gloo, fp32) on the same 8-layer GPT
   at pp=2 with 4 micro-batches per step, for gpipe, 1f1b and interleaved 1f1b (2 stages per rank),
   and the same model on one process: per rank, the model states after a step against the
   planner's ``rank_memory(pp=2, pp_rank=r)``, the peak of live saved activations during one
   schedule step (saved-tensor hooks; a saved storage counts from its save until autograd frees it,
   so the micro-batches a schedule keeps in flight show) against the planner's in-flight estimate,
   both within 15%; each schedule's step time against the 1-process step (informational on CPU).

6. Context parallelism (``--part cp``; 1, 2 and 4 CPU processes, gloo, fp32): bytes autograd saves
   for backward per rank (saved-tensor hooks, unique storages, parameters excluded) in one training
   forward of a narrow 2-layer model, d 64: a decoder (Llama flavour) at seq 8192 and T5 at encoder
   4096 / decoder 1024 tokens, one sequence, cp=2 and cp=4 against the same model on one process
   (local attention), plus the time of that forward + backward (informational). Targets: cp=2 <=
   0.55x and cp=4 <= 0.30x of cp=1 for both. Measured (AVX2 CPU, 2026-11-24): decoder 91.5 MB ->
   0.522x / 0.261x; T5 726 MB -> 0.033x / 0.016x, because one process builds T5's (heads, S, S)
   relative bias and mask whole (~0.7 GB at 4096), which the chunk-pair path never does.

7. Context parallelism's reach (``--part cp`` after 6, or ``--part cp-length`` alone; 1, 2 and 4 CPU
   processes): the longest sequence a tiny Llama (d 64, 2 layers, GQA) trains within a fixed budget
   of activation + temporary bytes per rank (MemTracker's running peak over one forward + backward,
   the gathered K/V included), searched by doubling and bisection to 2%; target cp=4 >= 3.5x cp=1.
   Then ``tformer plan``'s per-rank activations (``plan.cp_activation_bytes``) against the measured
   peak at seq 8192 for cp 1, 2, 4 (within 15%), and the step time of cp=2 against one process
   (informational). Measured (AVX2 CPU, 2026-11-25): longest 3,904 / 7,424 / 14,848 tokens (cp=4:
   3.80x); plan / measured peak 0.943 / 0.982 / 1.054; step 1.89 s / 1.11 s (cp=1 / cp=2).

    .venv/bin/python bench/bench_scale.py [--part memory|ac|throughput|mesh|pipeline|cp|cp-length]
        [--micro 8 --seq 256 --rounds 2]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL_50M = [
    "model.preset=gpt2-tiny",
    "model.vocab_size=16384",
    "model.d_model=512",
    "model.num_layers=12",
    "model.num_heads=8",
    "model.d_ff=2048",
    "model.max_seq_len=256",
    "data.tokenizer_vocab_size=8192",
]
STRATEGIES = {
    "ddp": ["parallel.strategy=ddp"],
    "zero1": ["parallel.strategy=deepspeed", f"parallel.deepspeed_config={ROOT}/configs/deepspeed/zero1.json"],
    "zero2": ["parallel.strategy=deepspeed", f"parallel.deepspeed_config={ROOT}/configs/deepspeed/zero2.json"],
    "zero3": ["parallel.strategy=deepspeed", f"parallel.deepspeed_config={ROOT}/configs/deepspeed/zero3.json"],
    "fsdp": ["parallel.strategy=fsdp"],
}
THROUGHPUT_ONLY = {"fsdp-no-reshard": ["parallel.strategy=fsdp", "parallel.reshard_after_forward=false"]}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _become_rank(rank, world, port, cache):
    """The environment torchrun would give rank ``rank`` of ``world``, one thread each."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TFORMER_CACHE=cache,
        TFORMER_DIST_TIMEOUT="600",
    )
    torch.set_num_threads(1)


def _worker(rank, world, port, jobs, out, cache):
    _become_rank(rank, world, port, cache)
    import torch.distributed as dist

    from tformer.parallel.memory import model_state_bytes
    from tformer.parallel.strategy import param_counts
    from tformer.train.config import load_config
    from tformer.train.trainer import Trainer

    for name, overrides, steps in jobs:
        cfg = load_config(
            ROOT / "configs" / "gpt2-tiny.yaml", overrides + [f"output_dir={out}/{name}", f"max_steps={steps}"]
        )
        step_times = []  # the trainer's own step time (no evaluation or checkpoint in it)
        t = Trainer(cfg, callbacks=[lambda tr, rec, times=step_times: times.append(rec["step_time"])])
        t.fit()
        # Peak model state: parameters, optimizer states *and* gradients, i.e. after a backward
        # (the trainer frees gradients after each step).
        batch = t.data.collator([t.data.train[i] for i in range(cfg.micro_batch_size)])
        with t._autocast():
            loss = t.wrapped(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        t.strategy.backward(loss, True, None)
        local, total = param_counts(t.model)
        buffers = {}
        state = model_state_bytes(t.model, t.optimizer, buffers)
        # tokens/s of the median step after two warm-up steps
        tokens = cfg.micro_batch_size * cfg.grad_accum * cfg.data.seq_len * world
        rate = tokens / statistics.median(step_times[2:] or step_times)
        if rank == 0:
            with open(f"{out}/{name}.txt", "w") as f:
                f.write(f"{state} {total} {rate} {sum(buffers.values())}\n")
    dist.barrier()
    dist.destroy_process_group()


def run_two(jobs, out, cache):
    mp.start_processes(_worker, args=(2, _port(), jobs, out, cache), nprocs=2, join=True, start_method="spawn")


def common(precision: str) -> list[str]:
    return [
        *MODEL_50M,
        "data.seq_len=16",
        "micro_batch_size=1",
        f"precision={precision}",
        "eval_every=0",
        "save_every=0",
        "eval_batches=1",
        "progress=false",
        "log_every=1000",
        "resume=none",
    ]


# DeepSpeed in pure fp32 still clones the parameter partition into a separate fp32 master copy
# (4Ψ/N more than the paper's fp32 variant), and ZeRO-1 frees the full gradients once they are
# reduced into the partition (measured after backward, as here). Bytes per Ψ for N ranks:
from tformer.parallel.memory import activation_peak_tracker  # noqa: E402
from tformer.plan.states import DEEPSPEED_FP32_AS_BUILT as AS_BUILT_FP32  # noqa: E402


def memory_part(tmp: str, cache: str, precisions=("bf16", "fp32")) -> None:
    from tformer.plan.states import model_state_bytes as formula

    n = 2
    for precision in precisions:
        jobs = [(f"{name}-{precision}", common(precision) + flags, 2) for name, flags in STRATEGIES.items()]
        run_two(jobs, tmp, cache)
        master = " mixed (fp32 master)" if precision == "bf16" else ""
        print(f"\n=== model-state memory per rank, {precision}{master}, N=2 ===")
        print(
            f"{'strategy':<8}{'Ψ (params)':>14}{'measured MB':>14}{'formula MB':>13}{'ratio':>8}  formula"
            f"{'':<18}DeepSpeed buckets (not model state)"
        )
        for name in STRATEGIES:
            state, total, _, buckets = open(f"{tmp}/{name}-{precision}.txt").read().split()
            state, total, buckets = int(state), int(total), int(buckets)
            mixed = precision == "bf16"
            # our ddp / fsdp keep fp32 params and autocast: 16Ψ and 16Ψ/N in both precisions
            key = {"ddp": "ddp", "fsdp": "fsdp"}.get(name, name)
            want = formula(key if name != "ddp" else "ddp", total, n, mixed and name.startswith("zero"))
            text = {
                "ddp": "16Ψ",
                "fsdp": "16Ψ/N",
                "zero1": "4Ψ+12Ψ/N" if mixed else "8Ψ+8Ψ/N",
                "zero2": "2Ψ+14Ψ/N" if mixed else "4Ψ+12Ψ/N",
                "zero3": "16Ψ/N",
            }[name]
            ratio = state / want
            verdict = f"{text} {'PASS' if abs(ratio - 1) <= 0.15 else 'MISS'}"
            extra = f"{buckets / 2**20:.0f} MB" if buckets else ""
            print(f"{name:<8}{total:>14,}{state / 2**20:>14.1f}{want / 2**20:>13.1f}{ratio:>8.3f}  {verdict:<22}{extra}")
            if not mixed and name in AS_BUILT_FP32:  # DeepSpeed keeps a separate fp32 master partition
                text, per_psi = AS_BUILT_FP32[name]
                built = per_psi(n) * total
                print(
                    f"{'':<8}{'':>14}{'':>14}{built / 2**20:>13.1f}{state / built:>8.3f}  {text} (DeepSpeed as "
                    "built: an fp32 master copy of the partition even in fp32)"
                )


def ac_part(rounds: int = 3, d_model: int = 512, batch: int = 2) -> None:
    from tformer import build_model
    from tformer.parallel.ac import apply_activation_checkpointing
    from tformer.parallel.memory import SavedActivations

    torch.set_num_threads(1)  # steadier on a shared machine
    torch.manual_seed(0)
    model = build_model(
        "gpt2-tiny",
        vocab_size=8192,
        d_model=d_model,
        num_layers=12,
        num_heads=8,
        d_ff=4 * d_model,
        max_seq_len=512,
        dropout=0.0,
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 8192, (batch, 512))
    times = {"none": [], "full": []}
    memory = {}

    def step(mode):
        apply_activation_checkpointing(model, mode)
        t0 = time.perf_counter()
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    step("none")  # warm-up; AdamW's states exist from here on
    for mode in ("none", "full"):  # memory: one forward + backward per mode, tracked op by op
        apply_activation_checkpointing(model, mode)
        tracker = activation_peak_tracker()
        tracker.track_external(model, opt)
        with tracker, SavedActivations() as saved:
            model(ids, labels=ids).loss.backward()
        opt.zero_grad(set_to_none=True)
        memory[mode] = (
            tracker.peak_activations,
            max(tracker.get_tracker_snapshot("peak")[torch.device("cpu")].values()),
            saved.bytes,
        )
    for _ in range(rounds):  # step time, interleaved, untracked
        for mode in ("none", "full"):
            times[mode].append(step(mode))
    (a_none, p_none, s_none), (a_full, p_full, s_full) = memory["none"], memory["full"]
    t_none, t_full = statistics.median(times["none"]), statistics.median(times["full"])
    mb = 2**20
    print(f"\n=== activation checkpointing: 12 layers, d {d_model}, seq 512, batch {batch}, fp32, 1 thread ===")
    print(
        f"peak activation memory (activations + temporaries, tensor bytes): none {a_none / mb:.0f} MB, "
        f"full AC {a_full / mb:.0f} MB -> {100 * (1 - a_full / a_none):.0f}% less (target >= 50%) "
        f"{'PASS' if a_full <= 0.5 * a_none else 'MISS'}"
    )
    print(
        f"peak total (params + grads + AdamW states + activations): none {p_none / mb:.0f} MB, "
        f"full AC {p_full / mb:.0f} MB -> {100 * (1 - p_full / p_none):.0f}% less"
    )
    print(f"saved for backward at the end of forward: none {s_none / mb:.0f} MB, full AC {s_full / mb:.0f} MB")
    print(
        f"step time (median of {rounds}): none {t_none:.2f}s, full AC {t_full:.2f}s -> "
        f"{100 * (t_full / t_none - 1):+.0f}% (target <= +40%) {'PASS' if t_full <= 1.4 * t_none else 'MISS'}"
    )


def throughput_part(
    tmp: str,
    cache: str,
    micro: int = 8,
    seq: int = 256,
    steps: int = 5,
    rounds: int = 2,
    names=("ddp", "fsdp", "zero2", "zero3"),
) -> None:
    rates = {n: [] for n in names}
    for r in range(rounds):  # interleaved rounds
        jobs = [
            (
                f"tp{r}-{name}",
                common("fp32")
                + {**STRATEGIES, **THROUGHPUT_ONLY}[name]
                + [f"micro_batch_size={micro}", f"data.seq_len={seq}"],
                steps,
            )
            for name in names
        ]
        run_two(jobs, tmp, cache)
        for name in names:
            rates[name].append(float(open(f"{tmp}/tp{r}-{name}.txt").read().split()[2]))
    print(
        f"\n=== step throughput, 2 processes x 1 thread, fp32, ~50M params, micro-batch {micro} x seq {seq} "
        f"per rank, median step of {steps - 2} (after 2 warm-up), best of {rounds} interleaved rounds ==="
    )
    base = max(rates["ddp"])
    for name in names:
        ratio = max(rates[name]) / base
        print(
            f"{name:<16} {max(rates[name]):>8,.0f} tok/s  {ratio:.2f}x DDP"
            f"{'' if name == 'ddp' else ('  PASS' if ratio >= 0.8 else '  MISS')}"
            f"   (rounds: {', '.join(f'{x:,.0f}' for x in rates[name])})"
        )


MESH_MODEL = [
    "model.preset=gpt2-tiny",
    "model.vocab_size=8192",
    "model.d_model=512",
    "model.num_layers=8",
    "model.num_heads=8",
    "model.d_ff=2048",
    "model.max_seq_len=512",
    "model.dropout=0.0",
    "data.tokenizer_vocab_size=8192",
    "data.seq_len=512",
    "micro_batch_size=1",
    "precision=fp32",
    "eval_every=0",
    "save_every=0",
    "eval_batches=1",
    "progress=false",
    "log_every=1000",
    "resume=none",
]
# name: (ranks, overrides, torch's sequence parallel alone: without tformer's re-gather in backward)
MESH_LAYOUTS = {
    "ddp": (2, ["parallel.strategy=ddp"], False),
    "tp2": (2, ["parallel.strategy=ddp", "parallel.tp=2", "parallel.sp=false"], False),
    "tp2+sp": (2, ["parallel.strategy=ddp", "parallel.tp=2", "parallel.sp=true"], False),
    "tp2+sp (torch alone)": (2, ["parallel.strategy=ddp", "parallel.tp=2", "parallel.sp=true"], True),
    "dp_shard2 x tp2+sp": (4, ["parallel.strategy=fsdp", "parallel.dp_shard=2", "parallel.tp=2", "parallel.sp=true"], False),
}


def _mesh_worker(rank, world, port, jobs, out, cache):
    import json

    _become_rank(rank, world, port, cache)
    import torch.distributed as dist

    import tformer.parallel.tp as tp_module
    from tformer.models.padding import pad_sequences
    from tformer.parallel.memory import SavedActivations, model_state_bytes
    from tformer.plan.activations import _block_parts
    from tformer.plan.memory import rank_memory, training_memory
    from tformer.parallel.strategy import param_counts
    from tformer.train.config import load_config
    from tformer.train.trainer import Trainer

    keep = tp_module.keep_gathered_inputs_sharded
    for index, (_name, overrides, steps, torch_sp_alone) in enumerate(jobs):
        tp_module.keep_gathered_inputs_sharded = (lambda *a: 0) if torch_sp_alone else keep
        cfg = load_config(
            ROOT / "configs" / "gpt2-tiny.yaml", overrides + [f"output_dir={out}/mesh{index}", f"max_steps={steps}"]
        )
        step_times = []
        t = Trainer(cfg, callbacks=[lambda tr, rec, times=step_times: times.append(rec["step_time"])])
        t.fit()
        # one more training forward + backward, as the trainer runs it, counting what it saves
        batch = t.data.collator([t.data.train[i] for i in range(cfg.micro_batch_size)])
        inputs = {"input_ids": batch["input_ids"], "labels": batch["labels"]}
        if t.dims.tp > 1 and cfg.parallel.sp:
            inputs = pad_sequences(inputs, t.dims.tp, t.model_cfg.pad_token_id, "decoder")
        with t.strategy.loss_context():
            with SavedActivations() as saved:
                loss = t.wrapped(**inputs, return_logits=False).loss
            t.strategy.backward(loss, True, None)
        local, _ = param_counts(t.model)
        states = model_state_bytes(t.model, t.optimizer)
        pcfg = cfg.parallel
        plan = rank_memory(
            t.model_cfg,
            seq_len=inputs["input_ids"].shape[1],
            micro_batch=cfg.micro_batch_size,
            dp_shard=t.dims.dp_shard,
            tp=t.dims.tp,
            sp=pcfg.sp and t.dims.tp > 1,
            precision="fp32",
            strategy=pcfg.strategy,
            loss_parallel=pcfg.loss_parallel,
            **training_memory(cfg),
        )
        # what tensor parallelism already splits by tp, whatever SP does: q, k, v, attention, the
        # FFN width (every block) and the vocabulary-sharded log-softmax: SP's floor
        _, _, heads = _block_parts(t.model_cfg, inputs["input_ids"].shape[1], tp=t.dims.tp)
        split = rank_memory(
            t.model_cfg,
            seq_len=inputs["input_ids"].shape[1],
            tp=t.dims.tp,
            precision="fp32",
            strategy=pcfg.strategy,
            **training_memory(cfg),
        ).activations
        split -= rank_memory(
            t.model_cfg,
            seq_len=inputs["input_ids"].shape[1],
            tp=t.dims.tp,
            precision="fp32",
            strategy=pcfg.strategy,
            transient=False,
            **training_memory(cfg),
        ).activations
        split += t.model_cfg.num_layers * inputs["input_ids"].numel() * heads / t.dims.tp * 4
        tokens = cfg.micro_batch_size * cfg.grad_accum * cfg.data.seq_len * t.dims.dp_size
        Path(f"{out}/mesh{index}.rank{rank}.json").write_text(
            json.dumps(
                {
                    "states": states,
                    "local_params": local,
                    "saved": saved.bytes,
                    "plan_states": plan.model_states,
                    "plan_activations": plan.activations,
                    "floor": split,
                    "rate": tokens / statistics.median(step_times[2:] or step_times),
                }
            )
        )
        dist.barrier()
    dist.destroy_process_group()


def mesh_part(tmp: str, cache: str, steps: int = 5) -> None:
    """The device mesh's memory and throughput, per rank (module doc, part 4)."""
    import json

    names = list(MESH_LAYOUTS)
    for world in (2, 4):
        jobs = [
            (name, MESH_MODEL + MESH_LAYOUTS[name][1], steps, MESH_LAYOUTS[name][2])
            for name in names
            if MESH_LAYOUTS[name][0] == world
        ]
        mp.start_processes(
            _mesh_worker,
            args=(world, _port(), jobs, f"{tmp}/w{world}", cache),
            nprocs=world,
            join=True,
            start_method="spawn",
        )
    got = {}
    for name in names:
        world = MESH_LAYOUTS[name][0]
        index = [n for n in names if MESH_LAYOUTS[n][0] == world].index(name)
        ranks = [json.loads(Path(f"{tmp}/w{world}/mesh{index}.rank{r}.json").read_text()) for r in range(world)]
        got[name] = {k: max(r[k] for r in ranks) for k in ranks[0]}  # the fullest rank
    mb = 2**20

    def verdict(ok):
        return "PASS" if ok else "MISS"

    print(
        f"\n=== device mesh: GPT d 512, 8 layers, seq 512, vocab 8192, fp32, 1 sequence per dp rank, "
        f"{steps} trainer steps, per rank (the fullest), tensor bytes ==="
    )
    print(
        f"{'layout':<22}{'states MB':>10}{'16Ψ/N MB':>10}{'ratio':>7}{'saved MB':>10}{'peak MB':>9}{'plan MB':>9}"
        f"{'ratio':>7}{'tok/s':>8}"
    )
    for name in names:
        g = got[name]
        exact = 16 * g["local_params"]  # fp32 parameter, gradient, AdamW m and v of each local element
        peak = g["states"] + g["saved"]
        plan = g["plan_states"] + g["plan_activations"]
        planned = "" if MESH_LAYOUTS[name][2] else f"{plan / mb:>9.1f}{plan / peak:>7.3f}"  # plans tformer's SP
        print(
            f"{name:<22}{g['states'] / mb:>10.1f}{g['plan_states'] / mb:>10.1f}{g['states'] / g['plan_states']:>7.3f}"
            f"{g['saved'] / mb:>10.1f}{peak / mb:>9.1f}{planned:>16}{g['rate']:>8.0f}"
        )
        got[name].update(exact=exact, peak=peak, plan=plan)
    print("\ntargets:")
    for name in ("tp2", "dp_shard2 x tp2+sp"):
        g = got[name]
        r, e = g["states"] / g["plan_states"], g["states"] / g["exact"]
        print(
            f"  model states per rank, {name}: {r:.3f}x the formula (rank_memory; exact per-rank count "
            f"16 x {g['local_params']:,} local elements: {e:.3f}x), target within 5%: {verdict(abs(r - 1) <= 0.05)}"
        )
    sp, no_sp, alone, ddp = (got[n]["saved"] for n in ("tp2+sp", "tp2", "tp2+sp (torch alone)", "ddp"))
    print(
        f"  saved activations per rank, tp=2 with SP against without: {sp / no_sp:.3f}x (target <= 0.6x): "
        f"{verdict(sp <= 0.6 * no_sp)}; torch's SP alone {alone / no_sp:.3f}x; against no TP (a DDP rank, same "
        f"micro-batch): tp=2 {no_sp / ddp:.3f}x, tp=2 + SP {sp / ddp:.3f}x"
    )
    floor = got["tp2+sp"]["floor"]
    print(
        f"    (what tp=2 splits already, SP or not: q, k, v, attention, FFN width, sharded log-softmax = "
        f"{floor / mb:.1f} MB by the planner's formula, {floor / no_sp:.3f}x of tp=2 without SP: the least SP "
        "could reach at tp=2 if it kept nothing else)"
    )
    for name in ("tp2", "tp2+sp", "dp_shard2 x tp2+sp"):
        g = got[name]
        r = g["plan"] / g["peak"]
        print(
            f"  tformer plan against the measured peak, {name}: {r:.3f}x (target within 15%): {verdict(abs(r - 1) <= 0.15)}"
        )
    ratio = got["tp2"]["rate"] / got["ddp"]["rate"]
    print(f"  step throughput, tp=2 against DDP on 2 processes (tokens/s; informational): {ratio:.2f}x")


PP_LAYOUTS = {  # name: (ranks, overrides)
    "1 process": (1, ["grad_accum=4"]),
    "pp2 gpipe": (2, ["parallel.pp=2", "parallel.pp_schedule=gpipe", "grad_accum=4"]),
    "pp2 1f1b": (2, ["parallel.pp=2", "parallel.pp_schedule=1f1b", "grad_accum=4"]),
    "pp2 interleaved": (
        2,
        ["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_stages_per_rank=2", "grad_accum=4"],
    ),
}


class LiveSaved:
    """Peak bytes of activations saved for backward and not yet freed (unique storages, this rank's
    part of a DTensor; parameters excluded)."""

    def __init__(self):
        self.live: dict[int, list] = {}
        self.current = self.peak = 0

    def _pack(self, t):
        import weakref

        from tformer.parallel.memory import local_part

        if isinstance(t if t._base is None else t._base, torch.nn.Parameter):
            return t
        storage = local_part(t).untyped_storage()
        key = storage.data_ptr()
        entry = self.live.setdefault(key, [0, storage.nbytes()])
        if entry[0] == 0:
            self.current += entry[1]
            self.peak = max(self.peak, self.current)
        entry[0] += 1
        box = _Box(t)
        weakref.finalize(box, self._release, key)
        return box

    def _release(self, key):
        entry = self.live[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.current -= entry[1]
            del self.live[key]

    def __enter__(self):
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda b: b.t if isinstance(b, _Box) else b)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)


class _Box:
    __slots__ = ("t", "__weakref__")

    def __init__(self, t):
        self.t = t


def _pp_worker(rank, world, port, jobs, out, cache):
    import json

    _become_rank(rank, world, port, cache)
    import torch.distributed as dist

    from tformer.parallel.memory import model_state_bytes
    from tformer.plan import rank_memory
    from tformer.plan.memory import training_memory
    from tformer.train.config import load_config
    from tformer.train.trainer import Trainer, _concat

    for index, overrides in enumerate(jobs):
        cfg = load_config(
            ROOT / "configs" / "gpt2-tiny.yaml",
            MESH_MODEL + overrides + [f"output_dir={out}/pp{index}", "max_steps=4", "loss.chunk_size=null"],
        )
        step_times: list = []
        t = Trainer(cfg, callbacks=[lambda tr, rec, times=step_times: times.append(rec["step_time"])])
        t.fit()
        batches = [
            t.data.collator([t.data.train[i + k * cfg.micro_batch_size] for i in range(cfg.micro_batch_size)])
            for k in range(cfg.grad_accum)
        ]
        inputs = _concat([{"input_ids": b["input_ids"], "labels": b["labels"]} for b in batches])
        if t.dims.pp > 1:
            # fit() ended with an evaluation: torch's schedule re-infers its stages' metadata on the
            # next training step (eval -> train) with a real forward whose graph it keeps; one step
            # first, so the measured one is a training step like every other
            t.strategy.pipeline.step(inputs)
            t.optimizer.zero_grad(set_to_none=True)
        with LiveSaved() as live:
            if t.dims.pp > 1:
                t.strategy.pipeline.step(inputs)
            else:
                for b in batches:
                    (
                        t.wrapped(input_ids=b["input_ids"], labels=b["labels"], return_logits=False).loss / cfg.grad_accum
                    ).backward()
        states = model_state_bytes(t.model, t.optimizer)
        pcfg = cfg.parallel
        plan = rank_memory(
            t.model_cfg,
            seq_len=cfg.data.seq_len,
            micro_batch=cfg.micro_batch_size,
            precision="fp32",
            strategy=pcfg.strategy,
            pp=t.dims.pp,
            pp_schedule=pcfg.pp_schedule,
            pp_stages_per_rank=pcfg.pp_stages_per_rank,
            n_micro=cfg.grad_accum,
            pp_rank=t.dims.pp_rank(rank),
            **training_memory(cfg),
        )
        Path(f"{out}/pp{index}.rank{rank}.json").write_text(
            json.dumps(
                {
                    "states": states,
                    "saved_peak": live.peak,
                    "plan_states": plan.model_states,
                    "plan_activations": plan.activations,
                    "in_flight": getattr(plan, "in_flight", None),
                    "step": statistics.median(step_times[1:] or step_times),
                }
            )
        )
        if dist.is_initialized():
            dist.barrier()
    if dist.is_initialized():
        dist.destroy_process_group()


def pipeline_part(tmp: str, cache: str) -> None:
    """Pipeline parallelism's per-rank memory against the planner, and each schedule's step time
    (module doc, part 5)."""
    import json

    one = [o for n, (w, o) in PP_LAYOUTS.items() if w == 1]
    two = [o for n, (w, o) in PP_LAYOUTS.items() if w == 2]
    _pp_worker(0, 1, _port(), one, f"{tmp}/one", cache)
    mp.start_processes(_pp_worker, args=(2, _port(), two, f"{tmp}/two", cache), nprocs=2, join=True, start_method="spawn")
    mb = 2**20

    def verdict(ok):
        return "PASS" if ok else "MISS"

    base = json.loads(Path(f"{tmp}/one/pp0.rank0.json").read_text())
    print(
        "\n=== pipeline: GPT d 512, 8 layers, seq 512, vocab 8192, fp32, 4 micro-batches of 1 sequence per step, "
        "per rank ==="
    )
    print(
        f"{'layout':<18}{'rank':>5}{'states MB':>10}{'plan':>8}{'ratio':>7}{'act. peak MB':>13}{'plan':>8}{'ratio':>7}"
        f"{'in flight':>10}{'step s':>8}{'vs 1 proc':>10}"
    )
    misses = []
    for index, name in enumerate(n for n, (w, _) in PP_LAYOUTS.items() if w == 2):
        for rank in (0, 1):
            g = json.loads(Path(f"{tmp}/two/pp{index}.rank{rank}.json").read_text())
            rs, ra = g["states"] / g["plan_states"], g["saved_peak"] / g["plan_activations"]
            misses += [abs(1 / rs - 1) > 0.15, abs(1 / ra - 1) > 0.15]
            print(
                f"{name:<18}{rank:>5}{g['states'] / mb:>10.1f}{g['plan_states'] / mb:>8.1f}{1 / rs:>7.3f}"
                f"{g['saved_peak'] / mb:>13.1f}{g['plan_activations'] / mb:>8.1f}{1 / ra:>7.3f}"
                f"{g['in_flight'] if g['in_flight'] is not None else '-':>10}{g['step']:>8.2f}"
                f"{g['step'] / base['step']:>10.2f}"
            )
    print(
        f"{'1 process':<18}{0:>5}{base['states'] / mb:>10.1f}{'':>15}{base['saved_peak'] / mb:>13.1f}{'':>25}"
        f"{base['step']:>8.2f}{1.0:>10.2f}"
    )
    print(
        f"\ntargets: per-rank model states and activation peak within 15% of tformer plan (plan / measured): "
        f"{verdict(not any(misses))}; step times are informational on a shared 2-core CPU"
    )


CP_MODELS = {"decoder seq 8192": ("llama-tiny", 8192, None), "t5 enc 4096 / dec 1024": ("t5-tiny", 4096, 1024)}


def _cp_worker(rank, world, port, out, cache):
    """Saved bytes and forward + backward time of each CP_MODELS case on this rank (``world`` = cp)."""
    import json
    import time

    _become_rank(rank, world, port, cache)
    import torch.distributed as dist

    from tformer.models import build_model
    from tformer.parallel.context import apply_context_parallel, loss_tokens, shard_batch
    from tformer.parallel.memory import SavedActivations

    if world > 1:
        dist.init_process_group("gloo")
    report = {}
    for name, (preset, seq, target) in CP_MODELS.items():
        torch.manual_seed(0)
        model = build_model(preset, d_model=64, d_ff=128, num_layers=2, max_seq_len=seq, dropout=0.0)
        gen = torch.Generator().manual_seed(0)
        vocab = model.config.vocab_size
        batch = {"input_ids": torch.randint(1, vocab, (1, seq), generator=gen)}
        batch["labels"] = torch.randint(1, vocab, (1, target or seq), generator=gen)
        if world > 1:
            apply_context_parallel(model, dist.group.WORLD)
            batch = shard_batch(batch, rank, world, model.config)
            batch["loss_tokens"] = loss_tokens(batch["labels"], dist.group.WORLD)
        t0 = time.perf_counter()
        with SavedActivations() as saved:
            loss = model(**batch, return_logits=False).loss
        loss.backward()
        ok = bool(torch.isfinite(loss)) and all(p.grad is not None for p in model.parameters())
        report[name] = {"saved": saved.bytes, "time": time.perf_counter() - t0, "ok": ok}
    Path(f"{out}/cp{world}.rank{rank}.json").write_text(json.dumps(report))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def cp_part(tmp: str, cache: str) -> None:
    """Context parallelism's saved activations per rank against one process (module doc, part 6)."""
    import json

    _cp_worker(0, 1, _port(), tmp, cache)
    for world in (2, 4):
        mp.start_processes(_cp_worker, args=(world, _port(), tmp, cache), nprocs=world, join=True, start_method="spawn")
    runs = {w: [json.loads(Path(f"{tmp}/cp{w}.rank{r}.json").read_text()) for r in range(w)] for w in (1, 2, 4)}
    mb, limits, misses = 2**20, {2: 0.55, 4: 0.30}, []
    print("\n=== context parallelism: bytes saved for backward per rank (largest rank), fp32, d 64, 2 layers ===")
    print(f"{'model':<26}{'cp':>3}{'saved MB':>10}{'vs cp=1':>9}{'target':>8}{'fwd+bwd s':>11}{'ran':>5}")
    for name in CP_MODELS:
        base = runs[1][0][name]["saved"]
        for w in (1, 2, 4):
            saved = max(r[name]["saved"] for r in runs[w])
            ok = all(r[name]["ok"] for r in runs[w])
            ratio = saved / base
            if w > 1:
                misses.append(ratio > limits[w] or not ok)
            limit = f"<={limits[w]}" if w > 1 else ""
            seconds = max(r[name]["time"] for r in runs[w])
            print(f"{name:<26}{w:>3}{saved / mb:>10.1f}{ratio:>9.3f}{limit:>8}{seconds:>11.2f}{'yes' if ok else 'NO':>5}")
    print(
        f"\ntargets: cp=2 <= 0.55x and cp=4 <= 0.30x of cp=1, every run finite with every gradient: "
        f"{'PASS' if not any(misses) else 'MISS'}; times are informational on a shared 2-core CPU"
    )


# The longest sequence within a per-rank budget (module doc, part 7): a tiny Llama (d 64, 2 layers,
# GQA 4/2 heads, vocabulary 1024), one sequence, fp32, AC none, the unchunked loss-only head
CP_BUDGET = 48 * 2**20  # activation + temporary bytes per rank (MemTracker's running peak)
CP_PLAN_SEQ = 8192  # where tformer plan's per-rank activations are held against the measured peak


def _cp_model():
    from tformer.models import build_model

    torch.manual_seed(0)
    return build_model("llama-tiny", num_layers=2, max_seq_len=1 << 17, dropout=0.0, attn_dropout=0.0)


def _cp_step(model, seq, rank, world, track: bool):
    """(peak activation + temporary bytes of the largest rank, seconds) of one training forward +
    backward of one ``seq``-token sequence, this rank holding its cp shard of it."""
    import time

    import torch.distributed as dist

    from tformer.parallel.context import loss_tokens, shard_batch

    gen = torch.Generator().manual_seed(seq)
    vocab = model.config.vocab_size
    batch = {"input_ids": torch.randint(1, vocab, (1, seq), generator=gen)}
    batch["labels"] = torch.randint(1, vocab, (1, seq), generator=gen)
    if world > 1:
        batch = shard_batch(batch, rank, world, model.config)
        batch["loss_tokens"] = loss_tokens(batch["labels"], dist.group.WORLD)
    tracker = activation_peak_tracker() if track else contextlib.nullcontext()
    if track:
        tracker.track_external(model)
    t0 = time.perf_counter()
    with tracker:
        loss = model(**batch, return_logits=False).loss
        loss.backward()
    seconds = time.perf_counter() - t0
    ok = bool(torch.isfinite(loss)) and all(p.grad is not None for p in model.parameters())
    model.zero_grad(set_to_none=True)
    stats = torch.tensor([float(tracker.peak_activations if track else 0), seconds, 0.0 if ok else 1.0])
    if world > 1:
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    return stats[0].item(), stats[1].item(), stats[2].item() == 0


def _longest(model, rank, world) -> tuple[int, bool]:
    """The longest sequence (to 2%, a multiple of 2 cp) whose step stays within ``CP_BUDGET``:
    doubling, then bisection; every rank probes the same lengths (the ranks' largest peak decides)."""
    step = 2 * world
    fits = lambda n: _cp_step(model, n, rank, world, True)[0] <= CP_BUDGET  # noqa: E731
    lo, hi, ok = 0, 1024, True
    while fits(hi):
        lo, hi = hi, 2 * hi
    while hi - lo > max(step, lo // 50):
        mid = (lo + hi) // 2 // step * step
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo, ok


def _cp_length_worker(rank, world, port, out, cache):
    import json

    _become_rank(rank, world, port, cache)
    import torch.distributed as dist

    from tformer.parallel.context import apply_context_parallel

    if world > 1:
        dist.init_process_group("gloo")
    model = _cp_model()
    if world > 1:
        apply_context_parallel(model, dist.group.WORLD)
    peak, _, ok = _cp_step(model, CP_PLAN_SEQ, rank, world, True)
    _cp_step(model, CP_PLAN_SEQ, rank, world, False)  # warm-up for the timed step
    seconds = _cp_step(model, CP_PLAN_SEQ, rank, world, False)[1]
    longest, _ = _longest(model, rank, world)
    if rank == 0:
        report = {"peak": peak, "ok": ok, "seconds": seconds, "longest": longest}
        Path(f"{out}/cplen{world}.json").write_text(json.dumps(report))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def _planned_activations(cp: int) -> float:
    from tformer.plan.activations import activation_bytes
    from tformer.plan.memory import cp_activation_bytes

    cfg = _cp_model().config
    memory = {"return_logits": False, "chunk": None}
    if cp == 1:
        return activation_bytes(cfg, 1, CP_PLAN_SEQ, None, "none", False, **memory)
    return cp_activation_bytes(cfg, 1, CP_PLAN_SEQ, None, "none", False, cp, **memory)


def cp_length_part(tmp: str, cache: str) -> None:
    """The longest sequence per rank budget, tformer plan against the measured peak, step time
    (module doc, part 7)."""
    import json

    _cp_length_worker(0, 1, _port(), tmp, cache)
    for world in (2, 4):
        mp.start_processes(
            _cp_length_worker, args=(world, _port(), tmp, cache), nprocs=world, join=True, start_method="spawn"
        )
    runs = {w: json.loads(Path(f"{tmp}/cplen{w}.json").read_text()) for w in (1, 2, 4)}
    mb = 2**20
    print(
        f"\n=== context parallelism: the longest sequence within {CP_BUDGET / mb:.0f} MB of activations + temporaries "
        "per rank (MemTracker peak of one forward + backward), tiny Llama d 64, 2 layers, fp32 ==="
    )
    print(f"{'cp':>3}{'longest':>9}{'vs cp=1':>9}{'plan MB':>9}{'measured MB':>12}{'plan/meas':>10}{'step s':>8}{'ran':>5}")
    misses = []
    for w, r in runs.items():
        plan = _planned_activations(w)
        ratio = plan / r["peak"]
        misses.append(abs(ratio - 1) > 0.15 or not r["ok"])
        print(
            f"{w:>3}{r['longest']:>9}{r['longest'] / runs[1]['longest']:>9.2f}{plan / mb:>9.1f}{r['peak'] / mb:>12.1f}"
            f"{ratio:>10.3f}{r['seconds']:>8.2f}{'yes' if r['ok'] else 'NO':>5}"
        )
    reach = runs[4]["longest"] / runs[1]["longest"]
    print(f"longest sequence cp=4 / cp=1: {reach:.2f}x (target >= 3.5x) {'PASS' if reach >= 3.5 else 'MISS'}")
    print(
        f"tformer plan's per-rank activations at seq {CP_PLAN_SEQ} within 15% of the measured peak for cp 1, 2, 4: "
        f"{'PASS' if not any(misses) else 'MISS'}"
    )
    print(
        f"step time at seq {CP_PLAN_SEQ}: cp=2 {runs[2]['seconds']:.2f}s vs 1 process {runs[1]['seconds']:.2f}s "
        f"({runs[1]['seconds'] / runs[2]['seconds']:.2f}x; informational on a shared 2-core CPU)"
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument(
        "--part", choices=("memory", "ac", "throughput", "mesh", "pipeline", "cp", "cp-length", "all"), default="all"
    )
    p.add_argument("--precisions", default="bf16,fp32", help="memory part: bf16 (mixed) and/or fp32")
    p.add_argument("--micro", type=int, default=8, help="throughput part: micro-batch per rank")
    p.add_argument("--seq", type=int, default=256, help="throughput part: sequence length")
    p.add_argument("--steps", type=int, default=5, help="throughput part: steps per run (2 are warm-up)")
    p.add_argument("--rounds", type=int, default=2, help="throughput part: interleaved rounds")
    p.add_argument("--strategies", default="ddp,fsdp,zero2,zero3", help="throughput part (also: fsdp-no-reshard, zero1)")
    args = p.parse_args()
    cache = os.environ.get("TFORMER_CACHE") or str(Path.home() / ".cache" / "tformer")
    with tempfile.TemporaryDirectory() as tmp:
        if args.part in ("memory", "all"):
            memory_part(tmp, cache, tuple(args.precisions.split(",")))
        if args.part in ("ac", "all"):
            ac_part()
        if args.part in ("throughput", "all"):
            throughput_part(tmp, cache, args.micro, args.seq, args.steps, args.rounds, tuple(args.strategies.split(",")))
        if args.part in ("mesh", "all"):
            mesh_part(tmp, cache, args.steps)
        if args.part in ("pipeline", "all"):
            pipeline_part(tmp, cache)
        if args.part in ("cp", "all"):
            cp_part(tmp, cache)
            cp_length_part(tmp, cache)
        if args.part == "cp-length":
            cp_length_part(tmp, cache)


if __name__ == "__main__":
    main()
