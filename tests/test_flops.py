"""The FLOPs formula per family equals what torch's FlopCounterMode counts on a real step."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from tformer import build_model
from tformer.models import spec_of
from tformer.models.block_flops import keys_per_query
from tformer.models.flops import training_flops, training_flops_per_token
from tformer.nn.moe import Experts

from conftest import TINY


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("overrides", [{}, {"num_kv_heads": 1, "d_head": 24, "pad_vocab_multiple": 64}])
def test_training_flops_match_flop_counter(name, overrides):
    if overrides.get("num_kv_heads") and name != "llama-tiny":
        overrides = {"d_head": 24, "pad_vocab_multiple": 64}
    # The explicit math path runs attention as plain matmuls, which the counter sees exactly.
    model = build_model(name, attn_impl="math", vocab_size=1000, **overrides)
    for module in model.modules():
        if isinstance(module, Experts):
            module.grouped = False  # the counter has no formula for torch._grouped_mm; plain matmuls it sees
    b, s, t = 2, 24, 10
    ids = torch.randint(0, 1000, (b, s))
    labels = torch.randint(0, 1000, (b, t if model.config.family == "encdec" else s))
    with FlopCounterMode(display=False) as counter:
        model(ids, labels=labels).loss.backward()
    # windowed presets (ModernBERT, Gemma): the math path also multiplies the keys outside each window
    assert counter.get_total_flops() == training_flops(model.config, b, s, t) + 3 * _outside_windows(model.config, b, s, t)


def test_flops_per_token_grows_with_context_and_is_6n_for_short_sequences():
    with torch.device("meta"):
        cfg = build_model("gpt2-small").config
        n = build_model("gpt2-small").num_parameters(exclude_embeddings=True) + 50257 * 768
    short, long = training_flops_per_token(cfg, 8), training_flops_per_token(cfg, 1024)
    assert long > short
    assert short == pytest.approx(6 * n, rel=0.01)  # the 6N rule when attention is negligible


def test_encdec_needs_target_len():
    cfg = build_model("t5-tiny").config
    with pytest.raises(ValueError, match="target_len"):
        training_flops(cfg, 1, 8)


def test_moe_flops_and_parameters_are_the_active_ones():
    """Mixtral 8x7B: 46.7B parameters, 12.9B active per token (Mistral AI's figures); FLOPs per
    token follow the active ones (6N at short sequences), and a Switch model counts every other block."""
    with torch.device("meta"):
        mixtral = build_model("mixtral-8x7b")
        assert mixtral.num_parameters() == 46_702_792_704
        active = mixtral.num_active_parameters()
        assert round(active / 1e9, 1) == 12.9
        lookup = 32000 * 4096  # the input embedding is a lookup, no matmul (the untied head is one)
        per_token = training_flops_per_token(mixtral.config, 8)
        assert per_token == pytest.approx(6 * (active - lookup), rel=0.002)
        dense = build_model("t5-tiny", d_ff=128)
        switch = build_model("switch-tiny")
    assert training_flops(switch.config, 2, 24, 10) > training_flops(dense.config, 2, 24, 10)  # + routers


def _counted(model, b, s, t=None):
    for module in model.modules():
        if isinstance(module, Experts):
            module.grouped = False
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (b, s))
    labels = torch.randint(0, vocab, (b, t if model.config.family == "encdec" else s))
    with FlopCounterMode(display=False) as counter:
        model(ids, labels=labels).loss.backward()
    return counter.get_total_flops()


# (preset, overrides): causal windows on every other block with sinks (gpt-oss); bidirectional
# windows with every third block global from block 0 (ModernBERT's pattern); an encoder-decoder whose
# two stacks window differently (causal decoder, bidirectional encoder)
WINDOWED = [
    ("gpt-oss-tiny", {}),
    ("bert-tiny", {"attn_window": 8, "global_every": 3, "global_offset": 0, "position": "rotary"}),
    ("t5-v1.1-tiny", {"attn_window": 6, "global_every": 2}),
]


@pytest.mark.parametrize("name, overrides", WINDOWED, ids=[w[0] for w in WINDOWED])
def test_a_windowed_blocks_attention_flops_grow_with_the_window_not_the_sequence(name, overrides):
    """The math path multiplies every query by every key and masks afterwards, so FlopCounterMode
    sees the whole S x S; the count takes each windowed block's queries against the keys of its
    window only (``keys_per_query``): the two differ by exactly the keys outside the windows, in
    QK^T and PV, forward and backward (3x)."""
    model = build_model(name, attn_impl="math", **overrides)
    cfg = model.config
    b, s, t = 2, 24, 20
    spec = spec_of(cfg)
    for stack, (blocks, length, _) in enumerate(spec.stack_shapes(cfg, s, t)):
        causal = spec.causal_lm or (spec.seq2seq and stack == 1)  # an encoder-decoder's decoder
        for i in range(blocks):
            w = cfg.stack_config(causal).layer_window(i)
            if w is not None:
                keys = keys_per_query(cfg, i, length, causal)
                assert keys == (w if causal else 2 * (w // 2) + 1) < length  # narrower than the sequence
                assert keys_per_query(cfg, i, 100 * length, causal) == keys  # the window's, whatever the length
    outside = _outside_windows(cfg, b, s, t)
    assert outside > 0
    assert _counted(model, b, s, t) == training_flops(cfg, b, s, t) + 3 * outside


def _outside_windows(cfg, b, s, t):
    """Forward FLOPs of the score and value matmuls against the keys outside each windowed block's
    window: what the math path computes (and masks) beyond what the count takes."""
    h, dk, spec = cfg.num_heads, cfg.head_dim, spec_of(cfg)
    outside = 0
    for stack, (blocks, length, _) in enumerate(spec.stack_shapes(cfg, s, t)):
        causal = spec.causal_lm or (spec.seq2seq and stack == 1)  # an encoder-decoder's decoder
        for i in range(blocks):
            keys = keys_per_query(cfg, i, length, causal)
            outside += 2 * (2 * b * length * (length - keys) * h * dk)  # scores and values
    return outside


@pytest.mark.parametrize(
    "overrides",
    [{"mtp_depth": 1}, {"mtp_depth": 2, "mla": {"q_lora_rank": None}}],
    ids=["mtp1", "mtp2-no-q-lora"],
)
def test_latent_attention_and_multi_token_prediction_flops_match_flop_counter(overrides):
    """DeepSeek-V3's blocks (latent attention with and without the query's low-rank pair, the first
    block dense, shared experts) plus each MTP depth: its projection, its block (MoE, the index after
    the trunk's) and the shared head, counted as torch counts the real forward and backward."""
    model = build_model("deepseek-v3-tiny", attn_impl="math", **overrides)
    model.train()
    b, s = 2, 24
    assert _counted(model, b, s) == training_flops(model.config, b, s)
    plain = build_model("deepseek-v3-tiny", attn_impl="math", **{**overrides, "mtp_depth": 0}).config
    assert training_flops(model.config, b, s) > training_flops(plain, b, s)


def test_latent_attention_flops_by_hand():
    """One MLA layer at small shapes, counted from its matrices: q down (d x r_q) and up
    (r_q x h(nope + rope)), the latent and rope key down (d x (r_kv + rope)), the latent's up to
    each head's key part and value (r_kv x h(nope + v)), scores at width nope + rope, values at v,
    the output (h v x d): 2 FLOPs per multiply-add."""
    from tformer.models.block_flops import attention_flops

    cfg = build_model("deepseek-v3-tiny").config
    m, d, h, n = cfg.mla, cfg.d_model, cfg.num_heads, 10  # tokens = keys per query = 10
    assert (d, h, m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim) == (
        64, 4, 32, 24, 16, 8, 16
    )  # fmt: skip
    q = 2 * n * (64 * 32 + 32 * 4 * 24)
    kv = 2 * n * (64 * (24 + 8) + 24 * 4 * (16 + 16))
    core = 2 * n * n * 4 * 24 + 2 * n * n * 4 * 16
    out = 2 * n * 4 * 16 * 64
    assert attention_flops(cfg, n, n, n) == q + kv + core + out
