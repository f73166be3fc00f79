"""Using a trained image classifier: image files read as the training images are, the predict
command's CSV, export with a parity check, and one line for each bad input."""

from __future__ import annotations

import csv
import io
import json
import os
import signal
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest
import torch
from PIL import Image

from {{ cookiecutter.package_name }}.cli import (
    _run,
)
from {{ cookiecutter.package_name }}.data.digits import (
    PIXEL_MAX,
    DigitsDataModule,
    load_digits,
)
from {{ cookiecutter.package_name }}.data.image_files import (
    image_paths,
)
from {{ cookiecutter.package_name }}.errors import (
    ConfigError,
)
from {{ cookiecutter.package_name }}.recipes import (
    export as export_module,
)

from .helpers import PACKAGE, compose_config, run_cli, run_commands
from .killing import entry_point as entry


def write_digit(image: torch.Tensor, path: Path, scale: int = 1, mode: str = "L") -> None:
    """A data set image (values 0..16) as an 8-bit image file, `scale` times larger."""
    pixels = (image[0].float() * 255 / PIXEL_MAX).round().to(torch.uint8).numpy()
    picture = Image.fromarray(pixels, "L").convert(mode)
    picture.resize((8 * scale, 8 * scale), Image.Resampling.NEAREST).save(path)


def test_an_image_file_of_a_training_image_reads_back_as_that_image(tmp_path: Path) -> None:
    images, _ = load_digits()
    write_digit(images[0], tmp_path / "a.png")
    write_digit(images[1], tmp_path / "b.png", mode="RGB")
    read = DigitsDataModule.images_from_files(image_paths([str(tmp_path)]))
    assert read.dtype == torch.uint8 and read.shape == (2, 1, 8, 8)
    assert torch.equal(read, images[:2])


def test_a_file_that_is_not_an_image_is_named(tmp_path: Path) -> None:
    (tmp_path / "broken.png").write_bytes(b"\x89PNG but not really")
    with pytest.raises(ConfigError, match=r"cannot read .*broken.png as an image"):
        DigitsDataModule.images_from_files(image_paths([str(tmp_path)]))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no image files"):
        image_paths([str(tmp_path / "empty")])


QUIET = ["trainer=cpu", "logger=csv", "extras.print_config=false", "callbacks.progress_bar=null"]


def command(entry_name: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return run_cli(*entry(entry_name), *args, cwd=cwd)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cwd = tmp_path_factory.mktemp("digits")
    result = run_cli("-m", PACKAGE, *QUIET, "trainer.max_epochs=3", "run_name=digits", cwd=cwd)
    assert result.returncode == 0, result.stderr[-3000:]
    return cwd / "logs" / "train" / "runs" / "digits" / "checkpoints" / "last.ckpt"


def predictions(folder: Path) -> list[dict[str, str]]:
    with (folder / "predictions.csv").open() as handle:
        return list(csv.DictReader(handle))


@pytest.mark.slow
def test_predict_classifies_image_files_of_any_size_and_the_test_split(
    trained: Path, tmp_path: Path
) -> None:
    images, labels = load_digits()
    (tmp_path / "in").mkdir()
    for index in range(8):
        suffix = "png" if index % 2 else "jpg"
        write_digit(images[index], tmp_path / "in" / f"{index}.{suffix}", scale=1 + index % 4)
    runs = []
    for name in ("first", "second"):
        result = command("predict", f"ckpt_path={trained}", "inputs=in", "top_k_classes=3",
                         f"hydra.run.dir={name}", cwd=tmp_path)  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        runs.append(predictions(tmp_path / name))
    rows = runs[0]
    assert runs[0] == runs[1]
    assert [Path(row["path"]).name for row in rows] == [
        f"{i}.{'png' if i % 2 else 'jpg'}" for i in range(8)
    ]
    for row in rows:
        top = [int(c) for c in row["top_classes"].split()]
        probabilities = [float(p) for p in row["top_probabilities"].split()]
        assert len(top) == 3 and top[0] == int(row["class"]) and 0 <= top[0] <= 9
        # The digits' class names are their digits.
        assert row["name"] == row["class"] and json.loads(row["top_names"]) == list(map(str, top))
        assert probabilities == sorted(probabilities, reverse=True) and sum(probabilities) <= 1.0001
    # The PNG files hold the training images exactly: most are recognised after 3 epochs.
    correct = sum(int(row["class"]) == int(labels[i]) for i, row in enumerate(rows) if i % 2)
    assert correct >= 3, rows
    result = command("predict", f"ckpt_path={trained}", "inputs=test", "hydra.run.dir=test",
                     cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(predictions(tmp_path / "test")) == int(len(labels) * 0.2)


@pytest.mark.slow
def test_a_killed_predict_run_again_writes_its_predictions_in_the_same_folder(
    trained: Path, tmp_path: Path
) -> None:
    """Killed as soon as it has made its folder, the same command run again writes there what a
    command never killed writes."""
    args = [sys.executable, *entry("predict"), f"ckpt_path={trained}", "inputs=test"]
    never_killed, killed = tmp_path / "never_killed", tmp_path / "killed"
    for cwd in (never_killed, killed):
        cwd.mkdir()
    started = subprocess.Popen(
        args, cwd=killed, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while not list(killed.glob("logs/predict/runs/*/predict.log")):
        assert started.poll() is None and time.monotonic() < deadline, "it never started"
        time.sleep(0.05)
    os.killpg(started.pid, signal.SIGKILL)
    started.wait()
    (folder,) = (killed / "logs" / "predict" / "runs").iterdir()
    assert not (folder / "predictions.csv").exists(), "killed before it wrote its output"
    for cwd in (never_killed, killed):
        result = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
    assert list((killed / "logs" / "predict" / "runs").iterdir()) == [folder]
    (reference,) = (never_killed / "logs" / "predict" / "runs").iterdir()
    assert predictions(folder) == predictions(reference)


def test_predict_killed_while_writing_its_file_leaves_one_file_when_run_again(
    trained: Path, tmp_path: Path
) -> None:
    """Killed between writing its temporary file and renaming it, the same command run again
    leaves the predictions and nothing else."""
    kill_in_write = (
        "import os, signal; os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL); "
        f"from {PACKAGE}.cli import predict; predict()"
    )
    args = [f"ckpt_path={trained}", "inputs=test", "hydra.run.dir=out"]
    killed = subprocess.run(
        [sys.executable, "-c", kill_in_write, *args], cwd=tmp_path, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert list((tmp_path / "out").glob(".predictions.csv.tmp-*")), "killed mid-write"
    result = subprocess.run(
        [sys.executable, *entry("predict"), *args], cwd=tmp_path, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "out").glob("*predictions*")) == ["predictions.csv"]


@pytest.mark.slow
def test_exported_programs_match_the_model_and_run_without_the_project(
    trained: Path, tmp_path: Path
) -> None:
    for fmt in ("pt2", "onnx"):
        result = command("export", f"ckpt_path={trained}", f"format={fmt}",
                         f"output=model.{fmt}", cwd=tmp_path)  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
    script = f"""
import sys; sys.modules[{PACKAGE!r}] = None
import torch, numpy, onnxruntime
images = torch.randint(0, 17, (5, 1, 8, 8), dtype=torch.uint8)
logits = torch.export.load("model.pt2").module()(images)
(other,) = onnxruntime.InferenceSession("model.onnx").run(None, dict(inputs=images.numpy()))
assert logits.shape == (5, 10), logits.shape
assert numpy.abs(logits.detach().numpy() - other).max() < 1e-4
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            cwd=tmp_path, timeout=300)  # fmt: skip
    assert result.stdout.strip() == "ok", result.stderr[-3000:]


@pytest.mark.slow
def test_bad_inputs_get_one_line_and_leave_nothing(trained: Path, tmp_path: Path) -> None:
    (tmp_path / "broken.jpg").write_bytes(b"no jpeg here")
    (tmp_path / "folder").mkdir()
    (tmp_path / "huge.png").write_bytes(png_claiming(30_000, 30_000))
    cases = {
        ("predict", "inputs=broken.jpg"): ("broken.jpg", "PNG or JPEG"),
        ("predict", "inputs=folder"): ("no image files",),
        ("predict", "inputs=missing.png"): ("does not exist",),
        ("predict", "inputs=/dev/zero"): ("not a regular file",),
        ("predict",): ("inputs",),
        ("predict", "inputs=''"): ("empty name",),
        ("predict", "inputs=huge.png"): ("huge.png", "decompression bomb"),
        ("predict", "prompt=hello"): ("image classifier", "inputs="),
        ("predict", "inputs=test", "top_k_classes=0"): ("top_k_classes",),
        ("predict", "inputs=test", "trainer.devices=2"): ("one device", "trainer.devices=2"),
        ("export", "format=pt2", "output=folder"): ("output=", "is a folder"),
        ("export", "format=pt2", "output=/dev/null"): ("output=/dev/null", "not a regular file"),
        ("export", "format=pt2", f"output={trained}"): ("is the checkpoint being exported",),
        ("export", "format=pt2", "output=model.onnx"): ("format=onnx", "model.pt2"),
        ("export", "format=pt2", "tolerance=close"): ("tolerance='close'",),
        ("export", "format=pt2", "tolerance=-1"): ("tolerance=-1",),
        ("export", "format=pt2", "tolerance=nan"): ("tolerance=nan",),
    }
    commands = [(name, f"ckpt_path={trained}", *args) for name, *args in cases]
    ran = run_commands(commands, tmp_path, tmp_path.parent / f"{tmp_path.name}-results.json")
    for result, words in zip(ran, cases.values(), strict=True):
        assert result.returncode == 1, result.stderr[-3000:]
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-3000:]
        assert all(word in lines[0] for word in words), lines[0]
    assert not (tmp_path / "logs").exists()


def png_claiming(width: int, height: int) -> bytes:
    """A PNG file whose header claims `width` x `height` pixels (it holds one)."""
    buffer = io.BytesIO()
    Image.new("L", (1, 1)).save(buffer, "PNG")
    data = bytearray(buffer.getvalue())
    data[16:24] = struct.pack(">II", width, height)  # the IHDR chunk's data starts at byte 16
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


@pytest.mark.slow
def test_a_failed_export_removes_the_folders_it_made_and_a_rerun_its_partial_files(
    trained: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    output = tmp_path / "new" / "deeper" / "model.pt2"
    overrides = [f"ckpt_path={trained}", "format=pt2", f"output={output}"]
    cfg = compose_config("export", overrides, tmp_path / "export")
    eager = export_module.export_pt2
    monkeypatch.setattr(export_module, "export_pt2", lambda *args: eager(*args) + 1)
    with pytest.raises(SystemExit) as exit_info:
        _run(export_module.export, cfg)
    assert exit_info.value.code == 1
    assert "differ from the model's" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()
    monkeypatch.setattr(export_module, "export_pt2", eager)
    output.parent.mkdir(parents=True)
    killed = output.with_name(f".{output.name}.tmp-{dead_pid()}")
    killed.write_bytes(b"half an export")
    _run(export_module.export, compose_config("export", overrides, tmp_path / "export"))
    assert output.is_file() and not killed.exists()


def dead_pid() -> int:
    """The id of a process that has ended."""
    process = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                             capture_output=True, text=True, check=True)  # fmt: skip
    return int(process.stdout)
