"""Export a tformer checkpoint to a HF ``transformers`` directory, and import one back.

    export_hf("runs/gpt2-tiny", "hf/gpt2-tiny")        # -> AutoModelForCausalLM.from_pretrained
    import_hf("hf/gpt2-tiny", "runs/gpt2-continued")   # -> tformer train ... resume=runs/gpt2-continued

The target is the model's ``flavour`` (bert, gpt2, llama, t5). Every config switch is checked
against what the target class can express: anything else is an ``ExportError`` naming the field,
never a silently dropped tensor. Output appears in one rename once complete.
"""

from __future__ import annotations

import importlib
import logging
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from ..checkpoint.io import RUN_CONFIG, WEIGHTS, commit, partial_dir, write_bytes_durable
from ..checkpoint.state import TrainerState
from ..checkpoint.runconfig import run_config_yaml, saved_decode
from ..config import ModelConfig
from ..files import save_safetensors
from ..models import SPECS, spec_of
from ..models.base import TformerModel
from .common import (
    ExportError,
    atomic_dir,
    check_against,
    check_out_dir,
    check_tokenizer,
    find_tokenizer,
    from_hf,
    hf_expected,
    hf_saved_layout,
    model_shapes,
    read_hf_weights,
    read_model_state,
    resolve_checkpoint,
    save_generation_config,
    save_hf_tokenizer,
    to_hf,
    unique_tensors,
    unpad_vocab,
    write_safetensors,
)

log = logging.getLogger("tformer.export")


class _Targets(Mapping):
    """flavour (= HF model_type) -> the module that maps it: the ``exporter`` of every registered
    ``ModelSpec`` (models/spec.py names it by module path; it is imported here, the layer that may)."""

    def _all(self) -> dict[str, Any]:
        return {name: _module(spec.exporter) for name, spec in SPECS.items() if spec.exporter is not None}

    def __getitem__(self, flavour: str) -> Any:
        spec = SPECS.get(flavour)
        if spec is None or spec.exporter is None:
            raise KeyError(flavour)
        return _module(spec.exporter)

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())


def _module(exporter: Any) -> Any:
    return importlib.import_module(exporter) if isinstance(exporter, str) else exporter


TARGETS = _Targets()
DEFAULT_SHARD_SIZE = "5GB"


def target_of(cfg: ModelConfig):
    target = TARGETS.get(cfg.flavour)
    if target is None:
        raise ExportError(
            f"model flavour={cfg.flavour!r} has no HF equivalent; exportable flavours are "
            f"{', '.join(TARGETS)} (set flavour to the one whose switches the model uses)"
        )
    return target


def check_moe(cfg: ModelConfig, target) -> None:
    """Mixture-of-experts FFNs go only to the HF classes that have them (``MOE = True``)."""
    if cfg.moe.enabled and not getattr(target, "MOE", False):
        moe_targets = ", ".join(f"{name} ({t.HF_CLASS})" for name, t in TARGETS.items() if getattr(t, "MOE", False))
        raise ExportError(
            f"cannot export to HF {target.HF_CLASS}: moe=(num_experts={cfg.moe.num_experts}): it has no mixture-of-experts "
            f"FFN, and a {cfg.family} with MoE has HF twins only among flavours {moe_targets or 'none'}"
        )


def check_qkv_bias(cfg: ModelConfig, target) -> None:
    """Biases on q/k/v alone go only to the HF classes that have them (``QKV_BIAS = True``)."""
    if cfg.attn_qkv_bias != cfg.bias and not getattr(target, "QKV_BIAS", False):
        raise ExportError(
            f"cannot export to HF {target.HF_CLASS}: qkv_bias={cfg.qkv_bias} with bias={cfg.bias}: it has one bias "
            "switch for every projection; set qkv_bias=null"
        )


def check_blocks(cfg: ModelConfig, target) -> None:
    """Latent attention and DeepSeek-V3's routing go only to the HF classes that have them
    (``MLA``, ``SIGMOID_ROUTING`` = True)."""
    moe = cfg.moe
    found = [
        cfg.latent_attention and not getattr(target, "MLA", False) and "attention=mla (latent attention)",
        moe.enabled
        and not getattr(target, "SIGMOID_ROUTING", False)
        and (moe.router_score == "sigmoid" or moe.first_dense or moe.routed_scaling_factor != 1.0)
        and f"moe=(router_score={moe.router_score}, first_dense={moe.first_dense}, routed_scaling_factor="
        f"{moe.routed_scaling_factor}) (DeepSeek-V3's routing)",
    ]
    found.append(cfg.mtp_depth and not hasattr(target, "drop_mtp") and f"mtp_depth={cfg.mtp_depth} (multi-token prediction)")
    found = [f for f in found if f]
    if found:
        raise ExportError(f"cannot export to HF {target.HF_CLASS}: {found[0]} has no place in it; use flavour=deepseek_v3")


# Switches only some HF classes have: (field, its "off" value, the exporter attribute that says the
# class has it, what the switch is). Off, they export anywhere; on, only to a class that has them.
SWITCHES = (
    ("qk_norm", "none", "QK_NORM", "a norm on each head's queries and keys"),
    ("attn_window", None, "WINDOW", "local (sliding-window) attention"),
    ("attn_sinks", False, "SINKS", "attention sinks"),
    ("yarn.factor", None, "YARN", "YaRN rotary scaling"),
    ("moe.expert_bias", False, "GPT_OSS_EXPERTS", "biases in the experts"),
    ("moe.swiglu_limit", None, "GPT_OSS_EXPERTS", "gpt-oss's clamped SwiGLU"),
    ("global_offset", None, "GLOBAL_OFFSET", "global blocks at an offset other than the last of each group"),
    ("rope_local_theta", None, "LOCAL_ROPE", "a RoPE base of the windowed blocks' own"),
    ("attn_softcap", None, "SOFTCAP", "soft-capped attention logits"),
    ("final_softcap", None, "SOFTCAP", "soft-capped output logits"),
    ("query_pre_attn_scalar", None, "QUERY_SCALAR", "an attention scale other than d_head's"),
    ("sandwich_norm", False, "SANDWICH", "sandwich norms"),
    ("norm_unit_offset", False, "GEMMA_NORM", "RMSNorm gains as offsets from 1"),
    ("embed_scale_dtype", False, "GEMMA_NORM", "the embedding scale rounded to the activations' dtype"),
    ("first_attn_norm", True, "FIRST_ATTN_NORM", "a block 0 whose attention input is the embedding norm's output"),
    ("head_bias", True, "HEAD_BIAS_OFF", "an MLM head whose dense layer has no bias"),
    ("shared_embeddings", True, "OWN_ENCODER_EMBED", "an encoder token embedding apart from the decoder's"),
    ("rope_linear", 1.0, "LINEAR_ROPE", "linear rotary scaling"),
)


def check_switches(cfg: ModelConfig, target) -> None:
    """Each switch of ``SWITCHES`` that is on goes only to a class that has it: else one line
    naming the field and the flavours that do."""
    for field, off, attr, what in SWITCHES:
        section, _, name = field.rpartition(".")
        value = getattr(getattr(cfg, section) if section else cfg, name)
        if value != off and not getattr(target, attr, False):
            have = ", ".join(name for name, t in TARGETS.items() if getattr(t, attr, False))
            raise ExportError(
                f"cannot export to HF {target.HF_CLASS}: {field}={value!r}: it has no {what}; "
                f"set {field}={'null' if off is None else off} or use a flavour that has it ({have or 'none'})"
            )


def to_hf_state(cfg: ModelConfig, state: dict[str, torch.Tensor]):
    """(HF config, HF tensors) of our model tensors (each tied tensor once, under its first name):
    the whole export but the files. Every tensor is checked against the HF class's parameters."""
    target = target_of(cfg)
    check_moe(cfg, target)
    check_qkv_bias(cfg, target)
    check_blocks(cfg, target)
    check_switches(cfg, target)
    target.check(cfg)
    hf_config = target.hf_config(cfg)
    dtype = state["embed.tok.weight"].dtype
    hf_config.dtype = str(dtype).removeprefix("torch.")
    state = unpad_vocab(cfg, state)
    if hasattr(target, "drop_mtp"):  # DeepSeek-V3: HF has no multi-token prediction module
        state = target.drop_mtp(state)
    if hasattr(target, "before_export"):  # e.g. Marian: our d_model order -> HF's
        state = target.before_export(cfg, state)
    hf_state = to_hf(state, target.rules(cfg), target.HF_CLASS)
    if hasattr(target, "after_export"):  # e.g. gpt-oss: our stacked experts -> its interleaved layout
        hf_state = target.after_export(cfg, hf_state)
    if hasattr(target, "fill"):
        hf_state.update(target.fill(cfg, dtype))
    unique, aliases = hf_expected(hf_config, target.HF_CLASS)
    # parameters HF itself does not save but recomputes on load (Marian's sinusoidal tables)
    unique = {k: v for k, v in unique.items() if k not in getattr(target, "NOT_SAVED", ())}
    # persistent HF buffers mapped from ours (DeepSeek-V3's e_score_correction_bias) are no parameters
    held = {k: hf_state.pop(k) for k in list(hf_state) if k.endswith(getattr(target, "HF_BUFFERS", ()) or ("\0",))}
    check_against(hf_state, (unique, aliases), target.HF_CLASS)
    hf_state.update(held)
    if hasattr(target, "buffers"):  # persistent HF buffers (Marian's final_logits_bias)
        hf_state.update(target.buffers(cfg, dtype))
    if getattr(target, "MOE", False):  # written one tensor per expert, as HF writes them
        hf_state = hf_saved_layout(hf_config, target.HF_CLASS, hf_state)
    return hf_config, hf_state


def to_hf_model(model: TformerModel, attn_implementation: str = "sdpa"):
    """The HF ``transformers`` model holding ``model``'s weights: what ``export_hf`` and
    ``from_pretrained`` give (through a temporary directory, without the tokenizer), on the model's
    device and dtype. For side-by-side checks and benchmarks against HF."""
    import tempfile

    import transformers

    cfg = model.config
    state = {name: t.detach().cpu() for name, t in unique_tensors(model).items()}
    hf_config, hf_state = to_hf_state(cfg, state)
    cls = getattr(transformers, target_of(cfg).HF_CLASS)
    if attn_implementation == "sdpa" and not cls._supports_sdpa:
        attn_implementation = "eager"  # gpt-oss: its sinks have no SDPA path in transformers
    weight = state["embed.tok.weight"]
    with tempfile.TemporaryDirectory(prefix="tformer-hf-") as tmp:
        hf_config.save_pretrained(tmp)
        write_safetensors(hf_state, Path(tmp), DEFAULT_SHARD_SIZE)
        hf = cls.from_pretrained(tmp, attn_implementation=attn_implementation, dtype=weight.dtype)
    device = next(model.parameters()).device
    return hf.to(device).train(model.training)


def export_hf(
    checkpoint: str | Path,
    out_dir: str | Path,
    force: bool = False,
    tokenizer: str | Path | None = None,
    max_shard_size: int | str = DEFAULT_SHARD_SIZE,
    trust: bool = False,
) -> Path:
    """Write ``out_dir`` (config, safetensors, generation config, tokenizer) for the checkpoint
    (or a run directory's newest one). Everything is checked before anything is written; the
    checkpoint's pickles go through an allow-list unless ``trust``."""
    from ..data import DataError, load_tokenizer

    out = Path(out_dir)
    check_out_dir(out, force, Path(checkpoint))
    ckpt = resolve_checkpoint(checkpoint, trust)
    cfg, state = read_model_state(ckpt, trust)
    target = target_of(cfg)
    hf_config, hf_state = to_hf_state(cfg, state)

    tok_path = Path(tokenizer) if tokenizer is not None else find_tokenizer(ckpt)
    if tok_path is None:
        raise ExportError(
            f"no tokenizer.json in {ckpt} or its run directory; pass the one the model was trained with (--tokenizer PATH)"
        )
    try:
        tok = load_tokenizer(tok_path)
    except DataError as e:
        raise ExportError(str(e)) from None
    check_tokenizer(tok, cfg)

    with atomic_dir(out, force, ckpt) as tmp:
        hf_config.save_pretrained(str(tmp))
        write_safetensors(hf_state, tmp, max_shard_size)
        if not spec_of(cfg).masked_lm:  # a model that generates
            save_generation_config(cfg, tmp, saved_decode(ckpt))
        save_hf_tokenizer(tok, cfg, tmp)
    log.info("exported %s to %s (%s)", ckpt, out, target.HF_CLASS)
    return out


def import_hf(hf_dir: str | Path, out_dir: str | Path, force: bool = False) -> Path:
    """Write a tformer run directory (``checkpoints/step_00000000``, ``tokenizer.json``,
    ``config.yaml``) from a HF model directory (or hub name), to continue pretraining it.
    The checkpoint holds weights only: the optimizer and LR schedule start fresh."""
    from transformers import AutoConfig

    out = Path(out_dir)
    local = Path(hf_dir) if Path(hf_dir).exists() else None  # else a hub name
    check_out_dir(out, force, local)
    try:
        hf_config = AutoConfig.from_pretrained(str(hf_dir))
    except (OSError, ValueError) as e:
        raise ExportError(
            f"cannot read a HF config from {hf_dir} ({str(e).splitlines()[0]}); pass a directory holding config.json"
        ) from None
    target = TARGETS.get(hf_config.model_type) or next(
        (t for t in TARGETS.values() if getattr(t, "HF_MODEL_TYPE", None) == hf_config.model_type), None
    )
    if target is None:
        raise ExportError(f"HF model_type={hf_config.model_type!r} cannot be imported; tformer imports {', '.join(TARGETS)}")
    hf_state, tied = read_hf_weights(str(hf_dir), target.HF_CLASS, hf_config, getattr(target, "HF_BUFFERS", ()))
    cfg = target.model_config(hf_config, tied)
    shapes = model_shapes(cfg)
    if hasattr(target, "drop_on_import"):  # fixed tensors HF stores and tformer computes
        hf_state = target.drop_on_import(cfg, hf_state, str(hf_dir))
    if hasattr(target, "before_import"):  # the inverse of after_export
        hf_state = target.before_import(cfg, hf_state)
    state = from_hf(hf_state, target.rules(cfg), shapes, str(hf_dir))
    if hasattr(target, "after_import"):
        state = target.after_import(cfg, state)
    missing = sorted(set(shapes) - set(state))
    if missing:
        raise ExportError(f"the name map leaves tformer tensor {missing[0]} empty; this is a bug in tformer.export")
    tok_file = Path(hf_dir) / "tokenizer.json"

    with atomic_dir(out, force, local) as tmp:
        if tok_file.is_file():
            shutil.copyfile(tok_file, tmp / "tokenizer.json")
        else:
            log.warning("%s has no tokenizer.json; give the run one with data.tokenizer=PATH", hf_dir)
        _write_checkpoint(tmp / "checkpoints", cfg, state, str(hf_dir))
        (tmp / RUN_CONFIG).write_text(_recipe(cfg, out, tok_file.is_file()))
    log.info("imported %s to %s", hf_dir, out)
    return out


def _write_checkpoint(root: Path, cfg: ModelConfig, state: dict, source: str) -> Path:
    """A step-0 checkpoint in the trainer's layout (marker last, renamed into place), weights only."""
    tmp = partial_dir(root, 0)
    tmp.mkdir(parents=True)
    save_safetensors(state, tmp / WEIGHTS)
    # weights_only: the trainer resumes it with a fresh optimizer and LR schedule
    TrainerState(step=0, weights_only=True, model_config=cfg.to_dict(), family=cfg.family, imported_from=source).write(tmp)
    write_bytes_durable(tmp / RUN_CONFIG, run_config_yaml(cfg).encode())
    return commit(root, 0, keep=1)


def _recipe(cfg: ModelConfig, out: Path, has_tokenizer: bool) -> str:
    """``config.yaml`` of the imported run: ``tformer train OUT/config.yaml`` continues pretraining
    (resume=auto finds the step-0 checkpoint); every key it leaves out takes its default."""
    out = out.resolve()
    data = {"tokenizer": str(out / "tokenizer.json")} if has_tokenizer else {}
    return run_config_yaml(cfg, data=data, output_dir=str(out))
