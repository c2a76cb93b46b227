"""The benchmarks' verdicts: a PASS line must be able to read FAIL or MISS. Each check function of
bench/ is fed a failing result (a run that exited 2, two untrained models, a planner far off) and
the like-with-like contenders of bench_trainer are checked to do the same work."""

from __future__ import annotations

import sys

import pytest

from train_helpers import ROOT, small_overrides

sys.path.insert(0, str(ROOT / "bench"))

import bench_memory  # noqa: E402
import bench_packed_mlm  # noqa: E402
import bench_trainer  # noqa: E402
import bench_translate  # noqa: E402
from bench_trainer import Rate, Start  # noqa: E402


def test_start_time_fails_when_the_run_failed_however_fast(tmp_path):
    """An unusable cache directory: tformer train exits 2 within seconds; the start-time line once
    read '2.4s ... PASS' for it."""
    blocked = tmp_path / "cache-is-a-file"
    blocked.write_text("")
    env = {**__import__("os").environ, "TFORMER_CACHE": str(blocked / "sub")}
    start = bench_trainer.first_step_seconds(tmp_path / "run", timeout=120, env=env)
    assert start.returncode == 2 and not start.logged, start
    line = bench_trainer.start_line([start])
    assert line.split("target <= 15 s")[1].split()[0] == "FAIL", line
    assert "exit 2" in line and start.error in line and start.error.startswith("error:"), line
    assert "PASS" in bench_trainer.start_line([Start(2.4, 0, True, "")])
    assert "MISS" in bench_trainer.start_line([Start(20.0, 0, True, "")])
    assert "FAIL" in bench_trainer.start_line([Start(2.4, 0, False, "")])  # exit 0, nothing logged
    assert "FAIL" in bench_trainer.start_line([Start(2.4, None, True, "")])  # killed at the deadline


def test_trainer_overhead_fails_unless_both_sides_did_the_same_work():
    same = [Rate(1000.0, [7.5, 7.0]), Rate(990.0, [7.5, 7.1])]
    assert "PASS" in bench_trainer.overhead_line(same[:1], same[1:], steps=2)
    assert "MISS" in bench_trainer.overhead_line([Rate(1000.0, [7.5, 7.0])], [Rate(500.0, [7.5, 7.1])], steps=2)
    for bare, trainer in (
        (Rate(1000.0, [7.5, 7.0]), Rate(990.0, [7.4, 7.1])),  # another start: other weights or batch
        (Rate(1000.0, [7.5, 7.0]), Rate(990.0, [7.5])),  # the trainer stopped early
        (Rate(1000.0, [7.5, float("nan")]), Rate(990.0, [7.5, 7.1])),
    ):
        assert "FAIL" in bench_trainer.overhead_line([bare], [trainer], steps=2), (bare, trainer)


def test_bare_loop_runs_the_trainers_step(tmp_path, monkeypatch):
    """The bare loop computes what the trainer does: the chunked loss-only head (it once computed
    full logits), from the trainer's initial weights and batches (equal first losses)."""
    import tformer.models.base as base

    monkeypatch.setenv("TFORMER_CACHE", str(tmp_path / "cache"))
    calls = []
    chunked = base.chunked_lm_loss
    monkeypatch.setattr(base, "chunked_lm_loss", lambda *a, **k: calls.append(1) or chunked(*a, **k))
    args = small_overrides("gpt2-tiny", tmp_path / "x", "eval_every=0", "save_every=0", "model.dropout=0.0")[1:]
    bare = bench_trainer.bare_rate(args, 3, tmp_path / "bare")
    assert len(calls) == 3, "the bare loop did not use the trainer's chunked head"
    trainer = bench_trainer.trainer_rate(args, 3, tmp_path / "trainer")
    assert bare.losses[0] == pytest.approx(trainer.losses[0], rel=1e-6)
    assert "FAIL" not in bench_trainer.overhead_line([bare], [trainer], steps=3)


def test_translation_quality_fails_when_nothing_was_learnt():
    line = bench_translate.quality_line(0.07, 0.13, 6.152, 6.152, trained=True)  # README's 100-step run
    assert line.startswith("FAIL") and "train longer" in line, line
    assert bench_translate.quality_line(5.0, 5.2, 4.0, 4.01, trained=True).startswith("PASS")
    assert bench_translate.quality_line(3.0, 5.2, 4.0, 4.0, trained=True).startswith("MISS")  # BLEU behind
    assert bench_translate.quality_line(5.2, 5.2, 4.5, 4.0, trained=True).startswith("MISS")  # NLL behind
    assert bench_translate.quality_line(5.0, 5.2, 4.0, 4.0, trained=False).startswith("FAIL")


def test_memory_bench_prints_a_planner_verdict():
    mb = bench_memory.MB
    assert bench_memory.planner_verdict(110 * mb, 100 * mb).endswith("PASS")
    assert bench_memory.planner_verdict(86 * mb, 100 * mb).endswith("PASS")
    assert bench_memory.planner_verdict(120 * mb, 100 * mb).endswith("MISS")
    assert bench_memory.planner_verdict(50 * mb, 100 * mb).endswith("MISS")
    assert bench_memory.planner_verdict(50 * mb, 0).endswith("FAIL")


def test_plan_speed_order_fails_a_pair_the_machine_told_apart_and_forgives_a_tie():
    """bench_plan_speed's order check: a pair measured apart by more than its spread must be in the
    predicted order; a pair within its spread is a tie either way."""
    from bench_plan_speed import misordered, tied

    measured = {"1 process": 0.10, "fsdp 2": 0.240, "pp=2": 0.245, "tp=2": 0.30}
    spreads = {"1 process": 0.05, "fsdp 2": 0.05, "pp=2": 0.05, "tp=2": 0.05}
    assert tied("fsdp 2", "pp=2", measured, spreads) and not tied("pp=2", "tp=2", measured, spreads)
    right = {"1 process": 0.1, "fsdp 2": 0.26, "pp=2": 0.25, "tp=2": 0.31}  # fsdp/pp swapped: a tie
    assert misordered(measured, right, spreads) == []
    wrong = {"1 process": 0.1, "fsdp 2": 0.24, "pp=2": 0.25, "tp=2": 0.23}  # tp predicted fastest of three
    assert misordered(measured, wrong, spreads) == [("fsdp 2", "tp=2"), ("pp=2", "tp=2")]
    # with no spread (one round) every pair counts
    assert misordered(measured, right, dict.fromkeys(measured, 0.0)) == [("fsdp 2", "pp=2")]


def test_plan_speed_order_fails_when_the_machine_settled_too_few_pairs():
    """On a noisy machine every spread is wide and every pair a tie: the order check then checked
    nothing, and a reversed prediction must not read PASS. The lines say how many pairs it checked."""
    from bench_plan_speed import order_verdict

    measured = {"1 process": 0.10, "fsdp 2": 0.240, "pp=2": 0.245, "tp=2": 0.30}
    reversed_guess = {name: 1 / t for name, t in measured.items()}
    ok, lines = order_verdict(measured, measured, dict.fromkeys(measured, 0.05))
    assert ok and "order checked on 5 of 6 pairs" in lines, lines
    ok, lines = order_verdict(measured, reversed_guess, dict.fromkeys(measured, 0.05))
    assert not ok and "out of order: " in lines[-1] and "none" not in lines[-1], lines
    # spreads of 200%: every pair a tie, so nothing is out of order, yet the reversed order fails
    ok, lines = order_verdict(measured, reversed_guess, dict.fromkeys(measured, 2.0))
    assert not ok and "out of order: none" in lines, lines
    assert "order checked on 0 of 6 pairs: fewer than 50%, the machine was too noisy to check the order" in lines
    # spreads of 150%: only 1 process against tp=2 told apart, fewer than half the pairs
    ok, lines = order_verdict(measured, measured, dict.fromkeys(measured, 1.5))
    assert not ok and any(line.startswith("order checked on 1 of 6 pairs: fewer") for line in lines), lines


def test_moe_bench_fails_unless_the_balancing_loss_beats_no_loss_and_exits_non_zero_on_a_miss(monkeypatch):
    import bench_moe

    assert bench_moe.balance_lines(1.18, 3.30, 300)[1].startswith("PASS")  # the docstring's run
    assert bench_moe.balance_lines(1.18, 1.10, 300)[1].startswith("MISS")  # better without the loss
    assert bench_moe.balance_lines(1.18, 1.18, 300)[1].startswith("MISS")
    assert bench_moe.balance_lines(1.60, 3.30, 300)[1].startswith("MISS")
    assert not bench_moe.failed(["block: ...", "PASS a", "  (fastest ...)", "PASS b"])
    assert bench_moe.failed(["PASS a", "MISS b"]) and bench_moe.failed(["FAIL all-to-all: did not finish"])
    monkeypatch.setattr(bench_moe.torch, "set_num_threads", lambda n: None)  # main's: not this process's
    monkeypatch.setattr(bench_moe, "bench_balance", lambda args: bench_moe.balance_lines(1.18, 1.10, args.steps))
    assert bench_moe.main(["--part", "balance"]) == 1
    monkeypatch.setattr(bench_moe, "bench_balance", lambda args: bench_moe.balance_lines(1.18, 3.30, args.steps))
    assert bench_moe.main(["--part", "balance"]) == 0


def test_ft_bench_verdicts_read_miss_or_fail():
    """bench_ft's lines: the overhead ratio, wall time lost per failure (each side against its own
    failure-free run), the recovery time; a run that did not finish is a FAIL, never a figure."""
    import bench_ft
    from bench_ft import Run

    assert bench_ft.overhead_line([0.100], [0.105], same=True).startswith("PASS")
    assert bench_ft.overhead_line([0.100], [0.120], same=True).startswith("MISS")
    assert bench_ft.overhead_line([0.100], [0.090], same=False).startswith("FAIL")  # other losses
    assert bench_ft.overhead_line([], [], same=True, error="exit 2: ...").startswith("FAIL")

    def sides(lost_restart: float, lost_ft: float, recoveries=(12.0, 14.0, 13.0), error="", stalls=(5.2, 5.9, 5.5)):
        restart = (
            Run(wall=100.0, kept_s=80.0),
            Run(wall=100 + 3 * lost_restart, kept_s=80.0, kills=[75, 175, 275], rolled_back=75, step_s=0.2),
        )
        ft = (
            Run(wall=90.0, kept_s=80.0),
            Run(wall=90 + 3 * lost_ft, kept_s=80.0, kills=[75, 175, 275], recoveries=list(recoveries), error=error),
        )
        ft[1].step_s, ft[1].stalls = 0.2, list(stalls)
        return bench_ft.failure_lines(restart, ft, samples_per_step=16, heartbeat_s=5.0)

    good = sides(30.0, 6.0)
    assert [x.split()[0] for x in good if not x.startswith(" ")] == ["PASS", "PASS", "PASS"], good
    assert "5.0x smaller" in good[-2] and "goodput" in good[-2], good
    # the restart's 30 s: 25 steps again at 0.2 s = 5.0 s, relaunch 0 (none recorded), 25.0 s other
    assert "25 steps trained again 5.0 s" in good[-5] and "other +25.0 s" in good[-5], good
    assert sides(30.0, 6.0, stalls=(5.2, 7.5, 5.5))[-3].startswith("MISS")  # over 5 + 2 x 0.2 + 1 s
    assert sides(30.0, 6.0, stalls=())[-3].startswith("MISS")  # never measured
    assert sides(30.0, 12.0)[-2].startswith("MISS")  # 2.5x: short of 3x
    assert sides(30.0, 6.0, recoveries=(12.0, 31.0, 13.0))[-1].startswith("MISS")  # one recovery over 30 s
    assert sides(30.0, 6.0, recoveries=())[-1].startswith("MISS")  # never rejoined
    broken = sides(30.0, 6.0, error="group 1 exit 1: ...")
    assert all(x.startswith("FAIL") for x in broken) and "group 1 exit 1" in broken[0], broken
    assert bench_ft.failed(good[:1] + broken) and not bench_ft.failed(good)
    assert len(bench_ft.kill_steps(400, 3, 50)) == 3 and bench_ft.kill_steps(100, 3, 50) == []


def test_muon_bench_verdicts_read_miss_or_fail():
    """bench_muon's lines: the step-time ratio against its 1.3x target, the convergence sweep's best
    runs, the planner's predicted optimizer step against +-35%; an untimed or unfinished side is a FAIL."""
    import bench_muon

    assert bench_muon.ratio_line([0.10, 0.11], [0.12, 0.13]).startswith("PASS")
    assert bench_muon.ratio_line([0.10], [0.14]).startswith("MISS")
    assert bench_muon.ratio_line([], [0.12]).startswith("FAIL")
    nan = float("nan")
    assert bench_muon.best_line({("adamw", 1e-3): 5.0, ("muon", 1e-3): 4.9}).startswith("PASS")
    assert bench_muon.best_line({("adamw", 1e-3): 4.8, ("muon", 1e-3): 4.9}).startswith("MISS")
    assert bench_muon.best_line({("adamw", 1e-3): 4.8, ("muon", 1e-3): nan}).startswith("FAIL")
    assert bench_muon.predicted_line("muon", 0.0013, 0.001).startswith("PASS")  # +30%
    assert bench_muon.predicted_line("muon", 0.0006, 0.001).startswith("MISS")  # -40%
    assert bench_muon.predicted_line("muon", 0.001, 0.0).startswith("FAIL")


def test_ft_outage_lines_and_stalls():
    """The lighthouse-outage part: lost wall time per outage against heartbeat + join + 2 steps, the
    longest gap between commits (any group) after each outage, a run that did not finish a FAIL."""
    import ft_outage
    from ft_outage import OutageRun

    # commits every second, a 5 s gap after the first kill (at 3.5) and a 7 s one after the second (14.5)
    commits = [0, 1, 2, 3, 8, 9, 10, 11, 12, 13, 14, 21, 22]
    assert ft_outage.stalls(commits, [3.5, 14.5]) == [5, 7]
    assert ft_outage.stalls([0, 1, 2], [2.5]) == [float("inf")]  # nothing committed after it
    steps = ft_outage.outage_steps(200, 3, seed=1)
    assert len(steps) == 3 and steps == sorted(steps) and 20 <= steps[0] and steps[-1] < 140
    assert ft_outage.outage_steps(10, 3, seed=1) == []
    clean = OutageRun(wall=40.0, step_s=0.2)
    fine = OutageRun(wall=40.0 + 3 * 4.6, kills=[30, 80, 120], kill_times=[3.5, 14.5], commits=commits)
    line = ft_outage.outage_line(clean, fine, join_s=10.0, heartbeat_s=5.0)
    assert line.startswith("PASS") and "lost per outage 4.6 s" in line and "15.4 s" in line, line
    slow = OutageRun(wall=40.0 + 3 * 16.0, kills=[30, 80, 120], kill_times=[3.5], commits=commits)
    assert ft_outage.outage_line(clean, slow, join_s=10.0, heartbeat_s=5.0).startswith("MISS")
    broken = OutageRun(wall=50.0, kills=[30], error="group 1 exit 1: ...")
    assert ft_outage.outage_line(clean, broken, 10.0, 5.0).startswith("FAIL")


def test_packed_mlm_verdict_reads_miss_below_its_bar():
    assert bench_packed_mlm.packed_verdict(2.1, 0.52).startswith("PASS")
    assert bench_packed_mlm.packed_verdict(1.3, 0.52).startswith("MISS")  # padding allows 2.08x: the bar is 1.5x
    assert bench_packed_mlm.packed_verdict(1.15, 0.2).startswith("PASS")  # 1.25x is all packing can gain: 0.9 of it
    assert bench_packed_mlm.packed_verdict(1.0, 0.2).startswith("MISS")


def test_zoo_verdict_reads_fail_for_a_step_that_did_not_train_and_miss_below_the_target():
    import bench_zoo

    row = dict(finite=True, med=1.2, noisy=False)
    assert bench_zoo.verdict(row) == "PASS"
    assert bench_zoo.verdict({**row, "med": 0.97}) == "MISS"
    assert bench_zoo.verdict({**row, "finite": False}).startswith("FAIL")  # however fast
