"""torch.compile as users expect it (parallel/compile.py): the whole model, and the head with its
loss, trace into one graph under bf16 autocast for every family, and compute what eager does."""

import copy

import pytest
import torch
from rounding import assert_within, float64_throughout, yardstick

from tformer.config import ConfigError
from tformer.models import build_model
from tformer.parallel.compile import allow_dynamic_shapes

# dense families: an MoE layer's routing is traced by dynamo but left eager by tformer (inductor
# cannot lower its data-dependent grouped matmuls on torch 2.13; parallel/compile.py)
PRESETS = ["gpt2-tiny", "llama-tiny", "bert-tiny", "t5-tiny", "t5-v1.1-tiny", "transformer-tiny"]


def _batch(model, b=2, s=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    ids = torch.randint(5, vocab, (b, s), generator=g)
    if model.config.family == "encdec":
        return {"input_ids": ids, "labels": torch.randint(5, vocab, (b, 8), generator=g)}
    labels = ids.clone()
    if model.config.family == "encoder":  # 15% labelled, as the MLM collator leaves them
        labels = labels.masked_fill(torch.rand(b, s, generator=g) > 0.15, -100)
    return {"input_ids": ids, "labels": labels}


# the routed ones: Mixtral's softmax top-k, Qwen3-MoE's, DeepSeek-V3's grouped sigmoid routing with
# its loss-free bias (loads counted in the graph) and MTP, gpt-oss's biased clamped experts
MOE_PRESETS = ["mixtral-tiny", "qwen3-moe-tiny", "deepseek-v3-tiny", "gpt-oss-tiny"]


@pytest.mark.parametrize("preset", PRESETS + MOE_PRESETS)
def test_the_whole_training_forward_is_one_graph_under_bf16(preset):
    """The trainer's forward (loss only, chunked head) of every family: one graph, no break (a
    break would cut it in two and return to Python between the parts). A routed layer too: its
    counts have a fixed shape (``moe.expert_counts``), its experts run one grouped matmul in the
    autocast dtype, and the loss-free bias's recomputation check reads a flag, not autograd's task."""
    torch.manual_seed(0)
    model = build_model(preset).train()
    allow_dynamic_shapes(model)
    model.loss_chunk_size = 16
    batch = _batch(model)

    def step(**kw):
        return model(**kw, return_logits=False).loss

    torch._dynamo.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        explained = torch._dynamo.explain(step)(**batch)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, [
        str(r.reason)[:200] for r in explained.break_reasons
    ]


@pytest.mark.parametrize("preset", ["gpt2-tiny", "bert-tiny", pytest.param("mixtral-tiny", marks=pytest.mark.long)])
def test_a_compiled_model_computes_what_eager_does(preset):
    """Loss and gradients of the compiled step (compile=model's graph, run by AOTAutograd without
    code generation) equal eager's in fp32: the chunked loss's traced backward, BERT's whole head at
    its labelled rows, the MoE model with its routing between graphs."""
    torch.manual_seed(0)
    model = build_model(preset).train()
    allow_dynamic_shapes(model)
    model.config.dropout = 0.0
    model.loss_chunk_size = 16
    batch = _batch(model)
    exact_model = copy.deepcopy(model).double()  # before a forward (an MoE layer keeps its statistics)
    results = []
    for compiled in (False, True):
        torch._dynamo.reset()
        model.zero_grad()
        whole = not model.config.moe.enabled  # MoE: its routing is a graph break (parallel/compile.py)
        run = torch.compile(model, fullgraph=whole, backend="aot_eager") if compiled else model
        loss = run(**batch, return_logits=False).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (eager, eager_grads), (comp, comp_grads) = results
    # not bitwise: AOTAutograd's decompositions reorder some sums (BERT's head at its labelled rows,
    # every gradient; gpt2 happens to agree exactly). The compiled step may lie a few times as far
    # from eager's as eager's lies from the same model in float64 throughout (tests/rounding.py)
    exact_model.loss_chunk_size = None  # the chunked loss keeps its gradient in fp32; the exact value is one
    with float64_throughout():
        exact = exact_model(**batch, return_logits=False).loss
        exact.backward()
    exact_grads = {"loss": exact.detach(), **{n: p.grad for n, p in exact_model.named_parameters() if p.grad is not None}}
    scale = max(g.abs().max().item() for g in eager_grads.values())  # a key bias's exact gradient is 0
    yard = yardstick({"loss": eager, **eager_grads}, exact_grads, scale)
    ratio = assert_within({"loss": comp, **comp_grads}, {"loss": eager, **eager_grads}, yard, scale, preset)
    print(f"{preset}: aot_eager vs eager {ratio:.2f} yardsticks ({yard:.1e})")


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (["compile=maybe"], "compile='maybe' is not allowed; use true (every block and the head), model"),
        (["compile=model", "parallel.strategy=fsdp"], "compile=model does not compose with parallel.strategy=fsdp"),
        (["compile=model", "parallel.tp=2"], "compile=model does not compose with parallel.tp=2"),
    ],
)
def test_compile_settings_that_cannot_run_are_one_line(tmp_path, overrides, needle):
    from tformer.train.config import load_config

    from train_helpers import CONFIGS

    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        load_config(CONFIGS / "gpt2-tiny.yaml", [f"output_dir={tmp_path}", *overrides])


@pytest.mark.long  # 38 s with inductor's cache cold, as in a fresh CI checkout
def test_compile_model_trains_what_eager_trains_through_inductor(tmp_path):
    """``compile=model`` in the trainer, inductor's generated code and all: one graph per step (no
    break), and 3 fp32 AdamW steps of gpt2-tiny train what eager trains, to the layout bound
    (test_mesh.LAYOUT_FACTOR times the distance from the eager run to the same run with the
    attention written out, another valid summation order, measured here). Fused kernels sum in
    another order, which Adam's division by each gradient's magnitude grows in the parameters; a
    wrong kernel is far outside: compiled only, the chunked loss's divisor one too many moved the
    losses 6.5e4 yardsticks (3.9e-3; Adam's normalisation hides it from the parameters), one row
    left out of the head's weight gradient the parameters 9.3e3 (3.7e-2) and the losses 91 (5.4e-6,
    which the fixed bound of 1e-5 this replaces let pass)."""
    from test_mesh import FP32_ROUNDING, LAYOUT_FACTOR
    from torch._dynamo.utils import counters

    from tformer.train.config import load_config
    from tformer.train.trainer import Trainer

    from train_helpers import CONFIGS, losses, small_overrides

    common = ["max_steps=3", "eval_every=0", "save_every=0", "model.dropout=0.0", "micro_batch_size=4"]
    runs = {}
    for mode, flags in (("false", []), ("math", ["model.attn_impl=math"]), ("model", ["compile=model"])):
        torch._dynamo.reset()
        counters.clear()
        out = tmp_path / mode
        t = Trainer(load_config(CONFIGS / "gpt2-tiny.yaml", small_overrides("gpt2-tiny", out, *common, *flags)))
        assert (t.model._compiled_call_impl is not None) == (mode == "model")
        t.fit()
        if mode == "model":
            assert not counters["graph_break"], dict(counters["graph_break"])
            assert counters["inductor"], "inductor generated no code"
        runs[mode] = (losses(out), {k: v.detach().clone() for k, v in t.model.state_dict().items()})

    def distance(mode):
        (got, got_state), (want, want_state) = runs[mode], runs["false"]
        assert got.keys() == want.keys() == {1, 2, 3}, (mode, got, want)
        loss = max(abs(got[s] - want[s]) / want[s] for s in want)
        # a key bias's exact gradient is 0 (softmax ignores a per-query constant): round-off alone
        params = max(
            ((got_state[k] - v).abs().max() / v.abs().max().clamp(min=1e-6)).item()
            for k, v in want_state.items()
            if not k.endswith("k_proj.bias")
        )
        return loss, params

    yard = [max(y, FP32_ROUNDING) for y in distance("math")]
    got = distance("model")
    # measured on a 2-core AVX2 EPYC: losses bitwise equal (0), parameters 3.6 yardsticks (1.5e-5 of 4.0e-6)
    print(f"compile=model vs eager, fp32: loss {got[0]:.1e}, parameters {got[1]:.1e}; yardsticks {yard}")
    assert all(g <= LAYOUT_FACTOR * y for g, y in zip(got, yard)), (got, yard, runs["false"][0], runs["model"][0])
