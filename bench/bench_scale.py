"""Scale benchmark (2 CPU processes, gloo):

1. Model-state memory per rank (parameters + gradients + optimizer states, counted as tensor bytes)
   for ddp, ZeRO-1/2/3 (DeepSpeed) and FSDP2 on a ~50M-parameter GPT, bf16 mixed precision, next to
   the ZeRO paper's formulas (and their fp32 variants). Target: within 15%.
2. Activation checkpointing on a 12-layer, seq-512 model (one process): peak saved activations
   and step time, AC vs none. Target: >= 50% less activation memory at <= 40% extra step time.
3. Step throughput of FSDP2 and DeepSpeed relative to DDP on 2 processes. Target: >= 0.8x.

    .venv/bin/python bench/bench_scale.py [--part memory|ac|throughput]
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
        stamps = []
        t = Trainer(cfg, callbacks=[lambda tr, rec: stamps.append(time.perf_counter())])
        t.fit()
        # Peak model state: parameters, optimizer states *and* gradients, i.e. after a backward
        # (the trainer frees gradients after each step).
        batch = t.data.collator([t.data.train[i] for i in range(cfg.micro_batch_size)])
        with t._autocast():
            loss = t.wrapped(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        t.strategy.backward(loss, True, None)
        local, total = param_counts(t.model)
        state = model_state_bytes(t.model, t.optimizer)
        rate = (len(stamps) - 1) * cfg.micro_batch_size * cfg.data.seq_len * world / (stamps[-1] - stamps[0])
        if rank == 0:
            with open(f"{out}/{name}.txt", "w") as f:
                f.write(f"{state} {total} {rate}\n")
    dist.barrier()
    dist.destroy_process_group()


def run_two(jobs, out, cache):
    mp.start_processes(_worker, args=(2, _port(), jobs, out, cache), nprocs=2, join=True, start_method="spawn")


def common(precision: str) -> list[str]:
    return [*MODEL_50M, "data.seq_len=16", "micro_batch_size=1", f"precision={precision}", "eval_every=0",
            "save_every=0", "eval_batches=1", "progress=false", "log_every=1000", "resume=none"]


def memory_part(tmp: str, cache: str, precisions=("bf16", "fp32")) -> None:
    from tformer.parallel.plan import model_state_bytes as formula
    n = 2
    for precision in precisions:
        jobs = [(f"{name}-{precision}", common(precision) + flags, 2) for name, flags in STRATEGIES.items()]
        run_two(jobs, tmp, cache)
        print(f"\n=== model-state memory per rank, {precision}{' mixed (fp32 master)' if precision == 'bf16' else ''}, N=2 ===")
        print(f"{'strategy':<8}{'Ψ (params)':>14}{'measured MB':>14}{'formula MB':>13}{'ratio':>8}  formula")
        for name in STRATEGIES:
            state, total, _ = open(f"{tmp}/{name}-{precision}.txt").read().split()
            state, total = int(state), int(total)
            mixed = precision == "bf16"
            # our ddp / fsdp keep fp32 params and autocast: 16Ψ and 16Ψ/N in both precisions
            key = {"ddp": "ddp", "fsdp": "fsdp"}.get(name, name)
            want = formula(key if name != "ddp" else "ddp", total, n, mixed and name.startswith("zero"))
            text = {"ddp": "16Ψ", "fsdp": "16Ψ/N", "zero1": "4Ψ+12Ψ/N" if mixed else "8Ψ+8Ψ/N",
                    "zero2": "2Ψ+14Ψ/N" if mixed else "4Ψ+12Ψ/N", "zero3": "16Ψ/N"}[name]
            ratio = state / want
            print(f"{name:<8}{total:>14,}{state / 2**20:>14.1f}{want / 2**20:>13.1f}{ratio:>8.3f}  {text} "
                  f"{'PASS' if abs(ratio - 1) <= 0.15 else 'MISS'}")


def ac_part(rounds: int = 3) -> None:
    from tformer import build_model
    from tformer.parallel.ac import apply_activation_checkpointing
    from tformer.parallel.memory import SavedActivations
    torch.set_num_threads(2)
    torch.manual_seed(0)
    model = build_model("gpt2-tiny", vocab_size=8192, d_model=512, num_layers=12, num_heads=8, d_ff=2048,
                        max_seq_len=512, dropout=0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 8192, (2, 512))
    results = {"none": ([], 0), "full": ([], 0)}

    def step(mode):
        apply_activation_checkpointing(model, mode)
        t0 = time.perf_counter()
        with SavedActivations() as saved:
            loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0, saved.bytes

    step("none")
    for _ in range(rounds):  # interleaved
        for mode in ("none", "full"):
            dt, saved = step(mode)
            results[mode][0].append(dt)
            results[mode] = (results[mode][0], saved)
    t_none, m_none = statistics.median(results["none"][0]), results["none"][1]
    t_full, m_full = statistics.median(results["full"][0]), results["full"][1]
    print("\n=== activation checkpointing: 12 layers, d 512, seq 512, batch 2, fp32 ===")
    print(f"saved activations: none {m_none / 2**20:.0f} MB, full AC {m_full / 2**20:.0f} MB -> "
          f"{100 * (1 - m_full / m_none):.0f}% less (target >= 50%) {'PASS' if m_full <= 0.5 * m_none else 'MISS'}")
    print(f"step time: none {t_none:.2f}s, full AC {t_full:.2f}s -> {100 * (t_full / t_none - 1):+.0f}% "
          f"(target <= +40%) {'PASS' if t_full <= 1.4 * t_none else 'MISS'}")


def throughput_part(tmp: str, cache: str) -> None:
    names = ("ddp", "fsdp", "zero2", "zero3")
    rates = {n: [] for n in names}
    for r in range(2):  # interleaved rounds
        jobs = [(f"tp{r}-{name}", common("fp32") + STRATEGIES[name] + ["micro_batch_size=4", "data.seq_len=128"], 8)
                for name in names]
        run_two(jobs, tmp, cache)
        for name in names:
            rates[name].append(float(open(f"{tmp}/tp{r}-{name}.txt").read().split()[2]))
    print("\n=== step throughput, 2 processes, fp32, ~50M params ===")
    base = statistics.median(rates["ddp"])
    for name in names:
        ratio = statistics.median(rates[name]) / base
        print(f"{name:<6} {statistics.median(rates[name]):>10,.0f} tok/s  {ratio:.2f}x DDP"
              f"{'' if name == 'ddp' else ('  PASS' if ratio >= 0.8 else '  MISS')}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--part", choices=("memory", "ac", "throughput", "all"), default="all")
    p.add_argument("--precisions", default="bf16,fp32", help="memory part: bf16 (mixed) and/or fp32")
    args = p.parse_args()
    cache = os.environ.get("TFORMER_CACHE") or str(Path.home() / ".cache" / "tformer")
    with tempfile.TemporaryDirectory() as tmp:
        if args.part in ("memory", "all"):
            memory_part(tmp, cache, tuple(args.precisions.split(",")))
        if args.part in ("ac", "all"):
            ac_part()
        if args.part in ("throughput", "all"):
            throughput_part(tmp, cache)


if __name__ == "__main__":
    main()
