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

    def __init__(
        self,
        source: TokenizedCorpus,
        target: TokenizedCorpus,
        eos_id: int,
        *,
        max_source_length: int = 512,
        max_target_length: int = 512,
        overlong: str = "drop",
        prefix_ids: Sequence[int] = (),
    ):
        if source.num_docs != target.num_docs:
            raise DataError(
                f"source has {source.num_docs:,} rows but target has {target.num_docs:,}: "
                "tokenize both columns together with tokenize_pairs"
            )
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
            raise DataError(
                f"{int(too_long.sum())} pairs exceed {max_source_length}/{max_target_length} "
                f"tokens (first: row {first}, {src_len[first]}/{tgt_len[first]} tokens): raise "
                "the maximum lengths or use overlong='drop' or 'truncate'"
            )
        keep = ~empty & (~too_long if overlong == "drop" else True)
        self.rows = np.flatnonzero(keep)
        if len(self.rows) == 0:
            raise DataError(
                f"no usable pairs among {source.num_docs:,} rows ({self.counts['empty']} empty, "
                f"{self.counts['overlong']} too long): check the columns and maximum lengths"
            )
        log.info(
            "seq2seq pairs: %d usable of %d rows; %d skipped as empty, %d longer than %d/%d tokens %s",
            len(self.rows),
            source.num_docs,
            self.counts["empty"],
            self.counts["overlong"],
            max_source_length,
            max_target_length,
            {"drop": "dropped", "truncate": "truncated", "error": ""}[overlong],
        )

    def __len__(self) -> int:
        return len(self.rows)

    def lengths(self) -> tuple[np.ndarray, np.ndarray]:
        """Source and target lengths of every sample (as ``sample`` returns them), for batching."""
        src = self.source.lengths()[self.rows] + len(self.prefix) + 1
        tgt = self.target.lengths()[self.rows] + 1
        return np.minimum(src, self.max_source_length), np.minimum(tgt, self.max_target_length)

    def sample(self, index: int, epoch: int = 0) -> dict[str, np.ndarray]:
        row = int(self.rows[index])
        src = np.concatenate([self.prefix, self.source.doc(row)])[: self.max_source_length - 1]
        tgt = self.target.doc(row)[: self.max_target_length - 1]
        input_ids = np.append(src, self.eos_id)
        return {"input_ids": input_ids, "attention_mask": np.ones_like(input_ids), "labels": np.append(tgt, self.eos_id)}


class PackedSeq2Seq(KeyedDataset):
    """Several (source, target) pairs per row, for document-masked encoder-decoder training.

    The pairs of ``pairs`` are visited in one order fixed by ``seed``, in pools of ``pool`` pairs;
    each pool is packed first-fit decreasing: longest pairs first, each into the first row where its
    source and its target still fit ``row_length`` tokens (default, and at least, the pairs' own
    maximum lengths; longer rows fill better). Each sample holds

    input_ids / labels      the pairs' sources / targets (with EOS) back to back
    decoder_input_ids       each target shifted right behind its own ``start_id``
    doc_ids                 pair number (0, 1, ...) of every source token
    decoder_doc_ids         pair number of every target token

    The model confines encoder, decoder and cross-attention to each pair (``DocumentMask``), so a
    packed row trains exactly like its pairs run one by one, without the padding. Every pair sits
    in exactly one row; the row order is the sampler's to shuffle.
    """

    def __init__(self, pairs: Seq2SeqPairs, start_id: int, seed: int = 0, pool: int = 2048, row_length: int | None = None):
        self.pairs, self.start_id = pairs, start_id
        src, tgt = pairs.lengths()
        # rows may be longer than the longest pair: short bins waste their tails
        self.row_source = max(row_length or 0, pairs.max_source_length)
        self.row_target = max(row_length or 0, pairs.max_target_length)
        order = np.random.default_rng([seed, 7]).permutation(len(pairs))
        rows: list[np.ndarray] = []
        for a in range(0, len(order), pool):
            rows += _first_fit_decreasing(order[a : a + pool], src, tgt, self.row_source, self.row_target)
        self.order = np.concatenate(rows)
        self.bounds = np.zeros(len(rows) + 1, np.int64)
        np.cumsum([len(r) for r in rows], out=self.bounds[1:])
        real = int(tgt.sum())
        log.info(
            "seq2seq packing: %d pairs -> %d rows (%.1f pairs per row; %.1f%% of target slots hold tokens)",
            len(order),
            len(self),
            len(order) / len(self),
            100.0 * real / (len(self) * self.row_target),
        )

    def __len__(self) -> int:
        return len(self.bounds) - 1

    def sample(self, index: int, epoch: int = 0) -> dict[str, np.ndarray]:
        if not 0 <= index < len(self):
            raise IndexError(f"row {index} out of range [0, {len(self)})")
        parts = [self.pairs.sample(int(i)) for i in self.order[self.bounds[index] : self.bounds[index + 1]]]
        src = [p["input_ids"] for p in parts]
        tgt = [p["labels"] for p in parts]
        return {
            "input_ids": np.concatenate(src),
            "attention_mask": np.ones(sum(len(s) for s in src), np.int64),
            "labels": np.concatenate(tgt),
            "decoder_input_ids": np.concatenate([np.concatenate([[self.start_id], t[:-1]]) for t in tgt]),
            "doc_ids": np.concatenate([np.full(len(s), d, np.int64) for d, s in enumerate(src)]),
            "decoder_doc_ids": np.concatenate([np.full(len(t), d, np.int64) for d, t in enumerate(tgt)]),
        }


def _first_fit_decreasing(
    items: np.ndarray, src: np.ndarray, tgt: np.ndarray, max_src: int, max_tgt: int
) -> list[np.ndarray]:
    items = items[np.argsort(-(src[items] + tgt[items]), kind="stable")]
    src_free = np.empty(len(items), np.int64)
    tgt_free = np.empty(len(items), np.int64)
    members: list[list[int]] = []
    for idx in items:
        s, t = src[idx], tgt[idx]
        n = len(members)
        fits = np.flatnonzero((src_free[:n] >= s) & (tgt_free[:n] >= t))
        if len(fits):
            r = int(fits[0])
            members[r].append(int(idx))
            src_free[r] -= s
            tgt_free[r] -= t
        else:
            members.append([int(idx)])
            src_free[n], tgt_free[n] = max_src - s, max_tgt - t
    return [np.asarray(m, np.int64) for m in members]
