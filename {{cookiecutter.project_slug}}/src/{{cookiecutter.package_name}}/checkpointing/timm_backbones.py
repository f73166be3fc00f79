"""A timm model by name as a pretrained backbone (`model/backbone=timm`), built without its
classifier (`timm.create_model(name, pretrained=..., num_classes=0)`).

timm needs torchvision, and torchvision must be the build made for the installed torch (`make
install VISION=1` installs the pair): where it is missing or does not import, one error line says
so. `pretrained=true` lets timm download the weights from the Hugging Face Hub (timm reads its
safetensors there); `weights=<file>.safetensors` reads a file you have instead, through the door,
each name and shape checked against the model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError
from ..models.nets.backbones import IMAGENET_MEAN, IMAGENET_STD, TimmBackbone
from .differences import shape_differences
from .door import first_line, read_safetensors
from .hugging_face_images import check_normalization

KEY = "model.backbone"
INSTALL = (
    "make install VISION=1 (torchvision built for the installed torch, then timm); without a "
    "matching torchvision build use model/backbone=hugging_face, which needs neither"
)


def import_timm() -> Any:
    try:
        import timm
    except ImportError as error:
        raise ConfigError(
            f"model/backbone=timm needs the timm package ({first_line(error)}): {INSTALL}."
        ) from error
    except Exception as error:  # torchvision built for another torch fails as it registers ops
        raise ConfigError(
            f"model/backbone=timm: timm does not import ({first_line(error)}), usually a "
            f"torchvision built for another torch: {INSTALL}."
        ) from error
    return timm


def local_weights(
    model: torch.nn.Module, file: Path, classifier: str | tuple[str, ...]
) -> dict[str, torch.Tensor]:
    """The file's tensors, its classifier left out, each name and shape checked."""
    tensors = read_safetensors(file, f"{KEY}.weights")
    heads = (classifier,) if isinstance(classifier, str) else tuple(classifier)
    expected = model.state_dict()
    kept = {
        name: value
        for name, value in tensors.items()
        if name in expected or not any(name.startswith(f"{head}.") for head in heads)
    }
    stored = {name: tuple(value.shape) for name, value in kept.items()}
    details = shape_differences({n: tuple(v.shape) for n, v in expected.items()}, stored)
    if details:
        raise ConfigError(
            f"{KEY}.weights={file} does not hold the weights of this timm model "
            f"({details}): save them from the same model name."
        )
    return kept


def timm_backbone(
    name: str,
    pretrained: bool = True,
    weights: str | None = None,
    input_mean: list[float] | None = None,
    input_std: list[float] | None = None,
) -> TimmBackbone:
    """timm's model `name` without its classifier: with the Hub's weights (`pretrained`), a local
    safetensors file's (`weights`), or as timm initializes it (neither)."""
    timm = import_timm()
    if not timm.is_model(name):
        raise ConfigError(
            f'{KEY}.name={name} is not a timm model: list them with python -c "import timm; '
            f"print(timm.list_models('*{name.split('.')[0][:8]}*'))\"."
        )
    file = Path(weights).expanduser() if weights else None
    if file is not None and not file.is_file():
        raise ConfigError(f"{KEY}.weights={weights} is not a file: give a .safetensors file.")
    try:
        model = timm.create_model(name, pretrained=pretrained and file is None, num_classes=0)
    except Exception as error:  # a download that fails, a name without weights, ...
        raise ConfigError(
            f"{KEY}.name={name}: timm cannot build it ({first_line(error)}). Offline, download "
            f"its model.safetensors and give {KEY}.weights=<file>, or {KEY}.pretrained=false."
        ) from error
    config = dict(getattr(model, "pretrained_cfg", None) or {})
    if file is not None:
        state = local_weights(model, file, config.get("classifier") or ())
        with torch.no_grad():
            target = model.state_dict()
            for key, value in state.items():
                target[key].copy_(value)
    if pretrained or file is not None:
        wanted = (
            tuple(config.get("mean") or IMAGENET_MEAN),
            tuple(config.get("std") or IMAGENET_STD),
        )
        check_normalization(wanted, input_mean, input_std, f"{KEY}.name={name}")
    return TimmBackbone(model)
