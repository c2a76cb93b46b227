"""The FlexAttention path (tformer/nn/flex.py) against the math path, and which kernel each layer takes.

On this CPU FlexAttention runs eagerly and forward only (torch 2.13 has no CPU backward, eager or
compiled; its compiled CPU kernel is inference-only and returns no log-sum-exp), so the flex path's
forward is held here to the math path at odd shapes (37 positions, a window of 5, 4 query heads on
2 K/V heads), every switch in turn; its backward runs on a GPU (the ``gpu`` test) and, here, through
a differentiable stand-in for the kernel that checks what ``flex_attend`` adds around it (the sinks'
rescaling). fp32; the bound is FACTOR times the math path's own fp32 distance from float64
(tests/rounding.py); each planted defect lands orders of magnitude outside it.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from rounding import FACTOR, float64_throughout, relative

from tformer.models import build_model
from tformer.models.kernels import attention_kernels, attention_line
from tformer.models.presets import preset
from tformer.nn import DocumentMask
from tformer.nn import attention as attention_module
from tformer.nn import flex
from tformer.nn.attention import local_attention
from tformer.nn.flex import attention_kernel, flex_attend

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

B, H, HKV, S, D, W = 2, 4, 2, 37, 16, 5
DOCS = [[0] * 11 + [1] * 20 + [2] * 3 + [-1] * 3, [0] * 30 + [1] * 7]  # documents, padding (-1) at a tail
PADDED = [[1] * 31 + [0] * 6, [1] * S]


def _inputs(dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, S, D, generator=g) * 2  # scores of a few units: a cap of 2 bites
    k, v = (torch.randn(B, HKV, S, D, generator=g) for _ in range(2))
    sinks = torch.randn(H, generator=g)
    bias = torch.randn(1, H, S, S, generator=g)
    return [t.to(device, dtype) for t in (q, k, v, sinks, bias)]


CASES = {  # name -> the switches both paths take
    "window causal": dict(causal=True, window=W),
    "window bidirectional": dict(causal=False, window=W + 1),  # |distance| <= 3
    "sinks": dict(causal=True, sinks=True),
    "softcap": dict(causal=True, window=W, softcap=2.0),
    "documents + window": dict(causal=True, window=W, documents=True),
    "padding + window + sinks + cap": dict(causal=False, window=W + 1, padded=True, sinks=True, softcap=2.0),
    "bias + cap": dict(causal=False, bias=True, softcap=2.0),
}


def _switches(case, sinks, bias, device="cpu"):
    kw = dict(causal=case["causal"], window=case.get("window"), softcap=case.get("softcap"))
    kw["sinks"] = sinks if case.get("sinks") else None
    kw["bias"] = bias if case.get("bias") else None
    kw["doc_mask"] = DocumentMask(torch.tensor(DOCS, device=device)) if case.get("documents") else None
    kw["padding_mask"] = torch.tensor(PADDED, device=device) if case.get("padded") else None
    return kw


def _math(q, k, v, scale, kw):
    return local_attention(
        q, k, v, padding_mask=kw["padding_mask"], causal=kw["causal"], attn_bias=kw["bias"], doc_mask=kw["doc_mask"],
        scale=scale, dropout_p=0.0, impl="math", window=kw["window"], sinks=kw["sinks"], softcap=kw["softcap"],
    )  # fmt: skip


def _real_rows(kw) -> torch.Tensor:
    """Queries with a key to see: a padding query may find none in its window, where the math path
    averages every value and FlexAttention returns zeros (flex_attend's docstring); neither is used."""
    if kw["doc_mask"] is not None:
        return (kw["doc_mask"].q_ids >= 0)[:, None, :, None]
    if kw["padding_mask"] is not None:
        return kw["padding_mask"].bool()[:, None, :, None]
    return torch.ones(1, 1, 1, 1, dtype=torch.bool)


def _bound(q, k, v, sinks, bias, case):
    """(float64 reference, the math path's fp32 distance from it): the reference's rows of real queries."""
    scale = D**-0.5
    kw = _switches(case, sinks, bias)
    real = _real_rows(kw)
    fp32 = _math(q, k, v, scale, kw)
    with float64_throughout():
        kw64 = _switches(case, sinks.double(), bias.double())
        exact = _math(q.double(), k.double(), v.double(), scale, kw64)
    return exact * real, max(relative(fp32 * real, exact * real), 2.0**-24), real


def _flex(q, k, v, case, sink_logits, bias_tensor, **change):
    kw = {**_switches(case, sink_logits, bias_tensor), **change}
    return flex_attend(q, k, v, scale=D**-0.5, compiled=False, **kw)


@pytest.mark.parametrize("name", CASES)
def test_flex_equals_the_math_path(name):
    case = CASES[name]
    q, k, v, sinks, bias = _inputs()
    exact, yard, real = _bound(q, k, v, sinks, bias, case)
    err = relative(_flex(q, k, v, case, sinks, bias) * real, exact)
    assert err <= FACTOR * yard, (name, err, yard)


def test_planted_defects_fail():
    """A window one key too wide (causal; bidirectional: one more each side), the sink left out of
    the denominator, the cap not applied: each far outside the bound the real path keeps."""
    q, k, v, sinks, bias = _inputs()
    defects = [
        ("window causal", dict(window=W + 1)),
        ("window bidirectional", dict(window=W + 3)),
        ("sinks", dict(sinks=None)),
        ("softcap", dict(softcap=None)),
        ("documents + window", dict(doc_mask=None)),
    ]
    for name, change in defects:
        exact, yard, real = _bound(q, k, v, sinks, bias, CASES[name])
        err = relative(_flex(q, k, v, CASES[name], sinks, bias, **change) * real, exact)
        print(f"{name} {change}: {err / yard:.1e} yardsticks")
        assert err > 1e3 * FACTOR * yard, (name, change, err, yard)


def test_the_sinks_rescaling_is_differentiable(monkeypatch):
    """The kernel's backward needs CUDA; what ``flex_attend`` computes around it (the output scaled
    by sigmoid(lse - sink), the mask and score rules it hands over) is checked here through a
    differentiable stand-in for the kernel: gradients of q, k, v and the sinks equal the math path's."""
    from torch.nn.attention.flex_attention import AuxOutput

    def kernel(q, k, v, *, score_mod, block_mask, scale, enable_gqa, return_aux=None):
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        idx = [torch.arange(n)[shape] for n, shape in zip(q.shape[:3] + (k.shape[2],), SLICES)]
        scores = q @ k.transpose(-1, -2) * scale
        scores = score_mod(scores, *idx) if score_mod is not None else scores
        scores = scores.masked_fill(~block_mask.mask_mod(*idx), float("-inf"))
        lse = scores.logsumexp(-1)
        out = torch.softmax(scores, -1) @ v
        return (out, AuxOutput(lse=lse)) if return_aux is not None else out

    SLICES = [(slice(None), None, None, None), (None, slice(None), None, None), (None, None, slice(None), None)]
    SLICES.append((None, None, None, slice(None)))
    monkeypatch.setattr(flex, "flex_function", lambda compiled: kernel)
    case = dict(causal=True, window=W, sinks=True, softcap=2.0)
    grads = {}
    for path in ("flex", "math"):
        q, k, v, sinks, bias = (t.requires_grad_() for t in _inputs())
        kw = _switches(case, sinks, bias)
        out = flex_attend(q, k, v, scale=D**-0.5, **kw) if path == "flex" else _math(q, k, v, D**-0.5, kw)
        (out * torch.linspace(-1, 1, D)).sum().backward()
        grads[path] = [t.grad for t in (q, k, v, sinks)]
    for got, want in zip(grads["flex"], grads["math"]):
        assert relative(got, want) < 1e-5  # fp32 both, the same arithmetic in another order
    assert grads["math"][3].abs().min() > 1e-3  # the sinks do get a gradient


def test_each_call_takes_its_kernel():
    cuda = dict(device_type="cuda", impl="sdpa")
    assert attention_kernel(**cuda, causal=True) == "sdpa-causal"
    assert attention_kernel(**cuda, causal=False, padded=True) == "sdpa"
    for switch in (dict(window=128), dict(sinks=True), dict(softcap=50.0), dict(documents=True)):
        assert attention_kernel(**cuda, causal=True, **switch) == "flex", switch
        assert attention_kernel(**cuda, causal=True, dropout=True, **switch) != "flex"  # Flex has no dropout
        assert attention_kernel(**cuda, causal=True, head_dims=(8, 8), **switch) != "flex"  # Triton tiles: >= 16
        assert attention_kernel(**cuda, causal=True, same_length=False, **switch) != "flex"  # a decoding step
        assert attention_kernel("cuda", "math", causal=True, **switch) == "math"
        on_cpu = attention_kernel("cpu", "sdpa", causal=True, **switch)
        assert on_cpu == ("math" if "softcap" in switch else "sdpa"), switch
    assert attention_kernel(**cuda, causal=True, documents=True, flex=False) == "sdpa"


def test_the_start_up_line_names_each_layer_kinds_kernel():
    oss = preset("gpt-oss-tiny")  # windows on every other layer, sinks on all
    assert attention_line(oss, "cuda") == "attention: global layers flex, local layers (window 16) flex"
    assert attention_line(oss, "cpu") == "attention: global layers sdpa, local layers (window 16) sdpa"
    windows = preset("llama-tiny").replace(attn_window=16, global_every=2)
    assert attention_line(windows, "cuda") == "attention: global layers sdpa-causal, local layers (window 16) flex"
    assert attention_line(windows, "cuda", documents=True) == "attention: global layers flex, local layers (window 16) flex"
    capped = preset("bert-tiny").replace(attn_window=8, global_every=3, global_offset=0, attn_softcap=50.0)
    assert attention_kernels(capped, "cuda") == [("global layers", "flex"), ("local layers (window 8)", "flex")]
    line = attention_line(capped, "cpu")
    assert line.startswith("attention: global layers math, local layers (window 8) math (model.attn_softcap=50.0")
    assert "\n" not in line
    t5 = preset("t5-tiny").replace(attn_window=8, global_every=2)
    assert attention_kernels(t5, "cuda") == [
        ("encoder global layers", "sdpa"), ("encoder local layers (window 8)", "flex"),
        ("decoder global layers", "sdpa"), ("decoder local layers (window 8)", "flex"), ("cross-attention", "sdpa"),
    ]  # fmt: skip
    assert attention_line(preset("llama-tiny"), "cuda") == "attention: every layer sdpa-causal"


def _forced_flex(monkeypatch) -> list:
    """local_attention takes the flex path (eager here) wherever it would on CUDA; the list
    returned collects each call's switches."""
    real_kernel, real_attend, calls = attention_kernel, flex_attend, []

    def as_on_cuda(device_type, impl, **kw):
        return real_kernel("cuda", impl, **kw)

    def attend(*args, **kw):
        calls.append(sorted(name for name, value in kw.items() if value is not None and value is not False))
        return real_attend(*args, **kw)

    monkeypatch.setattr(attention_module, "attention_kernel", as_on_cuda)
    monkeypatch.setattr(attention_module, "flex_attend", attend)
    return calls


@pytest.mark.parametrize("name", ["gpt-oss-tiny", "bert-tiny"])
def test_a_model_through_flex_equals_the_math_path(name, monkeypatch):
    """Whole models on the flex path (eager, forward) against the same weights on the math path:
    gpt-oss's windows and sinks over grouped K/V; an encoder's padded rows with bidirectional
    windows, a cap and packed documents."""
    cfg = preset(name)
    if cfg.family == "encoder":
        cfg = cfg.replace(attn_window=6, global_every=2, attn_softcap=2.0, d_head=16, num_heads=cfg.d_model // 16)
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    ids = torch.randint(3, cfg.vocab_size, (2, 37))
    extra = {}
    if cfg.family == "encoder":
        extra = dict(attention_mask=torch.tensor(PADDED), doc_ids=torch.tensor([[0] * 20 + [1] * 11 + [-1] * 6, [0] * S]))
    with torch.no_grad():
        want = model(ids, **extra).logits
        math_model = build_model(cfg.replace(attn_impl="math")).eval()
        math_model.load_state_dict(model.state_dict())
        exact = math_model(ids, **extra).logits
        calls = _forced_flex(monkeypatch)
        got = model(ids, **extra).logits
    switches = ["window", "sinks"] if name == "gpt-oss-tiny" else ["window", "doc_mask", "padding_mask", "softcap"]
    assert len(calls) == cfg.num_layers and set(switches) <= set(calls[0]), calls
    real = torch.tensor(PADDED).bool()[..., None] if extra else torch.ones(1, 1, 1, dtype=torch.bool)
    err, yard = relative(got * real, exact * real), relative(want * real, exact * real)
    assert err <= FACTOR * max(yard, 2.0**-24), (err, yard)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_takes_flex_and_it_equals_the_math_path(dtype, monkeypatch, request):
    """On CUDA: windowed, capped and sinks layers take the compiled FlexAttention, plain causal
    ones SDPA's causal kernel (the line and the calls agree); forward and backward (through the
    kernel's log-sum-exp for the sinks) equal the math path, in fp32 and bf16, within the math
    path's own distance from float64 (bf16: its rounding, 2^-8, dominates both)."""
    assert attention_line(preset("gpt-oss-tiny"), "cuda") == "attention: global layers flex, local layers (window 16) flex"
    assert attention_line(preset("llama-tiny"), "cuda") == "attention: every layer sdpa-causal"
    # each case's rules compile a kernel of their own: past dynamo's limit it would fall back to eager
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 64, raising=False)
    # fp32 products in fp32 (not TF32) in both kernels, whatever an earlier test left set
    was = torch.get_float32_matmul_precision()
    request.addfinalizer(lambda: torch.set_float32_matmul_precision(was))
    torch.set_float32_matmul_precision("highest")
    for name, case in CASES.items():
        inputs = _inputs(dtype, "cuda")
        kw = _switches(case, inputs[3], inputs[4], device="cuda")
        flags = {switch: bool(case.get(switch)) for switch in ("sinks", "bias", "documents")}
        kernel = attention_kernel("cuda", "sdpa", causal=kw["causal"], window=kw["window"], softcap=kw["softcap"], **flags)
        assert kernel == "flex", name
        outs = {}
        for path in ("flex", "math", "exact"):
            q, k, v, sinks, bias = (t.detach().double() if path == "exact" else t.detach() for t in inputs)
            q, k, v = (t.requires_grad_() for t in (q, k, v))
            kw = _switches(case, sinks, bias, device="cuda")
            with float64_throughout() if path == "exact" else contextlib.nullcontext():
                out = local_attention(
                    q, k, v, padding_mask=kw["padding_mask"], causal=kw["causal"], attn_bias=kw["bias"],
                    doc_mask=kw["doc_mask"], scale=D**-0.5, dropout_p=0.0, impl="sdpa" if path == "flex" else "math",
                    window=kw["window"], sinks=kw["sinks"], softcap=kw["softcap"],
                )  # fmt: skip
                out = out * _real_rows(kw).to("cuda")
                (out.float() * torch.linspace(-1, 1, D, device="cuda")).sum().backward()
            outs[path] = [out, q.grad, k.grad, v.grad]
        for i, what in enumerate(("out", "dq", "dk", "dv")):
            yard = max(relative(outs["math"][i], outs["exact"][i]), 2.0**-24)
            err = relative(outs["flex"][i], outs["exact"][i])
            print(f"{name} {dtype} {what}: flex {err:.2e}, math {yard:.2e}")
            assert err <= FACTOR * yard, (name, what, err, yard)
