"""Every family on one GPU against HF ``transformers``: tokens/s, MFU, peak memory against the planner,
and KV-cached generation.

    python bench/bench_gpu.py [--family gpt2,llama,bert,t5] [--compile off,on] [--steps 10]
                              [--micro-batch auto|N] [--fill 0.85] [--peak TFLOPS] [--json out.json]
    python bench/bench_gpu.py --precision fp8 # the 8B-shaped row: bf16 vs float8 tensorwise vs rowwise
    python bench/bench_gpu.py --tiny          # the same code on tiny presets, on CPU (CI runs this)

Rows (one device, bf16 autocast with fp32 master weights): ``gpt2-small`` (seq 1,024), ``llama-1b``
(seq 2,048), ``bert-base`` (seq 512, 15% of positions labelled), ``t5-base`` (source 512, target 114).
For each, up to four contenders take the same batches one after another, each from the same initial
weights (HF's through ``tformer.export.to_hf_model``, so their first losses agree):

- tformer as its trainer runs it: the loss-only head in chunks of ``loss.chunk_size`` tokens (BERT's
  MLM head at the labelled positions), ``build_optimizer`` (fused AdamW), gradients clipped to 1.0,
  and with ``--compile on`` every block compiled on its own (``parallel.compile.compile_blocks``);
- the trainer's own step (``Trainer._train_step`` of a run config of the row: ``data.source:
  synthetic``, ``compile: true`` when compiled), built and timed as a run trains, so that what
  the raw loop shows is what a run gets (the trainer / raw loop ratio is checked, >= 0.95);
- the HF model of identical configuration (``attn_implementation="sdpa"``, its own loss from
  ``labels``), the same optimizer and clipping, and compiled whole (``torch.compile``) with
  ``--compile on``.

Printed per contender: micro-batch, tokens/s (the mean of the timed steps, the device synchronised
once after the last), MFU (training FLOPs of the batch from
``tformer.models.flops.training_flops`` -- HF models of the same configuration do the same work --
over the step time and the device's dense bf16 peak: ``tformer.train.observe.metrics.gpu_peak``'s table,
989 TFLOP/s for an H100 SXM, or ``--peak``), peak allocated memory, the compile (first-step) time,
and for tformer the planner's prediction (``tformer.plan.rank_memory`` with the trainer's head
settings: what ``tformer plan`` prints) against the measured peak. Ratios against HF eager and HF
compiled. Then greedy KV-cached generation (bf16 weights, 256 new tokens after a 128-token prompt,
batch 1 and 8) against HF ``generate`` on the same weights, with the share of identical tokens.

Micro-batch (``--micro-batch auto``): the largest power of two whose tformer step the planner puts
under ``--fill`` of the device's free memory; a contender that runs out of memory halves it and
tries again (each row says the micro-batch it ran). ``--start-from RESULTS.json`` starts each
contender where it settled in an earlier run on the same device (the trainer, failing that, where
the raw loop settled), sparing the compiles an out-of-memory try costs.

``--precision fp8`` (issue #43, item 4): one row shaped like Llama-3-8B's width (``llama-8b``: hidden
4,096, FFN 14,336, 32 heads / 8 KV heads, vocabulary 128,256, untied head) at sequence 2,048, with
as many layers as fit one device (``fp8_shape``: the planner's bf16 step at micro-batch 2 -- 4,096
tokens a step, GEMMs large enough for float8 to pay -- under ``--fill`` of the free memory; at 1 if
not even one layer fits at 2), built on the device from one seed and trained by tformer's raw loop
three times, compiled: bf16, then the blocks' linear layers in float8 (torchao, as ``precision:
fp8`` converts them: ``parallel/float8.convert_to_float8``) tensorwise, then rowwise. MFU is
against the bf16 peak for all three (the same FLOPs). Targets: tensorwise >= 1.3x bf16 tokens/s,
rowwise >= 1.15x. On a CPU (``--tiny``) the same code on ``llama-tiny`` with float8 emulated and a
fake device (``TINY_FP8_CAPACITY``) for the layer count.

``--json`` is rewritten (whole, then renamed) after every row: a run killed by a deadline keeps
every row it finished. Targets (issue #18) are checked at the end.

On CPU (``--tiny``): tiny presets, short sequences, a few steps, MFU against a measured bf16
``torch.mm`` and no memory comparison (the CPU allocator has no peak counter): it proves the script,
not the speed. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tformer import build_model  # noqa: E402
from tformer.export import to_hf_model  # noqa: E402
from tformer.generate import generate  # noqa: E402
from tformer.models.flops import training_flops  # noqa: E402
from tformer.models.presets import preset  # noqa: E402
from tformer.models.loss import auto_chunk_size  # noqa: E402
from tformer.parallel.compile import compile_blocks, compile_head  # noqa: E402
from tformer.plan import rank_memory  # noqa: E402
from tformer.plan.memory import training_memory  # noqa: E402
from tformer.train.config import LossConfig, OptimConfig, TrainConfig  # noqa: E402
from tformer.plan.head import free_after_states  # noqa: E402
from tformer.plan.states import num_parameters  # noqa: E402
from tformer.train.observe.metrics import peak_flops  # noqa: E402
from tformer.train.loop.optim import build_optimizer  # noqa: E402

# family -> (preset, sequence, target sequence): the issue's sizes, then the --tiny ones
ROWS = {
    "gpt2": ("gpt2-small", 1024, None),
    "llama": ("llama-1b", 2048, None),
    "bert": ("bert-base", 512, None),
    "t5": ("t5-base", 512, 114),
}
TINY_ROWS = {
    "gpt2": ("gpt2-tiny", 64, None),
    "llama": ("llama-tiny", 64, None),
    "bert": ("bert-tiny", 64, None),
    "t5": ("t5-tiny", 64, 14),  # span corruption's target for 64 (data.t5_lengths), as 114 is for 512
}
# The zoo of [zoo-dec] ([gpu] item 4), `--family zoo`: published shapes; the MoEs cut to the layers
# whose planned step fits one device (ZOO_CUT) -- a DeepSeek-V3-shaped model as Moonlight's 16B
# dimensions (one DeepSeek-V3 MoE layer alone holds 11B parameters: ~180 GB of fp32 states)
ZOO_ROWS = {
    "qwen3": ("qwen3-0.6b", 2048, None),
    "qwen3_moe": ("qwen3-30b-a3b", 2048, None),
    "deepseek_v3": ("moonlight-16b-a3b", 2048, None),
    "gpt_oss": ("gpt-oss-20b", 2048, None),
    "modernbert": ("modernbert-base", 1024, None),  # [zoo-enc]: its pretraining length before 8k
    "t5gemma": ("t5gemma-s-s", 512, 114),
}
TINY_ZOO_ROWS = {
    "qwen3": ("qwen3-tiny", 64, None),
    "qwen3_moe": ("qwen3-moe-tiny", 64, None),
    "deepseek_v3": ("deepseek-v3-tiny", 64, None),
    "gpt_oss": ("gpt-oss-tiny", 64, None),
    "modernbert": ("modernbert-tiny", 64, None),
    "t5gemma": ("t5gemma-tiny", 64, 14),
}
ROWS.update(ZOO_ROWS)
TINY_ROWS.update(TINY_ZOO_ROWS)
ZOO_CUT = {"qwen3_moe", "deepseek_v3", "gpt_oss"}
ZOO_CUT_MICRO_BATCH = 4  # the layers kept leave room for at least this micro-batch
ZOO_OVERRIDES = {"mtp_depth": 0}  # HF's DeepSeek-V3 has no MTP module: the same work on both sides
MLM_SHARE = 0.15
MAX_MICRO_BATCH = 256
TARGETS = dict(llama_mfu=0.40, llama_vs_hf=1.1, vs_hf=1.0, zoo_vs_hf=1.15, plan=0.10, generate=1.0, trainer=0.95)
# --precision fp8: (preset whose width the row takes, sequence), the recipes in the order they run
# (None: bf16), and each float8 recipe's target over bf16's tokens/s (issue #43)
FP8_ROW = ("llama-8b", 2048)
TINY_FP8_ROW = ("llama-tiny", 64)
FP8_RECIPES = (None, "tensorwise", "rowwise")
FP8_TARGETS = {"tensorwise": 1.3, "rowwise": 1.15}
FP8_MICRO_BATCH = 2  # 4,096 tokens a step at 2,048; 1 where not even one layer fits at 2
FP8_MAX_LAYERS = 32  # Llama-3-8B's depth
# --tiny's pretend device: room for 3 llama-tiny layers at micro-batch 2, sequence 64 (fill 0.85)
TINY_FP8_CAPACITY = 8.3e6


@dataclass
class Row:
    family: str
    preset: str
    contender: str  # tformer (its raw loop) | trainer (Trainer's own step) | HF
    compiled: bool
    micro_batch: int
    seq: int
    target: int | None
    tokens_per_s: float = float("nan")
    step_s: float = float("nan")
    mfu: float = float("nan")
    peak_mb: float = float("nan")
    plan_mb: float = float("nan")
    compile_s: float = float("nan")
    first_loss: float = float("nan")
    oom_retries: int = 0
    loss_chunk: int | None = None  # tformer's head: tokens per chunk (None: whole)
    error: str | None = None
    num_layers: int | None = None  # --precision fp8: the layers the row was cut to (None: the preset's)
    float8: str | None = None  # --precision fp8: the blocks' linear layers' torchao recipe (None: bf16)


# --------------------------------------------------------------------------------------------
def batch(cfg, b: int, s: int, t: int | None, device: torch.device, seed: int = 0) -> tuple[dict, dict]:
    """(tformer's inputs, HF's inputs) of one random batch. tformer takes next-token labels shifted
    (its collator's layout), HF shifts inside; BERT labels a random 15% of positions and, unpadded,
    goes without a mask as the trainer's batches do; T5 takes its all-ones mask, as they do."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, cfg.vocab_size, (b, s), generator=g)
    if cfg.family == "decoder":
        shifted = torch.cat((ids[:, 1:], torch.full((b, 1), -100)), dim=1)
        ours, theirs = dict(input_ids=ids, labels=shifted), dict(input_ids=ids, labels=ids)
    elif cfg.family == "encoder":
        labels = ids.masked_fill(torch.rand(b, s, generator=g) >= MLM_SHARE, -100)
        ours = theirs = dict(input_ids=ids, labels=labels)
    else:
        target = torch.randint(3, cfg.vocab_size, (b, t), generator=g)
        # the all-ones mask the data pipeline gives T5 (train/data.make_collator keeps it): without it
        # tformer's relative bias reached SDPA broadcast over the batch, 1.25x slower on an H100
        ours = theirs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=target)
    move = lambda d: {k: v.to(device) for k, v in d.items()}  # noqa: E731
    return move(ours), move(theirs)


def planned_bytes(cfg, device: torch.device, b: int, s: int, t: int | None, chunk: int | None) -> float:
    """The planner's per-device bytes for tformer's step (one device, bf16 mixed, no AC), with the
    head settings the trainer uses (``training_memory``)."""
    run = TrainConfig(model=cfg, device=device.type)
    run.loss.chunk_size = chunk
    memory = training_memory(run)
    return rank_memory(cfg, seq_len=s, micro_batch=b, target_len=t, precision="bf16", strategy="ddp", **memory).total


def head_chunk(cfg, b: int, s: int, t: int | None, device: torch.device, chunk, parameters: int) -> int | None:
    """The trainer's ``loss.chunk_size`` for this row: a number or null as given, ``auto`` by the
    trainer's rule (``models/loss.auto_chunk_size``; free memory: the device's less the states)."""
    if chunk != "auto":
        return chunk  # type: ignore[return-value]
    free = None
    if device.type == "cuda":
        free = free_after_states(torch.cuda.get_device_properties(device).total_memory, parameters, "ddp", 1, 1, 1)
    rows = b * (t or s)
    if cfg.family == "encoder":
        rows = int(rows * MLM_SHARE)
    return auto_chunk_size(rows, cfg.padded_vocab_size, 6, free)


def auto_micro_batch(cfg, device: torch.device, s: int, t: int | None, chunk, fill: float, parameters: int) -> int:
    """The largest power of two whose planned step (its head chunked as the trainer would) fits in
    ``fill`` of the free device memory."""
    free = torch.cuda.mem_get_info(device)[0]

    def fits(b: int) -> bool:
        at = head_chunk(cfg, b, s, t, device, chunk, parameters)
        return planned_bytes(cfg, device, b, s, t, at) <= fill * free

    b = 1
    while b < MAX_MICRO_BATCH and fits(2 * b):
        b *= 2
    return b


def free_memory(device: torch.device) -> None:
    if device.type == "cuda":  # a CPU frees a dropped contender's tensors with their last reference
        gc.collect()  # ~0.5 s here once transformers and dynamo are imported
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_step(model, opt, inputs: dict, ours: bool, device: torch.device):
    """One step as the trainer takes it: bf16 autocast forward (tformer: loss only), backward,
    clip to 1.0, AdamW, gradients cleared; returns the loss."""
    params = [p for p in model.parameters() if p.requires_grad]
    extra = dict(return_logits=False) if ours else {}

    def step() -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(**inputs, **extra).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def measure(row: Row, base: torch.nn.Module, cfg, device, args, peak: float) -> None:
    """Warm-up (compile included) and timed steps of one contender at ``row.micro_batch``; fills in
    the row. Everything it allocates dies with its frame, so an out-of-memory leaves nothing behind.
    Without ``base`` (the 8B-shaped row, too big to copy) the model is built on the device from seed
    0, the same weights each time; ``row.float8`` converts its blocks' linear layers first."""
    if base is None:
        torch.manual_seed(0)
        with device:
            model = build_model(cfg).train()
    else:
        model = copy.deepcopy(base).to(device).train()
    if row.float8:
        to_float8(model, row.float8, row.compiled, device)
    ours = row.contender == "tformer"
    if ours:
        n = sum(p.numel() for p in model.parameters())
        chunk = head_chunk(cfg, row.micro_batch, row.seq, row.target, device, args.loss_chunk, n)
        model.loss_chunk_size = row.loss_chunk = chunk
        if row.compiled:  # as the trainer's compile=true: every block, and the head with its loss
            compile_blocks(model)
            compile_head(model)
    elif row.compiled:
        model = torch.compile(model)
    opt = build_optimizer(model, OptimConfig(), device)
    inputs = batch(cfg, row.micro_batch, row.seq, row.target, device)[0 if ours else 1]
    step = train_step(model, opt, inputs, ours, device)
    t0 = time.perf_counter()
    row.first_loss = step().float().item()
    row.compile_s = time.perf_counter() - t0
    warmup, steps = (args.compiled_warmup, args.compiled_steps) if row.compiled else (args.warmup, args.steps)
    for _ in range(warmup - 1):
        step()
    free_memory(device)  # the peak of the timed steps: parameters and AdamW states are held by now
    times, loss = timed_steps(step, steps, device)
    if not math.isfinite(loss.float().item()):
        row.error = "non-finite loss"
    finish(row, times, cfg, device, peak)
    if ours:
        row.plan_mb = planned_bytes(cfg, device, row.micro_batch, row.seq, row.target, row.loss_chunk) / 2**20


def build_trainer(row: Row, device: torch.device, args, out: Path, log_every: int = 1_000_000, precision: str = "bf16"):
    """The trainer as a run config makes it for this row: the preset, ``data.source: synthetic``
    at the row's lengths, the row's micro-batch, bf16, the head's ``loss.chunk_size``, and
    ``compile: true`` for a compiled row; no evaluation or checkpoint inside the timed steps."""
    from tformer.train.config import load_config
    from tformer.train.trainer import Trainer

    model = dict(preset=row.preset)
    if row.family in ZOO_ROWS:  # the row's overrides and cut, as row_config made its model
        model.update(ZOO_OVERRIDES)
        model.update({"num_layers": row.num_layers} if row.num_layers else {})
    base = dict(
        model=model,
        data=dict(source="synthetic", seq_len=row.seq),
        output_dir=str(out),
        micro_batch_size=row.micro_batch,
        max_steps=10**9,
        precision=precision,
        log_every=log_every,
        eval_every=0,
        save_every=0,
        progress=False,
        compile=row.compiled,
        device=device.type,
        loss=dict(chunk_size=args.loss_chunk),
    )
    trainer = Trainer(load_config(base=base))
    if row.target is not None and trainer.data.target_len != row.target:
        raise ValueError(f"the trainer's target length {trainer.data.target_len} is not the row's {row.target}")
    return trainer


def measure_trainer(row: Row, base, cfg, device, args, peak: float) -> None:
    """Warm-up and timed steps of the trainer's own step (``Trainer._train_step``: the batch from
    its loader, forward and backward, the statistics' all-reduce, clip, update, schedule), timed
    from outside with the device synchronised: what a run of this config trains at."""
    import tempfile

    with tempfile.TemporaryDirectory() as out:
        trainer = build_trainer(row, device, args, Path(out))
        row.loss_chunk = trainer.model.loss_chunk_size
        batches = trainer._batches()
        t0 = time.perf_counter()
        trainer._train_step(batches)
        # a step that does not log leaves its figures on the device: read them as a logging step does
        row.first_loss = trainer._read_figures()[-1]["loss"]
        row.compile_s = time.perf_counter() - t0
        warmup, steps = (args.compiled_warmup, args.compiled_steps) if row.compiled else (args.warmup, args.steps)
        for _ in range(warmup - 1):
            trainer._train_step(batches)
        free_memory(device)
        times, _ = trainer_steps(trainer, batches, steps, device)
        record = trainer._read_figures()[-1]  # after the timing, as the next logging step would
        if not math.isfinite(record["loss"]):
            row.error = "non-finite loss"
        finish(row, times, cfg, device, peak)
        if device.type == "cuda":
            row.plan_mb = planned_bytes(cfg, device, row.micro_batch, row.seq, row.target, row.loss_chunk) / 2**20


def timed_steps(step, steps: int, device: torch.device):
    """``steps`` calls of ``step`` timed together, the device synchronised before and after, not
    between: the host runs ahead as in a run, and a step that reads the device stalls it there.
    ([the mean step's seconds], the last call's result)."""
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        out = step()
    sync(device)
    return [(time.perf_counter() - t0) / steps], out


def trainer_steps(trainer, batches, steps: int, device: torch.device) -> tuple[list[float], dict]:
    """``timed_steps`` of the trainer's own step: the mean step and the last step's record."""
    return timed_steps(lambda: trainer._train_step(batches), steps, device)


def finish(row: Row, times: list[float], cfg, device, peak: float) -> None:
    row.step_s = statistics.median(times)
    row.tokens_per_s = row.micro_batch * (row.seq + (row.target or 0)) / row.step_s
    row.mfu = training_flops(cfg, row.micro_batch, row.seq, row.target) / row.step_s / peak
    if device.type == "cuda":
        row.peak_mb = torch.cuda.max_memory_allocated(device) / 2**20


def run_contender(row: Row, base: torch.nn.Module, cfg, device, args, peak: float) -> Row:
    """``measure`` the contender; out of memory, halve the micro-batch and start again."""
    while True:
        free_memory(device)
        torch._dynamo.reset()
        try:
            (measure_trainer if row.contender == "trainer" else measure)(row, base, cfg, device, args, peak)
            return row
        except torch.OutOfMemoryError:
            if row.micro_batch == 1:
                row.error = "out of memory at micro-batch 1"
                return row
        finally:
            free_memory(device)
        row.micro_batch //= 2
        row.oom_retries += 1


def start_micro_batch(args, family: str, contender: str, compiled: bool, device_name: str) -> int | None:
    """The micro-batch this contender settled on in ``--start-from`` (an earlier results file of the
    same device): a row that starts there skips the out-of-memory tries a compiled contender pays a
    whole compile for. The trainer's row the file lacks starts where the raw loop's settled; a
    compiled row the file lacks at twice its eager row's (HF gpt2 on an H100: eager 32, compiled
    64). None where the file has neither, or is of another device."""
    prior = getattr(args, "prior", None)
    if not prior or prior.get("device") != device_name:
        return None
    settled = {
        (r["family"], r["contender"], r["compiled"]): int(r["micro_batch"])
        for r in prior.get("training", [])
        if not r.get("error")
    }
    if (family, contender, compiled) in settled:
        return settled[(family, contender, compiled)]
    if contender == "trainer" and (family, "tformer", compiled) in settled:
        # the same model and head as the raw loop (scripts/gpu_session.sh's `more` runs the trainer
        # on its own, from the `all` part's file)
        return settled[(family, "tformer", compiled)]
    if compiled and (family, contender, False) in settled:
        return 2 * settled[(family, contender, False)]
    return None


def row_config(family: str, name: str, s: int, device: torch.device, fill: float):
    """The row's model: the preset, with a zoo row's overrides, a cut MoE row at the layers that fit."""
    cfg = preset(name)
    if family in ZOO_ROWS:
        cfg = cfg.replace(**ZOO_OVERRIDES)
    if family in ZOO_CUT and device.type == "cuda":
        cfg = cfg.replace(num_layers=fit_layers(cfg, s, torch.cuda.mem_get_info(device)[0], fill))
    return cfg


def fit_layers(cfg, s: int, free: float, fill: float) -> int:
    """The most of ``cfg``'s layers whose planned step at ``ZOO_CUT_MICRO_BATCH`` (the head chunked
    by the trainer's rule) fits ``fill`` of ``free`` bytes; a one-line exit when not even one does."""

    def fits(layers: int) -> bool:
        c = cfg.replace(num_layers=layers)
        b = ZOO_CUT_MICRO_BATCH
        state_free = free_after_states(free, num_parameters(c), "ddp", 1, 1, 1)
        chunk = auto_chunk_size(b * s, c.padded_vocab_size, 6, state_free)
        return planned_bytes(c, torch.device("cuda"), b, s, None, chunk) <= fill * free

    low, high = 0, cfg.num_layers  # the bytes grow with the layers: bisect for the last that fits
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    if not low:
        raise SystemExit(f"{cfg.flavour}: not one layer fits {fill:.0%} of {free / 2**30:.1f} GiB free; free the device")
    return low


def bench_training(family: str, args, device: torch.device, peak: float, done=lambda row: None) -> list[Row]:
    name, s, t = (TINY_ROWS if args.tiny else ROWS)[family]
    cfg = row_config(family, name, s, device, args.fill)
    torch.manual_seed(0)
    ours = theirs = None
    if {"tformer", "HF"} & set(args.contenders):
        ours = build_model(cfg)  # on the CPU: every contender copies these weights to the device
        theirs = to_hf_model(ours) if "HF" in args.contenders else None
        n = sum(p.numel() for p in ours.parameters())
    else:  # the trainer builds its own model: llama-1b's ~15 s of CPU initialisation spared
        n = num_parameters(cfg)
    if args.micro_batch == "auto":
        b = 4 if device.type == "cpu" else auto_micro_batch(cfg, device, s, t, args.loss_chunk, args.fill, n)
    else:
        b = int(args.micro_batch)
    how = f" (planner, fill {args.fill:.0%})" if args.micro_batch == "auto" and device.type == "cuda" else ""
    target = f" -> {t}" if t else ""
    full = preset(name).num_layers
    cut = f" cut to {cfg.num_layers} of {full} layers" if cfg.num_layers != full else ""
    print(f"\n[{family}] {name}{cut}: {n / 1e6:.1f}M parameters, seq {s}{target}, micro-batch {b}{how}", flush=True)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    rows = []
    for compiled in args.compile:
        for who, base in [(w, m) for w, m in (("tformer", ours), ("trainer", None), ("HF", theirs)) if w in args.contenders]:
            start = start_micro_batch(args, family, who, compiled, device_name) if args.micro_batch == "auto" else None
            raw = [r for r in rows if (r.contender, r.compiled) == ("tformer", compiled) and not r.error]
            if who == "trainer" and start is None and raw:
                start = raw[0].micro_batch  # the same model and head as the raw loop: where it settled
            row = Row(family, name, who, compiled, min(b, start) if start else b, s, t)
            row.num_layers = cfg.num_layers if cut else None
            rows.append(run_contender(row, base, cfg, device, args, peak))
            r = rows[-1]
            done(r)
            print(
                f"  {who:7} {'compiled' if compiled else 'eager':8} micro-batch {r.micro_batch:3}: "
                f"{r.tokens_per_s:10,.0f} tok/s, MFU {r.mfu:6.1%}, step {r.step_s * 1e3:8.1f} ms, "
                f"first step {r.compile_s:6.1f} s, loss {r.first_loss:.4f}"
                + (f", peak {r.peak_mb / 1024:.2f} GiB" if math.isfinite(r.peak_mb) else "")
                + (f", plan {r.plan_mb / 1024:.2f} GiB" if math.isfinite(r.plan_mb) else "")
                + (f"  [{r.error}]" if r.error else ""),
                flush=True,
            )
    return rows


# --------------------------------------------------------------------------------------------
def fp8_planned(name: str, layers: int, b: int, s: int, capacity: float) -> float:
    """The planner's bytes for the 8B-shaped row cut to ``layers`` (bf16 autocast over fp32 weights,
    fused AdamW, the head chunked by the trainer's rule for a device of ``capacity`` bytes): the
    bf16 step, which float8 does not outgrow (its casts are transient; the saved inputs stay bf16)."""
    cfg = preset(name).replace(num_layers=layers)
    free = free_after_states(capacity, num_parameters(cfg), "ddp", 1, 1, 1)
    chunk = auto_chunk_size(b * s, cfg.padded_vocab_size, 6, free)
    return planned_bytes(cfg, torch.device("cuda"), b, s, None, chunk)


def fp8_shape(name: str, s: int, capacity: float, fill: float) -> tuple[int, int]:
    """(layers, micro-batch) of the 8B-shaped row: the most layers (up to ``FP8_MAX_LAYERS``) whose
    planned step fits ``fill`` of ``capacity`` at micro-batch ``FP8_MICRO_BATCH``, else at 1."""
    for b in (FP8_MICRO_BATCH, 1):
        low, high = 0, FP8_MAX_LAYERS  # the bytes grow with the layers: bisect for the last that fits
        while low < high:
            mid = (low + high + 1) // 2
            if fp8_planned(name, mid, b, s, capacity) <= fill * capacity:
                low = mid
            else:
                high = mid - 1
        if low:
            return low, b
    raise SystemExit(
        f"--precision fp8: not one {name}-wide layer at sequence {s} fits {fill:.0%} of {capacity / 2**30:.1f} GiB "
        "free on this device; free the device or raise --fill"
    )


def to_float8(model: torch.nn.Module, recipe: str, compiled: bool, device: torch.device) -> None:
    """The blocks' linear layers in float8 as ``precision: fp8`` converts them (emulated on a CPU)."""
    from tformer.parallel.config import Float8Config
    from tformer.parallel.float8 import compile_flags, convert_to_float8

    convert_to_float8(model, Float8Config(recipe=recipe), device)  # type: ignore[arg-type]
    compile_flags(recipe, compiled)


def bench_fp8(args, device: torch.device, peak: float, done=lambda row: None) -> list[Row]:
    """The 8B-shaped row (module docstring): bf16, float8 tensorwise, float8 rowwise, each built on
    the device from the same seed, in each of ``--compile``'s modes."""
    name, s = TINY_FP8_ROW if args.tiny else FP8_ROW
    capacity = TINY_FP8_CAPACITY if args.tiny else torch.cuda.mem_get_info(device)[0]
    layers, b = fp8_shape(name, s, capacity, args.fill)
    if args.micro_batch != "auto":
        b = int(args.micro_batch)
    cfg = preset(name).replace(num_layers=layers)
    print(
        f"\n[fp8] {name} cut to {layers} layers ({num_parameters(cfg) / 1e9:.2f}B parameters; the planner's "
        f"most at {fill_words(args.fill, capacity)}), seq {s}, micro-batch {b}",
        flush=True,
    )
    rows = []
    for recipe in FP8_RECIPES:
        for compiled in args.compile:
            row = Row("llama", name, "tformer", compiled, b, s, None, num_layers=layers, float8=recipe)
            rows.append(run_contender(row, None, cfg, device, args, peak))
            done(row)
            print(
                f"  {recipe or 'bf16':10} {'compiled' if compiled else 'eager':8} micro-batch {row.micro_batch:3}: "
                f"{row.tokens_per_s:10,.0f} tok/s, MFU (bf16 peak) {row.mfu:6.1%}, step {row.step_s * 1e3:8.1f} ms, "
                f"first step {row.compile_s:6.1f} s"
                + (f", peak {row.peak_mb / 1024:.2f} GiB" if math.isfinite(row.peak_mb) else "")
                + (f"  [{row.error}]" if row.error else ""),
                flush=True,
            )
    return rows


def check_fp8(device: torch.device) -> None:
    """--precision fp8 refused in one line before any work: no torchao, or a GPU without FP8 cores."""
    from tformer.config import ConfigError
    from tformer.parallel.float8 import MIN_CAPABILITY, torchao_float8

    try:
        torchao_float8()
    except ConfigError as e:
        raise SystemExit(f"--precision fp8: {e}") from None
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < MIN_CAPABILITY:
        raise SystemExit(
            f"--precision fp8 needs FP8 tensor cores (compute capability 8.9+); {torch.cuda.get_device_name(device)} "
            "has none: run the bf16 rows only"
        )


def fill_words(fill: float, capacity: float) -> str:
    return f"{fill:.0%} of {capacity / 2**30:.1f} GiB"


def fp8_verdicts(rows: list[Row]) -> list[str]:
    """Each float8 recipe's tokens/s over bf16's on the 8B-shaped row, compiled (eager where only
    eager ran: the tiny CPU check); a recipe without a finished row, or bf16 without one, misses."""
    mode = any(r.compiled for r in rows)
    finished = {r.float8: r for r in rows if r.compiled == mode and not r.error and r.float8 in FP8_RECIPES}
    how = "compiled" if mode else "eager"
    shape = f"{rows[0].preset} x{rows[0].num_layers}" if rows else "8B-shaped row"
    lines = []
    for recipe, target in FP8_TARGETS.items():
        base, r = finished.get(None), finished.get(recipe)
        if base is None or r is None:
            lines.append(f"fp8 {shape} {recipe} {how}: no finished {'bf16' if base is None else recipe} row: MISS")
            continue
        ratio = r.tokens_per_s / base.tokens_per_s
        verdict = "PASS" if ratio >= target else "MISS"
        lines.append(f"fp8 {shape} {recipe} / bf16 {how} tokens/s = {ratio:.2f} (>= {target}): {verdict}")
    return lines


# --------------------------------------------------------------------------------------------
def bench_generate(family: str, args, device: torch.device) -> list[dict]:
    """Greedy KV-cached decoding, tformer ``generate`` against HF ``generate``, bf16 weights."""
    name, s, _ = (TINY_ROWS if args.tiny else ROWS)[family]
    cfg = row_config(family, name, s, device, args.fill)
    torch.manual_seed(0)
    ours = build_model(cfg)
    theirs = to_hf_model(ours)
    ours, theirs = (m.to(device, torch.bfloat16).eval() for m in (ours, theirs))
    prompt_len, new = (8, 16) if args.tiny else (128, 256)
    out = []
    for b in (1, 8):
        prompt = torch.randint(3, cfg.vocab_size, (b, prompt_len), generator=torch.Generator().manual_seed(b)).to(device)
        mask = torch.ones_like(prompt)

        hf_args = dict(attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, num_beams=1)
        runs = {
            "tformer": lambda p=prompt: generate(ours, p, new, eos_token_id=None),
            "HF": lambda p=prompt, kw=hf_args: theirs.generate(input_ids=p, pad_token_id=cfg.pad_token_id, **kw),
        }
        times: dict[str, list[float]] = {"tformer": [], "HF": []}
        tokens = {}
        with torch.inference_mode():
            for fn in runs.values():
                fn()  # warm-up
            for _ in range(args.gen_repeats):
                for who, fn in runs.items():
                    sync(device)
                    t0 = time.perf_counter()
                    tokens[who] = fn()
                    sync(device)
                    times[who].append(time.perf_counter() - t0)
        a, c = tokens["tformer"][:, -new:], tokens["HF"][:, -new:]
        same = (a == c).float().mean().item() if a.shape == c.shape else float("nan")
        row = dict(
            family=family,
            preset=name,
            batch=b,
            prompt=prompt_len,
            new_tokens=new,
            tformer_tok_s=b * new / statistics.median(times["tformer"]),
            hf_tok_s=b * new / statistics.median(times["HF"]),
            same_tokens=same,
        )
        row["ratio"] = row["tformer_tok_s"] / row["hf_tok_s"]
        out.append(row)
        print(
            f"  generate {family} batch {b}: tformer {row['tformer_tok_s']:8,.0f} tok/s, HF {row['hf_tok_s']:8,.0f} "
            f"tok/s -> {row['ratio']:.2f}x; identical tokens {same:.0%}",
            flush=True,
        )
    return out


# --------------------------------------------------------------------------------------------
def verdicts(rows: list[Row], gens: list[dict], device: torch.device) -> list[str]:
    """The issue's targets, one line each: PASS / MISS with the figure."""
    lines = []

    def best(family: str, who: str, compiled: bool | None = None) -> Row | None:
        cands = [
            r
            for r in rows
            if r.family == family and r.contender == who and not r.error and (compiled is None or r.compiled == compiled)
        ]
        return max(cands, key=lambda r: r.tokens_per_s, default=None)

    def mark(ok: bool) -> str:
        return "PASS" if ok else "MISS"

    for family in dict.fromkeys(r.family for r in rows):
        ours, theirs = best(family, "tformer"), best(family, "HF")
        if ours and theirs:
            ratio = ours.tokens_per_s / theirs.tokens_per_s
            target = TARGETS["zoo_vs_hf" if family in ZOO_ROWS else "vs_hf"]
            lines.append(f"{family}: best tformer / best HF tokens/s = {ratio:.2f} (>= {target}): {mark(ratio >= target)}")
        if family == "llama":
            compiled = best(family, "tformer", True)
            if compiled and theirs:
                ratio = compiled.tokens_per_s / theirs.tokens_per_s
                lines.append(
                    f"llama: tformer compiled MFU {compiled.mfu:.1%} (>= {TARGETS['llama_mfu']:.0%}): "
                    f"{mark(compiled.mfu >= TARGETS['llama_mfu'])}; vs best HF {ratio:.2f}x "
                    f"(>= {TARGETS['llama_vs_hf']}): {mark(ratio >= TARGETS['llama_vs_hf'])}"
                )
        for compiled in (False, True):
            raw, trainer = best(family, "tformer", compiled), best(family, "trainer", compiled)
            if raw and trainer:
                ratio = trainer.tokens_per_s / raw.tokens_per_s
                lines.append(
                    f"{family} {'compiled' if compiled else 'eager'}: trainer / raw loop tokens/s = {ratio:.2f} "
                    f"(>= {TARGETS['trainer']}): {mark(ratio >= TARGETS['trainer'])}"
                )
        if device.type == "cuda":
            for r in rows:
                if r.family == family and r.contender in ("tformer", "trainer") and not r.error:
                    off = r.plan_mb / r.peak_mb - 1
                    mode = "compiled" if r.compiled else "eager"
                    lines.append(
                        f"{family} {r.contender} {mode}: plan/measured peak {r.plan_mb / r.peak_mb:.3f} "
                        f"(within {TARGETS['plan']:.0%}): {mark(abs(off) <= TARGETS['plan'])}"
                    )
    for g in gens:
        lines.append(
            f"generate {g['family']} batch {g['batch']}: {g['ratio']:.2f}x HF (>= {TARGETS['generate']}): "
            f"{mark(g['ratio'] >= TARGETS['generate'])}"
        )
    return lines


def _chunk(text: str) -> int | str | None:
    if text in ("auto", "null"):
        return None if text == "null" else text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: use auto, null or a positive number of tokens")
    return int(text)


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny presets and sequences (runs on CPU; CI)")
    p.add_argument(
        "--precision",
        default="bf16",
        choices=("bf16", "fp8"),
        help="bf16: every family; fp8: the 8B-shaped row in bf16, float8 tensorwise and rowwise (compiled by default)",
    )
    p.add_argument(
        "--family",
        default=None,
        help="comma list of gpt2, llama, bert, t5 (the default); zoo rows: " + ", ".join(ZOO_ROWS) + " (zoo: all)",
    )
    p.add_argument("--compile", default=None, help="comma list of off, on (default off,on; --precision fp8: on)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per contender (default 10; --tiny 2)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps, compile included (default 3; --tiny 1)")
    p.add_argument("--compiled-steps", type=int, default=None, help="timed steps of a compiled contender (default --steps)")
    p.add_argument(
        "--compiled-warmup", type=int, default=None, help="untimed compiled steps, compile included (default --warmup)"
    )
    p.add_argument(
        "--start-from",
        default=None,
        help="an earlier results JSON of the same device: each contender starts at the micro-batch it settled on there",
    )
    p.add_argument(
        "--contenders",
        default=None,
        help="comma list of tformer (its raw loop), trainer (Trainer's step), HF (default: all three)",
    )
    p.add_argument("--micro-batch", default="auto", help="auto (the planner fills the GPU) or a number")
    p.add_argument("--fill", type=float, default=0.85, help="share of free device memory the planner may fill")
    p.add_argument(
        "--loss-chunk", type=_chunk, default=LossConfig().chunk_size, help="tformer's loss.chunk_size: auto, null or N"
    )
    p.add_argument("--peak", type=float, default=None, help="dense bf16 peak in TFLOP/s (default: the GPU table)")
    p.add_argument("--no-generate", action="store_true", help="skip the generation rows")
    p.add_argument("--gen-repeats", type=int, default=3)
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when visible)")
    p.add_argument("--json", default=None, help="write every row to this JSON file")
    args = p.parse_args(argv)
    if args.precision == "fp8" and (args.family or args.contenders):
        p.error("--precision fp8 runs its own row (Llama-3-8B's width, tformer's loop): drop --family and --contenders")
    args.family = args.family or "gpt2,llama,bert,t5"
    args.family = args.family.replace("zoo", ",".join(ZOO_ROWS))  # every zoo row
    args.contenders = args.contenders or "tformer,trainer,HF"
    args.families = [f for f in args.family.split(",") if f]
    if bad := [f for f in args.families if f not in ROWS]:
        p.error(f"unknown family {bad[0]!r}; use gpt2, llama, bert, t5, {', '.join(ZOO_ROWS)} or zoo (all of those)")
    args.contenders = [c for c in args.contenders.split(",") if c]
    if bad := [c for c in args.contenders if c not in ("tformer", "trainer", "HF")]:
        p.error(f"unknown contender {bad[0]!r}; use tformer, trainer or HF")
    args.compile = args.compile or ("on" if args.precision == "fp8" else "off,on")
    modes = [m for m in args.compile.split(",") if m]
    if bad := [m for m in modes if m not in ("off", "on")]:
        p.error(f"--compile takes off and/or on, not {bad[0]!r}")
    args.compile = [m == "on" for m in modes]
    if args.micro_batch != "auto" and not (args.micro_batch.isdigit() and int(args.micro_batch) > 0):
        p.error(f"--micro-batch must be auto or a positive number, not {args.micro_batch!r}")
    if not 0 < args.fill <= 1:
        p.error(f"--fill must be in (0, 1], not {args.fill}")
    args.steps = args.steps or (2 if args.tiny else 10)
    args.warmup = args.warmup or (1 if args.tiny else 3)
    args.compiled_steps = args.compiled_steps or args.steps
    args.compiled_warmup = args.compiled_warmup or args.warmup
    if min(args.steps, args.warmup, args.compiled_steps, args.compiled_warmup) < 1:
        p.error("--steps, --warmup, --compiled-steps and --compiled-warmup must be positive")
    args.prior = None
    if args.start_from:
        try:
            args.prior = json.loads(Path(args.start_from).read_text())
        except (OSError, ValueError) as e:
            p.error(f"--start-from {args.start_from}: not a results JSON ({e}); name a bench/results file or drop it")
    if args.tiny:
        args.gen_repeats = 1
    return args


def main(argv=None) -> dict:
    args = parse(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda, but no CUDA GPU is visible; use --device cpu --tiny")
    if device.type == "cpu" and not args.tiny:
        raise SystemExit("no GPU here: the full sizes need one; run with --tiny on a CPU")
    if args.precision == "fp8":
        check_fp8(device)
    from importlib.metadata import version

    hf_version = version("transformers")
    if args.precision != "fp8" and ("HF" in args.contenders or not args.no_generate):  # 2-5 s of imports
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if args.peak:
        peak, source = args.peak * 1e12, "--peak"
    else:
        peak, source = peak_flops(device, torch.bfloat16)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(
        f"{name}; torch {torch.__version__}, transformers {hf_version}; bf16 autocast, fp32 master "
        f"weights; dense bf16 peak {peak / 1e12:.1f} TFLOP/s ({source}); {args.warmup} warm-up + {args.steps} "
        f"timed steps per contender; tformer loss chunk {args.loss_chunk}",
        flush=True,
    )
    rows: list[Row] = []
    gens: list[dict] = []

    def result(lines: list[str]) -> dict:
        return dict(
            device=name,
            torch=torch.__version__,
            transformers=hf_version,
            date=time.strftime("%Y-%m-%d"),
            peak_tflops=peak / 1e12,
            peak_source=source,
            training=[asdict(r) for r in rows],
            generation=gens,
            verdicts=lines,
        )

    def save(lines: list[str]) -> None:
        """The file holds every finished row at any moment: a deadline that kills the run loses
        only the row in flight (written whole and renamed, so a kill mid-write leaves the last one)."""
        if args.json:
            write_atomically(Path(args.json), json.dumps(result(lines), indent=1) + "\n")

    def done(row: Row) -> None:
        rows.append(row)
        save([])

    if args.precision == "fp8":
        bench_fp8(args, device, peak, done)
        lines = fp8_verdicts(rows)
    else:
        for family in args.families:
            bench_training(family, args, device, peak, done)
            if not args.no_generate and preset(ROWS[family][0]).family != "encoder":  # encoders do not generate
                gens += bench_generate(family, args, device)
                save([])
        lines = verdicts(rows, gens, device)
    print("\n" + "\n".join(lines))
    save(lines)
    return result(lines)


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".part")
    tmp.write_text(text)
    os.replace(tmp, path)


if __name__ == "__main__":
    main()
