"""Encoder MLM without padding compute: packed documents against padded ones, tokens per second.

    python bench/bench_packed_mlm.py [--steps 12] [--verses 20000] [--batch 16]

ModernBERT-tiny as configs/modernbert-tiny.yaml builds it (4 x 128, GeGLU, RoPE, every third
block global and 16-token windows elsewhere; vocabulary 4096, a WordPiece tokenizer trained on the
verses), fp32, one thread. Data: the first ``--verses`` verses of ../shared/data/bible_web.txt.gz
(the bundled corpus when that is absent), one masked ``[CLS] verse [SEP]`` per document
(``MLMDocuments``), lengths as they come. Two contenders, interleaved step by step, at the same
micro-batch of ``--batch`` rows:

  padded   ``--batch`` documents a step, drawn at random, padded to the batch's longest (the trainer's
           collator), a padding mask; what an encoder computes without packing
  packed   ``--batch`` rows of ``PackedMLM`` (the same documents first-fit into rows of at most 128
           tokens, document masks, positions restarting per document: ``data.pack: true``)

Each step is forward + backward (loss at the masked positions only, as the trainer runs it) + an
AdamW step; the rate is real (non-padding) tokens per second of the median step. The padding
fraction of each contender's batches is printed; 1 / (1 - padded's padding fraction) bounds what
packing can gain where a slot costs the same. Verdict: PASS when packed / padded >= 1.5x (the
target of issue 54), or, on data whose padding bounds the gain below 1.66x, >= 0.9 of that bound;
MISS otherwise (exit code 1).
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
TARGET = 1.5


def packed_verdict(ratio: float, padded_padding: float) -> str:
    """PASS / MISS line for ``ratio`` = packed / padded tokens per second; the bar is TARGET, or 0.9
    of the bound the padded batches' padding fraction sets when that bound is below TARGET / 0.9."""
    bound = 1.0 / max(1e-9, 1.0 - padded_padding)
    need = TARGET if bound >= TARGET / 0.9 else 0.9 * bound
    verdict = "PASS" if ratio >= need else "MISS"
    return f"{verdict} packed / padded = {ratio:.2f}x (need >= {need:.2f}x; padding bounds it at {bound:.2f}x)"


def verses(count: int) -> tuple[list[str], Path]:
    shared = ROOT.parent / "shared" / "data" / "bible_web.txt.gz"
    if not shared.is_file():
        from tformer.data import default_corpus_path

        shared = Path(default_corpus_path())
    with gzip.open(shared, "rt", encoding="utf-8") as f:
        return [line.strip() for line in itertools.islice(f, count) if line.strip()], shared


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12, help="interleaved training steps per contender")
    p.add_argument("--verses", type=int, default=20000, help="documents read from the corpus")
    p.add_argument("--batch", type=int, default=16, help="rows per micro-batch, both contenders")
    args = p.parse_args()

    import torch

    from tformer.data import Collator, MLMDocuments, PackedMLM, TokenizedCorpus, load_tokenizer, train_tokenizer
    from tformer.models import build_model
    from tformer.train.config import load_config

    torch.set_num_threads(1)
    torch.manual_seed(0)
    texts, source = verses(args.verses)
    with tempfile.TemporaryDirectory() as work:
        text = Path(work) / "verses.txt"
        text.write_text("\n".join(texts) + "\n", encoding="utf-8")
        train_tokenizer("wordpiece", str(text), 4096, Path(work) / "tok.json")
        tok = load_tokenizer(Path(work) / "tok.json")
    corpus = TokenizedCorpus.from_docs(e.ids for e in tok.encode_batch(texts, add_special_tokens=False))
    cfg = load_config(ROOT / "configs" / "modernbert-tiny.yaml", ["precision=fp32"])
    docs = MLMDocuments(corpus, tok, cfg.data.seq_len, seed=0, mask_prob=cfg.data.mlm_probability)
    packed = PackedMLM(docs, seed=0)
    model = build_model(cfg.model.replace(pad_token_id=0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    collate = Collator(pad_id=0)
    rng = np.random.default_rng(0)
    padding: dict[str, list[float]] = {"padded": [], "packed": []}

    def batches(ds, name):
        keys = ("input_ids", "attention_mask", "labels", "doc_ids", "position_ids")
        while True:
            batch = collate([ds[int(i)] for i in rng.integers(0, len(ds), args.batch)])
            padding[name].append(1.0 - float(batch["attention_mask"].float().mean()))
            yield {k: batch[k] for k in keys if k in batch}

    def timed(it):
        def go():
            inputs = next(it)
            real = int(inputs["attention_mask"].sum())
            t0 = time.perf_counter()
            model(**inputs, return_logits=False).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return (time.perf_counter() - t0) / real  # seconds per real token

        return go

    steps = {"padded": timed(batches(docs, "padded")), "packed": timed(batches(packed, "packed"))}
    for go in steps.values():
        go()  # warm-up
    per: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(args.steps):
        for k, go in steps.items():
            per[k].append(go())
    rate = {k: 1.0 / float(np.median(v)) for k, v in per.items()}
    lengths = docs.lengths()
    print(
        f"modernbert-tiny MLM, fp32, 1 thread, median of {args.steps} interleaved steps of {args.batch} rows; "
        f"{len(docs):,} documents of {source.name} ({lengths.mean():.1f} tokens on average, {lengths.max()} at most, "
        f"[CLS]/[SEP] included) -> {len(packed):,} packed rows of <= {cfg.data.seq_len}"
    )
    for k, r in rate.items():
        print(f"  {k:7}: {r:9,.0f} real tokens/s  (padding fraction of its batches: {np.mean(padding[k]):.1%})")
    ratio = rate["packed"] / rate["padded"]
    line = packed_verdict(ratio, float(np.mean(padding["padded"])))
    print(line)
    sys.exit(0 if line.startswith("PASS") else 1)


if __name__ == "__main__":
    main()
