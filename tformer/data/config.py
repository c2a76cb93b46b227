"""The run config's ``data`` section: what a run reads and how its samples are made.

Its owner is this package; ``tformer/train/config.py`` composes it into the run config (and
re-exports it). Ranges are declared on the fields (``ranged``) and checked by ``check_ranges``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from ..config import Family, OnExhausted, check_table, ranged

Objective = Literal["auto", "causal", "mlm", "span", "seq2seq"]
OBJECTIVES: tuple[Objective, ...] = get_args(Objective)
# data.objective=auto: the objective of each family
AUTO_OBJECTIVE: dict[Family, Objective] = {"decoder": "causal", "encoder": "mlm", "encdec": "span"}
check_table(AUTO_OBJECTIVE, Family, "AUTO_OBJECTIVE")


@dataclass
class DataConfig:
    source: str = "default"  # "default" (bundled corpus), a file/dir/glob, a dataset name, or "synthetic" (random ids)
    text_column: str = "text"  # the column of a table source that holds the text
    source_column: str = "src"  # seq2seq pairs: the column of the source side
    target_column: str = "tgt"  # seq2seq pairs: the column of the target side
    objective: Objective = "auto"  # auto: decoder->causal, encoder->mlm, encdec->span
    tokenizer: str = "auto"  # path to tokenizer.json, or "auto": train one on the source, cached
    tokenizer_vocab_size: int | None = ranged(None, "[1, inf)")  # for "auto"; default = model.vocab_size
    seq_len: int = ranged(128, "[1, inf)")  # tokens per training sequence (the source side for seq2seq)
    target_len: int | None = ranged(None, "[1, inf)")  # seq2seq decoder length (span corruption computes its own)
    # seq2seq: batches of similar-length pairs up to this many source (and target) tokens, padding
    # included; replaces micro_batch_size for training
    tokens_per_batch: int | None = ranged(None, "[1, inf)")
    mlm_probability: float = ranged(0.15, "(0, 1)")  # mlm: share of tokens masked
    whole_word_mask: bool = False  # mlm: mask every piece of a chosen word
    noise_density: float = ranged(0.15, "(0, 1)")  # span corruption: share of tokens corrupted
    mean_span_length: float = ranged(3.0, "[1, inf)")  # span corruption: mean length of a corrupted span
    val_fraction: float = ranged(0.01, "[0, 1)")  # ignored for the bundled corpus (its split is fixed)
    tokenizer_max_rows: int | None = ranged(None, "[1, inf)")  # "auto" trains on the first N rows (Unigram is slow)
    num_proc: int | None = ranged(None, "[1, inf)")  # processes that tokenize a corpus (default: one)
    cache_dir: str | None = None  # default: $TFORMER_CACHE or ~/.cache/tformer
    num_workers: int = ranged(0, "[0, inf)")  # DataLoader worker processes
    # A weighted mixture instead of one source: [{source: PATH|NAME|default, weight: W, name: web,
    # text_column: text (optional)}, ...]; see tformer/data/mixture.py
    sources: list = field(default_factory=list)
    # The mixture changing at given steps: [{until_step: N, sources: [...]}, ...]; the last stage
    # must reach max_steps. Sources are matched across stages by name.
    stages: list = field(default_factory=list)
    on_exhausted: OnExhausted = "repeat"  # a mixture source read to its end: repeat (re-epoch, logged) | stop
    document_mask: bool = False  # packed documents (pairs) attend only within themselves
    # seq2seq + document_mask: source / target tokens per packed row (default: data.seq_len /
    # data.target_len, the longest pair)
    pack_len: int | None = ranged(None, "[1, inf)")
    # mlm + document_mask: one [CLS] document [SEP] sample per document, packed into rows of at most
    # data.seq_len tokens (RoPE / positions restarting at each): no position computed on padding
    # and the loss of the same documents padded (data/mlm_pack.py); false: cut from the token stream
    pack: bool = False
    prepared: bool = False  # require the token cache of `tformer data prepare`; never tokenize here
