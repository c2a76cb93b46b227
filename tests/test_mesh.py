"""The device mesh: tensor parallel (+ sequence and loss parallel), FSDP2 x TP and HSDP, for every
family, proven equal to the 1-process run; DCP resharding across layouts; export of TP checkpoints.

Runs are real trainer runs over 2 or 4 gloo processes on tiny models; every spawned group has a
timeout that fails the test (``TFORMER_DIST_TIMEOUT`` bounds each collective, ``join`` the group).
"""

import json
import os
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from rounding import assert_within, float64_throughout, yardstick

from tformer.config import ConfigError
from tformer.parallel.mesh import ParallelDims
from tformer.train.config import load_config
from tformer.train.trainer import Trainer

from train_helpers import CONFIGS, become_rank, free_port, losses, run_cli, small_overrides, spawn_ranks

GROUP_TIMEOUT = 900  # seconds for one spawned group of jobs, then the test fails
# a test runs references besides its group: its own deadline above fires before pytest-timeout's
pytestmark = pytest.mark.timeout(2 * GROUP_TIMEOUT)


def _worker(rank, world, port, jobs, cache):
    become_rank(rank, world, port, cache, 300)
    import torch.distributed as dist

    try:
        from torch._dynamo.utils import counters

        for recipe, overrides, report in jobs:
            trainer = Trainer(load_config(CONFIGS / f"{recipe}.yaml", overrides))
            if trainer.cfg.compile:
                torch._dynamo.reset()  # this run compiles its own graphs
            graphs = counters["stats"]["unique_graphs"]
            trainer.fit()
            if report is not None:
                _report(trainer, rank, report)
                Path(f"{report}.graphs{rank}").write_text(str(counters["stats"]["unique_graphs"] - graphs))
    finally:
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def _report(trainer, rank, path):
    """Per-parameter local element counts (every rank) and the full model's tensors (rank 0)."""
    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    counts = {
        n: [p.to_local().numel() if hasattr(p, "to_local") else p.numel(), p.numel()]
        for n, p in trainer.model.named_parameters()
    }
    Path(f"{path}.rank{rank}.json").write_text(json.dumps(counts))
    from tformer.parallel.pipeline import Parts

    # every rank gets the full tensors (with cpu_offload only rank 0 would)
    state = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True))
    state = {Parts.strip(k): v for k, v in state.items()}  # a pipeline rank: its stages' tensors
    if dist.get_rank() == 0 or trainer.dims.pp > 1:
        save_file(
            {k: v.contiguous() for k, v in state.items() if k != "lm_head.weight" or not trainer.model_cfg.tie_embeddings},
            f"{path}.full{dist.get_rank()}.safetensors",
        )


def run_ranks(world, jobs, cache, worker=_worker):
    spawn_ranks(worker, (world, free_port(), jobs, cache), world, GROUP_TIMEOUT)


# optim.eps=1e-4: Adam divides each gradient by its own running magnitude, so an element whose true
# gradient is zero (attention's key bias: softmax ignores a per-query constant) moves by +-lr on
# round-off alone, in whichever direction the summation order gives; a larger eps keeps such noise
# from being amplified, so that the updated parameters can be compared at rounding's scale at all.
COMMON = [
    "max_steps=4",
    "eval_every=0",
    "save_every=0",
    "micro_batch_size=4",
    "precision=fp32",
    "model.dropout=0.0",
    "optim.warmup_steps=1",
    "optim.eps=1e-4",
]
# (recipe, extra overrides): GPT-2 (tied, learned positions, LayerNorm), Llama (GQA: 4 heads over 2
# KV heads, RoPE, SwiGLU, untied), BERT (post-norm, MLM head at masked positions, tied), T5 v1.0
# (relative bias, tied + rescaled head) and v1.1 (GEGLU, untied, deeper decoder)
FAMILIES = {
    "gpt2": ("gpt2-tiny", ["model.pad_vocab_multiple=192"]),  # 2048 -> 2112 rows: padded columns
    "llama": ("llama-tiny", []),
    "bert": ("bert-tiny", []),
    "t5": ("t5-tiny", ["optim.label_smoothing=0.1"]),
    "t5-v1.1": ("t5-tiny", ["model.preset=t5-v1.1-tiny", "model.num_decoder_layers=3", "model.d_ff=96"]),
}
REFS: dict = {}
REF_DIRS: dict = {}  # the same key -> the reference's run directory (its metrics: val_loss...)


def reference_dir(name, grad_accum, *extra):
    """The run directory of ``reference(name, ..., grad_accum, *extra)``, once it has run."""
    return REF_DIRS[(name, grad_accum, *extra)]


def _overrides(name, out, *extra):
    recipe, own = FAMILIES[name]
    return recipe, small_overrides(recipe, out, *COMMON, *own, *extra)


def run_cases(world, cases, tmp, cache, *common):
    """Train every ``(family, flags)`` of ``cases`` on ``world`` ranks in one spawned group: run i
    in ``tmp/run{i}`` with ``common`` + its flags, its report in ``tmp/report{i}``."""
    jobs = []
    for i, (name, flags) in enumerate(cases):
        recipe, overrides = _overrides(name, tmp / f"run{i}", *common, *flags)
        jobs.append((recipe, overrides, str(tmp / f"report{i}")))
    run_ranks(world, jobs, cache)


# Layout tolerances (CONTRIBUTING.md "Tolerances hold on every CPU"). A layout computes what one
# process computes, its sums split and joined in another order: the two runs differ by fp32 rounding
# only, grown over 4 AdamW steps (Adam divides each gradient by its own magnitude, so an element with
# a small gradient moves by round-off). How far rounding moves a run is measured next to each
# reference, not taken from one machine: the yardstick is the distance from the reference to the
# same run with model.attn_impl=math (the same attention, written out: another valid summation
# order, the same mathematics, every family and loss). A layout may be LAYOUT_FACTOR times it.
# Measured on a 2-core AVX2 EPYC over the default lane's layouts (test_mesh, test_pipeline,
# test_moe_layouts, test_expert_parallel, test_context_parallel), at AVX2 and with
# ATEN_CPU_CAPABILITY=default (scalar kernels) and with 1-thread references: the losses at most 2.2
# yardsticks (1 or 2 fp32 roundings), the parameters at most 4.9 (t5-v1.1 at tp=2, scalar; 3.9 at
# AVX2, 4.3 on 1 thread). A layout's own defects are 10^3 yardsticks and more: the pipeline
# stages' gradient norms not summed 3.5e3 (losses) and 6e4 (parameters), tp=3's padded vocabulary
# column taking probability 1.0e3 (losses), cp=2 x ep=2's pad counted in the MoE balancing loss
# 1.8e3 (losses) and 1.1e5 (parameters: the router).
LAYOUT_FACTOR = 16.0
# Per-block compile besides a layout (long lane) is held to the same bound: inductor's fused kernels
# are one more valid summation order, and test_compile measures them against this yardstick in the
# default lane (compile=model in the trainer: 3.6 yardsticks on the parameters, the losses bitwise;
# per-block compile with TP, pipeline and CP 0.5 to 1.2 on a 2-core AVX2 EPYC).
# the yardstick's floor: one rounding of fp32 (2^-24 relative), where the twin happens to agree
FP32_ROUNDING = 2.0**-24


class Reference(NamedTuple):
    """A 1-process run: its losses by step, its final state, and how far a second valid rounding of
    the same run lies from it (relative: losses, parameters)."""

    losses: dict
    state: dict
    yardstick: tuple[float, float]


def _distance(got_losses, got_state, ref_losses, ref_state, name=""):
    """Largest relative difference of the losses, and of each parameter (to its tensor's largest
    element), from the reference's."""
    assert list(got_losses) == list(ref_losses) == [1, 2, 3, 4], (name, got_losses, ref_losses)
    loss = max(abs(got_losses[s] - ref_losses[s]) / abs(ref_losses[s]) for s in ref_losses)
    errs = {}
    for k, v in got_state.items():
        if v.shape != ref_state[k].shape:  # a vocabulary padded by tp: its padding rows stay zero
            assert not v[ref_state[k].shape[0] :].any(), (name, k)
            v = v[: ref_state[k].shape[0]]
        if k.endswith("k_proj.bias") and ref_state[k].abs().max() < 1e-3:  # zero true gradient (softmax
            # ignores a per-query constant): it stays at its initial 0 up to round-off in both runs,
            # which is all there is to compare. Not so beside attention sinks (gpt-oss), which the
            # constant does not reach: there it trains, and is compared as any parameter
            assert v.abs().max() < 1e-3, (name, k)
            continue
        scale = ref_state[k].abs().max().clamp(min=1e-6)
        errs[k] = ((v - ref_state[k]).abs().max() / scale).item()
    return loss, errs


def _split_twin(flags) -> tuple[str, ...]:
    """The yardstick's twin where the attention is written out already (soft-caps run the math
    path, so ``model.attn_impl=math`` is the same run bitwise): the same global batch in micro-
    batches of half the size, twice as many (the loss and the gradients summed in another order)."""
    accum = next((int(f.split("=")[1]) for f in flags if f.startswith("grad_accum=")), 1)
    micro = next(int(f.split("=")[1]) for f in COMMON if f.startswith("micro_batch_size="))
    return (f"micro_batch_size={micro // 2}", f"grad_accum={2 * accum}")


def one_process(name, out, *flags) -> Reference:
    """Train ``name`` on one process with ``flags``, and again with the attention written out (the
    yardstick), or, where that twin is bitwise the run (every attention on the math path already),
    in micro-batches of half the size (``_split_twin``)."""

    def train(run, *extra):
        recipe, overrides = _overrides(name, run, *flags, *extra)
        trainer = Trainer(load_config(CONFIGS / f"{recipe}.yaml", overrides))
        trainer.fit()
        return losses(run), {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}

    ref_losses, ref_state = train(out)
    twin_losses, twin_state = train(out.with_name(out.name + "-math"), "model.attn_impl=math")
    loss, errs = _distance(twin_losses, twin_state, ref_losses, ref_state, name)
    if loss == 0 and not any(errs.values()):
        twin_losses, twin_state = train(out.with_name(out.name + "-split"), *_split_twin(flags))
        loss, errs = _distance(twin_losses, twin_state, ref_losses, ref_state, name)
    return Reference(ref_losses, ref_state, (loss, max(errs.values())))


def reference(name, tmp_path_factory, grad_accum, *extra) -> Reference:
    """The 1-process run with the same global batch (cached per family, accumulation and extras)."""
    key = (name, grad_accum, *extra)
    if key not in REFS:
        out = tmp_path_factory.mktemp(f"ref-{name}")
        REFS[key] = one_process(name, out / "run", f"grad_accum={grad_accum}", *extra)
        REF_DIRS[key] = out / "run"
    return REFS[key]


def loss_bound(ref: Reference) -> float:
    """How far a layout's (or a resumed run's) losses may lie from ``ref``'s, relative."""
    return LAYOUT_FACTOR * max(ref.yardstick[0], FP32_ROUNDING)


def assert_same_run(name, got_dir, report, ref: Reference):
    """The run in ``got_dir`` (its parameters in ``report``) against ``ref``: losses and updated
    parameters within LAYOUT_FACTOR times the reference's yardstick; returns the largest
    differences (loss, parameter)."""
    from safetensors.torch import load_file

    state = {}
    for part in sorted(Path(report).parent.glob(f"{Path(report).name}.full*.safetensors")):
        state.update(load_file(part))  # pipeline ranks: each wrote its stages
    return assert_same_state(name, losses(got_dir), state, ref)


def assert_layouts_equal_one_process(name, preset_flags, layouts, tmp_path_factory, cache):
    """A flavour outside ``FAMILIES`` (``name`` -> (preset, flags)) run at each of ``layouts``
    ((name, flags, grad_accum of its 1-process reference)) on 2 ranks, each equal to one process
    (``assert_same_run``); a tensor-parallel run also holds half of the sharded parameters a rank."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(FAMILIES, name, preset_flags)
        tmp = tmp_path_factory.mktemp(f"{name}-layouts")
        run_cases(2, [(case, flags) for case, flags, _ in layouts], tmp, cache)
        for i, (case, flags, dp) in enumerate(layouts):
            ref = reference(case, tmp_path_factory, dp)
            assert_same_run(case, tmp / f"run{i}", tmp / f"report{i}", ref)
            if "parallel.tp=2" in flags:
                assert_counts(tmp / f"report{i}", 2, 2)


def assert_same_state(name, got_losses: dict, state: dict, ref: Reference):
    """``assert_same_run`` of losses by step and full parameters already read."""
    assert state.keys() >= {k for k in ref.state if k != "lm_head.weight"}, (name, set(ref.state) - set(state))
    loss, errs = _distance(got_losses, state, ref.losses, ref.state, name)
    worst = max(errs, key=errs.get)
    yard_loss, yard_param = (max(y, FP32_ROUNDING) for y in ref.yardstick)
    print(
        f"{name}: loss {loss:.1e} ({loss / yard_loss:.2f} of the yardstick {yard_loss:.1e}), "
        f"parameters {errs[worst]:.1e} ({errs[worst] / yard_param:.2f} of {yard_param:.1e}, {worst})"
    )
    loss_tol, param_tol = LAYOUT_FACTOR * yard_loss, LAYOUT_FACTOR * yard_param
    assert loss <= loss_tol, (name, "losses", loss, yard_loss, got_losses, ref.losses)
    bad = {k: e for k, e in errs.items() if not e <= param_tol}  # a NaN is bad too
    assert not bad, (name, "parameters", bad, yard_param)
    return loss, errs[worst]


def sharded(name: str) -> bool:
    """Parameters tensor parallelism splits (see tformer/parallel/tp.py); latent attention's down
    projections are whole on every rank, its up projections split by head; an MoE layer's shared
    experts are whole on every rank."""
    if name.endswith(("o_proj.bias", "down.bias", "q_down.weight", "kv_down.weight", "kv_down.bias")) or "norm" in name:
        return False
    if ".shared." in name:
        return False
    return name.endswith(
        (
            "q_up.weight",
            "kv_up.weight",
            "q_proj.weight",
            "k_proj.weight",
            "v_proj.weight",
            "q_proj.bias",
            "k_proj.bias",
            "v_proj.bias",
            "o_proj.weight",
            "up.weight",
            "up.bias",
            "gate.weight",
            "gate.bias",
            "down.weight",
            "embed.tok.weight",
            "lm_head.weight",
            "lm_head.bias",
            "rel_bias.embedding.weight",
        )
    )


def assert_counts(report, world, divisor_sharded, divisor_other=1):
    for rank in range(world):
        counts = json.loads(Path(f"{report}.rank{rank}.json").read_text())
        assert any(sharded(n) for n in counts)
        for n, (local, total) in counts.items():
            expected = total // (divisor_sharded if sharded(n) else divisor_other)
            assert local == expected, (n, rank, local, total)


# -- tp = 2 on 2 processes, every family, with and without sequence / loss parallel ---------------

TP_CASES = [
    ("gpt2", ["parallel.sp=true"]),
    ("gpt2", ["parallel.sp=false", "parallel.loss_parallel=false"]),
    ("llama", ["parallel.sp=true"]),
    ("llama", ["parallel.sp=false"]),
    ("bert", ["parallel.sp=true"]),
    ("bert", ["parallel.sp=false", "parallel.loss_parallel=false"]),
    ("t5", ["parallel.sp=true"]),
    ("t5", ["parallel.sp=false", "parallel.loss_parallel=false"]),
    ("t5-v1.1", ["parallel.sp=true"]),
    ("t5-v1.1", ["parallel.sp=false", "parallel.loss_parallel=false"]),
]


@pytest.fixture(scope="module")
def tp2_runs(cache, tmp_path_factory):
    """Every TP case trained for 4 steps on 2 ranks (each run ends with a tp=2 checkpoint)."""
    tmp = tmp_path_factory.mktemp("tp2")
    run_cases(2, TP_CASES, tmp, cache, "parallel.tp=2")
    return tmp


def test_tp2_equals_the_single_process_run_for_every_family(tp2_runs, tmp_path_factory):
    tmp = tp2_runs
    for i, (name, _) in enumerate(TP_CASES):
        assert_same_run(name, tmp / f"run{i}", tmp / f"report{i}", reference(name, tmp_path_factory, 1))
        assert_counts(tmp / f"report{i}", 2, 2)  # 1/tp of every TP-sharded parameter, exactly
    log = (tmp / "run0" / "config.yaml").read_text()
    assert "tp: 2" in log


def test_tp2_checkpoints_load_consolidate_and_export_with_hf_parity(tp2_runs, tmp_path):
    """A tp=2 checkpoint of every family: ``load_checkpoint`` and ``tformer consolidate`` give the
    full model the run held; ``export --to hf`` loads in transformers with logit parity (1e-4)."""
    from safetensors.torch import load_file
    from test_export import assert_logits_match, hf_model

    from tformer.checkpoint import load_checkpoint
    from tformer.checkpoint.consolidate import consolidate
    from tformer.export import export_hf

    done = set()
    for i, (name, _) in enumerate(TP_CASES):
        if name in done:
            continue
        done.add(name)
        ckpt = tp2_runs / f"run{i}" / "checkpoints" / "step_00000004"
        full = load_file(tp2_runs / f"report{i}.full0.safetensors")
        ours = load_checkpoint(ckpt).eval()
        state = ours.state_dict()
        single = load_file(consolidate(ckpt, tmp_path / f"{name}.safetensors"))
        for k in full:
            assert torch.equal(state[k], full[k]) and torch.equal(single[k], full[k]), (name, k)
        export_hf(ckpt, tmp_path / f"hf-{name}")
        assert_logits_match(ours, hf_model(tmp_path / f"hf-{name}", ours.config.family), ours.config)


def test_tp3_pads_the_vocabulary_without_changing_the_model(cache, tmp_path, tmp_path_factory):
    """2,048 tokens at tp=3: the trainer pads the embedding and head to 2,049 rows (as Megatron
    does) and records it in the run, yet trains the 1-process model of 2,048 rows: the padding
    draws no random numbers at init, starts and stays at zero, and takes no probability, so the
    losses and every real row equal the unpadded run's to the layout bound (LAYOUT_FACTOR; they
    differed by 1.2e-3 at step 1 when the padding shifted the init's random stream). The tp=3
    checkpoint resumes on one process, the 1-process one at tp=3, and the export holds the 2,048
    real rows with HF logit parity."""
    from test_export import assert_logits_match, hf_model

    from tformer.checkpoint import load_checkpoint
    from tformer.export import export_hf

    shape = ["model.num_heads=3", "model.d_model=96", "model.d_ff=192", "model.pad_vocab_multiple=1", "save_every=2"]
    tp3 = ["parallel.tp=3", "parallel.sp=true"]
    recipe = FAMILIES["gpt2"][0]
    ref = one_process("gpt2", tmp_path / "one", *shape)
    assert ref.state["embed.tok.weight"].shape[0] == 2048
    one_ckpt = tmp_path / "one" / "checkpoints" / "step_00000002"
    run_ranks(
        3,
        [
            (recipe, _overrides("gpt2", tmp_path / "tp3", *shape, *tp3)[1], str(tmp_path / "report")),
            (recipe, _overrides("gpt2", tmp_path / "from-one", *shape, *tp3, f"resume={one_ckpt}")[1], None),
        ],
        cache,
    )
    assert "pad_vocab_multiple: 3\n" in (tmp_path / "tp3" / "config.yaml").read_text()
    # three partial sums per row-parallel output; the padding moving the init was 1e-3 and more
    assert_same_run("gpt2-tp3", tmp_path / "tp3", tmp_path / "report", ref)
    tp3_ckpt = tmp_path / "tp3" / "checkpoints" / "step_00000002"
    Trainer(
        load_config(CONFIGS / f"{recipe}.yaml", _overrides("gpt2", tmp_path / "back", *shape, f"resume={tp3_ckpt}")[1])
    ).fit()
    for run in ("from-one", "back"):
        got = losses(tmp_path / run)
        assert list(got) == [3, 4], run
        for step in got:
            err = abs(got[step] - ref.losses[step]) / ref.losses[step]
            assert err <= loss_bound(ref), (run, step, err, ref.yardstick)
    final = tmp_path / "tp3" / "checkpoints" / "step_00000004"
    ours = load_checkpoint(final).eval()
    assert ours.embed.tok.weight.shape[0] == 2049 and not ours.embed.tok.weight[2048:].any()
    hf = hf_model(export_hf(final, tmp_path / "hf"), "decoder")
    assert hf.config.vocab_size == 2048 and hf.get_output_embeddings().weight.shape[0] == 2048
    assert_logits_match(ours, hf, ours.config)


@pytest.mark.long  # CI: compile + checkpointing under FSDP2 (test_parallel), per-block graphs (test_gpu)
def test_tp_with_compile_and_activation_checkpointing(cache, tmp_path, tmp_path_factory):
    """tp=2 + SP with per-block compile inside full and op-level activation checkpointing: the
    1-process run's losses and parameters to the layout bound (inductor fuses and reorders float
    math: not bitwise)."""
    runs = {
        "compiled-full": ["compile=true", "parallel.activation_checkpointing=full"],
        "compiled-op": ["compile=true", "parallel.activation_checkpointing=op"],
        "selective": ["parallel.activation_checkpointing=selective", "parallel.ac_every=2"],
    }
    if torch.torch_version.TorchVersion(torch.__version__) < (2, 13):  # the trainer refuses compile with TP there
        runs = {name: flags for name, flags in runs.items() if not name.startswith("compiled")}
    jobs = []
    for name, flags in runs.items():
        recipe, overrides = _overrides("gpt2", tmp_path / name, "parallel.tp=2", "parallel.sp=true", *flags)
        jobs.append((recipe, overrides, str(tmp_path / f"{name}-report")))
    run_ranks(2, jobs, cache)
    for name in runs:
        assert_same_run(name, tmp_path / name, tmp_path / f"{name}-report", reference("gpt2", tmp_path_factory, 1))
        if name.startswith("compiled"):
            for rank in (0, 1):  # the blocks really ran compiled (2 blocks, at least one graph each)
                assert int((tmp_path / f"{name}-report.graphs{rank}").read_text()) >= 2, name


# -- 4 processes: FSDP2 x TP and HSDP -----------------------------------------------------------

FSDP_TP = ["parallel.strategy=fsdp", "parallel.dp_shard=2", "parallel.tp=2"]
HSDP = ["parallel.strategy=fsdp", "parallel.dp_replicate=2", "parallel.dp_shard=2"]
# (family, flags, data-parallel ranks): every family at dp_shard 2 x tp 2 and at HSDP 2 x 2, plus
# HSDP 2 x tp 2. CI runs each layout for some families (every family at least once); the long lane
# the rest.
MESH_CASES = {
    "ci": [
        ("gpt2", [*FSDP_TP, "parallel.sp=true"], 2),
        ("llama", FSDP_TP, 2),
        ("t5", [*FSDP_TP, "parallel.sp=true"], 2),
        ("bert", HSDP, 4),
        ("t5-v1.1", HSDP, 4),
        ("bert", ["parallel.strategy=fsdp", "parallel.dp_replicate=2", "parallel.tp=2", "parallel.sp=true"], 2),
    ],
    "long": [
        ("bert", FSDP_TP, 2),
        ("t5-v1.1", FSDP_TP, 2),
        *((name, HSDP, 4) for name in FAMILIES if name not in ("bert", "t5-v1.1")),
    ],
}


@pytest.mark.parametrize("lane", ["ci", pytest.param("long", marks=pytest.mark.long)])
def test_fsdp_x_tp_and_hsdp_equal_the_single_process_run(cache, tmp_path_factory, lane):
    """dp_shard=2 x tp=2 and dp_replicate=2 x dp_shard=2 (and x tp=2) on 4 ranks against 1 process
    accumulating the same global batch; under FSDP2 x TP each rank holds 1/(tp x dp_shard) of a
    TP-sharded parameter."""
    cases = MESH_CASES[lane]
    tmp = tmp_path_factory.mktemp("mesh4")
    run_cases(4, [(name, flags) for name, flags, _ in cases], tmp, cache)
    for i, (name, _, dp) in enumerate(cases):
        assert_same_run(name, tmp / f"run{i}", tmp / f"report{i}", reference(name, tmp_path_factory, dp))
    for i, (_, flags, _) in enumerate(cases):
        if flags == FSDP_TP or flags[:3] == FSDP_TP:
            assert_counts(tmp / f"report{i}", 4, 4, 2)  # dp_shard 2 x tp 2
        elif flags == HSDP:
            assert_counts(tmp / f"report{i}", 4, 2, 2)  # HSDP: sharded within a replica of 2


# -- sequence parallel keeps the gathered inputs as shards for backward ------------------------------

SP_CASES = {  # name: (sp, tformer's re-gather, activation checkpointing)
    "tp": (False, True, "none"),
    "sp, torch alone": (True, False, "none"),
    "sp": (True, True, "none"),
    "sp + selective": (True, True, "selective"),
    "sp + op": (True, True, "op"),
    "sp + full": (True, True, "full"),
}
SP_SHAPE = {"d_model": 64, "num_layers": 2, "batch": 2, "seq": 64}


def _sp_worker(rank, world, port, out, cache):
    """One forward + backward of a small GPT per case on the tp=2 mesh: bytes saved for backward,
    loss and full gradients (rank 0 writes them)."""
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TFORMER_CACHE=str(cache)
    )
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import tformer.parallel.tp as tp_module
    from tformer import build_model
    from tformer.parallel.ac import apply_activation_checkpointing
    from tformer.parallel.memory import SavedActivations

    dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=120))
    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        keep = tp_module.keep_gathered_inputs_sharded
        d, layers, b, s = (SP_SHAPE[k] for k in ("d_model", "num_layers", "batch", "seq"))
        ids = torch.randint(0, 512, (b, s), generator=torch.Generator().manual_seed(0))
        results = {}
        for name, (sp, regather, ac) in SP_CASES.items():
            tp_module.keep_gathered_inputs_sharded = keep if regather else (lambda *a: 0)
            torch.manual_seed(0)
            model = build_model(
                "gpt2-tiny",
                vocab_size=512,
                d_model=d,
                num_layers=layers,
                num_heads=4,
                d_ff=4 * d,
                max_seq_len=s,
                dropout=0.0,
            )
            tp_module.apply_tensor_parallel(model, mesh, sp=sp)
            apply_activation_checkpointing(model, ac, every=2)
            with tp_module.loss_context(True):
                with SavedActivations() as saved:
                    loss = model(ids, labels=ids, return_logits=False).loss
                loss.backward()
            grads = {
                n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                for n, p in model.named_parameters()
            }
            results[name] = (saved.bytes, loss.item(), grads)
        # the yardstick of the "tp" case: how far torch's fp32 loss and gradients of the same model,
        # unsharded, lie from the model in float64 throughout (tests/rounding.py)
        for dtype in (torch.float32, torch.float64):
            torch.manual_seed(0)
            shape = {"d_model": d, "num_layers": layers, "num_heads": 4, "d_ff": 4 * d, "max_seq_len": s}
            model = build_model("gpt2-tiny", vocab_size=512, **shape, dropout=0.0).to(dtype)
            with float64_throughout():
                loss = model(ids, labels=ids, return_logits=False).loss
                loss.backward()
            results[dtype] = (None, loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
        if rank == 0:
            torch.save(results, out)
    finally:
        dist.barrier()
        dist.destroy_process_group()


def test_sequence_parallel_keeps_gathered_inputs_as_shards(cache, tmp_path):
    """Under SP, torch keeps the all-gathered input of each attention and FFN whole on every rank for
    the projections' weight gradients; tformer keeps this rank's shard and gathers it again in
    backward: the saved bytes per rank fall by exactly (1 - 1/tp) of a gathered input per
    sub-layer, the loss and every gradient stay bit for bit those of torch's SP, and activation
    checkpointing (selective, op, full) composes with it (same gradients; what checkpointed blocks
    keep is hidden from saved-tensor hooks, so their bytes are not compared here)."""
    out = tmp_path / "sp.pt"
    run_ranks(2, str(out), cache, worker=_sp_worker)
    results = torch.load(out)
    (_, fp32_loss, fp32), (_, exact_loss, exact) = results.pop(torch.float32), results.pop(torch.float64)
    d, layers, b, s = (SP_SHAPE[k] for k in ("d_model", "num_layers", "batch", "seq"))
    saved = {name: r[0] for name, r in results.items()}
    gathered = 2 * layers * b * s * d * 4  # fp32, two sub-layers per block
    assert saved["sp, torch alone"] - saved["sp"] == gathered - gathered // 2
    assert saved["sp"] < saved["sp, torch alone"] < saved["tp"]
    scale = max(g.abs().max().item() for g in fp32.values())
    yard = yardstick({"loss": fp32_loss, **fp32}, {"loss": exact_loss, **exact}, scale)
    ref_loss, ref_grads = results["sp, torch alone"][1:]
    for name, (_, loss, grads) in results.items():
        if name.startswith("sp"):  # the same collectives in the same order: bit for bit
            assert loss == ref_loss and all(torch.equal(g, ref_grads[n]) for n, g in grads.items()), name
        else:  # tp: an all-reduce where SP reduce-scatters and gathers, in another order
            got, want = {"loss": torch.tensor(loss), **grads}, {"loss": torch.tensor(ref_loss), **ref_grads}
            print(f"{name}: {assert_within(got, want, yard, scale, name):.2f} yardsticks ({yard:.1e})")
    print({name: round(v / saved["tp"], 3) for name, v in saved.items()})


# -- bad input: one line, before any process group -------------------------------------------------


@pytest.mark.parametrize(
    "world,flags,needle",
    [
        (2, ["parallel.tp=3"], "world size 2 is not divisible by parallel.dp_replicate x parallel.tp"),
        (4, ["parallel.tp=2", "parallel.dp_shard=4"], "world size 4 != parallel.dp_replicate x dp_shard x tp"),
        (4, ["parallel.tp=4", "model.num_heads=2", "model.d_model=64"], "parallel.tp=4 does not divide model.num_heads=2"),
        (2, ["parallel.tp=2", "model.num_heads=4", "model.num_kv_heads=1"], "does not divide model.num_kv_heads=1"),
        (2, ["parallel.tp=2", "model.d_ff=127"], "does not divide model.d_ff=127"),
        (2, ["parallel.tp=2", "parallel.strategy=deepspeed"], "parallel.strategy=deepspeed does not compose"),
        (2, ["parallel.dp_replicate=2"], "parallel.dp_replicate=2 (HSDP) needs parallel.strategy=fsdp"),
        (4, ["parallel.tp=2"], "parallel.tp=2 with 2 data-parallel ranks needs parallel.strategy=fsdp"),
        (2, ["parallel.tp=2", "compile=true", "model.position=rotary"], "compile=true with parallel.tp > 1 fails"),
    ],
)
def test_bad_mesh_is_one_line_before_any_process_group(tmp_path, monkeypatch, world, flags, needle):
    import torch.distributed as dist

    monkeypatch.setenv("WORLD_SIZE", str(world))
    recipe = "llama-tiny" if any("kv_heads" in f for f in flags) else "gpt2-tiny"
    cfg = load_config(CONFIGS / f"{recipe}.yaml", small_overrides(recipe, tmp_path, *flags))
    with pytest.raises(ConfigError) as err:
        Trainer(cfg)
    assert needle in str(err.value) and "\n" not in str(err.value)
    assert not dist.is_initialized()


def test_bad_mesh_from_the_cli_is_one_line(tmp_path, cache, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    r = run_cli(["train", str(CONFIGS / "gpt2-tiny.yaml"), f"output_dir={tmp_path}", "parallel.tp=2"], cache, timeout=120)
    assert r.returncode != 0
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "world size 3 is not divisible" in lines[0], r.stderr


def test_parallel_dims_arithmetic():
    dims = ParallelDims.resolve(8, dp_replicate=2, dp_shard=-1, tp=2)
    assert (dims.dp_replicate, dims.dp_shard, dims.tp, dims.dp_size) == (2, 2, 2, 4)
    # rank = ((replica * dp_shard) + shard) * tp + tp_rank: tp peers are neighbours, see one batch
    assert [dims.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [dims.tp_rank(r) for r in range(8)] == [0, 1] * 4
    with pytest.raises(ConfigError):
        ParallelDims.resolve(8, dp_shard=0)


# -- DCP resharding across layouts ------------------------------------------------------------------


def _resume(name, out, ckpt, *flags):
    return _overrides(name, out, "save_every=2", f"resume={ckpt}", *flags)


def test_checkpoints_reshard_between_mesh_layouts(cache, tmp_path, tmp_path_factory):
    """A run saved at (dp_shard 2, tp 2) resumes at (dp 1, tp 2), (dp 2, tp 1) and on one process;
    a 1-process checkpoint resumes at (dp_shard 2, tp 2). Every resumed step's loss is the
    uninterrupted run's to the layout bound: the arithmetic order changes with the layout (TP's partial sums,
    the order of the data-parallel gradient reduction), so not bitwise. The global batch stays 8:
    micro 4 x dp ranks x accumulation."""
    mesh = ["parallel.strategy=fsdp", "parallel.dp_shard=2", "parallel.tp=2", "parallel.sp=true"]
    # the 1-process run, saved at step 2
    recipe, one = _overrides("gpt2", tmp_path / "one", "save_every=2", "grad_accum=2")
    Trainer(load_config(CONFIGS / f"{recipe}.yaml", one)).fit()
    bound = loss_bound(reference("gpt2", tmp_path_factory, 2))  # the same run's yardstick (shared)
    one_ckpt = tmp_path / "one" / "checkpoints" / "step_00000002"
    straight = tmp_path / "straight"
    run_ranks(
        4,
        [
            (recipe, _overrides("gpt2", straight, "save_every=2", *mesh)[1], None),
            (recipe, _resume("gpt2", tmp_path / "from-one", one_ckpt, *mesh)[1], None),
        ],
        cache,
    )
    ckpt = straight / "checkpoints" / "step_00000002"
    run_ranks(
        2,
        [
            (
                recipe,
                _resume("gpt2", tmp_path / "tp2", ckpt, "parallel.strategy=fsdp", "parallel.tp=2", "grad_accum=2")[1],
                None,
            ),
            (recipe, _resume("gpt2", tmp_path / "dp2", ckpt, "parallel.strategy=fsdp", "parallel.dp_shard=2")[1], None),
        ],
        cache,
    )
    Trainer(load_config(CONFIGS / f"{recipe}.yaml", _resume("gpt2", tmp_path / "single", ckpt, "grad_accum=2")[1])).fit()
    base, mesh_losses = losses(tmp_path / "one"), losses(straight)
    assert list(base) == list(mesh_losses) == [1, 2, 3, 4]
    for step in base:
        assert abs(mesh_losses[step] - base[step]) / base[step] <= bound, (step, mesh_losses, base, bound)
    for run, expected in (("tp2", mesh_losses), ("dp2", mesh_losses), ("single", mesh_losses), ("from-one", base)):
        got = losses(tmp_path / run)
        assert list(got) == [3, 4], run
        for step in got:
            assert abs(got[step] - expected[step]) / expected[step] <= bound, (run, step, got, expected, bound)
