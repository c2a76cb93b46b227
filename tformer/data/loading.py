"""Load text with `datasets`: local text/jsonl/parquet/arrow/csv files, a hub name, or streaming.

Every bad input becomes one ``DataError`` naming the file or column and the fix, instead of the
library's nested exceptions.
"""

from __future__ import annotations

import glob
import logging
from pathlib import Path
from typing import Sequence

from .corpus import fixed_validation_start, split_rows
from .errors import DataError

log = logging.getLogger("tformer.data")

_COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst", ".lz4")
_FORMATS = {
    ".txt": "text",
    ".text": "text",
    ".md": "text",
    ".json": "json",
    ".jsonl": "json",
    ".ndjson": "json",
    ".parquet": "parquet",
    ".arrow": "arrow",
    ".csv": "csv",
}


def file_format(path: Path) -> str:
    """The `datasets` builder for a file, from its extension (a compression suffix is skipped)."""
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in _COMPRESSIONS:
        suffixes = suffixes[:-1]
    fmt = _FORMATS.get(suffixes[-1]) if suffixes else None
    if fmt is None:
        raise DataError(
            f"unknown file type for {path}: name it .txt, .jsonl, .parquet, .arrow "
            f"or .csv (optionally .gz), or pass format=..."
        )
    return fmt


def _is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file())


def resolve_source(source) -> tuple[str, list[Path] | str]:
    """Classify ``source``: ("files", paths) | ("saved", [dir]) | ("hub", name).

    Accepts a path, a glob, a directory (its data files, sorted) or a list of those. A string that
    names no local file and has no file extension is taken as a hub dataset name.
    """
    items = [source] if isinstance(source, (str, Path)) else list(source)
    if not items:
        raise DataError("no data files given: pass at least one file, glob or directory")
    files: list[Path] = []
    for item in items:
        p = Path(item).expanduser()
        s = str(item)
        if any(c in s for c in "*?["):
            matches = sorted(Path(m) for m in glob.glob(str(p), recursive=True) if Path(m).is_file())
            if not matches:
                raise DataError(f"no files match {s}: check the pattern and the current directory")
            files += matches
        elif p.is_dir():
            if _is_saved_dataset(p):
                if len(items) > 1:
                    raise DataError(f"{p} is a saved dataset: load it on its own, not with other files")
                return "saved", [p]
            found = sorted(f for f in p.iterdir() if f.is_file() and _known(f))
            if not found:
                raise DataError(f"no .txt/.jsonl/.parquet/.arrow/.csv files in directory {p}")
            files += found
        elif p.is_file():
            files.append(p)
        elif len(items) == 1 and not p.suffix and s.count("/") <= 1 and not s.startswith((".", "/", "~")):
            return "hub", s
        else:
            raise DataError(f"file not found: {p.resolve()}: check the path (relative paths start at {Path.cwd()})")
    return "files", files


def check_source(source) -> None:
    """Refuse a source that cannot give a single row, cheaply and before any tokenizer or token
    work: a path that does not exist, or a local file that is empty or holds only whitespace
    (which used to surface, after a tokenizer was trained, as "the corpus has 3 tokens"). Hub
    names and saved datasets are checked when they are loaded."""
    kind, files = resolve_source(source)
    if kind != "files":
        return
    for f in files:
        _check_not_empty(f)
        if file_format(f) in ("text", "json", "csv"):
            blank = _whitespace_bytes(f)
            if blank == 0:
                raise DataError(f"data source {f} is empty (nothing after decompression): give a file with data")
            if blank is not None:
                raise DataError(f"data source {f} is blank ({blank} bytes, all whitespace): give a file with text")


def _whitespace_bytes(f: Path) -> int | None:
    """The size of a (decompressed) text file that holds only whitespace, else None. Reading stops
    at the first chunk with text, so a real file costs one small read."""
    import fsspec

    seen = 0
    with fsspec.open(str(f), "rb", compression="infer") as fh:
        while chunk := fh.read(1 << 16):
            if chunk.strip():
                return None
            seen += len(chunk)
    return seen


def _check_not_empty(f: Path) -> None:
    if f.stat().st_size == 0:
        raise DataError(f"data source {f} is empty (0 bytes): give a file with data")


def _known(path: Path) -> bool:
    try:
        file_format(path)
        return True
    except DataError:
        return False


def _find_bad_utf8(files: Sequence[Path]) -> str | None:
    """Name the first file with invalid UTF-8 and where, reading compressed files decompressed."""
    import fsspec

    for f in files:
        if file_format(f) not in ("text", "json", "csv"):
            continue
        with fsspec.open(str(f), "rb", compression="infer") as fh:
            data_offset, line = 0, 1
            tail = b""
            while chunk := fh.read(1 << 22):
                buf = tail + chunk
                try:
                    buf.decode("utf-8")
                    tail = b""
                except UnicodeDecodeError as e:
                    if e.end == len(buf) and e.reason == "unexpected end of data":
                        tail = buf[e.start :]  # a character split across chunks
                        buf = buf[: e.start]
                    else:
                        bad = data_offset + e.start
                        line += buf.count(b"\n", 0, e.start)
                        return f"{f} is not valid UTF-8 (byte {bad}, line {line})"
                line += buf.count(b"\n")
                data_offset += len(buf)
            if tail:
                return f"{f} is not valid UTF-8 (truncated character at byte {data_offset})"
    return None


def _cause_chain(e: BaseException):
    while e is not None:
        yield e
        e = e.__cause__ or e.__context__


def utf8_error(e: BaseException, source) -> DataError | None:
    """A DataError naming the bad file and line if ``e`` comes from invalid UTF-8, else None.

    Some readers fail late: pyarrow's JSON reader stores invalid bytes and decoding fails only
    when rows are read, so callers that read rows (tokenization) use this too.
    """
    decode = any(isinstance(c, UnicodeDecodeError) for c in _cause_chain(e))
    if not decode and not any("utf-8" in str(c).lower() or "utf8" in str(c).lower() for c in _cause_chain(e)):
        return None
    where = None
    if isinstance(source, (str, Path, list, tuple)):
        kind, files = resolve_source(source)
        if kind == "files":
            where = _find_bad_utf8(files)
    if where is None:
        if not decode:
            return None
        where = f"{source} is not valid UTF-8"
    return DataError(f"{where}: convert it to UTF-8, e.g. `iconv -f latin1 -t utf-8`")


def load_text_dataset(
    source,
    *,
    columns: Sequence[str] | None = ("text",),
    split: str = "train",
    streaming: bool = False,
    val_fraction: float = 0.01,
    format: str | None = None,
    text_unit: str = "line",
    config_name: str | None = None,
    cache_dir: str | Path | None = None,
):
    """Load ``source`` as a `datasets` Dataset (IterableDataset when ``streaming``).

    source      path / glob / directory / list of them (text, jsonl, parquet, arrow, csv; ``.gz``
                etc. read directly), a directory written by ``Dataset.save_to_disk``, a hub dataset
                name (needs network), or an already loaded ``datasets`` dataset.
    columns     columns that must exist (text files have the one column ``text``).
    split       "train" | "validation" | "all". Local files and saved datasets: validation is
                the last ``val_fraction`` of rows in file order (the bundled corpus: its fixed
                book split, see ``tformer.data.corpus``). Hub names: the hub's own split name
                ("all" means "train").
                Streaming files cannot be split: use separate validation files and "all".
    text_unit   for text files: "line" (one row per line), "paragraph" or "document" (per file).
    cache_dir   where `datasets` keeps its Arrow copy (default: its own cache).
    """
    import datasets

    if type(source).__module__.startswith("datasets."):
        ds = source
        origin = "the given dataset"
        if split != "all":
            if not hasattr(ds, "select"):
                raise DataError(
                    "a streaming dataset cannot hold out validation rows: pass "
                    "split='all' and give validation data separately"
                )
            ds = ds.select(split_rows(len(ds), split, val_fraction))
    else:
        kind, what = resolve_source(source)
        origin = what if kind == "hub" else ", ".join(str(f) for f in what)
        if kind == "hub":
            try:
                ds = datasets.load_dataset(
                    what,
                    config_name,
                    split="train" if split == "all" else split,
                    streaming=streaming,
                    cache_dir=None if cache_dir is None else str(cache_dir),
                )
            except Exception as e:
                msg = str(e).splitlines()[0] if str(e) else type(e).__name__
                raise DataError(
                    f"cannot load dataset {what!r} from the hub ({msg}): check the name and the network, or give local files"
                ) from e
        elif kind == "saved":
            ds = datasets.load_from_disk(str(what[0]))
            if isinstance(ds, datasets.DatasetDict):
                raise DataError(
                    f"{what[0]} holds several splits ({', '.join(ds)}): give the "
                    f"directory of one split, e.g. {what[0] / next(iter(ds))}"
                )
            if streaming:
                ds = ds.to_iterable_dataset()
            elif split != "all":
                ds = ds.select(split_rows(len(ds), split, val_fraction))
        else:
            ds = _load_files(
                what,
                split=split,
                streaming=streaming,
                val_fraction=val_fraction,
                format=format,
                text_unit=text_unit,
                cache_dir=cache_dir,
            )
    if columns:
        names = ds.column_names
        if names is None and streaming:  # unknown until the first row
            try:
                names = list(next(iter(ds)).keys())
            except StopIteration:
                raise DataError(f"no rows in {origin}: the data is empty; give a file with data") from None
            except Exception as e:
                if (bad := utf8_error(e, source)) is not None:
                    raise bad from e
                raise
        for c in columns:
            if c not in names:
                raise DataError(
                    f"column {c!r} not found in {origin} (columns: {', '.join(names)}): pass one of these as the text column"
                )
        feats = ds.features
        for c in columns:
            dtype = getattr(feats.get(c), "dtype", "string") if feats else "string"
            if dtype not in ("string", "large_string"):
                raise DataError(f"column {c!r} in {origin} holds {dtype}, not text: pick a text column")
    return ds


def _load_files(files: list[Path], *, split, streaming, val_fraction, format, text_unit, cache_dir):
    import datasets

    formats = {format or file_format(f) for f in files}
    if len(formats) > 1:
        raise DataError(f"mixed file types ({', '.join(sorted(formats))}) in {files[0].parent}: give files of one type")
    fmt = formats.pop()
    for f in files:
        _check_not_empty(f)
    kwargs = {"sample_by": text_unit} if fmt == "text" else {}
    names = ", ".join(str(f) for f in files)
    if streaming and split != "all":
        raise DataError(
            f"streaming cannot hold out validation rows of {names}: use split='all' and give separate validation files"
        )
    try:
        ds = datasets.load_dataset(
            fmt,
            data_files=[str(f) for f in files],
            split="train",
            streaming=streaming,
            **kwargs,
            cache_dir=None if cache_dir is None else str(cache_dir),
        )
    except Exception as e:
        if (bad := utf8_error(e, files)) is not None:
            raise bad from e
        if isinstance(e, StopIteration) or any(type(c).__name__ == "SchemaInferenceError" for c in _cause_chain(e)):
            raise DataError(f"no rows in {names}: the data is empty; give a file with data") from e
        raise DataError(
            f"cannot read {names} as {fmt}: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
            ": check the file's contents match its extension"
        ) from e
    if streaming:
        return ds
    if len(ds) == 0:
        raise DataError(f"no rows in {names}: the data is empty; give a file with data")
    if split != "all":
        ds = ds.select(split_rows(len(ds), split, val_fraction, fixed_validation_start(files)))
    return ds
