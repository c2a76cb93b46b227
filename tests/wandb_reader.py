"""Read an offline W&B run back through wandb's own inspector (``wandb leet inspect --json``)."""

import json
import subprocess
import sys
from pathlib import Path


def read_offline_run(run_dir: Path) -> tuple[list[dict], dict]:
    """(history rows, config) of the ``.wandb`` transaction log in ``run_dir``."""
    exe = Path(sys.executable).with_name("wandb")
    out = subprocess.run(
        [str(exe), "leet", "inspect", "--json", str(run_dir)], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    history, config = [], {}
    for line in out.splitlines():
        rec = json.loads(line)
        if rec["type"] == "history":
            history.append(rec["history"]["item"])
        elif rec["type"] == "run":
            config.update(rec["run"].get("config", {}).get("update", {}))
        elif rec["type"] == "config":
            config.update(rec["config"].get("update", {}))
    return history, config
