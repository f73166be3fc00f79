"""Writing checkpoints so that a kill at any moment leaves a loadable one, and finding the
checkpoint a run resumes from."""

from __future__ import annotations

import errno
import logging
import os
import resource
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from ..command_errors import not_writable
from ..errors import ConfigError, TrainingError
from ..memory.plan import shards_itself
from ..run.machine import is_global_zero
from .differences import shape_differences
from .door import (
    UNREADABLE,
    first_line,
    load_plain,
    load_trusted,
    non_finite_tensors,
    read_fit_state,
)
from .sharded import fsync_directory, keeps_previous, remove

log = logging.getLogger(__name__)

TEMPORARY_GLOB = ".*.ckpt.tmp-*"


class NonFiniteWeightsError(RuntimeError):
    """A checkpoint would have held NaN or infinite weights."""


FULL_DISK_BYTES = 1 << 20


def failed_write(path: Path) -> OSError:
    """The OSError behind a write that torch reports only as a RuntimeError ("unexpected pos"):
    a full disk, else a file-size limit (`ulimit -f`) where one is set, else an I/O error."""
    full = shutil.disk_usage(path.parent).free < FULL_DISK_BYTES
    limited = resource.getrlimit(resource.RLIMIT_FSIZE)[0] != resource.RLIM_INFINITY
    code = errno.ENOSPC if full else errno.EFBIG if limited else errno.EIO
    return OSError(code, os.strerror(code), str(path))


def is_failed_write(error: BaseException) -> bool:
    return isinstance(error, RuntimeError) and "unexpected pos" in str(error)


def save_failed(path: Path, error: OSError) -> TrainingError:
    """One line for a checkpoint that could not be written, naming it (not its temporary file)."""
    code = error.errno or errno.EIO
    named = OSError(code, error.strerror or os.strerror(code), str(path))
    return TrainingError(f"{not_writable(named)} The checkpoints written before it are kept.")


def atomic_torch_save(checkpoint: dict[str, Any], path: Path) -> None:
    """Write to a temporary file beside `path`, fsync it, rename it over `path`, fsync the
    directory: a reader sees the old file or the new one, never a part. An overwritten file
    (last.ckpt) is kept as `<stem>-previous.ckpt`, so two checkpoints always remain."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(temporary, "wb") as file:
            try:
                torch.save(checkpoint, file)
            except RuntimeError as error:
                if is_failed_write(error):  # torch reports a failed write (a full disk) this way
                    raise failed_write(path) from error
                raise
            file.flush()
            os.fsync(file.fileno())
        if path.exists() and keeps_previous(path):
            path.replace(path.with_name(f"{path.stem}-previous{path.suffix}"))
        temporary.replace(path)
    except OSError as error:
        raise save_failed(path, error) from error
    finally:
        temporary.unlink(missing_ok=True)
    fsync_directory(path.parent)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint writer, made atomic on any filesystem (Lightning's own goes through
    $TMPDIR, which is atomic only when it shares a filesystem with the checkpoints), and refusing
    to write non-finite weights; its reader is the door's (`checkpointing.door`)."""

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        if weights_only is False:  # a trusted checkpoint, as the user said with trust_checkpoint
            return dict(load_trusted(Path(path)))
        return dict(load_plain(Path(path)))

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        bad = non_finite_tensors(checkpoint.get("state_dict", {}))
        if bad:
            raise NonFiniteWeightsError(
                f"Not writing {path}: non-finite values in {', '.join(bad[:5])}. The previous "
                "checkpoints stay as they were."
            )
        atomic_torch_save(checkpoint, Path(path))


def finish_checkpoint_writes(strategy: Any) -> None:
    """Wait until checkpoints that the strategy writes in the background are complete."""
    finish = getattr(strategy, "finish_checkpoint_writes", None)
    if finish is not None:
        finish()


def remove_interrupted_writes(ckpt_dir: Path) -> None:
    """Temporary files (or shard folders) of saves that a kill interrupted: never a complete
    checkpoint."""
    for leftover in ckpt_dir.glob(TEMPORARY_GLOB):
        log.info("Removing %s, left by an interrupted save.", leftover)
        remove(leftover)


def newest_valid_checkpoint(
    ckpt_dir: Path, passed_over: Callable[[dict[str, Any]], str | None] = lambda state: None
) -> Path | None:
    """The newest checkpoint that loads with weights_only=True (a file, or a folder of shards
    whose metadata is safe to read) and for which `passed_over` gives no reason to skip it
    (the reason is logged). An unreadable one is
    moved aside as `<name>.corrupt`, never deleted, and the one before it is used, with one
    warning naming both."""
    if is_global_zero():
        remove_interrupted_writes(ckpt_dir)
    candidates = sorted(ckpt_dir.glob("*.ckpt"), key=lambda p: p.stat().st_mtime, reverse=True)
    unreadable: list[tuple[Path, str]] = []
    chosen = None
    for path in candidates:
        try:
            state = read_fit_state(path)
        except UNREADABLE as error:
            unreadable.append((path, first_line(error)))
            continue
        reason_to_skip = passed_over(state)
        if reason_to_skip:
            log.info("Passing over %s: %s", path.name, reason_to_skip)
            continue
        chosen = path
        break
    for path, reason in unreadable:
        aside = path.with_name(path.name + ".corrupt")
        if is_global_zero():
            path.replace(aside)
        log.warning(
            "Checkpoint %s is unreadable (%s): moved to %s; resuming from %s instead.",
            path,
            reason,
            aside.name,
            chosen or "nothing (starting fresh)",
        )
    return chosen


def check_same_model(
    checkpoint: dict[str, Any],
    model: torch.nn.Module,
    path: Path,
    optional: Callable[[str], bool] = lambda name: False,
    key: str = "ckpt_path",
) -> None:
    """Refuse, with one clear message, a checkpoint whose weights do not fit this model (the
    names for which `optional` is true may be missing)."""
    expected = {name: tuple(value.shape) for name, value in model.state_dict().items()}
    if not expected and shards_itself(type(model)):
        return  # its layers are made in configure_model: Lightning checks while loading
    stored = {
        name: tuple(value.shape)
        for name, value in checkpoint.get("state_dict", {}).items()
        if isinstance(value, torch.Tensor)
    }
    details = shape_differences(expected, stored, optional)
    if details:
        raise ConfigError(
            f"{key}={path} holds weights of another model ({details}). Pass a checkpoint of "
            "this model, or choose the model it was trained with (e.g. experiment=...)."
        )
