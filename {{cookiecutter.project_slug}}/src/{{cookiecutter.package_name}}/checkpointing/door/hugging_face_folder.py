"""Hugging Face model folders: values only, never their pickles. `config.json` is read as JSON and
checked against the fields its reader expects, `model.safetensors` as safetensors (a JSON header,
then raw tensor bytes); neither format can name code, and the pickled weights
(`pytorch_model.bin`) are never read. Each file is read only as a regular file of the folder
(`data/folder_files.py`: no link out of it, no device or pipe)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from ...data.folder_files import file_in_folder
from ...errors import ConfigError
from .shard_metadata import is_sharded
from .single_file import first_line, non_finite_tensors

HF_CONFIG = "config.json"
HF_WEIGHTS = "model.safetensors"
HF_PICKLED = "pytorch_model.bin"
HF_INDEX = "model.safetensors.index.json"  # which shard file holds each tensor of a large model
HF_TOKENIZER = "tokenizer.json"  # JSON that the data modules read with the tokenizers library
JSON_LIMIT = 1 << 20  # a model's config.json is a few kilobytes
NAME_LIMIT = 255  # bytes of a file name on every common file system

# What a checked JSON field may hold.
JSON_KINDS: dict[str, Any] = {
    "a string": lambda value: type(value) is str,
    "a whole number": lambda value: type(value) is int,
    "a whole number or null": lambda value: value is None or type(value) is int,
    "a number": lambda value: type(value) in (int, float),
    "true or false": lambda value: type(value) is bool,
    "an object": lambda value: type(value) is dict,
    "an object or null": lambda value: value is None or type(value) is dict,
}


def is_hugging_face(path: Path) -> bool:
    """A folder laid out as a Hugging Face model: its config.json, or its weights."""
    return (
        path.is_dir()
        and not is_sharded(path)
        and any((path / name).is_file() for name in (HF_CONFIG, HF_WEIGHTS, HF_INDEX, HF_PICKLED))
    )


def hugging_face_files(folder: Path) -> list[Path]:
    """The files of a Hugging Face folder that make its model and its tokens (what a fingerprint
    of the folder covers; not the download's bookkeeping in `.cache`)."""
    names = [HF_CONFIG, HF_WEIGHTS, HF_INDEX, HF_TOKENIZER]
    if (folder / HF_INDEX).is_file() and not (folder / HF_WEIGHTS).is_file():
        # A damaged index is the reader's to report; the fingerprint is then the index's.
        with contextlib.suppress(ConfigError):
            names += sorted(set(shard_names(folder, "init_from").values()))
    found = (file_in_folder(folder, name, f"init_from={folder}") for name in names)
    return [path for path in found if path is not None]


def shard_names(folder: Path, key: str) -> dict[str, str]:
    """The index of a model saved in several safetensors files: each tensor's name and the file
    of the folder that holds it (a plain file name, never a path out of the folder)."""
    where = f"{key}={folder}: its {HF_INDEX}"
    index = read_json_fields(folder / HF_INDEX, {"weight_map": "an object"}, ["weight_map"], key)
    files: dict[str, str] = {}
    for name, file in index["weight_map"].items():
        if (
            type(file) is not str
            or Path(file).name != file
            or file in (".", "..")
            or not file.endswith(".safetensors")
            or len(file.encode("utf-8", "surrogatepass")) > NAME_LIMIT
        ):
            raise ConfigError(
                f"{where} names {json.dumps(file)[:80]} for {name[:80]}, not a .safetensors file "
                "of the folder: download the model again."
            )
        files[name] = file
    return files


def read_safetensors_folder(folder: Path, key: str) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face folder's weights: `model.safetensors`, or the files its
    `model.safetensors.index.json` names, each holding exactly the tensors the index gives it."""
    if (folder / HF_WEIGHTS).is_file() or not (folder / HF_INDEX).is_file():
        return read_safetensors(folder / HF_WEIGHTS, key)
    wanted = shard_names(folder, key)
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(set(wanted.values())):
        try:
            present = (folder / file).is_file()
        except (OSError, ValueError):  # a name the file system refuses (a NUL byte, ...)
            present = False
        if not present:
            raise ConfigError(
                f"{key}={folder}: its {HF_INDEX} names {file}, which the folder does not hold: "
                "download every file of the model."
            )
        held = read_safetensors(folder / file, key)
        expected = {name for name, own in wanted.items() if own == file}
        if set(held) != expected:
            stray = sorted(set(held) ^ expected)
            raise ConfigError(
                f"{key}={folder}: its {file} does not hold the tensors its {HF_INDEX} gives it "
                f"({', '.join(stray[:3])}{' ...' if len(stray) > 3 else ''}): download the model "
                "again."
            )
        tensors.update(held)
    return tensors


def read_json_fields(
    path: Path, fields: Mapping[str, str], required: Iterable[str], key: str
) -> dict[str, Any]:
    """A small JSON file holding one object, each of whose `fields` present holds what
    `JSON_KINDS` names for it and the `required` ones present; one error line otherwise. Other
    keys are kept as they are, unread."""
    where = f"{key}={path.parent}: its {path.name}"
    try:
        inside = file_in_folder(path.parent, path.name, f"{key}={path.parent}")
        with (inside or path).open("rb") as file:  # a missing one: the OSError's words
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
    inside = file_in_folder(path.parent, path.name, f"{key}={path.parent}")
    try:
        tensors = load_file(inside or path, device="cpu")
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
