"""The paper's Transformer against HF ``MarianMTModel``: translation quality after equal training, and
beam-search decoding speed.

    python bench/bench_translate.py [--steps N] [--samples N] [--threads 1] [--decode-only] [overrides ...]

1. Training (skipped with ``--decode-only``). ``configs/transformer-tiny-translate.yaml`` (plus any
   ``key=value`` overrides) is trained ``--steps`` optimizer steps by tformer's ``Trainer``. The HF
   reference is ``MarianMTModel`` of the same configuration, starting from the same initial weights
   (tformer's step-0 model mapped through the exporter's name map and d_model permutation), trained
   by a plain loop with the same token-budget batches (same sampler, seed and collator), the same
   AdamW settings, gradient clipping, inverse-sqrt schedule and label smoothing
   (``F.cross_entropy(..., label_smoothing)`` on HF's logits). Dropout streams differ. Both are then
   scored on the same ``--samples`` validation pairs with sacrebleu, each decoded by its own beam
   search with the run's beams and ``length_penalty`` in HF's form (``length_norm="power"``), so the
   decoding rule is the same. Printed: BLEU, chrF and training time of each, and the verdict
   (``quality_line``): PASS needs tformer's BLEU >= HF's - 0.5 and its validation NLL <= HF's + 2%,
   and a comparison that says something: both trainings ran every step with a finite loss, and HF
   reached BLEU >= 1 (two untrained models agree trivially: 0.07 vs 0.13 after 100 steps). FAIL
   otherwise, naming why (train longer: ``--steps``).
2. Decoding. tformer ``beam_search`` against HF ``generate(num_beams=k, length_penalty=a)`` on the
   same model and sources (the trained ones, or random weights with ``--decode-only``), interleaved
   and repeated; tokens/s from the generated tokens (the same tokens: parity is tested in
   tests/test_beam.py). Printed: tokens/s of each (median of repeats) and their ratio.

A benchmark, not a test: figures depend on the machine and on whatever else runs on it.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tformer.evaluate import bleu, corpus_scores  # noqa: E402
from tformer.export import to_hf_model  # noqa: E402
from tformer.generate import beam_search  # noqa: E402
from tformer.train.config import load_config  # noqa: E402
from tformer.train.loop.optim import build_optimizer, build_scheduler  # noqa: E402
from tformer.train.trainer import Trainer  # noqa: E402


MIN_BLEU = 1.0  # below this neither model translates yet: their BLEU gap says nothing


def quality_line(ours_bleu, hf_bleu, ours_nll, hf_nll, trained: bool) -> str:
    """The verdict of the quality comparison: FAIL when it cannot say anything, else PASS or MISS."""
    target = "target: BLEU gap >= -0.5, NLL <= HF's + 2%"
    if not trained:
        return f"FAIL ({target}): a training run stopped early or its loss was not finite"
    if hf_bleu < MIN_BLEU:
        return f"FAIL ({target}): HF's BLEU {hf_bleu:.2f} < {MIN_BLEU}, nothing learnt to compare; train longer (--steps)"
    met = ours_bleu >= hf_bleu - 0.5 and ours_nll <= hf_nll * 1.02
    return f"{'PASS' if met else 'MISS'} ({target}): gap {ours_bleu - hf_bleu:+.2f}, NLL {ours_nll / hf_nll:.3f}x HF's"


def train_hf(hf, trainer: Trainer, steps: int) -> tuple[float, bool]:
    """The plain loop: the trainer's batches, optimizer settings, schedule, clipping and smoothing.
    (seconds, whether every loss was finite)."""
    cfg = trainer.cfg
    opt = build_optimizer(hf, cfg.optim, torch.device("cpu"))
    sched = build_scheduler(opt, cfg.optim, cfg.max_steps)
    trainer.consumed = 0
    batches = trainer._batches()
    hf.train()
    start, finite = time.perf_counter(), True
    for _ in range(steps):
        batch = next(batches)
        logits = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]).logits
        loss = F.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]),
            batch["labels"].reshape(-1),
            ignore_index=-100,
            label_smoothing=cfg.optim.label_smoothing,
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(hf.parameters(), cfg.optim.grad_clip)
        opt.step()
        sched.step()
        finite &= bool(torch.isfinite(loss))
    return time.perf_counter() - start, finite


@torch.no_grad()
def hf_bleu(hf, trainer: Trainer, n: int, beams: int, alpha: float, max_new: int) -> tuple[float, float]:
    data, pad = trainer.data, trainer.model_cfg.pad_token_id
    hf.eval()
    samples = [data.validation.sample(i) for i in range(n)]
    hyps = []
    for start in range(0, n, 32):
        group = samples[start : start + 32]
        width = max(len(s["input_ids"]) for s in group)
        ids = torch.full((len(group), width), pad)
        mask = torch.zeros_like(ids)
        for r, s in enumerate(group):
            ids[r, : len(s["input_ids"])], mask[r, : len(s["input_ids"])] = torch.as_tensor(s["input_ids"]), 1
        out = hf.generate(
            input_ids=ids,
            attention_mask=mask,
            num_beams=beams,
            length_penalty=alpha,
            max_new_tokens=max_new,
            do_sample=False,
            early_stopping=False,
        )
        hyps += [data.tokenizer.decode(r[1:].tolist(), skip_special_tokens=True) for r in out]
    refs = [data.tokenizer.decode([t for t in s["labels"].tolist() if t >= 0], skip_special_tokens=True) for s in samples]
    b, c, _, _ = corpus_scores(hyps, refs)
    return b, c


@torch.no_grad()
def val_nll(forward, trainer: Trainer, n: int) -> float:
    """Mean NLL per target token of the first ``n`` validation pairs (plain, unsmoothed)."""
    data, total, count = trainer.data, 0.0, 0
    for start in range(0, n, 32):
        batch = data.collator([data.validation.sample(i) for i in range(start, min(n, start + 32))])
        logits = forward(batch).float()
        labels = batch["labels"]
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum").item()
        count += int((labels != -100).sum())
    return total / count


def decode_speed(model, hf, sources, mask, beams: int, alpha: float, max_new: int, repeats: int) -> None:
    model.eval()
    hf.eval()
    times: dict[str, list[float]] = {"tformer": [], "hf": []}
    tokens: dict[str, int] = {}
    with torch.no_grad():
        for _ in range(repeats):
            t0 = time.perf_counter()
            ours = beam_search(
                model, sources, max_new, num_beams=beams, attention_mask=mask, length_penalty=alpha, length_norm="power"
            )
            times["tformer"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            theirs = hf.generate(
                input_ids=sources,
                attention_mask=mask,
                num_beams=beams,
                length_penalty=alpha,
                max_new_tokens=max_new,
                do_sample=False,
                early_stopping=False,
            )
            times["hf"].append(time.perf_counter() - t0)
            # generated tokens up to and including EOS (both give the same tokens: tests/test_beam.py)
            tokens["tformer"] = int((ours[:, 1:] != model.config.pad_token_id).sum())
            del theirs
    rate = {k: tokens["tformer"] / statistics.median(v) for k, v in times.items()}
    best = {k: tokens["tformer"] / min(v) for k, v in times.items()}
    print(
        f"beam search ({beams} beams, {sources.shape[0]} sources, {tokens['tformer']} tokens generated): "
        f"tformer {rate['tformer']:,.0f} tok/s, HF generate {rate['hf']:,.0f} tok/s (median of {repeats}); "
        f"ratio {rate['tformer'] / rate['hf']:.2f}x (best-step ratio {best['tformer'] / best['hf']:.2f}x)"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the recipe's max_steps)")
    p.add_argument("--samples", type=int, default=200, help="validation pairs scored")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--decode-only", action="store_true")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    out = Path(tempfile.mkdtemp(prefix="bench-translate-"))
    overrides = [
        f"output_dir={out}",
        "progress=false",
        "eval_every=0",
        "eval_bleu=false",
        "max_time=null",
        "save_every=0",
        "precision=fp32",
        "resume=none",
        *args.overrides,
    ]
    if args.steps is not None:
        overrides.append(f"max_steps={args.steps}")
    cfg = load_config(ROOT / "configs" / "transformer-tiny-translate.yaml", overrides)
    losses: list[float] = []
    trainer = Trainer(cfg, callbacks=[lambda t, rec: losses.append(rec["loss"])])
    hf = to_hf_model(trainer.model)  # the same initial weights
    d = cfg.decode
    max_new = d.max_new_tokens or trainer.data.target_len
    if not args.decode_only:
        t0 = time.perf_counter()
        trainer.fit()
        ours_time = time.perf_counter() - t0
        hf_time, hf_finite = train_hf(hf, trainer, cfg.max_steps)
        trained = hf_finite and len(losses) == cfg.max_steps and all(map(math.isfinite, losses))
        ours = bleu(
            trainer.model.eval(),
            trainer.data.validation,
            trainer.data.tokenizer,
            range(args.samples),
            num_beams=d.num_beams,
            length_penalty=d.length_penalty,
            length_norm="power",
            max_new_tokens=max_new,
        )
        ref_bleu, ref_chrf = hf_bleu(hf, trainer, args.samples, d.num_beams, d.length_penalty, max_new)
        trainer.model.eval()
        hf.eval()
        ours_nll = val_nll(
            lambda b: trainer.model(b["input_ids"], b["attention_mask"], labels=b["labels"]).logits, trainer, args.samples
        )
        hf_nll = val_nll(
            lambda b: hf(input_ids=b["input_ids"], attention_mask=b["attention_mask"], labels=b["labels"]).logits,
            trainer,
            args.samples,
        )
        print(
            f"after {cfg.max_steps} steps, {args.samples} validation pairs, beam {d.num_beams}, "
            f"length_penalty {d.length_penalty} (power form):\n"
            f"  tformer: BLEU {ours.bleu:.2f}, chrF {ours.chrf:.2f}, val NLL {ours_nll:.3f} (training "
            f"{ours_time:.0f} s incl. evaluation and checkpointing)\n"
            f"  HF Marian: BLEU {ref_bleu:.2f}, chrF {ref_chrf:.2f}, val NLL {hf_nll:.3f} (training {hf_time:.0f} s)\n"
            f"  {ours.signature}\n"
            f"  quality: {quality_line(ours.bleu, ref_bleu, ours_nll, hf_nll, trained)}"
        )
    samples = [trainer.data.validation.sample(i)["input_ids"] for i in range(16)]
    width = max(len(s) for s in samples)
    src = torch.full((16, width), trainer.model_cfg.pad_token_id)
    mask = torch.zeros_like(src)
    for r, s in enumerate(samples):
        src[r, : len(s)], mask[r, : len(s)] = torch.as_tensor(s), 1
    decode_speed(trainer.model, to_hf_model(trainer.model), src, mask, d.num_beams, d.length_penalty, max_new, args.repeats)


if __name__ == "__main__":
    main()
