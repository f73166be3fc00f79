"""A run folder holds one run: the overrides it was started with are recorded in it, a different
command that comes to the same folder is refused, and a finished run is not trained again."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from ..checkpointing.door import UNREADABLE, read_fit_state
from ..errors import ConfigError
from .machine import is_global_zero
from .names import identifying
from .plan import StartPlan
from .steps import write_json

log = logging.getLogger(__name__)

STOPPING_KEYS = ("trainer.max_epochs", "trainer.max_steps", "trainer.max_time")


def identifying_overrides() -> list[str] | None:
    """The command's overrides that change what is trained (Hydra's `override_dirname` leaves out
    the same keys), or None outside a Hydra run."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    hydra = HydraConfig.get()
    return identifying(hydra.overrides.task, list(hydra.job.config.override_dirname.exclude_keys))


def check_limits_ahead(plan: StartPlan, last: Path) -> None:
    """`extend=true` trains a run further: a limit the run has already reached would have
    Lightning refuse it mid-start, or end it at once as finished at the lower limit."""
    try:
        state = read_fit_state(last)
    except (*UNREADABLE, OSError):
        return  # nothing to compare with: the run resumes from what loads, or starts fresh
    reached = {
        "trainer.max_epochs": (plan.max_epochs, int(state.get("epoch", 0)), "epochs"),
        "trainer.max_steps": (plan.max_steps, int(state.get("global_step", 0)), "steps"),
    }
    for key, (limit, done, unit) in reached.items():
        if isinstance(limit, int) and 0 <= limit <= done:
            raise ConfigError(
                f"{key}={limit} with extend=true: the run has already trained {done} {unit}; "
                f"give a higher limit to train it further (its results stay as they are)."
            )


def check_run_identity(plan: StartPlan) -> None:
    """A run directory holds one run. The overrides it was started with are recorded in it, and a
    different command that comes to the same directory (an explicit run_name=..., an Optuna trial of
    another study) is refused instead of resumed or taken as finished. `extend=true` may change
    the stopping limits (train a finished run further); the new ones are recorded."""
    overrides = identifying_overrides()
    if overrides is None or not is_global_zero():
        return
    path = plan.run_dir / "run_overrides.json"
    if plan.resume and path.is_file():
        recorded = json.loads(path.read_text())
        changed = sorted(set(recorded) ^ set(overrides))
        if plan.extend:
            changed = [o for o in changed if o.split("=")[0].lstrip("+~") not in STOPPING_KEYS]
        if changed:
            only_limits = all(o.split("=")[0].lstrip("+~") in STOPPING_KEYS for o in changed)
            extend = " To train that run further with the new limit, add extend=true." * only_limits
            raise ConfigError(
                f"{path.parent} holds a run of other settings ({' '.join(changed)} differ): pick "
                f"another run_name=..., or delete that directory to start over.{extend}"
            )
        if recorded == overrides:
            return
        check_limits_ahead(plan, plan.checkpoints / "last.ckpt")
        # New limits: the run is no longer finished (metrics.json goes before they are recorded,
        # so a kill in between leaves a run that trains on, never one finished at the old limit).
        (path.parent / "metrics.json").unlink(missing_ok=True)
    write_json(overrides, path)


def finished_metrics(plan: StartPlan) -> dict[str, float] | None:
    path = plan.run_dir / "metrics.json"
    if not plan.resume or not path.is_file():
        return None
    log.info(
        "This run already finished (%s): not training again. To train it further, raise "
        "trainer.max_epochs (or max_steps) and add extend=true; to train anew, pick another "
        "run_name=... or delete that directory.",
        path,
    )
    return {name: float(value) for name, value in json.loads(path.read_text()).items()}
