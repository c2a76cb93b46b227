"""Sequence parallel at sequence lengths that are not a multiple of tp (63 at tp=2): training, both
evaluations (plain and pipelined), BLEU decoding and generation pad the same way
(``models.base.pad_sequences``), and every number equals the 1-process run's (fp32): train and
validation losses, BLEU, generated tokens and the logits of every decoding step; each run ends with
its final checkpoint. "Equals" is to fp32 rounding (CONTRIBUTING.md, "Tolerances hold on every
CPU"): within test_mesh.LAYOUT_FACTOR times how far the 1-process run lies from its twin with the
attention written out (model.attn_impl=math: another valid summation order); BLEU, chrF and the
generated tokens exactly.

The spawned groups reuse test_mesh's launcher (a deadline that fails the test and kills the ranks)."""

from pathlib import Path

import pytest
import torch

from tformer.checkpoint import list_checkpoints, verify
from tformer.train.config import load_config
from tformer.train.trainer import Trainer

from test_mesh import COMMON, FAMILIES, FP32_ROUNDING, LAYOUT_FACTOR, run_ranks
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
    path = tmp_path_factory.mktemp("tformer-cache-sp")
    with pytest.MonkeyPatch.context() as mp:  # the next module finds TFORMER_CACHE as it was
        mp.setenv("TFORMER_CACHE", str(path))
        yield path


def _overrides(case, out, *extra):
    recipe, own = case
    return recipe, small_overrides(recipe, out, *COMMON, *own, *extra)


def _generated(model) -> dict:
    """Greedy and 2-beam decoding of PROMPT: {beams: (tokens, logits of every step)}. A 4-step model
    repeats one token for every prompt and beam, so equal tokens would not show a decode that reads
    the wrong position: the logits of each step (read where the decode loop reads them) do."""
    from unittest import mock

    import tformer.generate as gen

    steps: list = []

    def record(logits):
        logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits  # a TP rank's DTensor
        steps.append(logits.detach().float().clone())

    def next_token(logits, *args):
        record(logits)
        return greedy(logits, *args)

    def beam_step(self, step_input):
        logits = beam(self, step_input)
        record(logits)
        return logits

    greedy, beam = gen.next_token, gen._Stepper.__call__
    out = {}
    with mock.patch.object(gen, "next_token", next_token), mock.patch.object(gen._Stepper, "__call__", beam_step):
        for beams in (1, 2):
            steps.clear()
            tokens = gen.generate(model, PROMPT, 8, num_beams=beams, eos_token_id=None)
            out[beams] = (tokens, torch.stack(steps))
    return out


def _relative(got, want) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def assert_same_decoding(got: dict, ref_model, twin_model) -> None:
    """``got`` (``_generated`` of a parallel run) equals the 1-process model's decoding: the same
    tokens, and every step's logits within LAYOUT_FACTOR times how far the twin's (``_reference``
    with model.attn_impl=math) lie from them. The reference's logits change from one step to the
    next by far more than that, so a decode that read the previous (or next) position fails."""
    twins = _generated(twin_model)
    for beams, (tokens, logits) in _generated(ref_model).items():
        assert torch.equal(got[beams][0], tokens) and torch.equal(twins[beams][0], tokens), beams
        assert logits.shape == (8, PROMPT.shape[0] * beams, logits.shape[-1]), logits.shape
        yard = max(FP32_ROUNDING, _relative(twins[beams][1], logits))
        err = _relative(got[beams][1], logits)
        print(f"{beams} beam(s): logits {err:.1e} ({err / yard:.2f} of the yardstick {yard:.1e})")
        assert err <= LAYOUT_FACTOR * yard, (beams, err, yard)
        assert (logits[1:] - logits[:-1]).abs().amax() > 1e-2, "the reference's logits do not move between steps"


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
    """The 1-process run in ``out`` and its twin with the attention written out in ``out-math``
    (the yardstick of its losses and decoding; no BLEU, which is compared exactly); returns both
    trainers."""
    trainers = []
    for run, flags in ((out, ()), (out.with_name(out.name + "-math"), ("model.attn_impl=math", "eval_bleu=false"))):
        recipe, overrides = _overrides(case, run, *extra, *flags)
        trainers.append(Trainer(load_config(CONFIGS / f"{recipe}.yaml", overrides)))
        trainers[-1].fit()
    return trainers


def assert_same_run(got: Path, ref: Path, steps=(1, 2, 3, 4)):
    """Train and validation losses of every step equal the 1-process run's (``_reference``: within
    LAYOUT_FACTOR times how far its twin lies from it), BLEU and chrF exactly; the final checkpoint
    is complete."""
    ours = {r["step"]: r for r in metrics(got)}
    theirs = {r["step"]: r for r in metrics(ref)}
    twin = {r["step"]: r for r in metrics(ref.with_name(ref.name + "-math"))}
    assert sorted(ours) == sorted(theirs) == sorted(twin) == list(steps)
    losses = [(s, k) for s, r in theirs.items() for k in ("loss", "val_loss") if k in r]

    def distance(run):
        return max(abs(run[s][k] - theirs[s][k]) / abs(theirs[s][k]) for s, k in losses)

    yard = max(FP32_ROUNDING, distance(twin))
    print(f"{got.name}: losses {distance(ours):.1e} ({distance(ours) / yard:.2f} of the yardstick {yard:.1e})")
    assert distance(ours) <= LAYOUT_FACTOR * yard, (got, distance(ours), yard, ours, theirs)
    for step, r in theirs.items():
        for key in ("val_loss", "val_bleu", "val_chrf"):
            assert (key in ours[step]) == (key in r), (got, step, key)
            if key in r and key != "val_loss":  # scores of the decoded tokens: the same tokens
                assert ours[step][key] == r[key], (got, step, key)
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
    ref, twin = _reference(LLAMA_GQA, tmp_path / "llama-ref", *ODD)
    assert_same_run(tmp_path / "llama", tmp_path / "llama-ref")
    assert_same_decoding(torch.load(tmp_path / "llama.pt"), ref.model, twin.model)
    _reference(TRANSLATE, tmp_path / "translate-ref")
    assert_same_run(tmp_path / "translate", tmp_path / "translate-ref")
    text = (tmp_path / "llama" / "config.yaml").read_text()
    assert "seq_len: 63" in text and "sp: true" in text


@pytest.mark.long  # CI: tp2 + SP at the odd length
def test_pp2_x_tp2_sp_at_an_odd_length_evaluates_like_one_process(tmp_path, cache):
    """T5 v1.1 at pp=2 x tp=2 + SP, seq 63, on 4 ranks: the pipelined evaluation pads too."""
    flags = ["parallel.pp=2", "parallel.tp=2", "parallel.sp=true", "grad_accum=2"]
    run_ranks(4, [(*_overrides(T5_V11, tmp_path / "t5", *ODD, *flags), None)], cache, worker=_worker)
    _reference(T5_V11, tmp_path / "t5-ref", *ODD, "grad_accum=2")
    assert_same_run(tmp_path / "t5", tmp_path / "t5-ref")
