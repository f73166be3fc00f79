"""A folder of shards' `.metadata`, read by `MetadataUnpickler` (the classes a real one holds,
nothing else), then type-checked attribute by attribute against torch's own dataclasses; every
shard it names is a whole file of the folder, and every value that is not a tensor loads as plain
values."""

from __future__ import annotations

import dataclasses
import enum
import io
import pickle
from pathlib import Path, PurePath
from typing import TYPE_CHECKING, Any

import torch

from ...data.folder_files import read_bounded
from .single_file import load_plain

if TYPE_CHECKING:  # torch.distributed.checkpoint takes most of a second to import
    from torch.distributed.checkpoint.metadata import Metadata

METADATA = ".metadata"  # written last by torch.distributed.checkpoint: the shards are complete
METADATA_LIMIT = 1 << 30  # bytes: the most of it read (whole) before it is unpickled
META = "meta.pt"  # Lightning's name for everything but the weights and optimizer state


class UnsafeCheckpoint(pickle.UnpicklingError):
    """A checkpoint that names something a real one never holds, or is not whole."""


class MissingShards(UnsafeCheckpoint):
    """A `.metadata` file whose shards are not all there, whole."""


# What a `.metadata` file may name: all that a real one holds.
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


class MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if name in METADATA_CLASSES.get(module, ()) or dtype:
            return super().find_class(module, name)
        raise UnsafeCheckpoint(
            f"its .metadata names {module}.{name}, which a checkpoint never holds"
        )


def is_sharded(path: Path) -> bool:
    return path.is_dir() and (path / METADATA).is_file()


class Schema:
    """Checks that an unpickled `Metadata` holds, in every attribute, what torch's dataclasses
    declare: a `.metadata` whose classes are all allowed can still put a string where torch
    expects an object, and torch's loader then fails in ways that took other paths."""

    def __init__(self) -> None:
        from torch.distributed.checkpoint import filesystem, metadata

        self.md, self.fs = metadata, filesystem

    def fail(self, where: str, value: Any, expected: str) -> UnsafeCheckpoint:
        return UnsafeCheckpoint(
            f"its .metadata holds a {type(value).__name__} at {where}, where a checkpoint holds "
            f"{expected}"
        )

    def exactly(self, value: Any, kind: type, where: str) -> None:
        if type(value) is not kind:
            raise self.fail(where, value, kind.__name__)

    def fields(self, value: Any, kind: type, where: str) -> None:
        """An instance of the dataclass `kind` with no attribute but its fields."""
        self.exactly(value, kind, where)
        names = {f.name for f in dataclasses.fields(kind)}
        extra = set(vars(value)) - names
        if extra:
            raise UnsafeCheckpoint(f"its .metadata gives {where} attributes a checkpoint never has")

    def integer(self, value: Any, where: str, optional: bool = False) -> None:
        if optional and value is None:
            return
        if type(value) is not int or value < 0:
            raise self.fail(where, value, "a whole number")

    def text(self, value: Any, where: str, optional: bool = False) -> None:
        if optional and value is None:
            return
        self.exactly(value, str, where)

    def size(self, value: Any, where: str, optional: bool = False) -> None:
        if optional and value is None:
            return
        self.exactly(value, torch.Size, where)
        for index, part in enumerate(value):
            self.integer(part, f"{where}[{index}]")

    def metadata(self, value: Any) -> None:
        md = self.md
        self.fields(value, md.Metadata, "the top")
        self.exactly(value.state_dict_metadata, dict, "state_dict_metadata")
        for fqn, item in value.state_dict_metadata.items():
            self.text(fqn, "a state_dict_metadata key")
            self.storage_item(item, f"state_dict_metadata[{fqn!r}]")
        self.plain(value.planner_data, "planner_data")
        self.exactly(value.storage_data, dict, "storage_data")
        for index, info in value.storage_data.items():
            self.index(index)
            self.storage_info(info, f"storage_data[{index.fqn!r}]")
        if value.storage_meta is not None:
            self.storage_meta(value.storage_meta)
        self.text(value.version, "version", optional=True)

    def storage_item(self, item: Any, where: str) -> None:
        md = self.md
        if type(item) is md.BytesStorageMetadata:
            self.fields(item, md.BytesStorageMetadata, where)
            return
        self.fields(item, md.TensorStorageMetadata, where)
        properties = item.properties
        self.fields(properties, md.TensorProperties, f"{where}.properties")
        self.exactly(properties.dtype, torch.dtype, f"{where}.properties.dtype")
        self.exactly(properties.layout, torch.layout, f"{where}.properties.layout")
        self.exactly(properties.memory_format, torch.memory_format, f"{where}.memory_format")
        for flag in ("requires_grad", "pin_memory"):
            self.exactly(getattr(properties, flag), bool, f"{where}.properties.{flag}")
        self.size(item.size, f"{where}.size")
        self.exactly(item.chunks, list, f"{where}.chunks")
        for number, chunk in enumerate(item.chunks):
            self.fields(chunk, md.ChunkStorageMetadata, f"{where}.chunks[{number}]")
            self.size(chunk.offsets, f"{where}.chunks[{number}].offsets")
            self.size(chunk.sizes, f"{where}.chunks[{number}].sizes")

    def index(self, index: Any) -> None:
        self.fields(index, self.md.MetadataIndex, "a storage_data key")
        self.text(index.fqn, "a storage_data key's fqn")
        self.size(index.offset, "a storage_data key's offset", optional=True)
        self.integer(index.index, "a storage_data key's index", optional=True)

    def storage_info(self, info: Any, where: str) -> None:
        self.fields(info, self.fs._StorageInfo, where)
        self.text(info.relative_path, f"{where}.relative_path")
        self.integer(info.offset, f"{where}.offset")
        self.integer(info.length, f"{where}.length")
        if info.transform_descriptors:  # compression or other extensions: never written here
            raise UnsafeCheckpoint(
                f"its .metadata asks for transforms {info.transform_descriptors!r} at {where}, "
                "which this project never writes"
            )

    def storage_meta(self, meta: Any) -> None:
        self.fields(meta, self.md.StorageMeta, "storage_meta")
        if not (meta.checkpoint_id is None or isinstance(meta.checkpoint_id, (str, PurePath))):
            raise self.fail("storage_meta.checkpoint_id", meta.checkpoint_id, "a path")
        self.text(meta.save_id, "storage_meta.save_id", optional=True)
        self.text(meta.load_id, "storage_meta.load_id", optional=True)
        self.exactly(meta.modules, list, "storage_meta.modules")
        for number, module in enumerate(meta.modules):
            self.text(module, f"storage_meta.modules[{number}]")

    def plain(self, value: Any, where: str, depth: int = 0) -> None:
        """Strings, numbers and containers of them (the planner's flattening map)."""
        if depth > 32:
            raise UnsafeCheckpoint(f"its .metadata nests {where} too deep")
        if value is None or type(value) in (str, int, float, bool):
            return
        if type(value) in (list, tuple):
            for number, item in enumerate(value):
                self.plain(item, f"{where}[{number}]", depth + 1)
            return
        if type(value) is dict:
            for key, item in value.items():
                self.plain(key, f"a key of {where}", depth + 1)
                self.plain(item, f"{where}[{key!r}]", depth + 1)
            return
        if isinstance(value, enum.Enum) or type(value) is torch.Size:
            return
        raise self.fail(where, value, "plain values")


def read_shard_metadata(folder: Path) -> Metadata:
    """The folder's `.metadata`, unpickled with the classes a real one holds and type-checked
    attribute by attribute; every shard it names is a whole file of the folder (not a link),
    and every value that is not a tensor loads as plain values."""
    for own in (METADATA, META):
        if (folder / own).is_symlink():
            raise UnsafeCheckpoint(
                f"its {own} is a symbolic link: a checkpoint's files are its own"
            )
    written = read_bounded(folder / METADATA, METADATA_LIMIT, METADATA, "not a checkpoint's index")
    metadata = MetadataUnpickler(io.BytesIO(written)).load()
    Schema().metadata(metadata)
    ends: dict[str, int] = {}
    for info in metadata.storage_data.values():
        name = info.relative_path
        if name in ("", ".", "..") or Path(name).name != name:
            raise UnsafeCheckpoint(f"its .metadata names {name!r}, not a file in its folder")
        ends[name] = max(ends.get(name, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        shard = folder / name
        if shard.is_symlink():
            raise UnsafeCheckpoint(
                f"its shard {name} is a symbolic link: a checkpoint's files are its own"
            )
        size = shard.stat().st_size if shard.is_file() else None
        if size is None or size < end:
            state = "missing" if size is None else f"{size} bytes, not {end}"
            raise MissingShards(f"its shard {name} is {state}")
    check_plain_values(folder, metadata)
    return metadata


def check_plain_values(folder: Path, metadata: Any) -> None:
    """The values that are not tensors (the optimizer's settings; torch.distributed.checkpoint
    stores each as a `torch.save` of its own) load with weights_only=True: a folder whose shard
    was damaged is found before a run resumes from it."""
    kinds = metadata.state_dict_metadata
    for index, info in metadata.storage_data.items():
        if type(kinds.get(index.fqn)).__name__ != "BytesStorageMetadata":
            continue
        with open(folder / info.relative_path, "rb") as shard:
            shard.seek(info.offset)
            value = shard.read(info.length)
        try:
            load_plain(io.BytesIO(value))
        except Exception as error:
            raise UnsafeCheckpoint(
                f"its shard {info.relative_path} holds {index.fqn} in a form that does not load "
                "as plain values (damaged, or needing full unpickling, which can run code)"
            ) from error
