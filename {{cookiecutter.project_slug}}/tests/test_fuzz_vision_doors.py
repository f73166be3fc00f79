"""Fuzzing the vision example's door for image files a user did not make: a valid image of each
format the models train on (PNG, JPEG, BMP, GIF, WebP, TIFF), mutated at random
(tests/fuzzing.py), read as the digits and MNIST data read predict's inputs and as an image
folder checks and reads its files. Whatever the case: a result or one ConfigError line."""

from __future__ import annotations

import io
import random
from pathlib import Path

import pytest
from PIL import Image

from {{ cookiecutter.package_name }}.data.image_files import (
    IMAGE_FORMATS,
    read_gray_images,
)
from {{ cookiecutter.package_name }}.data.image_folder import (
    ImageFolderDataModule,
)

from .fuzzing import CASES, door_holds, mutate_bytes


def image_bytes(image_format: str) -> bytes:
    """A 24x16 RGB gradient in `image_format`."""
    image = Image.new("RGB", (24, 16))
    image.putdata([(x * 10, y * 15, (x + y) * 6) for y in range(16) for x in range(24)])
    buffer = io.BytesIO()
    image.save(buffer, format=image_format)
    return buffer.getvalue()


@pytest.mark.parametrize("image_format", IMAGE_FORMATS)
def test_image_files(image_format: str, tmp_path: Path) -> None:
    valid = image_bytes(image_format)
    root = tmp_path / "images"
    for name in ("cat", "dog"):
        (root / name).mkdir(parents=True)
        for index in range(2):
            (root / name / f"{index}.{image_format.lower()}").write_bytes(valid)
    path = root / "cat" / f"0.{image_format.lower()}"
    folder = ImageFolderDataModule(
        root=str(root), image_size=8, num_classes=2, batch_size=1, num_workers=0,
        val_fraction=0.25, test_fraction=0.25, min_steps_per_epoch=None,
    )  # fmt: skip
    rng = random.Random(f"{image_format} 7")
    for case in range(CASES):
        path.write_bytes(mutate_bytes(valid, rng))

        def door() -> None:
            read_gray_images([path], 8, 8)
            folder.images_from_files([path])
            folder.verify()

        door_holds(door, f"{image_format} case {case}: {path.read_bytes()[:64]!r}")
