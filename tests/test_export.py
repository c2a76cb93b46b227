"""Export to / import from HF transformers: logits and greedy-generation parity with tformer for
BERT, GPT-2, Llama and T5 (v1.0 and v1.1) on tiny and odd shapes, tokenizer ids, import -> export
identity, resuming pretraining after a round trip, HF fine-tuning of exported models, and
one-line errors with no partial output for bad input."""

import dataclasses
import gzip
import importlib.util
import itertools
import json
import os
import shutil
import stat
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file
from transformers.cache_utils import DynamicCache, EncoderDecoderCache

import tformer
from tformer.checkpoint import CheckpointError
from tformer.checkpoint.io import commit, partial_dir, save_model_weights, write_bytes_durable
from tformer.cli import main as cli_main
from tformer.config import ConfigError
from tformer.data import default_corpus_path, hf_tokenizer, load_tokenizer, train_tokenizer
from tformer.export import ExportError, export_hf, import_hf, to_hf_model
from tformer.export.hf import TARGETS
from tformer.generate import generate
from tformer.train.config import load_config
from tformer.train.loop.data import MODEL_INPUTS
from tformer.train.trainer import Trainer

from train_helpers import CONFIGS, ROOT, small_overrides

KIND = {"decoder": "bpe", "encoder": "wordpiece", "encdec": "unigram"}
TEXTS = [
    "In the beginning, God created the heavens and the earth.",
    "Jesus wept. “Lord,” they said — 12 baskets; naïve café!",
]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """The first 2,000 verses of the bundled corpus: enough to train tokenizers in seconds."""
    path = tmp_path_factory.mktemp("corpus") / "verses.txt"
    with gzip.open(default_corpus_path(), "rt", encoding="utf-8") as f:
        path.write_text("".join(itertools.islice(f, 2000)), encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def toks(corpus, cache):
    out = corpus.parent
    paths = {}
    for kind, size in (("bpe", 512), ("wordpiece", 512), ("unigram", 400)):
        paths[kind] = out / f"{kind}.json"
        train_tokenizer(kind, str(corpus), size, paths[kind])
    return paths


def save_run(model, tokenizer: Path, run: Path, step: int = 1) -> Path:
    """A run directory with one complete checkpoint of ``model``, as the trainer lays it out."""
    root = run / "checkpoints"
    tmp = partial_dir(root, step)
    tmp.mkdir(parents=True)
    save_model_weights(model, tmp / "model.safetensors")
    state = {"step": step, "model_config": model.config.to_dict()}
    write_bytes_durable(tmp / "trainer.json", json.dumps(state).encode())
    shutil.copyfile(tokenizer, run / "tokenizer.json")
    return commit(root, step, keep=1)


def hf_model(out: Path, family: str):
    auto = {"decoder": "AutoModelForCausalLM", "encoder": "AutoModelForMaskedLM", "encdec": "AutoModelForSeq2SeqLM"}[family]
    extra = {}
    if transformers.AutoConfig.from_pretrained(out).model_type in ("mixtral", "qwen2_moe", "deepseek_v3"):
        # transformers 5.24 runs these experts with torch._grouped_mm by default, which on CPU
        # fails at widths that are not a multiple of 4 floats (e.g. d_ff 90); its loop works
        extra["experts_implementation"] = "eager"
    return getattr(transformers, auto).from_pretrained(out, **extra).eval()


def hf_generate(hf, ids, mask, steps):
    extra = {}
    if hf.config.is_encoder_decoder:
        # transformers 5.23 sizes its default cache by the encoder's depth (wrong for a deeper decoder)
        extra["past_key_values"] = EncoderDecoderCache(DynamicCache(), DynamicCache())
    return hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=steps, do_sample=False, **extra)


def batch_for(cfg, seed=0):
    """A ragged batch: row 1 is padded on the right (and, for decoders, row 2 on the left)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, min(cfg.vocab_size, 400), (3, 11), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    if cfg.family == "decoder":
        mask[2, :3] = 0
    ids = ids.masked_fill(mask == 0, cfg.pad_token_id)
    labels = torch.randint(5, min(cfg.vocab_size, 400), (3, 6), generator=g)
    dmask = torch.ones_like(labels)
    dmask[1, 4:] = 0
    return ids, mask, labels.masked_fill(dmask == 0, -100), dmask


def assert_logits_match(model, hf, cfg):
    """Same logits (fp32, max abs diff <= 1e-4) and loss on a padded batch, at every real position."""
    ids, mask, labels, dmask = batch_for(cfg)
    with torch.no_grad():
        if cfg.family == "encdec":
            ours = model(ids, mask, labels=labels, decoder_attention_mask=dmask)
            theirs = hf(input_ids=ids, attention_mask=mask, labels=labels, decoder_attention_mask=dmask)
            keep = dmask.bool()
        elif cfg.family == "decoder":
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            targets = ids.masked_fill(mask == 0, -100)
            targets[:, 1:] = targets[:, 1:].masked_fill(mask[:, :-1] == 0, -100)  # not predicted from a pad
            # ours takes aligned labels (the target of position t at t); HF shifts them itself
            ours = model(
                ids, mask, labels=torch.cat((targets[:, 1:], torch.full_like(ids[:, :1], -100)), 1), position_ids=positions
            )
            theirs = hf(input_ids=ids, attention_mask=mask, position_ids=positions, labels=targets)
            keep = mask.bool()
        else:
            targets = ids.masked_fill(mask == 0, -100)
            types = torch.zeros_like(ids)
            if cfg.type_vocab_size > 1:
                types[:, 6:] = 1
            ours = model(ids, mask, labels=targets, token_type_ids=types)
            theirs = hf(input_ids=ids, attention_mask=mask, token_type_ids=types, labels=targets)
            keep = mask.bool()
    assert ours.logits.shape == theirs.logits.shape
    diff = (ours.logits[keep] - theirs.logits[keep]).abs().max().item()
    assert diff <= 1e-4, diff
    assert abs(ours.loss.item() - theirs.loss.item()) <= 1e-4


def assert_greedy_match(model, hf, cfg, steps=10):
    ids, mask, _, _ = batch_for(cfg, seed=1)
    ids, mask = ids[:, :6], mask[:, :6]
    if cfg.family == "decoder":  # HF decoders want left padding for generation
        ids, mask = ids[[0, 2]], mask[[0, 2]]
    ours = generate(model, ids, steps, attention_mask=mask)
    theirs = hf_generate(hf, ids, mask, steps)
    assert ours.tolist() == theirs.tolist()


def assert_same_tokens(out: Path, tok_path: Path):
    ours = load_tokenizer(tok_path)
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    for text in TEXTS:
        assert theirs(text)["input_ids"] == ours.encode(text).ids
        assert theirs.decode(theirs(text)["input_ids"], skip_special_tokens=True) == ours.decode(ours.encode(text).ids)


# -- parity on directly built models: tiny and odd shapes, random weights -------------------------

CASES = {
    # d_model 48 with 3 heads; vocabulary padded 520 -> 576 (the padding rows are dropped)
    "gpt2-odd-padded-vocab": ("gpt2-tiny", dict(vocab_size=520, d_model=48, num_heads=3, d_ff=100, pad_vocab_multiple=64)),
    "gpt2-untied-unscaled-gelu": (
        "gpt2-tiny",
        dict(vocab_size=512, tie_embeddings=False, attn_scale=False, activation="gelu", num_layers=3),
    ),
    "llama-gqa-odd-ff-biases": (
        "llama-tiny",
        dict(vocab_size=512, d_model=48, num_heads=6, num_kv_heads=2, d_head=12, d_ff=90, bias=True, rope_theta=500.0),
    ),
    "llama-mqa-tied-geglu": ("llama-tiny", dict(vocab_size=512, num_kv_heads=1, tie_embeddings=True, activation="geglu")),
    "bert-odd-padded-vocab": ("bert-tiny", dict(vocab_size=512, d_model=40, num_heads=5, d_ff=72, pad_vocab_multiple=64)),
    "bert-untied-no-types": (
        "bert-tiny",
        dict(vocab_size=512, tie_embeddings=False, type_vocab_size=0, activation="gelu_tanh", num_layers=3),
    ),
    "t5-v1.0-tied": ("t5-tiny", dict(vocab_size=400)),
    "t5-v1.1-untied-geglu-deeper-decoder": ("t5-v1.1-tiny", dict(vocab_size=400)),
    # the paper's model: d_model permuted into HF Marian's sines-then-cosines order on export
    "transformer-paper": ("transformer-tiny", dict(vocab_size=400)),
    "transformer-odd-heads-deeper-decoder-gelu": (
        "transformer-tiny",
        dict(vocab_size=400, d_model=48, num_heads=6, d_ff=72, num_decoder_layers=3, activation="gelu", embed_scale=False),
    ),
    "mixtral-gqa-odd-ff": (
        "mixtral-tiny",
        dict(vocab_size=512, d_model=48, num_heads=6, num_kv_heads=2, d_head=12, d_ff=90),
    ),
    "mixtral-all-renormalised-top3-geglu": (
        "mixtral-tiny",
        dict(
            vocab_size=512,
            activation="geglu",
            moe=dict(top_k=3, router_softmax="all", renormalize=True),
            tie_embeddings=True,
        ),
    ),
    "qwen2-moe-shared-gated-qkv-bias": ("qwen2-moe-tiny", dict(vocab_size=512)),
    "qwen2-moe-every-other-block-renormalised-untied": (
        "qwen2-moe-tiny",
        dict(vocab_size=512, num_layers=3, qkv_bias=False, moe=dict(moe_every=2, renormalize=True, top_k=3)),
    ),
    # capacity 3 per expert per sequence of 11: some tokens pass through on the residual alone
    "switch-capacity-drops": ("switch-tiny", dict(vocab_size=400, moe=dict(expert_capacity=3))),
    "switch-every-block-gelu-router-bias-deeper-decoder": (
        "switch-tiny",
        dict(vocab_size=400, activation="gelu", num_decoder_layers=3, moe=dict(moe_every=1, router_bias=True)),
    ),
    # latent attention (3 heads, odd latent widths), 6 experts in 3 groups (2 kept), top-3, YaRN
    "deepseek-v3-odd-groups-yarn": (
        "deepseek-v3-tiny",
        dict(
            vocab_size=512,
            d_model=36,
            num_heads=3,
            d_ff=52,
            mla=dict(q_lora_rank=14, kv_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5),
            moe=dict(num_experts=6, n_group=3, topk_group=2, top_k=3, d_expert=20),
            yarn=dict(factor=4.0, original_max_seq_len=16, mscale=0.9, mscale_all_dim=0.8),
        ),
    ),
    "t5-tied-unscaled-swiglu": (
        "t5-tiny",
        dict(vocab_size=400, tied_output_scale=False, activation="swiglu", d_head=12, num_heads=3),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_export_matches_hf_logits_generation_and_tokens(case, toks, tmp_path):
    preset, overrides = CASES[case]
    torch.manual_seed(0)
    model = tformer.build_model(preset, init_std=0.1, **overrides).eval()
    cfg = model.config
    tok = toks[KIND[cfg.family]]
    ckpt = save_run(model, tok, tmp_path / "run")
    shard = 40_000 if case.startswith("gpt2-odd") else "5GB"  # one case writes sharded safetensors
    out = export_hf(ckpt, tmp_path / "hf", max_shard_size=shard)
    if case.startswith("gpt2-odd"):
        assert (out / "model.safetensors.index.json").is_file() and len(list(out.glob("model-*"))) > 1
    hf = hf_model(out, cfg.family)
    assert type(hf).__name__ == TARGETS[cfg.flavour].HF_CLASS
    assert hf.config.vocab_size == cfg.vocab_size
    assert_logits_match(model, hf, cfg)
    if cfg.family != "encoder":
        assert_greedy_match(model, hf, cfg)
        gen = transformers.GenerationConfig.from_pretrained(out)
        assert (gen.eos_token_id, gen.pad_token_id) == (cfg.eos_token_id, cfg.pad_token_id)
    assert_same_tokens(out, tok)
    assert not list(tmp_path.glob(".partial-*"))


# Every ModelConfig field, flipped one at a time from each target's tiny preset: export either
# fails naming the field or gives a HF model with the same logits. No switch is silently dropped.
FLIPS = {
    "family": ["encoder", "decoder", "encdec"],
    "flavour": ["custom"],
    "vocab_size": [530],
    "pad_vocab_multiple": [64],
    "d_model": [48],
    "num_layers": [3],
    "num_decoder_layers": [1],
    "num_heads": [2],
    "num_kv_heads": [1],
    "d_head": [8],
    "d_ff": [40],
    "max_seq_len": [64],
    "position": ["none", "learned", "sinusoidal", "rotary", "relative"],
    "rope_theta": [1000.0],
    "rel_num_buckets": [16],
    "rel_max_distance": [64],
    "norm": ["layernorm", "rmsnorm"],
    "norm_eps": [1e-3],
    "norm_bias": [True, False],
    "norm_position": ["pre", "post"],
    "activation": ["relu", "gelu", "gelu_tanh", "silu", "swiglu", "geglu", "geglu_exact"],
    "bias": [True, False],
    "qkv_bias": [True, False],
    "attn_scale": [True, False],
    "qk_norm": ["none", "head"],
    "rope_linear": [4.0],
    "attn_window": [4],
    "encoder_window": [8],
    "global_every": [2],
    "attn_sinks": [True],
    "global_offset": [0],
    "rope_local_theta": [5000.0],
    "attn_softcap": [20.0],
    "final_softcap": [10.0],
    "query_pre_attn_scalar": [8.0],
    "sandwich_norm": [True],
    "norm_unit_offset": [True],
    "embed_scale_dtype": [True],
    "shared_embeddings": [False],
    "attn_impl": ["math"],
    "dropout": [0.1],
    "attn_dropout": [0.1],
    "tie_embeddings": [True, False],
    "tied_output_scale": [True, False],
    "type_vocab_size": [0, 2],
    "embed_norm": [True, False],
    "first_attn_norm": [False],
    "head_bias": [False],
    "embed_scale": [True, False],
    "init_std": [0.05],
    "pad_token_id": [3],
    "bos_token_id": [3, None],
    "eos_token_id": [3, None],
    "decoder_start_token_id": [2],
    "moe": [{"num_experts": 4, "top_k": 2}],
    "attention": ["mla"],
    "mla": [{"q_lora_rank": 16, "kv_lora_rank": 12, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8}],
    "yarn": [{"factor": 2.0, "original_max_seq_len": 32}, {"factor": 4.0, "original_max_seq_len": 32, "truncate": False}],
    "mtp_depth": [1],
    "mtp_loss_coef": [0.5],
}


def test_every_model_config_field_is_considered():
    assert set(FLIPS) == {f.name for f in dataclasses.fields(tformer.ModelConfig)}


@pytest.mark.parametrize("preset", ["gpt2-tiny", "llama-tiny", "bert-tiny", "t5-tiny", "transformer-tiny"])
def test_each_switch_exports_faithfully_or_fails_naming_it(preset, toks, tmp_path):
    base = tformer.build_config(preset, vocab_size=512, init_std=0.1)
    outcomes = {}
    for i, (field, values) in enumerate((f, v) for f, vs in FLIPS.items() for v in vs):
        if getattr(base, field) == values:
            continue
        try:
            torch.manual_seed(0)
            model = tformer.build_model(base.replace(**{field: values})).eval()
        except ConfigError:
            continue  # not a valid model in the first place
        ckpt = save_run(model, toks[KIND[base.family]], tmp_path / f"run{i}")
        try:
            out = export_hf(ckpt, tmp_path / f"hf{i}")
        except ExportError as e:
            assert f"{field}=" in str(e) or f"{field}." in str(e), (field, values, str(e))  # the field or its key
            outcomes[f"{field}={values}"] = "refused"
            continue
        assert_logits_match(model, hf_model(out, model.config.family), model.config)
        outcomes[f"{field}={values}"] = "exported"
    assert "refused" in outcomes.values() and "exported" in outcomes.values()


# -- train a few steps with the trainer, export, compare ----------------------------------------


@pytest.fixture(scope="session")
def trained(cache, corpus, toks, tmp_path_factory):
    """Runs of each tiny recipe, trained 2 steps on the small corpus with the test tokenizers."""
    runs = {}

    def get(recipe):
        if recipe not in runs:
            out = tmp_path_factory.mktemp(recipe)
            family = load_config(CONFIGS / f"{recipe}.yaml").model.family
            cfg = load_config(
                CONFIGS / f"{recipe}.yaml",
                small_overrides(
                    recipe,
                    out,
                    "max_steps=2",
                    "eval_every=0",
                    "save_every=0",
                    "eval_batches=2",
                    "precision=fp32",
                    "model.vocab_size=512",
                    "data.seq_len=48",
                    "micro_batch_size=4",
                    f"data.source={corpus}",
                    f"data.tokenizer={toks[KIND[family]]}",
                ),
            )
            trainer = Trainer(cfg)
            trainer.fit()
            runs[recipe] = (out, trainer)
        return runs[recipe]

    return get


@pytest.mark.parametrize("recipe", ["gpt2-tiny", "llama-tiny", "bert-tiny", "t5-tiny"])
def test_trained_model_exports_with_parity_on_its_own_batches(recipe, trained, tmp_path):
    run, trainer = trained(recipe)
    out = export_hf(run, tmp_path / "hf")
    model = tformer.load_checkpoint(run)
    cfg = model.config
    hf = hf_model(out, cfg.family)
    # a real training batch (MLM / span corruption batches carry padding and masks)
    batch = trainer.data.collator([trainer.data.validation[i] for i in range(4)])
    inputs = {k: batch[k] for k in MODEL_INPUTS[cfg.family] if k in batch}
    hf_inputs = dict(inputs)
    if cfg.family == "decoder":
        # our labels are aligned (the last one looks past the window); HF shifts its labels
        labels = inputs["labels"].clone()
        labels[:, -1] = -100
        inputs["labels"] = labels
        hf_inputs["labels"] = torch.cat((torch.full_like(labels[:, :1], -100), labels[:, :-1]), 1)
    with torch.no_grad():
        ours = model(**inputs)
        theirs = hf(**hf_inputs)
    assert (ours.logits - theirs.logits).abs().max().item() <= 1e-4
    assert abs(ours.loss.item() - theirs.loss.item()) <= 1e-4
    assert_logits_match(model, hf, cfg)
    if cfg.family != "encoder":
        assert_greedy_match(model, hf, cfg)
    assert_same_tokens(out, run / "tokenizer.json")


def test_exported_then_imported_model_resumes_pretraining_with_the_same_loss(trained, corpus, tmp_path):
    run, original = trained("gpt2-tiny")
    hf_dir = export_hf(run, tmp_path / "hf")
    imported = import_hf(hf_dir, tmp_path / "imported")
    cfg = load_config(
        imported / "config.yaml",
        [
            f"output_dir={tmp_path / 'continued'}",
            f"resume={imported}",
            "max_steps=1",
            "progress=false",
            "eval_every=0",
            "save_every=0",
            "eval_batches=2",
            "precision=fp32",
            "data.seq_len=48",
            "micro_batch_size=4",
            f"data.source={corpus}",
            "log_every=1",
        ],
    )
    resumed = Trainer(cfg)
    assert resumed.resumed_from == imported / "checkpoints" / "step_00000000"
    for (name, p), q in zip(original.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(p, q), name
    assert resumed.evaluate()["val_loss"] == pytest.approx(original.evaluate()["val_loss"], abs=1e-6)
    # the first step of the resumed run: same loss as the original model on that batch
    batch = next(resumed._batches())
    inputs = {k: batch[k] for k in MODEL_INPUTS["decoder"]}
    with torch.no_grad():
        expected = original.model(**inputs).loss.item()
    record = resumed.fit()
    assert record["step"] == 1 and record["loss"] == pytest.approx(expected, abs=1e-6)


# -- import -> export is the identity on tensors -------------------------------------------------


def hf_configs():
    t = transformers
    return {
        "gpt2": (
            t.GPT2Config(
                vocab_size=512,
                n_positions=64,
                n_embd=48,
                n_layer=2,
                n_head=3,
                n_inner=100,
                bos_token_id=0,
                eos_token_id=0,
                pad_token_id=0,
            ),
            "GPT2LMHeadModel",
            "bpe",
        ),
        "llama": (
            t.LlamaConfig(
                vocab_size=512,
                hidden_size=48,
                intermediate_size=90,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                max_position_embeddings=64,
                bos_token_id=0,
                eos_token_id=0,
                pad_token_id=0,
                tie_word_embeddings=False,
            ),
            "LlamaForCausalLM",
            "bpe",
        ),
        "bert": (
            t.BertConfig(
                vocab_size=512,
                hidden_size=40,
                num_hidden_layers=2,
                num_attention_heads=5,
                intermediate_size=72,
                max_position_embeddings=64,
            ),
            "BertForMaskedLM",
            "wordpiece",
        ),
        "bert-untied": (
            t.BertConfig(
                vocab_size=512,
                hidden_size=32,
                num_hidden_layers=1,
                num_attention_heads=2,
                intermediate_size=48,
                max_position_embeddings=32,
                type_vocab_size=3,
                hidden_act="relu",
                tie_word_embeddings=False,
            ),
            "BertForMaskedLM",
            "wordpiece",
        ),
        "t5-v1.0": (
            t.T5Config(
                vocab_size=400,
                d_model=32,
                d_kv=8,
                d_ff=48,
                num_layers=2,
                num_heads=4,
                relative_attention_num_buckets=8,
                relative_attention_max_distance=20,
                decoder_start_token_id=0,
            ),
            "T5ForConditionalGeneration",
            "unigram",
        ),
        "t5-v1.1": (
            t.T5Config(
                vocab_size=400,
                d_model=32,
                d_kv=8,
                d_ff=48,
                num_layers=2,
                num_decoder_layers=3,
                num_heads=4,
                relative_attention_num_buckets=8,
                relative_attention_max_distance=20,
                feed_forward_proj="gated-gelu",
                tie_word_embeddings=False,
                decoder_start_token_id=0,
            ),
            "T5ForConditionalGeneration",
            "unigram",
        ),
        "mixtral": (
            t.MixtralConfig(
                vocab_size=512,
                hidden_size=48,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                num_local_experts=4,
                num_experts_per_tok=2,
                max_position_embeddings=64,
                bos_token_id=0,
                eos_token_id=0,
                pad_token_id=0,
                tie_word_embeddings=False,
            ),
            "MixtralForCausalLM",
            "bpe",
        ),
        "qwen2_moe": (
            t.Qwen2MoeConfig(
                vocab_size=512,
                hidden_size=48,
                intermediate_size=64,
                moe_intermediate_size=32,
                shared_expert_intermediate_size=48,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                num_experts=4,
                num_experts_per_tok=2,
                decoder_sparse_step=2,
                max_position_embeddings=64,
                bos_token_id=0,
                eos_token_id=0,
                pad_token_id=0,
                tie_word_embeddings=False,
            ),
            "Qwen2MoeForCausalLM",
            "bpe",
        ),
        "deepseek_v3": (
            t.DeepseekV3Config(
                vocab_size=512,
                hidden_size=36,
                intermediate_size=52,
                moe_intermediate_size=20,
                num_hidden_layers=3,
                num_attention_heads=3,
                num_key_value_heads=3,
                n_routed_experts=6,
                n_shared_experts=2,
                num_experts_per_tok=3,
                n_group=3,
                topk_group=2,
                first_k_dense_replace=1,
                routed_scaling_factor=1.7,
                q_lora_rank=14,
                kv_lora_rank=10,
                qk_nope_head_dim=6,
                qk_rope_head_dim=4,
                v_head_dim=5,
                max_position_embeddings=64,
                rope_parameters={
                    "rope_type": "yarn",
                    "rope_theta": 10000.0,
                    "factor": 4.0,
                    "original_max_position_embeddings": 16,
                    "mscale": 0.9,
                    "mscale_all_dim": 0.8,
                },
                bos_token_id=0,
                eos_token_id=0,
                pad_token_id=0,
                tie_word_embeddings=False,
            ),
            "DeepseekV3ForCausalLM",
            "bpe",
        ),
        "switch_transformers": (
            t.SwitchTransformersConfig(
                vocab_size=400,
                d_model=32,
                d_kv=8,
                d_ff=48,
                num_layers=2,
                num_decoder_layers=2,
                num_sparse_encoder_layers=1,
                num_sparse_decoder_layers=1,
                num_heads=4,
                num_experts=4,
                expert_capacity=4,
                relative_attention_num_buckets=8,
                relative_attention_max_distance=32,
                pad_token_id=0,
                eos_token_id=1,
                decoder_start_token_id=0,
            ),
            "SwitchTransformersForConditionalGeneration",
            "unigram",
        ),
        "marian": (
            t.MarianConfig(
                vocab_size=400,
                d_model=32,
                encoder_layers=2,
                decoder_layers=3,
                encoder_attention_heads=4,
                decoder_attention_heads=4,
                encoder_ffn_dim=48,
                decoder_ffn_dim=48,
                max_position_embeddings=64,
                activation_function="relu",
                scale_embedding=True,
                pad_token_id=0,
                eos_token_id=1,
                decoder_start_token_id=0,
                forced_eos_token_id=None,
            ),
            "MarianMTModel",
            "unigram",
        ),
    }


@pytest.mark.parametrize(
    "name",
    [
        "gpt2",
        "llama",
        "bert",
        "bert-untied",
        "t5-v1.0",
        "t5-v1.1",
        "marian",
        "mixtral",
        "switch_transformers",
        "deepseek_v3",
    ],
)
def test_import_then_export_is_the_identity_on_tensors(name, toks, tmp_path):
    config, cls, kind = hf_configs()[name]
    torch.manual_seed(0)
    original = getattr(transformers, cls)(config).eval()
    if name == "deepseek_v3":  # every norm gain and the routers' correction bias off their init
        with torch.no_grad():
            for key, t in [*original.named_parameters(), *original.named_buffers()]:
                if key.endswith(("norm.weight", "layernorm.weight", "e_score_correction_bias")):
                    t.add_(torch.randn_like(t) * 0.1)
    if name == "t5-v1.1":  # transformers 5 ties a fresh T5 head whatever the config; untie it
        original.lm_head.weight = torch.nn.Parameter(torch.randn_like(original.shared.weight) * 0.05)
    src = tmp_path / "hf"
    original.save_pretrained(src)
    hf_tokenizer(load_tokenizer(toks[kind])).save_pretrained(src)

    run = import_hf(src, tmp_path / "run")
    model = tformer.load_checkpoint(run)
    assert model.config.flavour == name.split("-")[0]
    assert_logits_match(model, original, model.config)
    back = export_hf(run, tmp_path / "back")
    a, b = load_file(src / "model.safetensors"), load_file(back / "model.safetensors")
    assert sorted(a) == sorted(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert load_tokenizer(back).to_str() == load_tokenizer(src).to_str()


# -- fine-tuning hand-off: the examples lower the loss -------------------------------------------


def _example(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_hf_trainer_fine_tunes_an_exported_bert_for_classification(trained, tmp_path):
    out = export_hf(trained("bert-tiny")[0], tmp_path / "hf")
    result = _example("finetune_bert_classification").main(
        [
            str(out),
            "--out",
            str(tmp_path / "cls"),
            "--max-steps",
            "30",
            "--train-pairs",
            "300",
            "--eval-pairs",
            "20",
            "--batch-size",
            "8",
            "--lr",
            "2e-3",
        ]
    )
    losses = result["losses"]
    assert len(losses) >= 5 and sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.05, losses


def test_hf_trainer_fine_tunes_an_exported_t5_on_translation_pairs(trained, tmp_path):
    out = export_hf(trained("t5-tiny")[0], tmp_path / "hf")
    result = _example("finetune_t5_translation").main(
        [
            str(out),
            "--out",
            str(tmp_path / "mt"),
            "--max-steps",
            "30",
            "--train-pairs",
            "300",
            "--eval-pairs",
            "20",
            "--batch-size",
            "8",
            "--max-length",
            "32",
        ]
    )
    losses = result["losses"]
    assert len(losses) >= 5 and sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.1, losses


# -- bad input: one-line errors, nothing left behind ---------------------------------------------

NO_HF_EQUIVALENT = [
    ("gpt2-tiny", dict(position="rotary"), "position"),
    ("gpt2-tiny", dict(bias=False), "bias"),
    ("gpt2-tiny", dict(norm="rmsnorm"), "norm"),
    ("gpt2-tiny", dict(norm_position="post"), "norm_position"),
    ("gpt2-tiny", dict(num_kv_heads=2), "num_kv_heads"),
    ("llama-tiny", dict(activation="gelu"), "activation"),
    ("llama-tiny", dict(attn_scale=False), "attn_scale"),
    ("llama-tiny", dict(position="learned"), "position"),
    ("bert-tiny", dict(norm_position="pre"), "norm_position"),
    ("transformer-tiny", dict(norm_position="pre"), "norm_position"),
    ("transformer-tiny", dict(position="learned"), "position"),
    ("transformer-tiny", dict(tie_embeddings=False), "tie_embeddings"),
    ("bert-tiny", dict(embed_norm=False), "embed_norm"),
    ("t5-tiny", dict(attn_scale=True), "attn_scale"),
    ("t5-tiny", dict(bias=True), "bias"),
    ("t5-tiny", dict(num_kv_heads=2), "num_kv_heads"),
    ("t5-tiny", dict(embed_scale=True), "embed_scale"),
    ("gpt2-tiny", dict(flavour="custom"), "flavour"),
    ("gpt2-tiny", dict(flavour="t5"), "family"),
    ("bert-tiny", dict(moe={"num_experts": 4, "top_k": 2}), "moe"),  # BERT has no HF MoE twin
    ("llama-tiny", dict(moe={"num_experts": 4, "top_k": 2}), "moe"),
    ("mixtral-tiny", dict(moe={"capacity_factor": 1.25}), "moe.capacity_factor"),
    ("mixtral-tiny", dict(moe={"num_shared_experts": 1}), "moe.num_shared_experts"),
    ("mixtral-tiny", dict(moe={"router_softmax": "all"}), "moe.renormalize"),
    ("switch-tiny", dict(moe={"expert_capacity": None}), "moe.expert_capacity"),
    ("qwen2-moe-tiny", dict(moe={"shared_gate": False}), "moe.shared_gate"),
    ("llama-tiny", dict(qkv_bias=True), "qkv_bias"),
    ("switch-tiny", dict(moe={"top_k": 2}), "moe.top_k"),
    ("switch-tiny", dict(tie_embeddings=False), "tie_embeddings"),
    ("llama-tiny", dict(num_kv_heads=None, attention="mla"), "attention"),
    ("llama-tiny", dict(yarn={"factor": 2.0}), "yarn.factor"),
    ("mixtral-tiny", dict(moe={"first_dense": 1}), "moe"),
    ("deepseek-v3-tiny", dict(attention="mha"), "attention"),
    ("deepseek-v3-tiny", dict(moe={"shared_gate": True}), "moe.shared_gate"),
]


@pytest.mark.parametrize(
    "preset,overrides,field",
    NO_HF_EQUIVALENT,
    ids=[f"{p}-{'-'.join(f'{k}={v}' for k, v in o.items())}" for p, o, _ in NO_HF_EQUIVALENT],
)
def test_config_without_hf_equivalent_is_a_one_line_error_naming_the_field(preset, overrides, field, toks, tmp_path):
    model = tformer.build_model(preset, vocab_size=512, **overrides)
    ckpt = save_run(model, toks[KIND[model.config.family]], tmp_path / "run")
    with pytest.raises(ExportError) as e:
        export_hf(ckpt, tmp_path / "hf")
    message = str(e.value)
    assert "\n" not in message and f"{field}=" in message, message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def _gpt2_run(toks, run):
    return save_run(tformer.build_model("gpt2-tiny", vocab_size=512), toks["bpe"], run)


def test_missing_tokenizer_is_an_error_and_writes_nothing(toks, tmp_path):
    ckpt = _gpt2_run(toks, tmp_path / "run")
    (tmp_path / "run" / "tokenizer.json").unlink()
    with pytest.raises(ExportError, match="no tokenizer.json.*--tokenizer"):
        export_hf(ckpt, tmp_path / "hf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    # given explicitly, it works
    assert (export_hf(ckpt, tmp_path / "hf", tokenizer=toks["bpe"]) / "tokenizer.json").is_file()


def test_tokenizer_of_another_model_is_an_error(toks, tmp_path):
    ckpt = _gpt2_run(toks, tmp_path / "run")
    with pytest.raises(ExportError, match="tokenizer"):
        export_hf(ckpt, tmp_path / "hf", tokenizer=toks["unigram"])  # its eos </s> is id 1, not 0
    small = save_run(tformer.build_model("gpt2-tiny", vocab_size=300), toks["bpe"], tmp_path / "small")
    with pytest.raises(ExportError, match="the tokenizer has 512 tokens but model vocab_size=300"):
        export_hf(small, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_incomplete_checkpoint_is_an_error_and_writes_nothing(toks, tmp_path):
    ckpt = _gpt2_run(toks, tmp_path / "run")
    (ckpt / "COMPLETE").unlink()
    with pytest.raises(CheckpointError, match="incomplete"):
        export_hf(ckpt, tmp_path / "hf")
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        export_hf(tmp_path / "run", tmp_path / "hf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_non_empty_output_needs_force_and_is_replaced_whole(toks, tmp_path):
    ckpt = _gpt2_run(toks, tmp_path / "run")
    out = tmp_path / "hf"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    with pytest.raises(ExportError, match="not empty.*--force"):
        export_hf(ckpt, out)
    assert sorted(p.name for p in out.iterdir()) == ["stale.txt"]
    export_hf(ckpt, out, force=True)
    assert not (out / "stale.txt").exists() and (out / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "run"]
    (tmp_path / "empty").mkdir()  # an existing empty directory is fine
    export_hf(ckpt, tmp_path / "empty")
    with pytest.raises(ExportError, match="holds the input"):  # --force never deletes the source
        export_hf(ckpt, tmp_path / "run", force=True)
    with pytest.raises(ExportError, match="holds the input"):
        import_hf(out, out, force=True)
    assert (ckpt / "COMPLETE").is_file() and (out / "config.json").is_file()


def test_failure_while_writing_leaves_no_partial_output(toks, tmp_path, monkeypatch):
    ckpt = _gpt2_run(toks, tmp_path / "run")

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("tformer.export.hf.save_hf_tokenizer", broken)
    with pytest.raises(OSError, match="disk full"):
        export_hf(ckpt, tmp_path / "hf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_import_refuses_what_tformer_cannot_express(tmp_path):
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2, scale_attn_by_inverse_layer_idx=True
    )
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "hf")
    with pytest.raises(ExportError, match="scale_attn_by_inverse_layer_idx"):
        import_hf(tmp_path / "hf", tmp_path / "run")
    transformers.DistilBertConfig().save_pretrained(tmp_path / "other")
    with pytest.raises(ExportError, match="model_type='distilbert'"):
        import_hf(tmp_path / "other", tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_cli_export_and_import(toks, tmp_path, capsys):
    ckpt = _gpt2_run(toks, tmp_path / "run")
    old = os.umask(0o022)
    try:  # every file of an export and of an import: the umask's mode (safetensors' own is 0600)
        assert cli_main(["export", str(tmp_path / "run"), "--to", "hf", str(tmp_path / "hf")]) == 0
        assert cli_main(["import", str(tmp_path / "hf"), str(tmp_path / "imported")]) == 0
    finally:
        os.umask(old)
    files = [p for d in ("hf", "imported") for p in (tmp_path / d).rglob("*") if p.is_file()]
    assert any(p.name == "model.safetensors" for p in files) and len(files) > 5
    modes = {p.relative_to(tmp_path).as_posix(): oct(stat.S_IMODE(p.stat().st_mode)) for p in files}
    assert {name: mode for name, mode in modes.items() if mode != oct(0o644)} == {}
    assert cli_main(["export", str(ckpt), "--to", "hf", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: output directory")
    assert sum(line.startswith("error") for line in err) == 1
    assert (tmp_path / "imported" / "checkpoints" / "step_00000000" / "COMPLETE").is_file()
    no_bias = tformer.build_model("gpt2-tiny", vocab_size=512, bias=False)
    bad = save_run(no_bias, toks["bpe"], tmp_path / "bad")
    assert cli_main(["export", str(bad), "--to", "hf", str(tmp_path / "hf2")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: cannot export to HF GPT2LMHeadModel: bias=False")
    assert sum(line.startswith("error") for line in err) == 1 and not (tmp_path / "hf2").exists()


@pytest.mark.parametrize("name", ["bert-tiny", "gpt2-tiny", "llama-tiny", "t5-tiny", "t5-v1.1-tiny", "transformer-tiny"])
def test_to_hf_model_is_the_export_in_memory(name):
    """``to_hf_model`` (the GPU benchmark's HF twin): the exported class, the same parameter count
    (Marian's fixed sinusoidal tables aside), equal logits, and weights of its own (a step on one
    leaves the other as it was)."""
    model = tformer.build_model(name).eval()
    hf = to_hf_model(model).eval()
    assert type(hf).__name__ == TARGETS[model.config.flavour].HF_CLASS
    fixed = sum(p.numel() for n, p in hf.named_parameters() if "embed_positions" in n)
    assert sum(p.numel() for p in hf.parameters()) - fixed == model.num_parameters()
    ids = torch.randint(3, model.config.vocab_size, (2, 12))
    with torch.no_grad():
        if model.config.family == "encdec":
            target = torch.randint(3, model.config.vocab_size, (2, 7))
            ours, theirs = model(ids, labels=target).logits, hf(input_ids=ids, labels=target).logits
        else:
            ours, theirs = model(ids).logits, hf(input_ids=ids).logits
    torch.testing.assert_close(ours[..., : model.config.vocab_size], theirs, atol=1e-4, rtol=1e-4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(1.0)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_deepseek_v3_export_then_import_is_bitwise_and_drops_only_mtp(toks, tmp_path):
    """Every weight and buffer moved off its init (norm gains, the routers' correction bias): the
    tensors come back bitwise; the multi-token prediction depth is the one thing left out."""
    torch.manual_seed(0)
    preset, overrides = CASES["deepseek-v3-odd-groups-yarn"]
    model = tformer.build_model(preset, init_std=0.1, mtp_depth=1, **overrides)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if t.dim() == 1 and name in model.state_dict():  # not the rotary tables (recomputed)
                t.add_(torch.randn_like(t) * 0.1)
    out = export_hf(save_run(model, toks["bpe"], tmp_path / "run"), tmp_path / "hf")
    back = tformer.load_checkpoint(import_hf(out, tmp_path / "back"))
    ours, theirs = model.state_dict(), back.state_dict()
    assert sorted(k for k in ours if not k.startswith("mtp.")) == sorted(theirs)
    assert any(k.startswith("mtp.") for k in ours) and back.config.mtp_depth == 0
    for key, value in theirs.items():
        assert torch.equal(ours[key], value), key
    # training-only switches HF's config does not carry (the balancing rate, the sequence-wise loss,
    # the MTP weight) come back at their defaults; the model computes the same: bitwise equal logits
    ids = torch.randint(3, 500, (2, 9))
    with torch.no_grad():
        assert torch.equal(model.eval()(ids).logits, back.eval()(ids).logits)
