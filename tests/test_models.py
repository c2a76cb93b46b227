"""The three families: shapes, gradient flow, padding invariance, causality, KV cache, presets."""

import pytest
import torch

import tformer
from tformer import ConfigError, ModelConfig, build_model
from tformer.models import PRESETS
from tformer.models.encdec import shift_right

from conftest import TINY
from rounding import assert_within, float64_throughout, yardstick


def shrunk(name):
    """Every preset with its switches intact but toy widths."""
    cfg = PRESETS[name]
    kv = 2 if cfg.get("num_kv_heads") else None
    return build_model(
        name,
        vocab_size=300,
        d_model=32,
        num_heads=4,
        num_kv_heads=kv,
        d_head=None,
        d_ff=48,
        num_layers=2,
        max_seq_len=64,
        **({"num_decoder_layers": 2} if cfg["family"] == "encdec" else {}),
        **({k: 1 for k in ("bos_token_id", "eos_token_id", "pad_token_id") if cfg.get(k)}),
        **({"mla": _shrunk_mla(cfg["mla"])} if cfg.get("attention") == "mla" else {}),
        **({"attn_window": 8} if cfg.get("attn_window") else {}),  # shorter than the 12 tokens run
        **({"encoder_window": 6} if cfg.get("encoder_window") else {}),
    )


def _shrunk_mla(mla):
    """Latent attention's widths at toy size, with or without the query's bottleneck."""
    q = 16 if mla.get("q_lora_rank") else None
    return dict(mla, q_lora_rank=q, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)


def run(model, ids, mask=None, labels=None, dec=None):
    if model.config.family == "encdec":
        return model(ids, mask, decoder_input_ids=dec, labels=labels)
    return model(ids, mask, labels=labels)


@pytest.mark.parametrize("name", list(PRESETS))
def test_forward_backward_shapes_and_gradient_flow(name):
    model = shrunk(name) if "tiny" not in name else build_model(name)
    model.train()
    v = model.config.vocab_size
    ids = torch.randint(3, v, (3, 12))
    labels = torch.randint(0, v, (3, 7 if model.config.family == "encdec" else 12))
    labels[0, :2] = -100
    out = run(model, ids, torch.ones_like(ids), labels)
    assert out.logits.shape == (*labels.shape, v)
    assert out.loss.ndim == 0 and torch.isfinite(out.loss)
    out.loss.backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None, f"{pname} got no gradient"
        if pname.endswith("types.weight"):
            continue  # only row 0 is used by an all-zero token-type input
        assert p.grad.abs().sum() > 0, f"{pname} has an all-zero gradient"


@pytest.mark.parametrize("name", TINY)
def test_padding_does_not_change_real_positions(name):
    model = build_model(name).eval()
    ids = torch.randint(3, 1000, (2, 9))
    padded = torch.cat((ids, torch.zeros(2, 4, dtype=torch.long)), 1)
    mask = torch.cat((torch.ones(2, 9), torch.zeros(2, 4)), 1).long()
    with torch.no_grad():
        if model.config.family == "encdec":
            dec = torch.randint(3, 1000, (2, 5))
            a = model(ids, decoder_input_ids=dec).logits
            b = model(padded, mask, decoder_input_ids=dec).logits
            dec_pad = torch.cat((dec, torch.zeros(2, 3, dtype=torch.long)), 1)
            dmask = torch.cat((torch.ones(2, 5), torch.zeros(2, 3)), 1).long()
            c = model(ids, decoder_input_ids=dec_pad, decoder_attention_mask=dmask).logits[:, :5]
            torch.testing.assert_close(a, c, atol=1e-5, rtol=1e-5)
        else:
            a = model(ids).logits
            b = model(padded, mask).logits[:, :9]
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny", "t5-tiny", "t5-v1.1-tiny"])
def test_changing_token_t_plus_1_never_changes_outputs_up_to_t(name):
    model = build_model(name).eval()
    src = torch.randint(3, 1000, (1, 6))
    seq = torch.randint(3, 1000, (1, 10))
    for t in range(9):
        changed = seq.clone()
        changed[0, t + 1] = (seq[0, t + 1] + 1) % 1000
        with torch.no_grad():
            if model.config.family == "encdec":
                a = model(src, decoder_input_ids=seq).logits
                b = model(src, decoder_input_ids=changed).logits
            else:
                a, b = model(seq).logits, model(changed).logits
        torch.testing.assert_close(a[:, : t + 1], b[:, : t + 1], atol=1e-6, rtol=0)
        assert not torch.allclose(a[:, t + 1], b[:, t + 1])


def test_encoder_is_bidirectional():
    model = build_model("bert-tiny").eval()
    ids = torch.randint(3, 1000, (1, 8))
    changed = ids.clone()
    changed[0, -1] += 1
    with torch.no_grad():
        assert not torch.allclose(model(ids).logits[:, 0], model(changed).logits[:, 0])


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
@pytest.mark.parametrize("attn_impl", ["sdpa", "math"])
def test_decoder_kv_cache_matches_full_recompute(name, attn_impl):
    model = build_model(name, attn_impl=attn_impl).eval()
    ids = torch.randint(3, 1000, (2, 12))
    with torch.no_grad():
        full = model(ids).logits
        cache = model.new_cache()
        parts = [model(ids[:, :5], cache=cache).logits]
        for t in range(5, 12):
            parts.append(model(ids[:, t : t + 1], cache=cache).logits)
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["t5-tiny", "t5-v1.1-tiny"])
def test_encdec_kv_cache_matches_full_recompute(name):
    model = build_model(name).eval()
    src = torch.randint(3, 1000, (2, 9))
    src_mask = torch.tensor([[1] * 9, [1] * 6 + [0] * 3])
    dec = torch.randint(3, 1000, (2, 8))
    with torch.no_grad():
        full = model(src, src_mask, decoder_input_ids=dec).logits
        memory = model.encode(src, src_mask)
        cache = model.new_cache()
        parts = [model.decode(dec[:, t : t + 1], memory, src_mask, cache=cache) for t in range(8)]
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-5, rtol=1e-5)


def test_shift_right_builds_teacher_forcing_inputs():
    labels = torch.tensor([[5, 6, 7, -100]])
    assert shift_right(labels, 0, 0).tolist() == [[0, 5, 6, 7]]
    model = build_model("t5-tiny").eval()
    src = torch.randint(3, 1000, (1, 5))
    with torch.no_grad():
        a = model(src, labels=labels).logits
        b = model(src, decoder_input_ids=torch.tensor([[0, 5, 6, 7]])).logits
    torch.testing.assert_close(a, b)


def test_loss_ignores_minus_100_and_matches_cross_entropy():
    model = build_model("gpt2-tiny").eval()
    ids = torch.randint(3, 1000, (2, 6))
    labels = ids.roll(-1, 1)
    labels[:, -1] = -100
    out = model(ids, labels=labels)
    expected = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, 1024), labels[:, :-1].reshape(-1))
    torch.testing.assert_close(out.loss, expected)


def test_post_norm_and_pre_norm_wiring():
    from tformer.nn import LayerNorm, residual

    x = torch.randn(2, 3, 8)
    norm = LayerNorm(8)
    f = torch.nn.Linear(8, 8)
    torch.testing.assert_close(residual(x, norm, f, pre_norm=True), x + f(norm(x)))
    torch.testing.assert_close(residual(x, norm, f, pre_norm=False), norm(x + f(x)))
    post = build_model("bert-tiny")
    assert post.encoder.final_norm is None and post.embed.norm is not None
    pre = build_model("gpt2-tiny")
    assert pre.decoder.final_norm is not None


def test_tied_embeddings_share_storage_and_untied_do_not():
    tied = build_model("t5-tiny")
    assert tied.lm_head.weight is tied.embed.tok.weight
    untied = build_model("t5-v1.1-tiny")
    assert untied.lm_head.weight is not untied.embed.tok.weight
    assert untied.num_parameters() - tied.num_parameters() > 1024 * 64


def test_vocab_padding_rounds_rows_but_not_logits():
    model = build_model("gpt2-tiny", vocab_size=1000, pad_vocab_multiple=64)
    assert model.embed.tok.weight.shape[0] == 1024
    ids = torch.randint(0, 1000, (1, 5))
    assert model(ids).logits.shape[-1] == 1000


def test_sequence_longer_than_position_table_is_refused():
    model = build_model("gpt2-tiny")
    with pytest.raises(ConfigError, match="sequence length 129 exceeds max_seq_len=128"):
        model(torch.zeros(1, 129, dtype=torch.long))
    rope = build_model("llama-tiny")  # rotary has no table: longer sequences are fine
    assert rope(torch.zeros(1, 129, dtype=torch.long)).logits.shape[1] == 129


def _hf_reference(name):
    import transformers as T

    p = PRESETS[name]
    if p["flavour"] in ("gemma3", "t5gemma"):  # from the exporter (tests/test_zoo_gemma.py checks its parity)
        from tformer.export.hf import TARGETS

        target = TARGETS[p["flavour"]]
        return getattr(T, target.HF_CLASS)(target.hf_config(tformer.build_config(name)))
    if p["flavour"] == "deepseek_v3":  # its config from the exporter (tests/test_deepseek.py checks that one)
        from tformer.export.deepseek_v3 import hf_config

        return T.DeepseekV3ForCausalLM(hf_config(tformer.build_config(name)))
    if p["flavour"] == "modernbert":  # ModernBertConfig's defaults are answerdotai/ModernBERT-base's
        large = dict(hidden_size=1024, intermediate_size=2624, num_hidden_layers=28, num_attention_heads=16)
        return T.ModernBertForMaskedLM(T.ModernBertConfig(**(large if name.endswith("large") else {})))
    if p["family"] == "encoder":
        return T.BertForMaskedLM(
            T.BertConfig(
                hidden_size=p["d_model"],
                num_hidden_layers=p["num_layers"],
                num_attention_heads=p["num_heads"],
                intermediate_size=p["d_ff"],
            )
        )
    if p["flavour"] == "gpt2":
        return T.GPT2LMHeadModel(T.GPT2Config(n_embd=p["d_model"], n_layer=p["num_layers"], n_head=p["num_heads"]))
    if p["flavour"] == "llama":
        return T.LlamaForCausalLM(
            T.LlamaConfig(
                vocab_size=p["vocab_size"],
                hidden_size=p["d_model"],
                intermediate_size=p["d_ff"],
                num_hidden_layers=p["num_layers"],
                num_attention_heads=p["num_heads"],
                num_key_value_heads=p["num_kv_heads"],
                tie_word_embeddings=p["tie_embeddings"],
            )
        )
    if p["flavour"] == "mixtral":  # the published Mixtral-8x7B config
        return T.MixtralForCausalLM(
            T.MixtralConfig(
                vocab_size=32000,
                hidden_size=4096,
                intermediate_size=14336,
                num_hidden_layers=32,
                num_attention_heads=32,
                num_key_value_heads=8,
                num_local_experts=8,
                num_experts_per_tok=2,
                tie_word_embeddings=False,
            )
        )
    if p["flavour"] == "qwen2_moe":  # Qwen/Qwen1.5-MoE-A2.7B's config
        return T.Qwen2MoeForCausalLM(
            T.Qwen2MoeConfig(
                vocab_size=151936,
                hidden_size=2048,
                intermediate_size=5632,
                moe_intermediate_size=1408,
                shared_expert_intermediate_size=5632,
                num_hidden_layers=24,
                num_attention_heads=16,
                num_key_value_heads=16,
                num_experts=60,
                num_experts_per_tok=4,
                tie_word_embeddings=False,
            )
        )
    if p["flavour"] == "qwen3":  # Qwen/Qwen3-0.6B's and Qwen/Qwen3-8B's configs
        return T.Qwen3ForCausalLM(
            T.Qwen3Config(
                vocab_size=151936,
                hidden_size=p["d_model"],
                intermediate_size=p["d_ff"],
                num_hidden_layers=p["num_layers"],
                num_attention_heads=p["num_heads"],
                num_key_value_heads=p["num_kv_heads"],
                head_dim=128,
                tie_word_embeddings=p["tie_embeddings"],
            )
        )
    if p["flavour"] == "qwen3_moe":  # Qwen/Qwen3-30B-A3B's config
        return T.Qwen3MoeForCausalLM(
            T.Qwen3MoeConfig(
                vocab_size=151936,
                hidden_size=2048,
                intermediate_size=6144,
                moe_intermediate_size=768,
                num_hidden_layers=48,
                num_attention_heads=32,
                num_key_value_heads=4,
                head_dim=128,
                num_experts=128,
                num_experts_per_tok=8,
                norm_topk_prob=True,
                tie_word_embeddings=False,
            )
        )
    if p["flavour"] == "gpt_oss":  # openai/gpt-oss-20b's and -120b's configs
        return T.GptOssForCausalLM(
            T.GptOssConfig(num_hidden_layers=p["num_layers"], num_local_experts=p["moe"]["num_experts"])
        )
    if p["flavour"] == "switch_transformers":  # google/switch-base-8's config
        return T.SwitchTransformersForConditionalGeneration(
            T.SwitchTransformersConfig(
                d_model=768,
                d_ff=3072,
                d_kv=64,
                num_heads=12,
                num_layers=12,
                num_sparse_encoder_layers=6,
                num_sparse_decoder_layers=6,
                num_experts=8,
                expert_capacity=64,
            )
        )
    if p["flavour"] == "marian":
        return T.MarianMTModel(
            T.MarianConfig(
                vocab_size=p["vocab_size"],
                d_model=p["d_model"],
                encoder_layers=p["num_layers"],
                decoder_layers=p["num_layers"],
                encoder_attention_heads=p["num_heads"],
                decoder_attention_heads=p["num_heads"],
                encoder_ffn_dim=p["d_ff"],
                decoder_ffn_dim=p["d_ff"],
                max_position_embeddings=p["max_seq_len"],
                activation_function="relu",
                scale_embedding=True,
                pad_token_id=0,
                eos_token_id=1,
                decoder_start_token_id=0,
            )
        )
    return T.T5ForConditionalGeneration(
        T.T5Config(
            d_model=p["d_model"],
            d_kv=p["d_head"],
            d_ff=p["d_ff"],
            num_layers=p["num_layers"],
            num_heads=p["num_heads"],
            feed_forward_proj="gated-gelu" if p["activation"] == "geglu" else "relu",
            tie_word_embeddings=p["tie_embeddings"],
        )
    )


@pytest.mark.parametrize("name", [n for n in PRESETS if "tiny" not in n])
def test_standard_presets_have_exactly_the_hf_parameter_count(name):
    with torch.device("meta"):
        ours = build_model(name)
        hf = _hf_reference(name)
    expected = hf.num_parameters()
    if not PRESETS[name]["tie_embeddings"] and hf.lm_head.weight is hf.get_input_embeddings().weight:
        # transformers 5 re-ties a freshly built T5 despite tie_word_embeddings=False; the released
        # v1.1 checkpoints have a separate lm_head, which we count.
        expected += hf.lm_head.weight.numel()
    if PRESETS[name]["flavour"] == "marian":
        # HF Marian keeps its fixed sinusoidal tables as frozen parameters; tformer as buffers
        tables = 2 * PRESETS[name]["max_seq_len"] * PRESETS[name]["d_model"]
        assert hf.num_parameters() - hf.num_parameters(only_trainable=True) == tables
        expected = hf.num_parameters(only_trainable=True)
    assert ours.num_parameters() == expected


def test_well_known_sizes():
    with torch.device("meta"):
        assert build_model("gpt2-small").num_parameters() == 124_439_808
        assert 109e6 < build_model("bert-base").num_parameters() < 110e6
        assert 60.4e6 < build_model("t5-small").num_parameters() < 60.6e6
        # the paper's Table 3: base 65M, big 213M (for its 37000-token joint vocabulary)
        assert 62e6 < build_model("transformer-base").num_parameters() < 66e6
        assert 210e6 < build_model("transformer-big").num_parameters() < 216e6
        # config-only sizes (meta device, nothing allocated): the published Llama 3 and T5 counts
        assert build_model("llama-8b").num_parameters() == 8_030_261_248
        assert build_model("llama-70b").num_parameters() == 70_553_706_496
        assert build_model("t5-3b").num_parameters() == 2_851_598_336
        assert build_model("mixtral-8x7b").num_parameters() == 46_702_792_704  # "46.7B" (Mistral AI)
        assert build_model("t5-11b").num_parameters() == 11_307_321_344


@pytest.mark.parametrize(
    "overrides,match",
    [
        (dict(d_model=100, num_heads=3), "d_model=100 is not divisible by num_heads=3"),
        (dict(num_kv_heads=3), "num_kv_heads=3 must divide num_heads=4"),
        (dict(d_model=-8), "d_model=-8 must be a positive integer"),
        (dict(norm="batchnorm"), "norm='batchnorm' is not allowed; use one of: layernorm, rmsnorm"),
        (dict(activation="tanh"), "activation='tanh' is not allowed"),
        (dict(num_heads="4"), "num_heads='4' has the wrong type"),
        (dict(dropout=1.5), r"dropout=1.5 must be in \[0, 1\)"),
        (dict(num_layer=3), "unknown config key model.num_layer; did you mean model.num_layers"),
        (dict(eos_token_id=5000), r"eos_token_id=5000 is outside the vocabulary \[0, 1024\)"),
    ],
)
def test_config_errors_name_the_field_and_the_allowed_values(overrides, match):
    with pytest.raises(ConfigError, match=match) as err:
        build_model("gpt2-tiny", **overrides)
    assert "\n" not in str(err.value)


def test_choices_come_from_the_literal_types():
    """A choice's allowed values, its type check and every table keyed by it follow its Literal; a
    table missing a value fails at import (shown here on a copy missing one)."""
    from typing import get_args

    from tformer.config import ACTIVATIONS, Activation, check_table
    from tformer.nn.ffn import FFN_KINDS

    assert ACTIVATIONS == get_args(Activation) and tuple(FFN_KINDS) == ACTIVATIONS
    with pytest.raises(TypeError, match=r"FFN_KINDS does not match its choices: missing \['geglu'\], extra \['tanh'\]"):
        check_table({**{k: v for k, v in FFN_KINDS.items() if k != "geglu"}, "tanh": None}, Activation, "FFN_KINDS")
    with pytest.raises(ConfigError, match="activation=3 has the wrong type; expected a string"):
        build_model("gpt2-tiny", activation=3)
    with pytest.raises(ConfigError, match="d_head=2.0 has the wrong type; expected an integer"):
        build_model("gpt2-tiny", d_head=2.0)  # an optional int is still an int


def test_unknown_preset_suggests_the_closest():
    with pytest.raises(ConfigError, match="unknown preset 'gpt2-smal'; did you mean 'gpt2-small'"):
        build_model("gpt2-smal")


def test_build_model_accepts_config_dict_and_preset_key():
    cfg = ModelConfig(
        family="decoder",
        vocab_size=64,
        d_model=16,
        num_layers=1,
        num_heads=2,
        d_ff=32,
        max_seq_len=16,
        bos_token_id=None,
        eos_token_id=None,
    )
    assert build_model(cfg).config is cfg
    m = build_model({"preset": "gpt2-tiny", "num_layers": 3})
    assert len(m.decoder.layers) == 3
    assert tformer.build_config(cfg.to_dict()) == cfg


def test_models_never_import_torch_distributed():
    import pathlib

    root = pathlib.Path(tformer.__file__).parent
    for path in list((root / "models").glob("*.py")) + list((root / "nn").glob("*.py")):
        assert "torch.distributed" not in path.read_text(), path


@pytest.mark.parametrize("chunk", [None, 7])
def test_a_host_count_of_the_labels_finds_the_masked_rows_bitwise(chunk):
    """The trainer passes an eager masked LM the count of its labels, taken in host memory, so that
    the head's rows are found by a gather of a size the host knows (``nonzero_static``) instead of
    boolean indexing (which waits for the device): the same rows in the same order, so the same
    loss and gradients bitwise, whole head or chunked; a count one short would drop a row."""
    torch.manual_seed(0)
    model = build_model("bert-tiny")
    model.loss_chunk_size = chunk
    b, s = 3, 12
    ids = torch.randint(5, model.config.vocab_size, (b, s))
    labels = ids.masked_fill(torch.rand(b, s) > 0.3, -100)
    labels[:, 0] = ids[:, 0]
    count = int((labels != -100).sum())
    results = []
    for extra in ({}, {"labelled_count": count}, {"labelled_count": count - 1}):
        model.zero_grad()
        out = model(ids, labels=labels, return_logits=False, **extra)
        out.loss.backward()
        results.append((out.loss.detach(), [p.grad.clone() for p in model.parameters()]))
    (mask, mask_grads), (host, host_grads), (short, _) = results
    assert torch.equal(host, mask) and all(torch.equal(a, b) for a, b in zip(host_grads, mask_grads))
    assert not torch.equal(short, mask)


@pytest.mark.parametrize("preset", TINY)
def test_loss_only_forward_gives_the_same_loss_and_gradients(preset):
    """return_logits=False (the trainer's path; for BERT the MLM head runs at masked positions
    only) must be the full forward's loss and gradients, not an approximation."""
    torch.manual_seed(0)
    model = build_model(preset).double()
    model.train(False)
    b, s = 3, 12
    vocab = model.config.vocab_size
    ids = torch.randint(5, vocab, (b, s))
    labels = ids.masked_fill(torch.rand(b, s) > 0.3, -100)  # sparse labels, as in MLM
    labels[:, 0] = ids[:, 0]
    mask = torch.ones(b, s, dtype=torch.long)
    mask[1, -3:] = 0
    results = []
    for return_logits in (True, False):
        model.zero_grad()
        out = model(ids, attention_mask=mask, labels=labels, return_logits=return_logits)
        out.loss.backward()
        assert (out.logits is not None) == return_logits
        results.append((out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (full, full_grads), (only, only_grads) = results
    # the loss is computed in fp32 (lm_loss) and its round-off reaches every gradient: the two paths
    # may differ by a few times how far the full path lies from the same model run in float64
    # throughout (tests/rounding.py)
    model.zero_grad()
    with float64_throughout():
        exact = model(ids, attention_mask=mask, labels=labels).loss
        exact.backward()
    exact_grads = {"loss": exact.detach(), **{n: p.grad.clone() for n, p in model.named_parameters()}}
    scale = max(g.abs().max().item() for g in full_grads.values())  # a key bias's exact gradient is 0
    yard = yardstick({"loss": full, **full_grads}, exact_grads, scale)
    ratio = assert_within({"loss": only, **only_grads}, {"loss": full, **full_grads}, yard, scale, preset)
    print(f"{preset}: loss-only vs full {ratio:.2f} yardsticks ({yard:.1e})")
