"""Your own images: a folder with one subfolder per class, or a CSV file of `path,label` rows.

The files are found and counted per class when the data module is built, so a wrong folder or class
count fails before a run writes anything; with `verify_images`, `setup` opens every file once and
names the first one that does not decode. Pixels are decoded in the Dataset's `__getitem__`, so in
the DataLoader's worker processes, and travel as uint8 (a quarter of the bytes of float32) until
`on_after_batch_transfer` scales them on the accelerator.

Class ids follow the sorted class names: as numbers when every name is a whole number (`2` before
`10`), as text otherwise. Images are resized to `image_size` squares (bilinear, antialiased when
shrinking; the aspect ratio is not kept), after the rotation their EXIF data asks for.

Pixels are scaled to 0..1 and normalized per channel with `mean` and `std` (by default 0.5 and 1).
Augmentation (training split only, `augment`: a random crop of the image padded with zeros, a
horizontal flip half the time, or either) draws from a generator of its own for each sample,
seeded from the run's seed, the epoch and the sample's index. The training sampler hands all three to the Dataset with every
index, rather than the Dataset holding an epoch that a hook sets: the sampler lives in the main
process, where Lightning sets its epoch and `callbacks.ExactResume` tells it where to start, while
each worker holds a copy of the Dataset made when the worker started (persistent workers keep
theirs across epochs), so an epoch set on the Dataset would not reach them; and a worker's global
generator depends on which worker fetches a sample. So a sample looks the same with any number of
workers, on any rank, and in a run resumed mid-epoch: exact resume holds.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Iterator, Mapping, Sequence
from csv import DictReader
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image, ImageOps, UnidentifiedImageError
from torch.utils.data import Dataset, Sampler

from .base import ResumableSampler, SplitDataModule, check_fractions, split_indices
from .errors import ConfigError
from .folder_files import read_bounded
from .image_files import SUFFIXES, open_image

log = logging.getLogger(__name__)

MODES = {1: "L", 3: "RGB"}
CSV_LIMIT = 256 << 20  # bytes: ImageNet's 1.3 million training images take about 60 MiB of rows

# What the training sampler yields for each sample: (run seed, epoch, index in the split).
SampleKey = tuple[int, int, int]


def reason(error: Exception) -> str:
    """Why a file did not open or decode, in a few words, without repeating its path."""
    if isinstance(error, UnidentifiedImageError):
        return "not an image format that Pillow reads"
    strerror = getattr(error, "strerror", None)
    return strerror or (str(error).splitlines() or [type(error).__name__])[0]


def read_image(path: str | Path, size: int, channels: int) -> torch.Tensor:
    """(channels, size, size) uint8: turned as its EXIF data says, grey ("L") or RGB, resized."""
    with open_image(path) as opened:
        image = ImageOps.exif_transpose(opened)
    if "transparency" in image.info:
        image = image.convert("RGBA")  # palette transparency: converting it directly warns
    image = image.convert(MODES[channels])
    if image.size != (size, size):
        image = image.resize((size, size), Image.Resampling.BILINEAR)
    pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
    return pixels.reshape(size, size, channels).permute(2, 0, 1).contiguous()


@dataclass(frozen=True)
class Augmentation:
    """What training augmentation does to an image: `crop` pads each side with zeros by that
    fraction of the side (at least a pixel) and cuts a crop of the image's size from a random
    place (0: no crop); `flip` mirrors it left to right half the time."""

    crop: float = 0.125
    flip: bool = True


AUGMENTATION_KEYS = ("crop", "flip")


def augmentation(value: Any) -> Augmentation | None:
    """`data.augment` as an `Augmentation`, or None for none: true (crop and flip), false, or a
    mapping of `crop` and `flip` (a key left out is off)."""
    if isinstance(value, bool):
        return Augmentation() if value else None
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"data.augment={value!r}: use true, false or a mapping such as "
            "{crop: 0.125, flip: true}."
        )
    unknown = sorted(str(key) for key in value if key not in AUGMENTATION_KEYS)
    if unknown:
        raise ConfigError(
            f"data.augment has no key {unknown[0]}: its keys are {', '.join(AUGMENTATION_KEYS)}."
        )
    crop, flip = value.get("crop", 0), value.get("flip", False)
    if isinstance(crop, bool):
        crop = Augmentation.crop if crop else 0
    if not isinstance(crop, (int, float)) or not 0 <= crop <= 0.5:
        raise ConfigError(
            f"data.augment.crop={crop!r}: use a fraction of the side from 0 (no crop) to 0.5, "
            "or true (0.125) or false."
        )
    if not isinstance(flip, bool):
        raise ConfigError(f"data.augment.flip={flip!r}: use true or false.")
    chosen = Augmentation(crop=float(crop), flip=flip)
    return chosen if chosen.crop > 0 or chosen.flip else None


def augment(image: torch.Tensor, generator: random.Random, how: Augmentation) -> torch.Tensor:
    """The image as `how` says, at the places `generator` draws (crop first, then flip)."""
    if how.crop > 0:
        channels, height, width = image.shape
        pad = max(1, int(min(height, width) * how.crop))
        padded = image.new_zeros(channels, height + 2 * pad, width + 2 * pad)
        padded[:, pad : pad + height, pad : pad + width] = image
        top, left = generator.randint(0, 2 * pad), generator.randint(0, 2 * pad)
        image = padded[:, top : top + height, left : left + width]
    if how.flip and generator.random() < 0.5:
        image = image.flip(-1)
    return image.contiguous()


def sample_generator(seed: int, epoch: int, index: int) -> random.Random:
    """A generator for one sample's augmentation. A string seed is hashed (SHA-512) the same way
    in every process, whatever PYTHONHASHSEED is."""
    return random.Random(f"{seed}/{epoch}/{index}")


class ImageFileDataset(Dataset[tuple[torch.Tensor, int]]):
    """Image files and their class ids; a file is decoded when its item is fetched.

    An item is fetched by its index, or by (seed, epoch, index) as `SeededIndexSampler` yields
    them; with an `augment`, those three seed the sample's augmentation (a bare index: seed and
    epoch 0)."""

    def __init__(
        self,
        paths: list[str],
        labels: list[int],
        size: int,
        channels: int,
        augment: Augmentation | None,
    ) -> None:
        self.paths = paths
        self.labels = labels
        self.size = size
        self.channels = channels
        self.augment = augment

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, key: int | SampleKey) -> tuple[torch.Tensor, int]:
        seed, epoch, index = key if isinstance(key, tuple) else (0, 0, key)
        path = self.paths[index]
        try:
            image = read_image(path, self.size, self.channels)
        except Exception as error:  # Pillow raises OSError, SyntaxError, ValueError, ...
            raise ConfigError(f"cannot read {path} as an image ({reason(error)}).") from error
        if self.augment is not None:
            image = augment(image, sample_generator(seed, epoch, index), self.augment)
        return image, self.labels[index]


class SeededIndexSampler(ResumableSampler):
    """The training sampler (seeded shuffle, one shard per process, resumable mid-epoch) yielding
    (seed, epoch, index) for each sample, so that the worker that decodes it can seed its
    augmentation. The epoch is read when an epoch's first batch is drawn (`FirstBatchLoader`),
    after Lightning has set it, on a resumed run too."""

    def __iter__(self) -> Iterator[Any]:
        seed, epoch = self.seed, self.epoch
        return ((seed, epoch, index) for index in super().__iter__())


def class_order(names: set[str]) -> list[str]:
    """Names sorted as numbers when they all are whole numbers, else as text."""
    if all(name.isdecimal() for name in names):
        return sorted(names, key=int)
    return sorted(names)


def hidden(path: Path, under: Path) -> bool:
    return any(part.startswith(".") for part in path.relative_to(under).parts)


def scan_folder(root: Path) -> tuple[list[str], list[str], list[int]]:
    """Class names, image paths and class ids of a folder with one subfolder per class."""
    if not root.is_dir():
        raise ConfigError(
            f"data.root={root} is not a folder: give a folder with one subfolder of images per "
            "class, or data.csv=<a CSV file of path,label rows>."
        )
    names = {p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")}
    if not names:
        raise ConfigError(
            f"data.root={root} has no subfolders: put each class's images in a subfolder named "
            f"after the class (e.g. {root / 'cat' / '1.jpg'}), or give data.csv=... instead."
        )
    classes = class_order(names)
    paths: list[str] = []
    labels: list[int] = []
    for label, name in enumerate(classes):
        folder = root / name
        found = sorted(
            p
            for p in folder.rglob("*")
            if p.suffix.lower() in SUFFIXES and not hidden(p, folder) and p.is_file()
        )
        if not found:
            raise ConfigError(
                f"data.root={root}: the class folder {name} holds no image files "
                f"({', '.join(SUFFIXES)}): add images to it or remove it."
            )
        paths += [str(p) for p in found]
        labels += [label] * len(found)
    return classes, paths, labels


def read_csv(csv_path: Path) -> tuple[list[str], list[str], list[int]]:
    """Class names, image paths and class ids of a CSV file with a `path,label` header; paths are
    relative to the CSV file's folder, labels are class names."""
    data = read_bounded(csv_path, CSV_LIMIT, f"data.csv={csv_path}", "split the data set")
    try:
        lines = data.decode("utf-8-sig").splitlines()
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"data.csv={csv_path} cannot be read as UTF-8 text ({reason(error)})."
        ) from error
    reader = DictReader(lines)
    columns = [name.strip() for name in reader.fieldnames or []]
    if not {"path", "label"} <= set(columns):
        raise ConfigError(
            f"data.csv={csv_path} needs a header row naming the columns path and label (it has "
            f"{','.join(columns) or 'none'})."
        )
    reader.fieldnames = columns
    rows: list[tuple[str, str]] = []
    for line, row in enumerate(reader, start=2):
        file, label = (row.get("path") or "").strip(), (row.get("label") or "").strip()
        if not file or not label:
            raise ConfigError(f"data.csv={csv_path}, line {line}: the path or label is empty.")
        path = csv_path.parent / file
        try:
            found = path.is_file()
        except (OSError, ValueError):  # a name too long, a NUL byte
            found = False
        if not found:
            raise ConfigError(
                f"data.csv={csv_path}, line {line}: {path} is not a file (paths are relative to "
                "the CSV file's folder)."
            )
        rows.append((str(path), label))
    if not rows:
        raise ConfigError(f"data.csv={csv_path} lists no images (one path,label row for each).")
    classes = class_order({label for _, label in rows})
    ids = {name: index for index, name in enumerate(classes)}
    return classes, [path for path, _ in rows], [ids[label] for _, label in rows]


def per_channel(
    key: str, values: Any, channels: int, default: float, positive: bool = False
) -> list[float]:
    """`data.mean` or `data.std`: a number for each channel (a single one serves them all), or
    `default` for each where not set."""
    if values is None:
        return [default] * channels
    numbers = list(values) if isinstance(values, (list, tuple)) else [values]
    fine = [
        not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
        and (v > 0 or not positive)
        for v in numbers
    ]  # fmt: skip
    if len(numbers) not in (1, channels) or not all(fine):
        what = "numbers above 0" if positive else "finite numbers"
        raise ConfigError(
            f"data.{key}={values!r}: use a list of {channels} {what} (one for each of "
            f"data.channels={channels}, for pixels scaled to 0..1), or null."
        )
    return [float(v) for v in numbers] * (channels // len(numbers))


def plain_list(value: Any) -> Any:
    """A list of the config (a ListConfig) as a list; anything else as it is."""
    return list(value) if isinstance(value, Sequence) and not isinstance(value, str) else value


def check_whole(key: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"data.{key}={value!r}: use a whole number of {minimum} or more.")


class ImageFolderDataModule(SplitDataModule):
    """Image classification on your own files (see the module's docstring). Exactly one of `root`
        (a folder with one subfolder per class) and `csv` (a CSV file of `path,label` rows) is set.
        `num_classes` is checked against the classes found, so the model's head matches them; the class
    names travel in the checkpoints (`state_dict`), for the commands that name predictions. Where
    `batch_size` would leave an epoch fewer than `min_steps_per_epoch` steps, batches are smaller."""

    def __init__(
        self,
        root: str | None = None,
        csv: str | None = None,
        image_size: int = 32,
        channels: int = 3,
        num_classes: int = 10,
        batch_size: int = 64,
        val_fraction: float = 0.1,
        test_fraction: float = 0.2,
        split_seed: int = 0,
        num_workers: int | str = "auto",
        augment: bool | Mapping[str, Any] = True,
        verify_images: bool = True,
        channels_last: bool = False,
        mean: list[float] | None = None,
        std: list[float] | None = None,
        min_steps_per_epoch: int | None = 10,
    ) -> None:
        super().__init__(batch_size, num_workers)
        # Plain values in the hyperparameters (checkpoints load with weights_only=True), not the
        # mappings and lists of the config.
        augment = dict(augment) if isinstance(augment, Mapping) else augment
        mean, std = plain_list(mean), plain_list(std)
        self.save_hyperparameters()
        self.augmentation = augmentation(augment)
        self.requested_batch_size = batch_size
        self.sized_for = 0  # the number of processes that batch_size was last checked for
        if min_steps_per_epoch is not None:
            check_whole("min_steps_per_epoch", min_steps_per_epoch, 1)
        check_whole("image_size", image_size, 1)
        check_whole("num_classes", num_classes, 1)
        if channels not in MODES:
            raise ConfigError(f"data.channels={channels!r}: use 1 (grey) or 3 (RGB).")
        check_fractions(val_fraction, test_fraction)
        if (root is None) == (csv is None):
            given = "both are set" if root is not None else "neither is set"
            raise ConfigError(
                f"give one of data.root=<a folder with a subfolder of images per class> and "
                f"data.csv=<a CSV file of path,label rows> ({given})."
            )
        if root is not None:
            self.source = f"data.root={root}"
            self.classes, self.paths, self.labels = scan_folder(Path(str(root)).expanduser())
        else:
            self.source = f"data.csv={csv}"
            self.classes, self.paths, self.labels = read_csv(Path(str(csv)).expanduser())
        if len(self.classes) != num_classes:
            shown = ", ".join(self.classes[:5]) + (", ..." if len(self.classes) > 5 else "")
            raise ConfigError(
                f"{self.source} holds {len(self.classes)} classes ({shown}) but "
                f"data.num_classes={num_classes}: set data.num_classes={len(self.classes)}."
            )
        self.num_classes = num_classes
        self.image_size = image_size
        self.channels = channels
        self.mean = per_channel("mean", mean, channels, 0.5)
        self.std = per_channel("std", std, channels, 1.0, positive=True)
        self.scaling: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def verify(self) -> None:
        """Open every file and let Pillow check it (`Image.verify`: headers and, for PNG, the
        checksums; JPEG data is only checked when decoded)."""
        started = time.perf_counter()
        for path in self.paths:
            try:
                with open_image(path) as image:
                    image.verify()
            except Exception as error:  # Pillow raises OSError, SyntaxError, ValueError, ...
                raise ConfigError(
                    f"{self.source}: cannot read {path} as an image ({reason(error)}): replace or "
                    "remove the file."
                ) from error
        log.info("Checked %d image files in %.1f s", len(self.paths), time.perf_counter() - started)

    def load_splits(self) -> dict[str, Dataset[Any]]:
        if self.hparams["verify_images"]:
            self.verify()
        fractions = (self.hparams["val_fraction"], self.hparams["test_fraction"])
        splits = split_indices(len(self.paths), fractions, self.hparams["split_seed"])
        datasets: dict[str, Dataset[Any]] = {}
        for name, indices in zip(("train", "val", "test"), splits, strict=True):
            datasets[name] = ImageFileDataset(
                [self.paths[i] for i in indices.tolist()],
                [self.labels[i] for i in indices.tolist()],
                self.image_size,
                self.channels,
                augment=self.augmentation if name == "train" else None,
            )
        return datasets

    def setup(self, stage: str | None = None) -> None:
        super().setup(stage)
        world_size, _ = self.ranks()
        if "train" in self.splits and world_size != self.sized_for:
            # Once for a number of processes: a batch-size finder sets batch_size after this.
            self.sized_for = world_size
            self.batch_size = self.steps_batch_size(world_size)

    def steps_batch_size(self, world_size: int) -> int:
        """`data.batch_size`, or less where that leaves an epoch fewer than
        `data.min_steps_per_epoch` steps on each process: one line says so. An epoch of a step or
        two trains a small folder to chance: early stopping, validation and the logging interval
        count in epochs, and the learning-rate warm-up in steps."""
        requested, least = self.requested_batch_size, self.hparams["min_steps_per_epoch"]
        per_process = len(self.splits["train"]) // world_size  # type: ignore[arg-type]
        images = f"{per_process} training images" + (
            f" per process ({world_size} processes)" if world_size > 1 else ""
        )
        if least is None and per_process < requested:
            raise ConfigError(
                f"data.batch_size={requested} is more than the {images}, so an epoch would "
                "train on none (the last ragged batch is dropped): lower it, or set "
                "data.min_steps_per_epoch to a number of steps."
            )
        if least is None or per_process // requested >= least:
            return requested
        capped = max(1, per_process // least)
        log.warning(
            "data.batch_size=%d makes an epoch %d step%s of the %s: batches of %d instead, %d "
            "steps an epoch (data.min_steps_per_epoch=%d; null keeps data.batch_size).",
            requested, per_process // requested, "s"[: per_process // requested != 1], images,
            capped, per_process // capped, least,
        )  # fmt: skip
        return capped

    def sampler(self, split: str) -> Sampler[Any] | None:
        sampler = super().sampler(split)
        if isinstance(sampler, ResumableSampler):
            return SeededIndexSampler(
                sampler.dataset, sampler.num_replicas, sampler.rank, seed=sampler.seed
            )
        return sampler

    def images_from_files(self, paths: list[Path]) -> torch.Tensor:
        """Image files (the predict command's inputs) as the training images are read:
        (N, channels, image_size, image_size) uint8."""
        images = []
        for path in paths:
            try:
                images.append(read_image(path, self.image_size, self.channels))
            except Exception as error:  # Pillow raises OSError, SyntaxError, ValueError, ...
                raise ConfigError(
                    f"cannot read {path} as an image ({reason(error)}): pass PNG or JPEG files."
                ) from error
        return torch.stack(images)

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the data (Lightning stores it): the class names, so the
        predict and serve commands name the classes the model was trained on."""
        return {"classes": list(self.classes)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The class names a checkpoint stores replace those found now, where they are as many:
        the model's outputs mean the classes it was trained on. Only a list of strings is taken
        (a checkpoint is untrusted data); anything else leaves the names found."""
        stored = state_dict.get("classes") if isinstance(state_dict, dict) else None
        if (
            isinstance(stored, list)
            and len(stored) == len(self.classes)
            and all(isinstance(name, str) for name in stored)
        ):
            self.classes = list(stored)

    def normalization(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """`mean` and `std` on `device`, copied there once."""
        if device not in self.scaling:
            self.scaling[device] = tuple(  # type: ignore[assignment]
                torch.tensor(values, dtype=torch.float32).view(-1, 1, 1).to(device)
                for values in (self.mean, self.std)
            )
        return self.scaling[device]

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        images, labels = batch
        mean, std = self.normalization(images.device)
        images = images.float().div_(255).sub_(mean).div_(std)
        if self.hparams["channels_last"]:
            images = images.contiguous(memory_format=torch.channels_last)
        return images, labels
