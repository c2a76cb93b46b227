"""``data.source: synthetic``: random ids for every objective with no tokenizer and no files, a pure
function of the global sample index (so a resume and any world size see the same batches), and the
settings it cannot honour refused in one line."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tformer.config import ConfigError
from tformer.data import t5_lengths
from tformer.data.synthetic import RESERVED_IDS, SyntheticDataset
from tformer.train.config import load_config
from tformer.train.loop.data import build_data, train_batches

from train_helpers import CONFIGS


def config(recipe: str, *extra: str):
    return load_config(CONFIGS / f"{recipe}.yaml", ["data.source=synthetic", "micro_batch_size=2", *extra])


@pytest.mark.parametrize(
    "recipe,objective,keys",
    [
        ("gpt2-tiny", "causal", {"input_ids", "labels"}),
        ("bert-tiny", "mlm", {"input_ids", "token_type_ids", "attention_mask", "labels"}),
        ("t5-tiny", "span", {"input_ids", "attention_mask", "labels"}),
        ("t5-tiny", "seq2seq", {"input_ids", "attention_mask", "labels"}),
    ],
)
def test_every_objective_gets_random_ids_of_its_lengths_without_a_tokenizer(recipe, objective, keys, tmp_path):
    cfg = config(recipe, f"data.objective={objective}", "data.target_len=24", f"data.cache_dir={tmp_path}")
    data = build_data(cfg)
    assert data.tokenizer is None and data.objective == objective and not any(tmp_path.iterdir())  # no files
    sample = data.train[5]
    assert set(sample) == keys
    s, vocab = cfg.data.seq_len, cfg.model.vocab_size
    assert sample["input_ids"].shape == (s,) and data.seq_len == s
    ids = sample["input_ids"]
    assert RESERVED_IDS <= ids.min() and ids.max() < vocab
    if objective == "causal":
        assert (sample["labels"][:-1] == ids[1:]).all()  # next-token labels
    elif objective == "mlm":
        labelled = sample["labels"] != -100
        share = np.mean([(data.train[i]["labels"] != -100).mean() for i in range(200)])
        assert abs(share - cfg.data.mlm_probability) < 0.02, share
        # the input never shows the label it is asked for
        assert (ids[labelled] != sample["labels"][labelled]).all() and labelled.any()
    else:
        assert sample["labels"].shape == (data.target_len,)
        span_target = t5_lengths(s, cfg.data.noise_density, cfg.data.mean_span_length)[1]
        assert data.target_len == (24 if objective == "seq2seq" else span_target)
    # a pure function of (seed, epoch, index): the same key gives the same sample, another key not
    again = SyntheticDataset(objective, vocab, s, data.target_len, seed=cfg.seed)
    assert (again[5]["input_ids"] == ids).all()
    assert not (again[6]["input_ids"] == ids).all() and not (again[5 + len(again)]["input_ids"] == ids).all()
    assert not (data.validation[5]["input_ids"] == ids).all()  # validation draws from its own seed


def test_two_ranks_and_a_resume_read_the_batches_of_one_process():
    cfg = config("gpt2-tiny")
    data = build_data(cfg)
    cpu = torch.device("cpu")
    one = train_batches(cfg, data, 0, 1, 0, cpu)
    single = [next(one)["input_ids"] for _ in range(4)]
    r0, r1 = (train_batches(cfg, data, r, 2, 0, cpu) for r in (0, 1))
    pairs = [(next(r0)["input_ids"], next(r1)["input_ids"]) for _ in range(2)]
    # two ranks take micro-batches 0,1 then 2,3 of the one process's order
    assert all(torch.equal(a, single[2 * i]) and torch.equal(b, single[2 * i + 1]) for i, (a, b) in enumerate(pairs))
    resumed = train_batches(cfg, data, 0, 1, 2 * cfg.micro_batch_size, cpu)  # two micro-batches consumed
    assert torch.equal(next(resumed)["input_ids"], single[2])


@pytest.mark.parametrize(
    "setting,says",
    [
        ("data.tokenizer=tok.json", "data.tokenizer is set but data.source=synthetic takes none"),
        ("data.document_mask=true", "data.document_mask is set but data.source=synthetic"),
        ("data.whole_word_mask=true", "data.whole_word_mask is set but data.source=synthetic"),
    ],
)
def test_what_synthetic_data_cannot_honour_is_refused_in_one_line(setting, says):
    with pytest.raises(ConfigError, match=says) as e:
        config("bert-tiny", setting)
    assert "\n" not in str(e.value)
