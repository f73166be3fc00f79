"""The vision example: digits (bundled) and MNIST (IDX files written here) train on CPU."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest
import torch

from {{ cookiecutter.package_name }}.data.mnist import (
    MNISTDataModule,
    read_idx,
)
from {{ cookiecutter.package_name }}.errors import ConfigError
from {{ cookiecutter.package_name }}.recipes.evaluate import (
    evaluate,
)
from {{ cookiecutter.package_name }}.recipes.train import train

from .helpers import ComposeFn, assert_checkpoints_load_safely, checkpoints, read_metrics


def write_idx(path: Path, data: torch.Tensor) -> None:
    """Write uint8 data in the IDX format MNIST ships in (gzipped, like the download)."""
    header = bytes([0, 0, 0x08, data.dim()]) + b"".join(
        size.to_bytes(4, "big") for size in data.shape
    )
    path.write_bytes(gzip.compress(header + data.numpy().tobytes()))


def write_fake_mnist(folder: Path, train_count: int = 96, test_count: int = 32) -> None:
    """Learnable IDX files: each image is its label's bright horizontal stripe, plus noise."""
    generator = torch.Generator().manual_seed(0)
    folder.mkdir(parents=True, exist_ok=True)
    for prefix, count in (("train", train_count), ("t10k", test_count)):
        labels = torch.arange(count) % 10
        images = torch.randint(0, 60, (count, 28, 28), generator=generator, dtype=torch.uint8)
        for index, label in enumerate(labels):
            images[index, 2 * label + 4 : 2 * label + 7, :] = 255
        write_idx(folder / f"{prefix}-images-idx3-ubyte.gz", images)
        write_idx(folder / f"{prefix}-labels-idx1-ubyte.gz", labels.to(torch.uint8))


def test_digits_trains_and_eval_reproduces_test_metric(
    train_config: ComposeFn, eval_config: ComposeFn
) -> None:
    cfg = train_config("experiment=digits", "trainer.max_epochs=3")
    metrics = train(cfg)
    assert metrics["val/acc"] > 0.5, "three epochs of digits should be far above chance (0.1)"
    assert read_metrics(cfg)["test/acc"] == pytest.approx(metrics["test/acc"])
    assert_checkpoints_load_safely(cfg)

    best = next(p for p in checkpoints(cfg) if p.name.startswith("best"))
    evaluated = evaluate(eval_config(f"ckpt_path={best}"))
    assert evaluated["test/acc"] == pytest.approx(metrics["test/acc"], abs=1e-6)
    assert evaluated["test/loss"] == pytest.approx(metrics["test/loss"], rel=1e-5)


def test_mnist_reads_idx_files_and_trains(train_config: ComposeFn, tmp_path: Path) -> None:
    data_dir = tmp_path / "mnist"
    write_fake_mnist(data_dir)
    cfg = train_config(
        "experiment=mnist",
        f"data.data_dir={data_dir}",
        "data.download=false",
        "data.num_workers=0",
        "data.batch_size=16",
        "data.val_size=16",
        "trainer.max_epochs=4",
        "trainer.log_every_n_steps=1",
    )
    metrics = train(cfg)
    assert metrics["test/acc"] > 0.3, "the stripes are easy: accuracy must rise above chance"
    assert_checkpoints_load_safely(cfg)


def test_mnist_datamodule_splits(tmp_path: Path) -> None:
    write_fake_mnist(tmp_path, train_count=40, test_count=20)
    datamodule = MNISTDataModule(
        str(tmp_path), download=False, val_size=10, batch_size=8, num_workers=0
    )
    datamodule.setup()
    assert [len(datamodule.splits[s]) for s in ("train", "val", "test")] == [30, 10, 20]  # type: ignore[arg-type]
    images, labels = next(iter(datamodule.train_dataloader()))
    assert images.shape == (8, 1, 28, 28) and images.dtype == torch.uint8
    assert labels.dtype == torch.int64


def test_mnist_missing_files_name_the_path(tmp_path: Path) -> None:
    datamodule = MNISTDataModule(str(tmp_path / "nowhere"), download=False)
    with pytest.raises(ConfigError, match="nowhere"):
        datamodule.setup()


def test_truncated_idx_file_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "train-images-idx3-ubyte.gz"
    write_idx(path, torch.zeros(4, 28, 28, dtype=torch.uint8))
    path.write_bytes(gzip.compress(gzip.decompress(path.read_bytes())[:-10]))
    with pytest.raises(ConfigError, match="truncated or corrupt"):
        read_idx(path)


@pytest.mark.slow
def test_default_digits_experiment_reaches_target(train_config: ComposeFn) -> None:
    metrics = train(train_config("experiment=digits"))
    assert metrics["test/acc"] >= 0.95


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_digits_on_gpu_bf16_compiled(train_config: ComposeFn) -> None:
    cfg = train_config(
        "experiment=digits",
        "trainer=gpu",
        "trainer.precision=bf16-mixed",
        "model.compile=true",
        "trainer.max_epochs=3",
        "trainer.log_every_n_steps=5",
    )
    metrics = train(cfg)
    assert metrics["val/acc"] > 0.5
    assert metrics["perf/samples_per_sec"] > 0
