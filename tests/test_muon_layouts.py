"""Muon over layouts (tformer/parallel/newton_schulz.py): every matrix orthogonalised whole on one
owner rank and its update scattered back, so DDP, FSDP2, TP and EP runs equal the 1-process run of the
same global batch (test_mesh's bound); planted defects (a shard orthogonalised instead of the whole
matrix, the owner's result not scattered back) are caught.

Real gloo processes (2 ranks), each group under a deadline that kills it and fails the test.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import test_mesh
from test_mesh import _resume, assert_same_run, loss_bound, reference, run_cases
from train_helpers import CONFIGS, become_rank, free_port, losses, spawn_ranks

from tformer.train.config import load_config
from tformer.train.trainer import Trainer

GROUP_TIMEOUT = 300
pytestmark = pytest.mark.timeout(900)

# (mesh, shape, placements) on 4 ranks. The 1-D mesh of 4: an odd count of one shape (a batch of 3
# on 4 owners), rows and columns cut, an uneven cut (7 rows over 4), expert stacks whole on each rank
# (Shard(0)) and cut inside their matrices. The 2-D mesh (2, 2) as FSDP2 over TP lays them out:
# column-wise matrices strided (TP cut the rows first, FSDP2 each half), row-wise ones cut both ways,
# an expert stack strided inside its matrices.
MATRICES = [
    ("1d", (12, 20), "S0"),
    ("1d", (12, 20), "S0"),
    ("1d", (12, 20), "S0"),
    ("1d", (12, 20), "S1"),
    ("1d", (7, 10), "S0"),
    ("1d", (4, 6, 10), "S0"),
    ("1d", (2, 6, 10), "S1"),
    ("2d", (16, 12), "s0,S0"),
    ("2d", (16, 12), "s0,S0"),
    ("2d", (12, 16), "S0,S1"),
    ("2d", (2, 8, 12), "s1,S1"),
]
STRIDED = [i for i, (_, _, pl) in enumerate(MATRICES) if "s" in pl]
DEFECTS = ("none", "shard_only", "no_scatter", "no_swap", "in_order")


def _placement(code, mesh_sizes):
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    out = []
    for k, c in enumerate(code.split(",")):  # s: FSDP2's strided shard over the next mesh dimension's
        out.append(_StridedShard(int(c[1]), split_factor=mesh_sizes[k + 1]) if c[0] == "s" else Shard(int(c[1])))
    return out


def _in_order(count, loads, cost):
    """Planted defect: a batch's matrices to ranks 0, 1, ... whatever the ranks already own."""
    per = -(-count // len(loads))
    for s in range(count):
        loads[s // per] += cost
    return list(range(count)), per


def _orthogonalise_worker(rank, world, port, out):
    become_rank(rank, world, port, "", 60)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    from tformer.parallel import newton_schulz as ns

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        meshes = {"1d": init_device_mesh("cpu", (world,)), "2d": init_device_mesh("cpu", (2, world // 2))}
        gen = torch.Generator().manual_seed(0)
        fulls = [torch.randn(shape, generator=gen) for _, shape, _ in MATRICES]
        places = [_placement(code, meshes[m].shape) for m, _, code in MATRICES]
        params = [
            distribute_tensor(f, meshes[m], pl, src_data_rank=None) for f, (m, _, _), pl in zip(fulls, MATRICES, places)
        ]
        assert all(torch.equal(p.full_tensor(), f) for p, f in zip(params, fulls))
        want = [
            distribute_tensor(ns.orthogonalise_local(f, 5, torch.float32), p.device_mesh, p.placements, src_data_rank=None)
            for f, p in zip(fulls, params)
        ]
        want = [w.to_local() for w in want]
        saved = {k: getattr(ns, k) for k in ("scatter_from_owners", "whole_here", "_swap_blocks", "owner_slots")}
        results, flops = {}, {}
        for defect in DEFECTS:
            if defect == "shard_only":  # each rank orthogonalises the shard it holds
                ns.whole_here = lambda p: True
            if defect == "no_swap":  # strided shards taken as plain ones: the blocks out of order
                ns._swap_blocks = lambda x, swaps, back: x
            if defect == "in_order":
                ns.owner_slots = _in_order
            if defect == "no_scatter":  # an owner keeps its result: the other ranks get zeros

                def missed(like, result, shape):
                    got = saved["scatter_from_owners"](like, result, shape)
                    per, mine = result.shape[0], ns.owner_index(like.device_mesh)
                    return torch.stack([g if i // per == mine else torch.zeros_like(g) for i, g in enumerate(got)])

                ns.scatter_from_owners = missed
            got = ns.orthogonalise(params, [p.to_local() for p in params], 5, torch.float32)
            plan = ns.owner_plan(params, [4] * len(params))
            flops[defect] = {m: plan.flops.get(mesh, []) for m, mesh in meshes.items()}
            flops[defect]["everywhere"] = plan.everywhere
            for k, v in saved.items():
                setattr(ns, k, v)
            results[defect] = [torch.equal(g, w) for g, w in zip(got, want)]
        Path(out, f"rank{rank}.json").write_text(json.dumps({"results": results, "flops": flops}))
    finally:
        dist.barrier()
        dist.destroy_process_group()


def test_owners_orthogonalise_whole_matrices_balanced_and_defects_are_caught(tmp_path):
    """On 4 ranks (a 1-D mesh, and a 2 x 2 mesh laid out as FSDP2 over TP), each sharded matrix's
    result on every rank is bitwise its shard of the whole matrix's Newton-Schulz (the owner ran it
    on the gathered matrix, strided blocks put back in order), no matrix is gathered on every rank,
    and the owners' Newton-Schulz FLOPs differ by at most one matrix's. Planted defects are caught:
    orthogonalising shards, an owner that does not scatter its result back, strided shards taken
    as plain ones, every batch handed to ranks 0, 1, ... in order (unbalanced)."""
    from tformer.parallel.newton_schulz import newton_schulz_flops

    spawn_ranks(_orthogonalise_worker, (4, free_port(), str(tmp_path)), 4, GROUP_TIMEOUT)
    biggest = {m: max(newton_schulz_flops(s) for mm, s, _ in MATRICES if mm == m) for m in ("1d", "2d")}
    for rank in range(4):
        rec = json.loads((tmp_path / f"rank{rank}.json").read_text())
        got, flops = rec["results"], rec["flops"]
        assert all(got["none"]) and all(got["in_order"]), (rank, got)
        assert not all(got["shard_only"]) and not all(got["no_scatter"]), rank
        # strided blocks out of order: exactly the strided matrices come out wrong
        assert [i for i, ok in enumerate(got["no_swap"]) if not ok] == STRIDED, (rank, got["no_swap"])
        # whole expert stacks are never gathered nor cut: the defects leave them right
        assert got["shard_only"][5] and got["no_scatter"][5]
        assert flops["none"]["everywhere"] == []
        for m in ("1d", "2d"):
            load = flops["none"][m]
            assert max(load) - min(load) <= biggest[m], (m, load)
            skew = flops["in_order"][m]
            assert max(skew) - min(skew) > biggest[m], (m, skew)


MUON = ["optim.name=muon", "optim.muon.ns_dtype=fp32", "optim.lr=3e-3"]
QK_CLIP = "optim.muon.qk_clip=0.1"  # below gpt2-tiny's largest logits (0.11-0.14): it clips every step
LAYOUTS = {  # global batch 8 on each: micro-batches of 4, one per data-parallel rank and accumulation step
    "ddp": ["grad_accum=1"],
    "fsdp": ["parallel.strategy=fsdp", "grad_accum=1", "save_every=2"],
    "tp": ["parallel.strategy=fsdp", "parallel.tp=2", "grad_accum=2"],
}
# QK-clip where a rank holds part of the heads (tp: their columns of the table), of the layers (pp: a
# stage's rows) or of the sequence (cp: its queries against every key, the core's max_logits)
QK_CLIP_SPLIT = {
    "tp": LAYOUTS["tp"],
    "pp": ["parallel.pp=2", "grad_accum=2"],
    "cp": ["parallel.strategy=fsdp", "parallel.cp=2", "grad_accum=2"],
}


@pytest.mark.slow
@pytest.mark.usefixtures("cache")
def test_ddp_fsdp_and_tp_equal_the_single_process_run(tmp_path_factory):
    """gpt2-tiny with optim.name=muon on 2 ranks as DDP, FSDP2 (matrices gathered to their owners)
    and TP (the TP group's shards to their owners): losses and updated parameters of the 1-process
    run of the same global batch, within test_mesh.LAYOUT_FACTOR of its rounding yardstick. The
    FSDP2 run's step-2 checkpoint (momentum buffers as DTensor shards) resumes on one process: steps
    3 and 4 within the same bound of the uninterrupted run. DDP, FSDP2, TP, PP and CP with QK-clip on
    (every rank clips by the maxima of all ranks' sequences, heads, layers and positions) equal one
    process with it on."""
    tmp = tmp_path_factory.mktemp("muon-layouts")
    cases = [("gpt2", [*MUON, *flags]) for flags in LAYOUTS.values()]
    cases += [("gpt2", [*MUON, QK_CLIP, *LAYOUTS[name]]) for name in ("ddp", "fsdp")]
    cases += [("gpt2", [*MUON, QK_CLIP, *flags]) for flags in QK_CLIP_SPLIT.values()]
    run_cases(2, cases, tmp, os.environ["TFORMER_CACHE"])
    ref = reference("gpt2", tmp_path_factory, 2, *MUON)
    clipped = reference("gpt2", tmp_path_factory, 2, *MUON, QK_CLIP)
    for i, layout in enumerate(LAYOUTS):
        assert_same_run(f"gpt2 {layout}", tmp / f"run{i}", tmp / f"report{i}", ref)
    for i, layout in enumerate(
        ("ddp", "fsdp", *QK_CLIP_SPLIT), start=len(LAYOUTS)
    ):  # each rank clipped by every rank's maxima
        assert_same_run(f"gpt2 {layout} qk_clip", tmp / f"run{i}", tmp / f"report{i}", clipped)
    ckpt = tmp / "run1" / "checkpoints" / "step_00000002"
    recipe, flags = _resume("gpt2", tmp / "one", ckpt, *MUON, "grad_accum=2")
    Trainer(load_config(CONFIGS / f"{recipe}.yaml", flags)).fit()
    got, bound = losses(tmp / "one"), loss_bound(ref)
    assert list(got) == [3, 4], got
    for step in got:
        assert abs(got[step] - ref.losses[step]) / ref.losses[step] <= bound, (step, got, ref.losses, bound)


@pytest.mark.long
@pytest.mark.usefixtures("cache")
def test_ep_equals_the_single_process_run(tmp_path_factory):
    """mixtral-tiny with optim.name=muon at ep=2: each rank's experts (whole, Shard(0) of the stacks)
    orthogonalised where they are, every other matrix gathered to its owner; one sequence per
    micro-batch, the 1-process run accumulating the same micro-batches (test_expert_parallel)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(test_mesh.FAMILIES, "mixtral", ("mixtral-tiny", ["data.seq_len=32"]))
        tmp = tmp_path_factory.mktemp("muon-ep")
        flags = [*MUON, "micro_batch_size=1", "parallel.strategy=fsdp"]
        run_cases(2, [("mixtral", [*flags, "grad_accum=4", "parallel.ep=2"])], tmp, os.environ["TFORMER_CACHE"])
        ref = reference("mixtral", tmp_path_factory, 8, *MUON, "micro_batch_size=1")
        assert_same_run("mixtral ep2", tmp / "run0", tmp / "report0", ref)


# -- the rest of the mesh: FSDP2 x TP, pipeline stages, context parallel, DDP accumulating ----------

MOE = ("mixtral-tiny", ["data.seq_len=32"])  # the MoE decoder (8 experts, top-2, the balancing loss on)
# mechanism -> (ranks, the layout's flags, the 1-process run's grad_accum): the global batch is 8
# sequences everywhere but DDP accumulating (16): micro-batches of 4 x data ranks x accumulation
MECHANISMS = {
    "fsdp x tp": (4, ["parallel.strategy=fsdp", "parallel.dp_shard=2", "parallel.tp=2", "parallel.sp=true"], 2),
    # each stage's optimizer over its own blocks' matrices (the tied embedding: AdamW, on both ends)
    "pp": (2, ["parallel.pp=2", "grad_accum=2", "parallel.pp_schedule=1f1b"], 2),
    "cp": (2, ["parallel.strategy=fsdp", "parallel.cp=2", "grad_accum=2"], 2),
    "ddp accum": (2, ["grad_accum=2"], 4),
}
FAMILY_NAMES = ("gpt2", "mixtral", "bert", "t5")
# the default lane: one case per mechanism (a dense decoder; activation checkpointing on the pipeline's
# blocks); the long lane: every family at every mechanism, per-block compile, and a resume under TP
FAST = [
    ("gpt2", "fsdp x tp", ["save_every=2"]),
    ("gpt2", "pp", ["parallel.activation_checkpointing=full"]),
    ("gpt2", "cp", []),
]
FAST += [("gpt2", "ddp accum", [])]
LONG = [(f, m, []) for f in FAMILY_NAMES for m in MECHANISMS if (f, m) not in {(c[0], c[1]) for c in FAST}]
LONG += [("gpt2", "cp", ["parallel.activation_checkpointing=op", "compile=true"])]


def _mesh_cases(cases, tmp_path_factory, tag):
    """Run ``cases`` (family, mechanism, extra flags) grouped by rank count; assert each equals its
    1-process run; returns the run directory of each case."""
    tmp = tmp_path_factory.mktemp(f"muon-{tag}")
    dirs = {}
    for world in (2, 4):
        mine = [c for c in cases if MECHANISMS[c[1]][0] == world]
        if not mine:
            continue
        sub = tmp / f"w{world}"
        run_cases(world, [(f, [*MUON, *MECHANISMS[m][1], *extra]) for f, m, extra in mine], sub, os.environ["TFORMER_CACHE"])
        for i, (family, mech, extra) in enumerate(mine):
            ref = reference(family, tmp_path_factory, MECHANISMS[mech][2], *MUON)
            assert_same_run(f"muon {family} {mech} {extra}", sub / f"run{i}", sub / f"report{i}", ref)
            if "compile=true" in extra:  # the blocks really ran compiled
                assert all(int(Path(f"{sub}/report{i}.graphs{r}").read_text()) >= 1 for r in range(world))
            dirs[(family, mech, tuple(extra))] = sub / f"run{i}"
    return dirs


@pytest.fixture
def moe_family(monkeypatch):
    monkeypatch.setitem(test_mesh.FAMILIES, "mixtral", MOE)


@pytest.mark.slow
@pytest.mark.usefixtures("cache", "moe_family")
def test_fsdp_x_tp_pp_cp_and_ddp_accumulating_equal_the_single_process_run(tmp_path_factory):
    """gpt2-tiny with optim.name=muon at dp_shard 2 x tp 2 (4 ranks: strided FSDP2-over-TP shards to
    balanced owners), pp=2 (each stage's optimizer over its own parameters, activation
    checkpointing on), cp=2 and DDP accumulating 2 micro-batches: losses and updated parameters
    of the 1-process run of the same global batch within test_mesh's layout bound. The
    dp_shard x tp checkpoint of step 2 resumes on one process: steps 3 and 4 within the same bound."""
    dirs = _mesh_cases(FAST, tmp_path_factory, "fast")
    ckpt = dirs[("gpt2", "fsdp x tp", ("save_every=2",))] / "checkpoints" / "step_00000002"
    _resume_elsewhere(tmp_path_factory, ckpt, 1, "grad_accum=2")


def _resume_elsewhere(tmp_path_factory, ckpt, world, *flags):
    """``ckpt`` (a step-2 checkpoint of gpt2 under Muon) resumed on ``world`` ranks with ``flags``:
    steps 3 and 4 equal the uninterrupted 1-process run's (global batch 8) within the layout bound."""
    out = tmp_path_factory.mktemp("muon-resume") / "run"
    recipe, overrides = _resume("gpt2", out, ckpt, *MUON, *flags)
    if world == 1:
        Trainer(load_config(CONFIGS / f"{recipe}.yaml", overrides)).fit()
    else:
        test_mesh.run_ranks(world, [(recipe, overrides, None)], os.environ["TFORMER_CACHE"])
    ref = reference("gpt2", tmp_path_factory, 2, *MUON)
    got, bound = losses(out), loss_bound(ref)
    assert list(got) == [3, 4], got
    for step in got:
        assert abs(got[step] - ref.losses[step]) / ref.losses[step] <= bound, (step, got, ref.losses, bound)


@pytest.mark.long
@pytest.mark.usefixtures("cache", "moe_family")
def test_every_family_at_every_mechanism_equals_the_single_process_run(tmp_path_factory):
    """The rest of the matrix: a dense decoder (gpt2), an MoE decoder (mixtral), an encoder (bert)
    and an encoder-decoder (t5) at dp_shard x tp, pp, cp and DDP accumulating, and cp with op-level
    checkpointing and per-block compile; a 2-rank FSDP2 checkpoint resumed at tp=2 continues the
    uninterrupted run."""
    dirs = _mesh_cases(LONG, tmp_path_factory, "long")
    tmp = tmp_path_factory.mktemp("muon-fsdp-save")
    run_cases(2, [("gpt2", [*MUON, *LAYOUTS["fsdp"]])], tmp, os.environ["TFORMER_CACHE"])
    ckpt = tmp / "run0" / "checkpoints" / "step_00000002"
    _resume_elsewhere(tmp_path_factory, ckpt, 2, "parallel.strategy=fsdp", "parallel.tp=2", "grad_accum=2")
    assert dirs


@pytest.mark.long
@pytest.mark.usefixtures("cache")
def test_qk_clip_of_latent_attention_under_tp_and_cp_equals_one_process(tmp_path_factory):
    """DeepSeek-V3's latent attention with Muon and QK-clip (Kimi K2's recipe) at tp=2 (each rank its
    heads' q_up / kv_up rows) and cp=2 (its queries against every expanded key): within the layout
    bound of one process."""
    flags = ["model.num_layers=3", "model.mtp_depth=0", "model.moe.bias_update_rate=0", *MUON, QK_CLIP]
    layouts = [
        ("deepseek", ["parallel.strategy=fsdp", "parallel.tp=2", "grad_accum=2"], 2),
        ("deepseek", ["parallel.strategy=fsdp", "parallel.cp=2", "grad_accum=2"], 2),
    ]
    test_mesh.assert_layouts_equal_one_process(
        "deepseek", ("deepseek-v3-tiny", flags), layouts, tmp_path_factory, os.environ["TFORMER_CACHE"]
    )
