"""The learning-rate schedule's config (`model.scheduler`), checked in the validation phase against
the signature of the class it names: a wrong or missing argument is one line naming the class's
arguments, before anything is built or written."""

from __future__ import annotations

import inspect
from typing import Any

from hydra.utils import get_object
from omegaconf import DictConfig, OmegaConf

from ..errors import ConfigError
from ..models.optim import (
    INTERVALS,
    STEPPING_KEYS,
    described_arguments,
    schedule_arguments,
    takes_total_steps,
)

KEY = "model.scheduler"
CHOOSE = "choose one with scheduler=<cosine|onecycle|step|plateau|constant>"


def check_schedule(cfg: DictConfig) -> None:
    node = OmegaConf.select(cfg, KEY, default=None)
    if node is None:
        return
    if not isinstance(node, DictConfig) or not node.get("_target_"):
        raise ConfigError(
            f"{KEY} needs a `_target_` (a torch.optim.lr_scheduler class) with `_partial_: true`, "
            f"or null for a constant learning rate: {CHOOSE}."
        )
    target = str(node._target_)
    if node.get("_partial_") is not True:
        raise ConfigError(
            f"{KEY}._partial_ must be true: the optimizer that {target} schedules is built when "
            "training starts."
        )
    interval = node.get("interval", "step")
    if interval not in INTERVALS:
        raise ConfigError(
            f"{KEY}.interval={interval}: use step (after every optimizer step) or epoch."
        )
    frequency = node.get("frequency", 1)
    if isinstance(frequency, bool) or not isinstance(frequency, int) or frequency < 1:
        raise ConfigError(f"{KEY}.frequency={frequency}: use a whole number of 1 or more.")
    factory = scheduler_factory(target)
    unknown, missing = schedule_arguments(factory, [str(key) for key in node])
    if unknown or missing:
        name = getattr(factory, "__name__", target)
        problem = (
            f"{name} takes no {', '.join(unknown)}"
            if unknown
            else f"{name} needs {', '.join(missing)}"
        )
        fix = (
            f"remove {'them' if len(unknown) > 1 else 'it'} with "
            + " ".join(f"~{KEY}.{key}" for key in unknown)
            if unknown
            else "add " + " ".join(f"+{KEY}.{key}=<value>" for key in missing)
        )
        raise ConfigError(
            f"{KEY}._target_={target}: {problem}; its arguments are "
            f"{described_arguments(factory) or 'none'} (and {', '.join(STEPPING_KEYS)}, which "
            f"say when it steps): {fix}, or {CHOOSE}."
        )
    check_stepping(cfg, node, factory, interval)


def scheduler_factory(target: str) -> Any:
    try:
        factory = get_object(target)
    except Exception as error:  # Hydra's error for a name that does not import
        raise ConfigError(f"{KEY}._target_={target} cannot be imported: {error}") from None
    if not callable(factory):
        raise ConfigError(f"{KEY}._target_={target} is not a class or function.")
    try:
        inspect.signature(factory)
    except (TypeError, ValueError):
        raise ConfigError(f"{KEY}._target_={target} has no signature to check.") from None
    return factory


def check_stepping(cfg: DictConfig, node: DictConfig, factory: Any, interval: str) -> None:
    from torch.optim.lr_scheduler import ReduceLROnPlateau

    on_a_metric = isinstance(factory, type) and issubclass(factory, ReduceLROnPlateau)
    if on_a_metric and not node.get("monitor"):
        monitored = OmegaConf.select(cfg, "monitor.metric", default="val/loss")
        raise ConfigError(
            f"{KEY}._target_={factory.__name__} steps on a metric: set +{KEY}.monitor="
            f"{monitored} (scheduler=plateau watches the run's monitor.metric)."
        )
    if not on_a_metric and node.get("monitor") is not None:
        raise ConfigError(
            f"{KEY}.monitor is only for ReduceLROnPlateau, which steps on a metric: remove it "
            f"with ~{KEY}.monitor."
        )
    epochs = OmegaConf.select(cfg, "trainer.max_epochs", default=None)
    counts_epochs = interval == "epoch" and node.get("total_steps") is None
    if (
        counts_epochs
        and takes_total_steps(factory)
        and not (isinstance(epochs, int) and epochs > 0)
    ):
        raise ConfigError(
            f"{KEY}.interval=epoch: {factory.__name__} needs the number of epochs, and "
            f"trainer.max_epochs={epochs} gives none: set trainer.max_epochs, or "
            f"+{KEY}.total_steps=<epochs>, or {KEY}.interval=step."
        )
