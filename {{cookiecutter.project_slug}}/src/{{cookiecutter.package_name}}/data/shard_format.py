"""The format of a folder of token shards, torch-free: its file names, the manifest's checks, the
token dtype and the unigram baseline. The prepare command, which imports no torch, writes it;
`token_shards` reads it."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from .errors import ConfigError

MANIFEST = "manifest.json"
TOKENIZER = "tokenizer.json"
FORMAT = 1
SPLITS = ("train", "val", "test")


def token_dtype(vocab_size: int) -> np.dtype[Any]:
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


def whole(value: Any, low: int, high: float = math.inf) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def read_manifest(folder: Path, setting: str = "data.path") -> dict[str, Any]:
    path = folder / MANIFEST
    if not path.is_file():
        raise no_manifest(str(folder), setting)
    return parse_manifest(path.read_text(), str(path))


def no_manifest(folder: str, setting: str) -> ConfigError:
    return ConfigError(
        f"{setting}={folder} has no {MANIFEST}: it is not a folder of token shards. Write "
        f"one with the prepare command (e.g. source=stdlib) and point {setting} at its output."
    )


def parse_manifest(text: str, where: str) -> dict[str, Any]:
    try:
        manifest = json.loads(text)
        if manifest.get("format") != FORMAT or set(manifest["splits"]) != set(SPLITS):
            raise ValueError("unknown format")
        if manifest["dtype"] not in ("<u2", "<u4"):
            raise ValueError(f"dtype {manifest['dtype']!r} is not <u2 or <u4")
        if not whole(manifest["vocab_size"], 1, 2**32):
            raise ValueError(
                f"vocab_size {manifest['vocab_size']!r} is not a whole number from 1 to 2**32"
            )
        for split in SPLITS:
            for shard in manifest["splits"][split]["shards"]:
                if Path(shard["file"]).name != shard["file"] or shard["file"] in ("", ".", ".."):
                    raise ValueError(f"shard {shard['file']!r} is not a file in the folder")
                if not whole(shard["tokens"], 0) or not isinstance(shard["sha256"], str):
                    raise ValueError(f"shard {shard['file']!r} has no count of tokens and SHA-256")
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise ConfigError(
            f"{where} is not a manifest of this project's token shards ({error}): write the "
            "folder again with the prepare command."
        ) from error
    return dict(manifest)


def unigram_bits(counts: np.ndarray[Any, Any]) -> float:
    """Cross-entropy in bits per token of the token frequencies (the best context-free model)."""
    probs = counts[counts > 0] / counts.sum()
    return float(-(probs * np.log2(probs)).sum()) if len(probs) else math.nan
