"""The FLOPs formula per family equals what torch's FlopCounterMode counts on a real step."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from tformer import build_model
from tformer.models.flops import training_flops, training_flops_per_token
from tformer.nn.moe import Experts

from conftest import TINY


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("overrides", [{}, {"num_kv_heads": 1, "d_head": 24, "pad_vocab_multiple": 64}])
def test_training_flops_match_flop_counter(name, overrides):
    if overrides.get("num_kv_heads") and name != "llama-tiny":
        overrides = {"d_head": 24, "pad_vocab_multiple": 64}
    # The explicit math path runs attention as plain matmuls, which the counter sees exactly.
    model = build_model(name, attn_impl="math", vocab_size=1000, **overrides)
    for module in model.modules():
        if isinstance(module, Experts):
            module.grouped = False  # the counter has no formula for torch._grouped_mm; plain matmuls it sees
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


def test_moe_flops_and_parameters_are_the_active_ones():
    """Mixtral 8x7B: 46.7B parameters, 12.9B active per token (Mistral AI's figures); FLOPs per
    token follow the active ones (6N at short sequences), and a Switch model counts every other block."""
    with torch.device("meta"):
        mixtral = build_model("mixtral-8x7b")
        assert mixtral.num_parameters() == 46_702_792_704
        active = mixtral.num_active_parameters()
        assert round(active / 1e9, 1) == 12.9
        lookup = 32000 * 4096  # the input embedding is a lookup, no matmul (the untied head is one)
        per_token = training_flops_per_token(mixtral.config, 8)
        assert per_token == pytest.approx(6 * (active - lookup), rel=0.002)
        dense = build_model("t5-tiny", d_ff=128)
        switch = build_model("switch-tiny")
    assert training_flops(switch.config, 2, 24, 10) > training_flops(dense.config, 2, 24, 10)  # + routers
