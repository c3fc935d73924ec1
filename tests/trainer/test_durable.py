"""State written so that a crash leaves a complete copy: flushed files and directories, and a
directory replaced without a moment when none is there."""

from __future__ import annotations

import os

from trainer import durable
from trainer.durable import MARKER, latest_checkpoint


def _checkpoint(path, step: int):
    path.mkdir(parents=True)
    (path / "state").write_text(f"state of {step}")
    (path / MARKER).write_text(f"step {step}\n")
    return path


def test_swap_in_flushes_every_file_and_directory_before_and_after_the_rename(tmp_path, monkeypatch):
    flushed = []
    real = os.fsync

    def record(fd):  # which paths were flushed, by the descriptor's target
        flushed.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(durable.os, "fsync", record)
    tmp = _checkpoint(tmp_path / "step_3.partial", 3)
    (tmp / "sub").mkdir()
    (tmp / "sub" / "shard").write_text("x")
    durable.swap_in(tmp, tmp_path / "step_3")
    assert set(flushed[:5]) == {str(tmp / n) for n in ("state", MARKER, "sub/shard", "sub")} | {str(tmp)}
    assert flushed[-1] == str(tmp_path)  # the directory holding the rename
    assert (tmp_path / "step_3" / "state").read_text() == "state of 3" and not tmp.exists()


def test_replacing_a_checkpoint_leaves_a_complete_one_at_every_moment(tmp_path):
    root = tmp_path / "ckpt"
    _checkpoint(root / "step_2", 2)
    _checkpoint(root / "step_4", 4)
    # A crash between moving the old step 4 aside and renaming the new one in: the old one is taken.
    (root / "step_4").rename(root / f"step_4{durable.REPLACED}")
    _checkpoint(root / "step_4.partial", 4)
    assert latest_checkpoint(root) == root / f"step_4{durable.REPLACED}"
    durable.swap_in(root / "step_4.partial", root / "step_4")  # the next save of step 4 completes
    assert latest_checkpoint(root) == root / "step_4" and not (root / f"step_4{durable.REPLACED}").exists()
    # and a second swap over an existing step keeps one copy, the new one
    _checkpoint(root / "new.partial", 4)
    (root / "new.partial" / "state").write_text("newer state of 4")
    durable.swap_in(root / "new.partial", root / "step_4")
    assert (latest_checkpoint(root) / "state").read_text() == "newer state of 4"


def test_write_durably_replaces_a_file_whole(tmp_path):
    path = tmp_path / "controller_state.json"
    durable.write_durably(path, '{"version": 1}')
    durable.write_durably(path, '{"version": 2}')
    assert path.read_text() == '{"version": 2}' and sorted(p.name for p in tmp_path.iterdir()) == [path.name]
