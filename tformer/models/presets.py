"""Named model sizes. Standard presets reproduce the published HF configurations exactly
(parameter counts are checked against ``transformers`` in the tests); ``*-tiny`` are for tests."""

from __future__ import annotations

import difflib

from ..config import ConfigError, ModelConfig
from .presets_gemma import GEMMA_PRESETS

BERT = dict(
    family="encoder",
    flavour="bert",
    vocab_size=30522,
    max_seq_len=512,
    position="learned",
    norm="layernorm",
    norm_eps=1e-12,
    norm_position="post",
    activation="gelu",
    type_vocab_size=2,
    embed_norm=True,
    tie_embeddings=True,
    pad_token_id=0,
    dropout=0.1,
    attn_dropout=0.1,
)
# ModernBERT (Warner et al. 2024; HF ModernBertForMaskedLM, tformer/export/modernbert.py): pre-norm,
# RoPE, GeGLU (erf GELU), no biases, LayerNorms without bias, the embeddings normed (that norm is
# block 0's attention norm), every third block global from block 0 with RoPE base 160k, the others a
# 128-token bidirectional window with base 10k, a final norm, a bias-free head dense layer
MODERNBERT = dict(
    family="encoder",
    flavour="modernbert",
    vocab_size=50368,
    max_seq_len=8192,
    position="rotary",
    rope_theta=160000.0,
    rope_local_theta=10000.0,
    attn_window=128,
    global_every=3,
    global_offset=0,
    norm="layernorm",
    norm_eps=1e-5,
    norm_bias=False,
    norm_position="pre",
    activation="geglu_exact",
    bias=False,
    embed_norm=True,
    first_attn_norm=False,
    head_bias=False,
    tie_embeddings=True,
    pad_token_id=50283,
    bos_token_id=50281,
    eos_token_id=50282,
)
GPT2 = dict(
    family="decoder",
    flavour="gpt2",
    vocab_size=50257,
    max_seq_len=1024,
    position="learned",
    norm="layernorm",
    norm_eps=1e-5,
    norm_position="pre",
    activation="gelu_tanh",
    tie_embeddings=True,
    bos_token_id=50256,
    eos_token_id=50256,
    pad_token_id=50256,
)
LLAMA = dict(
    family="decoder",
    flavour="llama",
    position="rotary",
    norm="rmsnorm",
    norm_eps=1e-5,
    norm_position="pre",
    activation="swiglu",
    bias=False,
    norm_bias=False,
)
T5 = dict(
    family="encdec",
    flavour="t5",
    vocab_size=32128,
    max_seq_len=512,
    position="relative",
    norm="rmsnorm",
    norm_eps=1e-6,
    norm_position="pre",
    activation="relu",
    bias=False,
    norm_bias=False,
    attn_scale=False,
    tie_embeddings=True,
    tied_output_scale=True,
    rel_num_buckets=32,
    rel_max_distance=128,
    pad_token_id=0,
    eos_token_id=1,
    decoder_start_token_id=0,
    dropout=0.1,
)
# "Attention Is All You Need": post-norm LayerNorm, sinusoidal positions, ReLU, embeddings scaled by
# sqrt(d_model) and shared by source, target and the pre-softmax projection (a joint vocabulary of
# 37000 BPE tokens for English-German). HF counterpart: MarianMTModel (see tformer/export/marian.py).
TRANSFORMER = dict(
    family="encdec",
    flavour="marian",
    vocab_size=37000,
    max_seq_len=1024,
    position="sinusoidal",
    norm="layernorm",
    norm_eps=1e-5,
    norm_position="post",
    activation="relu",
    bias=True,
    attn_scale=True,
    embed_scale=True,
    tie_embeddings=True,
    tied_output_scale=False,
    pad_token_id=0,
    eos_token_id=1,
    decoder_start_token_id=0,
    dropout=0.1,
    attn_dropout=0.0,
)
T5_V11 = dict(T5, activation="geglu", tie_embeddings=False, tied_output_scale=False, dropout=0.0)
# Mixture-of-experts flavours (model.moe; HF twins in tformer/export/mixtral.py, qwen2_moe.py,
# switch_transformers.py). Mixtral: Llama with 8 SwiGLU experts in every block, top-2, softmax over
# the two chosen logits, dropless.
MIXTRAL = dict(
    LLAMA,
    flavour="mixtral",
    moe=dict(num_experts=8, top_k=2, router_softmax="topk", aux_loss_coef=0.02),
)
# Qwen2-MoE: Llama with q/k/v biases; 60 narrow experts (top-4, not renormalised) plus a shared
# expert as wide as four of them, gated by sigmoid(linear(x)), on every block
QWEN2_MOE = dict(
    LLAMA,
    flavour="qwen2_moe",
    qkv_bias=True,
    norm_eps=1e-6,
    moe=dict(num_experts=60, top_k=4, num_shared_experts=4, shared_gate=True, aux_loss_coef=1e-3),
)
# Qwen3: Llama with an RMSNorm over each head's q and k before RoPE, head width 128 whatever
# d_model, RoPE theta 1e6, no biases (HF Qwen3ForCausalLM; tformer/export/qwen3.py)
QWEN3 = dict(
    LLAMA,
    flavour="qwen3",
    qk_norm="head",
    norm_eps=1e-6,
    rope_theta=1e6,
    vocab_size=151936,
    max_seq_len=40960,
    d_head=128,
    bos_token_id=151643,
    eos_token_id=151645,
    pad_token_id=151643,
)
# Qwen3-MoE: Qwen3's attention, 128 narrow experts on every block, top-8 of a softmax over all of
# them renormalised (HF Qwen3MoeForCausalLM; tformer/export/qwen3_moe.py)
QWEN3_MOE = dict(
    QWEN3,
    flavour="qwen3_moe",
    moe=dict(num_experts=128, top_k=8, d_expert=768, renormalize=True, aux_loss_coef=1e-3),
)
# gpt-oss: biases on q/k/v/o, a sink logit per head, a 128-token window on every other block (the
# first local), YaRN (x32 over 4096), experts with biases and a clamped SwiGLU on every block, top-4
# of a softmax over the chosen logits, a router with a bias (HF GptOssForCausalLM; export/gpt_oss.py)
GPT_OSS = dict(
    LLAMA,
    flavour="gpt_oss",
    bias=True,
    vocab_size=201088,
    max_seq_len=131072,
    d_model=2880,
    num_heads=64,
    num_kv_heads=8,
    d_head=64,
    d_ff=2880,
    rope_theta=150000.0,
    yarn=dict(factor=32.0, original_max_seq_len=4096, truncate=False),
    attn_window=128,
    global_every=2,
    attn_sinks=True,
    tie_embeddings=False,
    bos_token_id=199998,
    eos_token_id=200002,
    pad_token_id=199999,
)
GPT_OSS_MOE = dict(
    top_k=4, d_expert=2880, router_softmax="topk", router_bias=True, expert_bias=True, swiglu_limit=7.0, aux_loss_coef=1e-3
)
# Switch Transformer: T5 v1.0 with 8 ReLU experts on every other block, top-1, capacity per sequence
SWITCH = dict(
    T5,
    flavour="switch_transformers",
    moe=dict(num_experts=8, top_k=1, moe_every=2, expert_capacity=64, jitter=0.01, aux_loss_coef=1e-3, z_loss_coef=1e-3),
)
# DeepSeek-V3: Llama's block with multi-head latent attention and, after the first dense blocks,
# sigmoid-scored, group-limited routing over fine-grained experts plus a shared one; loss-free
# balancing (bias_update_rate 1e-3, the paper's gamma) and a tiny sequence-wise balance loss
DEEPSEEK_V3_MLA: dict = dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
DEEPSEEK_V3_MOE: dict = dict(
    num_experts=256,
    top_k=8,
    router_score="sigmoid",
    renormalize=True,
    n_group=8,
    topk_group=4,
    routed_scaling_factor=2.5,
    num_shared_experts=1,
    first_dense=3,
    bias_update_rate=1e-3,
    seq_aux_loss_coef=1e-4,
    aux_loss_coef=0.0,
)
DEEPSEEK_V3 = dict(
    LLAMA,
    flavour="deepseek_v3",
    num_kv_heads=None,
    norm_eps=1e-6,
    attention="mla",
    mla=DEEPSEEK_V3_MLA,
    moe=DEEPSEEK_V3_MOE,
)

PRESETS: dict[str, dict] = {
    "bert-base": dict(BERT, d_model=768, num_layers=12, num_heads=12, d_ff=3072),
    "bert-large": dict(BERT, d_model=1024, num_layers=24, num_heads=16, d_ff=4096),
    # ModernBERT-base / -large (HF answerdotai/ModernBERT-base, -large): 149M and 395M parameters
    "modernbert-base": dict(MODERNBERT, d_model=768, num_layers=22, num_heads=12, d_ff=1152),
    "modernbert-large": dict(MODERNBERT, d_model=1024, num_layers=28, num_heads=16, d_ff=2624),
    "gpt2-small": dict(GPT2, d_model=768, num_layers=12, num_heads=12, d_ff=3072),
    "gpt2-medium": dict(GPT2, d_model=1024, num_layers=24, num_heads=16, d_ff=4096),
    "gpt2-large": dict(GPT2, d_model=1280, num_layers=36, num_heads=20, d_ff=5120),
    "gpt2-xl": dict(GPT2, d_model=1600, num_layers=48, num_heads=25, d_ff=6400),
    # Llama 3.2 1B shape: 16 layers, GQA 32/8, SwiGLU 8192, tied embeddings, RoPE theta 5e5.
    "llama-1b": dict(
        LLAMA,
        vocab_size=128256,
        d_model=2048,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        d_ff=8192,
        max_seq_len=8192,
        rope_theta=500000.0,
        tie_embeddings=True,
        bos_token_id=128000,
        eos_token_id=128001,
        pad_token_id=128001,
    ),
    # Llama 3 8B / 70B shapes (config only: planned, exported, never built at full size in tests):
    # GQA with 8 KV heads, SwiGLU, RoPE theta 5e5, untied output head.
    "llama-8b": dict(
        LLAMA,
        vocab_size=128256,
        d_model=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        d_ff=14336,
        max_seq_len=8192,
        rope_theta=500000.0,
        tie_embeddings=False,
        bos_token_id=128000,
        eos_token_id=128001,
        pad_token_id=128001,
    ),
    "llama-70b": dict(
        LLAMA,
        vocab_size=128256,
        d_model=8192,
        num_layers=80,
        num_heads=64,
        num_kv_heads=8,
        d_ff=28672,
        max_seq_len=8192,
        rope_theta=500000.0,
        tie_embeddings=False,
        bos_token_id=128000,
        eos_token_id=128001,
        pad_token_id=128001,
    ),
    "t5-small": dict(T5, d_model=512, d_head=64, num_layers=6, num_heads=8, d_ff=2048),
    "t5-base": dict(T5, d_model=768, d_head=64, num_layers=12, num_heads=12, d_ff=3072),
    "t5-large": dict(T5, d_model=1024, d_head=64, num_layers=24, num_heads=16, d_ff=4096),
    # T5 v1.0 3B / 11B: d_model 1024 with wide heads (d_kv 128) and a wide ReLU FFN (config only)
    "t5-3b": dict(T5, d_model=1024, d_head=128, num_layers=24, num_heads=32, d_ff=16384),
    "t5-11b": dict(T5, d_model=1024, d_head=128, num_layers=24, num_heads=128, d_ff=65536),
    "t5-v1.1-small": dict(T5_V11, d_model=512, d_head=64, num_layers=8, num_heads=6, d_ff=1024),
    "transformer-base": dict(TRANSFORMER, d_model=512, num_layers=6, num_heads=8, d_ff=2048),
    "transformer-big": dict(TRANSFORMER, d_model=1024, num_layers=6, num_heads=16, d_ff=4096, dropout=0.3),
    # Tiny sizes: same switches, toy widths (fast CPU tests); vocab fits the test tokenizers.
    "bert-tiny": dict(
        BERT,
        vocab_size=1024,
        max_seq_len=128,
        d_model=64,
        num_layers=2,
        num_heads=4,
        d_ff=128,
        dropout=0.0,
        attn_dropout=0.0,
    ),
    # three blocks: global, local, local; a 16-token window
    "modernbert-tiny": dict(
        MODERNBERT,
        vocab_size=1024,
        max_seq_len=128,
        d_model=64,
        num_layers=3,
        num_heads=4,
        d_ff=96,
        attn_window=16,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
    ),
    "gpt2-tiny": dict(
        GPT2,
        vocab_size=1024,
        max_seq_len=128,
        d_model=64,
        num_layers=2,
        num_heads=4,
        d_ff=256,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    ),
    "llama-tiny": dict(
        LLAMA,
        vocab_size=1024,
        max_seq_len=128,
        d_model=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        d_ff=176,
        tie_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    ),
    "t5-tiny": dict(
        T5,
        vocab_size=1024,
        max_seq_len=128,
        d_model=64,
        d_head=16,
        num_layers=2,
        num_heads=4,
        d_ff=128,
        rel_num_buckets=8,
        rel_max_distance=32,
        dropout=0.0,
    ),
    "t5-v1.1-tiny": dict(
        T5_V11,
        vocab_size=1024,
        max_seq_len=128,
        d_model=64,
        d_head=16,
        num_layers=2,
        num_decoder_layers=3,
        num_heads=4,
        d_ff=96,
        rel_num_buckets=8,
        rel_max_distance=32,
    ),
    # Mixtral 8x7B (config only: 46.7B parameters, 12.9B active per token)
    "mixtral-8x7b": dict(
        MIXTRAL,
        vocab_size=32000,
        d_model=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        d_ff=14336,
        max_seq_len=32768,
        rope_theta=1e6,
        tie_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    ),
    "mixtral-tiny": dict(
        MIXTRAL,
        vocab_size=1024,
        max_seq_len=128,
        d_model=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        d_ff=96,
        tie_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        moe=dict(num_experts=4, top_k=2, router_softmax="topk", aux_loss_coef=0.02),
    ),
    # Qwen1.5-MoE-A2.7B (HF Qwen/Qwen1.5-MoE-A2.7B; config only: 14.3B parameters, 2.7B active)
    "qwen2-moe-a2.7b": dict(
        QWEN2_MOE,
        vocab_size=151936,
        d_model=2048,
        num_layers=24,
        num_heads=16,
        d_ff=5632,
        max_seq_len=8192,
        rope_theta=1e6,
        tie_embeddings=False,
        bos_token_id=151643,
        eos_token_id=151643,
        pad_token_id=151643,
        moe=dict(
            num_experts=60, top_k=4, num_shared_experts=4, d_expert=1408, d_shared=1408, shared_gate=True, aux_loss_coef=1e-3
        ),
    ),
    "qwen2-moe-tiny": dict(
        QWEN2_MOE,
        vocab_size=1024,
        max_seq_len=128,
        d_model=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        d_ff=128,
        tie_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        moe=dict(num_experts=6, top_k=2, d_expert=32, num_shared_experts=2, d_shared=32, shared_gate=True),
    ),
    # DeepSeek-V3 (HF deepseek-ai/DeepSeek-V3; config only: 671B parameters, 37B active; its MTP
    # module, 14B more, is not built here), YaRN-extended from 4k to 160k positions
    "deepseek-v3": dict(
        DEEPSEEK_V3,
        vocab_size=129280,
        d_model=7168,
        num_layers=61,
        num_heads=128,
        d_ff=18432,
        max_seq_len=163840,
        tie_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
        yarn=dict(factor=40.0, original_max_seq_len=4096, beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
        moe=dict(DEEPSEEK_V3_MOE, d_expert=2048),
    ),
    # Moonlight-16B-A3B (HF moonshotai/Moonlight-16B-A3B, a DeepseekV3ForCausalLM; config only: ~16B
    # parameters, ~3B active): no query bottleneck, 64 experts in one group, top-6, two shared
    "moonlight-16b-a3b": dict(
        DEEPSEEK_V3,
        vocab_size=163840,
        d_model=2048,
        num_layers=27,
        num_heads=16,
        d_ff=11264,
        max_seq_len=8192,
        rope_theta=50000.0,
        norm_eps=1e-5,
        tie_embeddings=False,
        bos_token_id=163584,
        eos_token_id=163585,
        pad_token_id=163585,
        mla=dict(DEEPSEEK_V3_MLA, q_lora_rank=None),
        moe=dict(
            DEEPSEEK_V3_MOE,
            num_experts=64,
            top_k=6,
            d_expert=1408,
            num_shared_experts=2,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=2.446,
            first_dense=1,
        ),
    ),
    "deepseek-v3-tiny": dict(
        DEEPSEEK_V3,
        vocab_size=1024,
        max_seq_len=128,
        d_model=64,
        num_layers=3,
        num_heads=4,
        d_ff=128,
        tie_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        mla=dict(q_lora_rank=32, kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
        moe=dict(DEEPSEEK_V3_MOE, num_experts=8, top_k=2, d_expert=32, n_group=4, topk_group=2, first_dense=1),
    ),
    # Qwen3-0.6B and Qwen3-8B (HF Qwen/Qwen3-0.6B, Qwen/Qwen3-8B): 0.6B parameters (tied), 8.2B
    "qwen3-0.6b": dict(QWEN3, d_model=1024, num_layers=28, num_heads=16, num_kv_heads=8, d_ff=3072, tie_embeddings=True),
    "qwen3-8b": dict(QWEN3, d_model=4096, num_layers=36, num_heads=32, num_kv_heads=8, d_ff=12288, tie_embeddings=False),
    # heads wider than d_model / num_heads (4 x 24 = 96 > 64), as in Qwen3-0.6B (16 x 128 > 1024)
    "qwen3-tiny": dict(
        QWEN3,
        vocab_size=1024,
        max_seq_len=128,
        d_model=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        d_head=24,
        d_ff=176,
        tie_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    ),
    # Qwen3-30B-A3B (HF Qwen/Qwen3-30B-A3B): 30.5B parameters, 3.3B active
    "qwen3-30b-a3b": dict(
        QWEN3_MOE, d_model=2048, num_layers=48, num_heads=32, num_kv_heads=4, d_ff=6144, tie_embeddings=False
    ),
    "qwen3-moe-tiny": dict(
        QWEN3_MOE,
        vocab_size=1024,
        max_seq_len=128,
        d_model=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        d_head=24,
        d_ff=128,
        tie_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        moe=dict(num_experts=8, top_k=2, d_expert=48, renormalize=True, aux_loss_coef=1e-3),
    ),
    # gpt-oss-20b and gpt-oss-120b (HF openai/gpt-oss-20b, -120b): 21B / 3.6B active, 117B / 5.1B
    "gpt-oss-20b": dict(GPT_OSS, num_layers=24, moe=dict(GPT_OSS_MOE, num_experts=32)),
    "gpt-oss-120b": dict(GPT_OSS, num_layers=36, moe=dict(GPT_OSS_MOE, num_experts=128)),
    "gpt-oss-tiny": dict(
        GPT_OSS,
        vocab_size=1024,
        max_seq_len=128,
        d_model=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        d_head=16,
        d_ff=64,
        yarn=dict(factor=4.0, original_max_seq_len=32, truncate=False),
        attn_window=16,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        moe=dict(GPT_OSS_MOE, num_experts=4, top_k=2, d_expert=64),
    ),
    # Switch-Base-8 (Fedus et al. 2021; HF google/switch-base-8): T5 v1.0 base with 8 top-1 experts
    # on every other block, 64 tokens per expert per sequence (619M parameters)
    "switch-base-8": dict(SWITCH, d_model=768, d_head=64, num_layers=12, num_heads=12, d_ff=3072),
    "switch-tiny": dict(
        SWITCH,
        vocab_size=1024,
        max_seq_len=128,
        d_model=64,
        d_head=16,
        num_layers=2,
        num_heads=4,
        d_ff=128,
        rel_num_buckets=8,
        rel_max_distance=32,
        dropout=0.0,
        moe=dict(num_experts=4, top_k=1, moe_every=2, expert_capacity=16, aux_loss_coef=0.01, z_loss_coef=0.001),
    ),
    "transformer-tiny": dict(
        TRANSFORMER, vocab_size=1024, max_seq_len=128, d_model=64, num_layers=2, num_heads=4, d_ff=128, dropout=0.0
    ),
}

PRESETS.update(GEMMA_PRESETS)  # Gemma 3 and T5Gemma (presets_gemma.py)


def preset(name: str, **overrides) -> ModelConfig:
    if name not in PRESETS:
        close = difflib.get_close_matches(name, PRESETS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"unknown preset {name!r}{hint} (available: {', '.join(PRESETS)})")
    base = PRESETS[name]
    if isinstance(overrides.get("moe"), dict) and isinstance(base.get("moe"), dict):
        overrides = {**overrides, "moe": {**base["moe"], **overrides["moe"]}}  # model.moe.top_k=1 keeps the rest
    return ModelConfig.from_dict({**base, **overrides})
