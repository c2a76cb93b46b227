"""``tformer plot RUN_DIR``: training and validation loss curves from metrics.jsonl, as a PNG."""

from __future__ import annotations

import json
from pathlib import Path


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; pass a run directory written by tformer train")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        raise FileNotFoundError(f"{path} holds no metrics yet; train for at least log_every steps")
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label="train loss")
    val = [r for r in rows if "val_loss" in r]
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(run_dir.name)
    ax.grid(alpha=0.3)
    ax.legend()
    out = Path(out) if out else run_dir / "loss.png"
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
