"""Bounds for fp32 comparisons from a float64 computation of the same thing (CONTRIBUTING.md,
"Tolerances hold on every CPU"): two fp32 paths that compute the same mathematics in another order
(chunked and whole, loss-only and full logits, ours and torch's) each lie some rounding away from
the exact value. The float64 run gives that value to ~1e-16; how far torch's own fp32 path lies from
it is the yardstick of fp32 rounding for this computation on this CPU, and the path under test may
differ from torch's by a small factor of it. A wrong scale, a position counted twice or left out
is far outside (figures at FACTOR)."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

# fp32's unit roundoff: a yardstick never counts as smaller than one rounding (where fp32 and
# float64 happen to agree on a tensor)
FP32_ROUNDING = 2.0**-24
# the path under test against torch's fp32 path: each may be this many yardsticks from the other.
# Measured on a 2-core AVX2 EPYC, at AVX2 and with ATEN_CPU_CAPABILITY=default (scalar kernels): at
# most 2.0 (test_models' loss-only path), 1.3 (test_loss's smoothing), 2.8 (test_memory's chunks),
# 1.1 (test_context_parallel's families). Defects: the smoothing's vocabulary counted one too many
# 20 to 74 yardsticks, the chunked loss's divisor one too many 4.7e4, BERT's loss-only head reading
# the neighbouring position 1.9e7.
FACTOR = 8.0
# a tensor whose exact value is zero (a key bias's gradient: softmax ignores a per-query constant)
# holds round-off alone, ~1e-10 here: it is measured against this share of the model's largest
# gradient instead of its own largest element
ZERO = 1e-3


@contextmanager
def float64_throughout():
    """The model code casts to fp32 where it wants fp32 at least (``x.float()`` before a norm, a
    softmax, the loss); under this a float64 tensor stays float64 there, so a ``.double()`` model
    computes in float64 end to end."""
    original = torch.Tensor.float

    def keep_float64(self, *args, **kwargs):
        return self if self.dtype == torch.float64 else original(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:  # restores the inherited method as it was
        patch.setattr(torch.Tensor, "float", keep_float64)
        yield


def relative(got: torch.Tensor, want: torch.Tensor, scale: float | None = None) -> float:
    """Largest element difference relative to ``want``'s largest element (or ``scale``: a tensor
    whose exact value is zero, like a key bias's gradient, is measured against its model's)."""
    got, want = got.double(), want.double()
    floor = want.abs().max().item() if scale is None else max(want.abs().max().item(), scale)
    return (got - want).abs().max().item() / max(floor, 1e-30)


def yardstick(fp32: dict, exact: dict, scale: float) -> float:
    """The largest relative distance of torch's fp32 results from the float64 ones, at least one
    fp32 rounding."""
    return max(FP32_ROUNDING, *(relative(fp32[k], exact[k], ZERO * scale) for k in exact))


def assert_within(got: dict, want: dict, yard: float, scale: float, what: str = "") -> float:
    """Every tensor of ``got`` within FACTOR yardsticks of ``want``; returns the largest ratio."""
    assert got.keys() == want.keys(), (what, set(got) ^ set(want))
    errs = {k: relative(got[k], want[k], ZERO * scale) for k in want}
    bad = {k: e for k, e in errs.items() if not e <= FACTOR * yard}  # a NaN is bad too
    assert not bad, (what, bad, yard)
    return max(errs.values()) / yard
