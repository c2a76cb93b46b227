"""Plain source -> target pairs for encoder-decoder fine-tuning (e.g. translation)."""

from __future__ import annotations

import logging
from typing import Sequence

import numpy as np

from .cache import TokenizedCorpus
from .errors import DataError
from .samples import KeyedDataset

log = logging.getLogger("tformer.data")

OVERLONG = ("drop", "truncate", "error")


class Seq2SeqPairs(KeyedDataset):
    """Row-aligned pairs: input_ids = prefix + source + EOS, labels = target + EOS.

    ``source`` and ``target`` come from ``tokenize_pairs`` (same rows). Pairs with an empty side
    are skipped. A pair longer than ``max_source_length`` / ``max_target_length`` (EOS and prefix
    included) is dropped, truncated (keeping EOS) or refused, per ``overlong``; the counts are
    logged and kept in ``self.counts``. No randomness.
    """

    def __init__(self, source: TokenizedCorpus, target: TokenizedCorpus, eos_id: int, *,
                 max_source_length: int = 512, max_target_length: int = 512,
                 overlong: str = "drop", prefix_ids: Sequence[int] = ()):
        if source.num_docs != target.num_docs:
            raise DataError(f"source has {source.num_docs:,} rows but target has {target.num_docs:,}: "
                            "tokenize both columns together with tokenize_pairs")
        if overlong not in OVERLONG:
            raise DataError(f"overlong must be one of {', '.join(OVERLONG)}, got {overlong!r}")
        self.source, self.target, self.eos_id = source, target, eos_id
        self.prefix = np.asarray(prefix_ids, dtype=np.int64)
        self.max_source_length, self.max_target_length = max_source_length, max_target_length
        self.overlong = overlong
        src_len = source.lengths() + len(self.prefix) + 1
        tgt_len = target.lengths() + 1
        empty = (source.lengths() == 0) | (target.lengths() == 0)
        too_long = ~empty & ((src_len > max_source_length) | (tgt_len > max_target_length))
        self.counts = {"rows": source.num_docs, "empty": int(empty.sum()), "overlong": int(too_long.sum())}
        if too_long.any() and overlong == "error":
            first = int(np.flatnonzero(too_long)[0])
            raise DataError(f"{int(too_long.sum())} pairs exceed {max_source_length}/{max_target_length} "
                            f"tokens (first: row {first}, {src_len[first]}/{tgt_len[first]} tokens): raise "
                            "the maximum lengths or use overlong='drop' or 'truncate'")
        keep = ~empty & (~too_long if overlong == "drop" else True)
        self.rows = np.flatnonzero(keep)
        if len(self.rows) == 0:
            raise DataError(f"no usable pairs among {source.num_docs:,} rows ({self.counts['empty']} empty, "
                            f"{self.counts['overlong']} too long): check the columns and maximum lengths")
        log.info("seq2seq pairs: %d usable of %d rows; %d skipped as empty, %d longer than %d/%d "
                 "tokens %s", len(self.rows), source.num_docs, self.counts["empty"],
                 self.counts["overlong"], max_source_length, max_target_length,
                 {"drop": "dropped", "truncate": "truncated", "error": ""}[overlong])

    def __len__(self) -> int:
        return len(self.rows)

    def lengths(self) -> tuple[np.ndarray, np.ndarray]:
        """Source and target lengths of every sample (as ``sample`` returns them), for batching."""
        src = self.source.lengths()[self.rows] + len(self.prefix) + 1
        tgt = self.target.lengths()[self.rows] + 1
        return np.minimum(src, self.max_source_length), np.minimum(tgt, self.max_target_length)

    def sample(self, index: int, epoch: int = 0) -> dict[str, np.ndarray]:
        row = int(self.rows[index])
        src = np.concatenate([self.prefix, self.source.doc(row)])[:self.max_source_length - 1]
        tgt = self.target.doc(row)[:self.max_target_length - 1]
        input_ids = np.append(src, self.eos_id)
        return {"input_ids": input_ids, "attention_mask": np.ones_like(input_ids),
                "labels": np.append(tgt, self.eos_id)}
