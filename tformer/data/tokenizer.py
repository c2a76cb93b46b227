"""Train, load and check tokenizers for the three families, with the `tokenizers` library.

==========  ==================  ===============================================================
kind        family              special tokens (ids in this order from 0)
==========  ==================  ===============================================================
bpe         GPT (byte-level)    ``<|endoftext|>`` (end of document; also used as padding)
wordpiece   BERT (cased)        ``[PAD] [UNK] [CLS] [SEP] [MASK]``
unigram     T5                  ``<pad> </s> <unk>``; ``<extra_id_0..99>`` take the last 100 ids
                                (``<extra_id_0>`` = vocab_size - 1), as in T5's vocabulary
==========  ==================  ===============================================================

The output is a plain ``tokenizer.json``: ``tokenizers.Tokenizer.from_file`` and HF
``PreTrainedTokenizerFast(tokenizer_file=...)`` both load it unchanged.

Training is reproducible for bpe and unigram (same text -> same file). WordPiece training in
`tokenizers` breaks merge-count ties in hash-map order, so two runs may differ in a few tokens
near the vocabulary cutoff: train once and keep the file (token caches are keyed by its hash).
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from .errors import DataError

log = logging.getLogger("tformer.data")

KINDS = ("bpe", "wordpiece", "unigram")
NUM_SENTINELS = 100
# Printable ASCII is always in WordPiece/Unigram alphabets, so digits and punctuation missing
# from a small training text do not become [UNK]. (Byte-level BPE covers every byte anyway.)
ASCII_ALPHABET = [chr(c) for c in range(33, 127)]
EOT = "<|endoftext|>"
BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
T5_SPECIALS = ["<pad>", "</s>", "<unk>"]


def sentinel(i: int) -> str:
    return f"<extra_id_{i}>"


# ---------------------------------------------------------------------------------------------
# Building the empty pipelines


def _bpe() -> tuple[Tokenizer, trainers.Trainer]:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok, trainers.BpeTrainer


def _wordpiece() -> tuple[Tokenizer, trainers.Trainer]:
    # Cased: lowercasing and accent stripping would make decoding lossy beyond spacing.
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]", max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=False, lowercase=False
    )
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    return tok, trainers.WordPieceTrainer


def _unigram() -> tuple[Tokenizer, trainers.Trainer]:
    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    return tok, trainers.UnigramTrainer


def _finish(tok: Tokenizer, kind: str) -> None:
    """Post-processors (added by ``encode(add_special_tokens=True)``) and T5 sentinels."""
    if kind == "wordpiece":
        cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
        )
    elif kind == "unigram":
        # Added in reverse so that <extra_id_0> gets the highest id, as in T5.
        tok.add_special_tokens(
            [AddedToken(sentinel(i), special=True, normalized=False) for i in reversed(range(NUM_SENTINELS))]
        )
        tok.post_processor = processors.TemplateProcessing(
            single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", tok.token_to_id("</s>"))]
        )


def _canonical_ids(tok: Tokenizer, kind: str, num_specials: int) -> None:
    """Make training reproducible: `tokenizers` numbers the WordPiece alphabet and tied Unigram
    pieces in hash-map order (and sums Unigram scores in thread order), so two runs on the same
    text give the same tokens under different ids. Renumber them in a fixed order."""
    if kind == "wordpiece":
        # Segmentation is greedy longest-match: ids carry no meaning beyond the special tokens.
        vocab = sorted(tok.get_vocab(with_added_tokens=False).items(), key=lambda kv: kv[1])
        rest = sorted((t for t, _ in vocab[num_specials:]), key=lambda t: (len(t.removeprefix("##")), t))
        order = [t for t, _ in vocab[:num_specials]] + rest
        tok.model = models.WordPiece({t: i for i, t in enumerate(order)}, unk_token="[UNK]", max_input_chars_per_word=100)
    elif kind == "unigram":
        import json

        pieces = json.loads(tok.to_str())["model"]["vocab"]
        specials = [tuple(p) for p in pieces[:num_specials]]
        rest = sorted(((p, round(score, 9)) for p, score in pieces[num_specials:]), key=lambda ps: (-ps[1], ps[0]))
        # Characters the trainer had to keep (never learned as pieces) come last with scores
        # stepped down in hash-map order: give those scores to the characters in sorted order.
        tail = len(rest)
        while tail > 0 and len(rest[tail - 1][0]) == 1:
            tail -= 1
        rest[tail:] = zip(sorted(p for p, _ in rest[tail:]), [s for _, s in rest[tail:]])
        tok.model = models.Unigram(specials + rest, unk_id=T5_SPECIALS.index("<unk>"), byte_fallback=False)


# ---------------------------------------------------------------------------------------------
# Training


def _text_batches(source, column: str, max_rows: int | None) -> tuple[Iterator[list[str]], int | None]:
    """Batches of strings from files, a hub name or a ``datasets`` dataset, and their row count."""
    from .loading import load_text_dataset

    columns = [column] if isinstance(column, str) else list(column)  # several: a joint vocabulary
    ds = load_text_dataset(source, columns=columns, split="all")
    n = None if _is_iterable_dataset(ds) else len(ds)
    if n == 0:
        raise DataError(f"no rows to train the tokenizer on in {source}: give data with text")
    if max_rows is not None:
        log.info("tokenizer training reads the first %d rows only (max_rows)", max_rows)
        ds = ds.take(max_rows) if n is None else ds.select(range(min(max_rows, n)))
        n = None if n is None else min(max_rows, n)
    batches = ([t for c in columns for t in batch[c] if t] for batch in ds.iter(batch_size=1000))
    return batches, n


def _is_iterable_dataset(obj) -> bool:
    return type(obj).__name__ == "IterableDataset"


def _with_continuations(batches: Iterator[list[str]]) -> Iterator[list[str]]:
    """Add one word holding every ASCII letter and digit, so each also exists as a ``##``
    continuation: otherwise a word like "12" whose "##2" was never seen becomes [UNK]."""
    alnum = "".join(c for c in ASCII_ALPHABET if c.isalnum())
    yield [alnum]
    yield from batches


def train_tokenizer(
    kind: str,
    source,
    vocab_size: int,
    out_path: str | Path | None = None,
    *,
    column: str = "text",
    min_frequency: int = 2,
    max_rows: int | None = None,
) -> Tokenizer:
    """Train a ``kind`` tokenizer ("bpe" | "wordpiece" | "unigram") of ``vocab_size`` tokens.

    ``source``: a path, glob or directory of text/jsonl/parquet/arrow files (or a list of them), a
    hub dataset name, or a ``datasets`` Dataset/IterableDataset; ``column`` holds the text.
    ``vocab_size`` counts every token, special ones included (for unigram, the 100 sentinels too).
    ``max_rows`` trains on the first rows only (Unigram is ~30x slower per MB than BPE).
    Writes ``out_path`` (a directory gets ``tokenizer.json`` inside; a ``*.json`` path is used as
    is) when given, and returns the tokenizer.
    """
    if kind not in KINDS:
        raise DataError(f"unknown tokenizer kind {kind!r}: use one of {', '.join(KINDS)}")
    specials = {"bpe": [EOT], "wordpiece": BERT_SPECIALS, "unigram": T5_SPECIALS}[kind]
    floor = len(specials) + (NUM_SENTINELS if kind == "unigram" else 0) + (256 if kind == "bpe" else 1)
    if vocab_size <= floor:
        raise DataError(
            f"vocab_size {vocab_size} is too small for a {kind} tokenizer: it needs "
            f"more than {floor} (special tokens{' + 256 bytes' if kind == 'bpe' else ''})"
        )
    tok, trainer_cls = {"bpe": _bpe, "wordpiece": _wordpiece, "unigram": _unigram}[kind]()
    if kind == "bpe":
        trainer = trainer_cls(
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
    elif kind == "wordpiece":
        trainer = trainer_cls(
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            special_tokens=specials,
            continuing_subword_prefix="##",
            initial_alphabet=ASCII_ALPHABET,
            show_progress=False,
        )
    else:
        trainer = trainer_cls(
            vocab_size=vocab_size - NUM_SENTINELS,
            special_tokens=specials,
            unk_token="<unk>",
            initial_alphabet=ASCII_ALPHABET,
            show_progress=False,
        )
    batches, n = _text_batches(source, column, max_rows)
    if kind == "wordpiece":
        batches = _with_continuations(batches)
    start = time.perf_counter()
    tok.train_from_iterator(batches, trainer, length=n)
    _canonical_ids(tok, kind, len(specials))
    _finish(tok, kind)
    log.info("trained %s tokenizer: %d tokens in %.1fs", kind, tok.get_vocab_size(True), time.perf_counter() - start)
    if tok.get_vocab_size(True) < vocab_size:
        log.warning(
            "the %s tokenizer has %d tokens, fewer than the %d asked for: the training text is too small to learn more",
            kind,
            tok.get_vocab_size(True),
            vocab_size,
        )
    if out_path is not None:
        save_tokenizer(tok, out_path)
    return tok


def save_tokenizer(tok: Tokenizer, out_path: str | Path) -> Path:
    """Write ``tokenizer.json`` (into ``out_path`` if it is a directory or has no .json suffix)."""
    out = Path(out_path)
    if out.suffix != ".json":
        out = out / "tokenizer.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out))
    return out


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load a ``tokenizer.json`` file, or the one inside a directory."""
    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise DataError(
            f"tokenizer file not found: {p}: train one with `tformer tokenizer train` "
            "or give the directory holding tokenizer.json"
        )
    try:
        return Tokenizer.from_file(str(p))
    except Exception as e:  # tokenizers raises a bare Exception on bad JSON
        raise DataError(
            f"cannot read tokenizer {p}: {str(e).splitlines()[0]}: give a tokenizer.json written by `tokenizers`"
        ) from e


# ---------------------------------------------------------------------------------------------
# Introspection


@dataclass(frozen=True)
class SpecialTokens:
    """Ids of the family's special tokens; None when the tokenizer lacks one.

    ``kind`` is inferred from the tokens present. For "bpe", padding reuses ``<|endoftext|>``.
    ``sentinel_ids[i]`` is the id of ``<extra_id_i>``.
    """

    kind: str
    pad_id: int | None = None
    eos_id: int | None = None
    unk_id: int | None = None
    cls_id: int | None = None
    sep_id: int | None = None
    mask_id: int | None = None
    sentinel_ids: tuple[int, ...] = field(default_factory=tuple)

    def require(self, name: str, purpose: str) -> int:
        value = getattr(self, name)
        if value is None:
            raise DataError(
                f"the tokenizer has no {name.removesuffix('_id')} token, needed for "
                f"{purpose}: train a matching tokenizer (`tformer tokenizer train --kind ...`)"
            )
        return value


def special_tokens(tok: Tokenizer) -> SpecialTokens:
    """The special-token ids of ``tok`` (one of the three kinds, or a compatible tokenizer)."""
    t = tok.token_to_id
    if t("[MASK]") is not None or t("[CLS]") is not None:
        return SpecialTokens(
            "wordpiece", pad_id=t("[PAD]"), unk_id=t("[UNK]"), cls_id=t("[CLS]"), sep_id=t("[SEP]"), mask_id=t("[MASK]")
        )
    if t("</s>") is not None:
        sentinels = []
        while (i := t(sentinel(len(sentinels)))) is not None:
            sentinels.append(i)
        return SpecialTokens(
            "unigram", pad_id=t("<pad>"), eos_id=t("</s>"), unk_id=t("<unk>"), sentinel_ids=tuple(sentinels)
        )
    eos = t(EOT)
    return SpecialTokens("bpe", pad_id=eos, eos_id=eos)


def vocab_size(tok: Tokenizer) -> int:
    """Number of ids the tokenizer can emit (added tokens included)."""
    return tok.get_vocab_size(with_added_tokens=True)


def check_vocab(tok: Tokenizer, model_vocab_size: int) -> None:
    """Refuse a tokenizer that emits ids the model's embedding cannot hold.

    A model vocabulary larger than the tokenizer's is fine (e.g. padded to a multiple of 64).
    """
    n = vocab_size(tok)
    if n > model_vocab_size:
        suggestion = -(-n // 64) * 64
        raise DataError(
            f"the tokenizer has {n} tokens but the model's vocab_size is "
            f"{model_vocab_size}: set the model's vocab_size to at least {n} (e.g. "
            f"{suggestion}, a multiple of 64) or train a tokenizer with --vocab-size "
            f"{model_vocab_size}"
        )


def tokenizer_hash(tok: Tokenizer) -> str:
    """SHA-256 of the tokenizer's JSON: part of every token-cache key."""
    return hashlib.sha256(tok.to_str().encode()).hexdigest()


def word_start_table(tok: Tokenizer) -> np.ndarray:
    """Boolean array over ids: True where a token can begin a word (for whole-word masking).

    WordPiece continuations start with ``##``; byte-level BPE and Unigram mark word starts with a
    leading ``Ġ`` / ``▁`` instead. Special tokens count as word starts.
    """
    n = vocab_size(tok)
    table = np.ones(n, dtype=bool)
    model = type(tok.model).__name__
    for token, i in tok.get_vocab(with_added_tokens=False).items():
        if model == "WordPiece":
            table[i] = not token.startswith("##")
        elif model == "BPE":
            table[i] = token.startswith("Ġ") or not token[:1].isalnum()
        else:
            table[i] = token.startswith("▁") or not token[:1].isalnum()
    return table


def hf_tokenizer(tok: Tokenizer):
    """Wrap ``tok`` as a HF ``PreTrainedTokenizerFast`` with the family's special-token roles."""
    from transformers import PreTrainedTokenizerFast

    s = special_tokens(tok)
    name = tok.id_to_token
    roles = {
        "bpe": dict(bos_token=EOT, eos_token=EOT, unk_token=EOT, pad_token=EOT),
        "wordpiece": dict(pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]"),
        "unigram": dict(
            pad_token="<pad>", eos_token="</s>", unk_token="<unk>", extra_special_tokens=[name(i) for i in s.sentinel_ids]
        ),
    }[s.kind]
    return PreTrainedTokenizerFast(tokenizer_object=tok, **roles)


# ---------------------------------------------------------------------------------------------
# CLI


def tokenizer_main(argv: Sequence[str] | None = None) -> int:
    """``tformer tokenizer train --kind bpe --vocab-size N --out DIR FILES...``

    Raises DataError on bad input (the caller prints ``error: <message>`` and exits 2).
    """
    from ..args import Parser, number

    parser = Parser(prog="tformer tokenizer", description="Train a tokenizer for one of the model families.")
    sub = parser.add_subparsers(dest="command", required=True)
    tr = sub.add_parser("train", help="train a tokenizer and write DIR/tokenizer.json")
    tr.add_argument("--kind", choices=KINDS, required=True, help="bpe (GPT, byte-level), wordpiece (BERT), unigram (T5)")
    tr.add_argument("--vocab-size", type=number(int, "[1, inf)"), required=True)
    tr.add_argument("--out", required=True, help="output directory (or a .json file path)")
    tr.add_argument("--column", default="text", help="text column of jsonl/parquet/arrow input")
    tr.add_argument("--min-frequency", type=number(int, "[1, inf)"), default=2, help="bpe/wordpiece: rarest merge kept")
    tr.add_argument("--max-rows", type=number(int, "[1, inf)"), default=None, help="train on the first N rows only")
    tr.add_argument("--default-corpus", action="store_true", help="train on the bundled World English Bible")
    tr.add_argument("files", nargs="*", help="text/jsonl/parquet/arrow files, globs, directories, or one hub dataset name")
    args = parser.parse_args(argv)
    if args.default_corpus:
        from .corpus import default_corpus_path

        args.files = [*args.files, str(default_corpus_path())]
    if not args.files:
        raise DataError("no training text given: pass FILES... or --default-corpus")
    source = args.files[0] if len(args.files) == 1 else args.files
    tok = train_tokenizer(
        args.kind, source, args.vocab_size, column=args.column, min_frequency=args.min_frequency, max_rows=args.max_rows
    )
    path = save_tokenizer(tok, args.out)
    print(f"wrote {path} ({args.kind}, {vocab_size(tok)} tokens)")
    return 0


if __name__ == "__main__":
    import sys

    try:
        sys.exit(tokenizer_main())
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
