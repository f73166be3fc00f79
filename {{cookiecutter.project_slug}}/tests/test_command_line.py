"""The command line as a user types it: Hydra's own errors in one line, paths the project prints
pasted back, one live command per run directory, and a console without third-party noise."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from {{ cookiecutter.package_name }}.run.names import pasteable

from .helpers import PACKAGE, PROJECT_ROOT, run_cli
from .killing import COMMON, SMALL_SHAPE, fault, run, start

QUICK = ["trainer=cpu", "logger=csv", "extras.print_config=false", "callbacks.progress_bar=null"]
{%- if cookiecutter.examples == "language" %}
TINY = [*QUICK, "model.net.n_layer=1", "data.max_bytes=100000", "trainer.max_steps=4",
        "trainer.val_check_interval=4", "trainer.limit_val_batches=1", "trainer.limit_test_batches=1"]  # fmt: skip
{%- else %}
TINY = [*QUICK, "trainer.max_epochs=1", "trainer.limit_train_batches=4",
        "trainer.limit_val_batches=1", "trainer.limit_test_batches=1"]  # fmt: skip
{%- endif %}


# What a command needs to import this project's tests (the fault-injecting callbacks).
IMPORTABLE = {"PYTHONPATH": f"{PROJECT_ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 1, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def not_writable_folder(tmp_path: Path) -> Path:
    """A folder that even root cannot create: under /sys where it is read-only, else under a file."""
    try:
        os.mkdir("/sys/lightning-hydra-probe")
    except OSError as error:
        if error.errno in (errno.EPERM, errno.EROFS, errno.EACCES):
            return Path("/sys/lightning-hydra-probe")
    (tmp_path / "a_file").write_text("not a folder")
    return tmp_path / "a_file" / "logs"


RECIPE_MODULES = {"train": "train", "evaluate": "eval", "predict": "predict", "export": "export",
                  "serve": "serve"}  # fmt: skip
{%- if cookiecutter.examples != "vision" %}
RECIPE_MODULES["prepare"] = "prepare"
{%- endif %}


@pytest.mark.parametrize("module", list(RECIPE_MODULES))
def test_python_dash_m_on_a_recipe_module_runs_its_command(module: str, tmp_path: Path) -> None:
    result = run_cli("-m", f"{PACKAGE}.recipes.{module}", "--cfg", "job", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"task_name: {RECIPE_MODULES[module]}\n" in result.stdout


NOT_A_NUMBER = "in the environment is not a whole number"
# environment, command, its arguments, what the error says
LAUNCHER_ENVIRONMENT_CASES = {
    "LOCAL_RANK not a number": ({"LOCAL_RANK": "abc"}, "train", [], f"LOCAL_RANK='abc' {NOT_A_NUMBER}"),
    "SLURM_NTASKS not a number": ({"SLURM_NTASKS": "many", "SLURM_JOB_ID": "7"}, "train", [], f"SLURM_NTASKS='many' {NOT_A_NUMBER}"),
    "WORLD_SIZE empty": ({"WORLD_SIZE": ""}, "evaluate", ["ckpt_path=last.ckpt"], f"WORLD_SIZE='' {NOT_A_NUMBER}"),
    "MASTER_PORT negative": ({"MASTER_PORT": "-1"}, "bench", [], f"MASTER_PORT='-1' {NOT_A_NUMBER}"),
    "a launcher's variables left for a run of two processes": (
        {"LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "29500"}, "train",
        ["strategy=ddp", "trainer.devices=2"], "a launcher started 1 process(es), but trainer.devices=2",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(LAUNCHER_ENVIRONMENT_CASES))
def test_a_launcher_environment_that_cannot_work_is_one_line_and_writes_nothing(
    case: str, tmp_path: Path
) -> None:
    """torchmetrics reads LOCAL_RANK on import and Lightning SLURM_NTASKS on start-up (each was a
    traceback); with LOCAL_RANK set, Lightning waited for ever for processes that nobody starts."""
    environment, command, args, fragment = LAUNCHER_ENVIRONMENT_CASES[case]
    module, function = ("recipes.bench", "main") if command == "bench" else ("cli", command)
    entry = ["-c", f"from {PACKAGE}.{module} import {function}; {function}()"]
    result = run_cli(*entry, "trainer=cpu", *args, cwd=tmp_path, env=environment)
    assert fragment in one_error_line(result)
    assert not list(tmp_path.iterdir()), "nothing written"


COMMAND_LINE_CASES = {
    "typo in a nested key": (["model.optimizer.lrr=0.1"], ["model.optimizer.lrr", "+model.optimizer.lrr=0.1"]),
    "typo in a top-level key": (["sed=3"], ["'sed'", "+sed=3"]),
    "unknown option of a group": (["model=nope"], ["model/nope", "Choose one of"]),
    "unknown group": (["optimiser=adam"], ["optimiser"]),
    "unparsable override": (["trainer.max_epochs=[1"], ["'trainer.max_epochs=[1'", "Quote"]),
    "unclosed quote": (["run_name='abc"], ["run_name='abc", "Quote"]),
    "interpolation to nothing": (["seed=${nothing}"], ["nothing"]),
    "override without a key": (["=1"], ["has no key", "key=value"]),
    "launcher named by _target_": (["--multirun", "hydra.launcher._target_=os.system"], ["Invalid plugin 'os.system'", "hydra/launcher="]),
    "sweeper named by _target_": (["--multirun", "hydra.sweeper._target_=os.system"], ["Invalid plugin 'os.system'", "hparams_search="]),
}  # fmt: skip


@pytest.mark.parametrize("case", list(COMMAND_LINE_CASES))
def test_hydras_errors_are_one_line_and_write_nothing(case: str, tmp_path: Path) -> None:
    args, fragments = COMMAND_LINE_CASES[case]
    flags = [arg for arg in args if arg.startswith("--")]
    overrides = [arg for arg in args if arg not in flags]
    line = one_error_line(run_cli("-m", PACKAGE, *flags, *QUICK, *overrides, cwd=tmp_path))
    for fragment in fragments:
        assert fragment in line
    assert list(tmp_path.iterdir()) == []


def test_a_config_file_that_is_not_yaml_is_named_in_one_line(tmp_path: Path) -> None:
    """A broken `local/default.yaml` (the git-ignored machine settings), found on a config dir."""
    (tmp_path / "configs" / "local").mkdir(parents=True)
    broken = tmp_path / "configs" / "local" / "default.yaml"
    broken.write_text("trainer:\n  devices: [1\n")
    result = run_cli("-m", PACKAGE, "--config-dir", str(tmp_path / "configs"), *QUICK, cwd=tmp_path)
    line = one_error_line(result)
    assert str(broken) in line and "not valid YAML" in line
    assert not (tmp_path / "logs").exists()


def test_a_config_file_that_is_not_utf8_is_named_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "configs" / "local").mkdir(parents=True)
    latin1 = tmp_path / "configs" / "local" / "default.yaml"
    latin1.write_bytes("run_name: café\n".encode("latin-1"))
    result = run_cli("-m", PACKAGE, "--config-dir", str(tmp_path / "configs"), *QUICK, cwd=tmp_path)
    line = one_error_line(result)
    assert str(latin1) in line and "not UTF-8" in line
    assert not (tmp_path / "logs").exists()


def test_a_log_file_outside_the_run_folder_is_one_line(tmp_path: Path) -> None:
    log_file = not_writable_folder(tmp_path) / "train.log"
    handler = f"hydra.job_logging.handlers.file.filename={log_file}"
    line = one_error_line(run_cli("-m", PACKAGE, *TINY, handler, cwd=tmp_path))
    assert f"filename={log_file}: logging writes files only in the run's folder" in line


def test_a_trainer_that_cannot_be_built_leaves_no_run_directory(tmp_path: Path) -> None:
{%- if cookiecutter.logger == "wandb" %}
    """With the wandb logger, which has written its run id by then."""
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path / "wandb")}
    logger = "logger=wandb"
{%- else %}
    env: dict[str, str] = {}
    logger = "logger={{ cookiecutter.logger }}"
{%- endif %}
    result = run_cli("-m", PACKAGE, *QUICK, logger, "+trainer.bogus=1", cwd=tmp_path, env=env)
    assert "bogus" in one_error_line(result)
    assert not (tmp_path / "logs").exists()


def test_a_log_folder_that_cannot_be_written_is_one_line(tmp_path: Path) -> None:
    folder = not_writable_folder(tmp_path)
    line = one_error_line(run_cli("-m", PACKAGE, *TINY, f"paths.log_dir={folder}", cwd=tmp_path))
    assert "cannot write" in line and "paths.log_dir" in line


def test_a_log_folder_under_a_file_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "logs").write_text("a file where the log folder goes")
    line = one_error_line(run_cli("-m", PACKAGE, *TINY, cwd=tmp_path))
    assert "Not a directory" in line and "a file stands where a folder must" in line
    assert [path.name for path in tmp_path.iterdir()] == ["logs"]


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs a /proc file system")
def test_a_log_folder_where_none_can_be_made_is_one_line(tmp_path: Path) -> None:
    line = one_error_line(run_cli("-m", PACKAGE, *TINY, "paths.log_dir=/proc/logs", cwd=tmp_path))
    assert "cannot make the folder /proc/logs" in line and "paths.log_dir" in line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine with no GPU")
def test_a_machine_that_cannot_run_the_settings_is_refused_before_anything_is_written(
    tmp_path: Path,
) -> None:
    """With the project's default logger, which writes its folder when it starts."""
    result = run_cli("-m", PACKAGE, "trainer=gpu", "extras.print_config=false", cwd=tmp_path)
    assert "trainer=cpu" in one_error_line(result)
    assert list(tmp_path.iterdir()) == []


def test_an_error_in_training_starts_its_own_line_after_the_progress_bar(tmp_path: Path) -> None:
    """In a terminal the progress bar (stdout) and the error (stderr) share the screen: the
    error line was glued to the end of the bar's."""
    with_bar = [arg for arg in TINY if arg != "callbacks.progress_bar=null"]
    nan = ["allowed_targets=[tests.faults.NanGradientAt]",
           "+callbacks.nan._target_=tests.faults.NanGradientAt", "+callbacks.nan.steps=[2]"]  # fmt: skip
    screen = subprocess.run(
        [sys.executable, "-m", PACKAGE, *with_bar, *nan],
        cwd=tmp_path,
        env={**os.environ, **IMPORTABLE},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
    )
    assert screen.returncode == 1, screen.stdout[-3000:]
    assert "Epoch 0" in screen.stdout, "the progress bar was drawn"
    lines = screen.stdout.strip().split("\n")
    assert lines[-1].startswith("error: Non-finite"), lines[-1][-500:]


@pytest.mark.parametrize("metric", ["val/nothing", "train/nothing"])
def test_a_monitored_metric_that_is_not_logged_is_one_line_and_leaves_nothing(
    tmp_path: Path, metric: str
) -> None:
    """A validation metric is refused at the end of the sanity check, before any batch trains;
    a training metric once training has logged (Lightning's check), and what the new run wrote
    goes with it."""
    record = ["allowed_targets=[tests.faults.RecordBatches]",
              "+callbacks.record._target_=tests.faults.RecordBatches",
              f"+callbacks.record.path={tmp_path / 'batches.txt'}"]  # fmt: skip
    work = tmp_path / "work"
    work.mkdir()
    result = run_cli("-m", PACKAGE, *TINY, *record, "trainer.log_every_n_steps=1",
                     f"monitor.metric={metric}", cwd=work,
                     env=IMPORTABLE)  # fmt: skip
    line = one_error_line(result)
    assert f"monitor.metric={metric} is not a metric that the run logs" in line
    assert not list(work.iterdir()), "nothing written"
    trained = (tmp_path / "batches.txt.rank0").is_file()
    assert trained == metric.startswith("train"), "a validation metric is refused before training"


@pytest.mark.slow
@pytest.mark.parametrize("problem", ["metric not logged", "non-finite loss"])
def test_an_error_in_a_spawned_process_is_one_line_and_leaves_nothing(
    tmp_path: Path, problem: str
) -> None:
    """Under strategy=ddp_spawn torch hands the command only the processes' tracebacks as text:
    the project's error in them is still the one line, and what the run wrote goes."""
    bad, words = {
        "metric not logged": (["monitor.metric=val/nothing"], "monitor.metric=val/nothing"),
        "non-finite loss": (["allowed_targets=[tests.faults.NanGradientAt]",
                             "+callbacks.nan._target_=tests.faults.NanGradientAt",
                             "+callbacks.nan.steps=[1]"], "Non-finite"),
    }[problem]  # fmt: skip
    spawned = ["strategy=ddp_spawn", "trainer.devices=2", "trainer.log_every_n_steps=1"]
    result = run_cli("-m", PACKAGE, *TINY, *spawned, *bad, cwd=tmp_path, env=IMPORTABLE)
    assert result.returncode == 1, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and words in last, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    if problem == "metric not logged":
        assert not list(tmp_path.iterdir()), "nothing written"


def test_full_errors_stay_available(tmp_path: Path) -> None:
    result = run_cli("-m", PACKAGE, "sed=3", cwd=tmp_path, env={"HYDRA_FULL_ERROR": "1"})
    assert result.returncode == 1 and "Traceback" in result.stderr


PASTED = {
    "run directory with overrides": ("ckpt_path=logs/train/runs/a=1,b=2/last.ckpt", "ckpt_path='logs/train/runs/a=1,b=2/last.ckpt'"),
    "non-ASCII name": ("run_name=été", "run_name='été'"),
    "non-ASCII sweep": ("run_name=é,ü", "run_name='é','ü'"),
    "already quoted": ("run_name='a=b'", "run_name='a=b'"),
    "plain value": ("seed=3", "seed=3"),
    "sweep": ("seed=1,2", "seed=1,2"),
    "interpolation": ("x=${oc.env:A,b=c}", "x=${oc.env:A,b=c}"),
    "flag": ("--config-dir=/a=b", "--config-dir=/a=b"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(PASTED))
def test_pasted_values_are_quoted_for_hydra(case: str) -> None:
    typed, passed = PASTED[case]
    assert pasteable(typed) == passed


@pytest.mark.slow
def test_printed_paths_and_non_ascii_names_work_pasted_back(tmp_path: Path) -> None:
    """The run directory of a run with overrides, as the "Outputs in" line prints it, pasted into
    eval and into ckpt_path; two non-ASCII names that differ get two directories."""
    trained = run_cli("-m", PACKAGE, *TINY, "seed=3", cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr[-3000:]
    console = trained.stdout + trained.stderr
    (outputs,) = [line for line in console.splitlines() if "Outputs in " in line]
    run_dir = outputs.split("Outputs in ", 1)[1].strip()
    assert "=" in Path(run_dir).name and "," in Path(run_dir).name
    checkpoint = f"ckpt_path={run_dir}/checkpoints/last.ckpt"
    evaluated = run_cli("-c", f"from {PACKAGE}.cli import evaluate; evaluate()", checkpoint,
                        "trainer=cpu", "logger=none", cwd=tmp_path)  # fmt: skip
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert "test/loss=" in evaluated.stdout + evaluated.stderr
    for name in ("été", "ete\u0301", "x" * 300):
        named = run_cli("-m", PACKAGE, *TINY, f"run_name={name}", cwd=tmp_path)
        assert named.returncode == 0, named.stderr[-3000:]
        assert "already finished" not in named.stdout + named.stderr
    runs = tmp_path / "logs" / "train" / "runs"
    assert len(list(runs.iterdir())) == 4


def test_a_second_command_on_a_live_run_directory_is_refused(tmp_path: Path) -> None:
    """The first command holds the run directory while it lives (here stopped with SIGSTOP at its
    second step); the same command started beside it is refused with one line naming the holder's
    process, and runs once the holder is gone (killed: the lock dies with it)."""
    marker = tmp_path / "holding"
    command = [*COMMON, *SMALL_SHAPE, "run_name=shared", *fault("train_step", 2, marker, "SIGSTOP")]
    first = start(command, tmp_path)
    try:
        for _ in range(1200):
            if marker.exists() or first.poll() is not None:
                break
            time.sleep(0.1)
        assert marker.exists(), "the first command reached its second step"
        code, output = run(command, tmp_path)
        assert code == 1, output[-3000:]
        (line,) = [line for line in output.splitlines() if line.startswith("error: ")]
        assert f"process {first.pid} " in line and "run_name" in line
        assert (tmp_path / "logs" / "train" / "runs" / "shared" / ".hydra").is_dir(), "kept"
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    code, output = run(command, tmp_path)
    assert code == 0, output[-3000:]


@pytest.mark.slow
def test_a_refused_command_leaves_the_runs_record_of_its_config_as_it_was(tmp_path: Path) -> None:
    """Hydra writes `.hydra/` before the command checks anything: a command refused from a run
    directory (other overrides, a bad setting) must not leave its config as the run's record."""
    first = run_cli("-m", PACKAGE, *TINY, "run_name=kept", "seed=1", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    record = tmp_path / "logs" / "train" / "runs" / "kept" / ".hydra"
    before = {path.name: path.read_bytes() for path in record.iterdir()}
    assert {"config.yaml", "hydra.yaml", "overrides.yaml"} <= set(before)
    for refused in (["seed=2"], ["seed=abc"], ["model.optimizer.lr=-1"]):
        result = run_cli("-m", PACKAGE, *TINY, "run_name=kept", *refused, cwd=tmp_path)
        assert one_error_line(result)
        after = {path.name: path.read_bytes() for path in record.iterdir()}
        assert after == before, f"{refused} changed the run's record"


def refused_before_any_logger(tmp_path: Path, *args: str) -> str:
    """The one error line of a train command refused before its logger starts a run and prints,
    with this project's logger and with CSV; nothing written by either."""
{%- if cookiecutter.logger == "wandb" %}
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path / "wandb_dir")}
{%- else %}
    env: dict[str, str] = {}
{%- endif %}
    lines = []
    for logger in dict.fromkeys(("{{ cookiecutter.logger }}", "csv")):  # once where they are one
        cwd = tmp_path / logger
        cwd.mkdir()
        result = run_cli("-m", PACKAGE, "trainer=cpu", f"logger={logger}", *args, cwd=cwd, env=env)
        lines.append(one_error_line(result))
        assert not list(cwd.iterdir()), "nothing written"
    assert len(set(lines)) == 1, lines
    return lines[0]


def test_data_refused_while_loading_is_one_line_whatever_the_logger(tmp_path: Path) -> None:
    """Bad data is found as the data module loads: before any logger starts a run and prints."""
{%- if cookiecutter.examples != "vision" %}
    bad_data = ["experiment=language", f"data.source={tmp_path / 'no_such_corpus'}"]
{%- else %}
    for label in ("a", "b"):
        (tmp_path / "images" / label).mkdir(parents=True)
        (tmp_path / "images" / label / "1.png").write_bytes(b"not an image")
    bad_data = ["experiment=image_folder", f"data.root={tmp_path / 'images'}"]
{%- endif %}
    refused_before_any_logger(tmp_path, *bad_data)


def test_a_validation_interval_longer_than_an_epoch_is_one_line_whatever_the_logger(
    tmp_path: Path,
) -> None:
    """Refused once the data is loaded, before a logger starts a run and prints about it."""
{%- if cookiecutter.examples != "vision" %}
    data = ["experiment=language", "data.max_bytes=100000"]
{%- else %}
    data = ["experiment=digits"]
{%- endif %}
    interval = ["trainer.val_check_interval=100000", "trainer.check_val_every_n_epoch=1"]
    assert "val_check_interval=100000" in refused_before_any_logger(tmp_path, *data, *interval)


NOISE = (
    "litlogger", "litmodels", "LeafSpec", "dirpath has changed", "anonymous setting",
    "already configured with model summary", "weights_only` was not set", "INFO: Seed set",
)  # fmt: skip


def test_train_resume_and_eval_print_no_third_party_noise(tmp_path: Path) -> None:
{%- if cookiecutter.logger == "wandb" %}
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path)}
    logger = "logger=wandb"
{%- else %}
    env: dict[str, str] = {}
    logger = "logger={{ cookiecutter.logger }}"
{%- endif %}
    trained = run_cli("-m", PACKAGE, *TINY, logger, cwd=tmp_path, env=env)
    assert trained.returncode == 0, trained.stderr[-3000:]
    run_dir = next((tmp_path / "logs" / "train" / "runs").iterdir())
    (run_dir / "metrics.json").unlink()  # resumed from its finished checkpoint: tests again
    resumed = run_cli("-m", PACKAGE, *TINY, logger, cwd=tmp_path, env=env)
    evaluated = run_cli(
        "-c", f"from {PACKAGE}.cli import evaluate; evaluate()", "trainer=cpu", logger,
        f"ckpt_path={run_dir / 'checkpoints' / 'last.ckpt'}", cwd=tmp_path, env=env,
    )  # fmt: skip
    for result in (trained, resumed, evaluated):
        assert result.returncode == 0, result.stderr[-3000:]
        console = result.stdout + result.stderr
        assert "Outputs in" in console, "our own lines stay"
        assert [noise for noise in NOISE if noise in console] == []


def test_python_warnings_are_not_silenced_wholesale(tmp_path: Path) -> None:
    """Only the listed third-party lines go: a warning from the user's own code still shows."""
    probe = (
        "import warnings, sys\n"
        f"from {PACKAGE}.run.machine import use_hydra_logging_only\n"
        "use_hydra_logging_only()\n"
        "warnings.warn('my own warning')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path
    )
    assert "my own warning" in result.stderr
