"""A trained model rebuilt from a checkpoint that `train` wrote, for the commands that use one
(eval, predict, export), and the weights a fine-tuning run starts from (`init_from`: another
run's checkpoint{% if cookiecutter.examples != "vision" %}, or a Hugging Face GPT-2 folder{% endif %}).

A fine-tuning (LoRA) checkpoint holds its adapters and names the checkpoint its frozen weights
come from, with that file's SHA-256: they are loaded from there and verified."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from omegaconf import OmegaConf

from ..errors import PACKAGE, ConfigError
from ..files import absolute
from ..models.lora import is_adapter
from ..run.checks import check_vocabulary
from ..run.steps import build_model_and_data
from ..targets import build, plain, stored_config
from .door import (
    first_line,
    hugging_face_files,
    is_hugging_face,
    is_sharded,
    read_checkpoint,
)
from .saving import check_same_model


@dataclass
class Trained:
    path: Path
    checkpoint: dict[str, Any]
    model: L.LightningModule
    datamodule: L.LightningDataModule


def read_run_config(checkpoint: dict[str, Any], ckpt_path: Path) -> dict[str, Any]:
    """The data and model config that `train` stored in the checkpoint."""
    if "run_config" not in checkpoint:
        raise ConfigError(
            f"ckpt_path={ckpt_path} has no run_config: it was not written by this project's "
            "train command, so its model and data cannot be rebuilt."
        )
    stored = checkpoint["run_config"]
    if not (
        isinstance(stored, dict)
        and all(isinstance(stored.get(part), dict) for part in ("data", "model"))
    ):
        raise ConfigError(
            f"ckpt_path={ckpt_path} has a malformed run_config (it should hold the data and model "
            "configs): it was not written by this project's train command."
        )
    return {
        part: stored_config(stored[part], f"the run_config stored in ckpt_path={ckpt_path}")
        for part in ("data", "model")
    }


# Where a data config says its data is. A checkpoint's value is followed only to a local path
# that exists; anything else (a URL, a path that is not there) must come from the command line.
DATA_LOCATIONS = ("path", "root", "csv", "data_dir", "source", "tokenizer")
NAMED_TOKENIZERS = ("bytes", "bpe")  # data.tokenizer values that name a kind, not a file


def stored_data(stored: dict[str, Any], given: dict[str, Any], ckpt_path: Path) -> dict[str, Any]:
    """The stored data config with the user's keys over it; its stored locations checked, and
    downloads off unless the user turns them on."""
    for key, value in stored.items():
        if key in given or not isinstance(value, str):
            continue
        remote = "://" in value
        named = key == "tokenizer" and value in NAMED_TOKENIZERS
        missing = (
            key in DATA_LOCATIONS and not remote and not named
            and not Path(value).expanduser().exists()
        )  # fmt: skip
        if (key != "source" and missing) or remote:
            where = "a URL" if remote else "a path that does not exist here"
            raise ConfigError(
                f"ckpt_path={ckpt_path} stores data.{key}={value}, {where}: a checkpoint's data "
                f"location is followed only to a local path that exists. Give the data's "
                f"location yourself: data.{key}=..."
            )
    stored = dict(stored)
    if "download" in stored and "download" not in given:
        stored["download"] = False
    merged = OmegaConf.merge(stored, given)
    return OmegaConf.to_container(merged)  # type: ignore[return-value]


def rebuild(
    ckpt_path: Any, trust: bool, data_cfg: Any, model_cfg: Any, load_weights: bool = True
) -> Trained:
    """The model and data module of `ckpt_path`, with the command's `data` and `model` nodes
    merged over the stored configs; the frozen base weights of a fine-tuning run are always
    loaded, the checkpoint's own weights where `load_weights`."""
    ckpt_path = absolute(str(ckpt_path))
    checkpoint = read_checkpoint(ckpt_path, trust=trust)
    stored = read_run_config(checkpoint, ckpt_path)
    given_data, given_model = (plain(node or {}) for node in (data_cfg, model_cfg))
    merged_data = stored_data(stored["data"], given_data, ckpt_path)
    merged_model = OmegaConf.to_container(OmegaConf.merge(stored["model"], given_model))
    check_before_allocating(merged_model, checkpoint, ckpt_path)
    with without_initialization(load_weights):
        model, datamodule = build_model_and_data(
            merged_model, merged_data, f"ckpt_path={ckpt_path}"
        )
    check_vocabulary(datamodule, getattr(model, "net", None))  # the data given may be other
    data_state = checkpoint.get(type(datamodule).__qualname__)  # where Lightning stores it
    if isinstance(data_state, dict):
        datamodule.load_state_dict(data_state)  # e.g. an image folder's class names
    load_base_weights(model, checkpoint, ckpt_path)
    model.on_load_checkpoint(checkpoint)
    check_same_model(checkpoint, model, ckpt_path)  # also where Lightning loads the weights
    if load_weights:
        model.load_state_dict(checkpoint["state_dict"])
    return Trained(ckpt_path, checkpoint, model, datamodule)


def check_before_allocating(model_cfg: Any, checkpoint: dict[str, Any], ckpt_path: Path) -> None:
    """The model that the stored config describes, built on the meta device (shapes, no memory),
    must fit the checkpoint's weights before it is built for real: a small file whose config
    claims a huge model is refused in one line, not allocated. A fine-tuning checkpoint's frozen
    weights come from its base checkpoint, so only they may be missing here."""
    with torch.device("meta"):
        model = build(model_cfg, f"the run_config stored in ckpt_path={ckpt_path}", "model")
    if not isinstance(model, torch.nn.Module):
        return  # build_model_and_data says what it builds instead
    adapters_only = "base_weights" in checkpoint
    check_same_model(
        checkpoint, model, ckpt_path, optional=lambda name: adapters_only and not is_adapter(name)
    )


# The initializers that layers call as they are built (nn.Linear's kaiming_uniform_, ...).
INITIALIZERS = (
    "uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_",
    "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_",
)  # fmt: skip


@contextmanager
def without_initialization(skip: bool = True) -> Iterator[None]:
    """Layers built inside keep their memory as allocated, not randomly initialized: every
    parameter is about to be overwritten by a checkpoint's (check_same_model makes sure of
    it), and drawing 124M random numbers first takes longer than loading them."""
    if not skip:
        yield
        return
    kept = {name: getattr(torch.nn.init, name) for name in INITIALIZERS}
    for name in INITIALIZERS:
        setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, function in kept.items():
            setattr(torch.nn.init, name, function)


@dataclass(frozen=True)
class TextInterface:
    """How a trained language model reads and writes text: its data module's tokenizer, else
    UTF-8 bytes (the byte-level model's); the token that ends a document or a response, where
    the tokenizer has one; and, for a model trained on instructions, a conversation's prompt
    tokens (`chat`, which raises ValueError naming what is wrong with the messages)."""

    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    end_of_text: int | None
    chat: Callable[[Any], list[int]] | None


def utf8_bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def from_utf8_bytes(ids: list[int]) -> str:
    return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


def text_interface(datamodule: Any) -> TextInterface:
    encode, decode = getattr(datamodule, "encode", None), getattr(datamodule, "decode", None)
    if not (callable(encode) and callable(decode)):
        return TextInterface(utf8_bytes, from_utf8_bytes, None, None)
    load = getattr(datamodule, "load_tokenizer", None)
    token = getattr(load(), "end_of_text", None) if callable(load) else None
    chat = getattr(datamodule, "chat_tokens", None)
    return TextInterface(
        encode, decode, None if token is None else int(token), chat if callable(chat) else None
    )


def file_digest(path: Path) -> str:
    """SHA-256 of a file, or of a folder (each file's name and contents, in order): every file of
    a folder of shards, the model's files of a Hugging Face folder."""
    digest = hashlib.sha256()
    if is_hugging_face(path):
        parts = hugging_face_files(path)
    else:
        parts = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for part in parts:
        if path.is_dir():
            digest.update(str(part.relative_to(path)).encode() + b"\0")
        with open(part, "rb") as file:
            while chunk := file.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()


def load_init_weights(model: L.LightningModule, path: Path, trust: bool = False) -> dict[str, str]:
    """A new run's weights from another run's checkpoint{% if cookiecutter.examples != "vision" %} or a Hugging Face GPT-2 folder{% endif %}
    (optimizer, schedule and step counter start fresh); adapters the model adds start as they
    are. Returns where they came from."""
    path = absolute(path)
{%- if cookiecutter.examples != "vision" %}
    if is_hugging_face(path):
        from .hugging_face import load_hugging_face

        load_hugging_face(model, path)
        return {"path": str(path), "sha256": file_digest(path)}
{%- endif %}
    checkpoint = read_checkpoint(path, trust=trust, key="init_from")
    if "base_weights" in checkpoint:
        raise ConfigError(
            f"init_from={path} holds LoRA adapters, not a whole model: merge them into their base "
            f"weights first ({PACKAGE}-export ckpt_path={path} format=checkpoint) and start "
            "from the merged checkpoint."
        )
    check_same_model(checkpoint, model, path, optional=is_adapter, key="init_from")
    model.load_state_dict(checkpoint["state_dict"], strict=False)
    return {"path": str(path), "sha256": file_digest(path)}


def load_base_weights(
    model: L.LightningModule, checkpoint: dict[str, Any], ckpt_path: Path
) -> None:
    base = checkpoint.get("base_weights")
    if base is None:
        return
    if not (
        isinstance(base, dict)
        and isinstance(base.get("path"), str)
        and isinstance(base.get("sha256"), str)
    ):
        raise ConfigError(
            f"ckpt_path={ckpt_path} has a malformed base_weights entry (it should name the base "
            "checkpoint's path and SHA-256): it was not written by this project's train command."
        )
    path = Path(base["path"])
    adapters = f"ckpt_path={ckpt_path} holds LoRA adapters for the weights in {path}"
    if not path.exists():
        raise ConfigError(
            f"{adapters}, which is missing: put that checkpoint back there (SHA-256 "
            f"{base['sha256'][:16]}...)."
        )
    if not (path.is_file() or is_sharded(path) or is_hugging_face(path)):
        raise ConfigError(
            f"{adapters}, which is not a checkpoint (a file, a folder of shards or a Hugging Face "
            "folder) but another folder, a device or a pipe: the adapters were not written by "
            "this project's train command."
        )
    try:
        digest = file_digest(path)
    except OSError as error:
        raise ConfigError(f"{adapters}, which cannot be read ({first_line(error)}).") from error
    if digest != base["sha256"]:
        raise ConfigError(
            f"{adapters}, but {'its files have' if path.is_dir() else 'that file has'} changed "
            "since the fine-tuning run started: restore the original."
        )
    load_init_weights(model, path)
