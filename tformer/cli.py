"""``tformer train | tokenizer | generate | evaluate | plot | export | import``: bad input ends in one
``error:`` line, exit 2."""

from __future__ import annotations

import sys

from .args import Parser as _Parser
from .args import UsageError, byte_size as _byte_size, number as _number, shard_size as _shard_size


TRUST_HELP = (
    "load the checkpoint's pickles without the allow-list. DANGEROUS: a pickle can run any "
    "code; only for checkpoints whose origin you trust"
)


def _train(argv: list[str]) -> int:
    p = _Parser(prog="tformer train", description="Train a model from a YAML recipe.")
    p.add_argument("config", help="YAML recipe, e.g. configs/gpt2-tiny.yaml")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. max_steps=100 optim.lr=1e-3")
    p.add_argument("--trust-checkpoint", action="store_true", help=TRUST_HELP + " (= checkpoint.trust=true)")
    args = p.parse_args(argv)
    from .train.config import load_config
    from .train.dist import shutdown
    from .train.trainer import Trainer

    cfg = load_config(args.config, args.overrides + (["checkpoint.trust=true"] if args.trust_checkpoint else []))
    Trainer(cfg).fit()
    shutdown(0)
    return 0


def _data(argv: list[str]) -> int:
    p = _Parser(
        prog="tformer data",
        description="Data preparation: `tformer data prepare CONFIG` tokenizes "
        "every source of a recipe into the token cache ($TFORMER_CACHE or data.cache_dir) ahead of "
        "time; a training run with the same recipe and cache then starts without tokenizing.",
    )
    p.add_argument("action", choices=["prepare"], help="prepare: tokenize every source into the cache")
    p.add_argument("config", help="YAML recipe, e.g. configs/gpt2-tiny.yaml")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. data.seq_len=512")
    p.add_argument("--workers", type=int, default=1, help="tokenizing processes (default 1)")
    p.add_argument(
        "--shard-rows", type=int, default=20000, help="rows per shard, the unit of work and of resumption (default 20000)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_intermixed_args(argv)
    for flag, value in (("--workers", args.workers), ("--shard-rows", args.shard_rows)):
        if value < 1:
            raise UsageError(f"tformer data prepare: {flag}={value} must be >= 1")
    from .train.config import load_config
    from .train.data import prepare_data

    cfg = load_config(args.config, args.overrides)
    report = prepare_data(cfg, workers=args.workers, shard_rows=args.shard_rows, progress=not args.no_progress)
    for r in report:
        print(
            f"{r['name']:<16} {r['split']:<10} {r['tokens']:>14,} tokens {r['documents']:>12,} documents "
            f"{r['bytes']:>14,} bytes",
            flush=True,
        )
    return 0


def _generate(argv: list[str]) -> int:
    from .config import LENGTH_NORMS

    p = _Parser(
        prog="tformer generate",
        description="Generate text from a checkpoint: a continuation (decoder) or a translation (encoder-decoder).",
    )
    p.add_argument("checkpoint", help="a run directory or one of its checkpoints")
    p.add_argument("prompt", nargs="?", default="", help="the prompt (decoder) or the source text (encoder-decoder)")
    p.add_argument("--max-new-tokens", type=_number(int, "[1, inf)"), default=64)
    p.add_argument("--temperature", type=_number(float, "[0, inf)"), default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=_number(int, "[1, inf)"), default=None)
    p.add_argument("--top-p", type=_number(float, "(0, 1]"), default=None)
    p.add_argument("--num-beams", type=int, default=1, help="beam search with this many beams (1 = greedy)")
    p.add_argument(
        "--length-penalty",
        type=_number(float, "[0, inf)"),
        default=None,
        help="beam search: alpha of the length normalisation (the paper: 0.6)",
    )
    p.add_argument(
        "--length-norm",
        choices=LENGTH_NORMS,
        default="gnmt",
        help="gnmt: ((5 + len) / 6) ** alpha (the paper's); power: len ** alpha (HF's)",
    )
    p.add_argument(
        "--translation-only",
        action="store_true",
        help="encoder-decoder: print only the generated text, not the labelled source line",
    )
    p.add_argument("--seed", type=_number(int, "[0, inf)"), default=0)
    p.add_argument("--trust-checkpoint", action="store_true", help=TRUST_HELP)
    args = p.parse_args(argv)
    from pathlib import Path

    import torch

    from .checkpoint import load_checkpoint
    from .config import ConfigError
    from .data import load_tokenizer
    from .generate import generate

    if args.num_beams < 1:
        raise ConfigError(f"--num-beams={args.num_beams} must be >= 1 (1 = greedy)")
    if args.length_penalty is not None and args.num_beams == 1:
        print(
            f"warning: --length-penalty {args.length_penalty} has no effect without beam search (--num-beams > 1); ignored",
            file=sys.stderr,
        )
        args.length_penalty = None
    if args.num_beams > 1 and args.temperature > 0:
        raise ConfigError(
            "--temperature samples, beam search is deterministic: use one of --num-beams > 1 or --temperature > 0"
        )
    model = load_checkpoint(args.checkpoint, trust=args.trust_checkpoint)
    run = Path(args.checkpoint)
    tok_path = next((d / "tokenizer.json" for d in (run, *run.parents) if (d / "tokenizer.json").is_file()), None)
    if tok_path is None:
        raise FileNotFoundError(f"no tokenizer.json in {run} or its parents; pass a run directory")
    tok = load_tokenizer(tok_path)
    cfg = model.config
    ids = tok.encode(args.prompt, add_special_tokens=False).ids
    if cfg.family == "decoder":
        ids = [cfg.bos_token_id or 0] + ids
    elif cfg.eos_token_id is not None:
        ids = ids + [cfg.eos_token_id]  # sources end in EOS, as in training (Seq2SeqPairs)
    out = generate(
        model,
        torch.tensor([ids]),
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        generator=torch.Generator().manual_seed(args.seed),
        num_beams=args.num_beams,
        length_penalty=args.length_penalty,
        length_norm=args.length_norm,
    )
    if cfg.family == "decoder":
        print(args.prompt + tok.decode(out[0, len(ids) :].tolist()))
        return 0
    text = tok.decode(out[0, 1:].tolist(), skip_special_tokens=True)
    if args.translation_only:
        print(text)
    else:
        print(f"source:      {args.prompt}\ntranslation: {text}")
    return 0


def _evaluate(argv: list[str]) -> int:
    p = _Parser(
        prog="tformer evaluate",
        description="Score a run on its validation split: loss and perplexity, and with --bleu "
        "(seq2seq runs) BLEU and chrF of its translations.",
    )
    p.add_argument("run_dir", help="a run directory (its newest checkpoint is used)")
    p.add_argument("--bleu", action="store_true", help="decode the validation pairs and score them with sacrebleu")
    p.add_argument(
        "--samples", type=_number(int, "[1, inf)"), default=None, help="only the first N validation pairs (default: all)"
    )
    p.add_argument("--num-beams", type=_number(int, "[1, inf)"), default=None, help="override the run's decode.num_beams")
    p.add_argument("--length-penalty", type=_number(float, "[0, inf)"), default=None, help="override decode.length_penalty")
    p.add_argument(
        "--show", type=_number(int, "[0, inf)"), default=3, help="print this many source / hypothesis / reference triples"
    )
    args = p.parse_args(argv)
    import json
    import math
    from pathlib import Path

    import torch

    from .checkpoint import load_checkpoint
    from .config import ConfigError
    from .train.config import load_config
    from .train.data import build_data

    run = Path(args.run_dir)
    if not (run / "config.yaml").is_file():
        raise FileNotFoundError(f"{run} holds no config.yaml; pass a run directory written by tformer train")
    overrides = [f"data.tokenizer={run / 'tokenizer.json'}", f"output_dir={run}"]
    if args.num_beams is not None:
        overrides.append(f"decode.num_beams={args.num_beams}")
    if args.length_penalty is not None:
        overrides.append(f"decode.length_penalty={args.length_penalty}")
    cfg = load_config(run / "config.yaml", overrides)
    if args.samples is not None and args.samples < 1:
        raise ConfigError(f"--samples={args.samples} must be >= 1")
    if args.bleu and cfg.data.objective != "seq2seq":
        raise ConfigError(
            f"--bleu needs a translation run (data.objective=seq2seq); {run} was trained with "
            f"data.objective={cfg.data.objective!r}"
        )
    model = load_checkpoint(run)
    data = build_data(cfg)
    val = data.validation
    n = len(val) if args.samples is None else min(args.samples, len(val))
    total, count = 0.0, 0
    keys = data.model_inputs
    with torch.no_grad():
        for i in range(0, n, cfg.micro_batch_size):
            batch = data.collator([val[k] for k in range(i, min(n, i + cfg.micro_batch_size))])
            out = model(**{k: batch[k] for k in keys if k in batch})
            c = int((batch["labels"] != -100).sum())
            total, count = total + out.loss.item() * c, count + c
    result = {"val_loss": total / max(count, 1), "val_ppl": math.exp(min(total / max(count, 1), 50.0)), "samples": n}
    if args.bleu:
        from .evaluate import bleu

        d = cfg.decode
        scored = bleu(
            model,
            val,
            data.tokenizer,
            range(n),
            batch_size=d.batch_size,
            num_beams=d.num_beams,
            length_penalty=d.length_penalty,
            length_norm=d.length_norm,
            max_new_tokens=d.max_new_tokens,
        )
        result.update(scored.record(), num_beams=d.num_beams, length_penalty=d.length_penalty)
        for k in range(min(args.show, n)):
            src = data.tokenizer.decode([t for t in val.sample(k)["input_ids"].tolist()], skip_special_tokens=True)
            print(f"source:      {src}\ntranslation: {scored.hypotheses[k]}\nreference:   {scored.references[k]}\n")
    line = f"{run}: val_loss {result['val_loss']:.4f} (ppl {result['val_ppl']:.1f}) on {n} pairs"
    if args.bleu:
        line += f"; BLEU {result['val_bleu']:.2f}, chrF {result['val_chrf']:.2f} ({result['bleu_signature']})"
    print(line)
    (run / "evaluate.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


def _plot(argv: list[str]) -> int:
    p = _Parser(prog="tformer plot", description="Plot a run's loss curves to PNG.")
    p.add_argument("run_dir")
    p.add_argument("--out", default=None, help="PNG path (default RUN_DIR/loss.png)")
    args = p.parse_args(argv)
    from .train.plot import plot_run

    print(plot_run(args.run_dir, args.out))
    return 0


def _export(argv: list[str]) -> int:
    p = _Parser(prog="tformer export", description="Export a checkpoint to HF transformers (BERT, GPT-2, Llama, T5).")
    p.add_argument("checkpoint", help="a run directory (its newest checkpoint) or one of its checkpoints")
    p.add_argument("--to", choices=["hf"], default="hf", help="target format (hf: transformers)")
    p.add_argument("out_dir", help="output directory (must not exist, or be empty)")
    p.add_argument("--force", action="store_true", help="replace a non-empty output directory")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json (default: the run directory's)")
    p.add_argument("--max-shard-size", default="5GB", type=_shard_size, help="split safetensors above this size (e.g. 2GB)")
    p.add_argument("--trust-checkpoint", action="store_true", help=TRUST_HELP)
    args = p.parse_args(argv)
    from .export import export_hf

    out = export_hf(
        args.checkpoint,
        args.out_dir,
        force=args.force,
        tokenizer=args.tokenizer,
        max_shard_size=args.max_shard_size,
        trust=args.trust_checkpoint,
    )
    print(f"wrote {out}")
    return 0


def _import(argv: list[str]) -> int:
    p = _Parser(prog="tformer import", description="Import a HF transformers model to continue pretraining it.")
    p.add_argument("hf_dir", help="a HF model directory (or a hub name, when online)")
    p.add_argument("out_dir", nargs="?", default=None, help="run directory to write (default runs/NAME)")
    p.add_argument("--force", action="store_true", help="replace a non-empty output directory")
    args = p.parse_args(argv)
    from pathlib import Path

    from .export import import_hf

    out = args.out_dir or str(Path("runs") / Path(args.hf_dir.rstrip("/")).name)
    out = import_hf(args.hf_dir, out, force=args.force)
    print(f"wrote {out}; continue pretraining with: tformer train {out}/config.yaml max_steps=N")
    return 0


def _tokenizer(argv: list[str]) -> int:
    from .data import tokenizer_main

    return tokenizer_main(argv)


def _consolidate(argv: list[str]) -> int:
    p = _Parser(
        prog="tformer consolidate",
        description="Turn any checkpoint (DCP shards, DeepSpeed ZeRO, ...) into one fp32 safetensors file, on CPU.",
    )
    p.add_argument("checkpoint")
    p.add_argument("--out", default=None, help="default: CHECKPOINT/consolidated.safetensors")
    p.add_argument("--trust-checkpoint", action="store_true", help=TRUST_HELP)
    args = p.parse_args(argv)
    from .checkpoint.consolidate import consolidate

    print(consolidate(args.checkpoint, args.out, trust=args.trust_checkpoint))
    return 0


def _plan(argv: list[str]) -> int:
    p = _Parser(
        prog="tformer plan",
        description="Predict per-device memory for each strategy and mesh layout "
        "(pp x dp_replicate x dp_shard x tp) and recommend one.",
    )
    p.add_argument("config", nargs="?" if "--calibrate" in argv else None)
    p.add_argument("overrides", nargs="*")
    p.add_argument("--devices", type=_number(int, "[1, inf)"), default=8)
    p.add_argument("--device-memory", type=_byte_size, default="80GB")
    p.add_argument(
        "--gpus-per-node",
        type=_number(int, "[1, inf)"),
        default=8,
        help="tensor parallelism within a node is preferred; HSDP replicates across nodes",
    )
    p.add_argument(
        "--pp-microbatches",
        type=_number(int, "[1, inf)"),
        default=None,
        help="micro-batches per step (grad_accum) of the pipeline layouts (default: 4 x pp)",
    )
    p.add_argument(
        "--max-pp",
        type=_number(int, "[1, inf)"),
        default=None,
        help="the largest pipeline degree tried (default: the device count; 1: no pipelines)",
    )
    from .plan import report

    report.add_options(p, _number)
    args = p.parse_args(argv)
    if args.calibrate:
        return report.calibrate_main(args.calibrate)
    hw = report.hardware(args.gpu, args.set, args.gpus_per_node)  # bad figures fail here, before any work
    from .parallel.plan import plan_main
    from .train.config import load_config

    cfg = load_config(args.config, args.overrides)
    rc = plan_main(
        cfg,
        args.config,
        args.devices,
        args.device_memory,
        args.gpus_per_node,
        args.pp_microbatches,
        args.max_pp,
    )
    speed = (args.devices, args.device_memory, args.gpus_per_node, args.pp_microbatches, args.max_pp)
    return rc or report.plan_speed(cfg, *speed, hw, args.tokens)


COMMANDS = {
    "train": _train,
    "data": _data,
    "generate": _generate,
    "evaluate": _evaluate,
    "plot": _plot,
    "tokenizer": _tokenizer,
    "consolidate": _consolidate,
    "plan": _plan,
    "export": _export,
    "import": _import,
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        known = " | ".join(COMMANDS)
        if argv and argv[0] not in ("-h", "--help"):
            print(f"error: unknown command {argv[0]!r}; use one of: {known}", file=sys.stderr)
            return 2
        print(f"usage: tformer {{{known}}} ...", file=sys.stderr)
        return 0 if argv else 2
    from .logs import setup_logging

    setup_logging()
    from .checkpoint import CheckpointError
    from .config import ConfigError
    from .data import DataError
    from .export import ExportError

    try:
        return COMMANDS[argv[0]](argv[1:])
    except (ConfigError, DataError, CheckpointError, ExportError, FileNotFoundError, UsageError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a path the user gave: unreadable, unwritable, a file for a directory
        where = f" {e.filename}" if e.filename else ""
        print(f"error: {e.strerror or e}:{where}; check the path and its permissions", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001
        from .train.trainer import LossSpikeError, NonFiniteLoss

        if isinstance(e, (NonFiniteLoss, LossSpikeError)):
            print(f"error: {e}", file=sys.stderr)
            return 3
        raise


if __name__ == "__main__":
    sys.exit(main())
