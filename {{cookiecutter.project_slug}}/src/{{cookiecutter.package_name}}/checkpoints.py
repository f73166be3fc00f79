"""Writing checkpoints so that a kill at any moment leaves a loadable one, and finding the
checkpoint a run resumes from."""

from __future__ import annotations

import errno
import logging
import os
import pickle
import shutil
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from .errors import ConfigError
from .memory_plan import shards_itself
from .runtime import is_global_zero
from .sharded_checkpoints import (
    fsync_directory,
    is_sharded,
    keeps_previous,
    read_meta,
    remove,
)

log = logging.getLogger(__name__)

# What loading a file that is not a whole checkpoint raises (garbage makes the unpickler fail in
# many ways: a text file gave IndexError).
UNREADABLE = (
    RuntimeError, pickle.UnpicklingError, EOFError, ValueError, OSError, IndexError, KeyError,
    TypeError, AttributeError, zipfile.BadZipFile,
)  # fmt: skip
TEMPORARY_GLOB = ".*.ckpt.tmp-*"


class NonFiniteWeightsError(RuntimeError):
    """A checkpoint would have held NaN or infinite weights."""


def non_finite_tensors(state_dict: dict[str, Any]) -> list[str]:
    return [
        name
        for name, value in state_dict.items()
        if isinstance(value, torch.Tensor)
        and value.is_floating_point()
        and not bool(torch.isfinite(value).all())
    ]


FULL_DISK_BYTES = 1 << 20


def failed_write(path: Path) -> OSError:
    """The OSError behind a write that torch reports only as a RuntimeError ("unexpected pos")."""
    full = shutil.disk_usage(path.parent).free < FULL_DISK_BYTES
    code = errno.ENOSPC if full else errno.EIO
    return OSError(code, os.strerror(code), str(path))


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
            except RuntimeError as error:  # torch reports a failed write (a full disk) this way
                raise failed_write(path) from error
            file.flush()
            os.fsync(file.fileno())
        if path.exists() and keeps_previous(path):
            path.replace(path.with_name(f"{path.stem}-previous{path.suffix}"))
        temporary.replace(path)
    finally:
        temporary.unlink(missing_ok=True)
    fsync_directory(path.parent)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint writer, made atomic on any filesystem (Lightning's own goes through
    $TMPDIR, which is atomic only when it shares a filesystem with the checkpoints), and refusing
    to write non-finite weights."""

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


def read_fit_state(path: Path) -> dict[str, Any]:
    """A checkpoint of this run (a file, or a folder of shards) without its weights' values."""
    if path.is_dir():
        return read_meta(path)
    return dict(torch.load(path, map_location="cpu", weights_only=True, mmap=True))


def first_line(error: BaseException) -> str:
    """The gist of a loading error, without torch's advice to load with weights_only=False."""
    line = str(error).splitlines()[0] if str(error) else type(error).__name__
    return "weights_only=True refused it" if line.startswith("Weights only load failed") else line


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


def read_checkpoint(path: Path, trust: bool = False, key: str = "ckpt_path") -> dict[str, Any]:
    """A checkpoint given on the command line (as `key`), loaded safely (weights_only=True) and
    checked to hold finite weights, or one error saying what is wrong. Full unpickling, which runs
    code from the file, needs `trust`. A folder of shards is read whole into memory."""
    checkpoint = load_checkpoint(path, trust, key)
    check_weights(checkpoint, path, key)
    return checkpoint


def check_weights(checkpoint: Any, path: Path, key: str) -> None:
    """A dict whose `state_dict` maps names to tensors, none of them NaN or infinite."""
    if not isinstance(checkpoint, dict):
        raise ConfigError(
            f"{key}={path} holds a {type(checkpoint).__name__}, not a checkpoint (a dict with the "
            "weights in state_dict): pass a checkpoint that train wrote."
        )
    weights = checkpoint.get("state_dict")
    if not isinstance(weights, dict) or not all(
        isinstance(name, str) and isinstance(value, torch.Tensor) for name, value in weights.items()
    ):
        raise ConfigError(
            f"{key}={path} has no state_dict of named tensors: it was not written by this "
            "project's train command. Pass a checkpoint that train wrote."
        )
    bad = non_finite_tensors(weights)
    if bad:
        raise ConfigError(
            f"{key}={path} holds NaN or infinite weights ({', '.join(bad[:3])}"
            f"{' ...' if len(bad) > 3 else ''}): pass a checkpoint from before the run diverged."
        )


def load_checkpoint(path: Path, trust: bool, key: str) -> Any:
    if is_sharded(path):
        from .shard_planners import read_sharded

        try:
            return read_sharded(path)
        except UNREADABLE as error:
            raise ConfigError(
                f"{key}={path} is not a readable sharded checkpoint ({first_line(error)}): "
                "it may be incomplete, damaged or not written by this project. Pass another one."
            ) from error
    if path.is_dir():
        inside = sorted(
            (found for found in path.glob("**/*.ckpt") if found.is_file() or is_sharded(found)),
            key=lambda found: found.stat().st_mtime,
        )
        if inside:
            raise ConfigError(
                f"{key}={path} is a folder: pass a checkpoint in it, e.g. {key}={inside[-1]}"
            )
        raise ConfigError(
            f"{key}={path} is a folder that holds no checkpoint (a .ckpt file, or a folder of "
            f"shards with its .metadata): pass one, e.g. {key}=logs/train/runs/<run>/checkpoints/"
            "last.ckpt"
        )
    if path.exists() and not path.is_file():
        raise ConfigError(f"{key}={path} is not a regular file: pass a checkpoint file.")
    if path.is_symlink() and not path.exists():
        raise ConfigError(
            f"{key}={path} is a symbolic link that leads to no file (a broken link, or a loop of "
            "links): pass the checkpoint file itself."
        )
    if not path.is_file():
        raise ConfigError(
            f"{key}={path} does not exist. Pass a checkpoint file, e.g. "
            f"{key}=logs/train/runs/<run>/checkpoints/last.ckpt"
        )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's own, about what weights_only refuses
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        if "Unsupported operand" in str(error) or "Weights only load failed" not in str(error):
            # Not a pickle at all (random bytes), as opposed to one that names Python objects.
            raise ConfigError(
                f"{key}={path} is not a readable checkpoint ({first_line(error)}): it may be "
                "truncated or not a PyTorch checkpoint. Pass another file."
            ) from error
        if not trust:
            raise ConfigError(
                f"{key}={path} holds Python objects that only full unpickling can load, "
                "which can run any code stored in the file. If you trust where it came from, "
                "add trust_checkpoint=true."
            ) from error
    except UNREADABLE as error:
        raise ConfigError(
            f"{key}={path} is not a readable checkpoint ({first_line(error)}): it may be "
            "truncated or not a PyTorch checkpoint. Pass another file."
        ) from error
    log.warning("trust_checkpoint=true: loading %s with full unpickling.", path)
    return torch.load(path, map_location="cpu", weights_only=False)


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
    missing = sorted(name for name in set(expected) - set(stored) if not optional(name))
    unexpected = sorted(set(stored) - set(expected))
    resized = sorted(n for n in set(expected) & set(stored) if expected[n] != stored[n])
    if missing or unexpected or resized:
        details = "; ".join(
            f"{label}: {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}"
            for label, names in (
                ("missing", missing),
                ("unexpected", unexpected),
                ("other shape", resized),
            )
            if names
        )
        raise ConfigError(
            f"{key}={path} holds weights of another model ({details}). Pass a checkpoint of "
            "this model, or choose the model it was trained with (e.g. experiment=...)."
        )
