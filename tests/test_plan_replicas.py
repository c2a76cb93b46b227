"""``tformer plan`` prices fault tolerance's replica groups (tformer/plan/replicas.py): the
cross-group all-reduce per step, DiLoCo's every-``sync_every`` exchange amortised, its memory, and
the trainer's refusals for the same section."""

from __future__ import annotations

import pytest

from train_helpers import CONFIGS

from tformer.config import ConfigError
from tformer.plan import Layout, profile
from tformer.plan.layout import rank_stages
from tformer.plan.replicas import CHECKPOINT_READ, RELAUNCH_S, Replicas, replica_cost, restart_cost
from tformer.plan.states import num_parameters
from tformer.train.config import load_config


def _gpt2_tiny():
    return load_config(str(CONFIGS / "gpt2-tiny.yaml"), []).model


def test_per_step_all_reduce_is_a_ring_over_the_groups_on_the_network():
    """4 groups of 8 H100s, FSDP2 over the 8: each rank all-reduces its 1/8 of the fp32 gradients
    with its 3 counterparts over the network (50 GB/s, 10 us per hop): 2 x 3 hops and 2 x 3/4 of
    the buffer through each link."""
    model = _gpt2_tiny()
    layout = Layout(strategy="fsdp", dp_shard=8)
    hw = profile("h100-sxm")
    cost = replica_cost(layout, rank_stages(model, layout)[0], hw, Replicas(4))
    shard = num_parameters(model) / 8 * 4
    assert cost.bytes_per_step == pytest.approx(shard)
    assert cost.seconds_per_step == pytest.approx(6 * 10e-6 + 1.5 * shard / 50e9)
    assert cost.link.bandwidth == 50e9 and cost.device_bytes == cost.host_bytes == 0
    # DDP inside the group: every rank holds all the gradients; 2 groups of 4 fit one node: NVLink
    ddp = Layout(strategy="ddp", dp_shard=4)
    inside = replica_cost(ddp, rank_stages(model, ddp)[0], hw, Replicas(2))
    assert inside.bytes_per_step == pytest.approx(num_parameters(model) * 4)
    assert inside.seconds_per_step == pytest.approx(2 * hw.intra_latency + num_parameters(model) * 4 / hw.intra_bandwidth)
    # one group: nothing crosses
    assert replica_cost(layout, rank_stages(model, layout)[0], hw, Replicas(1)).seconds_per_step == 0


def test_diloco_every_20_costs_a_twentieth_of_per_step_sync_and_keeps_two_copies():
    model = _gpt2_tiny()
    layout = Layout(strategy="fsdp", dp_shard=8)
    stage, hw = rank_stages(model, layout)[0], profile("h100-sxm")
    every_step = replica_cost(layout, stage, hw, Replicas(4))
    diloco = replica_cost(layout, stage, hw, Replicas(4, "diloco", 20))
    assert diloco.bytes_per_step == pytest.approx(every_step.bytes_per_step / 20)
    assert diloco.seconds_per_step == pytest.approx(every_step.seconds_per_step / 20)
    # the backup (host) and the outer momentum (device): one fp32 copy of the rank's parameters each
    assert diloco.device_bytes == diloco.host_bytes == pytest.approx(every_step.bytes_per_step)
    assert replica_cost(layout, stage, hw, Replicas(4, "local_sgd", 20)).device_bytes == 0
    # streaming DiLoCo, 4 fragments: the same bytes, 4 times the hops' latency
    streamed = replica_cost(layout, stage, hw, Replicas(4, "diloco", 20, 4))
    assert streamed.bytes_per_step == pytest.approx(diloco.bytes_per_step)
    assert streamed.seconds_per_step - diloco.seconds_per_step == pytest.approx(3 * 6 * 10e-6 / 20)


@pytest.mark.parametrize(
    "extra, match",
    [
        (["fault_tolerance.fragments=2"], "fragments=2 streams DiLoCo's synchronisation; it needs"),
        (
            ["fault_tolerance.semi_sync=diloco", "fault_tolerance.sync_every=10", "fault_tolerance.fragments=3"],
            "sync_every=10 is not a multiple of",
        ),
        (["fault_tolerance.replica_id=4", "fault_tolerance.replicas=4"], "replica_id=4 is outside"),
    ],
)
def test_plan_refuses_what_the_trainer_refuses_in_one_line(extra, match, capsys):
    """The planner reads the run config's section, checked by the config as the trainer's is."""
    from tformer.cli import main

    with pytest.raises(ConfigError, match=match):
        load_config(str(CONFIGS / "gpt2-tiny.yaml"), ["fault_tolerance.enabled=true", *extra])
    assert main(["plan", str(CONFIGS / "gpt2-tiny.yaml"), "fault_tolerance.enabled=true", *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and match in err[0], err


def test_plan_cli_prints_what_the_replicas_cost(capsys):
    from tformer.cli import main

    config = str(CONFIGS / "gpt2-tiny.yaml")
    ft = ["fault_tolerance.enabled=true", "fault_tolerance.replicas=4"]
    assert main(["plan", config, *ft, "--devices", "6"]) == 2
    assert "--devices 6 is not a multiple of fault_tolerance.replicas=4" in capsys.readouterr().err
    args = ["plan", config, *ft, "fault_tolerance.semi_sync=diloco", "--devices", "32", "--max-cp", "1"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "4 replica groups of 8 devices each" in out
    line = next(x for x in out.splitlines() if x.startswith("replicas: 4 fault-tolerance groups x 8 devices"))
    assert "diloco every 20 steps" in line and "over the network" in line and "outer momentum" in line, line
    # beside it, a cluster restart: the recipe's save_every=50, so 25 steps since the last save
    assert "a cluster restart, about" in line and "25 steps since the last save (half of save_every=50)" in line, line
    main(["plan", config, *ft, "save_every=0", "--devices", "32", "--max-cp", "1"])
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("replicas: "))
    assert "restarts the job from step 0" in line, line


def test_a_cluster_restart_costs_relaunch_reload_and_half_a_save_interval():
    """FSDP2 over 8: each rank reads its 1/8 of 12 bytes a parameter (fp32 weights, AdamW's two
    moments); the steps since the last save, half of save_every, at the step time; DDP reads all."""
    model = _gpt2_tiny()
    layout = Layout(strategy="fsdp", dp_shard=8)
    cost = restart_cost(layout, rank_stages(model, layout)[0], step_s=0.5, save_every=200)
    assert cost is not None
    assert cost.reload_s == pytest.approx(num_parameters(model) / 8 * 12 / CHECKPOINT_READ)
    assert cost.retrain_steps == 100 and cost.retrain_s == pytest.approx(50.0) and cost.relaunch_s == RELAUNCH_S
    assert cost.total_s == pytest.approx(RELAUNCH_S + cost.reload_s + 50.0)
    ddp = Layout(strategy="ddp", dp_shard=8)
    assert restart_cost(ddp, rank_stages(model, ddp)[0], 0.5, 200).reload_s == pytest.approx(8 * cost.reload_s)
    assert restart_cost(layout, rank_stages(model, layout)[0], 0.5, 0) is None  # no checkpoint before the end


def _table(out: str) -> list[tuple[str, int]]:
    """(strategy, dp_replicate) of each row of the memory table."""
    rows = []
    for line in out.splitlines():
        parts = line.split()
        if (
            len(parts) > 3
            and parts[0] in ("ddp", "zero1", "zero2", "zero3", "fsdp", "fsdp-no-reshard")
            and parts[1].isdigit()
        ):
            rows.append((parts[0], int(parts[1])))
    return rows


def test_plan_lists_and_recommends_only_layouts_a_replica_group_runs(capsys):
    """Under fault tolerance a group runs neither ZeRO (DeepSpeed) nor HSDP (train/resilience/ft.py refuses
    both): the memory table and the recommendation leave them out, as the speed report does. Two
    groups of 16 devices (two nodes each); the same 16 devices without fault tolerance list both."""
    from tformer.cli import main

    config = str(CONFIGS / "gpt2-tiny.yaml")
    assert main(["plan", config, "--devices", "16", "--max-cp", "1"]) == 0
    plain = _table(capsys.readouterr().out)
    assert ("fsdp", 2) in plain and any(s.startswith("zero") for s, _ in plain), plain
    ft = ["fault_tolerance.enabled=true", "fault_tolerance.replicas=2"]
    assert main(["plan", config, *ft, "--devices", "32", "--max-cp", "1"]) == 0
    out = capsys.readouterr().out
    rows = _table(out)
    assert rows and all(rep == 1 and not s.startswith("zero") for s, rep in rows), rows
    assert "no ZeRO (DeepSpeed) and no HSDP" in out
    rec = next(x for x in out.splitlines() if x.startswith("recommendation: "))
    assert "dp_replicate=" not in rec and "zero" not in rec, rec


def test_diloco_outer_momentum_is_counted_in_the_fit_check():
    """DiLoCo's outer momentum (one fp32 copy of the rank's parameters on the device) is part of
    each layout's model states in the planner's fit check, the same bytes replicas.py prices."""
    from tformer.plan.memory import cp_estimate
    from tformer.plan.search import layout_estimate, recommend

    model, hw = _gpt2_tiny(), profile("h100-sxm")
    for strategy, tp in (("ddp", 1), ("fsdp", 1), ("fsdp", 2)):
        layout = (strategy, 1, tp, 1, "1f1b", 1, 1)
        base, diloco = (
            layout_estimate(model, layout, 8, 4, 256, None, "none", True, {"outer_momentum": m}) for m in (False, True)
        )
        plan = Layout(strategy=strategy, dp_shard=8 // tp, tp=tp, sp=tp > 1)
        cost = replica_cost(plan, rank_stages(model, plan)[0], hw, Replicas(2, "diloco", 20))
        assert diloco.model_states - base.model_states == pytest.approx(cost.device_bytes, rel=1e-3), strategy
        assert diloco.activations == base.activations
    base, diloco = (cp_estimate(model, "fsdp", 8, 4, 256, None, "none", True, 2, outer_momentum=m) for m in (False, True))
    assert diloco.model_states - base.model_states == pytest.approx(num_parameters(model) / 8 * 4, rel=1e-3)
    # memory for the DDP layout without recomputation at micro-batch 64 with 2 bytes a parameter to
    # spare: it fits without the momentum, and with it only at a smaller micro-batch
    ddp = layout_estimate(model, ("ddp", 1, 1, 1, "1f1b", 1, 1), 8, 64, 256, None, "none", True, {})
    memory = (ddp.total + num_parameters(model) * 2) / 0.9

    def micro(momentum: bool) -> int:
        got = recommend(model, 8, memory, 256, None, settings={"outer_momentum": momentum})
        return next(e.micro_batch for e in got if e.strategy == "ddp" and e.ac == "none")

    assert micro(False) == 64 and micro(True) < 64
