"""Loading checkpoints without running their code (and :class:`CheckpointError`, their one error).

It sits at the bottom of the layers, with ``config.py``: the strategies in ``parallel/`` load their
own states through it, and ``checkpoint/`` builds on it (``checkpoint/safe.py`` keeps the old names).

A pickle can name any importable callable and have the unpickler call it, so a checkpoint that
travelled between people and clusters must never be unpickled freely. Three kinds of pickle live
in tformer checkpoints, and each is read here through an allow-list before anything else opens it:

- ``*.pt`` files (ours: ``scheduler.pt``, ``rng_rank*.pt``; DeepSpeed's model/optimizer states and
  universal files): ``torch.load(weights_only=True)`` with an explicit list of the few DeepSpeed
  classes those files are made of. DeepSpeed itself loads them with ``weights_only=False``, so
  :func:`check_deepspeed_dir` reads every one of them first (memory-mapped: no tensor bytes are
  copied) and refuses the directory if any names something else.
- DCP's ``.metadata``: plain pickle; read by a restricted unpickler that admits only the classes
  DCP metadata is made of (:class:`SafeFileSystemReader`).
- DCP's non-tensor entries inside ``*.distcp`` (optimizer hyperparameters, step counts): DCP's
  default planner loads them with ``weights_only=False``; :class:`SafeLoadPlanner` uses
  ``weights_only=True``.

A refusal is one line naming the file and the class it tried to load. ``trust=True`` (the CLI's
``--trust-checkpoint``, the trainer's ``checkpoint.trust``) restores the libraries' own loading:
only for checkpoints whose origin you trust. Integrity checks (sizes, CRC-32) apply either way.
"""

from __future__ import annotations

import contextlib
import pickle
import re
from pathlib import Path

import torch


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, corrupt or does not fit the model (one line)."""


TRUST_HINT = "if you trust its origin, pass --trust-checkpoint (checkpoint.trust=true), which lets the file run code"


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file names a class or function outside the allow-list (it could run code)."""


def _refuse(path, what: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"checkpoint file {path} tries to load {what}, which no checkpoint needs; refused: it could run code; {TRUST_HINT}"
    )


# -- torch.load --------------------------------------------------------------------------------

# the ways torch's weights-only unpickler names what it refused
_NOT_ALLOWED = re.compile(r"GLOBAL ([\w.]+)|Trying to call reduce for ([\w.]+)|([\w.]+) is not an allowed")


def _deepspeed_globals() -> list:
    """The classes DeepSpeed's ZeRO 1/2/3 (+ offload, bf16, universal) state files are made of:
    plain records of numbers, nothing that acts on being built."""
    try:
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
    except ImportError:
        return []
    found = [LossScaler, DynamicLossScaler, ZeroStageEnum]
    with contextlib.suppress(ImportError):
        from deepspeed.utils.tensor_fragment import fragment_address

        found.append(fragment_address)
    return found


def _weights_only(source, where, extra_globals=(), mmap: bool = False):
    """``torch.load(source, weights_only=True)`` with ``extra_globals`` allowed; a refusal names
    ``where`` and what the pickle tried to load, any other failure is a damaged file (one line)."""
    try:
        with torch.serialization.safe_globals(list(extra_globals)):
            return torch.load(source, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        m = _NOT_ALLOWED.search(str(e))
        raise (_refuse(where, next(g for g in m.groups() if g)) if m else _corrupt(where, e)) from None
    except Exception as e:  # noqa: BLE001 - any other failure is a damaged file to the user
        raise _corrupt(where, e) from None


def torch_load(path: Path, trust: bool = False, extra_globals=(), mmap: bool = False):
    """``torch.load`` that never runs code: ``weights_only=True`` plus ``extra_globals``; a file
    naming anything else is refused with one line (``trust`` loads it freely)."""
    if not trust:
        return _weights_only(path, path, extra_globals, mmap)
    try:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
    except Exception as e:  # noqa: BLE001
        raise _corrupt(path, e) from None


def torch_load_safe(path: Path, trust: bool = False):
    """``torch.load`` of one of our ``.pt`` files: tensors and plain containers, never code."""
    return torch_load(path, trust=trust)


def _corrupt(path, e: Exception) -> CheckpointError:
    first = str(e).strip().splitlines()
    return CheckpointError(
        f"checkpoint file {path} cannot be read ({type(e).__name__}: "
        f"{first[0] if first else 'corrupt'}); use an earlier checkpoint"
    )


def check_deepspeed_dir(ds_dir: Path, trust: bool = False) -> None:
    """Read every pickle under a DeepSpeed checkpoint directory through the allow-list before
    DeepSpeed (or its universal converter, or ``zero_to_fp32``) loads it with ``weights_only=False``."""
    if trust:
        return
    allowed = _deepspeed_globals()
    for path in sorted(Path(ds_dir).rglob("*.pt")):
        torch_load(path, extra_globals=allowed, mmap=True)


# -- DCP ---------------------------------------------------------------------------------------

_DCP_MODULES = ("torch.distributed.checkpoint.metadata",)
_DCP_NAMES = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, path):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str):
        allowed = (module, name) in _DCP_NAMES
        if module in _DCP_MODULES:
            import importlib

            allowed = isinstance(getattr(importlib.import_module(module), name, None), type)
        elif module == "torch":  # dtypes, layouts, memory formats are constants, not callables
            allowed = allowed or isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format))
        if not allowed:
            raise _refuse(self.path, f"{module}.{name}")
        return super().find_class(module, name)


def read_dcp_metadata(path: Path):
    """DCP's ``.metadata`` through the allow-list."""
    try:
        with open(path, "rb") as f:
            return _MetadataUnpickler(f, path).load()
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001
        raise _corrupt(path, e) from None


def safe_dcp_reader_and_planner(dcp_dir: Path, trust: bool = False):
    """``(storage_reader, planner)`` for ``dcp.load``: DCP's own when ``trust``, else ones that
    read the metadata and the non-tensor entries through the allow-lists."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    if trust:
        return FileSystemReader(str(dcp_dir)), DefaultLoadPlanner()

    class SafeFileSystemReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            rank = kwargs.get("rank")
            metadata = read_dcp_metadata(Path(self._get_metadata_path(rank)))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class SafeLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value) -> None:
            where = dcp_dir
            info = (self.metadata.storage_data or {}).get(read_item.storage_index) if self.metadata else None
            if info is not None:
                where = dcp_dir / info.relative_path
            obj = _weights_only(value, f"{where} (entry {read_item.dest_index.fqn})")
            if self.flatten_state_dict:
                from torch.distributed.checkpoint._traverse import set_element

                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return SafeFileSystemReader(str(dcp_dir)), SafeLoadPlanner()


def check_dcp_dir(dcp_dir: Path) -> None:
    """Read DCP's metadata and every non-tensor entry of its shards through the allow-lists (the
    entries are small: hyperparameters, step counts), whichever of them a load will ask for."""
    import io

    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    metadata = read_dcp_metadata(dcp_dir / ".metadata")
    storage = metadata.storage_data or {}
    for index, info in storage.items():
        if not isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            continue
        if getattr(info, "transform_descriptors", None):
            continue  # transformed (e.g. compressed) entries are checked as they load (SafeLoadPlanner)
        with open(dcp_dir / info.relative_path, "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        _weights_only(io.BytesIO(data), f"{dcp_dir / info.relative_path} (entry {index.fqn})")


def dcp_load(state: dict, dcp_dir: Path, trust: bool = False) -> None:
    """``torch.distributed.checkpoint.load`` into ``state`` through the allow-lists. An unsafe
    file is an :class:`UnsafeCheckpointError`; any other failure a one-line CheckpointError."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    reader, planner = safe_dcp_reader_and_planner(dcp_dir, trust)
    try:
        dcp.load(state, storage_reader=reader, planner=planner)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP wraps errors of every rank
        inner = _unwrap(e)
        if isinstance(inner, CheckpointError):
            raise inner from None
        lines = str(inner).strip().splitlines()
        raise CheckpointError(
            f"checkpoint {dcp_dir} cannot be read ({type(inner).__name__}: "
            f"{lines[-1] if lines else 'corrupt'}); use an earlier checkpoint"
        ) from None


def _unwrap(e: BaseException) -> BaseException:
    """The first tformer error inside DCP's per-rank failure wrapper, else ``e``."""
    failures = getattr(e, "failures", None) or {}
    for pair in failures.values():
        inner = pair[0] if isinstance(pair, tuple) else getattr(pair, "exc", pair)
        if isinstance(inner, CheckpointError):
            return inner
    for pair in failures.values():
        return pair[0] if isinstance(pair, tuple) else getattr(pair, "exc", pair)
    return e
