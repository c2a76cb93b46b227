"""Pipeline parallelism (torch.distributed.pipelining) on the mesh: pp=2 under gpipe, 1f1b and
interleaved 1f1b equals the 1-process run for GPT-2, Llama, BERT and T5 (split at the
encoder/decoder boundary); pp x dp_shard and pp x tp on 4 processes; checkpoints reshard between pp
degrees. Every spawned group has a timeout that fails the test (see test_mesh.run_ranks): gloo's
point-to-point operations must never hang CI."""

import json
from pathlib import Path

import pytest

from tformer.config import ConfigError
from tformer.parallel.pipeline import stage_layers
from tformer.train.config import load_config
from tformer.train.trainer import Trainer

from test_mesh import CONFIGS, GROUP_TIMEOUT, _overrides, assert_same_run, losses
from test_mesh import loss_bound, one_process, reference, run_cases, run_ranks, small_overrides


pytestmark = pytest.mark.timeout(2 * GROUP_TIMEOUT)  # as in test_mesh: its group deadline fires first
DEEP = ["model.num_layers=4"]  # interleaved: 2 ranks x 2 stages, one block each
# (family, flags, extra model flags shared with the reference, data-parallel ranks x accumulation)
PP2 = [
    ("gpt2", ["parallel.pp_schedule=gpipe"], []),
    ("gpt2", ["parallel.pp_schedule=1f1b"], []),
    ("gpt2", ["parallel.pp_schedule=interleaved_1f1b", "parallel.pp_stages_per_rank=2"], DEEP),
    ("llama", ["parallel.pp_schedule=1f1b"], []),
    ("llama", ["parallel.pp_schedule=gpipe"], []),
    ("llama", ["parallel.pp_schedule=interleaved_1f1b", "parallel.pp_stages_per_rank=2"], DEEP),
    ("bert", ["parallel.pp_schedule=gpipe"], []),
    ("bert", ["parallel.pp_schedule=1f1b"], []),
    ("bert", ["parallel.pp_schedule=interleaved_1f1b", "parallel.pp_stages_per_rank=2"], DEEP),
    ("t5", ["parallel.pp_schedule=1f1b"], []),
    ("t5-v1.1", ["parallel.pp_schedule=gpipe"], []),
    ("gpt2", ["parallel.pp_schedule=1f1b", "compile=true", "parallel.activation_checkpointing=full"], []),
]


# CI: every schedule and every family at least once; the long lane: the rest, and per-block compile
PP2_CI = [0, 3, 8, 9, 10]


@pytest.mark.parametrize(
    "lane",
    [
        pytest.param([PP2[i] for i in PP2_CI], id="ci"),
        pytest.param([c for i, c in enumerate(PP2) if i not in PP2_CI], id="long", marks=pytest.mark.long),
    ],
)
def test_pp2_equals_the_single_process_run(cache, tmp_path_factory, lane):
    """pp=2 on 2 ranks with 2 pipeline micro-batches (grad_accum=2) against 1 process accumulating
    the same 2 micro-batches: losses and updated parameters within test_mesh.LAYOUT_FACTOR times
    the reference's rounding yardstick (fp32); also with per-block compile inside activation
    checkpointing (inductor fuses and reorders float math: not bitwise, the same bound)."""
    tmp = tmp_path_factory.mktemp("pp2")
    run_cases(2, [(name, [*flags, *extra]) for name, flags, extra in lane], tmp, cache, "parallel.pp=2", "grad_accum=2")
    for i, (name, flags, extra) in enumerate(lane):
        assert_same_run(
            f"{name} {flags}",
            tmp / f"run{i}",
            tmp / f"report{i}",
            reference(name, tmp_path_factory, 2, *extra),
        )
        # each rank holds its stages' parameters only (shared embedding on both ends)
        counts = [json.loads(Path(f"{tmp}/report{i}.rank{r}.json").read_text()) for r in (0, 1)]
        assert set(counts[0]) != set(counts[1])
        if "compile=true" in flags:  # each stage's block really ran compiled, inside full AC
            for rank in (0, 1):
                assert int(Path(f"{tmp}/report{i}.graphs{rank}").read_text()) >= 1, (name, rank)


PP4 = [
    ("gpt2", ["parallel.strategy=fsdp", "parallel.pp=2", "parallel.dp_shard=2", "grad_accum=2"], 4),
    (
        "bert",
        ["parallel.strategy=fsdp", "parallel.pp=2", "parallel.dp_shard=2", "grad_accum=2", "parallel.pp_schedule=gpipe"],
        4,
    ),
    ("t5", ["parallel.strategy=fsdp", "parallel.pp=2", "parallel.dp_shard=2", "grad_accum=2"], 4),
    ("llama", ["parallel.pp=2", "parallel.tp=2", "parallel.sp=true", "grad_accum=2"], 2),
    ("gpt2", ["parallel.pp=2", "parallel.tp=2", "grad_accum=2", "parallel.activation_checkpointing=full"], 2),
]


def test_pp_with_dp_shard_and_tp_on_four_ranks(cache, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pp4")
    run_cases(4, [(name, flags) for name, flags, _ in PP4], tmp, cache)
    for i, (name, flags, accum) in enumerate(PP4):
        assert_same_run(f"{name} {flags}", tmp / f"run{i}", tmp / f"report{i}", reference(name, tmp_path_factory, accum))


def test_pipeline_checkpoints_reshard_to_one_process_and_back(cache, tmp_path, tmp_path_factory):
    """Saved at pp=2 (step 2) -> resumed on one process; saved on one process -> resumed at pp=2:
    each resumed step's loss equals the uninterrupted run's (test_mesh.loss_bound)."""
    recipe, one = _overrides("gpt2", tmp_path / "one", "save_every=2", "grad_accum=2")
    Trainer(load_config(CONFIGS / f"{recipe}.yaml", one)).fit()
    bound = loss_bound(reference("gpt2", tmp_path_factory, 2))  # the same run's yardstick (shared)
    pp = ["parallel.pp=2", "grad_accum=2", "save_every=2"]
    run_ranks(
        2,
        [
            (recipe, _overrides("gpt2", tmp_path / "pp", *pp)[1], None),
            (
                recipe,
                _overrides(
                    "gpt2", tmp_path / "pp-from-one", *pp, f"resume={tmp_path / 'one' / 'checkpoints' / 'step_00000002'}"
                )[1],
                None,
            ),
        ],
        cache,
    )
    Trainer(
        load_config(
            CONFIGS / f"{recipe}.yaml",
            _overrides(
                "gpt2",
                tmp_path / "one-from-pp",
                "grad_accum=2",
                f"resume={tmp_path / 'pp' / 'checkpoints' / 'step_00000002'}",
            )[1],
        )
    ).fit()
    base, piped = losses(tmp_path / "one"), losses(tmp_path / "pp")
    assert list(base) == list(piped) == [1, 2, 3, 4]
    for run, expected in (("pp-from-one", base), ("one-from-pp", piped)):
        got = losses(tmp_path / run)
        assert list(got) == [3, 4], run
        for step in got:
            assert abs(got[step] - expected[step]) / expected[step] <= bound, (run, step, got, expected, bound)


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["parallel.pp=4"], "4 pipeline stages (parallel.pp=4) exceed the model's 2 blocks"),
        (["parallel.pp=2", "parallel.pp_layers=[1,2]"], "parallel.pp_layers=[1, 2] must list 2 positive block counts"),
        (["parallel.pp=2", "parallel.pp_schedule=zb"], "parallel.pp_schedule='zb' is not known"),
        (["parallel.pp=2", "parallel.strategy=deepspeed"], "parallel.pp does not compose with parallel.strategy=deepspeed"),
        (
            [
                "parallel.pp=2",
                "parallel.pp_schedule=interleaved_1f1b",
                "parallel.pp_stages_per_rank=2",
                "model.num_layers=6",
            ],
            "with 4 stages does not divide the model's 6 blocks evenly",
        ),
        (["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b"], "needs parallel.pp_stages_per_rank >= 2"),
    ],
)
def test_bad_pipeline_is_one_line_before_any_process_group(tmp_path, monkeypatch, flags, needle):
    import torch.distributed as dist

    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = load_config(CONFIGS / "gpt2-tiny.yaml", small_overrides("gpt2-tiny", tmp_path, *flags))
    with pytest.raises(ConfigError) as err:
        Trainer(cfg)
    assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)
    assert not dist.is_initialized()


def test_t5_layouts_other_than_the_boundary_are_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    cfg = load_config(CONFIGS / "t5-tiny.yaml", small_overrides("t5-tiny", tmp_path, "parallel.pp=4"))
    with pytest.raises(ConfigError, match="split only at the encoder/decoder boundary"):
        Trainer(cfg)


def test_stage_layers_split_evenly_or_as_listed():
    assert stage_layers(5, 2) == [range(0, 3), range(3, 5)]
    assert stage_layers(4, 4) == [range(i, i + 1) for i in range(4)]
    assert stage_layers(6, 2, [2, 4]) == [range(0, 2), range(2, 6)]


def test_an_imported_hf_checkpoint_starts_tp_and_pp_runs(cache, tmp_path):
    """A weights-only checkpoint (``tformer import`` of an HF export) resumed under tp=2 and pp=2:
    each rank takes its shard / its stages, and the runs continue as the 1-process run does."""
    from tformer.export import export_hf, import_hf

    recipe, first = _overrides("llama", tmp_path / "first", "max_steps=2", "model.d_head=16")
    Trainer(load_config(CONFIGS / f"{recipe}.yaml", first)).fit()
    imported = import_hf(
        export_hf(tmp_path / "first" / "checkpoints" / "step_00000002", tmp_path / "hf"), tmp_path / "imported"
    )
    ckpt = imported / "checkpoints" / "step_00000000"
    runs = {"one": [], "tp2": ["parallel.tp=2"], "pp2": ["parallel.pp=2"]}
    flags = {
        name: _overrides("llama", tmp_path / name, "grad_accum=2", "model.d_head=16", f"resume={ckpt}", *extra)[1]
        for name, extra in runs.items()
    }
    one = one_process("llama", tmp_path / "one", "grad_accum=2", "model.d_head=16", f"resume={ckpt}")
    run_ranks(2, [(recipe, flags["tp2"], None), (recipe, flags["pp2"], None)], cache)
    base = one.losses
    assert list(base) == [1, 2, 3, 4]
    for name in ("tp2", "pp2"):
        got = losses(tmp_path / name)
        assert list(got) == [1, 2, 3, 4], name
        for step in got:
            assert abs(got[step] - base[step]) / base[step] <= loss_bound(one), (name, step, got, base, one.yardstick)
