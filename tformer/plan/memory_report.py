"""``tformer plan``'s memory report: the per-device memory table of every layout, the pipeline
and context-parallel tables, what each memory setting saves, and the memory-first recommendation
with its overrides. The numbers come from memory.py and search.py; report.py adds the speed.
"""

from __future__ import annotations

from ..args import parse_bytes
from ..config import ModelConfig
from ..models import spec_of
from .activations import _block_elements_op_ac, _block_elements_per_token, _op_ac_parts, activation_bytes
from .memory import Estimate, cp_attention_bytes, cp_estimate, cp_local_length, in_flight, training_memory
from .states import num_parameters
from .search import cp_blocker, cp_layouts, layout_estimate, layouts, pp_layouts, recommend, recommend_cp, tp_degrees


def print_savings(cfg: ModelConfig, micro_batch: int, seq: int, target: int | None, mixed: bool, settings: dict) -> None:
    """Activation memory per device of each memory setting alone, against none of them (the
    unchunked head, no checkpointing, no offload), and of this run's choice."""
    gib = 2**30
    plain = {**settings, "chunk": None, "offload": False}
    plain.pop("outer_momentum", None)  # model states, not activations
    chunk = settings["chunk"] or 1024

    def act(ac="none", **change):
        return activation_bytes(cfg, micro_batch, seq, target, ac, mixed, **{**plain, **change})

    base = act()
    rows = [
        ("none of them (baseline)", base),
        (f"loss.chunk_size={chunk}", act(chunk=chunk)),
        ("activation_checkpointing=op", act("op")),
        ("activation_checkpointing=full", act("full")),
        ("activation_offload=true (on a GPU)", act(offload=True)),
        (f"chunk {chunk} + op + offload", act("op", chunk=chunk, offload=True)),
    ]
    print(f"\nwhat each memory setting saves per device (activations, micro-batch {micro_batch}):")
    print(f"{'setting':<38}{'activ. GiB':>11}{'saves GiB':>11}{'saves':>7}")
    for name, value in rows:
        print(f"{name:<38}{value / gib:>11.2f}{(base - value) / gib:>11.2f}{1 - value / base:>7.0%}")


def _overrides(e: Estimate, chunked: bool) -> str:
    if e.tp == 1 and e.dp_replicate == 1 and e.pp == 1:
        flag = {
            "ddp": "parallel.strategy=ddp",
            "fsdp": "parallel.strategy=fsdp",
            "fsdp-no-reshard": "parallel.strategy=fsdp parallel.reshard_after_forward=false",
        }.get(e.strategy, f"parallel.strategy=deepspeed parallel.deepspeed_config=configs/deepspeed/{e.strategy}.json")
    else:
        pipe = (
            ""
            if e.pp == 1
            else (
                f" parallel.pp={e.pp} parallel.pp_schedule={e.schedule}"
                + (f" parallel.pp_stages_per_rank={e.stages_per_rank}" if e.stages_per_rank > 1 else "")
                + f" grad_accum={e.n_micro}"
            )
        )
        flag = (
            f"parallel.strategy=fsdp{pipe} parallel.dp_replicate={e.dp_replicate} parallel.dp_shard={e.dp_shard} "
            f"parallel.tp={e.tp}"
            + (" parallel.sp=true" if e.sp else "")
            + (" loss.chunk_size=null" if chunked and e.tp > 1 else "")
        )
    ac = "" if e.ac == "none" else f" parallel.activation_checkpointing={e.ac}"
    return f"{flag} micro_batch_size={e.micro_batch}{ac}"


def op_ac_note(cfg: ModelConfig, seq: int, tp: int, none: float, op: float) -> str:
    """Why op-level AC holds more than no AC at ``tp`` (with SP), in values per token and block on
    one rank: op keeps the o_proj and FFN down matmul outputs, and under TP those are partial sums
    over the whole sequence, whole on every rank until their reduce-scatter; AC none keeps nothing
    whole under SP (every tensor it saves is split by tp along the heads or the sequence)."""
    kept_none = _block_elements_per_token(cfg, seq, tp=tp, sp=True)
    kept_op = _block_elements_op_ac(cfg, tp=tp, sp=True)
    partial = _op_ac_parts(cfg)[0]
    gib = 2**30
    return (
        f"note: at tp={tp} AC op holds more than AC none ({op / gib:.2f} vs {none / gib:.2f} GiB), and is never "
        f"picked there: op keeps the o_proj and FFN down outputs, which under TP are partial sums over the whole "
        f"sequence on every rank before their reduce-scatter ({partial:,.0f} of the {kept_op:,.0f} values it keeps "
        f"per token and block), while AC none with SP keeps {kept_none:,.0f}, all split by tp"
    )


def _pp_refused(cfg) -> str | None:
    """A run setting pipelines do not take (the trainer refuses it), or None."""
    data = cfg.data
    for refused, why in (
        (cfg.precision == "fp16", "precision=fp16"),
        (data.tokens_per_batch is not None, "data.tokens_per_batch"),
        (bool(cfg.eval_bleu), "eval_bleu"),
        (bool(data.document_mask), "data.document_mask"),
        (bool(cfg.model.mtp_depth), "model.mtp_depth"),
    ):
        if refused:
            return why
    return None


def _cp_overrides(e: Estimate) -> str:
    ac = "" if e.ac == "none" else f" parallel.activation_checkpointing={e.ac}"
    return (
        f"parallel.strategy={e.strategy} parallel.cp={e.cp} parallel.dp_shard={e.dp_shard} parallel.tp={e.tp}"
        + (" parallel.sp=true loss.chunk_size=null" if e.sp else "")
        + f" micro_batch_size={e.micro_batch}{ac}"
    )


def cp_searched(model_cfg: ModelConfig, max_cp: int | None) -> str | None:
    """Why context-parallel layouts are not searched (``--max-cp 1``, or a model the trainer runs
    no CP for), or None."""
    if max_cp == 1:
        return "--max-cp 1"
    return cp_blocker(model_cfg)


def _print_cp_table(cfg, model_cfg, devices: int, target, mixed: bool, settings: dict, max_cp: int | None) -> None:
    """The context-parallel layouts' table: per rank, the total of each AC at the run's micro-batch."""
    gib = 2**30
    seq = cfg.data.seq_len
    why = cp_searched(model_cfg, max_cp)
    if why:
        print(f"\ncontext-parallel layouts not searched: {why}")
        return
    print(f"\ncontext-parallel layouts (each sequence cut over cp ranks; per rank, micro-batch {cfg.micro_batch_size}):")
    print(f"{'strategy':<16}{'dp_shard':>9}{'cp':>4}{'tp':>4}{'tokens/rank':>12}{'none':>8}{'op':>8}{'full':>8}")
    for strategy, tp, cp in cp_layouts(model_cfg, devices, max_cp):
        mb = cfg.micro_batch_size
        totals = [
            cp_estimate(model_cfg, strategy, devices, mb, seq, target, ac, mixed, cp, tp=tp, sp=tp > 1, **settings)
            for ac in ("none", "op", "full")
        ]
        print(
            f"{strategy:<16}{totals[0].dp_shard:>9}{cp:>4}{tp:>4}{cp_local_length(seq, cp, tp, tp > 1):>12}"
            + "".join(f"{t.total / gib:>8.1f}" for t in totals)
        )


def _print_cp_recommendation(
    cfg, model_cfg, devices: int, memory: float, target, mixed: bool, settings: dict, max_cp: int | None
) -> int:
    """When no layout without CP fits: the best CP layout, with its overrides."""
    gib = 2**30
    seq = cfg.data.seq_len
    fits = (
        []
        if cp_searched(model_cfg, max_cp)
        else recommend_cp(model_cfg, devices, memory, seq, target, mixed, settings=settings, max_cp=max_cp)
    )
    if not fits:
        either = "" if cp_searched(model_cfg, max_cp) else ", with context parallelism either"
        print(f"recommendation: nothing fits{either}; use more devices or a shorter sequence")
        return 1
    best = fits[0]
    gathered = cp_attention_bytes(model_cfg, best.micro_batch, seq, target, mixed, best.cp, best.tp)
    print(
        f"recommendation: context parallelism (no layout without it fits seq {seq}): {best.strategy}, mesh "
        f"dp_shard={best.dp_shard} cp={best.cp} tp={best.tp}{' sp' if best.sp else ''}, micro_batch_size="
        f"{best.micro_batch}, AC {best.ac} ({best.total / gib:.2f} GiB per device, of which "
        f"{gathered / gib:.2f} the gathered K/V)\n"
        f"  overrides: {_cp_overrides(best)}"
    )
    return 0


def diloco(cfg) -> bool:
    """Whether the run keeps DiLoCo's outer momentum on each device (counted in the fit check)."""
    ft = cfg.fault_tolerance
    return bool(ft.enabled and ft.semi_sync == "diloco")


def plan_main(
    cfg,
    config: str,
    devices: int,
    device_memory: str,
    gpus_per_node: int = 8,
    n_micro: int | None = None,
    max_pp: int | None = None,
    max_cp: int | None = None,
) -> int:
    """Print the tables and the memory-first recommendation for ``cfg``, the run config (a
    ``TrainConfig``, loaded by the CLI from the file ``config``: train/ is a layer above this one).
    ``n_micro``: the pipeline layouts' micro-batches per step (default 4 x pp); ``max_pp`` and
    ``max_cp``: the largest pp and cp tried (default: the device count; 1: none)."""
    model_cfg = cfg.model
    memory = parse_bytes(device_memory)
    mixed = cfg.precision != "fp32"
    target = None
    if spec_of(model_cfg).seq2seq:
        from ..data import t5_lengths

        target = cfg.data.target_len or t5_lengths(cfg.data.seq_len)[1]
    gib = 2**30
    settings = {**training_memory(cfg, memory), "loss_parallel": cfg.parallel.loss_parallel}
    settings["outer_momentum"] = diloco(cfg)
    print(
        f"model: {model_cfg.family}, {config}; {devices} devices x {memory / gib:.1f} GiB; seq "
        f"{cfg.data.seq_len}; {'bf16 mixed' if mixed else 'fp32'}; loss.chunk_size={cfg.loss.chunk_size}; "
        f"activation_offload={'on' if settings['offload'] else 'off'}"
    )
    usable, skipped = tp_degrees(model_cfg, devices)
    print(
        f"{num_parameters(model_cfg) / 1e9:.2f}B parameters; tp candidates {', '.join(map(str, usable))} "
        f"({gpus_per_node} GPUs per node; tp > 1 with sequence parallel and an unchunked vocabulary-sharded head)"
    )
    from .moe import moe_lines  # MoE terms: total vs active, expert states under ep, all-to-all

    for line in moe_lines(model_cfg, num_parameters(model_cfg), devices, cfg.micro_batch_size * cfg.data.seq_len, mixed):
        print(line)
    from .kvcache import kv_cache_line

    if (kv_line := kv_cache_line(model_cfg, cfg.data.seq_len, mixed)) is not None:
        print(kv_line)
    if cfg.optim.name == "muon":
        from .optimizer import memory_line

        print(memory_line(model_cfg, num_parameters(model_cfg), devices, cfg.parallel.strategy))
    if skipped:
        print(
            "tp skipped (it must divide num_heads, num_kv_heads and d_ff): "
            + ", ".join(f"{tp} ({why})" for tp, why in skipped.items())
        )
    print(
        f"{'strategy':<16}{'dp_rep':>7}{'dp_shard':>9}{'tp':>4}{'sp':>4}  {'AC':<6}{'micro':>6}{'states GiB':>12}"
        f"{'activ. GiB':>12}{'total GiB':>11}  fits"
    )
    worse_op: dict[int, tuple[float, float]] = {}  # tp -> (AC none, AC op) totals where op holds more
    group = cfg.fault_tolerance.enabled  # the layouts of one replica group (train/resilience/ft.py refuses the rest)
    if group:
        print("one replica group's layouts: no ZeRO (DeepSpeed) and no HSDP (the replica groups are the replicas)")
    for strategy, replicate, tp in layouts(model_cfg, devices, gpus_per_node, group):
        totals = {}
        for ac in ("none", "op", "full"):
            layout = (strategy, replicate, tp, 1, "1f1b", 1, 1)
            e = layout_estimate(
                model_cfg, layout, devices, cfg.micro_batch_size, cfg.data.seq_len, target, ac, mixed, settings
            )
            print(
                f"{strategy:<16}{replicate:>7}{e.dp_shard:>9}{tp:>4}{'on' if e.sp else '-':>4}  {ac:<6}"
                f"{e.micro_batch:>6}{e.model_states / gib:>12.2f}{e.activations / gib:>12.2f}{e.total / gib:>11.2f}"
                f"  {'yes' if e.total <= 0.9 * memory else 'no'}"
            )
            totals[ac] = e.total
        if tp > 1 and totals["op"] > totals["none"]:
            worse_op[tp] = (totals["none"], totals["op"])
    if worse_op:
        print(op_ac_note(model_cfg, cfg.data.seq_len, max(worse_op), *worse_op[max(worse_op)]))
    refused = _pp_refused(cfg)
    max_pp = 1 if refused else (max_pp or devices)
    if refused:
        print(f"\npipeline layouts not searched: parallel.pp does not take {refused}")
    elif max_pp > 1:
        _print_pipelines(
            model_cfg,
            devices,
            memory,
            cfg.micro_batch_size,
            cfg.data.seq_len,
            target,
            mixed,
            settings,
            gpus_per_node,
            n_micro,
            max_pp,
        )
    _print_cp_table(cfg, model_cfg, devices, target, mixed, settings, max_cp)
    print_savings(model_cfg, cfg.micro_batch_size, cfg.data.seq_len, target, mixed, settings)
    fits = recommend(
        model_cfg,
        devices,
        memory,
        cfg.data.seq_len,
        target,
        mixed,
        settings=settings,
        gpus_per_node=gpus_per_node,
        max_pp=max_pp,
        n_micro=n_micro,
        replica_group=group,
    )
    if not fits:
        return _print_cp_recommendation(cfg, model_cfg, devices, memory, target, mixed, settings, max_cp)
    best = fits[0]
    pipe = "" if best.pp == 1 else f"pp={best.pp} "
    mesh = (
        ""
        if best.tp == 1 and best.dp_replicate == 1 and best.pp == 1
        else (
            f", mesh {pipe}dp_replicate={best.dp_replicate} dp_shard={best.dp_shard} tp={best.tp}"
            + (" sp" if best.sp else "")
            + (" (tp across nodes)" if best.tp > gpus_per_node else "")
        )
    )
    where = "" if best.pp == 1 else f" on pipeline rank {best.pp_rank} of {best.pp}, the fullest"
    print(
        f"recommendation: {best.strategy}{mesh}, micro_batch_size={best.micro_batch}, AC {best.ac} "
        f"({best.total / gib:.2f} GiB per device{where})\n"
        f"  overrides: {_overrides(best, cfg.loss.chunk_size is not None)}"
    )
    if best.pp > 1:
        interleaved = best.schedule == "interleaved_1f1b"
        formula = f"(pp-1)/({'v*' if interleaved else ''}m+pp-1)"
        print(
            f"  pipeline: {best.schedule}{f' ({best.stages_per_rank} stages per rank)' if interleaved else ''}, "
            f"m={best.n_micro} micro-batches per step (grad_accum; the global batch is micro_batch_size x m x "
            f"dp_replicate x dp_shard), bubble {best.bubble:.1%} of the step idle {formula}, "
            f"{best.in_flight:g} micro-batches in flight on rank {best.pp_rank}"
        )
    return 0


def _print_pipelines(
    cfg: ModelConfig,
    devices: int,
    memory: float,
    micro_batch: int,
    seq: int,
    target: int | None,
    mixed: bool,
    settings: dict,
    gpus_per_node: int,
    n_micro: int | None,
    max_pp: int,
) -> None:
    """The pipeline layouts' table: one row per layout and schedule, the worst rank's total per AC."""
    gib = 2**30
    pipes, skipped = pp_layouts(cfg, devices, gpus_per_node, n_micro, max_pp)
    m = "4 x pp" if n_micro is None else str(n_micro)
    print(
        f"\npipeline layouts (fsdp per stage; m = grad_accum = {m} micro-batches of micro_batch_size per step; "
        "in-flight: micro-batches rank 0 holds; none/op/full: total GiB of the fullest pipeline rank by AC; AC: the "
        "cheapest that fits; gpipe not searched: 1f1b's bubble with all m micro-batches in flight):"
    )
    if skipped:
        print("pp skipped: " + ", ".join(f"{pp} ({why})" for pp, why in skipped.items()))
    if not pipes:
        return
    print(
        f"{'strategy':<16}{'dp_rep':>7}{'dp_shard':>9}{'tp':>4}{'sp':>4}{'pp':>4}  {'schedule':<17}{'v':>2}{'m':>5}"
        f"{'bubble':>8}{'in-flight':>10}{'micro':>6}{'none':>8}{'op':>8}{'full':>8}  fits  AC"
    )
    for strategy, replicate, tp, pp, schedule, v, n in pipes:
        totals = {
            ac: layout_estimate(
                cfg, (strategy, replicate, tp, pp, schedule, v, n), devices, micro_batch, seq, target, ac, mixed, settings
            )
            for ac in ("none", "op", "full")
        }
        e = totals["none"]
        fit = next((ac for ac, t in totals.items() if t.total <= 0.9 * memory), None)
        held = in_flight(schedule, pp, n, 0, v) / v
        print(
            f"{strategy:<16}{replicate:>7}{e.dp_shard:>9}{tp:>4}{'on' if e.sp else '-':>4}{pp:>4}  {schedule:<17}"
            f"{v:>2}{n:>5}{e.bubble:>8.1%}{held:>10g}{micro_batch:>6}"
            + "".join(f"{t.total / gib:>8.1f}" for t in totals.values())
            + f"  {'yes' if fit else 'no':<4}  {fit or '-'}"
        )
