"""The time and memory model (tformer/plan) against published GPU measurements.

Rows: bench/published_speed.json (torchtitan's Llama 3.1 H100 tables, Dec 2024; the file says
which sources it could not include and why). For each row the planner can express: predicted vs
published tokens/s per GPU and memory; for the others, why not. Targets (issue 30): tokens/s within
+-20% and memory within +-10% on >= 80% of the expressible rows, and the published order kept
within each table that compares layouts of one model. Runs in seconds on a CPU (no GPU needed).

    PYTHONPATH=. .venv/bin/python bench/bench_plan_published.py
"""

from __future__ import annotations

import itertools
from pathlib import Path

from tformer.plan.published import load, predict

DATA = Path(__file__).with_name("published_speed.json")


def main() -> int:
    data = load(DATA)
    outcomes = [predict(data, row) for row in data["rows"]]
    print(f"{'row':<46}{'pub tok/s':>10}{'pred':>9}{'err':>7}{'pub GiB':>9}{'pred':>7}{'err':>7}")
    for o in outcomes:
        pub = o.row["published"]
        if o.why_not:
            print(f"{o.row['name']:<46}{pub['tokens_per_s_per_gpu']:>10,}  not expressible: {o.why_not}")
            continue
        print(
            f"{o.row['name']:<46}{pub['tokens_per_s_per_gpu']:>10,}{o.tokens_per_s:>9,.0f}{o.speed_error:>+7.0%}"
            f"{pub['memory_gib']:>9.1f}{o.memory_gib:>7.1f}{o.memory_error:>+7.0%}"
        )
    priced = [o for o in outcomes if not o.why_not]
    speed_hits = sum(abs(o.speed_error) <= 0.20 for o in priced)
    memory_hits = sum(abs(o.memory_error) <= 0.10 for o in priced)
    n = len(priced)
    print(f"\nexpressible rows: {n} of {len(outcomes)}")
    ok = n > 0
    for what, hits in (("tokens/s within +-20%", speed_hits), ("memory within +-10%", memory_hits)):
        passed = n > 0 and hits >= 0.8 * n
        ok &= passed
        print(f"{'PASS' if passed else 'FAIL'}: {what} on {hits} of {n} expressible rows (target >= 80%)")
    kept, compared = 0, 0
    by_table = itertools.groupby(priced, key=lambda o: (o.row["source"], o.row["table"]))
    for _, group in by_table:
        rows = list(group)
        for a, b in itertools.combinations(rows, 2):
            compared += 1
            published = a.row["published"]["tokens_per_s_per_gpu"] > b.row["published"]["tokens_per_s_per_gpu"]
            kept += published == (a.tokens_per_s > b.tokens_per_s)
    print(f"{'PASS' if kept == compared else 'FAIL'}: published order kept in {kept} of {compared} same-table pairs")
    return 0 if ok and kept == compared else 1


if __name__ == "__main__":
    raise SystemExit(main())
