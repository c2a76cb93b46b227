"""The model registry (tformer/models/spec.py): a flavour registered from outside the package is
built, trained, planned and exported through its spec alone, with no family switch to edit.

The throwaway flavour ``toy_gpt`` is what CONTRIBUTING's worked example adds: its model file (here
a subclass of the decoder with its own FLOP count), its spec (one ``register`` line) and its
exporter (here the GPT-2 exporter module, handed over as an object rather than a module path).
"""

from __future__ import annotations

import pytest
import torch
import transformers

import tformer
from tformer.config import ConfigError
from tformer.export import gpt2
from tformer.export.hf import TARGETS, export_hf
from tformer.models import DecoderModel, ModelSpec, build_model, register, spec_of
from tformer.models.flops import training_flops
from tformer.models.spec import SPECS, unregister
from tformer import plan
from tformer.plan.memory_report import plan_main
from tformer.train.config import load_config
from tformer.train.trainer import Trainer

from train_helpers import CONFIGS, small_overrides


class ToyDecoder(DecoderModel):
    """The flavour's model file: the decoder, counting its FLOPs as ten times the decoder's (a
    number no built-in family gives, so the test sees whose count the callers used)."""

    @classmethod
    def forward_flops(cls, cfg, batch, seq, target):
        return 10 * super().forward_flops(cfg, batch, seq, target)


@pytest.fixture
def toy_flavour():
    spec = register(ModelSpec("toy_gpt", ToyDecoder, exporter=gpt2))
    try:
        yield spec
    finally:
        unregister("toy_gpt")


def test_registry_refuses_a_second_spec_under_one_name(toy_flavour):
    with pytest.raises(ConfigError, match="toy_gpt"):
        register(ModelSpec("toy_gpt", DecoderModel))
    assert SPECS["toy_gpt"] is toy_flavour


def test_every_preset_has_a_registered_spec_of_its_family():
    """A preset whose flavour lost its registry line would fall back to a spec without exporter."""
    for name in tformer.PRESETS:
        cfg = tformer.preset(name)
        spec = spec_of(cfg)
        assert spec is SPECS[cfg.flavour], name
        assert spec.family == cfg.family and spec.exporter is not None, name


def test_a_flavour_registered_in_a_test_trains_plans_and_exports(toy_flavour, tmp_path, monkeypatch):
    monkeypatch.setenv("TFORMER_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    cfg = load_config(
        CONFIGS / "gpt2-tiny.yaml",
        small_overrides(
            "gpt2-tiny",
            out,
            "model.flavour=toy_gpt",
            "max_steps=2",
            "eval_every=0",
            "save_every=0",
            "eval_batches=2",
            "model.vocab_size=512",
            "data.seq_len=32",
            "micro_batch_size=4",
            "data.tokenizer_max_rows=2000",
        ),
    )
    # built through the spec: the flavour's own class, and its FLOP count is the one callers read
    model = build_model(cfg.model)
    assert type(model) is ToyDecoder
    plain = cfg.model.replace(flavour="gpt2")
    assert training_flops(cfg.model, 2, 32) == 10 * training_flops(plain, 2, 32)

    trainer = Trainer(cfg)
    trainer.fit()
    assert type(trainer.model) is ToyDecoder
    assert trainer.step == 2

    # planned: the planner counts the flavour's own modules, and `tformer plan` recommends a layout
    assert plan.num_parameters(cfg.model) == model.num_parameters()
    e = plan.estimate(cfg.model, "ddp", 1, 4, 32, mixed=False)
    assert e.model_states == 16 * model.num_parameters()
    assert plan_main(cfg, "toy_gpt", 2, "1GiB", max_pp=2) == 0

    # exported through the spec's exporter, with logits equal to the trained model's
    assert TARGETS["toy_gpt"] is gpt2
    hf_dir = export_hf(out, tmp_path / "hf")
    trained = tformer.load_checkpoint(out).eval()
    assert type(trained) is ToyDecoder
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    ids = torch.randint(0, cfg.model.vocab_size, (2, 12))
    with torch.no_grad():
        ours, theirs = trained(ids).logits, hf(ids).logits
    assert (ours - theirs).abs().max().item() <= 1e-4


def test_an_unregistered_flavour_builds_its_family_without_an_exporter():
    cfg = tformer.preset("gpt2-tiny").replace(flavour="custom")
    spec = spec_of(cfg)
    assert spec.model is DecoderModel and spec.exporter is None
    assert "custom" not in TARGETS
