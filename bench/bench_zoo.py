"""Training step of the new flavours (Qwen3, Qwen3-MoE, DeepSeek-V3, gpt-oss, ModernBERT, Gemma 3,
T5Gemma) against HF's own.

    python bench/bench_zoo.py [--flavour qwen3,qwen3_moe,deepseek_v3,gpt_oss,modernbert,gemma3,t5gemma]
        [--steps N] [--threads 1]

Each flavour's tiny preset (the shapes of ``configs/*-tiny.yaml``) and the HF model its exporter
configures (``TARGETS[flavour].hf_config``: the same architecture, the same parameter count, checked)
take forward + backward + fused AdamW steps interleaved one by one on the same batch, in one process,
as ``bench_models.py`` times its families; DeepSeek-V3 without its MTP module (HF has none);
ModernBERT on 15% of positions labelled, HF's ``sparse_prediction`` on (its head at those only);
T5Gemma on targets a quarter of the sources' length, each side shifting them behind its start token.
HF's experts run its default implementation where that runs on this CPU, else its loop (said in the
line). Target ([zoo-dec], [zoo-enc]): tformer's median step >= 1.0x HF's for every flavour, fp32,
one thread.
A row whose loss is not finite is FAIL; any MISS or FAIL sets the exit code. A benchmark, not a
test: the figures depend on the machine and what else runs on it.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_models import NOISE, Contender, interleave, num_params, speedup  # noqa: E402

from tformer import build_model  # noqa: E402
from tformer.models import spec_of  # noqa: E402

TARGET = 1.0
PRESETS = {
    "qwen3": ("qwen3-tiny", {}),
    "qwen3_moe": ("qwen3-moe-tiny", {}),
    "deepseek_v3": ("deepseek-v3-tiny", {"mtp_depth": 0}),
    "gpt_oss": ("gpt-oss-tiny", {}),
    "modernbert": ("modernbert-tiny", {}),
    "gemma3": ("gemma3-tiny", {}),
    "t5gemma": ("t5gemma-tiny", {}),
}
SIZES = dict(batch=8, seq=128)


def hf_twin(cfg, ids):
    """HF's model of ``cfg`` (its exporter's configuration; SDPA attention where the class takes it)
    and the experts implementation it ran."""
    import transformers

    from tformer.export.hf import TARGETS

    target = TARGETS[cfg.flavour]
    hf_cfg = target.hf_config(cfg)
    hf_cfg.sparse_prediction = True  # ModernBERT: the MLM head at labelled positions only, as ours (others ignore it)
    if cfg.moe.enabled and cfg.moe.aux_loss_coef:
        hf_cfg.output_router_logits = True  # HF adds its balance loss only then; tformer always does
    cls = getattr(transformers, target.HF_CLASS)
    attn = "sdpa" if cls._supports_sdpa else "eager"  # gpt-oss: eager only (its sinks)
    for experts in ("default", "eager") if cfg.moe.enabled else ("default",):
        extra = {} if experts == "default" else {"experts_implementation": "eager"}
        hf = cls._from_config(hf_cfg, attn_implementation=attn, **extra)
        try:
            hf(input_ids=ids[:1], labels=ids[:1]).loss.backward()
        except (RuntimeError, NotImplementedError):
            continue
        hf.zero_grad(set_to_none=True)
        return hf, experts
    raise SystemExit(f"{cfg.flavour}: HF's model does not run on this CPU")


def bench_flavour(flavour: str, args) -> dict:
    preset, over = PRESETS[flavour]
    torch.manual_seed(0)
    ours = build_model(preset, **over)
    cfg = ours.config
    b, s = SIZES["batch"], min(SIZES["seq"], cfg.max_seq_len)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (b, s), generator=gen)
    shifted = torch.cat((ids[:, 1:], torch.full((b, 1), -100)), dim=1)  # HF shifts inside
    hf_labels = ids
    if spec_of(cfg).masked_lm:  # MLM: 15% of positions labelled, the same for both; HF's head at those only too
        shifted = hf_labels = ids.masked_fill(torch.rand(b, s, generator=gen) >= 0.15, -100)
    if cfg.family == "encdec":  # targets: both shift them right behind the decoder's start token
        shifted = hf_labels = torch.randint(2, cfg.vocab_size, (b, s // 4), generator=gen)
    hf, experts = hf_twin(cfg, ids)
    if num_params(ours) != num_params(hf):
        raise SystemExit(f"{flavour}: configurations differ: tformer {num_params(ours):,} vs HF {num_params(hf):,}")
    losses: dict[str, list[float]] = {"tformer": [], "HF": []}

    def ours_loss():
        loss = ours(ids, labels=shifted, return_logits=False).loss
        losses["tformer"].append(loss.item())
        return loss

    def hf_loss():
        loss = hf(input_ids=ids, labels=hf_labels).loss
        losses["HF"].append(loss.item())
        return loss

    contenders = [Contender("tformer", ours, ours_loss, 0.0, b * s), Contender("HF", hf, hf_loss, 0.0, b * s)]
    kept = None
    for attempt in range(args.retries + 1):
        interleave(contenders, args.steps, args.warmup if attempt == 0 else 1, contextlib.nullcontext)
        spread = max(c.spread() for c in contenders)
        if kept is None or spread < kept[0]:
            kept = (spread, [list(c.times) for c in contenders])
        if spread <= NOISE:
            break
    for c, times in zip(contenders, kept[1]):
        c.times = times
    med, best = speedup(contenders[0], contenders[1])
    finite = all(math.isfinite(x) for v in losses.values() for x in v) and all(losses.values())
    return dict(
        flavour=flavour,
        preset=preset,
        params=num_params(ours),
        experts=experts if cfg.moe.enabled else None,
        ours=contenders[0].median(),
        hf=contenders[1].median(),
        med=med,
        best=best,
        noisy=kept[0] > NOISE,
        finite=finite,
    )


def verdict(row: dict) -> str:
    if not row["finite"]:
        return "FAIL (a loss was not finite)"
    return ("PASS" if row["med"] >= TARGET else "MISS") + (" (noisy)" if row["noisy"] else "")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flavour", default=",".join(PRESETS), help=f"comma list of {', '.join(PRESETS)}")
    p.add_argument("--steps", type=int, default=8, help="timed steps per contender")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (1: see bench_models.py)")
    args = p.parse_args(argv)
    args.warmup, args.retries = 2, 1
    flavours = [f for f in args.flavour.split(",") if f]
    if bad := [f for f in flavours if f not in PRESETS]:
        p.error(f"unknown flavour {bad[0]!r}; use {', '.join(PRESETS)}")
    torch.set_num_threads(args.threads)
    import transformers

    transformers.logging.set_verbosity_error()
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, {args.threads} thread(s), "
        f"CPU capability {torch.backends.cpu.get_cpu_capability()}; fp32, batch {SIZES['batch']} x seq "
        f"{SIZES['seq']}, {args.steps} interleaved steps after {args.warmup} warm-up"
    )
    failed = False
    for flavour in flavours:
        r = bench_flavour(flavour, args)
        experts = f" (experts: {r['experts']})" if r["experts"] else ""
        line = (
            f"{r['flavour']:12} {r['preset']:17} {r['params'] / 1e6:5.2f}M  tformer {r['ours'] * 1e3:7.1f} ms  "
            f"HF {r['hf'] * 1e3:7.1f} ms{experts}  {r['med']:.2f}x ({r['best']:.2f}x best)  >= {TARGET:.1f}x: {verdict(r)}"
        )
        print(line, flush=True)
        failed |= not verdict(r).startswith("PASS")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
