"""``data.source: synthetic``: uniform random token ids for any vocabulary and sequence length,
for every objective, with no tokenizer and no files. What a benchmark trains on (it times the
trainer's own step, not a corpus), and what checks a layout or a resume without data.

Sample ``i`` of epoch ``e`` is drawn from a generator seeded by ``(seed, e, i)`` (the same
``KeyedDataset`` keys as every other dataset), so the samples are a pure function of the global
sample index: a resume, or a run at another world size, sees the very same batches.

Per objective, in the layout of the real datasets (``causal.py``, ``mlm.py``, ``span.py``,
``seq2seq.py``):

- causal: ``seq_len + 1`` ids, split into ``input_ids`` and next-token ``labels``;
- mlm: ``seq_len`` ids, a ``mask_probability`` share of positions (at least one) labelled with
  the id they held and given another random id on the input (there is no mask token to use);
- span and seq2seq: ``seq_len`` source ids and ``target_len`` target ids, independent.

Ids are drawn from ``[reserved, vocab_size)``: the first ``reserved`` ids are the model's
special tokens (pad, eos, ...), which a random sample does not hold.
"""

from __future__ import annotations

import numpy as np

from .errors import DataError
from .samples import KeyedDataset

SYNTHETIC = "synthetic"  # the data.source that names it
IGNORE = -100
# Samples per epoch: the sampler permutes this many indices per epoch (8 MB), and the next epoch
# draws new ids (its key holds the epoch), so no sample ever repeats.
SYNTHETIC_SAMPLES = 1 << 20
RESERVED_IDS = 8


class SyntheticDataset(KeyedDataset):
    def __init__(
        self,
        objective: str,
        vocab_size: int,
        seq_len: int,
        target_len: int | None = None,
        *,
        seed: int = 0,
        mask_probability: float = 0.15,
        num_samples: int = SYNTHETIC_SAMPLES,
    ):
        if objective not in ("causal", "mlm", "span", "seq2seq"):
            raise DataError(f"synthetic data: unknown objective {objective!r}; use causal, mlm, span or seq2seq")
        if vocab_size <= RESERVED_IDS + 1:
            raise DataError(
                f"synthetic data needs model.vocab_size > {RESERVED_IDS + 1} (its first {RESERVED_IDS} ids are "
                f"kept for special tokens), got {vocab_size}"
            )
        if objective in ("span", "seq2seq") and not target_len:
            raise DataError(f"synthetic {objective} data needs a target length")
        self.objective, self.vocab_size, self.seq_len, self.target_len = objective, vocab_size, seq_len, target_len
        self.seed, self.mask_probability, self.num_samples = seed, mask_probability, num_samples

    def __len__(self) -> int:
        return self.num_samples

    def ids(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.integers(RESERVED_IDS, self.vocab_size, n, dtype=np.int64)

    def sample(self, index: int, epoch: int = 0) -> dict[str, np.ndarray]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range [0, {self.num_samples})")
        rng = self.rng(index, epoch)
        s = self.seq_len
        if self.objective == "causal":
            window = self.ids(rng, s + 1)
            return {"input_ids": window[:-1], "labels": window[1:]}
        if self.objective == "mlm":
            ids = self.ids(rng, s)
            chosen = rng.random(s) < self.mask_probability
            chosen[rng.integers(s)] = True  # every sample has a label: a mean over none is undefined
            labels = np.where(chosen, ids, IGNORE)
            # a different id at each labelled position, so the input never gives its label away
            shift = rng.integers(1, self.vocab_size - RESERVED_IDS, s)
            replaced = (ids - RESERVED_IDS + shift) % (self.vocab_size - RESERVED_IDS) + RESERVED_IDS
            return {
                "input_ids": np.where(chosen, replaced, ids),
                "token_type_ids": np.zeros(s, np.int64),
                "attention_mask": np.ones(s, np.int64),
                "labels": labels,
            }
        source = self.ids(rng, s)
        target = self.ids(rng, int(self.target_len or 0))  # checked at construction: span and seq2seq have one
        return {"input_ids": source, "attention_mask": np.ones(s, np.int64), "labels": target}
