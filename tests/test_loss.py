"""The LM loss: tformer's cross-entropy against ``F.cross_entropy``, value and gradient."""

import pytest
import torch

from tformer import build_model
from tformer.models.base import CrossEntropy, lm_loss


def labels_with_ignored(n, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[::3] = -100
    return labels


@pytest.mark.parametrize("n,vocab", [(7, 11), (64, 1000)])
def test_cross_entropy_matches_torch_in_value_and_gradient(n, vocab):
    logits = (3 * torch.randn(n, vocab, dtype=torch.float64)).requires_grad_()
    labels = labels_with_ignored(n, vocab)
    expected = torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100)
    (want,) = torch.autograd.grad(2.5 * expected, logits)
    got = CrossEntropy.apply(logits, labels)
    (have,) = torch.autograd.grad(2.5 * got, logits)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(have, want)
    assert have[labels == -100].abs().max() == 0  # ignored positions get no gradient


def test_lm_loss_upcasts_bf16_logits_and_returns_bf16_gradients():
    logits = torch.randn(2, 5, 40).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, 40, (2, 5))
    loss = lm_loss(logits, labels)
    assert loss.dtype == torch.float32
    expected = torch.nn.functional.cross_entropy(logits.float().reshape(-1, 40), labels.reshape(-1))
    torch.testing.assert_close(loss, expected)
    loss.backward()
    assert logits.grad.dtype == torch.bfloat16


def test_second_backward_through_the_same_loss_is_refused_loudly():
    logits = torch.randn(4, 9, requires_grad=True)
    loss = CrossEntropy.apply(logits, torch.tensor([1, 2, -100, 3]))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="inplace"):
        loss.backward()


def test_model_loss_gradients_match_torch_cross_entropy():
    model = build_model("gpt2-tiny", pad_vocab_multiple=64, vocab_size=1000)  # padded, sliced logits
    ids = torch.randint(0, 1000, (2, 9))
    labels = ids.roll(-1, 1)
    labels[:, -1] = -100
    out = model(ids, labels=labels)
    out.loss.backward()
    ours = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    logits = model(ids).logits
    torch.nn.functional.cross_entropy(logits.reshape(-1, 1000), labels.reshape(-1)).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(ours[n], p.grad, msg=n)


@pytest.mark.parametrize("pad", [1, 64])
def test_loss_only_path_equals_torch_cross_entropy(pad):
    """The trainer's path (``return_logits=False``) writes the log-softmax over the head's output;
    loss and gradients stay those of ``F.cross_entropy`` over the logits, sliced or not."""
    torch.manual_seed(0)
    model = build_model("gpt2-tiny", pad_vocab_multiple=pad, vocab_size=1000, dropout=0.0)
    ids = torch.randint(0, 1000, (2, 9))
    labels = ids.roll(-1, 1)
    labels[:, -1] = -100
    loss = model(ids, labels=labels, return_logits=False).loss
    loss.backward()
    ours = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    expected = torch.nn.functional.cross_entropy(model(ids).logits.reshape(-1, 1000), labels.reshape(-1))
    expected.backward()
    torch.testing.assert_close(loss, expected)
    for n, p in model.named_parameters():
        torch.testing.assert_close(ours[n], p.grad, msg=n)


# -- label smoothing (the paper's epsilon_ls) ----------------------------------------------------


@pytest.mark.parametrize("eps", [0.1, 0.35])
@pytest.mark.parametrize("n,vocab", [(7, 11), (64, 1000)])
def test_label_smoothing_matches_torch_in_value_and_gradient(eps, n, vocab):
    logits = (3 * torch.randn(n, vocab, dtype=torch.float64)).requires_grad_()
    labels = labels_with_ignored(n, vocab)
    expected = torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100, label_smoothing=eps)
    (want,) = torch.autograd.grad(1.5 * expected, logits)
    got = CrossEntropy.apply(logits, labels, eps)
    (have,) = torch.autograd.grad(1.5 * got, logits)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(have, want, atol=1e-6, rtol=0)
    assert have[labels == -100].abs().max() == 0


@pytest.mark.parametrize("preset", ["gpt2-tiny", "bert-tiny", "transformer-tiny"])
def test_label_smoothing_through_the_model_on_full_and_loss_only_paths(preset):
    """The logits path and the loss-only path (MLM head at labelled positions only) both give
    torch's smoothed loss and gradients, padded vocabulary rows sliced away."""
    torch.manual_seed(0)
    model = build_model(preset, vocab_size=500, pad_vocab_multiple=64)  # fp32, as lm_loss computes
    ids = torch.randint(3, 500, (2, 9))
    labels = torch.randint(3, 500, (2, 9))
    labels[0, :4] = -100
    kw = {"decoder_input_ids": ids} if model.config.family == "encdec" else {}
    logits = model(ids, **kw).logits
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, 500), labels.reshape(-1), label_smoothing=0.1)
    expected.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    for return_logits in (True, False):
        model.zero_grad()
        out = model(ids, labels=labels, label_smoothing=0.1, return_logits=return_logits, **kw)
        # fp32 summation orders differ by a few ulps (1.4e-6 = 3 ulps of a loss of 7.55 measured)
        torch.testing.assert_close(out.loss, expected, atol=0, rtol=1e-6)
        out.loss.backward()
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, want[n], atol=1e-6, rtol=0, msg=n)
