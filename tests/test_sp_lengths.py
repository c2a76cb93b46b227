"""Sequence parallel at sequence lengths that are not a multiple of tp (63 at tp=2): training, both
evaluations (plain and pipelined), BLEU decoding and generation pad the same way
(``models.base.pad_sequences``), and every number equals the 1-process run's (fp32): train and
validation losses, BLEU, generated tokens; each run ends with its final checkpoint.

The spawned groups reuse test_mesh's launcher (a deadline that fails the test and kills the ranks)."""

from pathlib import Path

import pytest
import torch

from tformer.checkpoint import list_checkpoints, verify
from tformer.train.config import load_config
from tformer.train.trainer import Trainer

from test_mesh import COMMON, FAMILIES, run_ranks
from train_helpers import CONFIGS, become_rank, metrics, small_overrides

ODD = ["data.seq_len=63", "eval_every=2"]
# Llama with grouped-query attention: 6 query heads over 2 KV heads (3 per KV head; tp=2 gives each
# rank 3 query heads and their 1 KV head)
LLAMA_GQA = ("llama-tiny", ["model.d_model=96", "model.num_heads=6", "model.num_kv_heads=2"])
T5_V11 = FAMILIES["t5-v1.1"]
TRANSLATE = ("transformer-tiny-translate", ["eval_every=2", "eval_bleu=true"])  # token-budget batches: ragged lengths
PROMPT = torch.tensor([[5, 17, 42, 7, 99, 3, 250], [8, 8, 31, 64, 12, 77, 5]])  # 7 tokens: odd


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    import os

    path = tmp_path_factory.mktemp("tformer-cache-sp")
    os.environ["TFORMER_CACHE"] = str(path)
    return path


def _overrides(case, out, *extra):
    recipe, own = case
    return recipe, small_overrides(recipe, out, *COMMON, *own, *extra)


def _generated(model) -> dict:
    from tformer.generate import generate

    return {beams: generate(model, PROMPT, 8, num_beams=beams, eos_token_id=None) for beams in (1, 2)}


def _worker(rank, world, port, jobs, cache):
    """test_mesh's worker, and after a decoder run its SP model's generations (rank 0 writes them)."""
    become_rank(rank, world, port, cache, 300)
    import torch.distributed as dist

    try:
        for recipe, overrides, report in jobs:
            trainer = Trainer(load_config(CONFIGS / f"{recipe}.yaml", overrides))
            trainer.fit()
            if report is not None:
                tokens = _generated(trainer.model)
                if rank == 0:
                    torch.save(tokens, report)
    finally:
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def _reference(case, out, *extra):
    recipe, overrides = _overrides(case, out, *extra)
    trainer = Trainer(load_config(CONFIGS / f"{recipe}.yaml", overrides))
    trainer.fit()
    return trainer


def assert_same_run(got: Path, ref: Path, steps=(1, 2, 3, 4)):
    """Train and validation losses (and BLEU) of every step equal the 1-process run's; the final
    checkpoint is complete."""
    ours = {r["step"]: r for r in metrics(got)}
    theirs = {r["step"]: r for r in metrics(ref)}
    assert sorted(ours) == sorted(theirs) == list(steps)
    for step, r in theirs.items():
        assert ours[step]["loss"] == pytest.approx(r["loss"], rel=1e-5), (got, step)
        for key in ("val_loss", "val_bleu", "val_chrf"):
            assert (key in ours[step]) == (key in r), (got, step, key)
            if key in r:
                assert ours[step][key] == pytest.approx(r[key], rel=1e-5, abs=1e-6), (got, step, key)
    assert [s for s in theirs if "val_loss" in theirs[s]] == [2, 4]
    newest = list_checkpoints(got / "checkpoints")[-1]
    assert newest.name == f"step_{steps[-1]:08d}"
    verify(newest, deep=True)


@pytest.mark.slow
def test_tp2_sp_at_an_odd_length_trains_evaluates_decodes_and_saves_like_one_process(tmp_path, cache):
    """Llama GQA (6/2 heads) and the translation Transformer (token-budget batches, BLEU with beam
    search at every evaluation) at tp=2 + SP, seq 63, on 2 ranks."""
    sp = ["parallel.tp=2", "parallel.sp=true"]
    llama = _overrides(LLAMA_GQA, tmp_path / "llama", *ODD, *sp)
    translate = _overrides(TRANSLATE, tmp_path / "translate", *sp)
    run_ranks(2, [(*llama, str(tmp_path / "llama.pt")), (*translate, None)], cache, worker=_worker)
    ref = _reference(LLAMA_GQA, tmp_path / "llama-ref", *ODD)
    assert_same_run(tmp_path / "llama", tmp_path / "llama-ref")
    got = torch.load(tmp_path / "llama.pt")
    for beams, tokens in _generated(ref.model).items():
        assert torch.equal(got[beams], tokens), beams
    _reference(TRANSLATE, tmp_path / "translate-ref")
    assert_same_run(tmp_path / "translate", tmp_path / "translate-ref")
    text = (tmp_path / "llama" / "config.yaml").read_text()
    assert "seq_len: 63" in text and "sp: true" in text


@pytest.mark.slow
def test_pp2_x_tp2_sp_at_an_odd_length_evaluates_like_one_process(tmp_path, cache):
    """T5 v1.1 at pp=2 x tp=2 + SP, seq 63, on 4 ranks: the pipelined evaluation pads too."""
    flags = ["parallel.pp=2", "parallel.tp=2", "parallel.sp=true", "grad_accum=2"]
    run_ranks(4, [(*_overrides(T5_V11, tmp_path / "t5", *ODD, *flags), None)], cache, worker=_worker)
    _reference(T5_V11, tmp_path / "t5-ref", *ODD, "grad_accum=2")
    assert_same_run(tmp_path / "t5", tmp_path / "t5-ref")
