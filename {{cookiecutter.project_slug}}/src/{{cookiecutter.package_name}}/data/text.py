"""Byte-level language-model data: any text file or folder, by default the Python standard
library's own source, which every Python installation ships, so it trains offline.

The corpus is cut into about a hundred chunks (64 KiB at most); a fixed, evenly spread choice of
chunks forms the validation and test splits, so every split samples the whole corpus. Each split
is read as non-overlapping windows of `block_size + 1` bytes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import Dataset

from .base import SplitDataModule, check_fractions, check_whole_numbers
from .corpus import GOLDEN_RATIO, corpus_files, unreadable
from .errors import ConfigError

VOCAB_SIZE = 256
MAX_CHUNK_BYTES = 64 * 1024


class ByteWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Item i: bytes [i*block, (i+1)*block) as input and the same shifted by one as target."""

    def __init__(self, data: torch.Tensor, block_size: int) -> None:
        self.data = data
        self.block_size = block_size

    def __len__(self) -> int:
        return max(0, (len(self.data) - 1) // self.block_size)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.block_size
        window = self.data[start : start + self.block_size + 1].long()
        return window[:-1], window[1:]


def read_corpus(source: str, max_bytes: int | None) -> torch.Tensor:
    chunks: list[bytes] = []
    total = 0
    for path in corpus_files(source):
        try:
            with path.open("rb") as file:  # never more than the limit, of a file however large
                chunk = file.read() if max_bytes is None else file.read(max_bytes - total)
        except OSError as error:
            raise unreadable(path, error, source) from error
        chunks.append(chunk)
        total += len(chunk)
        if max_bytes is not None and total >= max_bytes:
            break
    corpus = b"".join(chunks)
    if not corpus:
        raise ConfigError(f"data.source={source} holds no bytes to train on.")
    return torch.frombuffer(bytearray(corpus), dtype=torch.uint8)


def split_corpus(
    data: torch.Tensor, val_fraction: float, test_fraction: float, min_chunk: int
) -> dict[str, torch.Tensor]:
    """Chunk k goes to val or test when (k * golden ratio) mod 1 falls in their share of [0, 1)."""
    chunk = max(min_chunk, min(MAX_CHUNK_BYTES, len(data) // 100))
    parts: dict[str, list[torch.Tensor]] = {"train": [], "val": [], "test": []}
    for index, piece in enumerate(data.split(chunk)):
        position = (index * GOLDEN_RATIO) % 1.0
        if position < val_fraction:
            parts["val"].append(piece)
        elif position < val_fraction + test_fraction:
            parts["test"].append(piece)
        else:
            parts["train"].append(piece)
    return {name: torch.cat(pieces) if pieces else data[:0] for name, pieces in parts.items()}


def unigram_loss(data: torch.Tensor) -> float:
    """Cross-entropy in nats of the best model that ignores context: the byte frequencies."""
    counts = torch.bincount(data.long(), minlength=VOCAB_SIZE).double()
    probs = counts[counts > 0] / counts.sum()
    return float(-(probs * probs.log()).sum())


class ByteTextDataModule(SplitDataModule):
    vocab_size = VOCAB_SIZE

    def __init__(
        self,
        source: str = "stdlib",
        block_size: int = 256,
        batch_size: int = 32,
        max_bytes: int | None = None,
        val_fraction: float = 0.05,
        test_fraction: float = 0.05,
        num_workers: int = 0,
    ) -> None:
        super().__init__(batch_size, num_workers)
        check_fractions(val_fraction, test_fraction)
        check_whole_numbers(block_size=block_size)
        self.save_hyperparameters()
        self.baseline: dict[str, float] = {}

    def load_splits(self) -> dict[str, Dataset[Any]]:
        data = read_corpus(self.hparams["source"], self.hparams["max_bytes"])
        block = self.hparams["block_size"]
        parts = split_corpus(
            data, self.hparams["val_fraction"], self.hparams["test_fraction"], block + 1
        )
        for name, part in parts.items():
            if len(part) <= block:
                raise ConfigError(
                    f"the {name} split of data.source={self.hparams['source']} has {len(part)} "
                    f"bytes, fewer than one window of block_size={block}; use more text or a "
                    "smaller block_size."
                )
        self.baseline = {"baseline/unigram_loss": unigram_loss(parts["train"])}
        return {name: ByteWindows(part, block) for name, part in parts.items()}
