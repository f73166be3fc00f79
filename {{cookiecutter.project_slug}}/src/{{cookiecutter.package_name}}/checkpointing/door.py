"""The one door for checkpoint bytes that the user did not write by hand: single-file checkpoints,
folders of shards (torch.distributed.checkpoint), a fine-tuning run's base weights, and the
programs `export` writes and reads back. Nothing else in the package calls `torch.load`,
`pickle`, `torch.export.load` or a `torch.distributed.checkpoint` loader (a test reads the source
to make sure): every byte goes through the readers here, and none of them hands a file to an
unpickler that can import or call anything.

- A single file is read by torch's restricted unpickler (`weights_only=True`); full unpickling
  happens only for `trust_checkpoint=true`, which the user types.
- A folder's `.metadata` is read by `MetadataUnpickler` (the classes a real one holds, nothing
  else), then every attribute is type-checked against torch's own dataclasses, every shard it
  names is a whole file of the folder, and every value that is not a tensor loads as plain
  values. `ShardReader` is the only storage reader handed to torch.distributed.checkpoint: it
  returns that checked metadata, never reads a rank-local `__<rank>.metadata` (torch's loader
  falls back to one, with a bare `pickle.load`, when the global one fails to read), and refuses
  transforms it did not write.
- A Hugging Face model folder is read as JSON (`config.json`, checked against the fields its
  reader expects) and safetensors (`model.safetensors`: a JSON header, then raw tensor bytes);
  neither format can name code, and its pickled weights (`pytorch_model.bin`) are never read.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import json
import logging
import pickle
import warnings
import zipfile
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path, PurePath
from typing import TYPE_CHECKING, Any

import torch

from ..errors import ConfigError

if TYPE_CHECKING:  # torch.distributed.checkpoint takes most of a second to import
    from torch.distributed.checkpoint.metadata import Metadata
    from torch.distributed.checkpoint.planner import LoadPlanner

log = logging.getLogger(__name__)

METADATA = ".metadata"  # written last by torch.distributed.checkpoint: the shards are complete
META = "meta.pt"  # Lightning's name for everything but the weights and optimizer state

# What reading a file that is not a whole checkpoint raises (garbage makes an unpickler fail in
# many ways: a text file gave IndexError).
UNREADABLE = (
    RuntimeError, pickle.UnpicklingError, EOFError, ValueError, OSError, IndexError, KeyError,
    TypeError, AttributeError, zipfile.BadZipFile,
)  # fmt: skip


class UnsafeCheckpoint(pickle.UnpicklingError):
    """A checkpoint that names something a real one never holds, or is not whole."""


class MissingShards(UnsafeCheckpoint):
    """A `.metadata` file whose shards are not all there, whole."""


def first_line(error: BaseException) -> str:
    """The gist of a loading error, without torch's advice to load with weights_only=False."""
    line = str(error).splitlines()[0] if str(error) else type(error).__name__
    return "weights_only=True refused it" if line.startswith("Weights only load failed") else line


# Single files.


def load_plain(source: Path | io.BytesIO, mmap: bool = False) -> Any:
    """Plain values and tensors, through torch's restricted unpickler."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own, about what weights_only refuses
        return torch.load(source, map_location="cpu", weights_only=True, mmap=mmap)


def load_trusted(path: Path) -> Any:
    """Full unpickling, which runs whatever the file names: only for `trust_checkpoint=true`."""
    log.warning("trust_checkpoint=true: loading %s with full unpickling.", path)
    return torch.load(path, map_location="cpu", weights_only=False)


def refused_as_python_objects(error: pickle.UnpicklingError) -> bool:
    """True where the restricted unpickler refused a pickle that names Python objects (which
    full unpickling would build), False where the bytes are no pickle at all."""
    text = str(error)
    return "Weights only load failed" in text and "Unsupported operand" not in text


def non_finite_tensors(state_dict: dict[str, Any]) -> list[str]:
    return [
        name
        for name, value in state_dict.items()
        if isinstance(value, torch.Tensor)
        and value.is_floating_point()
        and not bool(torch.isfinite(value).all())
    ]


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
        return load_plain(path)
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


# Folders of shards.

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
    metadata = MetadataUnpickler(io.BytesIO((folder / METADATA).read_bytes())).load()
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


def read_meta(folder: Path) -> dict[str, Any]:
    """Everything but the weights and optimizer state (the step, loops and callbacks' states),
    once the folder's metadata has passed `read_shard_metadata`."""
    read_shard_metadata(folder)
    return dict(load_plain(folder / META))


def read_fit_state(path: Path) -> dict[str, Any]:
    """A checkpoint (a file, or a folder of shards) without its weights' values."""
    if path.is_dir():
        return read_meta(path)
    return dict(load_plain(path, mmap=True))


def shard_reader(folder: Path) -> Any:
    """The storage reader for torch.distributed.checkpoint's loaders (see the module's text)."""
    from torch.distributed.checkpoint import FileSystemReader

    class ShardReader(FileSystemReader):
        def __init__(self, folder: Path) -> None:
            super().__init__(folder)
            self.checked = read_shard_metadata(folder)

        def read_metadata(self) -> Metadata:  # no `rank` keyword: torch then tries no fallback
            from torch.distributed.checkpoint.metadata import StorageMeta

            if self.checked.storage_meta is None:
                self.checked.storage_meta = StorageMeta()
            self.checked.storage_meta.load_id = self.load_id
            return self.checked

        def read_data(self, plan: Any, planner: LoadPlanner) -> Any:
            self.storage_data = self.checked.storage_data  # never the caller's
            return super().read_data(plan, planner)

    return ShardReader(folder)


def plain_values_planner(planner_class: type) -> type:
    """`planner_class` whose values that are not tensors (an optimizer's hyperparameters) load
    with weights_only=True: torch's planners unpickle them with weights_only=False."""
    from torch.distributed.checkpoint._traverse import set_element

    class PlainValues(planner_class):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            name = read_item.dest_index.fqn
            try:
                loaded = load_plain(value)
            except Exception as error:
                raise UnsafeCheckpoint(
                    f"its shards hold {name} as something other than plain values, which only "
                    "full unpickling (a way to run code) can read"
                ) from error
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[name], loaded)
            else:
                self.state_dict[name] = loaded

    return PlainValues


@contextmanager
def first_failure() -> Iterator[None]:
    """torch.distributed.checkpoint gathers each rank's error into a CheckpointException (a
    BaseException whose text is every rank's traceback): raise the first error itself."""
    from torch.distributed.checkpoint import CheckpointException

    try:
        yield
    except CheckpointException as error:
        failures: list[Any] = [failure for failure, _ in error.failures.values()]
        if failures and isinstance(failures[0], Exception):
            raise failures[0] from error
        raise RuntimeError(str(error).splitlines()[0]) from error


def load_shards(state: dict[str, Any], folder: Path, allow_partial: bool = False) -> None:
    """Fill `state` (a model's or optimizer's state dict, sharded or not) from the folder, on
    every rank of the job, as `torch.distributed.checkpoint.load` does."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, load

    planner = plain_values_planner(DefaultLoadPlanner)(allow_partial_load=allow_partial)
    with first_failure():
        load(state, storage_reader=shard_reader(folder), planner=planner)


def read_shards_whole(folder: Path) -> dict[str, Any]:
    """The whole checkpoint in one process's memory, as a single-file one holds it."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    checkpoint = read_meta(folder)
    tensors: dict[str, Any] = {}
    with warnings.catch_warnings(), first_failure():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        _load_state_dict(
            tensors,
            storage_reader=shard_reader(folder),
            planner=plain_values_planner(_EmptyStateDictLoadPlanner)(),
            no_dist=True,
        )
    optimizers = sorted(key for key in tensors if key.startswith("optimizer_"))
    checkpoint["state_dict"] = tensors.get("state_dict", {})
    checkpoint["optimizer_states"] = [tensors[key] for key in optimizers]
    return checkpoint


# Programs that `export` wrote a moment ago, read back for its parity check.


def load_own_export(path: Path) -> Any:
    """A `torch.export` program that this process has just written (its parity check)."""
    with open(path, "rb") as file:
        return torch.export.load(file)


# Hugging Face model folders: values only (JSON and safetensors), never their pickles.

HF_CONFIG = "config.json"
HF_WEIGHTS = "model.safetensors"
HF_PICKLED = "pytorch_model.bin"
HF_TOKENIZER = "tokenizer.json"  # JSON that the data modules read with the tokenizers library
JSON_LIMIT = 1 << 20  # a model's config.json is a few kilobytes

# What a checked JSON field may hold.
JSON_KINDS: dict[str, Any] = {
    "a string": lambda value: type(value) is str,
    "a whole number": lambda value: type(value) is int,
    "a whole number or null": lambda value: value is None or type(value) is int,
    "a number": lambda value: type(value) in (int, float),
    "true or false": lambda value: type(value) is bool,
}


def is_hugging_face(path: Path) -> bool:
    """A folder laid out as a Hugging Face model: its config.json, or its weights."""
    return (
        path.is_dir()
        and not is_sharded(path)
        and any((path / name).is_file() for name in (HF_CONFIG, HF_WEIGHTS, HF_PICKLED))
    )


def hugging_face_files(folder: Path) -> list[Path]:
    """The files of a Hugging Face folder that make its model and its tokens (what a fingerprint
    of the folder covers; not the download's bookkeeping in `.cache`)."""
    names = (HF_CONFIG, HF_WEIGHTS, HF_TOKENIZER)
    return [folder / name for name in names if (folder / name).is_file()]


def read_json_fields(
    path: Path, fields: Mapping[str, str], required: Iterable[str], key: str
) -> dict[str, Any]:
    """A small JSON file holding one object, each of whose `fields` present holds what
    `JSON_KINDS` names for it and the `required` ones present; one error line otherwise. Other
    keys are kept as they are, unread."""
    where = f"{key}={path.parent}: its {path.name}"
    try:
        with path.open("rb") as file:
            data = file.read(JSON_LIMIT + 1)
    except OSError as error:
        raise ConfigError(f"{where} cannot be read ({error.strerror or error}).") from error
    if len(data) > JSON_LIMIT:
        raise ConfigError(
            f"{where} is larger than {JSON_LIMIT >> 20} MiB, which no model's config is: "
            "download it again."
        )
    try:
        value = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise ConfigError(
            f"{where} is not JSON ({first_line(error)}): download it again."
        ) from error
    if not isinstance(value, dict):
        raise ConfigError(
            f"{where} holds a JSON {type(value).__name__}, not an object of settings: download "
            "it again."
        )
    missing = [name for name in required if name not in value]
    if missing:
        raise ConfigError(
            f"{where} has no {', '.join(missing)}: it is not the config of a model this project "
            "converts."
        )
    for name, kind in fields.items():
        if name in value and not JSON_KINDS[kind](value[name]):
            raise ConfigError(
                f"{where} has {name}={json.dumps(value[name])[:80]}, where the config of this "
                f"model holds {kind}: download it again."
            )
    return value


def read_safetensors(path: Path, key: str) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file (a JSON header of names, types, shapes and offsets,
    then raw bytes), each finite; one error line otherwise."""
    where = f"{key}={path.parent}: its {path.name}"
    try:
        from safetensors.torch import load_file
    except ImportError as error:
        raise ConfigError(
            f"{where} needs the safetensors package: pip install safetensors (or the project's "
            "`pretrained` extra)."
        ) from error
    try:
        tensors = load_file(path, device="cpu")
    except Exception as error:  # safetensors raises its own SafetensorError, among others
        raise ConfigError(
            f"{where} is not a readable safetensors file ({first_line(error)}): it may be "
            "truncated or damaged; download it again."
        ) from error
    bad = non_finite_tensors(tensors)
    if bad:
        raise ConfigError(
            f"{where} holds NaN or infinite weights ({', '.join(bad[:3])}"
            f"{' ...' if len(bad) > 3 else ''}): download it again."
        )
    return tensors
