"""A small convolutional classifier for single- or multi-channel images of any size."""

from __future__ import annotations

import torch
from torch import nn


class ConvNet(nn.Module):
    """Blocks of conv-batchnorm-ReLU-maxpool, then global average pooling and a linear head.

    `channels_last` stores weights and inputs as NHWC, which cuDNN's tensor-core convolutions
    prefer; whether it is faster depends on the GPU, the image size and the precision.
    """

    def __init__(
        self,
        in_channels: int = 1,
        num_classes: int = 10,
        channels: tuple[int, ...] = (32, 64),
        dropout: float = 0.1,
        channels_last: bool = False,
    ) -> None:
        super().__init__()
        self.channels_last, self.in_channels = channels_last, in_channels
        self.min_image_size = 2 ** len(channels)  # each block halves the image
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
        if channels_last:
            self.to(memory_format=torch.channels_last)  # type: ignore[call-overload]

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if self.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        return self.head(self.features(images))
