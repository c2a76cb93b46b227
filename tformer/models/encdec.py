"""Encoder-decoder family (T5-like): bidirectional encoder, causal decoder with cross-attention,
one embedding shared by both stacks (or, ``shared_embeddings: false``, one per stack: T5Gemma)
and (v1.0) the LM head."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..config import ModelConfig
from ..nn import DocumentMask, StackCache, TransformerStack, positions_from_doc_ids
from .base import Embeddings, ModelOutput, TformerModel, default_positions, vocab_rows
from .block_flops import attention_flops, head_flops, stack_flops


def shift_right(labels: torch.Tensor, start_id: int, pad_id: int) -> torch.Tensor:
    """Decoder inputs from targets: prepend the start token, drop the last, -100 -> pad."""
    out = labels.new_full(labels.shape, start_id)
    out[:, 1:] = labels[:, :-1]
    return out.masked_fill(out == -100, pad_id)


def _positions(ids: torch.Tensor, doc_ids, position_ids, offset: int = 0) -> torch.Tensor:
    if position_ids is not None:
        return position_ids
    return default_positions(ids, offset) if doc_ids is None else positions_from_doc_ids(doc_ids)


class EncoderDecoderModel(TformerModel):
    FAMILY = "encdec"
    STACKS = ("encoder", "decoder")
    SEQ2SEQ = True
    encoder: Any  # None in pipeline stage 1, like ``decoder`` in stage 0 (``cut_stage``)
    decoder: Any
    encoder_embed: Any  # the encoder's own token embedding (``shared_embeddings: false``), else None

    @classmethod
    def stack_shapes(cls, cfg: ModelConfig, seq: int, target: int | None) -> list[tuple[int, int, int | None]]:
        """The encoder over the source, the decoder over the target (default: as long) attending to it."""
        return [(cfg.num_layers, seq, None), (cfg.decoder_layers, target or seq, seq)]

    @classmethod
    def forward_flops(cls, cfg: ModelConfig, batch: int, seq: int, target: int | None) -> int:
        if target is None:
            raise ValueError("encoder-decoder FLOPs need target_len (the decoder sequence length)")
        tokens, t_tokens = batch * seq, batch * target
        cross = cfg.decoder_layers * attention_flops(cfg, t_tokens, tokens, seq, cross=True)
        decoder = stack_flops(cfg, t_tokens, target, cfg.decoder_layers, causal=True) + cross
        return stack_flops(cfg, tokens, seq, cfg.num_layers, causal=False) + decoder + head_flops(cfg, t_tokens)

    def cut_stage(self, stage: int, stages: int, pp_layers: list | None = None) -> None:
        """Split at the encoder/decoder boundary (``pipeline.check_pipeline`` refuses any other):
        stage 0 embeds and encodes; stage 1 embeds the decoder input with the shared embedding and
        runs the decoder, the head and the loss."""
        if stage == 0:
            self.decoder, self.lm_head = None, None
            if self.encoder_embed is not None:
                self.embed = None
        else:
            self.encoder, self.encoder_embed = None, None

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed = Embeddings(cfg)
        self.encoder_embed = None if cfg.shared_embeddings else Embeddings(cfg)
        self.encoder = TransformerStack(cfg, cfg.num_layers, causal=False)
        self.decoder = TransformerStack(cfg, cfg.decoder_layers, causal=True, cross=True)
        self.lm_head = vocab_rows(nn.Linear(cfg.d_model, cfg.vocab_size, bias=False), cfg)
        self.init_weights()
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.tok.weight

    def new_cache(self) -> StackCache:
        return StackCache(self.config.decoder_layers, cross=True)

    def encode(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        doc_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``doc_ids`` (B, S): packed sources, each attending only to itself, positions per source.
        ``position_ids`` (S,) or (B, S) overrides the positions (a sequence shard's own)."""
        self._check_length(input_ids.shape[1])
        positions = _positions(input_ids, doc_ids, position_ids)
        doc_mask = DocumentMask(doc_ids) if doc_ids is not None else None
        embed = self.embed if self.encoder_embed is None else self.encoder_embed
        return self.encoder(embed(input_ids, positions), attention_mask, positions=positions, doc_mask=doc_mask)

    def decode(
        self,
        decoder_input_ids: torch.Tensor,
        memory: torch.Tensor,
        memory_mask: torch.Tensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        cache: StackCache | None = None,
    ) -> torch.Tensor:
        """Decoder logits for ``decoder_input_ids`` attending to the encoder output ``memory``."""
        return self._output_logits(
            self.decoder_hidden(decoder_input_ids, memory, memory_mask, decoder_attention_mask, cache)
        )

    def decoder_hidden(
        self,
        decoder_input_ids: torch.Tensor,
        memory: torch.Tensor,
        memory_mask: torch.Tensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        cache: StackCache | None = None,
        doc_ids: torch.Tensor | None = None,
        memory_doc_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``doc_ids`` (B, T) / ``memory_doc_ids`` (B, S): packed pairs; each target attends to its
        own earlier tokens and its own source only."""
        offset = cache.length if cache is not None else 0
        self._check_length(decoder_input_ids.shape[1], offset)
        positions = _positions(decoder_input_ids, doc_ids, position_ids, offset)
        x = self.embed(decoder_input_ids, positions)
        doc_mask = cross = None
        if doc_ids is not None:
            doc_mask = DocumentMask(doc_ids)
            cross = DocumentMask(doc_ids, memory_doc_ids, flex=doc_mask.flex)
        return self.decoder(
            x,
            decoder_attention_mask,
            positions=positions,
            memory=memory,
            memory_mask=memory_mask,
            cache=cache,
            doc_mask=doc_mask,
            memory_doc_mask=cross,
        )

    def _output_logits(self, h: torch.Tensor) -> torch.Tensor:
        return self._logits(self._head_input(h))

    def _head_input(self, h: torch.Tensor) -> torch.Tensor:
        if self.config.tie_embeddings and self.config.tied_output_scale:
            h = h * self.config.d_model**-0.5  # T5 rescales before the tied output projection
        return h

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        encoder_hidden: torch.Tensor | None = None,
        cache: StackCache | None = None,
        return_logits: bool = True,
        label_smoothing: float = 0.0,
        doc_ids: torch.Tensor | None = None,
        decoder_doc_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        decoder_position_ids: torch.Tensor | None = None,
        loss_tokens: torch.Tensor | None = None,
    ) -> ModelOutput | torch.Tensor:
        """``labels`` are the decoder targets; without ``decoder_input_ids`` they are shifted right
        behind ``decoder_start_token_id`` to form the decoder input (teacher forcing). Packed pairs
        give ``doc_ids`` (sources), ``decoder_doc_ids`` (targets) and ``decoder_input_ids`` (each
        target shifted behind its own start token). ``position_ids`` / ``decoder_position_ids`` override
        each stream's positions; ``loss_tokens`` is the loss's divisor (``models/base.lm_loss``).
        A pipeline stage (``cut_stage``) without the decoder returns the encoder output; one without
        the encoder takes the encoder output for ``input_ids``."""
        if self.decoder is None:  # pipeline stage 0: input ids -> encoder output
            return self.encode(input_ids, attention_mask, doc_ids, position_ids)
        if self.encoder is None:  # pipeline stage 1: the input is the encoder output
            encoder_hidden = input_ids
        if (doc_ids is None) != (decoder_doc_ids is None):
            raise ValueError("packed pairs need both doc_ids (sources) and decoder_doc_ids (targets)")
        if decoder_input_ids is None:
            if labels is None:
                raise ValueError("encoder-decoder forward needs decoder_input_ids or labels")
            cfg = self.config
            decoder_input_ids = shift_right(labels, cfg.decoder_start_token_id, cfg.pad_token_id)
        if encoder_hidden is None:
            encoder_hidden = self.encode(input_ids, attention_mask, doc_ids, position_ids)
        h = self.decoder_hidden(
            decoder_input_ids,
            encoder_hidden,
            attention_mask,
            decoder_attention_mask,
            cache,
            decoder_doc_ids,
            doc_ids,
            decoder_position_ids,
        )
        logits, loss = self._head_and_loss(
            h, labels, return_logits, label_smoothing=label_smoothing, loss_tokens=loss_tokens
        )
        return ModelOutput(logits, loss, cache, encoder_hidden)
