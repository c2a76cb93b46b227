"""`tformer plan`: its memory prediction against memory measured on this CPU, and its formulas."""

import contextlib

import pytest
import torch

from tformer import ConfigError, build_model
from tformer.parallel.memory import SavedActivations, model_state_bytes
from tformer.args import parse_bytes
from tformer.plan.activations import activation_bytes
from tformer.plan.memory import estimate
from tformer.plan.states import model_state_bytes as formula


def _measure(model, batch, ac):
    from tformer.parallel.ac import apply_activation_checkpointing

    apply_activation_checkpointing(model, ac)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    with SavedActivations() as saved:
        loss = model(**batch).loss
    loss.backward()
    opt.step()
    return model_state_bytes(model, opt), saved.bytes


@pytest.mark.parametrize(
    "name,ac",
    [("gpt2-tiny", "none"), ("gpt2-tiny", "full"), ("llama-tiny", "none"), ("t5-tiny", "none"), ("bert-tiny", "full")],
)
def test_prediction_within_25_percent_of_measured_memory(name, ac):
    """fp32, one process: model states (params + grads + Adam) + saved activations + logits."""
    extra = {"num_decoder_layers": 4} if "t5" in name else {}
    model = build_model(
        name,
        d_model=128,
        num_layers=4,
        d_ff=512,
        vocab_size=1024,
        dropout=0.0,
        **({"d_head": 32} if "t5" in name else {}),
        **extra,
    ).train()
    b, s, t = 4, 128, 32
    ids = torch.randint(3, 1000, (b, s))
    batch = {"input_ids": ids, "labels": ids if model.config.family != "encdec" else ids[:, :t]}
    states, activations = _measure(model, batch, ac)
    target = t if model.config.family == "encdec" else None
    e = estimate(model.config, "ddp", 1, b, s, target, ac, mixed=False)
    # model states are exact: 16 B per parameter; what the planner leaves out is AdamW's step count,
    # one 4-byte scalar per parameter tensor
    counters = 4 * len(list(model.parameters()))
    assert e.model_states == states - counters, (e.model_states, states, counters)
    # what is held between forward and backward: model states + the activations autograd saved
    kept = e.model_states + activation_bytes(model.config, b, s, target, ac, False, transient=False)
    assert kept == pytest.approx(states + activations, rel=0.25), (kept, states + activations)
    assert e.total > kept  # the peak adds the recomputed block / logits gradient on top


@pytest.mark.parametrize("ac", ["none", "full"])
@pytest.mark.parametrize("name", ["llama-tiny", "gpt2-tiny", "bert-tiny", "t5-tiny"])
def test_planned_activation_peak_is_the_measured_one(name, ac):
    """The planner's activations with their transients (the head's (tokens x vocab) log-softmax,
    T5's (heads x S x S) bias and score gradients, the recomputed block, the norms outside the
    blocks) against the running peak of activation + temporary bytes over one fp32 forward +
    backward (torch's MemTracker), on tiny models where the head and the scores are most of it."""
    from tformer.parallel.ac import apply_activation_checkpointing
    from tformer.parallel.memory import activation_peak_tracker

    torch.manual_seed(0)
    model = build_model(name, dropout=0.0, attn_dropout=0.0, max_seq_len=512)
    apply_activation_checkpointing(model, ac)
    cfg, b, s = model.config, 2, 512
    target = 128 if cfg.family == "encdec" else None
    ids = torch.randint(5, cfg.vocab_size, (b, s))
    labels = torch.randint(5, cfg.vocab_size, (b, target)) if target else ids
    tracker = activation_peak_tracker()
    tracker.track_external(model)
    with tracker:
        model(input_ids=ids, labels=labels, return_logits=False).loss.backward()
    planned = activation_bytes(cfg, b, s, target, ac, False, return_logits=False)
    assert planned == pytest.approx(tracker.peak_activations, rel=0.15), (planned, tracker.peak_activations)


DENSE = {"num_experts": 0}  # (the MoE FFN's activations are moe.py's terms)
MLA_SQUARE = dict(q_lora_rank=32, kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24)


def _saved_per_layer(name, extra, stack, b=2, s=64, t=32, mixed=False):
    """Bytes autograd saves for one more block of ``stack`` (0: encoder or only stack, 1: T5's
    decoder), measured as the difference of two models: what the planner must predict. ``mixed``:
    under bf16 autocast over fp32 weights (one device or DDP), whose bf16 weight copies count too."""

    def saved(layers):
        torch.manual_seed(0)
        dims = {"num_layers": 2, "num_decoder_layers": 2} if name.startswith(("t5", "transformer")) else {"num_layers": 2}
        dims["num_decoder_layers" if stack else "num_layers"] = layers
        model = build_model(name, d_model=128, d_ff=512, vocab_size=1024, **dims, **extra).train()
        ids = torch.randint(3, 1000, (b, s))
        autocast = torch.autocast("cpu", dtype=torch.bfloat16) if mixed else contextlib.nullcontext()
        with SavedActivations() as got, autocast:
            _ = model(input_ids=ids, labels=ids[:, :t] if model.config.family == "encdec" else ids).loss
        return got.bytes, model.config

    (two, cfg), (three, _) = saved(2), saved(3)
    target = t if cfg.family == "encdec" else None
    one = {"transient": False, "return_logits": False}
    blocks = (1, 0) if stack == 0 else (0, 1)
    planned = activation_bytes(cfg, b, s, target, "none", mixed, blocks=blocks, head=False, fp32_weights=mixed, **one)
    return three - two, planned


@pytest.mark.parametrize(
    "name,extra,stack",
    [
        ("gpt2-tiny", {}, 0),
        ("gpt2-tiny", {"attn_impl": "math"}, 0),
        ("llama-tiny", {}, 0),
        ("llama-tiny", {"attn_impl": "math"}, 0),
        ("bert-tiny", {}, 0),
        ("transformer-tiny", {}, 0),
        ("transformer-tiny", {}, 1),
        ("transformer-tiny", {"attn_impl": "math"}, 1),
        ("t5-tiny", {"d_head": 32}, 0),
        ("t5-tiny", {"d_head": 32}, 1),
        ("t5-tiny", {"d_head": 32, "activation": "geglu", "attn_impl": "math"}, 1),
        ("llama-tiny", {"attn_window": 16}, 0),  # SDPA's explicit window mask, S x S per block
        ("gpt-oss-tiny", {"global_every": 0, "moe": DENSE}, 0),  # sinks: the math path, one more key
        ("deepseek-v3-tiny", {"moe": DENSE}, 0),  # latent attention, values narrower: SDPA's math kernel
        ("deepseek-v3-tiny", {"moe": DENSE, "mla": dict(MLA_SQUARE, q_lora_rank=None)}, 0),  # flash, one q projection
    ],
)
def test_one_block_activations_are_what_autograd_saves(name, extra, stack):
    """The planner's bytes for one block, tensor by tensor, against the unique storages autograd
    saves for it (norm kinds, attention paths, grouped KV heads, activations, cross-attention)."""
    measured, planned = _saved_per_layer(name, {"dropout": 0.0, **extra}, stack)
    assert planned == pytest.approx(measured, rel=0.01), (planned, measured)


@pytest.mark.parametrize(
    "name,stack", [("gpt2-tiny", 0), ("llama-tiny", 0), ("bert-tiny", 0), ("transformer-tiny", 0), ("transformer-tiny", 1)]
)
def test_one_block_under_bf16_autocast_is_what_autograd_saves(name, stack):
    """bf16 autocast over fp32 weights (the one-device and DDP path): the fp32 residual stream the
    norms keep, one bf16 copy of each sub-layer input (nn/cast.py), each decoder layer's bf16 copy of
    the encoder output, and every matmul's bf16 weight copy, against autograd's saved storages.
    (T5's biased attention is left out: on this CPU, SDPA with an fp32 bias computes in fp32, while
    CUDA's autocast runs it in bf16.)"""
    measured, planned = _saved_per_layer(name, {"dropout": 0.0}, stack, mixed=True)
    assert planned == pytest.approx(measured, rel=0.02), (planned, measured)
    unmixed, _ = _saved_per_layer(name, {"dropout": 0.0}, stack)
    assert measured > 0.6 * unmixed  # bf16 does not halve what a block keeps: the planner must know why


@pytest.mark.parametrize("name,stack,masks", [("gpt2-tiny", 0, 2), ("transformer-tiny", 1, 3)])
def test_dropout_keeps_one_mask_per_sub_layer(name, stack, masks):
    """Dropout adds a mask per sub-layer output (attention, cross-attention, FFN). The planner
    counts CUDA's one-byte masks; this CPU keeps float masks, four bytes: the same count."""
    b, s, t = 2, 64, 32
    tokens = b * (t if stack else s)
    measured0, planned0 = _saved_per_layer(name, {"dropout": 0.0}, stack)
    measured, planned = _saved_per_layer(name, {"dropout": 0.1}, stack)
    assert measured - measured0 == pytest.approx(masks * 128 * 4 * tokens, rel=0.01)
    assert planned - planned0 == pytest.approx(masks * 128 * 1 * tokens, rel=0.01)


def test_zero_formulas_and_the_planner_choice():
    p, n = 1_000_000, 4
    assert formula("ddp", p, n, mixed=True) == 16 * p
    assert formula("zero1", p, n, mixed=True) == 4 * p + 12 * p / n
    assert formula("zero2", p, n, mixed=True) == 2 * p + 14 * p / n
    assert formula("zero3", p, n, mixed=True) == 16 * p / n
    assert formula("zero2", p, n, mixed=False) == 4 * p + 12 * p / n
    # what the planner predicts for fp32 DeepSpeed: its fp32 master copy of the partition
    assert formula("zero3", p, n, mixed=False, as_built=True) == 20 * p / n
    assert formula("zero2", p, n, mixed=False, as_built=True) == 4 * p + 16 * p / n
    tiny = build_model("gpt2-tiny")
    assert estimate(tiny.config, "zero3", n, 1, 64, mixed=False).model_states == 20 * tiny.num_parameters() / n
    with torch.device("meta"):
        cfg = build_model("llama-1b").config
    # A 1.2B model does not fit plain DDP on 16 GiB with Adam; the planner must shard
    from tformer.plan import recommend

    fits = recommend(cfg, 8, 16 * 2**30, 2048, None)
    assert fits and fits[0].strategy != "ddp"
    assert all(f.total <= 0.9 * 16 * 2**30 for f in fits)
    with torch.device("meta"):
        deep = build_model("gpt2-xl").config  # 48 layers: block activations dominate the logits
    assert activation_bytes(deep, 1, 1024, None, "full", True) < 0.5 * activation_bytes(deep, 1, 1024, None, "none", True)
    assert parse_bytes("80GB") == 80 * 2**30 and parse_bytes("512MiB") == 512 * 2**20


# --- the measuring instruments the benchmarks and the test above rely on -----------------------
def test_saved_activations_leave_out_parameters_and_their_views():
    lin = torch.nn.Linear(64, 32, bias=False)
    x = torch.randn(8, 64, requires_grad=True)
    with SavedActivations() as saved:
        y = torch.nn.functional.linear(x, lin.weight) + x @ lin.weight.t()  # saves weight and weight.t()
        z = torch.tanh(y)  # saves its output: an activation
    assert saved.bytes == x.nbytes + z.nbytes
    z.sum().backward()  # the hooks hand back what they were given


def test_model_state_bytes_counts_shared_storage_once_and_buckets_apart():
    model = torch.nn.Sequential(torch.nn.Embedding(100, 16), torch.nn.Linear(16, 100, bias=False))
    model[1].weight = model[0].weight  # tied: one storage
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.arange(10)).sum().backward()
    opt.step()
    p = model[0].weight.nbytes
    step = 4  # Adam's step counter: a float32 scalar per parameter
    assert model_state_bytes(model, opt) == 4 * p + step  # weight + grad + exp_avg + exp_avg_sq

    class Engine:  # the shape of a DeepSpeed ZeRO optimizer: partitions plus reduction buckets
        def __init__(self, inner):
            self.optimizer = inner
            self.fp32_partition = [torch.zeros(50)]
            self.ipg_buckets = {0: torch.zeros(1000)}
            self.ipg_buffer = [model[0].weight.grad]  # a bucket that is a model state stays one

    buffers = {}
    states = model_state_bytes(model, Engine(opt), buffers)
    assert states == 4 * p + step + 50 * 4
    assert sum(buffers.values()) == 1000 * 4


def test_model_state_bytes_counts_fsdp2_sharded_gradients():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
        total = sum(p.nbytes for p in model.parameters())
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(torch.randn(3, 16)).sum().backward()
        assert all(type(p.grad).__name__ == "DTensor" for p in model.parameters())
        opt.step()
        # params, grads, Adam's two moments and its step counters (a float32 scalar per parameter)
        assert model_state_bytes(model, opt) == 4 * total + 4 * len(list(model.parameters()))
    finally:
        dist.destroy_process_group()


def test_planner_models_the_chunked_head_op_checkpointing_and_offload(tmp_path, capsys):
    """Each memory setting lowers the planned activations, in the order of what it keeps, and
    `tformer plan` shows the saving of each; BERT's head counts its labelled share only."""
    with torch.device("meta"):
        cfg = build_model("llama-1b").config
    kw = dict(return_logits=False)

    def act(ac="none", **extra):
        return activation_bytes(cfg, 1, 2048, None, ac, True, **kw, **extra)

    assert act(chunk=128) < act()
    # the unchunked head is (tokens x vocab); a chunk of 128 rows is 1/16 of it (+ the input gradient)
    assert act() - act(chunk=128) == pytest.approx((1 - 1 / 16) * 2048 * cfg.padded_vocab_size * 6, rel=0.02)
    assert act("full") < act("op") < act("none")
    assert act(offload=True) < act("full") and act("op", chunk=128, offload=True) < act(offload=True)
    with torch.device("meta"):
        bert = build_model("bert-base").config
    assert activation_bytes(bert, 8, 512, None, "none", False, return_logits=False, labelled=0.15) < activation_bytes(
        bert, 8, 512, None, "none", False, return_logits=False
    )
    from tformer.cli import main

    assert (
        main(
            [
                "plan",
                str(CONFIGS / "llama-1b.yaml"),
                "micro_batch_size=1",
                "loss.chunk_size=256",
                "--devices",
                "8",
                "--device-memory",
                "80GB",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "loss.chunk_size=256" in out and "what each memory setting saves per device" in out
    for row in ("activation_checkpointing=op", "activation_offload=true", "chunk 256 + op + offload"):
        assert row in out
    assert any(line.startswith("ddp") and " op " in line for line in out.splitlines())


# --- the device mesh: tensor parallel (+ sequence parallel) x FSDP2 / HSDP ------------------------
COLUMN_WISE = (
    "q_proj.weight",
    "q_proj.bias",
    "k_proj.weight",
    "k_proj.bias",
    "v_proj.weight",
    "v_proj.bias",
    "ffn.up.weight",
    "ffn.up.bias",
    "ffn.gate.weight",
    "ffn.gate.bias",
    "q_up.weight",  # latent attention's up projections
    "kv_up.weight",
    "attn.sinks.logits",  # one per query head, split with them
)
ROW_WISE = ("o_proj.weight", "ffn.down.weight")
VOCABULARY = ("embed.tok.weight", "lm_head.weight", "lm_head.bias")


def tp_rank_elements(model, tp):
    """Elements one TP rank holds, from the parameter shapes by the sharding rules: column-wise
    (q/k/v, FFN up/gate: weight rows and bias) and vocabulary rows split dim 0, row-wise weights
    (o_proj, FFN down) dim 1, T5's relative bias (buckets, heads) by head; the rest is whole. A tied
    head is one tensor (named_parameters yields it once)."""
    total = 0
    for name, p in model.named_parameters():
        dim = (
            0
            if name.endswith(COLUMN_WISE) or name in VOCABULARY
            else 1
            if name.endswith(ROW_WISE)
            else 1
            if name.endswith("rel_bias.embedding.weight")
            else None
        )
        if dim is None:
            total += p.numel()
        else:
            assert p.shape[dim] % tp == 0, (name, tuple(p.shape), tp)
            total += p.numel() // tp
    return total


MESH_MODELS = [
    ("gpt2-tiny", {}),
    ("llama-tiny", {}),
    ("bert-tiny", {}),
    ("t5-tiny", {}),
    ("t5-v1.1-tiny", {}),
    ("transformer-tiny", {}),
    ("bert-tiny", dict(tie_embeddings=False)),
    ("llama-tiny", dict(num_kv_heads=4, bias=True, vocab_size=1000, pad_vocab_multiple=64)),
    ("t5-tiny", dict(num_decoder_layers=3, attn_impl="math")),
    ("mixtral-tiny", {}),  # MoE FFNs: whole on every TP rank, attention split
    ("qwen2-moe-tiny", {}),  # + a shared expert and its gate, whole as well
    # latent attention (up projections split, down projections whole), the first block dense, and
    # a multi-token prediction depth (its block split like the trunk's, its projection whole)
    ("deepseek-v3-tiny", dict(mtp_depth=1)),
    ("gpt-oss-tiny", {}),  # sinks split with their heads
]


@pytest.mark.parametrize("name,extra", MESH_MODELS)
def test_model_states_per_rank_are_the_tp_and_fsdp_shards_of_each_parameter(name, extra):
    from tformer.plan.memory import rank_memory
    from tformer.plan.states import tp_local_parameters

    with torch.device("meta"):
        model = build_model(name, **extra)
    cfg = model.config
    for tp in (2, 4):
        if tp == 4 and cfg.kv_heads % 4:
            continue
        local = tp_rank_elements(model, tp)
        assert tp_local_parameters(cfg, tp) == local
        # fp32: 4 param + 4 grad + 8 AdamW bytes per element a rank holds; FSDP2 shards its TP shard
        assert rank_memory(cfg, seq_len=16, tp=tp, precision="fp32").model_states == 16 * local
        assert rank_memory(cfg, seq_len=16, tp=tp, dp_shard=2, precision="fp32").model_states == 16 * local / 2
        # HSDP replicates the shard group: the same bytes per rank
        assert (
            rank_memory(cfg, seq_len=16, tp=tp, dp_shard=2, dp_replicate=2, precision="fp32").model_states == 16 * local / 2
        )
    assert tp_local_parameters(cfg, 1) == model.num_parameters()


def test_tp_and_sp_activation_formulas():
    """Per token and block: the column-wise projections' inputs (the two norm outputs) stay whole
    on every TP rank without SP, and are kept as sequence shards with it (gathered again in
    backward); q, k, v, attention and the FFN width split by tp; norm inputs and dropout masks split
    along the sequence only with SP. The logits split by tp with loss parallelism."""
    from tformer.plan import rank_memory

    with torch.device("meta"):
        cfg = build_model("gpt2-small", pad_vocab_multiple=64).config
    d, ff, L, b, s = cfg.d_model, cfg.d_ff, cfg.num_layers, 2, 256
    # MHA, GELU (no dropout in this preset): two norm outputs; two norm inputs; q, k, v, attention
    # output (= the o_proj input), the GELU input (its output is rebuilt in backward, except under
    # TP, where the down projection keeps its DTensor input)
    assert cfg.dropout == 0
    whole, sequence, heads = 2 * d, 2 * d, 4 * d + 2 * ff
    # and once per model, outside the blocks, the final norm's input (sequence-sharded under SP)
    final = b * s * 4 * d

    def kept(tp, sp, **kw):
        return rank_memory(
            cfg, seq_len=s, micro_batch=b, tp=tp, sp=sp, precision="fp32", transient=False, return_logits=False, **kw
        ).activations

    assert kept(1, False) == L * b * s * 4 * (whole + sequence + heads - ff) + final
    assert kept(2, False) == L * b * s * 4 * (whole + sequence + heads / 2) + final
    assert kept(2, True) == L * b * s * 4 * ((whole + sequence) / 2 + heads / 2) + final / 2
    assert kept(4, True) == L * b * s * 4 * ((whole + sequence) / 4 + heads / 4) + final / 4
    # full AC keeps each block's input: sequence-sharded under SP
    assert kept(2, True, ac="full") == (L * b * s * 4 * d + final) / 2
    assert kept(2, False, ac="full") == L * b * s * 4 * d + final
    # the head: an unchunked (tokens x vocabulary) fp32 buffer at the backward peak, split by loss parallelism
    vocab = b * s * cfg.padded_vocab_size * 4

    def head(tp, **kw):
        return rank_memory(
            cfg, seq_len=s, micro_batch=b, tp=tp, sp=True, precision="fp32", return_logits=False, chunk=None, **kw
        ).activations - kept(tp, True)

    assert head(1) == vocab and head(2) == vocab / 2 and head(4) == vocab / 4
    assert head(2, loss_parallel=False) - head(2) == pytest.approx(vocab / 2)
    # a TP head is never chunked (the chunked loss does not take a vocabulary-sharded head)
    assert head(2) == rank_memory(
        cfg, seq_len=s, micro_batch=b, tp=2, sp=True, precision="fp32", return_logits=False, chunk=128
    ).activations - kept(2, True)


def test_only_tp_degrees_that_split_the_model_are_candidates():
    from tformer.plan import layouts, rank_memory, recommend
    from tformer.plan.search import tp_degrees

    with torch.device("meta"):
        llama = build_model("llama-70b").config
        gpt2 = build_model("gpt2-small").config
    assert tp_degrees(llama, 64) == ([1, 2, 4, 8], {16: "num_kv_heads=8", 32: "num_kv_heads=8", 64: "num_kv_heads=8"})
    # TP pads the vocabulary itself (50257 -> 50258 rows at tp=2): it blocks no tp degree
    assert tp_degrees(gpt2, 8) == ([1, 2, 4], {8: "num_heads=12"})
    padded = gpt2.replace(pad_vocab_multiple=64)
    assert tp_degrees(padded, 8)[0] == [1, 2, 4] and tp_degrees(padded, 8)[1] == {8: "num_heads=12"}
    assert {tp for _, _, tp in layouts(llama, 64)} == {1, 2, 4, 8}
    assert all(e.tp in (1, 2, 4, 8) for e in recommend(llama, 64, 80 * 2**30, 8192, None))
    with pytest.raises(ConfigError, match=r"^parallel.tp=3 does not divide num_heads=16; use one of: 1, 2, 4, 8, 16$"):
        rank_memory(gpt2.replace(num_heads=16, pad_vocab_multiple=64), seq_len=16, tp=3)
    # the planner counts the rows the trainer will hold at that tp
    assert rank_memory(gpt2, seq_len=16, tp=2) == rank_memory(gpt2.replace(pad_vocab_multiple=2), seq_len=16, tp=2)
    assert rank_memory(gpt2, seq_len=16, tp=2) != rank_memory(gpt2, seq_len=16, tp=1)
    with pytest.raises(ConfigError, match="parallel.dp_replicate=2 needs parallel.strategy=fsdp"):
        rank_memory(gpt2, seq_len=16, dp_replicate=2, strategy="ddp")


def test_recommendation_is_tp_for_llama_70b_and_none_for_gpt2_small():
    from tformer.plan import recommend

    trainer = dict(return_logits=False, chunk=128)
    with torch.device("meta"):
        llama = build_model("llama-70b").config
        gpt2 = build_model("gpt2-small").config
    # Llama 3's 8192-token sequences on 64 x 80 GB: without TP only full recomputation fits
    fits = recommend(llama, 64, 80 * 2**30, 8192, None, settings=trainer)
    best = fits[0]
    assert best.tp in (2, 4, 8) and best.sp and best.ac != "full" and best.dp_shard * best.tp == 64
    assert any(e.tp == 1 and e.ac == "full" for e in fits)  # it fits, at ~1/3 more compute per step
    assert all(e.total <= 0.9 * 80 * 2**30 for e in fits)
    # before it: nothing without full AC at a smaller tp
    assert not any(e.tp < best.tp and e.ac != "full" for e in fits)
    for model in (gpt2, gpt2.replace(pad_vocab_multiple=64)):  # TP would be possible on the padded one
        best = recommend(model, 8, 80 * 2**30, 1024, None, settings=trainer)[0]
        assert best.tp == 1 and best.dp_replicate == 1 and best.ac == "none"


def test_plan_cli_prints_the_mesh_columns_and_a_tp_recommendation(capsys):
    from tformer.cli import main

    assert (
        main(
            [
                "plan",
                str(CONFIGS / "llama-1b.yaml"),
                "model.preset=llama-70b",
                "data.seq_len=8192",
                "micro_batch_size=1",
                "--devices",
                "64",
                "--device-memory",
                "80GB",
                "--gpus-per-node",
                "8",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("strategy"))
    assert header.split()[:6] == ["strategy", "dp_rep", "dp_shard", "tp", "sp", "AC"]
    assert "tp skipped" in out and "16 (num_kv_heads=8)" in out
    meshes = out[: out.index("\ncontext-parallel layouts")]  # the memory and pipeline tables (CP's has other columns)
    rows = [line.split() for line in meshes.splitlines() if line.startswith(("ddp", "zero", "fsdp"))]
    assert {row[3] for row in rows} == {"1", "2", "4", "8"}
    assert ["fsdp", "8", "8", "1", "-", "none"] == rows[12][:6]  # HSDP: one replica per node
    assert all(row[4] == ("on" if row[3] != "1" else "-") for row in rows)
    rec = out[out.index("recommendation:") :]
    assert "mesh dp_replicate=1" in rec and "parallel.sp=true" in rec and "loss.chunk_size=null" in rec
    assert main(["plan", str(CONFIGS / "llama-1b.yaml"), "--gpus-per-node", "0"]) == 2


from train_helpers import CONFIGS  # noqa: E402


# --- pipeline parallelism: per-stage parameters, micro-batches in flight, the bubble --------------
PP_MODELS = [
    ("gpt2-tiny", dict(num_layers=5)),
    ("llama-tiny", dict(num_layers=5, tie_embeddings=False)),
    ("llama-tiny", dict(num_layers=6)),
    ("bert-tiny", dict(num_layers=5)),
    ("bert-tiny", dict(num_layers=4, tie_embeddings=False)),
    ("t5-tiny", {}),
    ("t5-v1.1-tiny", {}),
    # the first block dense, the rest MoE: stages of equal block counts hold unequal parameters
    ("deepseek-v3-tiny", dict(num_layers=5)),
    ("deepseek-v3-tiny", dict(num_layers=4, moe=dict(first_dense=2, num_experts=8, top_k=2, d_expert=32))),
]


@pytest.mark.parametrize("name,extra", PP_MODELS)
def test_stage_parameters_are_those_of_the_split_model(name, extra):
    """Each stage's parameters on one TP rank, as the planner counts them, equal the elements of
    the stage build_stage makes (a pruned copy: no process group), sharded by the TP rules above:
    uneven splits, a tied embedding/head on the first and last stage, BERT's head, T5's halves."""
    from tformer.parallel.pipeline import build_stage, stages_of_rank
    from tformer.plan.memory import rank_memory
    from tformer.plan.states import stage_parameters

    with torch.device("meta"):
        model = build_model(name, **extra)
    cfg = model.config
    for stages in (2,) if cfg.family == "encdec" else (2, 3, cfg.num_layers):
        parts = [build_stage(model, s, stages, None, 0.0) for s in range(stages)]
        for tp in (1, 2):
            assert stage_parameters(cfg, stages, tp) == [tp_rank_elements(part, tp) for part in parts]
    assert stage_parameters(cfg, 1) == [model.num_parameters()]
    # a rank's model states are its stages' (interleaved: stages r, r + pp, ...), sharded by FSDP2
    pp, v = (2, 1) if cfg.family == "encdec" else (2, 2) if cfg.num_layers % 4 == 0 else (2, 1)
    schedule = "interleaved_1f1b" if v > 1 else "1f1b"
    counts = stage_parameters(cfg, pp * v)
    for rank in range(pp):
        held = sum(counts[s] for s in stages_of_rank(rank, pp, pp * v))
        e = rank_memory(
            cfg, seq_len=16, pp=pp, pp_schedule=schedule, pp_stages_per_rank=v, pp_rank=rank, dp_shard=2, precision="fp32"
        )
        assert e.model_states == 16 * held / 2 and e.pp_rank == rank


def _torch_interleaved_peak(pp, v, m, rank):
    """Stage micro-batches rank ``rank`` holds at its peak in torch's own interleaved 1F1B order."""
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

    fake = SimpleNamespace(
        n_local_stages=v, pp_group_size=pp, _n_microbatches=m, microbatches_per_round=m // max(1, m // pp)
    )
    held = peak = 0
    for action in ScheduleInterleaved1F1B._calculate_single_rank_operations(fake, rank):
        if action is not None:
            held += {_ComputationType.FORWARD: 1, _ComputationType.FULL_BACKWARD: -1}[action.computation_type]
            peak = max(peak, held)
    assert held == 0
    return peak


def test_micro_batches_in_flight_per_schedule_and_the_bubble():
    from tformer.plan.memory import bubble, in_flight

    # GPipe: every forward first; 1F1B: pp - rank warm-up forwards, then backward before forward
    assert [in_flight("gpipe", 4, 16, r) for r in range(4)] == [16] * 4
    assert [in_flight("1f1b", 4, 16, r) for r in range(4)] == [4, 3, 2, 1]
    assert in_flight("1f1b", 4, 2, 0) == 2
    # interleaved 1F1B: as torch orders it, in stage micro-batches
    for pp, v, m in ((2, 2, 4), (2, 2, 8), (4, 2, 4), (4, 2, 8), (4, 2, 16), (4, 3, 10), (4, 2, 6), (8, 2, 32)):
        for rank in range(pp):
            assert in_flight("interleaved_1f1b", pp, m, rank, v) == _torch_interleaved_peak(pp, v, m, rank), (pp, v, m)
    assert in_flight("interleaved_1f1b", 4, 16, 0, 2) == 11  # 5.5 micro-batches through the rank's blocks
    assert bubble("gpipe", 4, 16) == bubble("1f1b", 4, 16) == 3 / 19
    assert bubble("interleaved_1f1b", 4, 16, 2) == 3 / 35 and bubble("1f1b", 8, 32) == 7 / 39


def test_pipeline_activations_are_the_micro_batches_in_flight():
    """The first rank holds its blocks' activations of each micro-batch in flight; the last rank
    one micro-batch's, plus the head and loss."""
    from tformer.plan.activations import activation_bytes
    from tformer.plan.memory import rank_memory

    with torch.device("meta"):
        cfg = build_model("llama-1b").config  # 16 blocks
    kw = dict(seq_len=1024, micro_batch=2, precision="bf16", return_logits=False, chunk=None)

    def blocks(n, **extra):
        return activation_bytes(cfg, 2, 1024, None, "none", True, return_logits=False, chunk=None, blocks=(n, 0), **extra)

    kept, peak_last = blocks(4, transient=False, head=False), blocks(4, head=True)
    for schedule, first in (("gpipe", 16), ("1f1b", 4)):
        e0 = rank_memory(cfg, pp=4, pp_schedule=schedule, n_micro=16, pp_rank=0, **kw)
        assert e0.activations == pytest.approx(first * kept) and e0.in_flight == first
        assert rank_memory(cfg, pp=4, pp_schedule="1f1b", n_micro=16, pp_rank=3, **kw).activations == peak_last
    # unsplit, one micro-batch of all 16 blocks, with its head: what 1F1B's first rank holds, but the head
    whole = rank_memory(cfg, **kw).activations
    assert whole == pytest.approx(rank_memory(cfg, pp=4, n_micro=16, **kw).activations + peak_last - kept, rel=1e-9)
    inter = rank_memory(cfg, pp=4, pp_schedule="interleaved_1f1b", pp_stages_per_rank=2, n_micro=16, **kw)
    assert inter.in_flight == 5.5 and inter.activations == pytest.approx(11 * blocks(2, transient=False, head=False))


def test_invalid_pipeline_degrees_are_skipped_with_a_reason():
    from tformer.plan import pp_layouts, rank_memory

    with torch.device("meta"):
        gpt2 = build_model("gpt2-small").config  # 12 blocks
        t5 = build_model("t5-small").config
    layouts, skipped = pp_layouts(gpt2, 64)
    assert sorted({pp for _, _, _, pp, _, _, _ in layouts}) == [2, 4, 8]
    assert skipped == {
        16: "16 pipeline stages (parallel.pp=16) exceed the model's 12 blocks",
        32: "32 pipeline stages (parallel.pp=32) exceed the model's 12 blocks",
        64: "64 pipeline stages (parallel.pp=64) exceed the model's 12 blocks",
    }
    # interleaving at 2 stages per rank where 2 x pp divides the 12 blocks
    assert {(pp, s) for _, _, _, pp, s, _, _ in layouts} == {(2, "1f1b"), (2, "interleaved_1f1b"), (4, "1f1b"), (8, "1f1b")}
    layouts, skipped = pp_layouts(t5, 8)
    assert {(pp, s) for _, _, _, pp, s, _, _ in layouts} == {(2, "1f1b")}
    assert set(skipped) == {4, 8} and skipped[4].startswith(
        "encoder-decoder models split only at the encoder/decoder boundary"
    )
    assert pp_layouts(gpt2, 8, n_micro=2)[1] == {
        4: "1f1b needs grad_accum >= pp micro-batches (got 2)",
        8: "1f1b needs grad_accum >= pp micro-batches (got 2)",
    }
    with pytest.raises(ConfigError, match="encoder-decoder models split only"):
        rank_memory(t5, seq_len=16, pp=4)


def test_pipelines_come_after_tp_within_a_node_and_before_full_recomputation():
    from tformer.plan import recommend
    from tformer.plan.search import MAX_BUBBLE

    trainer = dict(return_logits=False, chunk=None)
    with torch.device("meta"):
        llama = build_model("llama-70b").config
        # one KV head: TP cannot split it; the unchunked head at 16k tokens is what does not fit
        mqa = build_model("llama-8b", num_kv_heads=1).config
    best = recommend(llama, 64, 80 * 2**30, 8192, None, settings=trainer, max_pp=64)[0]
    assert best.pp == 1 and best.tp in (2, 4, 8) and best.ac != "full"  # TP within a node: no pipeline
    unsplit = recommend(mqa, 8, 80 * 2**30, 16384, None, settings=trainer)[0]
    assert unsplit.tp == 1 and unsplit.ac == "full"
    fits = recommend(mqa, 8, 80 * 2**30, 16384, None, settings=trainer, max_pp=8)
    best = fits[0]
    assert best.pp == 2 and best.ac != "full" and best.bubble == pytest.approx(1 / 9) and best.n_micro == 8
    assert best.pp * best.dp_shard == 8 and best.total <= 0.9 * 80 * 2**30
    assert all(e.total <= 0.9 * 80 * 2**30 for e in fits)
    assert not any(e.pp == 1 and e.ac != "full" for e in fits)
    # a bubble longer than full recomputation's second forward ranks with it: at 2 micro-batches
    # 1F1B idles 1/3 of the step, interleaving (2 stages per rank) 1/5
    few = recommend(mqa, 8, 80 * 2**30, 16384, None, settings=trainer, max_pp=8, n_micro=2)
    assert any(e.schedule == "1f1b" and e.bubble == pytest.approx(1 / 3) and e.ac != "full" for e in few)
    assert 1 / 3 > MAX_BUBBLE and few[0].schedule == "interleaved_1f1b" and few[0].bubble == pytest.approx(1 / 5)


def test_plan_cli_prints_pipeline_layouts_and_the_bubble(capsys):
    from tformer.cli import main

    assert (
        main(
            [
                "plan",
                str(CONFIGS / "llama-1b.yaml"),
                "model.preset=llama-8b",
                "model.num_kv_heads=1",
                "data.seq_len=16384",
                "loss.chunk_size=null",
                "micro_batch_size=1",
                "--devices",
                "8",
                "--device-memory",
                "80GB",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "pipeline layouts" in out
    header = [line.split() for line in out.splitlines() if line.startswith("strategy")][1]
    assert header[:9] == ["strategy", "dp_rep", "dp_shard", "tp", "sp", "pp", "schedule", "v", "m"]
    rec = out[out.index("recommendation:") :]
    assert "mesh pp=2 dp_replicate=1 dp_shard=4 tp=1" in rec and "parallel.pp=2 parallel.pp_schedule=1f1b" in rec
    assert "grad_accum=8" in rec and "bubble 11.1% of the step idle (pp-1)/(m+pp-1)" in rec
    assert main(["plan", str(CONFIGS / "t5-small.yaml"), "--devices", "8", "--device-memory", "80GB"]) == 0
    out = capsys.readouterr().out
    assert "pp skipped: 4 (encoder-decoder models split only at the encoder/decoder boundary" in out
    assert main(["plan", str(CONFIGS / "llama-1b.yaml"), "--max-pp", "1", "--devices", "8"]) == 0
    assert "pipeline layouts" not in capsys.readouterr().out


# --- what `tformer plan` prints: sizes, columns, the documented picks, op-level AC under TP -------------
def test_device_memory_bare_number_is_gib_and_a_byte_count_says_so(capsys):
    from tformer.cli import main

    assert parse_bytes("80") == parse_bytes("80GiB") == parse_bytes("80GB") == 80 * 2**30
    assert parse_bytes("8.6e10B") == 8.6e10 and parse_bytes("0.5") == 2**29
    with pytest.raises(ConfigError, match=r"'80e9': a bare number is GiB; for bytes write 80e9B"):
        parse_bytes("80e9")
    cfg = str(CONFIGS / "llama-1b.yaml")
    assert main(["plan", cfg, "--devices", "8", "--device-memory", "80", "--max-pp", "1"]) == 0
    out = capsys.readouterr().out
    assert "8 devices x 80.0 GiB" in out and "nothing fits" not in out
    assert main(["plan", cfg, "--device-memory", "80000000000"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "a bare number is GiB; for bytes write 80000000000B" in err[0], err


def test_plan_help_gives_units_and_every_default(capsys):
    from tformer.cli import main

    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for said in ("(default: 8)", "a bare number is GiB", "(default: 80 GiB)", "(default: 4 x pp)", "(default: the device"):
        assert said in text, said
    assert text.count("(default: 8)") == 2  # --devices and --gpus-per-node


def _readme_plans() -> list[tuple[list[str], str]]:
    """The `tformer plan` examples of docs/planning.md that state their pick: (arguments, the pick's line)."""
    import re
    import shlex

    readme = (CONFIGS.parent / "docs" / "planning.md").read_text()
    found = re.findall(r"^tformer plan (.+?)\n# (recommendation: .+)$", readme.replace("\\\n", " "), re.MULTILINE)
    return [(shlex.split(args), line) for args, line in found]


def test_readme_plan_picks_are_what_the_tool_prints(capsys):
    """Each documented example with a stated recommendation prints exactly that line."""
    from tformer.cli import main

    examples = _readme_plans()
    assert len(examples) == 2 and any("llama-70b" in " ".join(args) for args, _ in examples)
    for args, stated in examples:
        args = [str(CONFIGS.parent / a) if a.startswith("configs/") else a for a in args]
        assert main(["plan", *args]) == 0
        printed = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("recommendation:"))
        assert printed == stated


def test_pipeline_table_says_fits_and_the_cheapest_ac_in_two_columns(capsys):
    from tformer.cli import main

    args = ["plan", str(CONFIGS / "llama-1b.yaml"), "model.preset=llama-70b", "data.seq_len=8192", "micro_batch_size=1"]
    assert main([*args, "--devices", "64", "--device-memory", "80", "--max-pp", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = [line.split() for line in lines if line.startswith("strategy")][1]
    assert header[-5:] == ["none", "op", "full", "fits", "AC"]
    rows = [r for r in (line.split() for line in lines) if len(r) == len(header) and r[0] == "fsdp"]
    assert rows and {r[-2] for r in rows} == {"yes", "no"}
    for r in rows:
        totals = dict(zip(("none", "op", "full"), map(float, r[-5:-2])))
        fitting = [ac for ac, total in totals.items() if total <= 0.9 * 80]
        assert (r[-2], r[-1]) == (("yes", fitting[0]) if fitting else ("no", "-")), r


def test_op_ac_under_tp_holds_more_than_none_and_the_plan_says_why(capsys):
    """At tp=8 with SP, Llama 70B's op-level AC keeps the o_proj and FFN down outputs whole (partial
    sums before their reduce-scatter): more than AC none, whose saved tensors are all split by tp."""
    from tformer.plan import rank_memory
    from tformer.plan.memory_report import op_ac_note

    with torch.device("meta"):
        cfg = build_model("llama-70b").config
    kw = dict(seq_len=8192, dp_shard=8, tp=8, sp=True, return_logits=False, chunk=128)
    none, op = rank_memory(cfg, **kw).total, rank_memory(cfg, ac="op", **kw).total
    assert op > none
    note = op_ac_note(cfg, 8192, 8, none, op)
    assert "16,384 of the 26,880 values it keeps per token and block" in note and "AC none with SP keeps 19,200" in note
    # op's backward rebuilds what none keeps less what op kept of it: never a negative peak
    one = dict(seq_len=8192, tp=8, sp=True, return_logits=False, chunk=128, precision="fp32")
    transient = rank_memory(cfg, ac="op", **one).activations - rank_memory(cfg, ac="op", transient=False, **one).activations
    assert transient > 0


def _op_saved_worker(rank, port, out):
    import json
    from pathlib import Path

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    import tformer.parallel.ac as ac
    from tformer.parallel.memory import local_part
    from tformer.parallel.tp import apply_tensor_parallel

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    stores = []

    def recording_context():  # the op policy's contexts, keeping a hand on what they save
        caching, cached = create_selective_checkpoint_contexts(ac.op_policy)
        stores.append(caching.storage)
        return caching, cached

    try:
        torch.manual_seed(0)
        model = build_model("llama-tiny", d_model=128, d_ff=512, vocab_size=1024, num_layers=1, dropout=0.0).train()
        apply_tensor_parallel(model, init_device_mesh("cpu", (2,)), sp=True)
        ac.apply_activation_checkpointing(model, "op")
        model.decoder.layers[0].checkpoint_context = recording_context
        ids = torch.randint(3, 1000, (2, 64))
        with loss_parallel():
            loss = model(input_ids=ids, labels=ids, return_logits=False).loss
        seen = {}
        for store in stores:  # what the forward saved (backward takes it out again)
            for outputs in store.values():  # op -> {call index: its outputs, each in a wrapper}
                for wrapped in outputs.values() if isinstance(outputs, dict) else outputs:
                    for t in wrapped if isinstance(wrapped, (tuple, list)) else [wrapped]:
                        t = getattr(t, "val", t)
                        if isinstance(t, torch.Tensor):
                            st = local_part(t).untyped_storage()
                            seen[st.data_ptr()] = st.nbytes()
        with loss_parallel():
            loss.backward()
        if rank == 0:
            Path(out).write_text(json.dumps({"saved": sum(seen.values())}))
    finally:
        dist.destroy_process_group()


def test_op_ac_under_tp_saves_what_the_planner_counts(tmp_path):
    """What the op policy saves for one block on one rank of tp=2 + SP (fp32), against the planner:
    the row-wise outputs whole, the rest split by tp, plus the block's input shard."""
    import json
    import time

    from train_helpers import free_port, start_ranks
    from tformer.plan.activations import _block_elements_op_ac

    out = tmp_path / "saved.json"
    ctx = start_ranks(_op_saved_worker, (free_port(), str(out)), 2)
    deadline = time.monotonic() + 240
    while not ctx.join(timeout=2):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("2-rank op-AC group did not finish in 240 s")
    cfg = build_model("llama-tiny", d_model=128, d_ff=512, vocab_size=1024, num_layers=1).config
    planned = 2 * 64 * 4 * _block_elements_op_ac(cfg, tp=2, sp=True)
    # the block input shard is saved by checkpoint itself, not by the policy
    planned_by_policy = planned - 2 * 64 * 4 * cfg.d_model / 2
    assert json.loads(out.read_text())["saved"] == pytest.approx(planned_by_policy, rel=0.02)
