"""T5 span corruption: drop random spans from the input, predict them after sentinels."""

from __future__ import annotations

import logging

import numpy as np
from tokenizers import Tokenizer

from .cache import TokenizedCorpus
from .errors import DataError
from .samples import KeyedDataset
from .tokenizer import special_tokens

log = logging.getLogger("tformer.data")


def _corrupted_lengths(tokens_length: int, noise_density: float, mean_span_length: float) -> tuple[int, int, int]:
    """(inputs, targets, spans) lengths for ``tokens_length`` raw tokens, EOS included."""
    noise = int(round(tokens_length * noise_density))
    noise = min(max(noise, 1), tokens_length - 1)
    spans = max(int(round(noise / mean_span_length)), 1)
    return tokens_length - noise + spans + 1, noise + spans + 1, spans


def t5_lengths(inputs_length: int, noise_density: float = 0.15, mean_span_length: float = 3.0) -> tuple[int, int]:
    """(raw tokens per sample, targets length) so that corrupted inputs fit ``inputs_length``.

    The largest raw length whose corrupted input (kept tokens + one sentinel per span + EOS)
    is at most ``inputs_length``, as in T5's ``compute_input_and_target_lengths``:
    512 -> (568, 114).
    """
    if inputs_length < 3:
        raise DataError(f"span corruption needs inputs of at least 3 tokens, got {inputs_length}")
    n = 2
    while _corrupted_lengths(n + 1, noise_density, mean_span_length)[0] <= inputs_length:
        n += 1
    return n, _corrupted_lengths(n, noise_density, mean_span_length)[1]


def _segment(total: int, parts: int, rng: np.random.Generator) -> np.ndarray:
    """Random lengths of ``parts`` non-empty segments summing to ``total``."""
    cuts = np.sort(rng.choice(np.arange(1, total), size=parts - 1, replace=False))
    return np.diff(np.concatenate([[0], cuts, [total]]))


def noise_mask(length: int, noise_density: float, mean_span_length: float, rng: np.random.Generator) -> np.ndarray:
    """Boolean mask of noise spans as T5 draws it: the span count is fixed by the length, noise and
    kept lengths are random partitions, and kept/noise segments alternate starting with kept."""
    _, _, spans = _corrupted_lengths(length, noise_density, mean_span_length)
    noise = int(round(length * noise_density))
    noise = min(max(noise, 1), length - 1)
    spans = min(spans, noise, length - noise)
    noise_lengths = _segment(noise, spans, rng)
    kept_lengths = _segment(length - noise, spans, rng)
    segment_lengths = np.stack([kept_lengths, noise_lengths], axis=1).reshape(-1)
    segment_is_noise = np.tile([False, True], spans)
    return np.repeat(segment_is_noise, segment_lengths)


class SpanCorruptionDataset(KeyedDataset):
    """T5 span-corruption samples from the concatenated corpus (documents joined without
    separators, as in T5's C4 pretraining).

    Sample ``i`` corrupts the next ``tokens_length`` raw tokens (``t5_lengths(inputs_length)``):
    input_ids = kept tokens with each noise span replaced by one sentinel (``<extra_id_0>``,
    ``<extra_id_1>``, ... in order) + EOS; labels = each sentinel followed by the span it
    replaced + EOS. The trainer shifts labels right with decoder_start_token_id = pad = 0.
    Noise density 0.15 and mean span length 3 are T5's defaults. Spans are drawn from a
    generator seeded by (seed, epoch, index).
    """

    def __init__(
        self,
        corpus: TokenizedCorpus,
        tokenizer: Tokenizer,
        inputs_length: int = 512,
        *,
        seed: int = 0,
        noise_density: float = 0.15,
        mean_span_length: float = 3.0,
    ):
        ids = special_tokens(tokenizer)
        self.eos_id = ids.require("eos_id", "span corruption")
        self.sentinels = np.asarray(ids.sentinel_ids, dtype=np.int64)
        if not 0.0 < noise_density < 1.0 or mean_span_length < 1:
            raise DataError(
                f"need 0 < noise_density < 1 and mean_span_length >= 1, got {noise_density} and {mean_span_length}"
            )
        self.tokens_length, self.targets_length = t5_lengths(inputs_length, noise_density, mean_span_length)
        spans = _corrupted_lengths(self.tokens_length, noise_density, mean_span_length)[2]
        if spans > len(self.sentinels):
            raise DataError(
                f"inputs_length {inputs_length} makes {spans} noise spans but the tokenizer "
                f"has {len(self.sentinels)} sentinel tokens: use inputs_length <= "
                f"{_max_inputs(len(self.sentinels), noise_density, mean_span_length)} or "
                "a longer mean_span_length"
            )
        self.tokens = corpus.tokens
        self.inputs_length, self.seed = inputs_length, seed
        self.noise_density, self.mean_span_length = noise_density, mean_span_length
        self.num_samples = corpus.num_tokens // self.tokens_length
        if self.num_samples == 0:
            raise DataError(
                f"the corpus has {corpus.num_tokens:,} tokens, fewer than one span-corruption "
                f"sample needs ({self.tokens_length}): use a shorter inputs_length or more data"
            )
        left = corpus.num_tokens - self.num_samples * self.tokens_length
        log.info(
            "span corruption: %d samples of %d raw tokens -> inputs %d, targets %d; the last %d "
            "tokens (%.3f%%) do not fill a sample and are left out",
            self.num_samples,
            self.tokens_length,
            inputs_length,
            self.targets_length,
            left,
            100.0 * left / corpus.num_tokens,
        )

    def __len__(self) -> int:
        return self.num_samples

    def sample(self, index: int, epoch: int = 0) -> dict[str, np.ndarray]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range [0, {self.num_samples})")
        a = index * self.tokens_length
        raw = np.asarray(self.tokens[a : a + self.tokens_length], dtype=np.int64)
        noise = noise_mask(len(raw), self.noise_density, self.mean_span_length, self.rng(index, epoch))
        input_ids = np.append(_replace_spans(raw, noise, self.sentinels), self.eos_id)
        labels = np.append(_replace_spans(raw, ~noise, self.sentinels), self.eos_id)
        return {"input_ids": input_ids, "attention_mask": np.ones_like(input_ids), "labels": labels}


def _replace_spans(raw: np.ndarray, drop: np.ndarray, sentinels: np.ndarray) -> np.ndarray:
    """Replace each run of ``drop`` by the next sentinel."""
    starts = drop & ~np.concatenate([[False], drop[:-1]])
    out = raw.copy()
    out[starts] = sentinels[np.cumsum(starts)[starts] - 1]
    return out[~drop | starts]


def _max_inputs(num_sentinels: int, noise_density: float, mean_span_length: float) -> int:
    """The largest inputs_length whose samples need at most ``num_sentinels`` spans."""
    n = 2
    while _corrupted_lengths(n + 1, noise_density, mean_span_length)[2] <= num_sentinels:
        n += 1
    return _corrupted_lengths(n, noise_density, mean_span_length)[0]
