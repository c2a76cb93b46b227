"""Gemma 3 (decoder, text only) and T5Gemma (encoder-decoder of Gemma 2 blocks) sizes, merged into
``presets.PRESETS``. Published sizes follow the HF configurations (google/gemma-3-1b-pt, the text
model of google/gemma-3-4b-pt, google/t5gemma-2b-2b-ul2, google/t5gemma-s-s-ul2); counts are
checked against transformers' own models in tests/test_zoo_gemma.py."""

from __future__ import annotations

# What every Gemma block shares: RMSNorm gains stored as offsets from 1, a norm after each
# sub-layer too (sandwich), GeGLU with the tanh GELU, no biases, the embedding scaled by
# sqrt(d_model) rounded to the activations' dtype, the head tied to it
GEMMA_BLOCKS = dict(
    position="rotary",
    norm="rmsnorm",
    norm_eps=1e-6,
    norm_bias=False,
    norm_position="pre",
    norm_unit_offset=True,
    sandwich_norm=True,
    activation="geglu",
    bias=False,
    embed_scale=True,
    embed_scale_dtype=True,
    tie_embeddings=True,
    dropout=0.0,
)
# Gemma 3: QK-norm, five windowed blocks to one global (the sixth of each group), RoPE base 1M on
# the global blocks and 10k on the windowed ones; attention scaled by query_pre_attn_scalar**-0.5
GEMMA3 = dict(
    GEMMA_BLOCKS,
    family="decoder",
    flavour="gemma3",
    qk_norm="head",
    global_every=6,
    rope_theta=1_000_000.0,
    rope_local_theta=10_000.0,
    d_head=256,
    query_pre_attn_scalar=256.0,
    bos_token_id=2,
    eos_token_id=1,
    pad_token_id=0,
)
# T5Gemma: Gemma 2 blocks in both stacks (global every other block, windowed first), attention
# logits capped at 50 and output logits at 30; the encoder has a token embedding of its own, the
# decoder's is tied to the head; HF counts the encoder's window as a radius (twice ours)
T5GEMMA = dict(
    GEMMA_BLOCKS,
    family="encdec",
    flavour="t5gemma",
    shared_embeddings=False,
    vocab_size=256000,
    max_seq_len=8192,
    global_every=2,
    rope_theta=10_000.0,
    attn_softcap=50.0,
    final_softcap=30.0,
    attn_window=4096,
    encoder_window=8192,
    pad_token_id=0,
    eos_token_id=1,
    decoder_start_token_id=2,
)
_TINY = dict(vocab_size=1024, max_seq_len=128, d_model=64, num_heads=4, num_kv_heads=2, d_head=16, d_ff=128)

GEMMA_PRESETS: dict[str, dict] = {
    # Gemma 3 1B (HF google/gemma-3-1b-pt): 1.0B parameters, MQA, windows of 512
    "gemma3-1b": dict(
        GEMMA3,
        vocab_size=262144,
        max_seq_len=32768,
        d_model=1152,
        num_layers=26,
        num_heads=4,
        num_kv_heads=1,
        d_ff=6912,
        attn_window=512,
    ),
    # Gemma 3 4B's text model (HF google/gemma-3-4b-pt's text_config): windows of 1024, the global
    # blocks' RoPE linearly scaled by 8 for a 128k context
    "gemma3-4b": dict(
        GEMMA3,
        vocab_size=262208,
        max_seq_len=131072,
        d_model=2560,
        num_layers=34,
        num_heads=8,
        num_kv_heads=4,
        d_ff=10240,
        attn_window=1024,
        rope_linear=8.0,
    ),
    # six blocks: five windowed (16) and one global
    "gemma3-tiny": dict(
        GEMMA3, **_TINY, num_layers=6, attn_window=16, query_pre_attn_scalar=16.0, bos_token_id=0, eos_token_id=0
    ),
    # T5Gemma 2B-2B (HF google/t5gemma-2b-2b-ul2): Gemma 2 2B in each stack
    "t5gemma-2b-2b": dict(
        T5GEMMA, d_model=2304, num_layers=26, num_heads=8, num_kv_heads=4, d_head=256, d_ff=9216, query_pre_attn_scalar=256.0
    ),
    # T5Gemma S-S (HF google/t5gemma-s-s-ul2): T5-small's shape in Gemma 2 blocks
    "t5gemma-s-s": dict(
        T5GEMMA, d_model=512, num_layers=8, num_heads=8, num_kv_heads=8, d_head=64, d_ff=1024, query_pre_attn_scalar=64.0
    ),
    "t5gemma-tiny": dict(
        T5GEMMA,
        **_TINY,
        num_layers=2,
        attn_window=16,
        encoder_window=32,
        query_pre_attn_scalar=16.0,
        decoder_start_token_id=0,
        eos_token_id=1,
    ),
}
