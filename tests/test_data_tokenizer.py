"""Tokenizers of the three kinds: round trips, atomic special tokens, HF loading, CLI, checks."""

import gzip
import json
import os
import unicodedata

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest
from tokenizers import Tokenizer

from tformer.data import (
    DataError,
    check_vocab,
    default_corpus_path,
    hf_tokenizer,
    load_tokenizer,
    special_tokens,
    tokenizer_main,
    train_tokenizer,
)
from tformer.data.tokenizer import word_start_table

KINDS = ["bpe", "wordpiece", "unigram"]
VOCAB = {"bpe": 1000, "wordpiece": 1000, "unigram": 600}
SPECIALS = {
    "bpe": ["<|endoftext|>"],
    "wordpiece": ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"],
    "unigram": ["<pad>", "</s>", "<unk>", "<extra_id_0>", "<extra_id_57>", "<extra_id_99>"],
}


@pytest.fixture(scope="module")
def lines():
    with gzip.open(default_corpus_path(), "rt", encoding="utf-8") as f:
        return [next(f).rstrip("\n") for _ in range(1500)]


@pytest.fixture(scope="module")
def train_file(tmp_path_factory, lines):
    path = tmp_path_factory.mktemp("text") / "genesis.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory, train_file):
    out = {}
    for kind in KINDS:
        d = tmp_path_factory.mktemp(kind)
        train_tokenizer(kind, train_file, VOCAB[kind], d)
        out[kind] = d
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip(trained, lines, kind):
    tok = load_tokenizer(trained[kind])
    sample = lines[::50] + ["Numbers 12, 345 and punctuation: (a) [b] {c}; x/y & z!"]
    for text in sample:
        ids = tok.encode(text, add_special_tokens=False).ids
        back = tok.decode(ids)
        if kind == "bpe":
            assert back == text
        elif kind == "unigram":
            assert back == unicodedata.normalize("NFKC", text)
        else:  # WordPiece decoding re-spaces punctuation; every character survives
            assert back.split() != [] and "".join(back.split()) == "".join(text.split())
        assert tok.token_to_id("[UNK]") not in ids and tok.token_to_id("<unk>") not in ids


def test_byte_level_bpe_round_trips_any_text(trained):
    tok = load_tokenizer(trained["bpe"])
    text = "Émoji 🙂, 日本語, tabs\tand\nnewlines,  double  spaces, \x00 NUL"
    assert tok.decode(tok.encode(text).ids) == text


@pytest.mark.parametrize("kind", KINDS)
def test_special_tokens_are_atomic(trained, kind):
    tok = load_tokenizer(trained[kind])
    for special in SPECIALS[kind]:
        i = tok.token_to_id(special)
        assert i is not None, special
        enc = tok.encode(f"In the beginning{special}God created", add_special_tokens=False)
        assert enc.ids.count(i) == 1 and special in enc.tokens
        assert tok.decode([i], skip_special_tokens=False) == special


def test_family_layouts(trained):
    bpe = special_tokens(load_tokenizer(trained["bpe"]))
    assert (bpe.kind, bpe.eos_id, bpe.pad_id) == ("bpe", 0, 0)
    wp = load_tokenizer(trained["wordpiece"])
    assert [wp.token_to_id(t) for t in SPECIALS["wordpiece"]] == [0, 1, 2, 3, 4]
    pair = wp.encode("In the beginning", "God created")
    assert pair.tokens[0] == "[CLS]" and pair.tokens.count("[SEP]") == 2
    assert pair.type_ids == [0] * (pair.tokens.index("[SEP]") + 1) + [1] * (
        len(pair.tokens) - pair.tokens.index("[SEP]") - 1
    )
    t5 = load_tokenizer(trained["unigram"])
    s = special_tokens(t5)
    n = t5.get_vocab_size()
    assert (s.pad_id, s.eos_id, s.unk_id) == (0, 1, 2)
    assert len(s.sentinel_ids) == 100 and s.sentinel_ids[0] == n - 1 and s.sentinel_ids[99] == n - 100
    assert t5.encode("light").ids[-1] == s.eos_id
    assert n == VOCAB["unigram"]


@pytest.mark.parametrize("kind", KINDS)
def test_hf_loads_tokenizer_json_unchanged(trained, lines, kind):
    from transformers import PreTrainedTokenizerFast

    tok = load_tokenizer(trained[kind])
    hf = PreTrainedTokenizerFast(tokenizer_file=str(trained[kind] / "tokenizer.json"))
    for text in lines[:20]:
        assert hf(text)["input_ids"] == tok.encode(text).ids
        assert hf(text, add_special_tokens=False)["input_ids"] == tok.encode(text, add_special_tokens=False).ids
    wrapped = hf_tokenizer(tok)
    if kind == "wordpiece":
        assert (wrapped.mask_token_id, wrapped.cls_token_id, wrapped.pad_token_id) == (4, 2, 0)
    elif kind == "unigram":
        assert wrapped.eos_token_id == 1 and wrapped.pad_token_id == 0
        assert wrapped.convert_tokens_to_ids("<extra_id_0>") == len(wrapped) - 1
    else:
        assert wrapped.eos_token_id == wrapped.pad_token_id == 0


def test_check_vocab(trained):
    tok = load_tokenizer(trained["bpe"])
    n = tok.get_vocab_size()
    check_vocab(tok, n)
    check_vocab(tok, n + 64)
    with pytest.raises(DataError, match=rf"has {n} tokens but the model's vocab_size is {n - 1}"):
        check_vocab(tok, n - 1)


def test_word_starts_for_whole_word_masking(trained):
    tok = load_tokenizer(trained["wordpiece"])
    table = word_start_table(tok)
    for token, i in tok.get_vocab().items():
        assert table[i] == (not token.startswith("##"))


def test_train_from_jsonl_column_and_dataset(tmp_path, lines):
    import datasets

    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"id": i, "body": t}) + "\n" for i, t in enumerate(lines[:300])))
    a = train_tokenizer("bpe", path, 400, column="body")
    b = train_tokenizer("bpe", datasets.Dataset.from_dict({"body": lines[:300]}), 400, column="body")
    assert a.get_vocab() == b.get_vocab()
    with pytest.raises(DataError, match=r"column 'text' not found in .*rows.jsonl \(columns: id, body\)"):
        train_tokenizer("wordpiece", path, 400)


def test_cli_trains_and_writes(tmp_path, train_file, capsys):
    out = tmp_path / "tok"
    assert tokenizer_main(["train", "--kind", "wordpiece", "--vocab-size", "500", "--out", str(out), str(train_file)]) == 0
    assert "wordpiece, 500 tokens" in capsys.readouterr().out
    assert Tokenizer.from_file(str(out / "tokenizer.json")).get_vocab_size() == 500


def test_bad_tokenizer_inputs(tmp_path, train_file):
    with pytest.raises(DataError, match="unknown tokenizer kind 'sentencepiece'"):
        train_tokenizer("sentencepiece", train_file, 1000)
    with pytest.raises(DataError, match="vocab_size 200 is too small for a bpe tokenizer"):
        train_tokenizer("bpe", train_file, 200)
    with pytest.raises(DataError, match=r"file not found: .*nope\.txt"):
        train_tokenizer("bpe", tmp_path / "nope.txt", 1000)
    with pytest.raises(DataError, match="tokenizer file not found"):
        load_tokenizer(tmp_path)
    with pytest.raises(SystemExit):  # argparse: missing --kind
        tokenizer_main(["train", "--vocab-size", "10", "--out", str(tmp_path), str(train_file)])


@pytest.mark.parametrize("kind", ["bpe", "unigram"])
def test_training_is_reproducible(lines, kind):
    # WordPiece is not: tokenizers breaks merge-count ties in hash-map order (documented).
    import datasets

    data = datasets.Dataset.from_dict({"text": lines[:600]})
    assert train_tokenizer(kind, data, 500).to_str() == train_tokenizer(kind, data, 500).to_str()
