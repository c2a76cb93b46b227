"""Translation quality: decode source -> target pairs with the run's decoding settings and score the
output with ``sacrebleu`` (corpus BLEU and chrF, with sacrebleu's signature).

References are the dataset's target sides as the run's tokenizer decodes them (the text the model
was trained to produce), so tokenization round-trips never count as errors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import LengthNorm
from .generate import generate


@dataclass
class BleuResult:
    bleu: float
    chrf: float
    signature: str  # sacrebleu's BLEU signature (tokenizer, smoothing, version)
    chrf_signature: str
    hypotheses: list[str]
    references: list[str]

    def record(self) -> dict:
        return {"val_bleu": self.bleu, "val_chrf": self.chrf, "bleu_signature": self.signature}


def corpus_scores(hypotheses: list[str], references: list[str]) -> tuple[float, float, str, str]:
    """Corpus BLEU and chrF of ``hypotheses`` against one reference each, and their signatures."""
    from sacrebleu.metrics import BLEU, CHRF

    bleu, chrf = BLEU(), CHRF()
    b = bleu.corpus_score(hypotheses, [references])
    c = chrf.corpus_score(hypotheses, [references])
    return b.score, c.score, str(bleu.get_signature()), str(chrf.get_signature())


@torch.no_grad()
def translate_pairs(
    model,
    pairs,
    tokenizer,
    indices,
    *,
    batch_size: int = 32,
    num_beams: int = 4,
    length_penalty: float | None = 0.6,
    length_norm: LengthNorm = "gnmt",
    max_new_tokens: int | None = None,
    device=None,
) -> tuple[list[str], list[str]]:
    """Decode the sources of ``pairs`` (a ``Seq2SeqPairs``) at ``indices``; returns hypotheses and
    references as text. Sources are sorted by length into batches (less padding), results are
    returned in the order of ``indices``."""
    cfg = model.config
    device = device or next(model.parameters()).device
    samples = [pairs.sample(int(i)) for i in indices]
    order = sorted(range(len(samples)), key=lambda j: len(samples[j]["input_ids"]))
    limit = max_new_tokens or pairs.max_target_length
    hyps = [""] * len(samples)  # every slot is filled below: ``order`` is a permutation
    for start in range(0, len(order), batch_size):
        group = order[start : start + batch_size]
        width = max(len(samples[j]["input_ids"]) for j in group)
        ids = torch.full((len(group), width), cfg.pad_token_id, dtype=torch.long)
        mask = torch.zeros(len(group), width, dtype=torch.long)
        for row, j in enumerate(group):
            src = torch.as_tensor(samples[j]["input_ids"])
            ids[row, : len(src)], mask[row, : len(src)] = src, 1
        out = generate(
            model,
            ids.to(device),
            limit,
            attention_mask=mask.to(device),
            num_beams=num_beams,
            length_penalty=length_penalty if num_beams > 1 else None,
            length_norm=length_norm,
        )
        for row, j in enumerate(group):
            hyps[j] = tokenizer.decode(out[row, 1:].tolist(), skip_special_tokens=True)
    refs = [tokenizer.decode([t for t in s["labels"].tolist() if t >= 0], skip_special_tokens=True) for s in samples]
    return hyps, refs


def bleu(model, pairs, tokenizer, indices, **decode) -> BleuResult:
    hyps, refs = translate_pairs(model, pairs, tokenizer, indices, **decode)
    b, c, sig, csig = corpus_scores(hyps, refs)
    return BleuResult(b, c, sig, csig, hyps, refs)
