"""Instantiating loggers and callbacks from their config groups. Each job of a command is a tracker
run of its own (W&B, MLflow): named by the job's overrides, grouped by its multirun, finished when
the job ends, and continued (same id) when the same command runs the job again."""

from __future__ import annotations

import csv
import fcntl
import json
import logging
import os
import re
import secrets
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch import loggers
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from omegaconf import DictConfig, OmegaConf, open_dict

from .errors import ConfigError
from .run.machine import wandb_login_present
from .run.plan import TrackedJob
from .targets import build

log = logging.getLogger(__name__)

NEEDS_A_LOGGER = ("LearningRateMonitor",)
# The file in a run directory that names its tracker runs, which eval and predict link to.
TRACKING_FILE = "tracking.json"
TRACKING_FILE_LIMIT = 64 << 10
SAFE_VALUE = re.compile(r"[^\x00-\x1f\x7f]{1,500}")  # one printable line
# The package each logger needs, and the project's extra that installs it.
PACKAGES = {"wandb": "wandb", "mlflow": "mlflow-skinny", "tensorboard": "tensorboard"}


class ColumnKeepingWriter(ExperimentWriter):
    """Appends to an existing metrics.csv (a resumed run, ddp_spawn's test stage) instead of
    deleting it, and keeps the columns already there besides the ones this process logs."""

    def _check_log_dir_exists(self) -> None:
        """Lightning's writer deletes an existing metrics.csv here; a resumed run keeps it."""

    def _record_new_keys(self) -> set[str]:
        if self._fs.isfile(self.metrics_file_path):
            with self._fs.open(self.metrics_file_path, "r", newline="") as file:
                header = next(csv.reader(file), [])
            known = set(self.metrics_keys)
            self.metrics_keys += [key for key in header if key not in known]
        return super()._record_new_keys()


class CSVLogger(loggers.CSVLogger):
    """Lightning's CSVLogger, writing through `ColumnKeepingWriter`."""

    @property
    @rank_zero_experiment
    def experiment(self) -> Any:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = ColumnKeepingWriter(log_dir=self.log_dir)
        return self._experiment


class WandbLogger(loggers.WandbLogger):
    """Lightning's WandbLogger without the `anonymous=None` it passes to `wandb.init`, which
    wandb answers with a deprecation warning on every run."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self._wandb_init.get("anonymous") is None:
            self._wandb_init.pop("anonymous", None)


class MLFlowLogger(loggers.MLFlowLogger):
    """Lightning's MLFlowLogger, taking the config's tags as a list, and keeping a resumed run's
    parameters: MLflow refuses to change a logged parameter (`extend=true` raises max_epochs), so
    a changed value is kept as the run first logged it, and said so."""

    def __init__(self, *, tags: Any = None, **kwargs: Any) -> None:
        if isinstance(tags, Mapping):
            tags = {str(key): str(value) for key, value in tags.items()}
        elif tags is not None:
            tags = {str(tag): "" for tag in tags}
        super().__init__(tags=tags, **kwargs)

    def log_hyperparams(self, params: Any) -> None:
        from lightning.fabric.utilities.logger import _convert_params, _flatten_dict

        flat = _flatten_dict(_convert_params(params))
        logged = self.experiment.get_run(self.run_id).data.params
        changed = sorted(k for k, v in flat.items() if k in logged and logged[k] != str(v)[:6000])
        if changed:
            log.info("mlflow: run %s keeps its first values of %s", self.run_id, ", ".join(changed))
        super().log_hyperparams({k: v for k, v in flat.items() if k not in logged})


@dataclass
class TrackedRun:
    """What a job's tracker runs are called: its overrides, its multirun (or its own run folder)
    as the group, the command, and the training run it comes from (eval, predict)."""

    name: str
    group: str
    job_type: str
    trained: dict[str, str] = field(default_factory=dict)


def describe_run(job: TrackedJob | None, trained_from: str | None = None) -> TrackedRun:
    """The job's tracker run: named by `run_name`, else its overrides (all of them, where its
    run folder's name is shortened), grouped by its multirun's folder (else its own folder, or
    the group of the training run it links to)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    job_type = job.command if job else "train"
    folder = job.run_dir.name if job else job_type
    name, group = folder, folder
    if HydraConfig.initialized():
        hydra = HydraConfig.get()
        overrides = str(hydra.job.override_dirname or "")
        if hydra.mode == RunMode.MULTIRUN:
            name, group = overrides or "default", Path(str(hydra.sweep.dir)).name
        else:
            name = job.run_name if job and job.run_name else overrides or folder
    trained = trained_run(Path(trained_from)) if trained_from else {}
    if trained.get("group"):
        group = trained["group"]
    return TrackedRun(name, group, job_type, trained)


def read_tracking(folder: Path) -> dict[str, str]:
    """The tracking record in a run folder, as plain names; nothing where there is none or it is
    not one."""
    path = folder / TRACKING_FILE
    try:
        if not path.is_file() or path.stat().st_size > TRACKING_FILE_LIMIT:
            return {}
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(record, dict):
        return {}
    values = {str(k): v for k, v in record.items() if isinstance(v, str)}
    return {k: v for k, v in values.items() if SAFE_VALUE.fullmatch(v)}


def trained_run(checkpoint: Path) -> dict[str, str]:
    """The tracking record of the run that wrote `checkpoint`: in the run folder above its
    checkpoints/ (or beside it)."""
    for folder in (checkpoint.parent.parent, checkpoint.parent):
        record = read_tracking(folder)
        if record:
            return record
    return {}


def write_tracking(output_dir: str | None, run: TrackedRun, started: list[Any]) -> None:
    """`tracking.json` in the run folder: the group and name, and each tracker's run id."""
    if not output_dir or not any(isinstance(x, (WandbLogger, MLFlowLogger)) for x in started):
        return
    record: dict[str, str] = {"group": run.group, "name": run.name, "job_type": run.job_type}
    for logger in started:
        if isinstance(logger, WandbLogger) and logger._wandb_init.get("id"):
            record["wandb"] = str(logger._wandb_init["id"])
        elif isinstance(logger, MLFlowLogger) and logger.run_id:
            record["mlflow"] = str(logger.run_id)
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    written = Path(output_dir) / f".{TRACKING_FILE}.tmp-{os.getpid()}"
    written.write_text(json.dumps(record, indent=1) + "\n")
    written.replace(Path(output_dir) / TRACKING_FILE)  # never half a record (no fsync: a hint)


def instantiate_group(group: DictConfig | None, where: str) -> list[Any]:
    """Instantiate each named entry (`name: {_target_: ...}`) of a callbacks or logger group; an
    entry set to null is off, and one that is neither (`early_stopping=maybe`) is refused."""
    check_group(group, where)
    return [
        build_logger(node, where=f"{where}.{name!s}")
        for name, node in (group or {}).items()
        if node is not None
    ]


def check_group(group: DictConfig | None, where: str) -> None:
    for name, node in (group or {}).items():
        if node is not None and not (isinstance(node, DictConfig) and "_target_" in node):
            raise ConfigError(
                f"{where}.{name!s}={node!r} is not a {where} config (with a _target_): "
                f"set {where}.{name!s}=null to turn it off."
            )


def build_logger(node: DictConfig, where: str) -> Any:
    """`build`, with a tracker package that is not installed as one line naming what to install."""
    try:
        return build(node, where=where)
    except ConfigError as error:
        missing = getattr(error.__cause__, "__cause__", None)
        if not isinstance(missing, ModuleNotFoundError):
            raise
        wanted = next((p for m, p in PACKAGES.items() if m in str(missing).lower()), None)
        if wanted is None:
            raise
        extra = next(m for m, p in PACKAGES.items() if p == wanted)
        raise ConfigError(
            f"{where} needs the {wanted} package, which is not installed: pip install "
            f"-e '.[{extra}]' in the project (or pip install {wanted})."
        ) from error


def instantiate_callbacks(group: DictConfig | None, have_logger: bool) -> list[Any]:
    callbacks = instantiate_group(group, "callbacks")
    if have_logger:
        return callbacks
    dropped = [c for c in callbacks if type(c).__name__ in NEEDS_A_LOGGER]
    for callback in dropped:
        log.info("No logger configured: %s is off.", type(callback).__name__)
    return [c for c in callbacks if c not in dropped]


def prepare_wandb(node: DictConfig, run: TrackedRun | None = None) -> None:
    """Name, group and job type from the job; with no wandb login, log offline (one line says so)
    instead of prompting or failing. A run keeps one wandb run id, stored in its run directory,
    so a resumed run continues it; under a W&B sweep agent, the id is the one the agent gave."""
    with open_dict(node):
        if run is not None:
            node.name = node.get("name") or run.name
            node.group = node.get("group") or run.group
            node.job_type = node.get("job_type") or run.job_type
        if node.get("id") is None and node.get("save_dir"):
            id_file = Path(str(node.save_dir)) / "wandb_run_id.txt"
            agents = os.environ.get("WANDB_RUN_ID") if os.environ.get("WANDB_SWEEP_ID") else None
            if agents or not id_file.is_file():
                id_file.parent.mkdir(parents=True, exist_ok=True)
                id_file.write_text((agents or secrets.token_hex(8)) + "\n")
            node.id = id_file.read_text().strip()
            node.resume = "allow"
    if node.get("offline") or os.environ.get("WANDB_MODE") in ("offline", "disabled", "dryrun"):
        return
    if not wandb_login_present():
        node.offline = True
        log.warning(
            "wandb: no login found, logging offline under %s; after `wandb login`, upload "
            "with `wandb sync <that folder>/wandb/offline-run-*`.",
            node.get("save_dir"),
        )


def wandb_server_answers(timeout: float) -> str | None:
    """None when the wandb server answers HTTP within `timeout` seconds (through any proxy the
    environment sets), else why not. wandb's own wait for an unreachable server is minutes."""
    url = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")
    try:
        urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout)
    except urllib.error.HTTPError:
        return None  # it answered
    except (OSError, ValueError) as error:
        return f"{url} does not answer: {getattr(error, 'reason', error)}"
    return None


def finish_leftover_wandb_run() -> None:
    """A wandb run still open in this process (an earlier job of a multirun whose process runs
    this job too) ends here: Lightning would log this job into it."""
    wandb = sys.modules.get("wandb")
    if wandb is not None and getattr(wandb, "run", None) is not None:
        log.info("wandb: finishing run %s, left open by an earlier job", wandb.run.id)
        wandb.run.finish()


def start_wandb(node: DictConfig, run: TrackedRun | None = None) -> Any:
    """Start the wandb run now rather than at its first log call, so that an unreachable server
    means logging offline within about `settings.init_timeout` seconds, not a crash."""
    finish_leftover_wandb_run()
    prepare_wandb(node, run)
    if node.get("offline") or os.environ.get("WANDB_MODE") in ("offline", "disabled", "dryrun"):
        return build_logger(node, "logger.wandb")
    timeout = float(OmegaConf.select(node, "settings.init_timeout", default=30))
    problem = wandb_server_answers(timeout / 3)
    logger = build_logger(node, "logger.wandb")
    if problem is None:
        try:
            logger.experiment  # noqa: B018 (starts the run)
            return logger
        except Exception as error:  # wandb raises several types for network failures
            problem = str(error).splitlines()[0] if str(error) else type(error).__name__
            import wandb

            wandb.teardown()
    log.warning(
        "wandb: cannot start the online run (%s); logging offline under %s instead. Upload "
        "later with `wandb sync <that folder>/wandb/offline-run-*`.",
        problem,
        node.get("save_dir"),
    )
    node.offline = True
    return build_logger(node, "logger.wandb")


@contextmanager
def store_lock(tracking_uri: str) -> Iterator[None]:
    """For a local SQLite store: its folder made, and one process at a time creating its tables,
    experiment and run (the jobs of a parallel multirun start together)."""
    if not tracking_uri.startswith("sqlite:///"):
        yield
        return
    database = Path(tracking_uri.removeprefix("sqlite:///"))
    database.parent.mkdir(parents=True, exist_ok=True)
    with open(database.parent / (database.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def start_mlflow(node: DictConfig, run: TrackedRun | None, output_dir: str | None) -> Any:
    """The job's MLflow run: the one its run folder names (a resumed job), else a new one, named,
    tagged with the config's tags, the group and the command, and under the training run it
    comes from (eval, predict)."""
    with open_dict(node):
        tags = {str(tag): "" for tag in (node.get("tags") or [])}
        if run is not None:
            node.run_name = node.get("run_name") or run.name
            tags |= {"group": run.group, "job_type": run.job_type}
            if run.trained.get("mlflow"):
                tags["mlflow.parentRunId"] = run.trained["mlflow"]
        node.tags = tags
        if node.get("run_id") is None and output_dir:
            node.run_id = read_tracking(Path(output_dir)).get("mlflow")
    uri = str(node.get("tracking_uri") or "")
    with store_lock(uri):
        logger = build_logger(node, "logger.mlflow")
        if node.get("run_id"):
            try:
                logger.experiment.get_run(node.run_id)
            except Exception:  # the store no longer holds it (a new store): a new run
                log.info("mlflow: run %s is not in %s: starting a new run", node.run_id, uri)
                with open_dict(node):
                    node.run_id = None
                logger = build_logger(node, "logger.mlflow")
        logger.run_id  # noqa: B018 (creates the experiment and the run)
    return logger


def instantiate_loggers(
    group: DictConfig | None, job: TrackedJob | None = None, trained_from: str | None = None
) -> list[Any]:
    """The logger group's loggers, W&B and MLflow runs started for this job; with `job`, the run
    folder's `tracking.json` names them; `trained_from`: the checkpoint whose run this job links
    to (eval, predict)."""
    if not group:
        return []
    check_group(group, "logger")
    run = describe_run(job, trained_from)
    output_dir = str(job.run_dir) if job else None
    started: list[Any] = []
    for name, node in group.items():
        target = str(node.get("_target_")) if node is not None else ""
        if target.endswith(".WandbLogger"):
            started.append(start_wandb(node, run))
        elif target.endswith(".MLFlowLogger"):
            started.append(start_mlflow(node, run, output_dir))
        elif node is not None:
            started.append(build_logger(node, f"logger.{name!s}"))
    write_tracking(output_dir, run, started)
    return started


def log_run_config(started: list[Any], config: Any, trained_from: str | None) -> None:
    """The command's config (resolved, as plain data), and the training run it links to, to each
    logger (eval, predict)."""
    if trained_from and isinstance(config, dict):
        linked = trained_run(Path(trained_from)) | {"checkpoint": trained_from}
        config = config | {"trained_run": linked}
    for logger in started:
        logger.log_hyperparams(config)


def finish_loggers(started: list[Any], failed: bool) -> None:
    """End the job's tracker runs (a W&B run is otherwise reused by the next job of the
    process); an MLflow run ended by an error is marked failed."""
    for logger in started:
        if isinstance(logger, WandbLogger):
            experiment = logger._experiment
            if experiment is not None and not getattr(experiment, "_is_finished", False):
                experiment.finish(exit_code=1 if failed else 0)
        elif isinstance(logger, MLFlowLogger) and failed and logger._initialized:
            logger.finalize("failed")


@contextmanager
def finished_at_the_end(started: list[Any]) -> Iterator[None]:
    try:
        yield
    except BaseException:
        finish_loggers(started, failed=True)
        raise
    finish_loggers(started, failed=False)


def log_predictions(started: list[Any], output_dir: Path) -> None:
    """The predict command's output file to each tracker run (a W&B run file, an MLflow
    artifact), and how many predictions it holds as `predict/count`."""
    for path in sorted(output_dir.glob("predictions.*")):
        count = sum(1 for line in path.read_text().splitlines()[path.suffix == ".csv" :] if line)
        for logger in started:
            logger.log_metrics({"predict/count": count}, step=0)
            if isinstance(logger, WandbLogger) and logger._experiment is not None:
                logger.experiment.save(str(path), base_path=str(output_dir), policy="now")
            elif isinstance(logger, MLFlowLogger):
                logger.experiment.log_artifact(logger.run_id, str(path))
