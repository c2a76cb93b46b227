"""Objectives: causal packing, BERT MLM, T5 span corruption, seq2seq pairs."""

import gzip
import logging
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import numpy as np
import pytest

from tformer.data import (
    DataError,
    MLMDataset,
    PackedCausalLM,
    Seq2SeqPairs,
    SpanCorruptionDataset,
    TokenizedCorpus,
    default_corpus_path,
    special_tokens,
    t5_lengths,
    train_tokenizer,
)
from tformer.data.span import noise_mask
from tformer.data.tokenizer import word_start_table


@pytest.fixture(scope="module")
def lines():
    with gzip.open(default_corpus_path(), "rt", encoding="utf-8") as f:
        return [next(f).rstrip("\n") for _ in range(1200)]


def trained(kind, lines, vocab):
    import datasets

    return train_tokenizer(kind, datasets.Dataset.from_dict({"text": lines}), vocab)


def corpus_of(tok, texts):
    return TokenizedCorpus.from_docs(tok.encode(t, add_special_tokens=False).ids for t in texts)


# --- causal LM packing ------------------------------------------------------------------------


def random_docs(rng, n=60, eos=0):
    docs = [rng.integers(1, 500, size=rng.integers(0, 40)).tolist() for _ in range(n)]
    docs[5] = []  # empty documents are skipped
    return docs


@pytest.mark.parametrize("seq_len", [1, 7, 64])
def test_packing_loses_and_duplicates_nothing(seq_len, caplog):
    docs = random_docs(np.random.default_rng(seq_len))
    stream = [t for d in docs if d for t in d + [0]]
    with caplog.at_level(logging.INFO, logger="tformer.data"):
        ds = PackedCausalLM(TokenizedCorpus.from_docs(docs), seq_len, eos_id=0)
    n = len(ds)
    assert n == (len(stream) - 1) // seq_len
    inputs = np.concatenate([ds[i]["input_ids"] for i in range(n)])
    labels = np.concatenate([ds[i]["labels"] for i in range(n)])
    assert inputs.tolist() == stream[: n * seq_len]  # every token once, in order
    assert labels.tolist() == stream[1 : n * seq_len + 1]  # next token
    assert ds.dropped_tokens == len(stream) - n * seq_len
    assert f"the last {ds.dropped_tokens} tokens" in caplog.text
    assert f"skipped {sum(not d for d in docs)} empty documents" in caplog.text


def test_packing_document_boundaries():
    docs = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14, 15, 16], [17]]
    ds = PackedCausalLM(TokenizedCorpus.from_docs(docs), 6, eos_id=0)
    s0, s1 = ds[0], ds[1]
    assert s0["input_ids"].tolist() == [5, 6, 7, 0, 8, 9]
    assert s0["doc_ids"].tolist() == [0, 0, 0, 0, 1, 1]
    assert s0["position_ids"].tolist() == [0, 1, 2, 3, 0, 1]
    assert s1["input_ids"].tolist() == [0, 10, 11, 12, 13, 14]  # EOS of doc 1, then doc 2
    assert s1["doc_ids"].tolist() == [0, 1, 1, 1, 1, 1]
    assert s1["position_ids"].tolist() == [0, 0, 1, 2, 3, 4]  # positions restart at the window
    # Wherever an input is EOS, the next position starts a new document.
    for i in range(len(ds)):
        s = ds[i]
        eos = np.flatnonzero(s["input_ids"][:-1] == 0)
        assert (s["doc_ids"][eos + 1] == s["doc_ids"][eos] + 1).all()
        assert (s["position_ids"][eos + 1] == 0).all()


def test_packing_refuses_too_little_data():
    with pytest.raises(DataError, match=r"the corpus has 4 tokens with EOS, fewer than seq_len \+ 1 = 9"):
        PackedCausalLM(TokenizedCorpus.from_docs([[1, 2, 3]]), 8, eos_id=0)


# --- MLM ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def wordpiece(lines):
    return trained("wordpiece", lines, 1500)


@pytest.fixture(scope="module")
def mlm_corpus(wordpiece, lines):
    return corpus_of(wordpiece, lines)


@pytest.mark.parametrize("whole_word", [False, True])
def test_mlm_rates_and_labels(wordpiece, mlm_corpus, whole_word):
    ds = MLMDataset(mlm_corpus, wordpiece, 128, seed=3, whole_word=whole_word)
    ids = special_tokens(wordpiece)
    specials = {ids.cls_id, ids.sep_id, ids.pad_id, ids.mask_id, ids.unk_id}
    chosen = masked = randomized = kept = candidates = 0
    for i in range(len(ds)):
        s = ds[i]
        original = s["labels"] >= 0
        assert (s["labels"][~original] == -100).all()
        # Reconstruct the unmasked sequence and compare with the corpus chunk.
        restored = np.where(original, s["labels"], s["input_ids"])
        body = restored[~np.isin(restored, [ids.cls_id, ids.sep_id])]
        assert body.tolist() == mlm_corpus.tokens[i * ds.chunk : (i + 1) * ds.chunk].tolist()
        assert not np.isin(restored[original], list(specials)).any()  # specials never chosen
        n_cand = int((~np.isin(restored, list(specials))).sum())
        candidates += n_cand
        chosen += int(original.sum())
        masked += int((s["input_ids"][original] == ids.mask_id).sum())
        kept += int((s["input_ids"][original] == s["labels"][original]).sum())
        randomized += int(((s["input_ids"] != s["labels"]) & original & (s["input_ids"] != ids.mask_id)).sum())
    assert len(ds) > 150
    rate = chosen / candidates
    assert (0.145 if not whole_word else 0.14) < rate < 0.155
    assert abs(masked / chosen - 0.8) < 0.02
    assert abs(randomized / chosen - 0.1) < 0.015
    assert abs(kept / chosen - 0.1) < 0.015


def test_mlm_whole_words_are_masked_together(wordpiece, mlm_corpus):
    ds = MLMDataset(mlm_corpus, wordpiece, 64, seed=0, whole_word=True)
    ids = special_tokens(wordpiece)
    starts = word_start_table(wordpiece)
    split_words = 0
    for i in range(100):
        s = ds[i]
        chosen = s["labels"] >= 0
        restored = np.where(chosen, s["labels"], s["input_ids"])
        after_special = np.isin(np.roll(restored, 1), [ids.cls_id, ids.sep_id])
        continuation = ~starts[restored] & ~after_special  # a chunk may start mid-word
        # A continuation token is chosen exactly when the token before it is.
        assert (chosen[1:][continuation[1:]] == chosen[:-1][continuation[1:]]).all()
        split_words += int(continuation[chosen].sum())
    assert split_words > 0  # multi-token words were in fact masked


def test_mlm_pairs_and_token_types(wordpiece, mlm_corpus):
    ids = special_tokens(wordpiece)
    ds = MLMDataset(mlm_corpus, wordpiece, 96, seed=1)
    boundaries = set(np.asarray(mlm_corpus.offsets).tolist())
    for i in range(50):
        s = ds[i]
        restored = np.where(s["labels"] >= 0, s["labels"], s["input_ids"])
        assert restored[0] == ids.cls_id and restored[-1] == ids.sep_id
        first_sep = int(np.flatnonzero(restored == ids.sep_id)[0])
        assert s["token_type_ids"].tolist() == [0] * (first_sep + 1) + [1] * (96 - first_sep - 1)
        # B starts at a document start when the chunk contains one.
        b_start = i * ds.chunk + first_sep - 1
        inside = [b for b in boundaries if i * ds.chunk < b < (i + 1) * ds.chunk]
        if inside:
            assert b_start in boundaries
        assert s["attention_mask"].tolist() == [1] * 96
    single = MLMDataset(mlm_corpus, wordpiece, 96, pairs=False)[0]
    assert (single["token_type_ids"] == 0).all()


def test_mlm_is_a_pure_function_of_seed_epoch_index(wordpiece, mlm_corpus):
    ds = MLMDataset(mlm_corpus, wordpiece, 64, seed=7)
    a = ds[5]
    np.random.seed(123)  # the global RNG plays no part
    ds[9]
    b = MLMDataset(mlm_corpus, wordpiece, 64, seed=7)[5]
    assert all(np.array_equal(a[k], b[k]) for k in a)
    next_epoch = ds[len(ds) + 5]  # key = epoch * len + index
    assert not np.array_equal(a["labels"], next_epoch["labels"])
    assert np.array_equal(ds.sample(5, epoch=1)["labels"], next_epoch["labels"])


def test_mlm_needs_a_mask_token(lines):
    bpe = trained("bpe", lines[:200], 400)
    with pytest.raises(DataError, match=r"no cls token, needed for MLM samples: train a matching tokenizer"):
        MLMDataset(TokenizedCorpus.from_docs([[1] * 100]), bpe, 32)


# --- T5 span corruption ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def unigram(lines):
    return trained("unigram", lines[:600], 800)


def test_t5_lengths():
    assert t5_lengths(512) == (568, 114)  # T5's compute_input_and_target_lengths
    assert t5_lengths(128) == (141, 29)  # 141 -> 120 kept + 7 sentinels + EOS; 142 would give 129


def test_noise_mask_statistics():
    rng = np.random.default_rng(0)
    masks = [noise_mask(568, 0.15, 3.0, rng) for _ in range(300)]
    density = np.mean([m.mean() for m in masks])
    spans = [int((m[1:] & ~m[:-1]).sum()) for m in masks]
    assert abs(density - 85 / 568) < 1e-9  # exactly round(0.15 * 568) noise tokens
    assert set(spans) == {28}  # round(85 / 3) spans
    assert not any(m[0] for m in masks)  # the first segment is kept, as in T5


def test_span_corruption_structure_and_reconstruction(unigram, lines):
    ids = special_tokens(unigram)
    corpus = corpus_of(unigram, lines[:600])
    ds = SpanCorruptionDataset(corpus, unigram, 128, seed=0)
    assert (ds.tokens_length, ds.targets_length) == (141, 29)
    sentinels = {sid: k for k, sid in enumerate(ids.sentinel_ids)}
    for i in range(min(len(ds), 60)):
        s = ds[i]
        inp, lab = s["input_ids"].tolist(), s["labels"].tolist()
        assert len(inp) == 128 and len(lab) == 29 and inp[-1] == lab[-1] == ids.eos_id
        in_sent = [sentinels[t] for t in inp if t in sentinels]
        lab_sent = [sentinels[t] for t in lab if t in sentinels]
        assert in_sent == lab_sent == list(range(len(in_sent)))  # 0, 1, 2, ... in both
        assert lab[0] == ids.sentinel_ids[0] and inp[-2] in sentinels  # T5: ends with a noise span
        assert all(a not in sentinels or b not in sentinels for a, b in zip(inp, inp[1:]))
        # Put every span back in place of its sentinel: the original tokens and text return.
        spans, k = {}, None
        for t in lab[:-1]:
            if t in sentinels:
                k = sentinels[t]
                spans[k] = []
            else:
                spans[k].append(t)
        assert all(spans.values())  # no empty span
        rebuilt = [x for t in inp[:-1] for x in (spans[sentinels[t]] if t in sentinels else [t])]
        raw = corpus.tokens[i * ds.tokens_length : (i + 1) * ds.tokens_length].tolist()
        assert rebuilt == raw
        assert unigram.decode(rebuilt) == unigram.decode(raw)
        if i == 0:  # the first sample starts at the first verse
            assert unigram.decode(rebuilt).startswith("In the beginning, God created the heavens")


def test_span_corruption_refusals(unigram):
    corpus = TokenizedCorpus.from_docs([[5] * 100])
    with pytest.raises(
        DataError,
        match=r"inputs_length 4096 makes \d+ noise spans but the tokenizer has "
        r"100 sentinel tokens: use inputs_length <= (\d+)",
    ):
        SpanCorruptionDataset(corpus, unigram, 4096)
    with pytest.raises(DataError, match="fewer than one span-corruption sample needs"):
        SpanCorruptionDataset(corpus, unigram, 512)


# --- seq2seq pairs -----------------------------------------------------------------------------


def test_seq2seq_pairs(caplog):
    src = TokenizedCorpus.from_docs([[1, 2], [3] * 10, [], [4]])
    tgt = TokenizedCorpus.from_docs([[5], [6], [7], [8] * 9])
    with caplog.at_level(logging.INFO, logger="tformer.data"):
        ds = Seq2SeqPairs(src, tgt, eos_id=0, max_source_length=8, max_target_length=8, prefix_ids=[9])
    assert len(ds) == 1 and ds.counts == {"rows": 4, "empty": 1, "overlong": 2}
    assert "1 skipped as empty, 2 longer than 8/8 tokens dropped" in caplog.text
    assert ds[0]["input_ids"].tolist() == [9, 1, 2, 0] and ds[0]["labels"].tolist() == [5, 0]
    cut = Seq2SeqPairs(src, tgt, eos_id=0, max_source_length=8, max_target_length=8, overlong="truncate")
    assert len(cut) == 3 and cut[1]["input_ids"].tolist() == [3] * 7 + [0]
    assert cut[2]["labels"].tolist() == [8] * 7 + [0]
    with pytest.raises(DataError, match=r"2 pairs exceed 8/8 tokens \(first: row 1, 11/2 tokens\)"):
        Seq2SeqPairs(src, tgt, eos_id=0, max_source_length=8, max_target_length=8, overlong="error")
