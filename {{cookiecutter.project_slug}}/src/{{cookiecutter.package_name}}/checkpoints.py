"""Finding the checkpoint a run resumes from."""

from __future__ import annotations

import logging
import os
import pickle
from pathlib import Path

import torch

log = logging.getLogger(__name__)

UNREADABLE = (RuntimeError, pickle.UnpicklingError, EOFError, ValueError, OSError)


def newest_valid_checkpoint(ckpt_dir: Path) -> Path | None:
    """The newest checkpoint that loads with weights_only=True. An unreadable one (a kill
    mid-save) is moved aside as `<name>.corrupt`, never deleted, and the one before it is used."""
    candidates = sorted(ckpt_dir.glob("*.ckpt"), key=lambda p: p.stat().st_mtime, reverse=True)
    for path in candidates:
        try:
            torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except UNREADABLE as error:
            reason = str(error).splitlines()[0] if str(error) else type(error).__name__
            if os.environ.get("LOCAL_RANK", "0") == "0" and os.environ.get("NODE_RANK", "0") == "0":
                aside = path.with_name(path.name + ".corrupt")
                path.replace(aside)
                log.warning(
                    "Checkpoint %s is unreadable (%s): moved to %s.", path, reason, aside.name
                )
            continue
        return path
    return None
