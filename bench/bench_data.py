"""Data path vs training: can tokenize-and-pack keep a GPT-2-small trainer fed on this machine?

    python bench/bench_data.py [--seq-len 1024] [--num-proc 2] [--train-steps 2]

Measures, on the bundled World English Bible (train split):
  1. tokenizer training (one-off, byte-level BPE) -- reported, not part of the ratios;
  2. first start, in a fresh process: tokenize with `datasets` (num_proc) into the token cache,
     then pack every sample into seq_len windows and collate batches;
  3. second start, in a fresh process: the same call hits the cache (np.memmap);
  4. training consumption: fwd + bwd + AdamW steps of HF GPT2LMHeadModel built from the default
     GPT2Config (124M, 12 x 768, 1024 positions; no hub access), fp32 by default (bf16
     autocast with --precision bf16; it is emulated, hence slow, on CPUs without avx512_bf16).
Prints data tokens/s beside training tokens/s and checks data/train >= 20x and
cached/first start < 5%.

    python bench/bench_data.py --scale [--steps 12]

Data at scale (issue 17), same-run ratios:
  1. `tformer data prepare`'s sharded tokenizer (``prepare_columns``) on the bundled WEB Bible with
     1 and 2 worker processes: tokens/s and their ratio (best of two runs each, interleaved);
  2. t5-tiny-translate (configs/t5-tiny-translate.yaml, fp32) on the bundled en-es pairs: real
     (non-pad) target tokens per second of training steps on padded batches of micro_batch_size
     pairs (padded to the batch's longest, as the trainer does; and to seq_len, fixed shapes)
     against document-masked packed rows (data.document_mask=true, data.pack_len=128, 12 rows:
     the same token slots per batch), interleaved; need >= 1.8x. The share of target slots
     holding tokens is printed too: its ratio bounds the speed-up where a slot costs the same;
  3. decoder (GPT-2 flavour, 4 x 256, seq 512, batch 4) fwd + bwd step time with the document
     mask against the plain causal fast path, on CPU (SDPA + boolean mask; CUDA would use Flex).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def start(tokenizer_path: str, cache_dir: str, seq_len: int, num_proc: int, batch_size: int) -> dict:
    """One data start: corpus -> token cache (or cache hit) -> packed dataset -> every batch."""
    import torch

    from tformer.data import (
        Collator,
        PackedCausalLM,
        ResumableSampler,
        default_corpus_path,
        load_tokenizer,
        special_tokens,
        tokenize_corpus,
    )

    tok = load_tokenizer(tokenizer_path)
    eos = special_tokens(tok).eos_id
    t0 = time.perf_counter()
    corpus = tokenize_corpus(default_corpus_path(), tok, cache_dir, split="train", num_proc=num_proc)
    t_tokenize = time.perf_counter() - t0
    ds = PackedCausalLM(corpus, seq_len, eos_id=eos)
    loader = torch.utils.data.DataLoader(
        ds, batch_size=batch_size, collate_fn=Collator(eos), sampler=ResumableSampler(len(ds), seed=0, num_epochs=1)
    )
    first_batch = None
    tokens = 0
    for batch in loader:
        if first_batch is None:
            first_batch = time.perf_counter() - t0
        tokens += batch["input_ids"].numel()
    total = time.perf_counter() - t0
    return dict(
        corpus_tokens=corpus.num_tokens,
        docs=corpus.num_docs,
        samples=len(ds),
        packed_tokens=tokens,
        tokenize_s=t_tokenize,
        pack_s=total - t_tokenize,
        first_batch_s=first_batch,
        total_s=total,
    )


def run_start(args, tokenizer_path: str, cache_dir: str) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--phase",
        "start",
        "--tokenizer",
        tokenizer_path,
        "--cache",
        cache_dir,
        "--seq-len",
        str(args.seq_len),
        "--num-proc",
        str(args.num_proc),
        "--batch-size",
        str(args.batch_size),
    ]
    t0 = time.perf_counter()
    out = subprocess.run(
        cmd,
        check=True,
        capture_output=True,
        text=True,
        env={
            **os.environ,
            "HF_DATASETS_OFFLINE": "1",
            "HF_HUB_OFFLINE": "1",
            "HF_HOME": str(Path(cache_dir).parent / "hf_home"),
        },
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["process_s"] = time.perf_counter() - t0
    return result


def train_rate(seq_len: int, steps: int, dtype: str) -> float:
    """Tokens/s of GPT-2-small fwd + bwd + AdamW at batch 1 on this machine."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_positions=max(1024, seq_len)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, model.config.vocab_size, (1, seq_len))

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # warm-up: allocations, optimizer state
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    return steps * seq_len / (time.perf_counter() - t0)


def _best_of(fns: dict, rounds: int) -> dict:
    """Run the contenders interleaved ``rounds`` times; the best (smallest) time of each."""
    best = {k: float("inf") for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            best[k] = min(best[k], fn())
    return best


def bench_prepare(work: Path) -> None:
    import resource

    from tformer.data import default_corpus_path, default_pairs_path, train_tokenizer
    from tformer.data.cache import prepare_columns

    tok = train_tokenizer("bpe", default_corpus_path(), 8000, None)
    jobs = [(default_corpus_path(), ["text"]), (default_pairs_path(), ["src", "tgt"])]
    tokens, cpu = {}, {}

    def cpu_s():
        own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime

    def run(workers):
        def go():
            cache = work / f"prepare-{workers}-{time.perf_counter_ns()}"
            t0, c0, n = time.perf_counter(), cpu_s(), 0
            for source, columns in jobs:
                out = prepare_columns(
                    source, tok, cache, columns, split="all", workers=workers, shard_rows=4000, progress=False
                )
                n += sum(c.num_tokens for c in out.values())
            dt = time.perf_counter() - t0
            tokens[workers] = n
            cpu[workers] = min(cpu.get(workers, float("inf")), cpu_s() - c0)
            return dt

        return go

    best = _best_of({1: run(1), 2: run(2)}, 2)
    rate = {w: tokens[w] / best[w] for w in best}
    print(
        f"prepare (WEB Bible + en-es pairs, all rows, {tokens[1]:,} tokens, shards of 4000 rows, incl. "
        f"Arrow load; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores):"
    )
    for w in (1, 2):
        print(f"  workers={w}: {best[w]:6.2f} s wall, {cpu[w]:6.2f} s CPU  {rate[w]:12,.0f} tokens/s")
    print(f"  2 workers / 1 worker = {rate[2] / rate[1]:.2f}x")


def bench_translate_packing(work: Path, steps: int, pack_len: int = 128) -> bool:
    import numpy as np
    import torch

    from tformer.models import build_model
    from tformer.train.config import load_config
    from tformer.train.loop.data import build_data

    os.environ["TFORMER_CACHE"] = str(work / "cache")
    base = [f"output_dir={work}/run", "precision=fp32"]
    cfg_pad = load_config(ROOT / "configs" / "t5-tiny-translate.yaml", base)
    # the same slots per batch: micro_batch_size pairs padded to <= seq_len, or fewer, longer
    # rows (pairs still at most seq_len long)
    cfg_pack = load_config(
        ROOT / "configs" / "t5-tiny-translate.yaml",
        base
        + [
            "data.document_mask=true",
            f"data.pack_len={pack_len}",
            f"micro_batch_size={cfg_pad.micro_batch_size * cfg_pad.data.seq_len // pack_len}",
        ],
    )
    padded, packed = build_data(cfg_pad), build_data(cfg_pack)
    torch.manual_seed(0)
    model = build_model(padded.model_config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rng = np.random.default_rng(0)

    fill = {}

    def batches(data, b, name, collator=None):
        ds, collate = data.train, collator or data.collator
        while True:
            batch = collate([ds[int(i)] for i in rng.integers(0, len(ds), b)])
            fill.setdefault(name, []).append(float((batch["labels"] != -100).float().mean()))
            yield {k: batch[k] for k in data.model_inputs if k in batch}

    def timed(it):
        def go():
            inputs = next(it)
            real = int((inputs["labels"] != -100).sum())
            t0 = time.perf_counter()
            model(**inputs, return_logits=False).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return (time.perf_counter() - t0) / real  # seconds per real target token

        return go

    from tformer.data import Collator

    its = {
        "padded": batches(padded, cfg_pad.micro_batch_size, "padded"),
        "padded to seq_len": batches(
            padded, cfg_pad.micro_batch_size, "padded to seq_len", Collator(padded.collator.pad_id, cfg_pad.data.seq_len)
        ),
        "packed": batches(packed, cfg_pack.micro_batch_size, "packed"),
    }
    for it in its.values():
        timed(it)()  # warm-up
    per = {k: [] for k in its}
    for _ in range(steps):
        for k, it in its.items():
            per[k].append(timed(it)())
    rate = {k: 1.0 / float(np.median(v)) for k, v in per.items()}
    ratio = rate["packed"] / rate["padded"]
    print(
        f"t5-tiny-translate on en-es pairs, fp32, median of {steps} interleaved steps: padded batches of "
        f"{cfg_pad.micro_batch_size} pairs (<= {cfg_pad.data.seq_len} tokens) against "
        f"{cfg_pack.micro_batch_size} packed rows of {cfg_pack.data.pack_len} "
        f"({len(packed.train.pairs):,} pairs -> {len(packed.train):,} rows)"
    )
    for k, r in rate.items():
        print(f"  {k:17}: {r:8,.0f} real target tokens/s  (target slots filled: {np.mean(fill[k]):.0%})")
    print(
        f"  packed / padded = {ratio:.2f}x  [need >= 1.8x: {'ok' if ratio >= 1.8 else 'FAIL'}]; the fill "
        f"ratio bounds it at {np.mean(fill['packed']) / np.mean(fill['padded']):.2f}x on this data; packed / "
        f"padded to seq_len = {rate['packed'] / rate['padded to seq_len']:.2f}x"
    )
    return ratio >= 1.8


def bench_decoder_mask(steps: int) -> None:
    import torch

    from tformer.models import build_model
    from tformer.nn import positions_from_doc_ids

    torch.manual_seed(0)
    model = build_model("gpt2-tiny", d_model=256, num_layers=4, num_heads=4, d_ff=1024, max_seq_len=512)
    x = torch.randint(1, 1024, (4, 512))
    doc = torch.cumsum(torch.rand(4, 512) < 1 / 60, dim=1)  # documents of ~60 tokens

    def step(**kw):
        def go():
            t0 = time.perf_counter()
            model(x, labels=x, return_logits=False, **kw).loss.backward()
            model.zero_grad(set_to_none=True)
            return time.perf_counter() - t0

        return go

    contenders = {"causal (no mask)": step(), "document mask": step(doc_ids=doc, position_ids=positions_from_doc_ids(doc))}
    for fn in contenders.values():
        fn()
    best = _best_of(contenders, steps)
    print(
        f"decoder fwd + bwd, 4 x 256, batch 4 x 512, CPU (best of {steps}, interleaved; CUDA takes FlexAttention instead):"
    )
    for k, t in best.items():
        print(f"  {k:17}: {1000 * t:8.1f} ms")
    print(f"  masked / plain = {best['document mask'] / best['causal (no mask)']:.2f}x")


def scale_main(args) -> None:
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(dir=args.work_dir) as work:
        work = Path(work)
        bench_prepare(work)
        ok = bench_translate_packing(work, args.steps)
    bench_decoder_mask(max(3, args.steps // 2))
    sys.exit(0 if ok else 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scale", action="store_true", help="the data-at-scale benchmark (see the docstring)")
    p.add_argument("--steps", type=int, default=12, help="--scale: interleaved training steps per contender")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--num-proc", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--vocab-size", type=int, default=16384, help="BPE tokenizer trained for the bench")
    p.add_argument("--train-steps", type=int, default=2)
    p.add_argument("--precision", nargs="+", default=["fp32"], choices=["fp32", "bf16"])
    p.add_argument("--work-dir", default=None, help="default: a temporary directory")
    p.add_argument("--phase", default="all", choices=["all", "start"], help=argparse.SUPPRESS)
    p.add_argument("--tokenizer", help=argparse.SUPPRESS)
    p.add_argument("--cache", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.scale:
        scale_main(args)
        return
    if args.phase == "start":
        print(json.dumps(start(args.tokenizer, args.cache, args.seq_len, args.num_proc, args.batch_size)))
        return

    import torch

    from tformer.data import check_vocab, default_corpus_path, train_tokenizer

    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory(dir=args.work_dir) as work:
        work = Path(work)
        t0 = time.perf_counter()
        tok = train_tokenizer("bpe", default_corpus_path(), args.vocab_size, work / "tok")
        t_tok = time.perf_counter() - t0
        check_vocab(tok, 50257)
        first = run_start(args, str(work / "tok"), str(work / "cache"))
        second = run_start(args, str(work / "tok"), str(work / "cache"))

    rates = {d: train_rate(args.seq_len, args.train_steps, d) for d in args.precision}
    train = max(rates.values())
    first_rate = first["corpus_tokens"] / (first["tokenize_s"] + first["pack_s"])
    cached_rate = second["packed_tokens"] / (second["tokenize_s"] + second["pack_s"])
    start_ratio = second["first_batch_s"] / first["first_batch_s"]

    print(
        f"corpus: bundled WEB Bible, train split: {first['corpus_tokens']:,} tokens in "
        f"{first['docs']:,} rows -> {first['samples']:,} packed samples of {args.seq_len}"
    )
    print(f"tokenizer training (one-off, bpe {tok.get_vocab_size():,} tokens): {t_tok:.1f} s")
    print(f"{'':34}{'seconds':>10}{'tokens/s':>14}")
    print(
        f"{'first start: tokenize (num_proc=' + str(args.num_proc) + ')':34}{first['tokenize_s']:10.2f}"
        f"{first['corpus_tokens'] / first['tokenize_s']:14,.0f}"
    )
    print(f"{'first start: pack + collate all':34}{first['pack_s']:10.2f}{first['packed_tokens'] / first['pack_s']:14,.0f}")
    print(f"{'first start: tokenize-and-pack':34}{first['tokenize_s'] + first['pack_s']:10.2f}{first_rate:14,.0f}")
    print(f"{'cached start: open + pack all':34}{second['tokenize_s'] + second['pack_s']:10.2f}{cached_rate:14,.0f}")
    for d, r in rates.items():
        print(f"{'train GPT-2 small, ' + d + ', b1 x ' + str(args.seq_len):34}{args.seq_len / r:10.2f}{r:14,.0f}")
    print(
        f"start to first batch: first {first['first_batch_s']:.2f} s, cached {second['first_batch_s']:.3f} s"
        f" (processes incl. imports: {first['process_s']:.1f} s, {second['process_s']:.1f} s)"
    )
    ok_rate = first_rate >= 20 * train
    ok_start = start_ratio < 0.05
    print(
        f"data/train = {first_rate / train:,.0f}x (cached loader {cached_rate / train:,.0f}x)  "
        f"[need >= 20x: {'ok' if ok_rate else 'FAIL'}]"
    )
    print(f"cached/first start = {100 * start_ratio:.2f}%  [need < 5%: {'ok' if ok_start else 'FAIL'}]")
    sys.exit(0 if ok_rate and ok_start else 1)


if __name__ == "__main__":
    main()
