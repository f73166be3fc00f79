"""Fuzzing the language example's doors for files a user did not write: instruction JSONL, a
Hugging Face folder's config.json, model.safetensors and shard index, a tokenizer.json, a chat
template, and a folder of token shards (its manifest and its shards). Each case is a valid file
mutated at random (tests/fuzzing.py); whatever the case, the door gives a result or the project's
one-line ConfigError, never another exception."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

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
from {{ cookiecutter.package_name }}.data.token_shards import (
    MANIFEST,
    TokenShardDataModule,
)
from {{ cookiecutter.package_name }}.data.tokenizer import (
    tokenizer_file,
)
from {{ cookiecutter.package_name }}.errors import ConfigError
from {{ cookiecutter.package_name }}.recipes.prepare import (
    prepare,
)

from .fuzzing import (
    CASES,
    door_holds,
    must_refuse,
    mutate_bytes,
    mutated_json_text,
    remove,
    write_case,
)
from .test_llama_family import CHATML, CONVERSATION, built, chat_folder, save_family
from .test_token_shards import PREPARED, prepare_config, write_corpus

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
            good = (llama_folder / name).read_bytes()
            kind = write_case(folder / name, mutated_json_text(valid, rng), rng, good)
            door_holds(
                lambda: load_hugging_face(net, folder),  # noqa: B023
                f"{name} case {case} ({kind})",
                must_refuse(kind, own_file=True),
            )


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
        mutated = mutate_bytes(head, rng) + rest if case % 3 else mutate_bytes(valid, rng)
        kind = write_case(shard, mutated, rng, valid)
        door_holds(
            lambda: load_hugging_face(net, folder),
            f"{shard.name} case {case} ({kind})",
            must_refuse(kind, own_file=True),
        )
        remove(shard)
        shard.write_bytes(valid)
    with torch.no_grad():
        load_hugging_face(net, folder)  # the intact folder still loads


def test_tokenizer_json(tmp_path: Path) -> None:
    folder = chat_folder(tmp_path / "model", "chatml", json.dumps(RECORDS) * 10)
    valid = json.loads((folder / "tokenizer.json").read_text())
    path = tmp_path / "tokenizer.json"
    rng = random.Random(4)
    for case in range(CASES):
        good = (folder / "tokenizer.json").read_bytes()
        kind = write_case(path, mutated_json_text(valid, rng), rng, good)

        def door() -> None:
            tokenizer = tokenizer_file("data.tokenizer", str(path), "give another")
            tokenizer.decode(tokenizer.encode("Reverse: owl"))

        door_holds(door, f"case {case} ({kind})", must_refuse(kind, own_file=False))


def test_chat_template(tmp_path: Path) -> None:
    folder = chat_folder(tmp_path / "model", "chatml", json.dumps(RECORDS) * 10)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    rng = random.Random(5)
    for case in range(CASES):
        if case % 2:
            text = mutate_bytes(CHATML.encode(), rng).decode("utf-8", "replace")
            written = json.dumps({**config, "chat_template": text}).encode()
        else:
            written = mutated_json_text(config, rng)
        good = json.dumps(config).encode()
        kind = write_case(folder / "tokenizer_config.json", written, rng, good)

        def door() -> None:
            template = ChatTemplate.load(str(folder))
            try:
                template.parts(CONVERSATION)
            except ValueError as error:  # a record's one line, as load_splits words it
                raise ConfigError(f"line 1: {error}") from None

        door_holds(door, f"case {case} ({kind})", must_refuse(kind, own_file=True))


@pytest.fixture(scope="module")
def shard_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A BPE of 300 tokens in shards of 2,000 tokens."""
    corpus = write_corpus(tmp_path_factory.mktemp("corpus"))
    folder = tmp_path_factory.mktemp("prepared")
    prepare(prepare_config(folder, f"source={corpus}", *PREPARED))
    return folder / "tokens"


def read_every_split(folder: Path, verify_checksums: bool) -> None:
    """What training reads: the manifest, the checks, the tokenizer, and each split's first and
    last windows."""
    data = TokenShardDataModule(
        str(folder), vocab_size=300, block_size=32, verify_checksums=verify_checksums
    )
    for split in data.load_splits().values():
        split[0], split[len(split) - 1]


def test_token_shard_folders(shard_folder: Path, tmp_path: Path) -> None:
    """The manifest mutated as JSON or bytes, or one shard's bytes mutated (truncated, flipped:
    ids past the vocabulary), read with and without the checksum pass."""
    folder = Path(shutil.copytree(shard_folder, tmp_path / "tokens"))
    manifest = json.loads((shard_folder / MANIFEST).read_text())
    shards = sorted(path.name for path in shard_folder.glob("*.bin"))
    assert shards, "prepare wrote no .bin shards"
    rng = random.Random(6)
    for case in range(CASES):
        if case % 2:
            name = MANIFEST
            good = (shard_folder / name).read_bytes()
            kind = write_case(folder / name, mutated_json_text(manifest, rng), rng, good)
        else:
            name = rng.choice(shards)
            good = (shard_folder / name).read_bytes()
            kind = write_case(folder / name, mutate_bytes(good, rng), rng, good)
        verify = case % 4 < 2
        door_holds(
            lambda: read_every_split(folder, verify),  # noqa: B023
            f"{name} case {case} ({kind})",
            must_refuse(kind, own_file=True),
        )
        remove(folder / name)
        shutil.copy(shard_folder / name, folder / name)
    read_every_split(folder, verify_checksums=False)  # the intact folder still reads
