"""Checkpoints as folders of shards (torch.distributed.checkpoint): each rank writes its own part
of the weights and optimizer state, rank 0 the rest (`meta.pt`), into a hidden staging folder
that is renamed to its name only once complete, so a folder under a checkpoint's name is
always whole. Reading one is the door's job (`checkpointing.door`)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def fsync_directory(directory: Path) -> None:
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def staging_folder(path: Path) -> Path:
    """Where the checkpoint for `path` is written before it is complete (the same name on every
    rank; a leftover of a kill matches checkpoints.TEMPORARY_GLOB and is removed on resume)."""
    return path.with_name(f".{path.name}.tmp-shards")


def keeps_previous(path: Path) -> bool:
    """`last.ckpt` is rewritten at every save, and the one it replaces stays beside it; another
    checkpoint is rewritten only by a resumed run saving the same step again, which replaces it."""
    return path.stem == "last"


def publish(staging: Path, path: Path) -> None:
    """Rename the complete `staging` folder to `path`. One that it replaces (last.ckpt) is kept
    as `<stem>-previous<suffix>` until then, as single-file saves do."""
    for written in staging.iterdir():
        if written.is_file():
            with open(written, "rb") as file:
                os.fsync(file.fileno())
    fsync_directory(staging)
    previous = path.with_name(f"{path.stem}-previous{path.suffix}")
    if path.exists():
        remove(previous)
        path.replace(previous)
    staging.replace(path)
    if not keeps_previous(path):
        remove(previous)
    fsync_directory(path.parent)
