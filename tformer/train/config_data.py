"""The run config's data checks (called by ``TrainConfig.validate``): mixture sources and stages,
synthetic data, document masks. Each error names the key and the fix in one line."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from ..config import AttnImpl, ConfigError, ModelConfig
from ..data.config import AUTO_OBJECTIVE


DOC_MASK_IMPLS: tuple[AttnImpl, ...] = ("sdpa", "math")  # attention implementations that take a document mask


SOURCE_KEYS = ("source", "weight", "name", "text_column")


def source_name(entry: dict) -> str:
    """A mixture source's name: its ``name``, else its file name up to the first dot."""
    return entry.get("name") or Path(str(entry["source"])).name.split(".")[0]


def _check_sources(entries: Any, where: str) -> list[str]:
    """One mixture's source list: a non-empty list of {source, weight, name}; returns the names."""
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{where} must be a non-empty list of {{source: PATH, weight: W, name: NAME}}")
    names = []
    for i, e in enumerate(entries):
        at = f"{where}[{i}]"
        if not isinstance(e, dict):
            raise ConfigError(f"{at} must be a mapping like {{source: data/web.jsonl, weight: 0.7, name: web}}")
        unknown = sorted(set(e) - set(SOURCE_KEYS))
        if unknown:
            raise ConfigError(f"{at} has unknown key(s) {', '.join(unknown)}; allowed: {', '.join(SOURCE_KEYS)}")
        if not isinstance(e.get("source"), str) or not e["source"]:
            raise ConfigError(f"{at}.source is missing: give a file, directory, glob, dataset name or default")
        w = e.get("weight", 1.0)
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0:
            raise ConfigError(f"{at}.weight={w!r} must be a number >= 0")
        name = source_name(e)
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
            raise ConfigError(f"{at}.name={name!r} may hold only letters, digits, _ . - (it names val_loss/NAME)")
        if name in names:
            raise ConfigError(f"{at}.name={name!r} is used twice in {where}; give each source its own name")
        names.append(name)
    if sum(float(e.get("weight", 1.0)) for e in entries) <= 0:
        raise ConfigError(f"{where}: the weights are all zero; give at least one source a weight > 0")
    return names


def check_mixture(cfg: Any) -> None:
    d = cfg.data
    if (d.sources or d.stages) and d.source != "default":
        raise ConfigError("data.source and data.sources/data.stages are both set; give one (a single source, or a mixture)")
    if d.sources and d.stages:
        raise ConfigError("data.sources and data.stages are both set; put the sources in the stages")
    if (d.sources or d.stages) and d.objective == "seq2seq":
        raise ConfigError("data.sources/data.stages mix text corpora; data.objective=seq2seq takes one data.source of pairs")
    if (d.sources or d.stages) and d.tokens_per_batch is not None:
        raise ConfigError("data.tokens_per_batch batches one source of pairs; unset it for a mixture")
    if d.sources:
        _check_sources(d.sources, "data.sources")
    if not d.stages:
        return
    if not isinstance(d.stages, list):
        raise ConfigError("data.stages must be a list of {until_step: N, sources: [...]}")
    last = 0
    for i, st in enumerate(d.stages):
        at = f"data.stages[{i}]"
        if not isinstance(st, dict) or set(st) - {"until_step", "sources"}:
            raise ConfigError(f"{at} must be a mapping with keys until_step and sources")
        step = st.get("until_step")
        if isinstance(step, bool) or not isinstance(step, int):
            raise ConfigError(f"{at}.until_step={step!r} must be an integer step")
        if step <= last:
            raise ConfigError(
                f"{at}.until_step={step} must be greater than the previous stage's ({last}); "
                "list the stages in order of increasing until_step"
            )
        last = step
        _check_sources(st.get("sources"), f"{at}.sources")
    if last < cfg.max_steps:
        raise ConfigError(
            f"data.stages end at until_step={last} but max_steps={cfg.max_steps}; raise the last "
            f"stage's until_step to >= {cfg.max_steps}"
        )


def check_synthetic(cfg: Any) -> None:
    """``data.source: synthetic`` draws random ids with no tokenizer and no documents: what needs
    either is refused here rather than silently ignored."""
    d = cfg.data
    if d.source != "synthetic":
        return
    for name, value, why in (
        ("data.tokenizer", d.tokenizer != "auto", "it makes ids without a tokenizer; drop data.tokenizer"),
        ("data.document_mask", d.document_mask, "its samples hold no documents; set data.document_mask=false"),
        ("data.tokens_per_batch", d.tokens_per_batch is not None, "its pairs all have one length; use micro_batch_size"),
        ("data.whole_word_mask", d.whole_word_mask, "its ids form no words; set data.whole_word_mask=false"),
        ("data.prepared", d.prepared, "it has no token cache to prepare; set data.prepared=false"),
    ):
        if value:
            raise ConfigError(f"{name} is set but data.source=synthetic takes none: {why}")


def check_document_mask(cfg: Any, model: ModelConfig) -> None:
    d = cfg.data
    objective = d.objective if d.objective != "auto" else AUTO_OBJECTIVE[model.family]
    if d.pack and objective != "mlm":
        raise ConfigError(
            f"data.pack=true packs masked-LM documents, not {objective} samples (causal rows are always packed; "
            "seq2seq pairs pack with data.document_mask alone): unset data.pack"
        )
    if d.pack and not d.document_mask:
        raise ConfigError("data.pack=true keeps the packed documents apart by their masks; set data.document_mask=true")
    if not d.document_mask:
        if d.pack_len is not None:
            raise ConfigError(f"data.pack_len={d.pack_len} sizes packed rows; it needs data.document_mask=true")
        return
    if objective == "span":
        raise ConfigError(
            "data.document_mask=true cannot be honoured by span corruption (its spans are cut "
            "across documents); use data.objective=seq2seq for packed pairs, or "
            "data.document_mask=false"
        )
    if d.tokens_per_batch is not None:
        raise ConfigError(
            "data.document_mask=true packs pairs into rows; unset data.tokens_per_batch "
            "(padded token-budget batches) or set data.document_mask=false"
        )
    if d.pack_len is not None and objective != "seq2seq":
        raise ConfigError(
            f"data.pack_len={d.pack_len} sizes rows of packed pairs (data.objective=seq2seq); "
            f"{objective} packing fills data.seq_len: unset data.pack_len"
        )
    if d.pack_len is not None and model.position in ("learned", "sinusoidal") and d.pack_len > model.max_seq_len:
        raise ConfigError(
            f"data.pack_len={d.pack_len} exceeds model.max_seq_len={model.max_seq_len} (the "
            f"position table); use data.pack_len <= {model.max_seq_len}"
        )
    if model.attn_impl not in DOC_MASK_IMPLS:
        raise ConfigError(
            f"data.document_mask=true needs model.attn_impl in {', '.join(DOC_MASK_IMPLS)}, not {model.attn_impl!r}"
        )
