"""The same command resumes a killed run from its newest valid checkpoint, in the same run
directory, and does not train a finished run again."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from {{ cookiecutter.package_name }}.checkpoints import newest_valid_checkpoint
from {{ cookiecutter.package_name }}.run_names import run_name
from {{ cookiecutter.package_name }}.train import train

from .helpers import PACKAGE, ComposeFn, run_cli
{%- if cookiecutter.examples == "language" %}

LONG_RUN = [
    "model.net.n_layer=1", "data.max_bytes=200000", "trainer.max_steps=200",
    "trainer.val_check_interval=20", "trainer.limit_val_batches=2", "trainer.limit_test_batches=2",
]  # fmt: skip
SHORT_RUN = [*LONG_RUN[:2], "trainer.max_steps=4", "trainer.val_check_interval=2"]
{%- else %}

LONG_RUN = ["trainer.max_epochs=25", "callbacks.early_stopping=null"]
SHORT_RUN = ["trainer.max_epochs=1", "trainer.limit_train_batches=3"]
{%- endif %}


def test_run_names_follow_the_overrides() -> None:
    assert run_name(None, "") == "default"
    assert run_name(None, "experiment=big,trainer=gpu") == "experiment=big,trainer=gpu"
    assert run_name(None, "hydra/launcher=joblib,x='a b'") == "hydra_launcher=joblib,x=_a_b_"
    long_name = run_name(None, "model.optimizer.lr=0.001," * 20)
    assert len(long_name) == 100
    assert long_name != run_name(None, "model.optimizer.lr=0.002," * 20)
    assert run_name("my-run", "experiment=big") == "my-run"


def test_unreadable_newest_checkpoint_is_moved_aside(tmp_path: Path) -> None:
    older, newer = tmp_path / "step0000010.ckpt", tmp_path / "last.ckpt"
    torch.save({"global_step": 10}, older)
    torch.save({"global_step": 20}, newer)
    newer.write_bytes(newer.read_bytes()[:100])
    os.utime(older, (time.time() - 60, time.time() - 60))
    assert newest_valid_checkpoint(tmp_path) == older
    assert (tmp_path / "last.ckpt.corrupt").is_file(), "kept for inspection, never deleted"


def test_finished_run_is_not_trained_again(train_config: ComposeFn) -> None:
    cfg = train_config(*SHORT_RUN, "trainer.limit_val_batches=2", "trainer.limit_test_batches=2")
    first = train(cfg)
    last = Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt"
    written = last.stat().st_mtime_ns
    assert train(cfg) == pytest.approx(first)
    assert last.stat().st_mtime_ns == written


@pytest.mark.slow
def test_killed_run_resumes_with_the_same_command(tmp_path: Path) -> None:
    command = ["trainer=cpu", "logger=csv", "extras.print_config=false", *LONG_RUN]
    process = subprocess.Popen(
        [sys.executable, "-m", PACKAGE, *command],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 180
    while not list(tmp_path.glob("logs/train/runs/*/checkpoints/last.ckpt")):
        assert process.poll() is None, "the run ended before it could be killed"
        assert time.monotonic() < deadline, "no checkpoint within 180 s"
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()

    resumed = run_cli("-m", PACKAGE, *command, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Resuming from" in resumed.stdout + resumed.stderr
    run_dirs = list((tmp_path / "logs" / "train" / "runs").iterdir())
    assert len(run_dirs) == 1, "the same command uses the same run directory"
    last = torch.load(run_dirs[0] / "checkpoints" / "last.ckpt", weights_only=True)
{%- if cookiecutter.examples == "language" %}
    assert last["global_step"] == 200
{%- else %}
    assert last["epoch"] == 24
{%- endif %}
    assert (run_dirs[0] / "metrics.json").is_file()
