"""A hang watchdog: a rank that makes no step progress for ``watchdog_timeout`` seconds dumps the
Python stacks of all its threads, names the ranks that stopped, and leaves the job non-zero.

A rank stuck in a collective (a peer that died or froze, a dead NIC, a deadlocked data worker)
otherwise holds the whole job until the cluster's time limit. With the watchdog the job fails
within the timeout, so torchrun's ``--max-restarts`` or a SLURM requeue resumes it from the last
checkpoint.

Every rank keeps a heartbeat file ``OUTPUT/watchdog/heartbeat_rank{R}.json`` (written by a
background thread about once a second: the step and phase of the last progress, and when). A
rank whose file is no longer written is *not responding* (stopped, killed, or frozen with the
interpreter lock held); a rank whose file is fresh but whose progress is old is *waiting* (for
example in a collective for the rank that is not responding). The report names both, and each
rank's stacks land in ``OUTPUT/watchdog/stacks_rank{R}.txt``.

With the watchdog on, torch's flight recorders are turned on too (``TORCH_FR_BUFFER_SIZE``, before
the process group starts): ring buffers of the collectives each rank entered, NCCL's (its own
recorder) and, in torch 2.13, gloo's (the generic one). On a hang each rank dumps both
(``flight_rank{R}.json`` with their entries, and the pickles that ``torchfrtrace`` reads:
``flight_rank{R}.pkl`` for NCCL, ``flight_rank{R}_cpu.pkl`` for gloo); the report names, per process group, the collective
(name, sizes, sequence number) the furthest rank entered and the ranks that never joined it.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from ...files import atomic_write

log = logging.getLogger("tformer.train")

EXIT_CODE = 75  # a job that hung: torchrun restarts it, SLURM scripts requeue on non-zero
FLIGHT_ENTRIES = "2000"  # collectives kept per rank (torch's ring buffer; the last ones are what a hang needs)


def enable_flight_recorder() -> None:
    """Before the process group starts: record its collectives (a user's own size wins). NCCL's
    recorder read ``TORCH_NCCL_TRACE_BUFFER_SIZE`` before torch named both ``TORCH_FR_BUFFER_SIZE``."""
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", FLIGHT_ENTRIES)
    os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", FLIGHT_ENTRIES)


# torch keeps two flight recorders: ProcessGroupNCCL's own (only in CUDA builds; NCCL's collectives
# go there and nowhere else) and the generic one (gloo's). (JSON dump, pickle dump, pickle file.)
RECORDERS = (
    ("_dump_nccl_trace_json", "_dump_nccl_trace", "flight_rank{rank}.pkl"),
    ("_dump_fr_trace_json", "_dump_fr_trace", "flight_rank{rank}_cpu.pkl"),
)


def dump_flight_recorder(directory: Path, rank: int) -> dict | None:
    """This rank's flight recorders, written beside its stacks: each one's pickle (what
    ``torchfrtrace`` reads) and one JSON of their entries together, finished ones included (a rank
    that never joined a collective is told apart by the ones it finished). None where this torch
    records nothing."""
    from torch._C import _distributed_c10d as c10d

    merged: dict | None = None
    for json_dump, pickle_dump, pickle_file in RECORDERS:
        if not hasattr(c10d, json_dump):
            continue
        try:
            data = json.loads(getattr(c10d, json_dump)(True, False))  # (collectives, only the active ones)
        except Exception:  # noqa: BLE001 - a recorder that is off or has no process group
            continue
        if data.get("entries"):
            with contextlib.suppress(Exception):  # (collectives, stack traces, only active)
                (directory / pickle_file.format(rank=rank)).write_bytes(getattr(c10d, pickle_dump)(True, True, False))
        if merged is None:
            merged = data
        else:
            merged["entries"] = list(merged.get("entries") or []) + list(data.get("entries") or [])
    if merged is not None:
        (directory / f"flight_rank{rank}.json").write_text(json.dumps(merged))
    return merged


def stuck_collectives(dumps: dict[int, dict | None], world_size: int) -> str:
    """Per process group: the collective the furthest rank last entered and the ranks that never
    joined it (their own last one named), from the ranks' flight-recorder dumps."""
    if not any(d and d.get("entries") for d in dumps.values()):
        return "the flight recorder holds no collectives (this torch does not record this backend): no collective named"
    last: dict[str, dict[int, dict]] = {}  # process group -> rank -> its last entry
    for r, d in dumps.items():
        for e in (d or {}).get("entries", []):
            if e.get("is_p2p"):
                continue
            pg = "/".join(map(str, e.get("process_group", ["?"])))
            seen = last.setdefault(pg, {}).get(r)
            if seen is None or e["collective_seq_id"] > seen["collective_seq_id"]:
                last[pg][r] = e
    missing = sorted(set(range(world_size)) - {r for r, d in dumps.items() if d is not None})
    parts = []
    for pg, ranks in sorted(last.items()):
        top = max(ranks.values(), key=lambda e: e["collective_seq_id"])
        behind = {r: e for r, e in ranks.items() if e["collective_seq_id"] < top["collective_seq_id"]}
        if not behind:
            continue
        joined = sorted(r for r in ranks if r not in behind)
        never = "; ".join(
            f"rank {r} never joined it (its last: {e['profiling_name']} #{e['collective_seq_id']})"
            for r, e in sorted(behind.items())
        )
        parts.append(
            f"process group {pg}: rank(s) {joined} entered {top['profiling_name']} #{top['collective_seq_id']} "
            f"(sizes {top.get('input_sizes')}), {never}"
        )
    if missing:
        parts.append(f"no flight-recorder dump from rank(s) {missing} (not responding)")
    return "; ".join(parts) or "every rank entered the same collectives (the hang is outside them)"


class Watchdog:
    def __init__(self, directory: Path, rank: int, world_size: int, timeout: float, interval: float = 1.0):
        self.dir = Path(directory)
        self.rank, self.world_size, self.timeout, self.interval = rank, world_size, timeout, interval
        self.dir.mkdir(parents=True, exist_ok=True)
        self._step, self._phase, self._progress = 0, "start-up", time.time()
        self._armed = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tformer-watchdog", daemon=True)

    def start(self) -> "Watchdog":
        self._write_heartbeat()
        self._thread.start()
        return self

    def beat(self, step: int, phase: str) -> None:
        """Progress: called by the training loop at each phase (cheap: no I/O)."""
        self._step, self._phase, self._progress = step, phase, time.time()

    def arm(self) -> None:
        """Start judging progress (after the first step: start-up, compilation and the first
        collectives may legitimately take long)."""
        self._progress = time.time()
        self._armed = True

    def disarm(self) -> None:
        self._armed = False

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    # -- the thread ---------------------------------------------------------------------------
    def _write_heartbeat(self) -> None:
        record = {
            "rank": self.rank,
            "pid": os.getpid(),
            "step": self._step,
            "phase": self._phase,
            "progress": self._progress,
            "written": time.time(),
        }
        path = self.dir / f"heartbeat_rank{self.rank}.json"
        with atomic_write(path) as tmp:
            tmp.write_text(json.dumps(record))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._write_heartbeat()
            except OSError:
                pass  # a full or vanished disk must not kill training; the timeout still applies
            if self._armed and time.time() - self._progress > self.timeout:
                self._fire()

    def _fire(self) -> None:
        stacks = self.dir / f"stacks_rank{self.rank}.txt"
        with open(stacks, "w") as f:
            f.write(
                f"rank {self.rank} (pid {os.getpid()}): no progress for "
                f"{time.time() - self._progress:.0f} s, last at step {self._step} ({self._phase})\n"
            )
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        mine = dump_flight_recorder(self.dir, self.rank)
        report = self.report()
        if mine is not None:
            report += "; collectives: " + stuck_collectives(self._peer_dumps(mine), self.world_size)
        try:
            (self.dir / f"report_rank{self.rank}.txt").write_text(report + "\n")
        except OSError:
            pass
        log.error("%s; stacks in %s", report, self.dir)
        for handler in logging.getLogger().handlers + log.handlers:
            handler.flush()
        os._exit(EXIT_CODE)

    def _peer_dumps(self, mine: dict) -> dict[int, dict | None]:
        """The other ranks' dumps (their watchdogs fire within about an interval of this one's;
        one that is not responding writes none): waited for a few intervals, then read."""
        dumps: dict[int, dict | None] = {self.rank: mine}
        deadline = time.time() + max(3 * self.interval, 3.0)
        while True:
            for r in range(self.world_size):
                if dumps.get(r) is None:
                    try:
                        dumps[r] = json.loads((self.dir / f"flight_rank{r}.json").read_text())
                    except (OSError, ValueError):
                        dumps[r] = None
            if all(d is not None for d in dumps.values()) or time.time() > deadline:
                return dumps
            time.sleep(0.2)

    def report(self) -> str:
        """One line: this rank's view of which ranks stopped where."""
        now = time.time()
        stale, waiting = [], []
        for r in range(self.world_size):
            try:
                hb: dict[str, Any] = (
                    json.loads((self.dir / f"heartbeat_rank{r}.json").read_text())
                    if r != self.rank
                    else {"step": self._step, "phase": self._phase, "progress": self._progress, "written": now}
                )
            except (OSError, ValueError):
                stale.append(f"rank {r} (no heartbeat)")
                continue
            where = f"step {hb['step']} ({hb['phase']})"
            if r != self.rank and now - hb["written"] > max(5 * self.interval, 3.0):
                stale.append(f"rank {r} not responding for {now - hb['written']:.0f} s, last at {where}")
            elif now - hb["progress"] > self.timeout or r == self.rank:
                waiting.append(f"rank {r} waiting {now - hb['progress']:.0f} s at {where}")
        stuck = "; ".join(stale) if stale else "no rank stopped responding (all wait: a collective or data hang)"
        return (
            f"watchdog: no step progress for {self.timeout:g} s (watchdog_timeout) on rank {self.rank}; "
            f"stuck: {stuck}; {'; '.join(waiting)}"
        )
