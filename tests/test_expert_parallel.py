"""Expert parallelism (``parallel.ep``): the Mixtral-like, Qwen2-MoE-like and Switch models trained
with their experts split over 2 ranks (and FSDP2 over what EP leaves, on 4) equal the 1-process run
of the same global batch; a checkpoint reshards across a change of ep; bad layouts are one line.

Runs are real trainer runs over gloo processes on tiny models (fp32, test_mesh's worker and
deadlines: every spawned group fails the test when it overruns and is killed).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from tformer.config import ConfigError

import test_mesh
from rounding import FACTOR, FP32_ROUNDING, float64_throughout, relative
from test_mesh import _overrides, _resume, assert_same_run, loss_bound, reference, run_ranks
from train_helpers import CONFIGS, losses, small_overrides

# MoE flavours for test_mesh's runner, by name: (recipe, overrides). Eight experts, so ep=2 gives
# each rank four; seq 32 keeps the 4-rank runs short. Switch routes top-1 with capacity per sequence.
MOE_FAMILIES = {
    "mixtral": ("mixtral-tiny", ["data.seq_len=32"]),
    # without its q/k/v biases: the key bias has no true gradient and Adam walks it on round-off
    # further than test_mesh's check of it allows at this recipe's learning rate
    "qwen2_moe": ("mixtral-tiny", ["model.preset=qwen2-moe-tiny", "model.qkv_bias=false", "data.seq_len=32"]),
    "switch": ("switch-tiny", ["data.seq_len=32", "model.moe.expert_capacity=6"]),
}
FSDP = ["parallel.strategy=fsdp"]
# One sequence per micro-batch, global batch 8 on every layout. The balancing loss is not linear in
# the tokens it averages over, so the 1-process run must accumulate the very micro-batches the ranks
# see: rank r's micro-batch j is the global batch's j x world + r at any micro-batch size
# (tformer/data/sampler.py; tests/test_moe_layouts.py runs micro-batches of 2).
ONE = "micro_batch_size=1"


@pytest.fixture(scope="module", autouse=True)
def moe_families():
    """test_mesh's reference runs and overrides know these by name while this module runs; its own
    list is left as it was (module scope: mesh4_runs needs them too)."""
    with pytest.MonkeyPatch.context() as patch:
        for name, entry in MOE_FAMILIES.items():
            patch.setitem(test_mesh.FAMILIES, name, entry)
        yield


def _reference(name, tmp_path_factory):
    return reference(name, tmp_path_factory, 8, ONE)


def _jobs(tmp, world, *world_flags):
    jobs = []
    for i, name in enumerate(MOE_FAMILIES):
        recipe, overrides = _overrides(name, tmp / f"run{i}", *FSDP, ONE, f"grad_accum={8 // world}", *world_flags)
        jobs.append((recipe, overrides, str(tmp / f"report{i}")))
    return jobs


def _expert_counts(report, world, ep, dp_mod_ep):
    """Each rank holds 1/ep of every expert stack, FSDP2 cuts that over dp_mod_ep."""
    import json
    from pathlib import Path

    for rank in range(world):
        counts = json.loads(Path(f"{report}.rank{rank}.json").read_text())
        stacks = {n: c for n, c in counts.items() if ".experts." in n}
        assert stacks, counts
        for n, (local, total) in stacks.items():
            assert local == total // (ep * dp_mod_ep), (n, rank, local, total)


@pytest.mark.slow
@pytest.mark.usefixtures("cache")
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.long)])  # ep2 x dp2: long lane
def test_ep2_equals_the_single_process_run(world, tmp_path_factory):
    """parallel.ep=2 on 2 ranks (each routes its own micro-batches, holds four of eight experts) and
    on 4 (ep borrowed from dp_shard=4: experts split over 2 and FSDP2-sharded over the other 2,
    every other weight over all 4): losses and updated parameters of 1 process accumulating the
    same micro-batches (test_mesh.LAYOUT_FACTOR times the reference's rounding yardstick)."""
    tmp = tmp_path_factory.mktemp(f"ep2-world{world}")
    run_ranks(world, _jobs(tmp, world, "parallel.ep=2"), os.environ["TFORMER_CACHE"])
    for i, name in enumerate(MOE_FAMILIES):
        assert_same_run(name, tmp / f"run{i}", tmp / f"report{i}", _reference(name, tmp_path_factory))
        _expert_counts(tmp / f"report{i}", world, 2, world // 2)


@pytest.mark.slow
@pytest.mark.usefixtures("cache")
def test_resume_across_ep(tmp_path, tmp_path_factory):
    """An ep=2 checkpoint (expert stacks as DTensor shards over 2 ranks) resumes on one process:
    steps 3 and 4 have the uninterrupted 1-process run's losses (test_mesh.loss_bound)."""
    from tformer.train.config import load_config
    from tformer.train.trainer import Trainer

    recipe, ep2 = _overrides("mixtral", tmp_path / "ep2", *FSDP, ONE, "grad_accum=4", "save_every=2", "parallel.ep=2")
    run_ranks(2, [(recipe, ep2, None)], os.environ["TFORMER_CACHE"])
    ckpt = tmp_path / "ep2" / "checkpoints" / "step_00000002"
    Trainer(
        load_config(CONFIGS / f"{recipe}.yaml", _resume("mixtral", tmp_path / "one", ckpt, ONE, "grad_accum=8")[1])
    ).fit()
    ref = _reference("mixtral", tmp_path_factory)
    base, bound = ref.losses, loss_bound(ref)
    got = losses(tmp_path / "one")
    assert list(got) == [3, 4]
    for step in got:
        assert abs(got[step] - base[step]) / base[step] <= bound, (step, got, base, bound)


@pytest.mark.slow
@pytest.mark.usefixtures("cache")
def test_pp2_counts_every_stages_auxiliary_loss(tmp_path_factory):
    """Mixtral-like at parallel.pp=2 (one MoE block per stage): the first stage's balancing loss
    joins the backward and the logged loss, so losses and parameters equal 1 process's (test_mesh.LAYOUT_FACTOR).
    With only the last stage's counted, the router of block 0 missed its gradient."""
    tmp = tmp_path_factory.mktemp("pp2moe")
    recipe, overrides = _overrides("mixtral", tmp / "run", "grad_accum=2", "parallel.pp=2", "model.moe.aux_loss_coef=0.5")
    run_ranks(2, [(recipe, overrides, str(tmp / "report"))], os.environ["TFORMER_CACHE"])
    assert_same_run(
        "mixtral", tmp / "run", tmp / "report", reference("mixtral", tmp_path_factory, 2, "model.moe.aux_loss_coef=0.5")
    )


# -- expert parallelism with a pipeline and with tensor parallelism; resharding ep 1 -> 4 ---------------

# tp=2 alone on 2 ranks: the MoE FFNs run whole on both TP ranks (on the whole sequence under SP),
# attention and dense FFNs split as usual. (family, flags, the reference's extra flags)
TP2_CASES = [
    ("mixtral", ["parallel.sp=true"], []),
    ("mixtral", ["parallel.sp=false"], []),
    # a shared expert and its gate; block 0 dense (its FFN TP-split), block 1 MoE
    ("qwen2_moe", ["parallel.sp=true", "model.moe.moe_every=2"], ["model.moe.moe_every=2"]),
    ("switch", ["parallel.sp=true"], []),  # capacity per whole sequence, cross-attention, dense block 0
]
# on 4 ranks, FSDP2, one sequence per micro-batch and global batch 8 as above: name -> flags
MESH4 = {
    "ep2-pp2": ["parallel.ep=2", "parallel.pp=2", "grad_accum=4"],  # ep over each stage's dp_shard=2
    "ep2-tp2": ["parallel.ep=2", "parallel.tp=2", "parallel.sp=true", "grad_accum=4"],  # ep: same tp index
}


def _counts(report, rank):
    import json
    from pathlib import Path

    return json.loads(Path(f"{report}.rank{rank}.json").read_text())


@pytest.mark.long  # CI: ep2 x tp2 (MESH4), whose tp ranks hold the experts the same way
@pytest.mark.usefixtures("cache")
def test_tp2_runs_moe_ffns_whole_on_every_tp_rank(tmp_path_factory):
    """parallel.tp=2 on a MoE model, with and without sequence parallelism: routing, capacity groups
    and auxiliary losses are the unsplit model's, so losses and updated parameters equal 1 process
    accumulating the same micro-batches (test_mesh.LAYOUT_FACTOR); each rank holds half of q/k/v and the dense FFN,
    and the whole router, experts and shared expert."""
    tmp = tmp_path_factory.mktemp("moe-tp2")
    jobs = []
    for i, (name, flags, _) in enumerate(TP2_CASES):
        recipe, overrides = _overrides(name, tmp / f"run{i}", ONE, "grad_accum=8", "parallel.tp=2", *flags)
        jobs.append((recipe, overrides, str(tmp / f"report{i}")))
    run_ranks(2, jobs, os.environ["TFORMER_CACHE"])
    for i, (name, flags, ref_flags) in enumerate(TP2_CASES):
        ref = reference(name, tmp_path_factory, 8, ONE, *ref_flags)
        diff = assert_same_run(name, tmp / f"run{i}", tmp / f"report{i}", ref)
        print(f"tp=2 {name} {flags}: max relative difference loss {diff[0]:.1e}, parameters {diff[1]:.1e}")
        for rank in range(2):
            counts = _counts(tmp / f"report{i}", rank)
            assert any(".ffn.up." in n for n in counts) == (name != "mixtral"), counts  # a dense block 0
            for n, (local, total) in counts.items():
                if n.endswith(("q_proj.weight", "k_proj.weight", "ffn.up.weight", "ffn.down.weight")):
                    assert local == total // 2, (n, local, total)
                elif any(part in n for part in (".router.", ".experts.", ".shared.", ".shared_gate.")):
                    assert local == total, (n, local, total)


@pytest.fixture(scope="module")
def mesh4_runs(request, tmp_path_factory):
    """One 4-rank group: ep=2 x pp=2, ep=2 x tp=2 (x dp_shard=2), and a 1-process checkpoint (step 2)
    resumed at ep=4 x dp_shard=4. Returns the directory and the 1-process run's losses."""
    from tformer.train.config import load_config
    from tformer.train.trainer import Trainer

    request.getfixturevalue("cache")
    tmp = tmp_path_factory.mktemp("moe-mesh4")
    recipe, one = _overrides("mixtral", tmp / "one", ONE, "grad_accum=8", "save_every=2")
    Trainer(load_config(CONFIGS / f"{recipe}.yaml", one)).fit()
    ckpt = tmp / "one" / "checkpoints" / "step_00000002"
    jobs = [
        (recipe, _overrides("mixtral", tmp / name, *FSDP, ONE, *flags)[1], str(tmp / f"{name}.report"))
        for name, flags in MESH4.items()
    ]
    ep4 = _resume("mixtral", tmp / "ep4", ckpt, *FSDP, ONE, "grad_accum=2", "parallel.ep=4")[1]
    run_ranks(4, [*jobs, (recipe, ep4, None)], os.environ["TFORMER_CACHE"])
    return tmp, losses(tmp / "one")


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MESH4))
def test_ep2_with_a_pipeline_or_tensor_parallelism_equals_one_process(name, mesh4_runs, tmp_path_factory):
    """ep=2 x pp=2: each stage's experts split over its two data-parallel ranks, the first stage's
    auxiliary loss through the stage hook. ep=2 x tp=2: ep groups are the dp ranks with the same
    TP index, each TP rank of a group exchanges the same rows. Losses and updated parameters equal
    1 process accumulating the same micro-batches (test_mesh.LAYOUT_FACTOR); every rank holds half of each expert stack
    of its stage (dp_shard_mod_ep is 1), under TP the whole router (FSDP2-sharded over dp_shard=2)
    and half of q."""
    tmp = mesh4_runs[0]
    report = tmp / f"{name}.report"
    diff = assert_same_run("mixtral", tmp / name, report, _reference("mixtral", tmp_path_factory))
    print(f"{name}: max relative difference loss {diff[0]:.1e}, parameters {diff[1]:.1e}")
    _expert_counts(report, 4, 2, 1)
    if name == "ep2-tp2":
        for rank in range(4):
            for n, (local, total) in _counts(report, rank).items():
                if n.endswith(("router.weight", "q_proj.weight")):
                    assert local == total // (2 if "router" in n else 4), (n, local, total)


@pytest.mark.slow
def test_resume_from_one_process_at_ep4(mesh4_runs, tmp_path_factory):
    """A 1-process checkpoint (whole expert stacks) resumed at ep=4 x dp_shard=4 (two of eight
    experts per rank): steps 3 and 4 have the uninterrupted run's losses (test_mesh.loss_bound of
    the same 1-process run without its checkpoints)."""
    tmp, base = mesh4_runs
    bound = loss_bound(_reference("mixtral", tmp_path_factory))
    got = losses(tmp / "ep4")
    assert list(got) == [3, 4]
    for step in got:
        assert abs(got[step] - base[step]) / base[step] <= bound, (step, got, base, bound)
    print("ep 1 -> 4: max relative loss difference", max(abs(got[s] - base[s]) / abs(base[s]) for s in got))


@pytest.mark.parametrize(
    "world,recipe,flags,needle",
    [
        (
            4,
            "mixtral-tiny",
            ["parallel.ep=4", "model.moe.num_experts=6"],
            "model.moe.num_experts=6 is not divisible by parallel.ep=4",
        ),
        (
            2,
            "mixtral-tiny",
            ["parallel.ep=4"],
            "parallel.ep=4 must be a multiple of parallel.cp=1 that divides parallel.dp_shard",
        ),
        (
            4,
            "mixtral-tiny",
            ["parallel.ep=4", "parallel.dp_shard=2", "parallel.dp_replicate=2", *FSDP],
            "divides parallel.dp_shard",
        ),
        (2, "mixtral-tiny", ["parallel.ep=2"], "parallel.ep=2 does not run with parallel.strategy=ddp"),
        (2, "switch-tiny", ["parallel.strategy=deepspeed"], "model.moe does not run with parallel.strategy=deepspeed"),
        (2, "gpt2-tiny", ["parallel.ep=2", *FSDP], "parallel.ep=2 needs a mixture-of-experts model"),
        (1, "mixtral-tiny", ["model.moe.top_k=9"], "model.moe.top_k=9 must be in [1, num_experts=8]"),
        (
            1,
            "switch-tiny",
            ["model.moe.expert_capacity=null", "model.moe.capacity_factor=0"],
            "model.moe.capacity_factor=0 must be > 0",
        ),
    ],
)
def test_bad_moe_layout_is_one_line_before_any_process_group(tmp_path, monkeypatch, world, recipe, flags, needle):
    import torch.distributed as dist

    from tformer.train.config import load_config
    from tformer.train.trainer import Trainer

    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(ConfigError) as err:
        Trainer(load_config(CONFIGS / f"{recipe}.yaml", small_overrides(recipe, tmp_path, *flags)))
    assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)
    assert not dist.is_initialized()
    assert not (tmp_path / "checkpoints").exists()


def test_moe_export_to_a_family_without_an_hf_twin_is_one_line():
    """BERT with MoE FFNs: refused from the config alone, before any tensor is converted."""
    import tformer
    from tformer.export.hf import ExportError, to_hf_state

    cfg = tformer.build_config("bert-tiny", moe={"num_experts": 4, "top_k": 2})
    with pytest.raises(ExportError) as err:
        to_hf_state(cfg, {})
    msg = str(err.value)
    assert "moe=(num_experts=4)" in msg and "mixtral" in msg and "\n" not in msg, msg


def test_mesh_arithmetic_with_ep():
    from tformer.parallel.mesh import ParallelDims

    dims = ParallelDims.resolve(8, dp_shard=-1, cp=2, ep=4)
    assert (dims.dp_shard, dims.cp, dims.ep, dims.dp_size) == (4, 2, 4, 4)  # ep: 2 dp_shard ranks x cp
    assert "ep=4" in dims.describe()
    with pytest.raises(ConfigError, match="multiple of parallel.cp=2"):
        ParallelDims.resolve(8, cp=2, ep=3)
    assert ParallelDims.resolve(4, ep=1).ep == 1


def test_expert_exchange_equals_local_experts_forward_and_backward(tmp_path):
    """The all-to-all exchange on 2 gloo ranks, uneven routing (some experts get no row from a
    rank): outputs and input gradients equal the local experts', expert gradients the sum of
    both ranks' local ones, each within rounding.FACTOR times how far the local experts' fp32
    result lies from the same in float64 (tests/rounding.py)."""
    from train_helpers import free_port, spawn_ranks

    spawn_ranks(_exchange_worker, (free_port(), str(tmp_path)), 2, 300)
    for rank in range(2):
        errs = torch.load(tmp_path / f"err{rank}.pt", weights_only=True)
        # every error checked: max() passes a NaN that is not first (NaN < x and NaN > x are both False)
        assert len(errs) == 5, errs
        bad = {k: (e, yard) for k, (e, yard) in errs.items() if not (math.isfinite(e) and e <= FACTOR * yard)}
        assert not bad, (rank, bad)
        print(f"rank {rank}: at most {max(e / yard for e, yard in errs.values()):.2f} yardsticks")


def _exchange_worker(rank, port, out):
    import copy
    import datetime

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from tformer.config import MoEConfig
    from tformer.nn.moe import MoEFeedForward
    from tformer.parallel.ep import apply_expert_parallel

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60)
    )
    try:
        torch.manual_seed(0)
        moe = MoEFeedForward(MoEConfig(num_experts=4, top_k=2, router_softmax="topk"), 16, 24, "swiglu")
        for p in moe.parameters():
            torch.nn.init.normal_(p, 0, 0.2)
        moe.router.weight.data[3] -= 5.0  # expert 3 (rank 1's) nearly never chosen: empty sends
        ref = copy.deepcopy(moe)
        exact = copy.deepcopy(moe).double()
        xs = [torch.randn(3, 7, 16, requires_grad=True) for _ in range(2)]
        apply_expert_parallel(moe, init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))["ep"])
        x = xs[rank].detach().requires_grad_()
        y = moe(x)
        y.square().sum().backward()
        # each: (this rank's largest difference from the local experts', relative, and the yardstick:
        # how far the local experts' fp32 result lies from float64's, at least one fp32 rounding)
        errs = {}
        for i, xi in enumerate(xs):
            yr = ref(xi)
            yr.square().sum().backward()
            x64 = xi.detach().double().requires_grad_()
            with float64_throughout():
                y64 = exact(x64)
            y64.square().sum().backward()
            if i == rank:
                errs["out"] = (relative(y, yr), max(FP32_ROUNDING, relative(yr, y64)))
                errs["x.grad"] = (relative(x.grad, xi.grad), max(FP32_ROUNDING, relative(xi.grad, x64.grad)))
        for name in ("gate", "up", "down"):
            mine = getattr(moe.experts, name).grad.to_local()
            want = getattr(ref.experts, name).grad.chunk(2)[rank]  # both ranks' tokens, summed in another order
            want64 = getattr(exact.experts, name).grad.chunk(2)[rank]
            errs[name] = (relative(mine, want), max(FP32_ROUNDING, relative(want, want64)))
        torch.save(errs, f"{out}/err{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_planner_moe_terms():
    """Total vs active parameters agree with the built model's own counts; expert states per rank
    are 1/(ep x dp_shard/ep) of the experts' states; the all-to-all volume is 4 exchanges of
    (ep-1)/ep of the routed rows per MoE layer and micro-batch (bench_moe.py --part a2a measures it)."""
    import tformer
    from tformer.plan.moe import (
        MoELayout,
        active_parameters,
        all_to_all_bytes_per_step,
        expert_parameters,
        expert_states_per_rank,
        moe_lines,
    )

    for name in ("mixtral-tiny", "qwen2-moe-tiny", "switch-tiny"):
        model = tformer.build_model(name)
        total = model.num_parameters()
        assert active_parameters(model.config, total) == model.num_active_parameters(), name
        stacks = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
        assert expert_parameters(model.config) == stacks, name
    cfg = tformer.build_config("mixtral-tiny")  # 4 experts, top-2, 2 MoE layers, d 64
    layout = MoELayout(ep=2, dp_shard=4, tokens=100, micro_batches=3, elt=2)
    assert all_to_all_bytes_per_step(cfg, layout) == 4 * (100 * 2 * 64 * 2 / 2) * 2 * 3
    assert all_to_all_bytes_per_step(cfg, MoELayout(ep=1, dp_shard=4, tokens=100)) == 0
    assert expert_states_per_rank(cfg, layout, 16) == expert_parameters(cfg) * 16 / 4
    lines = moe_lines(cfg, tformer.build_model(cfg).num_parameters(), 4, 512, mixed=True)
    assert "active per token" in lines[0] and [line.split()[0] for line in lines[1:]] == ["ep=1", "ep=2", "ep=4"]
