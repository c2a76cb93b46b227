"""Tensor parallelism (+ sequence parallelism, + loss parallelism) for all three families, applied
from outside the model with torch's ``parallelize_module`` (Megatron-LM's layout, torch-native).

With degree ``t`` on the mesh's ``tp`` dimension:

- attention (self and cross): q/k/v column-wise, so each rank computes ``num_heads / t`` query heads
  and ``num_kv_heads / t`` key/value heads (a GQA group never straddles ranks: rank r's query heads
  use exactly rank r's KV heads); the output projection row-wise, its partial sums reduced;
- FFN: up (and gate) column-wise, down row-wise, for every activation;
- token embedding vocabulary-parallel (row-wise: each rank looks up its vocabulary slice, the
  partial embeddings are summed), the LM / MLM head column-wise over the vocabulary; tied weights
  stay one tensor (both layouts split the vocabulary rows the same way);
- T5's relative-position bias table is split by head (column-wise over its ``num_heads`` columns):
  each rank needs only its heads' biases, and the table's gradient stays with its heads, so nothing
  is communicated for it;
- loss parallel (``parallel.loss_parallel``, on by default): the head's logits stay
  vocabulary-sharded and torch's ``loss_parallel`` computes the cross-entropy over them (a max and a
  sum all-reduced per token) without ever gathering the (tokens x vocabulary) tensor; padded
  vocabulary columns are masked out and label smoothing's uniform term is summed over the real
  columns, so the loss is the unsharded one;
- sequence parallel (``parallel.sp``): between blocks the residual stream is split along the
  sequence: norms, dropout and residual adds run on ``S / t`` positions per rank; each attention /
  FFN all-gathers its input once and reduce-scatters its output (in place of the all-reduce).
  Each stack's first block takes the full sequence and keeps its slice, its last block gathers
  the sequence again, so embeddings, final norms, heads and cross-attention memories see whole
  sequences. Sequence lengths must then be multiples of ``t``: the model's ``sequence_multiple``
  says so, and training, evaluation and decoding pad with ``models.padding.pad_sequences``.
  Backward keeps each gathered input as this rank's sequence shard and all-gathers it again when
  the projections' weight gradients need it (``KeepSequenceShard``, Megatron-LM's way): torch's
  sequence parallel alone would keep the whole gathered input of every sub-layer on every rank.

What stays replicated on every TP rank: norms, sandwich norms (Gemma) included (their gradients
are summed over the sequence shards under SP; QK-norm's gains over the ranks' heads, always; the
attention sinks are split with their heads), position and token-type embeddings, BERT's MLM
transform, the biases of row-wise projections, and mixture-of-experts FFNs (router,
experts, shared experts; ``nn/moe.py``): each TP rank runs the whole MoE FFN on the whole sequence
(under SP its input is gathered before it and its output cut back to the rank's slice after it), so
routing, capacity groups and auxiliary losses are the unsplit model's, and its plain parameters get
the same gradient on every TP rank. Splitting the experts is expert parallelism's job (``ep.py``:
its groups are ranks with the same TP index).

Model files never import ``torch.distributed``: this module sets the attention modules' local head
counts and the model's ``sharded_loss``/``gather_logits`` hooks from outside.

Order of application (``Strategy.__init__``): TP (+SP) -> activation checkpointing -> per-block
compile -> FSDP2 (HSDP) or nothing, as torchtitan's ``parallelize_llama`` does.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any

import torch
import torch.nn.functional as F

from ..config import ConfigError, ModelConfig
from ..models import spec_of
from ..models.loss import loss_divisor
from ..nn import MultiHeadAttention, TransformerBlock, TransformerStack
from ..nn.latent import LatentAttention
from ..nn.moe import MoEFeedForward
from .memory import local_part


def check_tp(cfg: ModelConfig, tp: int, sp: bool = False) -> None:
    """One line for each model shape that ``tp`` ranks cannot split evenly."""
    if tp == 1:
        return
    for name, value, fix in (
        ("model.num_heads", cfg.num_heads, "a tp that divides the head count"),
        ("model.num_kv_heads", cfg.kv_heads, "a tp that divides the KV head count (a GQA group cannot straddle ranks)"),
        ("model.d_ff", cfg.d_ff, "a tp that divides the FFN width"),
    ):
        if value % tp:
            raise ConfigError(f"parallel.tp={tp} does not divide {name}={value}; use {fix}")


def pad_vocab_for_tp(cfg: ModelConfig, tp: int) -> ModelConfig:
    """``cfg`` with its vocabulary rows padded to a multiple of ``tp`` as well (Megatron pads the
    same way), so every rank holds an equal slice of the embedding and the head whatever the
    tokenizer's size. The padding rows are never predicted (the logits are sliced, the vocabulary-
    parallel loss masks them) and export drops them; the run's config and checkpoints record the
    resulting ``pad_vocab_multiple``."""
    if cfg.padded_vocab_size % tp == 0:
        return cfg
    return cfg.replace(pad_vocab_multiple=math.lcm(cfg.pad_vocab_multiple, tp))


def _stacks(model):
    return [(name, m) for name, m in model.named_modules() if isinstance(m, TransformerStack)]


def head_split():
    """The style of a per-head parameter module (``nn.attention.HeadLogits``, the attention sinks):
    its parameter split along the heads as q_proj's rows are (Shard(0)), and its output handed to
    the attention as this rank's part, a plain tensor; the gradient goes back to the rank's rows."""
    from torch.distributed.tensor import Shard, distribute_module, distribute_tensor
    from torch.distributed.tensor.parallel.style import ParallelStyle

    class _HeadSplit(ParallelStyle):
        def _apply(self, module, device_mesh):
            def split(name, mod, mesh):
                for key, param in list(mod.named_parameters(recurse=False)):
                    mod.register_parameter(key, torch.nn.Parameter(distribute_tensor(param, mesh, [Shard(0)])))

            return distribute_module(module, device_mesh, split, output_fn=lambda mod, out, mesh: out.to_local())

    return _HeadSplit()


def tp_plan(model, sp: bool, loss_parallel: bool) -> dict:
    """The ``parallelize_module`` plan: module path -> ParallelStyle."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleInputOutput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    between = Shard(1) if sp else Replicate()  # the residual stream's layout between sub-layers
    plan: dict = {}
    if getattr(model, "embed", None) is not None:  # (a pipeline stage may hold neither of these)
        plan["embed.tok"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if getattr(model, "encoder_embed", None) is not None:  # an encoder's own token embedding (T5Gemma)
        plan["encoder_embed.tok"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if getattr(model, "lm_head", None) is not None and loss_parallel:
        plan["lm_head"] = ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1), use_local_output=False)
    elif getattr(model, "lm_head", None) is not None:
        plan["lm_head"] = ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    for stack_name, stack in _stacks(model):
        if stack.rel_bias is not None:  # (buckets, heads) table: split by head
            plan[f"{stack_name}.rel_bias.embedding"] = ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1))
        owned = [i for i, block in enumerate(stack.layers) if isinstance(block, TransformerBlock)]
        first, last = owned[0], owned[-1]  # this stack's first and last block (of this pipeline stage)
        for i in owned:
            block = stack.layers[i]
            p = f"{stack_name}.layers.{i}"
            for attn in ("attn", "cross_attn") if block.cross_attn is not None else ("attn",):
                for proj in _column_projections(getattr(block, attn)):
                    plan[f"{p}.{attn}.{proj}"] = ColwiseParallel()
                plan[f"{p}.{attn}.o_proj"] = RowwiseParallel(output_layouts=between)
                module = getattr(block, attn)
                if not isinstance(module, MultiHeadAttention):  # latent attention: its norms are the latents'
                    continue
                if module.sinks is not None:  # one logit per query head: split with them
                    plan[f"{p}.{attn}.sinks"] = head_split()
                for norm in ("q_norm", "k_norm"):  # QK-norm: its gain whole on every rank, its input
                    # (B, heads, S, d) split by head; the gain's gradient summed over the ranks' heads
                    if getattr(module, norm) is not None:
                        plan[f"{p}.{attn}.{norm}"] = SequenceParallel(sequence_dim=1, use_local_output=True)
            moe = isinstance(block.ffn, MoEFeedForward)
            if not moe:
                for proj in ("up", "gate") if block.ffn.gated else ("up",):
                    plan[f"{p}.ffn.{proj}"] = ColwiseParallel()
                plan[f"{p}.ffn.down"] = RowwiseParallel(output_layouts=between)
            if not sp:
                continue  # an MoE FFN gets the whole (replicated) stream as a plain tensor already
            # sandwich norms (Gemma) act on a sub-layer's output, which the row-wise projection
            # reduce-scattered to this rank's positions: sharded on the sequence like the others
            for norm in ("attn_norm", "cross_norm", "ffn_norm", "attn_post_norm", "cross_post_norm", "ffn_post_norm"):
                if getattr(block, norm) is not None:
                    plan[f"{p}.{norm}"] = SequenceParallel(use_local_output=True)
            # each sub-layer gathers its (sequence-sharded) query stream once; memory is whole
            plan[f"{p}.attn"] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
            )
            if block.cross_attn is not None:
                plan[f"{p}.cross_attn"] = PrepareModuleInput(
                    input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None), use_local_output=True
                )
            if moe:  # replicated: the whole sequence in, this rank's slice of the output back
                plan[f"{p}.ffn"] = PrepareModuleInputOutput(
                    input_layouts=(Shard(1),),
                    desired_input_layouts=(Replicate(),),
                    use_local_input=True,
                    output_layouts=Replicate(),
                    desired_output_layouts=Shard(1),
                    use_local_output=True,
                )
            else:
                plan[f"{p}.ffn"] = PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
                )
            # stack boundaries: the first block keeps its slice of the sequence (no communication),
            # the last one gathers it (block inputs: x, padding_mask)
            if i == first and i == last:
                plan[p] = PrepareModuleInputOutput(
                    input_layouts=(Replicate(), None),
                    desired_input_layouts=(Shard(1), None),
                    use_local_input=True,
                    output_layouts=Shard(1),
                    desired_output_layouts=Replicate(),
                    use_local_output=True,
                )
            elif i == first:
                plan[p] = PrepareModuleInput(
                    input_layouts=(Replicate(), None), desired_input_layouts=(Shard(1), None), use_local_output=True
                )
            elif i == last:
                plan[p] = PrepareModuleOutput(
                    output_layouts=Shard(1), desired_output_layouts=Replicate(), use_local_output=True
                )
    return plan


def _column_projections(attn) -> tuple[str, ...]:
    """An attention module's column-wise projections: MHA's q/k/v; MLA's up projections (whole heads
    per rank), its latent down projections and their norms staying replicated (every rank needs the
    whole latent)."""
    if isinstance(attn, LatentAttention):
        return ("q_proj" if attn.q_proj is not None else "q_up", "kv_up")
    return ("q_proj", "k_proj", "v_proj")


def _sum_grad_over(mesh):
    """Identity whose backward sums the gradient over ``mesh`` (MLA's rotary key, see nn/latent.py)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    def shared(t: torch.Tensor) -> torch.Tensor:
        return DTensor.from_local(t, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])

    return shared


def apply_tensor_parallel(model, mesh, sp: bool = False, loss_parallel: bool = True) -> None:
    """Split ``model`` over the 1-D ``mesh`` (the run mesh's ``tp`` dimension) in place."""
    from torch.distributed.tensor.parallel import parallelize_module

    tp = mesh.size()
    cfg = model.config
    check_tp(cfg, tp, sp)
    plan = spec_of(cfg).tp_plan or tp_plan  # a flavour with its own layout says so in its spec
    parallelize_module(model, mesh, plan(model, sp, loss_parallel))
    if sp:
        keep_gathered_inputs_sharded(model, mesh)
    if cfg.tie_embeddings and getattr(model, "embed", None) is not None and getattr(model, "lm_head", None) is not None:
        model.lm_head.weight = model.embed.tok.weight  # both layouts split the vocabulary rows: one tensor
    for m in model.modules():
        if isinstance(m, MultiHeadAttention):  # this rank's heads
            m.num_heads //= tp
            m.num_kv_heads //= tp
        if isinstance(m, LatentAttention):
            m.num_heads //= tp
            m.shared_key_grad = _sum_grad_over(mesh)
    model.loss_chunk_size = None  # the sharded logits are already 1/tp of the vocabulary
    if sp:  # what callers pad every sequence to (training, evaluation, decoding: pad_sequences)
        model.sequence_multiple = tp
    if loss_parallel:
        model.sharded_loss = functools.partial(vocab_parallel_loss, mesh=mesh)
        model.gather_logits = _full
    model.tp_mesh = mesh


class KeepSequenceShard(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks around one sequence-parallel sub-layer call (attention, cross-attention's
    query stream, FFN), entered after its input was all-gathered.

    Autograd saves the gathered (whole-sequence) input for the weight gradients of the column-wise
    projections that read it (q/k/v, up/gate): d values per token on every rank, twice per block,
    as much as all the sequence-sharded norms and residuals together. Each saved tensor that lives
    in the gathered input's storage is stored instead as this rank's shard of it, which the caller
    had before the gather; backward all-gathers the shard again the first time one of them is
    needed and keeps that copy until the last one is unpacked (q, k and v share one gather). The
    forward and every gradient are unchanged: an all-gather is exact. The cost is one all-gather
    per sub-layer in backward (Korthikanti et al., 2022, do the same in Megatron-LM).

    Every other saved tensor, and the shard itself, goes through the hooks active outside
    (activation offload, a memory count) as if these hooks were not there."""

    def __init__(self, shard: torch.Tensor, gathered: torch.Tensor, mesh):
        self.shard: Any = shard
        self.mesh = mesh
        self.ptr = _storage_ptr(local_part(gathered))
        self.packed_shard: Any = None  # the shard as the outer hooks packed it (once)
        self.whole = None  # the input gathered again, from the first unpack to the last
        self.pending = 0
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        self.outer_pack: Any
        self.outer_unpack: Any
        self.outer_pack, self.outer_unpack = outer if outer is not None else (None, None)
        super().__init__(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor):
        local = local_part(t)
        if self.ptr is None or _storage_ptr(local) != self.ptr:
            return False, self.outer_pack(t) if self.outer_pack else t
        if self.packed_shard is None:
            self.packed_shard = self.outer_pack(self.shard) if self.outer_pack else self.shard
            self.shard = None
        self.pending += 1
        spec = getattr(t, "_spec", None)  # a DTensor (the projection's replicated input): rebuild it
        return True, (spec, local.size(), local.stride(), local.storage_offset(), t.requires_grad)

    def _unpack(self, packed):
        from_shard, data = packed
        if not from_shard:
            return self.outer_unpack(data) if self.outer_unpack else data
        whole = self.whole
        if whole is None:
            shard = self.outer_unpack(self.packed_shard) if self.outer_unpack else self.packed_shard
            with torch.no_grad():
                whole = _gather_sequence(shard, self.mesh)
            self.whole = whole
        self.pending -= 1
        if self.pending <= 0:
            self.whole = None
        spec, size, stride, offset, requires_grad = data
        local = whole.as_strided(size, stride, offset)
        if spec is None:
            return local
        from torch.distributed.tensor import DTensor

        return DTensor(local, spec, requires_grad=requires_grad)


def _storage_ptr(t: torch.Tensor) -> int | None:
    if t.device.type == "meta":
        return None
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor without one storage of its own
        return None


def _gather_sequence(shard: torch.Tensor, mesh) -> torch.Tensor:
    """The sequence-sharded (dim 1) local tensor gathered whole, by the ops ``PrepareModuleInput``
    uses in forward (so the result has the forward's layout)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    whole = DTensor.from_local(shard, mesh, [Shard(1)], run_check=False).redistribute(mesh, [Replicate()])
    return whole.to_local().contiguous()


class _ShardedSaves:
    """The hooks of one sequence-parallel sub-layer module that enter ``KeepSequenceShard`` around
    its forward: one forward pre-hook before the gather (it sees the shard), one after it (the
    gathered input), a forward hook that leaves. Blocks that activation checkpointing recomputes
    are left alone (full: backward keeps only the block input; op: its policy already recomputes
    the gather), and so is a compiled block (the compiler's partitioner chooses what it keeps)."""

    def __init__(self, module, stack, index: int, mesh):
        self.stack, self.index, self.block, self.mesh = stack, index, stack.layers[index], mesh
        self.shard = None
        self.active: list = []
        module.register_forward_pre_hook(self.before_gather, prepend=True)
        module.register_forward_pre_hook(self.after_gather)
        module.register_forward_hook(self.after, always_call=True)

    def _wanted(self) -> bool:
        return (
            torch.is_grad_enabled() and self.index not in self.stack.checkpointed and self.block.checkpoint_context is None
        )

    def before_gather(self, module, args):
        if not torch.compiler.is_compiling() and self._wanted():
            self.shard = args[0]

    def after_gather(self, module, args):
        if self.shard is None or torch.compiler.is_compiling():
            return
        hooks = KeepSequenceShard(self.shard, args[0], self.mesh)
        self.shard = None
        hooks.__enter__()
        self.active.append(hooks)

    def after(self, module, args, output):
        if self.active and not torch.compiler.is_compiling():
            self.active.pop().__exit__(None, None, None)


def keep_gathered_inputs_sharded(model, mesh) -> int:
    """``KeepSequenceShard`` on every sequence-parallel sub-layer of ``model`` (after
    ``parallelize_module`` installed their gathers); returns how many."""
    count = 0
    for _, stack in _stacks(model):
        for i, block in enumerate(stack.layers):
            if not isinstance(block, TransformerBlock):
                continue
            for name in ("attn", "cross_attn", "ffn"):
                module = getattr(block, name)
                if module is not None:
                    _ShardedSaves(module, stack, i, mesh)
                    count += 1
    return count


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def loss_context(enabled: bool):
    """torch's ``loss_parallel`` (forward and backward of the sharded cross-entropy run inside it)."""
    if not enabled:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def vocab_parallel_loss(
    logits, labels: torch.Tensor, vocab_size: int, label_smoothing: float = 0.0, loss_tokens=None, *, mesh
):
    """Mean cross-entropy over labelled positions of vocabulary-sharded logits (a DTensor sharded on
    its last dim), under ``loss_parallel``: the same value and gradients as ``lm_loss`` on the
    gathered logits sliced to ``vocab_size``.

    torch's loss parallel covers log-softmax + NLL only (its log-softmax backward is fused into
    NLL's), so label smoothing is written without a second log-softmax use:
    ``(1 - e) nll + e (lse - mean z) = nll + e (z_target - mean z)``, a linear term whose pieces
    are per-shard sums added over the ranks. ``loss_tokens`` divides the sums in place of the count of
    labelled positions (``models/base.lm_loss``)."""
    from torch.distributed.tensor import DTensor, Partial, Shard

    padded = logits.shape[-1]
    logits = logits.float().reshape(-1, padded)
    labels = labels.reshape(-1)
    width = padded // mesh.size()
    first = mesh.get_local_rank() * width  # this rank's vocabulary columns: [first, first + width)
    real = torch.arange(first, first + width, device=labels.device) < vocab_size
    masked = logits
    if padded != vocab_size:  # padded columns never win probability mass
        masked = logits + DTensor.from_local((~real).float() * -1e30, mesh, [Shard(0)], run_check=False)
    valid = (labels != -100).float()
    count = loss_divisor(valid, loss_tokens)
    loss = F.nll_loss(F.log_softmax(masked, dim=-1), labels, ignore_index=-100, reduction="sum")
    loss = (loss.full_tensor() if isinstance(loss, DTensor) else loss) / count
    if not label_smoothing:
        return loss
    local = logits.to_local()
    mine = (labels >= first) & (labels < first + width)
    picked = local.gather(-1, (labels - first).clamp(0, width - 1)[:, None]).squeeze(-1) * mine
    row_sum = (local * real).sum(-1)

    def summed(t):  # the sum over the tp ranks of each rank's part
        return DTensor.from_local(t, mesh, [Partial()], run_check=False).full_tensor()

    extra = ((summed(picked) - summed(row_sum) / vocab_size) * valid).sum() / count
    return loss + label_smoothing * extra


def grad_norm_and_clip(named_params, max_norm: float, group=None, skip=frozenset()) -> torch.Tensor:
    """The global L2 norm of the gradients of ``named_params`` (plain tensors, TP DTensors, FSDP2
    DTensors, mixed: grouped by mesh and placements, each group reduced over its own shards), clipped
    to ``max_norm`` when it is > 0, as ``torch.nn.utils.clip_grad_norm_`` does. ``group``: the
    squares are also summed over that process group (pipeline stages, each with its own parameters);
    names in ``skip`` are clipped but counted by another stage (a weight two stages share)."""
    from .dist import all_reduce

    groups: dict = {}
    counted: dict = {}
    for name, p in named_params:
        g = p.grad
        if g is None:
            continue
        if hasattr(g, "placements") and any(pl.is_partial() for pl in g.placements):
            # a replicated parameter used on sequence shards (norms under SP) gets a Partial
            # gradient: sum it now, once, so the norm and the optimizer see the reduced values
            # (torch 2.11's DTensor ops do not always reduce it first; 2.13 gives the same values)
            from torch.distributed.tensor import Replicate

            g = p.grad = g.redistribute(g.device_mesh, [Replicate() if pl.is_partial() else pl for pl in g.placements])
        key = (g.device_mesh, tuple(g.placements)) if hasattr(g, "device_mesh") else None
        groups.setdefault(key, []).append(g)
        if name not in skip:
            counted.setdefault(key, []).append(g)
    device = next((g.device for grads in groups.values() for g in grads), torch.device("cpu"))
    # summed on the device: the norm is read once, by the trainer, with the step's other figures
    total_sq = torch.zeros((), dtype=torch.float64, device=device)
    for grads in counted.values():
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        total_sq += norm.double().to(device) ** 2
    if group is not None:
        all_reduce(total_sq, group=group)
    total = total_sq.sqrt()
    if max_norm > 0 and max_norm != float("inf"):
        # as torch.nn.utils.clip_grad_norm_: the coefficient clamped to 1 on the device, no read
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for grads in groups.values():
            # DTensors: their local shards scaled in place (the placements are Shard / Replicate here)
            local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
            torch._foreach_mul_(local, coef.to(local[0].dtype))
    return total
