"""Merge a GPU session part's bench JSON files into one (``scripts/gpu_session.sh all`` and
``more``): the device's facts once, every training row, every verdict line, the code's commit,
and the gpu tests' closing line from the log. A part that ran past its deadline gave what it
finished (bench_gpu.py writes its file after every row); a part that wrote nothing is listed under
``missing``, one that cannot be read under ``unreadable``, and the merge goes on.

With ``--price``: the planner's predicted step time and peak memory for every measured tformer and
trainer row (``tformer.plan.gpu_rows.price_rows``, the device's datasheet profile) of the merged
rows and of each further results file named after it (the session's other part), as ``plan``.

    python3 scripts/gpu_merge.py OUT.json BENCH.json [BENCH.json ...] [SESSION.log] [--price [OTHER.json ...]]
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

# issue #43's bounds for the planner on a datasheet profile
TIME_BOUND, MEMORY_BOUND = 0.35, 0.10


def main(argv: list[str]) -> int:
    price = "--price" in argv
    others = argv[argv.index("--price") + 1 :] if price else []
    out, *parts = argv[: argv.index("--price")] if price else argv
    log = Path(parts.pop()) if parts and parts[-1].endswith(".log") else None
    merged: dict = {"training": [], "generation": [], "verdicts": []}
    for part in parts:
        data = read(part, merged)
        if data is None:
            continue
        for key, value in data.items():
            if key in ("training", "generation", "verdicts"):
                merged[key] += value
            else:
                merged.setdefault(key, value)
    try:
        merged["code"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        merged["code"] = "unknown"  # the checkout travels without .git on some machines
    if log is not None and log.is_file():
        closing = [
            line for line in log.read_text().splitlines() if re.search(r"\d+ (passed|failed|skipped|errors?)\b", line)
        ]
        merged["gpu_tests"] = closing[0] if closing else "no closing line"
    summary = ""
    if price:
        summary = "; " + plan(merged, out, others)
    Path(out).write_text(json.dumps(merged, indent=1))
    print(
        f"wrote {out}: {len(merged['training'])} training rows, missing parts: {merged.get('missing', [])}"
        + (f", unreadable: {merged['unreadable']}" if "unreadable" in merged else "")
        + summary
    )
    return 0


def read(part: str, merged: dict) -> dict | None:
    path = Path(part)
    if not path.is_file():
        merged.setdefault("missing", []).append(part)  # that part ran past its deadline
        return None
    try:
        return json.loads(path.read_text())
    except ValueError:
        merged.setdefault("unreadable", []).append(part)
        return None


def plan(merged: dict, out: str, others: list[str]) -> str:
    """``merged["plan"]``: the planner against every priced row; returns the summary's words."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tformer.plan.gpu_rows import price_rows

    entries = price_rows(merged, Path(out).name)
    for other in others:
        data = read(other, merged)
        if data is not None:
            entries += price_rows(data, Path(other).name)
    merged["plan"] = entries
    for e in entries:  # one line a row in the session's log
        what = f"  plan {e['source']}: {e['preset']}{' x' + str(e['num_layers']) if e.get('num_layers') else ''} "
        what += f"{e['contender']} {'compiled' if e['compiled'] else 'eager'}{' ' + e['float8'] if e.get('float8') else ''}"
        if "error" in e:
            print(f"{what}: not priced ({e['error']})")
        else:
            memory = f"{e['memory']:.3f}" if e["memory"] is not None else "-"
            print(
                f"{what} mb {e['micro_batch']}: step {e['step_s'] * 1e3:.1f} ms, planned {e['plan_step_s'] * 1e3:.1f} "
                f"({e['time']:.2f}); peak memory planned / measured {memory}"
            )
    priced = [e for e in entries if "error" not in e]
    times = sum(abs(e["time"] - 1) <= TIME_BOUND for e in priced)
    memories = sum(e["memory"] is not None and abs(e["memory"] - 1) <= MEMORY_BOUND for e in priced)
    return (
        f"planner: {len(priced)} of {len(entries)} rows priced, step time within +-{TIME_BOUND:.0%} for {times}, "
        f"peak memory within {MEMORY_BOUND:.0%} for {memories}"
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
