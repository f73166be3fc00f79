"""Pre-tokenized text in memory-mapped shards (`<package>-prepare` writes them).

A folder holds `manifest.json`, the tokenizer (`tokenizer.json`) and per split one or more shard
files of raw little-endian token ids (uint16 when the vocabulary fits, else uint32). Each split
is read as non-overlapping windows of `block_size + 1` tokens straight from the memory maps,
which the operating system pages in on demand: nothing is loaded whole, in any process.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from ..errors import ConfigError
from .base import SplitDataModule
from .tokenizer import TextTokenizer, load_tokenizer

MANIFEST = "manifest.json"
TOKENIZER = "tokenizer.json"
FORMAT = 1
SPLITS = ("train", "val", "test")


def token_dtype(vocab_size: int) -> np.dtype[Any]:
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def read_manifest(folder: Path, setting: str = "data.path") -> dict[str, Any]:
    path = folder / MANIFEST
    if not path.is_file():
        raise ConfigError(
            f"{setting}={folder} has no {MANIFEST}: it is not a folder of token shards. Write "
            "one with the prepare command (e.g. <package>-prepare source=stdlib), or point "
            f"{setting} at its output."
        )
    try:
        manifest = json.loads(path.read_text())
        if manifest.get("format") != FORMAT or set(manifest["splits"]) != set(SPLITS):
            raise ValueError("unknown format")
        for split in SPLITS:
            for shard in manifest["splits"][split]["shards"]:
                if Path(shard["file"]).name != shard["file"] or shard["file"] in ("", ".", ".."):
                    raise ValueError(f"shard {shard['file']!r} is not a file in the folder")
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise ConfigError(
            f"{path} is not a manifest of this project's token shards ({error}): write the "
            "folder again with the prepare command."
        ) from error
    return dict(manifest)


def check_shards(folder: Path, manifest: dict[str, Any], checksums: bool) -> None:
    """Every shard present with its recorded size (and SHA-256, when `checksums`)."""
    itemsize = np.dtype(manifest["dtype"]).itemsize
    for split in SPLITS:
        for shard in manifest["splits"][split]["shards"]:
            path = folder / shard["file"]
            expected = shard["tokens"] * itemsize
            found = path.stat().st_size if path.is_file() else None
            problem = (
                "is missing" if found is None
                else f"has {found} bytes, not {expected}" if found != expected
                else "does not match its SHA-256" if checksums and file_sha256(path) != shard["sha256"]
                else None
            )  # fmt: skip
            if problem:
                raise ConfigError(
                    f"token shard {path} {problem} (recorded in {MANIFEST}): it is damaged or "
                    "from another preparation. Run the prepare command again."
                )


class TokenWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Item i: tokens [i*block, (i+1)*block] of the split's shards, read as one stream, as input
    and the same shifted by one as target. The maps open on first use, in each worker."""

    def __init__(self, paths: list[Path], counts: list[int], dtype: str, block_size: int) -> None:
        self.paths, self.dtype, self.block_size = paths, dtype, block_size
        self.starts = np.cumsum([0, *counts])
        self.maps: list[np.memmap[Any, Any]] | None = None

    def __len__(self) -> int:
        return max(0, (int(self.starts[-1]) - 1) // self.block_size)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "maps": None}  # workers map the files themselves

    def read(self, start: int, stop: int) -> np.ndarray[Any, Any]:
        if self.maps is None:
            self.maps = [np.memmap(p, dtype=self.dtype, mode="r") for p in self.paths]
        pieces = []
        shard = int(np.searchsorted(self.starts, start, side="right")) - 1
        while start < stop:
            offset = start - int(self.starts[shard])
            end = min(stop, int(self.starts[shard + 1]))
            pieces.append(self.maps[shard][offset : offset + end - start])
            start, shard = end, shard + 1
        return np.concatenate(pieces) if len(pieces) > 1 else pieces[0]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.block_size
        window = torch.from_numpy(self.read(start, start + self.block_size + 1).astype(np.int64))
        return window[:-1], window[1:]


class TokenShardDataModule(SplitDataModule):
    """Language-model batches from a folder of token shards. `vocab_size` is the model's: at
    least the tokenizer's (a larger one pads the embedding to a friendlier size)."""

    def __init__(
        self,
        path: str,
        vocab_size: int,
        block_size: int = 256,
        batch_size: int = 32,
        num_workers: int = 0,
        verify_checksums: bool = True,
    ) -> None:
        super().__init__(batch_size, num_workers)
        self.save_hyperparameters()
        self.folder = Path(path).expanduser()
        self.manifest = read_manifest(self.folder)
        if vocab_size < self.manifest["vocab_size"]:
            raise ConfigError(
                f"data.vocab_size={vocab_size} is smaller than the tokenizer's "
                f"{self.manifest['vocab_size']} ({self.folder / MANIFEST}): set "
                f"data.vocab_size={self.manifest['vocab_size']} or more."
            )
        self.vocab_size = vocab_size
        self.tokenizer: TextTokenizer | None = None
        self.baseline: dict[str, float] = {}

    def tokens_per_byte(self, split: str) -> float:
        """Of the split's text: bits per byte = loss in nats x this / ln 2."""
        counts = self.manifest["splits"][split]
        return float(counts["tokens"]) / max(1, int(counts["bytes"]))

    def load_splits(self) -> dict[str, Dataset[Any]]:
        check_shards(self.folder, self.manifest, self.hparams["verify_checksums"])
        block = self.hparams["block_size"]
        splits: dict[str, Dataset[Any]] = {}
        for split in SPLITS:
            shards = self.manifest["splits"][split]["shards"]
            counts = [int(shard["tokens"]) for shard in shards]
            if sum(counts) <= block:
                raise ConfigError(
                    f"the {split} split of {self.folder} has {sum(counts)} tokens, fewer than one "
                    f"window of block_size={block}: prepare more text or use a smaller block_size."
                )
            paths = [self.folder / shard["file"] for shard in shards]
            splits[split] = TokenWindows(paths, counts, self.manifest["dtype"], block)
        self.baseline = {
            "baseline/unigram_bits_per_byte": self.manifest["unigram_bits_per_token"]
            * self.tokens_per_byte("train"),
        }
        return splits

    def encode(self, text: str) -> list[int]:
        return self.load_tokenizer().encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.load_tokenizer().decode(ids)

    def load_tokenizer(self) -> TextTokenizer:
        if self.tokenizer is None:
            self.tokenizer = load_tokenizer(self.folder / TOKENIZER)
        return self.tokenizer


def unigram_bits(counts: np.ndarray[Any, Any]) -> float:
    """Cross-entropy in bits per token of the token frequencies (the best context-free model)."""
    probs = counts[counts > 0] / counts.sum()
    return float(-(probs * np.log2(probs)).sum()) if len(probs) else math.nan
