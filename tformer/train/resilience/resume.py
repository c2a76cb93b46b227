"""What a resumed run may change, judged against the checkpoint it resumes from.

A checkpoint holds the run's resolved ``config.yaml`` and, in ``trainer.json``, its global batch and
the horizon of its LR schedule. At resume (docs/reliability.md, "Resuming"):

- the layout and the bookkeeping may change silently (``RESUME_FREE`` in ``train/config.py``),
  micro_batch_size and grad_accum included as long as the global batch stays;
- ``max_steps`` / ``max_tokens`` may change to extend or shorten the run: the LR schedule keeps the
  horizon it was planned with (the ``max_steps`` of the run's start), so the LR never jumps; past
  that horizon it stays at the schedule's final value;
- any other key, and the global batch, changes what the run trains: refused in one line naming
  each change, unless ``resume_changes=allow`` (then one warning line per change);
- a run that has already reached ``max_steps`` (or ``max_tokens``) has nothing to train:
  :class:`RunComplete`, before any work, with its ``config.yaml`` left as it is; unless it was
  killed between its last save and that step's log line (``unlogged_record``): then it evaluates
  and logs that step first.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import yaml

from ...checkpoint.io import RUN_CONFIG
from ...checkpoint.manager import CheckpointManager
from ...checkpoint.state import TrainerState
from ...config import ConfigError
from ..config import RESUME_EXTEND, RESUME_FREE, TrainConfig
from ..observe.console import logged_steps

log = logging.getLogger("tformer.train")

GLOBAL_BATCH = "global batch"  # the name a change of the global batch is reported under


class RunComplete(Exception):
    """The run to resume has already reached its end; nothing to train (``tformer train`` exits 0)."""


def saved_config(ckpt: Path) -> dict:
    """The resolved config a checkpoint was written with ({} if it has none: an import)."""
    path = Path(ckpt) / RUN_CONFIG
    data = yaml.safe_load(path.read_text()) if path.is_file() else None
    return data if isinstance(data, dict) else {}


def check_not_complete(cfg: TrainConfig, ckpt: Path, state: TrainerState) -> None:
    """Raise :class:`RunComplete` if resuming ``ckpt`` leaves nothing to train."""
    if state.weights_only:
        return
    if state.step >= cfg.max_steps:
        reached = f"step {state.step}, max_steps={cfg.max_steps}"
        extend = "pass a larger max_steps"
    elif cfg.max_tokens is not None and state.tokens >= cfg.max_tokens:
        reached = f"{state.tokens:,} tokens, max_tokens={cfg.max_tokens}"
        extend = "pass a larger max_tokens"
    else:
        return
    raise RunComplete(
        f"the run in {ckpt.parent.parent} is complete ({ckpt.name}: {reached}); nothing to train and "
        f"nothing changed. To extend it {extend}; to start afresh pass another output_dir (resume=none "
        "in this directory would mix a new run's checkpoints with these)"
    )


def unlogged_record(state: TrainerState, ckpt: Path, run_dir: Path) -> dict | None:
    """The record a checkpoint of this run was saved with (its step due to be logged, and perhaps
    evaluated) when ``metrics.jsonl`` has no line for that step: the run was killed between the
    save and the log line. None when there is nothing to make good (or the checkpoint is another
    run's, or a replica group of its fault-tolerant phase logged that step)."""
    pending = state.pending
    if not pending or Path(ckpt).resolve().parent != (Path(run_dir) / "checkpoints").resolve():
        return None
    # a fault-tolerant phase of the run logged its steps per replica group (replicas/<id>/)
    logs = [Path(run_dir), *sorted((Path(run_dir) / "replicas").glob("*"))]
    if any(state.step in logged_steps(d) for d in logs):
        return None
    return pending


def check_padding(saved: dict, current: dict, strategy: str) -> None:
    """A padded vocabulary may change at resume (a checkpoint loads into any padding of the same
    vocabulary: ``checkpoint/io.py`` ``regrows``), except under DeepSpeed, whose own files load only
    at the shapes they were saved with."""
    before = (saved.get("model") or {}).get("pad_vocab_multiple")
    now = current["model"].get("pad_vocab_multiple")
    if strategy == "deepspeed" and before is not None and before != now:
        raise ConfigError(
            f"resuming a DeepSpeed checkpoint padded with model.pad_vocab_multiple={before} as {now}: DeepSpeed "
            f"loads its files only at their saved shapes; keep model.pad_vocab_multiple={before}"
        )


def float8_change(saved: dict, precision: str) -> list[tuple[str, Any, Any]]:
    """Switching to or from ``precision: fp8`` changes the rounding of every block's matrix products:
    a change of what the run trains (``judge`` refuses it, or warns once under
    ``resume_changes=allow``), though the weights and optimizer state load unchanged. Other
    precision changes (bf16 <-> fp32) are free (``RESUME_FREE``)."""
    before = saved.get("precision")
    if before is None or before == precision or "fp8" not in (before, precision):
        return []
    return [("precision", before, precision)]


def schedule_steps(cfg: TrainConfig, state: TrainerState | None, saved: dict) -> int:
    """The horizon of the LR schedule: the run's first ``max_steps``, kept through every resume."""
    if state is None or state.weights_only:
        return cfg.max_steps
    return state.schedule_steps or saved.get("max_steps") or cfg.max_steps


def saved_global_batch(state: TrainerState, saved: dict) -> tuple[int | None, int | None]:
    """(sequences, tokens) per optimizer step of the checkpoint's run; derived from its config for
    checkpoints written before ``trainer.json`` recorded them (tokens then unknown)."""
    if state.global_batch is not None:
        return state.global_batch, state.global_batch_tokens
    par = saved.get("parallel") or {}
    try:
        dp = state.world_size // (par.get("tp", 1) * par.get("pp", 1))
        return saved["micro_batch_size"] * saved["grad_accum"] * dp, None
    except (KeyError, TypeError):
        return None, None


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _matches(key: str, names: tuple[str, ...]) -> bool:
    return any(key == n or key.startswith(n + ".") for n in names)


def meaning_changes(saved: dict, current: dict, weights_only: bool = False) -> list[tuple[str, Any, Any]]:
    """(key, saved value, current value) of every key both configs hold that changes what the run
    trains (keys one of them lacks come from another tformer version: not compared). An imported
    model (``weights_only``) may be trained with other dropout rates than its source used."""
    free = RESUME_FREE + RESUME_EXTEND + (("model.dropout", "model.attn_dropout") if weights_only else ())
    old, new = flatten(saved), flatten(current)
    return [(k, old[k], new[k]) for k in old if k in new and old[k] != new[k] and not _matches(k, free)]


def batch_change(saved: tuple[int | None, int | None], current: tuple[int, int]) -> list[tuple[str, Any, Any]]:
    (seqs, tokens), (now_seqs, now_tokens) = saved, current
    if seqs is None or (seqs == now_seqs and tokens in (None, now_tokens)):
        return []
    return [(GLOBAL_BATCH, f"{seqs} sequences ({tokens or '?'} tokens)", f"{now_seqs} ({now_tokens} tokens)")]


def judge(changes: list[tuple[str, Any, Any]], cfg: TrainConfig, ckpt: Path, step: int) -> list[str]:
    """Refuse the changes in one line, or (``resume_changes=allow``) return one warning per change."""
    if not changes:
        return []
    said = [f"{k} {old!r} -> {new!r}" if k != GLOBAL_BATCH else f"{k} {old} -> {new}" for k, old, new in changes]
    if cfg.resume_changes != "allow":
        batch = (
            " (the global batch is micro_batch_size x grad_accum x data-parallel ranks: keep it with "
            "grad_accum on another layout)"
            if any(k == GLOBAL_BATCH for k, _, _ in changes)
            else ""
        )
        raise ConfigError(
            f"resuming {ckpt} would change what the run trains: {'; '.join(said)}{batch}; resume with the "
            "checkpoint's values (its config.yaml), start a new run in another output_dir, or set "
            "resume_changes=allow to continue with the changes"
        )
    return [f"resume_changes=allow: {s} from step {step} on" for s in said]


def fault_tolerance_note(saved: dict, cfg: TrainConfig, step: int) -> str | None:
    """One line when this resume switches fault tolerance on or off (``fault_tolerance`` is free to
    change, RESUME_FREE): what the run becomes. The math is unchanged; the layout rules of any
    resume hold (the global batch spans every replica group)."""
    before = (saved.get("fault_tolerance") or {}).get("enabled")
    ft = cfg.fault_tolerance
    if before is None or bool(before) == ft.enabled:
        return None
    if ft.enabled:
        return (
            f"fault tolerance switched on at this resume (step {step}): the data-parallel replicas are now "
            f"{ft.replicas} torchft replica group(s) (this one is {ft.replica_id}) that meet at the lighthouse every "
            "step; a dead group no longer stops the others, and a restarted one heals from a live peer"
        )
    return (
        f"fault tolerance switched off at this resume (step {step}): the run is one job again, its data-parallel "
        "ranks average their gradients among themselves; a dead rank stops the job (restart it and it resumes "
        "from the newest checkpoint)"
    )


def horizon_note(cfg: TrainConfig, saved: dict, horizon: int, step: int) -> str | None:
    """One line when the run's length changes: what the LR schedule does."""
    before = saved.get("max_steps")
    if before is None or before == cfg.max_steps:
        return None
    schedule = cfg.optim.schedule
    rule = (
        f"the LR schedule ({schedule}) does not depend on max_steps"
        if schedule in ("constant", "inverse_sqrt")
        else f"the LR schedule ({schedule}) keeps its {horizon}-step horizon; past step {horizon} the LR "
        "stays at its final value"
    )
    return f"max_steps {before} -> {cfg.max_steps} at step {step}: {rule}"


Found = tuple[Path, TrainerState, dict]  # a checkpoint to resume: its path, trainer.json, config.yaml


def peek(cfg: TrainConfig) -> tuple[Found | None, list[tuple[Path, str]], dict | None, int]:
    """The checkpoint to resume from, read cheaply (``trainer.json``, ``config.yaml``; verified when
    loaded), or None; the damaged newer ones it falls back past (path, why); the record its step
    still has to log (``unlogged_record``); the LR schedule's horizon. A run already complete
    raises :class:`RunComplete`, before any work."""
    manager = CheckpointManager(Path(cfg.output_dir) / "checkpoints")
    path, damaged = manager.locate(cfg.resume)
    found: Found | None = None
    unlogged = None
    if path is not None and path.is_dir():
        state, saved = manager.read(path), saved_config(path)
        if not cfg.fault_tolerance.enabled:  # under torchft each group logs apart (replicas/<id>/)
            unlogged = unlogged_record(state, path, Path(cfg.output_dir))
        if unlogged is None:  # a record still to log (and evaluate) is work left
            check_not_complete(cfg, path, state)
        found = (path, state, saved)
    return found, damaged, unlogged, schedule_steps(cfg, *(found or (None, None, {}))[1:])


def change_notes(found: Found, cfg: TrainConfig, model: dict, global_batch: tuple[int, int], horizon: int) -> list[str]:
    """Refuse what the resumed run changes (``ConfigError``), or under ``resume_changes=allow`` the
    warning lines naming each change; with the schedule's and fault tolerance's notes. ``model``:
    this run's model config (its vocabulary padded), ``global_batch``: (sequences, tokens)."""
    path, state, saved = found
    current = {**cfg.to_dict(), "model": model}
    if state.weights_only:  # an import starts a run: only the model its weights belong to counts
        saved, current = {"model": state.model_config or {}}, {"model": current["model"]}
    check_padding(saved, current, cfg.parallel.strategy)
    changes = meaning_changes(saved, current, weights_only=state.weights_only)
    changes += batch_change(saved_global_batch(state, saved), global_batch)
    changes += float8_change(saved, cfg.precision)
    notes: list[str | None] = list(judge(changes, cfg, path, state.step))
    notes.append(horizon_note(cfg, saved, horizon, state.step))
    notes.append(fault_tolerance_note(saved, cfg, state.step))
    return [note for note in notes if note]


def say_damaged(damaged: list[tuple[Path, str]], moved: list[Path], own: bool, back: str) -> None:
    """One warning line per damaged checkpoint a resume fell back past (set aside as ``moved`` when
    ``own``: this run's own), naming the one it resumes from."""
    for (path, why), where in zip(damaged, moved):
        aside = f"; set aside as {where.name}" if own else ""
        log.warning(
            "%s is damaged (%s)%s; resuming from %s: the steps after it are trained again",
            path.name,
            why.split("; use an")[0],
            aside,
            back,
        )
