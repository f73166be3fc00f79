"""Pretrained backbones (model=backbone_classifier): Hugging Face image folders that compute as
transformers does, read only through the door (a hostile folder is one error line); a new head,
a frozen backbone and its own learning rate; timm models where timm and torchvision import; and a
backbone pretrained here on other images, fine-tuned by the documented command."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image, ImageDraw
from safetensors.torch import load_file, save_file
from torch import nn

from {{ cookiecutter.package_name }}.checkpointing.hugging_face_images import (
    hugging_face_backbone,
)
from {{ cookiecutter.package_name }}.errors import ConfigError
from {{ cookiecutter.package_name }}.models.image_classifier import (
    ImageClassifier,
)
from {{ cookiecutter.package_name }}.models.nets.backbones import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    BackboneClassifier,
)
from {{ cookiecutter.package_name }}.models.optim import (
    configure_optimizers,
)
from {{ cookiecutter.package_name }}.targets import build

from .helpers import PACKAGE, ComposeFn, run_cli

transformers = pytest.importorskip("transformers")

IMAGENET = {"input_mean": list(IMAGENET_MEAN), "input_std": list(IMAGENET_STD)}
TINY = {
    "resnet": lambda: transformers.ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic"
    ),
    "convnext": lambda: transformers.ConvNextConfig(
        hidden_sizes=[8, 16], depths=[1, 1], num_stages=2
    ),
    "vit": lambda: transformers.ViTConfig(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        image_size=32, patch_size=8,
    ),
    "dinov2": lambda: transformers.Dinov2Config(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, mlp_ratio=2, image_size=32,
        patch_size=8,
    ),
}  # fmt: skip
CLASSIFIERS = {
    "resnet": "ResNetForImageClassification",
    "convnext": "ConvNextForImageClassification",
    "vit": "ViTForImageClassification",
    "dinov2": "Dinov2ForImageClassification",
}
BASES = {
    "resnet": "ResNetModel",
    "convnext": "ConvNextModel",
    "vit": "ViTModel",
    "dinov2": "Dinov2Model",
}


def save_classifier(model_type: str, folder: Path, num_labels: int = 3) -> Any:
    """A tiny random transformers classifier of `model_type`, saved as the Hub holds one."""
    torch.manual_seed(0)
    config = TINY[model_type]()
    config.num_labels = num_labels
    model = getattr(transformers, CLASSIFIERS[model_type])(config).eval()
    model.save_pretrained(folder)
    return model


def head_of(model: Any) -> nn.Linear:
    classifier = model.classifier
    return classifier[1] if isinstance(classifier, nn.Sequential) else classifier


@pytest.mark.parametrize("model_type", list(TINY))
def test_a_hugging_face_classifier_folder_gives_its_logits(model_type: str, tmp_path: Path) -> None:
    """The backbone with transformers' head copied onto the new one gives the classifier's
    logits: the same weights, the same features, at another image size too."""
    reference = save_classifier(model_type, tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    net = BackboneClassifier(hugging_face_backbone(str(tmp_path), **IMAGENET), num_classes=3)
    net.head[1].load_state_dict(head_of(reference).state_dict())
    net.eval()
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(net(images), reference(pixel_values=images).logits)
        if model_type != "vit":  # ViT's classifier takes only its own size
            larger = torch.randn(1, 3, 48, 48)
            torch.testing.assert_close(net(larger), reference(pixel_values=larger).logits)


@pytest.mark.parametrize("model_type", list(TINY))
def test_a_hugging_face_base_model_folder_gives_its_features(
    model_type: str, tmp_path: Path
) -> None:
    torch.manual_seed(1)
    model = getattr(transformers, BASES[model_type])(TINY[model_type]()).eval()
    model.save_pretrained(tmp_path)
    backbone = hugging_face_backbone(str(tmp_path), **IMAGENET)
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        output = model(pixel_values=images)
        tokens = output.last_hidden_state
        expected = {
            "resnet": lambda: output.pooler_output.flatten(1),
            "convnext": lambda: output.pooler_output,
            "vit": lambda: tokens[:, 0],
            "dinov2": lambda: torch.cat([tokens[:, 0], tokens[:, 1:].mean(1)], dim=1),
        }[model_type]()
        torch.testing.assert_close(backbone(images), expected)
    assert backbone.num_features == expected.shape[1]


def test_pretrained_false_builds_the_architecture_without_weights(tmp_path: Path) -> None:
    save_classifier("resnet", tmp_path)
    (tmp_path / "model.safetensors").unlink()
    backbone = hugging_face_backbone(str(tmp_path), pretrained=False)
    assert backbone(torch.randn(1, 3, 16, 16)).shape == (1, 16)


def rewrite_config(folder: Path, **changes: Any) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))


def hostile(folder: Path, case: str) -> None:
    """Make a good folder (a saved ResNet classifier) bad in one way."""
    weights = folder / "model.safetensors"
    if case == "unknown model_type":
        rewrite_config(folder, model_type="swin")
    elif case == "pickled weights only":
        weights.unlink()
        (folder / "pytorch_model.bin").write_bytes(b"\x80\x04 never unpickled")
    elif case == "weights of other shapes":
        rewrite_config(folder, hidden_sizes=[8, 32])
    elif case == "weights renamed":
        tensors = load_file(weights)
        name = next(n for n in tensors if "convolution" in n)
        tensors[name.replace("convolution", "convolutions")] = tensors.pop(name)
        save_file(tensors, weights)
    elif case == "NaN weights":
        tensors = load_file(weights)
        next(iter(v for v in tensors.values() if v.is_floating_point())).fill_(float("nan"))
        save_file(tensors, weights)
    elif case == "truncated weights":
        weights.write_bytes(weights.read_bytes()[:100])
    elif case == "config too large":
        rewrite_config(folder, padding="x" * (1 << 20))
    elif case == "config not JSON":
        (folder / "config.json").write_text("{model_type: resnet")
    elif case == "a size of the wrong kind":
        rewrite_config(folder, hidden_sizes="big")
    elif case == "grey images":
        rewrite_config(folder, num_channels=1)
    elif case == "config not a file":
        (folder / "config.json").unlink()
        (folder / "config.json").mkdir()
    elif case == "other normalization":
        (folder / "preprocessor_config.json").write_text(
            json.dumps({"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]})
        )
    elif case == "a bad preprocessor":
        (folder / "preprocessor_config.json").write_text(json.dumps({"image_mean": [0.5]}))


HOSTILE = {
    "unknown model_type": "is a Hugging Face 'swin' model",
    "pickled weights only": "only as pytorch_model.bin, a pickle",
    "weights of other shapes": "describes one of",
    "weights renamed": "does not hold the model its config.json describes",
    "NaN weights": "NaN or infinite",
    "truncated weights": "not a readable safetensors file",
    "config too large": "larger than 1 MiB",
    "config not JSON": "is not JSON",
    "a size of the wrong kind": "hidden_sizes=big",
    "grey images": "num_channels=1",
    "config not a file": "has no config.json",
    "other normalization": "add data.mean=[0.5,0.5,0.5] data.std=[0.5,0.5,0.5]",
    "a bad preprocessor": "image_mean=[0.5]",
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_folder_is_one_error_line(
    case: str, tmp_path: Path, train_config: ComposeFn
) -> None:
    """Built as every command builds a model (targets.build), nothing is run or unpickled."""
    folder = tmp_path / "backbone"
    save_classifier("resnet", folder)
    hostile(folder, case)
    cfg = train_config(
        "experiment=image_folder_pretrained", f"model.backbone.path={folder}",
        f"data.root={tmp_path}", "data.num_classes=3",
    )  # fmt: skip
    with pytest.raises(ConfigError) as raised:
        build(cfg.model, where="model")
    message = str(raised.value)
    assert HOSTILE[case] in message and "\n" not in message, message


def test_the_data_normalization_the_folder_names_builds(
    tmp_path: Path, train_config: ComposeFn
) -> None:
    folder = tmp_path / "backbone"
    save_classifier("vit", folder)
    hostile(folder, "other normalization")
    cfg = train_config(
        "experiment=image_folder_pretrained", f"model.backbone.path={folder}",
        f"data.root={tmp_path}", "data.num_classes=3", "data.mean=[0.5,0.5,0.5]",
        "data.std=[0.5,0.5,0.5]",
    )  # fmt: skip
    model = build(cfg.model, where="model")
    assert isinstance(model.net, BackboneClassifier) and model.net.head[1].out_features == 3


@pytest.mark.slow
def test_a_hostile_folder_on_the_command_line_is_one_line_and_leaves_no_run(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "backbone"
    save_classifier("resnet", folder)
    hostile(folder, "weights of other shapes")
    images = tmp_path / "images"
    write_shapes(images, DOWNSTREAM, per_class=2, seed=0)
    result = run_cli(
        "-m", PACKAGE, "experiment=image_folder_pretrained", f"model.backbone.path={folder}",
        f"data.root={images}", "data.num_classes=3", "trainer=cpu", "logger=csv",
        "extras.print_config=false", "run_name=hostile", cwd=tmp_path,
    )  # fmt: skip
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and lines[-1].startswith("error: model.backbone.path="), (
        result.stderr[-3000:]
    )
    assert not (tmp_path / "logs" / "train" / "runs" / "hostile").exists()


def classifier(tmp_path: Path, **settings: Any) -> ImageClassifier:
    save_classifier("resnet", tmp_path)
    optimizer = _partial(torch.optim.AdamW, lr=0.01, weight_decay=0.05)
    return ImageClassifier(
        optimizer=optimizer,
        backbone=hugging_face_backbone(str(tmp_path), **IMAGENET),
        num_classes=4,
        **settings,
    )


def _partial(function: Any, **keywords: Any) -> Any:
    import functools

    return functools.partial(function, **keywords)


def test_a_frozen_backbone_keeps_its_weights_and_statistics(tmp_path: Path) -> None:
    model = classifier(tmp_path, freeze_backbone=True)
    before = {k: v.clone() for k, v in model.net.backbone.state_dict().items()}
    head = model.net.head[1].weight.clone()
    optimizer = configure_optimizers(model.net, model.scaled_optimizer(), None, 10)["optimizer"]
    model.train()
    assert not model.net.backbone.training, "the frozen backbone stays in eval mode"
    for _ in range(3):
        loss = nn.functional.cross_entropy(model(torch.randn(4, 3, 16, 16)), torch.arange(4))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    after = model.net.backbone.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "weights and BN statistics"
    assert not torch.equal(head, model.net.head[1].weight)
    trained = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert trained == {id(p) for p in model.net.head.parameters()}


def test_the_backbone_learns_at_its_own_learning_rate(tmp_path: Path) -> None:
    model = classifier(tmp_path, backbone_lr_scale=0.1)
    optimizer = configure_optimizers(model.net, model.scaled_optimizer(), None, 10)["optimizer"]
    rates = {group["name"]: group["lr"] for group in optimizer.param_groups}
    assert rates == pytest.approx({
        "head/decay": 0.01, "head/no_decay": 0.01,
        "backbone/decay": 0.001, "backbone/no_decay": 0.001,
    })  # fmt: skip
    decay = {g["name"]: g["weight_decay"] for g in optimizer.param_groups}
    assert decay["backbone/decay"] == 0.05 and decay["backbone/no_decay"] == 0.0
    grouped = [p for group in optimizer.param_groups for p in group["params"]]
    assert len(grouped) == len(list(model.parameters())) == len({id(p) for p in grouped})


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.backbone_lr_scale=-1"], "model.backbone_lr_scale=-1"),
        (["model.freeze_backbone=maybe"], "model.freeze_backbone='maybe'"),
    ],
)
def test_bad_backbone_settings_are_one_line(
    overrides: list[str], message: str, tmp_path: Path, train_config: ComposeFn
) -> None:
    folder = tmp_path / "backbone"
    save_classifier("resnet", folder)
    cfg = train_config(
        "experiment=image_folder_pretrained", f"model.backbone.path={folder}",
        f"data.root={tmp_path}", *overrides,
    )  # fmt: skip
    with pytest.raises(ConfigError, match=re.escape(message)):
        build(cfg.model, where="model")


def test_a_net_and_a_backbone_are_not_both_given(tmp_path: Path) -> None:
    save_classifier("resnet", tmp_path)
    with pytest.raises(ValueError, match="both are set"):
        ImageClassifier(
            optimizer=_partial(torch.optim.AdamW),
            net=nn.Linear(2, 2),
            backbone=hugging_face_backbone(str(tmp_path), **IMAGENET),
        )


# timm by name: skipped where timm or a torchvision built for this torch does not import (run them
# where `make install VISION=1` installed both: pytest -m timm).


@pytest.fixture
def timm() -> Any:
    try:
        import timm
    except Exception as error:  # ImportError, or a torchvision built for another torch
        reason = (str(error).strip().splitlines() or [type(error).__name__])[-1]
        pytest.skip(
            f"timm with a torchvision built for this torch does not import here ({reason}): run "
            "pytest -m timm where make install VISION=1 installed them"
        )
    return timm


def saved_timm(timm: Any, name: str, file: Path) -> Any:
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, num_classes=5).eval()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, file)
    return model


@pytest.mark.timm
def test_a_timm_model_with_local_weights_gives_its_pooled_features(
    timm: Any, tmp_path: Path
) -> None:
    from {{ cookiecutter.package_name }}.checkpointing.timm_backbones import (
        timm_backbone,
    )

    source = saved_timm(timm, "resnet18", tmp_path / "model.safetensors")
    backbone = timm_backbone(
        "resnet18", pretrained=False, weights=str(tmp_path / "model.safetensors"), **IMAGENET
    ).eval()
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        expected = source.forward_head(source.forward_features(images), pre_logits=True)
        torch.testing.assert_close(backbone(images), expected)
    assert backbone.num_features == expected.shape[1] == 512


@pytest.mark.timm
@pytest.mark.parametrize(
    ("name", "weights_of", "normalization", "message"),
    [
        ("resnet18", "resnet34", IMAGENET, "does not hold the weights of this timm model"),
        ("not_a_model_name", None, IMAGENET, "is not a timm model"),
        ("vit_tiny_patch16_224.augreg_in21k", "vit_tiny_patch16_224.augreg_in21k", IMAGENET,
         "add data.mean=[0.5,0.5,0.5] data.std=[0.5,0.5,0.5]"),
    ],
)  # fmt: skip
def test_bad_timm_settings_are_one_line(
    timm: Any,
    name: str,
    weights_of: str | None,
    normalization: dict[str, Any],
    message: str,
    tmp_path: Path,
) -> None:
    from {{ cookiecutter.package_name }}.checkpointing.timm_backbones import (
        timm_backbone,
    )

    file = tmp_path / "model.safetensors"
    if weights_of is not None:
        saved_timm(timm, weights_of, file)
    with pytest.raises(ConfigError) as raised:
        timm_backbone(
            name, pretrained=False, weights=str(file) if weights_of else None, **normalization
        )
    assert message in str(raised.value) and "\n" not in str(raised.value), raised.value


@pytest.mark.timm
def test_a_timm_backbone_trains_by_the_documented_command(timm: Any, tmp_path: Path) -> None:
    images = tmp_path / "images"
    write_shapes(images, DOWNSTREAM, per_class=10, seed=0)
    result = run_cli(
        "-m", PACKAGE, "experiment=image_folder_pretrained", "model/backbone=timm",
        "model.backbone.name=resnet18", "model.backbone.pretrained=false", f"data.root={images}",
        "data.num_classes=3", "data.image_size=32", "trainer.max_epochs=1", "logger=csv",
        "extras.print_config=false", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert 0 <= metrics["test/acc"] <= 1


class StandInTimm:
    """What timm_backbone uses of timm (is_model, create_model), for its own logic where timm does
    not import: a linear "model" with a classifier `fc` and a pretrained config."""

    def __init__(self, mean: tuple[float, ...] = IMAGENET_MEAN, fails: bool = False) -> None:
        self.mean, self.fails = mean, fails

    def is_model(self, name: str) -> bool:
        return name == "stand_in"

    def create_model(self, name: str, pretrained: bool, num_classes: int) -> nn.Module:
        if self.fails:
            raise OSError("We couldn't connect to 'https://huggingface.co'\nmore")
        model = nn.Sequential(nn.Flatten(), nn.Linear(12, 6))
        model.num_features = 6  # type: ignore[assignment]
        model.pretrained_cfg = {"mean": self.mean, "std": IMAGENET_STD, "classifier": "fc"}  # type: ignore[assignment]
        return model


def test_timm_backbone_reads_local_weights_through_the_door(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from {{ cookiecutter.package_name }}.checkpointing import (
        timm_backbones,
    )

    monkeypatch.setattr(timm_backbones, "import_timm", StandInTimm)
    file = tmp_path / "model.safetensors"
    weights = {
        "1.weight": torch.randn(6, 12),
        "1.bias": torch.randn(6),
        "fc.weight": torch.ones(2, 6),
    }
    save_file(weights, file)
    backbone = timm_backbones.timm_backbone("stand_in", weights=str(file), **IMAGENET)
    torch.testing.assert_close(backbone.model[1].weight, weights["1.weight"])
    assert backbone.num_features == 6
    save_file({**weights, "1.weight": torch.randn(6, 4)}, file)
    with pytest.raises(ConfigError, match=r"other shape: 1\.weight"):
        timm_backbones.timm_backbone("stand_in", weights=str(file), **IMAGENET)


@pytest.mark.parametrize(
    ("timm", "message"),
    [
        (StandInTimm(mean=(0.5, 0.5, 0.5)), "add data.mean=[0.5,0.5,0.5] data.std="),
        (StandInTimm(fails=True), "timm cannot build it (We couldn't connect"),
    ],
)
def test_bad_timm_backbones_are_one_line(
    timm: StandInTimm, message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from {{ cookiecutter.package_name }}.checkpointing import (
        timm_backbones,
    )

    monkeypatch.setattr(timm_backbones, "import_timm", lambda: timm)
    with pytest.raises(ConfigError) as raised:
        timm_backbones.timm_backbone("stand_in", pretrained=True, **IMAGENET)
    assert message in str(raised.value) and "\n" not in str(raised.value), raised.value


def test_timm_that_does_not_import_is_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, train_config: ComposeFn
) -> None:
    monkeypatch.setitem(sys.modules, "timm", None)  # as where timm is not installed
    cfg = train_config(
        "experiment=image_folder_pretrained", "model/backbone=timm", f"data.root={tmp_path}"
    )
    with pytest.raises(ConfigError, match="make install VISION=1"):
        build(cfg.model, where="model")


# Pretraining on other images, then fine-tuning by the documented command.

PRETRAINING = {"ring": (220, 40, 40), "cross": (40, 200, 40), "bar": (200, 200, 200)}
DOWNSTREAM = {"disc": (40, 80, 230), "square": (230, 200, 30), "triangle": (200, 60, 200)}
SIZE = 32


def draw(shape: str, colour: tuple[int, int, int], generator: torch.Generator) -> Image.Image:
    """One shape at a random place and size on a dark, noisy background."""
    noise = torch.randint(0, 60, (SIZE, SIZE, 3), generator=generator, dtype=torch.uint8)
    image = Image.fromarray(noise.numpy(), "RGB")
    canvas = ImageDraw.Draw(image)
    half = int(torch.randint(6, 11, (1,), generator=generator))
    x, y = (int(v) for v in torch.randint(half, SIZE - half, (2,), generator=generator))
    box = (x - half, y - half, x + half, y + half)
    if shape in ("disc", "ring"):
        canvas.ellipse(box, fill=colour if shape == "disc" else None, outline=colour, width=2)
    elif shape == "square":
        canvas.rectangle(box, fill=colour)
    elif shape == "triangle":
        canvas.polygon([(x, y - half), (x - half, y + half), (x + half, y + half)], fill=colour)
    elif shape == "cross":
        canvas.line((x - half, y, x + half, y), fill=colour, width=3)
        canvas.line((x, y - half, x, y + half), fill=colour, width=3)
    else:
        canvas.rectangle((x - half, y - 2, x + half, y + 2), fill=colour)
    return image


def write_shapes(
    root: Path, classes: dict[str, tuple[int, int, int]], per_class: int, seed: int
) -> None:
    generator = torch.Generator().manual_seed(seed)
    for shape, colour in classes.items():
        (root / shape).mkdir(parents=True)
        for index in range(per_class):
            draw(shape, colour, generator).save(root / shape / f"{index}.png")


def shape_tensors(
    classes: dict[str, tuple[int, int, int]], per_class: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Images normalized as the backbone's folder says (no preprocessor_config.json: ImageNet's)."""
    generator = torch.Generator().manual_seed(1)
    images, labels = [], []
    for label, (shape, colour) in enumerate(classes.items()):
        for _ in range(per_class):
            pixels = torch.tensor(
                list(draw(shape, colour, generator).getdata()), dtype=torch.float32
            )
            images.append(pixels.reshape(SIZE, SIZE, 3).permute(2, 0, 1) / 255)
            labels.append(label)
    mean, std = (
        torch.tensor(IMAGENET_MEAN)[:, None, None],
        torch.tensor(IMAGENET_STD)[:, None, None],
    )
    return (torch.stack(images) - mean) / std, torch.tensor(labels)


def pretrain(folder: Path) -> float:
    """A small ResNet trained to tell other shapes in other colours apart, saved as a Hugging
    Face folder (config.json, model.safetensors); returns its training accuracy."""
    torch.manual_seed(0)
    config = transformers.ResNetConfig(
        embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic",
        num_labels=len(PRETRAINING),
    )  # fmt: skip
    model = transformers.ResNetForImageClassification(config)
    images, labels = shape_tensors(PRETRAINING, per_class=100)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _epoch in range(6):
        for batch in torch.randperm(len(labels)).split(32):
            loss = nn.functional.cross_entropy(
                model(pixel_values=images[batch]).logits, labels[batch]
            )
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    model.eval()
    with torch.no_grad():
        accuracy = (model(pixel_values=images).logits.argmax(1) == labels).float().mean().item()
    model.save_pretrained(folder)
    return accuracy


@pytest.mark.slow
def test_a_backbone_pretrained_on_other_images_fine_tunes_by_the_documented_command(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "checkpoints" / "shapes-resnet"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core, as the run below: threads waiting on a busy machine
    try:
        assert pretrain(folder) > 0.9
    finally:
        torch.set_num_threads(threads)
    assert (folder / "model.safetensors").is_file() and not (folder / "pytorch_model.bin").exists()
    images = tmp_path / "images"
    write_shapes(images, DOWNSTREAM, per_class=50, seed=2)
    result = run_cli(
        "-m", PACKAGE, "experiment=image_folder_pretrained", f"model.backbone.path={folder}",
        f"data.root={images}", "data.num_classes=3", "data.image_size=32", "trainer=cpu",
        "logger=csv", "extras.print_config=false", f"hydra.run.dir={tmp_path / 'run'}",
        cwd=tmp_path, env={"OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["test/acc"] >= 0.9, metrics
