"""Token shards: worker processes (`data/tokenizing_worker.py`: fresh interpreters that import no
torch) tokenize the pieces in order, each piece followed by `<|endoftext|>`, into shards of at most
`shard_tokens` tokens, written with `manifest.json` (settings, counts, SHA-256 of each shard)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
from tqdm import tqdm

from ...data.shard_format import FORMAT, MANIFEST, SPLITS, TOKENIZER, token_dtype, unigram_bits
from ...data.tokenizer import BYTES, BPETokenizer, ByteTokenizer, TextTokenizer, load_tokenizer
from ...data.tokenizing import FIRST_TOKENS, TokenizerWorkers, seconds_since_start
from ...errors import ConfigError
from ...run.stop_signals import STOPPED_BY_SIGNAL_EXIT_CODE

log = logging.getLogger(__name__)

BATCH_CHARACTERS = 128 * 1024  # a worker's unit of work: small, so that all finish together


def build_tokenizer(settings: dict[str, Any], train_pieces: list[str]) -> TextTokenizer:
    choice, vocab_size = settings["tokenizer"], settings["vocab_size"]
    if choice == BYTES:
        return ByteTokenizer()
    if choice == "bpe":
        log.info("Training a BPE tokenizer of %d tokens on the training split", vocab_size)
        return BPETokenizer.train(train_pieces, vocab_size)
    try:
        return load_tokenizer(Path(choice))
    except Exception as error:
        raise ConfigError(
            f"tokenizer={choice} is not a readable tokenizer.json ({error})."
        ) from error


class ShardWriter:
    """Appends tokens to `<split>-<n>.bin`, starting a new file every `shard_tokens`."""

    def __init__(self, folder: Path, split: str, dtype: np.dtype[Any], shard_tokens: int) -> None:
        self.folder, self.split, self.dtype, self.limit = folder, split, dtype, shard_tokens
        self.shards: list[dict[str, Any]] = []
        self.file: Any = None
        self.digest: Any = None

    def open_next(self) -> None:
        self.close()
        name = f"{self.split}-{len(self.shards):05d}.bin"
        self.file, self.digest = open(self.folder / name, "wb"), hashlib.sha256()  # noqa: SIM115
        self.shards.append({"file": name, "tokens": 0, "sha256": ""})

    def write(self, tokens: np.ndarray[Any, Any]) -> None:
        data = tokens.astype(self.dtype, copy=False)
        while len(data):
            if self.file is None or self.shards[-1]["tokens"] >= self.limit:
                self.open_next()
            room = self.limit - self.shards[-1]["tokens"]
            raw = data[:room].tobytes()
            self.file.write(raw)
            self.digest.update(raw)
            self.shards[-1]["tokens"] += len(data[:room])
            data = data[room:]

    def close(self) -> None:
        if self.file is not None:
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()
            self.shards[-1]["sha256"] = self.digest.hexdigest()
            self.file = None


def batches(pieces: list[str]) -> list[list[str]]:
    """Runs of consecutive pieces of BATCH_CHARACTERS or more (the last may be shorter)."""
    runs: list[list[str]] = [[]]
    size = 0
    for piece in pieces:
        if size >= BATCH_CHARACTERS:
            runs.append([])
            size = 0
        runs[-1].append(piece)
        size += len(piece)
    return runs if runs[0] else []


def tokenize_split(
    pieces: list[str], split: str, folder: Path, manifest: dict[str, Any], shard_tokens: int,
    answers: Iterator[np.ndarray[Any, Any]],
) -> np.ndarray[Any, Any]:  # fmt: skip
    """Writes the split's shards from the workers' answers to its batches; returns its token
    counts by id."""
    vocab = manifest["vocab_size"]
    writer = ShardWriter(folder, split, np.dtype(manifest["dtype"]), shard_tokens)
    counts = np.zeros(vocab, dtype=np.int64)
    progress = tqdm(total=len(pieces), desc=f"Tokenizing {split}", unit="piece", leave=False)
    for batch in batches(pieces):
        tokens = next(answers)
        writer.write(tokens)
        counts += np.bincount(tokens, minlength=vocab)[:vocab]
        progress.update(len(batch))
    progress.close()
    writer.close()
    manifest["splits"][split] = {
        "shards": writer.shards,
        "tokens": sum(shard["tokens"] for shard in writer.shards),
        "bytes": sum(len(piece.encode("utf-8")) for piece in pieces),
        "pieces": len(pieces),
    }
    return counts


def worker_count(workers: int | None, max_bytes: int | None) -> int:
    """`workers`, or one per core this process may run on; never more than `max_bytes` of text
    makes batches (each split's last batch may be short)."""
    if workers is None:
        affinity = getattr(os, "sched_getaffinity", None)
        workers = len(affinity(0)) if affinity else os.cpu_count() or 1
    if max_bytes is not None:
        workers = min(workers, max_bytes // BATCH_CHARACTERS + 1 + len(SPLITS))
    return max(1, workers)


class Stopped(SystemExit):
    """SIGTERM while the workers tokenize: the command ends with exit code 143 once the staging
    folder is removed and every worker has ended."""


def stop(number: int, frame: FrameType | None) -> None:
    log.warning("Stopped by %s: nothing written.", signal.Signals(number).name)
    raise Stopped(STOPPED_BY_SIGNAL_EXIT_CODE)


def write_shards(
    tokenizer: TextTokenizer, pieces: dict[str, list[str]], settings: dict[str, Any],
    staging: Path, workers: TokenizerWorkers,
) -> dict[str, Any]:  # fmt: skip
    """The tokenizer, the shards of every split and their manifest, written into `staging`."""
    tokenizer.save(staging / TOKENIZER)
    dtype = token_dtype(tokenizer.vocab_size)
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "settings": settings,
        "tokenizer": TOKENIZER,
        "vocab_size": tokenizer.vocab_size,
        "end_of_text": tokenizer.end_of_text,
        "dtype": dtype.str,
        "splits": {},
    }
    workers.load(staging / TOKENIZER, dtype)
    answers = first_logged(
        workers.tokenize([batch for split in SPLITS for batch in batches(pieces[split])])
    )
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, stop) if in_main_thread else None
    try:
        counts = {
            split: tokenize_split(
                pieces[split], split, staging, manifest, settings["shard_tokens"], answers
            )
            for split in SPLITS
        }
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
    manifest["unigram_bits_per_token"] = unigram_bits(counts["train"].astype(np.float64))
    (staging / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def first_logged(answers: Iterator[np.ndarray[Any, Any]]) -> Iterator[np.ndarray[Any, Any]]:
    """`answers`, logging when the first came back (the first-batch latency)."""
    for index, tokens in enumerate(answers):
        if index == 0 and (age := seconds_since_start()) is not None:
            log.info(FIRST_TOKENS, age)
        yield tokens
