"""The README's "Speed on a GPU" table, generated from the newest measurement in ``bench/results/``
(never typed by hand): one row per model and mode, tformer against HF ``transformers`` on the same
device, with the date, device, torch and transformers versions and the commit measured.

    python bench/speed_table.py            # print the table
    python bench/speed_table.py --write    # replace it in README.md (between its markers)

``tests/test_docs.py`` fails when README.md holds another table than this renders. A GPU session
(``scripts/gpu_session.sh all``) writes a new JSON; commit it under ``bench/results/`` and run
``--write``.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
README = ROOT / "README.md"
START, END = "<!-- speed-table:start -->", "<!-- speed-table:end -->"


def newest(results: Path = RESULTS) -> Path:
    """The newest result file (their names start with the date)."""
    files = sorted(results.glob("*.json"))
    if not files:
        raise SystemExit(f"no measurement under {results}")
    return files[-1]


def _cell(row: dict | None) -> str:
    if row is None or row.get("error") or not math.isfinite(row.get("tokens_per_s", math.nan)):
        return "-" if row is None else f"failed ({row.get('error') or 'no figure'})"
    return f"{row['tokens_per_s']:,.0f} ({100 * row['mfu']:.1f}%) mb {row['micro_batch']}"


def render(path: Path | None = None) -> str:
    """The table (markdown) of one result file, its provenance on the line above it."""
    path = path or newest()
    data = json.loads(path.read_text())
    rows = data["training"]
    seen: list[tuple[str, bool]] = []
    for r in rows:
        if (r["family"], r["compiled"]) not in seen:
            seen.append((r["family"], r["compiled"]))
    lines = [
        f"Measured {data['date']} on one {data['device']} (torch {data['torch']}, transformers "
        f"{data['transformers']}, tformer `{data.get('code', '?')}`), bf16 autocast over fp32 weights, "
        f"tokens/s and MFU of {data['peak_tflops']:g} TFLOP/s; `bench/results/{path.name}`:",
        "",
        "| model | mode | tformer tok/s (MFU) | HF tok/s (MFU) | tformer / HF | Trainer's step / raw loop "
        "| planned / measured peak |",
        "|---|---|---|---|---|---|---|",
    ]
    for family, compiled in seen:
        ours, theirs, trainer = (
            next((r for r in rows if (r["family"], r["compiled"], r["contender"]) == (family, compiled, who)), None)
            for who in ("tformer", "HF", "trainer")
        )
        ratio = plan = steps = "-"
        if ours and trainer and not ours.get("error") and not trainer.get("error"):
            steps = f"{trainer['tokens_per_s'] / ours['tokens_per_s']:.2f}"
        if ours and theirs and not ours.get("error") and not theirs.get("error"):
            ratio = f"{ours['tokens_per_s'] / theirs['tokens_per_s']:.2f}"
        if ours and math.isfinite(ours.get("plan_mb", math.nan)) and math.isfinite(ours.get("peak_mb", math.nan)):
            plan = f"{ours['plan_mb'] / ours['peak_mb']:.2f}"
        model = (ours or theirs or {}).get("preset", family)
        seq = (ours or theirs or {}).get("seq")
        target = (ours or theirs or {}).get("target")
        shape = f"{model}, seq {seq}" + (f" -> {target}" if target else "")
        mode = "compiled" if compiled else "eager"
        lines.append(f"| {shape} | {mode} | {_cell(ours)} | {_cell(theirs)} | {ratio} | {steps} | {plan} |")
    return "\n".join(lines) + "\n"


def readme_table(text: str) -> str:
    """What README.md holds between the markers."""
    if START not in text or END not in text:
        raise SystemExit(f"README.md has no {START} ... {END} block")
    return text.split(START, 1)[1].split(END, 1)[0].strip("\n") + "\n"


def write(readme: Path = README, table: str | None = None) -> None:
    text = readme.read_text()
    readme_table(text)  # the markers are there
    head, rest = text.split(START, 1)
    tail = rest.split(END, 1)[1]
    readme.write_text(f"{head}{START}\n{table or render()}{END}{tail}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--write", action="store_true", help="replace the table in README.md")
    p.add_argument("--results", type=Path, default=None, help="a result file (default: the newest)")
    args = p.parse_args(argv)
    table = render(args.results)
    if args.write:
        write(table=table)
    print(table, end="")


if __name__ == "__main__":
    main()
