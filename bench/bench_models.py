"""Training throughput of tformer's three families against HF ``transformers`` and a single-file GPT.

    python bench/bench_models.py [--quick] [--family gpt2,bert,t5] [--precision fp32,bf16]
                                 [--threads 2] [--no-generate]

For each family and precision (fp32, and bf16 under ``torch.autocast("cpu", torch.bfloat16)``) the
contenders -- tformer, the HF model of identical configuration and, for GPT-2, a single-file
nanoGPT-shaped baseline written below -- take forward + backward + AdamW steps interleaved one by
one (A, B, C, A, B, C, ...) after warm-up, in one process, next to a square ``torch.mm`` measured
the same way. Printed: tokens/s (best and median step), ratios against HF and the baseline, and each
model's FLOP rate as a fraction of the ``torch.mm`` rate (training FLOPs from
``tformer.models.flops.training_flops``, which HF models of the same configuration share). A
measurement whose best and median step differ by more than 10% is repeated a bounded number of
times, then reported as noisy. Last, KV-cached against uncached greedy generation of 256 tokens.

Ratios come from the median steps of interleaved contenders (contention hits all of them alike);
the best-step ratio is printed beside it. This is a benchmark, not a test: figures depend on the
machine and on whatever else runs on it.
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

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tformer import build_model  # noqa: E402
from tformer.generate import generate  # noqa: E402
from tformer.models.flops import training_flops  # noqa: E402

TARGETS = {  # (family, what) -> minimum
    ("gpt2", "hf"): 1.15, ("gpt2", "base"): 1.0, ("bert", "hf"): 1.15, ("t5", "hf"): 1.15,
}
BF16_MM_TARGET = 0.70
GENERATE_TARGET = 5.0
NOISE = 0.10  # reject a measurement whose best and median step differ by more than this

# Benchmark shapes: GPT-2-small-like heads (64 wide), fewer and narrower layers, a small vocabulary so
# the stack rather than one vocabulary matmul dominates; a step takes ~0.5-1.5 s on 2 cores in fp32.
SHAPES = {
    "gpt2": dict(preset="gpt2-small", d_model=512, num_heads=8, num_layers=4, d_ff=2048,
                 vocab_size=8192, max_seq_len=512, bos_token_id=0, eos_token_id=0, pad_token_id=0),
    "bert": dict(preset="bert-base", d_model=512, num_heads=8, num_layers=4, d_ff=2048,
                 vocab_size=8192, max_seq_len=512, dropout=0.0, attn_dropout=0.0),
    "t5": dict(preset="t5-small", d_model=512, d_head=64, num_heads=8, num_layers=3,
               num_decoder_layers=3, d_ff=2048, vocab_size=8192, dropout=0.0),
}
BATCH, SEQ, TARGET_LEN = 4, 256, 128
# Without bf16 matmul hardware (no avx512_bf16 / AMX) torch's bf16 GEMM is a scalar fallback ~100x
# slower than fp32; bf16 then runs these toy shapes so that a step still takes about a second.
TINY = dict(d_model=128, num_heads=2, d_head=None, num_layers=2, num_decoder_layers=2, d_ff=512,
            vocab_size=2048)
TINY_BATCH, TINY_SEQ, TINY_TARGET_LEN = 2, 128, 64


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
# HF models of identical configuration, built from configs (no hub).
def hf_model(family: str, cfg):
    import transformers as tf

    common = dict(vocab_size=cfg.vocab_size, tie_word_embeddings=cfg.tie_embeddings,
                  pad_token_id=cfg.pad_token_id)
    if family == "gpt2":
        hf_cfg = tf.GPT2Config(n_positions=cfg.max_seq_len, n_embd=cfg.d_model, n_layer=cfg.num_layers,
                               n_head=cfg.num_heads, n_inner=cfg.d_ff, activation_function="gelu_new",
                               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                               layer_norm_epsilon=cfg.norm_eps, bos_token_id=cfg.bos_token_id,
                               eos_token_id=cfg.eos_token_id, **common)
        cls = tf.GPT2LMHeadModel
    elif family == "bert":
        hf_cfg = tf.BertConfig(hidden_size=cfg.d_model, num_hidden_layers=cfg.num_layers,
                               num_attention_heads=cfg.num_heads, intermediate_size=cfg.d_ff,
                               hidden_act="gelu", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                               max_position_embeddings=cfg.max_seq_len, type_vocab_size=cfg.type_vocab_size,
                               layer_norm_eps=cfg.norm_eps, **common)
        cls = tf.BertForMaskedLM
    else:
        hf_cfg = tf.T5Config(d_model=cfg.d_model, d_kv=cfg.head_dim, d_ff=cfg.d_ff, num_layers=cfg.num_layers,
                             num_decoder_layers=cfg.decoder_layers, num_heads=cfg.num_heads,
                             relative_attention_num_buckets=cfg.rel_num_buckets,
                             relative_attention_max_distance=cfg.rel_max_distance, dropout_rate=0.0,
                             layer_norm_epsilon=cfg.norm_eps, feed_forward_proj="relu",
                             decoder_start_token_id=cfg.decoder_start_token_id, eos_token_id=cfg.eos_token_id,
                             **common)
        cls = tf.T5ForConditionalGeneration
    return cls._from_config(hf_cfg, attn_implementation="sdpa")


def unique_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied tensor once


# --------------------------------------------------------------------------------------------
@dataclass
class Contender:
    name: str
    model: nn.Module | None
    loss: callable  # () -> loss tensor; or the whole step for the matmul
    flops: float     # per step
    tokens: int      # per step
    times: list[float] = field(default_factory=list)
    optimizer: torch.optim.Optimizer | None = None

    def __post_init__(self):
        if self.model is not None:
            self.model.train()
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, betas=(0.9, 0.95),
                                               weight_decay=0.1, fused=True)

    def step(self, autocast) -> None:
        if self.model is None:
            self.loss()
            return
        self.optimizer.zero_grad(set_to_none=True)
        with autocast():
            loss = self.loss()
        loss.backward()
        self.optimizer.step()

    def best(self) -> float:
        return min(self.times)

    def median(self) -> float:
        return statistics.median(self.times)

    def spread(self) -> float:
        return self.median() / self.best() - 1.0


def matmul_contender(dtype: torch.dtype, budget_s: float) -> Contender:
    """A square ``torch.mm``, repeated to take about ``budget_s`` like a model step."""
    n = 256
    while True:
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        torch.mm(a, b)
        t0 = time.perf_counter()
        torch.mm(a, b)
        dt = time.perf_counter() - t0
        if n >= 2048 or dt > 0.05:
            break
        n *= 2
    reps = max(1, round(budget_s / max(dt, 1e-4)))

    def run():
        for _ in range(reps):
            torch.mm(a, b)

    return Contender(f"torch.mm {n}", None, run, 2 * n ** 3 * reps, 0)


def contenders_for(family: str, shape: dict, batch: int, seq: int, target_len: int, gen: torch.Generator):
    """tformer, HF and (GPT-2) the baseline, each with the same batch."""
    cfg_over = dict(SHAPES[family])
    preset = cfg_over.pop("preset")
    cfg_over.update(shape)
    ours = build_model(preset, **cfg_over)
    cfg = ours.config
    hf = hf_model(family, cfg)
    n_ours, n_hf = unique_params(ours), unique_params(hf)
    if n_ours != n_hf:
        raise SystemExit(f"{family}: configurations differ: tformer {n_ours:,} vs HF {n_hf:,} parameters")
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen)
    out = []
    if family == "gpt2":
        shifted = torch.cat((ids[:, 1:], torch.full((batch, 1), -100)), dim=1)  # HF shifts inside
        flops = training_flops(cfg, batch, seq)
        out.append(Contender("tformer", ours, lambda: ours(ids, labels=shifted).loss, flops, batch * seq))
        out.append(Contender("HF", hf, lambda: hf(input_ids=ids, labels=ids).loss, flops, batch * seq))
        base = MiniGPT(cfg.vocab_size, cfg.max_seq_len, cfg.d_model, cfg.num_heads, cfg.num_layers, cfg.d_ff)
        if unique_params(base) != n_ours:
            raise SystemExit(f"baseline has {unique_params(base):,} parameters, tformer {n_ours:,}")
        out.append(Contender("baseline", base, lambda: base(ids, shifted), flops, batch * seq))
    elif family == "bert":
        masked = torch.rand(batch, seq, generator=gen) < 0.15
        labels = ids.masked_fill(~masked, -100)
        flops = training_flops(cfg, batch, seq)
        out.append(Contender("tformer", ours, lambda: ours(ids, labels=labels).loss, flops, batch * seq))
        out.append(Contender("HF", hf, lambda: hf(input_ids=ids, labels=labels).loss, flops, batch * seq))
    else:
        target = torch.randint(2, cfg.vocab_size, (batch, target_len), generator=gen)
        flops = training_flops(cfg, batch, seq, target_len)
        tokens = batch * (seq + target_len)
        out.append(Contender("tformer", ours, lambda: ours(ids, labels=target).loss, flops, tokens))
        out.append(Contender("HF", hf, lambda: hf(input_ids=ids, labels=target).loss, flops, tokens))
    return cfg, out


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


def ratio(a: Contender, b: Contender) -> tuple[float, float]:
    """(median-step ratio, best-step ratio) of a's speed over b's."""
    return b.median() / a.median(), b.best() / a.best()


# --------------------------------------------------------------------------------------------
def bench_family(family: str, precision: str, args, tiny: bool, results: list) -> None:
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    batch, seq, tlen = (TINY_BATCH, TINY_SEQ, TINY_TARGET_LEN) if tiny else (BATCH, SEQ, TARGET_LEN)
    shape = {k: v for k, v in TINY.items() if not (k == "num_decoder_layers" and family != "t5")} if tiny else {}
    if tiny and family == "t5":
        shape["d_head"] = 64
    cfg, models = contenders_for(family, shape, batch, seq, tlen, gen)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    if precision == "bf16":
        def autocast():
            return torch.autocast("cpu", dtype=torch.bfloat16)
    else:
        autocast = contextlib.nullcontext
    # Size the matmul like one model step.
    models[0].step(autocast)
    t0 = time.perf_counter()
    models[0].step(autocast)
    mm = matmul_contender(dtype, time.perf_counter() - t0)
    everyone = models + [mm]
    shape_text = (f"d_model {cfg.d_model}, heads {cfg.num_heads} x {cfg.head_dim}, layers {cfg.num_layers}"
                  + (f"+{cfg.decoder_layers}" if family == "t5" else "")
                  + f", d_ff {cfg.d_ff}, vocab {cfg.vocab_size}, batch {batch}, seq {seq}"
                  + (f", target {tlen}" if family == "t5" else "")
                  + f"; {models[0].flops / 1e9:.1f} GFLOP/step")
    print(f"\n[{family} {precision}] {shape_text}; {unique_params(models[0].model) / 1e6:.1f}M params; "
          f"attention: tformer {cfg.attn_impl}, HF {models[1].model.config._attn_implementation}", flush=True)
    attempts = 0
    best_attempt = None
    while True:
        attempts += 1
        interleave(everyone, args.steps, args.warmup if attempts == 1 else 1, autocast)
        spread = max(c.spread() for c in everyone)
        print(f"  attempt {attempts}: " + ", ".join(
            f"{c.name} {c.median():.3f}s (best {c.best():.3f})" for c in everyone)
            + f"; worst best-vs-median spread {spread:.0%}", flush=True)
        snapshot = {c.name: list(c.times) for c in everyone}
        if best_attempt is None or spread < best_attempt[0]:
            best_attempt = (spread, snapshot)
        if spread <= NOISE or attempts > args.retries:
            break
    for c in everyone:
        c.times = best_attempt[1][c.name]
    noisy = best_attempt[0] > NOISE
    by_name = {c.name: c for c in models}
    for c in models:
        vs_hf = ratio(c, by_name["HF"]) if c.name != "HF" else None
        vs_base = ratio(c, by_name["baseline"]) if "baseline" in by_name and c.name != "baseline" else None
        frac = (c.flops / c.median()) / (mm.flops / mm.median())
        results.append(dict(family=family, precision=precision, name=c.name, tiny=tiny, noisy=noisy,
                            tok_best=c.tokens / c.best(), tok_med=c.tokens / c.median(),
                            vs_hf=vs_hf, vs_base=vs_base, frac=frac,
                            gflops=c.flops / c.median() / 1e9, mm_gflops=mm.flops / mm.median() / 1e9))
    for m in models:  # free memory before the next family
        m.model = m.optimizer = None


def bench_generate(args) -> dict:
    torch.manual_seed(0)
    over = dict(SHAPES["gpt2"])
    model = build_model(over.pop("preset"), **over).eval()
    prompt = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1))
    generate(model, prompt, 8, eos_token_id=None)  # warm-up
    generate(model, prompt, 8, eos_token_id=None, use_cache=False)
    times = {True: [], False: []}
    outs = {}
    for _ in range(args.gen_repeats):
        for use_cache in (True, False):
            t0 = time.perf_counter()
            outs[use_cache] = generate(model, prompt, 256, eos_token_id=None, use_cache=use_cache)
            times[use_cache].append(time.perf_counter() - t0)
    same = torch.equal(outs[True], outs[False])
    cached, uncached = min(times[True]), min(times[False])
    return dict(cached=cached, uncached=uncached, speedup=uncached / cached, same=same)


# --------------------------------------------------------------------------------------------
def verdict(value: float | None, target: float | None, noisy: bool) -> str:
    if value is None or target is None:
        return ""
    return ("PASS" if value >= target else "MISS") + (" (noisy)" if noisy else "")


def fmt_ratio(r) -> str:
    return "-" if r is None else f"{r[0]:.2f} ({r[1]:.2f})"


def print_table(results: list, gen: dict | None, mm_rates: dict) -> None:
    print("\n" + "=" * 118)
    print("Forward + backward + AdamW, tokens/s; ratios = median-step ratio (best-step ratio); "
          "%mm = model FLOP/s over the same run's torch.mm FLOP/s (medians)")
    head = (f"{'family':6} {'prec':5} {'contender':9} {'tok/s med':>10} {'tok/s best':>10} {'GFLOP/s':>8} "
            f"{'vs HF':>12} {'vs base':>12} {'%mm':>6}  verdicts")
    print(head)
    print("-" * len(head))
    for r in results:
        checks = []
        if r["name"] == "tformer":
            fam = r["family"]
            if r["vs_hf"] is not None:
                checks.append(f"vsHF>={TARGETS[(fam, 'hf')]}: "
                              f"{verdict(r['vs_hf'][0], TARGETS[(fam, 'hf')], r['noisy'])}")
            if r["vs_base"] is not None:
                checks.append(f"vsBase>={TARGETS[(fam, 'base')]}: "
                              f"{verdict(r['vs_base'][0], TARGETS[(fam, 'base')], r['noisy'])}")
            if r["precision"] == "bf16":
                checks.append(f"%mm>={BF16_MM_TARGET:.0%}: {verdict(r['frac'], BF16_MM_TARGET, r['noisy'])}")
        elif r["noisy"]:
            checks.append("(noisy)")
        prec = r["precision"] + ("*" if r["tiny"] else "")
        print(f"{r['family']:6} {prec:5} {r['name']:9} {r['tok_med']:10.0f} {r['tok_best']:10.0f} "
              f"{r['gflops']:8.1f} {fmt_ratio(r['vs_hf']):>12} {fmt_ratio(r['vs_base']):>12} "
              f"{r['frac']:6.0%}  {'; '.join(checks)}")
    for prec, rates in mm_rates.items():
        print(f"torch.mm {prec}: {min(rates):.1f}-{max(rates):.1f} GFLOP/s (median step, per family round)")
    if any(r["tiny"] for r in results):
        print("* bf16 rounds ran the toy shapes: this CPU has no bf16 matmul instructions, so bf16 GEMM is a "
              "scalar fallback (see torch.mm bf16 above) and the benchmark shapes would take minutes per step.")
    if gen is not None:
        print(f"generation, gpt2 flavour, batch 1, 16-token prompt + 256 new tokens: cached {gen['cached']:.2f}s, "
              f"uncached {gen['uncached']:.2f}s -> {gen['speedup']:.1f}x "
              f"(>= {GENERATE_TARGET:.0f}x: {verdict(gen['speedup'], GENERATE_TARGET, False)}); "
              f"same tokens: {gen['same']}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer steps and retries (~3 min)")
    p.add_argument("--family", default="gpt2,bert,t5", help="comma list of gpt2, bert, t5")
    p.add_argument("--precision", default="fp32,bf16", help="comma list of fp32, bf16")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (1 = least noise)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per contender")
    p.add_argument("--no-generate", action="store_true", help="skip the generation benchmark")
    args = p.parse_args(argv)
    args.steps = args.steps or (4 if args.quick else 8)
    args.warmup = 1 if args.quick else 2
    args.retries = 1 if args.quick else 2
    args.gen_repeats = 1 if args.quick else 2
    families = [f.strip() for f in args.family.split(",") if f.strip()]
    precisions = [x.strip() for x in args.precision.split(",") if x.strip()]
    for f in families:
        if f not in SHAPES:
            p.error(f"unknown family {f!r}; use gpt2, bert or t5")
    for x in precisions:
        if x not in ("fp32", "bf16"):
            p.error(f"unknown precision {x!r}; use fp32 or bf16")
    torch.set_num_threads(args.threads)
    import transformers
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {args.threads} threads, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"oneDNN bf16: {torch.ops.mkldnn._is_mkldnn_bf16_supported()}")
    print(f"optimizer: torch.optim.AdamW(lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True) for every contender (as tformer.train.optim on CPU); "
          f"{args.steps} interleaved steps after {args.warmup} warm-up; up to {args.retries} retries if noisy")
    # bf16 without hardware support: fall back to toy shapes (detected, not assumed).
    tiny_bf16 = False
    if "bf16" in precisions:
        fp = matmul_contender(torch.float32, 0.05)
        bf = matmul_contender(torch.bfloat16, 0.05)
        interleave([fp, bf], 2, 0, contextlib.nullcontext)
        r_fp, r_bf = fp.flops / fp.best(), bf.flops / bf.best()
        tiny_bf16 = r_bf < 0.1 * r_fp
        print(f"torch.mm probe: fp32 {r_fp / 1e9:.1f} GFLOP/s, bf16 {r_bf / 1e9:.1f} GFLOP/s"
              + (" -> bf16 rounds use toy shapes" if tiny_bf16 else ""))
    results = []
    start = time.perf_counter()
    for precision in precisions:
        for family in families:
            bench_family(family, precision, args, tiny_bf16 and precision == "bf16", results)
    gen = None if args.no_generate else bench_generate(args)
    mm_rates = {}
    for r in results:
        mm_rates.setdefault(r["precision"], []).append(r["mm_gflops"])
    print_table(results, gen, mm_rates)
    print(f"total {time.perf_counter() - start:.0f}s")


if __name__ == "__main__":
    main()
