"""Console scripts. Hydra parses and composes the config here; torch and Lightning are imported only
once a run really starts, so `--help`, `--cfg job` and tab completion answer at once."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from . import command_errors
from .console import remove_unused_run_dir
from .errors import ConfigError, TrainingError, raised_by_a_spawned_process
from .run import record as run_record
from .run import stop_signals
from .run.names import pasteable, verbatim
from .run.other_ranks import wait_for_other_ranks
from .run.parent_death import stop_when_the_torchrun_agent_dies
from .run.settings import check_launcher_environment


def in_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def end_progress_bars() -> None:
    """Progress bars that an error interrupted end their lines (on stdout), so that in a terminal
    the error line starts a line of its own."""
    tqdm = sys.modules.get("tqdm")
    for bar in list(getattr(getattr(tqdm, "tqdm", None), "_instances", ())):
        bar.close()
    sys.stdout.flush()


def _run(task: Callable[[DictConfig], Any], cfg: DictConfig) -> float | None:
    """Run `task`, which imports its recipe (and with it torch) only when called."""
    extras = cfg.get("extras") or {}
    if extras.get("ignore_warnings"):
        warnings.filterwarnings("ignore")
    if extras.get("print_config"):
        print(OmegaConf.to_yaml(cfg, resolve=True))
    try:
        missing = sorted(OmegaConf.missing_keys(cfg))
        if missing:
            raise ConfigError(
                f"{', '.join(missing)} must be set: add e.g. {missing[0]}=... to the command."
            )
        check_launcher_environment()  # torchmetrics reads LOCAL_RANK on import
        metrics = task(cfg)
    except Exception as raised:
        error = raised_by_a_spawned_process(raised) or raised
        if not isinstance(error, (ConfigError, TrainingError, OSError)):
            raise
        line = (
            command_errors.one_line(error) if isinstance(error, OSError)
            else command_errors.without_worker_trace(str(error))
        )  # fmt: skip
        if line is None:
            raise
        if in_multirun():
            raise  # Hydra marks this job failed, runs the others, then exits with code 1
        if isinstance(error, ConfigError):
            run_record.put_back()
        remove_unused_run_dir()
        end_progress_bars()
        # An error that every rank raised alike (a collective's) is printed by the first alone.
        if not getattr(error, "every_rank", False) or command_errors.first_rank():
            print(f"error: {line}", file=sys.stderr)
        wait_for_other_ranks()
        sys.exit(1)
    name = cfg.get("optimized_metric")
    return metrics.get(name) if name else None


# Folders that an empty value would put at the top of the file system or in the folder the
# command runs in ("" + "/checkpoints").
FOLDER_KEYS = ("paths.", "hydra.run.dir", "hydra.sweep.dir", "hydra.sweep.subdir")


def paste_back_arguments() -> None:
    """Paths the project prints (run directories are named `key=value,...`) work pasted back; a
    folder given as nothing is refused before Hydra makes any."""
    sys.argv[1:] = [pasteable(argument) for argument in sys.argv[1:]]
    for argument in sys.argv[1:]:
        key, equals, value = argument.lstrip("+~").partition("=")
        if equals and key.startswith(FOLDER_KEYS) and not value.strip().strip("'\"").strip():
            print(f"error: {key} is empty: give a folder, or leave {key} out.", file=sys.stderr)
            sys.exit(1)


@contextmanager
def ctrl_c_is_one_line() -> Iterator[None]:
    """Ctrl-C before a run's loop, or in a sweep's driver between its jobs, ends the command with
    one line and exit code 130 (inside the loop the run saves first: run.stop_signals)."""
    stop_signals.interrupt_from_startup()
    try:
        yield
    except stop_signals.Interrupted as stopped:
        remove_unused_run_dir(stopped.run_dir)
        end_progress_bars()
        print(stopped, file=sys.stderr)
        sys.exit(stop_signals.INTERRUPTED_EXIT_CODE)


def train() -> None:
    stop_when_the_torchrun_agent_dies()
    if not {"-m", "--multirun"} & set(sys.argv[1:]):  # a sweep's driver stops as it always did
        stop_signals.record_from_startup()
    paste_back_arguments()
    try:
        with ctrl_c_is_one_line():
            train_main()
    finally:
        stop_signals.ignore_warnings()


def predict() -> None:
    stop_signals.record_from_startup()
    sys.argv[1:] = [verbatim(argument, ("prompt",)) for argument in sys.argv[1:]]
    paste_back_arguments()
    try:
        predict_main()
    finally:
        stop_signals.ignore_warnings()


def export() -> None:
    paste_back_arguments()
    export_main()


def serve() -> None:
    paste_back_arguments()
    serve_main()
{%- if cookiecutter.examples != "vision" %}


def prepare() -> None:
    paste_back_arguments()
    prepare_main()
{%- endif %}


def evaluate() -> None:
    stop_signals.record_from_startup()
    paste_back_arguments()
    try:
        with ctrl_c_is_one_line():
            evaluate_main()
    finally:
        stop_signals.ignore_warnings()


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def train_main(cfg: DictConfig) -> float | None:
    """Train, then test the best checkpoint; returns `optimized_metric` for sweepers."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from .sweeps.summary import ddp_multirun_problem

    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode == RunMode.MULTIRUN:
        problem = ddp_multirun_problem(cfg, str(hydra_cfg.launcher.get("_target_", "")))
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            sys.exit(1)

    def run_training(cfg: DictConfig) -> Any:
        from .recipes.train import train

        return train(cfg)

    return _run(run_training, cfg)


@hydra.main(version_base="1.3", config_path="configs", config_name="eval")
def evaluate_main(cfg: DictConfig) -> float | None:
    """Test a checkpoint written by `train`."""

    def run_evaluation(cfg: DictConfig) -> Any:
        from .recipes.evaluate import evaluate

        return evaluate(cfg)

    return _run(run_evaluation, cfg)


@hydra.main(version_base="1.3", config_path="configs", config_name="predict")
def predict_main(cfg: DictConfig) -> float | None:
    """Run a checkpoint written by `train` on new inputs."""

    def run_prediction(cfg: DictConfig) -> Any:
        from .recipes.predict import predict

        return predict(cfg)

    return _run(run_prediction, cfg)


@hydra.main(version_base="1.3", config_path="configs", config_name="export")
def export_main(cfg: DictConfig) -> float | None:
    """Write a checkpoint as a plain (merged) checkpoint, a torch.export program or ONNX."""

    def run_export(cfg: DictConfig) -> Any:
        from .recipes.export import export

        return export(cfg)

    return _run(run_export, cfg)


@hydra.main(version_base="1.3", config_path="configs", config_name="serve")
def serve_main(cfg: DictConfig) -> float | None:
    """Answer HTTP requests with a checkpoint written by `train`, until stopped."""

    def run_server(cfg: DictConfig) -> Any:
        from .recipes.serve import serve

        return serve(cfg)

    return _run(run_server, cfg)
{%- if cookiecutter.examples != "vision" %}


@hydra.main(version_base="1.3", config_path="configs", config_name="prepare")
def prepare_main(cfg: DictConfig) -> float | None:
    """Tokenize a text corpus into memory-mapped token shards."""

    def run_preparation(cfg: DictConfig) -> Any:
        from .recipes.prepare import prepare

        return prepare(cfg)

    return _run(run_preparation, cfg)
{%- endif %}
