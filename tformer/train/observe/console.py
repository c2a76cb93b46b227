"""What a training run prints: a short summary when it starts (not the resolved config), and each
logged step's line.

The resolved config (every key, ~170 lines) is the run directory's ``config.yaml``, written before
this is printed; the summary names it. The layout line says what the run really is: DDP replicates
the model (no ``dp_shard``), FSDP2 shards it, tensor and pipeline parallelism split it.
"""

from __future__ import annotations

import datetime
import json
import sys
import time
from pathlib import Path

from ...files import atomic_write

METRICS = "metrics.jsonl"


def layout(strategy: str, dims, sp: bool, world: int) -> str:
    """The run's parallel layout in words, e.g. ``1 process``, ``ddp: 2 replicas``,
    ``fsdp: dp_replicate=2 x dp_shard=4``, ``fsdp: dp_shard=2 x tp=2 (sp)``."""
    parts = []
    if dims.pp > 1:
        parts.append(f"pp={dims.pp}")
    if strategy == "ddp":
        if dims.dp_size > 1:
            parts.append(f"{dims.dp_size} replicas")
    else:
        if dims.dp_replicate > 1:
            parts.append(f"dp_replicate={dims.dp_replicate}")
        parts.append(f"dp_shard={dims.dp_shard}")
    if dims.tp > 1:
        parts.append(f"tp={dims.tp}" + (" (sp)" if sp else ""))
    if world == 1:
        return "1 process"
    return f"{strategy}: {' x '.join(parts)}" if parts else strategy


def _data(cfg, objective: str) -> str:
    data = cfg.data
    if data.sources or data.stages:
        names = [str(s.get("name") or s.get("source")) for s in data.sources] or ["staged mixture"]
        where = "mixture of " + ", ".join(names)
    else:
        where = data.source
    length = f"seq {data.seq_len}" + (f", target {data.target_len}" if data.target_len else "")
    return f"{where}; {objective}; {length}"


def start_summary(trainer) -> str:
    """The few lines a run prints at its start (rank 0)."""
    t, cfg = trainer, trainer.cfg
    m = t.model_cfg
    batch = (
        f"{cfg.data.tokens_per_batch:,} tokens per micro-batch"
        if cfg.data.tokens_per_batch
        else f"{cfg.micro_batch_size * cfg.grad_accum * t.dims.dp_size} sequences per step"
    )
    start = f" (resuming at step {t.step})" if t.step else ""
    return "\n".join(
        [
            f"tformer: {m.family} model ({m.flavour}, {m.num_layers} layers, d_model {m.d_model}), "
            f"{t.num_parameters:,} parameters, {t.dist.world_size} rank(s) on {t.device}, precision {t.precision}",
            f"layout: {layout(cfg.parallel.strategy, t.dims, cfg.parallel.sp, t.dist.world_size)}",
            f"data: {_data(cfg, t.data.objective)}; {batch}",
            f"steps: {cfg.max_steps:,}{start}",
            f"output: {t.out} (resolved config: {t.out / 'config.yaml'})",
        ]
    )


def _records(path: Path) -> list[dict]:
    """The records of a ``metrics.jsonl``; a torn last line (a kill mid-write) is left out."""
    rows = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def logged_steps(run_dir: Path) -> set[int]:
    """The steps that have a record in the run's ``metrics.jsonl``."""
    return {r["step"] for r in _records(Path(run_dir) / METRICS) if isinstance(r.get("step"), int)}


def trim_metrics(run_dir: Path, step: int) -> int:
    """At a resume from the checkpoint of ``step``: drop the records of the steps after it, which
    the run trains (and logs) again, so every step has one record. A loss spike's own record is
    kept (it is the event, not the step's training). Returns how many records were dropped."""
    path = Path(run_dir) / METRICS
    rows = _records(path)
    keep = [r for r in rows if not isinstance(r.get("step"), int) or r["step"] <= step or r.get("spike")]
    if path.is_file() and len(keep) != len(path.read_text().splitlines()):
        with atomic_write(path, durable=True) as tmp:  # a kill now leaves the old file whole
            tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
    return len(rows) - len(keep)


_started = time.monotonic()


def mark_start() -> None:
    """The moment training starts in this process: each record's ``elapsed_s`` counts from it."""
    global _started
    _started = time.monotonic()


def log_step(record: dict, metrics_file, tracker, bar) -> None:
    """A step's record (rank 0): a line of ``metrics.jsonl``, to W&B, and one line on the console
    (through the progress bar when there is one, so the bar stays at the bottom). Each row says
    when it was written: ``time`` (UTC) and ``elapsed_s`` (since training started in this process),
    so a stall shows in the records, not only in the log."""
    now = datetime.datetime.now(datetime.timezone.utc)
    record.setdefault("time", now.isoformat(timespec="milliseconds").replace("+00:00", "Z"))
    record.setdefault("elapsed_s", round(time.monotonic() - _started, 3))
    metrics_file.write(json.dumps(record) + "\n")
    metrics_file.flush()
    if tracker is not None:
        tracker.log(record)
    text = (
        f"step {record['step']:>6} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | "
        f"grad {record['grad_norm']:.3f} | {record['tokens_per_s']:,.0f} tok/s | "
        f"MFU {100 * record['mfu']:.1f}%"
    )
    if "quorum" in record:  # fault tolerance: the replica groups in this step's quorum / configured
        text += f" | quorum {record['quorum']}"
    if "val_loss" in record:
        text += f" | val {record['val_loss']:.4f} (ppl {record['val_ppl']:.1f})"
    if "slow_rank" in record:
        text += (
            f" | slowest rank {record['slow_rank']}: {record['slowest_rank_ratio']:.2f}x the median step "
            f"({record['rank_step_time_max']:.3f} s vs {record['rank_step_time_median']:.3f} s)"
        )
    if "val_bleu" in record:
        text += f" | BLEU {record['val_bleu']:.2f} chrF {record['val_chrf']:.1f} ({record['bleu_signature']})"
    if "replica_group" in record:  # fault tolerance: every group prints, each line says whose it is
        text = f"[group {record['replica_group']}] {text}"
    if bar is not None:
        bar.write(text, file=sys.stdout)
    else:
        say(text)


def say(text: str) -> None:
    """``text`` and its newline in one write: processes that share a terminal or a log file (the
    replica groups of a fault-tolerant run, each under ``python -u``, where ``print`` writes the
    text and the newline apart) then never cut into each other's lines."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()
