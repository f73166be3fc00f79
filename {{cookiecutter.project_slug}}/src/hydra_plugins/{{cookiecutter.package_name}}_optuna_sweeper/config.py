# No `from __future__ import annotations`: Hydra loads plugin modules outside sys.modules, where
# dataclasses cannot resolve string annotations.
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore


@dataclass
class OptunaSweeperConf:
    _target_: str = __name__.rpartition(".")[0] + ".optuna_sweeper.OptunaSweeper"
    # Where the study lives; a database URL (sqlite:///path.db) makes it survive crashes: the
    # same command continues the study until it holds n_trials finished trials.
    storage: str | None = None
    study_name: str = "study"
    direction: str = "minimize"
    n_trials: int = 20
    # Trials handed to the launcher at once (parallel with joblib or submitit).
    n_jobs: int = 1
    seed: int | None = None
    # Median pruning of trials whose intermediate values fall behind; null turns pruning off.
    pruner: dict[str, Any] | None = field(
        default_factory=lambda: {"n_startup_trials": 2, "n_warmup_steps": 0}
    )
    # Stop the study once this many trials in a row have failed (the command then exits 1):
    # settings that fail every trial would otherwise fail them for ever.
    max_failures_in_a_row: int = 3
    # Search space: key -> choice(a, b), range(lo, hi[, step]), interval(lo, hi) or
    # tag(log, interval(lo, hi)), in Hydra's sweep syntax.
    params: dict[str, str] = field(default_factory=dict)


ConfigStore.instance().store(group="hydra/sweeper", name="optuna", node=OptunaSweeperConf)
