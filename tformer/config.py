"""Typed model configuration: one dataclass whose fields are the family switches, and the checks
every config dataclass (this one and the run config's sections) gets from its annotations.

Every error names the field and the allowed values, in one line. Each choice is a ``Literal``
type: the field's annotation, the tuple of allowed values and the error message all come from it,
so a new value is added in one place.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, get_args

from .config_checks import (  # noqa: F401 - re-exported: the rest of the house imports them from here
    ConfigError,
    check_table,
    parse_range,
    in_range,
    ranged,
    positive,
    _range_words,
    range_error,
    check_ranges,
    ranges,
    _divisors,
    config_key,
    check_keys,
    field_hints,
    unwrap_optional,
    choices,
    _check_type,
    _check_choice,
    _walk,
    check_fields,
)


# -- the model's choices ---------------------------------------------------------------------------
Family = Literal["encoder", "decoder", "encdec"]
Position = Literal["none", "learned", "sinusoidal", "rotary", "relative"]
Norm = Literal["layernorm", "rmsnorm"]
NormPosition = Literal["pre", "post"]
# geglu: the gate through the tanh GELU (Gemma, T5 v1.1); geglu_exact: through the erf GELU (ModernBERT)
Activation = Literal["relu", "gelu", "gelu_tanh", "silu", "swiglu", "geglu", "geglu_exact"]
AttnImpl = Literal["sdpa", "math"]
RouterSoftmax = Literal["all", "topk"]
RouterScore = Literal["softmax", "sigmoid"]
AttentionKind = Literal["mha", "mla"]
# "head": an RMSNorm over each head's query and key (width d_head, one gain shared by the heads)
# before RoPE (Qwen3, Gemma 3); "none": none
QKNorm = Literal["none", "head"]

# -- training choices the lower layers act on ------------------------------------------------------
# They live here, not in tformer/train/config.py (which re-exports them), because nn, models, data
# and parallel may import this module but not the train layer above them.
# fp8: the blocks' linear layers in float8 (torchao), bf16 autocast elsewhere (tformer/parallel/float8.py)
Precision = Literal["auto", "bf16", "fp32", "fp16", "fp8"]
StrategyName = Literal["ddp", "fsdp", "deepspeed"]
ACMode = Literal["none", "full", "selective", "op"]
PPSchedule = Literal["gpipe", "1f1b", "interleaved_1f1b"]
LengthNorm = Literal["gnmt", "power"]
OnExhausted = Literal["repeat", "stop"]

FAMILIES: tuple[Family, ...] = get_args(Family)
POSITIONS: tuple[Position, ...] = get_args(Position)
NORMS: tuple[Norm, ...] = get_args(Norm)
NORM_POSITIONS: tuple[NormPosition, ...] = get_args(NormPosition)
ACTIVATIONS: tuple[Activation, ...] = get_args(Activation)
ATTN_IMPLS: tuple[AttnImpl, ...] = get_args(AttnImpl)
ROUTER_SOFTMAXES: tuple[RouterSoftmax, ...] = get_args(RouterSoftmax)
ROUTER_SCORES: tuple[RouterScore, ...] = get_args(RouterScore)
ATTENTION_KINDS: tuple[AttentionKind, ...] = get_args(AttentionKind)
QK_NORMS: tuple[QKNorm, ...] = get_args(QKNorm)
PRECISIONS: tuple[Precision, ...] = get_args(Precision)
STRATEGIES: tuple[StrategyName, ...] = get_args(StrategyName)
AC_MODES: tuple[ACMode, ...] = get_args(ACMode)
PP_SCHEDULES: tuple[PPSchedule, ...] = get_args(PPSchedule)
LENGTH_NORMS: tuple[LengthNorm, ...] = get_args(LengthNorm)
ON_EXHAUSTED: tuple[OnExhausted, ...] = get_args(OnExhausted)


@dataclass
class MoEConfig:
    """Mixture-of-experts FFNs (``model.moe.*``); ``num_experts: 0`` keeps every FFN dense."""

    num_experts: int = ranged(0, "[0, inf)")  # experts per MoE block; 0 = every FFN dense
    top_k: int = ranged(2, "[1, inf)", says="in [1, num_experts={num_experts}]")  # experts per token
    # blocks k-1, 2k-1, ... of each stack are MoE (Switch: 2; HF's decoder_sparse_step)
    moe_every: int = ranged(1, "[1, inf)")
    d_expert: int | None = ranged(None, "[1, inf)")  # hidden width of each expert; default the model's d_ff
    activation: Activation | None = None  # the experts' FFN kind; default the model's activation
    num_shared_experts: int = ranged(0, "[0, inf)")  # experts every token passes through (Qwen2-MoE, DeepSeek)
    d_shared: int | None = ranged(None, "[1, inf)")  # hidden width of each shared expert; default d_expert
    shared_gate: bool = False  # sigmoid(linear(x)) scales the shared experts' output (Qwen2-MoE)
    # "topk": softmax over the k chosen logits (Mixtral); "all": softmax over every expert, then
    # the k largest (Switch, Qwen2-MoE), renormalised to sum 1 with ``renormalize``. "topk" equals
    # "all" with renormalisation.
    router_softmax: RouterSoftmax = "all"
    renormalize: bool = False  # router_softmax=all: the top-k weights rescaled to sum 1
    router_bias: bool = False  # the router projection has a bias
    # "softmax": the router_softmax rules above; "sigmoid": each expert scored by sigmoid(logit)
    # on its own (DeepSeek-V3), the top-k weights renormalised over the chosen with ``renormalize``
    router_score: RouterScore = "softmax"
    n_group: int = ranged(1, "[1, inf)")  # sigmoid routing: experts in n_group groups; a token picks topk_group groups first
    topk_group: int = ranged(1, "[1, inf)", says="in [1, n_group={n_group}]")  # groups a token's experts come from
    routed_scaling_factor: float = ranged(1.0, "(0, inf)")  # the routed experts' weights times this (DeepSeek-V3: 2.5)
    first_dense: int = ranged(0, "[0, inf)")  # the first k blocks keep a dense FFN (DeepSeek-V3: 3)
    # Auxiliary-loss-free balancing (sigmoid routing): a per-expert bias added to the scores for
    # the choice only, moved by +-bias_update_rate after every optimizer step towards even loads
    # (tformer/train/balance.py); 0 = the bias stays as loaded
    bias_update_rate: float = ranged(0.0, "[0, inf)")
    # DeepSeek-V3's sequence-wise balance loss (alpha there: 1e-4), added while training
    seq_aux_loss_coef: float = ranged(0.0, "[0, inf)")
    jitter: float = ranged(0.0, "[0, 1)")  # training only: router input times uniform noise in [1 - jitter, 1 + jitter]
    # Capacity routing (null: dropless). Each sequence is a group; an expert takes at most
    # ceil(capacity_factor * tokens * top_k / num_experts) of its tokens (or ``expert_capacity``,
    # HF Switch's fixed number), first choices before second ones, earlier tokens first; a token
    # over capacity gets nothing from that expert and goes on through the residual.
    capacity_factor: float | None = ranged(None, "(0, inf)", note="or null: dropless")  # routing capacity; null: dropless
    expert_capacity: int | None = ranged(None, "[1, inf)")  # per expert and sequence (HF Switch); or capacity_factor
    expert_bias: bool = False  # biases on every expert projection (gpt-oss)
    # gpt-oss's clamped SwiGLU (activation swiglu): gate clamped to <= limit, up to [-limit, limit],
    # output (up + 1) * gate * sigmoid(swiglu_alpha * gate); null: plain SwiGLU
    swiglu_limit: float | None = ranged(None, "(0, inf)")  # gpt-oss 7.0
    swiglu_alpha: float = ranged(1.702, "(0, inf)")  # the sigmoid's slope with swiglu_limit (gpt-oss 1.702)
    aux_loss_coef: float = ranged(0.01, "[0, inf)")  # load-balancing loss (Switch / Mixtral form), added while training
    z_loss_coef: float = ranged(0.0, "[0, inf)")  # router z-loss (ST-MoE; 1e-3 there)

    @property
    def enabled(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, index: int) -> bool:
        return self.enabled and index >= self.first_dense and index % self.moe_every == self.moe_every - 1

    @property
    def score_bias(self) -> bool:
        """The router carries the loss-free balancing bias (HF's ``e_score_correction_bias``)."""
        return self.enabled and self.router_score == "sigmoid"

    def validate(self) -> None:
        if not self.enabled:
            return
        if self.top_k > self.num_experts:  # its bound by another field; the range itself is on the field
            raise ConfigError(range_error(self, "top_k", "model.moe."))
        check_ranges(self, "model.moe.")
        if self.capacity_factor is not None and self.expert_capacity is not None:
            raise ConfigError("model.moe.capacity_factor and model.moe.expert_capacity are exclusive; set one")
        if self.num_experts % self.n_group:
            raise ConfigError(
                f"model.moe.n_group={self.n_group} must divide num_experts={self.num_experts} "
                f"(allowed: {', '.join(str(d) for d in _divisors(self.num_experts))})"
            )
        if self.topk_group > self.n_group:
            raise ConfigError(range_error(self, "topk_group", "model.moe."))
        if self.top_k > self.topk_group * (self.num_experts // self.n_group):
            raise ConfigError(
                f"model.moe.top_k={self.top_k} exceeds the {self.topk_group * (self.num_experts // self.n_group)} "
                "experts of topk_group groups; raise topk_group or lower top_k"
            )
        if self.router_score == "softmax" and (self.n_group > 1 or self.bias_update_rate or self.seq_aux_loss_coef):
            raise ConfigError(
                "model.moe.n_group, bias_update_rate and seq_aux_loss_coef need router_score=sigmoid (DeepSeek-V3's routing)"
            )


def moe_config(value: Any) -> MoEConfig:
    """``model.moe`` from YAML / a saved config (a mapping) or already built."""
    if isinstance(value, MoEConfig):
        return value
    if not isinstance(value, dict):
        raise ConfigError(f"model.moe must be a mapping (e.g. num_experts: 8), got {value!r}")
    check_keys(value, MoEConfig, "model.moe")
    return MoEConfig(**value)


@dataclass
class MLAConfig:
    """Multi-head latent attention (``model.mla.*``, DeepSeek-V2/V3), used where ``attention: mla``.

    Queries come through a low-rank down/up projection with an RMSNorm between (or one projection
    when ``q_lora_rank`` is null); keys and values are expanded from one shared latent of width
    ``kv_lora_rank`` (normed), plus one rotary key of width ``qk_rope_head_dim`` shared by every
    head. A query/key head is ``qk_nope_head_dim + qk_rope_head_dim`` wide, a value head
    ``v_head_dim``; generation caches the latent and the rotary key only."""

    q_lora_rank: int | None = ranged(None, "[1, inf)", note="or null: one projection")  # the query's low-rank width
    kv_lora_rank: int = ranged(512, "[1, inf)")  # width of the shared key/value latent (what the cache holds)
    qk_nope_head_dim: int = ranged(128, "[1, inf)")  # per-head query/key width without positions
    qk_rope_head_dim: int = ranged(64, "[2, inf)")  # width of the rotary part (shared key, per-head query); even
    v_head_dim: int = ranged(128, "[1, inf)")  # per-head value width
    # rotary pairs (x0, x1), (x2, x3), ... as DeepSeek and HF's rope_interleave=true, instead of the halves
    rope_interleave: bool = True

    def validate(self, num_heads: int) -> None:
        check_ranges(self, "model.mla.")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"model.mla.qk_rope_head_dim={self.qk_rope_head_dim} must be even (rotary rotates pairs)")
        kv_out = num_heads * (self.qk_nope_head_dim + self.v_head_dim)
        if self.kv_lora_rank >= kv_out:
            raise ConfigError(
                f"model.mla.kv_lora_rank={self.kv_lora_rank} must be below num_heads * (qk_nope_head_dim + v_head_dim)"
                f" = {kv_out}, the keys and values it expands to; lower it"
            )
        q_out = num_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim)
        if self.q_lora_rank is not None and self.q_lora_rank >= q_out:
            raise ConfigError(
                f"model.mla.q_lora_rank={self.q_lora_rank} must be below num_heads * (qk_nope_head_dim + "
                f"qk_rope_head_dim) = {q_out}; lower it or set null"
            )

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass
class YarnConfig:
    """YaRN RoPE scaling (``model.yarn.*``; DeepSeek-V3, gpt-oss): frequencies interpolated by
    ``factor`` outside a band ramped between ``beta_fast`` and ``beta_slow`` rotations over
    ``original_max_seq_len``, cos/sin scaled by ``mscale``'s attention factor; ``factor: null`` is
    plain RoPE. MLA's softmax scale also takes ``mscale_all_dim``'s factor squared (HF's rule)."""

    factor: float | None = ranged(None, "(1, inf)", note="or null: off")  # context extension factor
    original_max_seq_len: int = positive(4096)  # the pretraining length the factor extends
    beta_fast: float = ranged(32.0, "(0, inf)")  # rotations where extrapolation ends
    beta_slow: float = ranged(1.0, "(0, inf)")  # rotations where interpolation begins
    mscale: float = ranged(1.0, "[0, inf)")  # cos/sin scale 0.1 * mscale * ln(factor) + 1 (over mscale_all_dim's)
    mscale_all_dim: float = ranged(0.0, "[0, inf)")  # 0 = off; else the softmax scale's factor (0.1 m ln(factor) + 1)^2
    truncate: bool = True  # the ramp's ends rounded outwards to whole pairs (DeepSeek-V3); gpt-oss: false

    @property
    def enabled(self) -> bool:
        return self.factor is not None


def section(cls: type, key: str):
    """``model.<key>`` from YAML / a saved config (a mapping) or already built."""

    def make(value: Any):
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"model.{key} must be a mapping, got {value!r}")
        check_keys(value, cls, f"model.{key}")
        return cls(**value)

    return make


@dataclass
class ModelConfig:
    """Architecture of one model. ``family`` picks the stack; the other fields pick the blocks."""

    family: Family = "decoder"  # encoder (BERT-like) | decoder (GPT-like) | encdec (T5-like)
    flavour: str = "gpt2"  # HF counterpart for export: bert | gpt2 | llama | t5 | marian | custom
    vocab_size: int = positive(50257)  # token ids the embedding holds (the tokenizer's size)
    pad_vocab_multiple: int = positive(1)  # pad the embedding rows to a multiple (64 is fast); 1 = off
    d_model: int = positive(768)  # width of the residual stream
    num_layers: int = positive(12)  # blocks; encoder layers for encdec
    num_decoder_layers: int | None = positive(None)  # encdec only; default = num_layers
    num_heads: int = positive(12)  # attention (query) heads
    num_kv_heads: int | None = positive(None)  # < num_heads: grouped-query attention; 1: multi-query
    d_head: int | None = positive(None)  # per-head width d_k = d_v; default d_model // num_heads
    d_ff: int = positive(3072)  # hidden width of the FFN
    max_seq_len: int = positive(1024)  # longest sequence (size of a learned position table)
    position: Position = "learned"  # how positions enter: none, learned or sinusoidal tables, rotary, T5 relative bias
    rope_theta: float = ranged(10000.0, "(0, inf)")  # base of the rotary frequencies
    # every rotary frequency divided by this (positions interpolated linearly; Gemma 3 4B: 8, on its
    # global blocks only where rope_local_theta gives the windowed ones their own table); 1: off
    rope_linear: float = ranged(1.0, "[1, inf)")
    rel_num_buckets: int = positive(32)  # T5 relative-position buckets
    rel_max_distance: int = positive(128)  # T5: distances beyond share the last bucket
    norm: Norm = "layernorm"  # the norm of every block and the final one
    norm_eps: float = ranged(1e-5, "(0, 1)")  # epsilon of every norm
    norm_bias: bool = True  # LayerNorm with a bias (RMSNorm has none)
    norm_position: NormPosition = "pre"  # pre (GPT-2, Llama, T5) | post (the paper, BERT)
    activation: Activation = "gelu_tanh"  # the FFN kind (swiglu, geglu: gated)
    bias: bool = True  # biases in attention and FFN projections
    qkv_bias: bool | None = None  # biases on q/k/v alone (Qwen2: bias=false, qkv_bias=true); null: as bias
    attn_scale: bool = True  # 1/sqrt(d_k); T5 has none
    qk_norm: QKNorm = "none"  # head: RMSNorm (norm_eps) over each head's q and k before RoPE (Qwen3)
    attn_impl: AttnImpl = "sdpa"  # sdpa (fast path) | math (explicit reference)
    # Local attention: a query sees the attn_window keys up to itself (causal; bidirectional: those
    # within attn_window // 2 either side), on every block but the global ones (global_every)
    attn_window: int | None = ranged(None, "[1, inf)", note="or null: every block global")  # gpt-oss 128
    # encdec: the encoder's window where it differs from the decoder's attn_window (T5Gemma: twice it,
    # HF counting a bidirectional window as the keys up to that far either side); null: attn_window
    encoder_window: int | None = ranged(None, "[2, inf)", note="or null: attn_window")
    global_every: int = ranged(0, "[0, inf)")  # with attn_window: blocks k-1, 2k-1, ... global (gpt-oss 2); 0: none
    # with global_every: block i is global when i % global_every == global_offset (ModernBERT 0:
    # blocks 0, 3, 6, ...); null: global_every - 1 (gpt-oss, Gemma 3: the last of each group)
    global_offset: int | None = ranged(None, "[0, inf)", note="or null: global_every - 1")  # ModernBERT 0
    rope_local_theta: float | None = ranged(None, "(0, inf)", note="or null: rope_theta")  # windowed blocks' RoPE base
    attn_sinks: bool = False  # a learned logit per head joins each softmax's denominator (gpt-oss)
    # cap * tanh(x / cap) on the attention logits, before the mask (Gemma 2 50.0); FlexAttention
    # computes it on CUDA, the math path elsewhere (SDPA cannot)
    attn_softcap: float | None = ranged(None, "(0, inf)", note="or null: no cap")  # on the attention logits
    final_softcap: float | None = ranged(None, "(0, inf)", note="or null: no cap")  # on the output logits (Gemma 2 30)
    # the attention scale is query_pre_attn_scalar ** -0.5 rather than d_head ** -0.5 (Gemma)
    query_pre_attn_scalar: float | None = ranged(None, "(0, inf)", note="or null: d_head")  # Gemma 3 256
    sandwich_norm: bool = False  # a norm on each sub-layer's output too, before the residual add (Gemma 2/3)
    norm_unit_offset: bool = False  # RMSNorm gains as offsets from 1: applied as 1 + weight (Gemma)
    dropout: float = ranged(0.0, "[0, 1)")  # residual and FFN dropout
    attn_dropout: float = ranged(0.0, "[0, 1)")  # dropout on the attention probabilities
    tie_embeddings: bool = True  # the output head shares the token embedding
    tied_output_scale: bool = False  # scale by d_model**-0.5 before a tied LM head (T5 v1.0)
    type_vocab_size: int = ranged(0, "[0, inf)", note="0 = no token types")  # token-type (segment) embeddings, BERT uses 2
    embed_norm: bool = False  # norm right after the embedding sum (BERT)
    # block 0 normalises its attention input; false: the embedding norm is its only norm (ModernBERT)
    first_attn_norm: bool = True
    head_bias: bool = True  # the MLM head's dense layer has a bias (BERT; ModernBERT: false)
    embed_scale: bool = False  # multiply token embeddings by sqrt(d_model) (the paper)
    embed_scale_dtype: bool = False  # with embed_scale: sqrt(d_model) rounded to the activations' dtype first (Gemma)
    # encdec: the encoder reads the decoder's token embedding; false: it has one of its own (T5Gemma)
    shared_embeddings: bool = True
    init_std: float = ranged(0.02, "(0, inf)")  # standard deviation of the initial weights
    pad_token_id: int = ranged(0, "[0, inf)")  # padding id (masked out, ignored by the loss)
    bos_token_id: int | None = ranged(None, "[0, inf)")  # beginning-of-sequence id, if the tokenizer has one
    eos_token_id: int | None = ranged(None, "[0, inf)")  # end-of-sequence id (stops generation)
    decoder_start_token_id: int = ranged(0, "[0, inf)")  # encdec: first decoder input (T5 uses pad = 0)
    moe: MoEConfig = dataclasses.field(default_factory=MoEConfig)
    attention: AttentionKind = "mha"  # mha: multi-head (GQA / MQA) | mla: multi-head latent attention (model.mla)
    mla: MLAConfig = dataclasses.field(default_factory=MLAConfig)
    yarn: YarnConfig = dataclasses.field(default_factory=YarnConfig)
    # decoder: multi-token prediction depth D (DeepSeek-V3: 1), extra modules each predicting one token further
    mtp_depth: int = ranged(0, "[0, inf)")
    mtp_loss_coef: float = ranged(0.3, "[0, inf)")  # the MTP depths' mean loss times this joins the training loss

    # keys of an earlier release and where they went (``check_keys`` names the new place)
    MOVED_KEYS: ClassVar[dict[str, str]] = {
        "rope_scaling": "yarn.factor (YaRN; null: none) or model.rope_linear (linear)",
        "rope_factor": "yarn.factor (YaRN) or model.rope_linear (linear)",
        "rope_original_max_len": "yarn.original_max_seq_len",
        "rope_beta_fast": "yarn.beta_fast",
        "rope_beta_slow": "yarn.beta_slow",
        "rope_truncate": "yarn.truncate",
    }

    def __post_init__(self) -> None:
        self.moe = moe_config(self.moe)
        self.mla = section(MLAConfig, "mla")(self.mla)
        self.yarn = section(YarnConfig, "yarn")(self.yarn)
        self.validate()

    # -- derived ---------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.d_head or self.d_model // self.num_heads

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def decoder_layers(self) -> int:
        return self.num_decoder_layers if self.num_decoder_layers is not None else self.num_layers

    @property
    def padded_vocab_size(self) -> int:
        m = self.pad_vocab_multiple
        return -(-self.vocab_size // m) * m

    @property
    def attn_qkv_bias(self) -> bool:
        return self.bias if self.qkv_bias is None else self.qkv_bias

    def layer_window(self, index: int) -> int | None:
        """The attention window of block ``index`` (None: it sees the whole sequence). The one place
        a per-layer pattern is read: a new pattern (ModernBERT's offset, Gemma 3's) goes here."""
        if self.attn_window is None:
            return None
        if self.global_every and index % self.global_every == self.global_layer_offset:
            return None
        return self.attn_window

    def stack_config(self, causal: bool) -> "ModelConfig":
        """The config a stack's blocks are built from: an encoder-decoder's encoder takes
        ``encoder_window`` as its window where set."""
        if causal or self.encoder_window is None:
            return self
        return dataclasses.replace(self, attn_window=self.encoder_window, encoder_window=None)

    @property
    def global_layer_offset(self) -> int:
        return self.global_every - 1 if self.global_offset is None else self.global_offset

    def layer_rope_theta(self, index: int) -> float:
        """The RoPE base of block ``index``: ``rope_local_theta`` on a windowed block, if set."""
        if self.rope_local_theta is not None and self.layer_window(index) is not None:
            return self.rope_local_theta
        return self.rope_theta

    @property
    def pre_norm(self) -> bool:
        return self.norm_position == "pre"

    @property
    def latent_attention(self) -> bool:
        return self.attention == "mla"

    @property
    def rotary_dim(self) -> int:
        """Width the rotary table turns: MLA's rotary part, else the whole head."""
        return self.mla.qk_rope_head_dim if self.latent_attention else self.head_dim

    # -- validation --------------------------------------------------------------------------
    def validate(self) -> None:
        check_fields(self)
        check_ranges(self)  # before the checks below, which divide by some of these
        if self.d_head is None and self.d_model % self.num_heads:
            raise ConfigError(
                f"d_model={self.d_model} is not divisible by num_heads={self.num_heads}; "
                "change one of them or set d_head explicitly"
            )
        if self.num_heads % self.kv_heads:
            raise ConfigError(
                f"num_kv_heads={self.kv_heads} must divide num_heads={self.num_heads} "
                f"(allowed: {', '.join(str(d) for d in _divisors(self.num_heads))})"
            )
        if self.position == "rotary" and self.head_dim % 2 and not self.latent_attention:
            raise ConfigError(f"position='rotary' needs an even head width, got d_head={self.head_dim}")
        for name in ("attn_window", "encoder_window"):
            window = getattr(self, name)
            if window is not None and window > self.max_seq_len:
                raise ConfigError(
                    f"{name}={window} is longer than max_seq_len={self.max_seq_len}; a window that long "
                    f"is full attention: set {name}=null or a shorter window"
                )
        if self.encoder_window is not None and (self.family != "encdec" or self.attn_window is None):
            raise ConfigError(
                f"encoder_window={self.encoder_window} is an encoder-decoder's encoder window beside attn_window; "
                f"set attn_window (family={self.family!r}, attn_window={self.attn_window}) or encoder_window=null"
            )
        bidirectional = ("encoder_window", self.encoder_window) if self.encoder_window else ("attn_window", self.attn_window)
        if bidirectional[1] is not None and bidirectional[1] % 2 and self.family != "decoder":
            raise ConfigError(
                f"{bidirectional[0]}={bidirectional[1]} must be even for a bidirectional ({self.family}) window: it spans "
                f"{bidirectional[0]} // 2 keys either side of the query (ModernBERT 128)"
            )
        if self.global_offset is not None and not self.global_offset < self.global_every:
            raise ConfigError(
                f"global_offset={self.global_offset} needs a global-layer period global_every > {self.global_offset} "
                f"(global_every={self.global_every}); set global_every or global_offset=null"
            )
        if self.sandwich_norm and not self.pre_norm:
            raise ConfigError(
                "sandwich_norm=true needs norm_position='pre' (post-norm blocks already normalise each output)"
            )
        if not self.first_attn_norm and not (self.pre_norm and self.embed_norm):
            raise ConfigError(
                "first_attn_norm=false leaves block 0's attention input to the embedding norm; it needs "
                "norm_position='pre' and embed_norm=true (ModernBERT)"
            )
        if self.norm_unit_offset and self.norm != "rmsnorm":
            raise ConfigError(f"norm_unit_offset=true is for norm='rmsnorm' (Gemma's), not norm={self.norm!r}")
        if self.position == "relative" and self.family == "encoder" and self.rel_num_buckets < 2:
            raise ConfigError("rel_num_buckets must be >= 2 for bidirectional relative positions")
        if self.family != "encdec" and not self.shared_embeddings:
            raise ConfigError(
                f"shared_embeddings=false gives an encoder-decoder's encoder its own embedding; family={self.family!r} "
                "has one stack: set shared_embeddings=true"
            )
        if self.family != "encdec" and self.num_decoder_layers is not None:
            raise ConfigError(
                f"num_decoder_layers is only for family='encdec' (family={self.family!r}); remove it or set num_layers"
            )
        for name in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < self.vocab_size:
                raise ConfigError(f"{name}={value} is outside the vocabulary [0, {self.vocab_size})")
        self.moe.validate()
        check_ranges(self.yarn, "model.yarn.")
        if self.latent_attention:
            if self.position != "rotary":
                raise ConfigError(f"attention=mla needs position=rotary (its decoupled rotary key), got {self.position!r}")
            if self.num_kv_heads not in (None, self.num_heads):
                raise ConfigError("attention=mla expands keys for every head; remove num_kv_heads")
            self.mla.validate(self.num_heads)
        if self.mtp_depth and self.family != "decoder":
            raise ConfigError(f"mtp_depth={self.mtp_depth} predicts further tokens of a decoder; set mtp_depth=0")
        if self.yarn.enabled and self.position != "rotary":
            raise ConfigError("model.yarn.factor scales rotary positions; set position=rotary or yarn.factor=null")

    # -- conversion --------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        check_keys(data, cls, "model")
        return cls(**data)

    def replace(self, **overrides: Any) -> "ModelConfig":
        check_keys(overrides, type(self), "model")
        return dataclasses.replace(self, **overrides)


MODEL_RANGES = ranges(ModelConfig, nested=False)
MOE_RANGES = ranges(MoEConfig)
MLA_RANGES = ranges(MLAConfig)
YARN_RANGES = ranges(YarnConfig)
