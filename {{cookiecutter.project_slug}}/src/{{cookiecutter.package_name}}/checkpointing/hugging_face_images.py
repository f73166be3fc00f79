"""A Hugging Face image model folder (`config.json` and `model.safetensors`, as the Hub's
microsoft/resnet-18, facebook/convnext-tiny-224, google/vit-base-patch16-224-in21k and
facebook/dinov2-small hold them) as a pretrained backbone (`model/backbone=hugging_face`).

Every file is read by the door: config.json and preprocessor_config.json as small JSON (a size
cap, each field's type checked), the weights as safetensors; weights that are only a pickle
(`pytorch_model.bin`) are refused. The architecture is one of an allowlist of `model_type`s,
built with transformers' own class for it from the checked fields alone: no Auto class, no
remote code, no download. It is first built on the meta device (no memory), and only where the
file holds as many numbers as that model is it built for real, by transformers' loader from the
tensors already read (it renames keys that older transformers saved), every weight present at
its shape and nothing else in the file."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError
from ..models.nets.backbones import IMAGENET_MEAN, IMAGENET_STD, HuggingFaceBackbone
from .differences import listed_differences
from .door import HF_CONFIG, HF_PICKLED, HF_WEIGHTS, first_line, read_json_fields, read_safetensors

KEY = "model.backbone.path"
PREPROCESSOR = "preprocessor_config.json"
DOWNLOAD = "hf download microsoft/resnet-18 --local-dir checkpoints/resnet-18"

WHOLE, NUMBER, TEXT, SWITCH = "a whole number", "a number", "a string", "true or false"
WHOLE_LIST = "a list of whole numbers"


@dataclass(frozen=True)
class Architecture:
    """What transformers builds for one `model_type`, and the config.json fields passed to it
    (nothing else from the file reaches transformers)."""

    config_class: str
    model_class: str
    fields: dict[str, str]
    model_arguments: tuple[tuple[str, Any], ...] = ()

    def num_features(self, built: Any) -> int:
        """How wide the backbone's features are (see `hugging_face_features`)."""
        if "hidden_sizes" in self.fields:
            return int(built.hidden_sizes[-1])
        width = int(built.hidden_size)
        return 2 * width if self.model_class == "Dinov2Model" else width


DROPOUTS = {"hidden_dropout_prob": NUMBER, "attention_probs_dropout_prob": NUMBER}
TRANSFORMER = {
    "hidden_size": WHOLE, "num_hidden_layers": WHOLE, "num_attention_heads": WHOLE,
    "hidden_act": TEXT, "layer_norm_eps": NUMBER, "image_size": WHOLE, "patch_size": WHOLE,
    "num_channels": WHOLE, "qkv_bias": SWITCH, **DROPOUTS,
}  # fmt: skip
ARCHITECTURES = {
    "resnet": Architecture(
        "ResNetConfig", "ResNetModel",
        {
            "num_channels": WHOLE, "embedding_size": WHOLE, "hidden_sizes": WHOLE_LIST,
            "depths": WHOLE_LIST, "layer_type": TEXT, "hidden_act": TEXT,
            "downsample_in_first_stage": SWITCH, "downsample_in_bottleneck": SWITCH,
        },
    ),
    "convnext": Architecture(
        "ConvNextConfig", "ConvNextModel",
        {
            "num_channels": WHOLE, "patch_size": WHOLE, "num_stages": WHOLE,
            "hidden_sizes": WHOLE_LIST, "depths": WHOLE_LIST, "hidden_act": TEXT,
            "layer_norm_eps": NUMBER, "layer_scale_init_value": NUMBER, "drop_path_rate": NUMBER,
            "image_size": WHOLE,
        },
    ),
    "vit": Architecture(
        "ViTConfig", "ViTModel",
        {**TRANSFORMER, "intermediate_size": WHOLE, "encoder_stride": WHOLE},
        (("add_pooling_layer", False),),  # the head takes the class token, not the pooler
    ),
    "dinov2": Architecture(
        "Dinov2Config", "Dinov2Model",
        {
            **TRANSFORMER, "mlp_ratio": NUMBER, "layerscale_value": NUMBER,
            "drop_path_rate": NUMBER, "use_swiglu_ffn": SWITCH, "use_mask_token": SWITCH,
        },
    ),
}  # fmt: skip
# The heads that transformers' classifiers keep beside the backbone (a `...ForImageClassification`
# save), and ViT's pooler, which this backbone does not use: left out of the weights.
LEFT_OUT = ("classifier.", "pooler.")


def checked_files(folder: Path, pretrained: bool) -> tuple[Path, Path | None]:
    """config.json, and model.safetensors where the weights are wanted; one error otherwise."""
    if not folder.is_dir():
        raise ConfigError(
            f"{KEY}={folder} is not a folder: download a Hugging Face image model into it, e.g. "
            f"{DOWNLOAD}"
        )
    config, weights = folder / HF_CONFIG, folder / HF_WEIGHTS
    if not config.is_file():
        raise ConfigError(
            f"{KEY}={folder} has no {HF_CONFIG} (the model's architecture): download the model's "
            f"files into it, e.g. {DOWNLOAD}"
        )
    if not pretrained:
        return config, None
    if not weights.is_file():
        if (folder / HF_PICKLED).exists():
            raise ConfigError(
                f"{KEY}={folder} holds its weights only as {HF_PICKLED}, a pickle, which this "
                f"project never loads (unpickling can run code stored in the file): get the "
                f"model's {HF_WEIGHTS} instead (hf download <repo> {HF_WEIGHTS} --local-dir "
                f"{folder})."
            )
        raise ConfigError(
            f"{KEY}={folder} has {HF_CONFIG} but no {HF_WEIGHTS}: download it too (hf download "
            f"<repo> {HF_WEIGHTS} --local-dir {folder}), or train the architecture from scratch "
            "with model.backbone.pretrained=false."
        )
    return config, weights


def check_list(value: Any, name: str, where: str) -> None:
    if not (
        isinstance(value, list) and value and all(type(item) is int and item >= 1 for item in value)
    ):
        raise ConfigError(
            f"{where} has {name}={str(value)[:80]}, where the config of this model holds "
            f"{WHOLE_LIST} (each 1 or more): download it again."
        )


def read_config(path: Path) -> tuple[Architecture, dict[str, Any]]:
    """The architecture that config.json names and the fields of it that are passed on."""
    value = read_json_fields(path, {"model_type": TEXT}, ("model_type",), KEY)
    where = f"{KEY}={path.parent}: its {HF_CONFIG}"
    architecture = ARCHITECTURES.get(value["model_type"])
    if architecture is None:
        raise ConfigError(
            f"{KEY}={path.parent} is a Hugging Face {value['model_type']!r} model: the image "
            f"backbones this project builds are {', '.join(sorted(ARCHITECTURES))} (ResNet, "
            "ConvNeXt, ViT, DINOv2); for another one try model/backbone=timm."
        )
    scalar = {name: kind for name, kind in architecture.fields.items() if kind != WHOLE_LIST}
    read_json_fields(path, scalar, (), KEY)
    for name, kind in architecture.fields.items():
        if kind == WHOLE_LIST and name in value:
            check_list(value[name], name, where)
        elif kind == WHOLE and name in value and value[name] < 1:
            raise ConfigError(f"{where} has {name}={value[name]}, not a size: download it again.")
    if value.get("num_channels", 3) != 3:
        raise ConfigError(
            f"{where} has num_channels={value['num_channels']}: the image data gives RGB images "
            "(3 channels), which this model does not take."
        )
    return architecture, {name: value[name] for name in architecture.fields if name in value}


def transformers_classes(architecture: Architecture) -> tuple[Any, Any]:
    try:
        import transformers
    except ImportError as error:
        raise ConfigError(
            "model/backbone=hugging_face builds the model with the transformers package: "
            "pip install -e '.[vision]' (or pip install transformers safetensors)."
        ) from error
    return (
        getattr(transformers, architecture.config_class),
        getattr(transformers, architecture.model_class),
    )


def build(architecture: Architecture, fields: dict[str, Any], folder: Path, meta: bool) -> Any:
    """The transformers model of the fields: on the meta device (shapes only) or for real."""
    config_class, model_class = transformers_classes(architecture)
    try:
        config = config_class(**fields)
        if meta:
            with torch.device("meta"):
                return config, model_class(config, **dict(architecture.model_arguments))
        return config, model_class(config, **dict(architecture.model_arguments))
    except Exception as error:  # transformers raises ValueError, KeyError, TypeError, ...
        raise ConfigError(
            f"{KEY}={folder}: its {HF_CONFIG} does not build a {architecture.model_class} "
            f"({first_line(error)}): download it again."
        ) from error


def backbone_tensors(
    tensors: dict[str, torch.Tensor], prefix: str, expected: int, folder: Path
) -> dict[str, torch.Tensor]:
    """The file's tensors of the backbone: a classifier's save prefixes them with `prefix.`, and
    its head (and ViT's pooler, which this backbone does not use) is left out. The file must
    hold as many numbers as the built model (`expected`), before anything is allocated for it."""
    kept: dict[str, torch.Tensor] = {}
    for name, value in tensors.items():
        short = name.removeprefix(f"{prefix}.")
        if not short.startswith(LEFT_OUT):
            kept[short] = value
    held = sum(value.numel() for value in kept.values())
    if held != expected:
        raise ConfigError(
            f"{KEY}={folder}: its {HF_WEIGHTS} holds {held:,} weights for the backbone and its "
            f"{HF_CONFIG} describes one of {expected:,}: download both files again, from the "
            "same model."
        )
    return kept


def load(
    architecture: Architecture, config: Any, tensors: dict[str, torch.Tensor], folder: Path
) -> Any:
    """The model built from `config` with the file's tensors, through transformers' own loading,
    which renames a checkpoint's keys where its classes have changed since it was saved. Every
    weight must be in the file, at its shape; nothing else may be."""
    _, model_class = transformers_classes(architecture)
    where = f"{KEY}={folder}: its {HF_WEIGHTS}"
    try:
        model, info = model_class.from_pretrained(
            None,
            config=config,
            state_dict=tensors,
            output_loading_info=True,
            **dict(architecture.model_arguments),
        )
    except Exception as error:  # a shape that differs, a tensor of another kind, ...
        raise ConfigError(
            f"{where} does not hold the model its {HF_CONFIG} describes ({first_line(error)}): "
            "download both files again, from the same model."
        ) from error
    details = listed_differences(
        [str(name) for name in info.get("missing_keys") or ()],
        [str(name) for name in info.get("unexpected_keys") or ()],
        [str(name) for name in info.get("mismatched_keys") or ()],
    )
    if details:
        raise ConfigError(
            f"{where} does not hold the model its {HF_CONFIG} describes ({details}): "
            "download both files again, from the same model."
        )
    return model


def preprocessing(folder: Path) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The per-channel mean and std the backbone was trained with: its preprocessor_config.json's
    image_mean and image_std where the folder has one, else ImageNet's."""
    path = folder / PREPROCESSOR
    if not path.exists():
        return IMAGENET_MEAN, IMAGENET_STD
    where = f"{KEY}={folder}: its {PREPROCESSOR}"
    if not path.is_file():
        raise ConfigError(f"{where} is not a regular file: download it again.")
    value = read_json_fields(path, {}, (), KEY)
    found: list[tuple[float, ...]] = []
    for name in ("image_mean", "image_std"):
        numbers = value.get(name)
        if numbers is None:
            found.append(IMAGENET_MEAN if name == "image_mean" else IMAGENET_STD)
            continue
        if not (
            isinstance(numbers, list)
            and len(numbers) == 3
            and all(type(n) in (int, float) and math.isfinite(n) for n in numbers)
            and (name == "image_mean" or all(n > 0 for n in numbers))
        ):
            raise ConfigError(
                f"{where} has {name}={str(numbers)[:80]}, where it holds 3 numbers (one per RGB "
                "channel): download it again."
            )
        found.append(tuple(float(n) for n in numbers))
    return found[0], found[1]


def shown(numbers: tuple[float, ...]) -> str:
    return "[" + ",".join(f"{n:g}" for n in numbers) + "]"


def check_normalization(
    wanted: tuple[tuple[float, ...], tuple[float, ...]],
    input_mean: list[float] | None,
    input_std: list[float] | None,
    source: str,
) -> None:
    """The data normalizes images as the backbone was trained on them, or one error with the
    overrides that make it (data.mean null, std null: the data's own -0.5..0.5)."""
    given = (
        tuple(float(n) for n in input_mean) if input_mean is not None else (0.5, 0.5, 0.5),
        tuple(float(n) for n in input_std) if input_std is not None else (1.0, 1.0, 1.0),
    )
    same = all(
        len(a) == len(b)
        and all(math.isclose(x, y, abs_tol=1e-3) for x, y in zip(a, b, strict=True))
        for a, b in zip(wanted, given, strict=True)
    )
    if not same:
        raise ConfigError(
            f"{source} was trained on images normalized with mean {shown(wanted[0])} and std "
            f"{shown(wanted[1])}, and the data normalizes with mean {shown(given[0])}, std "
            f"{shown(given[1])}: add data.mean={shown(wanted[0])} data.std={shown(wanted[1])}"
        )


def hugging_face_backbone(
    path: str,
    pretrained: bool = True,
    input_mean: list[float] | None = None,
    input_std: list[float] | None = None,
) -> HuggingFaceBackbone:
    """The backbone of a Hugging Face image model folder, with its weights (`pretrained`) or as
    transformers initializes it; `input_mean`, `input_std` are the data's normalization, checked
    against the one the backbone was trained with."""
    folder = Path(str(path)).expanduser()
    config_path, weights_path = checked_files(folder, pretrained)
    architecture, fields = read_config(config_path)
    if pretrained:
        check_normalization(preprocessing(folder), input_mean, input_std, f"{KEY}={folder}")
    config, shapes = build(architecture, fields, folder, meta=True)
    if weights_path is None:
        _, model = build(architecture, fields, folder, meta=False)
    else:
        expected = sum(value.numel() for value in shapes.state_dict().values())
        tensors = read_safetensors(weights_path, KEY)
        kept = backbone_tensors(tensors, shapes.base_model_prefix, expected, folder)
        model = load(architecture, config, kept, folder)
    model.eval()  # as transformers loads it; the training loop sets the mode it trains in
    return HuggingFaceBackbone(model, config.model_type, architecture.num_features(config))
