"""What a training run prints when it starts: a short summary, not the resolved config.

The resolved config (every key, ~170 lines) is the run directory's ``config.yaml``, written before
this is printed; the summary names it. The layout line says what the run really is: DDP replicates
the model (no ``dp_shard``), FSDP2 shards it, tensor and pipeline parallelism split it.
"""

from __future__ import annotations


def layout(strategy: str, dims, sp: bool, world: int) -> str:
    """The run's parallel layout in words, e.g. ``1 process``, ``ddp: 2 replicas``,
    ``fsdp: dp_replicate=2 x dp_shard=4``, ``fsdp: dp_shard=2 x tp=2 (sp)``."""
    parts = []
    if dims.pp > 1:
        parts.append(f"pp={dims.pp}")
    if strategy == "ddp":
        if dims.dp_size > 1:
            parts.append(f"{dims.dp_size} replicas")
    else:
        if dims.dp_replicate > 1:
            parts.append(f"dp_replicate={dims.dp_replicate}")
        parts.append(f"dp_shard={dims.dp_shard}")
    if dims.tp > 1:
        parts.append(f"tp={dims.tp}" + (" (sp)" if sp else ""))
    if world == 1:
        return "1 process"
    return f"{strategy}: {' x '.join(parts)}" if parts else strategy


def _data(cfg, objective: str) -> str:
    data = cfg.data
    if data.sources or data.stages:
        names = [str(s.get("name") or s.get("source")) for s in data.sources] or ["staged mixture"]
        where = "mixture of " + ", ".join(names)
    else:
        where = data.source
    length = f"seq {data.seq_len}" + (f", target {data.target_len}" if data.target_len else "")
    return f"{where}; {objective}; {length}"


def start_summary(trainer) -> str:
    """The few lines a run prints at its start (rank 0)."""
    t, cfg = trainer, trainer.cfg
    m = t.model_cfg
    batch = (
        f"{cfg.data.tokens_per_batch:,} tokens per micro-batch"
        if cfg.data.tokens_per_batch
        else f"{cfg.micro_batch_size * cfg.grad_accum * t.dims.dp_size} sequences per step"
    )
    start = f" (resuming at step {t.step})" if t.step else ""
    return "\n".join(
        [
            f"tformer: {m.family} model ({m.flavour}, {m.num_layers} layers, d_model {m.d_model}), "
            f"{t.num_parameters:,} parameters, {t.dist.world_size} rank(s) on {t.device}, precision {t.precision}",
            f"layout: {layout(cfg.parallel.strategy, t.dims, cfg.parallel.sp, t.dist.world_size)}",
            f"data: {_data(cfg, t.data.objective)}; {batch}",
            f"steps: {cfg.max_steps:,}{start}",
            f"output: {t.out} (resolved config: {t.out / 'config.yaml'})",
        ]
    )
