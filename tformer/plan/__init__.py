"""The planner: what a training layout costs in memory and in time, before anything is launched.

- memory.py: the bytes one rank holds (``rank_memory``: model states and activations) on the mesh
  pp x dp_replicate x dp_shard x cp x tp, from states.py (the parameters a rank holds and the bytes
  of their states) and activations.py (what autograd keeps); moe.py: the mixture-of-experts terms
  (active parameters, expert states under expert parallelism, all-to-all bytes);
- search.py: the layouts ``tformer plan`` tries and the memory-first ranking of those that fit;
- time.py: one step's seconds, tokens/s per device, MFU and its breakdown
  (``step_time(cfg, Layout(...), profile("h100-sxm"), seq_len)``), the sum of compute.py (GEMMs),
  memory_bound.py (elementwise traffic), comm.py (collectives and their overlap) and host.py (the
  host's time) for a layout.py ``Layout``; hardware.py: the device figures it divides by;
  calibrate.py: a profile measured on this machine;
- memory_report.py and report.py: ``tformer plan``'s printed tables (memory, then speed).
"""

from .hardware import PROFILES, Hardware, load_profile, override, profile
from .memory import Estimate, estimate, rank_memory
from .search import layouts, pp_layouts, recommend, recommend_cp
from .states import num_parameters
from .layout import Layout, NotPriced, StepTime
from .time import step_time

__all__ = [
    "PROFILES",
    "Estimate",
    "Hardware",
    "Layout",
    "NotPriced",
    "StepTime",
    "estimate",
    "layouts",
    "load_profile",
    "num_parameters",
    "override",
    "pp_layouts",
    "profile",
    "rank_memory",
    "recommend",
    "recommend_cp",
    "step_time",
]
