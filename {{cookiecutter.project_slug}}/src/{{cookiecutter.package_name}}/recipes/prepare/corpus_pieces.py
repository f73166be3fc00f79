"""The corpus (`source`: stdlib, a file, a folder or a glob; never hidden files, folders of token
shards or the output) read as documents (files), each cut at line ends into pieces of at most
65,536 characters; piece k goes to the validation or test split when (k x golden ratio) mod 1
falls in their share, so every split samples the whole corpus."""

from __future__ import annotations

import codecs
import glob
import logging
import os
from collections.abc import Iterator
from pathlib import Path

from ...data.corpus import GOLDEN_RATIO, corpus_files, unreadable
from ...data.shard_format import MANIFEST, SPLITS, parse_manifest
from ...errors import ConfigError

log = logging.getLogger(__name__)

PIECE_CHARACTERS = 64 * 1024
NAMED_CORPORA = ("stdlib", "project_configs")  # the sources corpus_files knows by name


def is_glob(source: str) -> bool:
    return any(character in source for character in "*?[")


def staging_of(output: Path) -> Path:
    return output.with_name(f".{output.name}.tmp-prepare")


def is_prepared(folder: Path) -> bool:
    """Whether `folder` holds token shards that this command wrote."""
    try:
        parse_manifest((folder / MANIFEST).read_bytes(), str(folder / MANIFEST))
    except (OSError, ConfigError):
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
