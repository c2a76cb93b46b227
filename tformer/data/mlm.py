"""BERT masked-language-model samples: 15% of tokens chosen, 80/10/10 mask/random/keep."""

from __future__ import annotations

import logging

import numpy as np
from tokenizers import Tokenizer

from .cache import TokenizedCorpus
from .errors import DataError
from .samples import KeyedDataset
from .tokenizer import special_tokens, vocab_size, word_start_table

log = logging.getLogger("tformer.data")

IGNORE = -100


class MLMDataset(KeyedDataset):
    """Fixed-length MLM samples cut from the concatenated corpus.

    Sample ``i`` takes the next ``seq_len - 3`` tokens of the stream (``seq_len - 2`` without
    pairs) and lays them out as ``[CLS] A [SEP] B [SEP]``: A and B are split at a document
    boundary inside the chunk, chosen at random (at a random token when the chunk has none).
    token_type_ids are 0 over ``[CLS] A [SEP]`` and 1 over ``B [SEP]``; with ``pairs=False`` the
    layout is ``[CLS] chunk [SEP]``, all type 0.

    Masking: ``round(mask_prob * n)`` of the ``n`` non-special positions are chosen (whole
    words when ``whole_word``: a word is a word-start token and its continuations); each chosen
    token becomes ``[MASK]`` with p=0.8, a random non-special token with p=0.1, or stays, p=0.1.
    labels hold the original id at chosen positions and -100 elsewhere.

    Randomness comes from a generator seeded by (seed, epoch, index) only. Returns input_ids,
    token_type_ids, attention_mask, labels (numpy int64, length ``seq_len``).

    ``document_mask=True`` (single-segment layout only) adds ``doc_ids`` (document of every position,
    from 0; ``[CLS]`` joins the first document, the final ``[SEP]`` the last) and ``position_ids``
    restarting at each document, so the model can keep the packed documents apart.
    """

    def __init__(
        self,
        corpus: TokenizedCorpus,
        tokenizer: Tokenizer,
        seq_len: int,
        *,
        seed: int = 0,
        mask_prob: float = 0.15,
        whole_word: bool = False,
        pairs: bool = True,
        document_mask: bool = False,
    ):
        if document_mask and pairs:
            raise DataError(
                "MLM document masking needs the single-segment layout (pairs=False): the "
                "[CLS] A [SEP] B [SEP] layout relates A and B across documents"
            )
        self.document_mask = document_mask
        self._masking(tokenizer, seed, mask_prob, whole_word)
        self.chunk = seq_len - (3 if pairs else 2)
        if self.chunk < (2 if pairs else 1):
            raise DataError(f"seq_len {seq_len} is too short for MLM samples: use at least {5 if pairs else 3}")
        self.tokens, self.offsets = corpus.tokens, np.asarray(corpus.offsets)
        self.seq_len, self.pairs = seq_len, pairs
        self.num_samples = corpus.num_tokens // self.chunk
        if self.num_samples == 0:
            raise DataError(
                f"the corpus has {corpus.num_tokens:,} tokens, fewer than one MLM sample "
                f"needs ({self.chunk}): use a shorter seq_len or more data"
            )
        left = corpus.num_tokens - self.num_samples * self.chunk
        log.info(
            "MLM: %d samples of %d tokens; the last %d tokens (%.3f%%) do not fill a sample and are left out",
            self.num_samples,
            seq_len,
            left,
            100.0 * left / corpus.num_tokens,
        )

    def _masking(self, tokenizer: Tokenizer, seed: int, mask_prob: float, whole_word: bool) -> None:
        """What ``_mask`` reads: the special ids, the tokens a random replacement draws from."""
        ids = special_tokens(tokenizer)
        self.cls_id = ids.require("cls_id", "MLM samples")
        self.sep_id = ids.require("sep_id", "MLM samples")
        self.mask_id = ids.require("mask_id", "MLM samples")
        if not 0.0 < mask_prob < 1.0:
            raise DataError(f"mask_prob must be in (0, 1), got {mask_prob}")
        self.seed, self.mask_prob, self.whole_word = seed, mask_prob, whole_word
        self.is_special = np.zeros(vocab_size(tokenizer), dtype=bool)
        self.is_special[_special_ids(tokenizer)] = True
        self.random_ids = np.flatnonzero(~self.is_special)
        self.word_start = word_start_table(tokenizer) if whole_word else None

    def __len__(self) -> int:
        return self.num_samples

    def sample(self, index: int, epoch: int = 0) -> dict[str, np.ndarray]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range [0, {self.num_samples})")
        rng = self.rng(index, epoch)
        a, b = index * self.chunk, (index + 1) * self.chunk
        chunk = np.asarray(self.tokens[a:b], dtype=np.int64)
        if self.pairs:
            lo, hi = np.searchsorted(self.offsets, [a + 1, b], side="left")
            boundaries = np.unique(self.offsets[lo:hi]) - a  # document starts strictly inside
            split = int(rng.choice(boundaries)) if len(boundaries) else int(rng.integers(1, self.chunk))
            input_ids = np.concatenate([[self.cls_id], chunk[:split], [self.sep_id], chunk[split:], [self.sep_id]])
            token_type_ids = np.zeros(self.seq_len, np.int64)
            token_type_ids[split + 2 :] = 1
        else:
            input_ids = np.concatenate([[self.cls_id], chunk, [self.sep_id]])
            token_type_ids = np.zeros(self.seq_len, np.int64)
        input_ids, labels = self._mask(input_ids, rng)
        out = {
            "input_ids": input_ids,
            "token_type_ids": token_type_ids,
            "attention_mask": np.ones(self.seq_len, np.int64),
            "labels": labels,
        }
        if self.document_mask:
            doc = np.searchsorted(self.offsets, np.arange(a, b), side="right") - 1
            doc = np.concatenate([doc[:1], doc, doc[-1:]]) - doc[0]
            start = np.ones(len(doc), bool)
            start[1:] = doc[1:] != doc[:-1]
            idx = np.arange(len(doc))
            out["doc_ids"] = doc
            out["position_ids"] = idx - np.maximum.accumulate(np.where(start, idx, 0))
        return out

    def _mask(self, ids: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        candidates = np.flatnonzero(~self.is_special[ids])
        target = max(1, int(round(self.mask_prob * len(candidates))))
        if self.whole_word:
            chosen = self._choose_words(ids, candidates, target, rng)
        else:
            chosen = rng.choice(candidates, size=min(target, len(candidates)), replace=False)
        labels = np.full_like(ids, IGNORE)
        labels[chosen] = ids[chosen]
        out = ids.copy()
        roll = rng.random(len(chosen))
        out[chosen[roll < 0.8]] = self.mask_id
        to_random = chosen[(roll >= 0.8) & (roll < 0.9)]
        out[to_random] = rng.choice(self.random_ids, size=len(to_random))
        return out, labels

    def _choose_words(self, ids, candidates, target, rng) -> np.ndarray:
        # A word starts at a word-start token or right after a special token (e.g. [CLS], [SEP]).
        starts = self.word_start[ids[candidates]] | self.is_special[ids[candidates - 1]]
        bounds = np.concatenate([np.flatnonzero(starts), [len(candidates)]])
        chosen, count = [], 0
        for w in rng.permutation(len(bounds) - 1):
            size = bounds[w + 1] - bounds[w]
            if count + size > target:
                continue
            chosen.append(candidates[bounds[w] : bounds[w + 1]])
            count += size
            if count == target:
                break
        return np.concatenate(chosen) if chosen else candidates[:0]


def _special_ids(tokenizer: Tokenizer) -> list[int]:
    """Ids of the tokenizer's special tokens ([PAD], [UNK], [CLS], [SEP], [MASK])."""
    return [i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special]
