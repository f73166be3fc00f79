"""Fuzzing the vision example's door for image files a user did not make: a valid image of each
format the models train on (PNG, JPEG, BMP, GIF, WebP, TIFF), mutated at random
(tests/fuzzing.py), read as the digits and MNIST data read predict's inputs and as an image
folder checks and reads its files; MNIST's IDX files; an image folder's CSV of labels. Whatever
the case: a result or one ConfigError line."""

from __future__ import annotations

import gzip
import io
import random
import shutil
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
from {{ cookiecutter.package_name }}.data.mnist import (
    MNISTDataModule,
)

from .fuzzing import CASES, door_holds, must_refuse, mutate_bytes, remove, write_case
from .test_vision import write_fake_mnist


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
        kind = write_case(path, mutate_bytes(valid, rng), rng, valid)

        def door() -> None:
            read_gray_images([path], 8, 8)
            folder.images_from_files([path])
            folder.verify()

        shown = path.read_bytes()[:64] if kind in ("bytes", "link out") else kind
        door_holds(door, f"{image_format} case {case}: {shown!r}", must_refuse(kind, False))


def test_mnist_files(tmp_path: Path) -> None:
    """MNIST's four IDX files (gzipped, as downloaded), one mutated as bytes, packed or
    unpacked (a header that promises another size), or an odd file in its place."""
    valid_dir = tmp_path / "valid"
    write_fake_mnist(valid_dir, train_count=20, test_count=10)
    folder = tmp_path / "mnist"
    shutil.copytree(valid_dir, folder)
    names = sorted(path.name for path in valid_dir.iterdir())
    rng = random.Random(15)
    for case in range(CASES):
        name = rng.choice(names)
        good = (valid_dir / name).read_bytes()
        inner = gzip.decompress(good)
        mutated = mutate_bytes(good, rng) if case % 2 else gzip.compress(mutate_bytes(inner, rng))
        kind = write_case(folder / name, mutated, rng, good)

        def door() -> None:
            data = MNISTDataModule(str(folder), download=False, val_size=5, num_workers=0)
            data.setup("fit")
            data.setup("test")

        door_holds(door, f"{name} case {case} ({kind})", must_refuse(kind, own_file=False))
        remove(folder / name)
        (folder / name).write_bytes(good)


def test_image_folder_csv(tmp_path: Path) -> None:
    """A CSV of path,label rows (data.csv) mutated as bytes, or an odd file in its place."""
    valid = image_bytes("PNG")
    for index in range(8):
        (tmp_path / f"{index}.png").write_bytes(valid)
    good = "path,label\n" + "".join(f"{i}.png,{'cat' if i % 2 else 'dog'}\n" for i in range(8))
    csv = tmp_path / "labels.csv"
    rng = random.Random(16)
    for case in range(CASES):
        kind = write_case(csv, mutate_bytes(good.encode(), rng), rng, good.encode())

        def door() -> None:
            data = ImageFolderDataModule(
                csv=str(csv), image_size=8, num_classes=2, batch_size=1, num_workers=0,
                val_fraction=0.25, test_fraction=0.25, min_steps_per_epoch=None,
            )  # fmt: skip
            data.verify()

        door_holds(door, f"case {case} ({kind})", must_refuse(kind, own_file=False))
