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
from .folder_files import file_in_folder, read_bounded

MANIFEST = "manifest.json"
TOKENIZER = "tokenizer.json"
FORMAT = 1
SPLITS = ("train", "val", "test")
# A manifest lists every shard in a line or so: this is a million shards' worth.
MANIFEST_BYTES = 64 * 2**20


def token_dtype(vocab_size: int) -> np.dtype[Any]:
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


def whole(value: Any, low: int, high: float = math.inf) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def read_manifest(folder: Path, setting: str = "data.path") -> dict[str, Any]:
    path = file_in_folder(folder, MANIFEST, f"{setting}={folder}")
    if path is None:
        raise no_manifest(str(folder), setting)
    data = read_bounded(path, MANIFEST_BYTES, str(path), "prepare the folder again")
    return parse_manifest(data, str(path))


def no_manifest(folder: str, setting: str) -> ConfigError:
    return ConfigError(
        f"{setting}={folder} has no {MANIFEST}: it is not a folder of token shards. Write "
        f"one with the prepare command (e.g. source=stdlib) and point {setting} at its output."
    )


def parse_manifest(data: bytes | str, where: str) -> dict[str, Any]:
    """The manifest's checked values; whatever in it fails the checks or the parser (bytes that
    are not UTF-8, nesting too deep, a number too long) is one ConfigError."""
    try:
        if len(data) > MANIFEST_BYTES:
            raise ValueError(f"larger than {MANIFEST_BYTES // 2**20} MiB")
        manifest = json.loads(data)
        if not isinstance(manifest, dict):
            raise ValueError("not a JSON object")
        if manifest.get("format") != FORMAT or set(manifest["splits"]) != set(SPLITS):
            raise ValueError("unknown format")
        if manifest["dtype"] not in ("<u2", "<u4"):
            raise ValueError(f"dtype {manifest['dtype']!r} is not <u2 or <u4")
        if not whole(manifest["vocab_size"], 1, 2**32):
            raise ValueError(
                f"vocab_size {manifest['vocab_size']!r} is not a whole number from 1 to 2**32"
            )
        bits = manifest["unigram_bits_per_token"]
        if not (isinstance(bits, (int, float)) and 0 <= bits < math.inf):
            raise ValueError(f"unigram_bits_per_token {bits!r} is not a number of bits")
        for split in SPLITS:
            counts = manifest["splits"][split]
            if not all(whole(counts[key], 0) for key in ("tokens", "bytes")):
                raise ValueError(f"the {split} split has no whole counts of tokens and bytes")
            for shard in counts["shards"]:
                if Path(shard["file"]).name != shard["file"] or shard["file"] in ("", ".", ".."):
                    raise ValueError(f"shard {shard['file']!r} is not a file in the folder")
                if not whole(shard["tokens"], 0) or not isinstance(shard["sha256"], str):
                    raise ValueError(f"shard {shard['file']!r} has no count of tokens and SHA-256")
    except Exception as error:  # the boundary of this door: every parser's failure is this line
        reason = (str(error).splitlines() or [type(error).__name__])[0][:200]
        raise ConfigError(
            f"{where} is not a manifest of this project's token shards ({reason}): write the "
            "folder again with the prepare command."
        ) from None
    return dict(manifest)


def unigram_bits(counts: np.ndarray[Any, Any]) -> float:
    """Cross-entropy in bits per token of the token frequencies (the best context-free model)."""
    probs = counts[counts > 0] / counts.sum()
    return float(-(probs * np.log2(probs)).sum()) if len(probs) else math.nan
