"""One cast per sub-layer input under autocast."""

from __future__ import annotations

import torch


def autocast_input(x: torch.Tensor) -> torch.Tensor:
    """``x`` in autocast's compute dtype when autocast is on (else ``x`` itself).

    Autocast casts an fp32 activation for every matmul that reads it, and each of those ops saves
    its own low-precision copy for backward: q, k and v (a gated FFN's gate and up, cross-attention's
    k and v of the encoder output) would keep three (two) copies of the same values. Casting once
    before the projections keeps one, and runs one cast kernel instead of three. The forward values
    are the same; the input gradient is the sum of the projections' gradients taken in the compute
    dtype (as it is whenever the residual stream itself is bf16, e.g. under FSDP2's bf16 params)."""
    device = x.device.type
    if torch.is_autocast_enabled(device) and x.is_floating_point():
        dtype = torch.get_autocast_dtype(device)
        if x.dtype != dtype:
            return x.to(dtype)
    return x
