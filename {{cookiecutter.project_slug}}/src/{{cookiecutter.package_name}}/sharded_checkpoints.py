"""Checkpoints as folders of shards (torch.distributed.checkpoint): each rank writes its own part
of the weights and optimizer state, rank 0 the rest (`meta.pt`), into a hidden staging folder
that is renamed to its name only once complete, so a folder under a checkpoint's name is
always whole."""

from __future__ import annotations

import io
import os
import pickle
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

METADATA = ".metadata"  # written last by torch.distributed.checkpoint: the shards are complete
META = "meta.pt"  # Lightning's name for everything but the weights and optimizer state

# What a `.metadata` file may name. torch.distributed.checkpoint reads it with a bare
# pickle.load, which runs whatever a hostile file names; these are all a real one holds.
METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}  # fmt: skip


class UnsafeMetadata(pickle.UnpicklingError):
    """A `.metadata` file that names something a real one never holds."""


class MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if name in METADATA_CLASSES.get(module, ()) or dtype:
            return super().find_class(module, name)
        raise UnsafeMetadata(f"its .metadata names {module}.{name}, which a checkpoint never holds")


def is_sharded(path: Path) -> bool:
    return path.is_dir() and (path / METADATA).is_file()


class MissingShards(ValueError):
    """A `.metadata` file whose shards are not all there, whole."""


def check_metadata(path: Path) -> None:
    """Raises (UNREADABLE errors) unless `path/.metadata` holds only what a real one does, and
    names only shard files inside `path` (not links to elsewhere) that hold every byte it says
    they do, with every value that is not a tensor loading as plain values."""
    for own in (METADATA, META):
        if (path / own).is_symlink():
            raise UnsafeMetadata(f"its {own} is a symbolic link: a checkpoint's files are its own")
    metadata = MetadataUnpickler(io.BytesIO((path / METADATA).read_bytes())).load()
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, dict):
        raise UnsafeMetadata("its .metadata has no index of its shards")
    ends: dict[str, int] = {}
    for info in storage.values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or name in ("", ".", "..") or Path(name).name != name:
            raise UnsafeMetadata(f"its .metadata names {name!r}, not a file in its folder")
        ends[name] = max(ends.get(name, 0), int(info.offset) + int(info.length))
    for name, end in sorted(ends.items()):
        shard = path / name
        if shard.is_symlink():
            raise UnsafeMetadata(
                f"its shard {name} is a symbolic link: a checkpoint's files are its own"
            )
        size = shard.stat().st_size if shard.is_file() else None
        if size is None or size < end:
            state = "missing" if size is None else f"{size} bytes, not {end}"
            raise MissingShards(f"its shard {name} is {state}")
    check_plain_values(path, metadata)


def check_plain_values(path: Path, metadata: Any) -> None:
    """The values that are not tensors (the optimizer's settings; torch.distributed.checkpoint
    stores each as a `torch.save` of its own) load with weights_only=True: a folder whose shard
    was damaged is found before a run resumes from it."""
    kinds = getattr(metadata, "state_dict_metadata", None) or {}
    for index, info in metadata.storage_data.items():
        fqn = getattr(index, "fqn", index)
        bytes_item = type(kinds.get(fqn)).__name__ == "BytesStorageMetadata"
        if not bytes_item or getattr(info, "transform_descriptors", None):
            continue
        with open(path / info.relative_path, "rb") as shard:
            shard.seek(int(info.offset))
            value = shard.read(int(info.length))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.load(io.BytesIO(value), map_location="cpu", weights_only=True)
        except Exception as error:
            raise UnsafeMetadata(
                f"its shard {info.relative_path} holds {fqn} in a form that does not load as "
                "plain values (damaged, or needing full unpickling, which can run code)"
            ) from error


def read_meta(path: Path) -> dict[str, Any]:
    """Everything but the weights and optimizer state (the step, loops and callbacks' states)."""
    check_metadata(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own about what weights_only refused
        return dict(torch.load(path / META, map_location="cpu", weights_only=True))


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
