"""The files of a text corpus, torch-free (the prepare command imports no torch): the Python
standard library's source, this project's configs, a file or a folder. Pieces k of a corpus go to
the validation or test split when (k x golden ratio) mod 1 falls in their share."""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

from .errors import ConfigError

GOLDEN_RATIO = 0.6180339887498949


def corpus_files(source: str, setting: str = "data.source") -> list[Path]:
    """`stdlib`, `project_configs` (this project's YAML configs, for the fine-tuning example), a
    file, or a folder (every file under it that is not hidden, in sorted order)."""
    if source == "project_configs":
        return sorted((Path(__file__).parents[1] / "configs").rglob("*.yaml"))
    if source == "stdlib":
        return stdlib_files()
    path = Path(source).expanduser()
    if path.is_file():
        return [path]
    if path.is_dir():
        return files_under(path, source, setting)
    raise ConfigError(
        f"{setting}={source} is neither a file nor a folder. Point it at a text file or a "
        f"folder of text files, or use {setting}=stdlib."
    )


def stdlib_files() -> list[Path]:
    """The standard library's `.py` files, sorted; not those of installed packages, whose
    `site-packages` folders (tens of thousands of files on some machines) are not walked."""
    files: list[Path] = []
    for folder, folders, names in os.walk(sysconfig.get_paths()["stdlib"]):
        folders[:] = [name for name in folders if name != "site-packages"]
        files += [Path(folder) / name for name in names if name.endswith(".py")]
    return sorted(path for path in files if path.is_file())


def unreadable(
    path: Path | str, error: OSError, source: str, setting: str = "data.source"
) -> ConfigError:
    return ConfigError(
        f"{setting}={source}: cannot read {path} ({error.strerror or error}). Make it "
        f"readable, or point {setting} at other text."
    )


def files_under(folder: Path, source: str, setting: str = "data.source") -> list[Path]:
    """Every file under `folder` that is not hidden (nor in a hidden folder such as `.git`),
    sorted; a subfolder that cannot be listed is an error, not silently skipped."""

    def refuse(error: OSError) -> None:
        raise unreadable(error.filename or folder, error, source, setting)

    files = []
    for root, folders, names in os.walk(folder, onerror=refuse):
        folders[:] = [name for name in folders if not name.startswith(".")]
        files += [
            Path(root) / name
            for name in names
            if not name.startswith(".") and (Path(root) / name).is_file()
        ]
    if not files:
        raise ConfigError(
            f"{setting}={source} is a folder with no files in it (hidden files are not read)."
        )
    return sorted(files)
