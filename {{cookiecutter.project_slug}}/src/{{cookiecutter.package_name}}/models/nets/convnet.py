"""A small convolutional classifier for single- or multi-channel images of any size."""

from __future__ import annotations

import torch
from torch import nn


class ConvNet(nn.Module):
    """Blocks of conv-batchnorm-ReLU-maxpool, then global average pooling and a linear head."""

    def __init__(
        self,
        in_channels: int = 1,
        num_classes: int = 10,
        channels: tuple[int, ...] = (32, 64),
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        blocks: list[nn.Module] = []
        previous = in_channels
        for width in channels:
            blocks += [
                nn.Conv2d(previous, width, kernel_size=3, padding=1, bias=False),
                nn.BatchNorm2d(width),
                nn.ReLU(inplace=True),
                nn.MaxPool2d(2),
            ]
            previous = width
        self.features = nn.Sequential(*blocks)
        self.head = nn.Sequential(
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Dropout(dropout),
            nn.Linear(previous, num_classes),
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images))
