"""The image-folder data module on real PNG and JPEG files: class folders or a CSV file read back
exactly, disjoint splits, augmentation seeded per (seed, epoch, sample) so that worker processes
and resumed runs see the same batches, one line for each bad input, and a training run."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from {{ cookiecutter.package_name }}.data.image_folder import (
    ImageFileDataset,
    ImageFolderDataModule,
    SeededIndexSampler,
)
from {{ cookiecutter.package_name }}.errors import ConfigError

from .helpers import PACKAGE, run_cli
from .killing import COMMON, References, assert_same_outcome, fault, killed_then_finished

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
        image_size=SIZE, num_classes=len(CLASSES), batch_size=4, num_workers=0
    )
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
        "data.batch_size=8", "data.num_workers=2", f"hydra.run.dir={tmp_path / 'run'}",
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
        "data.batch_size=4", "data.num_workers=2", "trainer.max_epochs=3",
        "trainer.limit_val_batches=1", "trainer.limit_test_batches=1",
        "callbacks.step_checkpoint.every_n_train_steps=4",
    ]  # fmt: skip
    killed_then_finished([*run, *fault("train_step", 10, tmp_path / "fired")], tmp_path / "run")
    assert_same_outcome(reference_run(run), tmp_path / "run")
