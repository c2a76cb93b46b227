"""Writing and reading checkpoint directories (see the package docstring for the layout)."""

from __future__ import annotations

import json
import re
import shutil
import zlib
from pathlib import Path

import torch

# the writers and the error live below parallel/, whose strategies use them; the old names stay here
from ..files import PARTIAL, fsync_dir, publish, save_model_weights, torch_save_durable, write_bytes_durable  # noqa: F401
from ..safeload import CheckpointError, check_dcp_dir, check_deepspeed_dir, torch_load, torch_load_safe  # noqa: F401

STEP_DIR = re.compile(r"^step_(\d+)$")
# Every name inside a checkpoint directory, spelt once (the package docstring says what each holds).
MARKER = "COMPLETE"
WEIGHTS = "model.safetensors"
DCP_DIR = "dcp"
DEEPSPEED_DIR = "deepspeed"
DEEPSPEED_TAG = "state"  # deepspeed/state/: the tag of DeepSpeed's own save
SHARED_STATE = "scheduler.pt"  # rank 0's small states: LR schedule, loss scaler, ...
TRAINER_STATE = "trainer.json"
RUN_CONFIG = "config.yaml"
RNG_FILE = "rng_rank{rank}.pt"


def check_checkpoint(ckpt: Path, trust: bool = False) -> None:
    """Every pickle of a tformer checkpoint through its allow-list, before any of them is loaded:
    ``*.pt`` files, DCP metadata and entries, DeepSpeed states. A checkpoint carrying a payload
    anywhere is refused whole, whichever part a command would read."""
    if trust:
        return
    ckpt = Path(ckpt)
    for path in sorted(ckpt.glob("*.pt")):
        torch_load(path, mmap=True)
    if (ckpt / DCP_DIR / ".metadata").is_file():
        check_dcp_dir(ckpt / DCP_DIR)
    if (ckpt / DEEPSPEED_DIR).is_dir():
        check_deepspeed_dir(ckpt / DEEPSPEED_DIR)


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def partial_dir(root: Path, step: int) -> Path:
    return root / f"{PARTIAL}{step_dir_name(step)}"  # files.PARTIAL: never a complete output


def crc32(path: Path) -> int:
    value = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            value = zlib.crc32(chunk, value)
    return value


def commit(root: Path, step: int, keep: int) -> Path:
    """Seal the partial directory of ``step`` (marker with each file's size and CRC-32), rename it
    into place, prune old checkpoints."""
    tmp = partial_dir(root, step)
    files = {str(p.relative_to(tmp)): [p.stat().st_size, crc32(p)] for p in sorted(tmp.rglob("*")) if p.is_file()}
    write_bytes_durable(tmp / MARKER, json.dumps({"step": step, "files": files}, indent=1).encode())
    # a re-save of the same step (e.g. resumed then stopped at once) replaces the older copy
    final = publish(tmp, root / step_dir_name(step), durable=True)
    for old in list_checkpoints(root)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first. Partial directories are never listed."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = STEP_DIR.match(p.name)
        if m and p.is_dir() and (p / MARKER).is_file():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def find_latest(root: str | Path) -> Path | None:
    """The newest complete checkpoint (interrupted saves are never complete). It is verified: a
    complete checkpoint whose files were damaged afterwards is an error, not silently skipped."""
    found = list_checkpoints(root)
    if not found:
        return None
    try:
        verify(found[-1], deep=True)
    except CheckpointError as e:
        raise CheckpointError(f"{e}; or delete {found[-1]} to resume from the one before") from None
    return found[-1]


def newest_intact(root: str | Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest complete checkpoint that verifies (sizes and CRC-32), and the newer ones that do
    not, each with what is wrong: what a resume falls back to, and what it sets aside. Every
    checkpoint damaged is an error (one line naming the newest's damage): starting afresh beside
    them would mix two runs."""
    found = list_checkpoints(root)
    damaged: list[tuple[Path, str]] = []
    for ckpt in reversed(found):
        try:
            verify(ckpt, deep=True)
        except CheckpointError as e:
            damaged.append((ckpt, str(e)))
            continue
        return ckpt, damaged
    if damaged:
        raise CheckpointError(
            f"every checkpoint under {root} is damaged (the newest: {damaged[0][1].split('; use an')[0]}); "
            "restore one from a copy, or start afresh in another output_dir"
        )
    return None, []


DAMAGED = "damaged-"  # the prefix a damaged checkpoint is set aside under: never listed, never pruned


def set_aside(ckpt: Path) -> Path:
    """Rename a damaged checkpoint out of the list of complete ones (kept for inspection, never
    deleted), so that pruning never counts it among the ``keep_checkpoints`` newest."""
    target = ckpt.with_name(DAMAGED + ckpt.name)
    n = 1
    while target.exists():
        n += 1
        target = ckpt.with_name(f"{DAMAGED}{ckpt.name}.{n}")
    ckpt.rename(target)
    fsync_dir(ckpt.parent)
    return target


def verify(ckpt: str | Path, deep: bool = False) -> dict:
    """Check the marker and that every file it lists is present with its recorded size; ``deep``
    also compares CRC-32 checksums (done before a resume reads the files)."""
    ckpt = Path(ckpt)
    if not ckpt.is_dir():
        raise CheckpointError(f"checkpoint {ckpt} does not exist; pass a directory like RUN/checkpoints/step_00000100")
    marker = ckpt / MARKER
    if not marker.is_file():
        raise CheckpointError(
            f"checkpoint {ckpt} is incomplete (no {MARKER} marker: the save was interrupted); use an earlier checkpoint"
        )
    try:
        info = json.loads(marker.read_text())
        files = info["files"]
    except (ValueError, KeyError, TypeError):
        raise CheckpointError(f"checkpoint {ckpt} has a corrupt {MARKER} marker; use an earlier checkpoint") from None
    for name, record in files.items():
        size, crc = record if isinstance(record, list) else (record, None)
        path = ckpt / name
        if not path.is_file():
            raise CheckpointError(f"checkpoint {ckpt} is missing {name}; use an earlier checkpoint")
        if path.stat().st_size != size:
            raise CheckpointError(
                f"checkpoint file {path} is truncated or corrupt ({path.stat().st_size} "
                f"bytes, expected {size}); use an earlier checkpoint"
            )
        if deep and crc is not None and crc32(path) != crc:
            raise CheckpointError(f"checkpoint file {path} is corrupt (CRC-32 mismatch); use an earlier checkpoint")
    return info


def read_trainer_state(ckpt: str | Path) -> dict:
    path = Path(ckpt) / TRAINER_STATE
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {ckpt} has no trainer.json; it is not a tformer checkpoint") from None
    except ValueError:
        raise CheckpointError(f"checkpoint file {path} is corrupt (invalid JSON); use an earlier checkpoint") from None


# tensors with one row per (padded) token
VOCAB_ROWS = ("embed.tok.weight", "encoder_embed.tok.weight", "lm_head.weight", "lm_head.bias")


def is_vocab_rows(name: str) -> bool:
    """A parameter (or its optimizer state, ``state.NAME.exp_avg``) with one row per vocabulary entry."""
    return any(f".{v}." in f".{name}." for v in VOCAB_ROWS)


def regrows(name: str, saved: tuple[int, ...], live: tuple[int, ...]) -> bool:
    """True if a saved tensor differs from the live one only in its padding rows: a vocabulary
    padded to another multiple (``pad_vocab_multiple``, or tp's). Rows past ``vocab_size`` are
    never looked up nor predicted, so a checkpoint loads into any padding of the same vocabulary."""
    saved, live = tuple(saved), tuple(live)
    return saved != live and len(saved) == len(live) > 0 and saved[1:] == live[1:] and is_vocab_rows(name)


def fit_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """``tensor`` cut or grown (zero rows) to ``rows`` rows: the padding of the live model."""
    if tensor.shape[0] >= rows:
        return tensor[:rows]
    return torch.cat([tensor, tensor.new_zeros(rows - tensor.shape[0], *tensor.shape[1:])])


def load_model_weights(model: torch.nn.Module, ckpt: str | Path) -> None:
    """Load the checkpoint's weights file (``WEIGHTS``) into ``model``; a shape or name mismatch is
    one clear error."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(ckpt) / WEIGHTS
    if not path.is_file():
        raise CheckpointError(f"checkpoint {ckpt} has no {WEIGHTS}")
    try:
        state = load_file(path)
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint file {path} is corrupt or truncated ({e}); use an earlier checkpoint") from None
    own = model.state_dict()
    for name, tensor in state.items():
        if name in own and regrows(name, tensor.shape, own[name].shape):
            state[name] = tensor = fit_rows(tensor, own[name].shape[0])
        if name in own and own[name].shape != tensor.shape:
            raise CheckpointError(
                f"checkpoint {ckpt} does not fit this model: {name} has shape "
                f"{tuple(tensor.shape)} in the checkpoint but {tuple(own[name].shape)} "
                "in the model; use the model config the checkpoint was trained with"
            )
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {n for n in missing if is_tied_alias(model, n, state)}
    missing = [n for n in missing if n not in tied]
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {ckpt} does not fit this model (missing: "
            f"{', '.join(missing[:3]) or '-'}; unexpected: {', '.join(unexpected[:3]) or '-'}); "
            "use the model config the checkpoint was trained with"
        )


def is_tied_alias(model: torch.nn.Module, name: str, state: dict) -> bool:
    """True if parameter ``name`` shares storage with a parameter that the file does hold."""
    params = dict(model.named_parameters(remove_duplicate=False))
    target = params.get(name)
    if target is None:
        return False
    return any(p is target and other in state for other, p in params.items() if other != name)


def resolve_checkpoint(path: str | Path, trust: bool = False) -> Path:
    """A checkpoint directory, or a run directory's newest complete checkpoint; verified (sizes
    and CRC-32) and its pickles checked against the allow-lists unless ``trust``."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist; pass a run directory or RUN/checkpoints/step_XXXXXXXX")
    is_run_dir = (path / "checkpoints").is_dir()
    if is_run_dir or (not (path / MARKER).exists() and not STEP_DIR.match(path.name)):
        latest = find_latest(path / "checkpoints" if is_run_dir else path)
        if latest is None:
            raise CheckpointError(f"no complete checkpoint under {path}")
        path = latest
    verify(path, deep=True)
    check_checkpoint(path, trust)
    return path


def load_model_from_dcp(model: torch.nn.Module, ckpt: Path, trust: bool = False) -> None:
    """Read the model part of a DCP checkpoint (any number of shards) into a full model in this
    one process, on CPU: no process group and no accelerator needed."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from ..safeload import dcp_load

    if not (ckpt / DCP_DIR).is_dir():
        raise CheckpointError(f"checkpoint {ckpt} holds neither {WEIGHTS} nor {DCP_DIR}/")
    state = {"model": get_model_state_dict(model)}
    dcp_load(state, ckpt / DCP_DIR, trust)
    set_model_state_dict(model, state["model"])
