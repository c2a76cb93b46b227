"""From the run config to tokenizer + train/validation datasets for the family's objective, and
the training batches a rank draws from them."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from ...config import Family, ModelConfig, check_table
from ...files import atomic_write, cache_home
from ...data import (
    Collator,
    DataError,
    MLMDataset,
    MLMDocuments,
    MixtureDataset,
    MixtureSampler,
    MixtureSchedule,
    PackedCausalLM,
    PackedMLM,
    PackedSeq2Seq,
    ResumableSampler,
    Seq2SeqPairs,
    SpanCorruptionDataset,
    check_seq_len,
    check_vocab,
    default_corpus_path,
    default_pairs_path,
    load_tokenizer,
    special_tokens,
    t5_lengths,
    tokenize_corpus,
    tokenize_pairs,
    train_tokenizer,
)
from ...data.loading import check_source
from ...data.synthetic import SYNTHETIC, SyntheticDataset
from ...data.mixture import ConcatKeyed
from ...models import spec_of
from ...parallel.dist import barrier, multi_process
from ..config import AUTO_OBJECTIVE, TrainConfig, source_name
from ..resilience.signals import ignore_interrupts

log = logging.getLogger("tformer.train")

TOKENIZER_KIND = {"decoder": "bpe", "encoder": "wordpiece", "encdec": "unigram"}
# Keys each family's forward takes from a batch (the rest, e.g. doc_ids, stays in the pipeline).
MODEL_INPUTS = {
    "decoder": ("input_ids", "labels"),
    "encoder": ("input_ids", "attention_mask", "token_type_ids", "labels"),
    "encdec": ("input_ids", "attention_mask", "labels"),
}
# What document-masked packing adds (data.document_mask=true).
DOC_INPUTS = {
    "decoder": ("doc_ids", "position_ids"),
    "encoder": ("doc_ids", "position_ids"),
    "encdec": ("decoder_input_ids", "doc_ids", "decoder_doc_ids"),
}
check_table(TOKENIZER_KIND, Family, "TOKENIZER_KIND")
check_table(MODEL_INPUTS, Family, "MODEL_INPUTS")
check_table(DOC_INPUTS, Family, "DOC_INPUTS")


@dataclass
class RunData:
    tokenizer: object  # None with data.source=synthetic
    tokenizer_path: Path | None
    model_config: ModelConfig
    train: object
    validation: object
    collator: Collator
    objective: str
    seq_len: int  # tokens per sample on the model's (encoder) input
    target_len: int | None  # decoder tokens per sample (encoder-decoder)
    model_inputs: tuple = ()  # batch keys the model's forward takes
    validation_sources: dict | None = None  # a mixture: name -> that source's validation set


def model_inputs(family: str, document_mask: bool) -> tuple:
    return MODEL_INPUTS[family] + (DOC_INPUTS[family] if document_mask else ())


def mixture_sources(cfg: TrainConfig) -> list[dict]:
    """Every source of ``data.sources`` / ``data.stages``, once per name: {name, source, text_column}."""
    d = cfg.data
    lists = [d.sources] if d.sources else [st["sources"] for st in d.stages]
    found: dict[str, dict] = {}
    for entries in lists:
        for e in entries:
            name = source_name(e)
            entry = {"name": name, "source": e["source"], "text_column": e.get("text_column", d.text_column)}
            if name in found and found[name] != entry:
                raise DataError(
                    f"mixture source name {name!r} stands for {found[name]['source']} and for "
                    f"{entry['source']}; give different sources different names"
                )
            found[name] = entry
    return list(found.values())


def mixture_schedule(cfg: TrainConfig, names: list[str], world_size: int) -> MixtureSchedule:
    """Stage ends in global sample positions: ``until_step`` x the global batch."""
    d = cfg.data
    batch = cfg.micro_batch_size * cfg.grad_accum * world_size
    stages = [{"until_step": None, "sources": d.sources}] if d.sources else d.stages

    def weights(entries):
        by_name = {source_name(e): float(e.get("weight", 1.0)) for e in entries}
        return [by_name.get(n, 0.0) for n in names]

    return MixtureSchedule(
        names, [(None if st["until_step"] is None else st["until_step"] * batch, weights(st["sources"])) for st in stages]
    )


def cache_root(cfg: TrainConfig) -> Path:
    return cache_home(cfg.data.cache_dir)


def _source(cfg: TrainConfig, objective: str):
    if cfg.data.source != "default":
        return cfg.data.source
    return default_pairs_path() if objective == "seq2seq" else default_corpus_path()


def _auto_tokenizer(cfg: TrainConfig, family: str, source, column: str, vocab_size: int, rank: int):
    """Train the family's tokenizer on the source once; later runs (and other ranks) reuse it."""
    kind = TOKENIZER_KIND[family]
    ident = json.dumps([str(source), _file_identity(source), kind, vocab_size, column, cfg.data.tokenizer_max_rows])
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
    barrier()
    return path


def _file_identity(source) -> list:
    p = Path(str(source))
    if p.is_file():
        st = p.stat()
        return [st.st_size, int(st.st_mtime)]
    return []


def check_sources(cfg: TrainConfig) -> None:
    """Every data source of the run exists and holds data (``check_source``): cheap, so the
    trainer calls it before it makes the run directory."""
    if cfg.data.source == SYNTHETIC:
        return
    entries = mixture_sources(cfg) if (cfg.data.sources or cfg.data.stages) else [{"source": cfg.data.source}]
    for e in entries:
        if e["source"] != "default":
            check_source(e["source"])


def build_data(cfg: TrainConfig, rank: int = 0, world_size: int = 1) -> RunData:
    model_cfg = cfg.model
    family = model_cfg.family
    objective = AUTO_OBJECTIVE[family] if cfg.data.objective == "auto" else cfg.data.objective
    allowed = {"decoder": ("causal",), "encoder": ("mlm",), "encdec": ("span", "seq2seq")}[family]
    if objective not in allowed:
        raise DataError(f"data.objective={objective!r} does not fit a {family} model; use {' or '.join(allowed)}")
    check_sources(cfg)  # a missing or empty source fails here, before any tokenizer or token work
    if cfg.data.source == SYNTHETIC:
        return synthetic_data(cfg, objective)
    entries = mixture_sources(cfg) if (cfg.data.sources or cfg.data.stages) else []
    if entries:  # the tokenizer ("auto") is trained on the first source
        source = default_corpus_path() if entries[0]["source"] == "default" else entries[0]["source"]
    else:
        source = _source(cfg, objective)
    # translation pairs: one joint vocabulary over both sides (the paper's shared source/target BPE)
    column = (
        [cfg.data.source_column, cfg.data.target_column]
        if objective == "seq2seq"
        else entries[0]["text_column"]
        if entries
        else cfg.data.text_column
    )
    if cfg.data.tokenizer == "auto":
        tok_path = _auto_tokenizer(cfg, family, source, column, cfg.data.tokenizer_vocab_size or model_cfg.vocab_size, rank)
    else:
        tok_path = Path(cfg.data.tokenizer)
    tok = load_tokenizer(tok_path)
    check_vocab(tok, model_cfg.vocab_size)
    ids = special_tokens(tok)

    # The model's special ids come from the tokenizer, so generation and export agree with it.
    updates = {}
    if ids.pad_id is not None:
        updates["pad_token_id"] = ids.pad_id
    spec = spec_of(model_cfg)
    if not spec.masked_lm and ids.eos_id is not None:
        updates["eos_token_id"] = ids.eos_id
    if spec.causal_lm and ids.eos_id is not None:
        updates["bos_token_id"] = ids.eos_id
    if spec.seq2seq:
        updates["decoder_start_token_id"] = updates.get("pad_token_id", model_cfg.pad_token_id)
    model_cfg = model_cfg.replace(**updates)

    max_len = model_cfg.max_seq_len if model_cfg.position in ("learned", "sinusoidal") else None
    seq_len = cfg.data.seq_len
    check_seq_len(seq_len, max_len, "data.seq_len")
    cache = cache_root(cfg) / "tokens"
    opts = dict(val_fraction=cfg.data.val_fraction, num_proc=cfg.data.num_proc, require_prepared=cfg.data.prepared)
    masked = cfg.data.document_mask

    def split(name, source=source, column=column):
        if objective == "seq2seq":
            src, tgt = tokenize_pairs(
                source,
                tok,
                cache,
                source_column=cfg.data.source_column,
                target_column=cfg.data.target_column,
                split=name,
                **opts,
            )
            pairs = Seq2SeqPairs(
                src,
                tgt,
                ids.require("eos_id", "seq2seq targets"),
                max_source_length=seq_len,
                max_target_length=cfg.data.target_len or seq_len,
            )
            if not masked:
                return pairs
            return PackedSeq2Seq(pairs, model_cfg.decoder_start_token_id, seed=cfg.seed, row_length=cfg.data.pack_len)
        corpus = tokenize_corpus(source, tok, cache, column=column, split=name, **opts)
        if objective == "causal":
            return PackedCausalLM(corpus, seq_len, ids.require("eos_id", "causal LM packing"))
        if objective == "mlm" and cfg.data.pack:
            docs = MLMDocuments(
                corpus, tok, seq_len, seed=cfg.seed, mask_prob=cfg.data.mlm_probability, whole_word=cfg.data.whole_word_mask
            )
            return PackedMLM(docs, seed=cfg.seed)
        if objective == "mlm":
            return MLMDataset(
                corpus,
                tok,
                seq_len,
                seed=cfg.seed,
                mask_prob=cfg.data.mlm_probability,
                whole_word=cfg.data.whole_word_mask,
                pairs=not masked,
                document_mask=masked,
            )
        return SpanCorruptionDataset(
            corpus,
            tok,
            seq_len,
            seed=cfg.seed,
            noise_density=cfg.data.noise_density,
            mean_span_length=cfg.data.mean_span_length,
        )

    multi = multi_process()
    if multi and rank != 0:
        barrier()  # rank 0 tokenizes and caches first; the others then read its cache
    validation_sources = None
    if entries:
        parts = [(default_corpus_path() if e["source"] == "default" else e["source"], e["text_column"]) for e in entries]
        trains = [split("train", *p) for p in parts]
        vals = [split("validation", *p) for p in parts]
        names = [e["name"] for e in entries]
        train = MixtureDataset(
            trains, mixture_schedule(cfg, names, world_size), seed=cfg.seed, on_exhausted=cfg.data.on_exhausted
        )
        validation, validation_sources = ConcatKeyed(vals), dict(zip(names, vals))
    else:
        train, validation = split("train"), split("validation")
    if multi and rank == 0:
        barrier()
    target_len = decoder_target_len(cfg, objective, seq_len, max_len)
    if objective == "seq2seq" and masked:  # packed rows: the lengths the model sees (FLOPs, MFU)
        seq_len, target_len = max(seq_len, cfg.data.pack_len or 0), max(target_len, cfg.data.pack_len or 0)
    return RunData(
        tok,
        tok_path,
        model_cfg,
        train,
        validation,
        make_collator(cfg, model_cfg, ids.pad_id or 0),
        objective,
        seq_len,
        target_len,
        model_inputs(family, masked),
        validation_sources,
    )


def make_collator(cfg: TrainConfig, model_cfg: ModelConfig, pad_id: int) -> Collator:
    """The run's collator. An encoder's unpadded batch goes without its all-ones mask, to the flash
    kernel (not under pipelining: the schedule's micro-batches must all carry the same inputs). T5
    keeps it: its relative bias is a mask tensor either way, and without the padding mask its
    gradient-carrying bias, broadcast over the batch, ran 1.25x slower on an H100 (bench_gpu's bare
    loop against the trainer, 2026-11-28)."""
    return Collator(pad_id=pad_id, drop_full_mask=spec_of(model_cfg).encoder_only and cfg.parallel.pp == 1)


def decoder_target_len(cfg: TrainConfig, objective: str, seq_len: int, max_len: int | None) -> int | None:
    """The decoder's target length of an encoder-decoder objective (span corruption's from the noise
    settings, seq2seq's configured one), checked against the model's positions; None otherwise."""
    target_len = None
    if objective == "span":
        target_len = t5_lengths(seq_len, cfg.data.noise_density, cfg.data.mean_span_length)[1]
    elif objective == "seq2seq":
        target_len = cfg.data.target_len or seq_len
    if target_len is not None:
        check_seq_len(target_len, max_len, "decoder target length")
    return target_len


def synthetic_data(cfg: TrainConfig, objective: str) -> RunData:
    """``data.source: synthetic`` (``data/synthetic.py``): random ids over the model's vocabulary,
    no tokenizer; the model keeps its configured special ids. Validation draws from another seed."""
    model_cfg = cfg.model
    max_len = model_cfg.max_seq_len if model_cfg.position in ("learned", "sinusoidal") else None
    seq_len = cfg.data.seq_len
    check_seq_len(seq_len, max_len, "data.seq_len")
    target_len = decoder_target_len(cfg, objective, seq_len, max_len)

    def split(seed: int) -> SyntheticDataset:
        return SyntheticDataset(
            objective, model_cfg.vocab_size, seq_len, target_len, seed=seed, mask_probability=cfg.data.mlm_probability
        )

    train, validation = split(cfg.seed), split(cfg.seed + 1)
    family = model_cfg.family
    collator = make_collator(cfg, model_cfg, model_cfg.pad_token_id)
    return RunData(
        None, None, model_cfg, train, validation, collator, objective, seq_len, target_len, model_inputs(family, False)
    )


def prepare_data(cfg: TrainConfig, workers: int = 1, progress: bool = True, shard_rows: int = 20_000) -> list[dict]:
    """Tokenize every source of a recipe (train and validation splits) into the token cache, as a
    training run with the same config and ``TFORMER_CACHE`` will look for it. Returns one record per
    source and split: tokens, documents (rows) and bytes on disk."""
    from ...data.cache import prepare_columns

    family = cfg.model.family
    objective = AUTO_OBJECTIVE[family] if cfg.data.objective == "auto" else cfg.data.objective
    entries = (
        mixture_sources(cfg)
        if (cfg.data.sources or cfg.data.stages)
        else [
            {
                "name": source_name({"source": _source(cfg, objective)}),
                "source": str(_source(cfg, objective)),
                "text_column": cfg.data.text_column,
            }
        ]
    )
    check_sources(cfg)
    sources = [default_corpus_path() if e["source"] == "default" else e["source"] for e in entries]
    pairs = objective == "seq2seq"
    columns = [[cfg.data.source_column, cfg.data.target_column] if pairs else [e["text_column"]] for e in entries]
    if cfg.data.tokenizer == "auto":
        tok_path = _auto_tokenizer(
            cfg,
            family,
            sources[0],
            columns[0] if pairs else columns[0][0],
            cfg.data.tokenizer_vocab_size or cfg.model.vocab_size,
            0,
        )
    else:
        tok_path = Path(cfg.data.tokenizer)
    tok = load_tokenizer(tok_path)
    cache = cache_root(cfg) / "tokens"
    report = []
    for e, source, cols in zip(entries, sources, columns):
        for split in ("train", "validation"):
            out = prepare_columns(
                source,
                tok,
                cache,
                cols,
                split=split,
                val_fraction=cfg.data.val_fraction,
                workers=workers,
                progress=progress,
                tokenizer_path=str(tok_path),
                shard_rows=shard_rows,
            )
            first = next(iter(out.values()))
            entry = cache / first.meta["key"]
            report.append(
                {
                    "name": e["name"],
                    "split": split,
                    "tokens": sum(c.num_tokens for c in out.values()),
                    "documents": first.num_docs,
                    "bytes": sum(f.stat().st_size for f in entry.iterdir() if f.is_file()),
                }
            )
    return report


def copy_tokenizer(data: RunData, output_dir: Path) -> None:
    if data.tokenizer_path is None:
        return  # synthetic data: a run without a tokenizer
    dest = output_dir / "tokenizer.json"
    if not dest.exists():
        shutil.copyfile(data.tokenizer_path, dest)


def train_batches(cfg: TrainConfig, data: RunData, dp_rank: int, dp_size: int, consumed: int, device: torch.device):
    """This data-parallel rank's training batches, from ``consumed`` on (global samples, or batches
    with token-budget batches: the sampler's unit), at any number of ranks."""
    if cfg.data.tokens_per_batch is not None:
        from ...data import TokenBudgetSampler

        src, tgt = data.train.lengths()
        sampler = TokenBudgetSampler(
            src,
            tgt,
            cfg.data.tokens_per_batch,
            seed=cfg.seed,
            rank=dp_rank,
            world_size=dp_size,
            consumed=consumed,
        )
        return iter(torch.utils.data.DataLoader(data.train, batch_sampler=sampler, **loader_options(cfg, data, device)))
    # micro-batches dealt to the ranks whole: each is one that 1 process would accumulate
    ranks = dict(rank=dp_rank, world_size=dp_size, consumed=consumed, block=cfg.micro_batch_size)
    if isinstance(data.train, MixtureDataset):
        sampler = MixtureSampler(data.train, **ranks)
    else:
        sampler = ResumableSampler(len(data.train), seed=cfg.seed, **ranks)
    loader = torch.utils.data.DataLoader(
        data.train, batch_size=cfg.micro_batch_size, sampler=sampler, **loader_options(cfg, data, device)
    )
    return iter(loader)


def loader_options(cfg: TrainConfig, data: RunData, device: torch.device) -> dict:
    """DataLoader settings of both samplers: collation, workers, pinned host memory on a GPU
    (so the step's ``.to(device, non_blocking=True)`` copies overlap), and a generator of its
    own: creating the iterator must not draw from the global RNG that dropout uses."""
    workers = cfg.data.num_workers
    return dict(
        collate_fn=data.collator,
        num_workers=workers,
        persistent_workers=workers > 0,
        pin_memory=device.type == "cuda",
        generator=torch.Generator().manual_seed(cfg.seed),
        worker_init_fn=ignore_interrupts if workers > 0 else None,
    )
