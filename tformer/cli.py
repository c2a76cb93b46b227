"""``tformer train | tokenizer | generate | plot | export | import``: bad input ends in one
``error:`` line, exit 2."""
from __future__ import annotations

import logging
import sys

from .args import Parser as _Parser
from .args import UsageError, byte_size as _byte_size, number as _number, shard_size as _shard_size


TRUST_HELP = ("load the checkpoint's pickles without the allow-list. DANGEROUS: a pickle can run any "
              "code; only for checkpoints whose origin you trust")


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


def _generate(argv: list[str]) -> int:
    p = _Parser(prog="tformer generate", description="Generate text from a checkpoint.")
    p.add_argument("checkpoint", help="a run directory or one of its checkpoints")
    p.add_argument("prompt", nargs="?", default="")
    p.add_argument("--max-new-tokens", type=_number(int, "[1, inf)"), default=64)
    p.add_argument("--temperature", type=_number(float, "[0, inf)"), default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=_number(int, "[1, inf)"), default=None)
    p.add_argument("--top-p", type=_number(float, "(0, 1]"), default=None)
    p.add_argument("--seed", type=_number(int, "[0, inf)"), default=0)
    p.add_argument("--trust-checkpoint", action="store_true", help=TRUST_HELP)
    args = p.parse_args(argv)
    from pathlib import Path

    import torch

    from .checkpoint import load_checkpoint
    from .data import load_tokenizer
    from .generate import generate

    model = load_checkpoint(args.checkpoint, trust=args.trust_checkpoint)
    run = Path(args.checkpoint)
    tok_path = next((d / "tokenizer.json" for d in (run, *run.parents) if (d / "tokenizer.json").is_file()), None)
    if tok_path is None:
        raise FileNotFoundError(f"no tokenizer.json in {run} or its parents; pass a run directory")
    tok = load_tokenizer(tok_path)
    ids = tok.encode(args.prompt, add_special_tokens=False).ids
    if model.config.family == "decoder":
        ids = [model.config.bos_token_id or 0] + ids
    out = generate(model, torch.tensor([ids]), args.max_new_tokens, temperature=args.temperature,
                   top_k=args.top_k, top_p=args.top_p, generator=torch.Generator().manual_seed(args.seed))
    new = out[0, len(ids):] if model.config.family == "decoder" else out[0, 1:]
    print(args.prompt + tok.decode(new.tolist()))
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
    p = _Parser(prog="tformer export", description="Export a checkpoint to HF "
                                "transformers (BERT, GPT-2, Llama, T5).")
    p.add_argument("checkpoint", help="a run directory (its newest checkpoint) or one of its checkpoints")
    p.add_argument("--to", choices=["hf"], default="hf", help="target format (hf: transformers)")
    p.add_argument("out_dir", help="output directory (must not exist, or be empty)")
    p.add_argument("--force", action="store_true", help="replace a non-empty output directory")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json (default: the run directory's)")
    p.add_argument("--max-shard-size", default="5GB", type=_shard_size,
                   help="split safetensors above this size (e.g. 2GB)")
    p.add_argument("--trust-checkpoint", action="store_true", help=TRUST_HELP)
    args = p.parse_args(argv)
    from .export import export_hf

    out = export_hf(args.checkpoint, args.out_dir, force=args.force, tokenizer=args.tokenizer,
                    max_shard_size=args.max_shard_size, trust=args.trust_checkpoint)
    print(f"wrote {out}")
    return 0


def _import(argv: list[str]) -> int:
    p = _Parser(prog="tformer import",
                                description="Import a HF transformers model to continue pretraining it.")
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
    p = _Parser(prog="tformer consolidate",
                                description="Turn any checkpoint (DCP shards, DeepSpeed ZeRO, ...) into "
                                            "one fp32 safetensors file, on CPU.")
    p.add_argument("checkpoint")
    p.add_argument("--out", default=None, help="default: CHECKPOINT/consolidated.safetensors")
    p.add_argument("--trust-checkpoint", action="store_true", help=TRUST_HELP)
    args = p.parse_args(argv)
    from .checkpoint.consolidate import consolidate

    print(consolidate(args.checkpoint, args.out, trust=args.trust_checkpoint))
    return 0


def _plan(argv: list[str]) -> int:
    p = _Parser(prog="tformer plan",
                                description="Predict per-device memory for each strategy and recommend one.")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--devices", type=_number(int, "[1, inf)"), default=8)
    p.add_argument("--device-memory", type=_byte_size, default="80GB")
    args = p.parse_args(argv)
    from .parallel.plan import plan_main

    return plan_main(args.config, args.overrides, args.devices, args.device_memory)


COMMANDS = {"train": _train, "generate": _generate, "plot": _plot, "tokenizer": _tokenizer,
            "consolidate": _consolidate, "plan": _plan,
            "export": _export, "import": _import}


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
