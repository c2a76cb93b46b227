"""The planner: what each layout costs in memory (parallel/plan.py, to move here) and in time.

``step_time(cfg, Layout(...), profile("h100-sxm"), seq_len)`` predicts one step's seconds, tokens/s
per device, MFU and the time to train N tokens, with a breakdown (time.py); hardware.py holds the
device figures; report.py prints ``tformer plan``'s tables.
"""

from .hardware import PROFILES, Hardware, load_profile, override, profile
from .time import Layout, NotPriced, StepTime, step_time

__all__ = ["PROFILES", "Hardware", "Layout", "NotPriced", "StepTime", "load_profile", "override", "profile", "step_time"]
