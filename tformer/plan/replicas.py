"""What fault tolerance's replica groups cost on top of a group's layout (``fault_tolerance`` in
the run config; docs/fault-tolerance.md): torchft's cross-group traffic and DiLoCo's extra copies.

Each of ``groups`` replica groups runs the planned layout on its own devices; rank i of a group
meets rank i of every other group (they hold the same shard: the groups have one layout). Per rank:

- ``semi_sync: none``: every step, the rank's gradients (its local shard under FSDP2 / TP, fp32:
  the trainer's gradients are of fp32 parameters) and the step's statistics go through one
  ``Manager.allreduce`` after the backward (tformer/train/resilience/ft.py ``sync``): a ring all-reduce over
  the groups, nothing to hide it behind (exposed);
- ``local_sgd`` / ``diloco``: every ``sync_every`` steps the parameters (LocalSGD) or the
  pseudo-gradients (DiLoCo) of the same size, so 1/``sync_every`` of the bytes per step; streaming
  DiLoCo (``fragments`` f) sends 1/f of them every ``sync_every / f`` steps: the same bytes per
  step, f times the latency terms;
- the link: the groups' ranks are ``group devices`` apart on the cluster, so a ring over the groups
  runs inside a node only when every group fits in one node together (``comm.link_of``), else over
  the network (the profile's ``inter_*`` figures, per device: ``--set inter_bandwidth=`` for a
  slower link between clusters, or for gloo, which moves GPU tensors through the host over TCP and
  reaches less than the NIC's rate).

DiLoCo's memory (torchft's ``DiLoCo`` as ft.py builds it): a backup of the rank's parameters at
the last synchronisation, in host memory (fp32), and the outer Nesterov SGD's momentum, one fp32
buffer per parameter on the device. LocalSGD keeps neither.

Not priced: the per-step quorum and commit vote, one round trip each to the lighthouse and the
groups (bench/bench_ft.py measures their cost), and the fault-tolerant side of a failure: the live
groups wait about the lighthouse's heartbeat timeout (launch/ft.sh: 5 s) and a step or two while
the dead group is relaunched beside them (bench_ft.py: 5-6 s on a CPU).

Priced beside it (``restart_cost``): what the same failure costs without fault tolerance, the whole
job restarted and resumed from its newest checkpoint: a relaunch (the scheduler's requeue, process
start, imports, rendezvous: ``RELAUNCH_S``, assumed), the checkpoint's reload (each rank reads its
shard: fp32 weights and AdamW's two moments at ``CHECKPOINT_READ`` bytes/s, assumed shared storage)
and the steps trained again since the last save, half of ``save_every`` on average, at the planned
step time.
"""

from __future__ import annotations

from dataclasses import dataclass

from .comm import Link, link_of, ring
from .hardware import Hardware
from .layout import Layout, Stage

GRAD_BYTES = 4  # fp32 gradients and parameters: the trainer keeps fp32 weights under mixed precision
RELAUNCH_S = 120.0  # a cluster job's requeue to its first step: scheduler, process start, imports, rendezvous
CHECKPOINT_READ = 2e9  # bytes/s one rank reads its checkpoint shard at from shared storage
CHECKPOINT_BYTES = 12  # per parameter: fp32 weights and AdamW's two fp32 moments


@dataclass(frozen=True)
class Replicas:
    """Fault tolerance's replica groups, as ``fault_tolerance`` configures them."""

    groups: int
    semi_sync: str = "none"  # none | local_sgd | diloco
    sync_every: int = 1
    fragments: int = 1

    @classmethod
    def of(cls, ft) -> Replicas | None:
        """The run config's ``fault_tolerance`` section (already checked by the config: the
        trainer's refusals), or None when it is off."""
        if not ft.enabled:
            return None
        return cls(ft.replicas, ft.semi_sync, ft.sync_every if ft.semi_sync != "none" else 1, ft.fragments)

    @property
    def name(self) -> str:
        if self.semi_sync == "none":
            return "gradients every step"
        stream = f", {self.fragments} fragments" if self.fragments > 1 else ""
        return f"{self.semi_sync} every {self.sync_every} steps{stream}"


@dataclass(frozen=True)
class ReplicaCost:
    bytes_per_step: float  # what one rank puts into cross-group all-reduces per step (ft.py's ft_bytes)
    seconds_per_step: float  # their time, exposed, amortised per step
    link: Link
    device_bytes: float  # extra on each device (DiLoCo's outer momentum)
    host_bytes: float  # extra in host memory per rank (DiLoCo's parameter backup)


def local_parameters(layout: Layout, stage: Stage) -> float:
    """Parameters one rank holds the gradients of: its stage's (TP-local), 1/(dp_shard x cp) of
    them under FSDP2 (DDP: all of them)."""
    shard = 1 if layout.strategy == "ddp" else layout.dp_shard * layout.cp
    return stage.params / shard


def replica_cost(layout: Layout, stage: Stage, hw: Hardware, rep: Replicas) -> ReplicaCost:
    """The cross-group traffic and memory of ``rep`` on top of one group's ``layout`` (module doc)."""
    whole = local_parameters(layout, stage) * GRAD_BYTES
    link = link_of(hw, layout.devices, rep.groups)
    every = rep.sync_every if rep.semi_sync != "none" else 1
    f = rep.fragments
    seconds = f * ring("all_reduce", whole / f, rep.groups, link) / every
    diloco = rep.semi_sync == "diloco"
    backup = whole if diloco else 0.0
    return ReplicaCost(whole / every if rep.groups > 1 else 0.0, seconds, link, backup, backup)


@dataclass(frozen=True)
class RestartCost:
    """One failure's price when the whole job restarts and resumes (module doc), in seconds."""

    relaunch_s: float
    reload_s: float
    retrain_steps: float  # steps since the last save, on average
    retrain_s: float

    @property
    def total_s(self) -> float:
        return self.relaunch_s + self.reload_s + self.retrain_s


def restart_cost(layout: Layout, stage: Stage, step_s: float, save_every: int) -> RestartCost | None:
    """A cluster restart per failure for one group's ``layout`` at ``step_s`` a step; None when
    ``save_every`` is 0 (no checkpoint before the end: a restart trains from step 0)."""
    if save_every <= 0:
        return None
    reload = local_parameters(layout, stage) * CHECKPOINT_BYTES / CHECKPOINT_READ
    return RestartCost(RELAUNCH_S, reload, save_every / 2, save_every / 2 * step_s)
