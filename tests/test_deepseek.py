"""DeepSeek-V3's blocks: multi-head latent attention against a written-out reference (and a wrong
rope split or a missing norm, which must fail), its latent cache; group-limited sigmoid routing
against a per-token reference (and a group outside ``topk_group``, which must be caught); the
loss-free balancing bias (a buffer, moved the right way, summed over 2 gloo ranks bitwise as one
process); HF parity with every weight and buffer off its init, within the float64 bound; the
planner's parameter counts against transformers' meta-device model and the published figures;
bad input in one line each. fp32 throughout."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import transformers

import tformer
from tformer.config import ConfigError
from tformer.export import to_hf_model
from tformer.export.deepseek_v3 import hf_config
from tformer.generate import generate
from tformer.nn.latent import LatentAttention, cache_values_per_token
from tformer.nn.moe import MoEFeedForward, sigmoid_route
from tformer.parallel import balance
from tformer.parallel.balance import LoadBalancer
from tformer.plan.moe import active_parameters
from tformer.plan.states import num_parameters

from rounding import FACTOR, FP32_ROUNDING, float64_throughout, relative

pytestmark = pytest.mark.usefixtures("one_thread")

# odd widths: 3 heads, latent 10, rotary 4, nope 6, values 5; 6 experts in 3 groups, 2 kept, top-3
ODD = dict(
    vocab_size=300,
    d_model=36,
    num_heads=3,
    d_ff=52,
    init_std=0.1,
    mla=dict(q_lora_rank=14, kv_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5),
    moe=dict(num_experts=6, n_group=3, topk_group=2, top_k=3, d_expert=20, routed_scaling_factor=1.7),
)


def odd_model(seed: int = 0, **overrides):
    """The odd tiny DeepSeek-V3 with every norm gain and routing bias moved off its init."""
    torch.manual_seed(seed)
    cfg = {**ODD, **overrides}
    cfg["mla"] = {**ODD["mla"], **overrides.get("mla", {})}
    model = tformer.build_model("deepseek-v3-tiny", **cfg)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if t.dim() == 1 and name.endswith("weight"):
                t.normal_(1.0, 0.2)
            elif name.endswith("score_bias"):
                t.normal_(0.0, 0.1)
    return model


# -- multi-head latent attention -----------------------------------------------------------------


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rotate_pairs(x, positions, theta, interleave):
    """Rotary on pairs, written out: pair i is (x[2i], x[2i+1]) (interleaved) or (x[i], x[i+d/2])
    (halves), turned by position * theta^(-2i/d); the result keeps the input's layout."""
    d = x.shape[-1]
    freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = positions.double()[:, None] * freq  # (S, d/2)
    c, s = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    a, b = (x[..., 0::2], x[..., 1::2]) if interleave else (x[..., : d // 2], x[..., d // 2 :])
    ra, rb = a * c - b * s, b * c + a * s
    if interleave:
        return torch.stack((ra, rb), dim=-1).flatten(-2)
    return torch.cat((ra, rb), dim=-1)


def reference_mla(attn: LatentAttention, x: torch.Tensor, theta: float, interleave: bool) -> torch.Tensor:
    """DeepSeek-V2's equations (9)-(19), one head at a time, causal, no cache."""
    eps = attn.kv_norm.eps
    b, s, _ = x.shape
    H, dn, dr, dv, r = attn.num_heads, attn.nope, attn.rope, attn.d_v, attn.kv_rank
    pos = torch.arange(s)
    if attn.q_proj is not None:
        q_all = x @ attn.q_proj.weight.T
    else:
        q_all = rms(x @ attn.q_down.weight.T, attn.q_norm.weight, eps) @ attn.q_up.weight.T
    ckv = x @ attn.kv_down.weight.T
    c, k_r = ckv[..., :r], ckv[..., r:]
    kv = rms(c, attn.kv_norm.weight, eps) @ attn.kv_up.weight.T
    k_r = rotate_pairs(k_r, pos, theta, interleave)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    heads = []
    for h in range(H):
        q = q_all[..., h * (dn + dr) : (h + 1) * (dn + dr)]
        q = torch.cat((q[..., :dn], rotate_pairs(q[..., dn:], pos, theta, interleave)), -1)
        kvh = kv[..., h * (dn + dv) : (h + 1) * (dn + dv)]
        k = torch.cat((kvh[..., :dn], k_r), -1)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(dn + dr)
        p = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        heads.append(p @ kvh[..., dn:])
    return torch.cat(heads, -1) @ attn.o_proj.weight.T


def _wrong_rope_split(attn):
    queries = attn.queries
    attn.queries = lambda x: queries(x).roll(attn.rope, dims=-1)  # rotary read from the head's first dims


def _missing_kv_norm(attn):
    attn.kv_norm = torch.nn.Identity()


def _missing_q_norm(attn):
    attn.q_norm = torch.nn.Identity()


@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("q_lora", [14, None])
def test_mla_equals_the_written_out_equations_and_planted_defects_fail(interleave, q_lora):
    model = odd_model(mla=dict(q_lora_rank=q_lora, rope_interleave=interleave))
    attn = model.decoder.layers[0].attn
    x = torch.randn(2, 7, 36)
    rotary = model.decoder.rotary(torch.arange(7))
    with torch.no_grad():
        got = attn(x, causal=True, rotary=rotary)
        want = reference_mla(attn, x, 10000.0, interleave)
        exact = copy.deepcopy(attn).double()
        with float64_throughout():
            want64 = reference_mla(exact, x.double(), 10000.0, interleave)
    yard = max(FP32_ROUNDING, relative(want, want64))
    err = relative(got, want)
    assert err <= FACTOR * yard, (err, yard)
    defects = [_wrong_rope_split, _missing_kv_norm] + ([_missing_q_norm] if q_lora else [])
    for plant in defects:
        broken = copy.deepcopy(attn)
        plant(broken)
        with torch.no_grad():
            bad = relative(broken(x, causal=True, rotary=rotary), want)
        assert bad > 1000 * FACTOR * yard, (plant.__name__, bad, yard)


def test_mla_cache_holds_the_latent_and_rotary_key_and_decodes_as_the_full_forward():
    model = odd_model().eval()
    ids = torch.randint(3, 300, (2, 9))
    cache = model.new_cache()
    with torch.no_grad():
        full = model(ids).logits
        steps = [model(ids[:, :5], cache=cache).logits[:, -1]]
        for t in range(5, 9):
            steps.append(model(ids[:, t : t + 1], cache=cache).logits[:, -1])
    layer = cache.self_kv[0]
    assert layer.k.shape == (2, 1, 9, 10) and layer.v.shape == (2, 1, 9, 4)  # latent, rotary key
    assert torch.allclose(torch.stack(steps[1:], 1), full[:, 5:], atol=1e-5)
    assert torch.allclose(steps[0], full[:, 4], atol=1e-5)
    ds = tformer.build_config("deepseek-v3")
    assert cache_values_per_token(ds) == 576  # against 2 x 128 x 128 = 32,768 as full MHA heads
    assert cache_values_per_token(tformer.build_config("llama-tiny")) == 2 * 2 * 16


# -- group-limited sigmoid routing ---------------------------------------------------------------


def reference_route(logits, bias, n_group, topk_group, top_k, factor):
    """Per token, written out: groups ranked by the sum of their two best biased scores; the
    top_k biased scores among the kept groups; weights the unbiased scores, renormalised, scaled."""
    scores = logits.double().sigmoid()
    out = []
    per = logits.shape[1] // n_group
    for s in scores:
        biased = s + bias.double()
        group_score = [sorted(biased[g * per : (g + 1) * per].tolist())[-2:] for g in range(n_group)]
        kept = sorted(range(n_group), key=lambda g: -sum(group_score[g]))[:topk_group]
        allowed = [e for g in kept for e in range(g * per, (g + 1) * per)]
        chosen = sorted(allowed, key=lambda e: -biased[e].item())[:top_k]
        w = s[chosen] / s[chosen].sum() * factor
        out.append(dict(zip(chosen, w.tolist())))
    return out


def groups_respected(experts, logits, bias, n_group, topk_group) -> bool:
    """Every chosen expert lies in one of the token's topk_group best groups."""
    per = logits.shape[1] // n_group
    biased = (logits.sigmoid() + bias).view(logits.shape[0], n_group, per)
    best = biased.topk(2, -1).values.sum(-1).topk(topk_group, -1).indices  # (T, topk_group)
    return bool((experts[:, :, None] // per == best[:, None, :]).any(-1).all())


def test_group_limited_routing_equals_the_per_token_reference_and_a_group_outside_is_caught():
    cfg = tformer.build_config("deepseek-v3-tiny", moe=dict(num_experts=12, n_group=4, topk_group=2, top_k=3)).moe
    cfg.routed_scaling_factor = 2.5
    torch.manual_seed(0)
    logits, bias = torch.randn(64, 12) * 2, torch.randn(12) * 0.3
    _, experts, weights = sigmoid_route(logits, cfg, bias)
    weights = weights * cfg.routed_scaling_factor
    for t, want in enumerate(reference_route(logits, bias, 4, 2, 3, 2.5)):
        got = dict(zip(experts[t].tolist(), weights[t].tolist()))
        assert got.keys() == want.keys(), t
        assert all(abs(got[e] - want[e]) <= 4 * FP32_ROUNDING * 2.5 for e in want), t
    assert groups_respected(experts, logits, bias, 4, 2)
    # planted: the same scores routed without the group limit pick experts outside the kept groups
    cfg_flat = copy.copy(cfg)
    cfg_flat.n_group, cfg_flat.topk_group = 1, 1
    _, flat, _ = sigmoid_route(logits, cfg_flat, bias)
    assert not groups_respected(flat, logits, bias, 4, 2)


# -- loss-free balancing -------------------------------------------------------------------------


def _skewed_moe(seed=0):
    torch.manual_seed(seed)
    cfg = tformer.build_config("deepseek-v3-tiny", moe=dict(num_experts=8, n_group=1, topk_group=1, top_k=2)).moe
    cfg.bias_update_rate = 0.02
    moe = MoEFeedForward(cfg, 16, 32, "swiglu").train()
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.2)
        moe.router.weight[0] += 2.0  # expert 0 scores high for every token
    return moe


def _imbalance(moe, x, steps, balancer):
    for _ in range(steps):
        moe(x)
        balancer.after_step()
    moe(x)
    load = moe.load
    moe.load = None
    return (load.max() / load.mean()).item()


def test_bias_is_a_buffer_no_optimizer_holds_and_it_evens_the_loads():
    moe = _skewed_moe()
    assert "score_bias" in dict(moe.named_buffers()) and "score_bias" not in dict(moe.named_parameters())
    assert "score_bias" in moe.state_dict()
    x = torch.randn(4, 16, 16)
    before = _imbalance(copy.deepcopy(moe), x, 0, LoadBalancer(moe, 0.02))
    balanced = copy.deepcopy(moe)
    after = _imbalance(balanced, x, 40, LoadBalancer(balanced, 0.02))
    assert after < 0.8 * before, (before, after)
    assert balanced.score_bias[0] < 0  # the overloaded expert's bias went down


def test_bias_updated_with_the_wrong_sign_is_caught(monkeypatch):
    moe = _skewed_moe()
    x = torch.randn(4, 16, 16)
    before = _imbalance(copy.deepcopy(moe), x, 0, LoadBalancer(moe, 0.02))
    monkeypatch.setattr(
        balance, "update_score_bias", lambda b, load, rate: b.add_(torch.sign(load - load.mean()), alpha=rate)
    )
    worse = _imbalance(moe, x, 40, LoadBalancer(moe, 0.02))
    assert not worse < 0.8 * before, worse  # what the test above asserts fails


def _global_batches(steps=4):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 300, (4, 12), generator=g) for _ in range(steps)]


def _run_balancer(model, batches, balancer, part=slice(None)):
    model.train()
    for ids in batches:
        with torch.enable_grad():
            model(ids[part])  # a training forward counts its routing (no backward needed here)
        balancer.after_step()
    return [b.clone() for b in balancer.biases()]


def _bias_worker(rank, port, out, reduce):
    import datetime

    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60)
    )
    try:
        torch.set_num_threads(1)
        model = odd_model(moe=dict(ODD["moe"], bias_update_rate=0.01))
        balancer = LoadBalancer(model, 0.01, None, reduce)
        biases = _run_balancer(model, _global_batches(), balancer, slice(2 * rank, 2 * rank + 2))
        torch.save(biases, f"{out}/bias{rank}.pt")
    finally:
        dist.barrier()
        dist.destroy_process_group()


@pytest.mark.parametrize("reduce", [True, False], ids=["summed", "planted-one-rank-only"])
@pytest.mark.timeout(120)
def test_bias_on_2_ranks_is_bitwise_one_process_of_the_global_batch(reduce, tmp_path):
    from train_helpers import free_port, spawn_ranks

    spawn_ranks(_bias_worker, (free_port(), str(tmp_path), reduce), 2, 100)
    ranks = [torch.load(tmp_path / f"bias{r}.pt", weights_only=True) for r in range(2)]
    model = odd_model(moe=dict(ODD["moe"], bias_update_rate=0.01))
    one = _run_balancer(model, _global_batches(), LoadBalancer.of(model, model.config.moe, None))
    same_as_one = all(torch.equal(a, b) for a, b in zip(ranks[0], one)) and all(
        torch.equal(a, b) for a, b in zip(ranks[1], one)
    )
    assert any(b.abs().sum() > 0 for b in one)
    if reduce:
        assert same_as_one
    else:  # each rank moved its bias from its own half: not the global batch's update
        assert not same_as_one


# -- HF parity ------------------------------------------------------------------------------------

PARITY = {
    "interleaved-q-lora": {},
    "halves-no-q-lora": dict(mla=dict(q_lora_rank=None, rope_interleave=False)),
    "yarn": dict(yarn=dict(factor=4.0, original_max_seq_len=16, mscale=0.9, mscale_all_dim=0.8)),
}


@pytest.mark.parametrize("case", PARITY)
def test_logits_and_greedy_generation_match_hf_within_the_float64_bound(case):
    model = odd_model(**PARITY[case]).eval()
    hf = to_hf_model(model, attn_implementation="eager").eval()
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 300, (3, 11), generator=g)
    mask = torch.ones_like(ids)
    mask[2, :3] = 0  # left padding
    ids = ids.masked_fill(mask == 0, 0)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    keep = mask.bool()
    with torch.no_grad():
        ours = model(ids, mask, position_ids=pos).logits[keep]
        theirs = hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits[keep]
        exact = copy.deepcopy(model).double()
        with float64_throughout():
            ours64 = exact(ids, mask, position_ids=pos).logits[keep]
    # the bound: how far our fp32 logits lie from the float64 ones (tests/rounding.py); HF's fp32
    # logits must lie as close to the float64 value as a few of those roundings
    yard = max(FP32_ROUNDING, relative(ours, ours64))
    assert relative(theirs, ours64) <= FACTOR * yard, (relative(theirs, ours64), yard)
    prompt, pmask = ids[:2, :6], mask[:2, :6]
    want = hf.generate(input_ids=prompt, attention_mask=pmask, max_new_tokens=8, do_sample=False)
    assert generate(model, prompt, 8, attention_mask=pmask).tolist() == want.tolist()


# -- the planner's counts ------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["deepseek-v3", "moonlight-16b-a3b", "deepseek-v3-tiny"])
def test_parameter_counts_equal_transformers_meta_model(preset):
    cfg = tformer.build_config(preset)
    with torch.device("meta"):
        hf = transformers.DeepseekV3ForCausalLM(hf_config(cfg))
    assert num_parameters(cfg) == sum(p.numel() for p in hf.parameters())


def test_deepseek_v3_counts_are_the_published_ones():
    cfg = tformer.build_config("deepseek-v3")
    total = num_parameters(cfg)
    active = active_parameters(cfg, total)
    assert abs(total / 671e9 - 1) < 0.01  # 671.03B
    # 37.55B with the embedding and head (36.63B without the input embedding, a lookup): the paper's
    # "37B" is 1.5% below, the model card's "36.7B (including 0.9B embedding and 0.9B head)" 2.3%;
    # no stated convention explains either (docs/planning.md), so the 1% does not hold: 1.5% here
    assert abs(active / 37e9 - 1) < 0.015, active


# -- bad input -----------------------------------------------------------------------------------

BAD = [
    (dict(mla=dict(kv_lora_rank=40)), "model.mla.kv_lora_rank=40"),  # >= 3 x (6 + 5): not a compression
    (dict(mla=dict(qk_rope_head_dim=5)), "model.mla.qk_rope_head_dim=5"),  # rotary turns pairs
    (dict(mla=dict(q_lora_rank=40)), "model.mla.q_lora_rank=40"),
    (dict(moe=dict(ODD["moe"], n_group=4)), "model.moe.n_group=4"),
    (dict(moe=dict(ODD["moe"], topk_group=4)), "model.moe.topk_group=4"),
    (dict(moe=dict(ODD["moe"], router_score="softmax")), "router_score=sigmoid"),
    (dict(num_kv_heads=1), "num_kv_heads"),
    (dict(position="learned"), "position=rotary"),
]


@pytest.mark.parametrize("overrides,words", BAD, ids=[w for _, w in BAD])
def test_bad_input_is_one_line_naming_the_field(overrides, words):
    cfg = {**ODD, **overrides}
    if "mla" in overrides:
        cfg["mla"] = {**ODD["mla"], **overrides["mla"]}
    with pytest.raises(ConfigError) as e:
        tformer.build_config("deepseek-v3-tiny", **cfg)
    assert "\n" not in str(e.value) and words in str(e.value), str(e.value)


def test_router_choice_never_takes_gradient_from_the_bias():
    moe = _skewed_moe()
    moe.score_bias.requires_grad_(False)
    moe(torch.randn(2, 5, 16)).sum().backward()
    assert moe.score_bias.grad is None and moe.router.weight.grad is not None


# -- multi-token prediction ----------------------------------------------------------------------


def _mtp_targets_are_the_tokens_k_plus_1_ahead(model, ids) -> bool:
    """Depth k's labels at position t are the token at t + k + 1 (written out), -100 past the end."""
    labels = torch.cat((ids[:, 1:], torch.full_like(ids[:, :1], -100)), 1)  # the trunk's aligned labels
    seen = []
    with torch.no_grad():
        h = model.decoder(model.embed(ids, torch.arange(ids.shape[1])), positions=torch.arange(ids.shape[1]))
        model.mtp(h, ids, labels, model.embed.tok, lambda x, y: seen.append(y) or x.sum() * 0)
    b, s = ids.shape
    for k, got in enumerate(seen, start=1):
        want = [[ids[i, t + k + 1].item() if t + k + 1 < s else -100 for t in range(s)] for i in range(b)]
        if got.tolist() != want:
            return False
    return len(seen) == model.config.mtp_depth


def test_mtp_depths_predict_k_plus_1_ahead_and_a_label_one_short_is_caught(monkeypatch):
    model = odd_model(mtp_depth=2).train()
    ids = torch.randint(3, 300, (2, 10))
    assert _mtp_targets_are_the_tokens_k_plus_1_ahead(model, ids)
    from tformer.models import mtp

    monkeypatch.setattr(mtp, "mtp_labels", lambda labels, k, doc_ids=None: mtp.shift_left(labels, k - 1, -100))
    assert not _mtp_targets_are_the_tokens_k_plus_1_ahead(model, ids)


def test_mtp_loss_joins_the_training_loss_only_and_is_dropped_at_export():
    model = odd_model(mtp_depth=1, mtp_loss_coef=0.25, moe=dict(ODD["moe"], seq_aux_loss_coef=0.0))
    ids = torch.randint(3, 300, (2, 10))
    labels = torch.cat((ids[:, 1:], torch.full_like(ids[:, :1], -100)), 1)
    assert any(k.startswith("mtp.") for k in model.state_dict())  # kept in tformer's checkpoints
    train = model.train()(ids, labels=labels).loss
    mtp = model.mtp.stats["mtp_loss"]
    lm = model.eval()(ids, labels=labels).loss  # no dropout, no jitter: the same trunk
    assert torch.allclose(train, lm + 0.25 * mtp, atol=1e-6), (train, lm, mtp)
    hf = to_hf_model(model, attn_implementation="eager").eval()  # the MTP depth left out
    assert hf.config.num_mtp_layers == 0
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, hf(ids).logits, atol=1e-4)


def test_mtp_with_pipeline_parallelism_is_refused_in_one_line(tmp_path, monkeypatch):
    import torch.distributed as dist

    from tformer.train.config import load_config
    from tformer.train.trainer import Trainer
    from train_helpers import CONFIGS, small_overrides

    monkeypatch.setenv("WORLD_SIZE", "2")
    flags = small_overrides("deepseek-v3-tiny", tmp_path, "parallel.pp=2", "model.mla.kv_lora_rank=24")
    with pytest.raises(ConfigError) as err:
        Trainer(load_config(CONFIGS / "deepseek-v3-tiny.yaml", flags))
    assert "model.mtp_depth=1" in str(err.value) and "\n" not in str(err.value), str(err.value)
    assert not dist.is_initialized()


# -- the tiny recipe trains ----------------------------------------------------------------------


@pytest.mark.long
def test_tiny_recipe_loss_falls_and_logs_mtp_loss_and_routing(tmp_path):
    """200 fp32 steps of configs/deepseek-v3-tiny.yaml (at the suite's small sizes): the loss falls,
    mtp_loss and the routing figures are logged, the loss-free bias moved and is saved."""
    from tformer.train.config import load_config
    from tformer.train.trainer import Trainer
    from train_helpers import CONFIGS, metrics, small_overrides

    flags = small_overrides(
        "deepseek-v3-tiny", tmp_path, "max_steps=200", "log_every=20", "eval_every=0", "save_every=200",
        "model.mla.kv_lora_rank=24", "model.moe.d_expert=32",
    )  # fmt: skip
    trainer = Trainer(load_config(CONFIGS / "deepseek-v3-tiny.yaml", flags))
    trainer.fit()
    rows = metrics(tmp_path)
    first, last = rows[0], rows[-1]
    assert last["loss"] < first["loss"] - 1.0, (first["loss"], last["loss"])
    assert "mtp_loss" in last and last["mtp_loss"] < first["mtp_loss"]
    assert "moe/tokens_max_over_mean" in last
    biases = trainer.balancer.biases()
    assert biases and all(b.abs().max() > 0 for b in biases)
    saved = tformer.load_checkpoint(tmp_path)
    assert torch.equal(saved.decoder.layers[1].ffn.score_bias, trainer.model.decoder.layers[1].ffn.score_bias)


# -- tensor parallelism --------------------------------------------------------------------------

TP_MODEL = dict(num_heads=4, mtp_depth=1)


def _tp_batch():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 300, (2, 10), generator=g)
    return ids, torch.cat((ids[:, 1:], torch.full_like(ids[:, :1], -100)), 1)


def _loss_and_grads(model):
    ids, labels = _tp_batch()
    loss = model.train()(ids, labels=labels, return_logits=False).loss
    loss.backward()
    full = {}
    for name, p in model.named_parameters():
        g = p.grad
        full[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    return loss.detach(), full


def _tp_worker(rank, port, out):
    import datetime

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from tformer.parallel.tp import apply_tensor_parallel, loss_context

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60)
    )
    try:
        torch.set_num_threads(1)
        model = odd_model(**TP_MODEL)
        apply_tensor_parallel(model, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))["tp"])
        with loss_context(True):  # the vocabulary-parallel loss, as the trainer runs it
            loss, grads = _loss_and_grads(model)
        if rank == 0:
            torch.save({"loss": loss, **grads}, f"{out}/tp.pt")
    finally:
        dist.barrier()
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_mla_under_tensor_parallelism_equals_one_process(tmp_path):
    """tp=2 (latent down projections replicated, up projections column-wise, output row-wise; MoE
    and the MTP depth included): the loss and every parameter's gradient equal one process's within
    FACTOR times how far one process's fp32 values lie from float64 (tests/rounding.py). The
    replicated kv_down's gradient holds the rotary key's part, summed over the ranks' heads."""
    from train_helpers import free_port, spawn_ranks

    spawn_ranks(_tp_worker, (free_port(), str(tmp_path)), 2, 100)
    got = torch.load(tmp_path / "tp.pt", weights_only=True)
    loss, want = _loss_and_grads(odd_model(**TP_MODEL))
    exact = odd_model(**TP_MODEL).double()
    with float64_throughout():
        loss64, want64 = _loss_and_grads(exact)
    scale = max(g.abs().max().item() for g in want.values())
    yard = max(FP32_ROUNDING, relative(loss, loss64), *(relative(want[k], want64[k], 1e-3 * scale) for k in want))
    errs = {k: relative(got[k], want[k], 1e-3 * scale) for k in want}
    errs["loss"] = relative(got["loss"], loss)
    bad = {k: e for k, e in errs.items() if not e <= FACTOR * yard}
    assert not bad, (bad, yard)


@pytest.mark.parametrize("q_lora", [14, None])
def test_training_flops_with_mla_and_mtp_match_the_flop_counter(q_lora):
    from torch.utils.flop_counter import FlopCounterMode

    from tformer.models.flops import training_flops
    from tformer.nn.moe import Experts

    model = odd_model(mtp_depth=2, attn_impl="math", mla=dict(q_lora_rank=q_lora)).train()
    for module in model.modules():
        if isinstance(module, Experts):
            module.grouped = False  # the counter sees plain matmuls, not torch._grouped_mm
    ids = torch.randint(3, 300, (2, 12))
    with FlopCounterMode(display=False) as counter:
        model(ids, labels=ids).loss.backward()
    assert counter.get_total_flops() == training_flops(model.config, 2, 12, None)
