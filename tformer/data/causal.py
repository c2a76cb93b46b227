"""Causal LM packing: documents joined with EOS, cut into fixed-length next-token windows."""

from __future__ import annotations

import logging

import numpy as np

from .cache import TokenizedCorpus
from .errors import DataError
from .samples import KeyedDataset

log = logging.getLogger("tformer.data")


class PackedCausalLM(KeyedDataset):
    """Fixed-length causal LM samples over the stream ``doc_0 EOS doc_1 EOS ... doc_n EOS``.

    Sample ``i`` reads stream positions ``[i*seq_len, (i+1)*seq_len]`` (``seq_len + 1`` tokens):

    input_ids     the first ``seq_len`` tokens
    labels        the next token for each position (the window shifted by one)
    doc_ids       which document each position belongs to, numbered from 0 within the window
                  (an EOS belongs to the document it ends); mask attention to equal doc_ids
    position_ids  position inside the document, restarting at 0 at every document start and at
                  the window start (always < seq_len)

    Every stream token is an input of exactly one sample per epoch, except the tail that cannot
    fill a last window; its size is logged. Empty documents are skipped (counted in the log).
    Packing has no randomness: the epoch part of a sample key is ignored.
    """

    def __init__(self, corpus: TokenizedCorpus, seq_len: int, eos_id: int):
        if seq_len < 1:
            raise DataError(f"seq_len must be >= 1, got {seq_len}")
        lengths = corpus.lengths()
        keep = lengths > 0
        if (~keep).any():
            log.info("causal packing: skipped %d empty documents of %d", int((~keep).sum()), len(keep))
        self.tokens = corpus.tokens
        self.seq_len = seq_len
        self.eos_id = eos_id
        self.doc_start = np.asarray(corpus.offsets[:-1])[keep]
        self.doc_len = lengths[keep]
        # Start of each document in the EOS-joined stream; the last entry is the stream length.
        self.stream_start = np.zeros(len(self.doc_len) + 1, np.int64)
        np.cumsum(self.doc_len + 1, out=self.stream_start[1:])
        total = int(self.stream_start[-1])
        self.num_samples = (total - 1) // seq_len if total > 0 else 0
        if self.num_samples == 0:
            raise DataError(
                f"the corpus has {total:,} tokens with EOS, fewer than seq_len + 1 = "
                f"{seq_len + 1}: use a shorter seq_len or more data"
            )
        self.dropped_tokens = total - self.num_samples * seq_len
        log.info(
            "causal packing: %d documents, %d tokens + EOS -> %d samples of %d; the last %d "
            "tokens (%.3f%%) do not fill a window and are left out",
            len(self.doc_len),
            total - len(self.doc_len),
            self.num_samples,
            seq_len,
            self.dropped_tokens,
            100.0 * self.dropped_tokens / total,
        )

    def __len__(self) -> int:
        return self.num_samples

    def sample(self, index: int, epoch: int = 0) -> dict[str, np.ndarray]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range [0, {self.num_samples})")
        a = index * self.seq_len
        pos = np.arange(a, a + self.seq_len + 1)
        doc = np.searchsorted(self.stream_start, pos, side="right") - 1
        in_doc = pos - self.stream_start[doc]
        is_eos = in_doc == self.doc_len[doc]
        src = self.doc_start[doc] + np.minimum(in_doc, self.doc_len[doc] - 1)
        window = np.where(is_eos, self.eos_id, np.asarray(self.tokens[src], dtype=np.int64))
        first = np.maximum(self.stream_start[doc], a)
        return {
            "input_ids": window[:-1],
            "labels": window[1:],
            "doc_ids": (doc - doc[0])[:-1],
            "position_ids": (pos - first)[:-1],
        }
