"""Pretrained image backbones as plain `nn.Module`s that map images to one feature vector each,
and the classifier that puts a new head on one. The backbones are built, and their weights read,
by `checkpointing.image_backbones` (a Hugging Face folder) and `checkpointing.timm_backbones`
(a timm model by name); here they only compute."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

# ImageNet's per-channel statistics, which most pretrained backbones normalize their inputs with
# (what a folder without a preprocessor_config.json is taken to use).
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def hugging_face_features(model_type: str, output: Any) -> torch.Tensor:
    """The feature vector that transformers' own image classifier of each architecture puts its
    linear head on: the pooled last stage (ResNet, ConvNeXt), the class token (ViT), the class
    token beside the mean of the patch tokens (DINOv2)."""
    if model_type == "resnet":
        return output.pooler_output.flatten(1)
    if model_type == "convnext":
        return output.pooler_output
    tokens = output.last_hidden_state
    if model_type == "vit":
        return tokens[:, 0]
    return torch.cat([tokens[:, 0], tokens[:, 1:].mean(dim=1)], dim=1)


class HuggingFaceBackbone(nn.Module):
    """A transformers image model (`ResNetModel`, `ConvNextModel`, `ViTModel`, `Dinov2Model`);
    `num_features` wide. Images of another size than it was trained on are taken too: a ViT's
    position embeddings are interpolated to them (DINOv2 always does that)."""

    def __init__(self, model: nn.Module, model_type: str, num_features: int) -> None:
        super().__init__()
        self.model = model
        self.model_type = model_type
        self.num_features = num_features

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if self.model_type == "vit":
            output = self.model(pixel_values=images, interpolate_pos_encoding=True)
        else:
            output = self.model(pixel_values=images)
        return hugging_face_features(self.model_type, output)


class TimmBackbone(nn.Module):
    """A timm model built without its classifier (`num_classes=0`): its forward returns pooled
    features, `num_features` wide."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.num_features = int(getattr(model, "num_features", 0))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(images)


class BackboneClassifier(nn.Module):
    """A backbone and a new linear head for `num_classes` classes on its features. With
    `frozen`, the backbone's weights do not train and it stays in eval mode (its BatchNorm
    statistics and dropout as pretrained): only the head learns, a linear probe."""

    def __init__(
        self, backbone: nn.Module, num_classes: int, dropout: float = 0.0, frozen: bool = False
    ) -> None:
        super().__init__()
        width = getattr(backbone, "num_features", None)
        if not isinstance(width, int) or width < 1:
            raise ValueError(
                f"the backbone {type(backbone).__name__} does not say how wide its features are "
                "(a `num_features` attribute): build it with model/backbone=hugging_face or timm."
            )
        self.backbone = backbone
        self.head = nn.Sequential(nn.Dropout(dropout), nn.Linear(width, num_classes))
        self.frozen = frozen
        if frozen:
            self.backbone.requires_grad_(False)
            self.backbone.eval()

    def train(self, mode: bool = True) -> BackboneClassifier:
        super().train(mode)
        if self.frozen:
            self.backbone.eval()
        return self

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(images))
