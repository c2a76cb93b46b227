"""``loss.chunk_size: auto`` for a run config, as the trainer and the planner both resolve it.

The rule is ``models/loss.auto_chunk_size`` (the CPU's measured best; on an accelerator the whole
head where its logits fit a share of the memory the model states leave, else the fewest chunks that
do); this module measures what the rule needs from a run: the rows one micro-batch sends through
the head on one rank, and the memory left on a device of a given capacity.
"""

from __future__ import annotations

from typing import Any

from ..config import ModelConfig
from ..models.loss import auto_chunk_size
from ..models.spec import spec_of

# fp32 weights, their gradients and AdamW's two moments: what a parameter costs the rank holding it
STATE_BYTES_PER_PARAMETER = 16


def head_rows(cfg: Any, model_cfg: ModelConfig, seq_len: int, target_len: int | None, cp: int = 1) -> int:
    """Positions one micro-batch sends through the head on one rank (``cfg``: the run config): the
    target's (encoder-decoder) or the sequence's tokens, only the masked share under masked LM, 1/cp
    of them under context parallelism; a token-budget batch counts its budget."""
    budget = cfg.data.tokens_per_batch
    per_sample = spec_of(model_cfg).output_len(seq_len, target_len)
    tokens = budget if budget else cfg.micro_batch_size * per_sample
    share = cfg.data.mlm_probability if spec_of(model_cfg).masked_lm else 1.0
    return max(1, int(tokens * share / cp))


def free_after_states(capacity: float, num_parameters: int, strategy: str, tp: int, pp: int, dp_shard: int) -> float:
    """Bytes of a device of ``capacity`` the model states leave: ``STATE_BYTES_PER_PARAMETER`` for
    each parameter the rank holds (split by tp and pp, sharded over dp_shard by FSDP)."""
    shards = tp * pp * (max(dp_shard, 1) if strategy == "fsdp" else 1)
    return capacity - STATE_BYTES_PER_PARAMETER * num_parameters / shards


def run_chunk(
    cfg: Any,
    model_cfg: ModelConfig,
    precision: str,
    num_parameters: int,
    capacity: float | None,
    dims: tuple[int, int, int, int],
    seq_len: int,
    target_len: int | None,
) -> int | None:
    """The run's ``loss.chunk_size``: a number or null as given; ``auto`` by the rule, on a device of
    ``capacity`` bytes (None: a CPU). ``dims``: (tp, pp, dp_shard, cp)."""
    chunk = cfg.loss.chunk_size
    if chunk != "auto":
        return chunk
    tp, pp, dp_shard, cp = dims
    free = None if capacity is None else free_after_states(capacity, num_parameters, cfg.parallel.strategy, tp, pp, dp_shard)
    per_logit = 4 if precision == "fp32" else 6
    return auto_chunk_size(head_rows(cfg, model_cfg, seq_len, target_len, cp), model_cfg.padded_vocab_size, per_logit, free)
