"""Memory at the limit: the chunked head + loss, op-level selective activation checkpointing and
activation offload change memory and time only, never the loss or a gradient."""

import copy

import pytest
import torch
import torch.nn.functional as F

from tformer import build_model
from tformer.models.loss import chunked_lm_loss

from conftest import TINY
from rounding import assert_within, float64_throughout, yardstick


# -- chunked head + loss ---------------------------------------------------------------------


def _batch(model, seed, sparse):
    """Inputs and labels for one micro-batch; ``sparse`` leaves most labels at -100."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 1000, (2, 12), generator=g)
    family = model.config.family
    labels = torch.randint(3, 1000, (2, 7) if family == "encdec" else (2, 12), generator=g)
    if family == "encoder" or sparse:  # BERT: masked positions only (a fifth here)
        drop = torch.rand(labels.shape, generator=g) > (0.2 if family == "encoder" else 0.5)
        drop[0, 0] = False  # at least one labelled position
        labels = labels.masked_fill(drop, -100)
    return {"input_ids": ids, "labels": labels}


def _loss_and_grads(model, batches, chunk):
    """Mean of the micro-batch losses and the accumulated gradients, as the trainer does."""
    model.loss_chunk_size = chunk
    model.zero_grad(set_to_none=True)
    total = 0.0
    for batch in batches:
        loss = model(**batch, return_logits=False).loss / len(batches)
        loss.backward()
        total += loss.item()
    return total, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_rel(got, want, what, rel=1e-6):
    # relative to the tensor's norm; a gradient that is zero in exact arithmetic (a key bias under
    # softmax) is rounding noise around 1e-12 and is compared against 1e-3 (1e-9 absolute)
    err = (got - want).norm() / want.norm().clamp(min=1e-3)
    assert err <= rel, f"{what}: relative error {err:.2e}"


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("tied", [True, False])
def test_chunked_loss_equals_unchunked_loss_and_gradients(name, tied):
    """fp32, padded vocabulary (1000 -> 1024 rows), dense and sparse labels, BERT's masked
    positions, two accumulated micro-batches, chunk sizes that do (8 of 24) and do not (5, 7)
    divide the token count, and one larger than it."""
    torch.manual_seed(0)
    model = build_model(name, vocab_size=1000, pad_vocab_multiple=64, tie_embeddings=tied, dropout=0.0).train()
    assert model.config.padded_vocab_size == 1024
    assert (model.lm_head.weight is model.embed.tok.weight) == tied
    exact_model = copy.deepcopy(model).double()
    for sparse in (False, True):
        batches = [_batch(model, seed, sparse) for seed in (1, 2)]
        want_loss, want = _loss_and_grads(model, batches, None)
        # the chunks sum the head's gradient and the loss in another order: each chunked run may lie
        # a few times as far from the whole head's result as that lies from the same model in
        # float64 throughout (tests/rounding.py; a sum over every token, as an MoE router's, a
        # shared-expert gate's or a norm's bias gradient, carries the most of it)
        with float64_throughout():
            exact_loss, exact = _loss_and_grads(exact_model, batches, None)
        want["loss"], exact["loss"] = (torch.tensor(v, dtype=torch.float64) for v in (want_loss, exact_loss))
        scale = max(g.abs().max().item() for k, g in want.items() if k != "loss")
        yard = yardstick(want, exact, scale)
        for chunk in (5, 7, 8, 4096):
            loss, grads = _loss_and_grads(model, batches, chunk)
            grads["loss"] = torch.tensor(loss, dtype=torch.float64)
            ratio = assert_within(grads, want, yard, scale, f"{name} sparse={sparse} chunk={chunk}")
            print(f"{name} tied={tied} sparse={sparse} chunk={chunk}: {ratio:.2f} yardsticks ({yard:.1e})")
    padded = model.lm_head.weight.grad[1000:]
    assert padded.abs().max() == 0  # padded vocabulary rows get no gradient


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("bias", [False, True])
def test_chunked_loss_function_matches_torch_cross_entropy(smoothing, bias):
    """Against ``F.cross_entropy(F.linear(...))`` with label smoothing, bias, ignore index,
    padded weight rows and a non-unit incoming gradient."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 11, 16, generator=g, requires_grad=True)
    w = (0.3 * torch.randn(70, 16, generator=g)).requires_grad_()
    b = torch.randn(70, generator=g, requires_grad=True) if bias else None
    labels = torch.randint(0, 64, (3, 11), generator=g)
    labels[:, ::4] = -100
    inputs = [t for t in (x, w, b) if t is not None]

    def torch_loss(inputs):
        logits = F.linear(*inputs)[..., :64]
        loss = F.cross_entropy(logits.reshape(-1, 64), labels.reshape(-1), label_smoothing=smoothing)
        return {"loss": loss.detach(), **dict(zip("xwb", torch.autograd.grad(2.5 * loss, inputs)))}

    want = torch_loss(inputs)
    # torch's fp32 result against the same in float64: the yardstick (tests/rounding.py)
    exact = torch_loss([t.detach().double().requires_grad_() for t in inputs])
    got = chunked_lm_loss(x, w, b, labels, 4, vocab_size=64, label_smoothing=smoothing)
    got = {"loss": got.detach(), **dict(zip("xwb", torch.autograd.grad(2.5 * got, inputs)))}
    scale = max(g.abs().max().item() for k, g in want.items() if k != "loss")
    yard = yardstick(want, exact, scale)
    print(f"chunked vs torch: {assert_within(got, want, yard, scale):.2f} yardsticks ({yard:.1e})")


def test_chunked_loss_under_bf16_autocast_is_close_to_the_unchunked_one():
    torch.manual_seed(0)
    model = build_model("llama-tiny", dropout=0.0).train()
    batches = [_batch(model, 1, False)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want_loss, want = _loss_and_grads(model, batches, None)
        loss, grads = _loss_and_grads(model, batches, 8)
    assert loss == pytest.approx(want_loss, rel=1e-2)
    for n in want:
        assert grads[n].dtype == want[n].dtype == torch.float32
        _assert_rel(grads[n], want[n], n, rel=3e-2)


def test_chunked_loss_without_grad_and_second_backward():
    model = build_model("gpt2-tiny", dropout=0.0)
    model.loss_chunk_size = 5
    batch = _batch(model, 1, False)
    with torch.no_grad():
        loss = model(**batch, return_logits=False).loss
    model.loss_chunk_size = None
    with torch.no_grad():
        assert loss.item() == pytest.approx(model(**batch, return_logits=False).loss.item(), rel=1e-6)
    model.loss_chunk_size = 5
    loss = model(**batch, return_logits=False).loss
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="one backward"):
        loss.backward()


# -- op-level selective activation checkpointing ---------------------------------------------


class OpCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the aten ops that really run (ops answered from the checkpoint's cache do not)."""

    def __init__(self):
        super().__init__()
        from collections import Counter

        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func] += 1
        return func(*args, **(kwargs or {}))


def _backward_ops(model, batch, seed=0):
    """Gradients of one step and the ops its backward ran (recomputation included)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the same dropout masks in every run
    loss = model(**batch).loss
    with OpCounter() as counter:
        loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, counter.ops


@pytest.mark.parametrize("name", TINY)
def test_op_checkpointing_changes_no_gradient_and_recomputes_only_cheap_ops(name):
    """Dropout on (0.1 everywhere, attention dropout included): the masks are reproduced exactly.
    Backward under ``op`` runs the forward's cheap ops again but not one more matmul or attention
    than without checkpointing, while ``full`` recomputes the matmuls too."""
    from tformer.parallel.ac import ATTENTION_OPS, MATMUL_OPS, apply_activation_checkpointing

    torch.manual_seed(0)
    model = build_model(name, dropout=0.1, attn_dropout=0.1).train()
    batch = _batch(model, 1, False)
    apply_activation_checkpointing(model, "none")
    want, base = _backward_ops(model, batch)
    marked = apply_activation_checkpointing(model, "op")
    assert marked == sum(1 for m in model.modules() if m.__class__.__name__ == "TransformerBlock")
    grads, ops = _backward_ops(model, batch)
    for n in want:
        _assert_rel(grads[n], want[n], n)
    recomputed = ops - base
    assert recomputed, "op-level checkpointing recomputed nothing"
    assert not set(recomputed) & MATMUL_OPS, recomputed  # no matmul is recomputed ...
    norm_ops = {torch.ops.aten.native_layer_norm.default, torch.ops.aten.rsqrt.default}
    assert set(recomputed) & norm_ops, recomputed  # ... but the norms are
    assert torch.ops.aten.bernoulli_.float in recomputed  # and the dropouts, with the same masks
    # without attention dropout, attention is saved: only the cheap ops run again
    model = build_model(name, dropout=0.1, attn_dropout=0.0).train()
    apply_activation_checkpointing(model, "none")
    want, base = _backward_ops(model, batch)
    apply_activation_checkpointing(model, "op")
    grads, ops = _backward_ops(model, batch)
    for n in want:
        _assert_rel(grads[n], want[n], n)
    assert not set(ops - base) & SAVED, ops - base
    with OpCounter() as forward:
        model(**batch)
    # latent attention's values are narrower than its queries and keys: SDPA runs its math kernel
    # (matmuls, checked above not to run again), no fused op to count
    # (soft-capped logits take the math path too: SDPA cannot cap them)
    if not model.config.latent_attention and model.config.attn_softcap is None:
        assert set(forward.ops) & ATTENTION_OPS  # the fused attention ran in forward ...
    assert not set(ops - base) & ATTENTION_OPS  # ... and not again in backward
    apply_activation_checkpointing(model, "full")
    grads, full = _backward_ops(model, batch)
    assert set(full - base) & MATMUL_OPS  # full AC recomputes the matmuls as well


from tformer.parallel.ac import SAVED_OPS as SAVED  # noqa: E402


# -- activation offload ------------------------------------------------------------------------


def test_activation_offload_changes_no_gradient_and_keeps_parameters_in_place(caplog):
    """The offload hooks forced on CPU (on a CPU device the setting is a no-op): the same
    gradients, bitwise, with every saved activation copied out and no parameter copied."""
    from tformer.parallel.offload import OffloadActivations, activation_offload

    torch.manual_seed(0)
    model = build_model("llama-tiny", dropout=0.1).train()
    batch = _batch(model, 1, False)
    model.loss_chunk_size = 8
    torch.manual_seed(1)
    model(**batch, return_logits=False).loss.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    hooks = activation_offload(torch.device("cpu"), True, force=True)
    with hooks:
        loss = model(**batch, return_logits=False).loss
    loss.backward()
    assert isinstance(hooks, OffloadActivations) and hooks.copies > 0 and hooks.kept > 0
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, want[n]), n
    # on a CPU device it is a no-op; where memory cannot be pinned: one warning, then unpinned copies
    assert not isinstance(activation_offload(torch.device("cpu"), True), OffloadActivations)
    import tformer.parallel.offload as offload

    offload._warned.clear()
    with caplog.at_level("WARNING"):
        first = activation_offload(torch.device("cuda"), True)
        activation_offload(torch.device("cuda"), True)
    if not offload.can_pin_memory():
        assert isinstance(first, OffloadActivations)
        assert sum("cannot pin host memory" in r.message for r in caplog.records) == 1


# -- the FFN's activations rebuilt in backward ---------------------------------------------------


def _step_with_rebuild(name, rebuild, ac, autocast, offload=False):
    """Loss, gradients and saved bytes of one step with the FFNs' rebuild on or off."""
    from tformer.parallel.ac import apply_activation_checkpointing
    from tformer.parallel.memory import SavedActivations
    from tformer.parallel.offload import activation_offload

    torch.manual_seed(0)
    model = build_model(name, dropout=0.1).train()
    for ffn in (m for m in model.modules() if hasattr(m, "rebuild")):
        ffn.rebuild = rebuild and ffn.rebuild
    apply_activation_checkpointing(model, ac)
    batch = _batch(model, 1, False)
    torch.manual_seed(1)  # the same dropout masks
    saved = SavedActivations()  # (the innermost saved-tensor hooks see the saved tensors: one at a time)
    hooks = activation_offload(torch.device("cpu"), True, force=True) if offload else saved
    with hooks, torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        loss = model(**batch, return_logits=False).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, saved.bytes, model


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize(
    "ac,autocast,offload",
    [("none", False, False), ("none", True, False), ("full", False, False), ("op", True, False), ("none", False, True)],
)
def test_ffn_rebuilds_its_activation_in_backward_with_the_same_gradients(name, ac, autocast, offload):
    """The FFN keeps the activation's input (and a gated unit's gate and up projections) and
    rebuilds the activation's output and the gated product in backward: loss and every gradient
    bit for bit those of keeping them (fp32 and bf16 autocast, dropout on, under full and op-level
    checkpointing and CPU offload); without checkpointing the saved bytes fall by exactly those
    tensors (ReLU keeps its output: nothing to rebuild)."""
    want_loss, want, kept, model = _step_with_rebuild(name, False, ac, autocast, offload)
    loss, got, rebuilt, _ = _step_with_rebuild(name, True, ac, autocast, offload)
    assert torch.equal(loss, want_loss)
    for n, g in got.items():
        assert torch.equal(g, want[n]), n
    if ac == "none" and not offload and not model.config.moe.enabled:  # dense FFNs: d_ff wide
        cfg = model.config  # _batch: 2 x 12 tokens (encoder-decoder: 2 x 7 target tokens)
        block_tokens = cfg.num_layers * 2 * 12 + (cfg.decoder_layers * 2 * 7 if cfg.family == "encdec" else 0)
        kept_per_unit = {"relu": 0, "swiglu": 2, "geglu": 2, "geglu_exact": 2}.get(cfg.activation, 1)
        per_token = kept_per_unit * cfg.d_ff * (2 if autocast else 4)
        assert kept - rebuilt == block_tokens * per_token, (kept, rebuilt)


# -- op-level checkpointing under FSDP2 on 2 ranks ---------------------------------------------


def _fsdp_worker(rank, port, out):
    import datetime

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from tformer.parallel.ac import MATMUL_OPS, apply_activation_checkpointing

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120)
    )
    try:
        results = {}
        for name in ("bert-tiny", "gpt2-tiny", "t5-tiny"):
            torch.manual_seed(0)  # the same full model on both ranks before sharding
            model = build_model(name, dropout=0.1).train()
            for block in (m for m in model.modules() if m.__class__.__name__ == "TransformerBlock"):
                fully_shard(block)
            fully_shard(model)
            batch = _batch(model, 10 + rank, False)  # each rank its own data
            grads, ops = {}, {}
            for mode in ("none", "op"):
                apply_activation_checkpointing(model, mode)
                g, ops[mode] = _backward_ops(model, batch, seed=rank)
                grads[mode] = {n: t.full_tensor() for n, t in g.items()}
            err = max(
                ((grads["op"][n] - grads["none"][n]).norm() / grads["none"][n].norm().clamp(min=1e-3)).item()
                for n in grads["none"]
            )
            recomputed = ops["op"] - ops["none"]
            results[name] = (
                err,
                sorted(str(op) for op in recomputed),
                sorted(str(op) for op in set(recomputed) & MATMUL_OPS),
            )
        torch.save(results, f"{out}/rank{rank}.pt")
    finally:
        dist.barrier()
        dist.destroy_process_group()


def test_op_checkpointing_under_fsdp2_on_two_ranks(tmp_path):
    """Each family sharded per block and at the root on 2 gloo ranks, dropout on: op-level
    checkpointing gives the same (all-reduced) gradients and recomputes norms and dropouts, but no
    matmul, while FSDP2 gathers and frees the parameters around it."""
    from train_helpers import free_port, spawn_ranks

    spawn_ranks(_fsdp_worker, (free_port(), str(tmp_path)), 2, timeout=600)
    for rank in (0, 1):
        for name, (err, recomputed, matmuls) in torch.load(tmp_path / f"rank{rank}.pt").items():
            assert err <= 1e-6, (rank, name, err)
            assert not matmuls, (rank, name, matmuls)
            assert "aten.bernoulli_.float" in recomputed, (rank, name)
            assert {"aten.native_layer_norm.default", "aten.rsqrt.default"} & set(recomputed), (rank, name)
