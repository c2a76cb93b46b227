"""Files written whole or not at all: the one atomic-write helper every writer uses.

A reader (a resume, an export consumer, another rank, a second run sharing a cache) must see the
old file or directory or the new one, never half of one. Every writer therefore builds its output
under a ``.partial-`` sibling and renames it into place (:func:`atomic_write`, or
:func:`temp_sibling` + :func:`publish` where the building code has its own error handling).
``durable`` adds the fsyncs that make the result survive a power cut, not only a crash: checkpoints
and run records use it; exports, caches and heartbeats are cheap to redo and skip it.

It sits at the bottom of the layers (with ``config.py``): checkpoints, strategies, exports, the data
cache and the trainer all write through it.
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

PARTIAL = ".partial-"  # the prefix of everything being written; never a complete output


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (a rename into it, a new file) durable; a no-op where the
    platform cannot open directories."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def write_bytes_durable(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def torch_save_durable(obj: Any, path: Path) -> None:
    import torch

    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def unique_tensors(state: dict[str, Any]) -> dict[str, Any]:
    """The one tied-tensor rule: a tensor that shares memory (same address, shape and dtype) with
    an earlier entry is a tied alias and is kept once, under its first name. Empty tensors have
    no address and are all kept."""
    seen, out = set(), {}
    for name, t in state.items():
        key = (t.data_ptr(), tuple(t.shape), t.dtype) if t.numel() else None
        if key is not None and key in seen:
            continue
        if key is not None:
            seen.add(key)
        out[name] = t
    return out


def _umask() -> int:
    """The process's umask, read without changing it where Linux shows it (``os.umask`` can only
    be read by setting it, which would race with threads creating files meanwhile)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def save_safetensors(state: dict[str, Any], path: str | Path, metadata: dict[str, str] | None = None) -> None:
    """``safetensors.torch.save_file``, with the permissions of any other file of the run.
    safetensors (0.8, checked) writes through a private temporary file (mode 0600) that it renames
    into place, so ``model.safetensors`` came out unreadable to the group and others while
    ``config.yaml`` beside it was 0644 (umask 022)."""
    from safetensors.torch import save_file

    save_file(state, str(path), metadata={"format": "pt", **(metadata or {})})
    os.chmod(path, 0o666 & ~_umask())


def save_weights(state: dict[str, Any], path: Path) -> None:
    """Safetensors of a model state dict with each tied tensor once (its first name), made durable."""
    state = {name: t.detach().contiguous().cpu() for name, t in unique_tensors(state).items()}
    save_safetensors(state, path)
    fsync_file(path)


def save_model_weights(model: Any, path: Path) -> None:
    """Safetensors of the model with each tied tensor once (its first name), made durable."""
    save_weights(dict(model.state_dict()), path)


def temp_sibling(path: Path, directory: bool = False) -> Path:
    """A fresh ``.partial-`` name next to ``path`` (created as an empty directory if
    ``directory``), so the final rename never crosses a filesystem. Unlike ``tempfile``'s, the
    output gets the umask's permissions, as if written in place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        tmp = path.with_name(f"{PARTIAL}{path.name}-{os.getpid()}-{secrets.token_hex(4)}")
        if not tmp.exists():
            break
    if directory:
        tmp.mkdir()
    return tmp


def remove(path: Path) -> None:
    """Remove a file or a directory tree if it is there."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def publish(tmp: Path, path: Path, durable: bool = False, keep_existing: bool = False) -> Path:
    """Rename the finished ``tmp`` to ``path`` in one step. A file replaces a file atomically. A
    directory replaces an existing one by moving it aside first (it is removed afterwards), or,
    with ``keep_existing``, yields to it: another writer finished the same content first and
    ``tmp`` is dropped. ``durable``: ``tmp`` (a file's content, a directory's entries) and the
    rename are fsynced."""
    if durable:
        if tmp.is_dir():
            fsync_dir(tmp)
        else:
            fsync_file(tmp)
    if tmp.is_dir() and keep_existing:
        try:
            os.rename(tmp, path)  # refused when another writer's ``path`` is already in place
        except OSError:
            if not path.exists():
                raise
            remove(tmp)
            return path
    elif tmp.is_dir() and path.exists():
        old = path.with_name(f".old-{path.name}-{os.getpid()}")
        remove(old)
        os.rename(path, old)
        os.rename(tmp, path)
        remove(old)
    else:
        os.replace(tmp, path)
    if durable:
        fsync_dir(path.parent)
    return path


@contextmanager
def atomic_write(
    path: str | Path, directory: bool = False, durable: bool = False, keep_existing: bool = False
) -> Iterator[Path]:
    """Yield a temporary sibling of ``path`` (an empty directory if ``directory``) to write; when
    the block ends it takes ``path``'s place (:func:`publish`), and on any error it is removed,
    so no partial output is ever left behind."""
    path = Path(path)
    tmp = temp_sibling(path, directory)
    try:
        yield tmp
        publish(tmp, path, durable=durable, keep_existing=keep_existing)
    except BaseException:
        remove(tmp)
        raise


def cache_home(configured: str | Path | None = None) -> Path:
    """tformer's cache directory: ``configured`` (``data.cache_dir``) if set, else ``$TFORMER_CACHE``,
    else ``~/.cache/tformer`` (tokenized data, the CPU's measured matmul peak)."""
    return Path(configured or os.environ.get("TFORMER_CACHE") or Path.home() / ".cache" / "tformer")
