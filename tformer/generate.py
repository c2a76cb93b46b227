"""Autoregressive decoding with a KV cache: greedy, temperature, top-k and top-p sampling.

With the cache, each step feeds only the newest token as the query; the encoder-decoder computes the
encoder output and the cross-attention keys/values once.
"""
from __future__ import annotations

import torch

from .models import DecoderModel, EncoderDecoderModel


def filter_logits(logits: torch.Tensor, top_k: int | None = None, top_p: float | None = None) -> torch.Tensor:
    """Set logits outside the top-k / the top-p nucleus to -inf (at least one token survives)."""
    if top_k is not None and top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and 0.0 < top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop_sorted = cum - torch.softmax(sorted_logits, dim=-1) >= top_p  # mass before this token
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def next_token(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None,
               generator: torch.Generator | None) -> torch.Tensor:
    logits = logits.float()
    if temperature <= 0.0:
        return logits.argmax(dim=-1)
    logits = filter_logits(logits / temperature, top_k, top_p)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _check_args(max_new_tokens: int, temperature: float, top_k, top_p) -> None:
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 0")
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0 (0 = greedy)")
    if top_k is not None and top_k < 0:
        raise ValueError(f"top_k={top_k} must be >= 0 (0 or None = off)")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p={top_p} must be in (0, 1]")


_FROM_CONFIG = object()


@torch.no_grad()
def generate(model, input_ids: torch.Tensor, max_new_tokens: int = 32, *,
             attention_mask: torch.Tensor | None = None, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, eos_token_id=_FROM_CONFIG,
             generator: torch.Generator | None = None, use_cache: bool = True) -> torch.Tensor:
    """Continue ``input_ids`` (decoder: the prompt, left-padded with ``attention_mask`` for ragged
    batches; encoder-decoder: the source). Returns prompt + new tokens for a decoder, and the
    decoder sequence (start token + new tokens) for an encoder-decoder. Finished rows (after EOS)
    are filled with the pad id; ``eos_token_id`` defaults to the config's, None disables stopping.
    ``temperature=0`` is greedy."""
    _check_args(max_new_tokens, temperature, top_k, top_p)
    cfg = model.config
    eos = cfg.eos_token_id if eos_token_id is _FROM_CONFIG else eos_token_id
    was_training = model.training
    model.eval()
    try:
        if isinstance(model, EncoderDecoderModel):
            return _generate_encdec(model, input_ids, attention_mask, max_new_tokens, temperature,
                                    top_k, top_p, eos, generator, use_cache)
        if isinstance(model, DecoderModel):
            return _generate_decoder(model, input_ids, attention_mask, max_new_tokens, temperature,
                                     top_k, top_p, eos, generator, use_cache)
        raise TypeError(f"generate needs a decoder or encoder-decoder model, not {type(model).__name__}")
    finally:
        model.train(was_training)


def _finish(tokens, done, eos, pad):
    tokens = torch.where(done, torch.full_like(tokens, pad), tokens)
    if eos is not None:
        done = done | (tokens == eos)
    return tokens, done


def _generate_decoder(model, ids, mask, steps, temperature, top_k, top_p, eos, generator, use_cache):
    b = ids.shape[0]
    mask = torch.ones_like(ids) if mask is None else mask.long()
    padded = bool((mask == 0).any())
    done = torch.zeros(b, dtype=torch.bool, device=ids.device)
    cache = model.new_cache() if use_cache else None
    out, step_input = ids, ids
    for _ in range(steps):
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        if use_cache:
            positions = positions[:, -step_input.shape[1]:]
            logits = model(step_input, mask if padded else None, position_ids=positions, cache=cache).logits
        else:
            logits = model(out, mask if padded else None, position_ids=positions).logits
        tok, done_next = _finish(next_token(logits[:, -1], temperature, top_k, top_p, generator),
                                 done, eos, model.config.pad_token_id)
        out = torch.cat((out, tok[:, None]), dim=1)
        mask = torch.cat((mask, torch.ones_like(tok[:, None])), dim=1)
        step_input, done = tok[:, None], done_next
        if done.all():
            break
    return out


def _generate_encdec(model, src, src_mask, steps, temperature, top_k, top_p, eos, generator, use_cache):
    cfg = model.config
    memory = model.encode(src, src_mask)
    out = torch.full((src.shape[0], 1), cfg.decoder_start_token_id, dtype=torch.long, device=src.device)
    done = torch.zeros(src.shape[0], dtype=torch.bool, device=src.device)
    cache = model.new_cache() if use_cache else None
    step_input = out
    for _ in range(steps):
        if use_cache:
            logits = model.decode(step_input, memory, src_mask, cache=cache)
        else:
            logits = model.decode(out, memory, src_mask)
        tok, done_next = _finish(next_token(logits[:, -1], temperature, top_k, top_p, generator),
                                 done, eos, cfg.pad_token_id)
        out = torch.cat((out, tok[:, None]), dim=1)
        step_input, done = tok[:, None], done_next
        if done.all():
            break
    return out
