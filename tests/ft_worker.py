"""One rank of a replica group (or of a plain DDP run) for tests/test_ft.py: trains through the
Trainer with the overrides given, then saves the final model and optimizer state
(``OUT/final_<tag>.pt``; under FSDP2 each rank its shards, ``OUT/final_<tag>_rank<r>.pt``) so the
test can compare groups bitwise. ``FT_TEST_PACE`` (seconds) paces every step, leaving a test time
to kill a group mid-run (when ``FT_TEST_PACE_WHILE`` is set, only while the file it names exists);
while the file ``FT_TEST_SLOW`` names exists, each step takes a second more: a restarted group has
time to start (a loaded CPU takes 10-30 s) while the live group goes on committing alone."""

from __future__ import annotations

import os
import sys
import time

import torch


def main() -> int:
    from tformer.parallel.dist import shutdown
    from tformer.train.resilience.ft import _local_tensors
    from tformer.train.config import load_config
    from tformer.train.trainer import Trainer

    tag, config, *overrides = sys.argv[1:]
    torch.set_num_threads(1)
    cfg = load_config(config, overrides)
    pace, slow = float(os.environ.get("FT_TEST_PACE", "0")), os.environ.get("FT_TEST_SLOW")
    pace_while = os.environ.get("FT_TEST_PACE_WHILE")  # a file: paced only while it exists

    def paced(trainer, record):
        wait = pace if not pace_while or os.path.exists(pace_while) else 0.0
        time.sleep(wait + (1.0 if slow and os.path.exists(slow) else 0.0))

    trainer = Trainer(cfg, callbacks=[paced])
    trainer.fit()
    state = {"model": trainer.model.state_dict(), "optimizer": trainer.optimizer.state_dict(), "step": trainer.step}
    if cfg.parallel.strategy == "fsdp" and trainer.dist.world_size > 1:  # each rank its shards
        torch.save(_local_tensors(state), os.path.join(cfg.output_dir, f"final_{tag}_rank{trainer.dist.rank}.pt"))
    elif trainer.dist.is_main:
        torch.save(state, os.path.join(cfg.output_dir, f"final_{tag}.pt"))
    shutdown(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
