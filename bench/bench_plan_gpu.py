"""The planner's step time and memory against tformer's rows measured on a GPU (bench/results/).

    PYTHONPATH=. python bench/bench_plan_gpu.py [RESULTS.json ...] [--gpu PROFILE]

Each tformer row of each file is priced as it ran (``tformer.plan.gpu_rows``) on ``--gpu``: a
profile name or a file from ``tformer plan --calibrate`` on that card; by default the datasheet
profile of the file's device. Targets (issue #43): step time within +-35% with a datasheet
profile, +-20% with a calibrated one; peak memory within 10%. One line per row, PASS/MISS at the
end, MISS sets the exit code. Runs in seconds on a CPU (default: every file of bench/results/).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tformer.plan import gpu_rows  # noqa: E402
from tformer.plan.report import hardware  # noqa: E402

RESULTS = Path(__file__).with_name("results")
DATASHEET, CALIBRATED, MEMORY = 0.35, 0.20, 0.10


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="*", type=Path, help="bench_gpu JSON files (default: bench/results/*.json)")
    p.add_argument("--gpu", default=None, help="profile name or calibration file (default: the device's datasheet)")
    args = p.parse_args(argv)
    files = args.results or sorted(RESULTS.glob("*.json"))
    calibrated = args.gpu is not None and Path(args.gpu).suffix == ".json"
    tolerance = CALIBRATED if calibrated else DATASHEET
    times = memories = 0
    rows = 0
    for path in files:
        device = json.loads(path.read_text())["device"]
        hw = hardware(args.gpu or gpu_rows.card_of(device), [])
        print(f"{path.name} ({device}) on {hw.name}: planned / measured")
        for row, chunk in gpu_rows.tformer_rows(path):
            step, memory = gpu_rows.planned(row, chunk, hw)
            t, m = step / row["step_s"], memory / (row["peak_mb"] * 2**20)
            times += abs(t - 1) <= tolerance
            memories += abs(m - 1) <= MEMORY
            rows += 1
            mode = "compiled" if row["compiled"] else "eager"
            print(
                f"  {row['preset']:<12}{mode:<9}mb {row['micro_batch']:>4}  chunk {str(chunk):>6}  step "
                f"{row['step_s'] * 1e3:8.1f} ms planned {step * 1e3:8.1f} ({t:.2f})  memory {m:.3f}"
            )
    ok = times == rows and memories == rows
    print(f"step time within +-{tolerance:.0%}: {times} of {rows} rows; memory within {MEMORY:.0%}: {memories} of {rows}")
    print("PASS" if ok else "MISS")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
