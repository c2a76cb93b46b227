"""The new decoders (qwen3, qwen3_moe, deepseek_v3, gpt_oss) under every parallel dimension, each
equal to one process of the same global batch; context parallelism with windows that cross a shard
boundary, attention sinks and latent attention; the loss-free routing bias bitwise across layouts.

Gradient-level cases run on 2 gloo ranks (fp32) at odd widths and an odd length, and are held to
``rounding.FACTOR`` times how far one process's fp32 result lies from the same model in float64
(tests/rounding.py): a layout computes one process's mathematics in another summation order, so it
lies within a few roundings of one process; its defects lie orders of magnitude further.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

import tformer
from tformer.nn.attention import local_attention
from tformer.parallel.context import held_positions, shard_seq

from rounding import FACTOR, FP32_ROUNDING, ZERO, float64_throughout, relative, yardstick
from test_context_parallel import ATTENTION_FACTOR, close_group, init_group, run_group

pytestmark = pytest.mark.usefixtures("one_thread")

SEQ = 13  # padded to 16 over cp=2: four chunks of 4, so a window of 5 reaches across every border

# -- context parallelism's attention core: windows, sinks, latent heads ---------------------------

# name: (causal, window, sinks, (heads, kv heads), (qk width, v width), soft-cap)
CORE_CASES = {
    "causal-window": (True, 5, False, (4, 2), (8, 8), None),
    "causal-window-sinks": (True, 5, True, (4, 2), (8, 8), None),
    "sinks": (True, None, True, (4, 4), (8, 8), None),
    "bidirectional-window": (False, 6, False, (4, 2), (8, 8), None),
    "latent-heads-window": (True, 3, False, (3, 3), (10, 5), None),  # MLA: values narrower than q/k
    # Gemma's cap on the scores (std ~1.1 here: a cap of 1.5 bends most of them), windowed both ways
    "softcap-causal-window": (True, 5, False, (4, 2), (8, 8), 1.5),
    "softcap-bidirectional-window": (False, 6, False, (4, 2), (8, 8), 1.5),
}


def _core_inputs(name, gen):
    causal, window, sinks, (h, hk), (dk, dv), _ = CORE_CASES[name]
    b = 2
    q = torch.randn(b, h, SEQ, dk, generator=gen)
    k = torch.randn(b, hk, SEQ, dk, generator=gen)
    v = torch.randn(b, hk, SEQ, dv, generator=gen)
    s = torch.randn(h, generator=gen) if sinks else None
    return q, k, v, s, causal, window


def _core_reference(name, seed, dtype):
    q, k, v, s, causal, window = _core_inputs(name, torch.Generator().manual_seed(seed))
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v) + ((s,) if s is not None else ())]
    pad = None if causal else torch.ones(2, SEQ, dtype=torch.long)
    out = local_attention(
        *leaves[:3], padding_mask=pad, causal=causal, attn_bias=None, doc_mask=None, scale=0.4, dropout_p=0.0,
        impl="math", window=window, sinks=leaves[3] if s is not None else None, softcap=CORE_CASES[name][5],
    )  # fmt: skip
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 100)).to(dtype)
    return out.detach(), dout, torch.autograd.grad(out, leaves, dout)


def _core_worker(rank, world, seq, out_dir):
    init_group(rank, world, out_dir)
    import torch.distributed as dist

    from tformer.parallel.context import ContextParallelAttention

    try:
        core = ContextParallelAttention(dist.group.WORLD)
        report = {}
        for seed, name in enumerate(CORE_CASES):
            ref_out, ref_dout, ref_grads = _core_reference(name, seed, torch.float32)
            with float64_throughout():
                exact_out, _, exact_grads = _core_reference(name, seed, torch.float64)
            q, k, v, s, causal, window = _core_inputs(name, torch.Generator().manual_seed(seed))
            cap = CORE_CASES[name][5]
            # planted defects: the window one key wider each way than one process's, the sinks left
            # out, the cap left out
            variants = (
                ("ok", window, s, cap),
                ("wide", window and window + 2, s, cap),
                ("no-sinks", window, None, cap),
                ("no-cap", window, s, None),
            )
            for variant, win, sinks, capped in variants:
                if variant != "ok" and (win == window and sinks is s and capped == cap):
                    continue
                ql, kl, vl = (shard_seq(x, rank, world, dim=2).requires_grad_() for x in (q, k, v))
                sl = sinks.clone().requires_grad_() if sinks is not None else None
                pad = None if causal else shard_seq(torch.ones(2, SEQ, dtype=torch.long), rank, world)
                kw = {n: x for n, x in (("window", win), ("sinks", sl), ("softcap", capped)) if x is not None}
                out = core(
                    ql, kl, vl, padding_mask=pad, causal=causal, attn_bias=None, doc_mask=None, scale=0.4,
                    dropout_p=0.0, impl="math", **kw,
                )  # fmt: skip
                leaves = [ql, kl, vl] + ([sl] if sl is not None else [])
                grads = list(torch.autograd.grad(out, leaves, shard_seq(ref_dout, rank, world, dim=2)))
                real = held_positions(2 * out.shape[2], rank, world) < SEQ
                errs = {
                    "out": _ratio(out[:, :, real], shard_seq(ref_out, rank, world, dim=2)[:, :, real], ref_out, exact_out)
                }
                for what, got, want, exact in zip("qkv", grads, ref_grads, exact_grads):
                    errs[f"d{what}"] = _ratio(got, shard_seq(want, rank, world, dim=2), want, exact)
                if s is not None and sl is not None:  # every rank holds its queries' part of the sink's gradient
                    dist.all_reduce(grads[3])
                    errs["dsinks"] = _ratio(grads[3], ref_grads[3], ref_grads[3], exact_grads[3])
                report[f"{name}/{variant}"] = errs
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))
    finally:
        close_group()


def _ratio(got, want, fp32, exact):
    """Largest difference from one process's part, in yardsticks (its fp32 distance from float64)."""
    yard = max((fp32.double() - exact).abs().max().item(), FP32_ROUNDING * exact.abs().max().item())
    return (got.double() - want.double()).abs().max().item() / yard


def test_cp_attention_with_windows_sinks_and_latent_heads_equals_one_process(tmp_path):
    """cp=2 over 13 tokens: windows that cross the shard boundary (causal and bidirectional), sinks
    merged into the pairs' log-sum-exp, MLA's narrower values, soft-capped scores (capped before
    the masks, the gradient through tanh): output and every gradient (the sinks' summed over the
    ranks) within ATTENTION_FACTOR yardsticks of one process. The window one key wider (each side,
    bidirectional), the sinks or the cap left out, lie far outside. Measured on a 2-core AVX512
    Xeon (2026-11-28): at most 3.0 yardsticks; the planted defects 6e6 and more."""
    run_group(2, SEQ, str(tmp_path), _core_worker)
    worst = 0.0
    planted = {}
    for rank in range(2):
        for key, errs in json.loads(Path(tmp_path, f"rank{rank}.json").read_text()).items():
            name, variant = key.split("/")
            if variant == "ok":
                bad = {w: e for w, e in errs.items() if not e <= ATTENTION_FACTOR}
                assert not bad, (rank, name, bad)
                worst = max(worst, *errs.values())
            else:
                planted[key] = max(planted.get(key, 0.0), *errs.values())
    assert set(planted) == (
        {f"{n}/wide" for n, c in CORE_CASES.items() if c[1]}
        | {f"{n}/no-sinks" for n, c in CORE_CASES.items() if c[2]}
        | {f"{n}/no-cap" for n, c in CORE_CASES.items() if c[5]}
    )
    print(f"cp=2 attention: at most {worst:.2f} yardsticks; planted defects from {min(planted.values()):.1e}")
    assert all(e > 100 * ATTENTION_FACTOR for e in planted.values()), planted
    print(f"cp=2 windows/sinks/latent: at most {worst:.2f} yardsticks; planted defects at least {min(planted.values()):.0f}")


# -- the flavours' models: cp, tp and ep against one process, at the gradient ----------------------


def _moved(model):
    """Every norm gain, sink, bias and routing bias moved off its initial value, so that a layout
    that drops or mis-splits one is seen."""
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if t.dim() == 1 and name.endswith("weight"):
                t.normal_(1.0, 0.2)
            elif name.endswith(("score_bias", "sinks.logits")) or (name.endswith("bias") and t.is_floating_point()):
                t.normal_(0.0, 0.3)
            elif name.endswith(("gate_bias", "up_bias", "down_bias")):
                t.normal_(0.0, 0.1)
    return model


ODD_DENSE = dict(vocab_size=300, d_model=36, max_seq_len=32, init_std=0.1, num_layers=2)
MODELS = {
    # name: (preset, overrides); 4 heads over 2 KV heads where tp=2 splits them
    "qwen3": ("qwen3-tiny", dict(ODD_DENSE, num_heads=4, num_kv_heads=2, d_head=10, d_ff=44)),
    "qwen3_moe": (
        "qwen3-moe-tiny",
        dict(ODD_DENSE, num_heads=4, num_kv_heads=2, d_head=10, moe=dict(num_experts=6, top_k=2, d_expert=14)),
    ),
    "gpt_oss": (
        "gpt-oss-tiny",  # window 5 on block 0, global block 1, sinks, biased experts, YaRN
        dict(
            ODD_DENSE,
            num_heads=4,
            num_kv_heads=2,
            d_head=10,
            attn_window=5,
            yarn=dict(factor=4.0, original_max_seq_len=8, truncate=False),
            moe=dict(num_experts=4, top_k=2, d_expert=14),
        ),
    ),  # fmt: skip
    "deepseek_v3": (
        "deepseek-v3-tiny",  # first block dense, then shared + routed experts, group-limited sigmoid routing
        dict(
            ODD_DENSE,
            num_heads=4,
            d_ff=52,
            mtp_depth=0,
            mla=dict(q_lora_rank=14, kv_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5),
            moe=dict(num_experts=6, n_group=3, topk_group=2, top_k=3, d_expert=20, routed_scaling_factor=1.7),
        ),
    ),  # fmt: skip
}
# the layouts run at the gradient (the default lane: one per mechanism and flavour that needs it)
LAYOUTS = [
    ("gpt_oss", "cp"),  # windows across the shard border, sinks
    ("deepseek_v3", "cp"),  # latent attention
    ("gpt_oss", "tp"),  # sinks split with their heads, biased q/k/v/o and experts
    ("qwen3_moe", "ep"),
    ("deepseek_v3", "ep"),  # shared experts beside the routed ones, the dense first block
    ("gpt_oss", "ep"),  # expert biases sharded with their experts
    ("gpt_oss", "fsdp"),  # FSDP2: sinks, biases and stacked experts sharded as any parameter
    ("deepseek_v3", "fsdp"),
    # planted: latent attention left attending within each shard (as before cp replaced its core)
    ("deepseek_v3", "cp-planted"),
]


def zoo_model(name, no_aux=False):
    preset, overrides = MODELS[name]
    overrides = copy.deepcopy(overrides)
    if no_aux and "moe" in overrides:  # per-shard routing losses are not the sequence's (see _layout_worker)
        overrides["moe"].update(aux_loss_coef=0.0, seq_aux_loss_coef=0.0)
    torch.manual_seed(0)
    return _moved(tformer.build_model(preset, dropout=0.0, attn_dropout=0.0, **overrides)).float()


def _batch(vocab, rows, seed, length=SEQ):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, length), generator=gen)
    labels = torch.randint(3, vocab, (rows, length), generator=gen)
    labels[0, :3] = -100
    return {"input_ids": ids, "labels": labels}


def _grads(model, batches):
    """Mean loss of ``batches`` (each one micro-batch) and every parameter's gradient."""
    model.train()
    total = 0.0
    for batch in batches:
        loss = model(**batch, return_logits=False).loss / len(batches)
        loss.backward()
        total = total + loss.detach()
    return {"loss": total, **{n: p.grad.detach().clone() for n, p in model.named_parameters()}}


def _full(g):
    return g.full_tensor() if hasattr(g, "full_tensor") else g


def _layout_worker(rank, world, seq, out_dir):
    init_group(rank, world, out_dir)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from tformer.nn.latent import LatentAttention
    from tformer.parallel.context import apply_context_parallel, loss_tokens, shard_batch
    from tformer.parallel.ep import apply_expert_parallel
    from tformer.parallel.tp import apply_tensor_parallel, loss_context

    try:
        report = {}
        for seed, (name, layout) in enumerate(LAYOUTS):
            # cp: each rank holds a shard of every sequence, whose routing losses are the sequence's
            # only through the trainer's pool (test_moe_layouts): none here. ep: each rank holds
            # half the batch, one process accumulates the two halves as two micro-batches.
            no_aux = layout.startswith("cp")
            ref = zoo_model(name, no_aux)
            # sequence parallelism splits the sequence evenly (the trainer pads it to a multiple of tp)
            split = layout in ("ep", "fsdp")  # each rank a half of the batch
            batch = _batch(ref.config.vocab_size, 4 if split else 2, seed, SEQ + (layout == "tp"))
            halves = [{k: v[2 * r : 2 * r + 2] for k, v in batch.items()} for r in range(2)]
            parts = halves if split else [batch]
            exact_model = copy.deepcopy(ref).double()
            model = copy.deepcopy(ref)
            want = _grads(ref, parts)
            with float64_throughout():
                exact = _grads(exact_model, parts)
            scale = max(g.abs().max().item() for n, g in want.items() if n != "loss")
            model.train()
            if layout.startswith("cp"):
                apply_context_parallel(model, dist.group.WORLD)
                if layout == "cp-planted":
                    for m in model.modules():
                        if isinstance(m, LatentAttention):
                            m.core = local_attention
                shard = shard_batch(batch, rank, world, model.config)
                count = loss_tokens(shard["labels"], dist.group.WORLD)
                loss = model(**shard, return_logits=False, loss_tokens=count).loss
                loss.backward()
                dist.all_reduce(loss := loss.detach())
                got = {"loss": loss}
                for n, p in model.named_parameters():
                    dist.all_reduce(p.grad)
                    got[n] = p.grad
            elif layout == "tp":
                apply_tensor_parallel(model, init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))["tp"], sp=True)
                with loss_context(True):
                    loss = model(**batch, return_logits=False).loss
                    loss.backward()
                got = {"loss": _full(loss.detach())}
                got.update({n: _full(p.grad) for n, p in model.named_parameters()})
            elif layout == "fsdp":  # this rank's half; FSDP2 averages the gradients over the ranks
                from torch.distributed.fsdp import fully_shard

                mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
                for block in model.decoder.layers:
                    fully_shard(block, mesh=mesh)
                fully_shard(model, mesh=mesh)
                loss = model(**halves[rank], return_logits=False).loss
                loss.backward()
                dist.all_reduce(loss := loss.detach())
                got = {"loss": loss / world, **{n: _full(p.grad) for n, p in model.named_parameters()}}
            else:  # ep: this rank's half; the experts' gradients arrive summed over both halves
                apply_expert_parallel(model, init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))["ep"])
                loss = model(**halves[rank], return_logits=False).loss / world
                loss.backward()
                dist.all_reduce(loss := loss.detach())
                got = {"loss": loss}
                for n, p in model.named_parameters():
                    if hasattr(p.grad, "full_tensor"):
                        got[n] = p.grad.full_tensor()
                    else:
                        dist.all_reduce(p.grad)
                        got[n] = p.grad
            assert got.keys() == want.keys(), set(got) ^ set(want)
            yard = yardstick(want, exact, scale)
            report[f"{name}/{layout}"] = {"yard": yard, **{n: relative(got[n], want[n], ZERO * scale) for n in got}}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))
    finally:
        close_group()


def test_flavours_under_cp_tp_ep_and_fsdp_equal_one_process(tmp_path):
    """Loss and every parameter's gradient of 2 ranks equal one process of the same global batch
    within FACTOR yardsticks (tests/rounding.py): gpt-oss under cp (its window crossing the shard
    border, sinks in the merged softmax) and tp + SP (sinks split with their heads); DeepSeek-V3's
    latent attention under cp; qwen3-moe, DeepSeek-V3 (shared experts, group-limited routing, a
    dense first block) and gpt-oss (expert biases) under ep; gpt-oss and DeepSeek-V3 under FSDP2.
    Latent attention left attending within each cp shard (planted) lies far outside."""
    run_group(2, SEQ, str(tmp_path), _layout_worker)
    report = json.loads(Path(tmp_path, "rank0.json").read_text())
    assert list(report) == [f"{n}/{lay}" for n, lay in LAYOUTS]
    lines = []
    for case, errs in report.items():
        yard = errs.pop("yard")
        if case.endswith("planted"):
            assert max(errs.values()) > 100 * FACTOR * yard, (case, max(errs.values()) / yard)
            lines.append(f"{case} {max(errs.values()) / yard:.0f}")
            continue
        bad = {w: e for w, e in errs.items() if not e <= FACTOR * yard}
        assert not bad, (case, bad, yard)
        worst = max(errs, key=errs.get)
        lines.append(f"{case} {errs[worst] / yard:.2f} ({worst})")
    print("yardsticks: " + "; ".join(lines))


# -- trainer runs: the loss-free bias bitwise across layouts and a resume; pipeline cuts -----------

# DeepSeek-V3's tiny recipe at test size: a dense first block, then two MoE blocks (sigmoid routing,
# the bias moved by 1e-3 after every step), one MTP depth where the layout allows it
DEEPSEEK = ["model.num_layers=3", "model.moe.bias_update_rate=0.01"]


def _bias_worker(rank, world, port, jobs, cache):
    """test_mesh's worker, each run writing its routing biases (every rank) and, for ``planted``
    runs, the balancer built to update from this rank's loads only."""
    from train_helpers import become_rank

    become_rank(rank, world, port, cache, 300)
    import torch.distributed as dist

    from tformer.parallel import balance
    from tformer.train.config import load_config
    from tformer.train.trainer import Trainer
    from train_helpers import CONFIGS

    try:
        for recipe, overrides, out, planted in jobs:
            of = balance.LoadBalancer.of
            if planted:  # the planted defect: each rank updates from its own loads
                balance.LoadBalancer.of = classmethod(_one_rank)  # type: ignore[method-assign]
            trainer = Trainer(load_config(CONFIGS / f"{recipe}.yaml", overrides))
            balance.LoadBalancer.of = of  # type: ignore[method-assign]
            trainer.fit()
            biases = {n: b.clone() for n, b in trainer.model.named_buffers() if n.endswith("score_bias")}
            torch.save(biases, f"{out}/bias{rank}.pt")
    finally:
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def _one_rank(cls, model, moe_cfg, dist_info):
    return cls(model, moe_cfg.bias_update_rate, None, reduce=False)


def _train_one(recipe, out, *flags):
    from tformer.train.config import load_config
    from tformer.train.trainer import Trainer
    from train_helpers import CONFIGS, losses, small_overrides

    from test_mesh import COMMON

    trainer = Trainer(load_config(CONFIGS / f"{recipe}.yaml", small_overrides(recipe, out, *COMMON, *flags)))
    trainer.fit()
    biases = {n: b.clone() for n, b in trainer.model.named_buffers() if n.endswith("score_bias")}
    return losses(out), biases, trainer


BIAS_LAYOUTS = [
    ("ddp", ["parallel.strategy=ddp"], False),
    ("fsdp", ["parallel.strategy=fsdp", "parallel.dp_shard=2"], False),
    ("ep", ["parallel.strategy=fsdp", "parallel.dp_shard=2", "parallel.ep=2"], False),
    ("planted-one-rank", ["parallel.strategy=ddp"], True),
]


@pytest.mark.parametrize(
    "lane", [pytest.param(slice(0, 1), id="ddp"), pytest.param(slice(1, None), id="fsdp-ep", marks=pytest.mark.long)]
)
@pytest.mark.timeout(1200)
def test_routing_bias_is_bitwise_one_process_across_layouts_and_a_resume(lane, cache, tmp_path):
    """The loss-free bias after 4 steps of DeepSeek-V3's tiny recipe: DDP, FSDP2 and FSDP2 x ep=2
    on 2 ranks hold, on every rank, bitwise the bias of one process accumulating the same global
    batch (loads are integer counts, summed exactly in any order); so does a run saved at step 2
    and resumed, whose losses are bitwise the uninterrupted run's too. Updated from one rank's
    loads only (planted), the bias is another."""
    from train_helpers import free_port, losses, small_overrides, spawn_ranks

    from test_mesh import COMMON

    recipe = "deepseek-v3-tiny"
    ref_losses, ref, _ = _train_one(recipe, tmp_path / "one", *DEEPSEEK, "grad_accum=2", "save_every=2")
    assert ref and all(b.abs().sum() > 0 for b in ref.values())
    layouts = BIAS_LAYOUTS[lane] + ([BIAS_LAYOUTS[-1]] if lane.start == 0 else [])
    jobs = []
    for name, flags, planted in layouts:
        out = tmp_path / name
        jobs.append((recipe, small_overrides(recipe, out, *COMMON, *DEEPSEEK, *flags), str(out), planted))
    spawn_ranks(_bias_worker, (2, free_port(), jobs, cache), 2, 900)
    for name, _, planted in layouts:
        for rank in range(2):
            got = torch.load(tmp_path / name / f"bias{rank}.pt", weights_only=True)
            same = got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)
            assert same != planted, (name, rank)
    if lane.start == 0:  # resume: the uninterrupted run's step-2 checkpoint, trained on to step 4
        import shutil

        out = tmp_path / "resumed"
        shutil.copytree(tmp_path / "one", out)
        shutil.rmtree(out / "checkpoints" / "step_00000004")
        _, resumed, trainer = _train_one(recipe, out, *DEEPSEEK, "grad_accum=2", "save_every=2")
        assert trainer.resumed_from is not None and trainer.resumed_from.name == "step_00000002"
        assert losses(out) == ref_losses, (losses(out), ref_losses)  # steps 3 and 4 logged again
        assert all(torch.equal(resumed[k], ref[k]) for k in ref)


@pytest.mark.timeout(1200)
def test_routing_bias_through_a_pipeline_is_bitwise_one_process(cache, tmp_path):
    """DeepSeek-V3's tiny recipe (no MTP: refused with pipelines) cut into 2 stages: each stage's
    routing biases after 4 steps are bitwise those of one process accumulating the same micro-
    batches; what torch's shape-inference forward would count is put back (pipeline.py)."""
    from tformer.parallel.pipeline import Parts
    from train_helpers import free_port, small_overrides, spawn_ranks

    from test_mesh import COMMON

    recipe, flags = "deepseek-v3-tiny", [*DEEPSEEK, "model.mtp_depth=0", "grad_accum=2"]
    _, ref, _ = _train_one(recipe, tmp_path / "one", *flags)
    out = tmp_path / "pp"
    pp = ["parallel.pp=2", "parallel.pp_schedule=gpipe"]
    jobs = [(recipe, small_overrides(recipe, out, *COMMON, *flags, *pp), str(out), False)]
    spawn_ranks(_bias_worker, (2, free_port(), jobs, cache), 2, 900)
    got = {}
    for rank in range(2):
        got.update({Parts.strip(k): v for k, v in torch.load(out / f"bias{rank}.pt", weights_only=True).items()})
    assert ref and got.keys() == ref.keys(), (sorted(got), sorted(ref))
    assert all(torch.equal(got[k], ref[k]) for k in ref), {k: (got[k] - ref[k]).abs().max().item() for k in ref}


PIPELINES = [
    ("qwen3", ["parallel.pp=2", "parallel.pp_schedule=1f1b"]),
    # 3 blocks cut 2 + 1: the dense first block and an MoE block on stage 0, an MoE block on stage 1
    ("deepseek_v3", ["parallel.pp=2", "parallel.pp_schedule=gpipe"]),
]


@pytest.mark.timeout(1800)
def test_pipeline_cuts_of_qwen3_and_deepseek_v3_equal_one_process(cache, tmp_path_factory):
    """pp=2 (grad_accum=2 micro-batches) of qwen3 and of DeepSeek-V3 without MTP (refused with
    pipelines in one line, test_deepseek), the loss-free bias moving: losses and parameters within
    test_mesh's layout bound of one process. Measured on a 2-core AVX512 Xeon (2026-11-28): 0.03
    and 0.10 yardsticks on the parameters; with the loads that torch's shape-inference forward
    counts on a later stage's uninitialised inputs left in (pipeline._leave_no_record undone), the
    bias 1.0 off and the run 640 yardsticks."""
    import test_mesh

    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(test_mesh.FAMILIES, "qwen3", ("qwen3-tiny", ["model.d_head=16"]))
        deepseek = ["model.num_layers=3", "model.moe.bias_update_rate=0.01", "model.mtp_depth=0"]
        patch.setitem(test_mesh.FAMILIES, "deepseek_v3", ("deepseek-v3-tiny", deepseek))
        tmp = tmp_path_factory.mktemp("zoo-pp")
        test_mesh.run_cases(2, PIPELINES, tmp, cache, "grad_accum=2")
        for i, (name, _) in enumerate(PIPELINES):
            ref = test_mesh.reference(name, tmp_path_factory, 2)
            test_mesh.assert_same_run(name, tmp / f"run{i}", tmp / f"report{i}", ref)


# -- float8's layer choice, activation checkpointing, compile -----------------------------------


def test_float8_takes_the_new_linear_layers_that_fit_and_leaves_routers_and_sinks():
    """MLA's low-rank projections are ordinary block linears: converted where both sizes are
    multiples of 16 (deepseek-v3-tiny: q_down 64->32, q_up 32->96, kv_down 64->32, o_proj; kv_up
    24->128 is not); routers stay fp32; gpt-oss's biased q/k/v/o are taken, its sinks (no linear)
    and biased experts (stacked, not nn.Linear) are not."""
    from tformer.parallel.float8 import float8_filter

    ds = float8_filter(tformer.build_model("deepseek-v3-tiny", mtp_depth=0))
    for attn in ("q_down", "q_up", "kv_down", "o_proj"):
        assert f"decoder.layers.0.attn.{attn}" in ds and f"decoder.layers.2.attn.{attn}" in ds, (attn, sorted(ds))
    assert not any(n.endswith(("kv_up", "router")) for n in ds), sorted(ds)
    oss = float8_filter(tformer.build_model("gpt-oss-tiny"))
    assert {f"decoder.layers.0.attn.{p}_proj" for p in "qkvo"} <= oss, sorted(oss)
    assert not any(("sinks" in n) or ("experts" in n) or n.endswith("router") for n in oss), sorted(oss)


@pytest.mark.parametrize("name", ["gpt_oss", "deepseek_v3"])
def test_activation_checkpointing_trains_what_the_plain_model_trains_bitwise(name):
    """Full AC over every block: loss and gradients bitwise those without (the recomputed forward
    is the same arithmetic; the routing loads are counted once, not again in the recomputation)."""
    from tformer.parallel.ac import apply_activation_checkpointing

    batch = _batch(300, 2, 0)
    plain = zoo_model(name)
    want = _grads(plain, [batch])
    ac = zoo_model(name)
    assert apply_activation_checkpointing(ac, "full") == 2
    got = _grads(ac, [batch])
    assert all(torch.equal(got[k], want[k]) for k in want), [k for k in want if not torch.equal(got[k], want[k])]
    loads = [m.load for m in ac.modules() if getattr(m, "load", None) is not None]
    ref_loads = [m.load for m in plain.modules() if getattr(m, "load", None) is not None]
    assert len(loads) == len(ref_loads) and all(torch.equal(a, b) for a, b in zip(loads, ref_loads))


@pytest.mark.parametrize("mode", ["full", "op"])
def test_compiled_blocks_under_checkpointing_count_each_routing_load_once(mode):
    """DeepSeek-V3's blocks compiled (aot_eager) under full or op-level activation checkpointing:
    the expert loads that move the loss-free bias are the eager model's, bitwise (moe.in_backward
    does not read autograd's task while compiling; a recomputation must not count again)."""
    from tformer.parallel.ac import apply_activation_checkpointing
    from tformer.parallel.compile import compile_blocks

    batch = _batch(300, 2, 0, 16)
    plain = zoo_model("deepseek_v3")
    compiled = zoo_model("deepseek_v3")
    apply_activation_checkpointing(compiled, mode)
    torch._dynamo.reset()
    compile_blocks(compiled, backend="aot_eager")
    for model in (plain, compiled):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(**batch, return_logits=False).loss.backward()
    want = [m.load for m in plain.modules() if getattr(m, "load", None) is not None]
    got = [m.load for m in compiled.modules() if getattr(m, "load", None) is not None]
    assert want and len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want)), (got, want)


@pytest.mark.parametrize("name", ["qwen3", "gpt_oss", "deepseek_v3"])
def test_every_new_attention_and_dense_block_compiles_without_a_graph_break(name):
    """The blocks per-block compile traces: QK-norm attention (and qwen3's whole training forward),
    gpt-oss's windowed attention with sinks, MLA and DeepSeek-V3's dense first block; one graph
    each. (An MoE layer's routing is left eager by design: parallel/compile.py.)"""
    from tformer.parallel.compile import allow_dynamic_shapes

    model = zoo_model(name).train()
    allow_dynamic_shapes(model)
    batch = _batch(300, 2, 0, 16)
    x = torch.randn(2, 16, model.config.d_model)
    layers = model.decoder.layers
    targets = [("attn", layers[0].attn, (x,), {"causal": True})]
    if name == "deepseek_v3":
        targets.append(("dense block", layers[0], (x,), {}))
    if name == "qwen3":
        targets.append(("model", lambda **kw: model(**kw, return_logits=False).loss, (), batch))
    for what, fn, args, kwargs in targets:
        torch._dynamo.reset()
        explained = torch._dynamo.explain(fn)(*args, **kwargs)
        assert explained.graph_break_count == 0 and explained.graph_count == 1, (
            what, [str(r.reason)[:200] for r in explained.break_reasons]
        )  # fmt: skip


CP_RUNS = [
    ("gpt_oss", ["parallel.strategy=fsdp", "parallel.cp=2"]),
    ("deepseek_v3", ["parallel.strategy=fsdp", "parallel.cp=2"]),
]


@pytest.mark.timeout(1800)
def test_trainer_cp2_of_gpt_oss_and_deepseek_v3_equals_one_process(cache, tmp_path_factory):
    """The trainer at cp=2 (61 tokens: gpt-oss's 16-token window crosses the shard borders, sinks;
    DeepSeek-V3's latent attention, its routing losses pooled over the whole sequence): losses and
    parameters within test_mesh's layout bound of one process over 4 AdamW steps. Measured on a
    2-core AVX512 Xeon (2026-11-28): 1.1 and 0.6 yardsticks; the sequence-wise balance loss taken per shard (as it
    was before it was pooled) put DeepSeek-V3's routers 62 off, and gpt-oss's key bias, which
    trains beside sinks, broke test_mesh's rule that a key bias stays at 0."""
    import test_mesh

    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(test_mesh.FAMILIES, "gpt_oss", ("gpt-oss-tiny", ["data.seq_len=61", "model.attn_window=16"]))
        deepseek = ["data.seq_len=61", "model.num_layers=3", "model.moe.bias_update_rate=0", "model.mtp_depth=0"]
        patch.setitem(test_mesh.FAMILIES, "deepseek_v3", ("deepseek-v3-tiny", deepseek))
        tmp = tmp_path_factory.mktemp("zoo-cp")
        test_mesh.run_cases(2, CP_RUNS, tmp, cache)
        for i, (name, _) in enumerate(CP_RUNS):
            ref = test_mesh.reference(name, tmp_path_factory, 1)
            test_mesh.assert_same_run(name, tmp / f"run{i}", tmp / f"report{i}", ref)


GPT_OSS_RUNS = [
    ("gpt_oss", ["parallel.tp=2", "parallel.sp=true"]),
    ("gpt_oss", ["parallel.strategy=fsdp", "parallel.dp_shard=2"]),
]


@pytest.mark.long
@pytest.mark.timeout(1800)
def test_trainer_gpt_oss_under_tp_sp_and_fsdp2_equals_one_process(cache, tmp_path_factory):
    """gpt-oss's trainer runs at tp=2 + SP (sinks split with their heads) and FSDP2 dp_shard=2
    within test_mesh's layout bound (the 2.1-yardstick loss measured before was within it; its
    parameters failed on test_mesh's rule that a key bias stays at 0, which sinks break)."""
    import test_mesh

    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(test_mesh.FAMILIES, "gpt_oss", ("gpt-oss-tiny", ["data.seq_len=61", "model.attn_window=16"]))
        tmp = tmp_path_factory.mktemp("zoo-gpt-oss")
        test_mesh.run_cases(2, GPT_OSS_RUNS, tmp, cache)
        for i, (name, flags) in enumerate(GPT_OSS_RUNS):
            ref = test_mesh.reference(name, tmp_path_factory, 1 if "parallel.tp=2" in flags else 2)
            test_mesh.assert_same_run(name, tmp / f"run{i}", tmp / f"report{i}", ref)
