"""Run the trainer and SIGKILL this process at a chosen point: after step N (``--kill-after N``),
in the middle of writing the checkpoint of step N, before it is sealed (``--kill-in-save N``), or
while the background write of step N's checkpoint (``checkpoint.async=true``) is held up, from
the training loop one step later (``--kill-in-async-write N``); or after step N's checkpoint is
saved, before its evaluation (``--kill-before-eval N``) or before its log line (``--kill-before-log N``)."""

import argparse
import logging
import os
import signal

from tformer.checkpoint import io
from tformer.train import trainer as trainer_mod
from tformer.train.loop import components as components_mod
from tformer.train.config import load_config

p = argparse.ArgumentParser()
p.add_argument("config")
p.add_argument("overrides", nargs="*")
p.add_argument("--kill-after", type=int)
p.add_argument("--kill-in-save", type=int)
p.add_argument("--kill-in-async-write", type=int)
p.add_argument("--kill-before-eval", type=int)
p.add_argument("--kill-before-log", type=int)
p.add_argument(
    "--spike-at-sample", type=int, help="blow the loss up (x100) on the batch that starts at this global sample index"
)
args = p.parse_args()
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

if args.kill_in_save is not None:
    real_commit = io.commit

    def commit(root, step, keep):
        if step == args.kill_in_save:
            os.kill(os.getpid(), signal.SIGKILL)  # files written, marker and rename not yet done
        return real_commit(root, step, keep)

    io.commit = commit  # the checkpoint manager commits through the module


if args.kill_in_async_write is not None:
    import time

    from torch.distributed.checkpoint import filesystem

    real_write = filesystem._FileSystemWriter.write_data
    held = f"step_{args.kill_in_async_write:08d}"

    def slow_write(self, plan, planner):
        if held in str(self.path):
            time.sleep(120)  # a slow disk: the process is killed long before this ends
        return real_write(self, plan, planner)

    filesystem._FileSystemWriter.write_data = slow_write


def kill_after(trainer, record):
    if args.kill_after is not None and record["step"] == args.kill_after:
        os.kill(os.getpid(), signal.SIGKILL)
    if args.kill_in_async_write is not None and record["step"] == args.kill_in_async_write + 1:
        assert trainer.ckpt.in_flight == args.kill_in_async_write  # the loop went on; the write did not end
        os.kill(os.getpid(), signal.SIGKILL)


def plant_spike(trainer, sample):
    """The loss of the optimizer step whose data starts at global sample ``sample`` is x100."""
    forward = trainer.model.forward

    def patched(*a, **kw):
        out = forward(*a, **kw)
        if trainer.model.training and trainer.consumed == sample:
            out.loss = out.loss * 100.0
        return out

    trainer.model.forward = patched


if args.kill_before_eval is not None:
    real_evaluate = trainer_mod.Trainer.evaluate

    def evaluate(self):
        if self.step == args.kill_before_eval:
            assert (self.ckpt_root / f"step_{self.step:08d}").is_dir()  # saved, not yet evaluated
            os.kill(os.getpid(), signal.SIGKILL)
        return real_evaluate(self)

    trainer_mod.Trainer.evaluate = evaluate

if args.kill_before_log is not None:
    real_log = components_mod.log_step

    def log_step(record, *rest):
        if record["step"] == args.kill_before_log:
            os.kill(os.getpid(), signal.SIGKILL)  # saved and evaluated, the line not yet written
        return real_log(record, *rest)

    components_mod.log_step = log_step

t = trainer_mod.Trainer(load_config(args.config, args.overrides), callbacks=[kill_after])
if args.spike_at_sample is not None:
    plant_spike(t, args.spike_at_sample)
t.fit()
