"""A checkpoint that a command is given, whatever its form: a single file or a folder of shards
read whole, checked to hold finite weights; a Hugging Face folder or any other folder is refused
with what to pass instead."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch

from ...errors import ConfigError
from .hugging_face_folder import is_hugging_face
from .shard_metadata import is_sharded
from .shards import read_meta, read_shards_whole
from .single_file import (
    UNREADABLE,
    first_line,
    load_plain,
    load_trusted,
    non_finite_tensors,
    refused_as_python_objects,
)


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
        try:
            return read_shards_whole(path)
        except UNREADABLE as error:
            raise ConfigError(
                f"{key}={path} is not a readable sharded checkpoint ({first_line(error)}): "
                "it may be incomplete, damaged or not written by this project. Pass another one."
            ) from error
    if is_hugging_face(path):
        raise ConfigError(
            f"{key}={path} is a Hugging Face model folder, not a checkpoint that train wrote: "
            f"start a training run from its weights with init_from={path}"
        )
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
        return load_mapped(path)
    except pickle.UnpicklingError as error:
        if not refused_as_python_objects(error):
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
    return load_trusted(path)


def load_mapped(path: Path) -> Any:
    """The file memory-mapped: tensors that the reader never touches (the optimizer's state, for
    predict, serve, export and eval) are never read from disk. Files in torch's legacy format,
    which cannot be mapped, are read whole."""
    try:
        return load_plain(path, mmap=True)
    except RuntimeError as error:
        if "mmap" not in str(error):
            raise
        return load_plain(path)


def read_fit_state(path: Path) -> dict[str, Any]:
    """A checkpoint (a file, or a folder of shards) without its weights' values."""
    if path.is_dir():
        return read_meta(path)
    return dict(load_plain(path, mmap=True))
