"""KV-cached generation: same tokens as recomputation, correct sampling filters, EOS handling."""

import pytest
import torch

from tformer import build_model
from tformer.generate import filter_logits, generate
from tformer.nn import TransformerStack


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny", "t5-tiny", "t5-v1.1-tiny"])
def test_cached_greedy_equals_uncached_and_stepwise_argmax(name):
    model = build_model(name, eos_token_id=None).eval()
    ids = torch.randint(3, 1000, (2, 6))
    cached = generate(model, ids, 10)
    uncached = generate(model, ids, 10, use_cache=False)
    assert torch.equal(cached, uncached)
    # Greedy = argmax of a full forward at every step.
    seq = cached
    with torch.no_grad():
        if model.config.family == "encdec":
            logits = model(ids, decoder_input_ids=seq[:, :-1]).logits
            assert torch.equal(logits.argmax(-1), seq[:, 1:])
        else:
            logits = model(seq[:, :-1]).logits[:, 5:]
            assert torch.equal(logits.argmax(-1), seq[:, 6:])


def test_left_padded_batch_generates_like_each_prompt_alone():
    model = build_model("llama-tiny", eos_token_id=None).eval()
    a = torch.randint(3, 1000, (1, 7))
    b = torch.randint(3, 1000, (1, 4))
    batch = torch.cat((a, torch.cat((torch.zeros(1, 3, dtype=torch.long), b), 1)))
    mask = torch.tensor([[1] * 7, [0] * 3 + [1] * 4])
    out = generate(model, batch, 6, attention_mask=mask)
    assert torch.equal(out[0, 7:], generate(model, a, 6)[0, 7:])
    assert torch.equal(out[1, 7:], generate(model, b, 6)[0, 4:])


def test_sampling_is_reproducible_with_a_generator_and_respects_top_k():
    model = build_model("gpt2-tiny", eos_token_id=None).eval()
    ids = torch.randint(3, 1000, (3, 4))
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    s1 = generate(model, ids, 8, temperature=1.0, top_k=5, generator=g1)
    s2 = generate(model, ids, 8, temperature=1.0, top_k=5, generator=g2)
    assert torch.equal(s1, s2)
    top1 = generate(model, ids, 8, temperature=1.0, top_k=1, generator=g1)
    assert torch.equal(top1, generate(model, ids, 8))  # top-k 1 is greedy


def test_filter_logits_top_k_and_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept_k = torch.isfinite(filter_logits(logits, top_k=2))
    assert kept_k.tolist() == [[True, True, False, False]]
    kept_p = torch.isfinite(filter_logits(logits, top_p=0.75))
    assert kept_p.tolist() == [[True, True, False, False]]  # 0.5 + 0.3 reaches 0.75
    kept_p = torch.isfinite(filter_logits(logits, top_p=0.4))
    assert kept_p.tolist() == [[True, False, False, False]]  # the top token always survives
    shuffled = logits[:, [2, 0, 3, 1]]
    assert torch.isfinite(filter_logits(shuffled, top_p=0.75)).tolist() == [[False, True, False, True]]


def test_generation_stops_at_eos_and_pads_finished_rows():
    model = build_model("gpt2-tiny").eval()
    ids = torch.randint(3, 1000, (2, 4))
    free = generate(model, ids, 6, eos_token_id=None)
    eos = int(free[0, 4])  # the first token row 0 emits
    out = generate(model, ids, 6, eos_token_id=eos)
    assert out[0, 4] == eos
    assert (out[0, 5:] == model.config.pad_token_id).all()
    if eos not in free[1, 4:]:  # the other row runs on as before
        assert torch.equal(out[1], free[1])


def test_bad_generation_arguments():
    model = build_model("gpt2-tiny")
    with pytest.raises(ValueError, match="top_p=1.5 must be in"):
        generate(model, torch.zeros(1, 2, dtype=torch.long), 2, temperature=1.0, top_p=1.5)
    with pytest.raises(TypeError, match="decoder or encoder-decoder"):
        generate(build_model("bert-tiny"), torch.zeros(1, 2, dtype=torch.long), 2)


@pytest.mark.parametrize("name", ["llama-tiny", "t5-v1.1-tiny"])
def test_a_sequence_parallel_model_decodes_padded_and_uncached_to_the_same_tokens(name):
    """Under SP (``sequence_multiple`` = tp) every forward needs a length that is a multiple of tp:
    decoding pads each step's whole sequence as training pads its batches. Set on an unsplit model
    here (3: no odd prompt or step is a multiple), greedy and beam search give the cached tokens;
    the 2-rank run is in test_sp_lengths.py."""
    model = build_model(name, eos_token_id=None).eval()
    ids = torch.randint(3, 1000, (2, 7))
    mask = torch.tensor([[1] * 7, [0] * 2 + [1] * 5])
    ids[1, :2] = model.config.pad_token_id
    if model.config.family == "encdec":  # a ragged source: right-padded
        mask = mask.flip(1)
        ids = torch.where(mask.bool(), ids, model.config.pad_token_id)
    expected = {beams: generate(model, ids, 9, attention_mask=mask, num_beams=beams) for beams in (1, 3)}
    lengths = []  # of every sequence a stack (encoder or decoder) ran on
    for stack in (m for m in model.modules() if isinstance(m, TransformerStack)):
        stack.register_forward_pre_hook(lambda m, args: lengths.append(args[0].shape[1]))
    model.sequence_multiple = 3
    for beams, tokens in expected.items():
        assert torch.equal(generate(model, ids, 9, attention_mask=mask, num_beams=beams), tokens), beams
    assert len(lengths) > 9 and all(n % 3 == 0 for n in lengths), lengths
