"""Memory benchmark (one CPU process, fp32): what the chunked head + loss, op-level selective
activation checkpointing and the planner deliver. Every figure is a ratio against a baseline
measured in the same run; tensor bytes are tracked op by op with torch's MemTracker.

1. head: head + loss transient memory at the llama-1b shape (vocab 128,256, d 2,048, seq 2,048,
   micro-batch 1): peak tensor bytes during forward + backward minus what is left at the end
   (parameters + gradients), chunked vs unchunked; traced on fake tensors (MemTracker counts the
   same allocations as on real ones, checked at a small shape here), and step time measured on real
   tensors at a shorter sequence, interleaved. Targets: <= 10% memory, <= 1.05x time.
2. step: whole training-step peak RSS of a fresh process over two AdamW steps at gpt2-small (seq
   1,024, micro-batch 4, fp32, no AC): tformer with its defaults vs HF GPT2LMHeadModel. Target <= 0.5x.
3. ac: op-level checkpointing against none and full on a 12-layer, d-512, seq-512 GPT: peak
   activation memory (activations + temporaries) and step time, interleaved. Target: <= 0.5x of
   none at <= 1.08x time.
4. Planner predictions (``tformer plan``'s formulas) against each measured peak. Target: within 15%,
   a PASS/MISS on every line that prints a prediction (``planner_verdict``).

    .venv/bin/python bench/bench_memory.py [--part head|step|ac|all] [--rounds 3]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MB = 2**20
PLANNER_TOLERANCE = 0.15


def planner_verdict(predicted: float, measured: float) -> str:
    """The planner's prediction against a measured peak: PASS within 15% either way, MISS otherwise
    (FAIL when nothing was measured)."""
    if not measured > 0:
        return f"planner {predicted / MB:,.0f} MB against no measurement: FAIL"
    ratio = predicted / measured
    ok = abs(ratio - 1) <= PLANNER_TOLERANCE
    return f"planner {predicted / MB:,.0f} MB = {ratio:.2f}x measured (target within 15%) {'PASS' if ok else 'MISS'}"


def _tracked(fn, *modules_or_tensors, outer=None):
    """Run ``fn`` under MemTracker (inside ``outer``, e.g. a FakeTensorMode, when given): (peak total
    bytes, bytes at the end, peak activations + temporaries)."""
    from tformer.parallel.memory import activation_peak_tracker

    tracker = activation_peak_tracker()
    tracker.track_external(*modules_or_tensors)
    with outer or contextlib.nullcontext(), tracker:
        fn()
    peak = tracker.get_tracker_snapshot("peak")
    now = tracker.get_tracker_snapshot()
    device = next(iter(peak))
    return peak[device]["Total"], now[device]["Total"], tracker.peak_activations


def _head_loss(vocab, d, tokens, chunk, fake=False):
    from torch._subclasses.fake_tensor import FakeTensorMode
    from tformer.models.base import lm_loss
    from tformer.models.loss import chunked_lm_loss

    mode = FakeTensorMode() if fake else contextlib.nullcontext()
    with mode:
        head = nn.Linear(d, vocab, bias=False)
        hidden = torch.randn(tokens, d, requires_grad=True)
        labels = torch.randint(0, vocab, (tokens,))

    def step():
        loss = lm_loss(head(hidden), labels) if chunk is None else chunked_lm_loss(hidden, head.weight, None, labels, chunk)
        loss.backward()

    return step, head, hidden, mode


def head_part(rounds: int, chunks=(128, 256, 1024), time_tokens: int = 512) -> None:
    from tformer.models import build_model
    from tformer.plan.activations import head_bytes

    vocab, d, tokens = 128256, 2048, 2048
    with torch.device("meta"):
        cfg = build_model("llama-1b").config
    print(f"\n=== head + loss at the llama-1b shape: vocab {vocab:,}, d {d}, {tokens} tokens, fp32 ===")
    # fake tensors count what real ones would: checked at a small shape first
    small = [
        _tracked(step, head, x, outer=mode)
        for step, head, x, mode in (_head_loss(8192, 256, 512, c, fake) for c in (None, 128) for fake in (False, True))
    ]
    assert small[0][:2] == small[1][:2] and small[2][:2] == small[3][:2], small
    step, head, x, mode = _head_loss(vocab, d, tokens, None, fake=True)
    base_peak, base_end, _ = _tracked(step, head, x, outer=mode)
    base = base_peak - base_end
    predicted = head_bytes(cfg, tokens, mixed=False)
    print(f"unchunked: transient {base / MB:,.0f} MB; {planner_verdict(predicted, base)}")
    results = {}
    for chunk in chunks:
        step, head, x, mode = _head_loss(vocab, d, tokens, chunk, fake=True)
        peak, end, _ = _tracked(step, head, x, outer=mode)
        results[chunk] = peak - end
        predicted = head_bytes(cfg, tokens, mixed=False, chunk=chunk)
        ratio = results[chunk] / base
        print(
            f"chunk {chunk:>5}: transient {results[chunk] / MB:,.0f} MB = {ratio:.1%} of unchunked "
            f"(target <= 10%) {'PASS' if ratio <= 0.10 else 'MISS'}; {planner_verdict(predicted, results[chunk])}"
        )
    if not time_tokens:
        return
    # step time on real tensors, interleaved, one thread
    torch.set_num_threads(1)
    variants = [None, *chunks]
    steps = {c: _head_loss(vocab, d, time_tokens, c)[0] for c in variants}
    for c in variants:
        steps[c]()  # warm-up
    times = {c: [] for c in variants}
    for _ in range(rounds):
        for c in variants:
            t0 = time.perf_counter()
            steps[c]()
            times[c].append(time.perf_counter() - t0)
    t_base = statistics.median(times[None])
    print(
        f"step time at {time_tokens} tokens (forward + backward of head + loss, 1 thread, median of {rounds}, "
        f"interleaved): unchunked {t_base:.2f}s [{min(times[None]):.2f}-{max(times[None]):.2f}]"
    )
    for c in chunks:
        t = statistics.median(times[c])
        spread = [x / y for x, y in zip(times[c], times[None])]
        print(
            f"chunk {c:>5}: {t:.2f}s -> {t / t_base:.3f}x (per-round ratios {min(spread):.3f}-{max(spread):.3f}; "
            f"target <= 1.05x) {'PASS' if t <= 1.05 * t_base else 'MISS'}"
        )


STEP_SCRIPT = r"""
import resource, sys, time, torch, json
sys.path.insert(0, {root!r})
torch.manual_seed(0)
torch.set_num_threads({threads})
which, batch, seq = {which!r}, {batch}, {seq}
if which == "hf":
    from transformers import GPT2Config, GPT2LMHeadModel
    model = GPT2LMHeadModel(GPT2Config(n_positions=1024, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
else:
    from tformer import build_model
    model = build_model("gpt2-small", dropout=0.0)
    model.loss_chunk_size = {chunk}
    from tformer.parallel.ac import apply_activation_checkpointing
    apply_activation_checkpointing(model, {ac!r})
model.train()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
ids = torch.randint(0, 50257, (batch, seq))
rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
times = []
for _ in range(2):
    t0 = time.perf_counter()
    if which == "hf":
        loss = model(input_ids=ids, labels=ids).loss
    else:
        loss = model(ids, labels=ids, return_logits=False).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    times.append(time.perf_counter() - t0)
print(json.dumps({{"peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "rss_before": rss0 * 1024, "times": times,
                  "params": sum(p.numel() for p in model.parameters())}}))
"""


def _fresh_step(which: str, batch: int, seq: int, chunk, threads: int, ac: str = "none") -> dict:
    code = STEP_SCRIPT.format(root=str(ROOT), which=which, batch=batch, seq=seq, chunk=chunk, threads=threads, ac=ac)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=1800)
    return json.loads(out.stdout.strip().splitlines()[-1])


def step_part(batch: int = 4, seq: int = 1024, threads: int = 2, chunk: int | None = None) -> None:
    from tformer.models import build_model
    from tformer.plan.activations import activation_bytes
    from tformer.models.loss import CPU_CHUNK

    chunk = chunk or CPU_CHUNK  # loss.chunk_size=auto on a CPU
    print(
        f"\n=== whole training step, gpt2-small, seq {seq}, micro-batch {batch}, fp32, AdamW, no AC: peak RSS "
        f"of a fresh process over two steps ==="
    )
    runs = {
        "tformer (defaults: chunk %d)" % chunk: ("tformer", chunk, "none"),
        "tformer unchunked": ("tformer", None, "none"),
        "tformer + AC op": ("tformer", chunk, "op"),
        "HF GPT2LMHeadModel": ("hf", None, "none"),
    }
    res = {name: _fresh_step(which, batch, seq, c, threads, ac) for name, (which, c, ac) in runs.items()}
    hf = res["HF GPT2LMHeadModel"]["peak_rss"]
    cfg = build_model("gpt2-small", dropout=0.0).config
    for name, r in res.items():
        line = (
            f"{name:<28} peak RSS {r['peak_rss'] / 2**30:5.2f} GB ({r['peak_rss'] / hf:.2f}x HF); before the "
            f"steps {r['rss_before'] / 2**30:4.2f} GB; step times {', '.join(f'{t:.1f}s' for t in r['times'])}"
        )
        if name.startswith("tformer"):
            _, c, ac = runs[name]
            planned = (
                r["rss_before"]
                + 12 * r["params"]  # + grads and AdamW m, v
                + activation_bytes(cfg, batch, seq, None, ac, False, chunk=c, return_logits=False)
            )
            line += f"; RSS before + 12 B/param + activations: {planner_verdict(planned, r['peak_rss'])}"
        print(line)
    ours = res[next(iter(res))]["peak_rss"]
    print(f"tformer defaults / HF: {ours / hf:.2f}x (target <= 0.5x) {'PASS' if ours <= 0.5 * hf else 'MISS'}")


def ac_part(rounds: int = 3, d_model: int = 512, batch: int = 2, seq: int = 512) -> None:
    from tformer import build_model
    from tformer.parallel.ac import apply_activation_checkpointing
    from tformer.plan.activations import activation_bytes

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model(
        "gpt2-tiny",
        vocab_size=8192,
        d_model=d_model,
        num_layers=12,
        num_heads=8,
        d_ff=4 * d_model,
        max_seq_len=seq,
        dropout=0.0,
    )
    model.loss_chunk_size = 128
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 8192, (batch, seq))
    modes = ("none", "op", "full")

    def step(mode):
        apply_activation_checkpointing(model, mode)
        t0 = time.perf_counter()
        model(ids, labels=ids, return_logits=False).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    step("none")  # AdamW's states exist from here on
    memory = {}
    for mode in modes:
        apply_activation_checkpointing(model, mode)
        _, _, memory[mode] = _tracked(lambda: model(ids, labels=ids, return_logits=False).loss.backward(), model, opt)
        opt.zero_grad(set_to_none=True)
    times = {m: [] for m in modes}
    for _ in range(rounds):
        for mode in modes:
            times[mode].append(step(mode))
    print(
        f"\n=== activation checkpointing: 12 layers, d {d_model}, seq {seq}, batch {batch}, fp32, 1 thread, chunked loss ==="
    )
    t_none = statistics.median(times["none"])
    for mode in modes:
        a, t = memory[mode], statistics.median(times[mode])
        spread = [x / y for x, y in zip(times[mode], times["none"])]
        planned = activation_bytes(model.config, batch, seq, None, mode, False, chunk=128, return_logits=False)
        verdict = ""
        if mode == "op":
            verdict = (
                f"  memory target <= 0.5x {'PASS' if a <= 0.5 * memory['none'] else 'MISS'}, time target <= 1.08x "
                f"{'PASS' if t <= 1.08 * t_none else 'MISS'}"
            )
        print(
            f"{mode:<5} peak activations {a / MB:6.0f} MB ({a / memory['none']:.2f}x none), step {t:.2f}s "
            f"({t / t_none:.3f}x; rounds {min(spread):.3f}-{max(spread):.3f}); {planner_verdict(planned, a)}{verdict}"
        )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--part", choices=("head", "step", "ac", "all"), default="all")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2, help="step part: threads per process")
    p.add_argument("--head-time-tokens", type=int, default=512, help="head part: tokens of the timed steps (0: memory only)")
    args = p.parse_args()
    if args.part in ("head", "all"):
        head_part(args.rounds, time_tokens=args.head_time_tokens)
    if args.part in ("ac", "all"):
        ac_part(args.rounds)
    if args.part in ("step", "all"):
        step_part(threads=args.threads)


if __name__ == "__main__":
    main()
