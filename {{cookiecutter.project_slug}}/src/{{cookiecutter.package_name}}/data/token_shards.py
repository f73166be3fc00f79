"""Pre-tokenized text in memory-mapped shards (the prepare command writes them).

A folder holds `manifest.json`, the tokenizer (`tokenizer.json`) and per split one or more shard
files of raw little-endian token ids (uint16 when the vocabulary fits, else uint32). Each split
is read as non-overlapping windows of `block_size + 1` tokens straight from the memory maps,
which the operating system pages in on demand: nothing is loaded whole, in any process.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from .base import SplitDataModule, shuffle_seed
from .errors import ConfigError
from .folder_files import file_in_folder
from .shard_format import (
    MANIFEST,
    SPLITS,
    TOKENIZER,
    no_manifest,
    parse_manifest,
    read_manifest,
)
from .streaming import PageOrderSampler, ShardFolder, StreamedWindows, is_url, spans
from .tokenizer import TextTokenizer, read_tokenizer_text, tokenizer_from_json


def file_sha256(path: Path, dtype: str, vocab_size: int) -> str:
    """The file's SHA-256; in the same pass, its token ids are checked against the vocabulary."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 24):  # a multiple of every token size
            digest.update(chunk)
            check_token_ids(np.frombuffer(chunk, dtype=dtype), vocab_size, path.name)
    return digest.hexdigest()


def check_token_ids(tokens: np.ndarray[Any, Any], vocab_size: int, shard: str) -> None:
    """Token ids past the model's vocabulary would index past its embedding (a device-side
    assert on a GPU): refused in one line before they reach it."""
    if tokens.size and int(tokens.max()) >= vocab_size:
        raise ConfigError(
            f"token shard {shard} holds token id {int(tokens.max())}, past the model's vocabulary "
            f"of {vocab_size} (data.vocab_size): it was prepared with another tokenizer; prepare "
            "it again, or raise data.vocab_size."
        )


def check_shards(
    where: str,
    manifest: dict[str, Any],
    size_of: Callable[[str], int | None],
    checksum_of: Callable[[str], str] | None,
) -> None:
    """Every shard present with its recorded size (and SHA-256, given `checksum_of`)."""
    itemsize = np.dtype(manifest["dtype"]).itemsize
    for split in SPLITS:
        for shard in manifest["splits"][split]["shards"]:
            expected = shard["tokens"] * itemsize
            found = size_of(shard["file"])
            problem = (
                "is missing" if found is None
                else f"has {found} bytes, not {expected}" if found != expected
                else "does not match its SHA-256"
                if checksum_of and checksum_of(shard["file"]) != shard["sha256"]
                else None
            )  # fmt: skip
            if problem:
                raise ConfigError(
                    f"token shard {where}/{shard['file']} {problem} (recorded in {MANIFEST}): it "
                    "is damaged or from another preparation. Run the prepare command again."
                )


def local_size(folder: Path, name: str) -> int | None:
    path = file_in_folder(folder, name, f"the token shards in {folder}")
    return None if path is None else path.stat().st_size


class TokenWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Item i: tokens [i*block, (i+1)*block] of the split's shards, read as one stream, as input
    and the same shifted by one as target. The maps open on first use, in each worker."""

    def __init__(
        self,
        paths: list[Path],
        counts: list[int],
        dtype: str,
        block_size: int,
        vocab_size: int | None,  # None: the checksum pass checked every id already
    ) -> None:
        self.paths, self.dtype, self.block_size = paths, dtype, block_size
        self.vocab_size = vocab_size
        self.starts = np.cumsum([0, *counts])
        self.maps: list[np.memmap[Any, Any]] | None = None

    def __len__(self) -> int:
        return max(0, (int(self.starts[-1]) - 1) // self.block_size)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "maps": None}  # workers map the files themselves

    def read(self, start: int, stop: int) -> np.ndarray[Any, Any]:
        if self.maps is None:
            self.maps = [np.memmap(p, dtype=self.dtype, mode="r") for p in self.paths]
        pieces = [
            self.maps[shard][offset : offset + count]
            for shard, offset, count in spans(self.starts, start, stop)
        ]
        return np.concatenate(pieces) if len(pieces) > 1 else pieces[0]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.block_size
        tokens = self.read(start, start + self.block_size + 1)
        if self.vocab_size is not None:
            check_token_ids(tokens, self.vocab_size, "of this split")
        window = torch.from_numpy(tokens.astype(np.int64))
        return window[:-1], window[1:]


class TokenShardDataModule(SplitDataModule):
    """Language-model batches from a folder of token shards: a local folder, memory-mapped, or a
    URL, streamed (`streaming`). `vocab_size` is the model's: at least the tokenizer's (a larger
    one pads the embedding to a friendlier size)."""

    def __init__(
        self,
        path: str,
        vocab_size: int,
        block_size: int = 256,
        batch_size: int = 32,
        num_workers: int | str = 0,
        verify_checksums: bool = True,
        read_mb: float = 8.0,
        shuffle_pages: int = 4,
    ) -> None:
        super().__init__(batch_size, num_workers)
        self.save_hyperparameters()
        if not read_mb > 0 or not isinstance(shuffle_pages, int) or shuffle_pages < 1:
            raise ConfigError(
                f"data.read_mb={read_mb!r}, data.shuffle_pages={shuffle_pages!r}: use a "
                "positive size in MB and a whole number of pages, 1 or more."
            )
        self.remote = ShardFolder(path) if is_url(path) else None
        self.folder = Path(path).expanduser()
        if self.remote is None:
            self.manifest = read_manifest(self.folder)
        else:
            text = self.remote.read_text(MANIFEST)
            if text is None:
                raise no_manifest(self.remote.url, "data.path")
            self.manifest = parse_manifest(text, self.remote.file_url(MANIFEST))
        if vocab_size < self.manifest["vocab_size"]:
            raise ConfigError(
                f"data.vocab_size={vocab_size} is smaller than the tokenizer's "
                f"{self.manifest['vocab_size']} ({self.where(MANIFEST)}): set "
                f"data.vocab_size={self.manifest['vocab_size']} or more."
            )
        self.vocab_size = vocab_size
        self.tokenizer: TextTokenizer | None = None
        self.baseline: dict[str, float] = {}

    def where(self, name: str) -> str:
        return self.remote.file_url(name) if self.remote else str(self.folder / name)

    def tokens_per_byte(self, split: str) -> float:
        """Of the split's text: bits per byte = loss in nats x this / ln 2."""
        counts = self.manifest["splits"][split]
        return float(counts["tokens"]) / max(1, int(counts["bytes"]))

    def load_splits(self) -> dict[str, Dataset[Any]]:
        """A URL's shards are checked by size only: their checksums would mean reading them all."""
        if self.remote is None:
            folder, dtype = self.folder, self.manifest["dtype"]
            checksum_of = (
                (lambda name: file_sha256(folder / name, dtype, self.vocab_size))
                if self.hparams["verify_checksums"]
                else None
            )
            check_shards(str(folder), self.manifest, partial(local_size, folder), checksum_of)
        else:
            check_shards(self.remote.url, self.manifest, self.remote.size, None)
        self.load_tokenizer()  # predict and eval need it: a run must not train without it
        block = self.hparams["block_size"]
        splits: dict[str, Dataset[Any]] = {}
        for split in SPLITS:
            shards = self.manifest["splits"][split]["shards"]
            counts = [int(shard["tokens"]) for shard in shards]
            if sum(counts) <= block:
                raise ConfigError(
                    f"the {split} split of {self.hparams['path']} has {sum(counts)} tokens, fewer "
                    f"than one window of block_size={block}: prepare more text or use a smaller "
                    "block_size."
                )
            dtype = self.manifest["dtype"]
            if self.remote is None:
                paths = [self.folder / shard["file"] for shard in shards]
                unchecked = None if self.hparams["verify_checksums"] else self.vocab_size
                splits[split] = TokenWindows(paths, counts, dtype, block, unchecked)
            else:
                urls = [self.remote.file_url(shard["file"]) for shard in shards]
                read_bytes = int(self.hparams["read_mb"] * 2**20)
                pages = self.hparams["shuffle_pages"]
                splits[split] = StreamedWindows(urls, counts, dtype, block, read_bytes, pages)
        self.baseline = {
            "baseline/unigram_bits_per_byte": self.manifest["unigram_bits_per_token"]
            * self.tokens_per_byte("train"),
        }
        return splits

    def sampler(self, split: str) -> Sampler[int] | None:
        dataset = self.splits[split]
        if not isinstance(dataset, StreamedWindows):
            return super().sampler(split)
        world_size, rank = self.ranks()
        streams = max(1, self.num_workers)
        dataset.fit_pages(world_size * streams)
        sampler = PageOrderSampler(
            dataset, world_size, rank, shuffle_seed(), streams, self.batch_size,
            shuffle=split == "train", shuffle_pages=self.hparams["shuffle_pages"],
        )  # fmt: skip
        if len(sampler) < (self.batch_size if split == "train" else 1):
            raise ConfigError(
                f"the {split} split of {self.hparams['path']} gives {len(sampler)} windows of "
                f"block_size={self.hparams['block_size']} to each of {world_size} process(es), "
                f"fewer than one batch of {self.batch_size}: prepare more text, or use a smaller "
                "batch_size or block_size."
            )
        return sampler

    def encode(self, text: str) -> list[int]:
        return self.load_tokenizer().encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.load_tokenizer().decode(ids)

    def load_tokenizer(self) -> TextTokenizer:
        if self.tokenizer is None:
            try:
                where = f"data.path={self.folder}"
                local = None if self.remote else file_in_folder(self.folder, TOKENIZER, where)
                text = (
                    self.remote.read_text(TOKENIZER) if self.remote
                    else read_tokenizer_text(local) if local else None
                )  # fmt: skip
            except (OSError, ValueError) as error:
                reason = getattr(error, "strerror", None) or str(error).splitlines()[0]
                raise ConfigError(
                    f"{self.where(TOKENIZER)} cannot be read ({reason}): prepare the folder again."
                ) from None
            if text is None:
                raise ConfigError(f"{self.where(TOKENIZER)} is missing: prepare the folder again.")
            try:
                self.tokenizer = tokenizer_from_json(text)
            except Exception as error:  # the tokenizers library raises plain Exceptions
                reason = str(error).splitlines()[0] if str(error) else type(error).__name__
                raise ConfigError(
                    f"{self.where(TOKENIZER)} is not a tokenizer ({reason}): prepare the folder "
                    "again."
                ) from None
        return self.tokenizer
