"""The LM loss: tformer's cross-entropy against ``F.cross_entropy``, value and gradient."""

import copy

import pytest
import torch

from tformer import build_model
from tformer.models.base import CrossEntropy, lm_loss

from rounding import assert_within, float64_throughout, yardstick


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


@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_bf16_logits_give_the_fp32_loss_and_its_gradient_rounded_once(eps):
    """Low-precision logits go into the loss as they are (no fp32 copy first): the log-softmax
    upcasts them and the gradient comes back in bf16 from its last pass. The loss is the float64
    loss of the same bf16 logits to fp32's accuracy, and each gradient element that value rounded
    to bf16 once (within u = 2^-8 of it, bf16's unit roundoff; scaling in bf16 after a bf16
    rounding, or a lost 1/count, would not be)."""
    n, vocab = 64, 1000
    logits = (3 * torch.randn(n, vocab, generator=torch.Generator().manual_seed(1))).bfloat16().requires_grad_()
    labels = labels_with_ignored(n, vocab)
    exact = logits.detach().double().requires_grad_()
    expected = torch.nn.functional.cross_entropy(exact, labels, ignore_index=-100, label_smoothing=eps)
    (want,) = torch.autograd.grad(1.5 * expected, exact)
    got = lm_loss(logits, labels, eps)
    (have,) = torch.autograd.grad(1.5 * got, logits)
    assert got.dtype == torch.float32 and have.dtype == torch.bfloat16
    assert abs(got.item() - expected.item()) <= 1e-6 * expected.item()
    assert ((have.double() - want).abs() <= 2.0**-8 * want.abs() + 1e-12).all()
    assert have[labels == -100].abs().max() == 0


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

    def torch_loss(model):
        model.zero_grad()
        logits = model(ids, **kw).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 500), labels.reshape(-1), label_smoothing=0.1)
        loss.backward()
        return {"loss": loss.detach(), **{n: p.grad.clone() for n, p in model.named_parameters()}}

    want = torch_loss(model)
    # fp32 summation orders differ: ours may lie a few times as far from torch's fp32 result as
    # torch's lies from the same model in float64 (tests/rounding.py)
    with float64_throughout():
        exact = torch_loss(copy.deepcopy(model).double())
    scale = max(g.abs().max().item() for k, g in want.items() if k != "loss")
    yard = yardstick(want, exact, scale)
    for return_logits in (True, False):
        model.zero_grad()
        out = model(ids, labels=labels, label_smoothing=0.1, return_logits=return_logits, **kw)
        out.loss.backward()
        got = {"loss": out.loss.detach(), **{n: p.grad.clone() for n, p in model.named_parameters()}}
        ratio = assert_within(got, want, yard, scale, f"{preset} return_logits={return_logits}")
        print(f"{preset} return_logits={return_logits}: {ratio:.2f} yardsticks ({yard:.1e})")


# -- loss.chunk_size=auto: the head sized for the device (models/loss.auto_chunk_size) -------------

GB = 1e9


def test_auto_chunk_keeps_the_cpus_measured_best():
    from tformer.models.loss import CPU_CHUNK, auto_chunk_size

    assert auto_chunk_size(8 * 64, 4096, 4, None) == CPU_CHUNK == 128


@pytest.mark.parametrize(
    "tokens,vocab,free,want",
    [
        # llama-1b on an H200, micro-batch 16 x 2,048: 25 GB of bf16 logits fit a quarter of the
        # ~122 GB the states leave, so the head runs whole (the fastest there: 634 ms against 821
        # ms a step at 128-token chunks, shared/gpu/README.md)
        (16 * 2048, 128256, 122 * GB, None),
        # micro-batch 32: 50 GB does not fit 30.5 GB; the fewest chunks that do, a multiple of 256
        (32 * 2048, 128256, 122 * GB, 39424),
        # gpt2-small at micro-batch 256 x 1,024: 3 chunks a step where 128-token chunks made 2,048
        (256 * 1024, 50304, 139 * GB, 114944),
        # a small card and a huge vocabulary: never under 256 rows
        (4096, 256000, 2 * GB, 256),
    ],
)
def test_auto_chunk_on_an_accelerator_runs_the_head_whole_where_it_fits(tokens, vocab, free, want):
    from tformer.models.loss import GPU_MIN_CHUNK, HEAD_SHARE, auto_chunk_size

    got = auto_chunk_size(tokens, vocab, 6, free)
    assert got == want
    if got is None:
        assert tokens * vocab * 6 <= HEAD_SHARE * free
    else:
        assert got % GPU_MIN_CHUNK == 0 and (got == GPU_MIN_CHUNK or got * vocab * 6 <= HEAD_SHARE * free)
        assert got >= GPU_MIN_CHUNK and tokens * vocab * 6 > HEAD_SHARE * free


def test_the_trainer_resolves_auto_and_keeps_a_number(tmp_path, monkeypatch):
    """The default (auto) is the CPU's 128 here; a number or null is taken as given; the head's rows
    count a micro-batch's target tokens (T5), its masked share (BERT), 1/cp of them."""
    from tformer.train.config import load_config
    from tformer.plan.head import head_rows
    from tformer.train.loop.head import loss_chunk_size
    from tformer.parallel.mesh import ParallelDims

    from train_helpers import CONFIGS

    cfg = load_config(CONFIGS / "gpt2-tiny.yaml", [f"output_dir={tmp_path}"])
    assert cfg.loss.chunk_size == "auto"
    dims = ParallelDims(1, 1, 1)
    cpu = torch.device("cpu")
    assert loss_chunk_size(cfg, cfg.model, cpu, "fp32", 10**6, dims, 64, None) == 128
    cfg.loss.chunk_size = None
    assert loss_chunk_size(cfg, cfg.model, cpu, "fp32", 10**6, dims, 64, None) is None
    cfg.loss.chunk_size = 7
    assert loss_chunk_size(cfg, cfg.model, cpu, "fp32", 10**6, dims, 64, None) == 7
    assert head_rows(cfg, cfg.model, 64, None, 1) == cfg.micro_batch_size * 64
    assert head_rows(cfg, cfg.model, 64, None, 2) == cfg.micro_batch_size * 32
    t5 = load_config(CONFIGS / "t5-tiny.yaml", [f"output_dir={tmp_path}"])
    assert head_rows(t5, t5.model, 128, 30, 1) == t5.micro_batch_size * 30
    bert = load_config(CONFIGS / "bert-tiny.yaml", [f"output_dir={tmp_path}"])
    assert head_rows(bert, bert.model, 100, None, 1) == int(bert.micro_batch_size * 100 * bert.data.mlm_probability)


def test_auto_on_a_gpu_sizes_the_head_from_the_devices_capacity(tmp_path, monkeypatch):
    """The trainer's GPU branch (train/loop/head.py): the capacity it reads from the device, less 16 bytes
    per parameter the rank holds, decides between the whole head and the fewest chunks that fit."""
    from types import SimpleNamespace

    from tformer.models.loss import GPU_MIN_CHUNK, HEAD_SHARE
    from tformer.parallel.mesh import ParallelDims
    from tformer.train.config import load_config
    from tformer.train.loop.head import loss_chunk_size

    from train_helpers import CONFIGS

    seen = []

    def properties(device):
        seen.append(device)
        return SimpleNamespace(total_memory=capacity)

    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    cfg = load_config(CONFIGS / "gpt2-tiny.yaml", [f"output_dir={tmp_path}", "micro_batch_size=16"])
    cuda, params, rows, vocab = torch.device("cuda", 0), 10**9, 16 * 1024, cfg.model.padded_vocab_size
    logits = rows * vocab * 6  # bf16: 6 bytes a logit at the head's peak
    states = 16 * params  # fp32 weights, gradients and AdamW's two moments

    capacity = states + 5 * logits  # the whole head fits HEAD_SHARE of what the states leave
    assert HEAD_SHARE * (capacity - states) >= logits
    assert loss_chunk_size(cfg, cfg.model, cuda, "bf16", params, ParallelDims(1, 1, 1), 1024, None) is None
    assert seen == [cuda]

    capacity = states + 2 * logits  # half the head's rows fit: chunks of them, in GPU_MIN_CHUNK steps
    want = int(HEAD_SHARE * (capacity - states) // (vocab * 6)) // GPU_MIN_CHUNK * GPU_MIN_CHUNK
    assert GPU_MIN_CHUNK <= want < rows
    got = loss_chunk_size(cfg, cfg.model, cuda, "bf16", params, ParallelDims(1, 1, 1), 1024, None)
    assert got == want
    # FSDP over 8 ranks holds an eighth of the states: room for the whole head
    cfg.parallel.strategy = "fsdp"
    assert loss_chunk_size(cfg, cfg.model, cuda, "bf16", params, ParallelDims(1, 8, 1), 1024, None) is None


@pytest.mark.parametrize("fp32_out", [True, False], ids=["addmm-out-dtype", "without-it"])
def test_a_chunked_heads_weight_gradient_on_an_accelerator_multiplies_the_bf16_operands(fp32_out, monkeypatch):
    """Under bf16 autocast on an accelerator, each chunk's weight gradient multiplies the bf16
    operands (as ``F.linear``'s own weight gradient does) and the chunks are summed in fp32: with
    ``addmm(..., out_dtype=float32)`` (CUDA) straight into the fp32 gradient; without it (this CPU
    build has no such kernel) the bf16 product of each chunk added in. An fp32 GEMM there ran at
    the card's fp32 rate. Against the fp32 product (the CPU path, same logits), the difference is
    what rounding the two operands to bf16 explains (2u of |g|^T |x|, u = 2^-8 its unit roundoff),
    plus one rounding of each chunk's product without ``out_dtype``: measured 0.46 and 0.42 of
    those bounds, and a chunk left out 117 and 78 times them."""
    import tformer.models.loss as loss

    torch.manual_seed(0)
    n, d, vocab, chunk = 96, 32, 64, 32
    x = torch.randn(n, d)
    w = torch.randn(vocab, d) * 0.3
    labels = labels_with_ignored(n, vocab)

    def weight_grad() -> torch.Tensor:
        weight = w.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss.chunked_lm_loss(x, weight, None, labels, chunk).backward()
        return weight.grad

    fp32 = weight_grad()  # the CPU's path: an fp32 GEMM of the fp32 gradient and input
    calls = []
    if fp32_out:

        def addmm(c, a, b, *, out_dtype=None, out=None):  # CUDA's kernel, emulated: fp32 accumulation
            assert out_dtype == torch.float32 and a.dtype == b.dtype == torch.bfloat16 and out is c
            calls.append(a.shape)
            return out.add_(a.float() @ b.float())

        monkeypatch.setattr(torch, "addmm", addmm)
    monkeypatch.setattr(loss, "_accelerated", lambda t: True)
    monkeypatch.setattr(loss, "_FP32_OUT_ADDMM", {})
    got = weight_grad()
    assert loss._FP32_OUT_ADDMM == {"cpu": fp32_out}
    assert len(calls) == (n // chunk if fp32_out else 0)

    # the gradient of the logits the chunks computed (bf16 logits, fp32 softmax), to size the bound
    z = torch.nn.functional.linear(x.bfloat16(), w.bfloat16()).float()
    valid = labels != -100
    g = torch.softmax(z, -1)
    g[torch.arange(n)[valid], labels[valid]] -= 1
    g = g * valid[:, None] / valid.sum()
    scale = g.abs().t() @ x.abs()
    u = 2.0**-8
    bound = (2 * u + (0 if fp32_out else u) + 1e-5) * scale
    assert ((got - fp32).abs() <= bound).all(), ((got - fp32).abs() / bound).max()
    assert (got - fp32).abs().max() > 0  # the bf16 operands were used, not the fp32 ones
