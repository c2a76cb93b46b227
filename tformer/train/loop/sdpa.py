"""Which SDPA kernel a run's attention takes on CUDA, decided before any step.

``F.scaled_dot_product_attention`` picks, per call, the first backend in its priority order
(``torch._C._get_sdp_priority_order``: flash, memory-efficient, math, cuDNN by default) that is
enabled and whose ``torch.backends.cuda.can_use_*`` check accepts the call's inputs. In fp32 the
flash and cuDNN kernels are out (they take fp16/bf16 only), and the memory-efficient kernel takes
no grouped K/V heads (torch 2.11-2.13), so an fp32 decoder with GQA runs the math kernel: scores
materialised, several times the time and memory. ``math_fallback_line`` says so in one line at
start-up (the trainer logs it); ``backends_run`` names the kernels a profiled step ran, from the
ATen op each backend is (``tests/test_gpu.py`` holds the two to each other on a GPU).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from ...config import ModelConfig
from ...models.spec import spec_of

# torch.nn.attention.SDPBackend's values (what _get_sdp_priority_order returns) -> our names
BACKENDS = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}
DEFAULT_ORDER = ("flash", "efficient", "math", "cudnn")  # torch's default where it cannot be read
# the ATen op each backend runs as (a profiler event's name): flash's CPU kernel has its own op
OPS = {
    "aten::_scaled_dot_product_flash_attention": "flash",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "flash",
    "aten::_scaled_dot_product_efficient_attention": "efficient",
    "aten::_scaled_dot_product_cudnn_attention": "cudnn",
    "aten::_scaled_dot_product_attention_math": "math",
}

Check = Callable[[Any], bool]  # given a torch.backends.cuda.SDPAParams


def cuda_checks() -> dict[str, Check]:
    """Each backend's test as the dispatcher applies it: enabled (``sdpa_kernel``, the
    ``torch.backends.cuda.enable_*`` switches) and able to take these inputs."""
    cuda = torch.backends.cuda
    return {
        "flash": lambda p: cuda.flash_sdp_enabled() and cuda.can_use_flash_attention(p),
        "efficient": lambda p: cuda.mem_efficient_sdp_enabled() and cuda.can_use_efficient_attention(p),
        "cudnn": lambda p: cuda.cudnn_sdp_enabled() and cuda.can_use_cudnn_attention(p),
        "math": lambda p: cuda.math_sdp_enabled(),
    }


def priority_order() -> tuple[str, ...]:
    try:
        return tuple(BACKENDS[i] for i in torch._C._get_sdp_priority_order())
    except (AttributeError, KeyError):  # a torch without the call
        return DEFAULT_ORDER


def sdpa_kernel(params: object, checks: dict[str, Check] | None = None, order: Iterable[str] | None = None) -> str:
    """The backend SDPA picks for ``params`` (a ``torch.backends.cuda.SDPAParams``): the first in
    ``order`` whose check accepts it; ``none`` where none does (SDPA would raise)."""
    checks = cuda_checks() if checks is None else checks
    for name in priority_order() if order is None else order:
        check = checks.get(name)
        if check is not None and check(params):
            return name
    return "none"


def attention_calls(
    cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str, seq: int = 128
) -> list[tuple[str, object]]:
    """(what, SDPAParams) of each kind of SDPA call a training batch of the family makes (its
    default data: packed causal rows for a decoder; padded rows for an encoder, the padding an
    additive (batch, 1, 1, keys) mask; T5's relative bias an additive (1, heads, queries, keys)
    mask in both stacks' self-attention, its cross-attention over unpadded sources unmasked), at
    ``seq`` tokens; the tensors are ``device``'s, empty."""
    from torch.backends.cuda import SDPAParams

    heads, kv, d = cfg.num_heads, cfg.kv_heads, cfg.head_dim
    gqa = kv != heads
    q = torch.empty(1, heads, seq, d, dtype=dtype, device=device)
    k = v = torch.empty(1, kv, seq, d, dtype=dtype, device=device)
    p = float(cfg.attn_dropout)
    spec = spec_of(cfg)
    if spec.causal_lm:
        return [("causal self-attention", SDPAParams(q, k, v, None, p, True, gqa))]
    mask = torch.empty(1, 1, 1, seq, dtype=dtype, device=device)  # padding: additive, broadcast over the heads
    if spec.encoder_only:
        return [("padded self-attention", SDPAParams(q, k, v, mask, p, False, gqa))]
    if cfg.position == "relative":  # T5's bias: an additive mask of every head, query and key
        bias = torch.empty(1, heads, seq, seq, dtype=dtype, device=device)
        own = ("relative-bias self-attention", SDPAParams(q, k, v, bias, p, False, gqa))
    else:
        own = ("padded self-attention", SDPAParams(q, k, v, mask, p, False, gqa))
    return [own, ("cross-attention", SDPAParams(q, k, v, None, p, False, gqa))]


def math_fallback_line(
    cfg: ModelConfig,
    precision: str,
    device: torch.device,
    checks: dict[str, Check] | None = None,
    order: Iterable[str] | None = None,
    tensors_on: torch.device | str | None = None,
) -> str | None:
    """One line when an fp32 run on CUDA sends its attention to SDPA's math kernel, else None.
    ``checks``/``order``/``tensors_on`` replace the device's (a CPU test fakes them). A model with
    ``attn_softcap`` runs no SDPA on CUDA (FlexAttention, or the math path where Flex cannot run):
    the kernel line (``models/kernels.py``) names them, this one has nothing to add."""
    if device.type != "cuda" or precision != "fp32" or cfg.attn_impl != "sdpa" or cfg.attn_softcap is not None:
        return None
    order = tuple(priority_order() if order is None else order)
    calls = attention_calls(cfg, torch.float32, tensors_on or device)
    slow = [what for what, params in calls if sdpa_kernel(params, checks, order) == "math"]
    if not slow:
        return None
    why = "flash and cuDNN take only fp16/bf16"
    if cfg.kv_heads != cfg.num_heads:
        why += f", the memory-efficient kernel no grouped K/V ({cfg.num_heads} query / {cfg.kv_heads} K/V heads)"
    return (
        f"precision=fp32 on CUDA: SDPA runs the {' and '.join(slow)} on its math kernel, the scores "
        f"materialised ({why}); precision=bf16 runs it on a fused kernel"
    )


def backends_run(event_names: Iterable[str]) -> set[str]:
    """The SDPA backends among a profile's op names (``torch.profiler``'s events)."""
    return {OPS[name] for name in event_names if name in OPS}
