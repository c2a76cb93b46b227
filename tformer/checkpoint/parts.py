"""The parts of a checkpoint: each is a ``Stateful`` (``state_dict`` / ``load_state_dict``, the
protocol of ``torch.distributed.checkpoint.stateful``) and a :class:`Part` that knows where it
lives in the checkpoint directory and which ranks write it.

=====================  ===========================  =========================================
part                   Stateful                     where (``io``'s names)
=====================  ===========================  =========================================
model + optimizer      :class:`ModelOptimizer`      ``DCP_DIR`` (every rank its shards; any
                                                    layout reads any other), ``WEIGHTS`` (ddp)
  or under DeepSpeed   the engine                   ``DEEPSPEED_DIR`` (``checkpoint/deepspeed.py``)
LR schedule, scaler    :class:`Schedule`, scaler    ``SHARED_STATE`` (rank 0)
RNG streams            :class:`RNGState`            ``RNG_FILE`` (every rank its own)
trainer state, data    the trainer's (``train/``)   ``TRAINER_STATE`` (rank 0, JSON)
run config             text                         ``RUN_CONFIG`` (rank 0)
=====================  ===========================  =========================================

:class:`~tformer.checkpoint.manager.CheckpointManager` saves the parts in its order and loads them
in the same order (model and optimizer first, the RNG streams and the trainer's counters last).
A part reads what the saved :class:`TrainerState` says: a weights-only import has no optimizer,
schedule or RNG state, a checkpoint of another world size no RNG file for this rank.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch.distributed.checkpoint.stateful import Stateful

from ..files import save_model_weights, torch_save_durable, write_bytes_durable
from ..parallel.async_save import AsyncSaver, BackgroundWrite
from ..safeload import CheckpointError, dcp_load, torch_load_safe
from .io import DCP_DIR, RNG_FILE, RUN_CONFIG, SHARED_STATE, WEIGHTS, fit_rows, load_model_weights, regrows
from .state import TrainerState

log = logging.getLogger("tformer.checkpoint")


class Part(Protocol):
    """One part of a checkpoint. ``save`` writes this rank's files into the partial directory and
    returns None (written) or a write still going on in the background (``background``: the
    manager saves asynchronously and the part can); ``load`` reads them back from a verified
    checkpoint whose pickles were checked, told what the saved ``trainer.json`` says."""

    can_write_in_background: bool

    def save(self, tmp: Path, background: bool) -> BackgroundWrite | None: ...

    def load(self, ckpt: Path, saved: TrainerState) -> None: ...


# -- model and optimizer through DCP -------------------------------------------------------------


def _strip_optimizer_key(key: str) -> str:
    """``state.parts.1.NAME.exp_avg`` -> ``state.NAME.exp_avg`` (and ``param_groups.`` keys)."""
    head, _, rest = key.partition(".")
    if rest.startswith("parts."):
        rest = rest.split(".", 2)[2]
    return f"{head}.{rest}"


_KERNEL_FLAGS = ("fused", "foreach", "capturable", "differentiable")  # how AdamW runs, not what it computes


class ModelOptimizer(Stateful):
    """Model and optimizer state by parameter name (optimizer states flattened to one key per
    tensor, ``state.NAME.exp_avg``), so any layout loads any other: the names are the unsplit
    model's under every strategy, mesh and pipeline split (DTensor shards reshard in DCP)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def _local(self) -> tuple[dict[str, Any], dict[str, Any]]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        return get_state_dict(self.model, self.optimizer, options=_FLAT())

    @property
    def _pipelined(self) -> bool:
        from ..parallel.pipeline import Parts

        return isinstance(self.model, Parts)

    def state_dict(self) -> dict[str, Any]:
        from ..parallel.pipeline import Parts

        msd, osd = self._local()
        if self._pipelined:
            msd = {Parts.strip(k): v for k, v in msd.items()}
            osd = {_strip_optimizer_key(k): v for k, v in osd.items()}
        return {"model": msd, "optimizer": osd}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        from ..parallel.pipeline import Parts

        msd, osd = state_dict["model"], state_dict["optimizer"]
        if self._pipelined:  # back to this rank's names (the tensors are the loaded ones)
            own_m, own_o = self._local()
            msd = {k: msd[Parts.strip(k)] for k in own_m}
            osd = {k: osd[_strip_optimizer_key(k)] for k in own_o}
        # how this run's optimizer executes (fused, foreach) is this layout's choice, not the saved
        # run's: a 1-process checkpoint's fused AdamW would meet tp's mix of DTensor and plain tensors
        kernels = [{k: g[k] for k in _KERNEL_FLAGS if k in g} for g in self.optimizer.param_groups]
        set_state_dict(self.model, self.optimizer, model_state_dict=msd, optim_state_dict=osd, options=_FLAT())
        for group, flags in zip(self.optimizer.param_groups, kernels):
            group.update(flags)

    def load_full_weights(self, path: Path) -> None:
        """A weights-only checkpoint (one full ``WEIGHTS`` file, ``tformer import``) into the live
        model, tensor-parallel or split into pipeline stages: each rank takes its part."""
        from safetensors.torch import load_file
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        from ..parallel.pipeline import Parts

        full = load_file(path / WEIGHTS)
        own = self.model.state_dict()
        tied = getattr(getattr(self.model, "config", None), "tie_embeddings", False)
        if tied and "embed.tok.weight" in full:
            full.setdefault("lm_head.weight", full["embed.tok.weight"])  # the file stores it once
        for k, tensor in own.items():  # a file padded to another row count (see io.regrows)
            name = Parts.strip(k)
            if name in full and regrows(name, tuple(full[name].shape), tuple(tensor.shape)):
                full[name] = fit_rows(full[name], tensor.shape[0])
        missing = [k for k in own if Parts.strip(k) not in full]
        if missing:
            raise CheckpointError(
                f"checkpoint {path} does not fit this model (missing: {', '.join(missing[:3])}); "
                "use the model config the checkpoint was trained with"
            )
        set_model_state_dict(
            self.model, {k: full[Parts.strip(k)] for k in own}, options=StateDictOptions(full_state_dict=True)
        )


def _FLAT():  # noqa: N802 - a constant made on demand (the import is heavy)
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


class DCPPart:
    """:class:`ModelOptimizer` in ``DCP_DIR``: every rank writes its shards. ``weights``: rank 0
    also writes ``WEIGHTS`` (ddp without tp/pp holds the full model anyway). ``split``: the model
    is tensor-parallel or pipelined, so a weights-only import is scattered to each rank's part."""

    can_write_in_background = True

    def __init__(self, state: ModelOptimizer, device: torch.device, trust: bool, weights: bool, split: bool):
        self.state, self.trust, self.weights, self.split = state, trust, weights, split
        self.device = device
        self._saver: AsyncSaver | None = None  # made at the first background save

    def save(self, tmp: Path, background: bool) -> BackgroundWrite | None:
        import torch.distributed.checkpoint as dcp

        weights = tmp / WEIGHTS if self.weights else None
        if background:
            if self._saver is None:
                self._saver = AsyncSaver(self.device)
            return self._saver.save(self.state.state_dict(), tmp / DCP_DIR, weights)
        dcp.save(self.state.state_dict(), checkpoint_id=str(tmp / DCP_DIR))
        if weights is not None:
            save_model_weights(self.state.model, weights)
        return None

    def load(self, ckpt: Path, saved: TrainerState) -> None:
        if saved.weights_only:
            # A model imported from HF (step 0): AdamW's moments start at zero, the schedule at its start.
            if self.split:
                self.state.load_full_weights(ckpt)
            else:
                load_model_weights(self.state.model, ckpt)
            log.warning("%s holds weights only: the optimizer and LR schedule start fresh", ckpt)
            return
        if not (ckpt / DCP_DIR).is_dir():
            raise CheckpointError(
                f"checkpoint {ckpt} has no {DCP_DIR}/ directory; it was not written by the "
                "ddp or fsdp strategy (a deepspeed checkpoint needs parallel.strategy="
                "deepspeed, or `tformer consolidate` first)"
            )
        state = self.state.state_dict()  # the live tensors, by the unsplit model's names: loaded in place
        live = _read_other_padding(state, ckpt / DCP_DIR, self.trust)
        dcp_load(state, ckpt / DCP_DIR, self.trust)
        for (section, key), tensor in live.items():
            state[section][key] = _like(fit_rows(state[section][key], tensor.shape[0]), tensor)
        self.state.load_state_dict(state)


def _read_other_padding(state: dict[str, dict[str, Any]], dcp_dir: Path, trust: bool) -> dict[tuple[str, str], Any]:
    """Where the checkpoint pads the vocabulary to another row count than this run (tp=3 pads
    2,048 tokens to 2,049 rows, one process does not): read those tensors (embedding, head, their
    optimizer moments) whole at their saved shape instead. Returns the live tensors they replace."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from ..safeload import read_dcp_metadata

    saved = read_dcp_metadata(dcp_dir / ".metadata").state_dict_metadata if not trust else None
    if saved is None:
        from torch.distributed.checkpoint import FileSystemReader

        saved = FileSystemReader(str(dcp_dir)).read_metadata().state_dict_metadata
    live = {}
    for section, entries in state.items():
        for key, tensor in entries.items():
            md = saved.get(f"{section}.{key}")
            if isinstance(tensor, torch.Tensor) and isinstance(md, TensorStorageMetadata):
                if regrows(key, tuple(md.size), tuple(tensor.shape)):
                    live[(section, key)] = tensor
                    entries[key] = torch.empty(md.size, dtype=md.properties.dtype)
    return live


def _like(full: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """``full`` (every rank holds all of it) laid out as ``live``: the same shards of the same mesh
    (each rank keeps its own part, no communication), on its device."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    full = full.to(device=live.device, dtype=live.dtype)
    if isinstance(live, DTensor):
        return distribute_tensor(full, live.device_mesh, live.placements, src_data_rank=None)
    return full


# -- small states --------------------------------------------------------------------------------


class Schedule(Stateful):
    """The LR schedule; on load the optimizer's learning rates become the schedule's at the saved
    step, whatever restored the optimizer (DeepSpeed's universal load hands back this run's)."""

    def __init__(self, scheduler: Any, optimizer: torch.optim.Optimizer):
        self.scheduler, self.optimizer = scheduler, optimizer

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)
        for group, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr()):
            group["lr"] = lr


class SharedPart:
    """Small states every rank holds alike, written once by rank 0 into ``SHARED_STATE`` as one
    dict, each under its key (None: a state this run does not have, e.g. no loss scaler). A key the
    file lacks (an older checkpoint) or saved as None leaves that state as it is."""

    can_write_in_background = True  # small: written at once, before the commit

    def __init__(self, states: dict[str, Stateful | None], is_main: bool, trust: bool):
        self.states, self.is_main, self.trust = states, is_main, trust

    def save(self, tmp: Path, background: bool) -> None:
        if self.is_main:
            states = {k: s.state_dict() if s is not None else None for k, s in self.states.items()}
            torch_save_durable(states, tmp / SHARED_STATE)

    def load(self, ckpt: Path, saved: TrainerState) -> None:
        if saved.weights_only:
            return
        stored = torch_load_safe(ckpt / SHARED_STATE, self.trust)
        for key, state in self.states.items():
            if state is not None and stored.get(key) is not None:
                state.load_state_dict(stored[key])


class RNGState(Stateful):
    """This process's RNG streams (torch, Python, NumPy, CUDA): dropout and anything else random."""

    def state_dict(self) -> dict[str, Any]:
        np_state: Any = np.random.get_state()
        state = {
            "torch": torch.get_rng_state(),
            "python": random.getstate(),
            "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
        }
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        torch.set_rng_state(state_dict["torch"])
        random.setstate(state_dict["python"])
        name, keys, *rest = state_dict["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
        if "cuda" in state_dict and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state_dict["cuda"])


def rng_file(ckpt: Path, rank: int) -> Path:
    return ckpt / RNG_FILE.format(rank=rank)


class PerRankPart:
    """A state of each rank of its own (the RNG streams), one file per rank; restored only from a
    checkpoint written by as many ranks (else the streams restart, with a warning)."""

    can_write_in_background = True

    def __init__(self, state: Stateful, rank: int, world_size: int, trust: bool):
        self.state, self.rank, self.world_size, self.trust = state, rank, world_size, trust

    def save(self, tmp: Path, background: bool) -> None:
        torch_save_durable(self.state.state_dict(), rng_file(tmp, self.rank))

    def load(self, ckpt: Path, saved: TrainerState) -> None:
        path = rng_file(ckpt, self.rank)
        if path.is_file() and saved.world_size == self.world_size:
            self.state.load_state_dict(torch_load_safe(path, self.trust))
            return
        log.warning(
            "rank %d: no RNG state for this world size in %s; dropout streams restart (data order is unaffected)",
            self.rank,
            ckpt,
        )


class TrainerStatePart:
    """``TRAINER_STATE``: the fields of :class:`TrainerState` that each state gives (their
    ``state_dict``s are merged; rank 0 writes them). On load every state gets the whole saved
    record and takes its own keys (a state may refuse it: the data mixture's fingerprint)."""

    can_write_in_background = True

    def __init__(self, states: list[Stateful], is_main: bool):
        self.states, self.is_main = states, is_main

    def record(self) -> TrainerState:
        merged: dict[str, Any] = {}
        for state in self.states:
            merged.update(state.state_dict())
        return TrainerState(**merged)

    def save(self, tmp: Path, background: bool) -> None:
        if self.is_main:
            self.record().write(tmp)

    def load(self, ckpt: Path, saved: TrainerState) -> None:
        record = saved.to_dict()
        for state in self.states:
            state.load_state_dict(record)


class TextPart:
    """A text file written by rank 0 and not loaded back (the resolved run config: a resume reads
    it before any work, through ``train/resilience/resume.py``)."""

    can_write_in_background = True

    def __init__(self, text: str, is_main: bool, name: str = RUN_CONFIG):
        self.text, self.is_main, self.name = text, is_main, name

    def save(self, tmp: Path, background: bool) -> None:
        if self.is_main:
            write_bytes_durable(tmp / self.name, self.text.encode())

    def load(self, ckpt: Path, saved: TrainerState) -> None:
        return None
