"""The checkpointer's seams: a Stateful part added to the manager comes back on load, in the
manager's order; and every checkpoint file name is spelt once (``checkpoint/io.py``)."""

import ast
import random
from pathlib import Path

import torch

from tformer.checkpoint import CheckpointManager, io
from tformer.checkpoint.parts import PerRankPart, RNGState, SharedPart, TrainerStatePart, rng_file

ROOT = Path(__file__).resolve().parents[1]


class Counter:
    """A Stateful as CONTRIBUTING's worked example adds one: two methods, nothing else."""

    def __init__(self, value=0):
        self.value = value

    def state_dict(self):
        return {"value": torch.tensor(self.value)}

    def load_state_dict(self, state_dict):
        self.value = int(state_dict["value"])


class Step:
    def __init__(self, step, seen):
        self.step, self.seen = step, seen

    def state_dict(self):
        return {"step": self.step, "world_size": 1}  # RNG files are restored only at the same world size

    def load_state_dict(self, state_dict):
        self.seen.append(("step", state_dict["step"], random.random()))


def test_an_added_part_round_trips_and_parts_load_in_order(tmp_path):
    seen: list = []
    extra, missing = Counter(7), Counter(3)
    parts = {
        "shared": SharedPart({"counter": extra, "absent": None}, is_main=True, trust=False),
        "rng": PerRankPart(RNGState(), rank=0, world_size=1, trust=False),
        "trainer": TrainerStatePart([Step(5, seen)], is_main=True),
    }
    manager = CheckpointManager(tmp_path, parts=parts)
    random.seed(1)
    assert manager.save(5) == tmp_path / "step_00000005"
    extra.value = 99
    random.random()
    path, saved = manager.load("auto")
    assert path == tmp_path / "step_00000005" and saved.step == 5
    assert extra.value == 7  # the added state came back
    # the RNG part loaded before the trainer's: its first draw is the saved stream's next one
    saved_stream = random.Random()
    saved_stream.setstate(torch.load(rng_file(path, 0), weights_only=True)["python"])
    assert seen == [("step", 5, saved_stream.random())]
    # a key the file lacks (a part added after the save) leaves that state as it is
    manager.parts["shared"] = SharedPart({"counter": extra, "later": missing}, is_main=True, trust=False)
    manager.load(str(path))
    assert missing.value == 3


NAMES = (io.WEIGHTS, io.SHARED_STATE, io.TRAINER_STATE, io.RNG_FILE.split("{")[0], io.MARKER)
# a Hugging Face model directory's own index file (export/common.py writes HF's layout)
HF_NAMES = {"model.safetensors.index.json"}


def _code_strings(tree: ast.AST):
    """String constants that are code (docstrings left out)."""
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            yield node


def test_checkpoint_file_names_are_spelt_only_in_checkpoint_io():
    found = []
    for path in sorted((ROOT / "tformer").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel == "tformer/checkpoint/io.py":
            continue
        for node in _code_strings(ast.parse(path.read_text())):
            for name in NAMES:
                if name in node.value and node.value not in HF_NAMES:
                    found.append(f"{rel}:{node.lineno} spells {name!r}")
    assert not found, "use the constants of tformer/checkpoint/io.py: " + "; ".join(found)
