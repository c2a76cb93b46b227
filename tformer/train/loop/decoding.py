"""BLEU / chrF of a translation run, decoded with its ``decode`` section: what ``eval_bleu`` logs in
training and ``tformer evaluate --bleu`` prints.

The section itself (``DecodeConfig``) lives in tformer/decode_config.py and a checkpoint's saved settings
are read by ``checkpoint.runconfig.saved_decode``, below this package, because ``tformer generate``
and the HF export's ``generation_config.json`` take them as their defaults too.
"""

from __future__ import annotations

from ...decode_config import DecodeConfig
from ...evaluate import bleu


def decoded_bleu(decode: DecodeConfig, model, pairs, tokenizer, n: int, device=None):
    """BLEU / chrF (``evaluate.BleuResult``) of the first ``n`` of ``pairs`` decoded with the run's
    ``decode`` settings: what ``eval_bleu`` logs in training and ``tformer evaluate --bleu`` prints."""
    d = decode
    beams = dict(num_beams=d.num_beams, length_penalty=d.length_penalty, length_norm=d.length_norm)
    lengths = dict(batch_size=d.batch_size, max_new_tokens=d.max_new_tokens)
    return bleu(model, pairs, tokenizer, range(n), device=device, **beams, **lengths)
