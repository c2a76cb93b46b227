"""A sampler whose order depends only on (seed, epoch, global position): resumable at any world size.

Global order: epoch ``e`` visits the samples in the permutation drawn from (seed, e). Global
position ``g`` counts samples across epochs (``epoch = g // num_samples``). With ``world_size``
ranks, the global order is dealt out in blocks of ``block`` positions (the micro-batch size), to
the ranks in turn, from ``start``, the ``consumed`` count the iteration began at: position ``g``
goes to rank ``(g - start) // block % world_size``. Rank ``r``'s micro-batch ``j`` is then
micro-batch ``j W + r`` of the global order: the very micro-batch that one process accumulating
``W`` times as many micro-batches takes, which a loss that is not linear in its micro-batch (a
mixture of experts' balancing loss; a mean over a micro-batch's labelled tokens, when their
number varies) needs to be the same at every world size. With ``block`` 1 the ranks read the
global order interleaved: rank 0 takes ``start, start + W, ...``, rank 1 ``start + 1, ...``. The state is the
number of global samples consumed by all ranks together; resuming from it on any number of ranks
continues the same global sequence, across epoch boundaries too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, Sequence

import numpy as np

from .errors import DataError

if TYPE_CHECKING:
    import torch


class ResumableSampler:
    """Yields sample keys ``epoch * num_samples + index`` for this rank (see ``samples.py``).

    ``consumed`` is the number of global samples handed out (by all ranks together); iterating
    advances it by ``world_size`` per key yielded here, which is exact for ranks stepping in
    lockstep. A trainer whose DataLoader prefetches (workers) should set ``sampler.consumed =
    step * global_batch_size`` before ``state_dict()``. Iteration is endless unless
    ``num_epochs`` is given (then ranks may get fewer samples than others at the end).
    """

    def __init__(
        self,
        num_samples: int,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
        consumed: int = 0,
        num_epochs: int | None = None,
        block: int = 1,
    ):
        if num_samples < 1:
            raise DataError(
                f"the dataset has {num_samples} samples: nothing to sample; give more data or a shorter sequence length"
            )
        if not 0 <= rank < world_size:
            raise DataError(f"rank {rank} is outside world_size {world_size}")
        self.num_samples, self.seed, self.shuffle = num_samples, seed, shuffle
        if block < 1:
            raise DataError(f"a sampler block of {block} samples: give 1 or more (the micro-batch size)")
        self.rank, self.world_size, self.block = rank, world_size, block
        self.consumed = consumed
        self.num_epochs = num_epochs
        self._perms: dict[int, np.ndarray] = {}

    def order(self, epoch: int) -> np.ndarray:
        """The global visiting order of sample indices in ``epoch``."""
        if not self.shuffle:
            return np.arange(self.num_samples)
        if epoch not in self._perms:
            if len(self._perms) >= 2:
                self._perms.pop(min(self._perms))
            self._perms[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
        return self._perms[epoch]

    def key(self, position: int) -> int:
        """The sample key at global position ``position``."""
        epoch, i = divmod(position, self.num_samples)
        return epoch * self.num_samples + int(self.order(epoch)[i])

    @property
    def epoch(self) -> int:
        return self.consumed // self.num_samples

    def __iter__(self) -> Iterator[int]:
        end = None if self.num_epochs is None else self.num_epochs * self.num_samples
        for g, consumed in dealt(self.consumed, self.rank, self.world_size, self.block):
            if end is not None and g >= end:
                return
            self.consumed = consumed
            yield self.key(g)

    def __len__(self) -> int:
        if self.num_epochs is None:
            raise TypeError("an endless ResumableSampler has no length; give num_epochs")
        left = max(0, self.num_epochs * self.num_samples - self.consumed)
        rounds, rest = divmod(left, self.world_size * self.block)
        return rounds * self.block + min(self.block, max(0, rest - self.rank * self.block))

    def state_dict(self) -> dict:
        return {"consumed": self.consumed, "seed": self.seed, "num_samples": self.num_samples, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict) -> None:
        """Resume at ``state["consumed"]``; refuses a state taken over different data or seed."""
        for name in ("num_samples", "seed", "shuffle"):
            if name in state and state[name] != getattr(self, name):
                raise DataError(
                    f"the checkpoint's sampler has {name}={state[name]} but this run has "
                    f"{getattr(self, name)}: resume with the same data, seed and "
                    "sequence length, or start a new run"
                )
        self.consumed = int(state["consumed"])


def dealt(start: int, rank: int, world_size: int, block: int = 1) -> Iterator[tuple[int, int]]:
    """Rank ``rank``'s global positions from ``start`` on, dealt to the ranks in turn in blocks of
    ``block``, each with the count that ranks stepping in lockstep have consumed once it is handed
    out (with ``block`` 1 every position before the next round; at a block's end, likewise)."""
    g = start + rank * block
    while True:
        for i in range(block):
            yield g + i, start + world_size * (i + 1)
        g += world_size * block
        start += world_size * block


class TokenBudgetSampler:
    """Batches of similar-length pairs holding at most ``tokens_per_batch`` source tokens and at most
    as many target tokens, padding included (``size * longest <= budget`` on each side): the paper's
    batches of ~25000 source and target tokens. Yields one list of sample keys per batch.

    Epoch ``e`` is fixed by (seed, e): the pairs are permuted, cut into pools of ``pool`` pairs, each
    pool sorted by length and cut greedily into batches, and the batches shuffled. Every pair is in
    exactly one batch per epoch. Like ``ResumableSampler``, positions count globally (here in
    batches): rank ``r`` of ``W`` takes batches ``start + r, start + r + W, ...``, and ``consumed``
    (global batches handed out) resumes the same sequence on any number of ranks.
    """

    def __init__(
        self,
        source_lengths,
        target_lengths,
        tokens_per_batch: int,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        consumed: int = 0,
        pool: int = 2048,
    ):
        self.src = np.asarray(source_lengths, dtype=np.int64)
        self.tgt = np.asarray(target_lengths, dtype=np.int64)
        self.num_samples = len(self.src)
        if self.num_samples < 1:
            raise DataError("no pairs to batch: give more data or longer maximum lengths")
        longest = int(max(self.src.max(), self.tgt.max()))
        if tokens_per_batch < longest:
            raise DataError(
                f"data.tokens_per_batch={tokens_per_batch} is smaller than the longest pair "
                f"({longest} tokens); raise it or lower data.seq_len / data.target_len"
            )
        if not 0 <= rank < world_size:
            raise DataError(f"rank {rank} is outside world_size {world_size}")
        self.budget, self.seed, self.rank, self.world_size = tokens_per_batch, seed, rank, world_size
        self.consumed, self.pool = consumed, pool
        self._epochs: dict[int, list[np.ndarray]] = {}

    def epoch_batches(self, epoch: int) -> list[np.ndarray]:
        """The batches (arrays of sample indices) of ``epoch``, in their visiting order."""
        if epoch not in self._epochs:
            if len(self._epochs) >= 2:
                self._epochs.pop(min(self._epochs))
            rng = np.random.default_rng([self.seed, epoch])
            order = rng.permutation(self.num_samples)
            longest = np.maximum(self.src, self.tgt)
            batches = []
            for start in range(0, self.num_samples, self.pool):
                chunk = order[start : start + self.pool]
                chunk = chunk[np.argsort(longest[chunk], kind="stable")]
                first, src_max, tgt_max = 0, 0, 0
                for i, idx in enumerate(chunk):
                    s, t = max(src_max, self.src[idx]), max(tgt_max, self.tgt[idx])
                    if (i - first + 1) * max(s, t) > self.budget:
                        batches.append(chunk[first:i])
                        first, s, t = i, self.src[idx], self.tgt[idx]
                    src_max, tgt_max = s, t
                batches.append(chunk[first:])
            self._epochs[epoch] = [batches[i] for i in rng.permutation(len(batches))]
        return self._epochs[epoch]

    def locate(self, position: int) -> tuple[int, int]:
        """(epoch, batch index in it) of global batch ``position``."""
        epoch = 0
        while position >= len(self.epoch_batches(epoch)):
            position -= len(self.epoch_batches(epoch))
            epoch += 1
        return epoch, position

    def batch(self, position: int) -> list[int]:
        epoch, i = self.locate(position)
        return [epoch * self.num_samples + int(j) for j in self.epoch_batches(epoch)[i]]

    def __iter__(self) -> Iterator[list[int]]:
        g = self.consumed + self.rank
        while True:
            self.consumed = g - self.rank + self.world_size
            yield self.batch(g)
            g += self.world_size

    def state_dict(self) -> dict:
        return {
            "consumed": self.consumed,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "tokens_per_batch": self.budget,
        }

    def load_state_dict(self, state: dict) -> None:
        for name, ours in (("num_samples", self.num_samples), ("seed", self.seed), ("tokens_per_batch", self.budget)):
            if name in state and state[name] != ours:
                raise DataError(
                    f"the checkpoint's sampler has {name}={state[name]} but this run has {ours}: "
                    "resume with the same data and batching, or start a new run"
                )
        self.consumed = int(state["consumed"])


# Padding values per field; unknown fields pad with the pad id.
PAD_VALUES = {
    "labels": -100,
    "attention_mask": 0,
    "token_type_ids": 0,
    "position_ids": 0,
    "doc_ids": -1,
    "decoder_doc_ids": -1,
    "source": -1,
}


class Collator:
    """Pads a list of samples into a batch of ``torch.long`` tensors, per field to its longest.

    input_ids pad with ``pad_id``, labels with -100, doc_ids (any ``*doc_ids``) with -1, masks/types/positions
    with 0. ``attention_mask`` (1 = real token) is added for input_ids when absent.
    ``pad_to_multiple_of`` rounds padded lengths up.

    ``drop_full_mask``: a batch without a single pad position leaves its ``attention_mask`` out
    (decided here, on the host: no device read). An all-ones mask changes no score, but it reaches
    SDPA as a mask tensor, and a mask tensor rules out the flash kernel on a GPU (BERT-base's
    trainer step ran at 0.87-0.89 of the same step without the mask on an H100, 2026-11-28).
    """

    def __init__(self, pad_id: int = 0, pad_to_multiple_of: int | None = None, drop_full_mask: bool = False):
        self.pad_id, self.multiple, self.drop_full_mask = pad_id, pad_to_multiple_of, drop_full_mask

    def __call__(self, samples: Sequence[dict]) -> dict[str, "torch.Tensor"]:
        import torch  # here, so that importing tformer.data (e.g. for the tokenizer CLI) stays light

        if not samples:
            raise DataError("cannot collate an empty batch")
        fields = list(samples[0])
        if "attention_mask" not in fields and "input_ids" in fields:
            samples = [{**s, "attention_mask": np.ones(len(s["input_ids"]), np.int64)} for s in samples]
            fields.append("attention_mask")
        batch = {}
        for f in fields:
            seqs = [np.asarray(s[f], dtype=np.int64) for s in samples]
            n = max(len(x) for x in seqs)
            if self.multiple:
                n = -(-n // self.multiple) * self.multiple
            out = np.full((len(seqs), n), PAD_VALUES.get(f, self.pad_id), dtype=np.int64)
            for i, x in enumerate(seqs):
                out[i, : len(x)] = x
            if f == "attention_mask" and self.drop_full_mask and out.all():
                continue
            batch[f] = torch.from_numpy(out)
        return batch


def collate(samples: Sequence[dict], pad_id: int = 0) -> dict[str, "torch.Tensor"]:
    """``Collator(pad_id)(samples)``."""
    return Collator(pad_id)(samples)
