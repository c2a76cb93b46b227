"""Masked-LM samples one document at a time, padded or packed.

``MLMDocuments``: sample ``i`` is document ``i`` as ``[CLS] doc [SEP]`` (cut to ``seq_len``),
masked as ``MLMDataset`` masks (15%, 80/10/10), from a generator seeded by (seed, epoch, i). Its
batches are padded to their longest document: the path of fine-tuning-shaped batches.

``PackedMLM``: the same documents, several to a row of at most ``seq_len`` tokens (first-fit
decreasing over pools of documents), each carrying ``doc_ids`` and ``position_ids`` that restart
at every document, so attention stays inside each document (``DocumentMask``) and RoPE counts from
each document's start. Each document is masked exactly as ``MLMDocuments`` masks it, so a batch of
packed rows has the loss of the same documents padded, without computing the padding.
"""

from __future__ import annotations

import logging

import numpy as np
from tokenizers import Tokenizer

from .cache import TokenizedCorpus
from .errors import DataError
from .mlm import MLMDataset
from .samples import KeyedDataset
from .seq2seq import _first_fit_decreasing

log = logging.getLogger("tformer.data")


class MLMDocuments(MLMDataset):
    """One masked ``[CLS] doc [SEP]`` sample per non-empty document (see the module docstring)."""

    def __init__(
        self,
        corpus: TokenizedCorpus,
        tokenizer: Tokenizer,
        seq_len: int,
        *,
        seed: int = 0,
        mask_prob: float = 0.15,
        whole_word: bool = False,
    ):
        if seq_len < 3:
            raise DataError(f"seq_len {seq_len} is too short for MLM documents: use at least 3 ([CLS] token [SEP])")
        self._masking(tokenizer, seed, mask_prob, whole_word)
        self.corpus, self.seq_len, self.document_mask, self.pairs = corpus, seq_len, False, False
        lengths = corpus.lengths()
        self.docs = np.flatnonzero(lengths > 0)
        if len(self.docs) == 0:
            raise DataError("the corpus holds no non-empty document for MLM samples")
        self.num_samples = len(self.docs)
        cut = int(np.maximum(lengths[self.docs] + 2 - seq_len, 0).sum())
        log.info(
            "MLM documents: %d documents (%d empty left out); %d tokens (%.3f%%) beyond seq_len=%d are cut",
            len(self.docs),
            corpus.num_docs - len(self.docs),
            cut,
            100.0 * cut / max(1, corpus.num_tokens),
            seq_len,
        )

    def lengths(self) -> np.ndarray:
        """Tokens of every sample, [CLS] and [SEP] included."""
        return np.minimum(self.corpus.lengths()[self.docs] + 2, self.seq_len)

    def sample(self, index: int, epoch: int = 0) -> dict[str, np.ndarray]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range [0, {self.num_samples})")
        doc = self.corpus.doc(int(self.docs[index]))[: self.seq_len - 2]
        ids = np.concatenate([[self.cls_id], doc, [self.sep_id]])
        input_ids, labels = self._mask(ids, self.rng(index, epoch))
        n = len(ids)
        return {
            "input_ids": input_ids,
            "token_type_ids": np.zeros(n, np.int64),
            "attention_mask": np.ones(n, np.int64),
            "labels": labels,
        }


class PackedMLM(KeyedDataset):
    """``documents`` packed into rows of at most ``seq_len`` tokens (see the module docstring).
    Rows are formed once, over the documents in an order fixed by ``seed`` in pools of ``pool``;
    every document sits in exactly one row, and the row order is the sampler's to shuffle."""

    def __init__(self, documents: MLMDocuments, seed: int = 0, pool: int = 2048):
        self.documents, self.seed = documents, documents.seed
        lengths = documents.lengths()
        order = np.random.default_rng([seed, 11]).permutation(len(documents))
        rows: list[np.ndarray] = []
        for a in range(0, len(order), pool):
            rows += _first_fit_decreasing(order[a : a + pool], lengths, np.zeros_like(lengths), documents.seq_len, 0)
        self.order = np.concatenate(rows)
        self.bounds = np.zeros(len(rows) + 1, np.int64)
        np.cumsum([len(r) for r in rows], out=self.bounds[1:])
        log.info(
            "MLM packing: %d documents -> %d rows of <= %d tokens (%.1f documents per row; %.1f%% of slots hold tokens)",
            len(order),
            len(rows),
            documents.seq_len,
            len(order) / len(rows),
            100.0 * lengths.sum() / (len(rows) * documents.seq_len),
        )

    def __len__(self) -> int:
        return len(self.bounds) - 1

    def row_documents(self, index: int) -> np.ndarray:
        """The document (sample) indices of row ``index``, in the row's order."""
        return self.order[self.bounds[index] : self.bounds[index + 1]]

    def sample(self, index: int, epoch: int = 0) -> dict[str, np.ndarray]:
        if not 0 <= index < len(self):
            raise IndexError(f"row {index} out of range [0, {len(self)})")
        parts = [self.documents.sample(int(i), epoch) for i in self.row_documents(index)]
        out = {key: np.concatenate([p[key] for p in parts]) for key in parts[0]}
        out["doc_ids"] = np.concatenate([np.full(len(p["input_ids"]), d, np.int64) for d, p in enumerate(parts)])
        out["position_ids"] = np.concatenate([np.arange(len(p["input_ids"]), dtype=np.int64) for p in parts])
        return out
