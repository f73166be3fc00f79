"""The files that a folder's own index names (a manifest's token shards, a Hugging Face folder's
config, weights and shard index) are read only as regular files inside that folder once every
link is resolved: an index cannot make a reader follow a link out of its folder, nor open a
device or a pipe that never ends. A snapshot of the Hugging Face cache
(`.../models--<name>/snapshots/<revision>/`) links each file into its repository's `blobs/`, so
there the folder is the repository's."""

from __future__ import annotations

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
