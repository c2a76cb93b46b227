"""Training throughput of tformer's three families against HF ``transformers`` and a single-file GPT.

    python bench/bench_models.py [--quick] [--family gpt2,bert,t5] [--precision fp32,bf16] [--gemm-share]
                                 [--threads 1] [--steps N] [--no-generate]

For each family and precision (fp32, and bf16 under ``torch.autocast("cpu", torch.bfloat16)``) the
contenders -- tformer, the HF model of identical configuration and, for GPT-2, a single-file
nanoGPT-shaped baseline written below -- take forward + backward + AdamW steps interleaved one by
one (A, B, C, A, B, C, ...) after warm-up, in one process, next to a square ``torch.mm`` timed the
same way. Printed: tokens/s (best and median step), ratios against HF and the baseline, and each
model's FLOP rate as a fraction of the ``torch.mm`` rate (training FLOPs from
``tformer.models.flops.training_flops``, which HF models of the same configuration share). A
measurement whose best and median step differ by more than 10% is repeated a bounded number of
times, then reported as noisy. Last, KV-cached against uncached greedy generation of 256 tokens.

Ratios are taken between median steps of interleaved contenders (contention hits all of them
alike); the best-step ratio is printed beside it. One thread by default (``--threads 2`` for both
cores): on a shared machine a second thread waits at every parallel op whenever another process
preempts it, which measures the scheduler more than the model. This is a benchmark, not a test: the
figures depend on the machine and on whatever else runs on it.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tformer import build_model  # noqa: E402
from tformer.generate import generate  # noqa: E402
from tformer.models.flops import training_flops  # noqa: E402

TARGETS = {("gpt2", "HF"): 1.15, ("gpt2", "baseline"): 1.0, ("bert", "HF"): 1.15, ("t5", "HF"): 1.15}
BF16_MM_TARGET = 0.70
GENERATE_TARGET = 5.0
NOISE = 0.10  # a measurement whose best and median step differ by more than this is retried

# GPT-2-small-like heads (64 wide) on narrower, fewer layers and an 8k vocabulary, so that the
# stack rather than one vocabulary matmul dominates; a step takes about a second on 2 idle cores.
SHAPES = {
    "gpt2": dict(
        preset="gpt2-small",
        d_model=512,
        num_heads=8,
        num_layers=4,
        d_ff=2048,
        vocab_size=8192,
        max_seq_len=512,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    ),
    "bert": dict(
        preset="bert-base",
        d_model=512,
        num_heads=8,
        num_layers=4,
        d_ff=2048,
        vocab_size=8192,
        max_seq_len=512,
        dropout=0.0,
        attn_dropout=0.0,
    ),
    "t5": dict(
        preset="t5-small",
        d_model=512,
        d_head=64,
        num_heads=8,
        num_layers=3,
        num_decoder_layers=3,
        d_ff=2048,
        vocab_size=8192,
        dropout=0.0,
    ),
}
SIZES = dict(batch=4, seq=256, target_len=128)
# Without bf16 matmul instructions (no avx512_bf16 / AMX: oneDNN bf16 unsupported) torch's bf16
# GEMM is a scalar fallback 100x slower than fp32; bf16 then runs toy shapes, ~1 s a step.
TOY = dict(d_model=128, num_heads=2, d_head=64, num_layers=2, d_ff=512, vocab_size=2048)
TOY_SIZES = dict(batch=2, seq=128, target_len=64)


# --------------------------------------------------------------------------------------------
# The single-file baseline: nanoGPT's shape (fused c_attn, SDPA causal, GELU-tanh MLP, LayerNorm,
# tied head), written here for the benchmark.
class MiniBlock(nn.Module):
    def __init__(self, d: int, heads: int, d_ff: int):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.c_fc, self.mlp_proj = nn.Linear(d, d_ff), nn.Linear(d_ff, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).reshape(b, s, d))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class MiniGPT(nn.Module):
    def __init__(self, vocab: int, max_len: int, d: int, heads: int, layers: int, d_ff: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(max_len, d)
        self.blocks = nn.ModuleList(MiniBlock(d, heads, d_ff) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
        self.head.weight = self.wte.weight

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100)


# --------------------------------------------------------------------------------------------
# HF models of identical configuration, built from configs (no hub), dropout 0, SDPA attention.
def hf_model(family: str, cfg) -> nn.Module:
    import transformers as tf

    common = dict(vocab_size=cfg.vocab_size, tie_word_embeddings=cfg.tie_embeddings, pad_token_id=cfg.pad_token_id)
    if family == "gpt2":
        hf_cfg = tf.GPT2Config(
            n_positions=cfg.max_seq_len,
            n_embd=cfg.d_model,
            n_layer=cfg.num_layers,
            n_head=cfg.num_heads,
            n_inner=cfg.d_ff,
            activation_function="gelu_new",
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            layer_norm_epsilon=cfg.norm_eps,
            bos_token_id=cfg.bos_token_id,
            eos_token_id=cfg.eos_token_id,
            **common,
        )
        cls = tf.GPT2LMHeadModel
    elif family == "bert":
        hf_cfg = tf.BertConfig(
            hidden_size=cfg.d_model,
            num_hidden_layers=cfg.num_layers,
            num_attention_heads=cfg.num_heads,
            intermediate_size=cfg.d_ff,
            hidden_act="gelu",
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            max_position_embeddings=cfg.max_seq_len,
            type_vocab_size=cfg.type_vocab_size,
            layer_norm_eps=cfg.norm_eps,
            **common,
        )
        cls = tf.BertForMaskedLM
    else:
        hf_cfg = tf.T5Config(
            d_model=cfg.d_model,
            d_kv=cfg.head_dim,
            d_ff=cfg.d_ff,
            num_layers=cfg.num_layers,
            num_decoder_layers=cfg.decoder_layers,
            num_heads=cfg.num_heads,
            relative_attention_num_buckets=cfg.rel_num_buckets,
            relative_attention_max_distance=cfg.rel_max_distance,
            dropout_rate=0.0,
            layer_norm_epsilon=cfg.norm_eps,
            feed_forward_proj="relu",
            decoder_start_token_id=cfg.decoder_start_token_id,
            eos_token_id=cfg.eos_token_id,
            **common,
        )
        cls = tf.T5ForConditionalGeneration
    return cls._from_config(hf_cfg, attn_implementation="sdpa")


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # a tied tensor is yielded once


# --------------------------------------------------------------------------------------------
@dataclass
class Contender:
    """One model (or the matmul) with its batch and optimizer; ``times`` holds its timed steps."""

    name: str
    model: nn.Module | None
    run: Callable[[], torch.Tensor | None]  # a model's loss; for the matmul, the whole step
    flops: float
    tokens: int
    times: list[float] = field(default_factory=list)
    optimizer: torch.optim.Optimizer | None = None

    def __post_init__(self):
        if self.model is not None:
            self.model.train()
            # The trainer's choice on CPU (tformer.train.loop.optim): fused AdamW.
            self.optimizer = torch.optim.AdamW(
                self.model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True
            )

    def step(self, autocast) -> None:
        if self.model is None:
            self.run()
            return
        self.optimizer.zero_grad(set_to_none=True)
        with autocast():
            loss = self.run()
        loss.backward()
        self.optimizer.step()

    def best(self) -> float:
        return min(self.times)

    def median(self) -> float:
        return statistics.median(self.times)

    def spread(self) -> float:
        return self.median() / self.best() - 1.0


def matmul_contender(dtype: torch.dtype, n: int, budget_s: float) -> Contender:
    """A square ``torch.mm`` of size ``n``, repeated to take about ``budget_s`` like a model step."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    torch.mm(a, b)
    t0 = time.perf_counter()
    torch.mm(a, b)
    reps = max(1, round(budget_s / max(time.perf_counter() - t0, 1e-4)))

    def run():
        for _ in range(reps):
            torch.mm(a, b)

    return Contender(f"torch.mm {n}", None, run, 2 * n**3 * reps, 0)


def contenders_for(family: str, toy: bool) -> tuple:
    """tformer, HF and (GPT-2) the baseline, all fed the same batch. tformer runs as its trainer does
    (``return_logits=False``: loss only; for BERT the MLM head at the masked positions only)."""
    over = dict(SHAPES[family])
    preset = over.pop("preset")
    sizes = TOY_SIZES if toy else SIZES
    if toy:
        over.update(TOY)
        if family != "t5":
            over.pop("d_head")
    torch.manual_seed(0)
    ours = build_model(preset, **over)
    cfg = ours.config
    hf = hf_model(family, cfg)
    if num_params(ours) != num_params(hf):
        raise SystemExit(
            f"{family}: configurations differ: tformer {num_params(ours):,} vs HF {num_params(hf):,} parameters"
        )
    gen = torch.Generator().manual_seed(0)
    b, s, t = sizes["batch"], sizes["seq"], sizes["target_len"]
    ids = torch.randint(0, cfg.vocab_size, (b, s), generator=gen)
    if family == "gpt2":
        shifted = torch.cat((ids[:, 1:], torch.full((b, 1), -100)), dim=1)  # HF shifts inside
        flops, tokens = training_flops(cfg, b, s), b * s
        base = MiniGPT(cfg.vocab_size, cfg.max_seq_len, cfg.d_model, cfg.num_heads, cfg.num_layers, cfg.d_ff)
        if num_params(base) != num_params(ours):
            raise SystemExit(f"baseline has {num_params(base):,} parameters, tformer {num_params(ours):,}")
        contenders = [
            Contender("tformer", ours, lambda: ours(ids, labels=shifted, return_logits=False).loss, flops, tokens),
            Contender("HF", hf, lambda: hf(input_ids=ids, labels=ids).loss, flops, tokens),
            Contender("baseline", base, lambda: base(ids, shifted), flops, tokens),
        ]
    elif family == "bert":
        labels = ids.masked_fill(torch.rand(b, s, generator=gen) >= 0.15, -100)
        flops, tokens = training_flops(cfg, b, s), b * s
        contenders = [
            Contender("tformer", ours, lambda: ours(ids, labels=labels, return_logits=False).loss, flops, tokens),
            Contender("HF", hf, lambda: hf(input_ids=ids, labels=labels).loss, flops, tokens),
        ]
    else:
        target = torch.randint(2, cfg.vocab_size, (b, t), generator=gen)
        flops, tokens = training_flops(cfg, b, s, t), b * (s + t)
        contenders = [
            Contender("tformer", ours, lambda: ours(ids, labels=target, return_logits=False).loss, flops, tokens),
            Contender("HF", hf, lambda: hf(input_ids=ids, labels=target).loss, flops, tokens),
        ]
    return cfg, sizes, contenders


def interleave(contenders: list[Contender], steps: int, warmup: int, autocast) -> None:
    """Warm up each, then time one step of each in turn, rotating who goes first every round."""
    for c in contenders:
        c.times = []
        for _ in range(warmup):
            c.step(autocast)
    for r in range(steps):
        k = r % len(contenders)
        for c in contenders[k:] + contenders[:k]:
            t0 = time.perf_counter()
            c.step(autocast)
            c.times.append(time.perf_counter() - t0)


def speedup(a: Contender, b: Contender) -> tuple[float, float]:
    """How much faster ``a`` is than ``b``: (median-step ratio, best-step ratio)."""
    return b.median() / a.median(), b.best() / a.best()


# --------------------------------------------------------------------------------------------
def bench_family(family: str, precision: str, args, toy: bool) -> list[dict]:
    cfg, sizes, models = contenders_for(family, toy)
    bf16 = precision == "bf16"
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
    models[0].step(autocast)  # one step to size the matmul like a model step
    t0 = time.perf_counter()
    models[0].step(autocast)
    mm = matmul_contender(torch.bfloat16 if bf16 else torch.float32, 512 if toy else 2048, time.perf_counter() - t0)
    everyone = models + [mm]
    t5 = family == "t5"
    layers = f"{cfg.num_layers}+{cfg.decoder_layers}" if t5 else f"{cfg.num_layers}"
    tokens = f"batch {sizes['batch']}, seq {sizes['seq']}" + (f", target {sizes['target_len']}" if t5 else "")
    print(
        f"\n[{family} {precision}{' toy' if toy else ''}] d_model {cfg.d_model}, heads {cfg.num_heads} x "
        f"{cfg.head_dim}, layers {layers}, d_ff {cfg.d_ff}, vocab {cfg.vocab_size}; {tokens}; "
        f"{num_params(models[0].model) / 1e6:.1f}M params, {models[0].flops / 1e9:.1f} GFLOP/step; "
        f"attention: tformer {cfg.attn_impl}, HF {models[1].model.config._attn_implementation}",
        flush=True,
    )
    kept = None  # (spread, times by contender) of the least noisy attempt
    for attempt in range(1, args.retries + 2):
        interleave(everyone, args.steps, args.warmup if attempt == 1 else 1, autocast)
        spread = max(c.spread() for c in everyone)
        print(
            f"  attempt {attempt}: "
            + ", ".join(f"{c.name} {c.median():.3f}s (best {c.best():.3f})" for c in everyone)
            + f"; largest best-vs-median gap {spread:.0%}",
            flush=True,
        )
        if kept is None or spread < kept[0]:
            kept = (spread, {c.name: list(c.times) for c in everyone})
        if spread <= NOISE:
            break
    for c in everyone:
        c.times = kept[1][c.name]
    if args.gemm_share:
        for g in gemm_share(models, autocast):
            print(
                f"  profiled step, {g['name']}: {g['calls']} GEMM calls, {g['gemm']:.3f} s of {g['step']:.3f} s "
                f"in GEMMs ({g['gemm'] / g['step']:.0%})"
                + (f"; ceiling vs HF with every non-GEMM op free: {g['ceiling']:.2f}x" if g["name"] == "tformer" else ""),
                flush=True,
            )
    by_name = {c.name: c for c in models}
    rows = []
    for c in models:
        rows.append(
            dict(
                family=family,
                precision=precision,
                name=c.name,
                toy=toy,
                noisy=kept[0] > NOISE,
                tok_best=c.tokens / c.best(),
                tok_med=c.tokens / c.median(),
                gflops=c.flops / c.median() / 1e9,
                mm_gflops=mm.flops / mm.median() / 1e9,
                frac=(c.flops / c.median()) / (mm.flops / mm.median()),
                vs={o: speedup(c, by_name[o]) for o in ("HF", "baseline") if o in by_name and o != c.name},
            )
        )
    return rows


GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_addmm_activation")


def gemm_share(models: list[Contender], autocast, rounds: int = 3) -> list[dict]:
    """Profiled steps of each model, interleaved: time in GEMM kernels (self time of mm/addmm/bmm),
    their count, and the whole step (medians over ``rounds``). ``ceiling`` bounds tformer's speed-up
    on HF: HF's step over tformer's GEMM time alone, i.e. tformer with every non-GEMM op made free."""
    from torch.profiler import ProfilerActivity, profile

    seen = {c.name: [] for c in models}
    for _ in range(rounds):
        for c in models:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                c.step(autocast)
            events = prof.key_averages()
            gemm = [e for e in events if e.key in GEMM_OPS]
            seen[c.name].append(
                (
                    sum(e.self_cpu_time_total for e in events) / 1e6,
                    sum(e.self_cpu_time_total for e in gemm) / 1e6,
                    sum(e.count for e in gemm),
                )
            )
    rows = [
        dict(
            name=name,
            step=statistics.median(s for s, _, _ in runs),
            gemm=statistics.median(g for _, g, _ in runs),
            calls=runs[0][2],
        )
        for name, runs in seen.items()
    ]
    hf = next((r for r in rows if r["name"] == "HF"), None)
    for r in rows:
        r["ceiling"] = hf["step"] / r["gemm"] if hf else float("nan")
    return rows


def bench_generate(args) -> dict:
    """Greedy decoding of 256 new tokens after a 16-token prompt, batch 1, with and without cache."""
    over = dict(SHAPES["gpt2"])
    torch.manual_seed(0)
    model = build_model(over.pop("preset"), **over).eval()
    prompt = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1))
    for use_cache in (True, False):  # warm-up
        generate(model, prompt, 8, eos_token_id=None, use_cache=use_cache)
    times, outs = {True: [], False: []}, {}
    for _ in range(args.gen_repeats):
        for use_cache in (True, False):
            t0 = time.perf_counter()
            outs[use_cache] = generate(model, prompt, 256, eos_token_id=None, use_cache=use_cache)
            times[use_cache].append(time.perf_counter() - t0)
    cached, uncached = min(times[True]), min(times[False])
    return dict(cached=cached, uncached=uncached, speedup=uncached / cached, same=torch.equal(outs[True], outs[False]))


def probe_matmul() -> dict:
    """fp32 vs bf16 ``torch.mm`` rates, and bf16 by operand layout (the fallback GEMM cares)."""
    rates = {}
    for name, dtype, n, layout in (
        ("fp32", torch.float32, 1024, "nn"),
        ("bf16", torch.bfloat16, 384, "nn"),
        ("bf16 a@b.T", torch.bfloat16, 384, "nt"),
        ("bf16 a.T@b", torch.bfloat16, 384, "tn"),
    ):
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        a, b = (a.t() if layout == "tn" else a), (b.t() if layout == "nt" else b)
        torch.mm(a, b)
        best = math.inf
        for _ in range(3):
            t0 = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - t0)
        rates[name] = 2 * n**3 / best / 1e9
    return rates


# --------------------------------------------------------------------------------------------
def verdict(value: float, target: float, noisy: bool) -> str:
    return ("PASS" if value >= target else "MISS") + (" (noisy)" if noisy else "")


def print_table(rows: list[dict], gen: dict | None, slow_bf16: bool, probe: dict | None) -> None:
    print("\n" + "=" * 120)
    print(
        "Forward + backward + AdamW. Ratios: median-step (best-step). %mm: model FLOP/s / torch.mm FLOP/s, "
        "same run, medians."
    )
    head = (
        f"{'family':6} {'prec':8} {'contender':9} {'tok/s med':>9} {'tok/s best':>10} {'GFLOP/s':>8} "
        f"{'vs HF':>12} {'vs base':>12} {'%mm':>5}  targets"
    )
    print(head)
    print("-" * 120)
    for r in rows:
        checks = []
        if r["name"] == "tformer":
            for other, (med, _) in r["vs"].items():
                target = TARGETS[(r["family"], other)]
                checks.append(f"vs {other} >= {target:.2f}: {verdict(med, target, r['noisy'])}")
            if r["precision"] == "bf16":
                checks.append(f"%mm >= {BF16_MM_TARGET:.0%}: {verdict(r['frac'], BF16_MM_TARGET, r['noisy'])}")
        elif r["noisy"]:
            checks.append("(noisy)")
        ratios = [f"{r['vs'][o][0]:.2f} ({r['vs'][o][1]:.2f})" if o in r["vs"] else "-" for o in ("HF", "baseline")]
        prec = r["precision"] + (" toy" if r["toy"] else "")
        print(
            f"{r['family']:6} {prec:8} {r['name']:9} {r['tok_med']:9.0f} {r['tok_best']:10.0f} "
            f"{r['gflops']:8.1f} {ratios[0]:>12} {ratios[1]:>12} {r['frac']:5.0%}  {'; '.join(checks)}"
        )
    for prec in ("fp32", "bf16"):
        rates = [r["mm_gflops"] for r in rows if r["precision"] == prec and r["name"] == "tformer"]
        if rates:
            print(f"torch.mm {prec} (square, median step): {min(rates):.1f}-{max(rates):.1f} GFLOP/s across the rounds")
    if slow_bf16:
        print(
            f"NOTE: no bf16 matmul hardware here (oneDNN bf16 unsupported): torch.mm bf16 "
            f"{probe['bf16']:.1f} GFLOP/s vs fp32 {probe['fp32']:.1f}; the fallback GEMM's speed depends on "
            f"operand layout (a@b.T {probe['bf16 a@b.T']:.1f}, a.T@b {probe['bf16 a.T@b']:.1f} GFLOP/s), so "
            "bf16 %mm can exceed 100% and bf16 rounds ran toy shapes."
        )
    if gen is not None:
        print(
            f"generation (gpt2 shape above, batch 1, 16-token prompt, 256 new tokens, greedy): "
            f"cached {gen['cached']:.2f} s, uncached {gen['uncached']:.2f} s -> {gen['speedup']:.1f}x "
            f"(>= {GENERATE_TARGET:.0f}x: {verdict(gen['speedup'], GENERATE_TARGET, False)}); "
            f"identical tokens: {gen['same']}"
        )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="4 timed steps, 1 warm-up, one generation run (~half the time)")
    p.add_argument("--family", default="gpt2,bert,t5", help="comma list of gpt2, bert, t5")
    p.add_argument("--precision", default="fp32,bf16", help="comma list of fp32, bf16")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch.set_num_threads; 1 by default: on the shared 2-core machine two threads stall at "
        "every parallel op another process preempts (best-vs-median gaps of 30-300%%)",
    )
    p.add_argument("--steps", type=int, default=None, help="timed steps per contender (default 6, quick 4)")
    p.add_argument("--no-generate", action="store_true", help="skip the generation benchmark")
    p.add_argument(
        "--gemm-share",
        action="store_true",
        help="also profile 3 steps of each model: time in GEMM kernels and the speed-up ceiling it sets",
    )
    args = p.parse_args(argv)
    args.steps = args.steps or (4 if args.quick else 6)
    args.warmup, args.retries, args.gen_repeats = (1, 1, 1) if args.quick else (2, 1, 2)
    families = [f for f in args.family.split(",") if f]
    precisions = [x for x in args.precision.split(",") if x]
    if bad := [f for f in families if f not in SHAPES]:
        p.error(f"unknown family {bad[0]!r}; use gpt2, bert or t5")
    if bad := [x for x in precisions if x not in ("fp32", "bf16")]:
        p.error(f"unknown precision {bad[0]!r}; use fp32 or bf16")
    torch.set_num_threads(args.threads)
    import transformers

    transformers.logging.set_verbosity_error()
    start = time.perf_counter()
    probe = probe_matmul()
    slow_bf16 = probe["bf16"] < 0.1 * probe["fp32"]
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, {args.threads} threads, "
        f"CPU capability {torch.backends.cpu.get_cpu_capability()}, oneDNN bf16 "
        f"{torch.ops.mkldnn._is_mkldnn_bf16_supported()}; mm probe fp32 {probe['fp32']:.1f}, "
        f"bf16 {probe['bf16']:.1f} GFLOP/s{' -> bf16 rounds use toy shapes' if slow_bf16 else ''}"
    )
    print(
        f"every contender: torch.optim.AdamW(lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True); "
        f"{args.steps} interleaved steps after {args.warmup} warm-up; {args.retries} retry if best and "
        f"median step differ by > {NOISE:.0%}"
    )
    rows = []
    for precision in precisions:
        for family in families:
            rows += bench_family(family, precision, args, toy=slow_bf16 and precision == "bf16")
    gen = None if args.no_generate else bench_generate(args)
    print_table(rows, gen, slow_bf16 and "bf16" in precisions, probe)
    print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
