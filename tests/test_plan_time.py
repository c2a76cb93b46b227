"""The time model (tformer/plan): its FLOPs agree with models/flops.py, it refuses what it cannot
price, bad hardware figures are one line, and its comparisons go the way the physics says."""

from __future__ import annotations

import pytest

from tformer.config import ConfigError
from tformer.models.flops import forward_flops
from tformer.models.presets import preset
from tformer.plan import Layout, NotPriced, profile, step_time
from tformer.plan.time import AC_POLICIES, block_gemms, head_gemms, recomputed_gemms


@pytest.mark.parametrize("name", ["gpt2-tiny", "bert-tiny", "t5-tiny", "llama-tiny"])
@pytest.mark.parametrize("tp", [1, 2])
def test_the_gemms_count_the_flops_of_models_flops(name, tp):
    cfg = preset(name)
    batch, seq, target = 3, 24, 10
    if cfg.family == "encdec":
        blocks = cfg.num_layers * block_gemms(cfg, batch, seq, tp) + cfg.decoder_layers * block_gemms(
            cfg, batch, target, tp, cross_len=seq
        )
        out = target
    else:
        blocks, out = cfg.num_layers * block_gemms(cfg, batch, seq, tp), seq
    counted = sum(g[1] for g in blocks + head_gemms(cfg, batch * out, tp)) * tp
    if cfg.family == "encoder":  # BERT's head dense is whole on every TP rank
        counted -= (tp - 1) * 2 * batch * out * cfg.d_model**2
    assert counted == forward_flops(cfg, batch, seq, target)


@pytest.mark.parametrize(
    "layout, gpu, why",
    [
        (Layout(float8=True, dp_shard=8), "h100-sxm", "float8"),
        (Layout(async_tp=True, tp=8), "h100-sxm", "async TP"),
        (Layout(cp=2, dp_shard=4), "h100-sxm", "context parallelism"),
        (Layout(precision="fp32", dp_shard=8), "b200", "no fp32 peak"),
        (Layout(strategy="ddp", dp_replicate=2, dp_shard=4), "h100-sxm", "HSDP"),
        (Layout(ac="selective", dp_shard=8), "h100-sxm", "activation checkpointing 'selective'"),
    ],
)
def test_a_layout_it_cannot_price_is_refused_not_priced_at_zero(layout, gpu, why):
    with pytest.raises(NotPriced, match=why):
        step_time(preset("gpt2-tiny"), layout, profile(gpu), 64)


def test_bad_hardware_figures_are_one_line():
    with pytest.raises(ConfigError, match="unknown gpu 'h300'; use one of: h100-sxm"):
        profile("h300")
    with pytest.raises(ConfigError, match="inter_bandwidth=0.0 .* must be positive"):
        profile("h100-sxm", inter_bandwidth=0)
    with pytest.raises(ConfigError, match="peak.bf16=-1.0"):
        profile("a100-80gb", peak_bf16=-1)
    with pytest.raises(ConfigError, match="unknown hardware figure 'nvlink'"):
        profile("a100-80gb", nvlink=1)


def _step(layout, gpu="h100-sxm", cfg="gpt2-medium", seq=1024, **figures):
    return step_time(preset(cfg), layout, profile(gpu, **figures), seq)


def test_the_physics_goes_the_right_way():
    mb = dict(micro_batch=4)
    # the same DDP all-reduce over the network is slower than over NVLink
    inside, across = _step(Layout("ddp", dp_shard=8, **mb)), _step(Layout("ddp", dp_shard=8, **mb), gpus_per_node=1)
    assert across.step > inside.step and across.breakdown["ddp"] > inside.breakdown["ddp"]
    # TP across nodes exposes more than inside one
    tp_in, tp_out = _step(Layout(tp=4, dp_shard=2, **mb)), _step(Layout(tp=4, dp_shard=2, **mb), gpus_per_node=2)
    assert tp_out.breakdown["tp"] > 3 * tp_in.breakdown["tp"] > 0
    # interleaving shrinks the bubble; more micro-batches shrink it too
    pipe = dict(pp=4, dp_shard=2, n_micro=8, **mb)
    plain, inter = _step(Layout(**pipe)), _step(Layout(schedule="interleaved_1f1b", stages_per_rank=2, **pipe))
    assert 0 < inter.breakdown["bubble"] < plain.breakdown["bubble"]
    # full recomputation costs a forward: about 4/3 of the compute
    none, full = _step(Layout(dp_shard=8, **mb)), _step(Layout(dp_shard=8, ac="full", **mb))
    assert full.breakdown["compute"] == pytest.approx(none.breakdown["compute"] * 4 / 3, rel=0.05)
    # a faster GPU is faster; MFU never exceeds the GEMM ceiling
    assert _step(Layout(dp_shard=8, **mb), "a100-80gb").step > none.step > _step(Layout(dp_shard=8, **mb), "b200").step
    assert 0 < none.mfu < profile("h100-sxm").gemm_max


def test_the_numbers_agree_with_each_other():
    r = _step(Layout(dp_shard=8, micro_batch=2, grad_accum=3))
    assert r.tokens_per_step == 8 * 2 * 3 * 1024
    assert r.step == pytest.approx(sum(r.breakdown.values()))
    assert r.tokens_per_s_per_device == pytest.approx(r.tokens_per_step / r.step / 8)
    assert r.time_to_train(1e9) == pytest.approx(1e9 / r.tokens_per_step * r.step)
    assert r.memory > 0


@pytest.mark.parametrize(
    "args, message",
    [
        (["--gpu", "h300"], "unknown gpu 'h300'"),
        (["--set", "inter_bandwidth=0"], "inter_bandwidth=0.0 of h100-sxm must be positive"),
        (["--set", "peak_bf16=fast"], "give FIGURE=NUMBER"),
        (["--tokens", "many"], "'many' is not a number"),
        (["--tokens", "-5"], "out of range"),
    ],
)
def test_bad_speed_options_are_one_line(capsys, args, message):
    from tformer.cli import main

    assert main(["plan", "configs/gpt2-tiny.yaml", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_plan_prints_the_speed_of_every_layout_and_the_fastest(capsys):
    from tformer.cli import main

    assert main(["plan", "configs/llama-1b.yaml", "--devices", "16", "--max-pp", "1", "--tokens", "1e11"]) == 0
    out = capsys.readouterr().out
    speed = out[out.index("predicted speed on h100-sxm") :]
    rows = [line for line in speed.splitlines() if line.startswith(("  ddp", "  zero", "  fsdp"))]
    assert len(rows) >= 10 and all(line.rstrip().endswith(" d") for line in rows)  # days to 1e11 tokens
    assert "fastest that fits:" in speed and "breakdown: compute" in speed
    # a slower network changes the answer's speed, not the memory table
    main(["plan", "configs/llama-1b.yaml", "--devices", "16", "--max-pp", "1", "--set", "inter_bandwidth=1e9"])
    slow = capsys.readouterr().out
    assert slow[: slow.index("predicted speed")] == out[: out.index("predicted speed")]
    assert slow[slow.index("fastest") :] != speed[speed.index("fastest") :]


def _ideal(gpu="h100-sxm"):
    """A profile whose GEMMs all run at gemm_max x peak, whatever their shape: times are FLOPs."""
    return profile(gpu, gemm_half=1e-9)


def test_attention_backward_under_flash_is_two_and_a_half_forwards():
    """At equal tokens, doubling the sequence adds only attention's core (scores, weighted
    values); the step's compute grows by 3.5 x that core's forward: 1 forward + 2.5 backward
    (flash recomputes QK^T, then dV, dP, dQ, dK), not the 3 of a plain matmul."""
    cfg, hw = preset("llama-tiny"), _ideal()
    short, long = (step_time(cfg, Layout(dp_shard=1, micro_batch=mb), hw, seq) for mb, seq in ((2, 512), (1, 1024)))
    core = [
        sum(g.executed for g in block_gemms(cfg, mb, seq) if not g.linear) * cfg.num_layers
        for mb, seq in ((2, 512), (1, 1024))
    ]
    seconds_per_flop = 1 / (hw.peak["bf16"] * hw.gemm_max)
    added = (long.breakdown["compute"] - short.breakdown["compute"]) / ((core[1] - core[0]) * seconds_per_flop)
    assert added == pytest.approx(3.5, rel=1e-6)


@pytest.mark.parametrize("name, recomputed", [("llama-tiny", ["k", "o", "up"]), ("gpt2-tiny", ["k", "o", "down"])])
def test_op_alternate_recomputes_every_second_mm_of_a_block(name, recomputed):
    """torchtitan's op policy (``_apply_ac_to_transformer_block``: a per-block counter of aten.mm,
    recompute when it is even) over a block's linear layers in execution order q, k, v, o, gate,
    up, down: k, o and up are run again; attention's core is saved. The step pays exactly their
    forward on top of tformer's op policy, which keeps every matmul."""
    cfg, hw = preset(name), _ideal()
    gemms = block_gemms(cfg, 2, 64)
    names = ["q", "k", "v", "o", "gate", "up", "down"] if cfg.activation == "swiglu" else ["q", "k", "v", "o", "up", "down"]
    linear = dict(zip(names, [g for g in gemms if g.linear]))
    assert recomputed_gemms(gemms, "op-alternate") == [linear[n] for n in recomputed]
    assert recomputed_gemms(gemms, "full") == gemms and recomputed_gemms(gemms, "op") == []
    op, alternate = (step_time(cfg, Layout(micro_batch=2, ac=ac), hw, 64) for ac in ("op", "op-alternate"))
    extra = sum(linear[n].executed for n in recomputed) * cfg.num_layers / (hw.peak["bf16"] * hw.gemm_max)
    assert alternate.breakdown["compute"] - op.breakdown["compute"] == pytest.approx(extra, rel=1e-9)
    assert alternate.breakdown["memory-bound"] == op.breakdown["memory-bound"]  # both recompute the elementwise ops
    assert "op-alternate" in AC_POLICIES and alternate.memory == op.memory  # memory priced as op (an upper bound)


def test_unfused_attention_executes_every_score_and_moves_them_through_memory():
    """Explicit score GEMMs (Megatron-LM 2021) compute all S x S products of causal attention and
    a 2x backward: at equal tokens, doubling the sequence adds 3 x the whole core's forward (flash:
    3.5 x half of it). Their softmax and dropout kernels read and write the scores: with dropout
    and full recomputation, 2 x 9 bytes forward + 11 backward per fp16 score; flash moves none."""
    cfg, hw = preset("gpt2-tiny"), _ideal()
    shapes = ((2, 512), (1, 1024))

    def run(attention, ac="none"):
        return [step_time(cfg, Layout(micro_batch=mb, attention=attention, ac=ac), hw, seq) for mb, seq in shapes]

    core = [sum(g.counted for g in block_gemms(cfg, mb, seq) if not g.linear) * cfg.num_layers for mb, seq in shapes]
    seconds_per_flop = 1 / (hw.peak["bf16"] * hw.gemm_max)
    for attention, factor in (("unfused", 3.0), ("flash", 3.5 / 2)):
        short, long = run(attention)
        added = (long.breakdown["compute"] - short.breakdown["compute"]) / ((core[1] - core[0]) * seconds_per_flop)
        assert added == pytest.approx(factor, rel=1e-6), attention
    dropout = preset("gpt2-tiny", attn_dropout=0.1)
    flash, unfused = (
        step_time(dropout, Layout(micro_batch=2, attention=a, ac="full"), hw, 512) for a in ("flash", "unfused")
    )
    scores = 2 * dropout.num_heads * 512 * 512 * dropout.num_layers
    moved = (unfused.breakdown["memory-bound"] - flash.breakdown["memory-bound"]) * hw.hbm_bandwidth * hw.hbm_efficiency
    assert moved == pytest.approx(scores * (2 * 9 + 11), rel=1e-9)
    with pytest.raises(NotPriced, match="attention kernel 'xformers'"):
        step_time(cfg, Layout(attention="xformers"), hw, 64)
