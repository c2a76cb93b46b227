"""Try to resume each of several checkpoints in one process (one process group for all of them)
and write what happened to JSON: ``{"label": "loaded" | "error: <message>"}``.

    python resume_sweep.py JOBS.json OUT.json   # JOBS: [{"label", "recipe", "overrides"}, ...]
"""

import json
import sys
import traceback

from tformer.train.config import load_config
from tformer.train.trainer import Trainer

jobs = json.loads(open(sys.argv[1]).read())
results = {}
for job in jobs:
    try:
        Trainer(load_config(job["recipe"], job["overrides"]))
        results[job["label"]] = "loaded"
    except Exception as e:  # noqa: BLE001 - recorded for the test to judge
        text = str(e)
        results[job["label"]] = (
            f"error: {text}" if "\n" not in text.strip() else f"multi-line {type(e).__name__}: {traceback.format_exc()}"
        )
    with open(sys.argv[2], "w") as f:
        json.dump(results, f, indent=1)
