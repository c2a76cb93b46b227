"""Today's decoders (Qwen3, Qwen3-MoE, gpt-oss) against their HF twins, both ways: logits within a
float64-derived bound on tiny random HF configs at odd shapes with every weight moved off its
init, greedy generation token-equal, export -> import bitwise, and parameter counts equal to
transformers' own models on the meta device and within 1% of the published totals."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
import transformers
from rounding import FACTOR, float64_throughout, relative
from safetensors.torch import load_file

import tformer
from tformer.data import hf_tokenizer, load_tokenizer
from tformer.export import export_hf, import_hf
from tformer.export.hf import TARGETS
from tformer.generate import generate
from tformer.plan.moe import active_parameters

from test_export import batch_for, corpus, save_run, toks  # noqa: F401 - session fixtures shared with test_export

pytestmark = pytest.mark.usefixtures("one_thread")


def hf_configs():
    """Tiny random HF configs at odd shapes: heads wider than d_model / num_heads, GQA, an odd
    FFN width, untied heads."""
    t = transformers
    common = dict(
        vocab_size=512,
        hidden_size=40,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=14,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    oss = dict(
        {k: v for k, v in common.items() if k != "rope_parameters"},
        intermediate_size=22,
        num_local_experts=5,
        num_experts_per_tok=3,
        swiglu_limit=0.6,  # low enough that the clamps bite on these weights
        swiglu_alpha=1.3,
        sliding_window=4,
    )
    yarn = dict(rope_type="yarn", rope_theta=5000.0, factor=4.0, original_max_position_embeddings=16, truncate=False)
    moe = dict(moe_intermediate_size=22, num_experts=5, num_experts_per_tok=3, router_aux_loss_coef=0.01)
    return {
        # windows of 4 on blocks 0 and 2 (block 1 global), YaRN x4 over 16 positions
        "gpt_oss": t.GptOssConfig(**oss, rope_parameters=yarn),
        # global every third block, plain RoPE, tied
        "gpt_oss-every-third-plain-rope-tied": t.GptOssConfig(
            **{**oss, "tie_word_embeddings": True},
            rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        ),
        "qwen3": t.Qwen3Config(**common, intermediate_size=90),
        # every other block MoE (the others dense 90 wide), top-3 of 5 not renormalised
        "qwen3_moe": t.Qwen3MoeConfig(**common, **moe, intermediate_size=90, decoder_sparse_step=2, norm_topk_prob=False),
        "qwen3_moe-tied-renormalised": t.Qwen3MoeConfig(
            **{**common, "tie_word_embeddings": True}, **moe, intermediate_size=90, norm_topk_prob=True
        ),
        "qwen3-tied": t.Qwen3Config(
            **{**common, "tie_word_embeddings": True, "num_key_value_heads": 1}, intermediate_size=60
        ),
    }


def hf_model_of(config):
    name = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "gpt_oss": "GptOssForCausalLM"}
    return getattr(transformers, name[config.model_type])


def perturb(model: torch.nn.Module, seed: int = 0) -> None:
    """Every parameter and persistent float buffer moved off its init (norm gains off 1, biases
    and sinks off 0), so a tensor mapped to the wrong place or left out shows in the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() == 1 else 0.05))


def load_hf(out):
    config = transformers.AutoConfig.from_pretrained(out)
    extra = {}
    if config.model_type in ("qwen3_moe", "gpt_oss"):
        extra["experts_implementation"] = "eager"  # grouped_mm on CPU refuses odd widths (test_export)
    return transformers.AutoModelForCausalLM.from_pretrained(out, **extra).eval()


def assert_parity(model, hf):
    """Logits at every real position of a ragged batch: HF's fp32 logits lie within FACTOR
    yardsticks of ours, a yardstick being how far our own fp32 logits lie from our model run in
    float64 (tests/rounding.py). A tensor in the wrong place, a missing norm or an off-by-one
    mask is orders of magnitude outside."""
    cfg = model.config
    ids, mask, _, _ = batch_for(cfg)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    keep = mask.bool()
    with torch.no_grad():
        ours = model(ids, mask, position_ids=positions).logits[..., : cfg.vocab_size][keep]
        theirs = hf(input_ids=ids, attention_mask=mask, position_ids=positions).logits[keep]
        with float64_throughout():
            exact = copy.deepcopy(model).double()(ids, mask, position_ids=positions).logits[..., : cfg.vocab_size][keep]
    yard = max(2.0**-24, relative(ours, exact))
    err = relative(theirs, exact)
    print(f"{cfg.flavour}: HF {err / yard:.2f} yardsticks ({yard:.1e}) from float64, ours 1")
    assert err <= FACTOR * yard, (err, yard)


def assert_greedy(model, hf, steps=8):
    ids, mask, _, _ = batch_for(model.config, seed=1)
    ids, mask = ids[[0, 2], :6], mask[[0, 2], :6]  # HF decoders generate from left padding
    ours = generate(model, ids, steps, attention_mask=mask)
    theirs = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=steps, do_sample=False)
    assert ours.tolist() == theirs.tolist()


# -- HF -> tformer -> HF: import, parity, generation, export bitwise -----------------------------


@pytest.mark.parametrize(
    "name",
    ["qwen3", "qwen3-tied", "qwen3_moe", "qwen3_moe-tied-renormalised", "gpt_oss", "gpt_oss-every-third-plain-rope-tied"],
)
def test_import_matches_hf_and_exports_back_bitwise(name, toks, tmp_path):  # noqa: F811
    config = hf_configs()[name]
    torch.manual_seed(0)
    original = hf_model_of(config)(config).eval()
    for layer in original.model.layers:  # routers' choices clear-cut: no near-ties that rounding could flip
        router = getattr(layer.mlp, "gate", None) or getattr(layer.mlp, "router", None)
        if router is not None:
            router.weight.data.normal_(0.0, 1.0)
    perturb(original)
    src = tmp_path / "hf"
    original.save_pretrained(src)
    hf_tokenizer(load_tokenizer(toks["bpe"])).save_pretrained(src)
    run = import_hf(src, tmp_path / "run")
    model = tformer.load_checkpoint(run).eval()
    assert model.config.flavour == config.model_type
    original = load_hf(src)
    assert_parity(model, original)
    assert_greedy(model, original)
    back = export_hf(run, tmp_path / "back")
    a, b = load_file(src / "model.safetensors"), load_file(back / "model.safetensors")
    assert sorted(a) == sorted(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key


def meaning(cfg):
    """``cfg`` with equal spellings made one: top-k softmax as softmax-all renormalised (the same
    weights), YaRN's settings at their defaults where YaRN is off (unused)."""
    if cfg.moe.router_softmax == "topk":
        cfg = cfg.replace(moe={**dataclasses.asdict(cfg.moe), "router_softmax": "all", "renormalize": True})
    if not cfg.yarn.enabled:
        cfg = cfg.replace(yarn={})
    return cfg


# -- tformer -> HF -> tformer: export, parity, import bitwise ------------------------------------

EXPORTS = {
    "qwen3-tiny-odd": ("qwen3-tiny", dict(vocab_size=512, d_model=40, d_head=14, d_ff=90, num_layers=3, rope_theta=5e3)),
    "qwen3-tiny-tied-mqa-geglu": (
        "qwen3-tiny",
        dict(vocab_size=512, num_kv_heads=1, tie_embeddings=True, activation="geglu"),
    ),
    "qwen3-moe-tiny-odd-every-other-topk": (
        "qwen3-moe-tiny",
        dict(vocab_size=512, d_model=40, d_head=14, d_ff=90, num_layers=3, moe=dict(moe_every=2, router_softmax="topk")),
    ),
    "gpt-oss-tiny-odd-window-5": (
        "gpt-oss-tiny",
        dict(vocab_size=512, d_model=40, d_head=14, num_layers=3, attn_window=5, moe=dict(swiglu_limit=0.6, top_k=3)),
    ),
    "gpt-oss-tiny-every-third-no-yarn-tied": (
        "gpt-oss-tiny",
        dict(vocab_size=512, num_layers=3, global_every=3, yarn=dict(factor=None), tie_embeddings=True),
    ),
    "qwen3-moe-tiny-all-not-renormalised-tied": (
        "qwen3-moe-tiny",
        dict(vocab_size=512, tie_embeddings=True, moe=dict(num_experts=5, top_k=3, d_expert=22, renormalize=False)),
    ),
}


@pytest.mark.parametrize("case", list(EXPORTS))
def test_export_matches_hf_and_imports_back_bitwise(case, toks, tmp_path):  # noqa: F811
    preset, overrides = EXPORTS[case]
    torch.manual_seed(0)
    model = tformer.build_model(preset, **overrides).eval()
    perturb(model)
    ckpt = save_run(model, toks["bpe"], tmp_path / "run")
    out = export_hf(ckpt, tmp_path / "hf")
    hf = load_hf(out)
    assert type(hf).__name__ == TARGETS[model.config.flavour].HF_CLASS
    assert_parity(model, hf)
    assert_greedy(model, hf)
    back = tformer.load_checkpoint(import_hf(out, tmp_path / "back"))
    assert meaning(back.config) == meaning(model.config)
    theirs = back.state_dict()
    for key, value in model.state_dict().items():
        assert torch.equal(value, theirs[key]), key


# -- the planner's counts: transformers' own model, and the published figures --------------------

# preset -> (published total, published active), in parameters
PUBLISHED = {
    "qwen3-0.6b": (0.6e9, None),
    "qwen3-8b": (8.2e9, None),
    "qwen3-30b-a3b": (30.5e9, 3.3e9),
    "gpt-oss-20b": (20.91e9, 3.61e9),  # OpenAI's model card: 20.91B, 3.61B active
    "gpt-oss-120b": (116.83e9, 5.13e9),  # 116.83B, 5.13B active
}
# OpenAI counts active parameters without the token embedding (a lookup, no compute)
ACTIVE_WITHOUT_EMBEDDING = {"gpt-oss-20b", "gpt-oss-120b"}
# Qwen's "3.3B activated" is 3.353B rounded down (its experts 1.811B, attention 0.906B, embedding and
# head 0.622B, routers 0.013B): 1.6% above the printed figure, the only count held to 2%
ACTIVE_TOLERANCE = {"qwen3-30b-a3b": 0.02}


@pytest.mark.parametrize("preset", list(PUBLISHED))
def test_parameter_counts_equal_transformers_and_the_published_figures(preset):
    cfg = tformer.build_config(preset)
    with torch.device("meta"):
        ours = tformer.build_model(cfg)
        target = TARGETS[cfg.flavour]
        hf = getattr(transformers, target.HF_CLASS)(target.hf_config(cfg))
    total = ours.num_parameters()
    assert total == sum(p.numel() for p in hf.parameters())
    published, active = PUBLISHED[preset]
    assert abs(total / published - 1) <= 0.01, total
    if active is not None:
        tolerance = ACTIVE_TOLERANCE.get(preset, 0.01)
        counted = active_parameters(cfg, total)
        if preset in ACTIVE_WITHOUT_EMBEDDING:
            counted -= ours.embed.tok.weight.numel()
        assert counted == ours.num_active_parameters(preset in ACTIVE_WITHOUT_EMBEDDING)  # the planner's, the model's
        assert abs(counted / active - 1) <= tolerance, counted


# -- the blocks against written-out references, with planted defects -----------------------------


def _written_out_qk_norm_attention(attn, x, cos, sin):
    """Causal attention with each head's q and k RMS-normalised (times the gains) before RoPE,
    written out in float64 from the module's weights."""
    from tformer.nn.position import apply_rotary

    b, s, _ = x.shape
    h, kv, d = attn.num_heads, attn.num_kv_heads, attn.d_k

    def heads(t, n):
        return t.view(b, s, n, d).transpose(1, 2)

    def rms(t, gain, eps):
        return t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + eps) * gain

    q = rms(heads(x @ attn.q_proj.weight.t(), h), attn.q_norm.weight, attn.q_norm.eps)
    k = rms(heads(x @ attn.k_proj.weight.t(), kv), attn.k_norm.weight, attn.k_norm.eps)
    v = heads(x @ attn.v_proj.weight.t(), kv)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    k, v = k.repeat_interleave(h // kv, 1), v.repeat_interleave(h // kv, 1)
    scores = q @ k.transpose(-1, -2) / d**0.5
    scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, h * d)
    return out @ attn.o_proj.weight.t()


@pytest.mark.parametrize("impl", ["sdpa", "math"])
def test_qk_norm_attention_is_the_written_out_formula_and_a_missing_norm_is_not(impl):
    from tformer.nn import MultiHeadAttention, Rotary

    torch.manual_seed(0)
    attn = MultiHeadAttention(40, 4, num_kv_heads=2, d_k=14, bias=False, qk_norm=True, norm_eps=1e-5, impl=impl).eval()
    perturb(attn)
    x = torch.randn(2, 9, 40)
    cos, sin = Rotary(14, 5000.0)(torch.arange(9))
    got = attn(x, causal=True, rotary=(cos, sin))
    with torch.no_grad():
        attn64 = copy.deepcopy(attn).double()
        exact = _written_out_qk_norm_attention(attn64, x.double(), cos.double(), sin.double())
        with float64_throughout():
            ours64 = attn64(x.double(), causal=True, rotary=(cos.double(), sin.double()))
    assert relative(ours64, exact) <= 1e-12  # the module computes the formula
    yard = max(2.0**-24, relative(got, exact))
    assert yard <= 1e-5
    for defect in ("q_norm", "k_norm"):  # planted: one of the norms left out
        broken = copy.deepcopy(attn)
        setattr(broken, defect, None)
        assert relative(broken(x, causal=True, rotary=(cos, sin)), exact) > 1e3 * yard, defect


def test_bad_qk_norm_is_one_line():
    with pytest.raises(tformer.ConfigError, match=r"^qk_norm='rms' is not allowed; use one of: none, head$"):
        tformer.build_config("qwen3-tiny", qk_norm="rms")


@pytest.mark.parametrize("preset", ["llama-tiny", "gpt2-tiny"])
def test_a_target_without_qk_norm_refuses_it_naming_the_field(preset, toks, tmp_path):  # noqa: F811
    from tformer.export import ExportError

    model = tformer.build_model(preset, vocab_size=512, qk_norm="head")
    ckpt = save_run(model, toks["bpe"], tmp_path / "run")
    with pytest.raises(ExportError, match="qk_norm='head'") as e:
        export_hf(ckpt, tmp_path / "hf")
    assert "\n" not in str(e.value)


# -- the tiny recipes train -----------------------------------------------------------------------


@pytest.mark.long
@pytest.mark.parametrize("recipe", ["qwen3-tiny", "qwen3-moe-tiny", "gpt-oss-tiny"])
def test_the_tiny_recipe_loss_falls_over_200_steps(recipe, cache, tmp_path):
    from train_helpers import recipe_curve

    curve = recipe_curve(recipe, tmp_path)
    first, last = curve[min(curve)], curve[max(curve)]
    print(f"{recipe}: loss {first:.3f} -> {last:.3f} over 200 steps")
    assert max(curve) == 200 and last < first - 1.5, curve


def _written_out_local_attention(q, k, v, window, sinks, causal):
    """float64, per query and key: a key counts if the window lets it (causal: 0 <= i - j < W;
    bidirectional: |i - j| <= W // 2), and each softmax's denominator holds exp(sink) as well."""
    b, h, s, d = q.shape
    out = torch.zeros_like(q)
    for i in range(s):
        keys = [j for j in range(s) if (0 <= i - j < window if causal else abs(i - j) <= window // 2)]
        scores = torch.einsum("bhd,bhkd->bhk", q[:, :, i], k[:, :, keys]) / d**0.5
        weights = scores.exp()
        denominator = weights.sum(-1, keepdim=True)
        if sinks is not None:
            denominator = denominator + sinks.exp()[None, :, None]
        out[:, :, i] = torch.einsum("bhk,bhkd->bhd", weights / denominator, v[:, :, keys])
    return out


@pytest.mark.parametrize("impl", ["sdpa", "math"])
@pytest.mark.parametrize("causal", [True, False])
def test_windows_and_sinks_are_the_written_out_formula_and_planted_defects_are_not(impl, causal):
    from tformer.nn.attention import local_attention

    torch.manual_seed(0)
    b, h, s, d, window = 2, 3, 11, 8, 4
    q, k, v = (torch.randn(b, h, s, d) for _ in range(3))
    sinks = torch.randn(h)
    exact = _written_out_local_attention(q.double(), k.double(), v.double(), window, sinks.double(), causal)

    def run(window=window, sinks=sinks):
        extra = dict(window=window, sinks=sinks)
        common = dict(padding_mask=None, attn_bias=None, doc_mask=None, scale=d**-0.5, dropout_p=0.0)
        return local_attention(q, k, v, causal=causal, impl=impl, **common, **extra)

    yard = max(2.0**-24, relative(run(), exact))
    assert yard <= 1e-5, yard
    # planted: one key past the window visible; the sink left out of the denominator
    assert relative(run(window=window + (1 if causal else 2)), exact) > 1e3 * yard
    assert relative(run(sinks=None), exact) > 1e3 * yard


def test_a_window_under_the_kv_cache_sees_what_the_full_sequence_sees():
    """Decoding one token at a time with a cache: each new query sees the same window of keys as
    in the whole-sequence forward (the window counts from the query's own position)."""
    torch.manual_seed(0)
    model = tformer.build_model("gpt-oss-tiny", attn_window=3, num_layers=2).eval()
    perturb(model)
    ids = torch.randint(3, 1000, (2, 9))
    with torch.no_grad():
        whole = model(ids).logits
        cache = model.new_cache()
        steps = [model(ids[:, i : i + 1], cache=cache).logits for i in range(ids.shape[1])]
    assert relative(torch.cat(steps, 1), whole) <= 1e-5


def test_yarn_frequencies_and_scale_are_hf_ones():
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from tformer.config import YarnConfig
    from tformer.nn import Rotary

    for truncate in (True, False):
        rope = dict(
            rope_type="yarn", rope_theta=150000.0, factor=32.0, original_max_position_embeddings=4096, truncate=truncate
        )
        hf = GptOssConfig(head_dim=64, rope_parameters=rope)
        want, scale = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
        ours = Rotary(64, 150000.0, YarnConfig(factor=32.0, original_max_seq_len=4096, truncate=truncate))
        assert torch.equal(ours.inv_freq, want) and ours.scale == scale
    plain = Rotary(64, 150000.0)
    assert not torch.equal(plain.inv_freq, ours.inv_freq)  # planted: YaRN left out


BAD = [
    (dict(attn_window=129), "attn_window=129 is longer than max_seq_len=128"),
    (dict(attn_window=0), "attn_window=0 must be >= 1"),
    (dict(global_every=-1), "global_every=-1 must be >= 0"),
    (dict(yarn=dict(factor=0.5)), "model.yarn.factor=0.5 must be > 1"),
    (dict(rope_factor=32.0), "model.rope_factor has moved: write it as model.yarn.factor"),
    (dict(moe=dict(swiglu_limit=0.0)), "model.moe.swiglu_limit=0.0 must be > 0"),
]


@pytest.mark.parametrize("overrides,needle", BAD, ids=[n.split(" ")[0] for _, n in BAD])
def test_bad_gpt_oss_switches_are_one_line(overrides, needle):
    with pytest.raises(tformer.ConfigError) as e:
        tformer.build_config("gpt-oss-tiny", **overrides)
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize(
    "flag,needle",
    [
        ("model.attn_sinks=true", "parallel.cp_kernel=torch does not run with model.attn_sinks=true"),
        ("model.attn_window=16", "parallel.cp_kernel=torch does not run with model.attn_window=16"),
    ],
)
def test_sinks_and_windows_with_a_kernel_that_cannot_take_them_are_one_line(flag, needle, tmp_path, monkeypatch):
    from tformer.config import ConfigError
    from tformer.train.config import load_config
    from tformer.train.trainer import Trainer
    from train_helpers import CONFIGS, small_overrides

    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = load_config(
        CONFIGS / "gpt2-tiny.yaml", small_overrides("gpt2-tiny", tmp_path, "parallel.cp=2", "parallel.cp_kernel=torch", flag)
    )
    with pytest.raises(ConfigError) as e:
        Trainer(cfg)
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


# -- layouts: FSDP2 and TP (+ SP) equal to one process (tests/test_mesh.py's harness) -------------

LAYOUTS = [
    ("qwen3", ["parallel.tp=2", "parallel.sp=true"], 1),
    ("qwen3", ["parallel.tp=2", "parallel.sp=false"], 1),
    ("qwen3", ["parallel.strategy=fsdp", "parallel.dp_shard=2"], 2),
    # gpt-oss (sinks split with their heads under TP) ran on 2026-11-28 against one process: tp=2
    # (+SP) 2.1 yardsticks on the losses and 5.8e-6 relative on the parameters (the sinks the
    # worst), FSDP2 losses bitwise and 1.3e-6 on the parameters; not asserted here because
    # test_mesh's parameter yardstick is degenerate for it (its attn_impl=math twin equals the SDPA
    # run bitwise on the explicit-mask path, a bound of one fp32 rounding): it waits for a twin that
    # rounds differently. Settled in tests/test_zoo_layouts.py: no defect. At the gradient, against
    # float64, gpt-oss under tp=2 + SP is 1.4 yardsticks from one process and FSDP2 0; trainer runs
    # at 61 tokens (a yardstick that is not degenerate) 3.3 and 0.1 on the parameters, once
    # test_mesh compares its key bias (which trains beside sinks) as any parameter
]


@pytest.mark.long
@pytest.mark.timeout(1800)
def test_qwen3_under_fsdp2_and_tp_equals_one_process(cache, tmp_path_factory):
    """QK-norm under TP: each rank normalises its own heads with the whole gain, whose gradient is
    summed over the ranks' heads. Measured on a 2-core AVX2 EPYC: tp=2 (with and without SP) 1.05
    yardsticks on the losses and on the parameters, FSDP2 0 and 0.06; planted (the gains left out of
    the plan, each rank's gain updated from its own heads only) 30 yardsticks (losses) and 3.5e3
    (parameters)."""
    import test_mesh

    test_mesh.assert_layouts_equal_one_process(
        "qwen3", ("qwen3-tiny", ["model.d_head=16"]), LAYOUTS, tmp_path_factory, cache
    )


# -- the path users take after pretraining: the export fine-tuned by HF's own Trainer -------------


def hf_trainer_losses(hf, rows: list[dict], out, *, steps: int, batch: int, lr: float = 3e-3, **extra) -> list[float]:
    """``transformers.Trainer`` on ``hf`` over ``rows`` (dicts of tensors) for ``steps`` steps on the
    CPU, nothing saved or reported: the loss it logged at every step."""
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=steps, per_device_train_batch_size=batch, learning_rate=lr, logging_steps=1,
        save_strategy="no", report_to=[], use_cpu=True, seed=0, disable_tqdm=True, **extra,
    )  # fmt: skip
    trainer = transformers.Trainer(model=hf, args=args, train_dataset=rows)
    trainer.train()
    return [e["loss"] for e in trainer.state.log_history if "loss" in e]


@pytest.mark.parametrize("preset", ["qwen3-tiny", "qwen3-moe-tiny", "deepseek-v3-tiny", "gpt-oss-tiny"])
def test_export_fine_tunes_under_hf_trainer(preset, corpus, toks, tmp_path):  # noqa: F811
    """An exported checkpoint loaded by ``AutoModelForCausalLM`` trains under ``transformers.Trainer``:
    every parameter HF has gets a gradient (none left frozen or detached by the export) and the loss
    on the repeated batch falls."""
    torch.manual_seed(0)
    model = tformer.build_model(preset, vocab_size=512).eval()
    perturb(model)
    out = export_hf(save_run(model, toks["bpe"], tmp_path / "run"), tmp_path / "hf")
    hf = load_hf(out).train()
    tok = load_tokenizer(toks["bpe"])
    text = " ".join(corpus.read_text().split()[:2000])
    ids = tok.encode(text).ids
    rows = [{"input_ids": ids[k * 24 : (k + 1) * 24], "labels": ids[k * 24 : (k + 1) * 24]} for k in range(8)]
    untouched = {n: p.detach().clone() for n, p in hf.named_parameters()}
    losses = hf_trainer_losses(hf, rows, tmp_path / "ft", steps=12, batch=8, lr_scheduler_type="constant")
    assert len(losses) == 12 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < 0.8 * losses[0], losses
    stuck = [n for n, p in hf.named_parameters() if torch.equal(p.detach(), untouched[n])]
    assert not stuck, stuck
