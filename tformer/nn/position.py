"""Position schemes: sinusoidal and learned absolute embeddings, rotary (RoPE), T5 relative bias."""

from __future__ import annotations

import math

import torch
from torch import nn


def sinusoidal_table(max_len: int, dim: int) -> torch.Tensor:
    """The paper's table: ``PE[pos, 2i] = sin(pos / 10000^(2i/d))``, ``PE[pos, 2i+1] = cos(...)``."""
    pos = torch.arange(max_len, dtype=torch.float64).unsqueeze(1)
    inv = torch.exp(-math.log(10000.0) * torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    table = torch.zeros(max_len, dim, dtype=torch.float64)
    table[:, 0::2] = torch.sin(pos * inv)
    table[:, 1::2] = torch.cos(pos * inv)[:, : dim // 2]
    return table.float()


class SinusoidalPositions(nn.Module):
    """Fixed sinusoidal position embeddings (no parameters)."""

    def __init__(self, max_len: int, dim: int):
        super().__init__()
        self.register_buffer("table", sinusoidal_table(max_len, dim), persistent=False)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return self.table[positions]


class LearnedPositions(nn.Embedding):
    """Learned absolute position embeddings (GPT-2, BERT)."""

    def __init__(self, max_len: int, dim: int):
        super().__init__(max_len, dim)


class Rotary(nn.Module):
    """Rotary position embedding in HF's rotate-half layout.

    The head dimension is split in two halves ``(x1, x2)`` and rotated as
    ``(x1 cos - x2 sin, x2 cos + x1 sin)`` with frequency ``theta^(-2i/d)`` for pair ``i``.
    ``forward(positions)`` returns ``(cos, sin)`` shaped to broadcast over ``(B, h, S, d)``.
    ``yarn`` (a ``YarnConfig`` that is enabled: ``model.yarn``) replaces the frequencies by YaRN's
    and scales cos and sin by its attention factor (``yarn_frequencies``). ``linear`` divides every
    frequency by it (positions interpolated linearly; Gemma 3 4B's global blocks: 8).
    """

    def __init__(self, head_dim: int, theta: float = 10000.0, yarn=None, linear: float = 1.0):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary needs an even head dimension, got {head_dim}")
        self.scale = 1.0
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        if yarn is not None and yarn.enabled:
            inv_freq, self.scale = yarn_frequencies(head_dim, theta, yarn)
        if linear != 1.0:
            inv_freq = inv_freq / linear
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: (S,) or (B, S) -> cos/sin (1 or B, 1, S, head_dim)
        pos = positions if positions.dim() == 2 else positions.unsqueeze(0)
        angles = pos.float().unsqueeze(-1) * self.inv_freq  # (B, S, d/2)
        angles = torch.cat((angles, angles), dim=-1).unsqueeze(1)
        if self.scale != 1.0:
            return angles.cos() * self.scale, angles.sin() * self.scale
        return angles.cos(), angles.sin()


# -- YaRN (Peng et al. 2023), as HF configures it for DeepSeek-V3 and gpt-oss (``model.yarn``).


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(factor) + 1`` (1 when not extending)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_frequencies(dim: int, theta: float, yarn) -> tuple[torch.Tensor, float]:
    """(inverse frequencies (dim/2,), cos/sin scale). Pair ``i`` keeps its frequency where it turns
    more than ``beta_fast`` times over ``original_max_seq_len`` positions, is divided by ``factor``
    where it turns fewer than ``beta_slow`` times, and is blended linearly between (the band's
    ends rounded outwards to whole pairs when ``truncate``, as HF's). The scale is ``mscale``'s correction over
    ``mscale_all_dim``'s when both are set, else the plain one."""
    base = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolated, interpolated = 1.0 / base, 1.0 / (yarn.factor * base)

    def dim_of(rotations: float) -> float:  # the pair index that turns ``rotations`` times
        return dim * math.log(yarn.original_max_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(yarn.beta_fast), dim_of(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    span = (high - low) or 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / span).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (high frequencies), 0: interpolate
    inv_freq = interpolated * (1 - keep) + extrapolated * keep
    if yarn.mscale and yarn.mscale_all_dim:
        scale = yarn_mscale(yarn.factor, yarn.mscale) / yarn_mscale(yarn.factor, yarn.mscale_all_dim)
    else:
        scale = yarn_mscale(yarn.factor)
    return inv_freq, float(scale)


def yarn_softmax_scale(yarn) -> float:
    """The factor on MLA's softmax scale: ``yarn_mscale(factor, mscale_all_dim)**2`` (1 when off)."""
    if not yarn.enabled or not yarn.mscale_all_dim:
        return 1.0
    return yarn_mscale(yarn.factor, yarn.mscale_all_dim) ** 2


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape (B, h, S, d) by the angles of its positions."""
    return (x * cos.to(x.dtype)) + (rotate_half(x) * sin.to(x.dtype))


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the interleaved pairs ``(x0, x1), (x2, x3), ...`` of ``x`` (B, h, S, d) (DeepSeek's
    layout), pair ``i`` by ``Rotary``'s angle ``i``; the result is laid out de-interleaved (the
    first elements of the pairs, then the second ones), as HF's ``rope_interleave`` writes it: a
    fixed permutation of the head's rotary part that queries and keys share, so their products
    are those of the interleaved rotation."""
    half = cos.shape[-1] // 2
    c, s = cos[..., :half].to(x.dtype), sin[..., :half].to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def relative_bucket(relative: torch.Tensor, bidirectional: bool, num_buckets: int, max_distance: int) -> torch.Tensor:
    """T5's bucketing of ``key_pos - query_pos``: exact buckets for small distances,
    logarithmically wider ones up to ``max_distance``; causal mode folds the future into bucket 0."""
    bucket = torch.zeros_like(relative)
    if bidirectional:
        num_buckets //= 2
        bucket = bucket + (relative > 0).long() * num_buckets
        distance = relative.abs()
    else:
        distance = (-relative).clamp(min=0)
    max_exact = num_buckets // 2
    is_small = distance < max_exact
    log_ratio = torch.log(distance.float().clamp(min=1) / max_exact) / math.log(max_distance / max_exact)
    large = max_exact + (log_ratio * (num_buckets - max_exact)).long()
    large = large.clamp(max=num_buckets - 1)
    return bucket + torch.where(is_small, distance, large)


class RelativePositionBias(nn.Module):
    """T5 relative attention bias: a learned scalar per (bucket, head), added to the scores."""

    def __init__(self, num_heads: int, bidirectional: bool, num_buckets: int = 32, max_distance: int = 128):
        super().__init__()
        self.bidirectional = bidirectional
        self.num_buckets = num_buckets
        self.max_distance = max_distance
        self.embedding = nn.Embedding(num_buckets, num_heads)

    def forward(self, q_len: int, k_len: int, q_offset: int = 0) -> torch.Tensor:
        """Bias of shape (1, h, q_len, k_len); query ``i`` sits at absolute position ``q_offset + i``."""
        device = self.embedding.weight.device
        q_pos = torch.arange(q_offset, q_offset + q_len, device=device)
        return self.embedding(self.buckets(q_pos, torch.arange(k_len, device=device))).permute(2, 0, 1).unsqueeze(0)

    def buckets(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """The (len(q_pos), len(k_pos)) bucket of every (query, key) pair of absolute positions."""
        return relative_bucket(k_pos[None, :] - q_pos[:, None], self.bidirectional, self.num_buckets, self.max_distance)
