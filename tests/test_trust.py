"""Trust: a checkpoint never runs code. For every checkpoint layout (ddp, FSDP2/DCP, DeepSpeed
ZeRO-1/2/3 incl. its universal files, an imported HF model) a payload is planted in each pickle
file (and the COMPLETE marker re-sealed, so integrity checks pass); every loading path (resume,
``load_checkpoint``, consolidate, export, HF import) must refuse it in one line without running it,
and the untouched checkpoints must still load. With ``--trust-checkpoint`` the payload does run:
the planted files are live, so these tests can fail."""

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tformer.checkpoint.io import MARKER, crc32, find_latest

from train_helpers import CONFIGS, ROOT, env, run_cli, small_overrides

RECIPE = str(CONFIGS / "gpt2-tiny.yaml")
COMMON = ["max_steps=2", "save_every=0", "eval_every=0", "micro_batch_size=4", "precision=fp32"]
LAYOUTS = {
    "ddp": ["parallel.strategy=ddp"],
    "fsdp": ["parallel.strategy=fsdp"],
    **{
        f"zero{k}": ["parallel.strategy=deepspeed", f"parallel.deepspeed_config={CONFIGS / 'deepspeed' / f'zero{k}.json'}"]
        for k in (1, 2, 3)
    },
}


class Payload:
    """Unpickling this runs a shell command that creates ``marker``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def runs(cache, tmp_path_factory):
    """A trained 2-step run per layout (one process), plus DeepSpeed universal files for zero3."""
    pytest.importorskip("deepspeed")
    root = tmp_path_factory.mktemp("layouts")
    for name, strategy in LAYOUTS.items():
        proc = run_cli(["train", RECIPE, *small_overrides("gpt2-tiny", root / name, *COMMON, *strategy)], cache)
        assert proc.returncode == 0, proc.stderr[-3000:]
    ds = find_latest(root / "zero3" / "checkpoints") / "deepspeed"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "deepspeed.checkpoint.ds_to_universal",
            "--input_folder",
            str(ds / "state"),
            "--output_folder",
            str(ds / "state_universal"),
            "--inject_missing_state",
        ],
        check=True,
        capture_output=True,
        env=env(cache),
        timeout=300,
    )
    return root


def pickle_files(ckpt: Path) -> list[str]:
    """Every pickle a loader could open: *.pt anywhere, DCP metadata, DCP shards with non-tensor
    entries (one universal file stands for all of them)."""
    found = [str(p.relative_to(ckpt)) for p in sorted(ckpt.rglob("*.pt")) if "state_universal" not in str(p)]
    universal = sorted(ckpt.rglob("state_universal/zero/*/fp32.pt"))
    found += [str(universal[0].relative_to(ckpt))] if universal else []
    if (ckpt / "dcp" / ".metadata").is_file():
        found += ["dcp/.metadata", "dcp/entry"]
    return found


def reseal(ckpt: Path) -> None:
    """Rewrite COMPLETE with the new sizes and CRCs, as an attacker would."""
    files = {
        str(p.relative_to(ckpt)): [p.stat().st_size, crc32(p)]
        for p in sorted(ckpt.rglob("*"))
        if p.is_file() and p.name != MARKER
    }
    info = json.loads((ckpt / MARKER).read_text())
    info["files"] = files
    (ckpt / MARKER).write_text(json.dumps(info))


def plant(run: Path, rel: str, dest: Path, marker: Path) -> Path:
    """A copy of ``run`` whose newest checkpoint carries a payload in ``rel``; returns the checkpoint."""
    shutil.copytree(run, dest)
    ckpt = find_latest(dest / "checkpoints")
    if rel == "dcp/.metadata":
        with open(ckpt / rel, "rb") as f:
            md = pickle.load(f)
        md.__dict__["tformer_test"] = Payload(marker)  # a valid Metadata that also runs code
        with open(ckpt / rel, "wb") as f:
            pickle.dump(md, f)
    elif rel == "dcp/entry":  # an optimizer hyperparameter inside the .distcp shard
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(str(ckpt / "dcp"), str(dest / "full.pt"))
        state = torch.load(dest / "full.pt", weights_only=False)
        # optimizer states are stored flattened by parameter name: "param_groups.NAME.lr"
        lr = next(k for k in state["optimizer"] if k.startswith("param_groups.") and k.endswith(".lr"))
        state["optimizer"][lr] = Payload(marker)
        shutil.rmtree(ckpt / "dcp")
        dcp.save(state, checkpoint_id=str(ckpt / "dcp"))
        (dest / "full.pt").unlink()
    else:
        obj = torch.load(ckpt / rel, weights_only=False)
        obj = {**obj, "tformer_test": Payload(marker)} if isinstance(obj, dict) else [obj, Payload(marker)]
        torch.save(obj, ckpt / rel)
    if "state_universal" in rel:  # make a resume take the universal path (saved on 2 ranks)
        state = json.loads((ckpt / "trainer.json").read_text())
        (ckpt / "trainer.json").write_text(json.dumps(dict(state, world_size=2)))
    reseal(ckpt)
    return ckpt


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("error: ") and "Traceback" not in "\n".join(err), err[-5:]
    return err[-1]


def sweep(jobs: list[dict], cache: Path, tmp: Path) -> dict:
    (tmp / "jobs.json").write_text(json.dumps(jobs))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "resume_sweep.py"), str(tmp / "jobs.json"), str(tmp / "results.json")],
        env=env(cache),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((tmp / "results.json").read_text())


def test_no_loading_path_runs_a_planted_payload(runs, cache, tmp_path, capsys):
    import tformer
    from tformer.checkpoint.safe import UnsafeCheckpointError
    from tformer.cli import main

    jobs, planted = [], []
    for layout, strategy in LAYOUTS.items():
        clean = find_latest(runs / layout / "checkpoints")
        files = pickle_files(clean)
        assert len(files) >= 4, (layout, files)  # the layout's pickles are all covered
        for i, rel in enumerate(files):
            label = f"{layout}:{rel}"
            marker = tmp_path / f"ran-{layout}-{i}"
            ckpt = plant(runs / layout, rel, tmp_path / f"{layout}-{i}", marker)
            planted.append((label, marker))
            # load_checkpoint, consolidate, export: refused in one line, nothing run
            with pytest.raises(UnsafeCheckpointError, match="tries to load posix.system"):
                tformer.load_checkpoint(ckpt)
            assert main(["consolidate", str(ckpt)]) == 2
            assert "posix.system" in one_error_line(capsys), label
            assert main(["export", str(ckpt), str(tmp_path / f"hf-{layout}-{i}")]) == 2
            line = one_error_line(capsys)
            assert "tries to load posix.system" in line and "--trust-checkpoint" in line, line
            assert not (tmp_path / f"hf-{layout}-{i}").exists()
            jobs.append(
                {
                    "label": label,
                    "recipe": RECIPE,
                    "overrides": small_overrides(
                        "gpt2-tiny", tmp_path / f"resume-{layout}-{i}", *COMMON, *strategy, "max_steps=3", f"resume={ckpt}"
                    ),
                }
            )
            if (
                rel in ("dcp/.metadata", "dcp/entry", "scheduler.pt")
                and layout == "ddp"
                or rel.endswith("optim_states.pt")
                and layout == "zero3"
            ):
                live = tmp_path / f"live-{layout}-{i}"
                jobs.append(
                    {
                        "label": f"trusted {label}",
                        "recipe": RECIPE,
                        "overrides": small_overrides(
                            "gpt2-tiny",
                            tmp_path / f"trusted-{layout}-{i}",
                            *COMMON,
                            *strategy,
                            "max_steps=3",
                            f"resume={plant(runs / layout, rel, tmp_path / f'{layout}-{i}-live', live)}",
                            "checkpoint.trust=true",
                        ),
                    }
                )
                planted.append((f"trusted {label}", live))
        jobs.append(
            {
                "label": f"{layout}:clean",
                "recipe": RECIPE,
                "overrides": small_overrides(
                    "gpt2-tiny", tmp_path / f"resume-{layout}-clean", *COMMON, *strategy, "max_steps=3", f"resume={clean}"
                ),
            }
        )
    results = sweep(jobs, cache, tmp_path)
    for label, marker in planted:
        if label.startswith("trusted"):
            assert marker.exists(), f"{label}: the planted payload is not live (the test proves nothing)"
        else:
            assert not marker.exists(), f"{label}: the payload ran"
            assert results[label].startswith("error: checkpoint file") and "posix.system" in results[label], (
                label,
                results[label],
            )
    for layout in LAYOUTS:  # the untouched checkpoints still resume and load
        assert results[f"{layout}:clean"] == "loaded", results[f"{layout}:clean"]
        assert tformer.load_checkpoint(runs / layout) is not None
        assert main(["consolidate", str(runs / layout)]) == 0


def test_resume_of_a_planted_checkpoint_fails_in_one_line_in_a_real_process(runs, cache, tmp_path):
    marker = tmp_path / "ran"
    ckpt = plant(runs / "zero2", "deepspeed/state/zero_pp_rank_0_mp_rank_00_optim_states.pt", tmp_path / "run", marker)
    proc = run_cli(
        [
            "train",
            RECIPE,
            *small_overrides("gpt2-tiny", tmp_path / "new", *COMMON, *LAYOUTS["zero2"], "max_steps=3", f"resume={ckpt}"),
        ],
        cache,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("error: checkpoint file") and "optim_states.pt tries to load posix.system" in line
    assert not marker.exists()


def test_trust_never_skips_the_integrity_check(runs, tmp_path, capsys):
    from tformer.cli import main

    shutil.copytree(runs / "ddp", tmp_path / "run")
    ckpt = find_latest(tmp_path / "run" / "checkpoints")
    path = ckpt / "scheduler.pt"
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))
    assert main(["consolidate", str(ckpt), "--trust-checkpoint"]) == 2
    assert "CRC-32 mismatch" in one_error_line(capsys)


def test_imported_hf_model_carries_no_pickle_and_a_planted_one_is_refused(runs, cache, tmp_path, capsys):
    import tformer
    from tformer.cli import main

    assert main(["export", str(runs / "ddp"), str(tmp_path / "hf")]) == 0
    assert main(["import", str(tmp_path / "hf"), str(tmp_path / "imported")]) == 0
    ckpt = find_latest(tmp_path / "imported" / "checkpoints")
    assert pickle_files(ckpt) == []  # safetensors + JSON + YAML only
    assert tformer.load_checkpoint(ckpt) is not None
    marker = tmp_path / "ran"
    torch.save({"torch": torch.zeros(1), "x": Payload(marker)}, ckpt / "rng_rank0.pt")
    reseal(ckpt)
    for argv in (["consolidate", str(ckpt)], ["export", str(ckpt), str(tmp_path / "hf2")]):
        assert main(argv) == 2
        assert "rng_rank0.pt tries to load posix.system" in one_error_line(capsys)
    proc = run_cli(
        ["train", str(tmp_path / "imported" / "config.yaml"), "max_steps=1", "progress=false", "data.seq_len=64"], cache
    )
    assert proc.returncode == 2 and "posix.system" in proc.stderr.strip().splitlines()[-1], proc.stderr[-2000:]
    # a HF directory whose weights are a pickle with a payload: transformers' safe loading refuses it
    hf_bin = tmp_path / "hf-bin"
    shutil.copytree(tmp_path / "hf", hf_bin)
    from safetensors.torch import load_file

    state = load_file(hf_bin / "model.safetensors")
    (hf_bin / "model.safetensors").unlink()
    torch.save({**state, "x": Payload(marker)}, hf_bin / "pytorch_model.bin")
    assert main(["import", str(hf_bin), str(tmp_path / "imported2")]) == 2
    assert "pytorch_model.bin" in one_error_line(capsys)
    assert not marker.exists() and not (tmp_path / "imported2").exists()
