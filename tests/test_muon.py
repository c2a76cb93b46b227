"""Muon (``optim.name: muon``, tformer/parallel/muon.py) on one process: bitwise torch.optim.Muon on
the blocks' matrices and torch.optim.AdamW on the rest, expert stacks as per-expert loops, Muon never
on embeddings, the head, norms, biases or the router; its config's one-line refusals."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tformer.config import ConfigError
from tformer.models import build_config, build_model
from tformer.nn.moe import Experts, MoEFeedForward
from tformer.parallel import muon as muon_mod
from tformer.parallel.muon import MuonAdamW, build_muon, muon_parameters
from tformer.parallel.newton_schulz import NS_COEFFICIENTS, iterate, newton_schulz, newton_schulz_flops
from tformer.train.config import OptimConfig, TrainConfig

ADJUST = {"match_adamw": "match_rms_adamw", "spectral": "original"}


def _optim(**muon) -> OptimConfig:
    cfg = OptimConfig(name="muon", lr=0.02, weight_decay=0.1)
    for k, v in {"ns_dtype": "bf16", **muon}.items():
        setattr(cfg.muon, k, v)
    return cfg


def _random_grads(params, gen):
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)


@pytest.mark.parametrize("adjust", ["match_adamw", "spectral"])
def test_one_process_is_bitwise_torch_muon_and_adamw(adjust):
    """A decoder's optimizer against torch.optim.Muon on the same matrices and torch.optim.AdamW
    (decay on matrices, none on the rest) on everything else, over 3 steps of random gradients."""
    torch.manual_seed(0)
    model = build_model(build_config("llama-tiny"))
    twin = build_model(build_config("llama-tiny"))
    twin.load_state_dict(model.state_dict())
    ours = build_muon(model, _optim(adjust=adjust), fused=False)
    names = {id(p): n for n, p in model.named_parameters()}
    muon_names = {names[id(p)] for p in muon_parameters(model)}
    tp = dict(twin.named_parameters())
    muon_t = [tp[n] for n in tp if n in muon_names]
    rest = [tp[n] for n in tp if n not in muon_names]
    torch_muon = torch.optim.Muon(muon_t, lr=0.02, weight_decay=0.1, adjust_lr_fn=ADJUST[adjust])
    torch_adamw = torch.optim.AdamW(
        [
            {"params": [p for p in rest if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=0.02,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=False,
    )
    for step in range(3):
        _random_grads(model.parameters(), torch.Generator().manual_seed(step))
        _random_grads(twin.parameters(), torch.Generator().manual_seed(step))
        ours.step()
        torch_muon.step()
        torch_adamw.step()
    for n, p in model.named_parameters():
        assert torch.equal(p, tp[n]), n
    assert len(muon_names) == 4 * 2 + 3 * 2  # q, k, v, o and gate, up, down in each of 2 blocks


def test_expert_stacks_equal_per_expert_loops():
    """A 3-D stack (E, out, in) steps as E separate matrices through torch.optim.Muon: bitwise."""
    gen = torch.Generator().manual_seed(1)
    stack = nn.Parameter(torch.randn(3, 12, 20, generator=gen))
    experts = [nn.Parameter(e.detach().clone()) for e in stack.unbind(0)]
    group = {"params": [stack], "muon": True, **muon_mod.muon_group_settings(_optim(adjust="spectral"))}
    ours = MuonAdamW([group], lr=0.02, betas=(0.9, 0.95), eps=1e-8, fused=False)
    theirs = torch.optim.Muon(experts, lr=0.02, weight_decay=0.1, adjust_lr_fn="original")
    for _ in range(3):
        g = torch.randn(stack.shape, generator=gen)
        stack.grad = g.clone()
        for e, ge in zip(experts, g.unbind(0)):
            e.grad = ge.clone()
        ours.step()
        theirs.step()
    assert torch.equal(stack.detach(), torch.stack([e.detach() for e in experts]))


def test_the_dtype_free_iteration_is_torchs_in_bf16():
    """``iterate`` (the fp32 path) is torch's arithmetic: in bf16 it is bitwise torch's function;
    in fp32 it lies within 8x of its float64 distance from float64's result."""
    gen = torch.Generator().manual_seed(2)
    for shape in ((16, 40), (40, 16), (24, 24)):
        g = torch.randn(shape, generator=gen)
        ref = torch.optim._muon._zeropower_via_newtonschulz(g, NS_COEFFICIENTS, 5, 1e-7)
        assert torch.equal(iterate(g, 5, torch.bfloat16), ref), shape
        assert torch.equal(newton_schulz(g, 5, torch.bfloat16), ref), shape
        exact = iterate(g.double(), 5, torch.float64)
        fp32 = iterate(g, 5, torch.float32)
        # the result's singular values are ~0.7-1.2 (not 1): compare to float64's own iteration
        assert (fp32.double() - exact).abs().max() < 1e-5, shape
    assert newton_schulz_flops((64, 256)) == 5 * (4 * 64 * 64 * 256 + 2 * 64**3)
    assert newton_schulz_flops((8, 64, 256)) == 8 * newton_schulz_flops((64, 256))


def check_muon_split(model: nn.Module, optimizer) -> None:
    """Muon takes exactly the blocks' linear weights (not the router, the shared gate) and the
    expert stacks; embeddings, the head, norms and biases stay with AdamW."""
    muon_ids = {id(p) for g in optimizer.param_groups if g["muon"] for p in g["params"]}
    adamw_ids = {id(p) for g in optimizer.param_groups if not g["muon"] for p in g["params"]}
    assert not muon_ids & adamw_ids
    assert muon_ids | adamw_ids == {id(p) for p in model.parameters()}
    for name, module in model.named_modules():
        own = [(n, p) for n, p in module.named_parameters(recurse=False)]
        for n, p in own:
            where = f"{name}.{n}"
            if isinstance(module, nn.Embedding) or name.startswith(("lm_head", "head", "embed")):
                assert id(p) not in muon_ids, where
            elif p.dim() < 2 or ".router" in where or "shared_gate" in where:
                assert id(p) not in muon_ids, where
            elif isinstance(module, (nn.Linear, Experts)):
                assert id(p) in muon_ids, where


@pytest.mark.parametrize("preset", ["gpt2-tiny", "bert-tiny", "t5-tiny", "mixtral-tiny", "qwen2-moe-tiny"])
def test_muon_takes_only_the_blocks_matrices(preset):
    model = build_model(build_config(preset))
    check_muon_split(model, build_muon(model, _optim(), fused=False))
    assert any(isinstance(m, MoEFeedForward) for m in model.modules()) == ("moe" in preset or "mixtral" in preset)


def test_muon_on_the_embedding_is_caught(monkeypatch):
    """Planted defect: every matrix given to Muon (embeddings and head too) fails the split check."""
    model = build_model(build_config("gpt2-tiny"))
    monkeypatch.setattr(muon_mod, "muon_parameters", lambda m: [p for p in m.parameters() if p.dim() == 2])
    with pytest.raises(AssertionError, match="embed"):
        check_muon_split(model, build_muon(model, _optim(), fused=False))


def test_a_non_finite_step_on_the_device_leaves_everything():
    """``found_inf`` set (the trainer's step that never reads the host): weights and buffers stay."""
    model = build_model(build_config("gpt2-tiny"))
    opt = build_muon(model, _optim(ns_dtype="fp32"), fused=True)
    _random_grads(model.parameters(), torch.Generator().manual_seed(0))
    opt.step()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    bufs = {id(p): s["momentum_buffer"].clone() for p, s in opt.state.items() if "momentum_buffer" in s}
    _random_grads(model.parameters(), torch.Generator().manual_seed(1))
    next(iter(muon_parameters(model))).grad[0, 0] = float("nan")
    opt.found_inf = torch.ones(())
    opt.step()
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    for p, s in opt.state.items():
        if "momentum_buffer" in s:
            assert torch.equal(s["momentum_buffer"], bufs[id(p)])


@pytest.mark.parametrize(
    "flags,needle",
    [
        ({"optim": {"name": "sgd"}}, "optim.name='sgd' is not allowed"),
        ({"optim": {"name": "muon", "muon": {"adjust": "rms"}}}, "optim.muon.adjust='rms' is not allowed"),
        ({"optim": {"name": "muon", "muon": {"momentum": 1.0}}}, "optim.muon.momentum=1.0 must be in [0, 1)"),
        ({"optim": {"name": "muon"}, "parallel": {"strategy": "deepspeed"}}, "optim.name=muon does not run under"),
        ({"optim": {"muon": {"qk_clip": 50}}}, "optim.muon.qk_clip=50.0 is Muon's"),
    ],
)
def test_bad_muon_config_is_one_line(flags, needle):
    from tformer.train.config import _build

    with pytest.raises(ConfigError) as err:
        _build(TrainConfig, flags, "")
    assert needle in str(err.value) and "\n" not in str(err.value)


def _run(out, *flags):
    from train_helpers import CONFIGS, small_overrides

    from tformer.train.config import load_config
    from tformer.train.trainer import Trainer

    overrides = small_overrides("gpt2-tiny", out, "eval_every=0", "micro_batch_size=4", "model.dropout=0.0", *flags)
    trainer = Trainer(load_config(CONFIGS / "gpt2-tiny.yaml", overrides))
    trainer.fit()
    return trainer


MUON = ["optim.name=muon", "optim.muon.ns_dtype=fp32", "optim.lr=3e-3"]


@pytest.mark.usefixtures("cache")
def test_resume_is_exact_and_a_switch_of_optimizer_is_refused(tmp_path):
    """Muon's momentum is optimizer state: a run resumed at step 2 has the uninterrupted run's
    losses and weights bitwise (QK-clip on, its maximum logged at every logged step). Resuming an
    AdamW checkpoint with optim.name=muon is one line, even under resume_changes=allow."""
    from train_helpers import losses

    from train_helpers import metrics

    clip = "optim.muon.qk_clip=0.1"  # below gpt2-tiny's largest logits (0.11-0.14): every step clips
    straight = _run(tmp_path / "straight", "max_steps=4", "save_every=2", *MUON, clip)
    ckpt = tmp_path / "straight" / "checkpoints" / "step_00000002"
    resumed = _run(tmp_path / "resumed", "max_steps=4", "save_every=2", f"resume={ckpt}", *MUON, clip)
    want, got = losses(tmp_path / "straight"), losses(tmp_path / "resumed")
    assert all(r["max_logit"] > 0.1 for r in metrics(tmp_path / "straight")), "the clip's maximum is logged"
    assert list(got) == [3, 4] and all(got[s] == want[s] for s in got), (got, want)
    for (k, v), w in zip(resumed.model.state_dict().items(), straight.model.state_dict().values()):
        assert torch.equal(v, w), k
    buffers = [s["momentum_buffer"] for s in resumed.optimizer.state.values() if "momentum_buffer" in s]
    assert len(buffers) == 12 and all(b.abs().sum() > 0 for b in buffers)

    _run(tmp_path / "adamw", "max_steps=2", "save_every=2")
    adamw_ckpt = tmp_path / "adamw" / "checkpoints" / "step_00000002"
    with pytest.raises(ConfigError) as err:
        _run(tmp_path / "switch", "max_steps=4", f"resume={adamw_ckpt}", "resume_changes=allow", *MUON)
    assert "would switch optim.name adamw -> muon" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("causal", [True, False])
def test_qk_clips_maxima_are_over_the_pairs_attention_sees(causal):
    """A head's largest logit counts only the pairs its softmax takes: inside the window (causal: the
    3 keys up to the query; bidirectional: 1 either side) and the query's own document, written
    out pair by pair; the same maxima over every pair lie higher (what a window-blind count clips)."""
    from tformer.nn import DocumentMask
    from tformer.nn.attention import head_max_logits

    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 9, 8, generator=gen), torch.randn(2, 2, 9, 8, generator=gen)
    docs = torch.tensor([[0] * 5 + [1] * 4, [0] * 9])
    window = 3 if causal else 2
    got = head_max_logits(q, k, 0.5, causal, None, DocumentMask(docs), window)
    want = torch.full((4,), float("-inf"))
    for b in range(2):
        for h in range(4):
            for i in range(9):
                for j in range(9):
                    d = i - j
                    if docs[b, i] != docs[b, j] or (causal and not 0 <= d < 3) or (not causal and abs(d) > 1):
                        continue
                    want[h] = max(want[h], float(q[b, h, i] @ k[b, h // 2, j]) * 0.5)
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6), (got, want)
    blind = head_max_logits(q, k, 0.5, causal, None)
    assert (blind > want + 0.1).any(), (blind, want)


def test_qk_clip_of_latent_attention_rescales_one_head_and_leaves_the_shared_rotary_key():
    """MLA (DeepSeek-V3's shape; Kimi K2's): head 1 of the first block forced above TAU is clipped to
    TAU; only its rows move (its q_nope and k_nope rows by sqrt(gamma), its q_rope rows by gamma,
    its value rows not at all); the latent and the rotary key all heads share (kv_down) stay."""
    from tformer.parallel.qk_clip import QKClip

    torch.manual_seed(0)
    model = build_model(build_config("deepseek-v3-tiny", dropout=0.0, mtp_depth=0)).train()
    clip = QKClip(model, tau=1e9)
    ids = torch.randint(0, 1000, (2, 24))
    attn = clip.layers[0]
    q_rows = attn.q_up if attn.q_up is not None else attn.q_proj
    width, kv_width = attn.nope + attn.rope, attn.nope + attn.d_v
    model(ids)
    with torch.no_grad():  # head 1's queries 20x: its logits 20x
        q_rows.weight[width : 2 * width] *= 20
    attn.max_logit = clip._fresh(attn)
    model(ids)
    forced = attn.max_logit.clone()
    tau = float(forced[1]) / 4
    clip.tau = tau
    others = [h for h in range(forced.shape[0]) if h != 1]
    assert (forced[others] < tau).all(), (forced, tau)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    clip()
    gamma = tau / float(forced[1])
    model(ids)
    assert abs(float(attn.max_logit[1]) - tau) <= 1e-5 * tau, (attn.max_logit, tau)
    assert torch.equal(attn.max_logit[others], forced[others])
    after = model.state_dict()
    prefix = "decoder.layers.0.attn."
    for k, v in after.items():
        if k not in (prefix + "q_up.weight", prefix + "q_proj.weight", prefix + "kv_up.weight"):
            assert torch.equal(v, before[k]), k
    q_key = prefix + ("q_up.weight" if attn.q_up is not None else "q_proj.weight")
    head_q, was_q = after[q_key][width : 2 * width], before[q_key][width : 2 * width]
    torch.testing.assert_close(head_q[: attn.nope], was_q[: attn.nope] * gamma**0.5, rtol=1e-6, atol=0)
    torch.testing.assert_close(head_q[attn.nope :], was_q[attn.nope :] * gamma, rtol=1e-6, atol=0)
    kv, was_kv = after[prefix + "kv_up.weight"], before[prefix + "kv_up.weight"]
    torch.testing.assert_close(kv[kv_width : kv_width + attn.nope], was_kv[kv_width : kv_width + attn.nope] * gamma**0.5)
    assert torch.equal(kv[kv_width + attn.nope : 2 * kv_width], was_kv[kv_width + attn.nope : 2 * kv_width])  # values
    keep = torch.ones(kv.shape[0], dtype=torch.bool)
    keep[kv_width : kv_width + attn.nope] = False
    assert torch.equal(kv[keep], was_kv[keep])


@pytest.mark.parametrize("preset", ["gpt2-tiny", "llama-tiny"])  # MHA with q/k biases; GQA (4 heads over 2)
def test_qk_clip_rescales_the_head_above_tau_to_tau_and_nothing_else(preset):
    """Head 1 of the first block forced far above TAU: after the clip its largest logit on the same
    batch is TAU (fp32 rounding of the factors: 1e-5 relative); every other parameter (the other
    heads' q/k rows, v, o, FFN, embeddings, the other block) is bitwise as it was."""
    from tformer.parallel.qk_clip import QKClip

    torch.manual_seed(0)
    model = build_model(build_config(preset, dropout=0.0)).train()
    clip = QKClip(model, tau=1e9)
    ids = torch.randint(0, 1000, (2, 24))
    attn = clip.layers[0]
    d = attn.d_k
    model(ids)
    natural = attn.max_logit.clone()
    tau = float(natural.max()) * 2
    clip.tau = tau
    with torch.no_grad():  # head 1's queries 20x: its logits 20x, far above TAU
        attn.q_proj.weight[d : 2 * d] *= 20
        if attn.q_proj.bias is not None:
            attn.q_proj.bias[d : 2 * d] *= 20
    clip.layers[0].max_logit = clip._fresh(attn)
    model(ids)
    forced = attn.max_logit.clone()
    assert forced[1] > tau and (forced[[0, 2, 3]] < tau).all()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    clip()
    assert float(clip.last_max) == float(forced.max())
    model(ids)
    after = attn.max_logit
    assert abs(float(after[1]) - tau) <= 1e-5 * tau, (after, tau)
    assert torch.equal(after[[0, 2, 3]], forced[[0, 2, 3]])
    for k, v in model.state_dict().items():
        head = k.startswith("decoder.layers.0.attn.") and k.split(".")[-2] in ("q_proj", "k_proj")
        if not head:
            assert torch.equal(v, before[k]), k
            continue
        rows = slice(d, 2 * d) if attn.num_kv_heads == attn.num_heads or "q_proj" in k else slice(0, 0)
        keep = torch.ones(v.shape[0], dtype=torch.bool)
        keep[rows] = False
        assert torch.equal(v[keep], before[k][keep]), k
        assert rows.stop == 0 or k.endswith("bias") or not torch.equal(v[rows], before[k][rows]), k


def test_the_planner_prices_muons_states_and_newton_schulz():
    """plan/optimizer.py: Muon's parameters are those the optimizer takes; its FLOPs the sum over
    them; FSDP2 over 2 ranks halves the Newton-Schulz time (owners) and pays the traffic, DDP none."""
    from tformer.plan.hardware import profile
    from tformer.plan.layout import Layout
    from tformer.plan.optimizer import memory_line, muon_cost, muon_shapes

    cfg = build_config("mixtral-tiny")
    model = build_model(cfg)
    shapes = muon_shapes(cfg)
    assert sorted(shapes) == sorted(tuple(p.shape) for p in muon_parameters(model))
    hw = profile("h100-sxm")
    fsdp = muon_cost(cfg, Layout(strategy="fsdp", dp_shard=2), hw)
    ddp = muon_cost(cfg, Layout(strategy="ddp", dp_shard=2), hw)
    assert fsdp.flops == ddp.flops == sum(newton_schulz_flops(s) for s in shapes)
    assert fsdp.seconds == pytest.approx(ddp.seconds / 2) and ddp.comm_seconds == 0 < fsdp.comm_seconds
    assert fsdp.state_saving == 4 * fsdp.params / 2
    assert "momentum buffer" in memory_line(cfg, model.num_parameters(), 2, "fsdp")


def test_the_planners_muon_host_ops_leave_the_iterations_to_newton_schulzs_time():
    """Muon's host term counts the ops of its loop outside Newton-Schulz's iterations (the
    iterations' products are priced with their dispatch in ``_ns_seconds``): a real step's ops are
    those plus ``ns_steps`` iterations' own ops, neither counted twice nor left out; the plan's time
    line gives the optimizer's share of the step."""
    from tformer.parallel.newton_schulz import iterate
    from tformer.plan.hardware import profile
    from tformer.plan.host import _counting_mode
    from tformer.plan.layout import Layout
    from tformer.plan.optimizer import _count_step_ops, muon_ops_per_matrix, time_line

    def iteration_ops(steps: int) -> int:
        mode = _counting_mode()
        with mode:
            iterate(torch.ones(4, 8), steps, torch.float32)
        return mode.total

    per_iteration = iteration_ops(2) - iteration_ops(1)
    assert per_iteration >= 3  # the Gram matrix, its polynomial, the product with X
    per_matrix = (_count_step_ops(5, 8) - _count_step_ops(5, 4)) / 4
    assert per_matrix == muon_ops_per_matrix() + 5 * per_iteration
    line = time_line(build_config("llama-tiny"), Layout(strategy="fsdp", dp_shard=2), profile("h100-sxm"), 0.1, 5, "auto")
    assert "of the step (Newton-Schulz" in line, line


def test_float8_layers_keep_muons_matrices_and_step():
    """precision=fp8's conversion (torchao's Float8Linear in the blocks, tformer/parallel/float8.py)
    leaves Muon's split as it was (a converted layer is still an ``nn.Linear``, its weight the same
    parameter name), and the optimizer's step on the converted model is bitwise the unconverted
    model's for the same gradients: the optimizer sees parameters, not the layers' arithmetic."""
    pytest.importorskip("torchao.float8")
    from tformer.parallel.config import Float8Config
    from tformer.parallel.float8 import convert_to_float8

    torch.manual_seed(0)
    model = build_model(build_config("qwen2-moe-tiny"))
    twin = build_model(build_config("qwen2-moe-tiny"))
    twin.load_state_dict(model.state_dict())
    converted = convert_to_float8(model, Float8Config(), torch.device("cpu"))
    names = lambda m: {n for n, p in m.named_parameters() if any(p is q for q in muon_parameters(m))}  # noqa: E731
    assert names(model) == names(twin) and {f"{c}.weight" for c in converted} <= names(model)
    opts = [build_muon(m, _optim(ns_dtype="fp32"), fused=False) for m in (model, twin)]
    for step in range(2):
        for m, opt in zip((model, twin), opts):
            _random_grads(m.parameters(), torch.Generator().manual_seed(step))
            opt.step()
    twin_state = twin.state_dict()
    for k, v in model.state_dict().items():
        assert torch.equal(v, twin_state[k]), k
