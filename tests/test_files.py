"""The one atomic-write helper (tformer/files.py): whole or nothing, for files and directories."""

from __future__ import annotations

import os
import stat

import pytest

from tformer.files import PARTIAL, atomic_write, publish, temp_sibling


def test_a_file_replaces_the_old_one_whole_and_a_failure_leaves_the_old_one(tmp_path):
    path = tmp_path / "sub" / "record.json"
    with atomic_write(path, durable=True) as tmp:
        assert tmp.parent == path.parent and tmp.name.startswith(PARTIAL) and not path.exists()
        tmp.write_text("one")
    assert path.read_text() == "one"
    with pytest.raises(OSError, match="disk full"), atomic_write(path) as tmp:
        tmp.write_text("half")
        raise OSError("disk full")
    assert path.read_text() == "one" and sorted(p.name for p in path.parent.iterdir()) == ["record.json"]


def test_a_directory_replaces_an_existing_one_or_yields_to_it(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with atomic_write(out, directory=True) as tmp:
        (tmp / "new.txt").write_text("new")
    assert sorted(p.name for p in out.iterdir()) == ["new.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # nothing left aside
    # another writer finished the same entry first: keep theirs, drop ours
    late = temp_sibling(out, directory=True)
    (late / "late.txt").write_text("late")
    publish(late, out, keep_existing=True)
    assert sorted(p.name for p in out.iterdir()) == ["new.txt"] and not late.exists()


def test_output_gets_the_umask_permissions_as_if_written_in_place(tmp_path):
    old = os.umask(0o022)
    try:
        with atomic_write(tmp_path / "f") as tmp:
            tmp.write_text("x")
        with atomic_write(tmp_path / "d", directory=True):
            pass
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "f").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "d").stat().st_mode) == 0o755


@pytest.mark.parametrize("umask", [0o022, 0o077], ids=["umask022", "umask077"])
def test_safetensors_files_get_the_umask_permissions_like_the_rest_of_the_run(tmp_path, umask):
    """safetensors writes a private (0600) temporary file and renames it: model.safetensors was
    0600 beside a 0644 config.yaml. Checkpoints, consolidation and exports all write through
    save_safetensors."""
    import torch

    from tformer.files import save_safetensors, save_weights

    old = os.umask(umask)
    try:
        save_weights({"w": torch.ones(2, 3)}, tmp_path / "model.safetensors")
        save_safetensors({"w": torch.ones(2)}, tmp_path / "other.safetensors", {"note": "x"})
        (tmp_path / "config.yaml").write_text("x")
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()}
    assert modes == dict.fromkeys(modes, 0o666 & ~umask), modes
