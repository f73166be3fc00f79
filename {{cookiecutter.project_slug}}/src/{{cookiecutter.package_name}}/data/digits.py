"""The UCI handwritten digits (8x8 images, 1797 samples), shipped inside this package.

The copy is scikit-learn's `digits.csv.gz`: one image a row, 64 pixel values in 0..16 and the label.
It needs no download, so the default experiment trains offline on real data.
"""

from __future__ import annotations

import csv
import gzip
import io
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset, TensorDataset

from .base import SplitDataModule, check_fractions, split_indices
from .image_files import read_gray_images

PIXEL_MAX = 16.0


def load_digits() -> tuple[torch.Tensor, torch.Tensor]:
    """Images as uint8 (N, 1, 8, 8) and labels as int64 (N,)."""
    raw = (resources.files(__package__) / "assets" / "digits.csv.gz").read_bytes()
    rows = list(csv.reader(io.StringIO(gzip.decompress(raw).decode("ascii"))))
    values = torch.tensor([[int(v) for v in row] for row in rows], dtype=torch.uint8)
    return values[:, :64].reshape(-1, 1, 8, 8), values[:, 64].long()


class DigitsDataModule(SplitDataModule):
    num_classes = 10
    channels = 1

    def __init__(
        self,
        batch_size: int = 64,
        val_fraction: float = 0.1,
        test_fraction: float = 0.2,
        split_seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__(batch_size, num_workers)
        check_fractions(val_fraction, test_fraction)
        self.save_hyperparameters()

    def load_splits(self) -> dict[str, Dataset[Any]]:
        images, labels = load_digits()
        fractions = (self.hparams["val_fraction"], self.hparams["test_fraction"])
        train, val, test = split_indices(len(labels), fractions, self.hparams["split_seed"])
        return {
            name: TensorDataset(images[idx], labels[idx])
            for name, idx in (("train", train), ("val", val), ("test", test))
        }

    @staticmethod
    def images_from_files(paths: list[Path]) -> torch.Tensor:
        """Image files as training images: 8x8, ink bright on dark, values 0..16."""
        images = read_gray_images(paths, 8, 8).float()
        return images.mul_(PIXEL_MAX / 255).round_().to(torch.uint8)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        images, labels = batch
        return images.float().div_(PIXEL_MAX).sub_(0.5), labels
