"""Tokenize a corpus once, in parallel, into flat memory-mapped token arrays on disk.

A cache entry is a directory ``<cache_dir>/<key>/`` holding, per text column ``c``:

- ``c.tokens.bin``: every row's token ids back to back, no special tokens added (uint16 when the
  vocabulary fits, else uint32), read with ``np.memmap``;
- ``c.offsets.npy``: int64 row boundaries, ``len = rows + 1``; row ``i`` is
  ``tokens[offsets[i]:offsets[i+1]]``. Every row is kept, empty ones too, so columns stay aligned;

plus ``meta.json`` (counts, dtype, settings). The key hashes the source's identity (resolved
paths, sizes and mtimes; a ``datasets`` fingerprint; or a hub name), the tokenizer's JSON and the
settings, so a second run with the same inputs opens the arrays without importing `datasets`.
Entries are built in a temporary directory and renamed into place, so a crash leaves no half
entry. With several ranks, build on rank 0 and barrier before the others call.

Raw text that happens to spell a special token (``<|endoftext|>``, ``[SEP]``...) is tokenized as
plain text: only the objectives insert special tokens.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
from tokenizers import Tokenizer

from ..files import publish
from .errors import DataError
from .tokenizer import tokenizer_hash, vocab_size

log = logging.getLogger("tformer.data")

CACHE_VERSION = 1


@dataclass
class TokenizedCorpus:
    """Rows of token ids stored flat: ``tokens`` (1-D) and ``offsets`` (``num_docs + 1``)."""

    tokens: np.ndarray
    offsets: np.ndarray
    meta: dict = field(default_factory=dict)

    @classmethod
    def from_docs(cls, docs: Iterable[Sequence[int]]) -> "TokenizedCorpus":
        """Build an in-memory corpus from lists of ids (tests, small data)."""
        docs = [np.asarray(d, dtype=np.int64) for d in docs]
        lengths = np.array([len(d) for d in docs], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        flat = np.concatenate(docs) if docs else np.zeros(0, np.int64)
        dtype = np.uint16 if flat.size == 0 or flat.max() < 2**16 else np.uint32
        return cls(flat.astype(dtype), offsets)

    @property
    def num_docs(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def doc(self, i: int) -> np.ndarray:
        return np.asarray(self.tokens[self.offsets[i] : self.offsets[i + 1]], dtype=np.int64)


def tokenize_corpus(
    source, tokenizer: Tokenizer, cache_dir: str | Path, *, column: str = "text", **options
) -> TokenizedCorpus:
    """Token ids of ``column`` in ``source``, from the cache or tokenized now and cached.

    ``source`` and the options ``split`` ("train" | "validation" | "all"), ``streaming``,
    ``val_fraction``, ``format``, ``text_unit``, ``config_name`` are those of
    ``tformer.data.loading.load_text_dataset``. Further options:

    num_proc    processes for ``Dataset.map`` (default: all cores for >= 20k rows, else 1; with
                ``streaming`` the tokenizer's own threads are used instead).
    cache_key   identity of the source when it cannot be derived (a streaming dataset object).
    max_tokens  stop reading a streamed source after this many tokens (a count is logged).
    """
    return _cached(source, tokenizer, cache_dir, [column], **options)[column]


def tokenize_pairs(
    source, tokenizer: Tokenizer, cache_dir: str | Path, *, source_column: str = "src", target_column: str = "tgt", **options
) -> tuple[TokenizedCorpus, TokenizedCorpus]:
    """Row-aligned token ids of two columns (e.g. the bundled en-es pairs), cached together."""
    out = _cached(source, tokenizer, cache_dir, [source_column, target_column], **options)
    return out[source_column], out[target_column]


# ---------------------------------------------------------------------------------------------


def _source_identity(source, cache_key: str | None) -> list:
    if cache_key is not None:
        return ["key", cache_key]
    if type(source).__module__.startswith("datasets."):
        fingerprint = getattr(source, "_fingerprint", None)
        if fingerprint is None:
            raise DataError(
                "cannot derive a cache key for a streaming dataset object: pass "
                "cache_key='<name of the data and its version>'"
            )
        return ["dataset", fingerprint]
    from .loading import resolve_source

    kind, what = resolve_source(source)
    if kind == "hub":
        return ["hub", what]
    files = sorted(f for f in what[0].rglob("*") if f.is_file()) if kind == "saved" else what
    return [kind] + [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files]


def _settings(split: str, val_fraction, format, text_unit: str, config_name, max_tokens) -> dict:
    """What, besides the source and the tokenizer, makes a cache entry: part of its key, so a
    training run and ``tformer data prepare`` with the same inputs meet in the same entry."""
    return dict(
        split=split,
        val_fraction=val_fraction if split != "all" else None,  # the whole source has no split
        format=format,
        text_unit=text_unit,
        config_name=config_name,
        max_tokens=max_tokens,
    )


def _cache_key(identity: list, tok: Tokenizer, columns: list[str], settings: dict) -> str:
    blob = json.dumps(
        {
            "version": CACHE_VERSION,
            "source": identity,
            "tokenizer": tokenizer_hash(tok),
            "columns": columns,
            "settings": settings,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def _open(entry: Path, columns: list[str]) -> dict[str, TokenizedCorpus]:
    meta = json.loads((entry / "meta.json").read_text())
    out = {}
    for c in columns:
        n = meta["columns"][c]["tokens"]
        tokens = np.memmap(entry / f"{c}.tokens.bin", dtype=meta["dtype"], mode="r", shape=(n,))
        offsets = np.load(entry / f"{c}.offsets.npy", mmap_mode="r")
        out[c] = TokenizedCorpus(tokens, offsets, meta)
    return out


def _cached(
    source,
    tok: Tokenizer,
    cache_dir,
    columns: list[str],
    *,
    split: str = "train",
    streaming: bool = False,
    val_fraction: float = 0.01,
    format: str | None = None,
    text_unit: str = "line",
    config_name: str | None = None,
    num_proc: int | None = None,
    cache_key: str | None = None,
    max_tokens: int | None = None,
    require_prepared: bool = False,
) -> dict[str, TokenizedCorpus]:
    settings = _settings(split, val_fraction, format, text_unit, config_name, max_tokens)
    identity = _source_identity(source, cache_key)
    key = _cache_key(identity, tok, columns, settings)
    cache_dir = Path(cache_dir)
    entry = cache_dir / key
    if (entry / "meta.json").is_file():
        out = _open(entry, columns)
        log.info(
            "token cache hit %s: %s",
            entry,
            ", ".join(f"{c}: {v.num_tokens:,} tokens in {v.num_docs:,} rows" for c, v in out.items()),
        )
        return out
    if require_prepared:
        _refuse_unprepared(source, tok, cache_dir, identity, columns, settings)

    start = time.perf_counter()
    tmp = cache_dir / f".{key}.tmp.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        from .loading import load_text_dataset, resolve_source

        local = not isinstance(source, (str, Path, list, tuple)) or resolve_source(source)[0] != "hub"
        ds = load_text_dataset(
            source,
            columns=columns,
            split=split,
            streaming=streaming,
            val_fraction=val_fraction,
            format=format,
            text_unit=text_unit,
            config_name=config_name,
            cache_dir=tmp / "hf" if local else None,
        )
        encoder = Tokenizer.from_str(tok.to_str())
        encoder.no_truncation()
        encoder.no_padding()
        dtype = np.uint16 if vocab_size(tok) <= 2**16 else np.uint32
        if streaming or not hasattr(ds, "map") or type(ds).__name__ == "IterableDataset":
            counts = _write_streamed(ds, encoder, columns, tmp, dtype, max_tokens, source)
        else:
            counts = _write_mapped(ds, encoder, columns, tmp, dtype, num_proc)
        del ds
        for c, n in counts.items():
            if n["tokens"] == 0:
                raise DataError(
                    f"no tokens in column {c!r} of {_describe(source)}: all {n['rows']:,} "
                    f"rows are empty; give data with text"
                )
            if n["empty_rows"]:
                log.info(
                    "column %r: %d of %d rows are empty (kept in the cache; objectives skip them)",
                    c,
                    n["empty_rows"],
                    n["rows"],
                )
        meta = dict(
            version=CACHE_VERSION,
            key=key,
            source=_describe(source),
            columns=counts,
            dtype=np.dtype(dtype).name,
            vocab_size=vocab_size(tok),
            settings=settings,
        )
        shutil.rmtree(tmp / "hf", ignore_errors=True)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        publish(tmp, entry, keep_existing=True)  # another process may have finished the same entry first
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        from .loading import utf8_error

        if not isinstance(e, DataError) and (bad := utf8_error(e, source)) is not None:
            raise bad from e
        raise
    out = _open(entry, columns)
    log.info(
        "token cache built %s in %.1fs: %s",
        entry,
        time.perf_counter() - start,
        ", ".join(f"{c}: {v.num_tokens:,} tokens in {v.num_docs:,} rows" for c, v in out.items()),
    )
    return out


def _manifest_path(cache_dir: Path, identity: list, columns: list[str], settings: dict) -> Path:
    """Where `prepare` notes which tokenizer made a source's entry (one file per source + split)."""
    blob = json.dumps({"source": identity, "columns": columns, "settings": settings}, sort_keys=True)
    return cache_dir / "prepared" / f"{hashlib.sha256(blob.encode()).hexdigest()[:24]}.json"


def _refuse_unprepared(source, tok, cache_dir: Path, identity, columns, settings) -> None:
    manifest = _manifest_path(cache_dir, identity, columns, settings)
    if manifest.is_file():
        made = json.loads(manifest.read_text())
        raise DataError(
            f"the prepared token cache for {_describe(source)} ({settings['split']}) in {cache_dir} was "
            f"made with another tokenizer ({made['tokenizer_hash'][:12]}, {made.get('tokenizer_path')}; "
            f"this run's is {tokenizer_hash(tok)[:12]}): prepare again with this run's config, or set "
            "data.tokenizer to the tokenizer the cache was made with"
        )
    raise DataError(
        f"data.prepared=true but {cache_dir} holds no prepared tokens for {_describe(source)} "
        f"({settings['split']}): run `tformer data prepare CONFIG` with TFORMER_CACHE={cache_dir.parent}, "
        "or set data.prepared=false to tokenize here"
    )


SHARD_ROWS = 20_000
_JOB: dict = {}  # what forked prepare workers inherit: the dataset, encoder and shard layout


def prepare_columns(
    source,
    tokenizer: Tokenizer,
    cache_dir: str | Path,
    columns: list[str],
    *,
    split: str = "train",
    val_fraction: float = 0.01,
    workers: int = 1,
    shard_rows: int = SHARD_ROWS,
    progress: bool = True,
    tokenizer_path: str | None = None,
    format: str | None = None,
    text_unit: str = "line",
    config_name: str | None = None,
) -> dict[str, TokenizedCorpus]:
    """Tokenize ``columns`` of ``source`` into the same cache entry ``tokenize_corpus`` would build,
    ahead of time: in shards of ``shard_rows`` rows over ``workers`` forked processes, resumable.

    The rows are read from `datasets`' memory-mapped Arrow copy one batch at a time, so a source
    larger than memory streams through. Each finished shard is renamed into
    ``<cache>/.<key>.prepare/`` at once; a re-run after a crash (even SIGKILL) keeps finished shards
    and redoes only the rest, and the assembled entry is byte-identical to an uninterrupted build.
    """
    settings = _settings(split, val_fraction, format, text_unit, config_name, max_tokens=None)
    identity = _source_identity(source, None)
    key = _cache_key(identity, tokenizer, columns, settings)
    cache_dir = Path(cache_dir)
    entry = cache_dir / key
    if not (entry / "meta.json").is_file():
        _prepare_entry(source, tokenizer, cache_dir, key, columns, settings, workers, shard_rows, progress)
    manifest = _manifest_path(cache_dir, identity, columns, settings)
    manifest.parent.mkdir(parents=True, exist_ok=True)
    tmp = manifest.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(
        json.dumps(
            {
                "key": key,
                "tokenizer_hash": tokenizer_hash(tokenizer),
                "tokenizer_path": tokenizer_path,
                "source": _describe(source),
            },
            indent=1,
        )
    )
    os.replace(tmp, manifest)
    return _open(entry, columns)


def _prepare_entry(source, tok, cache_dir: Path, key: str, columns, settings, workers, shard_rows, progress):
    import multiprocessing

    from .loading import load_text_dataset

    work = cache_dir / f".{key}.prepare"
    work.mkdir(parents=True, exist_ok=True)
    for stale in work.glob("*.tmp*"):  # a shard a killed run was writing
        shutil.rmtree(stale, ignore_errors=True)
    ds = load_text_dataset(
        source,
        columns=columns,
        split=settings["split"],
        val_fraction=settings["val_fraction"] or 0.01,
        format=settings["format"],
        text_unit=settings["text_unit"],
        config_name=settings["config_name"],
        cache_dir=work / "hf",
    )
    encoder = Tokenizer.from_str(tok.to_str())
    encoder.no_truncation()
    encoder.no_padding()
    dtype = np.uint16 if vocab_size(tok) <= 2**16 else np.uint32
    shards = max(1, -(-len(ds) // shard_rows))
    todo = [i for i in range(shards) if not (work / f"shard{i:06d}").is_dir()]
    _JOB.update(ds=ds, encoder=encoder, columns=columns, work=work, dtype=dtype, rows=shard_rows)
    if todo and len(todo) < shards:
        log.info(
            "prepare %s: %d of %d shards already done, tokenizing the other %d",
            _describe(source),
            shards - len(todo),
            shards,
            len(todo),
        )
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(
            total=shards,
            initial=shards - len(todo),
            unit="shard",
            desc=f"{Path(str(_describe(source))).name} {settings['split']}",
        )
    try:
        workers = max(1, min(workers, len(todo)))
        # One tokenizer thread per worker: --workers is the number of cores prepare uses.
        saved = os.environ.get("TOKENIZERS_PARALLELISM")
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        try:
            if workers == 1:
                for i in todo:
                    _tokenize_shard(i)
                    bar is not None and bar.update(1)
            else:
                with multiprocessing.get_context("fork").Pool(workers) as pool:
                    for _ in pool.imap_unordered(_tokenize_shard, todo):
                        bar is not None and bar.update(1)
        finally:
            if saved is None:
                os.environ.pop("TOKENIZERS_PARALLELISM", None)
            else:
                os.environ["TOKENIZERS_PARALLELISM"] = saved
    finally:
        _JOB.clear()
        if bar is not None:
            bar.close()
    del ds
    tmp = cache_dir / f".{key}.tmp.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    counts = {}
    for c in columns:
        lengths = []
        with open(tmp / f"{c}.tokens.bin", "wb") as out:
            for i in range(shards):
                with open(work / f"shard{i:06d}" / f"{c}.tokens.bin", "rb") as fh:
                    shutil.copyfileobj(fh, out, 1 << 24)
                lengths.append(np.load(work / f"shard{i:06d}" / f"{c}.lengths.npy"))
        counts[c] = _save_offsets(tmp, c, np.concatenate(lengths))
        if counts[c]["tokens"] == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            raise DataError(
                f"no tokens in column {c!r} of {_describe(source)}: all {counts[c]['rows']:,} rows "
                "are empty; give data with text"
            )
    meta = dict(
        version=CACHE_VERSION,
        key=key,
        source=_describe(source),
        columns=counts,
        dtype=np.dtype(dtype).name,
        vocab_size=vocab_size(tok),
        settings=settings,
    )
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    try:
        os.replace(tmp, cache_dir / key)
    except OSError:  # another process finished the same entry first
        shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)


def _tokenize_shard(i: int) -> int:
    job = _JOB
    ds, columns, rows = job["ds"], job["columns"], job["rows"]
    final = job["work"] / f"shard{i:06d}"
    tmp = job["work"] / f"shard{i:06d}.tmp{os.getpid()}"
    tmp.mkdir()
    files = {c: open(tmp / f"{c}.tokens.bin", "wb") for c in columns}
    lengths = {c: [] for c in columns}
    try:
        for a in range(i * rows, min((i + 1) * rows, len(ds)), 1000):
            batch = ds[a : min(a + 1000, (i + 1) * rows, len(ds))]
            encoded = _encode_batch(batch, job["encoder"], columns)
            for c in columns:
                ids = encoded[f"ids.{c}"]
                lengths[c].append(np.fromiter((len(x) for x in ids), np.int64, len(ids)))
                if ids:
                    files[c].write(np.concatenate([np.asarray(x, job["dtype"]) for x in ids]).tobytes())
    finally:
        for fh in files.values():
            fh.close()
    for c in columns:
        np.save(tmp / f"{c}.lengths.npy", np.concatenate(lengths[c]) if lengths[c] else np.zeros(0, np.int64))
    os.replace(tmp, final)
    return i


def _describe(source) -> str:
    if isinstance(source, (list, tuple)):
        return ", ".join(str(s) for s in source)
    if isinstance(source, (str, Path)):
        return str(source)
    return f"dataset {getattr(source, '_fingerprint', type(source).__name__)}"


def _encode_batch(batch: dict, encoder: Tokenizer, columns: list[str]) -> dict:
    encoder.encode_special_tokens = True  # set here: pickling to map workers drops the flag
    out = {}
    for c in columns:
        texts = [t if t is not None else "" for t in batch[c]]
        out[f"ids.{c}"] = [e.ids for e in encoder.encode_batch_fast(texts, add_special_tokens=False)]
    return out


def _write_mapped(ds, encoder: Tokenizer, columns, tmp: Path, dtype, num_proc) -> dict:
    import datasets
    import pyarrow.compute as pc

    if num_proc is None:
        num_proc = (os.cpu_count() or 1) if len(ds) >= 20_000 else 1
    num_proc = max(1, min(num_proc, len(ds)))
    features = datasets.Features({f"ids.{c}": datasets.List(datasets.Value("uint32")) for c in columns})
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    if num_proc > 1:  # forked workers: one tokenizer thread each, and no fork warning
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        mapped = ds.map(
            _encode_batch,
            batched=True,
            batch_size=1000,
            num_proc=num_proc,
            remove_columns=ds.column_names,
            features=features,
            fn_kwargs=dict(encoder=encoder, columns=columns),
            cache_file_name=str(tmp / "hf" / "tokenized.arrow"),
            desc="tokenizing",
        )
    finally:
        if saved is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved
    counts = {}
    for c in columns:
        lengths = []
        with open(tmp / f"{c}.tokens.bin", "wb") as fh:
            for chunk in mapped.data.column(f"ids.{c}").chunks:
                fh.write(chunk.flatten().to_numpy(zero_copy_only=False).astype(dtype).tobytes())
                lengths.append(pc.list_value_length(chunk).fill_null(0).to_numpy(zero_copy_only=False))
        counts[c] = _save_offsets(tmp, c, np.concatenate(lengths) if lengths else np.zeros(0, np.int64))
    return counts


def _write_streamed(ds, encoder: Tokenizer, columns, tmp: Path, dtype, max_tokens, source) -> dict:
    files = {c: open(tmp / f"{c}.tokens.bin", "wb") for c in columns}
    lengths = {c: [] for c in columns}
    total, stopped = 0, False
    try:
        for batch in ds.iter(batch_size=1000):
            if max_tokens is not None and total >= max_tokens:
                stopped = True
                break
            encoded = _encode_batch(batch, encoder, columns)
            for c in columns:
                ids = encoded[f"ids.{c}"]
                lengths[c].append(np.fromiter((len(x) for x in ids), np.int64, len(ids)))
                if ids:
                    files[c].write(np.concatenate([np.asarray(x, dtype) for x in ids]).tobytes())
                total += int(lengths[c][-1].sum()) if c == columns[0] else 0
    finally:
        for fh in files.values():
            fh.close()
    if stopped:
        log.warning("streaming stopped at max_tokens=%d: the rest of %s is not in the cache", max_tokens, _describe(source))
    counts = {}
    for c in columns:
        counts[c] = _save_offsets(tmp, c, np.concatenate(lengths[c]) if lengths[c] else np.zeros(0, np.int64))
    if counts[columns[0]]["rows"] == 0:
        raise DataError(f"no rows in {_describe(source)}: the data is empty; give a file with data")
    return counts


def _save_offsets(tmp: Path, column: str, lengths: np.ndarray) -> dict:
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    np.save(tmp / f"{column}.offsets.npy", offsets)
    return dict(rows=int(len(lengths)), tokens=int(offsets[-1]), empty_rows=int((lengths == 0).sum()))
