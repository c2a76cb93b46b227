"""One source of decoding defaults: the recipe's ``decode`` section, saved with the run.

Every checkpoint directory (and its run directory) holds the resolved ``config.yaml``. Its
``decode`` section (num_beams, length_penalty, length_norm, max_new_tokens) is how the run
translates: ``eval_bleu`` during training and ``tformer evaluate --bleu`` decode with it, and
``tformer generate`` and the HF export's ``generation_config.json`` take it as their defaults too
(command-line flags override it). Runs that do not translate (``data.objective`` other than
``seq2seq``: language models, span corruption) have no decoding recipe: greedy, as HF's default.
"""

from __future__ import annotations

from pathlib import Path

from ..checkpoint.runconfig import find_run_config as saved_config  # its old name here
from .config import DecodeConfig, config_from_dict


def saved_decode(path: str | Path) -> DecodeConfig | None:
    """The ``decode`` settings of the translation run that wrote ``path``, with ``max_new_tokens``
    resolved to the run's target length when the recipe leaves it to the data (as BLEU does); None
    for a run that does not translate, or one without a config.yaml."""
    raw = saved_config(path)
    if raw is None or (raw.get("data") or {}).get("objective") != "seq2seq":
        return None
    decode = config_from_dict({"decode": raw.get("decode") or {}}).decode  # validated like the recipe
    if decode.max_new_tokens is None:
        decode.max_new_tokens = (raw.get("data") or {}).get("target_len") or (raw.get("data") or {}).get("seq_len")
    return decode


def decoded_bleu(decode: DecodeConfig, model, pairs, tokenizer, n: int, device=None):
    """BLEU / chrF (``evaluate.BleuResult``) of the first ``n`` of ``pairs`` decoded with the run's
    ``decode`` settings: what ``eval_bleu`` logs in training and ``tformer evaluate --bleu`` prints."""
    from ..evaluate import bleu

    d = decode
    beams = dict(num_beams=d.num_beams, length_penalty=d.length_penalty, length_norm=d.length_norm)
    lengths = dict(batch_size=d.batch_size, max_new_tokens=d.max_new_tokens)
    return bleu(model, pairs, tokenizer, range(n), device=device, **beams, **lengths)
