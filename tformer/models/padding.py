"""The one padding path of training, evaluation and decoding: a batch's sequences padded at the
end to a multiple of the sequence-parallel degree. It reads the family's data layout from the
family table (``spec.FAMILY_CLASSES``), so it sits above the families."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .spec import FAMILY_CLASSES


# What a field pads with, beside the ids (the pad id): nothing attends to it, no loss counts it,
# a packed row's padding is a document of its own (-1: nobody attends to it; it attends anywhere)
_SOURCE = {"attention_mask": 0, "token_type_ids": 0, "doc_ids": -1, "position_ids": 0}
_TARGET = {"decoder_attention_mask": 0, "decoder_doc_ids": -1, "decoder_position_ids": 0}


def pad_sequences(inputs: dict, multiple: int, pad_id: int, family: str) -> dict:
    """A batch's sequences padded at the end to a multiple of ``multiple`` (sequence parallelism
    splits them evenly over the tp ranks): the one padding path of training, evaluation and decoding.

    Added positions are padding: ids ``pad_id``, attention mask 0 (created for bidirectional
    stacks if the batch had none), labels -100, a packed row's document ids -1 and positions 0; they
    sit at the end, so causal positions never see them, and no loss, gradient or logit of a real
    position changes. An encoder-decoder's targets (labels and the decoder's own fields) pad too."""
    if multiple <= 1:
        return inputs
    kind = FAMILY_CLASSES[family]  # type: ignore[index]
    out = dict(inputs)

    def grow(t, n, value):
        return F.pad(t, (0, n), value=value) if n else t

    n = -out["input_ids"].shape[1] % multiple
    if n:
        if "attention_mask" not in out and not kind.CAUSAL_LM:
            out["attention_mask"] = torch.ones_like(out["input_ids"])
        out["input_ids"] = grow(out["input_ids"], n, pad_id)
        for key, value in _SOURCE.items():
            if key in out:
                out[key] = grow(out[key], n, value)
        if not kind.SEQ2SEQ and "labels" in out:
            out["labels"] = grow(out["labels"], n, -100)
    if kind.SEQ2SEQ and "labels" in out:
        m = -out["labels"].shape[1] % multiple
        out["labels"] = grow(out["labels"], m, -100)
        if "decoder_input_ids" in out:
            out["decoder_input_ids"] = grow(out["decoder_input_ids"], m, pad_id)
        for key, value in _TARGET.items():
            if key in out:
                out[key] = grow(out[key], m, value)
    return out
