"""A mixture of experts' balancing and z-losses are those of one process at every layout: computed
over the micro-batch's whole sequences (``tformer/parallel/routing.py``), its real tokens only, and
with the data-parallel ranks' micro-batches those one process accumulates (``data/sampler.py``).

The layout runs are real trainer runs over 2 gloo processes on tiny models (fp32, test_mesh's worker
and deadlines: a group that overruns is killed and fails the test).
"""

from __future__ import annotations

import os

import pytest
import torch

import test_mesh
from test_mesh import _overrides, assert_same_run, reference, run_ranks
from tformer.config import MoEConfig
from tformer.nn.moe import (
    MoEFeedForward,
    load_balancing_loss,
    route,
    router_z_loss,
    routing_losses,
    routing_sums,
)
from tformer.parallel.context import padded_length, shard_seq
from tformer.parallel.routing import RoutingPool

E = 6


def _routing(tokens: int, k: int = 2, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(tokens, E, generator=gen) * 2).requires_grad_()
    cfg = MoEConfig(num_experts=E, top_k=k, router_softmax="all")
    return logits, route(logits, cfg, tokens)


def test_routing_sums_of_parts_add_up_to_the_whole():
    """The losses from sums over parts of a group (what each cp rank holds) equal the group's, and
    the HF-parity functions; padded tokens with weight 0 change neither value nor gradient."""
    logits, r = _routing(40)
    balance, z, counts = routing_losses(routing_sums(r.probs, r.logits, r.experts))
    torch.testing.assert_close(balance, load_balancing_loss(r.probs, r.experts, E))
    torch.testing.assert_close(z, router_z_loss(r.logits))
    assert counts.sum() == 40 * 2
    parts = [slice(0, 7), slice(7, 30), slice(30, 40)]
    pooled = sum(routing_sums(r.probs[p], r.logits[p], r.experts[p]) for p in parts)
    torch.testing.assert_close(routing_losses(pooled)[0], balance)
    (grad,) = torch.autograd.grad(balance + z, logits)

    padded = torch.cat((logits.detach(), torch.randn(5, E) * 2)).requires_grad_()
    rp = route(padded, MoEConfig(num_experts=E, top_k=2, router_softmax="all"), 45)
    weight = (torch.arange(45) < 40).float()
    b2, z2, _ = routing_losses(routing_sums(rp.probs, rp.logits, rp.experts, weight))
    torch.testing.assert_close(b2, balance)
    torch.testing.assert_close(z2, z)
    (grad2,) = torch.autograd.grad(b2 + z2, padded)
    torch.testing.assert_close(grad2[:40], grad)
    assert grad2[40:].abs().max() == 0


@pytest.mark.parametrize("cp,tp,length", [(2, 1, 61), (2, 2, 61), (3, 1, 50), (2, 1, 64), (1, 2, 61), (1, 3, 61)])
def test_real_tokens_are_those_the_layout_did_not_pad(cp, tp, length):
    """Each rank's mask marks exactly the positions of its shard that hold a token of the sequence
    (context.shard_seq of an unpadded sequence; sequence parallelism alone pads to a multiple of tp)."""
    padded = padded_length(length, cp, tp) if cp > 1 else -(-length // tp) * tp
    for rank in range(cp):
        shard = shard_seq(torch.arange(length)[None], rank, cp, pad_value=-1, tp=tp) if cp > 1 else None
        pool = RoutingPool(("input_ids",), cp, rank)
        pool.length = length
        real = pool.real_tokens(padded // cp, torch.device("cpu"))
        want = (shard[0] >= 0) if shard is not None else torch.arange(padded) < length
        assert torch.equal(real.bool(), want) if real is not None else bool(want.all()), (rank, real, want)
    if padded == length:
        assert real is None  # nothing padded: no mask at all


def test_a_layer_leaves_the_layout_pad_out_of_its_losses():
    """A training MoE layer with a pool (sequence parallelism's: no peers) on sequences padded at the
    end has the auxiliary loss, statistics and router gradient of the unpadded sequences."""
    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=E, top_k=2, aux_loss_coef=0.1, z_loss_coef=0.01)
    layer = MoEFeedForward(cfg, 16, 32, "swiglu").train()
    x = torch.randn(3, 13, 16)
    layer(x)
    want, stats = layer.aux_loss, layer.stats
    (grad,) = torch.autograd.grad(want, layer.router.weight)
    layer.pool_routing = pool = RoutingPool(("input_ids",))
    pool.length = 13
    layer(torch.cat((x, torch.randn(3, 3, 16)), 1))
    torch.testing.assert_close(layer.aux_loss, want)
    torch.testing.assert_close(layer.stats["tokens_max_over_mean"], stats["tokens_max_over_mean"])
    torch.testing.assert_close(torch.autograd.grad(layer.aux_loss, layer.router.weight)[0], grad)


# -- layouts against one process, the balancing loss on ---------------------------------------------

# Issue 38 measured (aux_loss_coef 0.05, 4 steps): Qwen2-MoE-tiny at seq 61 with cp=2 x ep=2 drifted
# 1.0e-4 from one process and Mixtral (6 experts) with ep=2 x dp_shard=2 7e-5 from one process
# accumulating 2 micro-batches; with these fixes both agree to ~1e-7.
MOE_FAMILIES = {
    # without its q/k/v biases: the key bias has no true gradient (see test_expert_parallel)
    "qwen2_moe_tiny": ("mixtral-tiny", ["model.preset=qwen2-moe-tiny", "model.qkv_bias=false"]),
    "mixtral6": ("mixtral-tiny", ["model.moe.num_experts=6"]),
}


@pytest.fixture
def moe_families(monkeypatch):
    """test_mesh's families with these two, for this test only (test_mesh's own list stays as it is)."""
    for name, entry in MOE_FAMILIES.items():
        monkeypatch.setitem(test_mesh.FAMILIES, name, entry)


AUX = ["model.moe.aux_loss_coef=0.1", "model.moe.z_loss_coef=0.01", "micro_batch_size=2"]
FSDP = "parallel.strategy=fsdp"
# (name, family, flags of both runs, the layout's flags, the 1-process run's grad_accum)
CASES = [
    # each rank holds half of every sequence (padded 61 -> 64) and half of the experts
    ("cp2-ep2", "qwen2_moe_tiny", ["data.seq_len=61"], [FSDP, "parallel.cp=2", "parallel.ep=2"], 1),
    # each rank routes its own micro-batches: those of one process accumulating twice as many
    ("ep2-dp2", "mixtral6", ["data.seq_len=32"], [FSDP, "parallel.ep=2", "grad_accum=2"], 4),
    # the MoE layers run on whole sequences padded 61 -> 62 on both TP ranks
    ("tp2-sp", "mixtral6", ["data.seq_len=61"], ["parallel.tp=2", "parallel.sp=true"], 1),
]


@pytest.mark.usefixtures("cache", "moe_families")
def test_moe_layouts_equal_one_process_with_the_balancing_loss_on(tmp_path_factory):
    """cp=2 x ep=2 at an odd length, ep=2 x dp_shard=2 and tp=2 with sequence parallelism at an odd
    length, 4 AdamW steps with the balancing and z-losses on: losses and updated parameters of
    the 1-process run (test_mesh.LAYOUT_FACTOR times its rounding yardstick)."""
    tmp = tmp_path_factory.mktemp("moe-layouts")
    jobs = []
    for name, family, common, layout, _ in CASES:
        recipe, overrides = _overrides(family, tmp / name, *AUX, *common, *layout)
        jobs.append((recipe, overrides, str(tmp / f"{name}.report")))
    run_ranks(2, jobs, os.environ["TFORMER_CACHE"])
    for name, family, common, _, accum in CASES:
        ref = reference(family, tmp_path_factory, accum, *AUX, *common)
        diff = assert_same_run(family, tmp / name, tmp / f"{name}.report", ref)
        print(f"{name}: max relative difference loss {diff[0]:.1e}, parameters {diff[1]:.1e}")
