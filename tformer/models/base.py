"""What every family shares: the output record, embeddings, initialisation, loss, input checks."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from ..config import ConfigError, Family, ModelConfig
from ..nn import LearnedPositions, SinusoidalPositions, make_norm
from ..nn.attention import soft_cap
from ..nn.moe import Experts, moe_aux_loss, moe_layers
from .block_flops import head_flops, stack_flops
from .loss import chunked_lm_loss, loss_divisor


@dataclass
class ModelOutput:
    logits: torch.Tensor | None  # None when the forward was asked for the loss only
    loss: torch.Tensor | None = None
    cache: Any = None
    encoder_hidden: torch.Tensor | None = None


def vocab_rows(module: nn.Embedding | nn.Linear, cfg: ModelConfig) -> nn.Embedding | nn.Linear:
    """``module``, built with one row per token of ``cfg.vocab_size``, grown by zero rows to the
    padded vocabulary (``pad_vocab_multiple``, or tp's padding). Built this way the padding draws no
    random numbers, in the constructor or in ``init_weights``: a padded model starts from exactly
    the unpadded model's weights, and its padding rows (never looked up, never predicted) stay zero."""
    pad = cfg.padded_vocab_size - cfg.vocab_size
    if pad == 0:
        return module
    w = module.weight
    module.weight = nn.Parameter(torch.cat([w.detach(), w.new_zeros(pad, w.shape[1])]))
    bias = getattr(module, "bias", None)
    if bias is not None:
        module.bias = nn.Parameter(torch.cat([bias.detach(), bias.new_zeros(pad)]))
    if isinstance(module, nn.Embedding):
        module.num_embeddings += pad
    else:
        module.out_features += pad
    return module


class Embeddings(nn.Module):
    """Token (+ absolute position) (+ token type) embeddings, optional norm, dropout."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.tok = vocab_rows(nn.Embedding(cfg.vocab_size, cfg.d_model), cfg)
        self.pos = {"learned": LearnedPositions, "sinusoidal": SinusoidalPositions}.get(cfg.position, lambda *_: None)(
            cfg.max_seq_len, cfg.d_model
        )
        self.types = nn.Embedding(cfg.type_vocab_size, cfg.d_model) if cfg.type_vocab_size else None
        self.norm = (
            make_norm(cfg.norm, cfg.d_model, cfg.norm_eps, cfg.norm_bias, cfg.norm_unit_offset) if cfg.embed_norm else None
        )
        self.scale = math.sqrt(cfg.d_model) if cfg.embed_scale else None
        self.scale_in_dtype = cfg.embed_scale_dtype  # Gemma: sqrt(d_model) rounded to the activations' dtype
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        x = self.tok(input_ids)
        if self.scale is not None:
            x = x * (torch.tensor(self.scale, dtype=x.dtype) if self.scale_in_dtype else self.scale)
        if self.pos is not None:
            x = x + self.pos(positions)
        if self.types is not None:
            x = x + self.types(token_type_ids if token_type_ids is not None else torch.zeros_like(input_ids))
        if self.norm is not None:
            x = self.norm(x)
        return self.dropout(x)


def stage_layers(num_layers: int, stages: int, pp_layers: list | None = None) -> list[range]:
    """Block indices of each pipeline stage: ``pp_layers`` counts, or as even as possible (earlier
    stages take the remainder: the last stage also runs the head and the loss)."""
    counts = list(pp_layers) if pp_layers else [num_layers // stages + (i < num_layers % stages) for i in range(stages)]
    out, start = [], 0
    for n in counts:
        out.append(range(start, start + n))
        start += n
    return out


class SkipBlock(nn.Module):
    """A block another pipeline stage runs: passes the hidden states through, holds nothing. It keeps
    the stage's own blocks at their indices, so parameter names stay the unsplit model's."""

    def forward(self, x, *args, **kwargs):
        return x


class TformerModel(nn.Module):
    """Base of the three families. A family says what it is made of in the class attributes below
    and counts itself in the class methods (``stack_shapes``, ``forward_flops``): the planner, the
    pipeline and the exporters read those through the family's ``ModelSpec`` (models/spec.py).

    Every forward tolerates absent modules, so a pipeline stage is the model with what it does not
    run removed (``cut_stage``): no ``embed`` (or a floating-point input): the input is the hidden
    states of the stage before; no output head: the forward returns its hidden states."""

    FAMILY: ClassVar[Family]
    STACKS: ClassVar[tuple[str, ...]]  # attributes holding the TransformerStacks, input side first
    HEAD: ClassVar[tuple[str, ...]] = ("lm_head",)  # the output head's modules (the last stage's)
    LM_HEAD_BIAS: ClassVar[bool] = False  # the vocabulary projection has a bias (BERT's)
    SEQ2SEQ: ClassVar[bool] = False  # labels are a target sequence read by a cross-attending decoder
    CAUSAL_LM: ClassVar[bool] = False  # one causal stream: prompts start with BOS, no padding mask needed
    MASKED_LM: ClassVar[bool] = False  # the head runs at labelled positions only, through a dense + norm

    config: ModelConfig
    # absent (None) in a pipeline stage that does not run them (``cut_stage``)
    embed: Any
    lm_head: Any
    # Tokens per chunk of the training loss's head (None: one piece). Set from outside, like the
    # blocks' activation checkpointing: it changes memory and time, never the loss or a gradient.
    loss_chunk_size: int | None = None
    # Set from outside by a tensor-parallel layout (tformer/parallel/tp.py), whose ``lm_head`` then
    # returns vocabulary-sharded logits: ``sharded_loss(logits, labels, vocab_size, label_smoothing, loss_tokens)``
    # computes the training loss on them without gathering them ("loss parallel"), and
    # ``gather_logits`` makes them whole where logits are returned (evaluation, generation).
    sharded_loss: Any = None
    gather_logits: Any = None
    # Set from outside by sequence parallelism (tformer/parallel/tp.py) to the tp degree: every
    # forward's sequence length must then be a multiple of it (see ``padding.pad_sequences``).
    sequence_multiple: int = 1

    @classmethod
    def stack_shapes(cls, cfg: ModelConfig, seq: int, target: int | None) -> list[tuple[int, int, int | None]]:
        """(blocks, tokens per sample, cross-attended tokens or None) of each stack, in ``STACKS`` order."""
        return [(cfg.num_layers, seq, None)]

    @classmethod
    def moe_layer_count(cls, cfg: ModelConfig) -> int:
        """MoE layers of the whole model (a pipeline stage holds some of them)."""
        return sum(cfg.moe.is_moe_layer(i) for n, _, _ in cls.stack_shapes(cfg, 1, 1) for i in range(n))

    @classmethod
    def forward_flops(cls, cfg: ModelConfig, batch: int, seq: int, target: int | None) -> int:
        """Forward FLOPs of a batch (models/flops.py's conventions): the stack and the head."""
        tokens = batch * seq
        return stack_flops(cfg, tokens, seq, cfg.num_layers, cls.CAUSAL_LM) + head_flops(cfg, tokens)

    def stacks(self) -> list:
        return [getattr(self, name) for name in self.STACKS]

    def cut_stage(self, stage: int, stages: int, pp_layers: list | None = None) -> None:
        """Remove in place what pipeline stage ``stage`` of ``stages`` does not run: the other
        stages' blocks (``stage_layers``), the embeddings after the first stage (a head tied to the
        token embedding keeps that one tensor, by its name), the final norm and the head before
        the last."""
        first, last = stage == 0, stage == stages - 1
        stack = self.stacks()[0]
        keep = stage_layers(len(stack.layers), stages, pp_layers)[stage]
        for i in range(len(stack.layers)):
            if i not in keep:
                stack.layers[i] = SkipBlock()
        if not last:
            stack.final_norm = None
            for name in self.HEAD:
                setattr(self, name, None)
        if not first:
            if last and self.config.tie_embeddings:
                emb = self.embed
                emb.pos, emb.types, emb.norm = None, None, None
            else:
                self.embed = None

    def _embed_or_hidden(self, x: torch.Tensor, positions: torch.Tensor, *args: Any) -> torch.Tensor:
        """A floating-point input is the hidden states of the pipeline stage before; ids are embedded."""
        return x if x.is_floating_point() else self.embed(x, positions, *args)

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Unique parameter elements (tied weights counted once)."""
        skip = set()
        if exclude_embeddings:
            skip = {id(m.weight) for m in self.modules() if isinstance(m, nn.Embedding)}
        return sum(p.numel() for p in self.parameters() if id(p) not in skip)

    def num_active_parameters(self, exclude_embeddings: bool = False) -> int:
        """Parameters one token passes through: ``num_parameters`` less, in every MoE layer, the
        experts it is not routed to (all but ``top_k`` of ``num_experts``)."""
        idle = 0
        for m in moe_layers(self):
            per_expert = sum(p[0].numel() for p in m.experts.parameters())
            idle += per_expert * (m.cfg.num_experts - m.cfg.top_k)
        return self.num_parameters(exclude_embeddings) - idle

    def init_weights(self) -> None:
        """Normal(0, init_std) for matrices and embeddings, zero biases, unit norm gains; the
        projections that write into the residual stream are scaled by 1/sqrt(2 * depth) (GPT-2).
        With ``embed_scale`` (the paper's Transformer) the token embedding starts at Normal(0,
        d_model**-0.5), as fairseq does: scaled by sqrt(d_model) it is of unit size, like the
        sinusoidal positions added to it (at init_std 0.02 the positions would outweigh the tokens
        about 3:1 at d_model 128, 9:1 at 1024)."""
        cfg = self.config
        depth = sum(blocks for blocks, _, _ in self.stack_shapes(cfg, 1, None))
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                std = cfg.init_std
                if name.endswith(("o_proj", "ffn.down", "ffn.shared.down")):
                    std /= math.sqrt(2 * depth)
                if cfg.embed_scale and name in ("embed.tok", "encoder_embed.tok"):
                    std = cfg.d_model**-0.5
                nn.init.normal_(self._real_rows(name, module.weight), 0.0, std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, Experts):
                module.init_weights(cfg.init_std, cfg.init_std / math.sqrt(2 * depth))
            elif hasattr(module, "weight") and module.weight is not None and module.weight.dim() == 1:
                # a gain stored as its offset from 1 (Gemma's RMSNorm) starts at 0
                (nn.init.zeros_ if getattr(module, "unit_offset", False) else nn.init.ones_)(module.weight)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)

    def _real_rows(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        """The rows of ``weight`` that init draws: all of them, except for the token embedding and
        the output head of a padded vocabulary, whose padding rows start (and, never looked up nor
        predicted, stay) at zero. So padding draws no random numbers and changes nothing else a run
        trains: a tp=3 run pads 2,048 rows to 2,049 and starts from the 1-process model's weights."""
        cfg = self.config
        vocab_rows = name in ("embed.tok", "encoder_embed.tok") or name.endswith("lm_head")
        if not vocab_rows or weight.shape[0] != cfg.padded_vocab_size or cfg.padded_vocab_size == cfg.vocab_size:
            return weight
        with torch.no_grad():
            weight[cfg.vocab_size :].zero_()
        return weight[: cfg.vocab_size]

    def _check_length(self, seq_len: int, offset: int = 0) -> None:
        cfg = self.config
        if cfg.position in ("learned", "sinusoidal") and offset + seq_len > cfg.max_seq_len:
            raise ConfigError(
                f"sequence length {offset + seq_len} exceeds max_seq_len={cfg.max_seq_len} "
                "of this model's position table; use shorter sequences or a larger max_seq_len"
            )

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = soft_cap(self.lm_head(hidden), self.config.final_softcap)
        if self.gather_logits is not None:
            logits = self.gather_logits(logits)
        if self.config.padded_vocab_size != self.config.vocab_size:
            logits = logits[..., : self.config.vocab_size]
        return logits

    def _head_input(self, hidden: torch.Tensor) -> torch.Tensor:
        """What a family does to the hidden states before the vocabulary projection ``lm_head``."""
        return hidden

    def _head_and_loss(self, hidden: torch.Tensor, labels: torch.Tensor | None, return_logits: bool, **kw: Any):
        """``_head_and_lm_loss``, plus the MoE layers' auxiliary losses while training (their
        coefficients are in ``model.moe``): what the optimiser minimises."""
        logits, loss = self._head_and_lm_loss(hidden, labels, return_logits, **kw)
        if loss is not None and self.training and self.config.moe.enabled:
            aux = moe_aux_loss(self, self.moe_layer_count(self.config))
            if aux is not None:
                loss = loss + aux.to(loss.dtype)
        return logits, loss

    def _head_and_lm_loss(
        self,
        hidden: torch.Tensor,
        labels: torch.Tensor | None,
        return_logits: bool,
        labelled_only: bool = False,
        label_smoothing: float = 0.0,
        loss_tokens: torch.Tensor | None = None,
        labelled_count: int | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Apply the output head (``_head_input``, then ``lm_head``) and the loss.

        ``return_logits=False`` (the trainer's path, labels required) returns no logits. With
        ``labelled_only`` the head then runs only where a label is set (masked LM: ~15% of
        positions); the loss and every gradient are those of the full head, since unlabelled
        positions contribute nothing. With ``loss_chunk_size`` set (the trainer's ``loss.chunk_size``)
        no vocabulary-wide tensor exists at all: see ``models/loss.py``. ``loss_tokens``: see ``lm_loss``."""
        if labels is None or return_logits:
            logits = self._logits(self._head_input(hidden))
            return logits, (lm_loss(logits, labels, label_smoothing, loss_tokens) if labels is not None else None)
        if labelled_only:
            keep = labels != -100
            if labelled_count is None:
                hidden, labels = hidden[keep], labels[keep]  # a count only the device knows: it waits
            else:  # the same rows, in the same order, found in a tensor of a size the host knows
                rows = torch.nonzero_static(keep.reshape(-1), size=labelled_count).squeeze(1)
                hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows)
                labels = labels.reshape(-1).index_select(0, rows)
        x = self._head_input(hidden)
        if self.sharded_loss is not None:
            return None, self.sharded_loss(
                soft_cap(self.lm_head(x), self.config.final_softcap),
                labels,
                self.config.vocab_size,
                label_smoothing,
                loss_tokens,
            )
        # compiled, a masked LM's labelled rows are a data-dependent count, which a graph cannot loop
        # over in chunks: its head (15% of the positions) runs whole there
        # (capped logits, final_softcap, are computed whole too: the chunked loss takes plain ones)
        chunked = self.loss_chunk_size is not None and self.config.final_softcap is None
        if not chunked or (labelled_only and torch.compiler.is_compiling()):
            return None, lm_loss(self._logits(x), labels, label_smoothing, loss_tokens, overwrite=True)
        head = self.lm_head
        return None, chunked_lm_loss(
            x, head.weight, head.bias, labels, self.loss_chunk_size, self.config.vocab_size, label_smoothing, loss_tokens
        )


# logits the loss takes as they are (bf16 / fp16 under autocast): ``CrossEntropy`` upcasts them itself
LOW_PRECISION = (torch.bfloat16, torch.float16)


def lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    label_smoothing: float = 0.0,
    loss_tokens: torch.Tensor | None = None,
    overwrite: bool = False,
) -> torch.Tensor:
    """Mean cross-entropy over positions whose label is not -100. Labels are aligned with the
    logits (``labels[t]`` is the target of position ``t``); shifting is the data pipeline's job.
    ``label_smoothing`` = epsilon mixes the target with the uniform distribution, as
    ``F.cross_entropy(..., label_smoothing=epsilon)`` does: ``(1 - e) * nll + e * mean_j(-log p_j)``.

    ``loss_tokens`` (a count, or per-sample counts: their sum) divides the sum instead of the count of
    labelled positions here: a rank that holds part of a sequence (context parallelism) passes the
    whole sequence's count, so the ranks' losses add up to the mean, and a part without labels gives
    0, not 0 / 0. Per sample, the counts split with the batch (a pipeline's micro-batches).

    ``overwrite``: ``logits`` is the head's fresh output, which nothing reads after the loss (the
    trainer's loss-only path). The log-softmax is then written over it, and the loss never holds
    two (tokens, vocab) fp32 tensors at once: at a 128k vocabulary and 8k tokens that is 4 GiB less
    at the end of forward.

    Low-precision logits (bf16 / fp16 under autocast) go in as they are, outside a compiled graph:
    the log-softmax upcasts them and the gradient comes back in their dtype from the last pass, so
    the head's elementwise passes move 38 bytes a logit instead of 62 (``plan/memory_bound``); on
    an H100 that is ~15 ms a step at llama-1b's 2.1 billion logits."""
    compiling = torch.compiler.is_compiling()
    low = logits.dtype in LOW_PRECISION and not compiling
    flat = (logits if low else logits.float()).reshape(-1, logits.shape[-1])
    # a copy (the fp32 cast, a sliced vocabulary reshaped) or the head's own output may be written
    # over; a view autograd made elsewhere (a gathered tensor-parallel head's) may not. Compiled,
    # the graph plans its own buffers (and a data pointer is no traceable value). Low-precision
    # logits are never written over: ``CrossEntropy`` upcasts them into a tensor of its own
    overwrite = overwrite and not compiling and (not logits._is_view() or flat.data_ptr() != logits.data_ptr())
    return CrossEntropy.apply(flat, labels.reshape(-1), float(label_smoothing), loss_tokens, overwrite)


class CrossEntropy(torch.autograd.Function):
    """``F.cross_entropy(logits, labels, ignore_index=-100, label_smoothing=e)`` (mean), with the
    gradient ``(softmax - (1 - e) onehot - e / V) / count`` written into the saved log-probabilities.

    ``F.cross_entropy``'s backward allocates two more (tokens, vocab) tensors (nll_loss's zero-filled
    gradient, then log_softmax's); at vocabulary width each is a fresh mmap whose page faults cost as
    much as the arithmetic, and reusing the buffer halves the loss's time on CPU. The price: no second
    backward through the same graph (autograd reports the in-place change), and no double backward.
    """

    @staticmethod
    def forward(
        ctx, logits: torch.Tensor, labels: torch.Tensor, smoothing: float = 0.0, tokens=None, overwrite: bool = False
    ) -> torch.Tensor:
        valid = labels != -100
        target = labels.masked_fill(~valid, 0)[:, None]
        ctx.dtype = logits.dtype
        if logits.dtype in LOW_PRECISION:  # upcast by the log-softmax: no fp32 copy of the logits kept
            logp = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
        elif overwrite:  # (lm_loss) no autograd node reads the logits: the head's matmul saves its inputs
            logp = logits.sub_(torch.logsumexp(logits, dim=-1, keepdim=True))
        else:
            logp = torch.log_softmax(logits, dim=-1)
        count = loss_divisor(valid, tokens)
        ctx.save_for_backward(logp, target, valid, count)
        ctx.smoothing = smoothing
        nll = -(logp.gather(-1, target).squeeze(-1) * valid).sum() / count
        if not smoothing:
            return nll
        uniform = -(logp.mean(-1) * valid).sum() / count
        return (1.0 - smoothing) * nll + smoothing * uniform

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logp, target, valid, count = ctx.saved_tensors
        e = ctx.smoothing
        scale = (grad / count * valid)[:, None]
        if ctx.dtype in LOW_PRECISION:
            # softmax - (1-e) onehot - e/V in fp32 in place, then scaled straight into the logits'
            # dtype: one pass fewer than scaling in fp32 and casting after
            p = logp.exp_().scatter_add_(-1, target, torch.full_like(scale, e - 1.0))
            if e:
                p.sub_(e / logp.shape[-1])
            return torch.mul(p, scale, out=torch.empty_like(p, dtype=ctx.dtype)), None, None, None, None
        dlogits = logp.exp_().mul_(scale)
        if e:
            dlogits.sub_(scale * (e / logp.shape[-1]))
        return dlogits.scatter_add_(-1, target, -(1.0 - e) * scale), None, None, None, None


def default_positions(input_ids: torch.Tensor, offset: int = 0) -> torch.Tensor:
    return torch.arange(offset, offset + input_ids.shape[1], device=input_ids.device)
