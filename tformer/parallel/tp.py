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
  sequences. Sequence lengths must then be multiples of ``t`` (the trainer pads batches).

What stays replicated on every TP rank: norms (their gradients are summed over the sequence shards
under SP), position and token-type embeddings, BERT's MLM transform, and the biases of row-wise
projections. Model files never import ``torch.distributed``: this module sets the attention
modules' local head counts and the model's ``sharded_loss``/``gather_logits`` hooks from outside.

Order of application (``Strategy.__init__``): TP (+SP) -> activation checkpointing -> per-block
compile -> FSDP2 (HSDP) or nothing, as torchtitan's ``parallelize_llama`` does.
"""
from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F

from ..config import ConfigError, ModelConfig
from ..nn import MultiHeadAttention, TransformerBlock, TransformerStack


def check_tp(cfg: ModelConfig, tp: int, sp: bool = False) -> None:
    """One line for each model shape that ``tp`` ranks cannot split evenly."""
    if tp == 1:
        return
    for name, value, fix in (
            ("model.num_heads", cfg.num_heads, "a tp that divides the head count"),
            ("model.num_kv_heads", cfg.kv_heads, "a tp that divides the KV head count (a GQA group cannot "
                                                 "straddle ranks)"),
            ("model.d_ff", cfg.d_ff, "a tp that divides the FFN width")):
        if value % tp:
            raise ConfigError(f"parallel.tp={tp} does not divide {name}={value}; use {fix}")
    if cfg.padded_vocab_size % tp:
        raise ConfigError(f"parallel.tp={tp} does not divide the vocabulary (model.vocab_size={cfg.vocab_size}, "
                          f"padded to {cfg.padded_vocab_size}); set model.pad_vocab_multiple={64 * tp} to pad "
                          "the embedding rows to a multiple of tp")


def _stacks(model):
    return [(name, m) for name, m in model.named_modules() if isinstance(m, TransformerStack)]


def tp_plan(model, sp: bool, loss_parallel: bool) -> dict:
    """The ``parallelize_module`` plan: module path -> ParallelStyle."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   PrepareModuleInputOutput, PrepareModuleOutput,
                                                   RowwiseParallel, SequenceParallel)

    between = Shard(1) if sp else Replicate()  # the residual stream's layout between sub-layers
    plan: dict = {}
    if getattr(model, "embed", None) is not None:  # (a pipeline stage may hold neither of these)
        plan["embed.tok"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if getattr(model, "lm_head", None) is not None and loss_parallel:
        plan["lm_head"] = ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1),
                                          use_local_output=False)
    elif getattr(model, "lm_head", None) is not None:
        plan["lm_head"] = ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    for stack_name, stack in _stacks(model):
        if stack.rel_bias is not None:  # (buckets, heads) table: split by head
            plan[f"{stack_name}.rel_bias.embedding"] = ColwiseParallel(input_layouts=Replicate(),
                                                                       output_layouts=Shard(-1))
        owned = [i for i, block in enumerate(stack.layers) if isinstance(block, TransformerBlock)]
        first, last = owned[0], owned[-1]  # this stack's first and last block (of this pipeline stage)
        for i in owned:
            block = stack.layers[i]
            p = f"{stack_name}.layers.{i}"
            for attn in ("attn", "cross_attn") if block.cross_attn is not None else ("attn",):
                for proj in ("q_proj", "k_proj", "v_proj"):
                    plan[f"{p}.{attn}.{proj}"] = ColwiseParallel()
                plan[f"{p}.{attn}.o_proj"] = RowwiseParallel(output_layouts=between)
            for proj in ("up", "gate") if block.ffn.gated else ("up",):
                plan[f"{p}.ffn.{proj}"] = ColwiseParallel()
            plan[f"{p}.ffn.down"] = RowwiseParallel(output_layouts=between)
            if not sp:
                continue
            for norm in ("attn_norm", "cross_norm", "ffn_norm"):
                if getattr(block, norm) is not None:
                    plan[f"{p}.{norm}"] = SequenceParallel(use_local_output=True)
            # each sub-layer gathers its (sequence-sharded) query stream once; memory is whole
            plan[f"{p}.attn"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                                   use_local_output=True)
            if block.cross_attn is not None:
                plan[f"{p}.cross_attn"] = PrepareModuleInput(input_layouts=(Shard(1), None),
                                                             desired_input_layouts=(Replicate(), None),
                                                             use_local_output=True)
            plan[f"{p}.ffn"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                                  use_local_output=True)
            # stack boundaries: the first block keeps its slice of the sequence (no communication),
            # the last one gathers it (block inputs: x, padding_mask)
            if i == first and i == last:
                plan[p] = PrepareModuleInputOutput(input_layouts=(Replicate(), None),
                                                   desired_input_layouts=(Shard(1), None), use_local_input=True,
                                                   output_layouts=Shard(1), desired_output_layouts=Replicate(),
                                                   use_local_output=True)
            elif i == first:
                plan[p] = PrepareModuleInput(input_layouts=(Replicate(), None), desired_input_layouts=(Shard(1), None),
                                             use_local_output=True)
            elif i == last:
                plan[p] = PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate(),
                                              use_local_output=True)
    return plan


def apply_tensor_parallel(model, mesh, sp: bool = False, loss_parallel: bool = True) -> None:
    """Split ``model`` over the 1-D ``mesh`` (the run mesh's ``tp`` dimension) in place."""
    from torch.distributed.tensor.parallel import parallelize_module
    tp = mesh.size()
    cfg = model.config
    check_tp(cfg, tp, sp)
    parallelize_module(model, mesh, tp_plan(model, sp, loss_parallel))
    if cfg.tie_embeddings and getattr(model, "embed", None) is not None and getattr(model, "lm_head", None) is not None:
        model.lm_head.weight = model.embed.tok.weight  # both layouts split the vocabulary rows: one tensor
    for m in model.modules():
        if isinstance(m, MultiHeadAttention):  # this rank's heads
            m.num_heads //= tp
            m.num_kv_heads //= tp
    model.loss_chunk_size = None  # the sharded logits are already 1/tp of the vocabulary
    if loss_parallel:
        model.sharded_loss = functools.partial(vocab_parallel_loss, mesh=mesh)
        model.gather_logits = _full
    model.tp_mesh = mesh


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def loss_context(enabled: bool):
    """torch's ``loss_parallel`` (forward and backward of the sharded cross-entropy run inside it)."""
    if not enabled:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel
    return loss_parallel()


def vocab_parallel_loss(logits, labels: torch.Tensor, vocab_size: int, label_smoothing: float = 0.0, *, mesh):
    """Mean cross-entropy over labelled positions of vocabulary-sharded logits (a DTensor sharded on
    its last dim), under ``loss_parallel``: the same value and gradients as ``lm_loss`` on the
    gathered logits sliced to ``vocab_size``.

    torch's loss parallel covers log-softmax + NLL only (its log-softmax backward is fused into
    NLL's), so label smoothing is written without a second log-softmax use:
    ``(1 - e) nll + e (lse - mean z) = nll + e (z_target - mean z)``, a linear term whose pieces
    are per-shard sums added over the ranks."""
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
    loss = F.nll_loss(F.log_softmax(masked, dim=-1), labels, ignore_index=-100)
    loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
    if not label_smoothing:
        return loss
    local = logits.to_local()
    mine = (labels >= first) & (labels < first + width)
    picked = local.gather(-1, (labels - first).clamp(0, width - 1)[:, None]).squeeze(-1) * mine
    row_sum = (local * real).sum(-1)

    def summed(t):  # the sum over the tp ranks of each rank's part
        return DTensor.from_local(t, mesh, [Partial()], run_check=False).full_tensor()

    valid = (labels != -100).float()
    extra = ((summed(picked) - summed(row_sum) / vocab_size) * valid).sum() / valid.sum()
    return loss + label_smoothing * extra


def grad_norm_and_clip(named_params, max_norm: float, group=None, skip=frozenset()) -> float:
    """The global L2 norm of the gradients of ``named_params`` (plain tensors, TP DTensors, FSDP2
    DTensors, mixed: grouped by mesh and placements, each group reduced over its own shards), clipped
    to ``max_norm`` when it is > 0, as ``torch.nn.utils.clip_grad_norm_`` does. ``group``: the
    squares are also summed over that process group (pipeline stages, each with its own parameters);
    names in ``skip`` are clipped but counted by another stage (a weight two stages share)."""
    import torch.distributed as dist
    groups: dict = {}
    counted: dict = {}
    for name, p in named_params:
        g = p.grad
        if g is None:
            continue
        key = (g.device_mesh, tuple(g.placements)) if hasattr(g, "device_mesh") else None
        groups.setdefault(key, []).append(g)
        if name not in skip:
            counted.setdefault(key, []).append(g)
    total_sq = torch.zeros((), dtype=torch.float64)
    for grads in counted.values():
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        total_sq += norm.double().cpu() ** 2
    if group is not None:
        device = next(iter(next(iter(groups.values())))).device if groups else torch.device("cpu")
        total_sq = total_sq.to(device)
        dist.all_reduce(total_sq, group=group)
    total = float(total_sq) ** 0.5
    coef = max_norm / (total + 1e-6)  # as torch.nn.utils.clip_grad_norm_
    if max_norm > 0 and coef < 1.0:
        for grads in groups.values():
            torch._foreach_mul_(grads, coef)
    return total


def pad_for_sequence_parallel(inputs: dict, multiple: int, pad_id: int, family: str) -> dict:
    """Pad a batch's sequences to a multiple of ``multiple`` (sequence parallel splits them evenly).

    Added positions are padding: ids ``pad_id``, attention mask 0 (created for bidirectional
    stacks if the batch had none), labels -100; they sit at the end, so causal positions never see
    them, and no loss or gradient changes."""
    out = dict(inputs)

    def grow(t, n, value):
        return F.pad(t, (0, n), value=value) if n else t

    n = -out["input_ids"].shape[1] % multiple
    if n:
        if "attention_mask" not in out and family != "decoder":
            out["attention_mask"] = torch.ones_like(out["input_ids"])
        out["input_ids"] = grow(out["input_ids"], n, pad_id)
        for key, value in (("attention_mask", 0), ("token_type_ids", 0)):
            if key in out:
                out[key] = grow(out[key], n, value)
        if family != "encdec" and "labels" in out:
            out["labels"] = grow(out["labels"], n, -100)
    if family == "encdec" and "labels" in out:
        out["labels"] = grow(out["labels"], -out["labels"].shape[1] % multiple, -100)
    return out
