"""Seeing inside a run: profiler traces of chosen steps, profile-report's time split, the slow rank
named, the stuck collective named, TensorBoard beside W&B, and one-line errors for bad input."""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import sys
from pathlib import Path

import pytest
import torch

from tformer.train.config import load_config
from tformer.train.trainer import Trainer

from train_helpers import CONFIGS, become_rank, free_port, metrics, small_overrides, spawn_ranks, start_ranks

RANGES = {"tformer/step", "tformer/data", "tformer/forward", "tformer/backward", "tformer/optimizer"}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    path = tmp_path_factory.mktemp("tformer-cache-observe")
    os.environ["TFORMER_CACHE"] = str(path)
    return path


def _overrides(out, *extra):
    # a tokenizer trained on fewer rows: this module trains its own (its cache), in seconds
    base = ["max_steps=6", "eval_every=0", "save_every=0", "micro_batch_size=4", "data.tokenizer_max_rows=4000"]
    return small_overrides("gpt2-tiny", out, *base, *extra)


def _trace_names(path: Path) -> set[str]:
    with gzip.open(path, "rt") as f:  # a gzip'd Chrome trace
        trace = json.load(f)
    return {e.get("name", "") for e in trace["traceEvents"]}


def _check_run(out: Path, ranks: list[int], collectives: bool) -> None:
    """Traces of steps 3 and 4 only, with tformer's ranges; profile-report's split of each adds up
    to the step time the trainer measured for it (metrics.jsonl: rank 0's) within 10%."""
    from tformer.train.observe.profile_report import analyse

    step_time = {r["step"]: r["step_time"] for r in metrics(out)}
    for rank in ranks:
        d = out / "profile" / f"rank{rank}"
        assert sorted(p.name for p in d.glob("*.trace.json*")) == ["step3.trace.json.gz", "step4.trace.json.gz"]
        names = _trace_names(d / "step3.trace.json.gz")
        assert RANGES <= names, RANGES - names
        assert any(n.startswith("aten::") for n in names)
        if collectives:
            assert any("c10d" in n or "all_gather" in n for n in names)
    splits = analyse(out)
    assert sorted((s.rank, s.step) for s in splits) == [(r, s) for r in ranks for s in (3, 4)]
    for s in splits:
        total = sum(s.parts.values())
        assert s.parts["GEMMs"] > 0 and s.parts["optimizer"] > 0, s.parts
        assert s.measured is not None and abs(total - s.measured) <= 0.1 * s.measured, (total, s.measured)
        if s.rank == 0:
            assert abs(total - step_time[s.step]) <= 0.1 * step_time[s.step], (total, step_time[s.step])
        assert len(s.top) == 10
        if collectives:
            assert s.parts["collectives exposed"] > 0


def test_traces_of_chosen_steps_one_process_report_and_tensorboard(cache, tmp_path, capsys, caplog):
    """One 6-step run: traces of steps 3-4 only, the CPU memory line, profile-report's split and
    PNG, and TensorBoard's own reader finds the scalars of metrics.jsonl."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tformer.cli import main

    out = tmp_path / "run"
    cfg = load_config(
        CONFIGS / "gpt2-tiny.yaml",
        _overrides(out, "profile.steps=3-4", "profile.memory=true", "tensorboard.enabled=true"),
    )
    with caplog.at_level("WARNING", logger="tformer.train"):
        Trainer(cfg).fit()
    assert "profile.memory: allocator snapshots need CUDA" in caplog.text
    _check_run(out, [0], collectives=False)
    assert "[memory]" in _trace_names(out / "profile" / "rank0" / "step3.trace.json.gz")  # the CPU's memory events
    capsys.readouterr()
    assert main(["profile-report", str(out)]) == 0
    text = capsys.readouterr().out
    assert "rank 0, step 3" in text and "top 10 ops by self time" in text and "collectives exposed" in text
    assert "tformer plan --calibrate" in text  # a CPU run: how to get the prediction
    assert (out / "profile" / "split.png").stat().st_size > 1000
    # TensorBoard: the same scalars as metrics.jsonl, and the config as text
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    rows = metrics(out)
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "mfu"):
        events = acc.Scalars(key)
        assert [e.step for e in events] == [r["step"] for r in rows]
        assert [e.value for e in events] == pytest.approx([r[key] for r in rows], rel=1e-6)
    assert [(e.step, e.value) for e in acc.Scalars("val_loss")] == [(6, pytest.approx(rows[-1]["val_loss"]))]
    assert "config/text_summary" in acc.Tags()["tensors"]
    # the traces where TensorBoard's profile plugin looks for them
    plugin = out / "tensorboard" / "plugins" / "profile"
    assert sorted(p.relative_to(plugin).as_posix() for p in plugin.rglob("*.pt.trace.json.gz")) == [
        "step3/rank0.pt.trace.json.gz",
        "step4/rank0.pt.trace.json.gz",
    ]


def test_profiling_off_creates_no_profiler_and_records_no_range(cache, tmp_path, monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("profiler code ran with profiling off")

    # tformer's ranges are torch.profiler.record_function; torch's DataLoader keeps its own (the
    # same class under torch.autograd.profiler), which is torch's cost, not ours
    monkeypatch.setattr(torch.profiler, "record_function", refuse)
    monkeypatch.setattr(torch.profiler, "profile", refuse)
    monkeypatch.setattr(torch.autograd.profiler, "profile", refuse)
    cfg = load_config(CONFIGS / "gpt2-tiny.yaml", _overrides(tmp_path, "max_steps=2"))
    Trainer(cfg).fit()
    assert not (tmp_path / "profile").exists()


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["profile.steps=5-9"], "profile.steps='5-9' lies outside the run (steps 1 to max_steps=6)"),
        (["profile.steps=0"], "profile.steps=0 lies outside the run"),
        (["profile.steps=4-3"], "profile.steps='4-3' is malformed; use a range such as profile.steps=3-4"),
        (["profile.steps=three"], "profile.steps='three' is malformed"),
        (["profile.steps=3", "profile.ranks=[0,2]"], "profile.ranks=[0, 2] names rank(s) [2] but the run has 1 rank(s)"),
    ],
)
def test_bad_profile_input_is_one_line_before_any_work(cache, tmp_path, capsys, overrides, match):
    from tformer.cli import main

    out = tmp_path / "run"
    rc = main(["train", str(CONFIGS / "gpt2-tiny.yaml"), *_overrides(out, *overrides)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0 and match in err, err
    assert not out.exists()


def test_profile_report_without_traces_and_tensorboard_missing_are_one_line(cache, tmp_path, capsys, monkeypatch):
    import importlib.util

    from tformer.cli import main

    assert main(["profile-report", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "holds no profiler traces" in err and "profile.steps=3-4" in err
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    out = tmp_path / "run"
    assert main(["train", str(CONFIGS / "gpt2-tiny.yaml"), *_overrides(out, "tensorboard.enabled=true")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "pip install 'tformer[tensorboard]'" in err, err
    assert not out.exists()


# -- 2 ranks: traces under FSDP2 and TP, the slow rank --------------------------------------------


def _worker(rank, world, port, jobs, cache):
    become_rank(rank, world, port, cache, 120)
    import time

    import torch.distributed as dist

    try:
        for overrides, slow, console in jobs:
            trainer = Trainer(load_config(CONFIGS / "gpt2-tiny.yaml", overrides))
            if slow is not None and rank == slow:  # this rank's own work takes 0.3 s longer a step
                backward = trainer.strategy.backward

                def late(*a, backward=backward, **k):
                    backward(*a, **k)
                    time.sleep(0.3)

                trainer.strategy.backward = late
            if console and rank == 0:
                sys.stdout = open(console, "w")
            trainer.fit()
            sys.stdout.flush()
    finally:
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def test_two_ranks_fsdp_and_tp_traces_and_the_slow_rank_named(cache, tmp_path):
    """FSDP2 and TP runs traced on both ranks; in a third (DDP, one small block, so that a loaded
    machine's noise stays well below 0.3 s) rank 1 takes 0.3 s longer a step, after its backward."""
    fsdp, tp, slow = tmp_path / "fsdp", tmp_path / "tp", tmp_path / "slow"
    every = ["profile.steps=3-4", "profile.ranks=[0,1]"]
    small = ["max_steps=5", "model.num_layers=1", "micro_batch_size=2"]
    jobs = [
        (_overrides(fsdp, "parallel.strategy=fsdp", *every), None, None),
        (_overrides(tp, "parallel.strategy=fsdp", "parallel.tp=2", *every), None, None),
        (_overrides(slow, *small), 1, str(tmp_path / "console.txt")),
    ]
    spawn_ranks(_worker, (2, free_port(), jobs, cache), 2, 300)
    _check_run(fsdp, [0, 1], collectives=True)
    _check_run(tp, [0, 1], collectives=True)
    rows = metrics(slow)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    for r in rows:
        assert {"data_wait", "data_wait_min", "data_wait_median", "data_wait_max", "data_wait_max_rank"} <= set(r)
        assert r["rank_step_time_min"] <= r["rank_step_time_median"] <= r["rank_step_time_max"]
    later = rows[1:]  # the first step's start-up can hide 0.3 s
    assert all(r.get("slow_rank", 1) == 1 for r in later)  # no other rank is named
    named = [r for r in later if r.get("slow_rank") == 1 and r["rank_step_time_max"] - r["rank_step_time_min"] > 0.25]
    assert len(named) >= 3, later  # one step of four may drown in a loaded machine's noise
    console = (tmp_path / "console.txt").read_text()
    assert "slowest rank 1:" in console and "x the median step" in console


# -- the stuck collective named ---------------------------------------------------------------


def _skipping_worker(rank, world, port, out, cache):
    """Rank 1 skips the loss all-reduce of step 3 and stays in that step (its watchdog fires too)."""
    become_rank(rank, world, port, cache, 120)
    import time

    import tformer.train.trainer as trainer_module

    calls = []
    real = trainer_module.all_reduce

    def skip_third(t, *a, **k):
        calls.append(1)
        if rank == 1 and len(calls) == 3:
            time.sleep(120)  # never joins: the watchdog ends this process first
        return real(t, *a, **k)

    trainer_module.all_reduce = skip_third
    cfg = load_config(CONFIGS / "gpt2-tiny.yaml", _overrides(out, "watchdog_timeout=3"))
    Trainer(cfg).fit()


def test_watchdog_names_the_collective_a_rank_never_joined(cache, tmp_path):
    import time

    ctx = start_ranks(_skipping_worker, (2, free_port(), tmp_path, cache), 2)
    deadline = time.monotonic() + 120
    try:
        while not all(p.exitcode is not None for p in ctx.processes):
            assert time.monotonic() < deadline, "the watchdog did not end the hung ranks in 120 s"
            time.sleep(0.5)
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    from tformer.train.observe.watchdog import EXIT_CODE

    assert [p.exitcode for p in ctx.processes] == [EXIT_CODE, EXIT_CODE]
    d = tmp_path / "watchdog"
    assert (d / "flight_rank0.json").exists() and (d / "flight_rank0_cpu.pkl").exists()  # gloo: the generic recorder
    report = (d / "report_rank0.txt").read_text()
    # the loss all-reduce of step 3: the 3rd collective of the default group this run made on rank 0
    # after start-up; rank 1's last is the one before it
    entered = json.loads((d / "flight_rank0.json").read_text())["entries"][-1]
    assert entered["profiling_name"] == "gloo:all_reduce" and entered["input_sizes"] == [[5]]
    seq = entered["collective_seq_id"]
    assert f"rank(s) [0] entered gloo:all_reduce #{seq} (sizes [[5]])" in report, report
    assert f"rank 1 never joined it (its last: gloo:all_reduce #{seq - 1})" in report, report


def test_device_split_of_a_gpu_trace():
    """A GPU trace is split on the device's timeline: compute before communication (a collective
    kernel beside a GEMM is overlapped, alone exposed), kernels launched in the optimizer range are
    the optimizer's, an idle device inside tformer/data is data loading, the rest idle."""
    from tformer.train.observe.profile_report import split_step

    def span(name, ts, dur, cat="cpu_op", **args):
        return {"ph": "X", "name": name, "ts": ts, "dur": dur, "cat": cat, "tid": 1, "args": args}

    events = [
        span("tformer/step", 0, 100, "user_annotation"),
        span("tformer/data", 0, 10, "user_annotation"),
        span("tformer/optimizer", 60, 30, "user_annotation"),
        span("cudaLaunchKernel", 62, 1, "cuda_runtime", correlation=7),
        span("sm90_xmma_gemm_bf16", 10, 30, "kernel", correlation=1),
        span("ncclDevKernel_AllReduce_Sum_f32", 30, 30, "kernel", correlation=2),
        span("multi_tensor_apply_kernel", 70, 10, "kernel", correlation=7),
        span("pytorch_flash::flash_fwd_kernel", 85, 5, "kernel", correlation=3),
    ]
    s = split_step(events, 0, 3)
    ms = {k: round(v * 1e6, 6) for k, v in s.parts.items()}
    assert ms == {
        "GEMMs": 30,
        "attention": 5,
        "other compute": 0,
        "collectives exposed": 20,
        "optimizer": 10,
        "data loading": 10,
        "idle": 25,
    }
    assert round(s.overlapped * 1e6, 6) == 10 and sum(s.parts.values()) == pytest.approx(100e-6)


@pytest.mark.parametrize("steps, every, traced", [("3-4", None, [3, 4]), ([2, 5], 4, [2, 5, 6, 9, 10]), (7, 3, [7, 10])])
def test_traced_steps_from_a_range_a_list_and_every(steps, every, traced):
    from tformer.train.config import ProfileConfig

    assert ProfileConfig(steps=steps, every=every).traced(10) == traced


def test_each_run_of_traced_steps_gets_a_profiler_started_one_step_early(tmp_path, monkeypatch):
    """Steps 1, 3-4 of 5: two profilers (step 1 has no step before it; 3-4 warm up in step 2),
    one trace per traced step, none of the others, each with its step range."""
    from tformer.parallel.dist import DistInfo
    from tformer.train.config import ProfileConfig
    from tformer.train.observe.profiling import build_profiler

    started = []
    real = torch.profiler.profile

    def counting(*a, **k):
        started.append(k["schedule"])
        return real(*a, **k)

    monkeypatch.setattr(torch.profiler, "profile", counting)
    prof = build_profiler(ProfileConfig(steps=[1, 3, 4]), 5, DistInfo(), tmp_path, "fp32")
    x = torch.randn(64, 64)
    begun = []
    for step in range(1, 6):
        prof.before_step(step)
        begun.append(len(started))
        with prof.range("forward"):
            (x @ x).sum()
        prof.after_step(step, 0.01)
    prof.close()
    assert begun == [1, 2, 2, 2, 2]  # the second profiler starts before step 2, the warm-up of step 3
    assert [started[1](k).name for k in range(4)] == ["WARMUP", "RECORD_AND_SAVE", "RECORD_AND_SAVE", "NONE"]
    d = tmp_path / "profile" / "rank0"
    assert sorted(p.name for p in d.glob("*.trace.json.gz")) == [f"step{n}.trace.json.gz" for n in (1, 3, 4)]
    for n in (1, 3, 4):
        assert {"tformer/step", "tformer/forward", "aten::mm"} <= _trace_names(d / f"step{n}.trace.json.gz")
    assert set(json.loads((d / "steps.json").read_text())["step_time"]) == {"1", "3", "4"}


def _fake_allocator(monkeypatch) -> list:
    """CUDA's allocator-history calls, recorded on a machine without CUDA: a dump writes a file."""
    calls: list = []

    def record(enabled="all", **kw):
        calls.append(("record", enabled, kw))

    def dump(path):
        calls.append(("dump", Path(path).name))
        Path(path).write_bytes(b"snapshot")

    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", record)
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", dump)
    return calls


def test_memory_history_runs_from_the_first_step_and_an_oom_writes_its_snapshot(tmp_path, monkeypatch, caplog):
    """profile.memory=true on CUDA, no traced steps (the allocator calls faked): the history is
    recorded from step 1 to the end, so the snapshot an OOM writes at step 3 holds what led to it;
    nothing is dumped at the steps before it; the history stops when the run ends. On a CPU the
    same section makes no profiler and says so in one line."""
    from tformer.parallel.dist import DistInfo
    from tformer.train.config import ProfileConfig
    from tformer.train.observe.profiling import MEMORY_EVENTS, OFF, build_profiler

    calls = _fake_allocator(monkeypatch)
    cuda = DistInfo(device=torch.device("cuda"))
    prof = build_profiler(ProfileConfig(memory=True), 10, cuda, tmp_path, "bf16")
    assert prof is not OFF and prof.prof is None  # no torch.profiler: no step is traced
    for step in (1, 2):
        prof.before_step(step)
        prof.after_step(step, 0.1)
    prof.before_step(3)
    prof.on_oom(3)
    prof.close()
    assert calls == [
        ("record", "all", {"max_entries": MEMORY_EVENTS, "stacks": "python"}),
        ("dump", "memory_step3_oom.pickle"),
        ("record", None, {}),
    ]
    assert (tmp_path / "profile" / "rank0" / "memory_step3_oom.pickle").read_bytes() == b"snapshot"
    # a rank that does not profile records nothing
    other = DistInfo(rank=1, world_size=2, device=cuda.device)
    assert build_profiler(ProfileConfig(memory=True), 10, other, tmp_path, "bf16") is OFF
    with caplog.at_level("WARNING", logger="tformer.train"):
        assert build_profiler(ProfileConfig(memory=True), 10, DistInfo(), tmp_path, "fp32") is OFF
    assert [r.message for r in caplog.records if "profile.memory" in r.message][0].count("\n") == 0


def test_an_oom_in_a_step_reaches_the_profiler_with_the_step_in_flight(cache, tmp_path, monkeypatch):
    """The trainer hands an out-of-memory error to the profiler (the snapshot) before it stops, with
    the number of the step that ran out, and the error still ends the run."""
    import tformer.train.trainer as trainer_module

    seen: list = []

    class Recorder:
        active = False

        def range(self, name):
            return contextlib.nullcontext()

        def before_step(self, step):
            pass

        def after_step(self, step, step_time):
            pass

        def on_oom(self, step):
            seen.append(step)

        def close(self):
            seen.append("closed")

    monkeypatch.setattr(trainer_module, "build_profiler", lambda *a, **k: Recorder())

    trainer = Trainer(load_config(CONFIGS / "gpt2-tiny.yaml", _overrides(tmp_path)))
    forward, calls = trainer.model.forward, []

    def runs_out_in_step_3(*a, **k):  # one forward a step (one micro-batch, no evaluation)
        calls.append(1)
        if len(calls) == 3:
            raise torch.OutOfMemoryError("CUDA out of memory (raised by the test)")
        return forward(*a, **k)

    monkeypatch.setattr(trainer.model, "forward", runs_out_in_step_3)
    with pytest.raises(torch.OutOfMemoryError):
        trainer.fit()
    assert seen == [3, "closed"]


def test_the_watchdog_dumps_nccls_own_flight_recorder_beside_the_generic_one(tmp_path, monkeypatch):
    """NCCL's collectives go to ProcessGroupNCCL's own recorder (a CUDA build's
    ``_dump_nccl_trace*``), not to the generic one gloo's land in: the dump reads both (faked here,
    a CPU build has no NCCL), keeps finished entries (``onlyActive`` false), writes each one's
    pickle and one JSON of all entries, which names the stuck NCCL collective."""
    from torch._C import _distributed_c10d as c10d

    from tformer.train.observe.watchdog import dump_flight_recorder, stuck_collectives

    def entry(name, seq):
        return {"profiling_name": name, "collective_seq_id": seq, "process_group": ["0", "default"], "input_sizes": [[8]]}

    asked = []

    def recorder(entries, tag):
        def as_json(collectives, only_active):
            asked.append((tag, collectives, only_active))
            return json.dumps({"version": "2.10", "entries": entries})

        return as_json, lambda collectives, stacks, only_active: tag.encode()

    nccl_json, nccl_pickle = recorder([entry("nccl:all_reduce", 1), entry("nccl:all_reduce", 2)], "nccl")
    cpu_json, cpu_pickle = recorder([entry("gloo:broadcast", 1)], "cpu")
    monkeypatch.setattr(c10d, "_dump_nccl_trace_json", nccl_json, raising=False)
    monkeypatch.setattr(c10d, "_dump_nccl_trace", nccl_pickle, raising=False)
    monkeypatch.setattr(c10d, "_dump_fr_trace_json", cpu_json)
    monkeypatch.setattr(c10d, "_dump_fr_trace", cpu_pickle)
    mine = dump_flight_recorder(tmp_path, 0)
    assert asked == [("nccl", True, False), ("cpu", True, False)]
    assert (tmp_path / "flight_rank0.pkl").read_bytes() == b"nccl" and (
        tmp_path / "flight_rank0_cpu.pkl"
    ).read_bytes() == b"cpu"
    assert json.loads((tmp_path / "flight_rank0.json").read_text()) == mine
    assert [e["profiling_name"] for e in mine["entries"]] == ["nccl:all_reduce", "nccl:all_reduce", "gloo:broadcast"]
    peer = {"entries": [entry("nccl:all_reduce", 1), entry("gloo:broadcast", 1)]}
    report = stuck_collectives({0: mine, 1: peer}, 2)
    assert (
        "rank(s) [0] entered nccl:all_reduce #2 (sizes [[8]]), rank 1 never joined it (its last: nccl:all_reduce #1)"
        in report
    )
