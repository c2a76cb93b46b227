"""From the run config to tokenizer + train/validation datasets for the family's objective."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from ..config import ModelConfig
from ..files import atomic_write
from ..data import (Collator, DataError, MLMDataset, PackedCausalLM, Seq2SeqPairs,
                    SpanCorruptionDataset, check_seq_len, check_vocab, default_corpus_path,
                    default_pairs_path, load_tokenizer, special_tokens, t5_lengths, tokenize_corpus,
                    tokenize_pairs, train_tokenizer)
from .config import TrainConfig

log = logging.getLogger("tformer.train")

TOKENIZER_KIND = {"decoder": "bpe", "encoder": "wordpiece", "encdec": "unigram"}
OBJECTIVE = {"decoder": "causal", "encoder": "mlm", "encdec": "span"}
# Keys each family's forward takes from a batch (the rest, e.g. doc_ids, stays in the pipeline).
MODEL_INPUTS = {
    "decoder": ("input_ids", "labels"),
    "encoder": ("input_ids", "attention_mask", "token_type_ids", "labels"),
    "encdec": ("input_ids", "attention_mask", "labels"),
}


@dataclass
class RunData:
    tokenizer: object
    tokenizer_path: Path
    model_config: ModelConfig
    train: object
    validation: object
    collator: Collator
    objective: str
    seq_len: int                      # tokens per sample on the model's (encoder) input
    target_len: int | None            # decoder tokens per sample (encoder-decoder)


def cache_root(cfg: TrainConfig) -> Path:
    root = cfg.data.cache_dir or os.environ.get("TFORMER_CACHE") or Path.home() / ".cache" / "tformer"
    return Path(root)


def _source(cfg: TrainConfig, objective: str):
    if cfg.data.source != "default":
        return cfg.data.source
    return default_pairs_path() if objective == "seq2seq" else default_corpus_path()


def _auto_tokenizer(cfg: TrainConfig, family: str, source, column: str, vocab_size: int, rank: int):
    """Train the family's tokenizer on the source once; later runs (and other ranks) reuse it."""
    import torch.distributed as dist

    kind = TOKENIZER_KIND[family]
    ident = json.dumps([str(source), _file_identity(source), kind, vocab_size, column,
                        cfg.data.tokenizer_max_rows])
    path = cache_root(cfg) / "tokenizers" / hashlib.sha256(ident.encode()).hexdigest()[:16] / "tokenizer.json"
    if not path.is_file() and rank == 0:
        log.info("training a %s tokenizer (%d tokens) on %s -> %s", kind, vocab_size, source, path)
        max_rows = cfg.data.tokenizer_max_rows
        if max_rows is None and kind == "unigram":
            max_rows = 20000  # Unigram is ~30x slower per MB than BPE; 20k rows is plenty for tests
        tok = train_tokenizer(kind, source, vocab_size, None, column=column, max_rows=max_rows)
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_write(path) as tmp:
            tok.save(str(tmp))
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    return path


def _file_identity(source) -> list:
    p = Path(str(source))
    if p.is_file():
        st = p.stat()
        return [st.st_size, int(st.st_mtime)]
    return []


def build_data(cfg: TrainConfig, rank: int = 0) -> RunData:
    model_cfg = cfg.model_config()
    family = model_cfg.family
    objective = OBJECTIVE[family] if cfg.data.objective == "auto" else cfg.data.objective
    allowed = {"decoder": ("causal",), "encoder": ("mlm",), "encdec": ("span", "seq2seq")}[family]
    if objective not in allowed:
        raise DataError(f"data.objective={objective!r} does not fit a {family} model; use "
                        f"{' or '.join(allowed)}")
    source = _source(cfg, objective)
    # translation pairs: one joint vocabulary over both sides (the paper's shared source/target BPE)
    column = ([cfg.data.source_column, cfg.data.target_column] if objective == "seq2seq"
              else cfg.data.text_column)
    if cfg.data.tokenizer == "auto":
        tok_path = _auto_tokenizer(cfg, family, source, column,
                                   cfg.data.tokenizer_vocab_size or model_cfg.vocab_size, rank)
    else:
        tok_path = Path(cfg.data.tokenizer)
    tok = load_tokenizer(tok_path)
    check_vocab(tok, model_cfg.vocab_size)
    ids = special_tokens(tok)

    # The model's special ids come from the tokenizer, so generation and export agree with it.
    updates = {}
    if ids.pad_id is not None:
        updates["pad_token_id"] = ids.pad_id
    if family != "encoder" and ids.eos_id is not None:
        updates["eos_token_id"] = ids.eos_id
    if family == "decoder" and ids.eos_id is not None:
        updates["bos_token_id"] = ids.eos_id
    if family == "encdec":
        updates["decoder_start_token_id"] = updates.get("pad_token_id", model_cfg.pad_token_id)
    model_cfg = model_cfg.replace(**updates)

    max_len = model_cfg.max_seq_len if model_cfg.position in ("learned", "sinusoidal") else None
    seq_len = cfg.data.seq_len
    check_seq_len(seq_len, max_len, "data.seq_len")
    cache = cache_root(cfg) / "tokens"
    opts = dict(val_fraction=cfg.data.val_fraction, num_proc=cfg.data.num_proc)

    def split(name):
        if objective == "seq2seq":
            src, tgt = tokenize_pairs(source, tok, cache, source_column=cfg.data.source_column,
                                      target_column=cfg.data.target_column, split=name, **opts)
            return Seq2SeqPairs(src, tgt, ids.require("eos_id", "seq2seq targets"),
                                max_source_length=seq_len,
                                max_target_length=cfg.data.target_len or seq_len)
        corpus = tokenize_corpus(source, tok, cache, column=column, split=name, **opts)
        if objective == "causal":
            return PackedCausalLM(corpus, seq_len, ids.require("eos_id", "causal LM packing"))
        if objective == "mlm":
            return MLMDataset(corpus, tok, seq_len, seed=cfg.seed, mask_prob=cfg.data.mlm_probability,
                              whole_word=cfg.data.whole_word_mask)
        return SpanCorruptionDataset(corpus, tok, seq_len, seed=cfg.seed,
                                     noise_density=cfg.data.noise_density,
                                     mean_span_length=cfg.data.mean_span_length)

    import torch.distributed as dist
    multi = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if multi and rank != 0:
        dist.barrier()  # rank 0 tokenizes and caches first; the others then read its cache
    train, validation = split("train"), split("validation")
    if multi and rank == 0:
        dist.barrier()
    target_len = None
    if objective == "span":
        target_len = t5_lengths(seq_len, cfg.data.noise_density, cfg.data.mean_span_length)[1]
    elif objective == "seq2seq":
        target_len = cfg.data.target_len or seq_len
    if target_len is not None:
        check_seq_len(target_len, max_len, "decoder target length")
    return RunData(tok, tok_path, model_cfg, train, validation, Collator(pad_id=ids.pad_id or 0),
                   objective, seq_len, target_len)


def copy_tokenizer(data: RunData, output_dir: Path) -> None:
    dest = output_dir / "tokenizer.json"
    if not dest.exists():
        shutil.copyfile(data.tokenizer_path, dest)
