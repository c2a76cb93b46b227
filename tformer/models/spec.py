"""One registered ``ModelSpec`` per model flavour, and the registry the layers above read.

A spec says how to build its model, how a pipeline stage is cut from it, how it is counted (the
planner's parameters, activations and FLOPs) and which TP plan and HF exporter it takes. The
family code answers every question about shapes itself (``TformerModel``'s class attributes and
class methods: ``STACKS``, ``stack_shapes``, ``forward_flops``, ``cut_stage`` ...); the spec binds a
flavour name to it, so the layers above ask ``spec_of(cfg)`` instead of comparing family strings.

Layering: specs live in ``models/``, below ``parallel/`` and ``export/``. A spec therefore *names*
its exporter by module path (``"tformer.export.gpt2"``), which ``tformer.export`` imports when it
exports; a spec registered from a higher layer (a plugin, a test) may hand the module itself. Its
TP plan is a callable or None: None is the plan ``parallel/tp.py`` reads off the module names every
family shares (q/k/v, o_proj, ffn.up/gate/down, embed.tok, lm_head), which all built-in flavours use.

Adding a flavour: its model file (if the shared blocks do not already express it), its spec below
(or a ``register(ModelSpec(...))`` from your own code), its exporter module. See CONTRIBUTING.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..config import ConfigError, Family, ModelConfig, check_table
from .base import TformerModel
from .decoder import DecoderModel
from .encdec import EncoderDecoderModel
from .encoder import EncoderModel

FAMILY_CLASSES: dict[Family, type[TformerModel]] = {
    "encoder": EncoderModel,
    "decoder": DecoderModel,
    "encdec": EncoderDecoderModel,
}
check_table(FAMILY_CLASSES, Family, "FAMILY_CLASSES")


@dataclass(frozen=True)
class ModelSpec:
    """A flavour: its family's model class and what the layers above attach to it."""

    flavour: str  # the registry key; for an exportable flavour also the HF ``model_type``
    model: type[TformerModel]
    exporter: str | Any | None = None  # module path or module of the HF exporter (export/hf.py)
    tp_plan: Callable[..., dict] | None = None  # (model, sp, loss_parallel) -> plan; None: parallel/tp.py's

    @property
    def family(self) -> Family:
        return self.model.FAMILY

    # -- what the family code says about its data, for the layers above -------------------------
    @property
    def seq2seq(self) -> bool:
        """Labels are a second (target) sequence read by a decoder with cross-attention."""
        return self.model.SEQ2SEQ

    @property
    def causal_lm(self) -> bool:
        """One causal stack over one stream: prompts start with BOS, no padding mask is needed."""
        return self.model.CAUSAL_LM

    @property
    def encoder_only(self) -> bool:
        """One bidirectional stack over padded rows (no causal stack): its batch carries a padding mask."""
        return not self.causal_lm and not self.seq2seq

    @property
    def masked_lm(self) -> bool:
        """The head runs only at labelled (masked) positions and has its own dense + norm."""
        return self.model.MASKED_LM

    def build(self, cfg: ModelConfig) -> TformerModel:
        return self.model(cfg)

    def output_len(self, seq: int, target: int | None) -> int:
        """Positions the head reads: the target's for a seq2seq model (default: as long as the input)."""
        return (target or seq) if self.seq2seq else seq

    def stack_shapes(self, cfg: ModelConfig, seq: int, target: int | None) -> list[tuple[int, int, int | None]]:
        return self.model.stack_shapes(cfg, seq, target)

    def forward_flops(self, cfg: ModelConfig, batch: int, seq: int, target: int | None) -> int:
        return self.model.forward_flops(cfg, batch, seq, target)


SPECS: dict[str, ModelSpec] = {}


def register(spec: ModelSpec, replace: bool = False) -> ModelSpec:
    """Add ``spec`` under its flavour (``replace``: over an existing one, e.g. in a test)."""
    if spec.flavour in SPECS and not replace:
        raise ConfigError(f"model flavour {spec.flavour!r} is already registered; pick another name")
    SPECS[spec.flavour] = spec
    return spec


def unregister(flavour: str) -> None:
    SPECS.pop(flavour, None)


def spec_of(cfg: ModelConfig) -> ModelSpec:
    """The spec of ``cfg``'s flavour; a flavour not registered for this family (``custom``) gets the
    family's model with no exporter, so a model without an HF twin still trains and plans."""
    spec = SPECS.get(cfg.flavour)
    if spec is not None and spec.family == cfg.family:
        return spec
    return ModelSpec(cfg.flavour, FAMILY_CLASSES[cfg.family])


# the built-in flavours: one line each
register(ModelSpec("bert", EncoderModel, "tformer.export.bert"))
register(ModelSpec("modernbert", EncoderModel, "tformer.export.modernbert"))
register(ModelSpec("gpt2", DecoderModel, "tformer.export.gpt2"))
register(ModelSpec("llama", DecoderModel, "tformer.export.llama"))
register(ModelSpec("mixtral", DecoderModel, "tformer.export.mixtral"))
register(ModelSpec("qwen2_moe", DecoderModel, "tformer.export.qwen2_moe"))
register(ModelSpec("deepseek_v3", DecoderModel, "tformer.export.deepseek_v3"))
register(ModelSpec("qwen3", DecoderModel, "tformer.export.qwen3"))
register(ModelSpec("qwen3_moe", DecoderModel, "tformer.export.qwen3_moe"))
register(ModelSpec("gpt_oss", DecoderModel, "tformer.export.gpt_oss"))
register(ModelSpec("gemma3", DecoderModel, "tformer.export.gemma3"))  # Gemma3ForCausalLM (text)
register(ModelSpec("t5", EncoderDecoderModel, "tformer.export.t5"))  # v1.0 (tied) and v1.1 (untied)
register(ModelSpec("switch_transformers", EncoderDecoderModel, "tformer.export.switch_transformers"))
register(ModelSpec("t5gemma", EncoderDecoderModel, "tformer.export.t5gemma"))
register(ModelSpec("marian", EncoderDecoderModel, "tformer.export.marian"))  # the paper's Transformer
