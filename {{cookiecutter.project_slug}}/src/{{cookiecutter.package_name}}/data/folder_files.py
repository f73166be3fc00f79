"""The files that a folder's own index names (a manifest's token shards, a Hugging Face folder's
config, weights and shard index) are read only as regular files inside that folder once every
link is resolved: an index cannot make a reader follow a link out of its folder, nor open a
device or a pipe that never ends. A snapshot of the Hugging Face cache
(`.../models--<name>/snapshots/<revision>/`) links each file into its repository's `blobs/`, so
there the folder is the repository's.

A file a user did not write that is read whole is read through `read_bounded`: as a regular
file (a device or a pipe is refused before a byte is read, never waited on), of at most a size
fixed by what the file holds."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from .errors import ConfigError


def home_of(folder: Path) -> Path:
    """The folder whose files `folder`'s may resolve into."""
    resolved = folder.resolve()
    if resolved.parent.name == "snapshots" and (resolved.parent.parent / "blobs").is_dir():
        return resolved.parent.parent
    return resolved


def file_in_folder(folder: Path, name: str, where: str) -> Path | None:
    """`folder/name` resolved, or None where there is no such file; one error line (`where`
    first) where it resolves outside the folder or to something other than a regular file."""
    path = folder / name
    try:
        if not path.exists() and not path.is_symlink():
            return None
        resolved = path.resolve(strict=True)
        mode = resolved.stat().st_mode
    except FileNotFoundError:
        return None  # a dangling link: the file is missing
    except (OSError, RuntimeError, ValueError) as error:  # a loop of links, a NUL byte, ...
        reason = getattr(error, "strerror", None) or str(error) or type(error).__name__
        raise ConfigError(f"{where}: {name} cannot be read ({reason}).") from None
    if not resolved.is_relative_to(home_of(folder)):
        raise ConfigError(
            f"{where}: {name} is a link to a file outside the folder, which is not read: copy "
            "the file into the folder."
        )
    if not stat.S_ISREG(mode):
        raise ConfigError(
            f"{where}: {name} is not a regular file (a folder, a device or a pipe): put the "
            "file itself there."
        )
    return resolved


def read_bounded(
    path: Path,
    most_bytes: int,
    what: str,
    too_large: str = "more than such a file holds",
    follow_links: bool = True,
) -> bytes:
    """The bytes of the regular file `path` (links followed: where a folder's own file must stay
    inside it, `file_in_folder` comes first). One error line, `what` first, where it cannot be
    opened, is a folder, a device or a pipe, or holds more than `most_bytes`."""
    try:
        flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_links else os.O_NOFOLLOW)
        descriptor = os.open(path, flags)
    except (OSError, ValueError) as error:  # ValueError: a NUL byte in the path
        reason = getattr(error, "strerror", None) or str(error)
        raise ConfigError(f"{what} cannot be read ({reason}).") from None
    if not stat.S_ISREG(os.fstat(descriptor).st_mode):  # before fdopen, which refuses a folder
        os.close(descriptor)
        raise not_regular(what)
    with os.fdopen(descriptor, "rb") as file:
        try:
            data = file.read(most_bytes + 1)
        except OSError as error:
            raise ConfigError(f"{what} cannot be read ({error.strerror or error}).") from None
    if len(data) > most_bytes:
        raise ConfigError(f"{what} holds more than {size_text(most_bytes)}: {too_large}.")
    return data


def size_text(size: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if size >= 1 << shift:
            return f"{size / (1 << shift):g} {unit}"
    return f"{size} bytes"


def check_regular(path: Path, what: str) -> None:
    """One error line, `what` first, where `path` (links followed) is not a regular file: for a
    reader that opens the file itself and reads only what it needs of it."""
    try:
        mode = path.stat().st_mode
    except (OSError, ValueError) as error:
        reason = getattr(error, "strerror", None) or str(error)
        raise ConfigError(f"{what} cannot be read ({reason}).") from None
    if not stat.S_ISREG(mode):
        raise not_regular(what)


def not_regular(what: str) -> ConfigError:
    return ConfigError(
        f"{what} is not a regular file (a folder, a device or a pipe): give the file itself."
    )
