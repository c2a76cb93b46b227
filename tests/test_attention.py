"""MultiHeadAttention against the textbook: math vs SDPA, a naive per-head loop, masks, caches."""

import copy
import itertools
import math

import pytest
import torch
from rounding import assert_within, float64_throughout, yardstick

from tformer.nn import KVCache, MultiHeadAttention, Rotary, build_mask


def make_pair(**kw):
    """Two attention modules with identical weights: SDPA fast path and explicit math path."""
    fast = MultiHeadAttention(impl="sdpa", **kw)
    ref = MultiHeadAttention(impl="math", **kw)
    ref.load_state_dict(fast.state_dict())
    return fast.eval(), ref.eval()


def assert_rounding_close(got, want, exact, what=""):
    """``got`` within rounding.FACTOR yardsticks of ``want``: how far ``want`` (the textbook path in
    fp32) lies from ``exact`` (the same in float64, tests/rounding.py). Another summation order,
    not another computation: a wrong mask, scale or head is 10^3 yardsticks and more."""
    scale = want.abs().max().item()
    yard = yardstick({"out": want}, {"out": exact}, scale)
    ratio = assert_within({"out": got}, {"out": want}, yard, scale, what)
    print(f"{what}: {ratio:.2f} yardsticks ({yard:.1e})")


def double(module):
    return copy.deepcopy(module).double()


def padding(b, s, lengths):
    return (torch.arange(s)[None, :] < torch.tensor(lengths)[:, None]).long()


COMBOS = [c for c in itertools.product([False, True], repeat=5) if not (c[1] and c[4])]  # cross is never causal


@pytest.mark.parametrize("use_pad,causal,use_bias,gqa,cross", COMBOS)
def test_math_path_equals_sdpa_for_every_mask_combination(use_pad, causal, use_bias, gqa, cross):
    b, s_q, d, h = 3, 7, 32, 4
    s_k = 5 if cross else s_q
    fast, ref = make_pair(d_model=d, num_heads=h, num_kv_heads=2 if gqa else None)
    q = torch.randn(b, s_q, d)
    kv = torch.randn(b, s_k, d) if cross else q
    pad = padding(b, s_k, [s_k, s_k - 2, 1]) if use_pad else None
    bias = torch.randn(1, h, s_q, s_k) if use_bias else None
    out_fast = fast(q, kv, kv, pad, causal, attn_bias=bias)
    out_ref = ref(q, kv, kv, pad, causal, attn_bias=bias)
    assert out_fast.shape == (b, s_q, d)
    with float64_throughout():
        q64, kv64, bias64 = (t.double() if t is not None else None for t in (q, kv, bias))
        exact = double(ref)(q64, kv64, kv64, pad, causal, attn_bias=bias64)
    assert_rounding_close(out_fast, out_ref, exact)


def naive_attention(mha, q_in, kv_in, allowed):
    """Per-head loop with separate W^Q_i, W^K_i, W^V_i, then Concat(head_1..h) W^O (the paper)."""
    h, dk, dv = mha.num_heads, mha.d_k, mha.d_v
    heads = []
    for i in range(h):
        j = i // (h // mha.num_kv_heads)
        wq = mha.q_proj.weight[i * dk : (i + 1) * dk]
        bq = mha.q_proj.bias[i * dk : (i + 1) * dk]
        wk = mha.k_proj.weight[j * dk : (j + 1) * dk]
        bk = mha.k_proj.bias[j * dk : (j + 1) * dk]
        wv = mha.v_proj.weight[j * dv : (j + 1) * dv]
        bv = mha.v_proj.bias[j * dv : (j + 1) * dv]
        Q, K, V = q_in @ wq.T + bq, kv_in @ wk.T + bk, kv_in @ wv.T + bv
        scores = Q @ K.transpose(-1, -2) / math.sqrt(dk)
        if allowed is not None:
            scores = scores.masked_fill(~allowed[:, 0], float("-inf"))
        heads.append(torch.softmax(scores, -1) @ V)
    return torch.cat(heads, dim=-1) @ mha.o_proj.weight.T + mha.o_proj.bias


@pytest.mark.parametrize("impl", ["sdpa", "math"])
@pytest.mark.parametrize("kv_heads,d_k,d_v", [(None, None, None), (2, None, None), (1, 8, 12)])
def test_equals_naive_per_head_loop(impl, kv_heads, d_k, d_v):
    b, s, d, h = 2, 6, 24, 4
    mha = MultiHeadAttention(d, h, num_kv_heads=kv_heads, d_k=d_k, d_v=d_v, impl=impl).eval()
    x = torch.randn(b, s, d)
    pad = padding(b, s, [6, 4])
    for causal in (False, True):
        allowed = build_mask(pad, causal, s, s, x.device)
        expected = naive_attention(mha, x, x, allowed)
        got = mha(x, padding_mask=pad, causal=causal)
        with float64_throughout():
            exact = naive_attention(double(mha), x.double(), x.double(), allowed)
        # Compare real positions only: padding queries attend to padding-free keys either way.
        real = pad[..., None]
        assert_rounding_close(got * real, expected * real, exact * real, causal)


def test_padding_mask_broadcasts_to_b_h_sq_sk():
    pad = padding(2, 5, [5, 3])
    m = build_mask(pad, True, 5, 5, torch.device("cpu"))
    assert m.shape == (2, 1, 5, 5)
    full = m.expand(2, 4, 5, 5)
    assert not full[1, :, :, 3:].any()  # padded keys are never attended
    assert full[0, 2, 4, :].all()  # last query sees every real key when causal
    assert not full[0, 0, 1, 2:].any()  # no query sees the future


def test_fully_masked_rows_stay_finite():
    fast, ref = make_pair(d_model=16, num_heads=2)
    x = torch.randn(1, 4, 16)
    pad = torch.zeros(1, 4, dtype=torch.long)
    assert torch.isfinite(fast(x, padding_mask=pad)).all()
    assert torch.isfinite(ref(x, padding_mask=pad, causal=True)).all()


def test_scale_switch_removes_one_over_sqrt_dk():
    d, h = 16, 2
    a = MultiHeadAttention(d, h, scale=True, impl="math").eval()
    b = MultiHeadAttention(d, h, scale=False, impl="math").eval()
    b.load_state_dict(a.state_dict())
    with torch.no_grad():  # fold 1/sqrt(d_k) into W^Q: unscaled attention must then match
        b.q_proj.weight.mul_(1 / math.sqrt(d // h))
        b.q_proj.bias.mul_(1 / math.sqrt(d // h))
    x = torch.randn(2, 5, d)
    with float64_throughout():  # the yardstick: the scaled path in float64
        exact = double(a)(x.double())
    assert_rounding_close(b(x), a(x), exact, "folded scale")
    with torch.no_grad():  # and without the fold, the two differ
        b.q_proj.weight.mul_(math.sqrt(d // h))
        b.q_proj.bias.mul_(math.sqrt(d // h))
    assert not torch.allclose(a(x), b(x), atol=1e-4)


@pytest.mark.parametrize("impl", ["sdpa", "math"])
def test_kv_cache_last_token_query_matches_full_recompute(impl):
    d, h, s = 32, 4, 9
    mha = MultiHeadAttention(d, h, num_kv_heads=2, impl=impl).eval()
    rot = Rotary(d // h)
    x = torch.randn(2, s, d)
    full = mha(x, causal=True, rotary=rot(torch.arange(s)))
    cache = KVCache()
    steps = [mha(x[:, :4], causal=True, rotary=rot(torch.arange(4)), cache=cache)]
    for t in range(4, s):
        steps.append(mha(x[:, t : t + 1], causal=True, rotary=rot(torch.tensor([t])), cache=cache))
    with float64_throughout():
        exact = double(mha)(x.double(), causal=True, rotary=rot(torch.arange(s)))
    assert_rounding_close(torch.cat(steps, 1), full, exact)
    assert cache.length == s


def test_static_cross_cache_projects_memory_once():
    mha = MultiHeadAttention(16, 2).eval()
    calls = []
    mha.k_proj.register_forward_hook(lambda *a: calls.append(1))
    memory = torch.randn(2, 5, 16)
    cache = KVCache(static=True)
    outs = [mha(torch.randn(2, 1, 16), memory, memory, cache=cache) for _ in range(4)]
    assert len(calls) == 1 and cache.length == 5 and outs[-1].shape == (2, 1, 16)


def test_dropout_only_in_training():
    mha = MultiHeadAttention(16, 2, dropout=0.5, attn_dropout=0.5)
    x = torch.randn(2, 5, 16)
    mha.eval()
    torch.testing.assert_close(mha(x), mha(x))
    mha.train()
    assert not torch.allclose(mha(x), mha(x))


def test_bad_shapes_raise_clear_errors():
    with pytest.raises(ValueError, match="not divisible by num_heads"):
        MultiHeadAttention(30, 4)
    with pytest.raises(ValueError, match="not a multiple of num_kv_heads"):
        MultiHeadAttention(32, 4, num_kv_heads=3)
    mha = MultiHeadAttention(16, 2)
    with pytest.raises(ValueError, match="padding_mask must be"):
        mha(torch.randn(2, 5, 16), padding_mask=torch.ones(2, 4))
