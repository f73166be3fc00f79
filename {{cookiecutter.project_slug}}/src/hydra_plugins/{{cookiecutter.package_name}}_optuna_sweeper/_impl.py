"""The sweeper's work, imported only when a sweep starts (it imports optuna).

Each batch of trials is asked from the study, launched as Hydra jobs, and told back. A job
reports intermediate values through the `OptunaPruning` callback, which may stop it early."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optuna
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, Override, RangeSweep
from hydra.core.plugins import Plugins
from hydra.core.utils import JobReturn, JobStatus
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)

FINISHED = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)


def distribution(override: Override) -> optuna.distributions.BaseDistribution:
    value = override.value()
    if isinstance(value, ChoiceSweep):
        return optuna.distributions.CategoricalDistribution(list(override.sweep_iterator()))  # type: ignore[arg-type]
    if isinstance(value, RangeSweep):
        start, stop, step = int(value.start or 0), int(value.stop or 0), int(value.step or 1)
        last = start + (stop - 1 - start) // step * step  # Hydra's range excludes `stop`
        return optuna.distributions.IntDistribution(start, last, step=step)
    if isinstance(value, IntervalSweep):
        log_scale = "log" in value.tags
        if isinstance(value.start, int) and isinstance(value.end, int):
            return optuna.distributions.IntDistribution(value.start, value.end, log=log_scale)
        return optuna.distributions.FloatDistribution(
            float(value.start or 0.0), float(value.end or 0.0), log=log_scale
        )
    raise ValueError(
        f"{override.input_line}: use choice(...), range(...), interval(...) or "
        "tag(log, interval(...)) to define a search dimension"
    )


def quote(value: Any) -> str:
    return f"'{value}'" if isinstance(value, str) else str(value)


class OptunaSweeperImpl:
    def __init__(
        self,
        storage: str | None,
        study_name: str,
        direction: str,
        n_trials: int,
        n_jobs: int,
        seed: int | None,
        pruner: dict[str, Any] | None,
        params: dict[str, str] | None,
    ) -> None:
        self.storage = storage
        self.study_name = study_name
        self.direction = direction
        self.n_trials = n_trials
        self.n_jobs = n_jobs
        self.seed = seed
        self.pruner = pruner
        self.params = dict(params or {})
        self.name = study_name

    def setup(
        self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig
    ) -> None:
        self.config = config
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )

    def _search_space(
        self, arguments: list[str]
    ) -> tuple[dict[str, optuna.distributions.BaseDistribution], list[str]]:
        """`params` plus sweep overrides from the command line; a plain `key=value` on the
        command line pins that key and takes it out of the search."""
        parser = OverridesParser.create()
        space: dict[str, optuna.distributions.BaseDistribution] = {}
        for key, value in self.params.items():
            override = parser.parse_override(f"{key}={value}")
            space[override.get_key_element()] = distribution(override)
        fixed: list[str] = []
        for override in parser.parse_overrides(arguments):
            key = override.get_key_element()
            if override.is_sweep_override():
                space[key] = distribution(override)
            else:
                space.pop(key, None)
                fixed.append(str(override.input_line))
        return space, fixed

    def _identity(self) -> str:
        """The study's name: `study_name` and a digest of everything that defines the search (the
        command's overrides that change what is trained, the search space, the direction), so
        that only the same command continues a study and another one never joins it."""
        hydra = self.config.hydra
        excluded = set(hydra.job.config.override_dirname.exclude_keys)
        overrides = sorted(
            str(o)
            for o in hydra.overrides.task
            if str(o).split("=")[0].lstrip("+~") not in excluded
        )
        search = {"overrides": overrides, "params": self.params, "direction": self.direction}
        digest = hashlib.sha1(json.dumps(search, sort_keys=True).encode()).hexdigest()[:10]
        return f"{self.study_name}-{digest}"

    def _study(self) -> optuna.Study:
        if self.storage and self.storage.startswith("sqlite:///"):
            Path(self.storage.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        pruner = (
            optuna.pruners.MedianPruner(**self.pruner)
            if self.pruner
            else optuna.pruners.NopPruner()
        )
        study = optuna.create_study(
            study_name=self.name,
            storage=self.storage,
            pruner=pruner,
            direction=self.direction,  # type: ignore[arg-type]
            load_if_exists=True,
        )
        # A continued study samples on from where it stopped, not from its seed again (which
        # would repeat the parameters of its first trials).
        seed = None if self.seed is None else self.seed + len(study.trials)
        study.sampler = optuna.samplers.TPESampler(seed=seed)
        for trial in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
            log.warning(
                "Trial %d was left running by an earlier launch: marked failed.", trial.number
            )
            study.tell(trial.number, state=optuna.trial.TrialState.FAIL)
        return study

    def sweep(self, arguments: list[str]) -> None:
        self.name = self._identity()
        space, fixed = self._search_space(arguments)
        if not space:
            raise ValueError("nothing to search: set hydra.sweeper.params or pass sweep overrides")
        study = self._study()
        done = len(study.get_trials(deepcopy=False, states=FINISHED))
        if done:
            log.info(
                "Study %r continues: %d of %d trials finished.",
                self.name,
                done,
                self.n_trials,
            )
        while done < self.n_trials:
            trials = [study.ask(space) for _ in range(min(self.n_jobs, self.n_trials - done))]
            batch = [fixed + self._trial_overrides(trial) for trial in trials]
            # Job directories by trial number: a continued study never reuses a finished trial's.
            returns = self.launcher.launch(batch, initial_job_idx=trials[0].number)
            for trial, job in zip(trials, returns, strict=True):
                self._tell(study, trial, job)
            done = len(study.get_trials(deepcopy=False, states=FINISHED))
        self._report(study)

    def _trial_overrides(self, trial: optuna.Trial) -> list[str]:
        overrides = [f"{key}={quote(value)}" for key, value in trial.params.items()]
        overrides.append(f"++optuna_trial.number={trial.number}")
        overrides.append(f"++optuna_trial.trial_id={trial._trial_id}")
        if self.storage:
            overrides += [
                f"++optuna_trial.storage={quote(self.storage)}",
                f"++optuna_trial.study_name={quote(self.name)}",
            ]
            overrides += [f"++optuna_trial.pruner.{k}={v}" for k, v in (self.pruner or {}).items()]
        return overrides

    def _tell(self, study: optuna.Study, trial: optuna.Trial, job: JobReturn) -> None:
        if job.status == JobStatus.COMPLETED:
            value = job.return_value
            if isinstance(value, (int, float)) and math.isfinite(value):
                study.tell(trial, float(value))
                log.info("Trial %d: %s", trial.number, value)
                return
            log.error(
                "Trial %d returned %r, not a finite number: marked failed.", trial.number, value
            )
        elif type(job._return_value).__name__ == "TrialPruned":
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
            log.info("Trial %d pruned: %s", trial.number, job._return_value)
            return
        else:
            log.error("Trial %d failed: %r", trial.number, job._return_value)
        study.tell(trial, state=optuna.trial.TrialState.FAIL)

    def _report(self, study: optuna.Study) -> None:
        completed = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
        if not completed:
            log.error("No trial of study %r completed.", self.name)
            return
        best = study.best_trial
        results = {
            "study_name": self.name,
            "storage": self.storage,
            "best_trial": best.number,
            "best_value": best.value,
            "best_params": best.params,
            "trials": {
                state.name: len(study.get_trials(states=(state,)))
                for state in optuna.trial.TrialState
            },
        }
        path = Path(self.config.hydra.sweep.dir) / "optimization_results.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(OmegaConf.create(results), path)
        log.info(
            "Best trial %d: %s = %s with %s", best.number, self.direction, best.value, best.params
        )
        draw_study(study, path.parent)


def draw_study(study: optuna.Study, folder: Path) -> None:
    """Optuna's own matplotlib plots of the study: `optimization_history.png`, and
    `param_importances.png` once two trials have completed. A plot that cannot be drawn is named
    in a warning and never fails the sweep."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from optuna.visualization import matplotlib as plots

    completed = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    drawings: list[tuple[str, Callable[[optuna.Study], Any]]] = [
        ("optimization_history.png", plots.plot_optimization_history)
    ]
    if len(completed) >= 2 and study.best_trial.params:
        drawings.append(("param_importances.png", plots.plot_param_importances))
    for name, plot in drawings:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                plot(study)
            figure = plt.gcf()
            figure.set_size_inches(8, 5)
            figure.savefig(folder / name, dpi=110, bbox_inches="tight")
            plt.close(figure)
        except Exception as error:
            log.warning("%s not drawn: %s", name, error)
