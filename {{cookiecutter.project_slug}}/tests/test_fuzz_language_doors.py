"""Fuzzing the language example's doors for files a user did not write: instruction JSONL, a
Hugging Face folder's config.json, model.safetensors and shard index, a tokenizer.json and a
chat template. Each case is a valid file mutated at random (truncated, bits flipped, bytes
inserted, a value swapped for a huge, deep, non-UTF-8 or wrongly typed one); whatever the case,
the door gives a result or the project's one-line ConfigError, never another exception.

Seeded, so a failure names its case; FUZZ_CASES cases a door (`make test` keeps the default,
`make test-all` runs more)."""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from {{ cookiecutter.package_name }}.checkpointing.hugging_face import (
    load_hugging_face,
)
from {{ cookiecutter.package_name }}.data.chat_template import (
    ChatTemplate,
)
from {{ cookiecutter.package_name }}.data.instructions import (
    InstructionDataModule,
)
from {{ cookiecutter.package_name }}.data.tokenizer import (
    tokenizer_file,
)
from {{ cookiecutter.package_name }}.errors import ConfigError

from .test_llama_family import CHATML, CONVERSATION, built, chat_folder, save_family

CASES = int(os.environ.get("FUZZ_CASES", "60"))
ODD_VALUES: list[Any] = [
    None, True, -1, 0, 2**64, 1e309, float("nan"), "", "x" * 100_000, [], {}, [[[[]]]],
    {"role": "user"}, "\ud800",
]  # fmt: skip
ODD_TEXT = ["1" * 5000, "[" * 100_000, '"\\ud800"', "NaN", "-Infinity", "1e999999"]


def mutate_bytes(data: bytes, rng: random.Random) -> bytes:
    kind = rng.choice(["truncate", "flip", "insert", "repeat", "odd text"])
    if kind == "truncate":
        return data[: rng.randrange(len(data) + 1)]
    if kind == "flip":
        flipped = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
        return bytes(flipped)
    at = rng.randrange(len(data) + 1)
    if kind == "insert":
        return data[:at] + rng.randbytes(rng.randint(1, 16)) + data[at:]
    if kind == "repeat":
        return data[:at] + data[at : at + rng.randint(1, 64)] * rng.randint(2, 50) + data[at:]
    return data[:at] + rng.choice(ODD_TEXT).encode() + data[at:]


def mutate_json(value: Any, rng: random.Random) -> Any:
    """The same JSON with one value (at any depth) swapped for an odd one, or a key dropped."""
    if isinstance(value, dict) and value and rng.random() < 0.7:
        key = rng.choice(list(value))
        if rng.random() < 0.2:
            return {k: v for k, v in value.items() if k != key}
        return {**value, key: mutate_json(value[key], rng)}
    if isinstance(value, list) and value and rng.random() < 0.7:
        index = rng.randrange(len(value))
        return [*value[:index], mutate_json(value[index], rng), *value[index + 1 :]]
    return rng.choice(ODD_VALUES)


def mutated_json_text(value: Any, rng: random.Random) -> bytes:
    if rng.random() < 0.5:
        return mutate_bytes(json.dumps(value).encode(), rng)
    try:
        return json.dumps(mutate_json(value, rng)).encode("utf-8", "surrogatepass")
    except ValueError:
        return b"{}"


def door_holds(door: Callable[[], Any], case: str) -> None:
    """The door returns, or raises one line of ConfigError; anything else fails the test."""
    try:
        door()
    except ConfigError as error:
        assert "\n" not in str(error), f"{case}: {error}"
    except Exception as error:  # what this test looks for
        raise AssertionError(f"{case}: {type(error).__name__}: {error}"[:2000]) from error


RECORDS = [
    {"instruction": "Reverse the word.", "input": "cat", "output": "tac"},
    {"messages": CONVERSATION},
]


@pytest.mark.parametrize("template", [False, True], ids=["own template", "model's template"])
def test_instruction_records(tmp_path: Path, template: bool) -> None:
    folder = chat_folder(tmp_path / "model", "chatml", json.dumps(RECORDS) * 10)
    text = "\n".join(json.dumps(record) for record in RECORDS * 3).encode()
    source = tmp_path / "records.jsonl"
    rng = random.Random(1)
    for case in range(CASES):
        source.write_bytes(
            mutate_bytes(text, rng) if case % 2 else mutated_json_text(RECORDS[case % 4 // 2], rng)
        )

        def door() -> None:
            data = InstructionDataModule(
                source=str(source), vocab_size=1000, block_size=1 << 16,
                tokenizer=str(folder / "tokenizer.json") if template else None,
                chat_template=str(folder) if template else None,
            )  # fmt: skip
            data.setup("fit")

        door_holds(door, f"case {case}: {source.read_bytes()[:200]!r}")


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_family("qwen2", tmp_path_factory.mktemp("qwen2")).folder


def test_hugging_face_config_and_shard_index(llama_folder: Path, tmp_path: Path) -> None:
    net = built(llama_folder)
    rng = random.Random(2)
    for name in ("config.json", "model.safetensors.index.json"):
        folder = tmp_path / name
        shutil.copytree(llama_folder, folder)
        valid = json.loads((llama_folder / name).read_text())
        for case in range(CASES):
            (folder / name).write_bytes(mutated_json_text(valid, rng))
            door_holds(lambda: load_hugging_face(net, folder), f"{name} case {case}")  # noqa: B023


def test_safetensors_weights(llama_folder: Path, tmp_path: Path) -> None:
    folder = tmp_path / "weights"
    shutil.copytree(llama_folder, folder)
    shards = sorted(folder.glob("model-*.safetensors"))
    net = built(llama_folder)
    rng = random.Random(3)
    for case in range(CASES):
        shard = rng.choice(shards)
        valid = (llama_folder / shard.name).read_bytes()
        header = int.from_bytes(valid[:8], "little") + 8
        # Most flips land in the header (names, shapes, offsets), where parsers break.
        head, rest = valid[:header], valid[header:]
        shard.write_bytes(mutate_bytes(head, rng) + rest if case % 3 else mutate_bytes(valid, rng))
        door_holds(lambda: load_hugging_face(net, folder), f"{shard.name} case {case}")
        shard.write_bytes(valid)
    with torch.no_grad():
        load_hugging_face(net, folder)  # the intact folder still loads


def test_tokenizer_json(tmp_path: Path) -> None:
    folder = chat_folder(tmp_path / "model", "chatml", json.dumps(RECORDS) * 10)
    valid = json.loads((folder / "tokenizer.json").read_text())
    path = tmp_path / "tokenizer.json"
    rng = random.Random(4)
    for case in range(CASES):
        path.write_bytes(mutated_json_text(valid, rng))

        def door() -> None:
            tokenizer = tokenizer_file("data.tokenizer", str(path), "give another")
            tokenizer.decode(tokenizer.encode("Reverse: owl"))

        door_holds(door, f"case {case}")


def test_chat_template(tmp_path: Path) -> None:
    folder = chat_folder(tmp_path / "model", "chatml", json.dumps(RECORDS) * 10)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    rng = random.Random(5)
    for case in range(CASES):
        if case % 2:
            text = mutate_bytes(CHATML.encode(), rng).decode("utf-8", "replace")
            changed = {**config, "chat_template": text}
            (folder / "tokenizer_config.json").write_text(json.dumps(changed))
        else:
            (folder / "tokenizer_config.json").write_bytes(mutated_json_text(config, rng))

        def door() -> None:
            template = ChatTemplate.load(str(folder))
            try:
                template.parts(CONVERSATION)
            except ValueError as error:  # a record's one line, as load_splits words it
                raise ConfigError(f"line 1: {error}") from None

        door_holds(door, f"case {case}")
