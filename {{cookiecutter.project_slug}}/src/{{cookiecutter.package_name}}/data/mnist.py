"""MNIST from its original IDX files, downloaded once into `data_dir`.

The files may be gzipped (as downloaded) or not. Images stay uint8 until they reach the
accelerator, where `on_after_batch_transfer` scales them: a quarter of the bytes to copy.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import logging
import math
import urllib.request
import zlib
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset, TensorDataset

from .base import SplitDataModule, split_indices
from .errors import ConfigError
from .folder_files import read_bounded
from .image_files import read_gray_images

log = logging.getLogger(__name__)

MIRRORS = (
    "https://ossci-datasets.s3.amazonaws.com/mnist/",
    "https://storage.googleapis.com/cvdf-datasets/mnist/",
)
FILES = {
    "train-images-idx3-ubyte": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
    "train-labels-idx1-ubyte": "d53e105ee54ea40749a09fcbcd1e9432",
    "t10k-images-idx3-ubyte": "9fb629c4189551a2d022fa330f9573f3",
    "t10k-labels-idx1-ubyte": "ec29112dd5afa0611ce80d1b7f02629c",
}
MEAN, STD = 0.1307, 0.3081
IDX_LIMIT = 64 << 20  # bytes: the largest MNIST file (60,000 images of 28x28) holds 47 MB


def read_idx(path: Path) -> torch.Tensor:
    """Read an IDX file of unsigned bytes (the MNIST format), gzipped or not, of at most
    IDX_LIMIT bytes unpacked."""
    advice = "delete it and download again"
    raw = read_bounded(path, IDX_LIMIT, f"data file {path}", f"not an MNIST file: {advice}")
    if path.suffix == ".gz":
        try:
            with gzip.GzipFile(fileobj=io.BytesIO(raw)) as file:
                raw = file.read(IDX_LIMIT + 1)
        except (OSError, EOFError, zlib.error) as error:
            raise ConfigError(f"{path} is not a whole gzip file ({error}): {advice}.") from None
        if len(raw) > IDX_LIMIT:
            raise ConfigError(f"{path} unpacks to more than an MNIST file holds: {advice}.")
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise ConfigError(f"{path} is not an IDX file of unsigned bytes; {advice}.")
    ndim = raw[3]
    header = 4 + 4 * ndim
    shape = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    expected = header + math.prod(shape)
    if len(raw) != expected:
        raise ConfigError(
            f"{path} holds {len(raw)} bytes but its header promises {expected}; the file is "
            f"truncated or corrupt: {advice}."
        )
    return torch.frombuffer(bytearray(raw[header:]), dtype=torch.uint8).reshape(shape)


def download(name: str, data_dir: Path) -> Path:
    target = data_dir / f"{name}.gz"
    data_dir.mkdir(parents=True, exist_ok=True)
    errors = []
    for mirror in MIRRORS:
        try:
            with urllib.request.urlopen(mirror + target.name, timeout=30) as response:
                payload = response.read()
        except OSError as error:
            errors.append(f"{mirror}: {error}")
            continue
        if hashlib.md5(payload).hexdigest() != FILES[name]:
            errors.append(f"{mirror}: checksum mismatch")
            continue
        partial = target.with_suffix(".gz.part")
        partial.write_bytes(payload)
        partial.replace(target)
        log.info("Downloaded %s", target)
        return target
    raise ConfigError(
        f"could not download {target.name} ({'; '.join(errors)}). Put the MNIST IDX files in "
        f"{data_dir} by hand, or point data.data_dir at a folder that has them."
    )


def find_or_download(name: str, data_dir: Path, allow_download: bool) -> Path:
    for candidate in (data_dir / name, data_dir / f"{name}.gz"):
        if candidate.is_file():
            return candidate
    if not allow_download:
        raise ConfigError(
            f"{name}(.gz) is not in data.data_dir={data_dir}. Set data.download=true, or point "
            "data.data_dir at the folder that holds the MNIST IDX files."
        )
    return download(name, data_dir)


class MNISTDataModule(SplitDataModule):
    num_classes = 10
    channels = 1

    def __init__(
        self,
        data_dir: str = "data/mnist",
        download: bool = True,
        batch_size: int = 256,
        val_size: int = 5000,
        split_seed: int = 0,
        num_workers: int = 4,
    ) -> None:
        super().__init__(batch_size, num_workers)
        self.save_hyperparameters()
        self.data_dir = Path(data_dir).expanduser()

    def prepare_data(self) -> None:
        for name in FILES:
            find_or_download(name, self.data_dir, self.hparams["download"])

    def _read(self, prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
        allow = self.hparams["download"]
        images = read_idx(find_or_download(f"{prefix}-images-idx3-ubyte", self.data_dir, allow))
        labels = read_idx(find_or_download(f"{prefix}-labels-idx1-ubyte", self.data_dir, allow))
        if len(images) != len(labels):
            raise ConfigError(
                f"{self.data_dir}: {len(images)} {prefix} images but {len(labels)} labels; "
                "delete the files and download again."
            )
        return images.unsqueeze(1), labels.long()

    def load_splits(self) -> dict[str, Dataset[Any]]:
        images, labels = self._read("train")
        val_fraction = self.hparams["val_size"] / len(labels)
        train, val, _ = split_indices(len(labels), (val_fraction, 0.0), self.hparams["split_seed"])
        return {
            "train": TensorDataset(images[train], labels[train]),
            "val": TensorDataset(images[val], labels[val]),
            "test": TensorDataset(*self._read("t10k")),
        }

    @staticmethod
    def images_from_files(paths: list[Path]) -> torch.Tensor:
        """Image files as training images: 28x28 grayscale, ink bright on dark."""
        return read_gray_images(paths, 28, 28)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        images, labels = batch
        return images.float().div_(255).sub_(MEAN).div_(STD), labels
