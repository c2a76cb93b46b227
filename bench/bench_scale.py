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

    .venv/bin/python bench/bench_scale.py [--part memory|ac|throughput] [--micro 8 --seq 256 --rounds 2]
"""
from __future__ import annotations

import argparse
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

MODEL_50M = ["model.preset=gpt2-tiny", "model.vocab_size=16384", "model.d_model=512", "model.num_layers=12",
             "model.num_heads=8", "model.d_ff=2048", "model.max_seq_len=256", "data.tokenizer_vocab_size=8192"]
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


def _worker(rank, world, port, jobs, out, cache):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), TFORMER_CACHE=cache, TFORMER_DIST_TIMEOUT="600")
    torch.set_num_threads(1)
    import torch.distributed as dist

    from tformer.parallel.memory import model_state_bytes
    from tformer.parallel.strategy import param_counts
    from tformer.train.config import load_config
    from tformer.train.trainer import Trainer
    for name, overrides, steps in jobs:
        cfg = load_config(ROOT / "configs" / "gpt2-tiny.yaml", overrides + [f"output_dir={out}/{name}",
                                                                            f"max_steps={steps}"])
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
    return [*MODEL_50M, "data.seq_len=16", "micro_batch_size=1", f"precision={precision}", "eval_every=0",
            "save_every=0", "eval_batches=1", "progress=false", "log_every=1000", "resume=none"]


# DeepSpeed in pure fp32 still clones the parameter partition into a separate fp32 master copy
# (4Ψ/N more than the paper's fp32 variant), and ZeRO-1 frees the full gradients once they are
# reduced into the partition (measured after backward, as here). Bytes per Ψ for N ranks:
from tformer.parallel.plan import DEEPSPEED_FP32_AS_BUILT as AS_BUILT_FP32  # noqa: E402


def memory_part(tmp: str, cache: str, precisions=("bf16", "fp32")) -> None:
    from tformer.parallel.plan import model_state_bytes as formula
    n = 2
    for precision in precisions:
        jobs = [(f"{name}-{precision}", common(precision) + flags, 2) for name, flags in STRATEGIES.items()]
        run_two(jobs, tmp, cache)
        master = " mixed (fp32 master)" if precision == "bf16" else ""
        print(f"\n=== model-state memory per rank, {precision}{master}, N=2 ===")
        print(f"{'strategy':<8}{'Ψ (params)':>14}{'measured MB':>14}{'formula MB':>13}{'ratio':>8}  formula"
              f"{'':<18}DeepSpeed buckets (not model state)")
        for name in STRATEGIES:
            state, total, _, buckets = open(f"{tmp}/{name}-{precision}.txt").read().split()
            state, total, buckets = int(state), int(total), int(buckets)
            mixed = precision == "bf16"
            # our ddp / fsdp keep fp32 params and autocast: 16Ψ and 16Ψ/N in both precisions
            key = {"ddp": "ddp", "fsdp": "fsdp"}.get(name, name)
            want = formula(key if name != "ddp" else "ddp", total, n, mixed and name.startswith("zero"))
            text = {"ddp": "16Ψ", "fsdp": "16Ψ/N", "zero1": "4Ψ+12Ψ/N" if mixed else "8Ψ+8Ψ/N",
                    "zero2": "2Ψ+14Ψ/N" if mixed else "4Ψ+12Ψ/N", "zero3": "16Ψ/N"}[name]
            ratio = state / want
            verdict = f"{text} {'PASS' if abs(ratio - 1) <= 0.15 else 'MISS'}"
            extra = f"{buckets / 2**20:.0f} MB" if buckets else ""
            print(f"{name:<8}{total:>14,}{state / 2**20:>14.1f}{want / 2**20:>13.1f}{ratio:>8.3f}  {verdict:<22}{extra}")
            if not mixed and name in AS_BUILT_FP32:  # DeepSpeed keeps a separate fp32 master partition
                text, per_psi = AS_BUILT_FP32[name]
                built = per_psi(n) * total
                print(f"{'':<8}{'':>14}{'':>14}{built / 2**20:>13.1f}{state / built:>8.3f}  {text} (DeepSpeed as "
                      "built: an fp32 master copy of the partition even in fp32)")


def _activation_peak_tracker():
    """torch's MemTracker (tensor bytes by category, per op), extended to keep the running maximum
    of activation + temporary bytes: the peak activation memory, wherever in forward or backward
    it occurs (MemTracker itself only snapshots the moment of the peak *total*)."""
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    class Tracker(MemTracker):
        peak_activations = 0

        def _update_peak_stats(self, peak_state):
            super()._update_peak_stats(peak_state)
            for snap in self._curr_mem_snap.values():
                now = snap.get(_MemRefType.ACT, 0) + snap.get(_MemRefType.TEMP, 0)
                self.peak_activations = max(self.peak_activations, now)
    return Tracker()


def ac_part(rounds: int = 3, d_model: int = 512, batch: int = 2) -> None:
    from tformer import build_model
    from tformer.parallel.ac import apply_activation_checkpointing
    from tformer.parallel.memory import SavedActivations
    torch.set_num_threads(1)  # steadier on a shared machine
    torch.manual_seed(0)
    model = build_model("gpt2-tiny", vocab_size=8192, d_model=d_model, num_layers=12, num_heads=8,
                        d_ff=4 * d_model, max_seq_len=512, dropout=0.0)
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
        tracker = _activation_peak_tracker()
        tracker.track_external(model, opt)
        with tracker, SavedActivations() as saved:
            model(ids, labels=ids).loss.backward()
        opt.zero_grad(set_to_none=True)
        memory[mode] = (tracker.peak_activations, max(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
                                                      .values()), saved.bytes)
    for _ in range(rounds):  # step time, interleaved, untracked
        for mode in ("none", "full"):
            times[mode].append(step(mode))
    (a_none, p_none, s_none), (a_full, p_full, s_full) = memory["none"], memory["full"]
    t_none, t_full = statistics.median(times["none"]), statistics.median(times["full"])
    mb = 2 ** 20
    print(f"\n=== activation checkpointing: 12 layers, d {d_model}, seq 512, batch {batch}, fp32, 1 thread ===")
    print(f"peak activation memory (activations + temporaries, tensor bytes): none {a_none / mb:.0f} MB, "
          f"full AC {a_full / mb:.0f} MB -> {100 * (1 - a_full / a_none):.0f}% less (target >= 50%) "
          f"{'PASS' if a_full <= 0.5 * a_none else 'MISS'}")
    print(f"peak total (params + grads + AdamW states + activations): none {p_none / mb:.0f} MB, "
          f"full AC {p_full / mb:.0f} MB -> {100 * (1 - p_full / p_none):.0f}% less")
    print(f"saved for backward at the end of forward: none {s_none / mb:.0f} MB, full AC {s_full / mb:.0f} MB")
    print(f"step time (median of {rounds}): none {t_none:.2f}s, full AC {t_full:.2f}s -> "
          f"{100 * (t_full / t_none - 1):+.0f}% (target <= +40%) {'PASS' if t_full <= 1.4 * t_none else 'MISS'}")


def throughput_part(tmp: str, cache: str, micro: int = 8, seq: int = 256, steps: int = 5, rounds: int = 2,
                    names=("ddp", "fsdp", "zero2", "zero3")) -> None:
    rates = {n: [] for n in names}
    for r in range(rounds):  # interleaved rounds
        jobs = [(f"tp{r}-{name}", common("fp32") + {**STRATEGIES, **THROUGHPUT_ONLY}[name] + [f"micro_batch_size={micro}",
                                                                     f"data.seq_len={seq}"], steps)
                for name in names]
        run_two(jobs, tmp, cache)
        for name in names:
            rates[name].append(float(open(f"{tmp}/tp{r}-{name}.txt").read().split()[2]))
    print(f"\n=== step throughput, 2 processes x 1 thread, fp32, ~50M params, micro-batch {micro} x seq {seq} "
          f"per rank, median step of {steps - 2} (after 2 warm-up), best of {rounds} interleaved rounds ===")
    base = max(rates["ddp"])
    for name in names:
        ratio = max(rates[name]) / base
        print(f"{name:<16} {max(rates[name]):>8,.0f} tok/s  {ratio:.2f}x DDP"
              f"{'' if name == 'ddp' else ('  PASS' if ratio >= 0.8 else '  MISS')}"
              f"   (rounds: {', '.join(f'{x:,.0f}' for x in rates[name])})")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--part", choices=("memory", "ac", "throughput", "all"), default="all")
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


if __name__ == "__main__":
    main()
