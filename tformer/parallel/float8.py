"""Float8 training (``precision: fp8``): torchao's float8 linear layers in the transformer blocks,
applied from outside the model as the first ``apply_*`` step (before TP, AC, compile and FSDP2, as
torchtitan converts its models before parallelising them).

Which layers run in float8 (``float8_filter``): every ``nn.Linear`` inside a transformer block --
attention q/k/v/o, the FFN's up/gate/down, a MoE layer's shared experts -- whose input and output
sizes are both multiples of 16 (what the FP8 tensor cores' GEMM needs), except a MoE layer's router
and shared-expert gate (routing decisions are precision-sensitive: they run in fp32). The
embeddings, the output head (``lm_head``, BERT's MLM ``head_dense``) and T5's relative-position
table are outside the blocks and stay in bf16; so do MoE experts, which are stacked parameters
(grouped GEMMs), not ``nn.Linear``: torchao's float8 grouped GEMMs are a CUDA-only prototype.

A converted layer casts its input, weight and output gradient to float8 with dynamic scales
(``float8.recipe``: one per tensor, or one per row) and multiplies them in float8; its weight stays
an ordinary high-precision parameter under the same name, so state dicts, checkpoints (DCP,
safetensors) and ``tformer export`` see the model they always saw, and a run may change precision
at resume. ``float8.emulate`` (true on a CPU) computes each float8 product in fp32 from the float8
values: the same casts and scales without FP8 tensor cores, which is how the tests run it.

With FSDP2 and the tensorwise recipe the block weights are all-gathered in float8 (half bf16's
bytes), their scales computed once per optimizer step in one all-reduce
(``precompute_float8_dynamic_scale_for_fsdp``, an optimizer step hook). Model code knows none of
this; nothing here is imported unless precision=fp8.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import logging
from typing import Any

import torch

from ..config import ConfigError
from ..nn import TransformerBlock
from ..nn.moe import MoEFeedForward

log = logging.getLogger("tformer.parallel")

INSTALL = "pip install 'tformer[float8]'"
MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (8.9), Hopper (9.0), Blackwell


@contextlib.contextmanager
def _quiet_import():
    """torchao's import logs a warning per C++ extension it cannot load (CUDA kernels on a CPU
    build, a torch other than the one it was built for): nothing float8 training uses."""
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def torchao_float8() -> Any:
    """The ``torchao.float8`` module; ConfigError in one line when it is missing or cannot be imported."""
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError(f"precision=fp8 needs torchao (its float8 training layers), which is not installed; {INSTALL}")
    try:
        with _quiet_import():
            return importlib.import_module("torchao.float8")
    except Exception as e:  # an old torchao, or one built for another torch
        raise ConfigError(
            f"precision=fp8: torchao.float8 cannot be imported with torch {torch.__version__} ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}); install a torchao release built for this torch ({INSTALL})"
        ) from None


def emulated(f8cfg: Any, device: torch.device) -> bool:
    """``float8.emulate``, with null resolved: true on a CPU, false on a GPU."""
    return f8cfg.emulate if f8cfg.emulate is not None else device.type != "cuda"


def check_float8(cfg: Any, precision: str, device: torch.device) -> None:
    """Refuse, before any work, what precision=fp8 cannot run here: DeepSpeed, no torchao, a recipe
    this torchao lacks, a GPU without FP8 tensor cores, real float8 GEMMs on a CPU."""
    if precision != "fp8":
        return
    if cfg.parallel.strategy == "deepspeed":
        raise ConfigError(
            "precision=fp8 does not compose with parallel.strategy=deepspeed (its engine owns the model's "
            "precision and knows no float8 layers); use parallel.strategy=fsdp or ddp, or precision=bf16"
        )
    f8cfg = cfg.float8
    if device.type == "cuda" and not emulated(f8cfg, device):
        cap = torch.cuda.get_device_capability(device)
        if cap < MIN_CAPABILITY:
            raise ConfigError(
                f"precision=fp8 needs FP8 tensor cores (compute capability 8.9+: Ada, Hopper, Blackwell); "
                f"{torch.cuda.get_device_name(device)} has {cap[0]}.{cap[1]}; use precision=bf16"
            )
    if device.type != "cuda" and not emulated(f8cfg, device):
        # measured (torch 2.13, gpt2-tiny step): torch's CPU _scaled_mm 6.9 s, emulation 0.10 s
        raise ConfigError(
            f"float8.emulate=false on {device.type} runs torch's reference float8 matmul (~70x slower than "
            "emulation); leave float8.emulate unset (true on a CPU) or train on a GPU of compute capability 8.9+"
        )
    f8 = torchao_float8()
    offered = [r.value for r in f8.Float8LinearRecipeName]
    if f8cfg.recipe not in offered:
        raise ConfigError(
            f"float8.recipe={f8cfg.recipe} is not offered by this torchao ({_torchao_version()}); use one of: "
            f"{', '.join(offered)}, or upgrade torchao ({INSTALL})"
        )


def _torchao_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"torchao {version('torchao')}"
    except PackageNotFoundError:
        return "torchao of unknown version"


def float8_filter(model: torch.nn.Module) -> set[str]:
    """The qualified names of the linear layers ``precision: fp8`` converts (the rule is in the
    module docstring): inside a transformer block, not a MoE router or shared-expert gate, both
    sizes multiples of 16."""
    kept = {id(m) for moe in model.modules() if isinstance(moe, MoEFeedForward) for m in (moe.router, moe.shared_gate)}
    names = set()
    for block_name, block in model.named_modules():
        if not isinstance(block, TransformerBlock):
            continue
        for name, m in block.named_modules():
            if isinstance(m, torch.nn.Linear) and id(m) not in kept and m.in_features % 16 == 0 and m.out_features % 16 == 0:
                names.add(f"{block_name}.{name}" if block_name else name)
    return names


def torchao_config(f8cfg: Any, device: torch.device, fsdp: bool) -> Any:
    """torchao's ``Float8LinearConfig`` for the recipe, emulated or not; float8 all-gather under
    FSDP2 where torchao offers it (tensorwise scaling only)."""
    f8 = torchao_float8()
    config = f8.Float8LinearConfig.from_recipe_name(f8cfg.recipe)
    all_gather = fsdp and f8cfg.recipe == "tensorwise"
    return dataclasses.replace(config, emulate=emulated(f8cfg, device), enable_fsdp_float8_all_gather=all_gather)


def _input_in_autocast_dtype(module: torch.nn.Module, args: tuple) -> tuple | None:
    """Float8Linear casts its input to the autocast dtype only under CUDA autocast: on a CPU the
    same cast, so the float8 casts see the bf16 values they see on a GPU (and rowwise_with_gw_hp's
    bf16 weight-gradient product gets operands of one dtype)."""
    x = args[0]
    device = x.device.type
    if torch.is_autocast_enabled(device) and x.is_floating_point() and x.dtype != torch.get_autocast_dtype(device):
        return (x.to(torch.get_autocast_dtype(device)), *args[1:])
    return None


def convert_to_float8(model: torch.nn.Module, f8cfg: Any, device: torch.device, fsdp: bool = False) -> list[str]:
    """Swap the layers ``float8_filter`` names for torchao's Float8Linear, in place (the weights and
    their names stay); returns the converted names."""
    f8 = torchao_float8()
    names = float8_filter(model)
    config = torchao_config(f8cfg, device, fsdp)
    f8.convert_to_float8_training(model, config=config, module_filter_fn=lambda _m, fqn: fqn in names)
    if device.type != "cuda":
        for name in names:
            model.get_submodule(name).register_forward_pre_hook(_input_in_autocast_dtype)
    return sorted(names)


def compile_flags(recipe: str, compiled: bool) -> None:
    """Inductor's settings a compiled float8 recipe needs (the trainer's and bench_gpu's)."""
    if recipe != "tensorwise" and compiled:
        # pytorch/pytorch#150859 (as torchtitan does): inductor's float8 casts of rowwise scales
        # round like eager only with this flag
        from torch._inductor import config as inductor

        inductor.emulate_precision_casts = True


def apply_float8(model: torch.nn.Module, layout: Any) -> torch.nn.Module:
    """``precision: fp8``: the blocks' linear layers converted to float8 (``convert_to_float8``)."""
    cfg = layout.cfg
    if cfg.precision != "fp8":
        return model
    fsdp = cfg.parallel.strategy == "fsdp"
    names = convert_to_float8(model, cfg.float8, layout.device, fsdp)
    compile_flags(cfg.float8.recipe, bool(cfg.compile))
    if _is_main():
        total = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
        how = "emulated" if emulated(cfg.float8, layout.device) else "FP8 tensor cores"
        log.info(f"precision=fp8 ({cfg.float8.recipe}, {how}): {len(names)} of {total} linear layers in float8")
        if layout.device.type == "cuda" and not cfg.compile:
            log.warning(
                "precision=fp8 without compile: the float8 casts and scales run as separate eager kernels, "
                "which can cost more than the float8 matmuls save; set compile=true"
            )
    return model


def _is_main() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def fsdp_float8_weights(model: torch.nn.Module) -> bool:
    """Whether any FSDP2-sharded weight all-gathers in float8 (its scales then precomputed)."""
    local = (getattr(p, "_local_tensor", None) for p in model.parameters())
    return any(type(t).__name__ == "WeightWithDynamicFloat8CastTensor" for t in local)


def precompute_scales_after_step(optimizer: Any, model: torch.nn.Module) -> None:
    """FSDP2 with float8 all-gather: after every optimizer step, the scales of all float8 weights in
    one all-reduce (torchao's ``precompute_float8_dynamic_scale_for_fsdp``) instead of one per
    weight at each all-gather. A load of the weights (resume, rollback) drops the precomputed scales,
    so the next all-gather computes them from the loaded weights."""
    if not fsdp_float8_weights(model):
        return
    f8 = torchao_float8()
    optimizer.register_step_post_hook(lambda *_: f8.precompute_float8_dynamic_scale_for_fsdp(model))
    for m in model.modules():
        if type(m).__name__ == "Float8Linear":
            m.register_load_state_dict_post_hook(_drop_precomputed_scale)


def _drop_precomputed_scale(module: torch.nn.Module, _incompatible: Any) -> None:
    local = getattr(module.weight, "_local_tensor", None)
    if local is not None and hasattr(local, "_precomputed_scale"):
        local._precomputed_scale = None
