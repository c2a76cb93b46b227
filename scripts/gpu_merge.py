"""Merge a GPU session's bench JSON files into one (``scripts/gpu_session.sh all``): the device's
facts once, every training row, the code's commit, and the gpu tests' closing line from the log.
A part that ran past its deadline gave what it finished (bench_gpu.py writes its file after every
row); a part that wrote nothing is listed under ``missing``, one that cannot be read under
``unreadable``, and the merge goes on.

    python3 scripts/gpu_merge.py OUT.json BENCH.json [BENCH.json ...] SESSION.log
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    out, *parts = argv
    log = Path(parts.pop()) if parts and parts[-1].endswith(".log") else None
    merged: dict = {"training": [], "generation": []}
    for part in parts:
        path = Path(part)
        if not path.is_file():
            merged.setdefault("missing", []).append(part)  # that part ran past its deadline
            continue
        try:
            data = json.loads(path.read_text())
        except ValueError:
            merged.setdefault("unreadable", []).append(part)
            continue
        for key, value in data.items():
            if key in ("training", "generation"):
                merged[key] += value
            elif key != "verdicts":
                merged.setdefault(key, value)
    try:
        merged["code"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        merged["code"] = "unknown"  # the checkout travels without .git on some machines
    if log is not None and log.is_file():
        closing = [line for line in log.read_text().splitlines() if re.search(r"\d+ (passed|failed)", line)]
        merged["gpu_tests"] = closing[0] if closing else "no closing line"
    Path(out).write_text(json.dumps(merged, indent=1))
    print(
        f"wrote {out}: {len(merged['training'])} training rows, missing parts: {merged.get('missing', [])}"
        + (f", unreadable: {merged['unreadable']}" if "unreadable" in merged else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
