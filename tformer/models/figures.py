"""The model's own figures of the last forward, for the trainer's log: the MoE layers' routing
(``nn/moe.py``'s table, averaged over the layers as ``moe/...``) and multi-token prediction's
``mtp_loss``, gathered as one device tensor so that a logging step reads them with its other
figures in one read."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..nn.moe import moe_figures, moe_table
from .mtp import MultiTokenPrediction


@dataclass(frozen=True)
class TableKeys:
    """What the flat table holds: ``moe_rows`` rows of ``moe_keys``, then one value per ``extra`` key."""

    moe_keys: tuple[str, ...]
    moe_rows: int
    extra: tuple[str, ...]


def model_table(model: nn.Module) -> tuple[TableKeys, torch.Tensor] | None:
    moe = moe_table(model)
    extra = {k: v for m in model.modules() if isinstance(m, MultiTokenPrediction) for k, v in m.stats.items()}
    if moe is None and not extra:
        return None
    parts = [moe[1].flatten()] if moe is not None else []
    parts += [torch.as_tensor(v, dtype=torch.float32).reshape(1) for v in extra.values()]
    keys = TableKeys(tuple(moe[0]) if moe else (), moe[1].shape[0] if moe else 0, tuple(extra))
    return keys, torch.cat([p.to(parts[0].device) for p in parts])


def model_figures(keys: TableKeys, values: list[float]) -> dict[str, float]:
    cols, n = len(keys.moe_keys), len(keys.moe_keys) * keys.moe_rows
    out = moe_figures(list(keys.moe_keys), [values[i : i + cols] for i in range(0, n, cols)]) if n else {}
    out.update(zip(keys.extra, values[n:]))
    return out
