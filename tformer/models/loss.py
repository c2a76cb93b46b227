"""The chunked output head + cross-entropy: the training loss without a (tokens x vocabulary) tensor.

At Llama-3's 128k vocabulary and 2,048 tokens, the logits, their log-softmax and their gradient are
~1 GB each in fp32 per sample. Here ``chunk_size`` tokens at a time go through the output projection
and the loss, so at most one (chunk x vocabulary) block exists at any moment.

The gradients are *carried*, not recomputed: the loss is a scalar at the very end of the forward, so
each chunk's gradients (w.r.t. its hidden rows, the weight and the bias) are computed while its
logits are at hand, and backward only multiplies them by the incoming scalar. That costs the same
three matmuls per chunk as the unchunked head (forward, input gradient, weight gradient); recomputing
the logits in backward would cost a fourth, +33% on the head's FLOPs, for no memory gain: the
carried gradients are the (tokens x d) input gradient and the weight gradient, which backward must
produce anyway. The price is the one ``CrossEntropy`` already pays: a single backward per graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import ConfigError


CPU_CHUNK = 128  # tokens per chunk on a CPU: the measured best there (docs/memory.md)
HEAD_SHARE = 0.25  # of the memory the model states leave free, the share the head's logits may take
GPU_MIN_CHUNK = 256  # the smallest chunk on an accelerator, and the multiple chunks are rounded to


def auto_chunk_size(tokens: int, vocab: int, per_logit: int, free_bytes: float | None) -> int | None:
    """``loss.chunk_size=auto``: the chunk, in tokens, for a head of ``tokens`` rows (one micro-batch's
    labelled positions) over ``vocab`` columns, where each logit costs ``per_logit`` bytes at the
    head's peak (6 under mixed precision, 4 in fp32: ``plan/memory.head_bytes``), on a device with
    ``free_bytes`` left by the model states (None: a CPU).

    On a CPU the measured best, ``CPU_CHUNK``. On an accelerator chunks cost what no FLOP count
    shows (each is a handful of kernels: on an H200, llama-1b ran 821 ms a step at 128-token chunks,
    692 ms at 1,024, 634 ms unchunked), so the head runs whole (None) where its logits fit
    ``HEAD_SHARE`` of the free memory, else in the fewest chunks that do (a multiple of
    ``GPU_MIN_CHUNK``, at least that). The trainer and the planner both decide through here."""
    if free_bytes is None:
        return CPU_CHUNK
    budget = HEAD_SHARE * max(free_bytes, 0.0)
    if tokens * vocab * per_logit <= budget:
        return None
    rows = int(budget // (vocab * per_logit))
    return max(GPU_MIN_CHUNK, rows // GPU_MIN_CHUNK * GPU_MIN_CHUNK)


def loss_divisor(valid: torch.Tensor, loss_tokens: torch.Tensor | None) -> torch.Tensor:
    """What a mean loss divides its sum by: the labelled positions ``valid`` marks, or the sum of
    ``loss_tokens`` (a count, or per-sample counts that split with a pipeline's micro-batches;
    see ``models/base.lm_loss``)."""
    return valid.sum() if loss_tokens is None else loss_tokens.sum()


def chunked_lm_loss(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    chunk_size: int,
    vocab_size: int | None = None,
    label_smoothing: float = 0.0,
    loss_tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.cross_entropy(F.linear(x, weight, bias)[..., :vocab_size], labels, ignore_index=-100,
    label_smoothing=label_smoothing)`` (mean over labelled positions), ``chunk_size`` rows at a time.

    ``x`` (..., d) is the head's input (after any head transform), ``labels`` (...) aligned with it;
    ``vocab_size`` drops the padded rows of ``weight`` (they get a zero gradient, as when the logits
    are sliced). ``loss_tokens`` replaces the count of labelled positions as the divisor (see
    ``models/base.lm_loss``)."""
    if chunk_size < 1:
        raise ConfigError(f"loss.chunk_size={chunk_size} must be >= 1 (or null for the unchunked loss)")
    if type(weight).__name__ == "DTensor":
        raise ConfigError(
            "loss.chunk_size does not compose with a vocabulary-sharded (tensor-parallel) "
            "output head yet; set loss.chunk_size=null to use loss parallelism"
        )
    return ChunkedLinearCrossEntropy.apply(
        x.reshape(-1, x.shape[-1]),
        weight,
        bias,
        labels.reshape(-1),
        chunk_size,
        vocab_size or weight.shape[0],
        float(label_smoothing),
        loss_tokens,
    )


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Linear head + mean cross-entropy over chunks of rows, with the gradients computed in forward
    (see the module doc). Under autocast the matmuls run in the autocast dtype, as ``F.linear``
    would, and the weight gradient is accumulated across chunks in fp32 (``add_weight_grad``);
    log-softmax and the gradient arithmetic are fp32, in one (chunk x vocabulary) buffer."""

    @staticmethod
    def forward(ctx, x, weight, bias, labels, chunk_size, vocab, smoothing, loss_tokens=None):
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
        with torch.autocast(device, enabled=False):
            # padded vocabulary rows are left out here and get a zero gradient (slicing outside
            # would make autograd build a second weight-sized gradient in backward)
            xc, w = x.to(dtype), weight[:vocab].to(dtype)
            b = bias[:vocab].to(dtype) if bias is not None else None
            valid = labels != -100
            count = loss_divisor(valid, loss_tokens)
            target = labels.masked_fill(~valid, 0)[:, None]
            need_x, need_w, need_b = ctx.needs_input_grad[:3]
            grad_x = torch.empty_like(x) if need_x else None
            grad_w = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
            grad_b = torch.zeros_like(bias, dtype=torch.float32) if need_b else None
            total = torch.zeros((), dtype=torch.float32, device=x.device)
            for start in range(0, x.shape[0], chunk_size):
                rows = slice(start, start + chunk_size)
                # one (chunk x vocab) fp32 buffer: logits -> shifted -> exp -> softmax -> gradient
                z = F.linear(xc[rows], w, b).float()
                z.sub_(z.amax(dim=-1, keepdim=True))
                picked = z.gather(-1, target[rows]).squeeze(-1)
                mean = z.mean(dim=-1) if smoothing else None
                total_exp = z.exp_().sum(dim=-1, keepdim=True)
                lse = total_exp.log().squeeze(-1)  # of the shifted logits
                loss = lse - picked
                if smoothing:  # (1-e) * nll + e * mean over classes of -log p
                    loss = (1 - smoothing) * loss + smoothing * (lse - mean)
                keep = valid[rows]
                total += (loss * keep).sum()
                if not (need_x or need_w or need_b):
                    del z
                    continue
                # d(sum of losses)/dz = softmax - (1-e) onehot - e/V, zero on ignored rows; / count later
                g = z.div_(total_exp)
                g.scatter_add_(-1, target[rows], torch.full_like(total_exp, smoothing - 1))
                if smoothing:
                    g.sub_(smoothing / vocab)
                g.mul_(keep[:, None])
                g_low = g.to(dtype)
                if need_x:
                    grad_x[rows] = g_low @ w
                if need_w:
                    add_weight_grad(grad_w[:vocab], g, g_low, x[rows], xc[rows])
                if need_b:
                    grad_b[:vocab] += g.sum(0)
                del z, g, g_low  # before the next chunk's logits exist: one buffer at a time
            # as in F.cross_entropy, no labelled position at all gives 0 / 0 = nan
            scale = 1.0 / count
            for grad in (grad_x, grad_w, grad_b):
                if grad is not None:
                    grad.mul_(scale.to(grad.dtype))
        # kept on ctx, not saved: saved-tensor hooks (activation offload, memory counters) are for
        # activations, and these are gradients that backward hands over at once
        ctx.grads = (grad_x, grad_w, grad_b)
        ctx.dtypes = (x.dtype, weight.dtype, bias.dtype if bias is not None else None)
        return total / count

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.grads is None:
            raise RuntimeError(
                "the chunked loss supports one backward per forward (its gradients are "
                "computed in forward and handed over once)"
            )
        out = []
        for grad, dtype in zip(ctx.grads, ctx.dtypes):
            if grad is None:
                out.append(None)
                continue
            if grad.dtype != dtype:
                grad = grad.to(dtype)
            out.append(grad if _is_one(grad_out) else grad.mul_(grad_out.to(grad.dtype)))
        ctx.grads = None
        return (*out, None, None, None, None, None)


# whether this process's torch runs ``addmm(..., out_dtype=torch.float32)`` on low-precision inputs,
# by device type (CUDA builds of torch >= 2.8 do; a CPU build does not)
_FP32_OUT_ADDMM: dict[str, bool] = {}


def _accelerated(x: torch.Tensor) -> bool:
    return x.device.type != "cpu"  # a CPU's fp32 GEMM is its fastest (AVX2 has no bf16 arithmetic)


def add_weight_grad(
    grad_w: torch.Tensor, g: torch.Tensor, g_low: torch.Tensor, x: torch.Tensor, x_low: torch.Tensor
) -> None:
    """``grad_w += g.T @ x``, one chunk's weight gradient into the fp32 (vocab x d) accumulator.

    On a CPU, or where the head runs in fp32 (``g_low`` is ``g``), an fp32 GEMM in place, as
    before. Under mixed precision on an accelerator, the product of the autocast-dtype operands
    (what ``F.linear``'s own weight gradient multiplies), accumulated by the GEMM in fp32 straight
    into ``grad_w`` (``addmm`` with ``out_dtype``): the tensor-core rate, no temporary, no rounding
    of the sum. An fp32 GEMM there would run at the card's fp32 rate unless TF32 is allowed (67 of
    H100's 989 TFLOP/s: ~150 ms a step for gpt2-small's head at 131k tokens); where ``out_dtype``
    is missing (and under compile, which traces the plain ops), the low-precision product is added
    in, rounded once per chunk as an unchunked head's weight gradient is rounded once."""
    if not _accelerated(x) or g_low.dtype == torch.float32:
        grad_w.addmm_(g.t(), x.float())
        return
    kind = x.device.type
    if not torch.compiler.is_compiling() and _FP32_OUT_ADDMM.get(kind, True):
        try:
            torch.addmm(grad_w, g_low.t(), x_low, out_dtype=torch.float32, out=grad_w)
            _FP32_OUT_ADDMM[kind] = True
            return
        except (RuntimeError, TypeError, NotImplementedError):
            _FP32_OUT_ADDMM[kind] = False  # this build has no such kernel: the fallback from now on
    grad_w.add_(g_low.t() @ x_low)


def _is_one(t: torch.Tensor) -> bool:
    """A unit incoming gradient (``loss.backward()``) needs no pass over the weight gradient; on an
    accelerator (no host sync), for fake tensors (memory estimates) and under compile the multiply
    just runs."""
    from torch._subclasses.fake_tensor import FakeTensor

    if torch.compiler.is_compiling():  # a graph has no host reads: the multiply is traced into it
        return False
    return t.device.type == "cpu" and not isinstance(t, FakeTensor) and t.numel() == 1 and t.item() == 1.0
