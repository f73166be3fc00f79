"""Running the train command in a subprocess, stopping it in a chosen phase (tests/faults.py), and
comparing what the same command then finishes with an uninterrupted run of it: bitwise the same
weights and optimizer state in the final `last.ckpt`, the same batches at every step, the same
checkpoint files and the same `metrics.json` (timing keys aside)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from . import warm_start
from .helpers import PACKAGE, PROJECT_ROOT

TIMING_KEYS = ("perf/",)
FAULT_TARGETS = (
    "allowed_targets=[tests.faults.FaultAt,tests.faults.RecordBatches,tests.faults.SlowSteps,"
    "tests.faults.SlowSetup]"
)
{%- if cookiecutter.examples == "language" %}

# A byte-level GPT of one layer: validation every 4 steps, a step checkpoint every 4 (each one
# at a step that a validation follows), early stopping firing at step 8 of 12.
SMALL_SHAPE = [
    "model.net.n_layer=1", "data.max_bytes=200000", "trainer.max_steps=12",
    "trainer.val_check_interval=4", "trainer.limit_val_batches=2", "trainer.limit_test_batches=2",
    "callbacks.step_checkpoint.every_n_train_steps=4",
]  # fmt: skip
{%- else %}

# Four batches an epoch; a step checkpoint every 4 steps (each one at an epoch's last batch, which
# a validation follows); early stopping firing after epoch 1 of 4 (step 8).
SMALL_SHAPE = [
    "trainer.max_epochs=4", "trainer.limit_train_batches=4", "trainer.limit_val_batches=2",
    "trainer.limit_test_batches=2", "callbacks.step_checkpoint.every_n_train_steps=4",
]  # fmt: skip
{%- endif %}
# What every run of the harness shares: CPU, CSV logs, early stopping that fires at the second
# validation, and the fault and batch-recording callbacks allowed.
COMMON = [
    "trainer=cpu", "logger=csv", "extras.print_config=false", "callbacks.progress_bar=null",
    "trainer.log_every_n_steps=2", "callbacks.early_stopping.patience=1",
    "+callbacks.early_stopping.min_delta=1.0", FAULT_TARGETS,
    "+callbacks.record._target_=tests.faults.RecordBatches", "+callbacks.record.path=batches.txt",
]  # fmt: skip
SMALL_RUN = [*COMMON, *SMALL_SHAPE]


def fault(
    phase: str, at: int, marker: Path, signal_name: str = "SIGKILL", whole_group: bool = False,
    name: str = "fault",
) -> list[str]:  # fmt: skip
    """Overrides that add a `tests.faults.FaultAt` to the run."""
    return [
        f"+callbacks.{name}._target_=tests.faults.FaultAt", f"+callbacks.{name}.phase={phase}",
        f"+callbacks.{name}.at={at}", f"+callbacks.{name}.marker={marker}",
        f"+callbacks.{name}.signal_name={signal_name}",
        f"+callbacks.{name}.whole_group={str(whole_group).lower()}",
    ]  # fmt: skip


def entry_point(entry: str) -> list[str]:
    """`python -m <package>` for train (DDP re-runs this command line in its other processes)."""
    if entry == "train":
        return ["-m", PACKAGE]
    return ["-c", f"from {PACKAGE}.cli import {entry}; {entry}()"]


def start(
    args: list[str], cwd: Path, env: dict[str, str] | None = None, entry: str = "train",
    under: tuple[str, ...] = (),
) -> subprocess.Popen[str]:  # fmt: skip
    """The train (or eval) command in its own process group, as a shell starts a job (`under`
    a command that starts it, if any)."""
    cwd.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        [*under, sys.executable, *entry_point(entry), *args],
        cwd=cwd,
        env=environment_with(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
        preexec_fn=answer_ctrl_c,
    )


def environment_with(env: dict[str, str] | None) -> dict[str, str]:
    """This one, the project importable (tests.faults), stacks on a fatal signal, and `env`."""
    python_path = os.pathsep.join([str(PROJECT_ROOT), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": python_path, "PYTHONFAULTHANDLER": "1", **(env or {})}


def answer_ctrl_c() -> None:
    """SIGINT as a terminal's command gets it, also where the tests run in the background (whose
    commands inherit SIGINT ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def finish(
    process: subprocess.Popen[str] | warm_start.WarmProcess, timeout: float = 600
) -> tuple[int, str]:
    """The exit code and output of a `start`ed command; one still running after `timeout` (or
    whose pipe a leftover process of it holds) fails the test with every process's stacks."""
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # PYTHONFAULTHANDLER: SIGABRT makes each Python process print its threads' stacks.
        signal_group(process.pid, signal.SIGABRT)
        try:
            output, _ = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            signal_group(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
        signal_group(process.pid, signal.SIGKILL)
        raise AssertionError(
            f"still running after {timeout:.0f} s: {' '.join(map(str, process.args))}\n"
            f"{output[-12000:]}"
        ) from None
    return process.returncode, output


def signal_group(group: int, signal_number: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, signal_number)


def run(
    args: list[str], cwd: Path, env: dict[str, str] | None = None, entry: str = "train"
) -> tuple[int, str]:
    """The command run to its end: forked from a process that has imported torch and Hydra
    already (tests/warm_start.py), or started anew where its environment asks for that."""
    cwd.mkdir(parents=True, exist_ok=True)
    forked = warm_start.start([*entry_point(entry), *args], cwd, environment_with(env), env)
    return finish(forked or start(args, cwd, env, entry))


def run_dir(cwd: Path) -> Path:
    (found,) = (cwd / "logs" / "train" / "runs").iterdir()
    return found


def batches_by_step(cwd: Path) -> dict[str, dict[int, str]]:
    """Per rank: the batch each step trained on; a step run again after a resume counts once,
    as its last run (the one whose update was kept)."""
    seen: dict[str, dict[int, str]] = {}
    for path in sorted(cwd.glob("batches.txt.rank*")):
        steps = seen.setdefault(path.suffix, {})
        for line in path.read_text().splitlines():
            step, digest = line.split()
            steps[int(step)] = digest
    return seen


def read_last(path: Path) -> dict[str, Any]:
    """A single-file checkpoint, or a folder of shards read whole."""
    if path.is_dir():
        from {{ cookiecutter.package_name }}.checkpointing.door import (
            read_shards_whole,
        )

        return read_shards_whole(path)
    return dict(torch.load(path, weights_only=True))


def outcome(cwd: Path) -> dict[str, Any]:
    """What a finished run leaves: its metrics, final state, checkpoint files and batches."""
    folder = run_dir(cwd)
    assert (folder / "metrics.json").is_file(), "the run did not finish"
    metrics = json.loads((folder / "metrics.json").read_text())
    last = read_last(folder / "checkpoints" / "last.ckpt")
    return {
        "metrics": {k: v for k, v in metrics.items() if not k.startswith(TIMING_KEYS)},
        "global_step": last["global_step"],
        "epoch": last["epoch"],
        "epochs_done": epochs_done(last),
        "state_dict": last["state_dict"],
        "optimizer_states": last["optimizer_states"],
        "files": sorted(path.name for path in (folder / "checkpoints").iterdir()),
        "batches": batches_by_step(cwd),
    }


def epochs_done(checkpoint: dict[str, Any]) -> dict[str, int]:
    """The fit loop's count of epochs processed and completed (not of epochs started, which a
    resumed run counts again)."""
    total = checkpoint["loops"]["fit_loop"]["epoch_progress"]["total"]
    return {"processed": total["processed"], "completed": total["completed"]}


def assert_equal(expected: Any, got: Any, where: str) -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor) and torch.equal(expected, got), f"{where} differs"
    elif isinstance(expected, dict):
        assert expected.keys() == got.keys(), f"{where}: keys {expected.keys()} != {got.keys()}"
        for key in expected:
            assert_equal(expected[key], got[key], f"{where}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(expected) == len(got), f"{where}: {expected} != {got}"
        for index, (one, other) in enumerate(zip(expected, got, strict=True)):
            assert_equal(one, other, f"{where}[{index}]")
    else:
        assert expected == got, f"{where}: {expected!r} != {got!r}"


def killed_then_finished(command: list[str], cwd: Path, kills: int = 1) -> None:
    """Run `command` `kills` times, each ended by its faults' SIGKILL, then once more: that run
    must finish."""
    for _ in range(kills):
        code, output = run(command, cwd)
        assert code == -signal.SIGKILL, f"the fault did not fire:\n{output[-3000:]}"
    code, output = run(command, cwd)
    assert code == 0, output[-3000:]


def assert_same_outcome(reference: Path, resumed: Path) -> None:
    expected, got = outcome(reference), outcome(resumed)
    assert expected["batches"], "no batches were recorded"
    for key in expected:
        assert_equal(expected[key], got[key], key)


References = Callable[[list[str]], Path]
