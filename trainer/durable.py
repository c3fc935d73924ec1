"""Writing state so that a crash (of the process or the host) leaves a complete copy.

A rename is atomic but not durable: until the directory holding it is flushed, a host crash can
undo it, and until the files are flushed, the renamed name can point at empty blocks. So: flush
every file, rename, flush the directory. Replacing a directory moves the old one aside first and
removes it only once the new one is in, so no moment is without a complete copy.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

REPLACED = ".replaced"  # the suffix of a directory being replaced (kept until its successor is in)
MARKER = "COMPLETE"  # a checkpoint directory is complete once this file is in it


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """Every file under ``path``, then every directory, deepest first, flushed to the device."""
    for parent, _, files in os.walk(path, topdown=False):
        for name in files:
            fd = os.open(os.path.join(parent, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(parent))


def swap_in(tmp: Path, final: Path) -> None:
    """Put the complete directory ``tmp`` at ``final``, durably. An existing ``final`` is renamed
    to ``final.replaced`` first and removed after ``tmp`` is in: a reader finds a complete one at
    every moment (``latest_checkpoint`` takes a ``.replaced`` one whose successor is missing)."""
    fsync_tree(tmp)
    old = final.with_name(final.name + REPLACED)
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    tmp.rename(final)
    fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def write_durably(path: Path, text: str) -> None:
    """``path``'s new content, all or nothing across a crash: a flushed temporary file renamed over it."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint under ``root`` (None when there is none)."""
    root = Path(root)
    done: dict[int, Path] = {}
    for p in root.glob("step_*"):
        step = p.name[5:].removesuffix(REPLACED)
        if not (step.isdigit() and p.is_dir() and (p / MARKER).exists()):
            continue
        if p.name.endswith(REPLACED) and int(step) in done:  # its successor is in: the successor
            continue
        done[int(step)] = p
    return done[max(done)] if done else None
