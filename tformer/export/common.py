"""What the four HF targets share: the error type, name maps, reading our checkpoints, writing an
output directory atomically, sharded safetensors, and the tokenizer hand-off."""

from __future__ import annotations

import json
import pickle
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from ..checkpoint.io import TRAINER_STATE, WEIGHTS, CheckpointError, resolve_checkpoint
from ..checkpoint.state import TrainerState
from ..config import ConfigError, ModelConfig
from ..files import atomic_write, save_safetensors
from ..models import spec_of


class ExportError(ValueError):
    """A model, checkpoint or directory that cannot be converted, stated in one line that names the
    field (or file) and what to do."""


# -- name maps -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    """One HF tensor made of one or more of ours: concatenated along ``dim`` (GPT-2's fused q|k|v
    along 0, Mixtral's gate|up along 1 of the stacked experts), then transposed for HF ``Conv1D``
    layers, which store weights as (in, out). ``index``: the HF tensor is row ``index`` of ours
    (Switch's one module per expert of our stacked experts). A tensor of ours may feed several HF
    tensors (BERT's untied head keeps its bias twice); on import the first rule naming it wins."""

    hf: str
    ours: tuple[str, ...]
    transpose: bool = False
    dim: int = 0
    index: int | None = None


def rule(hf: str, *ours: str, transpose: bool = False, dim: int = 0, index: int | None = None) -> Rule:
    return Rule(hf, ours, transpose, dim, index)


def linear(hf: str, ours: str, bias: bool, transpose: bool = False) -> list[Rule]:
    """Weight (and bias) of one linear layer (or norm) named ``hf`` in HF and ``ours`` in tformer."""
    rules = [rule(f"{hf}.weight", f"{ours}.weight", transpose=transpose)]
    return rules + [rule(f"{hf}.bias", f"{ours}.bias")] if bias else rules


# Plain (ungated) activations: tformer name <-> HF ACT2FN name. HF's "gelu_new" and
# "gelu_pytorch_tanh" are both the tanh approximation (GPT-2's), "gelu" the exact erf form.
PLAIN_ACTS = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu", "silu": "silu"}
HF_PLAIN_ACTS = {
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "relu": "relu",
    "silu": "silu",
    "swish": "silu",
}


def to_hf(state: dict[str, torch.Tensor], rules: list[Rule], target: str) -> dict[str, torch.Tensor]:
    """Our tensors -> HF tensors. A tensor of ours that no rule takes is a feature the target
    cannot hold: an error naming it, never a silent drop."""
    used: set[str] = set()
    out: dict[str, Any] = {}
    for r in rules:
        missing = [o for o in r.ours if o not in state]
        if missing:
            raise ExportError(
                f"the checkpoint has no tensor {missing[0]} (needed for {target}'s {r.hf}); "
                "it does not match its model_config"
            )
        parts = [state[o] if r.index is None else state[o][r.index] for o in r.ours]
        t = torch.cat(parts, dim=r.dim) if len(parts) > 1 else parts[0]
        t = (t.t() if r.transpose else t).contiguous()
        shared = used.intersection(r.ours) or r.index is not None
        out[r.hf] = t.clone() if shared else t  # safetensors refuses shared memory
        used.update(r.ours)
    left = set(state) - used
    if left:
        raise ExportError(
            f"parameter {sorted(left)[0]} has no counterpart in HF {target} "
            f"({len(left)} such tensor(s)); the model uses a feature {target} cannot express"
        )
    return out


def from_hf(
    state: dict[str, torch.Tensor], rules: list[Rule], shapes: dict[str, torch.Size], source: str
) -> dict[str, torch.Tensor]:
    """HF tensors -> ours (the inverse of ``to_hf``); ``shapes`` are our parameters' shapes, used
    to split fused tensors and to check every tensor lands in a place of the right size."""
    left = dict(state)
    out = {}
    rows: dict[str, dict[int, torch.Tensor]] = {}  # index rules: the rows of one tensor of ours
    for r in rules:
        if r.hf not in left:
            raise ExportError(f"the HF model has no tensor {r.hf}; it does not match its config")
        t = left.pop(r.hf)
        if all(o in out for o in r.ours):
            continue
        t = t.t() if r.transpose else t
        want = {o: shapes[o][1:] if r.index is not None else shapes[o] for o in r.ours}
        sizes = [want[o][r.dim] for o in r.ours]
        for name, part in zip(r.ours, torch.split(t, sizes, dim=r.dim) if len(r.ours) > 1 else [t]):
            if part.shape != want[name]:
                raise ExportError(
                    f"HF tensor {r.hf} has shape {tuple(t.shape)}, which does not fit "
                    f"{name} {tuple(shapes[name])}; the HF config and weights disagree"
                )
            if r.index is None:
                out[name] = part.contiguous()
            else:
                rows.setdefault(name, {})[r.index] = part
    for name, parts in rows.items():
        if sorted(parts) != list(range(shapes[name][0])):
            raise ExportError(f"the name map fills only rows {sorted(parts)} of {name}; this is a bug in tformer.export")
        out[name] = torch.stack([parts[i] for i in range(len(parts))])
    if left:
        raise ExportError(
            f"HF tensor {sorted(left)[0]} of {source} has no place in a tformer model "
            f"({len(left)} such tensor(s)); the HF model uses a feature tformer lacks"
        )
    return out


# -- config checks ---------------------------------------------------------------------------


def need(cfg: ModelConfig, name: str, allowed: Any, fix: str) -> str | None:
    """A problem line when field ``name`` is not ``allowed`` (a value, a tuple of values, or a
    predicate), else None. ``fix`` says what to do."""
    value = getattr(cfg, name)
    if callable(allowed):
        ok = allowed(value)
    elif isinstance(allowed, tuple):
        ok = value in allowed
    else:
        ok = value == allowed
    return None if ok else f"{name}={value!r}: {fix}"


def need_moe(cfg: ModelConfig, name: str, allowed: Any, fix: str) -> str | None:
    """``need`` for a field of the ``moe`` section (the problem names ``moe.<name>``)."""
    problem = need(cfg.moe, name, allowed, fix)  # type: ignore[arg-type]
    return f"moe.{problem}" if problem else None


def raise_problems(target: str, problems: list[str | None]) -> None:
    found = [p for p in problems if p]
    if found:
        raise ExportError(f"cannot export to HF {target}: " + "; ".join(found))


def default_head_dim(cfg: ModelConfig) -> bool:
    return cfg.d_head is None or cfg.d_head * cfg.num_heads == cfg.d_model


def first_id(value: int | list[int] | None) -> int | None:
    """HF allows a list of EOS ids; tformer keeps one (the first)."""
    if isinstance(value, (list, tuple)):
        return value[0] if value else None
    return value


def rope_parameters(cfg: ModelConfig) -> dict:
    """HF's ``rope_parameters`` of a rotary model: the plain table, or YaRN's (``model.yarn``)."""
    y = cfg.yarn
    if not y.enabled:
        return {"rope_type": "default", "rope_theta": cfg.rope_theta}
    rope = {
        "rope_type": "yarn",
        "rope_theta": cfg.rope_theta,
        "factor": y.factor,
        "original_max_position_embeddings": y.original_max_seq_len,
        "beta_fast": y.beta_fast,
        "beta_slow": y.beta_slow,
        "truncate": y.truncate,
    }
    if y.mscale_all_dim:  # HF reads mscale only beside mscale_all_dim, as tformer does
        rope.update(mscale=y.mscale, mscale_all_dim=y.mscale_all_dim)
    return rope


def yarn_fields(rope: dict, target: str) -> dict:
    """``model.yarn`` from HF's ``rope_parameters`` (empty for the plain table); a kind tformer has
    not, or an attention factor set by hand (tformer derives it), refused in one line."""
    kind = rope.get("rope_type", "default")
    if kind == "default":
        return {}
    if kind != "yarn":
        raise ExportError(f"HF {target} rope_parameters.rope_type={kind!r} has no tformer equivalent (default or yarn)")
    if rope.get("attention_factor") is not None:
        raise ExportError(f"HF {target} rope_parameters sets YaRN's attention_factor; tformer derives it from mscale")
    all_dim = float(rope.get("mscale_all_dim") or 0.0)
    return {
        "factor": float(rope["factor"]),
        "original_max_seq_len": int(rope["original_max_position_embeddings"]),
        "beta_fast": float(rope.get("beta_fast") or 32.0),
        "beta_slow": float(rope.get("beta_slow") or 1.0),
        # read only beside mscale_all_dim; there, unset is 0 (HF then scales cos/sin the plain way)
        "mscale": float(rope.get("mscale") or 0.0) if all_dim else 1.0,
        "mscale_all_dim": all_dim,
        "truncate": bool(rope.get("truncate", True)),
    }


def build_config(source: str, **fields: Any) -> ModelConfig:
    try:
        return ModelConfig(**fields)
    except ConfigError as e:
        raise ExportError(f"{source} has no tformer equivalent: {e}") from None


# -- reading our checkpoints -----------------------------------------------------------------


def read_model_state(checkpoint: str | Path, trust: bool = False) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The model config and the full (unsharded) model tensors of a checkpoint, on CPU.

    The one entry point exporters read through, so sharded checkpoints (FSDP2 DCP, DeepSpeed
    ZeRO) plug in here by consolidating their shards tensor by tensor. Tied tensors appear once,
    under their first name (``embed.tok.weight``)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = resolve_checkpoint(checkpoint, trust)
    saved = TrainerState.read(path).model_config
    if saved is None:
        raise CheckpointError(f"checkpoint {path} records no model_config in {TRAINER_STATE}")
    cfg = ModelConfig.from_dict(dict(saved))
    weights = path / WEIGHTS
    if not weights.is_file():  # FSDP2 / DDP shards in dcp/, or DeepSpeed ZeRO partitions
        from ..checkpoint.consolidate import read_resolved_model_state

        return read_resolved_model_state(path, trust)
    try:
        state = load_file(weights)
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint file {weights} is corrupt or truncated ({e})") from None
    return cfg, state


def unique_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors as a checkpoint holds them: each tied tensor once, under its first name."""
    seen: set[int] = set()
    out = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            out[name] = t
    return out


def model_shapes(cfg: ModelConfig) -> dict[str, torch.Size]:
    """Shapes of our model's tensors as a checkpoint holds them (``unique_tensors``), from a model
    built on the meta device (no memory)."""
    from ..models import build_model

    with torch.device("meta"):
        model = build_model(cfg)
    return {name: t.shape for name, t in unique_tensors(model).items()}


def unpad_vocab(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop the rows padding the vocabulary to ``pad_vocab_multiple``: they are never predicted
    (our logits are sliced to ``vocab_size``) and HF models have exactly ``vocab_size`` rows."""
    if cfg.padded_vocab_size == cfg.vocab_size:
        return state
    out = dict(state)
    for name in ("embed.tok.weight", "encoder_embed.tok.weight", "lm_head.weight", "lm_head.bias"):
        if name in out:
            out[name] = out[name][: cfg.vocab_size]
    return out


# -- HF side ---------------------------------------------------------------------------------


def hf_expected(hf_config, class_name: str) -> tuple[dict[str, torch.Size], set[str]]:
    """Names and shapes of the HF model's parameters (each tied tensor once, its first name) and
    the names of tied aliases, for the model ``from_pretrained`` will build from the saved config."""
    import transformers

    reloaded = type(hf_config).from_dict(hf_config.to_dict())
    with torch.device("meta"):
        model = getattr(transformers, class_name)(reloaded)
    unique = {name: p.shape for name, p in model.named_parameters()}
    return unique, {name for name, _ in model.named_parameters(remove_duplicate=False)} - set(unique)


def hf_saved_layout(hf_config, class_name: str, hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``hf_state`` (the names and layout of the HF model's parameters) in the layout HF's own
    ``save_pretrained`` writes, through HF's own reversal of its load-time conversions. For the MoE
    models transformers 5 stacks the experts in memory but writes (and transformers 4 reads) one
    tensor per expert: ``block_sparse_moe.experts.{e}.w1.weight`` for Mixtral."""
    import transformers
    from transformers.core_model_loading import revert_weight_conversion

    with torch.device("meta"):
        model = getattr(transformers, class_name)(type(hf_config).from_dict(hf_config.to_dict()))
    saved = revert_weight_conversion(model, dict(hf_state))
    # per-expert slices of one stacked tensor share its storage, which safetensors refuses
    return {name: t.clone() if t._is_view() else t.contiguous() for name, t in saved.items()}


def check_against(hf_state: dict[str, torch.Tensor], expected: tuple[dict[str, torch.Size], set[str]], target: str) -> None:
    """Every HF parameter present with its shape; nothing else except a tied alias that holds
    different values on purpose (an untied T5 head, which the HF loader then keeps apart)."""
    unique, aliases = expected
    for name, shape in unique.items():
        if name not in hf_state:
            raise ExportError(
                f"HF {target} needs {name}, which the name map does not produce; this is a bug in tformer.export"
            )
        if hf_state[name].shape != shape:
            raise ExportError(
                f"{name} has shape {tuple(hf_state[name].shape)} but HF {target} expects "
                f"{tuple(shape)}; the config and the weights disagree"
            )
    extra = sorted(set(hf_state) - set(unique) - aliases)
    if extra:
        raise ExportError(f"tensor {extra[0]} has no place in HF {target}; the model uses a feature {target} cannot express")


def write_safetensors(state: dict[str, torch.Tensor], out: Path, max_shard_size: int | str) -> None:
    """``model.safetensors``, or shards plus ``model.safetensors.index.json`` above
    ``max_shard_size`` bytes: HF's layout, so ``from_pretrained`` reads either."""
    from huggingface_hub import split_torch_state_dict_into_shards

    split = split_torch_state_dict_into_shards(
        state, max_shard_size=max_shard_size, filename_pattern="model{suffix}.safetensors"
    )
    for filename, names in split.filename_to_tensors.items():
        save_safetensors({n: state[n] for n in names}, out / filename)
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        text = json.dumps(index, indent=2, sort_keys=True) + "\n"
        (out / "model.safetensors.index.json").write_text(text)


def read_hf_weights(
    hf_dir: str, class_name: str, hf_config, buffers: tuple[str, ...] = ()
) -> tuple[dict[str, torch.Tensor], bool]:
    """The HF model's parameters in fp32 (tformer's master weights), each tied tensor once, and
    whether its output projection is tied to the input embeddings. Loaded through ``transformers``,
    so sharded, legacy-named and hub checkpoints all work. ``buffers``: name endings of HF buffers
    that are weights of ours too (DeepSeek-V3's ``e_score_correction_bias``)."""
    import logging

    import transformers

    cls = getattr(transformers, class_name)
    try:  # transformers reads pickled weights (*.bin) with weights_only=True: never code
        model, info = cls.from_pretrained(hf_dir, config=hf_config, dtype=torch.float32, output_loading_info=True)
    except (OSError, ValueError, RuntimeError, pickle.UnpicklingError) as e:
        pickles = sorted(p.name for p in Path(hf_dir).glob("*.bin")) if Path(hf_dir).is_dir() else []
        found = re.search(r"GLOBAL ([\w.]+)", str(e))
        what = (
            f"{'/'.join(pickles) or 'its weights'} try to load {found.group(1)}, which no weights file needs; "
            "refused: it could run code"
            if found
            else f"its weights cannot be read ({type(e).__name__}: {(str(e).strip().splitlines() or ['?'])[0]})"
        )
        raise ExportError(f"{hf_dir}: {what}; use a safetensors copy of the model") from None
    missing = [k for k in info.get("missing_keys", []) if k]
    if missing:
        logging.getLogger("tformer.export").warning(
            "%s lacks %d tensor(s) of %s (e.g. %s); transformers initialised them randomly",
            hf_dir,
            len(missing),
            class_name,
            sorted(missing)[0],
        )
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    state = {name: p.detach() for name, p in model.named_parameters()}
    if buffers:
        state.update({name: b.detach() for name, b in model.named_buffers() if name.endswith(buffers)})
    return state, tied


# -- tokenizers ------------------------------------------------------------------------------


def find_tokenizer(ckpt: Path) -> Path | None:
    """``tokenizer.json`` of a checkpoint: in its directory or up to its run directory
    (``RUN/checkpoints/step_X``)."""
    for d in (ckpt, *ckpt.parents[:2]):
        if (d / "tokenizer.json").is_file():
            return d / "tokenizer.json"
    return None


def check_tokenizer(tok, cfg: ModelConfig) -> None:
    """The tokenizer must fit the model: no id beyond the vocabulary, and the special tokens the
    model was trained with (the trainer takes them from the tokenizer) at the same ids."""
    from ..data.tokenizer import special_tokens, vocab_size

    n = vocab_size(tok)
    if n > cfg.vocab_size:
        raise ExportError(
            f"the tokenizer has {n} tokens but model vocab_size={cfg.vocab_size}; export "
            "with the tokenizer the model was trained with (--tokenizer)"
        )
    s = special_tokens(tok)
    pairs = [("pad_token_id", s.pad_id, "pad")]
    spec = spec_of(cfg)
    if not spec.masked_lm:
        pairs.append(("eos_token_id", s.eos_id, "eos"))
    if spec.causal_lm and cfg.bos_token_id is not None:
        pairs.append(("bos_token_id", s.eos_id, "bos (= end-of-text)"))
    for field, tok_id, role in pairs:
        ours = getattr(cfg, field)
        if tok_id is not None and ours is not None and ours != tok_id:
            raise ExportError(
                f"model {field}={ours} but the tokenizer's {role} token has id {tok_id}; "
                "export with the tokenizer the model was trained with (--tokenizer)"
            )


def save_hf_tokenizer(tok, cfg: ModelConfig, out: Path) -> None:
    """``tokenizer.json`` + ``tokenizer_config.json`` through ``PreTrainedTokenizerFast`` with the
    family's special-token roles, so ``AutoTokenizer`` encodes exactly as tformer does."""
    from ..data.tokenizer import hf_tokenizer

    hf_tok = hf_tokenizer(tok)
    if cfg.position in ("learned", "sinusoidal"):
        hf_tok.model_max_length = cfg.max_seq_len
    hf_tok.save_pretrained(str(out))
    # transformers 5 records the class as "TokenizersBackend", which 4.x cannot load; its alias
    # "PreTrainedTokenizerFast" loads in both.
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def save_generation_config(cfg: ModelConfig, out: Path, decode=None) -> None:
    """``generation_config.json``: the special tokens, and with ``decode`` (a translation run's
    ``DecodeConfig``, checkpoint/runconfig.py) its beams, length penalty and length limit, so that HF's
    ``generate`` decodes as ``tformer generate`` and ``tformer evaluate`` do by default. HF divides
    a beam's score by len ** alpha (tformer's ``length_norm=power``); a run's ``gnmt`` norm,
    ((5 + len) / 6) ** alpha, has no HF equivalent, and the export says so."""
    import logging

    from transformers import GenerationConfig

    extra = {"decoder_start_token_id": cfg.decoder_start_token_id} if spec_of(cfg).seq2seq else {}
    if decode is not None:
        extra.update(num_beams=decode.num_beams, max_new_tokens=decode.max_new_tokens)
        if decode.num_beams > 1:
            extra.update(length_penalty=decode.length_penalty, early_stopping=False)  # as tformer's beam search
            if decode.length_norm != "power" and decode.length_penalty:
                logging.getLogger("tformer.export").warning(
                    "generation_config.json: HF's beam search divides by len ** %s where the run's "
                    "decode.length_norm=%s uses ((5 + len) / 6) ** %s; beams may rank differently",
                    decode.length_penalty,
                    decode.length_norm,
                    decode.length_penalty,
                )
    GenerationConfig(
        bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id, **extra
    ).save_pretrained(str(out))


# -- atomic output directories ---------------------------------------------------------------


def check_out_dir(out: Path, force: bool, source: Path | None = None) -> None:
    """``out`` may not exist, be empty, or (with ``force``) be replaced; never hold ``source``."""
    if source is not None and out.resolve() in (source.resolve(), *source.resolve().parents):
        raise ExportError(f"output directory {out} holds the input {source}; choose another path")
    if out.exists() and not out.is_dir():
        raise ExportError(f"output {out} exists and is not a directory; choose another path")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ExportError(
            f"output directory {out} exists and is not empty; choose another path or pass --force to replace it"
        )


@contextmanager
def atomic_dir(out: Path, force: bool, source: Path | None = None) -> Iterator[Path]:
    """Yield a temporary sibling of ``out``; on success it replaces ``out`` in one rename, on any
    error it is removed, so no partial output is ever left behind."""
    check_out_dir(out, force, source)
    with atomic_write(out, directory=True) as tmp:
        yield tmp
