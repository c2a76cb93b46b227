"""Host time: what the CPU spends issuing a step's operations, which no FLOP or byte term sees.

Every aten operation costs the host a fixed time before any arithmetic (Python, the dispatcher,
autograd's bookkeeping, the allocator, a kernel launch on a GPU): ``Hardware.op_overhead``. An
operation on a DTensor costs more (sharding propagation in Python): ``dtensor_op_overhead`` on top
in the model under TP, ``dtensor_optimizer_overhead`` in the optimizer. FSDP2 costs each sharded
module per micro-batch its hooks (pre/post-forward, pre/post-backward: gathering, copy-in and
copy-out, resharding, the reduce-scatter's launch and the gradient's DTensor):
``fsdp_unit_overhead``, or ``fsdp_local_overhead`` over a 1-rank group. On the CPU these are
measured by ``tformer plan --calibrate``; the GPU profiles state orders of magnitude (hardware.py).

The operations are counted, not estimated: ``op_counts`` runs the model itself, shrunk to tiny
widths (same families, blocks, norms, activation, positions, experts), once with one and once with
two blocks per stack, forward, loss and backward under a ``TorchDispatchMode`` that counts every
aten op; the difference is one block's, the rest the embedding's, head's and loss's. Under tensor
parallelism the ops of the modules tformer's TP plan parallelizes (``parallel.tp.tp_plan``), and
with loss parallelism the loss after the head, run on DTensors: they are counted apart, forward by
module hooks and backward by the autograd nodes those forwards made (their sequence numbers). The
optimizer's ops are counted by running torch's AdamW the way the trainer builds it (fused, for
every layout), with
the gradient norm and clip of ``parallel.tp.grad_norm_and_clip``. The counts are cached per model
structure (a few tens of milliseconds each, once).

An MoE model's blocks are all counted as MoE blocks (an upper bound for its dense ones). Under the
counts, only op kinds: a view costs what a small add costs (an upper bound: views skip
the allocator). The chunked loss (``loss.chunk_size``) runs its few ops once per chunk; the count
is of the unchunked loss.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from ..config import ModelConfig
from ..models.spec import spec_of

SHRUNK_HEAD_DIM = 4
SHRUNK_TOKENS = (2, 8)  # batch, sequence of the counting run (op counts do not depend on sizes)


@dataclass(frozen=True)
class OpCounts:
    """aten ops of one micro-batch's forward + backward, and parameter tensors, of one model."""

    blocks: tuple[int, int]  # ops of one block of each stack (encoder-decoder: encoder, decoder)
    forward: tuple[int, int]  # of them, the forward's (what a recomputed forward runs again)
    rest: int  # embedding, final norms, head and loss
    tp_blocks: tuple[int, int]  # of ``blocks``, those on DTensors under tensor parallelism
    tp_rest: int  # of ``rest``, those on DTensors under tensor parallelism (with loss parallelism)
    block_params: tuple[int, int]  # parameter tensors of one block of each stack
    rest_params: int


@dataclass(frozen=True)
class OptimizerOps:
    """aten ops of one optimizer step (clip + AdamW + zeroing): ``fixed`` + ``per_param`` x tensors."""

    fixed: float
    per_param: float

    def ops(self, params: int) -> float:
        return self.fixed + self.per_param * params


def _shrunk(cfg: ModelConfig, first: int, second: int) -> ModelConfig:
    """``cfg``'s structure at tiny widths with ``first`` (and ``second``) blocks per stack."""
    heads, kv = cfg.num_heads, cfg.kv_heads
    moe = cfg.moe
    if moe.enabled:
        moe = dataclasses.replace(
            moe, d_expert=8 if moe.d_expert else None, d_shared=8 if moe.d_shared else None, moe_every=1
        )
    return cfg.replace(
        d_model=heads * SHRUNK_HEAD_DIM,
        d_head=SHRUNK_HEAD_DIM,
        num_kv_heads=kv,
        d_ff=8,
        vocab_size=64,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
        decoder_start_token_id=0,
        pad_vocab_multiple=1,
        max_seq_len=max(SHRUNK_TOKENS[1], 8),
        num_layers=first,
        num_decoder_layers=second if spec_of(cfg).seq2seq else None,
        moe=moe,
    )


def _counting_mode():
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        """Counts aten ops; those in ``marked`` forward modules or made by their backward nodes apart."""

        def __init__(self):
            super().__init__()
            self.total = self.dtensor = 0
            self.inside = 0  # depth of marked modules being run forward
            self.ranges: list[tuple[int, int]] = []  # autograd sequence numbers the marked forwards made

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.total += 1
            node = torch._C._current_autograd_node()
            if self.inside or (node is not None and self._marked(node._sequence_nr())):
                self.dtensor += 1
            return func(*args, **(kwargs or {}))

        def _marked(self, seq: int) -> bool:
            return any(lo < seq <= hi for lo, hi in self.ranges)

    return Count()


def _sequence_now() -> int:
    """The autograd sequence number the next node gets, less one."""
    import torch

    with torch.enable_grad():
        node = (torch.zeros((), requires_grad=True) * 1).grad_fn
        assert node is not None  # a product of a leaf that requires grad has a node
        return int(node._sequence_nr())


def _mark(model, names: set[str], tail: str | None, mode) -> list:
    """Hooks that count the ops of the modules ``names`` (forward and the nodes they make) apart,
    and everything after module ``tail`` (the loss on vocabulary-sharded logits)."""
    handles = []
    for name, module in model.named_modules():
        if name not in names:
            continue

        def pre(_m, _args, mode=mode):
            mode.inside += 1
            mode.ranges.append((_sequence_now(), 1 << 62))

        def post(_m, _args, _out, mode=mode, name=name):
            mode.inside -= 1
            lo, _ = mode.ranges.pop()
            if name == tail:
                mode.inside += 1  # until the forward returns
                mode.ranges.append((lo, 1 << 62))
                return
            mode.ranges.append((lo, _sequence_now()))

        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    return handles


def _run(cfg: ModelConfig, tp: bool) -> tuple[int, int, int, int]:
    """(ops, DTensor ops under TP, parameter tensors, forward ops) of one forward + loss + backward
    of ``cfg``."""
    import torch

    from ..parallel.tp import tp_plan

    torch.manual_seed(0)
    model = spec_of(cfg).build(cfg)
    batch, seq = SHRUNK_TOKENS
    ids = torch.randint(1, cfg.vocab_size, (batch, seq))
    kwargs = {"labels": ids.clone(), "return_logits": False}
    mode = _counting_mode()
    handles = _mark(model, set(tp_plan(model, False, True)), "lm_head", mode) if tp else []
    try:
        with mode:
            out = model(ids, **kwargs)
            forward = mode.total
            mode.inside = 0  # the forward has returned
            mode.ranges = [(lo, _sequence_now() if hi == 1 << 62 else hi) for lo, hi in mode.ranges]
            out.loss.backward()
    finally:
        for h in handles:
            h.remove()
    return mode.total, mode.dtensor, sum(1 for _ in model.parameters()), forward


_COUNTED: dict[str, OpCounts] = {}


def op_counts(cfg: ModelConfig) -> OpCounts:
    """The ops of ``cfg``'s blocks and the rest, counted on the shrunk model (module doc); once per
    structure (the widths do not change the counts, so the shrunk config is the key)."""
    key = repr(_shrunk(cfg, 1, 1))
    if key not in _COUNTED:
        _COUNTED[key] = _count(cfg)
    return _COUNTED[key]


def _count(cfg: ModelConfig) -> OpCounts:
    seq2seq = spec_of(cfg).seq2seq
    base = [_run(_shrunk(cfg, 1, 1), tp) for tp in (False, True)]
    first = [_run(_shrunk(cfg, 2, 1), tp) for tp in (False, True)]
    second = [_run(_shrunk(cfg, 1, 2), tp) for tp in (False, True)] if seq2seq else base

    def per_block(more):
        return (more[0][0] - base[0][0], more[1][1] - base[1][1], more[0][2] - base[0][2], more[0][3] - base[0][3])

    a, b = per_block(first), per_block(second)
    if not seq2seq:
        b = (0, 0, 0, 0)
    return OpCounts(
        blocks=(a[0], b[0]),
        forward=(a[3], b[3]),
        rest=base[0][0] - a[0] - b[0],
        tp_blocks=(a[1], b[1]),
        tp_rest=base[1][1] - a[1] - b[1],
        block_params=(a[2], b[2]),
        rest_params=base[0][2] - a[2] - b[2],
    )


@functools.lru_cache(maxsize=8)
def optimizer_ops(kind: str) -> OptimizerOps:
    """aten ops of the trainer's optimizer step: AdamW ``kind`` (fused | foreach | loop) over two
    parameter groups (decay, no decay), the gradient norm and clip, zeroing; counted on 8 and 16
    parameter tensors."""
    import torch

    from ..parallel.tp import grad_norm_and_clip

    counts = []
    for n in (8, 16):
        params = [torch.nn.Parameter(torch.ones(4, 4) if i % 2 else torch.ones(4)) for i in range(n)]
        for p in params:
            p.grad = torch.ones_like(p)
        groups = [{"params": params[1::2], "weight_decay": 0.1}, {"params": params[::2], "weight_decay": 0.0}]
        opt = torch.optim.AdamW(groups, lr=1e-3, fused=kind == "fused" or None, foreach=kind == "foreach")
        opt.step()  # the state exists from the first step on
        mode = _counting_mode()
        with mode:
            grad_norm_and_clip(((str(i), p) for i, p in enumerate(params)), 1e-6)
            opt.step()
            opt.zero_grad(set_to_none=True)
        counts.append(mode.total)
    per_param = (counts[1] - counts[0]) / 8
    return OptimizerOps(counts[0] - 8 * per_param, per_param)
