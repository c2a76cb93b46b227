"""Position schemes: the paper's sinusoid formula, HF's rotate-half RoPE, T5 buckets, and the
permutation test (no positions = equivariant; every scheme breaks it)."""

import math

import pytest
import torch

import tformer
from tformer.nn import RelativePositionBias, Rotary, apply_rotary, relative_bucket, sinusoidal_table


def test_sinusoidal_table_matches_the_paper_formula():
    d, n = 16, 50
    pe = sinusoidal_table(n, d)
    for pos in (0, 1, 7, 49):
        for i in range(d // 2):
            angle = pos / 10000 ** (2 * i / d)
            assert pe[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert pe[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)


def test_rotary_matches_hf_rotate_half():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    hd, theta = 16, 10000.0
    rot = Rotary(hd, theta)
    pos = torch.arange(11)
    cos, sin = rot(pos)
    inv = 1.0 / theta ** (torch.arange(0, hd, 2).float() / hd)
    ang = torch.outer(pos.float(), inv)
    emb = torch.cat((ang, ang), -1)
    q, k = torch.randn(2, 3, 11, hd), torch.randn(2, 3, 11, hd)
    hq, hk = apply_rotary_pos_emb(q, k, emb.cos()[None], emb.sin()[None])
    torch.testing.assert_close(apply_rotary(q, cos, sin), hq)
    torch.testing.assert_close(apply_rotary(k, cos, sin), hk)
    # A rotation: norms are kept, and relative: <R(m)q, R(n)k> depends on m - n only.
    torch.testing.assert_close(apply_rotary(q, cos, sin).norm(dim=-1), q.norm(dim=-1))
    v1, v2 = torch.randn(hd), torch.randn(hd)

    def dot(m, n):
        c, s = rot(torch.tensor([m, n]))
        a = apply_rotary(v1.expand(1, 1, 2, hd), c, s)[0, 0, 0]
        b = apply_rotary(v2.expand(1, 1, 2, hd), c, s)[0, 0, 1]
        return (a @ b).item()

    assert dot(3, 1) == pytest.approx(dot(9, 7), abs=1e-4)


@pytest.mark.parametrize("bidirectional", [True, False])
def test_t5_buckets_match_hf(bidirectional):
    from transformers.models.t5.modeling_t5 import T5Attention

    rel = torch.arange(-300, 300)[None, :] - torch.arange(0, 7)[:, None]
    ours = relative_bucket(rel, bidirectional, 32, 128)
    theirs = T5Attention._relative_position_bucket(rel, bidirectional, 32, 128)
    assert torch.equal(ours, theirs)
    if not bidirectional:  # the future collapses into one bucket
        assert (ours[rel > 0] == 0).all()


def test_relative_bias_offset_matches_slice_of_full_table():
    rb = RelativePositionBias(4, bidirectional=False, num_buckets=8, max_distance=16)
    full = rb(10, 10)
    assert full.shape == (1, 4, 10, 10)
    torch.testing.assert_close(rb(1, 10, q_offset=9), full[:, :, 9:10])


def _permuted_equal(model, ids, perm):
    with torch.no_grad():
        h = model.hidden_states(ids)
        hp = model.hidden_states(ids[:, perm])
    return torch.allclose(h[:, perm], hp, atol=1e-5)


@pytest.mark.parametrize("position", ["learned", "sinusoidal", "rotary", "relative"])
def test_self_attention_is_permutation_equivariant_only_without_positions(position):
    perm = torch.tensor([3, 0, 5, 1, 7, 2, 6, 4])
    ids = torch.randint(0, 1000, (2, 8))
    plain = tformer.build_model("bert-tiny", position="none").eval()
    assert _permuted_equal(plain, ids, perm)
    with_pos = tformer.build_model("bert-tiny", position=position).eval()
    if position == "learned":
        torch.nn.init.normal_(with_pos.embed.pos.weight, std=1.0)
    if position == "relative":
        torch.nn.init.normal_(with_pos.encoder.rel_bias.embedding.weight, std=1.0)
    assert not _permuted_equal(with_pos, ids, perm)
