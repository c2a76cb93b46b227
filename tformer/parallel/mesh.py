"""The device mesh of a run: how its ranks split into data-parallel replicas, shard groups and
tensor-parallel groups, decided once from the world size and the ``parallel.*`` keys.

    world size = pp x dp_replicate x dp_shard x cp x tp

Ranks are laid out row-major over (pp, dp_replicate, dp_shard, cp, tp), so the ``tp`` ranks of one group
are neighbours (one node's GPUs, whose links tensor parallelism needs), a replica is a contiguous
block of ranks (one node or a few, for HSDP: shard within, all-reduce across), and pipeline stages
are the outermost split (point-to-point traffic only, the cheapest to send across nodes). Everything
that needs to know "which data does this rank see" reads ``dp_rank``/``dp_size`` here, never the
global rank: the ``tp`` ranks of a group, the ``cp`` ranks of a context-parallel group (each
holds a part of every sequence, ``parallel/context.py``) and the ``pp`` stages of a pipeline see
the same batch. FSDP2 shards parameters over ``dp_shard x cp`` together (flattened ``dp_shard_cp``):
the ``cp`` ranks hold the same parameters, as torchtitan does.

``ParallelDims`` is plain arithmetic, checked before any process group exists; ``build_mesh`` then
creates the named ``DeviceMesh`` that the strategies (FSDP2, HSDP, tensor parallel) and the
checkpointer use.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ConfigError

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int = 1
    cp: int = 1
    ep: int = 1  # expert parallelism: borrows its ranks from dp_shard x cp (no dimension of its own)

    @classmethod
    def resolve(
        cls,
        world_size: int,
        dp_replicate: int = 1,
        dp_shard: int = -1,
        tp: int = 1,
        pp: int = 1,
        cp: int = 1,
        ep: int = 1,
    ) -> ParallelDims:
        """The dims for ``world_size`` ranks; ``dp_shard=-1`` takes what pp x dp_replicate x cp x tp leave."""
        for name, value in (("dp_replicate", dp_replicate), ("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep)):
            if value < 1:
                raise ConfigError(f"parallel.{name}={value} must be >= 1")
        if dp_shard == -1:
            fixed = pp * dp_replicate * cp * tp
            if world_size % fixed:
                what = "parallel.dp_replicate x parallel.tp" + (" x parallel.pp" if pp > 1 else "")
                sizes = f"{dp_replicate} x {tp}" + (f" x {pp}" if pp > 1 else "")
                if cp > 1:
                    what, sizes = f"{what} x parallel.cp", f"{sizes} x {cp}"
                raise ConfigError(
                    f"world size {world_size} is not divisible by {what} = {sizes}; launch a "
                    f"multiple of {fixed} ranks or change them"
                )
            dp_shard = world_size // fixed
        elif dp_shard < 1:
            raise ConfigError(
                f"parallel.dp_shard={dp_shard} must be >= 1, or -1 for what the world size leaves after dp_replicate x tp"
            )
        if pp * dp_replicate * dp_shard * cp * tp != world_size:
            raise ConfigError(
                f"world size {world_size} != parallel.{'pp x ' if pp > 1 else ''}dp_replicate x dp_shard x "
                f"{'cp x ' if cp > 1 else ''}tp = {f'{pp} x ' if pp > 1 else ''}{dp_replicate} x {dp_shard} x "
                f"{f'{cp} x ' if cp > 1 else ''}{tp} = {pp * dp_replicate * dp_shard * cp * tp}; launch that many "
                "ranks or set parallel.dp_shard=-1 to use whatever is left"
            )
        check_ep(ep, dp_shard, cp)
        return cls(dp_replicate, dp_shard, tp, pp, cp, ep)

    @classmethod
    def from_config(cls, pcfg, world_size: int) -> ParallelDims:
        return cls.resolve(
            world_size, pcfg.dp_replicate, pcfg.dp_shard, pcfg.tp, pcfg.pp, getattr(pcfg, "cp", 1), getattr(pcfg, "ep", 1)
        )

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp_size(self) -> int:
        """Ranks that see different data (replicas x shard group)."""
        return self.dp_replicate * self.dp_shard

    def dp_rank(self, rank: int) -> int:
        return (rank // (self.tp * self.cp)) % self.dp_size

    def pp_rank(self, rank: int) -> int:
        return rank // (self.dp_size * self.cp * self.tp)

    def cp_rank(self, rank: int) -> int:
        return (rank // self.tp) % self.cp

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp

    def describe(self) -> str:
        return (
            f"{f'pp={self.pp} ' if self.pp > 1 else ''}dp_replicate={self.dp_replicate} "
            f"dp_shard={self.dp_shard} {f'cp={self.cp} ' if self.cp > 1 else ''}tp={self.tp}"
            f"{f' ep={self.ep}' if self.ep > 1 else ''}"
        )

    def build_mesh(self, device_type: str):
        """The named 5-D ``DeviceMesh`` (pp, dp_replicate, dp_shard, cp, tp), plus flattened ``dp``
        (replicate x shard: who sees which data) and ``dp_shard_cp`` (FSDP2's shard group), for a
        started process group."""
        from torch.distributed.device_mesh import init_device_mesh

        if self.ep > 1:
            return self._build_mesh_with_ep(device_type)
        shape = (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)
        mesh["dp_replicate", "dp_shard"]._flatten("dp")
        mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        return mesh

    def _build_mesh_with_ep(self, device_type: str):
        """With expert parallelism, as torchtitan lays it out: dp_shard splits into
        ``dp_shard_mod_ep`` x ``dp_shard_in_ep``, and ``ep`` is ``dp_shard_in_ep x cp`` flattened,
        so an expert group is a block of neighbouring ranks. Expert weights are sharded over ``ep``
        and FSDP2-sharded over ``dp_shard_mod_ep`` (what EP leaves); every other weight over
        ``dp_shard_cp`` as without EP. The names ``dp_shard``, ``dp``, ``dp_shard_cp`` exist as before."""
        from torch.distributed.device_mesh import init_device_mesh

        in_ep = self.ep // self.cp
        shape = (self.pp, self.dp_replicate, self.dp_shard // in_ep, in_ep, self.cp, self.tp)
        names = ("pp", "dp_replicate", "dp_shard_mod_ep", "dp_shard_in_ep", "cp", "tp")
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
        mesh["dp_shard_mod_ep", "dp_shard_in_ep"]._flatten("dp_shard")
        mesh["dp_replicate", "dp_shard_mod_ep", "dp_shard_in_ep"]._flatten("dp")
        mesh["dp_shard_mod_ep", "dp_shard_in_ep", "cp"]._flatten("dp_shard_cp")
        mesh["dp_shard_in_ep", "cp"]._flatten("ep")
        return mesh


def check_ep(ep: int, dp_shard: int, cp: int) -> None:
    """ep ranks are taken from dp_shard x cp: whole cp groups, and a divisor of dp_shard of them."""
    if ep == 1:
        return
    if ep % cp or dp_shard % (ep // cp):
        raise ConfigError(
            f"parallel.ep={ep} must be a multiple of parallel.cp={cp} that divides parallel.dp_shard x cp = "
            f"{dp_shard} x {cp} (expert parallelism borrows those ranks); choose ep among "
            f"{[cp * d for d in range(1, dp_shard + 1) if dp_shard % d == 0]}"
        )


def check_strategy(dims: ParallelDims, strategy: str) -> None:
    """Layouts a strategy cannot run, refused in one line before any process group exists."""
    if strategy == "deepspeed" and dims.cp > 1:
        raise ConfigError(
            f"parallel.cp={dims.cp} does not compose with parallel.strategy=deepspeed (DeepSpeed partitions "
            "over all ranks itself); use parallel.strategy=fsdp (or ddp) for context parallelism"
        )
    if strategy == "deepspeed" and (dims.tp > 1 or dims.dp_replicate > 1 or dims.pp > 1):
        raise ConfigError(
            f"parallel.strategy=deepspeed does not compose with the device mesh "
            f"({dims.describe()}): DeepSpeed partitions over all ranks itself; use "
            "parallel.strategy=fsdp for tensor or pipeline parallelism and HSDP"
        )
    if dims.dp_replicate > 1 and strategy != "fsdp":
        raise ConfigError(
            f"parallel.dp_replicate={dims.dp_replicate} (HSDP) needs parallel.strategy=fsdp, "
            f"not {strategy}; set parallel.strategy=fsdp or parallel.dp_replicate=1"
        )
    if strategy == "ddp" and dims.tp > 1 and dims.dp_size > 1:
        raise ConfigError(
            f"parallel.tp={dims.tp} with {dims.dp_size} data-parallel ranks needs "
            "parallel.strategy=fsdp (DDP does not replicate tensor-parallel parameters); "
            "set parallel.strategy=fsdp, or launch parallel.tp ranks for tensor parallelism alone"
        )
    if strategy == "ddp" and dims.pp > 1 and dims.dp_size > 1:
        raise ConfigError(
            f"parallel.pp={dims.pp} with {dims.dp_size} data-parallel ranks needs "
            "parallel.strategy=fsdp (FSDP2 per stage); set parallel.strategy=fsdp"
        )
