"""Instantiating loggers and callbacks from their config groups."""

from __future__ import annotations

import csv
import logging
{%- if cookiecutter.logger == "wandb" %}
import os
import secrets
import urllib.error
import urllib.request
from pathlib import Path
{%- endif %}
from typing import Any

from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch import loggers
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
{%- if cookiecutter.logger == "wandb" %}
from omegaconf import DictConfig, OmegaConf, open_dict

from .errors import ConfigError
from .run.machine import wandb_login_present
from .targets import build
{%- else %}
from omegaconf import DictConfig

from .errors import ConfigError
from .targets import build
{%- endif %}

log = logging.getLogger(__name__)

NEEDS_A_LOGGER = ("LearningRateMonitor",)


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

{%- if cookiecutter.logger == "wandb" %}


class WandbLogger(loggers.WandbLogger):
    """Lightning's WandbLogger without the `anonymous=None` it passes to `wandb.init`, which
    wandb answers with a deprecation warning on every run."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self._wandb_init.get("anonymous") is None:
            self._wandb_init.pop("anonymous", None)
{%- endif %}


def instantiate_group(group: DictConfig | None, where: str) -> list[Any]:
    """Instantiate each named entry (`name: {_target_: ...}`) of a callbacks or logger group; an
    entry set to null is off, and one that is neither (`early_stopping=maybe`) is refused."""
    if not group:
        return []
    for name, node in group.items():
        if node is not None and not (isinstance(node, DictConfig) and "_target_" in node):
            raise ConfigError(
                f"{where}.{name!s}={node!r} is not a {where} config (with a _target_): "
                f"set {where}.{name!s}=null to turn it off."
            )
    return [
        build(node, where=f"{where}.{name!s}") for name, node in group.items() if node is not None
    ]


def instantiate_callbacks(group: DictConfig | None, have_logger: bool) -> list[Any]:
    callbacks = instantiate_group(group, "callbacks")
    if have_logger:
        return callbacks
    dropped = [c for c in callbacks if type(c).__name__ in NEEDS_A_LOGGER]
    for callback in dropped:
        log.info("No logger configured: %s is off.", type(callback).__name__)
    return [c for c in callbacks if c not in dropped]
{%- if cookiecutter.logger == "wandb" %}


def prepare_wandb(node: DictConfig) -> None:
    """With no wandb login, log offline (one line says so) instead of prompting or failing. A run
    keeps one wandb run id, stored in its run directory, so a resumed run continues it."""
    if node.get("id") is None and node.get("save_dir"):
        id_file = Path(str(node.save_dir)) / "wandb_run_id.txt"
        if not id_file.is_file():
            id_file.parent.mkdir(parents=True, exist_ok=True)
            id_file.write_text(secrets.token_hex(8) + "\n")
        with open_dict(node):
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


def start_wandb(node: DictConfig) -> Any:
    """Start the wandb run now rather than at its first log call, so that an unreachable server
    means logging offline within about `settings.init_timeout` seconds, not a crash."""
    prepare_wandb(node)
    if node.get("offline") or os.environ.get("WANDB_MODE") in ("offline", "disabled", "dryrun"):
        return build(node)
    timeout = float(OmegaConf.select(node, "settings.init_timeout", default=30))
    problem = wandb_server_answers(timeout / 3)
    logger = build(node)
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
    return build(node)


{%- endif %}


def instantiate_loggers(group: DictConfig | None) -> list[Any]:
{%- if cookiecutter.logger == "wandb" %}
    if group and isinstance(group.get("wandb"), DictConfig) and "_target_" in group.wandb:
        others = OmegaConf.masked_copy(group, [str(name) for name in group if name != "wandb"])
        return [start_wandb(group.wandb), *instantiate_group(others, "logger")]
{%- endif %}
    return instantiate_group(group, "logger")
