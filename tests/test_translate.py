"""Translation with the paper's recipe: token-budget batches, BLEU (sacrebleu), the tiny recipe
end to end through the trainer, `tformer evaluate --bleu`, and its bad input."""

import itertools
import json

import numpy as np
import pytest
import sacrebleu

from tformer.data import DataError, TokenBudgetSampler
from tformer.evaluate import corpus_scores
from tformer.train.config import dump_yaml, load_config
from tformer.train.trainer import Trainer

from train_helpers import CONFIGS, small_overrides


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    import os

    path = tmp_path_factory.mktemp("tformer-cache")
    os.environ["TFORMER_CACHE"] = str(path)
    return path


def lengths(n=500, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(2, 60, n), rng.integers(2, 70, n)


def take(sampler, n):
    return list(itertools.islice(iter(sampler), n))


# -- token-budget batches ------------------------------------------------------------------------


def test_token_batches_respect_the_budget_and_hold_every_pair_once_per_epoch():
    src, tgt = lengths()
    sampler = TokenBudgetSampler(src, tgt, 300, seed=3)
    for epoch in range(2):
        batches = sampler.epoch_batches(epoch)
        for b in batches:
            assert len(b) * src[b].max() <= 300 and len(b) * tgt[b].max() <= 300
        assert sorted(np.concatenate(batches).tolist()) == list(range(500))
        padded = sum(len(b) * max(src[b].max(), tgt[b].max()) for b in batches)
        assert padded < 1.5 * np.maximum(src, tgt).sum()  # similar lengths: little padding
    assert [b.tolist() for b in sampler.epoch_batches(0)] != [b.tolist() for b in sampler.epoch_batches(1)]
    again = TokenBudgetSampler(src, tgt, 300, seed=3)
    assert take(again, 40) == take(TokenBudgetSampler(src, tgt, 300, seed=3), 40)  # deterministic


@pytest.mark.parametrize("world", [1, 2])
def test_token_batches_resume_exactly_at_one_and_two_ranks(world):
    src, tgt = lengths()
    n = 3 * len(TokenBudgetSampler(src, tgt, 300).epoch_batches(0))  # crosses epoch boundaries
    whole = take(TokenBudgetSampler(src, tgt, 300, seed=1), n)
    ranks = [TokenBudgetSampler(src, tgt, 300, seed=1, rank=r, world_size=world) for r in range(world)]
    first = [take(s, 10) for s in ranks]
    state = ranks[0].state_dict()
    assert state["consumed"] == 10 * world
    resumed = [TokenBudgetSampler(src, tgt, 300, seed=1, rank=r, world_size=world) for r in range(world)]
    for s in resumed:
        s.load_state_dict(state)
    rest = [take(s, (n - 10 * world) // world) for s in resumed]
    interleaved = [b for step in zip(*[f + r for f, r in zip(first, rest)]) for b in step]
    assert interleaved == whole[: len(interleaved)] and len(interleaved) >= n - world


def test_token_budget_smaller_than_the_longest_pair_is_refused():
    with pytest.raises(DataError, match="data.tokens_per_batch=50 is smaller than the longest pair"):
        TokenBudgetSampler(*lengths(), 50)


# -- BLEU -----------------------------------------------------------------------------------------


def test_bleu_and_chrf_are_sacrebleus():
    hyps = ["En el principio creó Dios los cielos y la tierra.", "Y dijo Dios: Sea la luz.", "Jesús lloró."]
    refs = ["EN el principio crió Dios los cielos y la tierra.", "Y dijo Dios: Sea la luz: y fué la luz.", "Y lloró Jesús."]
    bleu, chrf, sig, csig = corpus_scores(hyps, refs)
    assert bleu == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs]).score, abs=1e-9)
    assert chrf == pytest.approx(sacrebleu.corpus_chrf(hyps, [refs]).score, abs=1e-9)
    assert 0 < bleu < 100 and sig.startswith("nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:")
    assert corpus_scores(refs, refs)[0] == pytest.approx(100.0)


# -- the recipe, end to end -----------------------------------------------------------------------


def recipe(out, *extra):
    return load_config(
        CONFIGS / "transformer-tiny-translate.yaml", small_overrides("transformer-tiny-translate", out, *extra)
    )


def test_tiny_recipe_trains_logs_bleu_and_resumes_exactly(cache, tmp_path, capsys):
    common = ["eval_every=2", "save_every=2", "precision=fp32", "optim.warmup_steps=2"]
    Trainer(recipe(tmp_path / "a", "max_steps=4", *common)).fit()

    def preempt(trainer, record):  # the run stops after step 2 (and saves), as on SIGTERM
        if trainer.step == 2:
            trainer._stop_reason = "preempted"

    Trainer(recipe(tmp_path / "b", "max_steps=4", *common), callbacks=[preempt]).fit()
    Trainer(recipe(tmp_path / "b", "max_steps=4", *common)).fit()  # resumes at step 2
    records = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "val_bleu" in r]
    assert [r["step"] for r in evals] == [2, 4]
    assert all(0 <= r["val_bleu"] <= 100 and r["bleu_signature"].startswith("nrefs:1") for r in evals)
    assert "BLEU" in capsys.readouterr().out

    def losses(run):
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["loss"] for r in rows}

    assert losses(tmp_path / "a") == losses(tmp_path / "b")  # token-budget batches resume exactly

    from tformer.cli import main

    assert main(["evaluate", str(tmp_path / "a"), "--bleu", "--samples", "4", "--show", "1"]) == 0
    out = capsys.readouterr().out
    assert "source:" in out and "translation:" in out and "reference:" in out and "BLEU" in out
    result = json.loads((tmp_path / "a" / "evaluate.json").read_text())
    assert result["samples"] == 4 and result["bleu_signature"].startswith("nrefs:1")


def test_mfu_counts_the_flops_of_the_batches_as_they_are(cache, tmp_path, monkeypatch):
    """Token-budget batches vary in shape: each step's MFU is the FLOPs of the batches it ran (as
    ``training_flops`` of their shapes) over its time and the device's peak, not a nominal
    micro_batch_size x seq_len batch."""
    import tformer.train.trainer as trainer_module

    calls = []

    def counted(cfg, batch, seq, target=None):
        calls.append((batch, seq, target))
        return training_flops(cfg, batch, seq, target)

    from tformer.models.flops import training_flops

    monkeypatch.setattr(trainer_module, "training_flops", counted)
    steps = []
    trainer = Trainer(
        recipe(tmp_path / "run", "max_steps=3", "eval_every=0", "precision=fp32", "grad_accum=2"),
        callbacks=[lambda tr, rec: steps.append((rec, list(calls))) or calls.clear()],
    )
    trainer.fit()
    assert len(steps) == 3
    shapes = set()
    for record, step_calls in steps:
        assert len(step_calls) == 2  # one per micro-batch
        shapes.update(step_calls)
        want = sum(training_flops(trainer.model_cfg, *c) for c in step_calls)
        assert record["mfu"] * record["step_time"] * trainer.peak == pytest.approx(want, rel=1e-4)
    cfg = trainer.cfg
    assert len(shapes) > 1 and (cfg.micro_batch_size, cfg.data.seq_len, cfg.data.target_len) not in shapes


def _err(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize("d_model", [128, 512])
def test_scaled_token_embeddings_start_at_the_size_of_the_positions(d_model):
    """The paper's model multiplies its token embeddings by sqrt(d_model) before adding the
    sinusoidal positions (unit amplitude): its token embedding starts at Normal(0, d_model**-0.5),
    so both enter at the same scale; other models keep init_std."""
    import torch

    from tformer import build_model

    torch.manual_seed(0)
    model = build_model("transformer-tiny", d_model=d_model, num_heads=4, vocab_size=4096)
    scaled = model.embed.tok.weight * d_model**0.5
    assert scaled.std().item() == pytest.approx(1.0, rel=0.05)
    assert build_model("gpt2-tiny").embed.tok.weight.std().item() == pytest.approx(0.02, rel=0.05)


def test_bleu_of_a_non_translation_run_is_one_line(cache, tmp_path, capsys):
    from tformer.cli import main

    run = tmp_path / "gpt"
    run.mkdir()
    (run / "config.yaml").write_text(dump_yaml(load_config(CONFIGS / "gpt2-tiny.yaml")))
    assert main(["evaluate", str(run), "--bleu"]) == 2
    assert _err(capsys).startswith("error: --bleu needs a translation run (data.objective=seq2seq)")


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["data.tokens_per_batch=32"], "data.tokens_per_batch=32 is smaller than the longest allowed pair"),
        (["data.objective=span", "eval_bleu=true", "data.tokens_per_batch=null"], "eval_bleu=true needs translation pairs"),
        (["decode.num_beams=0"], "decode.num_beams=0 must be >= 1"),
    ],
)
def test_bad_translation_config_is_one_line(cache, tmp_path, capsys, overrides, match):
    from tformer.cli import main

    args = small_overrides("transformer-tiny-translate", tmp_path / "run") + overrides
    assert main(["train", str(CONFIGS / "transformer-tiny-translate.yaml"), *args]) == 2
    assert match in _err(capsys)


def test_generate_evaluate_and_export_decode_with_the_recipes_settings(cache, tmp_path, capsys, monkeypatch):
    """One source of decoding defaults: the run's decode.* (saved in its config.yaml) is what
    `tformer generate` uses without flags, what `tformer evaluate --bleu` uses, and what the HF
    export's generation_config.json holds; flags override it."""
    import transformers

    import tformer.generate
    from tformer.cli import main

    run = tmp_path / "run"
    decode = ["decode.num_beams=3", "decode.length_penalty=0.7", "decode.length_norm=power", "decode.max_new_tokens=5"]
    Trainer(recipe(run, "max_steps=1", "eval_every=0", "save_every=1", "precision=fp32", *decode)).fit()
    capsys.readouterr()
    calls = []
    real = tformer.generate.generate

    def spy(*args, **kwargs):
        calls.append({"max_new_tokens": args[2], **kwargs})
        return real(*args, **kwargs)

    monkeypatch.setattr(tformer.generate, "generate", spy)
    assert main(["generate", str(run), "in the beginning"]) == 0
    assert "decoding with the run's decode settings: num_beams=3 length_penalty=0.7" in capsys.readouterr().err
    assert main(["generate", str(run), "in the beginning", "--num-beams", "2", "--max-new-tokens", "4"]) == 0
    assert main(["generate", str(run), "in the beginning", "--temperature", "1.0"]) == 0  # sampling: no beams
    picked = [(c["num_beams"], c["length_penalty"], c["max_new_tokens"]) for c in calls]
    assert picked == [(3, 0.7, 5), (2, 0.7, 4), (1, None, 5)]
    assert [c["length_norm"] for c in calls[:2]] == ["power", "power"]

    assert main(["evaluate", str(run), "--bleu", "--samples", "2", "--show", "0"]) == 0
    result = json.loads((run / "evaluate.json").read_text())
    assert (result["num_beams"], result["length_penalty"]) == (3, 0.7)

    from tformer.export import export_hf

    gen = transformers.GenerationConfig.from_pretrained(export_hf(run, tmp_path / "hf"))
    assert (gen.num_beams, gen.length_penalty, gen.max_new_tokens, gen.early_stopping) == (3, 0.7, 5, False)
