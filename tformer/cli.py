"""The ``tformer`` command (``tformer --help`` lists its sub-commands): bad input ends in one
``error:`` line, exit 2."""

from __future__ import annotations

import sys

from .args import Parser as _Parser
from .args import SIZE_HELP as _SIZE_HELP, UsageError, byte_size as _byte_size, number as _number, shard_size as _shard_size


TRUST_HELP = (
    "load the checkpoint's pickles without the allow-list. DANGEROUS: a pickle can run any "
    "code; only for checkpoints whose origin you trust"
)


def _train(argv: list[str]) -> int:
    p = _Parser(
        prog="tformer train",
        description="Train a model from a YAML recipe. The keys a recipe (and a key=value override) takes "
        "are the fields of tformer/train/config.py (model.* those of tformer/config.py); README.md's "
        "'Training' section lists the common ones, docs/reference/config.md every one.",
    )
    p.add_argument("config", help="YAML recipe, e.g. configs/gpt2-tiny.yaml")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. max_steps=100 optim.lr=1e-3")
    p.add_argument("--trust-checkpoint", action="store_true", help=TRUST_HELP + " (= checkpoint.trust=true)")
    args = p.parse_args(argv)
    from .train.config import load_config
    from .train.dist import shutdown
    from .train.resilience.resume import RunComplete
    from .train.trainer import Trainer

    cfg = load_config(args.config, args.overrides + (["checkpoint.trust=true"] if args.trust_checkpoint else []))
    try:
        trainer = Trainer(cfg)
    except RunComplete as e:  # not an error: a chain's later jobs (slurm/chain.sh) end here
        import os

        if os.environ.get("RANK", "0") == "0":
            print(f"tformer: {e}", flush=True)
        return 0
    trainer.fit()
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
    from .train.loop.data import prepare_data

    cfg = load_config(args.config, args.overrides)
    from .logs import interactive

    bar = not args.no_progress and interactive()  # no bar in a log file
    report = prepare_data(cfg, workers=args.workers, shard_rows=args.shard_rows, progress=bar)
    for r in report:
        print(
            f"{r['name']:<16} {r['split']:<10} {r['tokens']:>14,} tokens {r['documents']:>12,} documents "
            f"{r['bytes']:>14,} bytes",
            flush=True,
        )
    return 0


RECIPE_DEFAULT = "a translation run's"


def _decoding_defaults(args, decode) -> None:
    """Fill the decoding flags left unset from the run's ``decode`` recipe (``checkpoint/runconfig.py``:
    the settings ``tformer evaluate`` and the HF export use too), and say so on stderr. Sampling
    (``--temperature`` > 0) keeps the recipe's beams out."""
    taken = []
    if decode is not None and args.num_beams is None and args.temperature == 0:
        args.num_beams = decode.num_beams
        taken.append(f"num_beams={decode.num_beams}")
    args.num_beams = args.num_beams or 1
    if decode is not None and args.num_beams > 1:
        if args.length_penalty is None:
            args.length_penalty = decode.length_penalty
            taken.append(f"length_penalty={decode.length_penalty}")
        if args.length_norm is None:
            args.length_norm = decode.length_norm
            taken.append(f"length_norm={decode.length_norm}")
    if decode is not None and args.max_new_tokens is None and decode.max_new_tokens:
        args.max_new_tokens = decode.max_new_tokens
        taken.append(f"max_new_tokens={decode.max_new_tokens}")
    args.max_new_tokens = args.max_new_tokens or 64
    args.length_norm = args.length_norm or "gnmt"
    if taken:
        print(f"decoding with the run's decode settings: {' '.join(taken)} (flags override them)", file=sys.stderr)


def _generate(argv: list[str]) -> int:
    from .config import LENGTH_NORMS

    p = _Parser(
        prog="tformer generate",
        description="Generate text from a checkpoint: a continuation (decoder) or a translation (encoder-decoder).",
    )
    p.add_argument("checkpoint", help="a run directory or one of its checkpoints")
    p.add_argument("prompt", nargs="?", default="", help="the prompt (decoder) or the source text (encoder-decoder)")
    p.add_argument(
        "--max-new-tokens",
        type=_number(int, "[1, inf)"),
        default=None,
        help=f"tokens to generate at most (default: {RECIPE_DEFAULT} decode.max_new_tokens, else its target length; 64)",
    )
    p.add_argument("--temperature", type=_number(float, "[0, inf)"), default=0.0, help="0 = greedy or beam search")
    p.add_argument("--top-k", type=_number(int, "[1, inf)"), default=None, help="sampling: the k likeliest tokens only")
    p.add_argument("--top-p", type=_number(float, "(0, 1]"), default=None, help="sampling: nucleus of this probability")
    p.add_argument(
        "--num-beams",
        type=int,
        default=None,
        help=f"beam search with this many beams, 1 = greedy (default: {RECIPE_DEFAULT} decode.num_beams; 1)",
    )
    p.add_argument(
        "--length-penalty",
        type=_number(float, "[0, inf)"),
        default=None,
        help=f"beam search: alpha of the length normalisation (default: {RECIPE_DEFAULT} decode.length_penalty)",
    )
    p.add_argument(
        "--length-norm",
        choices=LENGTH_NORMS,
        default=None,
        help="gnmt: ((5 + len) / 6) ** alpha (the paper's); power: len ** alpha (HF's) "
        f"(default: {RECIPE_DEFAULT} decode.length_norm; gnmt)",
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
    from .models import spec_of

    from .checkpoint.runconfig import saved_decode

    if args.num_beams is not None and args.num_beams < 1:
        raise ConfigError(f"--num-beams={args.num_beams} must be >= 1 (1 = greedy)")
    _decoding_defaults(args, saved_decode(args.checkpoint))
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
    causal_lm = spec_of(cfg).causal_lm
    if causal_lm:
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
    if causal_lm:
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

    from .checkpoint import load_checkpoint
    from .checkpoint.io import RUN_CONFIG
    from .config import ConfigError
    from .train.config import load_config
    from .train.loop.data import build_data

    run = Path(args.run_dir)
    if not (run / RUN_CONFIG).is_file():
        raise FileNotFoundError(f"{run} holds no {RUN_CONFIG}; pass a run directory written by tformer train")
    overrides = [f"data.tokenizer={run / 'tokenizer.json'}", f"output_dir={run}"]
    if args.num_beams is not None:
        overrides.append(f"decode.num_beams={args.num_beams}")
    if args.length_penalty is not None:
        overrides.append(f"decode.length_penalty={args.length_penalty}")
    cfg = load_config(run / RUN_CONFIG, overrides)
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
    # training's val_loss: the first eval_batches x micro_batch_size samples (one process)
    first = min(len(val), cfg.eval_batches * cfg.micro_batch_size)
    sums = _loss_sums(model, data, n, cfg.micro_batch_size, first)
    loss = sums["all"][0] / max(sums["all"][1], 1)
    result = {"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0)), "samples": n, "tokens": sums["all"][1]}
    if first <= n:
        result["val_loss_training_subset"] = sums["first"][0] / max(sums["first"][1], 1)
    if args.bleu:
        from .train.loop.decoding import decoded_bleu

        d = cfg.decode
        scored = decoded_bleu(d, model, val, data.tokenizer, n)
        result.update(scored.record(), num_beams=d.num_beams, length_penalty=d.length_penalty)
        for k in range(min(args.show, n)):
            src = data.tokenizer.decode([t for t in val.sample(k)["input_ids"].tolist()], skip_special_tokens=True)
            print(f"source:      {src}\ntranslation: {scored.hypotheses[k]}\nreference:   {scored.references[k]}\n")
    unit = "pairs" if cfg.data.objective == "seq2seq" else "sequences"
    line = f"{run}: val_loss {result['val_loss']:.4f} (ppl {result['val_ppl']:.1f}) on {n:,} validation {unit}"
    line += f" ({result['tokens']:,} labelled tokens)"
    if args.bleu:
        line += f"; BLEU {result['val_bleu']:.2f}, chrF {result['val_chrf']:.2f} ({result['bleu_signature']})"
    print(line)
    print(_against_training(run, cfg, result, n, first, unit))
    (run / "evaluate.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


def _loss_sums(model, data, n: int, micro: int, first: int) -> dict[str, tuple[float, int]]:
    """(loss sum, labelled tokens) over the first ``n`` validation samples (``all``) and over the
    first ``first`` of them (``first``: training's subset, in training's batches), ``micro`` at a time."""
    import torch

    cut = min(first, n)
    spans = [(i, min(i + micro, cut)) for i in range(0, cut, micro)] + [(i, min(i + micro, n)) for i in range(cut, n, micro)]
    total, count, at_first = 0.0, 0, (0.0, 0)
    with torch.no_grad():
        for start, end in spans:
            batch = data.collator([data.validation[k] for k in range(start, end)])
            out = model(**{k: batch[k] for k in data.model_inputs if k in batch})
            c = int((batch["labels"] != -100).sum())
            total, count = total + out.loss.item() * c, count + c
            if end == cut:
                at_first = (total, count)
    return {"all": (total, count), "first": at_first}


def _against_training(run, cfg, result: dict, n: int, first: int, unit: str) -> str:
    """How this number relates to the val_loss training logged: training evaluates only its first
    ``eval_batches x micro_batch_size`` samples, under the run's precision; this command every
    sample (or ``--samples``), in fp32 on CPU."""
    import json

    logged = None
    metrics = run / "metrics.jsonl"
    if metrics.is_file():
        for text in metrics.read_text().splitlines():
            try:
                record = json.loads(text)
            except ValueError:
                continue
            if "val_loss" in record:
                logged = (record["step"], record["val_loss"])
    subset = f"the first {first:,} {unit} (eval_batches={cfg.eval_batches} x micro_batch_size={cfg.micro_batch_size})"
    if "val_loss_training_subset" not in result:
        return f"training's val_loss is over {subset}: more than the {n:,} evaluated here"
    text = f"on {subset}, which training's val_loss averages: {result['val_loss_training_subset']:.4f}"
    if logged is not None:
        text += f"; training logged val_loss {logged[1]:.4f} at step {logged[0]}"
    if cfg.precision not in ("fp32", "auto"):
        text += f" (computed under {cfg.precision} there, fp32 here)"
    return text


def _plot(argv: list[str]) -> int:
    p = _Parser(prog="tformer plot", description="Plot a run's loss curves to PNG.")
    p.add_argument("run_dir")
    p.add_argument("--out", default=None, help="PNG path (default RUN_DIR/loss.png)")
    args = p.parse_args(argv)
    from .train.observe.plot import plot_run

    print(plot_run(args.run_dir, args.out))
    return 0


def _profile_report(argv: list[str]) -> int:
    p = _Parser(
        prog="tformer profile-report",
        description="Where each traced step's time went, per rank (traces of a run with profile.steps), "
        "beside the planner's prediction; writes OUTPUT/profile/split.png.",
    )
    p.add_argument("run_dir", help="a run directory trained with profile.steps (e.g. profile.steps=3-4)")
    p.add_argument(
        "--gpu",
        default=None,
        help="hardware the prediction prices (a profile such as h100-sxm, or a file from tformer plan "
        "--calibrate); default h100-sxm for a CUDA run, none for a CPU run",
    )
    p.add_argument("--no-png", action="store_true", help="print only")
    args = p.parse_args(argv)
    from .train.observe.profile_report import report

    print(report(args.run_dir, args.gpu, png=not args.no_png))
    return 0


def _export(argv: list[str]) -> int:
    p = _Parser(
        prog="tformer export", description="Export a checkpoint to HF transformers (BERT, GPT-2, Llama, T5, Marian)."
    )
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
    p.add_argument("config", nargs="?" if "--calibrate" in argv else None, help="YAML recipe, e.g. configs/llama-1b.yaml")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. model.preset=llama-70b data.seq_len=8192")
    p.add_argument("--devices", type=_number(int, "[1, inf)"), default=8, help="devices (GPUs) in the job, all nodes")
    p.add_argument(
        "--device-memory",
        type=_byte_size,
        default="80",
        help=f"memory of one device; {_SIZE_HELP}; a layout fits within 90%% of it (default: 80 GiB)",
    )
    p.add_argument(
        "--gpus-per-node",
        type=_number(int, "[1, inf)"),
        default=8,
        help="devices per node: tensor parallelism within a node is preferred; HSDP replicates across nodes",
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
    p.add_argument(
        "--max-cp",
        type=_number(int, "[1, inf)"),
        default=None,
        help="the largest context-parallel degree tried (default: the device count; 1: no context parallelism)",
    )
    from .plan import report

    report.add_options(p, _number)
    args = p.parse_args(argv)
    if args.calibrate:
        return report.calibrate_main(args.calibrate)
    hw = report.hardware(args.gpu, args.set, args.gpus_per_node)  # bad figures fail here, before any work
    from .config import ConfigError
    from .plan.memory_report import plan_main
    from .train.config import load_config

    cfg = load_config(args.config, args.overrides)
    ft = cfg.fault_tolerance
    if ft.enabled:  # the devices are split over the replica groups; each group plans its own layout
        if args.devices % ft.replicas:
            raise ConfigError(
                f"--devices {args.devices} is not a multiple of fault_tolerance.replicas={ft.replicas} "
                "(every replica group has the same layout); give a multiple"
            )
        args.devices //= ft.replicas
        args.max_pp = 1  # fault tolerance refuses pipelines (train/resilience/ft.py)
        print(
            f"fault tolerance: {ft.replicas} replica groups of {args.devices} devices each; "
            "the layouts below are one group's"
        )
    rc = plan_main(
        cfg,
        args.config,
        args.devices,
        args.device_memory,
        args.gpus_per_node,
        args.pp_microbatches,
        args.max_pp,
        args.max_cp,
    )
    speed = (args.devices, args.device_memory, args.gpus_per_node, args.pp_microbatches, args.max_pp)
    return rc or report.plan_speed(cfg, *speed, hw, args.tokens, args.max_cp)


COMMANDS = {  # name: (function, its one line in `tformer --help`)
    "train": (_train, "train a model from a YAML recipe (resumes its run directory)"),
    "data": (_data, "tokenize a recipe's sources into the token cache ahead of training"),
    "generate": (_generate, "continue a prompt or translate a sentence with a checkpoint"),
    "evaluate": (_evaluate, "validation loss and perplexity of a run, BLEU/chrF with --bleu"),
    "plot": (_plot, "plot a run's loss curves to PNG"),
    "profile-report": (_profile_report, "where the traced steps' time went, per rank (profile.steps), beside the plan"),
    "tokenizer": (_tokenizer, "train a tokenizer (tokenizer.json) for one of the model families"),
    "consolidate": (_consolidate, "turn any checkpoint into one fp32 safetensors file"),
    "plan": (_plan, "predict per-device memory per parallel layout and recommend one"),
    "export": (_export, "export a checkpoint to HF transformers"),
    "import": (_import, "import a HF transformers model to continue pretraining it"),
}


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {summary}" for name, (_, summary) in COMMANDS.items()]
    return (
        "usage: tformer COMMAND [ARGS ...]   (tformer COMMAND --help: its arguments)\n\ncommands:\n"
        + "\n".join(lines)
        + "\n\noptions:\n  -h, --help   this list\n  --version    the installed tformer's version\n"
    )


def _version() -> str:
    """The installed distribution's version (its metadata), which pyproject.toml takes from
    ``tformer.__version__``; a source tree that was never installed reports that attribute."""
    from importlib.metadata import PackageNotFoundError, version

    from . import __version__

    try:
        return version("tformer")
    except PackageNotFoundError:
        return f"{__version__} (not installed)"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--version":
        print(f"tformer {_version()}")
        return 0
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage(), end="", file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        print(
            f"error: unknown command {argv[0]!r}; use one of: {' | '.join(COMMANDS)} (see tformer --help)", file=sys.stderr
        )
        return 2
    from .logs import setup_logging

    setup_logging()
    from .checkpoint import CheckpointError
    from .config import ConfigError
    from .data import DataError
    from .export import ExportError

    try:
        return COMMANDS[argv[0]][0](argv[1:])
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
        from .train.resilience.ft import QuorumLost
        from .train.trainer import LossSpikeError, NonFiniteLoss

        if isinstance(e, (NonFiniteLoss, LossSpikeError, QuorumLost)):
            print(f"error: {e}", file=sys.stderr)
            return 3
        raise


if __name__ == "__main__":
    sys.exit(main())
