"""Text tokenized as it loads, by a `tokenizer.json`: a pretrained model's (the GPT-2 BPE of a
Hugging Face folder) or one that the prepare command wrote.

The corpus (`source`, as for the byte-level text module: stdlib, project_configs, a file or a
folder) is read and cut into train, validation and test splits as that module cuts it; each split
is tokenized in memory, in pieces cut at line ends, and read as non-overlapping windows of
`block_size + 1` tokens. For a corpus larger than memory, prepare token shards with the same
tokenizer (`prepare tokenizer=<tokenizer.json>`) and train on those (data=token_shards).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from .base import SplitDataModule, check_fractions, check_whole_numbers
from .errors import ConfigError
from .text import ByteWindows, read_corpus, split_corpus
from .tokenizer import TextTokenizer, tokenizer_file

PIECE_CHARACTERS = 64 * 1024


def read_tokenizer(choice: str) -> TextTokenizer:
    return tokenizer_file(
        "data.tokenizer", choice,
        "give the path of a tokenizer.json, one that the prepare command wrote or a Hugging Face "
        "model's (e.g. hf download openai-community/gpt2 config.json model.safetensors "
        f"tokenizer.json --local-dir {Path(choice).expanduser().parent}).",
    )  # fmt: skip


def pieces(text: str) -> Iterator[str]:
    """`text` in pieces of at most PIECE_CHARACTERS, cut after a line end where there is one."""
    start = 0
    while start < len(text):
        stop = min(len(text), start + PIECE_CHARACTERS)
        if stop < len(text):
            line_end = text.rfind("\n", start, stop)
            stop = line_end + 1 if line_end >= start else stop
        yield text[start:stop]
        start = stop


def unigram_bits(tokens: torch.Tensor, vocab_size: int) -> float:
    """Entropy in bits per token of the best model that ignores context: the token frequencies."""
    counts = torch.bincount(tokens.long(), minlength=vocab_size).double()
    probs = counts[counts > 0] / counts.sum()
    return float(-(probs * probs.log2()).sum())


class TokenizedTextDataModule(SplitDataModule):
    """`vocab_size` is the tokenizer's; the model's may be larger (check_vocabulary)."""

    def __init__(
        self,
        tokenizer: str,
        source: str = "stdlib",
        block_size: int = 128,
        batch_size: int = 16,
        max_bytes: int | None = 4_000_000,
        val_fraction: float = 0.05,
        test_fraction: float = 0.05,
        num_workers: int = 0,
    ) -> None:
        super().__init__(batch_size, num_workers)
        check_fractions(val_fraction, test_fraction)
        check_whole_numbers(block_size=block_size)
        self.save_hyperparameters()
        self.tokenizer = read_tokenizer(str(tokenizer))
        self.vocab_size = self.tokenizer.vocab_size
        self.counts: dict[str, tuple[int, int]] = {}  # each split's tokens and bytes
        self.baseline: dict[str, float] = {}

    def load_tokenizer(self) -> TextTokenizer:
        """Read at construction (predict and serve encode prompts with it; serve stops a
        completion at its end-of-text token)."""
        return self.tokenizer

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def tokens_per_byte(self, split: str) -> float:
        """Of the split's text: bits per byte = loss in nats x this / ln 2."""
        tokens, size = self.counts.get(split, (1, 1))
        return tokens / max(1, size)

    def load_splits(self) -> dict[str, Dataset[Any]]:
        source, block = self.hparams["source"], self.hparams["block_size"]
        data = read_corpus(source, self.hparams["max_bytes"])
        parts = split_corpus(
            data, self.hparams["val_fraction"], self.hparams["test_fraction"], block + 1
        )
        splits: dict[str, Dataset[Any]] = {}
        train = torch.empty(0)
        for name, part in parts.items():
            text = part.numpy().tobytes().decode("utf-8", errors="replace")
            ids = [token for piece in pieces(text) for token in self.tokenizer.encode(piece)]
            if len(ids) <= block:
                raise ConfigError(
                    f"the {name} split of data.source={source} has {len(ids)} tokens, fewer "
                    f"than one window of block_size={block}; use more text or a smaller "
                    "block_size."
                )
            tokens = torch.tensor(ids, dtype=torch.int32)
            self.counts[name] = (len(ids), len(part))
            splits[name] = ByteWindows(tokens, block)
            train = tokens if name == "train" else train
        bits = unigram_bits(train, self.vocab_size) * self.tokens_per_byte("train")
        self.baseline = {"baseline/unigram_bits_per_byte": bits}
        return splits
