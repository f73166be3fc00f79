"""Image files (PNG, JPEG, BMP, GIF, WebP, TIFF) as the uint8 tensors the vision data modules
train on: one channel, resized to the data set's image size."""

from __future__ import annotations

from pathlib import Path
from typing import IO

import torch
from PIL import Image

from .errors import ConfigError
from .folder_files import check_regular

SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")
# The only formats Pillow may try: no PostScript (EPS runs Ghostscript where it is installed), nor
# any other plugin that a file's first bytes could pick.
IMAGE_FORMATS = ("PNG", "JPEG", "BMP", "GIF", "WEBP", "TIFF")


def open_image(file: str | Path | IO[bytes]) -> Image.Image:
    """Pillow's lazy image of `file`, tried only as one of IMAGE_FORMATS; a path only where it is
    a regular file (a pipe or a device is refused, never waited on)."""
    if isinstance(file, (str, Path)):
        check_regular(Path(file), "the file")
    return Image.open(file, formats=IMAGE_FORMATS)


def image_paths(inputs: list[str]) -> list[Path]:
    """Files as given; folders as every image file under them, in sorted order."""
    paths: list[Path] = []
    for given in inputs:
        if not given.strip():
            raise ConfigError("inputs holds an empty name: pass image files or a folder.")
        path = Path(given).expanduser()
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.suffix.lower() in SUFFIXES)
            if not found:
                raise ConfigError(
                    f"inputs={given} is a folder with no image files ({', '.join(SUFFIXES)})."
                )
            paths += found
        elif path.is_file():
            paths.append(path)
        elif path.exists():
            raise ConfigError(
                f"inputs={given} is not a regular file: pass image files or a folder."
            )
        else:
            raise ConfigError(f"inputs={given} does not exist: pass image files or a folder.")
    return paths


def read_gray_images(paths: list[Path], height: int, width: int) -> torch.Tensor:
    """(N, 1, height, width) uint8: grayscale, resized with antialiasing."""
    images = []
    for path in paths:
        try:
            with open_image(path) as image:
                small = image.convert("L").resize((width, height), Image.Resampling.LANCZOS)
        except Exception as error:  # Pillow's plugins raise OSError, SyntaxError, ValueError, ...
            reason = (
                getattr(error, "strerror", None)
                or (str(error).splitlines() or [type(error).__name__])[0]
            )
            raise ConfigError(
                f"cannot read {path} as an image ({reason}): pass PNG or JPEG files."
            ) from error
        images.append(torch.frombuffer(bytearray(small.tobytes()), dtype=torch.uint8))
    return torch.stack(images).reshape(len(paths), 1, height, width)
