"""The MoE FFN against references written the way HF writes it (a loop over experts picked by a
one-hot mask) and against HF's own MoE blocks and auxiliary-loss functions, on the same weights."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
import torch.nn.functional as F
from rounding import assert_within, float64_throughout, yardstick

from tformer.config import ConfigError, ModelConfig, MoEConfig
from tformer.nn.moe import moe_layers
from tformer.nn.ffn import FFN_KINDS
from tformer.nn.moe import MoEFeedForward, capacity_mask, grouped_mm_ok, load_balancing_loss, router_z_loss

D, F_EXPERT, E = 16, 32, 4

MIXTRAL = MoEConfig(num_experts=E, top_k=2, router_softmax="topk", activation="swiglu")
QWEN = MoEConfig(
    num_experts=E, top_k=2, activation="swiglu", num_shared_experts=1, d_shared=24, shared_gate=True, renormalize=False
)
SWITCH = MoEConfig(num_experts=E, top_k=1, activation="relu", expert_capacity=3)
TOP2_CAPACITY = MoEConfig(num_experts=E, top_k=2, activation="gelu", renormalize=True, capacity_factor=0.75)
CASES = {"mixtral": MIXTRAL, "qwen2_moe": QWEN, "switch": SWITCH, "top2_capacity": TOP2_CAPACITY}


def make_block(cfg: MoEConfig, grouped: bool | None = None) -> MoEFeedForward:
    block = MoEFeedForward(cfg, D, F_EXPERT, "swiglu")
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, p.shape[-1] ** -0.5)  # routing spread over all experts
    block.experts.grouped = grouped
    return block


def reference_capacity(experts: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """Plain loops: per group, choice rank by choice rank, token by token, an expert takes
    assignments until it holds ``capacity``."""
    g, s, k = experts.shape
    keep = torch.zeros(g, s, k, dtype=torch.bool)
    for gi in range(g):
        load = [0] * num_experts
        for rank in range(k):
            for t in range(s):
                e = int(experts[gi, t, rank])
                if load[e] < capacity:
                    load[e] += 1
                    keep[gi, t, rank] = True
    return keep


def reference_forward(block: MoEFeedForward, x: torch.Tensor) -> torch.Tensor:
    """The block as HF writes it (Mixtral / Qwen2-MoE experts, Switch's router), independently of
    tformer's dispatch: an (E, k, T) one-hot mask, one expert at a time, ``index_add_``."""
    cfg, ex = block.cfg, block.experts
    b, s, d = x.shape
    h = x.reshape(-1, d)
    logits = F.linear(h, block.router.weight, block.router.bias)
    probs = logits.softmax(-1)
    weights, chosen = probs.topk(cfg.top_k, dim=-1)
    if cfg.router_softmax == "topk" or cfg.renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    if cfg.expert_capacity or cfg.capacity_factor:
        cap = cfg.expert_capacity or math.ceil(cfg.capacity_factor * s * cfg.top_k / cfg.num_experts)
        keep = reference_capacity(chosen.view(b, s, -1), cfg.num_experts, cap).view_as(chosen)
        weights = weights * keep
    act, gated = FFN_KINDS[cfg.activation]
    out = torch.zeros_like(h)
    mask = F.one_hot(chosen, cfg.num_experts).permute(2, 1, 0)
    for e in range(cfg.num_experts):
        rank, token = torch.where(mask[e])
        xe = h[token]
        up = xe @ ex.up[e].t()
        y = (act(xe @ ex.gate[e].t()) * up if gated else act(up)) @ ex.down[e].t()
        out.index_add_(0, token, y * weights[token, rank, None])
    if block.shared is not None:
        shared = block.shared(h)
        out = out + (torch.sigmoid(block.shared_gate(h)) * shared if block.shared_gate is not None else shared)
    return out.view(b, s, d)


def grads(block, x, fn):
    x = x.clone().requires_grad_()
    block.zero_grad()
    y = fn(x)
    (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in block.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("name", CASES)
def test_block_equals_hf_style_reference(name, grouped):
    block = make_block(CASES[name], grouped)
    exact_block = copy.deepcopy(block).double()
    x = torch.randn(3, 7, D)
    y, gx, gp = grads(block, x, block)
    y_ref, gx_ref, gp_ref = grads(block, x, lambda t: reference_forward(block, t))
    # the block sums its experts' outputs in another order than the reference's loop: it may lie a
    # few times as far from it as the reference lies from itself in float64 (tests/rounding.py)
    with float64_throughout():
        y64, gx64, gp64 = grads(exact_block, x.double(), lambda t: reference_forward(exact_block, t))
    want = {"y": y_ref, "x": gx_ref, **gp_ref}
    scale = max(g.abs().max().item() for g in gp_ref.values())
    yard = yardstick(want, {"y": y64, "x": gx64, **gp64}, scale)
    ratio = assert_within({"y": y, "x": gx, **gp}, want, yard, scale, name)
    print(f"{name} grouped={grouped}: {ratio:.2f} yardsticks ({yard:.1e})")
    if name in ("switch", "top2_capacity"):
        assert 0 < block.stats["dropped_fraction"] < 1  # capacity really dropped some


def test_grouped_and_loop_paths_agree():
    assert grouped_mm_ok(torch.randn(4, D), torch.randn(E, F_EXPERT, D))
    assert not grouped_mm_ok(torch.randn(4, 6), torch.randn(E, F_EXPERT, 6))  # 24-byte rows
    x = torch.randn(2, 9, D)
    loop, grouped = make_block(MIXTRAL, False), make_block(MIXTRAL, True)
    grouped.load_state_dict(loop.state_dict())
    a, b = grads(loop, x, loop), grads(grouped, x, grouped)
    for u, v in zip(a[:2], b[:2]):
        torch.testing.assert_close(u, v, atol=1e-6, rtol=1e-6)
    for n in a[2]:
        torch.testing.assert_close(a[2][n], b[2][n], atol=1e-6, rtol=1e-6)
    # an expert with no rows (expert 1): zero gradient, and equal outputs and gradients, on both paths
    counts = torch.tensor([5, 0, 4, 9])
    rows = torch.randn(18, D)
    outs = []
    for block in (loop, grouped):
        block.zero_grad()
        xr = rows.clone().requires_grad_()
        y = block.experts(xr, counts)
        y.sum().backward()  # a stride-0 gradient, which _grouped_mm's own backward refuses on CPU
        assert block.experts.up.grad[1].abs().sum() == 0
        outs.append((y, xr.grad, block.experts.down.grad))
    for u, v in zip(*outs):
        torch.testing.assert_close(u, v, atol=1e-6, rtol=1e-6)


def test_capacity_mask_matches_loops():
    experts = torch.randint(0, 5, (3, 11, 2))
    for cap in (1, 2, 4, 30):
        assert torch.equal(capacity_mask(experts, 5, cap), reference_capacity(experts, 5, cap))


def _hf_blocks():
    transformers = pytest.importorskip("transformers")
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
    from transformers.models.switch_transformers.modeling_switch_transformers import SwitchTransformersSparseMLP

    def mixtral(ours):
        cfg = transformers.MixtralConfig(
            hidden_size=D, intermediate_size=F_EXPERT, num_local_experts=E, num_experts_per_tok=2, router_jitter_noise=0.0
        )
        return MixtralSparseMoeBlock(cfg), {
            "gate.weight": ours.router.weight,
            "experts.gate_up_proj": torch.cat([ours.experts.gate, ours.experts.up], 1),
            "experts.down_proj": ours.experts.down,
        }

    def qwen(ours):
        cfg = transformers.Qwen2MoeConfig(
            hidden_size=D,
            moe_intermediate_size=F_EXPERT,
            shared_expert_intermediate_size=24,
            num_experts=E,
            num_experts_per_tok=2,
            norm_topk_prob=False,
        )
        return Qwen2MoeSparseMoeBlock(cfg), {
            "gate.weight": ours.router.weight,
            "experts.gate_up_proj": torch.cat([ours.experts.gate, ours.experts.up], 1),
            "experts.down_proj": ours.experts.down,
            "shared_expert.gate_proj.weight": ours.shared.gate.weight,
            "shared_expert.up_proj.weight": ours.shared.up.weight,
            "shared_expert.down_proj.weight": ours.shared.down.weight,
            "shared_expert_gate.weight": ours.shared_gate.weight,
        }

    def switch(ours):
        cfg = transformers.SwitchTransformersConfig(
            d_model=D, d_ff=F_EXPERT, num_experts=E, expert_capacity=3, router_jitter_noise=0.0, dropout_rate=0.0
        )
        state = {"router.classifier.weight": ours.router.weight}
        for e in range(E):
            state[f"experts.expert_{e}.wi.weight"] = ours.experts.up[e]
            state[f"experts.expert_{e}.wo.weight"] = ours.experts.down[e]
        return SwitchTransformersSparseMLP(cfg), state

    return {"mixtral": mixtral, "qwen2_moe": qwen, "switch": switch}


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "switch"])
def test_block_equals_hf_block(name):
    ours = make_block(CASES[name]).eval()
    hf, state = _hf_blocks()[name](ours)
    hf.load_state_dict({k: v.detach().clone() for k, v in state.items()}, strict=True)
    hf.eval()
    x = torch.randn(3, 7, D)
    y, gx, _ = grads(ours, x, ours)
    y_hf, gx_hf, _ = grads(hf, x, lambda t: hf(t)[0] if isinstance(hf(t), tuple) else hf(t))
    torch.testing.assert_close(y, y_hf, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gx, gx_hf, atol=1e-5, rtol=1e-5)


def test_aux_losses_equal_hf_functions():
    pytest.importorskip("transformers")
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func as mixtral_balance
    from transformers.models.switch_transformers.modeling_switch_transformers import (
        load_balancing_loss_func as switch_balance,
    )
    from transformers.models.switch_transformers.modeling_switch_transformers import router_z_loss_func

    logits = torch.randn(40, 8) * 2
    probs = logits.softmax(-1)
    for k in (1, 2, 3):
        chosen = probs.topk(k, dim=-1).indices
        torch.testing.assert_close(load_balancing_loss(probs, chosen, 8), mixtral_balance((logits,), 8, k))
    top1 = probs.argmax(-1)
    torch.testing.assert_close(load_balancing_loss(probs, top1, 8), switch_balance(probs[None], top1[None]))
    torch.testing.assert_close(router_z_loss(logits), router_z_loss_func(logits[None]))


def test_aux_loss_and_stats_recorded():
    cfg = MoEConfig(num_experts=E, top_k=1, activation="relu", capacity_factor=0.5, aux_loss_coef=0.1, z_loss_coef=0.01)
    block = make_block(cfg)
    x = torch.randn(2, 8, D)
    block(x)
    logits = F.linear(x.reshape(-1, D), block.router.weight)
    chosen = logits.argmax(-1)
    expected = 0.1 * load_balancing_loss(logits.softmax(-1), chosen, E) + 0.01 * router_z_loss(logits)
    torch.testing.assert_close(block.aux_loss, expected)
    counts = torch.bincount(chosen, minlength=E).float()
    torch.testing.assert_close(block.stats["tokens_max_over_mean"], counts.max() / counts.mean())
    kept = sum(min(int(c), 1) for g in chosen.view(2, 8) for c in torch.bincount(g, minlength=E))  # capacity 1
    torch.testing.assert_close(block.stats["dropped_fraction"], torch.tensor(1 - kept / 16))
    block.aux_loss.backward()
    assert block.router.weight.grad.abs().sum() > 0  # the losses train the router


def test_jitter_only_while_training():
    block = make_block(MoEConfig(num_experts=E, top_k=1, activation="relu", jitter=0.5))
    x = torch.randn(4, 16, D)
    block.eval()
    torch.testing.assert_close(block(x), reference_forward(block, x))
    block.train()
    assert not torch.allclose(block.router_logits(x.reshape(-1, D)), F.linear(x.reshape(-1, D), block.router.weight))


@pytest.mark.parametrize(
    "moe, message",
    [
        ({"num_experts": 4, "top_k": 5}, "model.moe.top_k=5 must be in [1, num_experts=4]"),
        ({"num_experts": 4, "top_k": 0}, "model.moe.top_k=0 must be in [1, num_experts=4]"),
        ({"num_experts": 4, "capacity_factor": 0.0}, "model.moe.capacity_factor=0.0 must be > 0"),
        ({"num_experts": 4, "capacity_factor": -1.0}, "model.moe.capacity_factor=-1.0 must be > 0"),
        ({"num_experts": 4, "top_kk": 1}, "unknown config key model.moe.top_kk; did you mean model.moe.top_k?"),
    ],
)
def test_bad_moe_config_is_one_line(moe, message):
    with pytest.raises(ConfigError) as err:
        ModelConfig(moe=moe)
    assert message in str(err.value) and "\n" not in str(err.value)


# -- every family trains with MoE FFNs -------------------------------------------------------------


@pytest.mark.parametrize(
    "recipe,extra",
    [
        ("mixtral-tiny", ()),
        ("switch-tiny", ()),
        # BERT with MoE FFNs: no HF twin (its export is refused, tests/test_export.py), but it trains
        ("bert-tiny", ("model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.moe_every=2")),
    ],
)
def test_moe_recipe_lowers_validation_loss(recipe, extra, cache, tmp_path, one_thread):
    from tformer.train.config import load_config
    from tformer.train.trainer import Trainer

    from train_helpers import CONFIGS, small_overrides

    overrides = small_overrides(
        recipe, tmp_path, "max_steps=40", "eval_every=0", "save_every=0", "optim.warmup_steps=5", "precision=fp32", *extra
    )
    t = Trainer(load_config(CONFIGS / f"{recipe}.yaml", overrides))
    layers = moe_layers(t.model)
    assert layers and all(m.cfg.num_experts == t.model_cfg.moe.num_experts for m in layers)
    before = t.evaluate()["val_loss"]
    last = t.fit()
    assert last["val_loss"] < before - 0.5, (before, last["val_loss"])
    assert all(m.aux_loss is not None and m.stats for m in layers)
    record = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()][-1]
    assert 1.0 <= record["moe/tokens_max_over_mean"] <= record["moe/tokens_max_over_mean_worst"]
    assert record["moe/balance_loss"] > 0 and record["moe/z_loss"] > 0
    if recipe == "switch-tiny":
        assert 0 <= record["moe/dropped_fraction"] < 1
    else:
        assert record["moe/dropped_fraction"] == 0  # dropless


def test_aux_loss_joins_the_training_loss_only_while_training():
    import tformer

    model = tformer.build_model("mixtral-tiny", vocab_size=300, moe={"aux_loss_coef": 0.5, "z_loss_coef": 0.1})
    ids = torch.randint(0, 300, (2, 12))
    model.train()
    loss = model(ids, labels=ids).loss
    aux = torch.stack([m.aux_loss for m in moe_layers(model)]).mean()
    model.eval()
    plain = model(ids, labels=ids).loss
    torch.testing.assert_close(loss, plain + aux)
    assert aux > 0.5  # the balance loss is ~1 at best, times 0.5


@pytest.mark.parametrize(
    "preset,modes",
    [
        ("mixtral-tiny", ("full", "op")),
        # inductor's cold compile of a MoE block: ~35 s in a fresh CI checkout, in the long lane
        pytest.param("mixtral-tiny", ("compile",), marks=pytest.mark.long),
        ("switch-tiny", ("full", "op")),
    ],
)
def test_moe_models_under_activation_checkpointing_and_compile_equal_the_plain_step(preset, modes):
    """One training forward + backward of a MoE model (dropless Mixtral-like; Switch with capacity
    routing, every other block MoE) under full and op-level activation checkpointing, and the
    Mixtral-like with compiled blocks (fp32: the grouped matmul's compiled form takes bf16 only, so
    compiled fp32 blocks take the per-expert path): the loss (with its auxiliary losses) and every gradient equal the plain
    step's (1e-6 relative; recomputation replays the same routing)."""
    from tformer.models import build_model
    from tformer.parallel.ac import apply_activation_checkpointing
    from tformer.parallel.compile import compile_blocks

    torch._dynamo.reset()

    def step(mode: str):
        torch.manual_seed(0)
        model = build_model(preset, dropout=0.0, attn_dropout=0.0)
        if mode in ("full", "op"):
            assert apply_activation_checkpointing(model, mode) > 0
        elif mode == "compile":
            compile_blocks(model)
        gen = torch.Generator().manual_seed(1)
        vocab = model.config.vocab_size
        ids = torch.randint(1, vocab, (2, 16), generator=gen)
        inputs = {"input_ids": ids, "labels": torch.randint(1, vocab, (2, 16), generator=gen)}
        if model.config.family == "encdec":
            inputs["decoder_input_ids"] = torch.randint(1, vocab, (2, 8), generator=gen)
            inputs["labels"] = torch.randint(1, vocab, (2, 8), generator=gen)
        out = model(**inputs)
        out.loss.backward()
        return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    want_loss, want = step("none")
    assert any(".experts." in n for n in want) and any("router" in n for n in want)
    for mode in modes:
        loss, got = step(mode)
        assert loss == pytest.approx(want_loss.item(), rel=1e-6), mode
        assert got.keys() == want.keys(), mode
        for n, g in got.items():
            scale = want[n].abs().max().clamp(min=1e-12)
            assert ((g - want[n]).abs().max() / scale).item() < 1e-5, (mode, n)
