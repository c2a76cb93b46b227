"""Fault tolerance across replica groups with torchft (``fault_tolerance`` in the run config;
docs/fault-tolerance.md).

Each replica group is one torchrun job with its own process group (DDP, or FSDP2 / TP / CP inside
it, as ``parallel.*`` says). Between the groups the gradients go through torchft's ``Manager``: every
step starts with a quorum at the lighthouse (which groups are alive), the gradients of the group are
averaged over the participating groups with ``Manager.allreduce`` (on the local shards: every group
has the same layout, so shard i of one group meets shard i of the others, which is what FSDP2's
all-reduce hook does in torchtitan), and the optimizer steps only when ``Manager.should_commit``
says every participant got there without an error. A step that is not committed changes nothing:
the gradients are dropped and the trainer redraws the same samples for the next try.

A group that (re)starts behind the others is healed from a live peer by torchft's checkpoint
transport (HTTP): weights, optimizer moments, LR schedule, step, data position. The quorum is
taken synchronously (``use_async_quorum=False``), so the heal lands before the step's forward and
the healed group trains on the step's own samples.

The data-parallel rank and size span every group (``DistInfo.replica``): the sampler hands sample
``g`` of a step to global data-parallel rank ``g mod (replicas x group ranks)``. When a group is
missing from a quorum its share of that step is skipped (not redistributed, never repeated) and
counted in ``ft_samples_skipped``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import socket
import threading
import time
from datetime import timedelta
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlparse

import torch

from ...config import ConfigError
from .ft_state import _local_tensors as _local_tensors  # tests/ft_worker.py reads it here
from .ft_state import _optimizer_like, _shard_like, grads_of, model_fragments

log = logging.getLogger("tformer.train")

INSTALL = "pip install 'tformer[ft]' (torchft==0.2.0)"

# How often a group asks again for a quorum while the lighthouse is unreachable (torchft's Manager
# retries the quorum, reconnecting, every quorum_timeout / (retries + 1)).
QUORUM_RETRY_S = 1.0


class QuorumLost(RuntimeError):
    """No quorum within ``fault_tolerance.quorum_timeout_s`` (the lighthouse gone, too few groups):
    the group stops, after writing a checkpoint of its last committed step when it is the writer."""


def lighthouse_address(ft_cfg: Any) -> str:
    addr = ft_cfg.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE", "")
    if not addr:
        raise ConfigError(
            "fault_tolerance.enabled=true needs the lighthouse's address: set fault_tolerance.lighthouse="
            "http://HOST:PORT or TORCHFT_LIGHTHOUSE (start it with torchft_lighthouse --min_replicas N)"
        )
    return addr if "://" in addr else f"http://{addr}"


def check_fault_tolerance(cfg: Any, device: torch.device) -> None:
    """Refuse, before any work, what fault tolerance cannot run with (one line each)."""
    ft = cfg.fault_tolerance
    if not ft.enabled:
        return
    if cfg.parallel.strategy == "deepspeed":
        raise ConfigError(
            "fault_tolerance.enabled=true does not compose with parallel.strategy=deepspeed (its engine owns the "
            "gradient reduction and the optimizer step); use parallel.strategy=ddp or fsdp"
        )
    p = cfg.parallel
    if p.pp != 1:  # (pp >= 1)
        raise ConfigError(
            f"fault_tolerance.enabled=true does not compose with parallel.pp={p.pp} (torchft heals whole "
            "replicas, the pipeline's schedule steps the stages itself); use parallel.pp=1"
        )
    if p.dp_replicate != 1:  # (dp_replicate >= 1)
        raise ConfigError(
            f"fault_tolerance.enabled=true makes the replica dimension torchft's; set parallel.dp_replicate=1 "
            f"(not {p.dp_replicate}) and run fault_tolerance.replicas groups instead"
        )
    if cfg.on_spike == "rollback":
        raise ConfigError(
            "on_spike=rollback reloads a checkpoint from disk in one group only, which would leave the groups "
            "apart; use on_spike=warn or none with fault_tolerance.enabled=true"
        )
    moe = cfg.model.moe
    if ft.semi_sync != "none" and moe.score_bias and moe.bias_update_rate > 0:
        raise ConfigError(
            f"fault_tolerance.semi_sync={ft.semi_sync} averages parameters only: the groups' loss-free MoE "
            "biases (a buffer) would drift apart; use semi_sync=none or model.moe.bias_update_rate=0"
        )
    if ft.fragments != 1 and ft.semi_sync != "diloco":
        raise ConfigError(
            f"fault_tolerance.fragments={ft.fragments} streams DiLoCo's synchronisation; it needs "
            f"fault_tolerance.semi_sync=diloco (not {ft.semi_sync}), or set fragments=1"
        )
    if ft.backend == "nccl" and device.type != "cuda":
        raise ConfigError("fault_tolerance.backend=nccl needs CUDA GPUs; use fault_tolerance.backend=gloo on CPU")
    os.environ.setdefault("RUST_LOG", "warn")  # before torchft's Rust core starts its logger
    try:
        import torchft  # noqa: F401
    except ImportError:
        raise ConfigError(f"fault_tolerance.enabled=true needs torchft, which is not installed: {INSTALL}") from None
    lighthouse_address(ft)


def lighthouse_endpoint(addr: str) -> tuple[str, int]:
    """The lighthouse's (host, port) from its address (torchft's default port when it names none)."""
    url = urlparse(addr)
    return url.hostname or "localhost", url.port or 29510


def wait_for_lighthouse(addr: str, timeout_s: float) -> None:
    """Connect to the lighthouse within ``timeout_s`` (it may still be starting), else one line."""
    host, port = lighthouse_endpoint(addr)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=min(2.0, timeout_s)):
                return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise ConfigError(
                    f"the torchft lighthouse at {addr} is unreachable after fault_tolerance.timeout_s={timeout_s:g} s "
                    f"({e.strerror or e}); start it (torchft_lighthouse --min_replicas N --bind [::]:{port}) or fix "
                    "fault_tolerance.lighthouse / TORCHFT_LIGHTHOUSE"
                ) from None
            time.sleep(0.2)


def configuration_id(quorum: Any) -> int:
    """A process-group configuration's id, the same on every member of ``quorum`` (it is made of
    what the lighthouse sent them all: its quorum id, the members, the step) and new whenever one
    of those is: the store prefix of the configuration's rendezvous is built from it."""
    text = f"{quorum.quorum_id}|{','.join(quorum.replica_ids)}|{quorum.max_step}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "big") + 1


class QuorumEpochs:
    """torchft's ``ManagerClient`` with its quorum ids made safe against a restarted lighthouse.

    torchft 0.2.0's ``Manager`` reconfigures its cross-group process group only when the quorum id
    changes, and a lighthouse numbers its quorums from 1 again when it restarts. Measured (two
    groups, the lighthouse killed at step 21): the fresh lighthouse gave group 0 a quorum alone as
    id 1 (group 0 committed step 22 alone), then both groups as id 2, which group 1 had last seen
    from the old lighthouse: group 1 kept its old process group, group 0 made a new one at the
    same store prefix (``/torchft/2/``, where the old rendezvous keys still lie), so their
    all-reduce paired nothing, group 0 stopped serving its checkpoint at its next vote while group
    1 still waited to heal ("Timed out waiting for wlock"), and no step committed anywhere for one
    ``timeout_s`` per try (minutes, with restarts).

    This client hands the Manager a configuration id instead (``configuration_id``): it changes
    when the lighthouse's id or the members change, and also when a member is behind under an
    unchanged id and members (under one lighthouse a commit failure bumps the id, so that happens
    only after a restart); every member decides the same from what the lighthouse sent them all,
    and each new configuration meets at a store prefix of its own. A fast quorum of the same
    members keeps its id and its process group, as before."""

    def __init__(self, client: Any):
        self._client = client
        self._key: tuple | None = None
        self._id = 0

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        got = self._client._quorum(*args, **kwargs)
        key = (got.quorum_id, tuple(got.replica_ids))
        behind = got.max_world_size < got.replica_world_size
        if key != self._key or behind:
            self._key, self._id = key, configuration_id(got)
        out = SimpleNamespace(**{name: getattr(got, name) for name in dir(got) if not name.startswith("_")})
        out.quorum_id = self._id
        return out

    def __getattr__(self, name: str) -> Any:  # should_commit, _checkpoint_metadata: torchft's own
        return getattr(self._client, name)


class _LighthouseWatch:
    """While a quorum takes long, asks whether the lighthouse still answers: when it does not, says
    so in one line (its address, how long the group waits), and in one more when the quorum came."""

    AFTER_S = 2.0  # a quorum normally takes milliseconds; a peer joining, up to the join timeout

    def __init__(self, addr: str, replica_id: int, step: int, timeout_s: float, speak: bool):
        self.addr, self.replica_id, self.step, self.timeout_s, self.speak = addr, replica_id, step, timeout_s, speak
        self.lost = False
        self.t0 = time.monotonic()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tformer_lighthouse_watch", daemon=True)
        self._thread.start()

    def _reachable(self) -> bool:
        try:
            with socket.create_connection(lighthouse_endpoint(self.addr), timeout=1.0):
                return True
        except OSError:
            return False

    def _run(self) -> None:
        if self._done.wait(self.AFTER_S):
            return
        while not self._done.is_set():
            if not self._reachable():
                self.lost = True
                if self.speak:
                    log.warning(
                        "replica group %d, step %d: the torchft lighthouse at %s is unreachable; no step commits "
                        "until it is back (waiting up to fault_tolerance.quorum_timeout_s=%g s)",
                        self.replica_id,
                        self.step,
                        self.addr,
                        self.timeout_s,
                    )
                return
            if self._done.wait(1.0):
                return

    def stop(self, came: bool = True) -> None:
        self._done.set()
        self._thread.join()
        if came and self.lost and self.speak:
            log.warning(
                "replica group %d, step %d: the lighthouse is back, quorum after %.1f s; going on",
                self.replica_id,
                self.step,
                time.monotonic() - self.t0,
            )


def _one_line(backend: str) -> Any:
    """A filter for torchft's Manager log: its errors as one line each, without the traceback of
    torchft's own wait (the message names the error: "got exception waiting for work ...
    Connection closed by peer"); on gloo, no warning about NCCL's flight recorder."""

    def keep(record: logging.LogRecord) -> bool:
        if backend != "nccl" and "NCCL flight recorder" in record.getMessage():
            return False
        record.exc_info, record.exc_text = None, None
        return True

    return keep


class FaultTolerance:
    """The trainer's side of torchft: one ``Manager`` per rank, the step's quorum, the cross-group
    average of the gradients (and of the step's statistics), the commit vote, and the state a
    restarted group heals from. Counts what happened for ``metrics.jsonl``."""

    def __init__(self, trainer: Any):
        # torchft logs every quorum and commit at INFO (Python and its Rust core): tformer's line per
        # step says the quorum; keep theirs for warnings unless asked otherwise
        os.environ.setdefault("RUST_LOG", "warn")
        for name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):
            logging.getLogger(name).setLevel(logging.WARNING)
        from torchft import Manager, ProcessGroupGloo

        cfg, d = trainer.cfg.fault_tolerance, trainer.dist
        self.trainer = trainer
        self.replicas, self.replica_id = cfg.replicas, cfg.replica_id
        timeout = timedelta(seconds=cfg.timeout_s)
        if cfg.backend == "nccl":
            from torchft import ProcessGroupNCCL

            pg: Any = ProcessGroupNCCL(timeout=timeout)
        else:
            pg = ProcessGroupGloo(timeout=timeout)
        store_addr, store_port = self._store()
        self.manager = Manager(
            pg=pg,
            load_state_dict=self._load,
            state_dict=self._state,
            min_replica_size=cfg.min_replicas,
            use_async_quorum=False,  # heal before the forward, so the healed group trains this step's samples
            timeout=timeout,
            quorum_timeout=timedelta(seconds=cfg.quorum_timeout_s),
            # a lighthouse that dies (and is restarted on its address) is asked again every second or
            # so until quorum_timeout_s: the groups go on when it is back
            quorum_retries=max(0, math.ceil(cfg.quorum_timeout_s / QUORUM_RETRY_S) - 1),
            connect_timeout=timeout,
            rank=d.rank,
            world_size=d.world_size,
            store_addr=store_addr,
            store_port=store_port,
            lighthouse_addr=lighthouse_address(cfg),
            replica_id=f"tformer_replica_{cfg.replica_id}",  # torchft reads the trailing digits
            init_sync=False,  # every group starts from the same seed: the same weights
        )
        # a restarted lighthouse numbers its quorums from 1 again: see QuorumEpochs
        self.manager._client = QuorumEpochs(self.manager._client)
        self._quiet(cfg.backend)
        self.semi_sync = cfg.semi_sync
        # a group resumed from disk stands at the checkpoint's step (the Manager counts commits:
        # every step, or every synchronisation under local_sgd / diloco)
        commits = trainer.step if cfg.semi_sync == "none" else trainer.step // cfg.sync_every
        self.manager.load_state_dict({"step": commits, "batches_committed": 0})
        self.bytes = 0  # bytes this rank put into cross-group all-reduces
        self._count_bytes()
        self.semi: Any = None
        if cfg.semi_sync != "none":
            self.semi = self._semi_sync(cfg, trainer).__enter__()  # hooks on the optimizer's step
        self.commits = self.uncommitted = self.failures = self.recoveries = 0
        self.recovery_s = 0.0
        self.samples_skipped = 0
        self._carry_counters(trainer.log_dir / "metrics.jsonl")
        self.writer = False  # this group was the first of its last quorum: it writes the checkpoints
        self.participants = 0
        self.committed_s = 0.0
        self.start = time.perf_counter()
        self._healed = False
        self.quorum_s = 0.0  # the last step's quorum (and heal): part of its step time

    def _quiet(self, backend: str) -> None:
        """One readable log: torchft's checkpoint server prints an access line per heal request
        (``"GET /checkpoint/230/full HTTP/1.1" 200 -``, the standard library's default), and its
        Manager warns at every reconfiguration that it cannot reset NCCL's flight recorder, which
        a gloo run has none of (both dropped; heals are said by tformer's own line), and logs a
        peer's death with a traceback of its own wait (kept as its one line)."""
        server = getattr(self.manager._checkpoint_transport, "_server", None)
        handler = getattr(server, "RequestHandlerClass", None)
        if handler is not None:
            handler.log_message = lambda *args, **kwargs: None
        logging.getLogger("torchft.manager").addFilter(_one_line(backend))

    def _carry_counters(self, path: Any) -> None:
        """A restarted group's counters go on from its own last record in ``metrics.jsonl`` (the
        counts are per replica group over the whole run, not per process): what it counted after
        its last logged step died with it (none with log_every=1)."""
        last: dict = {}
        try:
            with open(path) as f:
                lines = f.read().splitlines()
        except OSError:  # no record yet
            lines = []
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:  # a line cut short by a kill
                continue
            if isinstance(record, dict) and "ft_commits" in record:
                last = record
        if not last:
            return
        self.commits, self.uncommitted = int(last["ft_commits"]), int(last["ft_skipped_steps"])
        self.failures, self.recoveries = int(last["ft_failures"]), int(last["ft_recoveries"])
        self.recovery_s, self.samples_skipped = float(last["ft_recovery_s"]), int(last["ft_samples_skipped"])
        self.bytes = int(last.get("ft_bytes", 0))

    def _count_bytes(self) -> None:
        """Every cross-group all-reduce (tformer's, LocalSGD's, DiLoCo's) goes through
        ``Manager.allreduce``: count what it is given."""
        allreduce = self.manager.allreduce

        def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.bytes += tensor.numel() * tensor.element_size()
            return allreduce(tensor, *args, **kwargs)

        self.manager.allreduce = counted  # type: ignore[method-assign]

    def _semi_sync(self, cfg: Any, trainer: Any) -> Any:
        """torchft's LocalSGD (parameters averaged every ``sync_every`` steps) or DiLoCo (an outer
        Nesterov SGD on the averaged pseudo-gradient; with ``fragments`` > 1, streaming DiLoCo)."""
        from torchft.local_sgd import DiLoCo, LocalSGD

        if cfg.semi_sync == "local_sgd":
            return LocalSGD(self.manager, trainer.model, trainer.optimizer, cfg.sync_every)
        fragments = model_fragments(trainer.model, cfg.fragments)
        outer = [
            torch.optim.SGD(f.parameters(), lr=cfg.outer_lr, momentum=cfg.outer_momentum, nesterov=True) for f in fragments
        ]
        return DiLoCo(
            self.manager,
            fragments,
            trainer.optimizer,
            outer,
            cfg.sync_every,
            backup_device=torch.device("cpu"),
            pin_memory=False,
        )

    def _store(self) -> tuple[str, int]:
        """The group's TCPStore, where the Manager's ranks find each other: the process group's
        (torchrun's MASTER_ADDR / MASTER_PORT), or for a one-rank group, which starts no process
        group (torchrun's own store may not be shared with the workers), one of our own."""
        import torch.distributed as dist

        if dist.is_initialized():
            return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        self._own_store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        return "127.0.0.1", self._own_store.port

    # -- the state a restarted group heals from ----------------------------------------------
    # Rank r of the restarted group heals from rank r of a live one: both hold the same shards of
    # every FSDP2 / TP parameter, so only the local shards travel (a DTensor's mesh is a process
    # group of the sending job and means nothing to the receiver); they are put back into this
    # rank's own DTensors.
    def _state(self) -> dict:
        t = self.trainer
        return _local_tensors(
            {
                "model": t.model.state_dict(),
                "optimizer": t.optimizer.state_dict(),
                "scheduler": t.scheduler.state_dict(),
                "position": {"step": t.step, "consumed": t.consumed, "tokens": t.tokens},
            }
        )

    def _load(self, state: dict) -> None:
        t = self.trainer
        own = t.model.state_dict()
        t.model.load_state_dict({k: _shard_like(v, own[k]) for k, v in state["model"].items()})
        t.optimizer.load_state_dict(_optimizer_like(state["optimizer"], t.optimizer))
        t.scheduler.load_state_dict(state["scheduler"])
        p = state["position"]
        t.step, t.consumed, t.tokens = p["step"], p["consumed"], p["tokens"]
        self._healed = True

    # -- one step -----------------------------------------------------------------------------
    def take_healed(self) -> bool:
        """Under local_sgd / diloco the quorum (and a heal) comes inside the optimizer step of a
        synchronisation: True once after a heal, so the caller redraws its batches."""
        healed, self._healed = self._healed, False
        if healed:
            self.recoveries += 1
        return healed

    def start_step(self) -> bool:
        """The step's quorum (healing this group first when it is behind). True when a heal replaced
        the trainer's state: the caller redraws its batches from the new data position."""
        if self.semi is not None:  # their quorum comes at a synchronisation
            return False
        t0 = time.perf_counter()
        self.quorum_s = 0.0
        self._healed = False
        before = self.participants
        cfg = self.trainer.cfg.fault_tolerance
        where = lighthouse_address(cfg)
        watch = _LighthouseWatch(
            where, self.replica_id, self.trainer.step + 1, cfg.quorum_timeout_s, self.trainer.dist.is_main
        )
        try:
            self.manager.start_quorum()
        except Exception as e:  # noqa: BLE001 - torchft raises plain RuntimeErrors (timeouts, lost lighthouse)
            watch.stop(came=False)
            gone = " (the lighthouse is unreachable)" if watch.lost else ""
            raise QuorumLost(
                f"replica group {self.replica_id}: no torchft quorum at {where}{gone} within fault_tolerance."
                f"quorum_timeout_s={cfg.quorum_timeout_s:g} s, stopped after step {self.trainer.step} "
                f"({e.__class__.__name__}: {str(e).splitlines()[0][:200] if str(e) else 'timed out'}); restart the "
                "lighthouse (torchft_lighthouse) and the group, which heals from a live peer or resumes from the "
                "newest checkpoint"
            ) from None
        watch.stop()
        self.participants = self.manager.num_participants()
        self.writer = self.manager.participating_rank() == 0
        if before and self.participants < before:
            self.failures += before - self.participants
        if self._healed:
            self.recoveries += 1
            self.recovery_s += time.perf_counter() - t0
            if self.trainer.dist.is_main:
                log.warning(
                    "replica group %d healed from a live peer at step %d (%.1f s)",
                    self.replica_id,
                    self.trainer.step,
                    time.perf_counter() - t0,
                )
        self.quorum_s = time.perf_counter() - t0
        healed, self._healed = self._healed, False
        return healed

    def sync(
        self, model: torch.nn.Module, stats: torch.Tensor, counts: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, bool]:
        """The gradients and the step's statistics averaged over the participating groups (one
        all-reduce of one flat buffer), then the commit vote. Returns the statistics summed over the
        groups (the loss, averaged: the caller divides by the ranks of one group) and the verdict.
        ``counts`` (the MoE expert loads) ride in the same buffer and come back summed, in place:
        every group then moves the loss-free bias alike."""
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        if self.semi is not None:  # each group steps on its own; LocalSGD / DiLoCo synchronise
            self.participants = self.manager.num_participants()
            self.commits += 1
            return stats, True
        grads = grads_of(model)
        dtype = grads[0].dtype if grads else stats.dtype
        extra = [stats.to(dtype)] + ([counts.to(dtype)] if counts is not None else [])
        flat = _flatten_dense_tensors([*grads, *extra])
        self.manager.allreduce(flat).wait()
        pieces = _unflatten_dense_tensors(flat, [*grads, *extra])
        for g, new in zip(grads, pieces[: len(grads)]):
            g.copy_(new)
        n = max(self.participants, 1)
        if counts is not None:  # averaged by the all-reduce: whole counts again (exact below 2^24)
            counts.copy_(torch.round(pieces[-1].to(counts.dtype) * n))
        stats = pieces[len(grads)].to(stats.dtype)
        # the loss stays the mean over the groups; counts (tokens, signals, FLOPs) are sums
        summed = torch.cat([stats[:1], stats[1:] * n])
        committed = self.manager.should_commit()
        if committed:
            self.commits += 1
            missing = self.replicas - n
            t = self.trainer
            self.samples_skipped += missing * t.cfg.micro_batch_size * t.cfg.grad_accum * t.dist.group_dp_size
        else:
            self.uncommitted += 1
        return summed, committed

    def note_committed_time(self, seconds: float) -> None:
        self.committed_s += seconds

    def writes_checkpoints(self) -> bool:
        """One participating group writes the run's checkpoints: the first of the last quorum (also
        after a lost quorum, for the checkpoint of the last committed step)."""
        if self.semi is not None:  # their quorum comes at a synchronisation, not in start_step
            return self.manager.participating_rank() == 0
        return self.writer

    def record(self) -> dict:
        wall = time.perf_counter() - self.start
        return {
            "replica_group": self.replica_id,
            "quorum": f"{self.participants}/{self.replicas}",
            "ft_commits": self.commits,
            "ft_skipped_steps": self.uncommitted,
            "ft_failures": self.failures,
            "ft_recoveries": self.recoveries,
            "ft_recovery_s": self.recovery_s,
            "ft_samples_skipped": self.samples_skipped,
            "goodput": self.committed_s / wall if wall > 0 else 0.0,
            "ft_bytes": self.bytes,
        }

    def shutdown(self) -> None:
        if self.semi is not None:
            self.semi.__exit__(None, None, None)
        self.manager.shutdown(wait=False)
