"""Muon's orthogonalisation: torch's Newton-Schulz iteration, and over a layout every matrix whole
on exactly one owner rank.

A DTensor matrix sharded over its mesh (FSDP2's ``Shard(0)``, TP's ``Shard(0)`` / ``Shard(1)``,
FSDP2 over TP's strided shards, on meshes of any dimension; 3-D expert stacks likewise) is
orthogonalised in batches of equal-shaped matrices of one layout: the batch's shards are stacked into
a DTensor ``(B, m, k)`` sharded as the matrices are, one ``redistribute`` to ``Shard(0)`` on every
mesh dimension hands each rank its slots of the stack whole (an all-to-all: each rank sends each
owner its shards of that owner's matrices), the owner runs Newton-Schulz, and the reverse
``redistribute`` sends every rank its shards of the results. ``owner_plan`` places each batch's
matrices in the slots of the least-loaded ranks (in Newton-Schulz FLOPs, over all batches of the
step), so the work is balanced however many matrices of a shape there are; the empty slots are zero
padding their owner does not orthogonalise. FSDP2's strided shard over TP (``_StridedShard``: rank
(i, j) holds block ``j a + i`` of a dimension TP cut first) is declared as plain shards of the
matrix with its blocks permuted; the owner puts the blocks back in order before Newton-Schulz and
permutes the result again, so it is bitwise the whole matrix's.

Plain tensors (one process, DDP: every rank holds the same reduced gradient) and DTensors whose
matrices are whole on each rank (replicated, or EP's expert stacks sharded on the expert dimension
only) are orthogonalised where they are. A layout the owners do not take (a partial sum, uneven
strided blocks) is gathered whole on every rank (``full_tensor``) and cut back.
"""

from __future__ import annotations

import math
from typing import NamedTuple, cast

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, EPS, _zeropower_via_newtonschulz

NS_COEFFICIENTS = (DEFAULT_A, DEFAULT_B, DEFAULT_C)
# equal-shaped matrices moved in one redistribute each way, up to this many bytes of shards: fewer,
# larger collectives (gpt2-tiny on 2 ranks: 3 exchanges a step instead of 12)
BATCH_BYTES = 2**28


def newton_schulz(g: torch.Tensor, steps: int, dtype: torch.dtype, eps: float = EPS) -> torch.Tensor:
    """torch's quintic Newton-Schulz iteration on one matrix, in ``dtype``: bf16 is torch's own
    function (``torch.optim._muon._zeropower_via_newtonschulz``); another dtype runs
    ``iterate``, its arithmetic step for step (bf16 matmuls are a scalar fallback on CPUs without
    AVX512-BF16/AMX, 30-100x slower than fp32)."""
    if dtype == torch.bfloat16:
        return _zeropower_via_newtonschulz(g, NS_COEFFICIENTS, steps, eps)
    return iterate(g, steps, dtype, eps)


def iterate(g: torch.Tensor, steps: int, dtype: torch.dtype, eps: float = EPS) -> torch.Tensor:
    """torch's iteration written once more with the dtype free (in bf16 it is bitwise torch's:
    ``tests/test_muon.py``): the wide orientation, normalised by the Frobenius norm, then ``steps``
    times ``X = a X + (b A + c A^2) X`` with ``A = X X^T``."""
    a, b, c = NS_COEFFICIENTS
    x = g.to(dtype)
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def orthogonalise_local(u: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """A whole matrix, or a stack of whole matrices (one per expert, orthogonalised one by one),
    in ``u``'s dtype."""
    if u.dim() == 2:
        return newton_schulz(u, steps, dtype).to(u.dtype)
    return torch.stack([newton_schulz(e, steps, dtype) for e in u.unbind(0)]).to(u.dtype)


def newton_schulz_flops(shape: tuple[int, ...], steps: int = 5) -> float:
    """FLOPs of Newton-Schulz on one matrix (m, n), or a stack: per step a Gram matrix
    ``(s, l) @ (l, s)``, its square, and the product with ``X``: ``~3 * 2 * m * n * min(m, n)``."""
    *stack, m, n = shape
    s, big = min(m, n), max(m, n)
    per_step = 2 * s * s * big + 2 * s * s * s + 2 * s * s * big
    return float(math.prod(stack)) * steps * per_step


def orthogonalise(
    params: list[torch.Tensor], updates: list[torch.Tensor], steps: int, dtype: torch.dtype
) -> list[torch.Tensor]:
    """Newton-Schulz of each parameter's whole update, as this rank's part of it (``updates[i]``:
    this rank's local part of parameter ``i``'s update; the result has the same shape)."""
    out: list[torch.Tensor | None] = [None] * len(params)
    plan = owner_plan(params, [u.element_size() for u in updates])
    for i in plan.here:
        out[i] = orthogonalise_local(updates[i], steps, dtype)
    for i in plan.everywhere:
        out[i] = _gathered_everywhere(cast(DTensor, params[i]), updates[i], steps, dtype)
    for batch in plan.batches:
        like = cast(DTensor, params[batch.members[0]])
        got = owner_orthogonalise(like, [updates[i] for i in batch.members], steps, dtype, batch.slots, batch.per)
        for i, o in zip(batch.members, got):
            out[i] = o
    return out  # type: ignore[return-value]


class Batch(NamedTuple):
    """Equal-shaped matrices of one layout moved in one exchange: ``members`` (indices into the
    parameters) go to stack slots ``slots``; rank r owns slots ``r * per`` to ``(r + 1) * per - 1``
    of the ``per * n`` slots (the rest are zero padding)."""

    members: list[int]
    slots: list[int]
    per: int


class OwnerPlan(NamedTuple):
    """Where each parameter's update is orthogonalised: ``here`` (whole on this rank already),
    ``batches`` (gathered to owner ranks), ``everywhere`` (gathered whole on every rank: a layout
    the owners do not take); ``flops[r]``: the Newton-Schulz FLOPs owner rank r runs for ``batches``
    (rank = the row-major index on the batch's mesh)."""

    here: list[int]
    batches: list[Batch]
    everywhere: list[int]
    flops: dict[DeviceMesh, list[float]]  # per owner of each mesh


def owner_plan(params: list[torch.Tensor], element_sizes: list[int]) -> OwnerPlan:
    """The same plan on every rank (it reads only shapes and layouts, in the parameters' order):
    equal-shaped sharded matrices batched, each batch's matrices handed to the least-loaded owners
    of its mesh (the most expensive shapes first, the loads counted in Newton-Schulz FLOPs), so the
    owners' work is balanced across batches too (a batch of 2 on 4 ranks gives its 2 matrices to
    the 2 ranks with the least work so far, not always to ranks 0 and 1)."""
    here, everywhere = [], []
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        if not isinstance(p, DTensor) or whole_here(p):
            here.append(i)
        elif claimed_layout(p) is not None:
            key = (tuple(p.shape), p.device_mesh, tuple(map(str, p.placements)), element_sizes[i])
            groups.setdefault(key, []).append(i)
        else:
            everywhere.append(i)
    loads: dict[DeviceMesh, list[float]] = {}
    batches = []
    for members in sorted(groups.values(), key=lambda m: -newton_schulz_flops(tuple(params[m[0]].shape))):
        like = cast(DTensor, params[members[0]])
        n = like.device_mesh.size()
        cost = newton_schulz_flops(tuple(like.shape))
        per_batch = n * max(1, BATCH_BYTES // (n * like.numel() * element_sizes[members[0]]))  # a multiple of n
        load = loads.setdefault(like.device_mesh, [0.0] * n)
        for start in range(0, len(members), per_batch):
            chunk = members[start : start + per_batch]
            slots, per = owner_slots(len(chunk), load, cost)
            batches.append(Batch(chunk, slots, per))
    return OwnerPlan(here, batches, everywhere, loads)


def owner_slots(count: int, loads: list[float], cost: float) -> tuple[list[int], int]:
    """Slots for ``count`` matrices of ``cost`` FLOPs each over ``n = len(loads)`` owners of
    ``per = ceil(count / n)`` slots each: the ``count - (per - 1) n`` least-loaded ranks take
    ``per`` matrices, the others ``per - 1`` (ties to the lower rank); ``loads`` updated."""
    n = len(loads)
    per = -(-count // n)
    full = count - (per - 1) * n
    order = sorted(range(n), key=lambda r: (loads[r], r))
    takes = {r: per if k < full else per - 1 for k, r in enumerate(order)}
    slots = []
    for r in range(n):
        slots += [r * per + j for j in range(takes[r])]
        loads[r] += takes[r] * cost
    return slots, per


def whole_here(p: DTensor) -> bool:
    """Whether each rank's shard of ``p`` holds whole matrices: nothing split inside a matrix (the
    last two dimensions)."""
    return all(not isinstance(pl, (Shard, _StridedShard)) or pl.dim % p.dim() < p.dim() - 2 for pl in p.placements)


class Claimed(NamedTuple):
    """A layout the owners take: ``placements`` (plain ``Shard`` / ``Replicate``) under which each
    rank's shard is a shard of the matrix with its blocks permuted along ``swaps``' dimensions:
    ``(dim, a, b)`` for FSDP2's strided shard over TP's (torch's ``_StridedShard``: the dimension
    cut in ``b`` parts by TP first, each cut in ``a`` by FSDP2), whose rank (i, j) holds block
    ``j a + i`` where the plain placements say ``i b + j``."""

    placements: tuple
    swaps: tuple[tuple[int, int, int], ...]


def claimed_layout(p: DTensor) -> Claimed | None:
    """``p``'s layout as plain placements and block swaps; None for a layout the owners do not take
    (a partial sum, a strided shard not followed by the shard it strides over, or uneven blocks)."""
    mesh, placements, swaps = p.device_mesh, list(p.placements), []
    for a, pl in enumerate(p.placements):
        if isinstance(pl, (Shard, Replicate)):
            continue
        if not isinstance(pl, _StridedShard):
            return None
        later = [b for b, q in enumerate(p.placements) if b > a and type(q) is Shard and q.dim == pl.dim]
        if len(later) != 1 or pl.split_factor != mesh.size(later[0]):
            return None
        d = pl.dim % p.dim()
        if p.shape[d] % (mesh.size(a) * mesh.size(later[0])):
            return None
        placements[a] = Shard(pl.dim)
        swaps.append((d, mesh.size(a), mesh.size(later[0])))
    return Claimed(tuple(placements), tuple(swaps))


def _swap_blocks(x: torch.Tensor, swaps, back: bool) -> torch.Tensor:
    """A whole matrix (or stack) as the plain placements gathered it -> its true layout (``back``:
    the reverse); ``x`` has the parameter's shape."""
    for d, a, b in swaps:
        first, second = (b, a) if back else (a, b)
        x = x.unflatten(d, (first, second, -1)).transpose(d, d + 1).flatten(d, d + 2)
    return x


def owner_orthogonalise(
    like: DTensor,
    locals_: list[torch.Tensor],
    steps: int,
    dtype: torch.dtype,
    slots: list[int] | None = None,
    per: int | None = None,
) -> list[torch.Tensor]:
    """Matrices laid out as ``like``, given by this rank's shards, each orthogonalised whole on its
    owner (``slots[i]``: matrix i's slot of the ``per * n`` slots; default: in order, ``per =
    ceil(count / n)``), back as this rank's shards."""
    n = like.device_mesh.size()
    if slots is None or per is None:
        slots, per = list(range(len(locals_))), -(-len(locals_) // n)
    total = per * n
    claimed = claimed_layout(like)
    assert claimed is not None, like.placements
    stack = [torch.zeros_like(locals_[0])] * total
    for i, s in zip(range(len(locals_)), slots):
        stack[s] = locals_[i]
    stacked, shape = gather_to_owners(like, stack, claimed.placements)
    per, first = stacked.shape[0], owner_index(like.device_mesh) * stacked.shape[0]
    used = set(slots)
    result = torch.stack(
        [
            _swap_blocks(orthogonalise_local(_swap_blocks(m, claimed.swaps, False), steps, dtype), claimed.swaps, True)
            if first + j in used
            else torch.zeros_like(m)
            for j, m in enumerate(stacked)
        ]
    )
    assert result.shape[0] == per
    back = scatter_from_owners(like, result, shape)
    return [back[s] for s in slots]


def _stacked_placements(placements) -> list:
    return [Shard(pl.dim + 1) if isinstance(pl, Shard) else pl for pl in placements]


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))


def gather_to_owners(like: DTensor, stack: list[torch.Tensor], placements) -> tuple[torch.Tensor, tuple[int, ...]]:
    """The stack of the batch's shards (a multiple of ``mesh.size()``, padding included) under
    ``placements`` (``claimed_layout``'s), redistributed so that this rank holds its own matrices
    whole: ``((per, m, k), stack shape)``."""
    mesh = like.device_mesh
    shape = (len(stack), *like.shape)
    stacked = DTensor.from_local(
        torch.stack(stack),
        mesh,
        _stacked_placements(placements),
        run_check=False,
        shape=torch.Size(shape),
        stride=_contiguous_stride(shape),
    )
    return stacked.redistribute(mesh, [Shard(0)] * mesh.ndim).to_local(), shape


def scatter_from_owners(like: DTensor, result: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Each owner's orthogonalised matrices (``result``: (per, m, k)) back to every rank as its
    shards: ``(total, m_local, k_local)``."""
    mesh = like.device_mesh
    owned = DTensor.from_local(
        result,
        mesh,
        [Shard(0)] * mesh.ndim,
        run_check=False,
        shape=torch.Size(shape),
        stride=_contiguous_stride(shape),
    )
    return owned.redistribute(mesh, _stacked_placements(claimed_layout(like).placements)).to_local()  # type: ignore[union-attr]


def owner_index(mesh) -> int:
    """This rank's chunk of a dimension sharded over every mesh dimension in order (row-major)."""
    coord = mesh.get_coordinate()
    index = 0
    for c, size in zip(coord, mesh.shape):
        index = index * size + c
    return index


def _gathered_everywhere(p: DTensor, u: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    whole = DTensor.from_local(u, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
    ortho = orthogonalise_local(whole.full_tensor(), steps, dtype)
    return distribute_tensor(ortho, p.device_mesh, p.placements, src_data_rank=None).to_local()
