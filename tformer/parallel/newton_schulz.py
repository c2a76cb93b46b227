"""Muon's orthogonalisation: torch's Newton-Schulz iteration, and over a layout every matrix whole
on exactly one owner rank.

A DTensor matrix sharded over its mesh (FSDP2's ``Shard(0)``, TP's ``Shard(0)`` / ``Shard(1)``,
both on a 2-D mesh) is orthogonalised in batches of equal-shaped matrices of one layout (a multiple
of the mesh's n ranks): the batch's shards are stacked into a DTensor ``(B, m, k)`` sharded as the
matrices are, one ``redistribute`` to ``Shard(0)`` on every mesh dimension hands rank ``r`` matrices
``r B/n`` to ``(r + 1) B/n - 1`` whole (an all-to-all: each rank sends each owner its shards of that
owner's matrices), the owner runs Newton-Schulz, and the reverse ``redistribute`` sends every rank its
shards of the results. So the owners are spread evenly over the ranks and each moves one matrix's
worth of data per matrix it owns; a batch is padded with zero matrices to a multiple of n, which
their owner does not orthogonalise.

Plain tensors (one process, DDP: every rank holds the same reduced gradient) and DTensors whose
matrices are whole on each rank (replicated, or EP's expert stacks sharded on the expert dimension
only) are orthogonalised where they are. Anything else (a stack sharded inside its matrices, a
strided FSDP-over-TP shard) is gathered whole on every rank (``full_tensor``) and cut back.
"""

from __future__ import annotations

import math
from typing import cast

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
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
    batches: dict[tuple, list[int]] = {}
    for i, (p, u) in enumerate(zip(params, updates)):
        if not isinstance(p, DTensor) or whole_here(p):
            out[i] = orthogonalise_local(u, steps, dtype)
        elif p.dim() == 2 and all(type(pl) in (Shard, Replicate) for pl in p.placements):
            key = (tuple(p.shape), id(p.device_mesh), tuple(p.placements), u.dtype)
            batches.setdefault(key, []).append(i)
        else:
            out[i] = _gathered_everywhere(p, u, steps, dtype)
    for members in batches.values():
        like = cast(DTensor, params[members[0]])
        n = like.device_mesh.size()
        size = like.numel() * updates[members[0]].element_size()
        per_batch = n * max(1, BATCH_BYTES // (n * size))  # a multiple of the ranks
        for start in range(0, len(members), per_batch):
            batch = members[start : start + per_batch]
            for i, o in zip(batch, owner_orthogonalise(like, [updates[i] for i in batch], steps, dtype)):
                out[i] = o
    return out  # type: ignore[return-value]


def whole_here(p: DTensor) -> bool:
    """Whether each rank's shard of ``p`` holds whole matrices: nothing split inside a matrix (the
    last two dimensions)."""
    return all(not isinstance(pl, Shard) or pl.dim % p.dim() < p.dim() - 2 for pl in p.placements)


def owner_orthogonalise(like: DTensor, locals_: list[torch.Tensor], steps: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Matrices laid out as ``like``, given by this rank's shards, each orthogonalised whole on its
    owner (the batch padded to a multiple of the n ranks, ``per = len / n`` matrices each: rank r
    owns matrices ``r * per`` to ``(r + 1) * per - 1``), back as this rank's shards."""
    count = len(locals_)
    stacked, shape = gather_to_owners(like, locals_)
    per, first = stacked.shape[0], owner_index(like.device_mesh) * stacked.shape[0]
    result = torch.stack(
        [orthogonalise_local(m, steps, dtype) if first + j < count else torch.zeros_like(m) for j, m in enumerate(stacked)]
    )
    assert result.shape[0] == per
    return list(scatter_from_owners(like, result, shape).unbind(0)[:count])


def _stacked_placements(like: DTensor) -> list:
    return [Shard(pl.dim + 1) if isinstance(pl, Shard) else pl for pl in like.placements]


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))


def gather_to_owners(like: DTensor, locals_: list[torch.Tensor]) -> tuple[torch.Tensor, tuple[int, ...]]:
    """The stack of the batch's matrices, padded to a multiple of ``mesh.size()``, redistributed so
    that this rank holds its own matrices whole: ``((per, m, k), stack shape)``."""
    mesh = like.device_mesh
    total = -(-len(locals_) // mesh.size()) * mesh.size()
    pad = [torch.zeros_like(locals_[0])] * (total - len(locals_))
    shape = (total, *like.shape)
    stacked = DTensor.from_local(
        torch.stack([*locals_, *pad]),
        mesh,
        _stacked_placements(like),
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
    return owned.redistribute(mesh, _stacked_placements(like)).to_local()


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
