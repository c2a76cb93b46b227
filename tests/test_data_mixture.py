"""Data at scale: weighted mixtures, stages, exact resume, per-source validation, ahead-of-time
preparation (killed and resumed), and one-line refusals of bad recipes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tformer.config import ConfigError
from tformer.data import DataError, MixtureDataset, MixtureSampler, MixtureSchedule, default_pairs_path
from tformer.data.mixture import Mixture
from tformer.data.samples import KeyedDataset
from tformer.train.config import load_config

from train_helpers import CONFIGS, env, metrics, owned, reap, run_cmd, small_overrides
from train_helpers import start as start_cmd


class Numbers(KeyedDataset):
    """Sample ``i`` is ``{"x": [base + i]}``: which sample came out is visible in the batch."""

    def __init__(self, n, base):
        self.n, self.base = n, base

    def __len__(self):
        return self.n

    def sample(self, index, epoch=0):
        return {"x": np.array([self.base + index])}


def _sources(*sizes):
    return [Numbers(n, 100_000 * (s + 1)) for s, n in enumerate(sizes)]


def test_weights_hold_within_one_percent_over_any_10k_window():
    w = np.array([0.55, 0.3, 0.1, 0.05])
    m = Mixture(w)
    rng = np.random.default_rng(0)
    for start in rng.integers(0, 10**7, 20):
        counts = m.counts(start + 10_000) - m.counts(start)
        assert np.all(np.abs(counts / 10_000 - w) <= 0.01 * w), (start, counts)
    # the look-up agrees with counting the draws one by one
    seen = np.zeros(4, np.int64)
    for g in range(25_000):
        s, n = m.locate(g)
        assert n == seen[s]
        seen[s] += 1


def test_two_ranks_read_the_one_rank_order_interleaved():
    ds = MixtureDataset(_sources(50, 30, 7), MixtureSchedule(["a", "b", "c"], [(None, [5, 3, 2])]), seed=3)
    one = [ds[g]["x"][0] for g in _take(MixtureSampler(ds), 300)]
    r0 = [ds[g]["x"][0] for g in _take(MixtureSampler(ds, 0, 2), 150)]
    r1 = [ds[g]["x"][0] for g in _take(MixtureSampler(ds, 1, 2), 150)]
    assert one[0::2] == r0 and one[1::2] == r1
    # every source is read in full before any sample repeats (re-epoched, not re-sampled)
    c = [x for x in one if x >= 300_000][:7]
    assert sorted(c) == list(range(300_000, 300_007))


def test_two_ranks_read_whole_micro_batches_of_the_one_rank_order():
    """In blocks of the micro-batch size (3): rank r's micro-batch j is the one-rank order's j W + r."""
    ds = MixtureDataset(_sources(50, 30, 7), MixtureSchedule(["a", "b", "c"], [(None, [5, 3, 2])]), seed=3)
    one = _take(MixtureSampler(ds), 60)
    for r in range(2):
        keys = _take(MixtureSampler(ds, r, 2, consumed=0, block=3), 30)
        assert keys == [g for j in range(r, 20, 2) for g in one[3 * j : 3 * j + 3]]


def _take(sampler, n):
    it = iter(sampler)
    return [next(it) for _ in range(n)]


def test_stages_continue_each_source_and_resume_anywhere():
    sched = MixtureSchedule(["web", "books"], [(400, [0.8, 0.2]), (None, [0.2, 0.8])])
    ds = MixtureDataset(_sources(10_000, 10_000), sched, seed=1)
    full = [ds[g]["x"][0] for g in _take(MixtureSampler(ds), 800)]
    first, second = full[:400], full[400:]
    assert abs(sum(x >= 200_000 for x in first) - 80) <= 1 and abs(sum(x >= 200_000 for x in second) - 320) <= 1
    assert len(set(full)) == 800  # stage 2 continues each source where stage 1 left it
    for at in (123, 400, 401, 640):  # mid-stage, on and just after the boundary
        s = MixtureSampler(ds)
        s.load_state_dict({**MixtureSampler(ds).state_dict(), "consumed": at})
        assert [ds[g]["x"][0] for g in _take(s, 800 - at)] == full[at:]


def test_a_checkpoint_of_another_mixture_is_refused():
    a = MixtureDataset(_sources(10, 10), MixtureSchedule(["a", "b"], [(None, [1, 1])]))
    b = MixtureDataset(_sources(10, 10), MixtureSchedule(["a", "b"], [(None, [1, 2])]))
    with pytest.raises(DataError, match="same sources, weights"):
        MixtureSampler(b).load_state_dict(MixtureSampler(a).state_dict())


def test_an_exhausted_source_repeats_or_stops(caplog):
    sched = MixtureSchedule(["a", "b"], [(None, [1, 1])])
    with pytest.raises(DataError, match="source 'b' would be read 2.50 times"):
        MixtureDataset(_sources(100, 20), sched, on_exhausted="stop").check_exhaustion(100)
    with pytest.raises(DataError, match="source 'b' ran out"):
        MixtureDataset(_sources(100, 20), sched, on_exhausted="stop")[41]
    ds = MixtureDataset(_sources(100, 20), sched)
    with caplog.at_level("INFO", logger="tformer.data"):
        assert ds.check_exhaustion(100)["b"] == 2.5
        _take(MixtureSampler(ds), 45)
    assert "re-epoched" in caplog.text and "pass 2" in caplog.text


# -- bad recipes: one line each, before any work ------------------------------------------------


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["data.sources=[{source: default, weight: -1}]"], r"data.sources\[0\].weight=-1 must be a number >= 0"),
        (
            ["data.sources=[{source: default, weight: 0, name: a}, {source: default, weight: 0, name: b}]"],
            "the weights are all zero",
        ),
        (
            [
                "data.stages=[{until_step: 5, sources: [{source: default}]}, {until_step: 5, sources: [{source: default}]}]",
                "max_steps=5",
            ],
            r"data.stages\[1\].until_step=5 must be greater than the previous stage's \(5\)",
        ),
        (
            ["data.stages=[{until_step: 5, sources: [{source: default}]}]", "max_steps=10"],
            "data.stages end at until_step=5 but max_steps=10",
        ),
        (["data.sources=[{source: default, wieght: 1}]"], r"unknown key\(s\) wieght"),
        (["model.preset=t5-tiny", "data.document_mask=true"], "cannot be honoured by span corruption"),
        (
            ["model.preset=transformer-tiny", "data.objective=seq2seq", "data.document_mask=true", "data.pack_len=256"],
            "data.pack_len=256 exceeds model.max_seq_len=128",
        ),
        (["data.pack_len=256"], "needs data.document_mask=true"),
    ],
)
def test_bad_mixture_recipes_are_refused_in_one_line(tmp_path, overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(CONFIGS / "gpt2-tiny.yaml", [f"output_dir={tmp_path}", *overrides])


def test_an_unknown_source_is_refused_before_any_work(tmp_path, monkeypatch):
    from tformer.train.loop.data import build_data

    monkeypatch.setenv("TFORMER_CACHE", str(tmp_path / "cache"))
    cfg = load_config(
        CONFIGS / "gpt2-tiny.yaml",
        [f"output_dir={tmp_path}", f"data.sources=[{{source: default}}, {{source: {tmp_path}/nope.jsonl}}]"],
    )
    with pytest.raises(DataError, match="file not found: .*nope.jsonl"):
        build_data(cfg)
    assert not (tmp_path / "cache").exists()


# -- the trainer: stages resume bit for bit, per-source validation in JSONL and W&B ------------


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    path = tmp_path_factory.mktemp("tformer-cache")
    old = os.environ.get("TFORMER_CACHE")
    os.environ["TFORMER_CACHE"] = str(path)
    yield path
    if old is None:
        os.environ.pop("TFORMER_CACHE", None)
    else:
        os.environ["TFORMER_CACHE"] = old


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """Two small real sources: 8000 verses of the WEB bible (text), 4000 Spanish verses (jsonl)."""
    import gzip
    from tformer.data import default_corpus_path

    root = tmp_path_factory.mktemp("sources")
    with gzip.open(default_corpus_path(), "rt") as f:
        (root / "web.txt").write_text("".join(next(f) for _ in range(8000)))
    with gzip.open(default_pairs_path(), "rt") as f:
        rows = [json.loads(next(f)) for _ in range(4000)]
    (root / "es.jsonl").write_text("".join(json.dumps({"text": r["tgt"]}) + "\n" for r in rows))
    return root


def _mix(root, web=1.0, es=1.0):
    return (
        f"[{{source: {root / 'web.txt'}, name: web, weight: {web}}}, "
        f"{{source: {root / 'es.jsonl'}, name: es, weight: {es}}}]"
    )


def _fit(out, root, *extra):
    from tformer.train.trainer import Trainer

    stages = (
        f"data.stages=[{{until_step: 3, sources: {_mix(root, 0.7, 0.3)}}}, "
        f"{{until_step: 6, sources: [{{source: {root / 'web.txt'}, name: web}}]}}]"
    )
    cfg = load_config(
        CONFIGS / "gpt2-tiny.yaml",
        small_overrides(
            "gpt2-tiny",
            out,
            stages,
            "micro_batch_size=4",
            "eval_every=0",
            "save_every=0",
            "data.tokenizer_max_rows=4000",
            *extra,
        ),
    )
    t = Trainer(cfg)
    t.fit()
    return t


def test_resume_inside_a_stage_and_across_the_boundary_is_exact(cache, tmp_path, small):
    full = _fit(tmp_path / "full", small, "max_steps=6")
    want = {r["step"]: r["loss"] for r in metrics(tmp_path / "full")}
    assert set(full.data.validation_sources) == {"web", "es"}
    for stop in (2,):  # mid-stage 1; the resumed run crosses the boundary at step 3
        out = tmp_path / f"stop{stop}"
        _fit(out, small, f"max_steps={stop}")
        _fit(out, small, "max_steps=6")
        got = {r["step"]: r["loss"] for r in metrics(out)}
        assert got == want, stop


def test_per_source_validation_loss_in_jsonl_and_wandb(cache, tmp_path, small, monkeypatch):
    pytest.importorskip("wandb")  # optional at run time (tracking imports it only when enabled)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_CONFIG_DIR"):
        monkeypatch.delenv(var, raising=False)
    _fit(tmp_path, small, "max_steps=2", "eval_every=2", "eval_batches=2", "wandb.enabled=true", "wandb.mode=offline")
    last = metrics(tmp_path)[-1]
    assert {"val_loss", "val_loss/web", "val_loss/es"} <= set(last)
    assert (
        min(last["val_loss/web"], last["val_loss/es"]) <= last["val_loss"] <= max(last["val_loss/web"], last["val_loss/es"])
    )
    from wandb_reader import read_offline_run

    history, _ = read_offline_run(next((tmp_path / "wandb").glob("**/offline-run-*")))
    assert history[-1]["val_loss/es"] == pytest.approx(last["val_loss/es"])


# -- tformer data prepare ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from tformer.data import default_corpus_path, train_tokenizer

    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_tokenizer("bpe", default_corpus_path(), 1024, None, max_rows=3000).save(str(path))
    return path


def _prepare(cache_dir, tokenizer, root, *extra, wait=True):
    cmd = [
        sys.executable,
        "-m",
        "tformer",
        "data",
        "prepare",
        str(CONFIGS / "gpt2-tiny.yaml"),
        f"data.tokenizer={tokenizer}",
        "model.vocab_size=1024",
        "--shard-rows",
        "500",
        "--no-progress",
        f"data.sources={_mix(root)}",
        *extra,
    ]
    e = {**env(Path(cache_dir)), "HF_DATASETS_OFFLINE": "1"}
    if wait:
        return run_cmd(cmd, 300, env=e)
    return start_cmd(cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _tree(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_killed_prepare_resumes_to_a_byte_identical_cache(tmp_path, tokenizer, small):
    clean = _prepare(tmp_path / "clean", tokenizer, small, "--workers", "2")
    assert clean.returncode == 0, clean.stderr
    lines = [ln.split() for ln in clean.stdout.splitlines()]
    assert [ln[:2] for ln in lines] == [["web", "train"], ["web", "validation"], ["es", "train"], ["es", "validation"]]
    assert all(int(ln[2].replace(",", "")) > 0 and ln[3] == "tokens" for ln in lines)

    proc = _prepare(tmp_path / "killed", tokenizer, small, wait=False)
    work = tmp_path / "killed" / "tokens"
    with owned(proc):
        deadline = time.time() + 120
        while time.time() < deadline and not list(work.glob(".*.prepare/shard000003")):
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)  # between or inside shards, wherever it is
    reap([proc], 30)
    done = sorted(p.name for p in work.glob(".*.prepare/shard??????"))
    assert done, "the kill came before any shard finished"
    again = _prepare(tmp_path / "killed", tokenizer, small)
    assert again.returncode == 0, again.stderr
    assert f"{len(done)} of " in again.stderr and "shards already done" in again.stderr
    assert again.stdout == clean.stdout
    assert _tree(tmp_path / "killed" / "tokens") == _tree(tmp_path / "clean" / "tokens")


def test_a_training_run_finds_the_prepared_cache_or_says_why_not(tmp_path, tokenizer, small, monkeypatch):
    from tformer.data import train_tokenizer
    from tformer.train.loop.data import build_data

    assert _prepare(tmp_path / "c", tokenizer, small).returncode == 0
    monkeypatch.setenv("TFORMER_CACHE", str(tmp_path / "c"))
    base = [f"output_dir={tmp_path}/run", "model.vocab_size=1024", "data.prepared=true", f"data.sources={_mix(small)}"]
    data = build_data(load_config(CONFIGS / "gpt2-tiny.yaml", base + [f"data.tokenizer={tokenizer}"]))
    assert set(data.validation_sources) == {"web", "es"}  # opened from the cache, nothing tokenized
    other = tmp_path / "other.json"
    train_tokenizer("bpe", default_pairs_path(), 1024, None, column="tgt", max_rows=2000).save(str(other))
    with pytest.raises(DataError, match="made with another tokenizer"):
        build_data(load_config(CONFIGS / "gpt2-tiny.yaml", base + [f"data.tokenizer={other}"]))
