"""The planner against every tformer row measured on a GPU (bench/results/, bench/bench_gpu.py).

Each row's exact run is priced with the datasheet profile of its card (``h200``, ``h100-sxm``):
the preset, micro-batch, sequence and target lengths, eager or compiled, the head's chunk, one
device (bf16 autocast over fp32 weights, fused AdamW, clip). Issue #43's targets: predicted step
time within +-35% of measured, predicted peak memory within 10%. Rows the model does not reach yet
are strict xfails whose reason gives today's ratio (planned / measured) and what is missing, so
that the fix that reaches one flips it.

The rows are priced by ``tformer.plan.gpu_rows`` (the 2026-11-26 H200 file predates the
``loss_chunk`` field: that code's default, 128 tokens, ran it).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tformer.config import ConfigError
from tformer.models.presets import preset
from tformer.plan import Layout, gpu_rows, profile, step_time
from tformer.plan.gpu_rows import card_of, tformer_rows

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"
FILES = ("2026-11-26-h200.json", "2026-11-27-h100.json", "2026-11-28-h100.json")
TIME_TOLERANCE, MEMORY_TOLERANCE = 0.35, 0.10

TIME_MISSES: dict[tuple[str, str, bool], str] = {
    ("h200", "gpt2-small", False): "0.60 (0.37 before the head's and the fp32 stream's passes): GPT-2's "
    "50,257-word vocabulary makes the eager head's GEMMs misaligned (not a multiple of 8), off cuBLAS's "
    "aligned tensor-core kernels (compiled, inductor pads them: 0.87); no datasheet rate for that",
    ("h100-sxm", "gpt2-small", False): "0.62 (0.43 before): the misaligned eager head GEMMs of a 50,257-word vocabulary",
    ("h200", "t5-base", False): "0.48 (0.38 before): T5's relative-bias attention (the memory-efficient "
    "kernel with the bias's gradient) is priced at the flash curve; no measured rate for it",
    ("h100-sxm", "t5-base", False): "0.47 (0.36 before): T5's relative-bias attention priced at the flash curve",
    ("h100-sxm", "t5-base", True): "0.54 (0.52 before): T5's relative-bias attention priced at the flash curve",
}
MEMORY_MISSES: dict[tuple[str, str, bool], str] = {
    ("h200", "t5-base", False): "0.808: the bare loop fed T5 no attention mask (see the H100 row)",
    ("h100-sxm", "t5-base", False): "0.780: the bare loop fed T5 no attention mask, and its relative bias, "
    "broadcast over the batch, held 12 GiB more than the trainer's masked batch of 2026-11-28 (48.8 GiB: "
    "plan 0.977); bench_gpu feeds T5 the mask since",
    ("h100-sxm", "bert-base", True): "0.824: compiled BERT peaked 6 GiB above eager; what its graph keeps is not counted",
    ("h100-sxm", "llama-1b", True): "1.114: the compiled block keeps less than the eager count",
}


ROWS = [
    (card_of(json.loads((RESULTS / name).read_text())["device"]), row, chunk)
    for name in FILES
    for row, chunk in tformer_rows(RESULTS / name)
]


def _id(card: str, row: dict) -> str:
    return f"{card}-{row['preset']}-{'compiled' if row['compiled'] else 'eager'}"


def _marked(misses: dict) -> list:
    params = []
    for card, row, chunk in ROWS:
        why = misses.get((card, row["preset"], row["compiled"]))
        marks = [pytest.mark.xfail(strict=True, reason=why)] if why else []
        params.append(pytest.param(card, row, chunk, id=_id(card, row), marks=marks))
    return params


def planned(card: str, row: dict, chunk: int | None) -> tuple[float, float]:
    return gpu_rows.planned(row, chunk, profile(card))


def test_every_family_eager_and_compiled_is_measured():
    """The files hold what the test is about: each family eager and compiled on the H100, each
    family eager on the H200 (the first session compiled only llama)."""
    seen = {(card, row["family"], row["compiled"]) for card, row, _ in ROWS}
    families = {"gpt2", "llama", "bert", "t5"}
    assert {(f, c) for card, f, c in seen if card == "h100-sxm"} == {(f, c) for f in families for c in (False, True)}
    assert {f for card, f, c in seen if card == "h200" and not c} == families
    assert all(math.isfinite(row["step_s"]) and row["peak_mb"] > 0 for _, row, _ in ROWS)


@pytest.mark.parametrize("card, row, chunk", _marked(TIME_MISSES))
def test_the_datasheet_profile_predicts_the_measured_step_time(card, row, chunk):
    step, _ = planned(card, row, chunk)
    ratio = step / row["step_s"]
    assert abs(ratio - 1) <= TIME_TOLERANCE, f"{_id(card, row)}: planned / measured step time {ratio:.2f}"


@pytest.mark.parametrize("card, row, chunk", _marked(MEMORY_MISSES))
def test_the_planned_memory_is_the_measured_peak(card, row, chunk):
    _, memory = planned(card, row, chunk)
    ratio = memory / (row["peak_mb"] * 2**20)
    assert abs(ratio - 1) <= MEMORY_TOLERANCE, f"{_id(card, row)}: planned / measured peak {ratio:.3f}"


# --- the terms the rows asked for, each on its own --------------------------------------------------
def test_the_head_moves_what_its_loss_path_moves():
    """Per logit on a GPU: 62 bytes eager whole, 16 compiled, 54 chunked, each chunk's in-place add
    into the fp32 weight gradient 8 bytes per weight; fp32 runs skip the copy and the cast back."""
    from tformer.plan.memory_bound import gpu_head_bytes

    cfg = preset("gpt2-small")
    v, d, tokens = cfg.padded_vocab_size, cfg.d_model, 4096
    logits = tokens * v
    assert gpu_head_bytes(cfg, Layout(), tokens) == 38 * logits
    assert gpu_head_bytes(cfg, Layout(compile=True), tokens) == 16 * logits
    assert gpu_head_bytes(cfg, Layout(precision="fp32"), tokens) == 52 * logits
    one = gpu_head_bytes(cfg, Layout(loss_chunk=tokens), tokens)
    assert one == 54 * logits + 20 * v * d
    four = gpu_head_bytes(cfg, Layout(loss_chunk=tokens // 4), tokens)
    assert four - one == 3 * 8 * v * d
    assert gpu_head_bytes(cfg, Layout(loss_chunk=tokens, compile=True), tokens) == one  # the loop stays eager


def test_a_chunked_heads_weight_gradient_runs_at_the_bf16_rate_on_a_gpu():
    from tformer.plan.compute import head_time

    cfg, hw = preset("llama-1b"), profile("h100-sxm")
    peak = hw.peak["bf16"]
    whole = head_time(cfg, Layout(), 8192, peak, hw)
    chunked = head_time(cfg, Layout(loss_chunk=8192), 8192, peak, hw)
    assert chunked[0] == pytest.approx(whole[0])
    # backward: both products at bf16's rate (models/loss.add_weight_grad), not the weight's at tf32's
    assert chunked[1] == pytest.approx(whole[1])
    fp32 = head_time(cfg, Layout(precision="fp32", loss_chunk=8192), 8192, hw.peak["fp32"], hw)
    assert fp32 == head_time(cfg, Layout(precision="fp32"), 8192, hw.peak["fp32"], hw)


def test_a_masked_lms_head_is_priced_over_its_labelled_rows():
    from tformer.plan.time import head_rows

    assert head_rows(preset("bert-base"), 1000) == 150
    assert head_rows(preset("gpt2-small"), 1000) == head_rows(preset("t5-base"), 1000) == 1000
    hw = profile("h100-sxm")
    bert = step_time(preset("bert-base"), Layout(strategy="ddp", micro_batch=8), hw, 512, memory=False)
    whole = step_time(
        preset("bert-base").replace(family="decoder", flavour="gpt2"),
        Layout(strategy="ddp", micro_batch=8),
        hw,
        512,
        memory=False,
    )
    assert bert.breakdown["memory-bound"] < whole.breakdown["memory-bound"]


def test_the_fp32_residual_stream_is_priced_under_ddp_autocast_only():
    from tformer.plan.memory_bound import fp32_stream_bytes

    cfg, hw = preset("llama-1b"), profile("h100-sxm")
    eager, compiled = (fp32_stream_bytes(cfg, 1, False, c, False, False) for c in (False, True))
    assert eager == 2 * cfg.d_model * (32 + 64 - 30) and compiled == 2 * cfg.d_model * 8
    ddp = step_time(cfg, Layout(strategy="ddp", micro_batch=2), hw, 2048, memory=False)
    fsdp = step_time(cfg, Layout(strategy="fsdp", micro_batch=2), hw, 2048, memory=False)
    fp32 = step_time(cfg, Layout(strategy="ddp", micro_batch=2, precision="fp32"), hw, 2048, memory=False)
    stream = 2 * 2048 * cfg.num_layers * eager / (hw.hbm_bandwidth * hw.hbm_efficiency)
    assert ddp.breakdown["memory-bound"] - fsdp.breakdown["memory-bound"] == pytest.approx(stream)
    # fp32 runs keep every tensor fp32: elementwise already prices them at 4 bytes
    assert fp32.breakdown["memory-bound"] > ddp.breakdown["memory-bound"]


# --- tformer plan --calibrate on a CUDA device, its logic with the measurements faked ----------------
class FakeGpu:
    """Rates a GPU might give: the thin GEMM at half the large one's rate, T5's bias kernel at a
    third of flash's, a 3 TB/s copy, 4 us per op, a misaligned GEMM at a quarter of the rate."""

    def __init__(self, name="NVIDIA H200"):
        self.card, self.calls = name, []

    def name(self):
        return self.card

    def gemm(self, m, n, k, dtype):
        self.calls.append((m, n, k, dtype))
        rate = {"bf16": 800e12, "tf32": 400e12, "fp32": 50e12}[dtype]
        return rate / 2 if m < 1024 else rate

    def attention(self, seq, mask):
        return {"causal": 300e12, "bias": 100e12, "plain": 250e12}[mask] * seq / 4096

    def bandwidth(self, nbytes):
        return 3e12

    def op_overhead(self):
        return 4e-6

    def misaligned(self):
        return 0.25


def test_gpu_calibration_derives_the_profile_from_its_measurements(tmp_path, capsys):
    from tformer.plan import load_profile
    from tformer.plan.calibrate_gpu import LARGE, THIN, calibrate_gpu
    from tformer.plan.compute import gemm_efficiency
    from tformer.plan.report import calibrate_gpu_main, hardware

    path = tmp_path / "gpu.json"
    fake = FakeGpu()
    assert calibrate_gpu_main(str(path), fake) == 0
    assert "use it with: tformer plan CONFIG --gpu" in capsys.readouterr().out
    hw = hardware(str(path), [])
    assert hw == load_profile(path) and hw.device == "cuda"
    # the curve through the two measured shapes: each shape priced at the rate it was measured at
    for shape, rate in ((LARGE, 800e12), (THIN, 400e12)):
        assert hw.peak["bf16"] * gemm_efficiency(*shape, hw) == pytest.approx(rate, rel=1e-6)
    assert hw.peak["tf32"] * gemm_efficiency(*LARGE, hw) == pytest.approx(400e12, rel=1e-6)
    assert hw.hbm_bandwidth == 3e12 and hw.hbm_efficiency == 1.0 and hw.op_overhead == 4e-6
    assert hw.misaligned_gemm == 0.25
    assert hw.attention_flops(2048, "bias") == pytest.approx(50e12) and hw.attention_flops(1024, "causal") == pytest.approx(
        75e12
    )
    # what one GPU cannot measure is the card's datasheet's: links, memory, fp8
    assert (hw.memory, hw.intra_bandwidth, hw.peak["fp8"]) == (141e9, 450e9, profile("h200").peak["fp8"])
    # priced with it, T5's bias attention costs what its kernel was measured at
    cfg, layout = preset("t5-base"), Layout(strategy="ddp", micro_batch=64, loss_parallel=False)
    slow = step_time(cfg, layout, hw, 512, 114, memory=False).breakdown["compute"]
    fake.attention = lambda seq, mask: 300e12 * seq / 4096  # the bias kernel as fast as flash
    fast = step_time(cfg, layout, calibrate_gpu(tmp_path / "other.json", fake), 512, 114, memory=False).breakdown["compute"]
    assert slow > fast


def test_gpu_calibration_stops_at_its_budget_in_one_line(tmp_path, monkeypatch):
    from tformer.plan import calibrate_gpu

    monkeypatch.setattr(calibrate_gpu, "BUDGET_S", -1.0)
    with pytest.raises(ConfigError, match="^GPU calibration ran past its -1 s budget before the fp32 GEMMs") as e:
        calibrate_gpu.calibrate_gpu(tmp_path / "gpu.json", FakeGpu())
    assert len(str(e.value).splitlines()) == 1 and not (tmp_path / "gpu.json").exists()
    assert calibrate_gpu.datasheet_of("NVIDIA H100 80GB HBM3").name == "h100-sxm"


def test_a_measured_misaligned_gemm_rate_prices_an_odd_vocabularys_eager_head(tmp_path):
    """GPT-2's 50,257-word head, eager (whole or chunked), at the share of the aligned rate the
    profile measured; compiled whole (inductor pads it) and Llama's aligned vocabulary as before;
    the datasheet profiles have no such figure and price it aligned."""
    import dataclasses

    from tformer.plan.calibrate_gpu import calibrate_gpu
    from tformer.plan.compute import head_time

    hw = calibrate_gpu(tmp_path / "gpu.json", FakeGpu())
    aligned = dataclasses.replace(hw, misaligned_gemm=None)
    gpt2, llama, peak = preset("gpt2-small"), preset("llama-1b"), hw.peak["bf16"]
    for layout in (Layout(), Layout(loss_chunk=1024), Layout(loss_chunk=1024, compile=True)):
        slow, fast = head_time(gpt2, layout, 8192, peak, hw), head_time(gpt2, layout, 8192, peak, aligned)
        assert slow == pytest.approx((fast[0] * 4, fast[1] * 4))
    for cfg, layout in ((gpt2, Layout(compile=True)), (llama, Layout())):
        assert head_time(cfg, layout, 8192, peak, hw) == head_time(cfg, layout, 8192, peak, aligned)
    assert profile("h100-sxm").misaligned_gemm is None
    with pytest.raises(ConfigError, match="misaligned_gemm=0.0 of h200 must be positive"):
        profile("h200", misaligned_gemm=0)


def test_the_bench_prints_every_row_and_misses_outside_the_calibrated_bound(tmp_path, capsys):
    """bench/bench_plan_gpu.py: one line per row, PASS within +-35% on the datasheet profile, and a
    calibrated profile (a file) held to +-20%: the same row on a card measured twice as fast misses."""
    import dataclasses
    import importlib.util

    from tformer.plan.hardware import save_profile

    spec = importlib.util.spec_from_file_location("bench_plan_gpu", RESULTS.parent / "bench_plan_gpu.py")
    assert spec and spec.loader
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    data = json.loads((RESULTS / FILES[1]).read_text())
    rows = {("llama-1b", False), ("gpt2-small", True)}  # two rows the datasheet predicts (time and memory)
    data["training"] = [r for r in data["training"] if (r["preset"], r["compiled"]) in rows and r["contender"] == "tformer"]
    results = tmp_path / "h100.json"
    results.write_text(json.dumps(data))
    assert bench.main([str(results)]) == 0
    out = capsys.readouterr().out
    assert (
        out.count("llama-1b") == out.count("gpt2-small") == 1
        and "step time within +-35%: 2 of 2 rows" in out
        and out.endswith("PASS\n")
    )
    fast = dataclasses.replace(profile("h100-sxm"), peak={k: 2 * v for k, v in profile("h100-sxm").peak.items()})
    save_profile(fast, tmp_path / "fast.json")
    assert bench.main([str(results), "--gpu", str(tmp_path / "fast.json")]) == 1
    assert "step time within +-20%: 0 of 2 rows" in capsys.readouterr().out
