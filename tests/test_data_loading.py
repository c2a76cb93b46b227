"""Loading with `datasets`, the bundled corpus and its split, the token cache, and bad input."""

import gzip
import json
import os
import pickle
import re

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import numpy as np
import pytest

import tformer.data.loading as loading
from tformer.data import (
    DataError,
    PackedCausalLM,
    check_seq_len,
    default_corpus_path,
    default_pairs_path,
    load_text_dataset,
    split_rows,
    tokenize_corpus,
    tokenize_pairs,
    train_tokenizer,
)


@pytest.fixture(scope="module")
def lines():
    with gzip.open(default_corpus_path(), "rt", encoding="utf-8") as f:
        return [next(f).rstrip("\n") for _ in range(400)]


@pytest.fixture(scope="module")
def tok(lines):
    import datasets

    return train_tokenizer("bpe", datasets.Dataset.from_dict({"text": lines}), 400)


def write_text(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def encode_all(tok, texts):
    return [tok.encode(t, add_special_tokens=False).ids for t in texts]


def test_bundled_corpus_split_is_fixed():
    train = load_text_dataset(default_corpus_path(), split="train")
    val = load_text_dataset(default_corpus_path(), split="validation")
    assert (len(train), len(val)) == (36184, 1138)
    assert train[0]["text"].startswith("In the beginning, God created")
    assert val[0]["text"].startswith("God, having in the past spoken to the fathers")  # Hebrews 1:1
    assert val[-1]["text"] == "The grace of the Lord Jesus Christ be with all the saints. Amen."
    pairs = load_text_dataset(default_pairs_path(), columns=["src", "tgt"], split="validation")
    assert len(pairs) == 1138 and pairs[0]["ref"] == "Hebrews 1:1"
    assert pairs[-1]["ref"] == "Revelation of John 22:21"
    # Strong's concordance tags of the Spanish SWORD module are gone (corpus/README.md)
    with gzip.open(default_pairs_path(), "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == 31084 and not any(re.search(r"<[GH]\d+>", r["src"] + r["tgt"]) for r in rows)
    assert rows[29]["tgt"].endswith("en que hay vida, toda hierba verde les será para comer: y fué así.")  # Genesis 1:30


def test_split_rows_rule():
    assert split_rows(1000, "validation") == range(990, 1000)
    assert split_rows(1000, "train") == range(0, 990)
    assert split_rows(5, "validation", val_fraction=0.01) == range(4, 5)  # at least one row
    assert split_rows(5, "all") == range(5)
    with pytest.raises(DataError, match="cannot split 1 rows"):
        split_rows(1, "train")
    with pytest.raises(DataError, match="unknown split 'test'"):
        split_rows(10, "test")


def test_formats_load_the_same_rows(tmp_path, lines):
    import datasets

    texts = lines[:50]
    write_text(tmp_path / "a.txt", texts)
    with gzip.open(tmp_path / "a.txt.gz", "wt", encoding="utf-8") as f:
        f.write("\n".join(texts) + "\n")
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    ds = datasets.Dataset.from_dict({"text": texts})
    ds.to_parquet(str(tmp_path / "a.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    arrow = next((tmp_path / "saved").glob("*.arrow")).relative_to(tmp_path)
    for source in ["a.txt", "a.txt.gz", "a.jsonl", "a.parquet", "saved", arrow]:
        got = load_text_dataset(tmp_path / source, split="all", cache_dir=tmp_path / "hf")
        assert got["text"] == texts, source
    streamed = load_text_dataset(tmp_path / "a.jsonl", split="all", streaming=True)
    assert [row["text"] for row in streamed] == texts


def test_token_cache_round_trip_and_second_start(tmp_path, tok, lines, monkeypatch):
    path = write_text(tmp_path / "corpus.txt", lines[:300] + ["", "   "] + lines[300:])
    first = tokenize_corpus(path, tok, tmp_path / "cache", split="all")
    expected = encode_all(tok, lines[:300] + ["", "   "] + lines[300:])
    assert first.num_docs == len(expected)  # empty rows are kept so rows stay aligned
    assert [first.doc(i).tolist() for i in range(first.num_docs)] == expected
    assert first.tokens.dtype == np.uint16 and first.meta["columns"]["text"]["empty_rows"] == 1

    def no_loading(*a, **k):
        raise AssertionError("a cached start must not load the text again")

    monkeypatch.setattr(loading, "load_text_dataset", no_loading)
    second = tokenize_corpus(path, tok, tmp_path / "cache", split="all")
    assert isinstance(second.tokens, np.memmap)
    assert np.array_equal(second.tokens, first.tokens) and np.array_equal(second.offsets, first.offsets)
    assert len(list((tmp_path / "cache").iterdir())) == 1  # no temporary leftovers
    monkeypatch.undo()
    packed = PackedCausalLM(second, 32, eos_id=0)
    blob = pickle.dumps(packed)  # what a "spawn" DataLoader worker receives
    assert len(blob) < second.tokens.nbytes / 2
    clone = pickle.loads(blob)
    assert isinstance(clone.tokens, np.memmap) and np.array_equal(clone[3]["input_ids"], packed[3]["input_ids"])
    write_text(path, lines[:10])  # changed file -> new key -> rebuilt
    assert tokenize_corpus(path, tok, tmp_path / "cache", split="all").num_docs == 10


def test_parallel_and_streamed_tokenization_match(tmp_path, tok, lines):
    path = write_text(tmp_path / "corpus.txt", lines)
    one = tokenize_corpus(path, tok, tmp_path / "c1", split="all", num_proc=1)
    two = tokenize_corpus(path, tok, tmp_path / "c2", split="all", num_proc=2)
    streamed = tokenize_corpus(path, tok, tmp_path / "c3", split="all", streaming=True)
    for other in (two, streamed):
        assert np.array_equal(one.tokens, other.tokens) and np.array_equal(one.offsets, other.offsets)
    val = tokenize_corpus(path, tok, tmp_path / "c1", split="validation")
    assert val.num_docs == 4 and val.doc(3).tolist() == encode_all(tok, [lines[-1]])[0]


def test_special_token_text_is_not_special_in_the_cache(tmp_path, tok):
    path = write_text(tmp_path / "c.txt", ["before <|endoftext|> after"])
    corpus = tokenize_corpus(path, tok, tmp_path / "cache", split="all")
    assert tok.token_to_id("<|endoftext|>") not in corpus.doc(0).tolist()
    assert tok.decode(corpus.doc(0).tolist()) == "before <|endoftext|> after"


def test_large_vocab_uses_uint32(tmp_path, tok):
    from tokenizers import Tokenizer

    big = Tokenizer.from_str(tok.to_str())
    big.add_tokens([f"zz{i}zz" for i in range(66_000)])
    path = write_text(tmp_path / "c.txt", ["a zz65999zz b"])
    corpus = tokenize_corpus(path, big, tmp_path / "cache", split="all")
    assert corpus.tokens.dtype == np.uint32 and big.token_to_id("zz65999zz") in corpus.doc(0).tolist()


def test_pairs_stay_aligned(tmp_path, tok):
    rows = [
        {"src": "In the beginning", "tgt": "En el principio"},
        {"src": "", "tgt": "vacío"},
        {"src": "light", "tgt": "luz"},
    ]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    src, tgt = tokenize_pairs(path, tok, tmp_path / "cache", split="all")
    assert src.num_docs == tgt.num_docs == 3 and src.doc(1).size == 0
    assert tok.decode(tgt.doc(2).tolist()) == "luz"


# --- bad input: one DataError naming the file/column/number and what to do ---------------------


def test_missing_file(tmp_path, tok):
    with pytest.raises(DataError, match=r"file not found: .*missing\.txt: check the path"):
        tokenize_corpus(tmp_path / "missing.txt", tok, tmp_path / "cache")
    with pytest.raises(DataError, match=r"no files match .*\*\.jsonl"):
        load_text_dataset(str(tmp_path / "*.jsonl"))


def test_empty_inputs(tmp_path, tok):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match=r"empty\.txt is empty \(0 bytes\)"):
        load_text_dataset(tmp_path / "empty.txt")
    with gzip.open(tmp_path / "empty.jsonl.gz", "wt") as f:
        f.write("")
    with pytest.raises(DataError, match=r"no rows in .*empty\.jsonl\.gz"):
        load_text_dataset(tmp_path / "empty.jsonl.gz", split="all")
    write_text(tmp_path / "blank.txt", ["", "", ""])
    with pytest.raises(DataError, match=r"no tokens in column 'text' of .*blank\.txt: all 3 rows are empty"):
        tokenize_corpus(tmp_path / "blank.txt", tok, tmp_path / "cache", split="all")
    assert not any((tmp_path / "cache").iterdir())  # the failed build left nothing behind


def test_check_source_names_an_empty_or_blank_file_and_passes_real_data(tmp_path):
    """The cheap check the trainer runs before any tokenizer or run directory: a blank file is
    named as such, not reported later as "the corpus has 3 tokens"."""
    (tmp_path / "empty.txt").write_text("")
    write_text(tmp_path / "blank.txt", ["  ", "\t", ""])
    with gzip.open(tmp_path / "empty.jsonl.gz", "wt") as f:
        f.write("")
    with gzip.open(tmp_path / "blank.txt.gz", "wt") as f:
        f.write(" \n" * 100_000)  # 200 kB of whitespace: read past the first chunk
    cases = {
        "empty.txt": r"data source .*empty\.txt is empty \(0 bytes\)",
        "blank.txt": r"data source .*blank\.txt is blank \(6 bytes, all whitespace\): give a file with text",
        "empty.jsonl.gz": r"data source .*empty\.jsonl\.gz is empty \(nothing after decompression\)",
        "blank.txt.gz": r"data source .*blank\.txt\.gz is blank \(200000 bytes",
        "missing.txt": r"file not found: .*missing\.txt",
    }
    for name, match in cases.items():
        with pytest.raises(DataError, match=match):
            loading.check_source(tmp_path / name)
    shards = tmp_path / "shards"
    shards.mkdir()
    write_text(shards / "a.txt", ["one line"])
    with gzip.open(shards / "b.txt.gz", "wt") as f:
        f.write(" " * 70_000 + "text after the first chunk\n")
    loading.check_source(shards)  # real data, whitespace first or not
    write_text(shards / "c.txt", [""])
    with pytest.raises(DataError, match=r"shards/c\.txt is blank"):
        loading.check_source(shards)


@pytest.mark.parametrize(
    "name,data,options",
    [
        ("latin1.txt", b"line one\nse\xf1or\n", {}),
        ("latin1.jsonl", b'{"text": "line one"}\n{"text": "se\xf1or"}\n', {}),  # pyarrow fails late
        ("latin1.txt", b"line one\nse\xf1or\n", {"streaming": True}),
    ],
)
def test_non_utf8(tmp_path, tok, name, data, options):
    (tmp_path / name).write_bytes(data)
    line_start = data.index(b"\n") + 1
    byte = data.index(b"\xf1")
    with pytest.raises(DataError, match=rf"{name} is not valid UTF-8 \(byte {byte}, line 2\): convert it"):
        tokenize_corpus(tmp_path / name, tok, tmp_path / "cache", split="all", **options)
    assert line_start < byte


def test_missing_and_non_text_columns(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"id": 1, "body": "x"}\n{"id": 2, "body": "y"}\n')
    with pytest.raises(DataError, match=r"column 'text' not found in .*rows\.jsonl \(columns: id, body\)"):
        load_text_dataset(path, split="all")
    with pytest.raises(DataError, match=r"column 'id' in .*rows\.jsonl holds int64, not text"):
        load_text_dataset(path, columns=["id"], split="all")


def test_other_refusals(tmp_path):
    path = write_text(tmp_path / "a.txt", ["x", "y"])
    with pytest.raises(DataError, match="streaming cannot hold out validation rows"):
        load_text_dataset(path, streaming=True, split="train")
    with pytest.raises(DataError, match=r"unknown file type for .*a\.dat"):
        (tmp_path / "a.dat").write_text("x")
        load_text_dataset(tmp_path / "a.dat")
    with pytest.raises(DataError, match="cannot load dataset 'nobody/no-such-dataset' from the hub"):
        load_text_dataset("nobody/no-such-dataset")


def test_sequence_length_above_model_maximum():
    check_seq_len(1024, 1024)
    check_seq_len(4096, None)
    with pytest.raises(DataError, match="sequence length 2048 exceeds the model's maximum of 1024"):
        check_seq_len(2048, 1024)
