"""The prepare recipe: a text corpus -> a tokenizer -> memory-mapped token shards.

The corpus is read as documents cut into pieces, each piece assigned to a split
(`corpus_pieces.py`). A BPE tokenizer is trained on the
training split only. Worker processes (`data/tokenizing_worker.py`: fresh interpreters that import
no torch, started while the tokenizer trains) tokenize the pieces in order, each piece followed by
`<|endoftext|>`, into shards of at most `shard_tokens` tokens; every worker has ended, and been
waited for, when the command ends (SIGTERM included). Everything is written to a hidden
folder beside `output` and renamed once complete, with `manifest.json` (settings, counts, SHA-256
of each shard): a killed run leaves no folder that looks prepared, and the same command then
starts over.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ...data.shard_format import MANIFEST, SPLITS, read_manifest
from ...data.tokenizer import BYTES
from ...data.tokenizing import TokenizerWorkerError, TokenizerWorkers
from ...errors import ConfigError, TrainingError
from ...files import absolute
from ...run.settings import check_whole, number, refuse, whole
from ...targets import allow
from .corpus_pieces import NAMED_CORPORA, split_pieces, staging_of
from .shards import build_tokenizer, worker_count, write_shards

log = logging.getLogger(__name__)

SETTINGS = (
    "source", "tokenizer", "vocab_size", "max_bytes", "val_fraction", "test_fraction",
    "shard_tokens",
)  # fmt: skip
VOCAB_RANGE = (257, 2**32)


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
