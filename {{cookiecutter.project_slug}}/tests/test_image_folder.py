"""The image-folder data module on real PNG and JPEG files: class folders or a CSV file read back
exactly, disjoint splits, augmentation seeded per (seed, epoch, sample) so that worker processes
and resumed runs see the same batches, one line for each bad input, and a training run."""

from __future__ import annotations

import csv
import io
import json
import logging
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image, ImageDraw

from {{ cookiecutter.package_name }}.data.image_folder import (
    ImageFileDataset,
    ImageFolderDataModule,
    SeededIndexSampler,
)
from {{ cookiecutter.package_name }}.errors import ConfigError

from .helpers import PACKAGE, PROJECT_ROOT, compose_config, run_cli
from .killing import (
    COMMON,
    References,
    assert_same_outcome,
    entry_point,
    fault,
    killed_then_finished,
)

CLASSES = ["ant", "bee", "cat", "dog", "eel", "fox", "gnu", "hen", "ibis", "jay"]
PER_CLASS = 4
SIZE = 8


def write_images(root: Path) -> dict[str, torch.Tensor]:
    """Ten class folders of four 8x8 RGB images each: PNG files of random pixels (kept, to compare
    with what is read back) and, every other one, a JPEG of another size."""
    generator = torch.Generator().manual_seed(0)
    written: dict[str, torch.Tensor] = {}
    for name in CLASSES:
        (root / name).mkdir(parents=True)
        for index in range(PER_CLASS):
            if index % 2:
                pixels = torch.randint(0, 256, (11, 13, 3), generator=generator, dtype=torch.uint8)
                Image.fromarray(pixels.numpy(), "RGB").save(root / name / f"{index}.jpg")
                continue
            pixels = torch.randint(0, 256, (SIZE, SIZE, 3), generator=generator, dtype=torch.uint8)
            path = root / name / f"{index}.png"
            Image.fromarray(pixels.numpy(), "RGB").save(path)
            written[str(path)] = pixels.permute(2, 0, 1)
    return written


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    root = tmp_path_factory.mktemp("images")
    return root, write_images(root)


def module(**settings: Any) -> ImageFolderDataModule:
    defaults: dict[str, Any] = dict(
        image_size=SIZE, num_classes=len(CLASSES), batch_size=4, num_workers=0,
        min_steps_per_epoch=None,
    )  # fmt: skip
    datamodule = ImageFolderDataModule(**{**defaults, **settings})
    datamodule.setup("fit")
    return datamodule


def split(datamodule: ImageFolderDataModule, name: str) -> ImageFileDataset:
    dataset = datamodule.splits[name]
    assert isinstance(dataset, ImageFileDataset)
    return dataset


def items(dataset: ImageFileDataset) -> list[tuple[str, torch.Tensor, int]]:
    return [(dataset.paths[i], *dataset[i]) for i in range(len(dataset))]


def every_item(datamodule: ImageFolderDataModule) -> list[tuple[str, torch.Tensor, int]]:
    return [item for name in ("train", "val", "test") for item in items(split(datamodule, name))]


def test_class_folders_read_back_exactly(folder: tuple[Path, dict[str, torch.Tensor]]) -> None:
    root, written = folder
    datamodule = module(root=str(root), augment=False)
    assert datamodule.classes == CLASSES and datamodule.num_classes == len(CLASSES)
    seen = every_item(datamodule)
    assert len(seen) == len(CLASSES) * PER_CLASS
    for path, image, label in seen:
        assert image.dtype == torch.uint8 and image.shape == (3, SIZE, SIZE)
        assert label == CLASSES.index(Path(path).parent.name)
        if path.endswith(".png"):
            assert torch.equal(image, written[path]), path
    grey = module(root=str(root), channels=1, augment=False)
    for path, image, _ in items(split(grey, "train")):
        assert image.shape == (1, SIZE, SIZE)
        if path.endswith(".png"):
            with Image.open(path) as picture:
                expected = torch.tensor(list(picture.convert("L").getdata()), dtype=torch.uint8)
            assert torch.equal(image.flatten(), expected), path


def test_splits_are_disjoint_and_cover_every_file(
    folder: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    root, _ = folder
    datamodule = module(root=str(root), val_fraction=0.1, test_fraction=0.2)
    splits = {name: set(split(datamodule, name).paths) for name in ("train", "val", "test")}
    assert [len(s) for s in splits.values()] == [28, 4, 8]
    assert not splits["train"] & splits["val"] and not splits["train"] & splits["test"]
    assert not splits["val"] & splits["test"]
    assert set.union(*splits.values()) == set(datamodule.paths)
    again = module(root=str(root), val_fraction=0.1, test_fraction=0.2)
    assert split(again, "val").paths == split(datamodule, "val").paths


def test_a_csv_file_of_paths_and_labels(
    folder: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    _, written = folder
    listing = tmp_path / "labels.csv"
    labels = {path: ("2", "10", "7")[index % 3] for index, path in enumerate(sorted(written))}
    with listing.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["path", "label"])
        for path, label in labels.items():
            # Relative to the CSV file's folder, which is another one.
            writer.writerow([os.path.relpath(path, tmp_path), label])
    datamodule = module(csv=str(listing), num_classes=3, augment=False)
    assert datamodule.classes == ["2", "7", "10"]
    seen = [(str(Path(path).resolve()), *rest) for path, *rest in every_item(datamodule)]
    assert sorted(path for path, _, _ in seen) == sorted(written)
    for path, image, label in seen:
        assert torch.equal(image, written[path])
        assert datamodule.classes[label] == labels[path]  # numbers sort as numbers: 2 before 10


def all_variants(image: torch.Tensor) -> list[torch.Tensor]:
    """Every crop of the image padded with one zero all round, flipped or not."""
    padded = torch.nn.functional.pad(image, (1, 1, 1, 1))
    crops = [
        padded[:, top : top + SIZE, left : left + SIZE] for top in range(3) for left in range(3)
    ]
    return crops + [crop.flip(-1) for crop in crops]


def test_augmentation_depends_only_on_seed_epoch_and_index(
    folder: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    root, written = folder
    datamodule = module(root=str(root), augment=True)
    train = split(datamodule, "train")
    assert train.augment and not split(datamodule, "val").augment
    epochs = {
        epoch: [train[(7, epoch, index)][0] for index in range(len(train))] for epoch in (0, 1)
    }
    again = [train[(7, 1, index)][0] for index in range(len(train))]
    assert all(torch.equal(a, b) for a, b in zip(epochs[1], again, strict=True))
    differ = sum(not torch.equal(a, b) for a, b in zip(epochs[0], epochs[1], strict=True))
    assert differ >= len(train) // 2, "most samples should be cropped or flipped differently"
    other_seed = [train[(8, 1, index)][0] for index in range(len(train))]
    assert any(not torch.equal(a, b) for a, b in zip(epochs[1], other_seed, strict=True))
    for index, path in enumerate(train.paths):
        if path in written:
            variants = all_variants(written[path])
            assert any(torch.equal(epochs[0][index], v) for v in variants), path


def augmented(datamodule: ImageFolderDataModule, epochs: int = 4) -> list[tuple[str, torch.Tensor]]:
    """Each training sample's path and image, in each of `epochs` epochs."""
    train = split(datamodule, "train")
    return [
        (path, train[(7, epoch, index)][0])
        for epoch in range(epochs)
        for index, path in enumerate(train.paths)
    ]


def test_augmentation_parts_are_chosen_in_the_config(
    folder: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    """crop only: a crop of the padded image, never mirrored; flip only: the image or its mirror,
    both seen; true: the default mapping's crop and flip, draw for draw; false, or both off:
    the image itself."""
    root, written = folder
    crops_only = augmented(module(root=str(root), augment={"crop": 0.125, "flip": False}))
    flips_only = augmented(module(root=str(root), augment={"crop": 0, "flip": True}))
    crops = {path: all_variants(written[path])[:9] for path in written}
    assert all(
        any(torch.equal(image, c) for c in crops[p]) for p, image in crops_only if p in crops
    )
    assert any(not torch.equal(image, written[p]) for p, image in crops_only if p in written)
    flipped = [torch.equal(image, written[p].flip(-1)) for p, image in flips_only if p in written]
    assert all(torch.equal(image, written[p]) or torch.equal(image, written[p].flip(-1))
               for p, image in flips_only if p in written)  # fmt: skip
    assert any(flipped) and not all(flipped)
    default = augmented(module(root=str(root), augment=True))
    mapping = augmented(module(root=str(root), augment={"crop": 0.125, "flip": True}))
    assert all(torch.equal(a[1], b[1]) for a, b in zip(default, mapping, strict=True))
    for off in (False, {"crop": 0, "flip": False}):
        datamodule = module(root=str(root), augment=off)
        assert split(datamodule, "train").augment is None
        assert all(
            torch.equal(image, written[p]) for p, image in augmented(datamodule, 1) if p in written
        )


def test_mean_and_std_normalize_each_channel(
    folder: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    """Given as the config gives them (lists of the config), kept as plain lists: a checkpoint
    of the data module's hyperparameters loads with weights_only=True."""
    root, _ = folder
    mean, std = [0.1, 0.2, 0.3], [0.5, 0.25, 2.0]
    datamodule = module(root=str(root), mean=OmegaConf.create(mean), std=OmegaConf.create(std))
    images, labels = next(iter(datamodule.val_dataloader()))
    scaled, _ = datamodule.on_after_batch_transfer((images, labels), 0)
    means, stds = torch.tensor(mean).view(-1, 1, 1), torch.tensor(std).view(-1, 1, 1)
    expected = (images.float() / 255 - means) / stds
    assert torch.allclose(scaled, expected)
    buffer = io.BytesIO()
    torch.save(dict(datamodule.hparams), buffer)
    buffer.seek(0)
    stored = torch.load(buffer, weights_only=True)
    assert stored["mean"] == mean and stored["std"] == std
    grey = module(root=str(root), channels=1, mean=[0.25], std=[0.5], augment=False)
    images, labels = next(iter(grey.val_dataloader()))
    scaled, _ = grey.on_after_batch_transfer((images, labels), 0)
    assert torch.allclose(scaled, (images.float() / 255 - 0.25) / 0.5)
    one_for_all = module(root=str(root), mean=[0.25], std=[0.5])
    assert one_for_all.mean == [0.25] * 3 and one_for_all.std == [0.5] * 3


def test_an_epoch_of_few_steps_gets_smaller_batches_and_one_line(
    folder: tuple[Path, dict[str, torch.Tensor]], caplog: pytest.LogCaptureFixture
) -> None:
    """28 training images in batches of 64 would train on none (the ragged batch is dropped)."""
    root, _ = folder
    with caplog.at_level(logging.WARNING):
        capped = module(root=str(root), batch_size=64, min_steps_per_epoch=7)
        capped.setup("fit")  # a second setup (Lightning's, after the checks') says nothing more
    assert capped.batch_size == 4 and len(capped.train_dataloader()) == 7
    (line,) = [r.getMessage() for r in caplog.records if "min_steps_per_epoch" in r.getMessage()]
    assert line.startswith("data.batch_size=64 makes an epoch 0 steps of the 28 training images")
    assert "batches of 4 instead, 7 steps an epoch" in line and "null keeps" in line
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        enough = module(root=str(root), batch_size=4, min_steps_per_epoch=7)
    assert enough.batch_size == 4 and not caplog.records
    kept = module(root=str(root), batch_size=8, min_steps_per_epoch=None)
    assert kept.batch_size == 8 and len(kept.train_dataloader()) == 3
    message = one_line_error(
        "data.batch_size=64 is more than the 28 training images",
        root=str(root), batch_size=64, min_steps_per_epoch=None,
    )  # fmt: skip
    assert "data.min_steps_per_epoch" in message


def test_the_class_names_travel_in_the_checkpoint(
    folder: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    """Stored as plain strings (weights_only loads them); on loading, only a list of as many
    strings replaces the names found."""
    root, _ = folder
    state = module(root=str(root)).state_dict()
    buffer = io.BytesIO()
    torch.save({"ImageFolderDataModule": state}, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True)["ImageFolderDataModule"] == {"classes": CLASSES}
    renamed = [name.upper() for name in CLASSES]
    datamodule = module(root=str(root))
    datamodule.load_state_dict({"classes": renamed})
    assert datamodule.classes == renamed
    for hostile in ({"classes": list(range(10))}, {"classes": "ABCDEFGHIJ"}, {"classes": ["a"]},
                    {"other": 1}, {"classes": [*CLASSES[:9], None]}):  # fmt: skip
        untouched = module(root=str(root))
        untouched.load_state_dict(hostile)
        assert untouched.classes == CLASSES, hostile


def flat(images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A batch as one tensor, to compare batches with."""
    return torch.cat([images.flatten(), labels])


def epoch_batches(datamodule: ImageFolderDataModule, epochs: int) -> list[list[torch.Tensor]]:
    """The training batches of each epoch, from one loader (persistent workers, if any)."""
    loader = datamodule.train_dataloader()
    assert isinstance(loader.sampler, SeededIndexSampler)
    batches = []
    for epoch in range(epochs):
        loader.sampler.set_epoch(epoch)
        batches.append([flat(images, labels) for images, labels in loader])
    return batches


def sampled_batches(datamodule: ImageFolderDataModule, epoch: int) -> list[torch.Tensor]:
    """The batches an epoch should hold: the sampler's (seed, epoch, index) keys, fetched one by
    one from the training split."""
    sampler = datamodule.sampler("train")
    assert isinstance(sampler, SeededIndexSampler)
    sampler.set_epoch(epoch)
    keys = list(sampler)
    assert {key[:2] for key in keys} == {(3, epoch)}
    train, size = split(datamodule, "train"), datamodule.batch_size
    batches = [keys[start : start + size] for start in range(0, len(keys) - size + 1, size)]
    return [
        flat(torch.stack([train[k][0] for k in batch]), torch.tensor([train[k][1] for k in batch]))
        for batch in batches
    ]


def test_workers_decode_and_augment_as_the_main_process_does(
    folder: tuple[Path, dict[str, torch.Tensor]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two epochs through one loader each: in the main process, and in two persistent workers,
    which must see each epoch's keys (a Dataset copied into a worker would not)."""
    monkeypatch.setenv("PL_GLOBAL_SEED", "3")
    root, _ = folder
    in_process = epoch_batches(module(root=str(root)), epochs=2)
    in_workers = epoch_batches(module(root=str(root), num_workers=2), epochs=2)
    assert len(in_process[0]) == 7
    for epoch in range(2):
        expected = sampled_batches(module(root=str(root)), epoch)
        for batches in (in_process[epoch], in_workers[epoch]):
            assert all(torch.equal(a, b) for a, b in zip(expected, batches, strict=True)), epoch
    assert not torch.equal(torch.stack(in_process[0]), torch.stack(in_process[1]))


def test_a_resumed_epoch_sees_the_rest_of_the_same_batches(
    folder: tuple[Path, dict[str, torch.Tensor]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PL_GLOBAL_SEED", "3")
    root, _ = folder
    datamodule = module(root=str(root))
    (_, whole) = epoch_batches(datamodule, epochs=2)
    loader = datamodule.train_dataloader()
    assert isinstance(loader.sampler, SeededIndexSampler)
    loader.sampler.set_epoch(1)
    loader.sampler.skip = 3 * datamodule.batch_size
    rest = [flat(images, labels) for images, labels in loader]
    assert all(torch.equal(a, b) for a, b in zip(whole[3:], rest, strict=True))
    assert len(rest) == len(whole) - 3


def test_batches_are_scaled_on_the_device_side(
    folder: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    root, _ = folder
    datamodule = module(root=str(root), channels_last=True)
    images, labels = next(iter(datamodule.train_dataloader()))
    scaled, same = datamodule.on_after_batch_transfer((images, labels), 0)
    assert scaled.dtype == torch.float32 and same is labels
    assert float(scaled.min()) >= -0.5 and float(scaled.max()) <= 0.5
    assert scaled.is_contiguous(memory_format=torch.channels_last)
    assert torch.allclose(scaled, images.float() / 255 - 0.5)


def test_image_files_for_predict_read_as_training_images(
    folder: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    root, written = folder
    datamodule = module(root=str(root), augment=False)
    paths = sorted(written)[:3]
    images = datamodule.images_from_files([Path(p) for p in paths])
    assert torch.equal(images, torch.stack([written[p] for p in paths]))


def one_line_error(match: str, **settings: Any) -> str:
    with pytest.raises(ConfigError, match=match) as caught:
        module(**settings)
    message = str(caught.value)
    assert "\n" not in message, message
    return message


def test_a_file_that_does_not_decode_is_named_in_one_line(tmp_path: Path) -> None:
    write_images(tmp_path)
    (tmp_path / "cat" / "x.png").write_bytes(b"not an image")
    one_line_error(r"cannot read .*cat/x\.png as an image", root=str(tmp_path))
    unchecked = module(root=str(tmp_path), verify_images=False, augment=False)
    datasets = [split(unchecked, name) for name in ("train", "val", "test")]
    dataset, index = next(
        (d, i) for d in datasets for i, p in enumerate(d.paths) if p.endswith("x.png")
    )
    with pytest.raises(ConfigError, match=r"cannot read .*x\.png as an image"):
        dataset[index]


@pytest.mark.parametrize("logger", ["csv"{% if cookiecutter.logger == "wandb" %}, "wandb"{% endif %}])
def test_a_run_on_a_file_that_does_not_decode_is_one_line_and_leaves_no_run_folder(
    tmp_path: Path, logger: str
) -> None:
    """Found while the data module sets up, after the loggers started in the run folder."""
    root = tmp_path / "images"
    write_images(root)
    (root / "cat" / "x.png").write_bytes(b"not an image")
    result = run_cli(
        "-m", PACKAGE, "experiment=image_folder", f"data.root={root}", "trainer=cpu",
        f"logger={logger}", "extras.print_config=false", "run_name=bad", cwd=tmp_path,
{%- if cookiecutter.logger == "wandb" %}
        env={"WANDB_MODE": "offline"},
{%- endif %}
    )  # fmt: skip
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and lines[-1].startswith("error: "), result.stderr[-3000:]
    assert "x.png as an image" in lines[-1]
    assert not (tmp_path / "logs" / "train" / "runs" / "bad").exists()


def test_images_too_small_for_the_network_are_one_line_and_leave_no_run_folder(
    tmp_path: Path,
) -> None:
    root = tmp_path / "images"
    write_images(root)
    result = run_cli(
        "-m", PACKAGE, "experiment=image_folder", f"data.root={root}", "data.image_size=2",
        "trainer=cpu", "logger=csv", "extras.print_config=false", "run_name=small", cwd=tmp_path,
    )  # fmt: skip
    (line,) = result.stderr.strip().splitlines()
    assert result.returncode == 1 and line.startswith("error: data.image_size=2 is smaller")
    assert not (tmp_path / "logs").exists()


def test_bad_settings_get_one_line(
    folder: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    root, _ = folder
    message = one_line_error("holds 10 classes", root=str(root), num_classes=5)
    assert "data.num_classes=5" in message and "set data.num_classes=10" in message
    one_line_error("give one of data.root", num_classes=10)
    one_line_error("both are set", root=str(root), csv=str(root / "x.csv"))
    one_line_error("is not a folder", root=str(tmp_path / "missing"))
    (tmp_path / "flat").mkdir()
    Image.new("RGB", (4, 4)).save(tmp_path / "flat" / "a.png")
    one_line_error("has no subfolders", root=str(tmp_path / "flat"))
    (tmp_path / "flat" / "empty").mkdir()
    one_line_error("the class folder empty holds no image files", root=str(tmp_path / "flat"))
    one_line_error("use 1 .grey. or 3", root=str(root), channels=2)
    one_line_error(
        r"data.augment='yes': use true, false or a mapping", root=str(root), augment="yes"
    )
    one_line_error("data.augment has no key rotate: its keys are crop, flip",
                   root=str(root), augment={"rotate": 1})  # fmt: skip
    one_line_error("data.augment.crop=0.9: use a fraction", root=str(root), augment={"crop": 0.9})
    one_line_error(
        "data.augment.flip='no': use true or false", root=str(root), augment={"flip": "no"}
    )
    one_line_error(r"data.mean=\[0.5, 0.5\]: use a list of 3 finite numbers",
                   root=str(root), mean=[0.5, 0.5])  # fmt: skip
    one_line_error("data.std=.*: use a list of 3 numbers above 0", root=str(root), std=[1, 0, 1])
    one_line_error("data.mean=.*finite", root=str(root), mean=[float("nan")])
    one_line_error("data.min_steps_per_epoch=0", root=str(root), min_steps_per_epoch=0)
    one_line_error("leave nothing to train on", root=str(root), val_fraction=0.5, test_fraction=0.5)
    listing = tmp_path / "list.csv"
    listing.write_text("file,class\na.png,x\n")
    one_line_error("header row naming the columns path and label", csv=str(listing))
    listing.write_text("path,label\nmissing.png,x\n")
    one_line_error(r"line 2: .*missing\.png is not a file", csv=str(listing))


def test_a_training_run_on_an_image_folder(
    folder: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    root, _ = folder
    result = run_cli(
        "-m", PACKAGE, "experiment=image_folder", f"data.root={root}", "trainer=cpu",
        "logger=csv", "trainer.max_epochs=1", "extras.print_config=false",
        "data.batch_size=8", "data.num_workers=2", "data.min_steps_per_epoch=null",
        f"hydra.run.dir={tmp_path / 'run'}",
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert 0 <= metrics["val/acc"] <= 1 and 0 <= metrics["test/acc"] <= 1


@pytest.mark.slow
def test_a_run_on_an_image_folder_killed_mid_epoch_finishes_exactly(
    folder: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path, reference_run: References
) -> None:
    """Seven batches an epoch, augmented, decoded by two workers; killed at step 10 (epoch 1),
    resumed from the step checkpoint of step 8: bitwise the batches and weights of a run that was
    not killed (early stopping ends both after epoch 1)."""
    root, _ = folder
    run = [
        *COMMON, "experiment=image_folder", f"data.root={root}", f"data.image_size={SIZE}",
        "data.batch_size=4", "data.min_steps_per_epoch=null", "data.num_workers=2",
        "trainer.max_epochs=3",
        "trainer.limit_val_batches=1", "trainer.limit_test_batches=1",
        "callbacks.step_checkpoint.every_n_train_steps=4",
    ]  # fmt: skip
    killed_then_finished([*run, *fault("train_step", 10, tmp_path / "fired")], tmp_path / "run")
    assert_same_outcome(reference_run(run), tmp_path / "run")


def test_the_experiment_sets_only_what_any_image_model_takes(tmp_path: Path) -> None:
    """A model config of the user's own composes with experiment=image_folder and gets only its
    classes from the data, its network untouched; so does the pretrained backbone's model, which
    has no `net`; the ConvNet takes the data's channels itself and keeps its own widths and
    memory layout."""
    (tmp_path / "configs" / "model").mkdir(parents=True)
    (tmp_path / "configs" / "model" / "mine.yaml").write_text(
        f"_target_: {PACKAGE}.models.image_classifier.ImageClassifier\n"
        "net:\n"
        f"  _target_: {PACKAGE}.models.nets.convnet.ConvNet\n"
        "  num_classes: ${model.num_classes}\n"
    )
    given = ["experiment=image_folder", "data.root=images", "data.num_classes=3"]
    search = f"hydra.searchpath=[file://{tmp_path / 'configs'}]"
    mine = compose_config("train", [*given, "model=mine", search], tmp_path)
    assert set(mine.model) == {"_target_", "net", "num_classes"}
    assert set(mine.model.net) == {"_target_", "num_classes"}
    assert mine.model.num_classes == 3 and mine.model.net.num_classes == 3
    assert mine.data.channels_last is False
    backbone = compose_config("train", [*given, "model=backbone_classifier"], tmp_path)
    assert "net" not in backbone.model and backbone.model.num_classes == 3
    convnet = compose_config(
        "train", [*given, "data.channels=1", "model.net.channels_last=true"], tmp_path
    )
    assert list(convnet.model.net.channels) == [32, 64]  # configs/model/digits_convnet.yaml's
    assert convnet.model.net.in_channels == 1 and convnet.data.channels_last is True
    assert compose_config("train", given, tmp_path).model.net.in_channels == 3


SHAPES = ("circle", "square", "triangle")


def write_shapes(root: Path, per_class: int, seed: int) -> None:
    """48x48 PNG files, a class folder each: a light circle, square or triangle of random colour,
    size and place on a dark ground of random colour."""
    chance = torch.Generator().manual_seed(seed)

    def draw(low: int, high: int) -> int:
        return int(torch.randint(low, high, (), generator=chance))

    for shape in SHAPES:
        (root / shape).mkdir(parents=True)
        for index in range(per_class):
            image = Image.new("RGB", (48, 48), tuple(draw(0, 90) for _ in range(3)))
            colour = tuple(draw(140, 256) for _ in range(3))
            size = draw(18, 34)
            x, y = draw(2, 46 - size), draw(2, 46 - size)
            pen = ImageDraw.Draw(image)
            if shape == "circle":
                pen.ellipse((x, y, x + size, y + size), fill=colour)
            elif shape == "square":
                pen.rectangle((x, y, x + size, y + size), fill=colour)
            else:
                pen.polygon([(x, y + size), (x + size, y + size), (x + size // 2, y)], fill=colour)
            image.save(root / shape / f"{index}.png")


def documented_command() -> list[str]:
    """The arguments of the first image-folder training command in docs/data.md."""
    docs = (PROJECT_ROOT / "docs" / "data.md").read_text()
    start = f"{PACKAGE}-train experiment=image_folder data.root="
    return shlex.split(next(line for line in docs.splitlines() if line.startswith(start)))[1:]


@pytest.mark.slow
def test_the_documented_command_learns_a_small_folder_of_shapes(tmp_path: Path) -> None:
    """The docs' command on 150 images in 3 classes (105 to train on), from scratch, as a user
    runs it: the one line about smaller batches, and a test accuracy of 0.9 or more. predict then
    names the classes of new images as the checkpoint stores them (a class folder renamed since
    changes nothing)."""
    write_shapes(tmp_path / "images", per_class=50, seed=0)
    args = documented_command()
    assert "data.num_classes=3" in args, args
    args = [f"data.root={tmp_path / 'images'}" if a.startswith("data.root=") else a for a in args]
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path)}
    trained = subprocess.run(
        [sys.executable, *entry_point("train"), *args], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=1200, input="",
    )  # fmt: skip
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert (
        "data.batch_size=64 makes an epoch 1 step of the 105 training images: batches of 10 "
        "instead, 10 steps an epoch"
    ) in trained.stdout + trained.stderr
    (run,) = (tmp_path / "logs" / "train" / "runs").iterdir()
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["test/acc"] >= 0.9, metrics
    write_shapes(tmp_path / "new", per_class=6, seed=1)
    (tmp_path / "images" / "circle").rename(tmp_path / "images" / "ring")
    predicted = run_cli(
        *entry_point("predict"), f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}",
        f"inputs={tmp_path / 'new'}", "hydra.run.dir=predicted", cwd=tmp_path, env=env,
    )  # fmt: skip
    assert predicted.returncode == 0, predicted.stderr[-3000:]
    with (tmp_path / "predicted" / "predictions.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 18
    for row in rows:
        assert row["name"] == SHAPES[int(row["class"])]
        top = json.loads(row["top_names"])
        assert top[0] == row["name"] and sorted(top) == sorted(SHAPES)
    right = sum(row["name"] == Path(row["path"]).parent.name for row in rows)
    assert right >= 15, rows
