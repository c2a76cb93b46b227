"""The time model (tformer/plan): its FLOPs agree with models/flops.py, it refuses what it cannot
price, bad hardware figures are one line, and its comparisons go the way the physics says."""

from __future__ import annotations

import dataclasses

import pytest

from tformer.config import ConfigError
from tformer.models.flops import forward_flops
from tformer.models import spec_of
from tformer.models.presets import preset
from tformer.nn.ffn import FFN_KINDS
from tformer.plan import Layout, NotPriced, profile, step_time
from tformer.plan.moe import MoELayout, all_to_all_bytes_per_step
from tformer.plan.compute import block_gemms, head_gemms, recomputed_gemms
from tformer.plan.layout import AC_POLICIES


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
        (Layout(float8=True, dp_shard=8), "a100-80gb", "float8 on a100-80gb: no fp8 peak figure"),
        (Layout(float8="blockwise", dp_shard=8), "h100-sxm", "float8 recipe 'blockwise'"),
        (Layout(float8="rowwise", precision="fp32", dp_shard=8), "h100-sxm", "float8 under precision fp32"),
        (Layout(async_tp=True, tp=4), "h100-sxm", "async TP"),
        (Layout("zero2", cp=2, dp_shard=4), "h100-sxm", "context parallelism with DeepSpeed"),
        (Layout(cp=2, dp_shard=4), "b200", "fp32 scores on a GPU"),
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
    # a faster GPU is faster where the device's work, not the host issuing it, sets the step (at 4k
    # tokens per GPU, GPT-2 medium is host-bound on both: ``test_a_gpus_host_time_hides_behind...``);
    # MFU never exceeds the GEMM ceiling
    big = Layout(dp_shard=8, micro_batch=16)
    assert _step(big, "a100-80gb").step > _step(big).step > _step(big, "b200").step
    assert _step(big).breakdown["host/dispatch"] == 0.0
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


# --- context parallelism ----------------------------------------------------------------------------
def _core(gemms):
    return sum(g.executed for g in gemms if not g.linear)


def _no_latency(gpu="h100-sxm", **figures):
    """Links with (almost) no latency: a collective's seconds are its bytes over the bandwidth."""
    return profile(gpu, gemm_half=1e-9, intra_latency=1e-30, inter_latency=1e-30, **figures)


@pytest.mark.parametrize("name", ["gpt2-tiny", "bert-tiny", "t5-tiny", "llama-tiny", "mixtral-tiny", "switch-tiny"])
@pytest.mark.parametrize("cp", [2, 4])
def test_under_cp_a_rank_counts_one_cp_th_of_the_flops(name, cp):
    """Each rank's GEMMs count 1/cp of the model's FLOPs: its seq/cp tokens through every linear
    layer, its queries against every key (cross-attention: the encoder's)."""
    cfg = preset(name)
    batch, seq, target = 3, 32, 16
    total = 0.0
    for n, length, cross in spec_of(cfg).stack_shapes(cfg, seq, target):
        for i in range(n):
            moe = cfg.moe.is_moe_layer(i)
            total += sum(g.counted for g in block_gemms(cfg, batch, length, 1, cross, cp=cp, moe=moe))
    out = target if cfg.family == "encdec" else seq
    total += sum(g.counted for g in head_gemms(cfg, batch * out // cp, 1))
    assert total * cp == forward_flops(cfg, batch, seq, target if cfg.family == "encdec" else None)


def test_cp_halves_a_non_causal_models_attention_core_and_splits_a_causal_one_evenly():
    """bert-tiny (no mask): cp=2 gives each rank (S/2) x S scores, half the core, and half of every
    linear layer. Causal (llama-tiny), the rank's 2 cp + 1 chunk pairs on the GPU (the two diagonal
    pairs computed whole, masked after) and 2 cp pair-equivalents on the CPU (torch's kernel skips
    their masked half): half of the whole core on the CPU, on every rank alike."""
    bert, llama = preset("bert-tiny"), preset("llama-tiny")
    one, two = block_gemms(bert, 2, 512), block_gemms(bert, 2, 512, cp=2)
    assert _core(two) == _core(one) / 2
    assert sum(g.executed for g in two if g.linear) == sum(g.executed for g in one if g.linear) / 2
    whole = sum(g.counted for g in block_gemms(llama, 2, 512) if not g.linear)  # MFU's full S x S
    for cp in (2, 4, 8):
        assert _core(block_gemms(llama, 2, 512, cp=cp, device="cpu")) == whole / cp / 2
        assert _core(block_gemms(llama, 2, 512, cp=cp)) == whole / cp / 2 * (2 * cp + 1) / (2 * cp)


def test_the_gpu_chunk_pair_kernel_runs_fp32_scores_and_an_fp32_backward():
    """context._pair_forward off the CPU: QK^T in fp32, P V in the run's precision; its backward
    rebuilds QK^T and makes dP (2 x the scores' size) and dV, dQ, dK (3 x the values'), all in fp32.
    On the CPU torch's flash kernel per pair: flash's 2.5x backward, the run's precision."""
    cfg = preset("llama-tiny")
    scores, values = [g for g in block_gemms(cfg, 1, 256, cp=2) if not g.linear]
    assert (scores.kind, scores.fp32, scores.fp32_backward, scores.backward) == ("scores", True, True, 2.0)
    assert (values.kind, values.fp32, values.fp32_backward, values.backward) == ("values", False, True, 3.0)
    for g in (g for g in block_gemms(cfg, 1, 256, cp=2, device="cpu") if not g.linear):
        assert (g.fp32, g.fp32_backward, g.backward) == (False, False, 2.5)
    # per layer both run 7 GEMMs' worth (2 forward; flash's backward 2 x 2.5, the explicit one 2 + 3):
    # at an fp32 rate equal to bf16's only the GPU kernel's whole diagonal pairs differ ...
    hw = profile("h100-sxm", gemm_half=1e-9, peak_fp32=989.4e12)
    on_cpu, on_gpu = (step_time(cfg, Layout(cp=2), dataclasses.replace(hw, device=d), 256) for d in ("cpu", "cuda"))
    seconds = 1 / (hw.peak["bf16"] * hw.gemm_max)
    gpu, cpu = (_core(block_gemms(cfg, 1, 256, cp=2, device=d)) / 2 * cfg.num_layers for d in ("cuda", "cpu"))
    assert on_gpu.breakdown["compute"] - on_cpu.breakdown["compute"] == pytest.approx(7 * (gpu - cpu) * seconds, rel=1e-9)
    # ... and at the H100's fp32 rate, 15x slower than its bf16 one, the core's 6 fp32 GEMMs dominate
    real = step_time(cfg, Layout(cp=2), profile("h100-sxm", gemm_half=1e-9), 256)
    assert real.breakdown["compute"] - on_gpu.breakdown["compute"] == pytest.approx(
        6 * gpu * (1 / 66.9e12 - 1 / 989.4e12) / hw.gemm_max, rel=1e-9
    )


def test_cp_adds_exactly_the_gathered_kv_over_the_link():
    """Per attention layer and micro-batch: K and V of the whole sequence all-gathered in forward
    and again in backward (once more under AC), dK and dV reduce-scattered in fp32, each moving
    (cp-1)/cp of its bytes over the cp group's link (inside the node here); nothing else but the
    labelled-token counts (8 bytes per sample)."""
    cfg, hw = preset("gpt2-tiny"), _no_latency()
    mb, seq, cp = 2, 1024, 4
    kv = 2 * mb * seq * cfg.kv_heads * cfg.head_dim  # K and V elements of every key
    share = (cp - 1) / cp / hw.intra_bandwidth
    for ac, gathers in (("none", 2), ("full", 3), ("op", 3)):
        r = step_time(cfg, Layout(micro_batch=mb, cp=cp, ac=ac), hw, seq)
        expected = cfg.num_layers * (gathers * kv * 2 + kv * 4) * share + 2 * 8 * mb * share  # + the counts' all-reduce
        assert r.breakdown["cp"] == pytest.approx(expected, rel=1e-9), ac
    assert "cp" not in step_time(cfg, Layout(micro_batch=mb, dp_shard=cp), hw, seq).breakdown
    # across nodes the same bytes take the network
    slow = step_time(cfg, Layout(micro_batch=mb, cp=cp), _no_latency(gpus_per_node=2), seq)
    assert slow.breakdown["cp"] == pytest.approx(
        (cfg.num_layers * (2 * kv * 2 + kv * 4) + 2 * 8 * mb) * (cp - 1) / cp / hw.inter_bandwidth, rel=1e-9
    )


def test_cp_shares_sequences_and_fsdp_shards_over_dp_shard_x_cp():
    cfg = preset("llama-tiny")
    r = step_time(cfg, Layout(micro_batch=2, dp_shard=2, cp=4), profile("h100-sxm"), 4096)
    assert r.devices == 8 and r.tokens_per_step == 2 * 2 * 4096  # the cp ranks of a group see the same samples
    same = step_time(cfg, Layout(micro_batch=2, dp_shard=8), profile("h100-sxm"), 4096)
    assert r.breakdown["optimizer"] == same.breakdown["optimizer"]  # each rank updates 1/8 of the parameters
    assert r.memory > 0


def test_cp_with_a_pipeline_is_priced_stage_by_stage():
    """cp x pp (which the trainer runs): a stage's ranks hold 1/cp of every sequence, so the stages
    send each other half the bytes at cp=2, each stage gathers K/V for its own blocks only, and the
    FSDP2 shards of a stage span dp_shard x cp."""
    cfg, hw = preset("llama-tiny"), _no_latency()
    mb, seq, m = 2, 1024, 4
    pipe = step_time(cfg, Layout(micro_batch=mb, pp=2, dp_shard=2, n_micro=m), hw, seq)
    both = step_time(cfg, Layout(micro_batch=mb, pp=2, cp=2, n_micro=m), hw, seq)
    assert both.devices == 4 and both.breakdown["pp"] == pytest.approx(pipe.breakdown["pp"] / 2, rel=1e-9)
    kv = 2 * mb * seq * cfg.kv_heads * cfg.head_dim
    per_stage = (cfg.num_layers // 2) * (2 * kv * 2 + kv * 4) + 2 * 8 * mb  # one block per stage here
    assert both.breakdown["cp"] == pytest.approx(m * per_stage / 2 / hw.intra_bandwidth, rel=1e-9)
    assert both.breakdown["optimizer"] == pipe.breakdown["optimizer"]  # dp_shard x cp = 2 shards either way
    assert 0 < both.memory < pipe.memory


# --- expert parallelism -----------------------------------------------------------------------------
def test_moe_blocks_are_priced_by_their_active_gemms():
    """Router + top-k experts (grouped GEMMs of tokens x top_k rows) + shared experts: what MFU
    counts (models/flops.py); each expert's GEMM has tokens x top_k x ep / num_experts rows."""
    for name in ("mixtral-tiny", "qwen2-moe-tiny"):
        cfg = preset(name)
        moe = block_gemms(cfg, 2, 64, moe=True)
        dense = block_gemms(cfg, 2, 64)
        attention = sum(g.counted for g in dense[:6])
        assert (
            attention + sum(g.counted for g in moe[6:])
            == (forward_flops(cfg, 2, 64) - sum(g.counted for g in head_gemms(cfg, 128, 1))) / cfg.num_layers
        )
        matrices = 3 if FFN_KINDS[cfg.moe.activation or cfg.activation][1] else 2
        for ep in (1, 2):
            grouped = block_gemms(cfg, 2, 64, moe=True, ep=ep)[7 : 7 + matrices]  # after the router
            assert {g.m for g in grouped} == {128 * cfg.moe.top_k * ep / cfg.moe.num_experts}


def test_ep1_has_no_all_to_all_and_ep2_moves_what_moe_plan_counts():
    """ep=2: per MoE layer and micro-batch, four exchanges of the rank's tokens x top_k rows, half
    of them leaving the rank: the bytes plan/moe.py counts (bench_moe.py --part a2a measured them)."""
    cfg, hw = preset("mixtral-tiny"), _no_latency()
    mb, seq, accum = 4, 256, 3
    assert "ep" not in step_time(cfg, Layout(micro_batch=mb, dp_shard=4, grad_accum=accum), hw, seq).breakdown
    r = step_time(cfg, Layout(micro_batch=mb, dp_shard=4, ep=2, grad_accum=accum), hw, seq)
    moved = all_to_all_bytes_per_step(cfg, MoELayout(ep=2, dp_shard=4, tokens=mb * seq, micro_batches=accum, elt=2))
    assert moved > 0 and r.breakdown["ep"] * hw.intra_bandwidth == pytest.approx(moved, rel=1e-9)
    # a recomputed forward dispatches and combines once more: 6 exchanges instead of 4
    full = step_time(cfg, Layout(micro_batch=mb, dp_shard=4, ep=2, grad_accum=accum, ac="full"), hw, seq)
    assert full.breakdown["ep"] == pytest.approx(r.breakdown["ep"] * 6 / 4, rel=1e-9)


def test_ep_gathers_only_its_share_of_the_experts():
    """FSDP2 gathers each rank's 1/ep of the experts over the dp_shard x cp / ep ranks EP leaves:
    at ep=8 of 64 ranks the expert weights' traffic falls about 8x; the memory per rank stays."""
    cfg, hw = preset("mixtral-8x7b"), profile("h100-sxm")
    plain = step_time(cfg, Layout(dp_shard=64), hw, 4096)
    ep = step_time(cfg, Layout(dp_shard=64, ep=8), hw, 4096)
    assert ep.breakdown["fsdp"] < plain.breakdown["fsdp"] / 6
    assert ep.step < plain.step and ep.breakdown["ep"] > 0
    assert plain.memory < ep.memory < 1.1 * plain.memory  # the received rows, kept for backward


@pytest.mark.parametrize(
    "name, layout, message",
    [
        ("gpt2-tiny", Layout(ep=2, dp_shard=2), "parallel.ep=2 needs a mixture-of-experts model"),
        ("mixtral-tiny", Layout(ep=3, dp_shard=3), "model.moe.num_experts=4 is not divisible by parallel.ep=3"),
        ("mixtral-tiny", Layout(cp=4, ep=2, dp_shard=2), "parallel.ep=2 must be a multiple of parallel.cp=4"),
        ("mixtral-tiny", Layout(cp=2, ep=4, dp_shard=1), "parallel.ep=4 must be a multiple of parallel.cp=2 that divides"),
        ("gpt2-tiny", Layout(tp=3), "Layout.tp=3 does not divide num_heads=4"),
        ("gpt2-tiny", Layout(cp=0), "Layout.cp=0 must be >= 1"),
    ],
)
def test_a_layout_no_run_can_have_is_one_config_error_line(name, layout, message):
    with pytest.raises(ConfigError, match=message) as e:
        step_time(preset(name), layout, profile("h100-sxm"), 64)
    assert not isinstance(e.value, NotPriced) and len(str(e.value).splitlines()) == 1


@pytest.mark.parametrize(
    "name, layout, why",
    [
        ("mixtral-tiny", Layout(tp=2), "mixture-of-experts model with tensor parallelism"),
        ("mixtral-tiny", Layout("zero3", dp_shard=2), "mixture-of-experts model with DeepSpeed"),
        ("mixtral-tiny", Layout("ddp", dp_shard=2, ep=2), "expert parallelism with ddp"),
        ("mixtral-tiny", Layout(pp=2, dp_shard=2, ep=2), "expert parallelism with pipelines"),
        ("gpt2-tiny", Layout("zero2", dp_shard=2, cp=2), "context parallelism with DeepSpeed"),
    ],
)
def test_what_tformer_does_not_run_is_not_priced(name, layout, why):
    with pytest.raises(NotPriced, match=why):
        step_time(preset(name), layout, profile("h100-sxm"), 64)
    with pytest.raises(NotPriced, match="context parallelism with attention dropout"):
        step_time(preset("gpt2-tiny", attn_dropout=0.1), Layout(cp=2), profile("h100-sxm"), 64)


def test_the_search_offers_moe_models_what_the_trainer_runs():
    from tformer.plan.search import ep_degrees, layouts, tp_degrees

    cfg = preset("mixtral-8x7b")
    usable, skipped = tp_degrees(cfg, 16)
    assert usable == [1] and "model.moe" in skipped[2]
    assert {s for s, _, _ in layouts(cfg, 16)} == {"ddp", "fsdp", "fsdp-no-reshard"}
    assert ep_degrees(cfg, 16) == [2, 4, 8] and ep_degrees(cfg, 4, cp=2) == [2, 4, 8]
    assert ep_degrees(cfg, 1, cp=2) == [2] and ep_degrees(preset("llama-tiny"), 16) == []


def _speed_rows(out: str, marker: str) -> list[list[str]]:
    speed = out[out.index("predicted speed on") :].splitlines()
    return [line.split() for line in speed if line.startswith("  fsdp") and f" {marker}" in line[:42]]


@pytest.mark.parametrize(
    "argv, marker",
    [
        (["configs/llama-1b.yaml", "model.preset=llama-8b", "data.seq_len=65536", "--devices", "8"], "cp"),
        (["configs/mixtral-tiny.yaml", "--devices", "8"], "ep"),
    ],
)
def test_the_python_api_gives_the_cli_rows(capsys, argv, marker):
    """Each context- or expert-parallel row of ``tformer plan``'s speed table is what
    ``step_time`` returns for the layout the row names."""
    import re

    from tformer.cli import main
    from tformer.plan import rank_memory
    from tformer.plan.memory import training_memory
    from tformer.train.config import load_config

    from tformer.args import parse_bytes

    hw = profile("h100-sxm")
    assert main(["plan", *argv]) == 0
    rows = _speed_rows(capsys.readouterr().out, marker)
    assert rows, f"no {marker} rows"
    cfg = load_config(argv[0], argv[1:-2])
    for row in rows:
        name = " ".join(row[: row.index(next(w for w in row if w in AC_POLICIES))])
        ac, micro, gib, step, tokens, mfu = row[len(name.split()) :][:6]
        replicate, shard = map(int, re.search(r"(\d+)x(\d+)", name).groups())
        degrees = {k: int(v) for k, v in re.findall(r"\b(cp|tp|ep)(\d+)", name)}
        tp = degrees.get("tp", 1)
        layout = Layout(
            name.split()[0],
            int(micro),
            replicate,
            shard,
            tp,
            tp > 1,
            ac=ac,
            cp=degrees.get("cp", 1),
            ep=degrees.get("ep", 1),
            loss_chunk=training_memory(cfg, hw.memory)["chunk"],  # the run's head (auto: on this GPU)
        )
        r = step_time(cfg.model, layout, hw, cfg.data.seq_len, memory=False)
        assert (f"{r.step:.3f}", f"{r.tokens_per_s_per_device:,.0f}", f"{r.mfu:.0%}") == (step, tokens, mfu), name
        # the memory column: rank_memory with the run's loss settings (its chunked head)
        e = rank_memory(
            cfg.model,
            seq_len=cfg.data.seq_len,
            micro_batch=layout.micro_batch,
            dp_replicate=replicate,
            dp_shard=shard,
            tp=tp,
            sp=tp > 1,
            precision="bf16",
            ac=ac,
            strategy=layout.strategy,
            cp=layout.cp,
            ep=layout.ep,
            **training_memory(cfg, parse_bytes("80")),  # the CLI's --device-memory (default 80 GiB)
            loss_parallel=cfg.parallel.loss_parallel,
        )
        assert f"{e.total / 2**30:.1f}" == gib, name


def _speed_examples() -> list[tuple[list[str], list[str]]]:
    """The `tformer plan` examples of docs/planning.md that state speed lines: (arguments, the
    lines, whitespace collapsed)."""
    import re
    import shlex
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "planning.md").read_text().replace("\\\n", " ")
    found = re.findall(r"^tformer plan (.+)\n((?:# .+\n)+)", text, re.MULTILINE)
    return [
        (shlex.split(args), [" ".join(line[2:].split()) for line in lines.splitlines()])
        for args, lines in found
        if "fastest that fits" in lines
    ]


def test_the_documented_speed_examples_print_what_they_state(capsys):
    from tformer.cli import main

    examples = _speed_examples()
    assert len(examples) == 2
    for args, stated in examples:
        assert main(["plan", *args]) == 0
        printed = {" ".join(line.split()) for line in capsys.readouterr().out.splitlines()}
        assert set(stated) <= printed, args


def test_rank_memory_takes_cp_and_ep():
    """The memory API lays out cp and ep as the speed table does: EP keeps the model states (FSDP2
    shards the experts over dp_shard x cp either way) and adds the received rows; CP shrinks the
    activations per rank; what the trainer refuses is one line."""
    from tformer.plan import rank_memory

    cfg = preset("mixtral-tiny")
    base = rank_memory(cfg, seq_len=256, micro_batch=4, dp_shard=4)
    ep = rank_memory(cfg, seq_len=256, micro_batch=4, dp_shard=4, ep=2)
    assert ep.model_states == base.model_states and ep.activations > base.activations and ep.ep == 2
    cp = rank_memory(cfg, seq_len=256, micro_batch=4, dp_shard=2, cp=2)
    assert cp.cp == 2 and cp.activations < base.activations and cp.model_states == base.model_states
    # with a pipeline: the stage's states over dp_shard x cp, its activations at 1/cp of the tokens
    dense = preset("llama-tiny")
    pipe = rank_memory(dense, seq_len=256, micro_batch=4, dp_shard=2, pp=2)
    both = rank_memory(dense, seq_len=256, micro_batch=4, cp=2, pp=2)
    assert (both.cp, both.pp) == (2, 2) and both.model_states == pipe.model_states
    assert both.activations < pipe.activations
    for kwargs, message in (
        ({"ep": 2, "strategy": "ddp"}, "parallel.ep=2 needs parallel.strategy=fsdp"),
        ({"ep": 3}, "not divisible by parallel.ep=3"),
    ):
        with pytest.raises(ConfigError, match=message):
            rank_memory(cfg, seq_len=256, dp_shard=4, **kwargs)


# --- the host's time per operation (plan/host.py) ---------------------------------------------------
def _cpu(**figures):
    """A CPU-like profile: the host's time adds to the step (no overlap), with round host figures."""
    from tformer.plan.hardware import OVERRIDABLE

    given = {
        **dict(
            op_overhead=1e-5,
            dtensor_op_overhead=1e-4,
            dtensor_optimizer_overhead=4e-5,
            fsdp_unit_overhead=1e-3,
            fsdp_local_overhead=3e-4,
        ),
        **figures,
    }
    plain = {k: v for k, v in given.items() if k in OVERRIDABLE}  # the rest (activation_rate) is no --set figure
    rest = {k: v for k, v in given.items() if k not in plain}
    return dataclasses.replace(profile("a100-80gb", **plain), device="cpu", overlap=False, **rest).check()


def _host(cfg, layout, hw, seq=64):
    return step_time(cfg, layout, hw, seq, memory=False).breakdown["host/dispatch"]


def test_the_counted_ops_are_the_real_models_whatever_its_widths():
    """Blocks x ops per block + the rest (counted on the shrunk model) = the aten ops of a
    forward + loss + backward of the model at its own widths and depth."""
    import torch

    from tformer.models import build_model
    from tformer.plan.host import _counting_mode, op_counts

    for name, layers in (("gpt2-tiny", 3), ("t5-tiny", 2)):
        cfg = preset(name).replace(num_layers=layers)
        model = build_model(cfg)
        ids = torch.randint(1, cfg.vocab_size, (2, 16))
        mode = _counting_mode()
        with mode:
            model(ids, labels=ids, return_logits=False).loss.backward()
        c = op_counts(cfg)
        second = cfg.decoder_layers if cfg.family == "encdec" else 0
        assert mode.total == layers * c.blocks[0] + second * c.blocks[1] + c.rest, name
        assert c.blocks[0] > c.forward[0] > 0 and c.tp_blocks[0] > 0 and c.block_params[0] > 0


def test_host_time_is_a_line_of_the_breakdown_and_grows_with_the_blocks():
    from tformer.plan.host import op_counts

    hw = _cpu()
    cfg4, cfg8 = preset("gpt2-tiny").replace(num_layers=4), preset("gpt2-tiny").replace(num_layers=8)
    r4 = step_time(cfg4, Layout("ddp", precision="fp32"), hw, 64)
    assert r4.step == pytest.approx(sum(r4.breakdown.values())) and r4.breakdown["host/dispatch"] > 0
    added = _host(cfg8, Layout("ddp", precision="fp32"), hw) - r4.breakdown["host/dispatch"]
    # four more blocks: their ops, and the fused optimizer's ops do not grow with the tensors
    assert added == pytest.approx(4 * op_counts(cfg4).blocks[0] * hw.op_overhead)
    # recomputing the forward issues its ops again
    full = _host(cfg4, Layout("ddp", precision="fp32", ac="full"), hw) - r4.breakdown["host/dispatch"]
    assert full == pytest.approx(4 * op_counts(cfg4).forward[0] * hw.op_overhead)


def test_fsdp_and_tp_add_their_dtensor_and_hook_costs():
    from tformer.plan.host import op_counts, optimizer_ops

    cfg, hw = preset("gpt2-tiny"), _cpu()
    c = op_counts(cfg)
    ddp, fsdp = (_host(cfg, Layout(s, dp_shard=2, precision="fp32"), hw) for s in ("ddp", "fsdp"))
    tensors = cfg.num_layers * c.block_params[0] + c.rest_params
    # FSDP2: a hook cost per block and the root, and the fused optimizer's ops on DTensor parameters
    fused = optimizer_ops("fused").ops(tensors)
    assert fsdp - ddp == pytest.approx((cfg.num_layers + 1) * hw.fsdp_unit_overhead + fused * hw.dtensor_optimizer_overhead)
    # TP: the parallelized linears and the sharded loss run on DTensors
    tp1, tp2 = (_host(cfg, Layout(tp=tp, sp=False, precision="fp32"), hw) for tp in (1, 2))
    assert tp2 - tp1 == pytest.approx((cfg.num_layers * c.tp_blocks[0] + c.tp_rest) * hw.dtensor_op_overhead)
    # dearer DTensor ops make TP dearer, and leave DDP alone
    dear = _cpu(dtensor_op_overhead=1e-3)
    assert _host(cfg, Layout(tp=2, sp=False, precision="fp32"), dear) > tp2
    assert _host(cfg, Layout("ddp", dp_shard=2, precision="fp32"), dear) == pytest.approx(ddp)


def test_fsdp2_over_a_one_rank_group_costs_its_hooks_without_collectives():
    """The trainer shards with FSDP2 beside tp or pp even at dp_shard 1 (a 1-rank group): each
    module costs ``fsdp_local_overhead`` there, ``fsdp_unit_overhead`` where it has peers (dp_shard
    or cp > 1)."""
    cfg = preset("gpt2-tiny")
    local, peers = 3e-4, 1e-3
    units = cfg.num_layers + 1
    for layout in (Layout(tp=2, sp=False, precision="fp32"), Layout(pp=2, n_micro=2, precision="fp32")):
        cheap, dear = (_host(cfg, layout, _cpu(fsdp_local_overhead=x, fsdp_unit_overhead=peers)) for x in (local, 2 * local))
        stage_units = units if layout.pp == 1 else cfg.num_layers // 2 + 1
        assert dear - cheap == pytest.approx(stage_units * layout.micro_batches * local), layout
    # with a peer the group's figure is the one with collectives: the local one changes nothing
    shard = Layout(tp=2, dp_shard=2, sp=False, precision="fp32")
    a, b = (_host(cfg, shard, _cpu(fsdp_local_overhead=x)) for x in (local, 2 * local))
    assert a == pytest.approx(b)


def test_a_gpus_host_time_hides_behind_its_device_work():
    # a useful size: the host issues far less than the device computes, nothing is exposed
    big = _step(Layout(dp_shard=8, micro_batch=2), cfg="llama-1b", seq=4096)
    assert big.breakdown["host/dispatch"] == 0.0
    # a tiny one: the host is the step (max(host, device)), on the CPU it adds to the device's work
    cfg = preset("gpt2-tiny")
    gpu = step_time(cfg, Layout(dp_shard=8), profile("h100-sxm"), 16, memory=False)
    device = gpu.step - gpu.breakdown["host/dispatch"]
    assert gpu.breakdown["host/dispatch"] > 0 and gpu.step > device
    cpu_like = dataclasses.replace(profile("h100-sxm"), device="cpu")
    added = step_time(cfg, Layout(dp_shard=8), cpu_like, 16, memory=False)
    assert added.step == pytest.approx(device + added.breakdown["host/dispatch"])


@pytest.mark.parametrize(
    "figure",
    ["op_overhead", "dtensor_op_overhead", "dtensor_optimizer_overhead", "fsdp_unit_overhead", "fsdp_local_overhead"],
)
def test_a_non_positive_host_figure_is_refused_in_one_line(tmp_path, figure):
    import json

    from tformer.plan import load_profile
    from tformer.plan.hardware import save_profile

    with pytest.raises(ConfigError, match=f"^hardware figure {figure}=0.0 of h100-sxm must be positive"):
        profile("h100-sxm", **{figure: 0})
    path = tmp_path / "cpu.json"
    save_profile(_cpu(), path)
    data = json.loads(path.read_text())
    data[figure] = -1e-6
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=f"{figure}=-1e-06 .* must be positive") as e:
        load_profile(path)
    assert len(str(e.value).splitlines()) == 1


@pytest.mark.long  # a 2-process calibration (~50 s), its figures timed: out of CI, run with -m long
def test_calibrate_measures_positive_host_and_pricing_figures(tmp_path):
    """``tformer plan --calibrate`` (2 gloo processes, each with a deadline) writes a profile whose
    host figures are measured and positive, a DTensor op dearer than a plain one."""
    from tformer.plan import load_profile
    from tformer.plan.calibrate import calibrate

    hw = calibrate(tmp_path / "cpu.json", tmp_path)
    again = load_profile(tmp_path / "cpu.json")
    assert again == hw and hw.device == "cpu"
    assert 0 < hw.op_overhead < hw.dtensor_op_overhead and 0 < hw.dtensor_optimizer_overhead
    # FSDP2's collectives are dearer than its hooks alone (measured 6-10 ms against 1.5-4 ms per unit)
    assert 0 < hw.fsdp_local_overhead < hw.fsdp_unit_overhead
    # the CPU's pricing figures: a whole grid of positive GEMM rates, exp and GELU rates
    from tformer.plan.calibrate import GEMM_GRID

    assert len(hw.gemm_table) == len(GEMM_GRID[0]) * len(GEMM_GRID[1]) * len(GEMM_GRID[2])
    assert min(min(row[3:]) for row in hw.gemm_table) > 0 and hw.exp_rate > 0
    assert len(hw.attention_rate) == 12 and min(row[2] for row in hw.attention_rate) > 0
    assert set(hw.activation_rate) == {"gelu", "gelu_tanh", "silu"} and min(hw.activation_rate.values()) > 0
    assert hw.gemm_rate(512, 512, 512) > hw.gemm_rate(32, 32, 32)  # small GEMMs reach less of the peak


GRID = ((32, 512), (32, 4096), (32, 512))


def _table(rate=lambda m, n, k: 1e9 * m**0.3 * n**0.2 * k**0.1, backward=(0.5, 0.25)):
    """A gemm_table over GRID whose rates are a power law (log-linear: interpolation is exact),
    its input- and weight-gradient products ``backward`` times the forward's."""
    import itertools

    rows = []
    for m, n, k in itertools.product(*GRID):
        r = rate(m, n, k)
        rows.append((m, n, k, r, backward[0] * r, backward[1] * r))
    return tuple(rows)


def test_a_cpu_profile_prices_each_gemm_from_its_measured_table():
    hw = dataclasses.replace(_cpu(), gemm_table=_table()).check()
    # between the grid's shapes: log-space interpolation (exact for a power law), clamped outside it
    assert hw.gemm_rate(128, 512, 128) == pytest.approx(1e9 * 128**0.3 * 512**0.2 * 128**0.1)
    assert hw.gemm_rate(128, 512, 128, 2) == pytest.approx(0.25 * 1e9 * 128**0.3 * 512**0.2 * 128**0.1)
    assert hw.gemm_rate(8, 10**5, 512) == pytest.approx(hw.gemm_rate(32, 4096, 512))
    # the step's GEMMs are priced from the table, not the curve: twice the rates, half the compute
    cfg, layout = preset("gpt2-tiny"), Layout("ddp", precision="fp32", micro_batch=8)
    table = step_time(cfg, layout, hw, 64, memory=False)
    fast = dataclasses.replace(hw, gemm_table=_table(lambda m, n, k: 2e9 * m**0.3 * n**0.2 * k**0.1))
    assert step_time(cfg, layout, fast, 64, memory=False).breakdown["compute"] == pytest.approx(
        table.breakdown["compute"] / 2
    )
    assert table.breakdown["compute"] != pytest.approx(step_time(cfg, layout, _cpu(), 64).breakdown["compute"])
    # each backward product at its own rate: slower weight gradients, dearer backward, same forward
    slow = dataclasses.replace(hw, gemm_table=_table(backward=(0.5, 0.05)))
    assert step_time(cfg, layout, slow, 64, memory=False).breakdown["compute"] > table.breakdown["compute"]


def test_ranks_sharing_a_cpu_are_priced_at_the_rates_measured_with_the_machine_full():
    """A CPU's processes share its caches and memory bus: a layout of 2 ranks on it is priced at the
    GEMM rates and bandwidth measured with both calibration processes at work, 1 process at those
    measured alone; a GPU profile has no shared figures and is unchanged."""
    alone = dataclasses.replace(_cpu(), gemm_table=_table()).check()
    full = dataclasses.replace(alone, shared_gemm=0.5, hbm_bandwidth_shared=alone.hbm_bandwidth / 4).check()
    cfg = preset("gpt2-tiny")
    one = Layout("ddp", precision="fp32", micro_batch=8)
    two = dataclasses.replace(one, dp_shard=2)
    for layout in (one, two):  # without shared figures the table measured alone prices every layout
        assert step_time(cfg, layout, alone, 64).breakdown["compute"] == pytest.approx(
            step_time(cfg, one, alone, 64).breakdown["compute"]
        )
    assert step_time(cfg, one, full, 64).breakdown == step_time(cfg, one, alone, 64).breakdown
    shared, own = step_time(cfg, two, full, 64).breakdown, step_time(cfg, two, alone, 64).breakdown
    # half the GEMM rates with the machine full: twice the GEMMs' seconds (attention's core is the
    # profile's kernel figure here, as alone), a quarter of the bandwidth: dearer memory-bound work
    linear = sum(g.executed for g in block_gemms(cfg, 8, 64) if g.kind == "linear")
    assert shared["compute"] > own["compute"] + 0.9 * 3 * cfg.num_layers * linear / alone.gemm_rate(512, 512, 512)
    assert shared["memory-bound"] > 3 * own["memory-bound"]
    assert alone.shared(2) is alone and profile("h100-sxm").shared(8) == profile("h100-sxm")


def test_a_cpu_pipeline_stage_works_alone_while_its_peer_idles_in_the_bubble():
    """pp=2, 1F1B over 2 micro-batches: a bubble of 1/3, so each stage idles half as long as it
    works, its peer alone meanwhile; half a stage's work runs at the shared rates, half alone."""
    alone = dataclasses.replace(_cpu(), gemm_table=_table()).check()
    full = dataclasses.replace(alone, shared_gemm=0.5, hbm_bandwidth_shared=alone.hbm_bandwidth / 4).check()
    cfg = preset("gpt2-tiny")
    layout = Layout(pp=2, n_micro=2, precision="fp32", micro_batch=8)
    both, own = step_time(cfg, layout, full, 64).breakdown, step_time(cfg, layout, alone, 64).breakdown
    everywhere = dataclasses.replace(alone, gemm_table=full.shared(2).gemm_table, hbm_bandwidth=full.hbm_bandwidth_shared)
    shared = step_time(cfg, layout, everywhere, 64).breakdown  # as if the peer never idled
    for key in ("compute", "memory-bound"):
        assert both[key] == pytest.approx((shared[key] + own[key]) / 2), key
    # many micro-batches: a small bubble, nearly all the work beside the peer
    many = dataclasses.replace(layout, n_micro=32)
    b = 1 / 33
    assert step_time(cfg, many, full, 64).breakdown["compute"] == pytest.approx(
        (1 - b / (1 - b)) * step_time(cfg, many, everywhere, 64).breakdown["compute"]
        + b / (1 - b) * step_time(cfg, many, alone, 64).breakdown["compute"]
    )


def test_the_chunked_head_is_priced_as_its_chunk_by_vocabulary_gemms():
    from tformer.plan.compute import head_time

    cfg, hw = preset("gpt2-tiny").replace(vocab_size=4096), _cpu()
    tokens, peak = 8 * 64, hw.peak["fp32"]
    whole = head_time(cfg, Layout(precision="fp32"), tokens, peak, hw)
    chunked = head_time(cfg, Layout(precision="fp32", loss_chunk=128), tokens, peak, hw)
    # four 128-row GEMMs reach less of the peak than one of 512 rows (the curve's m = 128 < 512)
    assert chunked[0] > whole[0] and chunked[1] > whole[1]
    one = head_time(cfg, Layout(precision="fp32", loss_chunk=128), 128, peak, hw)
    assert chunked[0] == pytest.approx(4 * one[0])
    # a ragged last chunk is priced at its own rows; a chunk beyond the tokens is the whole head
    ragged = head_time(cfg, Layout(precision="fp32", loss_chunk=128), 130, peak, hw)
    two = head_time(cfg, Layout(precision="fp32", loss_chunk=2), 2, peak, hw)
    assert ragged[0] == pytest.approx(one[0] + two[0])
    assert head_time(cfg, Layout(precision="fp32", loss_chunk=4096), tokens, peak, hw) == whole
    # TP drops the chunked loss (parallel/tp.py): the vocabulary-sharded head over every token
    tp = Layout(precision="fp32", tp=2, sp=False)
    assert head_time(cfg, dataclasses.replace(tp, loss_chunk=128), tokens, peak, hw) == head_time(cfg, tp, tokens, peak, hw)
    # and the step says so
    step = [step_time(cfg, Layout("ddp", precision="fp32", micro_batch=8, loss_chunk=c), hw, 64) for c in (None, 128)]
    assert step[1].breakdown["compute"] - step[0].breakdown["compute"] == pytest.approx(sum(chunked) - sum(whole))


def test_gelu_and_exp_are_priced_at_their_measured_rates_where_slower_than_their_bytes():
    cfg, layout = preset("gpt2-tiny").replace(vocab_size=4096), Layout("ddp", precision="fp32", micro_batch=8)
    base = step_time(cfg, layout, _cpu(), 64, memory=False).breakdown["memory-bound"]
    # a rate far above what the bandwidth allows: the bytes still price GELU; attention's exps add
    fast = step_time(cfg, layout, _cpu(activation_rate={"gelu_tanh": 1e15}), 64, memory=False).breakdown["memory-bound"]
    assert fast == pytest.approx(base)
    # a slow GELU (GPT-2's tanh form): every FFN element of every block at the rate (3 passes: the measured triple)
    slow = step_time(cfg, layout, _cpu(activation_rate={"gelu_tanh": 1e8}), 64, memory=False).breakdown["memory-bound"]
    elements = cfg.num_layers * 8 * 64 * cfg.d_ff
    moved = 3 * 2 * elements * 4 / (_cpu().hbm_bandwidth * _cpu().hbm_efficiency)
    assert slow - base == pytest.approx(elements / 1e8 - moved)
    # exp: the flash kernel's scores (forward, and rebuilt in backward) and the head's log-softmax
    exp = step_time(cfg, layout, _cpu(exp_rate=1e8), 64, memory=False).breakdown["memory-bound"]
    scores = cfg.num_layers * 8 * cfg.num_heads * 64 * 64 / 2  # causal: half of them executed
    logits = 8 * 64 * cfg.padded_vocab_size
    assert exp - base == pytest.approx((2 * scores + 2 * logits) / 1e8, rel=0.02)
    # the chunked loss turns its exps into the gradient in place: one per logit, not two
    chunked = step_time(cfg, dataclasses.replace(layout, loss_chunk=128), _cpu(exp_rate=1e8), 64, memory=False)
    assert exp - chunked.breakdown["memory-bound"] == pytest.approx(logits / 1e8, rel=0.02)
    # a ReLU model has no activation rate to price
    t5 = preset("t5-tiny")
    assert step_time(t5, layout, _cpu(activation_rate={"gelu_tanh": 1e8}), 64, 16).step == pytest.approx(
        step_time(t5, layout, _cpu(), 64, 16).step
    )


@pytest.mark.parametrize(
    "figures, message",
    [
        (dict(exp_rate=0.0), r"^hardware figure exp_rate=0.0 of .* must be positive"),
        (dict(activation_rate={"gelu": -1.0}), r"^hardware figure activation_rate.gelu=-1.0 of .* must be positive"),
        (dict(gemm_table=_table()[:-1] + ((512, 4096, 512, 1e9, 0.0, 1e9),)), r"gemm_table\(512, 4096, 512\)=0.0"),
        (dict(gemm_table=_table()[:-1]), r"^hardware gemm_table lacks the shape \(512, 4096, 512\) of its grid"),
        (dict(shared_gemm=0.0), r"^hardware figure shared_gemm=0.0 of .* must be positive"),
        (dict(hbm_bandwidth_shared=0.0), r"^hardware figure hbm_bandwidth_shared=0.0 of .* must be positive"),
    ],
)
def test_a_bad_cpu_pricing_figure_is_refused_in_one_line(tmp_path, figures, message):
    import json

    from tformer.plan import load_profile
    from tformer.plan.hardware import save_profile

    with pytest.raises(ConfigError, match=message) as e:
        dataclasses.replace(_cpu(), **figures).check()
    assert len(str(e.value).splitlines()) == 1
    path = tmp_path / "cpu.json"
    save_profile(dataclasses.replace(_cpu(), gemm_table=_table()), path)
    data = json.loads(path.read_text())
    data.update(figures)
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=message.lstrip("^").replace("hardware", "")):
        load_profile(path)


def test_a_cpu_profile_prices_attention_at_its_measured_kernel_rate():
    rows = tuple((s, kind, 1e9 * s) for s in (32.0, 128.0) for kind in (0.0, 1.0, 2.0))
    hw = dataclasses.replace(_cpu(), gemm_table=_table(), attention_rate=rows).check()
    assert hw.attention_flops(64, "causal") == pytest.approx(64e9)  # log-space between 32 and 128
    assert hw.attention_flops(1024, "bias") == pytest.approx(128e9)  # clamped
    cfg, layout = preset("gpt2-tiny"), Layout("ddp", precision="fp32", micro_batch=8)
    base = step_time(cfg, layout, hw, 64, memory=False).breakdown["compute"]
    faster = dataclasses.replace(hw, attention_rate=tuple((s, k, 2 * r) for s, k, r in rows))
    core = sum(g.executed for g in block_gemms(cfg, 8, 64) if g.kind != "linear") * cfg.num_layers
    # the kernel's forward and its 2.5x backward at the rate: doubling it saves half of that
    saved = base - step_time(cfg, layout, faster, 64, memory=False).breakdown["compute"]
    assert saved == pytest.approx(3.5 * core / 64e9 / 2)
    with pytest.raises(ConfigError, match=r"attention_rate\(64, 0\)=0.0"):
        dataclasses.replace(hw, attention_rate=((64.0, 0.0, 0.0),)).check()


def _float8_pair(cfg, layout, hw, seq):
    bf16 = step_time(cfg, layout, hw, seq, memory=False)
    return bf16, step_time(cfg, dataclasses.replace(layout, float8="tensorwise"), hw, seq, memory=False)


@pytest.mark.parametrize("d_ff", [8192, 8200])
@pytest.mark.parametrize("compiled", [True, False])
def test_float8_runs_the_blocks_linear_layers_at_the_fp8_peak_and_pays_for_their_casts(d_ff, compiled):
    """precision=fp8 as tformer runs it, from llama-1b's shapes by hand: each block's q, k, v, o,
    gate, up and down (both sizes multiples of 16; an FFN of 8,200 is not, and stays bf16) run
    forward and both backward products at the fp8 peak, attention's core and the head at bf16's;
    each converted layer casts its input and weight in forward, and its output gradient twice and
    input and weight again in backward, 5 bytes an element compiled, 25 eager."""
    cfg, hw, mb, seq = preset("llama-1b", d_ff=d_ff), _ideal(), 2, 2048
    d, kvd, layers, T = cfg.d_model, cfg.kv_heads * cfg.head_dim, cfg.num_layers, mb * seq
    shapes = [(d, d), (kvd, d), (kvd, d), (d, d)]  # (n, k): q, k, v, o
    if d_ff % 16 == 0:
        shapes += [(d_ff, d), (d_ff, d), (d, d_ff)]  # gate, up, down
    flops = sum(3 * 2 * T * n * k for n, k in shapes) * layers  # forward and two backward products
    saved = flops / hw.gemm_max * (1 / hw.peak["bf16"] - 1 / hw.peak["fp8"])
    casts = sum(2 * (T * k + n * k + T * n) for n, k in shapes) * layers
    cast_seconds = casts * (5 if compiled else 25) / (hw.hbm_bandwidth * hw.hbm_efficiency)
    bf16, fp8 = _float8_pair(cfg, Layout(dp_shard=1, micro_batch=mb, compile=compiled), hw, seq)
    assert bf16.breakdown["compute"] - fp8.breakdown["compute"] == pytest.approx(saved, rel=1e-9)
    assert fp8.breakdown["memory-bound"] - bf16.breakdown["memory-bound"] == pytest.approx(cast_seconds, rel=1e-9)
    assert fp8.mfu / bf16.mfu == pytest.approx(bf16.step / fp8.step)  # MFU against the bf16 peak, as torchtitan's


def test_fsdp2_all_gathers_tensorwise_float8_weights_in_one_byte():
    """With the tensorwise recipe FSDP2 gathers the converted block weights in float8 (1 byte, not
    bf16's 2), twice a micro-batch (forward and the backward's re-gather); rowwise gathers bf16."""
    from tformer.plan.comm import data_parallel
    from tformer.plan.layout import rank_stages

    cfg, hw, n = preset("llama-1b"), _no_latency(), 8
    converted = cfg.num_layers * sum(g.n * g.k for g in block_gemms(cfg, 1, 64) if g.float8)
    d, kvd = cfg.d_model, cfg.kv_heads * cfg.head_dim
    assert converted == cfg.num_layers * (2 * d * d + 2 * d * kvd + 3 * d * cfg.d_ff)  # q, o; k, v; gate, up, down

    def fsdp(recipe):
        layout = Layout(dp_shard=n, float8=recipe, grad_accum=3)
        stage = rank_stages(cfg, layout)[0]
        return data_parallel(layout, hw, stage, 0.0, 0.0, cfg.num_layers, converted)["fsdp"]  # nothing hides it

    link = hw.intra_bandwidth
    assert fsdp(None) - fsdp("tensorwise") == pytest.approx(3 * 2 * (n - 1) / n * converted / link, rel=1e-9)
    assert fsdp("rowwise") == fsdp(None)


def test_plan_prices_a_float8_run_beside_bf16_and_refuses_a_card_without_fp8(capsys):
    from tformer.cli import main

    assert main(["plan", "configs/llama-1b.yaml", "precision=fp8", "compile=true", "--gpu", "h100-sxm"]) == 0
    out = capsys.readouterr().out
    assert "bf16, the blocks' linear layers in float8 (tensorwise)" in out and "fastest that fits" in out
    assert main(["plan", "configs/llama-1b.yaml", "precision=fp8", "--gpu", "a100-80gb"]) == 1
    assert "not priced: float8 on a100-80gb: no fp8 peak figure" in capsys.readouterr().out
