"""Autoregressive decoding with a KV cache: greedy, temperature, top-k and top-p sampling, and
beam search.

With the cache, each step feeds only the newest token as the query; the encoder-decoder computes the
encoder output and the cross-attention keys/values once.

A model under sequence parallelism (``sequence_multiple`` > 1, set by tformer/parallel/tp.py) takes
only sequences whose length is a multiple of tp, and a cached step's one token is not: it decodes
without the cache, each step running the whole sequence padded at the end by ``pad_sequences``
(training's padding; causal positions never see what follows them), and reads the logits of the
last real position.
"""

from __future__ import annotations

import logging
import math

import torch

from .config import LENGTH_NORMS, LengthNorm
from .models import DecoderModel, EncoderDecoderModel
from .models.padding import pad_sequences


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


def next_token(
    logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None, generator: torch.Generator | None
) -> torch.Tensor:
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
log = logging.getLogger("tformer.generate")


@torch.no_grad()
def generate(
    model,
    input_ids: torch.Tensor,
    max_new_tokens: int = 32,
    *,
    attention_mask: torch.Tensor | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id=_FROM_CONFIG,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
    num_beams: int = 1,
    length_penalty: float | None = None,
    length_norm: LengthNorm = "gnmt",
    early_stopping: bool = False,
) -> torch.Tensor:
    """Continue ``input_ids`` (decoder: the prompt, left-padded with ``attention_mask`` for ragged
    batches; encoder-decoder: the source). Returns prompt + new tokens for a decoder, and the
    decoder sequence (start token + new tokens) for an encoder-decoder. Finished rows (after EOS)
    are filled with the pad id; ``eos_token_id`` defaults to the config's, None disables stopping.
    ``temperature=0`` is greedy.

    ``num_beams > 1`` is beam search (see ``beam_search``); rows are padded with the pad id after
    their EOS. A ``length_penalty`` with ``num_beams=1`` has no effect: it is ignored with a warning."""
    _check_args(max_new_tokens, temperature, top_k, top_p)
    _check_beam_args(num_beams, length_penalty, length_norm)
    cfg = model.config
    eos = cfg.eos_token_id if eos_token_id is _FROM_CONFIG else eos_token_id
    if num_beams > 1:
        if temperature > 0:
            raise ValueError("beam search is deterministic: use temperature=0 with num_beams > 1")
        return beam_search(
            model,
            input_ids,
            max_new_tokens,
            num_beams=num_beams,
            attention_mask=attention_mask,
            length_penalty=length_penalty or 0.0,
            length_norm=length_norm,
            eos_token_id=eos,
            early_stopping=early_stopping,
        )
    if length_penalty:
        log.warning("length_penalty=%s has no effect with num_beams=1 (greedy or sampling); ignored", length_penalty)
    was_training = model.training
    model.eval()
    try:
        if isinstance(model, EncoderDecoderModel):
            return _generate_encdec(
                model, input_ids, attention_mask, max_new_tokens, temperature, top_k, top_p, eos, generator, use_cache
            )
        if isinstance(model, DecoderModel):
            return _generate_decoder(
                model, input_ids, attention_mask, max_new_tokens, temperature, top_k, top_p, eos, generator, use_cache
            )
        raise TypeError(f"generate needs a decoder or encoder-decoder model, not {type(model).__name__}")
    finally:
        model.train(was_training)


def _sequence_multiple(model) -> int:
    return getattr(model, "sequence_multiple", 1)


def _padded(model, ids: torch.Tensor, mask: torch.Tensor | None, family: str):
    """``ids`` and ``mask`` padded at the end to the model's sequence multiple (unchanged without SP)."""
    batch = {"input_ids": ids} if mask is None else {"input_ids": ids, "attention_mask": mask}
    batch = pad_sequences(batch, _sequence_multiple(model), model.config.pad_token_id, family)
    return batch["input_ids"], batch.get("attention_mask")


def _decoder_last_logits(model, ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Uncached: the logits of the last position of ``ids`` (``mask``: the prompt's padding, None if
    it has none)."""
    n = ids.shape[1]
    ids, mask = _padded(model, ids, mask, "decoder")
    positions = None if mask is None else (mask.cumsum(-1) - 1).clamp(min=0)
    return model(ids, mask, position_ids=positions).logits[:, n - 1]


def _encdec_last_logits(model, out: torch.Tensor, memory: torch.Tensor, memory_mask) -> torch.Tensor:
    """Uncached: the logits of the last position of the decoder sequence ``out``."""
    n = out.shape[1]
    return model.decode(_padded(model, out, None, "decoder")[0], memory, memory_mask)[:, n - 1]


def _encode(model, src: torch.Tensor, src_mask: torch.Tensor | None):
    """The encoder output and its mask (the source padded first under sequence parallelism)."""
    src, src_mask = _padded(model, src, src_mask, "encdec")
    return model.encode(src, src_mask), src_mask


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
    use_cache = use_cache and _sequence_multiple(model) == 1
    cache = model.new_cache() if use_cache else None
    out, step_input = ids, ids
    for _ in range(steps):
        if use_cache:
            positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -step_input.shape[1] :]
            logits = model(step_input, mask if padded else None, position_ids=positions, cache=cache).logits[:, -1]
        else:
            logits = _decoder_last_logits(model, out, mask if padded else None)
        tok, done_next = _finish(
            next_token(logits, temperature, top_k, top_p, generator), done, eos, model.config.pad_token_id
        )
        out = torch.cat((out, tok[:, None]), dim=1)
        mask = torch.cat((mask, torch.ones_like(tok[:, None])), dim=1)
        step_input, done = tok[:, None], done_next
        if done.all():
            break
    return out


def _generate_encdec(model, src, src_mask, steps, temperature, top_k, top_p, eos, generator, use_cache):
    cfg = model.config
    memory, memory_mask = _encode(model, src, src_mask)
    out = torch.full((src.shape[0], 1), cfg.decoder_start_token_id, dtype=torch.long, device=src.device)
    done = torch.zeros(src.shape[0], dtype=torch.bool, device=src.device)
    use_cache = use_cache and _sequence_multiple(model) == 1
    cache = model.new_cache() if use_cache else None
    step_input = out
    for _ in range(steps):
        if use_cache:
            logits = model.decode(step_input, memory, memory_mask, cache=cache)[:, -1]
        else:
            logits = _encdec_last_logits(model, out, memory, memory_mask)
        tok, done_next = _finish(next_token(logits, temperature, top_k, top_p, generator), done, eos, cfg.pad_token_id)
        out = torch.cat((out, tok[:, None]), dim=1)
        step_input, done = tok[:, None], done_next
        if done.all():
            break
    return out


# -- beam search ---------------------------------------------------------------------------------


def _check_beam_args(num_beams: int, length_penalty: float | None, length_norm: LengthNorm) -> None:
    if not isinstance(num_beams, int) or num_beams < 1:
        raise ValueError(f"num_beams={num_beams} must be an integer >= 1 (1 = greedy)")
    if length_norm not in LENGTH_NORMS:
        raise ValueError(f"length_norm={length_norm!r} is not allowed; use one of: {', '.join(LENGTH_NORMS)}")
    if length_penalty is not None and not math.isfinite(length_penalty):
        raise ValueError(f"length_penalty={length_penalty} must be a finite number")


def length_normaliser(length: int, alpha: float, form: LengthNorm = "gnmt") -> float:
    """Divisor of a hypothesis' summed log-probability. ``gnmt`` (Wu et al. 2016, used by the
    Transformer paper with alpha 0.6): ``((5 + length) / 6) ** alpha``; ``power`` (HF
    ``transformers``' ``length_penalty``): ``length ** alpha``. alpha 0: raw log-probability."""
    return ((5.0 + length) / 6.0) ** alpha if form == "gnmt" else float(length) ** alpha


class _Stepper:
    """Feeds one decoding step of (batch * beams) rows to a decoder or an encoder-decoder through
    the KV cache (under sequence parallelism: the whole sequences so far, uncached); ``reorder``
    follows the beams that survived."""

    def __init__(self, model, ids: torch.Tensor, mask: torch.Tensor | None, k: int):
        self.model, self.encdec = model, isinstance(model, EncoderDecoderModel)
        if not self.encdec and not isinstance(model, DecoderModel):
            raise TypeError(f"beam search needs a decoder or encoder-decoder model, not {type(model).__name__}")
        self.cache = model.new_cache() if _sequence_multiple(model) == 1 else None
        self.started = False
        if self.encdec:
            memory, memory_mask = _encode(model, ids, mask)
            self.memory = memory.repeat_interleave(k, 0)
            self.memory_mask = memory_mask.repeat_interleave(k, 0) if memory_mask is not None else None
            self.first = torch.full(
                (ids.shape[0] * k, 1), model.config.decoder_start_token_id, dtype=torch.long, device=ids.device
            )
        else:
            mask = torch.ones_like(ids) if mask is None else mask.long()
            self.padded = bool((mask == 0).any())
            self.mask = mask.repeat_interleave(k, 0)
            self.first = ids.repeat_interleave(k, 0)
        self.seq = self.first  # uncached: every row's tokens so far

    def __call__(self, step_input: torch.Tensor) -> torch.Tensor:
        if self.started:  # a new token: extend the sequences (uncached) and the decoder mask
            if self.cache is None:
                self.seq = torch.cat((self.seq, step_input), dim=1)
            if not self.encdec:
                self.mask = torch.cat((self.mask, torch.ones_like(step_input)), dim=1)
        self.started = True
        if self.cache is None:
            if self.encdec:
                return _encdec_last_logits(self.model, self.seq, self.memory, self.memory_mask)
            return _decoder_last_logits(self.model, self.seq, self.mask if self.padded else None)
        if self.encdec:
            return self.model.decode(step_input, self.memory, self.memory_mask, cache=self.cache)[:, -1]
        positions = (self.mask.cumsum(-1) - 1).clamp(min=0)[:, -step_input.shape[1] :]
        return self.model(step_input, self.mask if self.padded else None, position_ids=positions, cache=self.cache).logits[
            :, -1
        ]

    def reorder(self, index: torch.Tensor) -> None:
        # Beams never leave their batch row, so the cross-attention cache (equal within a row)
        # needs no reordering: only the self-attention caches (or the uncached sequences) and the
        # decoder mask follow.
        if self.cache is None:
            self.seq = self.seq[index]
        else:
            for c in self.cache.self_kv:
                c.reorder(index)
        if not self.encdec:
            self.mask = self.mask[index]


@torch.no_grad()
def beam_search(
    model,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    *,
    num_beams: int = 4,
    attention_mask: torch.Tensor | None = None,
    length_penalty: float = 0.0,
    length_norm: LengthNorm = "gnmt",
    eos_token_id=_FROM_CONFIG,
    early_stopping: bool = False,
) -> torch.Tensor:
    """Batched beam search with the KV cache (cache rows reordered as beams are chosen).

    Each step scores every continuation of the ``k`` live beams, keeps the best ``2k``, moves those
    ending in EOS (among the best ``k``) to the row's finished set, scored ``sum log p /
    length_normaliser(length)`` (length counts generated tokens, EOS included), and continues the
    best ``k`` others. A row stops when its ``k`` finished hypotheses cannot be beaten by the best
    live beam at its current length (``early_stopping=True``: as soon as ``k`` are finished), or at
    ``max_new_tokens`` (live beams are then finished as they are). This is the algorithm of HF
    ``generate(num_beams=k)``; with ``length_norm="power"`` the scores are HF's too, so the tokens
    are the same. Returns what ``generate`` returns: the best hypothesis per row, pad after EOS."""
    _check_args(max_new_tokens, 0.0, None, None)
    _check_beam_args(num_beams, length_penalty, length_norm)
    cfg = model.config
    eos = cfg.eos_token_id if eos_token_id is _FROM_CONFIG else eos_token_id
    was_training = model.training
    model.eval()
    try:
        return _beam_search(
            model,
            input_ids,
            attention_mask,
            max_new_tokens,
            num_beams,
            float(length_penalty),
            length_norm,
            eos,
            early_stopping,
        )
    finally:
        model.train(was_training)


def _beam_search(model, ids, mask, steps, k, alpha, norm, eos, early_stopping):
    b, device, pad = ids.shape[0], ids.device, model.config.pad_token_id
    step = _Stepper(model, ids, mask, k)
    if steps == 0:
        return step.first.view(b, k, -1)[:, 0]
    neg = -1.0e9
    keep = 2 * k  # candidates kept per row and step
    top_k_mask = torch.arange(keep, device=device) < k  # only these may finish
    tokens = torch.full((b, k, steps), pad, dtype=torch.long, device=device)  # live beams
    scores = torch.zeros(b, k, device=device)
    scores[:, 1:] = neg  # all beams start equal: expand only the first
    done_tokens = torch.full((b, k, steps), pad, dtype=torch.long, device=device)
    done_scores = torch.full((b, k), neg, device=device)
    done_len = torch.zeros(b, k, dtype=torch.long, device=device)
    done_any = torch.zeros(b, k, dtype=torch.bool, device=device)
    open_rows = torch.ones(b, 1, dtype=torch.bool, device=device)  # improvement still possible
    rows = torch.arange(b, device=device)[:, None]
    step_input = step.first
    for t in range(steps):
        logp = torch.log_softmax(step(step_input).float(), dim=-1)
        vocab = logp.shape[-1]
        total = (logp.view(b, k, vocab) + scores[:, :, None]).view(b, k * vocab)
        cand_scores, flat = torch.topk(total, keep, dim=1)
        beam, tok = flat // vocab, flat % vocab
        cand_tokens = tokens[rows, beam]  # (b, 2k, steps)
        cand_tokens[:, :, t] = tok
        ends = (tok == eos) if eos is not None else torch.zeros_like(tok, dtype=torch.bool)
        if t == steps - 1:
            ends = torch.ones_like(ends)  # the length limit finishes every beam
        # continue the best k candidates that did not end
        live = torch.topk(cand_scores + ends.float() * neg, k, dim=1).indices
        tokens, scores = cand_tokens[rows, live], (cand_scores + ends.float() * neg)[rows, live]
        # finish the candidates that ended (among the best k), if they beat the row's finished set
        normed = cand_scores / length_normaliser(t + 1, alpha, norm)
        full = done_any.all(dim=1, keepdim=True) & early_stopping
        normed = normed + (full | ~open_rows).float() * neg + (~(ends & top_k_mask)).float() * neg
        merged = torch.topk(torch.cat((done_scores, normed), dim=1), k, dim=1).indices
        done_tokens = torch.cat((done_tokens, cand_tokens), dim=1)[rows, merged]
        done_scores = torch.cat((done_scores, normed), dim=1)[rows, merged]
        done_len = torch.cat((done_len, torch.full_like(tok, t + 1)), dim=1)[rows, merged]
        done_any = torch.cat((done_any, ends & top_k_mask), dim=1)[rows, merged]
        step.reorder((rows * k + beam[rows, live]).reshape(-1))
        step_input = tokens[:, :, t].reshape(-1, 1)
        # can the best live beam (at today's length) still beat the worst finished one?
        best_live = scores[:, :1] / length_normaliser(t + 1, alpha, norm)
        worst_done = torch.where(done_any, done_scores.min(dim=1, keepdim=True).values, torch.full_like(done_scores, neg))
        open_rows = open_rows & (best_live > worst_done).any(dim=1, keepdim=True)
        if not open_rows.any() or (early_stopping and done_any.all()) or bool(ends.all()):
            break
    best_len = int(done_len[:, 0].max())
    out = done_tokens[:, 0, :best_len]
    if eos is not None:  # pad after EOS, as generate() does
        after = (out == eos).long().cumsum(1) - (out == eos).long() > 0
        out = out.masked_fill(after, pad)
    out = out.masked_fill(torch.arange(best_len, device=device)[None] >= done_len[:, :1], pad)
    first = step.first.view(b, k, -1)[:, 0]
    return torch.cat((first, out), dim=1)
