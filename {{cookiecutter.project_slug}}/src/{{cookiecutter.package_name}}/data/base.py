"""What the data modules share: seeded splits and DataLoader settings."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset


def split_indices(
    count: int, fractions: tuple[float, float], seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A seeded shuffle of range(count) cut into train, validation and test indices."""
    order = torch.randperm(count, generator=torch.Generator().manual_seed(seed))
    val_count = int(count * fractions[0])
    test_count = int(count * fractions[1])
    return (
        order[val_count + test_count :],
        order[:val_count],
        order[val_count : val_count + test_count],
    )


class SplitDataModule(L.LightningDataModule):
    """A data module whose `load_splits` returns the train, val and test data sets."""

    def __init__(self, batch_size: int, num_workers: int) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.splits: dict[str, Dataset[Any]] = {}

    def load_splits(self) -> dict[str, Dataset[Any]]:
        raise NotImplementedError

    def setup(self, stage: str | None = None) -> None:
        if not self.splits:
            self.splits = self.load_splits()

    def loader(self, split: str) -> DataLoader[Any]:
        """Shuffle and drop the ragged last batch when training, so compiled shapes stay static."""
        train = split == "train"
        return DataLoader(
            self.splits[split],
            batch_size=self.batch_size,
            shuffle=train,
            drop_last=train,
            num_workers=self.num_workers,
            pin_memory=torch.cuda.is_available(),
            persistent_workers=self.num_workers > 0,
            prefetch_factor=4 if self.num_workers > 0 else None,
        )

    def train_dataloader(self) -> DataLoader[Any]:
        return self.loader("train")

    def val_dataloader(self) -> DataLoader[Any]:
        return self.loader("val")

    def test_dataloader(self) -> DataLoader[Any]:
        return self.loader("test")
