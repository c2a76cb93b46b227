"""[zoo-enc]'s flavours under every parallel dimension, each equal to one process of the same global
batch (tests/test_mesh.py's bound): ModernBERT (local and global layers, packed MLM rows), T5Gemma
(Gemma 2 blocks in both stacks, soft-capped attention and logits, the encoder's own window) and
Gemma 3 (CP and PP; its TP and FSDP2 in test_zoo_gemma.py); and activation checkpointing, compile
and float8's layer choice for the three."""

from __future__ import annotations

import pytest
import torch

from test_zoo_layouts import _batch as zoo_batch
from test_zoo_layouts import _grads

# ModernBERT at test size: one global and one local block (window 16, bidirectional: 8 keys each
# side), packed rows of whole documents with document masks (the recipe's own data path)
MODERNBERT = ["model.global_every=2", "model.attn_window=16"]
MODERNBERT_LAYOUTS = [
    ("modernbert", ["parallel.tp=2", "parallel.sp=true"], 1),
    ("modernbert", ["parallel.strategy=fsdp", "parallel.dp_shard=2"], 2),
    # 64 positions over 2 ranks in 4 chunks of 16: every local block's window crosses a shard
    # boundary, and packed documents straddle it
    ("modernbert", ["parallel.cp=2"], 1),
    # every stage takes the documents' ids with the micro-batch (pipeline.MODEL_KWARGS)
    ("modernbert", ["parallel.pp=2", "parallel.pp_schedule=gpipe", "grad_accum=2"], 2),
]

# T5Gemma at test size: windows of 16 (decoder) and 32 (encoder) under 64 encoder positions
T5GEMMA = ["model.attn_window=16", "model.encoder_window=32"]
T5GEMMA_LAYOUTS = [
    ("t5gemma", ["parallel.tp=2", "parallel.sp=true"], 1),
    ("t5gemma", ["parallel.strategy=fsdp", "parallel.dp_shard=2"], 2),
    ("t5gemma", ["parallel.pp=2", "parallel.pp_schedule=gpipe", "grad_accum=2"], 2),
    # soft-capped scores across the shards, both stacks' windows crossing the boundary
    ("t5gemma", ["parallel.cp=2"], 1),
]


@pytest.mark.timeout(1800)
def test_modernbert_layouts_equal_one_process(cache, tmp_path_factory):
    """TP + SP, FSDP2, CP (windows and packed documents across the shard boundary) and a pipeline
    cut of ModernBERT, each within test_mesh's layout bound of one process."""
    import test_mesh

    test_mesh.assert_layouts_equal_one_process(
        "modernbert", ("modernbert-tiny", MODERNBERT), MODERNBERT_LAYOUTS, tmp_path_factory, cache
    )


@pytest.mark.timeout(1800)
def test_t5gemma_layouts_equal_one_process(cache, tmp_path_factory):
    """TP + SP, FSDP2 and a pipeline cut of T5Gemma, each within test_mesh's layout bound of one
    process; its soft-cap keeps every attention on the math path, so the yardstick is the run in
    half-size micro-batches (test_mesh._split_twin)."""
    import test_mesh

    test_mesh.assert_layouts_equal_one_process(
        "t5gemma", ("t5gemma-tiny", T5GEMMA), T5GEMMA_LAYOUTS, tmp_path_factory, cache
    )


GEMMA3_LAYOUTS = [
    ("gemma3", ["parallel.cp=2"], 1),
    ("gemma3", ["parallel.pp=2", "parallel.pp_schedule=1f1b", "grad_accum=2"], 2),
]


@pytest.mark.timeout(1800)
def test_gemma3_under_cp_and_pp_equals_one_process(cache, tmp_path_factory):
    """Gemma 3's causal windows and soft-capped scores across cp=2's shards, and its sandwich-normed
    blocks cut into 2 pipeline stages (TP and FSDP2: tests/test_zoo_gemma.py)."""
    import test_mesh

    # a cap that bends the tiny model's scores (Gemma 2's 50 would barely touch them)
    flags = ["model.global_every=2", "model.attn_window=16", "model.attn_softcap=2.0"]
    test_mesh.assert_layouts_equal_one_process("gemma3", ("gemma3-tiny", flags), GEMMA3_LAYOUTS, tmp_path_factory, cache)


# -- activation checkpointing, compile, float8's layer choice ------------------------------------

# windowed and global blocks in each: ModernBERT (bidirectional windows, GeGLU), Gemma 3 (causal
# windows, sandwich norms, QK-norm) and T5Gemma (both stacks, soft-caps, its encoder's own window)
PRESETS = {
    "modernbert": ("modernbert-tiny", dict(global_every=2, attn_window=8)),
    "gemma3": ("gemma3-tiny", dict(num_layers=2, global_every=2, attn_window=8, attn_softcap=2.0)),
    "t5gemma": ("t5gemma-tiny", dict(attn_window=8, encoder_window=8)),
}


def _model(name):
    import tformer

    preset, overrides = PRESETS[name]
    torch.manual_seed(0)
    model = tformer.build_model(preset, dropout=0.0, attn_dropout=0.0, **overrides).float()
    with torch.no_grad():  # every norm gain and bias off its init, so a path that skips one shows
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def _batch(model):
    return zoo_batch(model.config.vocab_size, 2, 0, 24)


@pytest.mark.parametrize("name", list(PRESETS))
def test_activation_checkpointing_trains_what_the_plain_model_trains_bitwise(name):
    """Full AC over every block of each stack: loss and every gradient bitwise those without."""
    from tformer.parallel.ac import apply_activation_checkpointing

    plain, ac = _model(name), _model(name)
    batch = _batch(plain)
    want = _grads(plain, [batch])
    assert apply_activation_checkpointing(ac, "full") == plain.config.num_layers * (2 if name == "t5gemma" else 1)
    got = _grads(ac, [batch])
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), [
        k for k in want if not torch.equal(got[k], want[k])
    ]


@pytest.mark.parametrize("name", list(PRESETS))
def test_the_whole_training_forward_compiles_without_a_graph_break(name):
    """One graph for the model's training forward (the loss-only head, windows, soft-caps, sandwich
    norms): what compile=model and per-block compile trace."""
    from tformer.parallel.compile import allow_dynamic_shapes

    model = _model(name).train()
    allow_dynamic_shapes(model)
    batch = _batch(model)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(lambda **kw: model(**kw, return_logits=False).loss)(**batch)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, [
        str(r.reason)[:200] for r in explained.break_reasons
    ]


def test_float8_takes_the_block_linears_of_each():
    """float8's layer choice (tformer/parallel/float8.py) over the three: every attention and FFN
    projection whose sizes are multiples of 16, in both stacks of T5Gemma; never a norm, the
    embeddings or the vocabulary head."""
    from tformer.parallel.float8 import float8_filter

    for name in PRESETS:
        model = _model(name)
        chosen = float8_filter(model)
        linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        blocks = {n for n in linears if ".layers." in n and all(s % 16 == 0 for s in model.get_submodule(n).weight.shape)}
        assert blocks and blocks <= chosen <= linears, (name, sorted(blocks - chosen), sorted(chosen - linears))
        assert not any("lm_head" in n or "embed" in n or "norm" in n for n in chosen), (name, sorted(chosen))
        if name == "t5gemma":
            assert any(n.startswith("encoder.") for n in chosen) and any(n.startswith("decoder.") for n in chosen)
