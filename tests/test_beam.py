"""Beam search: greedy at one beam, exhaustive search on a tiny vocabulary, HF generate's tokens on
the exported Marian model, batched equal to one by one, bad arguments."""

import gzip
import itertools
import math

import pytest
import torch
import transformers
from transformers.cache_utils import DynamicCache, EncoderDecoderCache

from tformer import build_model
from tformer.data import default_corpus_path, train_tokenizer
from tformer.generate import beam_search, generate, length_normaliser


pytestmark = pytest.mark.usefixtures("one_thread")


def paper_model(seed=0, **overrides):
    torch.manual_seed(seed)
    return build_model("transformer-tiny", **{"init_std": 0.3, **overrides}).eval()


def strip(row, eos):
    row = row.tolist()
    return row[: row.index(eos) + 1] if eos in row else row


@pytest.mark.parametrize("name", ["transformer-tiny", "gpt2-tiny"])
def test_one_beam_is_greedy(name):
    torch.manual_seed(0)
    model = build_model(name, init_std=0.3).eval()
    ids = torch.randint(3, 1000, (3, 7))
    greedy = generate(model, ids, 12)
    beam = beam_search(model, ids, 12, num_beams=1)
    eos = model.config.eos_token_id
    assert [strip(r, eos) for r in beam] == [strip(r, eos) for r in greedy]


@pytest.mark.parametrize("alpha,norm", [(0.0, "gnmt"), (1.0, "power"), (0.6, "gnmt")])
def test_enough_beams_find_the_exhaustive_best(alpha, norm):
    """Vocabulary of 4 (EOS = 1), at most 3 new tokens: score every possible output by teacher
    forcing; beam search with as many beams as outputs returns the best one."""
    model = paper_model(seed=1, vocab_size=4, d_model=16, num_heads=2, d_ff=32, init_std=1.0)
    src = torch.tensor([[2, 3, 2, 1]])
    eos, start, steps = 1, model.config.decoder_start_token_id, 3
    best, best_score = None, -math.inf
    for length in range(1, steps + 1):
        for seq in itertools.product(range(4), repeat=length):
            if eos in seq[:-1] or (length < steps and seq[-1] != eos):
                continue  # an output ends at its first EOS, or at the length limit
            dec = torch.tensor([[start, *seq[:-1]]])
            with torch.no_grad():
                logp = torch.log_softmax(model(src, decoder_input_ids=dec).logits[0].float(), -1)
            score = logp[torch.arange(length), list(seq)].sum().item() / length_normaliser(length, alpha, norm)
            if score > best_score:
                best, best_score = list(seq), score
    out = beam_search(model, src, steps, num_beams=4**steps, length_penalty=alpha, length_norm=norm)
    assert strip(out[0, 1:], eos) == best


@pytest.mark.parametrize("name", ["transformer-tiny", "llama-tiny"])
def test_batched_beams_equal_one_by_one(name):
    torch.manual_seed(0)
    model = build_model(name, init_std=0.3).eval()
    eos = model.config.eos_token_id
    srcs = [torch.randint(3, 1000, (n,)) for n in (7, 4, 6)]
    width = max(len(s) for s in srcs)
    ids = torch.full((3, width), model.config.pad_token_id)
    mask = torch.zeros(3, width, dtype=torch.long)
    for i, s in enumerate(srcs):  # encoder-decoder: right padding; decoder: left padding
        sl = slice(0, len(s)) if model.config.family == "encdec" else slice(width - len(s), width)
        ids[i, sl], mask[i, sl] = s, 1
    batched = beam_search(model, ids, 10, num_beams=3, attention_mask=mask, length_penalty=0.6)
    for i, s in enumerate(srcs):
        alone = beam_search(model, s[None], 10, num_beams=3, length_penalty=0.6)
        new = batched[i, ids.shape[1] :] if model.config.family == "decoder" else batched[i]
        ref = alone[0, len(s) :] if model.config.family == "decoder" else alone[0]
        assert strip(new, eos) == strip(ref, eos), i


def copy_trained(steps=50):
    """transformer-tiny taught for a few steps to copy 2-8 tokens and stop: its outputs end at
    varied lengths, so the length penalty and the finishing rules matter (random weights never
    choose EOS)."""
    model = paper_model(vocab_size=300, init_std=0.05).train()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    pos = torch.arange(9)[None]
    for _ in range(steps):
        n = torch.randint(2, 9, (16, 1), generator=g)
        ids = torch.randint(3, 40, (16, 9), generator=g)
        ids = torch.where(pos < n, ids, torch.where(pos == n, 1, 0))
        mask = (pos <= n).long()
        loss = model(ids, mask, labels=ids.masked_fill(mask == 0, -100)).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The copy-trained transformer-tiny, exported to HF Marian with a small tokenizer."""
    from test_export import save_run
    from tformer.export import export_hf

    tmp = tmp_path_factory.mktemp("beam")
    text = tmp / "verses.txt"
    with gzip.open(default_corpus_path(), "rt", encoding="utf-8") as f:
        text.write_text("".join(itertools.islice(f, 300)), encoding="utf-8")
    tok = tmp / "tok.json"
    train_tokenizer("unigram", str(text), 300, tok)
    model = copy_trained()
    out = export_hf(save_run(model, tok, tmp / "run"), tmp / "hf")
    return model, transformers.AutoModelForSeq2SeqLM.from_pretrained(out).eval(), tmp / "run"


@pytest.mark.parametrize("k,alpha", [(2, 1.0), (4, 0.6), (4, 0.0), (5, 2.0)])
def test_same_tokens_as_hf_generate_on_the_exported_model(exported, k, alpha):
    model, hf, _ = exported
    assert type(hf).__name__ == "MarianMTModel"
    g = torch.Generator().manual_seed(k)
    ids = torch.randint(3, 40, (4, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 5:], mask[3, 7:] = 0, 0
    ids = ids.masked_fill(mask == 0, model.config.pad_token_id)
    ours = beam_search(model, ids, 14, num_beams=k, attention_mask=mask, length_penalty=alpha, length_norm="power")
    theirs = hf.generate(
        input_ids=ids,
        attention_mask=mask,
        num_beams=k,
        length_penalty=alpha,
        max_new_tokens=14,
        do_sample=False,
        early_stopping=False,
        past_key_values=EncoderDecoderCache(DynamicCache(), DynamicCache()),
    )
    eos = model.config.eos_token_id
    assert [strip(r, eos) for r in ours] == [strip(r, eos) for r in theirs]
    assert all(eos in r.tolist() for r in ours)  # every row finished on EOS, at its own length


def test_bad_beam_arguments(caplog):
    model = paper_model()
    src = torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="num_beams=0 must be an integer >= 1"):
        generate(model, src, 4, num_beams=0)
    with pytest.raises(ValueError, match="length_norm='exp' is not allowed"):
        generate(model, src, 4, num_beams=2, length_norm="exp")
    with caplog.at_level("WARNING"):  # a length penalty with greedy decoding: warned, then ignored
        assert torch.equal(generate(model, src, 4, length_penalty=0.6), generate(model, src, 4))
    assert "length_penalty=0.6 has no effect with num_beams=1" in caplog.text


def test_cli_prints_source_and_translation_on_two_labelled_lines(exported, capsys):
    from tformer.cli import main
    from tformer.data import load_tokenizer

    _, _, run = exported
    source = "In the beginning God created"
    assert main(["generate", str(run), source, "--num-beams", "3", "--length-penalty", "0.6", "--max-new-tokens", "12"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and lines[0] == f"source:      {source}" and lines[1].startswith("translation: ")
    translation = lines[1].removeprefix("translation: ")
    assert (
        main(
            [
                "generate",
                str(run),
                source,
                "--num-beams",
                "3",
                "--length-penalty",
                "0.6",
                "--max-new-tokens",
                "12",
                "--translation-only",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out == translation + "\n"
    model, tok = exported[0], load_tokenizer(run / "tokenizer.json")
    ids = torch.tensor([tok.encode(source, add_special_tokens=False).ids + [model.config.eos_token_id]])
    want = generate(model, ids, 12, num_beams=3, length_penalty=0.6)
    assert translation == tok.decode(want[0, 1:].tolist(), skip_special_tokens=True)


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--num-beams", "0"], "error: --num-beams=0 must be >= 1"),
        (["--num-beams", "2", "--temperature", "0.7"], "error: --temperature samples, beam search is deterministic"),
        (["--length-penalty", "0.6"], "warning: --length-penalty 0.6 has no effect without beam search"),
    ],
)
def test_cli_bad_beam_flags_give_one_line(exported, capsys, flags, message):
    from tformer.cli import main

    code = main(["generate", str(exported[2]), "a b", "--max-new-tokens", "3", *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == (0 if message.startswith("warning") else 2)
    assert len(err) == 1 and err[0].startswith(message), err
