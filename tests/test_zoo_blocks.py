"""The shared switches of issue 54 (ModernBERT, Gemma 3, T5Gemma), each against a written-out
reference that fails on a planted defect: soft-capped attention and output logits, sandwich norms,
each layer kind's own RoPE base, Gemma's RMSNorm (1 + weight), query_pre_attn_scalar, the embedding
scale in the activations' dtype, ModernBERT's global-layer offset; bad input one line each.

fp32 throughout; the tolerances (1e-5 / 1e-6) are a few ulps of the sums involved, and each planted
defect moves the result by 1e-2 or more."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from tformer.config import ConfigError, ModelConfig
from tformer.models import build_model
from tformer.nn.attention import local_attention, math_attention, window_allowed
from tformer.nn.block import TransformerBlock, TransformerStack
from tformer.nn.norm import RMSNorm
from tformer.nn.position import Rotary
from tformer.parallel.context import check_context_parallel
from tformer.parallel.tp import check_tp

TINY = dict(vocab_size=97, d_model=32, num_heads=4, d_ff=48, num_layers=3, max_seq_len=32, position="rotary")


def _move(module: torch.nn.Module, seed: int = 0) -> None:
    """Every weight off its init, so a gain of 1 or a bias of 0 cannot hide a defect."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)


def test_attention_softcap_before_the_mask():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 7, 8) * 3 for _ in range(3))  # large scores, so the cap bites
    cap, scale = 2.0, 8**-0.5
    allowed = window_allowed(7, 7, 4, True, q.device) & torch.ones(7, 7).tril().bool()
    mask = torch.zeros(7, 7).masked_fill(~allowed, torch.finfo(torch.float32).min)
    scores = q @ k.transpose(-2, -1) * scale
    want = torch.softmax(cap * torch.tanh(scores / cap) + mask, -1) @ v
    after = torch.softmax(cap * torch.tanh((scores + mask) / cap), -1) @ v  # planted: the cap after the mask
    got = math_attention(q, k, v, mask, scale, softcap=cap)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert (after - want).abs().max() > 1e-2  # the masked keys leak through a cap after the mask
    # impl="sdpa" is routed to the math path on a CPU: the same numbers (SDPA would ignore the cap)
    kw = dict(padding_mask=None, attn_bias=None, doc_mask=None, scale=scale, dropout_p=0.0)
    sdpa = local_attention(q, k, v, causal=True, impl="sdpa", window=4, softcap=cap, **kw)
    torch.testing.assert_close(sdpa, want, atol=1e-6, rtol=1e-5)
    uncapped = local_attention(q, k, v, causal=True, impl="sdpa", window=4, **kw)
    assert (uncapped - want).abs().max() > 1e-2


def test_sandwich_norm_block():
    torch.manual_seed(0)
    cfg = ModelConfig(**TINY, norm="rmsnorm", bias=False, activation="geglu", sandwich_norm=True, norm_unit_offset=True)
    block = TransformerBlock(cfg, causal=True, cross=False)
    _move(block)
    x = torch.randn(2, 5, 32)
    got = block(x)
    h = x + block.attn_post_norm(block.attn(block.attn_norm(x), causal=True))
    want = h + block.ffn_post_norm(block.ffn(block.ffn_norm(h)))
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    h_bad = x + block.attn(block.attn_norm(x), causal=True)  # planted: the post-attention norm left out
    bad = h_bad + block.ffn_post_norm(block.ffn(block.ffn_norm(h_bad)))
    assert (bad - want).abs().max() > 1e-2


def test_gemma_rmsnorm_unit_offset():
    x = torch.randn(3, 16)
    norm = RMSNorm(16, 1e-6, unit_offset=True)
    assert torch.equal(norm.weight, torch.zeros(16))  # 1 + 0: the identity gain
    torch.testing.assert_close(norm(x), RMSNorm(16, 1e-6)(x))
    with torch.no_grad():
        norm.weight.fill_(0.5)
    torch.testing.assert_close(norm(x), F.rms_norm(x, (16,), eps=1e-6) * 1.5)
    # init_weights leaves such gains at 0 (1 + weight = 1), not at 1 (a gain of 2)
    model = build_model(ModelConfig(**TINY, norm="rmsnorm", norm_unit_offset=True, sandwich_norm=True))
    model.init_weights()
    assert torch.equal(model.decoder.final_norm.weight, torch.zeros(32))


def test_local_layers_take_their_own_rope_base():
    torch.manual_seed(0)
    cfg = ModelConfig(
        **{**TINY, "num_layers": 6}, attn_window=4, global_every=3, global_offset=0, rope_theta=160000.0,
        rope_local_theta=10000.0, family="encoder",
    )  # fmt: skip
    assert [cfg.layer_window(i) for i in range(6)] == [None, 4, 4, None, 4, 4]  # ModernBERT's pattern
    assert [cfg.layer_rope_theta(i) for i in range(6)] == [160000.0, 10000.0, 10000.0] * 2
    stack = TransformerStack(cfg, 6, causal=False)
    _move(stack)
    x = torch.randn(2, 9, 32)
    pos = torch.arange(9)
    tables = {t: Rotary(cfg.head_dim, t)(pos) for t in (10000.0, 160000.0)}

    def run(theta_of):
        h = x
        for i, layer in enumerate(stack.layers):
            h = layer(h, rotary=tables[theta_of(i)])
        return stack.final_norm(h)

    torch.testing.assert_close(stack(x), run(cfg.layer_rope_theta), atol=1e-5, rtol=1e-5)
    assert (stack(x) - run(lambda i: 160000.0)).abs().max() > 1e-3  # planted: a local layer given the global base


def test_bidirectional_window_edge():
    inside = window_allowed(9, 9, 4, False, torch.device("cpu"))  # 2 keys either side
    assert inside[4, 2] and inside[4, 6] and not inside[4, 1] and not inside[4, 7]  # a key one past is hidden


def test_final_softcap_and_scales():
    torch.manual_seed(0)
    cfg = ModelConfig(**TINY, final_softcap=3.0, query_pre_attn_scalar=16.0, embed_scale=True, embed_scale_dtype=True)
    model = build_model(cfg)
    _move(model)
    ids = torch.randint(0, 97, (2, 6))
    logits = model(ids).logits
    raw = model.lm_head(model.decoder(model.embed(ids, torch.arange(6))))
    torch.testing.assert_close(logits, 3.0 * torch.tanh(raw / 3.0), atol=1e-6, rtol=1e-5)
    assert logits.abs().max() < 3.0 < raw.abs().max()
    assert model.decoder.layers[0].attn.scale == 16.0**-0.5
    emb = model.embed.to(torch.bfloat16)
    got = emb(ids, torch.arange(6))
    assert torch.equal(got, emb.tok(ids) * torch.tensor(math.sqrt(32), dtype=torch.bfloat16))


@pytest.mark.parametrize(
    "overrides, words",
    [
        (dict(family="encoder", attn_window=5), "attn_window=5 must be even for a bidirectional"),
        (dict(attn_window=64), "attn_window=64 is longer than max_seq_len=32"),
        (dict(attn_window=4, global_offset=0), "global_offset=0 needs a global-layer period global_every > 0"),
        (dict(sandwich_norm=True, norm_position="post"), "sandwich_norm=true needs norm_position='pre'"),
        (dict(norm_unit_offset=True), "norm_unit_offset=true is for norm='rmsnorm'"),
        (dict(attn_softcap=0.0), "attn_softcap=0.0 must be > 0"),
    ],
)
def test_bad_input_one_line(overrides, words):
    with pytest.raises(ConfigError, match="^" + words.replace("(", r"\(")) as err:
        ModelConfig(**{**TINY, **overrides})
    assert "\n" not in str(err.value)


def test_kernels_that_cannot_cap_refuse():
    model = ModelConfig(**TINY, attn_softcap=50.0)
    with pytest.raises(ConfigError, match="^parallel.cp_kernel=torch does not run with model.attn_softcap=50.0") as err:
        check_context_parallel(
            SimpleNamespace(model=model, parallel=SimpleNamespace(cp_kernel="torch")), SimpleNamespace(cp=2)
        )
    assert "\n" not in str(err.value)
    check_tp(ModelConfig(**TINY, norm="rmsnorm", sandwich_norm=True), 2)  # laid out under TP (test_zoo_gemma)
    from tformer.models.kernels import attention_line

    line = attention_line(model, "cpu")  # no SDPA kernel caps: the math path here, FlexAttention on CUDA
    assert line.startswith("attention: every layer math (model.attn_softcap=50.0") and "\n" not in line
    assert attention_line(model.replace(num_heads=2), "cuda") == "attention: every layer flex"  # heads 16 wide


def test_export_refuses_switches_its_class_lacks():
    from tformer.export.hf import TARGETS, ExportError, check_switches

    cfg = ModelConfig(**TINY, norm="rmsnorm", flavour="llama", final_softcap=30.0)
    with pytest.raises(ExportError, match=r"final_softcap=30.0: it has no soft-capped output logits") as err:
        check_switches(cfg, TARGETS["llama"])
    assert "\n" not in str(err.value)
