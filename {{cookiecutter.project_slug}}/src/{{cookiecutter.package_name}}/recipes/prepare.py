"""The prepare recipe: a text corpus -> a tokenizer -> memory-mapped token shards.

The corpus (`source`: stdlib, a file, a folder or a glob; never hidden files, folders of token
shards or the output) is read as documents (files), each cut at line ends into pieces of at most
65,536 characters; piece k goes to the validation or test split when (k x golden ratio) mod 1
falls in their share, so every split samples the whole corpus. A BPE tokenizer is trained on the
training split only. Worker processes (`data/tokenizing_worker.py`: fresh interpreters that import
no torch, started while the tokenizer trains) tokenize the pieces in order, each piece followed by
`<|endoftext|>`, into shards of at most `shard_tokens` tokens; every worker has ended, and been
waited for, when the command ends (SIGTERM included). Everything is written to a hidden
folder beside `output` and renamed once complete, with `manifest.json` (settings, counts, SHA-256
of each shard): a killed run leaves no folder that looks prepared, and the same command then
starts over.
"""

from __future__ import annotations

import codecs
import glob
import hashlib
import json
import logging
import os
import shutil
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from ..data.corpus import GOLDEN_RATIO, corpus_files, unreadable
from ..data.shard_format import (
    FORMAT,
    MANIFEST,
    SPLITS,
    TOKENIZER,
    parse_manifest,
    read_manifest,
    token_dtype,
    unigram_bits,
)
from ..data.tokenizer import BYTES, BPETokenizer, ByteTokenizer, TextTokenizer, load_tokenizer
from ..data.tokenizing import (
    FIRST_TOKENS,
    TokenizerWorkerError,
    TokenizerWorkers,
    seconds_since_start,
)
from ..errors import ConfigError, TrainingError
from ..files import absolute
from ..run.settings import check_whole, number, refuse, whole
from ..run.stop_signals import STOPPED_BY_SIGNAL_EXIT_CODE
from ..targets import allow

log = logging.getLogger(__name__)

PIECE_CHARACTERS = 64 * 1024
BATCH_CHARACTERS = 128 * 1024  # a worker's unit of work: small, so that all finish together
SETTINGS = (
    "source", "tokenizer", "vocab_size", "max_bytes", "val_fraction", "test_fraction",
    "shard_tokens",
)  # fmt: skip
NAMED_CORPORA = ("stdlib", "project_configs")  # the sources corpus_files knows by name
VOCAB_RANGE = (257, 2**32)


def is_glob(source: str) -> bool:
    return any(character in source for character in "*?[")


def checked_settings(cfg: DictConfig) -> dict[str, Any]:
    """The settings that make an output the same, each checked and with paths made absolute, so
    that `./corpus` and `corpus` are one source."""
    resolved = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(resolved, dict)
    settings = {key: resolved[key] for key in SETTINGS}
    source = settings["source"]
    if source is None or not str(source).strip():
        raise ConfigError(
            "source is not set: use source=stdlib, a text file, a folder of text files or a glob."
        )
    if str(source) not in NAMED_CORPORA:
        settings["source"] = str(absolute(str(source)))
    if str(settings["tokenizer"]) not in ("bpe", BYTES):
        tokenizer = Path(str(settings["tokenizer"])).expanduser()
        if not tokenizer.is_file():
            raise ConfigError(
                f"tokenizer={settings['tokenizer']}: use bpe, bytes, or the path of a "
                "tokenizer.json that this command wrote."
            )
        settings["tokenizer"] = str(absolute(tokenizer))
    vocab_size = settings["vocab_size"]
    if not whole(vocab_size) or not VOCAB_RANGE[0] <= vocab_size <= VOCAB_RANGE[1]:
        raise refuse("vocab_size", vocab_size, "use a whole number from 257 to 4294967296")
    check_whole("max_bytes", settings["max_bytes"], 1)
    check_whole("shard_tokens", settings["shard_tokens"], 1, allowed=())
    for key in ("val_fraction", "test_fraction"):
        share = settings[key]
        if not number(share) or not 0 < share < 1:
            rule = f"use a number above 0 and below 1 (the {key[:-9]} split's share of the text)"
            raise refuse(key, share, rule)
    if settings["val_fraction"] + settings["test_fraction"] >= 1:
        raise ConfigError(
            f"val_fraction={settings['val_fraction']} and test_fraction="
            f"{settings['test_fraction']} leave nothing to train on: keep their sum below 1."
        )
    return settings


def defining(settings: dict[str, Any]) -> dict[str, Any]:
    """The settings that decide the shards: `vocab_size` only where a BPE tokenizer is trained."""
    if settings.get("tokenizer") == "bpe":
        return settings
    return {key: value for key, value in settings.items() if key != "vocab_size"}


def checked_output(cfg: DictConfig) -> Path:
    if cfg.output is None or not str(cfg.output).strip():
        raise ConfigError("output is not set: use output=<the folder to write>.")
    return absolute(str(cfg.output))


def staging_of(output: Path) -> Path:
    return output.with_name(f".{output.name}.tmp-prepare")


def is_prepared(folder: Path) -> bool:
    """Whether `folder` holds token shards that this command wrote."""
    try:
        parse_manifest((folder / MANIFEST).read_text(), str(folder / MANIFEST))
    except (OSError, UnicodeDecodeError, ConfigError):
        return False
    return True


def folder_files(folder: Path, source: str, skipped: set[Path]) -> list[Path]:
    """Every file under `folder`, sorted, except hidden ones (a killed run's staging folder among
    them), those under `skipped` and folders of token shards. A subfolder that cannot be listed
    is an error, not silently skipped."""

    def refuse_unlisted(error: OSError) -> None:
        raise unreadable(error.filename or folder, error, source, "source")

    files: list[Path] = []
    for root, folders, names in os.walk(folder, onerror=refuse_unlisted):
        here = Path(root)
        folders[:] = [
            name
            for name in folders
            if not name.startswith(".")
            and (here / name).resolve() not in skipped
            and not is_prepared(here / name)
        ]
        files += [here / n for n in names if not n.startswith(".") and (here / n).is_file()]
    if not files:
        raise ConfigError(
            f"source={source} is a folder with no files in it (hidden files and folders of "
            "token shards are not read)."
        )
    return sorted(files)


def source_files(source: str, output: Path | None = None) -> list[Path]:
    """The corpus's files; never those of `output`, its staging folder or other token shards."""
    skipped = {output, staging_of(output)} if output else set()
    if is_glob(source):
        found = sorted(Path(p) for p in glob.glob(os.path.expanduser(source), recursive=True))
        prepared = {folder for folder in {path.parent for path in found} if is_prepared(folder)}
        files = [
            path
            for path in found
            if path.is_file()
            and path.parent not in prepared
            and not skipped & set(path.resolve().parents)
        ]
        if not files:
            raise ConfigError(f"source={source} matches no files.")
        return files
    if source not in NAMED_CORPORA and Path(source).is_dir():
        if is_prepared(Path(source)):
            raise ConfigError(
                f"source={source} is a folder of token shards (this command's output), not text: "
                "point source at the text they were prepared from, or train on them with "
                f"data.path={source}."
            )
        return folder_files(Path(source), source, skipped)
    return corpus_files(source, "source")


def cut(text: str) -> Iterator[str]:
    """`text` in pieces of at most PIECE_CHARACTERS, ending at line ends where there are any."""
    while len(text) > PIECE_CHARACTERS:
        end = text.rfind("\n", 0, PIECE_CHARACTERS) + 1 or PIECE_CHARACTERS
        yield text[:end]
        text = text[end:]
    if text:
        yield text


def read_text(path: Path, limit: int | None, source: str) -> str | None:
    """The file as text, or as much as its first `limit` bytes hold; None where it is not UTF-8."""
    try:
        with path.open("rb") as file:
            data = file.read() if limit is None else file.read(limit)
            complete = limit is None or not file.read(1)
    except OSError as error:
        raise unreadable(path, error, source, "source") from error
    try:  # a cut may end inside a character: the incremental decoder leaves it out
        return codecs.getincrementaldecoder("utf-8")().decode(data, final=complete)
    except UnicodeDecodeError:
        return None


def split_pieces(
    source: str, max_bytes: int | None, val_fraction: float, test_fraction: float,
    output: Path | None = None,
) -> dict[str, list[str]]:  # fmt: skip
    """The pieces of each split, until `max_bytes` of text. A file that is not UTF-8 (a binary,
    Latin-1) is left out with a warning, or refused where it is the whole source."""
    pieces: dict[str, list[str]] = {split: [] for split in SPLITS}
    total, index = 0, 0
    files, skipped = source_files(source, output), []
    for path in files:
        if max_bytes is not None and total >= max_bytes:
            break
        # Read past the limit by one piece at most (4 bytes a character), so that the last piece
        # ends where it would in the whole file.
        limit = None if max_bytes is None else max_bytes - total + 4 * PIECE_CHARACTERS + 4
        text = read_text(path, limit, source)
        if text is None:
            if len(files) == 1:
                raise ConfigError(
                    f"source={source} is not UTF-8 text: convert it (e.g. iconv -f latin1 -t "
                    "utf-8), or point source at text files."
                )
            skipped.append(path)
            continue
        for piece in cut(text):
            if max_bytes is not None and total >= max_bytes:
                break
            position = (index * GOLDEN_RATIO) % 1.0
            split = (
                "val" if position < val_fraction
                else "test" if position < val_fraction + test_fraction
                else "train"
            )  # fmt: skip
            pieces[split].append(piece)
            total += len(piece.encode("utf-8"))
            index += 1
    if skipped:
        log.warning(
            "Left out %d file(s) of source=%s that are not UTF-8 text, e.g. %s",
            len(skipped), source, skipped[0],
        )  # fmt: skip
    if not any(piece.strip() for piece in pieces["train"]):
        not_text = (
            f" ({len(skipped)} files are not UTF-8 text, e.g. {skipped[0]})" if skipped else ""
        )
        raise ConfigError(f"source={source} holds no text to train on{not_text}.")
    for split in ("val", "test"):
        if not pieces[split]:
            raise ConfigError(
                f"source={source} has too little text for a {split} split ({index} pieces of up "
                f"to {PIECE_CHARACTERS:,} characters): add text or raise {split}_fraction."
            )
    return pieces


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


def prepare(cfg: DictConfig) -> dict[str, Any]:
    allow(cfg)
    settings = checked_settings(cfg)
    output = checked_output(cfg)
    check_whole("workers", cfg.workers, 1)
    if (output / MANIFEST).is_file():
        existing = read_manifest(output, "output")
        recorded = existing.get("settings") or {}
        if defining(recorded) != defining(settings):
            changed = sorted(k for k in defining(settings) if recorded.get(k) != settings[k])
            raise ConfigError(
                f"output={output} holds token shards of other settings ({', '.join(changed)} "
                "differ): pick another output=..., or delete that folder to prepare it again."
            )
        log.info("%s is already prepared with these settings: nothing to do.", output)
        return existing
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise ConfigError(
            f"output={output} exists and is not a folder of token shards: pick another output=..."
        )
    above = next(folder for folder in output.parents if folder.exists())
    if not above.is_dir():
        raise ConfigError(f"output={output} is inside {above}, a file: pick another output=...")
    # The workers start while the corpus is read and the tokenizer trains. Until they tokenize,
    # SIGTERM keeps its default action (the kernel then ends them with the command): a Python
    # handler would wait for the training, which holds the interpreter for as long as it runs.
    with TokenizerWorkers(worker_count(cfg.workers, settings["max_bytes"])) as workers:
        pieces = split_pieces(
            settings["source"], settings["max_bytes"], settings["val_fraction"],
            settings["test_fraction"], output,
        )  # fmt: skip
        tokenizer = build_tokenizer(settings, pieces["train"])
        staging = staging_of(output)
        shutil.rmtree(staging, ignore_errors=True)
        try:
            staging.mkdir(parents=True)
        except OSError as error:
            raise ConfigError(
                f"output={output} cannot be made ({error.strerror or error}): pick another "
                "output=..."
            ) from None
        try:
            manifest = write_shards(tokenizer, pieces, settings, staging, workers)
        except BaseException as error:
            shutil.rmtree(staging, ignore_errors=True)
            if isinstance(error, TokenizerWorkerError):
                raise TrainingError(str(error)) from error
            raise
    output.parent.mkdir(parents=True, exist_ok=True)
    if output.exists():
        output.rmdir()  # empty, checked above
    staging.replace(output)
    for split in SPLITS:
        counts = manifest["splits"][split]
        log.info(
            "%s: %d pieces, %d bytes -> %d tokens (%.2f bytes a token) in %d shards",
            split, counts["pieces"], counts["bytes"], counts["tokens"],
            counts["bytes"] / max(1, counts["tokens"]), len(counts["shards"]),
        )  # fmt: skip
    log.info("Wrote %s", output)
    return manifest


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


if __name__ == "__main__":  # `python -m <package>.recipes.prepare` runs `<package>-prepare`
    from .. import cli

    cli.prepare()
