"""The FLOPs formula per family equals what torch's FlopCounterMode counts on a real step."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from tformer import build_model
from tformer.models.flops import training_flops, training_flops_per_token

from conftest import TINY


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("overrides", [{}, {"num_kv_heads": 1, "d_head": 24, "pad_vocab_multiple": 64}])
def test_training_flops_match_flop_counter(name, overrides):
    if overrides.get("num_kv_heads") and name != "llama-tiny":
        overrides = {"d_head": 24, "pad_vocab_multiple": 64}
    # The explicit math path runs attention as plain matmuls, which the counter sees exactly.
    model = build_model(name, attn_impl="math", vocab_size=1000, **overrides)
    b, s, t = 2, 24, 10
    ids = torch.randint(0, 1000, (b, s))
    labels = torch.randint(0, 1000, (b, t if model.config.family == "encdec" else s))
    with FlopCounterMode(display=False) as counter:
        model(ids, labels=labels).loss.backward()
    assert counter.get_total_flops() == training_flops(model.config, b, s, t)


def test_flops_per_token_grows_with_context_and_is_6n_for_short_sequences():
    with torch.device("meta"):
        cfg = build_model("gpt2-small").config
        n = build_model("gpt2-small").num_parameters(exclude_embeddings=True) + 50257 * 768
    short, long = training_flops_per_token(cfg, 8), training_flops_per_token(cfg, 1024)
    assert long > short
    assert short == pytest.approx(6 * n, rel=0.01)  # the 6N rule when attention is negligible


def test_encdec_needs_target_len():
    cfg = build_model("t5-tiny").config
    with pytest.raises(ValueError, match="target_len"):
        training_flops(cfg, 1, 8)
