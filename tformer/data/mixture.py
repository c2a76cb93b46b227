"""Weighted mixtures of sources, optionally changing at given steps: a pure function of the global
sample position, so resume is exact at any world size.

A ``Mixture`` lays its weights out over a block of ``BLOCK`` positions once: position ``i`` of the
block goes to the source whose share so far lags its weight most (``argmax w * (i + 1) - count``,
Megatron's blending rule). The block repeats, so the source of global position ``g`` and how many
draws each source had before it are a table look-up: no state but the position. Every window of
``BLOCK`` positions holds each source within 1-2 samples of ``weight * BLOCK``, short windows are
interleaved too (a 0.5/0.3/0.2 mixture reads A B A C A B ...).

A ``MixtureSchedule`` strings stages together: stage ``k`` covers the positions
``[start_k, end_k)`` (from ``until_step`` x global batch). A source keeps its own running count
across stages (named sources), so an annealing stage continues each corpus where the last stage left
it instead of re-reading its start.

``MixtureDataset`` turns ``(source, n)`` -- the ``n``-th draw from a source -- into a sample of
that source: epoch ``n // len``, position ``n % len`` of a permutation drawn from (seed, source,
epoch). A source drawn past its end is re-epoched or, with ``on_exhausted="stop"``, refused.
"""

from __future__ import annotations

import logging
from typing import Iterator, Sequence

import numpy as np

from ..config import ON_EXHAUSTED, OnExhausted
from .errors import DataError
from .samples import KeyedDataset
from .sampler import dealt

log = logging.getLogger("tformer.data")

BLOCK = 10_000


class Mixture:
    """Blending of ``len(weights)`` sources; zero weights are allowed (a source absent from a stage)."""

    def __init__(self, weights: Sequence[float], block: int = BLOCK):
        w = np.asarray(weights, dtype=np.float64)
        if w.ndim != 1 or len(w) == 0 or (w < 0).any() or not np.isfinite(w).all() or w.sum() <= 0:
            raise DataError(f"mixture weights {list(weights)} must be finite, >= 0 and not all zero")
        self.weights = w / w.sum()
        self.block = block
        pattern = np.empty(block, np.int64)
        counts = np.zeros(len(w), np.int64)
        for i in range(block):
            s = int(np.argmax(self.weights * (i + 1) - counts))
            pattern[i] = s
            counts[s] += 1
        self.pattern = pattern
        # prefix[i, s]: draws of source s among the first i positions of a block
        self.prefix = np.zeros((block + 1, len(w)), np.int64)
        np.cumsum(np.eye(len(w), dtype=np.int64)[pattern], axis=0, out=self.prefix[1:])

    def counts(self, n: int) -> np.ndarray:
        """Draws of each source among positions ``[0, n)``."""
        k, r = divmod(int(n), self.block)
        return k * self.prefix[-1] + self.prefix[r]

    def locate(self, g: int) -> tuple[int, int]:
        """(source, index of this draw among that source's draws) at position ``g``."""
        s = int(self.pattern[g % self.block])
        return s, int(self.counts(g)[s])


class MixtureSchedule:
    """Stages of mixtures over one list of named sources.

    ``stages`` is a list of ``(end_position, weights)`` with increasing ends (the last may be None:
    open-ended); ``weights`` has one entry per source in ``names`` (0 = not drawn in this stage).
    """

    def __init__(self, names: Sequence[str], stages: Sequence[tuple[int | None, Sequence[float]]]):
        self.names = list(names)
        self.ends = [e for e, _ in stages]
        self.mixtures = [Mixture(w) for _, w in stages]
        self.starts = [0] + [int(e) for e in self.ends[:-1] if e is not None]
        for a, b in zip(self.starts, self.ends):
            if b is not None and b <= a:
                raise DataError(f"mixture stage ends {self.ends} must increase")
        # draws of every source before each stage starts
        self.base = [np.zeros(len(self.names), np.int64)]
        for k, m in enumerate(self.mixtures[:-1]):
            end = self.ends[k]
            assert end is not None  # only the last stage is open-ended
            self.base.append(self.base[-1] + m.counts(end - self.starts[k]))

    def stage(self, g: int) -> int:
        for k, end in enumerate(self.ends):
            if end is None or g < end:
                return k
        return len(self.ends) - 1  # past the last end: the last stage goes on

    def locate(self, g: int) -> tuple[int, int]:
        k = self.stage(g)
        s, n = self.mixtures[k].locate(g - self.starts[k])
        return s, int(self.base[k][s]) + n

    def counts(self, n: int) -> np.ndarray:
        """Draws of every source among positions ``[0, n)``."""
        k = self.stage(max(n - 1, 0))
        return self.base[k] + self.mixtures[k].counts(n - self.starts[k])

    def fingerprint(self) -> list:
        return [self.names, self.ends, [m.weights.round(12).tolist() for m in self.mixtures]]


class MixtureDataset(KeyedDataset):
    """``ds[g]``: the sample at global mixture position ``g`` (any ``g >= 0``; no epochs of its own).

    ``sources`` are keyed datasets in the order of ``schedule.names``. Each sample gains
    ``source``: the index of its source (one int, for per-source accounting; not a model input).
    """

    def __init__(
        self, sources: Sequence[KeyedDataset], schedule: MixtureSchedule, seed: int = 0, on_exhausted: OnExhausted = "repeat"
    ):
        if on_exhausted not in ON_EXHAUSTED:
            raise DataError(f"on_exhausted={on_exhausted!r}: use one of {', '.join(ON_EXHAUSTED)}")
        if len(sources) != len(schedule.names):
            raise DataError(f"{len(sources)} datasets for {len(schedule.names)} mixture sources")
        self.sources, self.schedule = list(sources), schedule
        self.seed, self.on_exhausted = seed, on_exhausted
        self.lengths = [len(d) for d in self.sources]
        self._perms: dict[tuple[int, int], np.ndarray] = {}

    def __len__(self) -> int:
        """Positions in one pass over the data at the first stage's weights (for batch-size checks)."""
        return sum(self.lengths)

    def order(self, s: int, epoch: int) -> np.ndarray:
        if (s, epoch) not in self._perms:
            if len(self._perms) >= 2 * len(self.sources):
                self._perms.pop(next(iter(self._perms)))
            self._perms[(s, epoch)] = np.random.default_rng([self.seed, s, epoch]).permutation(self.lengths[s])
        return self._perms[(s, epoch)]

    def key(self, g: int) -> tuple[int, int]:
        """(source, that source's sample key) at position ``g``."""
        s, n = self.schedule.locate(g)
        epoch, i = divmod(n, self.lengths[s])
        if epoch > 0 and self.on_exhausted == "stop":
            raise DataError(
                f"source {self.schedule.names[s]!r} ran out after {self.lengths[s]:,} samples "
                "(data.on_exhausted=stop): add data, lower its weight or max_steps, or set "
                "data.on_exhausted=repeat"
            )
        return s, epoch * self.lengths[s] + int(self.order(s, epoch)[i])

    def __getitem__(self, g: int) -> dict[str, np.ndarray]:
        s, key = self.key(int(g))
        return {**self.sources[s][key], "source": np.array([s], np.int64)}

    def check_exhaustion(self, positions: int) -> dict[str, float]:
        """Epochs each source needs over ``positions`` draws; refuses, before training, a run that would
        exhaust a source under ``on_exhausted=stop`` and logs the re-epoching under ``repeat``."""
        counts = self.schedule.counts(positions)
        epochs = {n: c / L for n, c, L in zip(self.schedule.names, counts, self.lengths)}
        over = {n: e for n, e in epochs.items() if e > 1.0}
        if over and self.on_exhausted == "stop":
            name, e = next(iter(over.items()))
            raise DataError(
                f"source {name!r} would be read {e:.2f} times over this run "
                "(data.on_exhausted=stop): add data, lower its weight or max_steps, or set "
                "data.on_exhausted=repeat"
            )
        for name, e in over.items():
            log.info(
                "source %r will be re-epoched: %.2f passes over its %s samples in this run",
                name,
                e,
                f"{self.lengths[self.schedule.names.index(name)]:,}",
            )
        return epochs


class MixtureSampler:
    """Yields global mixture positions for this rank, endless, dealt from ``start`` (=
    ``consumed``) in blocks of ``block`` (the micro-batch size) to the ranks in turn, as
    ``ResumableSampler`` deals them (block 1: ``start + rank, start + rank + W, ...``). Its state
    is the global count consumed by all ranks. Logs when a source starts a new epoch (on the rank
    that iterates, i.e. the main process)."""

    def __init__(self, dataset: MixtureDataset, rank: int = 0, world_size: int = 1, consumed: int = 0, block: int = 1):
        if not 0 <= rank < world_size:
            raise DataError(f"rank {rank} is outside world_size {world_size}")
        self.dataset, self.rank, self.world_size, self.consumed = dataset, rank, world_size, consumed
        self.block = block

    def __iter__(self) -> Iterator[int]:
        sched, lengths = self.dataset.schedule, self.dataset.lengths
        for g, consumed in dealt(self.consumed, self.rank, self.world_size, self.block):
            self.consumed = consumed
            if self.rank == 0:
                s, n = sched.locate(g)
                if n > 0 and n % lengths[s] == 0:
                    log.info(
                        "source %r re-epoched: starting pass %d over its %s samples",
                        sched.names[s],
                        n // lengths[s] + 1,
                        f"{lengths[s]:,}",
                    )
            yield g

    def state_dict(self) -> dict:
        return {
            "consumed": self.consumed,
            "mixture": self.dataset.schedule.fingerprint(),
            "seed": self.dataset.seed,
            "lengths": list(self.dataset.lengths),
        }

    def load_state_dict(self, state: dict) -> None:
        ours = self.state_dict()
        for name in ("mixture", "seed", "lengths"):
            if name in state and state[name] != ours[name]:
                raise DataError(
                    f"the checkpoint's data mixture has {name}={state[name]} but this run has "
                    f"{ours[name]}: resume with the same sources, weights, stages, batch size and "
                    "seed, or start a new run"
                )
        self.consumed = int(state["consumed"])


def mixture_keys(dataset: MixtureDataset, start: int, count: int) -> list[tuple[int, int]]:
    """(source, key) of positions ``[start, start + count)`` (tests, inspection)."""
    return [dataset.key(g) for g in range(start, start + count)]


class ConcatKeyed(KeyedDataset):
    """Keyed datasets one after another (e.g. every source's validation set)."""

    def __init__(self, datasets: Sequence[KeyedDataset]):
        self.datasets = list(datasets)
        self.ends = np.cumsum([len(d) for d in self.datasets])

    def __len__(self) -> int:
        return int(self.ends[-1])

    def sample(self, index: int, epoch: int = 0) -> dict[str, np.ndarray]:
        d = int(np.searchsorted(self.ends, index, side="right"))
        start = int(self.ends[d - 1]) if d else 0
        return self.datasets[d].sample(index - start, epoch)
