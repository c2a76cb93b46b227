"""Sample keys: how the sampler's global indices reach a dataset.

A key is ``epoch * len(dataset) + index``. Datasets are map-style with ``len`` = samples per
epoch; indexing with a key ``>= len`` selects that epoch's version of the sample, so random
choices (masks, spans) can differ per epoch while staying a pure function of
(seed, epoch, index). ``ResumableSampler`` yields keys in this form.
"""

from __future__ import annotations

import numpy as np


class KeyedDataset:
    """Map-style base: ``ds[key]`` -> ``ds.sample(index, epoch)``."""

    seed: int = 0

    def __len__(self) -> int:
        raise NotImplementedError

    def sample(self, index: int, epoch: int = 0) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def __getitem__(self, key: int) -> dict[str, np.ndarray]:
        key = int(key)
        if key < 0:
            raise IndexError(f"sample key must be >= 0, got {key}")
        epoch, index = divmod(key, len(self))
        return self.sample(index, epoch)

    def rng(self, index: int, epoch: int) -> np.random.Generator:
        """The per-sample generator; never the global RNG."""
        return np.random.default_rng([self.seed, epoch, index])

    # Pickling (DataLoader workers started with "spawn") sends memory-mapped token arrays as
    # their file path, not as a copy of the data.
    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        for name, value in state.items():
            if isinstance(value, np.memmap) and value.filename is not None:
                state[name] = _MemmapRef(value.filename, value.dtype.str, value.shape, value.offset)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update({k: v.open() if isinstance(v, _MemmapRef) else v for k, v in state.items()})


class _MemmapRef:
    def __init__(self, filename: str, dtype: str, shape: tuple, offset: int):
        self.filename, self.dtype, self.shape, self.offset = filename, dtype, shape, offset

    def open(self) -> np.memmap:
        return np.memmap(self.filename, dtype=self.dtype, mode="r", shape=self.shape, offset=self.offset)
