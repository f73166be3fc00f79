"""The same command resumes a killed run from its newest valid checkpoint, in the same run
directory, exactly (the same batches, bitwise the same weights), and does not train a finished run
again. Kills and signals are real: a subprocess, and SIGKILL/SIGTERM/SIGUSR1 sent at a chosen step.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from {{ cookiecutter.package_name }}.checkpoints import (
    NonFiniteWeightsError,
    atomic_torch_save,
    newest_valid_checkpoint,
)
from {{ cookiecutter.package_name }}.run_names import run_name
from {{ cookiecutter.package_name }}.train import train

from .helpers import PACKAGE, PROJECT_ROOT, ComposeFn
{%- if cookiecutter.examples == "language" %}

# Eight batches an epoch; a checkpoint every four steps and after each epoch's validation.
EXACT_RUN = [
    "model.net.n_layer=1", "data.max_bytes=200000", "trainer.max_steps=-1",
    "trainer.val_check_interval=null", "trainer.check_val_every_n_epoch=1",
]  # fmt: skip
{%- else %}

# Eight batches an epoch; a checkpoint every four steps and after each epoch's validation.
EXACT_RUN = ["callbacks.early_stopping=null"]
{%- endif %}
EXACT_RUN += [
    "trainer=cpu", "logger=csv", "extras.print_config=false", "test=false", "allowed_targets=[tests]",
    "trainer.max_epochs=3", "trainer.limit_train_batches=8", "trainer.limit_val_batches=2",
    "callbacks.step_checkpoint.every_n_train_steps=4", "callbacks.progress_bar=null",
    "+callbacks.record._target_=tests.faults.RecordBatches", "+callbacks.record.path=batches.txt",
]  # fmt: skip
{%- if cookiecutter.examples == "language" %}

SHORT_RUN = [
    "model.net.n_layer=1", "data.max_bytes=200000", "trainer.max_steps=4",
    "trainer.val_check_interval=2",
]  # fmt: skip
{%- else %}

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


def test_unreadable_newest_checkpoint_is_moved_aside(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    older, newer = tmp_path / "step0000010.ckpt", tmp_path / "last.ckpt"
    torch.save({"global_step": 10}, older)
    torch.save({"global_step": 20}, newer)
    newer.write_bytes(newer.read_bytes()[:100])
    os.utime(older, (time.time() - 60, time.time() - 60))
    assert newest_valid_checkpoint(tmp_path) == older
    assert (tmp_path / "last.ckpt.corrupt").is_file(), "kept for inspection, never deleted"
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert str(newer) in warning and str(older) in warning


def test_finished_run_is_not_trained_again(train_config: ComposeFn) -> None:
    cfg = train_config(*SHORT_RUN, "trainer.limit_val_batches=2", "trainer.limit_test_batches=2")
    first = train(cfg)
    last = Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt"
    written = last.stat().st_mtime_ns
    assert train(cfg) == pytest.approx(first)
    assert last.stat().st_mtime_ns == written


def test_step_checkpoints_can_follow_the_clock(train_config: ComposeFn) -> None:
    """The time-based interval that `step_checkpoint.yaml` documents composes, passes the target
    allowlist and saves: at one microsecond every step saves, and the two newest stay."""
    cfg = train_config(
        *SHORT_RUN,
        "test=false",
        "callbacks.step_checkpoint.every_n_train_steps=null",
        "+callbacks.step_checkpoint.train_time_interval={_target_:datetime.timedelta,microseconds:1}",
    )
    train(cfg)
    folder = Path(cfg.paths.output_dir) / "checkpoints"
    last = torch.load(folder / "last.ckpt", weights_only=True)["global_step"]
    kept = sorted(path.name for path in folder.glob("step*.ckpt"))
    assert kept == [f"step{step:07d}.ckpt" for step in (last - 1, last)]


def start(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """The train command in its own process group (a SIGKILL from inside kills only the run)."""
    cwd.mkdir(parents=True, exist_ok=True)
    python_path = os.pathsep.join([str(PROJECT_ROOT), os.environ.get("PYTHONPATH", "")])
    return subprocess.Popen(
        [sys.executable, "-m", PACKAGE, *args],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": python_path, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )


def finish(process: subprocess.Popen[str]) -> tuple[int, str]:
    output, _ = process.communicate(timeout=600)
    return process.returncode, output


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


def final_weights(cwd: Path) -> dict[str, torch.Tensor]:
    (run_dir,) = (cwd / "logs" / "train" / "runs").iterdir()
    assert (run_dir / "metrics.json").is_file(), "the run did not finish"
    newest = newest_valid_checkpoint(run_dir / "checkpoints")
    assert newest is not None
    return dict(torch.load(newest, weights_only=True)["state_dict"])


def assert_same_training(reference: Path, resumed: Path) -> None:
    expected, got = batches_by_step(reference), batches_by_step(resumed)
    assert expected and got == expected, "the resumed run saw other batches"
    weights, resumed_weights = final_weights(reference), final_weights(resumed)
    assert weights.keys() == resumed_weights.keys()
    for name, value in weights.items():
        assert torch.equal(value, resumed_weights[name]), f"{name} differs after the resume"


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory: pytest.TempPathFactory) -> Callable[[list[str]], Path]:
    """The uninterrupted run of EXACT_RUN plus some overrides, trained once for all tests."""
    runs: dict[str, Path] = {}

    def run(extra: list[str]) -> Path:
        key = " ".join(extra)
        if key not in runs:
            cwd = tmp_path_factory.mktemp("reference")
            code, output = finish(start([*EXACT_RUN, *extra], cwd))
            assert code == 0, output[-3000:]
            runs[key] = cwd
        return runs[key]

    return run


KILL_CASES = {
    # kill at step: what the newest checkpoint is when the run dies
    "mid-epoch": (6, []),  # step 4, half-way through epoch 0
    "last batch of an epoch": (10, ["callbacks.last_checkpoint=null"]),  # step 8 = batch 8 of 8
    "right after validation": (10, []),  # last.ckpt after epoch 0's validation
    "max_steps, mid-epoch validation": (
        9,
        ["trainer.max_epochs=-1", "trainer.max_steps=20", "trainer.val_check_interval=3"],
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(KILL_CASES))
def test_sigkill_then_the_same_command_trains_exactly_as_without(
    tmp_path: Path, case: str, reference_run: Callable[[list[str]], Path]
) -> None:
    kill_at, extra = KILL_CASES[case]
    # Which checkpoints are written does not change training: one reference serves both.
    reference = reference_run([o for o in extra if not o.startswith("callbacks.last_checkpoint")])

    kill = [
        "+callbacks.kill._target_=tests.faults.SignalAt", f"+callbacks.kill.step={kill_at}",
        f"+callbacks.kill.marker={tmp_path / 'killed.marker'}",
    ]  # fmt: skip
    command = [*EXACT_RUN, *extra, *kill]
    code, output = finish(start(command, tmp_path / "killed"))
    assert code == -signal.SIGKILL, output[-3000:]
    code, output = finish(start(command, tmp_path / "killed"))
    assert code == 0, output[-3000:]
    assert "Resuming from" in output
    assert_same_training(reference, tmp_path / "killed")


@pytest.mark.slow
def test_ddp_run_killed_on_both_ranks_resumes_exactly(tmp_path: Path) -> None:
    ddp = ["strategy=ddp", "trainer.devices=2"]
    code, output = finish(start([*EXACT_RUN, *ddp], tmp_path / "reference"))
    assert code == 0, output[-3000:]
    kill = [
        "+callbacks.kill._target_=tests.faults.SignalAt", "+callbacks.kill.step=6",
        f"+callbacks.kill.marker={tmp_path / 'killed.marker'}",
    ]  # fmt: skip
    code, output = finish(start([*EXACT_RUN, *ddp, *kill], tmp_path / "killed"))
    assert code == -signal.SIGKILL, output[-3000:]
    code, output = finish(start([*EXACT_RUN, *ddp, *kill], tmp_path / "killed"))
    assert code == 0, output[-3000:]
    assert set(batches_by_step(tmp_path / "killed")) == {".rank0", ".rank1"}
    assert_same_training(tmp_path / "reference", tmp_path / "killed")


@pytest.mark.slow
def test_sigterm_saves_at_the_next_step_boundary_and_exits_143(
    tmp_path: Path, reference_run: Callable[[list[str]], Path]
) -> None:
    term = [
        "+callbacks.term._target_=tests.faults.SignalAt", "+callbacks.term.step=5",
        "+callbacks.term.signal_name=SIGTERM", f"+callbacks.term.marker={tmp_path / 'marker'}",
    ]  # fmt: skip
    code, output = finish(start([*EXACT_RUN, *term], tmp_path / "stopped"))
    assert code == 143, output[-3000:]
    assert "SIGTERM at step 6" in output and "run the same command to resume" in output
    (run_dir,) = (tmp_path / "stopped" / "logs" / "train" / "runs").iterdir()
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 6
    assert not (run_dir / "metrics.json").exists(), "a stopped run is not a finished one"

    code, output = finish(start([*EXACT_RUN, *term], tmp_path / "stopped"))
    assert code == 0, output[-3000:]
    assert_same_training(reference_run([]), tmp_path / "stopped")


@pytest.mark.slow
def test_sigterm_to_one_ddp_rank_stops_both_at_the_next_agreement_step(tmp_path: Path) -> None:
    """Under DDP the ranks agree on a signal every `sync_every_n_steps` (10) steps, not every step:
    SIGTERM to rank 0 after step 5 makes both ranks save at step 10 and exit 143, and the same
    command then finishes the run."""
    ddp = ["strategy=ddp", "trainer.devices=2"]
    term = [
        "+callbacks.term._target_=tests.faults.SignalAt", "+callbacks.term.step=5",
        "+callbacks.term.signal_name=SIGTERM", f"+callbacks.term.marker={tmp_path / 'marker'}",
    ]  # fmt: skip
    code, output = finish(start([*EXACT_RUN, *ddp, *term], tmp_path / "stopped"))
    assert code == 143, output[-3000:]
    assert "Received SIGTERM: saving" in output, "rank 0 got the signal"
    assert "Received a signal on another rank: saving" in output, "rank 1 learned of it"
    assert "SIGTERM at step 10" in output
    (run_dir,) = (tmp_path / "stopped" / "logs" / "train" / "runs").iterdir()
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 10
    trained = batches_by_step(tmp_path / "stopped")
    assert [sorted(trained[rank]) for rank in (".rank0", ".rank1")] == [list(range(10))] * 2

    code, output = finish(start([*EXACT_RUN, *ddp, *term], tmp_path / "stopped"))
    assert code == 0, output[-3000:]
    assert "Resuming from" in output and (run_dir / "metrics.json").is_file()


@pytest.mark.slow
def test_sigusr1_under_slurm_saves_and_requeues_the_job(tmp_path: Path) -> None:
    """SLURM's time-limit warning (`sbatch --signal=USR1@90`): save at a step boundary, then
    `scontrol requeue <job id>` (a fake scontrol on PATH records its arguments)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "scontrol.log"}\n')
    scontrol.chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242"}
    usr1 = [
        "+callbacks.usr1._target_=tests.faults.SignalAt", "+callbacks.usr1.step=3",
        "+callbacks.usr1.signal_name=SIGUSR1", f"+callbacks.usr1.marker={tmp_path / 'marker'}",
    ]  # fmt: skip
    code, output = finish(start([*EXACT_RUN, *usr1], tmp_path / "job", env))
    assert code == 143, output[-3000:]
    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", "4242"]
    assert "SIGUSR1 at step 4" in output and "requeued the job" in output


def test_random_states_survive_a_checkpoint_and_load_lazily(tmp_path: Path) -> None:
    """Lightning's lazy loader (FSDP) reads every tensor a checkpoint holds."""
    from lightning.fabric.utilities.load import _lazy_load, _materialize_tensors

    from {{ cookiecutter.package_name }}.callbacks.exact_resume import (
        random_states,
        set_random_states,
    )

    path = tmp_path / "states.ckpt"
    torch.save({"random_states": random_states()}, path)
    expected = torch.rand(3)
    set_random_states(_materialize_tensors(_lazy_load(path))["random_states"])
    set_random_states(torch.load(path, weights_only=True)["random_states"])
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.slow
def test_terminated_multirun_exits_143_naming_the_job_and_the_same_command_finishes_it(
    tmp_path: Path,
) -> None:
    term = [
        "+callbacks.term._target_=tests.faults.SignalAt", "+callbacks.term.step=3",
        "+callbacks.term.signal_name=SIGTERM", f"+callbacks.term.marker={tmp_path / 'marker'}",
    ]  # fmt: skip
    sweep = ["--multirun", *EXACT_RUN, *term, "trainer.max_epochs=1", "seed=1,2"]
    code, output = finish(start(sweep, tmp_path))
    assert code == 143, output[-3000:]
    (sweep_dir,) = (tmp_path / "logs" / "train" / "multiruns").iterdir()
    assert f"SIGTERM at step 4: saved {sweep_dir / '0' / 'checkpoints' / 'last.ckpt'}" in output

    code, output = finish(start(sweep, tmp_path))
    assert code == 0, output[-3000:]
    assert "Resuming from" in output
    assert [row.split(",")[2] for row in (sweep_dir / "summary.csv").read_text().split()[1:]] == [
        "COMPLETED",
        "COMPLETED",
    ]


def test_checkpoint_writes_are_atomic_and_keep_the_previous_one(tmp_path: Path) -> None:
    path = tmp_path / "last.ckpt"
    atomic_torch_save({"global_step": 1}, path)
    atomic_torch_save({"global_step": 2}, path)
    assert torch.load(path, weights_only=True)["global_step"] == 2
    assert torch.load(tmp_path / "last-previous.ckpt", weights_only=True)["global_step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last-previous.ckpt", "last.ckpt"]


def test_interrupted_write_leaves_the_old_checkpoint_and_no_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "last.ckpt"
    atomic_torch_save({"global_step": 1}, path)

    def dies_mid_write(obj: object, file: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", dies_mid_write)
    with pytest.raises(KeyboardInterrupt):
        atomic_torch_save({"global_step": 2}, path)
    monkeypatch.undo()
    assert torch.load(path, weights_only=True)["global_step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


def test_leftover_temporary_file_of_a_killed_save_is_ignored_and_removed(tmp_path: Path) -> None:
    good = tmp_path / "last.ckpt"
    torch.save({"global_step": 3}, good)
    leftover = tmp_path / ".last.ckpt.tmp-12345"
    leftover.write_bytes(b"\x80\x02half a checkpoint")
    assert newest_valid_checkpoint(tmp_path) == good
    assert not leftover.exists()


def test_checkpoint_with_non_finite_weights_is_never_written(tmp_path: Path) -> None:
    from {{ cookiecutter.package_name }}.checkpoints import (
        AtomicCheckpointIO,
    )

    path = tmp_path / "last.ckpt"
    finite, broken = {"w": torch.ones(2)}, {"w": torch.tensor([1.0, torch.nan])}
    atomic_torch_save({"state_dict": finite}, path)
    with pytest.raises(NonFiniteWeightsError, match="w"):
        AtomicCheckpointIO().save_checkpoint({"state_dict": broken}, path)
    assert torch.equal(torch.load(path, weights_only=True)["state_dict"]["w"], torch.ones(2))
