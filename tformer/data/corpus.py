"""The embedded default corpus, shipped inside the package so a fresh clone trains without network.

Two public-domain files (see ``corpus/README.md``), kept byte-identical to their source:

- ``bible_web.txt.gz``: World English Bible, one verse per line (37,322 lines, 1.1M BPE tokens).
  The ``datasets`` ``text`` builder reads the gzip directly; each line is one document.
- ``parallel_en_es_bible.jsonl.gz``: 31,084 verse-aligned pairs ``{"ref", "src" (English, KJV),
  "tgt" (Spanish, Reina-Valera 1909)}`` for encoder-decoder fine-tuning.

Fixed train/validation split: validation is the last nine books of the Bible, Hebrews through
Revelation (1,138 rows = 3.0% of the WEB text, 3.7% of the pairs); train is everything before.
Holding out whole books rather than scattered verses keeps neighbouring verses, which often
repeat each other, from leaking between the two splits.
"""

from __future__ import annotations

import math
from pathlib import Path

CORPUS_DIR = Path(__file__).resolve().parent / "corpus"

BIBLE_FILE = "bible_web.txt.gz"
PAIRS_FILE = "parallel_en_es_bible.jsonl.gz"

# Row index (0-based) of Hebrews 1:1, the first validation row, in each bundled file.
_VALIDATION_START = {BIBLE_FILE: 36184, PAIRS_FILE: 29946}

SPLITS = ("train", "validation", "all")


def default_corpus_path() -> Path:
    """The bundled World English Bible text (gzip, one verse per line; column ``text``)."""
    return CORPUS_DIR / BIBLE_FILE


def default_pairs_path() -> Path:
    """The bundled English-Spanish verse pairs (gzip jsonl; columns ``ref``, ``src``, ``tgt``)."""
    return CORPUS_DIR / PAIRS_FILE


def fixed_validation_start(files: list[Path]) -> int | None:
    """First validation row when ``files`` is exactly one bundled file, else None."""
    if len(files) != 1 or files[0].resolve().parent != CORPUS_DIR:
        return None
    return _VALIDATION_START.get(files[0].name)


def split_rows(num_rows: int, split: str, val_fraction: float = 0.01, val_start: int | None = None) -> range:
    """Rows of ``split`` among ``num_rows`` rows in source order.

    Validation is the tail: rows ``val_start..`` when given (the bundled corpus), otherwise the
    last ``ceil(num_rows * val_fraction)`` rows (at least one). ``"all"`` is every row.
    """
    from .errors import DataError

    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}: use one of {', '.join(SPLITS)}")
    if split == "all":
        return range(num_rows)
    if val_start is None:
        if not 0.0 < val_fraction < 1.0:
            raise DataError(
                f"val_fraction must be in (0, 1) to split train/validation, got "
                f"{val_fraction}; use split='all' to take every row"
            )
        val_start = num_rows - max(1, math.ceil(num_rows * val_fraction))
    if val_start <= 0 or val_start >= num_rows:
        raise DataError(
            f"cannot split {num_rows} rows into train and validation (validation "
            f"would start at row {val_start}): give more rows or use split='all'"
        )
    return range(0, val_start) if split == "train" else range(val_start, num_rows)
